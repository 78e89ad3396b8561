"""ModelRepository alone (no gRPC): what it serves as an operator adds, breaks, deletes and
republishes version directories. Each test drives ``refresh()`` itself; a poll is one call."""
import asyncio
import contextlib
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from conftest import ROOT
from reference import golden_request

from recserve.manifest import MANIFEST_FILE, MAX_VERSION, MODEL_FILE, list_versions, scan_versions, sha256_file
from serving.config import ServerConfig
from serving.engine import repository
from serving.engine.assemble import host_item, host_result
from serving.engine.batcher import Work
from serving.engine.repository import DRAINING, READY, READY_REMOVED_FROM_DISK, ModelRepository
from serving.engine.runner import load_fbgemm
from serving.errors import Overloaded
from serving.frontend.validate import check_sparse, model_kjt
from serving.metrics import Metrics

# A load takes a few seconds here; a test that waits for a state that never comes fails in minutes,
# not at the suite's 600 s limit.
pytestmark = pytest.mark.timeout(180)

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


@pytest.fixture(scope="session")
def variant(artifact, tmp_path_factory):
    """The demo artifact with another model.pt: the same module saved again with an extra file, so
    its sha256 differs while its outputs (and golden.pt) do not."""
    out = tmp_path_factory.mktemp("variant") / "demo"
    shutil.copytree(artifact, out)
    load_fbgemm()
    torch.jit.save(torch.jit.load(str(artifact / MODEL_FILE)), str(out / MODEL_FILE), _extra_files={"note": b"v"})
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    manifest["files"][MODEL_FILE] = sha256_file(out / MODEL_FILE)
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert manifest["files"][MODEL_FILE] != json.loads((artifact / MANIFEST_FILE).read_text())["files"][MODEL_FILE]
    return out


def make(repo, **settings):
    metrics = Metrics()
    return ModelRepository(ServerConfig(**{"repo": repo, "device": "cpu", "poll_interval_s": 0, **settings}),
                           metrics), metrics


def failures(metrics, model, reason):
    return metrics.registry.get_sample_value("recserve_model_load_failures_total",
                                             {"model": model, "reason": reason, "engine": "0"})


async def around_a_move(r, model_dir, away, figure):
    """``figure()`` after a refresh, then after ``model_dir`` is moved to ``away`` and a refresh, then after it
    is put back unchanged and a refresh."""
    figures = []
    for move in (None, (model_dir, away), (away, model_dir)):
        if move:
            move[0].rename(move[1])
        await r.refresh()
        figures.append(figure())
    return figures


def gauge(metrics, model, version, state):
    return metrics.registry.get_sample_value("recserve_model_version_loaded",
                                             {"model": model, "version": str(version), "state": state})


def sha(mv):
    return mv.manifest.files[MODEL_FILE]


def model_sha(version_dir):
    return json.loads((version_dir / MANIFEST_FILE).read_text())["files"][MODEL_FILE]


