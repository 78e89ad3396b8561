"""Model lifecycle and overload behaviour: version swaps under load, refused versions, health,
SIGTERM, queue limits, deadlines, execution failures."""
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from conftest import ROOT
from servers import NOT_SERVING, SERVING, InProcessServer, ServeProcess, health_status

from recserve import wire
from recserve.local import samples
from recserve.client import Client, encode_sparse, random_request
from recserve.v1 import inference_pb2 as pb



def wait_for(predicate, timeout=60.0, every=0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return False


def publish_broken_copy(repo, source_version, new_version, how):
    """Copy a version as the next one, broken in one way, atomically (as an exporter would)."""
    work = repo / "demo" / f".{new_version}.incoming"
    shutil.copytree(repo / "demo" / str(source_version), work)
    if how == "checksum":
        data = bytearray((work / "model.pt").read_bytes())
        data[len(data) // 3] ^= 0x55
        (work / "model.pt").write_bytes(bytes(data))
    elif how == "manifest":
        (work / "manifest.json").write_text("{not json")
    work.rename(repo / "demo" / str(new_version))


def test_version_swap_under_load_has_no_failures(repo, checkpoint):
    server = InProcessServer(repo, max_batch_size=256, max_delay_ms=2, max_queue=256)
    stop = threading.Event()
    seen, failures = set(), []
    try:
        with Client(server.target) as client:
            info = client.model_info("demo").models[0]

            def load(seed):
                while not stop.is_set():
                    dense, sparse = random_request(info, 4, seed=seed)
                    seed += 1000
                    request = pb.PredictRequest(model_name="demo", dense=wire.encode(dense),
                                                sparse=encode_sparse(sparse))
                    try:
                        seen.add(client.stub.Predict(request, timeout=30).model_version)
                    except grpc.RpcError as e:
                        failures.append(e.code())

            with ThreadPoolExecutor(4) as pool:
                for i in range(4):
                    pool.submit(load, i)
                time.sleep(0.5)
                # In its own process, as a user runs it: torch.fx tracing patches nn.Module.__call__
                # process-wide, which must never overlap a model call of a server in the same process.
                subprocess.run([sys.executable, "-m", "recserve", "export", "--checkpoint", str(checkpoint),
                                "--repo", str(repo), "--name", "demo", "--no-progress"], check=True, cwd=ROOT,
                               capture_output=True)
                assert wait_for(lambda: 2 in seen)
                time.sleep(0.5)
                stop.set()
            assert failures == []
            assert seen == {1, 2}
            assert wait_for(lambda: [v.version for v in client.model_info("demo").models[0].versions] == [2])
            assert server.metric("recserve_model_version_loaded", model="demo", version="2", state="READY") == 1
    finally:
        stop.set()
        server.stop()


@pytest.mark.parametrize("how", ["checksum", "manifest"])
def test_broken_new_version_is_refused_and_old_keeps_serving(how, repo):
    server = InProcessServer(repo, max_batch_size=64, max_delay_ms=1)
    try:
        with Client(server.target) as client:
            info = client.model_info("demo").models[0]
            dense, sparse = random_request(info, 5, seed=1)
            before = client.predict("demo", dense, sparse)
            publish_broken_copy(repo, 1, 2, how)
            reason = "ArtifactError"
            assert wait_for(lambda: server.metric("recserve_model_load_failures_total", model="demo", reason=reason) >= 1)
            time.sleep(0.6)  # a few more polls: refused once, not retried while unchanged
            assert server.metric("recserve_model_load_failures_total", model="demo", reason=reason) == 1
            assert [v.version for v in client.model_info("demo").models[0].versions] == [1]
            np.testing.assert_array_equal(client.predict("demo", dense, sparse), before)
            assert health_status(server.target) == SERVING
    finally:
        server.stop()


def test_sigterm_health_and_exit_code(repo):
    proc = ServeProcess(repo, "--grace-period", "5")
    assert health_status(proc.target) == SERVING
    assert health_status(proc.target, "recserve.v1.Inference") == SERVING
    with Client(proc.target) as client:
        info = client.model_info("demo").models[0]
        assert client.predict("demo", *random_request(info, 3, seed=0)).shape == (3,)
    assert proc.terminate() == 0
    assert "shutting down" in proc.output() and "stopped" in proc.output()


def test_health_not_serving_until_a_model_loads(tmp_path, artifact):
    repo = tmp_path / "repo"
    repo.mkdir()
    server = InProcessServer(repo)
    try:
        assert health_status(server.target) == NOT_SERVING
        with Client(server.target) as client, pytest.raises(grpc.RpcError) as exc:
            client.model_info("demo")
        assert exc.value.code() in (grpc.StatusCode.NOT_FOUND,)
        shutil.copytree(artifact, repo / "demo" / ".incoming")
        (repo / "demo" / ".incoming").rename(repo / "demo" / "1")
        assert wait_for(lambda: health_status(server.target) == SERVING)
    finally:
        server.stop()


class SlowRuns:
    """Wraps a batcher's run function: each model call sleeps first and is counted."""

    def __init__(self, batcher, seconds):
        self.batcher, self.seconds, self.samples = batcher, seconds, []
        self.inner = batcher.launch
        batcher.launch = self

    def __call__(self, works):
        time.sleep(self.seconds)
        self.samples.extend(w.batch_size for w in works)
        return self.inner(works)


def test_full_queue_is_unavailable_at_once_and_deadline_skips_execution(repo):
    server = InProcessServer(repo, max_batch_size=8, max_delay_ms=0, max_queue=2)
    try:
        mv = server.model_version("demo")
        slow = SlowRuns(mv.routers["Predict"].batchers[0], 1.0)
        with Client(server.target, timeout=30) as client:
            info = client.model_info("demo").models[0]
            reqs = [random_request(info, 8, seed=i) for i in range(4)]
            with ThreadPoolExecutor(4) as pool:
                running = pool.submit(client.predict, "demo", *reqs[0])  # executing for 1 s
                time.sleep(0.3)
                queued = [pool.submit(client.predict, "demo", *r) for r in reqs[1:3]]  # fill the queue
                time.sleep(0.3)
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as exc:
                    client.predict("demo", *reqs[3])
                assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 0.5
                running.result(), [q.result() for q in queued]
            executed_before = len(slow.samples)
            # A request whose deadline passes while it waits behind a slow batch is never executed.
            with ThreadPoolExecutor(2) as pool:
                blocker = pool.submit(client.predict, "demo", *reqs[0])
                time.sleep(0.2)
                short = Client(server.target, timeout=0.3)
                with pytest.raises(grpc.RpcError) as exc:
                    short.predict("demo", *reqs[1])
                assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                blocker.result()
                time.sleep(1.2)
            assert len(slow.samples) == executed_before + 1  # only the blocker ran
            assert mv.routers["Predict"].depth == 0
    finally:
        server.stop()


def test_execution_failure_fails_only_that_batch(repo):
    server = InProcessServer(repo, max_batch_size=64, max_delay_ms=1)
    try:
        mv = server.model_version("demo")
        inner = mv.routers["Predict"].batchers[0].launch
        calls = []

        def flaky(works):
            calls.append(len(works))
            if len(calls) == 1:
                raise RuntimeError("shape mismatch in batch (injected)")
            return inner(works)

        mv.routers["Predict"].batchers[0].launch = flaky
        with Client(server.target) as client:
            info = client.model_info("demo").models[0]
            dense, sparse = random_request(info, 3, seed=9)
            with pytest.raises(grpc.RpcError) as exc:
                client.predict("demo", dense, sparse)
            assert exc.value.code() == grpc.StatusCode.INTERNAL and "injected" not in exc.value.details()
            mv.routers["Predict"].batchers[0].launch = inner
            assert client.predict("demo", dense, sparse).shape == (3,)
    finally:
        server.stop()


def test_frontends_share_one_port_and_one_engine_and_exit_0(repo):
    proc = ServeProcess(repo, "--frontends", "2", "--grace-period", "5")
    assert "(2 frontends, 1 engine)" in proc.output()
    with Client(proc.target) as client:
        info = client.model_info("demo").models[0]
        dense, sparse = random_request(info, 4, seed=2)
        first = client.predict("demo", dense, sparse)
        # New channels land on either front end; both reach the one engine and answer the same.
        for _ in range(6):
            with Client(proc.target, options=[("grpc.use_local_subchannel_pool", 1)]) as other:
                np.testing.assert_array_equal(other.predict("demo", dense, sparse), first)
    # One /metrics for the whole server: both front ends' requests, the engine's batches (one model copy).
    text = proc.scrape()
    served = sum(s.value for s in samples(text, "recserve_requests_total", rpc="Predict", code="OK"))
    batches = sum(s.value for s in samples(text, "recserve_batch_size_count"))
    loaded = [s for s in samples(text, "recserve_model_version_loaded") if s.value]
    assert served == 7 and batches == 7 and len(loaded) == 1
    assert proc.terminate() == 0


def test_make_demo_trains_exports_serves_and_exits_0(tmp_path):
    """What `make demo` runs, as a user runs it: the served AUC is the trained model's, exit code 0."""
    proc = subprocess.run([sys.executable, "-m", "recserve.demo", "--workdir", str(tmp_path / "demo")],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    auc = float(proc.stdout.split("Served held-out AUC over 4096 samples:")[1].split()[0])
    assert auc > 0.75 and "server exited with code 0" in proc.stdout
