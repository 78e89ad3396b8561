"""ModelRepository alone (no gRPC): what it serves as an operator adds, breaks, deletes and
republishes version directories. Each test drives ``refresh()`` itself; a poll is one call."""
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading

from conftest import ROOT

from recserve.manifest import MANIFEST_FILE, MAX_VERSION, list_versions, scan_versions
from serving.config import ServerConfig
from serving.metrics import Metrics
from serving.repository import ModelRepository

TOO_BIG = str(MAX_VERSION + 1)  # 9223372036854775808: an int64 overflow on the wire


def publish(repo, name, version, source):
    """Copy the artifact at ``source`` as ``repo/name/version`` atomically, its manifest saying so."""
    work = repo / name / f".{version}.incoming"
    shutil.copytree(source, work)
    manifest = json.loads((work / MANIFEST_FILE).read_text())
    manifest["name"], manifest["version"] = name, version
    (work / MANIFEST_FILE).write_text(json.dumps(manifest))
    work.rename(repo / name / str(version))
    return repo / name / str(version)


def make(repo, **settings):
    metrics = Metrics()
    return ModelRepository(ServerConfig(repo=repo, device="cpu", poll_interval_s=0, **settings), metrics), metrics


def failures(metrics, model, reason):
    return metrics.registry.get_sample_value("recserve_model_load_failures_total", {"model": model, "reason": reason})


# -- Source: version names ------------------------------------------------------------------------

def test_only_ascii_numbers_from_1_to_max_are_versions(tmp_path):
    for name in ["1", str(MAX_VERSION), "²", "0", "007", "v2", TOO_BIG, ".3.incoming"]:
        (tmp_path / name).mkdir()
    (tmp_path / "README").write_text("plain files are neither")
    listing = scan_versions(tmp_path)
    assert listing.versions == [1, MAX_VERSION]
    assert listing.not_versions == sorted(["²", "0", "007", "v2", TOO_BIG])
    assert list_versions(tmp_path) == [1, MAX_VERSION]
    assert list_versions(tmp_path / "absent") == []


# -- Loader: a read that never returns ------------------------------------------------------------

def fifo_version(repo, name, version, artifact):
    path = publish(repo, name, version, artifact)
    (path / MANIFEST_FILE).unlink()
    os.mkfifo(path / MANIFEST_FILE)  # open() for reading blocks until a writer comes: never
    return path / MANIFEST_FILE


def release(fifo):
    """Let the stuck reader go (it then fails on an empty manifest), so that it ends with the test."""
    with contextlib.suppress(OSError):  # ENXIO: no reader waits
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_hanging_read_times_out_once_and_the_served_version_stays(repo, artifact):
    fifos = []

    async def scenario():
        r, metrics = make(repo)
        await r.refresh()
        fifos.append(fifo_version(repo, "demo", 2, artifact))
        r.config.load_timeout_s = 0.2  # only the FIFO loads in the next polls, and it never finishes
        await r.refresh()
        await r.refresh()
        assert failures(metrics, "demo", "LoadTimeout") == 1  # not retried while unchanged
        assert r.models["demo"].version == 1
        stuck = [t for t in threading.enumerate() if t.name == "verify-demo-v2"]
        assert len(stuck) == 1 and stuck[0].daemon  # the interpreter does not wait for it at exit
        await r.close()

    try:
        asyncio.run(scenario())
    finally:
        for fifo in fifos:
            release(fifo)


def test_process_exits_0_while_a_read_hangs_and_a_load_runs(repo, artifact):
    """asyncio.run returns while stuck/1's manifest read hangs (a daemon thread: not waited for) and
    demo/1 warms up (an ordinary thread: waited for, as one killed inside torch aborts the process)."""
    fifo_version(repo, "stuck", 1, artifact)
    script = f"""
import asyncio, pathlib, threading
from serving.config import ServerConfig
from serving.metrics import Metrics
from serving.repository import ModelRepository
from serving.runner import ModelRunner

check, warming = ModelRunner.check_golden, threading.Event()

def long_check(self, path):
    warming.set()
    return check(self, path, warmup_runs=300)  # a long stay inside torch's C++ code

ModelRunner.check_golden = long_check

async def main():
    r = ModelRepository(ServerConfig(repo=pathlib.Path({str(repo)!r}), device="cpu"), Metrics())
    poll = asyncio.get_running_loop().create_task(r.refresh())
    while not (warming.is_set() and "verify-stuck-v1" in {{t.name for t in threading.enumerate()}}):
        await asyncio.sleep(0.001)
    print("exiting", flush=True)
    await r.close()

asyncio.run(main())
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stdout) == (0, "exiting\n"), proc.stderr[-2000:]