async def until_released(repo, name, version, timeout=30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while any(v.version == version and v.state == DRAINING for v in repo.versions(name)):
        assert asyncio.get_running_loop().time() < deadline, f"{name} version {version} was never released"
        await asyncio.sleep(0.01)


def engine_request(version_dir, schema):
    """golden.pt's inputs laid out as a front end lays out a Predict (serving/ipc.py), and the CTRs
    it must answer."""
    (dense, (keys, lengths, values)), ctr = golden_request(version_dir)
    kjt = model_kjt(check_sparse(keys, lengths, values, schema, dense.shape[0]), dense, schema)
    return host_item(kjt, schema, False, lookup=False), ctr


async def run_on(mv, item, timeout=30.0):
    """Run a request on a version as the engine does (its batcher, pumped here); its error or None,
    and its CTRs."""
    answers = []
    work = Work(inputs=item, batch_size=item.batch_size, deadline=None, ids=item.ids,
                answer=lambda w, error: answers.append(error))
    mv.submit("Predict", work)
    deadline = time.monotonic() + timeout
    while not answers:
        assert time.monotonic() < deadline, "the request was never answered"
        for b in mv.batchers:
            b.pump(time.monotonic())
        await asyncio.sleep(0.005)
    return answers[0], host_result(item, 1)


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


def test_bad_version_names_are_refused_once_for_that_model_only(repo, artifact, caplog):
    (repo / "demo" / "²").mkdir()
    (repo / "demo" / "3\n").mkdir()  # "$" in a pattern takes a final newline: this was version 3
    publish(repo, "demo", MAX_VERSION + 1, artifact)  # complete, and the highest: still never loaded
    publish(repo, "other", 1, artifact)

    async def scenario():
        r, metrics = make(repo)
        await r.refresh()
        assert {n: mv.version for n, mv in r.models.items()} == {"demo": 1, "other": 1}
        await r.refresh()
        assert failures(metrics, "demo", "InvalidVersionName") == 3
        assert failures(metrics, "other", "InvalidVersionName") is None
        publish(repo, "demo", 2, artifact)  # the model with bad entries still gets new versions
        await r.refresh()
        assert r.models["demo"].version == 2
        assert failures(metrics, "demo", "InvalidVersionName") == 3
        await r.close()

    with caplog.at_level(logging.ERROR, "serving.engine.repository"):
        asyncio.run(scenario())
    logged = [rec.getMessage() for rec in caplog.records if "InvalidVersionName" in rec.getMessage()]
    assert sorted(m.split(":")[0] for m in logged) == sorted([str(repo / "demo" / "²"), str(repo / "demo" / "3\n"),
                                                              str(repo / "demo" / TOO_BIG)])


def test_a_model_directory_not_named_as_a_model_is_reported_once(repo, artifact, caplog):
    """A model copied in as "my model" is never served: the operator is told once why, and again if
    it comes back after being renamed (renamed right, it serves)."""
    publish(repo, "my_model", 1, artifact).parent.rename(repo / "my model")

    async def scenario():
        r, _ = make(repo)
        await r.refresh()
        await r.refresh()
        (repo / "my model").rename(repo / "my_model")
        await r.refresh()
        (repo / "my_model").rename(repo / "my model")
        await r.refresh()
        served = sorted(r.models)
        await r.close()
        return served

    with caplog.at_level(logging.ERROR, "serving.engine.repository"):
        assert asyncio.run(scenario()) == ["demo", "my_model"]
    assert [rec.getMessage() for rec in caplog.records] == [
        f"{repo / 'my model'}: InvalidModelName: not a model: a model name is 1 to 128 ASCII letters, digits, "
        "'_', '.' and '-', starting with a letter or digit; ignored"] * 2


def test_unreadable_model_directory_is_refused_and_the_others_start(repo, artifact, monkeypatch, caplog):
    publish(repo, "other", 1, artifact)
    blocked = repo / "other"
    iterdir = pathlib.Path.iterdir

    def denied(path):
        if path == blocked:  # as chmod 000 would, for a user other than root (tests run as root)
            raise PermissionError(13, "Permission denied", str(path))
        return iterdir(path)

    async def scenario():
        r, metrics = make(repo)
        monkeypatch.setattr(pathlib.Path, "iterdir", denied)
        await r.refresh()
        await r.refresh()
        assert r.ready and {n: mv.version for n, mv in r.models.items()} == {"demo": 1}
        assert failures(metrics, "other", "PermissionError") == 1
        monkeypatch.setattr(pathlib.Path, "iterdir", iterdir)
        await r.refresh()
        assert r.models["other"].version == 1
        monkeypatch.setattr(pathlib.Path, "iterdir", denied)  # unreadable while serving: not "removed"
        await r.refresh()
        assert (r.models["other"].version, r.models["other"].state) == (1, READY)
        assert failures(metrics, "other", "PermissionError") == 2  # once more: it had been fixed in between
        await r.close()

    with caplog.at_level(logging.WARNING, "serving.engine.repository"):
        asyncio.run(scenario())
    assert any("starting without other" in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize("hung, reason", [("read_model_config", "InvalidConfig"), ("_dir_signature", "TimeoutError")])
def test_a_hung_config_or_version_directory_read_is_one_counted_line_not_a_traceback_per_poll(
        tmp_path, monkeypatch, caplog, hung, reason):
    """config.json, or a version directory, on a mount that stopped answering: each poll's read times
    out; that is reported once, in one line, and counted once, as an unreadable directory is."""
    (tmp_path / "other" / "1").mkdir(parents=True)
    mount_back = threading.Event()
    read = getattr(repository, hung)

    def stuck(path, *args):
        mount_back.wait(60)
        return read(path, *args)

    monkeypatch.setattr(repository, hung, stuck)

    async def scenario():
        r, metrics = make(tmp_path, load_timeout_s=0.2)
        for _ in range(3):
            await r.refresh()
        assert r.models == {} and failures(metrics, "other", reason) == 1
        await r.close()

    try:
        with caplog.at_level(logging.ERROR, "serving.engine.repository"):
            asyncio.run(scenario())
    finally:
        mount_back.set()
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None and "no answer from the disk" in errors[0].getMessage()


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


def test_hanging_load_holds_up_neither_other_models_nor_close(repo, artifact):
    publish(repo, "other", 1, artifact)
    fifos = []

    async def scenario():
        r, metrics = make(repo)
        await r.refresh()
        fifos.append(fifo_version(repo, "demo", 2, artifact))
        publish(repo, "other", 2, artifact)
        poll = asyncio.get_running_loop().create_task(r.refresh())
        deadline = asyncio.get_running_loop().time() + 60
        while r.models["other"].version != 2:  # loads while demo/2's read hangs
            assert asyncio.get_running_loop().time() < deadline, "other/2 never loaded"
            await asyncio.sleep(0.01)
        assert not poll.done() and r.models["demo"].version == 1
        await r.close()  # does not wait for demo/2
        await poll
        assert r.models == {}

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
from serving.engine.repository import ModelRepository
from serving.engine.runner import ModelRunner

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


def load_held_in_its_golden_check(repo, artifact, monkeypatch):
    """Three models, one load at a time (--load-threads 1), the first held in its golden check until
    ``go_on`` is set: (blocked, go_on, verified: the versions whose load began, warmed: those that
    reached their warm-up)."""
    from serving.engine import loader
    from serving.engine.runner import ModelRunner

    publish(repo, "other", 1, artifact)
    publish(repo, "third", 1, artifact)
    blocked, go_on, verified, warmed = threading.Event(), threading.Event(), [], []
    verify, check = loader.load_verified, ModelRunner.check_golden

    def recording_verify(path):
        verified.append(path.parent.name)
        return verify(path)

    def held_check(self, path, *args, **kwargs):
        blocked.set()
        go_on.wait(60)
        return check(self, path, *args, **kwargs)

    monkeypatch.setattr(loader, "load_verified", recording_verify)
    monkeypatch.setattr(ModelRunner, "check_golden", held_check)
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self, path, sizes: warmed.append(path.parent.name))
    return blocked, go_on, verified, warmed


async def until_set(event, what, timeout=60.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not event.is_set():
        assert asyncio.get_running_loop().time() < deadline, f"{what} never happened"
        await asyncio.sleep(0.01)


def test_a_stop_while_models_load_starts_no_queued_load_and_cuts_the_running_one_short(repo, artifact, monkeypatch,
                                                                                       caplog):
    """SIGTERM while the start-up load ran (101 models, 4 at a time): the engine loaded on until its
    shutdown reached the repository (after the requests in flight had drained), queued versions began,
    and every load thread held the GIL for tenths of a second at a time (torch.jit.load, the table
    check) against the loop that stops the engine: killed at the end of the grace period, exit 1. A
    stop now starts no queued load, the load under way gives up at its next step (here its warm-up),
    and the engine neither publishes nor logs the start-up load's outcome."""
    from serving.engine.core import Engine

    blocked, go_on, verified, warmed = load_held_in_its_golden_check(repo, artifact, monkeypatch)

    async def scenario():
        engine = Engine(ServerConfig(repo=repo, device="cpu", poll_interval_s=0, load_threads=1),
                        str(repo.parent / "engine.sock"))
        loading = asyncio.get_running_loop().create_task(engine.load())
        await until_set(blocked, "the first load")
        thread = next(t for t in threading.enumerate() if t.name == f"load-{verified[0]}-v1")
        engine.request_stop()  # what SIGTERM does; nothing else of the shutdown runs here
        go_on.set()
        await asyncio.wait_for(loading, 60)
        await asyncio.to_thread(thread.join, 60)
        outcome = (verified, warmed, engine.repo.served, engine.repo.loaded)
        await engine.repo.close()
        return outcome

    with caplog.at_level(logging.INFO):
        assert asyncio.run(scenario()) == ([verified[0]], [], {}, False)
    assert not [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("engine on ")]


def test_a_stop_while_models_load_says_they_were_not_loaded_not_that_they_failed(repo, artifact, monkeypatch,
                                                                                 caplog):
    """The start-up load cut short by a stop logged its summary as if it had ended: "starting without
    m30, m36, ...: no version loads (see the errors above)", above which no error was."""
    blocked, go_on, verified, _ = load_held_in_its_golden_check(repo, artifact, monkeypatch)

    async def scenario():
        r, _ = make(repo, load_threads=1)
        loading = asyncio.get_running_loop().create_task(r.refresh())
        await until_set(blocked, "the first load")
        await r.close()
        go_on.set()
        await asyncio.wait_for(loading, 60)

    with caplog.at_level(logging.INFO, "serving.engine.repository"):
        asyncio.run(scenario())
    messages = [rec.getMessage() for rec in caplog.records if rec.name == "serving.engine.repository"]
    assert messages == ["stopping: 3 models not loaded (their loads are abandoned): demo, other, third"]


# -- Manager: rollback, removal, republishing -----------------------------------------------------

def test_deleting_the_served_version_rolls_back_and_drains_it(repo, artifact):
    publish(repo, "demo", 2, artifact)
    publish(repo, "demo", 3, artifact)

    async def scenario():
        r, metrics = make(repo)
        await r.refresh()
        assert r.models["demo"].version == 3
        held = r.models["demo"]
        held.acquire()  # a request in flight on 3
        shutil.rmtree(repo / "demo" / "3")
        await r.refresh()
        assert r.models["demo"].version == 2
        assert [(v.version, v.state) for v in r.versions("demo")] == [(2, READY), (3, DRAINING)]
        assert held.state == DRAINING and not held.drained.is_set()
        held.release()  # its answer
        await until_released(r, "demo", 3)
        assert [(v.version, v.state) for v in r.versions("demo")] == [(2, READY)]
        assert (gauge(metrics, "demo", 2, READY), gauge(metrics, "demo", 3, READY)) == (1, None)
        await r.close()

    asyncio.run(scenario())


def test_a_draining_version_answers_its_holders_and_is_released_after_the_last(repo, variant, monkeypatch):
    """Requests that hold a replaced version run on it, answered by it; it is closed only when the
    last of them is done. The retire grace is over at once, so the holders alone keep it."""
    monkeypatch.setattr(repository, "RETIRE_GRACE_S", 0.0)
    publish(repo, "demo", 2, variant)  # another model.pt (its sha256 tells the versions apart), the same answers

    async def scenario():
        r, _ = make(repo)
        await r.refresh()
        held = r.models["demo"]
        held.acquire()  # two requests in flight on version 2
        held.acquire()
        assert (held.version, sha(held)) == (2, model_sha(variant))
        shutil.rmtree(repo / "demo" / "2")
        await r.refresh()
        await r.refresh()  # two polls passed since the swap, and its release task ran
        assert (r.models["demo"].version, held.state, held.in_flight) == (1, DRAINING, 2)
        assert not held.drained.is_set() and held.runners
        item, want = engine_request(repo / "demo" / "1", held.schema)
        error, ctr = await run_on(held, item)  # one of them runs on the draining version: answered by it
        assert error is None
        np.testing.assert_allclose(ctr, want, atol=1e-5, rtol=0)
        held.release()
        await r.refresh()
        assert (held.state, held.in_flight, held.drained.is_set()) == (DRAINING, 1, False)
        assert held in r.versions("demo") and held.runners
        held.release()  # the last one out releases it
        assert held.drained.is_set()
        await until_released(r, "demo", 2)
        assert not held.runners and [v.version for v in r.versions("demo")] == [1]
        await r.close()

    asyncio.run(scenario())


def test_a_retired_version_is_released_only_once_its_grace_is_over_and_its_last_holder_done():
    """retire(grace): a front end may still send requests laid out for the retired copy until it hears
    of the swap, so the copy drains only when both the grace is over and no request holds it: its last
    holder answered within the grace does not release it (a request arriving then would be refused),
    nor does the grace's end while one still holds it."""
    from types import SimpleNamespace

    from serving.engine.repository import ModelVersion

    async def scenario():
        mv = SimpleNamespace(state=READY, in_flight=0, drained=asyncio.Event(), _grace_over=False)
        ModelVersion.acquire(mv)
        ModelVersion.retire(mv, 0.2)
        ModelVersion.release(mv)  # its last holder answered within the grace
        ModelVersion.acquire(mv)  # one laid out for it before its front end heard of the swap
        early = mv.drained.is_set()
        await asyncio.sleep(0.3)  # the grace is over: the late one still holds it
        held = mv.drained.is_set()
        ModelVersion.release(mv)
        return mv.state, early, held, mv.drained.is_set()

    assert asyncio.run(scenario()) == (DRAINING, False, False, True)


def test_a_released_version_frees_its_module_without_waiting_for_a_full_collection(repo, artifact):
    """Its batchers held its runners, and through their observers the version itself (a cycle): the
    module, its tables and (on CUDA) its graph pools lived until some later gc.collect()."""
    import gc
    import weakref

    publish(repo, "demo", 2, artifact)

    async def scenario():
        r, _ = make(repo)
        await r.refresh()
        runner = weakref.ref(r.models["demo"].runners[0])
        module = weakref.ref(r.models["demo"].runners[0].module)
        released = r.models["demo"]
        shutil.rmtree(repo / "demo" / "2")
        await r.refresh()
        await until_released(r, "demo", 2)
        with pytest.raises(Overloaded, match="^demo version 2 is unloading; retry$"):  # not a KeyError in the pump
            released.submit("Predict", Work(inputs=None, batch_size=1, deadline=None))
        gc.disable()  # what stays alive now stays until a collection
        try:
            alive = runner() is not None, module() is not None
        finally:
            gc.enable()
        await r.close()
        return alive

    assert asyncio.run(scenario()) == (False, False)



def test_close_at_shutdown_frees_no_module(repo, artifact):
    """close() (the engine stops) dropped every version's runners: each module freed then, about 30 ms
    with the GIL held, 3 s for 101 models, while the engine had 3.75 s of a 3 s grace period to stop.
    The process exit frees them; until the repository goes, they stay."""
    import weakref

    publish(repo, "other", 1, artifact)

    async def scenario():
        r, _ = make(repo)
        await r.refresh()
        modules = [weakref.ref(mv.runners[0].module) for mv in r.models.values()]
        await r.close()
        return r.models, [module() is not None for module in modules]

    assert asyncio.run(scenario()) == ({}, [True, True])

def test_a_version_reloaded_under_its_number_is_published_to_the_front_ends(repo, variant, monkeypatch):
    """Another model.pt copied into a served version's directory: once it is swapped in (and the old
    copy released, with nothing in flight within the same poll), the front ends are sent the new
    state, its ModelInfo naming the new model.pt; before, the state published never changed again."""
    from types import SimpleNamespace

    from serving import ipc
    from serving.engine.core import Engine

    sent = []
    monkeypatch.setattr(ipc, "send_nowait", lambda writer, message: sent.append(message))

    async def scenario():
        engine = Engine(ServerConfig(repo=repo, device="cpu", poll_interval_s=0), str(repo / "engine.sock"))
        engine.links = [SimpleNamespace(closed=False, writer=None)]
        await engine.repo.refresh()
        engine.publish()
        first = sent[-1].models["demo"]
        shutil.rmtree(repo / "demo" / "1")
        publish(repo, "demo", 1, variant)
        await engine.repo.refresh()
        await until_released(engine.repo, "demo", 1)
        engine.publish()
        await engine.repo.close()
        return first

    first = asyncio.run(scenario())
    assert len(sent) == 2, "the swap was never published"
    now = sent[-1].models["demo"]
    assert model_sha(variant).encode() in now.info and model_sha(variant).encode() not in first.info
    assert list(now.versions) == [1] and now.versions[1].schema == first.versions[1].schema
    assert now.versions[1].model_id == first.versions[1].model_id  # the same inputs: the same layout id


def test_model_with_no_version_on_disk_keeps_serving_then_takes_a_new_1(repo, artifact, variant, caplog):
    publish(repo, "demo", 2, artifact)

    async def scenario():
        r, metrics = make(repo)
        await r.refresh()
        shutil.rmtree(repo / "demo")
        await r.refresh()
        await r.refresh()
        mv = r.models["demo"]
        assert (mv.version, mv.state) == (2, READY_REMOVED_FROM_DISK)
        assert (gauge(metrics, "demo", 2, READY_REMOVED_FROM_DISK), gauge(metrics, "demo", 2, READY)) == (1, None)
        publish(repo, "demo", 1, variant)  # the model exported again from scratch
        await r.refresh()
        new = r.models["demo"]
        assert (new.version, new.state, sha(new)) == (1, READY, model_sha(variant))
        await until_released(r, "demo", 2)
        assert [v.version for v in r.versions("demo")] == [1]
        assert gauge(metrics, "demo", 2, READY_REMOVED_FROM_DISK) is None
        await r.close()

    with caplog.at_level(logging.WARNING, "serving.engine.repository"):
        asyncio.run(scenario())
    assert sum(READY_REMOVED_FROM_DISK in rec.getMessage() for rec in caplog.records) == 1


def test_what_is_kept_of_a_version_goes_with_its_directory(repo, artifact):
    """A pipeline publishing a version every few minutes for months, deleting the old ones: what the
    repository keeps of a version (its directory's signature, its refusal) goes when it is no longer
    served and its directory is gone, not one entry per version ever published."""
    async def scenario():
        r, _ = make(repo)
        await r.refresh()
        (publish(repo, "demo", 2, artifact) / MODEL_FILE).write_bytes(b"not a model")
        await r.refresh()
        for version in (3, 4):
            publish(repo, "demo", version, artifact)
            await r.refresh()
            for old in range(1, version):
                shutil.rmtree(repo / "demo" / str(old), ignore_errors=True)
            await r.refresh()
        kept = (sorted(r._signatures), sorted(r._refused))
        await r.close()
        return kept

    assert asyncio.run(scenario()) == ([("demo", 4)], [])


def test_a_version_deleted_while_the_poll_runs_is_gone_not_refused(repo, artifact, monkeypatch, caplog):
    """The served version's directory is deleted after the poll listed it (while another version
    loaded, say): that poll keeps it, the next rolls back; no load failure is logged or counted."""
    publish(repo, "demo", 2, artifact)
    scan = repository._scan_model

    def scan_then_delete(model_dir, *args):
        listed = scan(model_dir, *args)
        shutil.rmtree(model_dir / "2", ignore_errors=True)
        return listed

    async def scenario():
        r, metrics = make(repo)
        await r.refresh()
        monkeypatch.setattr(repository, "_scan_model", scan_then_delete)
        await r.refresh()
        served = [mv.version for mv in r.versions("demo")]
        await r.refresh()
        served.append(r.models["demo"].version)
        await r.close()
        return served, failures(metrics, "demo", "FileNotFoundError"), failures(metrics, "demo", "ArtifactError")

    with caplog.at_level(logging.ERROR, "serving.engine.repository"):
        assert asyncio.run(scenario()) == ([2, 1], None, None)
    assert [rec.getMessage() for rec in caplog.records] == []


def test_version_republished_under_its_number_is_swapped_in_only_if_model_changed(repo, artifact, variant):
    async def scenario():
        r, metrics = make(repo)
        await r.refresh()
        first = r.models["demo"]
        manifest = repo / "demo" / "1" / MANIFEST_FILE
        manifest.write_text(manifest.read_text())  # touched, same model: not loaded again
        await r.refresh()
        assert r.models["demo"] is first

        shutil.rmtree(repo / "demo" / "1")
        broken = publish(repo, "demo", 1, variant)
        (broken / MODEL_FILE).write_bytes(b"not a model")
        await r.refresh()
        await r.refresh()
        assert r.models["demo"] is first  # a broken replacement is refused once; the loaded copy serves on
        assert failures(metrics, "demo", "ArtifactError") == 1

        shutil.rmtree(repo / "demo" / "1")
        publish(repo, "demo", 1, variant)
        await r.refresh()
        second = r.models["demo"]
        assert second is not first and (second.version, second.state) == (1, READY)
        assert sha(second) == model_sha(variant) != sha(first)
        assert first.state == DRAINING
        await until_released(r, "demo", 1)
        assert r.versions("demo") == [second] and gauge(metrics, "demo", 1, READY) == 1
        await r.close()

    asyncio.run(scenario())


def test_a_model_directory_whose_reads_hang_holds_up_neither_the_start_nor_the_other_models_polls(repo, artifact,
                                                                                                monkeypatch):
    """One model's directory on a mount that stopped answering (its listing blocks): the start-up
    load ends (the server goes ready with the models that load) and later polls still load the other
    models' new versions; the hung listing is waited on again, not repeated on another disk thread,
    and once the mount answers the model loads."""
    publish(repo, "other", 1, artifact)
    mount_back, reads = threading.Event(), []
    scan = repository.scan_versions

    def hung(model_dir):
        if model_dir.name == "other":
            reads.append(model_dir)
            mount_back.wait(60)
        return scan(model_dir)

    monkeypatch.setattr(repository, "scan_versions", hung)

    async def scenario():
        r, metrics = make(repo, load_timeout_s=2)
        await asyncio.wait_for(r.refresh(), 15)
        assert r.ready and {n: mv.version for n, mv in r.models.items()} == {"demo": 1}
        assert failures(metrics, "other", "TimeoutError") == 1
        publish(repo, "demo", 2, artifact)
        await asyncio.wait_for(r.refresh(), 15)
        assert {n: mv.version for n, mv in r.models.items()} == {"demo": 2} and len(reads) == 1
        mount_back.set()
        await asyncio.wait_for(r.refresh(), 15)
        assert {n: mv.version for n, mv in r.models.items()} == {"demo": 2, "other": 1}
        await r.close()

    try:
        asyncio.run(scenario())
    finally:
        mount_back.set()


def test_a_hanging_load_holds_up_no_other_models_next_polls_in_the_server(repo, artifact):
    """`recserve serve` polling: one model's new version hangs in its load (its manifest a FIFO; up to
    --load-timeout). Another model's version published meanwhile is served at its next poll, not once
    the hung load is given up: the poll loop does not wait for a model still busy."""
    from servers import InProcessServer
    from test_lifecycle import wait_for

    publish(repo, "other", 1, artifact)
    server = InProcessServer(repo, settings={"load_timeout_s": 60})
    fifo = None
    try:
        fifo = fifo_version(repo, "other", 2, artifact)
        assert wait_for(lambda: "other" in server.repo._busy, timeout=10)  # its load of version 2 hangs
        publish(repo, "demo", 2, artifact)
        assert wait_for(lambda: server.model_version("demo").version == 2, timeout=10)
        assert server.model_version("other").version == 1 and "other" in server.repo._busy
    finally:
        if fifo is not None:
            release(fifo)
        server.stop()


def test_each_engine_counts_the_versions_it_refused_under_its_own_label(tmp_path):
    """`--replicas 2`: both engines try a broken version and refuse it. Each counts its refusal under
    `engine`, so that one broken version is not two refusals to `sum by (model, reason)` but one per
    engine (README, Metrics)."""
    (tmp_path / "bad" / "1").mkdir(parents=True)

    async def scenario():
        counted = []
        for index in (0, 1):
            metrics = Metrics(index)
            r = ModelRepository(ServerConfig(repo=tmp_path, device="cpu", poll_interval_s=0, engine_index=index,
                                             engines=2), metrics)
            await r.refresh()
            counted += [(s.labels, s.value) for family in metrics.registry.collect() for s in family.samples
                        if s.name == "recserve_model_load_failures_total"]
            await r.close()
        return counted

    assert asyncio.run(scenario()) == [({"model": "bad", "reason": "ArtifactError", "engine": "0"}, 1.0),
                                       ({"model": "bad", "reason": "ArtifactError", "engine": "1"}, 1.0)]


def test_a_refused_model_whose_directory_is_removed_is_tried_again_when_it_comes_back(tmp_path):
    """As a version directory that is removed and published again (the refusal is forgotten with
    it), a whole model directory moved away and back is tried again: its refusal was kept for good
    (and every removed model's refusals piled up), so a version refused for a passing reason stayed
    refused after the model was taken out and put back unchanged."""
    broken = tmp_path / "repo" / "other" / "1"
    broken.mkdir(parents=True)
    away = tmp_path / "away"

    async def scenario():
        r, metrics = make(tmp_path / "repo")
        counts = await around_a_move(r, broken.parent, away, lambda: failures(metrics, "other", "ArtifactError"))
        await r.close()
        return counts

    assert asyncio.run(scenario()) == [1, 1, 2]


def test_a_model_whose_directory_is_removed_is_reported_again_when_it_comes_back_as_broken(tmp_path, caplog):
    """An invalid config.json, or a directory not named as a version, of a model moved away and put
    back unchanged (a redeploy of the same mistake) is logged and counted again, as a refused version
    is: what was reported of the model stayed with it for good, so the redeploy failed in silence."""
    model = tmp_path / "repo" / "other"
    (model / "v1").mkdir(parents=True)
    (model / "config.json").write_text('{"max_queue": 0}')
    away = tmp_path / "away"

    async def scenario():
        r, metrics = make(tmp_path / "repo")
        counts = await around_a_move(r, model, away, lambda: failures(metrics, "other", "InvalidConfig"))
        (model / "config.json").unlink()  # fixed: the directory not named as a version is what remains
        counts += await around_a_move(r, model, away, lambda: failures(metrics, "other", "InvalidVersionName"))
        await r.close()
        return counts

    with caplog.at_level(logging.ERROR, "serving.engine.repository"):
        assert asyncio.run(scenario()) == [1, 1, 2, 1, 1, 2]
    logged = [rec.getMessage().split(": ")[0] for rec in caplog.records if rec.levelno == logging.ERROR]
    assert logged == [str(model / "config.json")] * 2 + [str(model / "v1")] * 2


def test_the_index_forgets_a_config_json_error_once_it_is_fixed(tmp_path):
    """A model whose config.json was invalid and is fixed, with no version on disk yet: the repository
    index said the config.json error (fixed since) as why the model does not load."""
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "config.json").write_text('{"max_queue": 0}')

    async def scenario():
        r, _ = make(tmp_path)
        await r.refresh()
        before = r.index()
        (tmp_path / "demo" / "config.json").write_text('{"max_queue": 8}')
        await r.refresh()
        after = r.index()
        await r.close()
        return before, after

    before, after = asyncio.run(scenario())
    assert before == [("demo", "", "UNAVAILABLE", f"{tmp_path / 'demo' / 'config.json'}: max_queue: must be an "
                                                  "integer from 1 to 2147483647, got 0")]
    assert after == [("demo", "", "UNAVAILABLE", "no version loads")]


def test_the_index_lists_a_refused_new_version_with_why_beside_the_one_that_serves_on(repo, artifact):
    """An operator publishes version 2 and it is refused: `recserve models list` (the OIP repository
    index) showed only version 1 READY, nothing of version 2 nor why. Triton lists it UNAVAILABLE with
    its reason; so does recserve, while the version policy asks for it (version 3, published and
    served, makes it a version nobody asks for: it leaves the index)."""
    async def scenario():
        r, _ = make(repo)
        await r.refresh()
        (publish(repo, "demo", 2, artifact) / MODEL_FILE).write_bytes(b"not a model")
        await r.refresh()
        refused = (r.index(), r._refused[("demo", 2)][2])
        publish(repo, "demo", 3, artifact)
        await r.refresh()
        await until_released(r, "demo", 1)
        later = r.index()
        await r.close()
        return refused, later

    (index, why), later = asyncio.run(scenario())
    assert "model.pt" in why
    assert index == [("demo", "1", "READY", ""), ("demo", "2", "UNAVAILABLE", why)]
    assert later == [("demo", "3", "READY", "")]


def test_a_serving_model_whose_directory_is_removed_reports_its_config_json_again_when_it_comes_back(
        repo, tmp_path, caplog):
    """A model serving with its last good configuration, its config.json invalid: moved away (it keeps
    serving) and put back unchanged, the same invalid config.json was neither logged nor counted again
    (a model not serving was: e16a710), so the redeploy of the same mistake failed in silence."""
    (repo / "demo" / "config.json").write_text('{"max_queue": 8}')
    away = tmp_path / "away"

    async def scenario():
        r, metrics = make(repo)
        await r.refresh()
        (repo / "demo" / "config.json").write_text('{"max_queue": 0}')
        counts = await around_a_move(r, repo / "demo", away,
                                     lambda: (failures(metrics, "demo", "InvalidConfig"), r.models["demo"].version))
        await r.close()
        return counts

    with caplog.at_level(logging.ERROR, "serving.engine.repository"):
        assert asyncio.run(scenario()) == [(1, 1), (1, 1), (2, 1)]
    logged = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.ERROR]
    assert logged == [f"{repo / 'demo' / 'config.json'}: max_queue: must be an integer from 1 to 2147483647, "
                      "got 0; demo keeps serving with its last good configuration"] * 2


