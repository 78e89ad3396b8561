"""What scripts/mutants.py names must exist: a mutant's anchor text and the tests that must kill it."""
import importlib
import re
import sys

from conftest import ROOT


def defined(test_file: str, name: str) -> bool:
    path = ROOT / "tests" / test_file
    return path.exists() and re.search(rf"^(async )?def {name}\b", path.read_text(), re.M) is not None


def test_every_mutant_applies_to_the_tree_and_names_tests_that_exist():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        mutants = importlib.import_module("mutants")
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    missing = [m.name for m in mutants.MUTANTS if m.old not in (ROOT / m.file).read_text()]
    absent = [t for m in mutants.MUTANTS for t in m.tests
              if not defined(t.split("::")[0].removeprefix("tests/"), t.split("::")[1].split("[")[0])]
    assert (missing, absent) == ([], [])

