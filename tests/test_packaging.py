"""What `pip install` gets: the distribution's metadata against what the code needs, and what the
wheel and the sdist built from this tree hold."""
import ast
import email.parser
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile

import pytest
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


def test_the_extras_and_the_makefile_install_only_fbgemm_and_torchrec_built_for_their_torch():
    """The extras said fbgemm-gpu(-cpu)>=1.6,<1.9 beside torch>=2.11,<2.14: pip took fbgemm 1.8 next to
    torch 2.11 (neither wheel names its torch), whose libraries then did not load."""
    from packaging.requirements import Requirement

    from recserve.install import RELEASES

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = next(r.specifier for r in map(Requirement, project["dependencies"]) if r.name == "torch")
    minors = [f"{major}.{minor}" for major in (1, 2) for minor in range(20)]
    for extra in ("cpu", "cuda"):
        wanted = {r.name: r.specifier for r in map(Requirement, project["optional-dependencies"][extra])}
        torch = wanted.get("torch", SpecifierSet()) & base
        fbgemm = wanted["fbgemm-gpu-cpu" if extra == "cpu" else "fbgemm-gpu"]
        pairs = {(t, f) for t in minors for f in minors if torch.contains(f"{t}.0") and fbgemm.contains(f"{f}.0")}
        assert pairs and all(RELEASES.get(t) == f for t, f in pairs), (extra, sorted(pairs))
    make = dict(re.findall(r"^(\w+_VERSION)\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M))
    torch_minor = ".".join(make["TORCH_VERSION"].split(".")[:2])
    assert {make["FBGEMM_VERSION"][:3], make["TORCHREC_VERSION"][:3]} == {RELEASES[torch_minor]}


def test_the_makefile_installs_the_cpu_build_of_torch_where_it_installs_the_cpu_build_of_fbgemm():
    """It ran pip install torch==2.13.0 from PyPI everywhere: on Linux x86_64 that is the CUDA build, GBs
    of nvidia-* wheels on a machine without a GPU."""
    makefile = (ROOT / "Makefile").read_text()
    index = re.search(r"^TORCH_INDEX := (.+)$", makefile, re.M)
    assert index and index[1] == "$(if $(filter fbgemm-gpu-cpu,$(FBGEMM_PKG)),--index-url " \
                                 "https://download.pytorch.org/whl/cpu)"
    installs = [line for line in makefile.splitlines() if "install" in line and '"torch==' in line]
    assert installs and all("$(TORCH_INDEX)" in line for line in installs), installs


def test_the_readme_says_how_a_client_host_installs_without_torch():
    """README promised "a client host installs no torch" but never said how: pip install recserve
    brings torch (a dependency), GBs; the client's own requirements are the distribution's."""
    from packaging.requirements import Requirement

    client = (ROOT / "README.md").read_text().split("### Client", 1)[1].split("\n#", 1)[0]
    lines = re.findall(r"^ {4}(pip install .+?)(?:\s+#.*)?$", client, re.M)
    assert lines[0] == "pip install --no-deps recserve", lines
    named = {r.name: r.specifier for r in map(Requirement, re.findall(r'"([^"]+)"', lines[1]))}
    project = {r.name: r.specifier for r in map(Requirement, tomllib.loads(
        (ROOT / "pyproject.toml").read_text())["project"]["dependencies"])}
    assert named == {name: project[name] for name in ("grpcio", "protobuf", "numpy")}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The sdist and the wheel of a copy of this tree, built by its build backend as pip would; and
    what the backend said."""
    tree = tmp_path_factory.mktemp("tree") / "recserve"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".venv*", ".git", "build", "*.egg-info", "__pycache__",
                                                              ".pytest_cache", ".hypothesis"))
    proc = subprocess.run([sys.executable, "-c", "import setuptools.build_meta as backend; "
                           "backend.build_sdist('dist'); backend.build_wheel('dist')"],
                          cwd=tree, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return next((tree / "dist").glob("*.tar.gz")), next((tree / "dist").glob("*.whl")), proc.stderr


def test_the_wheel_states_its_license_and_carries_its_text(built):
    """pyproject.toml gave the license as a TOML table, which setuptools deprecates (builds stop
    working after 2027-02-18: `pip install .` would fail), and the wheel held no license text."""
    _, wheel, said = built
    assert "SetuptoolsDeprecationWarning" not in said, said[-3000:]
    with zipfile.ZipFile(wheel) as files:
        metadata = email.parser.Parser().parsestr(files.read("recserve-0.1.0.dist-info/METADATA").decode())
        license_text = files.read("recserve-0.1.0.dist-info/licenses/LICENSE").decode()
    assert (metadata["License-Expression"], metadata.get_all("License-File")) == ("Apache-2.0", ["LICENSE"])
    assert license_text == (ROOT / "LICENSE").read_text() and "Apache License" in license_text.splitlines()[0]


def test_the_sdist_is_the_source_tree_make_test_needs(built):
    """setuptools put only the packages, README.md and tests/test*.py in the sdist: its tests could not run
    (no conftest.py), and it lacked the .proto contract, the C++ loader, the Makefile and scripts/."""
    sdist, _, _ = built
    with tarfile.open(sdist) as archive:
        held = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    folders = ("protos", "cpp_loader", "tests", "scripts", "loadtest", "deploy", "docs", ".ci")
    tree = {f"{path.relative_to(ROOT)}" for folder in folders for path in (ROOT / folder).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and "build" not in path.parts
            and path.name != "build.log"}
    needed = tree | {"Makefile", "LICENSE", "README.md", "pyproject.toml"}
    assert sorted(needed - held) == []