def test_a_repository_that_cannot_be_read_for_a_poll_forgets_no_refusal(tmp_path, monkeypatch):
    """A poll that cannot list the repository (a mount that hangs past --load-timeout, an I/O error)
    says nothing of which models are gone: a broken model's refusal is kept, not tried, logged and
    counted again by the next poll as if the model had been removed and published again."""
    (tmp_path / "repo" / "other" / "1").mkdir(parents=True)
    scan = repository.scan_models

    def unreadable(path):
        raise OSError(5, "Input/output error")

    async def scenario():
        r, metrics = make(tmp_path / "repo")
        counts = []
        for listing in (scan, unreadable, scan):
            monkeypatch.setattr(repository, "scan_models", listing)
            await r.refresh()
            counts.append(failures(metrics, "other", "ArtifactError"))
        await r.close()
        return counts

    assert asyncio.run(scenario()) == [1, 1, 1]


def test_at_most_load_threads_versions_load_at_once_each_timed_from_its_turn(tmp_path, monkeypatch):
    """Every version of every model loaded at once: 101 models on a busy 2-core machine each ran past
    --load-timeout together and 95 were refused. Now --load-threads load at once, and a version's
    --load-timeout runs from its turn (here 10 loads of 0.3 s, 2 at a time, a 1 s timeout: the last
    turn starts at 1.2 s)."""
    from recserve.manifest import ArtifactError
    from serving.engine import loader
    from serving.model_config import ModelConfig

    running, most = [0], [0]
    lock = threading.Lock()

    def verify(path):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        raise ArtifactError(f"{path.name}: read")

    monkeypatch.setattr(loader, "load_verified", verify)
    load = loader.Loader(ServerConfig(repo=tmp_path, load_timeout_s=1.0, load_threads=2), "cpu")

    async def scenario():
        return await asyncio.gather(*(load.load("m", v, ModelConfig()) for v in range(1, 11)), return_exceptions=True)

    outcomes = asyncio.run(scenario())
    assert [str(e) for e in outcomes] == [f"{v}: read" for v in range(1, 11)]  # none a LoadTimeout
    assert most[0] == 2


