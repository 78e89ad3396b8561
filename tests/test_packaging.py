"""What `pip install` gets: the distribution's metadata against what the code needs."""
import ast
import tomllib

from packaging.specifiers import SpecifierSet

from conftest import ROOT

PACKAGES = ("recserve", "export", "serving", "bench")  # pyproject.toml's packages.find
# Standard-library names younger than a Python that requires-python could admit: name -> first version.
# (3.11 also made asyncio.TimeoutError the builtin TimeoutError, which `except TimeoutError` around
# asyncio.wait_for relies on.)
NEWER_STDLIB = {"asyncio.timeout": (3, 11), "asyncio.TaskGroup": (3, 11), "asyncio.Runner": (3, 11),
                "enum.StrEnum": (3, 11), "itertools.batched": (3, 12)}


def stdlib_uses(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            name = f"{node.value.id}.{node.attr}"
            if name in NEWER_STDLIB:
                yield name


def test_requires_python_admits_no_python_the_code_cannot_run_on():
    """requires-python said >=3.10: pip installed recserve (and torch, which has 3.10 wheels up to 2.14) on
    3.10, where every model load failed with "module 'asyncio' has no attribute 'timeout'"."""
    requires = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    admitted = [(3, minor) for minor in range(8, 20) if requires.contains(f"3.{minor}")]
    too_old = sorted({(name, f"{path.relative_to(ROOT)}") for package in PACKAGES
                      for path in (ROOT / package).rglob("*.py") for name in stdlib_uses(path)
                      if admitted[0] < NEWER_STDLIB[name]})
    assert too_old == []
