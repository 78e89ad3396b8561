"""What docs/reliability.md and scripts/mutants.py name must exist: a test cited for a property, a
mutant's anchor text and the tests that must kill it."""
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
    absent = [t for m in mutants.MUTANTS for t in m.tests  # a test, or a whole file of them
              if not (defined(t.split("::")[0].removeprefix("tests/"), t.split("::")[1].split("[")[0]) if "::" in t
                      else (ROOT / t).is_file())]
    assert (missing, absent) == ([], [])


def test_every_test_the_reliability_doc_cites_is_in_the_file_it_names():
    """A cell's bare names are in the file its first `file.py::name` names."""
    wrong = []
    for line in (ROOT / "docs" / "reliability.md").read_text().splitlines():
        test_file = None
        for quoted in re.findall(r"`([^`]+)`", line):
            cited = re.fullmatch(r"(test_\w+\.py)(?:::(test_\w+).*)?|(test_\w+)\b(?!\.).*", quoted)
            if cited is None:
                continue
            test_file = cited.group(1) or test_file
            name = cited.group(2) or cited.group(3)
            if test_file is None and name is not None:
                wrong += [] if any(defined(p.name, name) for p in (ROOT / "tests").glob("test_*.py")) else [name]
            elif name is not None and not defined(test_file, name):
                wrong.append(f"{test_file}::{name}")
    assert wrong == []


def test_every_metric_the_server_exports_is_in_the_readme_metrics_table():
    """README's metrics table is the list an operator builds dashboards and alerts from: a metric
    missing there (recserve_host_memory_bytes, whose meaning changed to the sum over engines) is
    one they never learn about."""
    from serving.metrics import Metrics

    readme = (ROOT / "README.md").read_text()
    table = readme.split("### Metrics", 1)[1].split("\n\n", 2)[1]
    listed = {name for row in table.splitlines() for name in re.findall(r"`(recserve_\w+)`", row.split("|")[1])}
    exported = {family.name + ("_total" if family.type == "counter" else "")
                for family in Metrics().registry.collect()}
    assert sorted(exported - listed) == []