# What c10 appends to every CUDA error (torch 2.11 and later): the reason is the line before.
CUDA_ADVICE = ("\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
               "below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
               "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")
IN_TORCHSCRIPT = ("The following operation failed in the TorchScript interpreter.\nTraceback of TorchScript (most "
                  "recent call last):\n  File \"code/__torch__/export/servable.py\", line 12, in lookup\n"
                  "    return (self.sparse).forward(values, lengths, )\n            ~~~~~~~~~~~~~~~~~~~~ <--- HERE\n"
                  "RuntimeError: ")


@pytest.mark.parametrize("error, fatal, reason", [
    ("CUDA error: an illegal memory access was encountered" + CUDA_ADVICE, True,
     "CUDA error: an illegal memory access was encountered"),
    (IN_TORCHSCRIPT + "CUDA error: an illegal memory access was encountered" + CUDA_ADVICE, True,
     "RuntimeError: CUDA error: an illegal memory access was encountered"),
    ("shape '[8, 32]' is invalid for input of size 384", False, "shape '[8, 32]' is invalid for input of size 384"),
    (IN_TORCHSCRIPT + "shape '[8, 32]' is invalid for input of size 384", False,
     "RuntimeError: shape '[8, 32]' is invalid for input of size 384"),
    # A version too large for the memory left is refused (runner.device_unusable), and says so: the line
    # given was c10's advice, "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."
    ("CUDA error: out of memory" + CUDA_ADVICE, False, "CUDA error: out of memory"),
    (IN_TORCHSCRIPT + "CUDA error: out of memory" + CUDA_ADVICE, False, "RuntimeError: CUDA error: out of memory"),
])
def test_a_load_that_leaves_the_device_unusable_takes_the_engine_down_as_a_batch_would(
        repo, artifact, monkeypatch, error, fatal, reason):
    """A CUDA error in a new version's warm-up (or golden check) only refused that version: the engine
    served on from a poisoned context until some batch failed. It now exits 3 at once, as after a
    batch that fails so; any other failure refuses the version and the one loaded serves on. Either
    way the one log line gives the error's own line, not c10's advice or TorchScript's header."""
    from serving.engine.core import EXIT_DEVICE_LOST, Engine
    from serving.engine.runner import ModelRunner

    warm_up = ModelRunner.warm_up

    def failing(self, path, sizes):
        if path.name == "2":
            raise RuntimeError(error)
        warm_up(self, path, sizes)

    monkeypatch.setattr(ModelRunner, "warm_up", failing)

    async def scenario():
        engine = Engine(ServerConfig(repo=repo, device="cpu", poll_interval_s=0), str(repo.parent / "engine.sock"))
        r = engine.repo
        await r.refresh()
        publish(repo, "demo", 2, artifact)
        await r.refresh()
        outcome = (engine.exit_code, engine._stop.is_set(), sorted(r.served["demo"]),
                   r._refused[("demo", 2)][2], failures(engine.metrics, "demo", "DeviceFailed"),
                   failures(engine.metrics, "demo", "ArtifactError"))
        await r.close()
        return outcome

    path = repo / "demo" / "2"
    if fatal:
        why = f"{path}: the device failed while this version loaded ({reason}); the engine exits for a restart"
        assert asyncio.run(scenario()) == (EXIT_DEVICE_LOST, True, [1], why, 1, None)
    else:
        why = f"{path}: model.pt fails on golden.pt's inputs ({reason})"
        assert asyncio.run(scenario()) == (0, False, [1], why, None, 1)


