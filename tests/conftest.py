import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from recserve.cli import main  # noqa: E402

# Property tests (tests/test_properties.py): bounded, no per-example deadline (a first torch call is
# slow); in CI the same examples every run (derandomized, no example database), so a red run replays.
settings.register_profile("dev", deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", settings.get_profile("dev"), derandomize=True, database=None, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def run_cli(*args: str) -> int:
    return main([*map(str, args)])


def cli_error(capsys, *args: str) -> str:
    """Run the CLI in this process (no interpreter and torch start per case); it must exit 2 with
    exactly one ``recserve <command>: error:`` line and no traceback on stderr: returns that line."""
    capsys.readouterr()
    try:
        code = run_cli(*args)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"recserve {args[0]}: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err[-3000:])
    return lines[0]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "demo"
    assert run_cli("train-demo", "--out", out, "--steps", "200") == 0
    return out


@pytest.fixture(scope="session")
def artifact(tmp_path_factory, checkpoint) -> Path:
    """A CPU artifact written by the CLI: REPO/demo/1."""
    repo = tmp_path_factory.mktemp("repo")
    assert run_cli("export", "--checkpoint", checkpoint, "--repo", repo, "--name", "demo", "--no-progress") == 0
    return repo / "demo" / "1"


@pytest.fixture
def repo(tmp_path, artifact) -> Path:
    """A model repository of its own holding the demo artifact as demo/1 (tests may add versions)."""
    repo = tmp_path / "repo"
    shutil.copytree(artifact, repo / "demo" / "1")
    return repo


@pytest.fixture
def fresh_repo(tmp_path) -> Path:
    return tmp_path / "repo"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_multi = pytest.mark.skip(reason="needs 2+ CUDA devices")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and torch.cuda.device_count() < 2:
            item.add_marker(skip_multi)