def start_up_warnings(repo, caplog, **settings):
    """What the start-up load of ``repo`` warns of."""
    async def scenario():
        r, _ = make(repo, **settings)
        await r.refresh()
        ready = r.ready
        await r.close()
        return ready

    with caplog.at_level(logging.WARNING, "serving.engine.repository"):
        ready = asyncio.run(scenario())
    return ready, [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING]


def test_an_empty_repository_says_so_and_how_to_fill_it(tmp_path, caplog):
    """Health NOT_SERVING with not a word in the log: the repository holds no model directory."""
    assert start_up_warnings(tmp_path, caplog) == (False, [
        f"starting with no model: {tmp_path} holds no model directory: export one into it (recserve export --repo "
        f"{tmp_path} --name NAME writes {tmp_path}/NAME/1/); then restart the server (--poll-interval 0: the "
        "repository is read only at start)"])


@pytest.mark.parametrize("poll", [0, 30])
def test_a_model_with_no_version_directory_says_so_naming_its_path(tmp_path, caplog, poll):
    """ "starting without demo: no version loads (see the errors above)" with no error above: demo/ holds
    only files (and a version still being copied, a dot name)."""
    (tmp_path / "demo" / ".1.incoming").mkdir(parents=True)
    (tmp_path / "demo" / "notes.txt").write_text("v1 is coming")
    then = ("the next poll loads it" if poll else
            "then restart the server (--poll-interval 0: the repository is read only at start)")
    assert start_up_warnings(tmp_path, caplog, poll_interval_s=poll) == (False, [
        f"starting without demo: {tmp_path / 'demo'} holds no version directory: export one into it (recserve "
        f"export --repo {tmp_path} --name demo writes {tmp_path / 'demo'}/1/); {then}"])


def test_a_version_policy_that_names_no_version_on_disk_says_so(tmp_path, caplog):
    (tmp_path / "demo" / "1").mkdir(parents=True)
    (tmp_path / "demo" / "2").mkdir()
    (tmp_path / "demo" / "config.json").write_text('{"version_policy": {"specific": [3, 5]}}')
    assert start_up_warnings(tmp_path, caplog, poll_interval_s=30) == (False, [
        f"starting without demo: its version_policy in {tmp_path / 'demo' / 'config.json'} asks for versions "
        f"[3, 5], and {tmp_path / 'demo'} holds versions [1, 2]: export one of those, or change the policy; "
        "the next poll loads it"])


def test_a_model_asked_for_under_explicit_control_with_no_version_says_how_to_load_it(tmp_path, caplog):
    (tmp_path / "demo").mkdir()
    assert start_up_warnings(tmp_path, caplog, model_control="explicit", load_models=("demo",)) == (True, [
        f"starting without demo: {tmp_path / 'demo'} holds no version directory: export one into it (recserve "
        f"export --repo {tmp_path} --name demo writes {tmp_path / 'demo'}/1/); then load it (recserve models load "
        "demo)"])
