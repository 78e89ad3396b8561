"""Model lifecycle and overload behaviour: version swaps under load, refused versions, health,
SIGTERM, queue limits, deadlines, execution failures."""
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from conftest import ROOT
from reference import golden_request
from servers import NOT_SERVING, SERVING, InProcessServer, ServeProcess, health_status

from recserve import wire
from recserve.local import samples, scrape
from recserve.client import Client, encode_sparse, random_request
from recserve.v1 import inference_pb2 as pb
from serving.frontend import servicer
from serving.supervisor import WORKDIR_NAME

# Each test here starts a server (seconds) and waits for states with deadlines of their own; a hang
# fails in minutes, not at the suite's 600 s limit.
pytestmark = pytest.mark.timeout(300)


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
    answered, failures = {1: 0, 2: 0}, []
    try:
        with Client(server.target) as client:
            info = client.model_info("demo").models[0]
            # Version 2 is exported from the same checkpoint: both answer every request alike.
            requests = [pb.PredictRequest(model_name="demo", dense=wire.encode(dense), sparse=encode_sparse(sparse))
                        for dense, sparse in (random_request(info, 4, seed=seed) for seed in range(8))]
            expected = [wire.decode(client.stub.Predict(r, timeout=30).ctr, "ctr", ("float32",)) for r in requests]

            def load(first):
                i = first
                while not stop.is_set():
                    try:
                        response = client.stub.Predict(requests[i % 8], timeout=30)
                    except grpc.RpcError as e:
                        failures.append(e.code())
                        continue
                    np.testing.assert_allclose(wire.decode(response.ctr, "ctr", ("float32",)), expected[i % 8],
                                               atol=1e-6, rtol=0)  # merged batches may round the last bit
                    answered[response.model_version] += 1
                    i += 1

            with ThreadPoolExecutor(4) as pool:
                loads = [pool.submit(load, i) for i in range(4)]
                try:
                    assert wait_for(lambda: answered[1] >= 20)
                    # In its own process, as a user runs it: torch.fx tracing patches nn.Module.__call__
                    # process-wide, which must never overlap a model call of a server in the same process.
                    subprocess.run([sys.executable, "-m", "recserve", "export", "--checkpoint", str(checkpoint),
                                    "--repo", str(repo), "--name", "demo", "--no-progress"], check=True, cwd=ROOT,
                                   capture_output=True)
                    assert wait_for(lambda: answered[2] >= 20)
                finally:
                    stop.set()
                for f in loads:
                    f.result()  # an assertion in a load thread fails the test here
            assert failures == []
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
            polls = server.polls
            assert wait_for(lambda: server.polls >= polls + 2)  # two more polls: refused once, not retried
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
    request, ctr = golden_request(repo / "demo" / "1")
    with Client(proc.target) as client:
        np.testing.assert_allclose(client.predict("demo", *request), ctr, atol=1e-5, rtol=0)
    assert proc.terminate() == 0
    assert "shutting down" in proc.output() and "stopped" in proc.output()


def test_sigterm_while_the_processes_start_exits_0_within_the_grace_period(tmp_path):
    """SIGTERM before the server listens (its engine still importing torch, front ends to start): the
    supervisor went on starting every one of them, printed "listening" and only then stopped,
    seconds past --grace-period + 1 s (up to 120 s per process that hangs at start)."""
    proc = subprocess.Popen([sys.executable, "-m", "recserve", "--log-level", "WARNING", "serve", "--repo", str(tmp_path),
                             "--port", "0", "--metrics-port", "0", "--device", "cpu", "--frontends", "2",
                             "--grace-period", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    assert wait_for(lambda: _spawned_children(proc.pid), timeout=60)  # the engine is importing torch
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, out) == (0, ""), err[-2000:]
    assert time.monotonic() - signalled < 1.0


def test_sigterm_with_an_http_request_still_arriving_exits_0_within_the_grace_period(repo):
    """An HTTP client that has sent a request's headers but not all of its body when SIGTERM comes
    (a slow upload, a client stalled mid-request): the front end stops at the end of the grace
    period (aiohttp's own wait for open requests is 60 s, and the supervisor killed it: exit 1).
    The ready line counts one front end in the singular (it said "1 frontends")."""
    import re
    import socket

    proc = ServeProcess(repo, "--http-port", "0", "--frontends", "1", "--grace-period", "1")
    (line,) = [line for line in proc.lines if "listening on" in line]
    assert re.sub(r":\d+", ":PORT", line.strip()) == (
        "recserve: listening on 127.0.0.1:PORT (1 frontend, 1 engine); HTTP/REST on 127.0.0.1:PORT")
    host, port = re.search(r"; HTTP/REST on (\S+):(\d+)$", line.strip()).groups()
    with socket.create_connection((host, int(port))) as stalled:
        stalled.sendall(b"POST /v2/models/demo/infer HTTP/1.1\r\nHost: recserve\r\nContent-Length: 1000\r\n"
                        b"Content-Type: application/json\r\n\r\n{")
        time.sleep(0.5)  # the handler is reading the body
        assert proc.terminate() == 0, proc.output()[-2000:]
    assert "did not stop within the grace period" not in proc.output()


def test_an_ipv6_host_serves_grpc_http_and_metrics(repo):
    """`--host ::1` (an IPv6-only pod: `--host ::`): gRPC, HTTP/REST and /metrics listen on it, and the
    ready line names the address as a gRPC target reads it ([::1]:PORT). gRPC was given "::1:PORT",
    which it cannot read: the server did not start."""
    import urllib.request

    proc = ServeProcess(repo, "--host", "::1", "--http-port", "0", "--frontends", "1")
    try:
        assert proc.target.startswith("[::1]:")
        (line,) = [line for line in proc.lines if "listening on" in line]
        assert f"listening on {proc.target} " in line and "; HTTP/REST on [::1]:" in line
        request, ctr = golden_request(repo / "demo" / "1")
        with Client(proc.target) as client:
            np.testing.assert_allclose(client.predict("demo", *request), ctr, atol=1e-5, rtol=0)
        http = line.strip().rsplit(" ", 1)[-1]
        with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=10) as r:
            assert r.status == 200
        assert samples(scrape(proc.metrics_port, "[::1]"), "recserve_requests_total", rpc="Predict", code="OK")[0].value == 1
    finally:
        assert proc.terminate() == 0


NO_MODEL_LOADED = ("no model has loaded on this server (the server's log says why each failed); retry once the "
                   "repository has a good version")


def test_health_not_serving_until_a_model_loads(tmp_path, artifact):
    repo = tmp_path / "repo"
    repo.mkdir()
    server = InProcessServer(repo)
    try:
        assert health_status(server.target) == NOT_SERVING
        with Client(server.target) as client, pytest.raises(grpc.RpcError) as exc:
            client.model_info("demo")
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE  # the model may be on its way
        assert exc.value.details() == NO_MODEL_LOADED
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


class GatedRuns:
    """Wraps a batcher's launch: each model call waits until the test opens the gate; the calls
    that entered and the samples that ran are counted."""

    def __init__(self, batcher):
        self.entered, self.samples, self.open = 0, [], threading.Event()
        self.inner = batcher.launch
        batcher.launch = self

    def __call__(self, works):
        self.entered += 1
        assert self.open.wait(60), "the test never opened the gate"
        self.samples.extend(w.batch_size for w in works)
        return self.inner(works)


def test_full_queue_is_unavailable_at_once(repo):
    """While the model call waits (gate closed), a request beyond the queue is refused: it cannot
    have waited for the call."""
    server = InProcessServer(repo, max_batch_size=8, max_delay_ms=0, max_queue=2)
    try:
        router = server.model_version("demo").routers["Predict"]
        gate = GatedRuns(router.batchers[0])
        with Client(server.target, timeout=30) as client:
            info = client.model_info("demo").models[0]
            reqs = [random_request(info, 8, seed=i) for i in range(4)]
            with ThreadPoolExecutor(3) as pool:
                try:
                    calls = [pool.submit(client.predict, "demo", *reqs[0])]
                    assert wait_for(lambda: gate.entered == 1, timeout=30)
                    calls += [pool.submit(client.predict, "demo", *r) for r in reqs[1:3]]
                    assert wait_for(lambda: router.depth == 2, timeout=30)
                    with pytest.raises(grpc.RpcError) as exc:
                        client.predict("demo", *reqs[3])
                    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert "queue full (2 requests waiting)" in exc.value.details()
                finally:
                    gate.open.set()
                answers = [c.result() for c in calls]
            for r, got in zip(reqs, answers):
                np.testing.assert_allclose(got, client.predict("demo", *r), atol=1e-6, rtol=0)
            assert gate.samples[:3] == [8, 8, 8] and router.depth == 0
        # The OIP statistics (serving/statistics.py): the refused request reached the engine and failed there.
        stats = server.engine.statistics()[("demo", 1)]
        assert (stats.success[0], stats.fail[0], stats.inference_count) == (6, 1, 48)
    finally:
        server.stop()


def test_queue_depth_of_a_model_unloaded_with_a_request_queued_returns_to_0(repo):
    """recserve_queue_depth is sampled from the models served: a model unloaded (explicit control)
    while a request waited for a batch must not keep its last depth once that request is answered."""
    server = InProcessServer(repo, settings={"model_control": "explicit", "load_models": ("demo",)},
                             max_delay_ms=3000)  # a lone request waits 3 s for company: queued
    try:
        (dense, sparse), ctr = golden_request(repo / "demo" / "1")
        depth = lambda: server.metric("recserve_queue_depth", rpc="Predict", model="demo")  # noqa: E731
        with Client(server.target, timeout=30) as client, ThreadPoolExecutor(1) as pool:
            queued = pool.submit(client.predict, "demo", dense, sparse)
            assert wait_for(lambda: depth() == 1, timeout=30)
            server.call(server.engine.repo.unload_model("demo"))
            np.testing.assert_allclose(queued.result(), ctr, atol=1e-5, rtol=0)  # drained: answered
        assert wait_for(lambda: depth() == 0, timeout=5), depth()  # the gauges update every 0.2 s
    finally:
        server.stop()


def test_a_request_whose_deadline_passes_behind_a_slow_batch_is_never_executed(repo, monkeypatch):
    """The engine's own deadline check: here the engine is given a 0.3 s deadline while the
    transport's is 30 s, so no cancellation removes the request first (with the transport's deadline
    the client's cancel races the check); the batch it would have joined refuses it unexecuted."""
    server = InProcessServer(repo, max_batch_size=8, max_delay_ms=0)
    deadlines = []

    def short_deadline(context):
        deadlines.append(time.monotonic() + 0.3)
        return deadlines[-1]

    try:
        router = server.model_version("demo").routers["Predict"]
        gate = GatedRuns(router.batchers[0])
        monkeypatch.setattr(servicer, "deadline", short_deadline)
        (dense, sparse), ctr = golden_request(repo / "demo" / "1")
        with Client(server.target, timeout=30) as client, ThreadPoolExecutor(2) as pool:
            try:
                blocker = pool.submit(client.predict, "demo", dense, sparse)
                assert wait_for(lambda: gate.entered == 1, timeout=30)
                expiring = pool.submit(client.predict, "demo", dense, sparse)
                assert wait_for(lambda: router.depth == 1 and len(deadlines) == 2, timeout=30)
                assert wait_for(lambda: time.monotonic() > deadlines[1], timeout=30)
            finally:
                gate.open.set()
            np.testing.assert_allclose(blocker.result(), ctr, atol=1e-5, rtol=0)
            with pytest.raises(grpc.RpcError) as exc:
                expiring.result()
        assert (exc.value.code(), exc.value.details()) == (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                           "deadline passed while queued; not executed")
        assert gate.samples == [dense.shape[0]] and router.depth == 0  # only the blocker ran
        assert server.metric("recserve_requests_total", rpc="Predict", model="demo", code="DEADLINE_EXCEEDED") == 1
    finally:
        server.stop()


def test_a_client_timeout_is_the_engines_deadline_and_an_expired_request_never_runs(repo):
    """The deadline the client set through gRPC (its timeout) reaches the engine as the request's
    deadline on the engine's clock: queued behind a held model call past it, the request is never
    executed and its client gets DEADLINE_EXCEEDED. (Which one drops it, the engine's deadline check
    or the cancel that follows the transport's deadline, is a race: the test above pins the check.)"""
    server = InProcessServer(repo, max_batch_size=8, max_delay_ms=0)
    try:
        router = server.model_version("demo").routers["Predict"]
        batcher = router.batchers[0]
        gate = GatedRuns(batcher)
        deadlines, submit = [], batcher.submit

        def recorded(work):
            deadlines.append(work.deadline)
            submit(work)

        batcher.submit = recorded
        (dense, sparse), ctr = golden_request(repo / "demo" / "1")
        request = pb.PredictRequest(model_name="demo", dense=wire.encode(dense), sparse=encode_sparse(sparse))
        with Client(server.target, timeout=30) as client, ThreadPoolExecutor(1) as pool:
            try:
                blocker = pool.submit(client.predict, "demo", dense, sparse)
                assert wait_for(lambda: gate.entered == 1, timeout=30)
                sent = time.monotonic()
                expiring = client.stub.Predict.future(request, timeout=1.0)
                assert wait_for(lambda: len(deadlines) == 2, timeout=30)
                with pytest.raises(grpc.RpcError) as exc:
                    expiring.result(30)
                assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert wait_for(lambda: router.depth == 0, timeout=30)  # dropped while the call is held
            finally:
                gate.open.set()
            np.testing.assert_allclose(blocker.result(), ctr, atol=1e-5, rtol=0)
        assert deadlines[1] == pytest.approx(sent + 1.0, abs=0.25)  # the client's, not None nor the clock's epoch
        assert sent + 20 < deadlines[0] <= sent + 30.1  # the blocker's 30 s
        assert gate.samples == [dense.shape[0]]  # only the blocker ran
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

        (dense, sparse), ctr = golden_request(repo / "demo" / "1")
        assert ctr.std() > 1e-3  # distinct answers per sample: a mixed-up or zeroed result shows
        with Client(server.target) as client:
            before = client.predict("demo", dense, sparse)
            np.testing.assert_allclose(before, ctr, atol=1e-5, rtol=0)
            mv.routers["Predict"].batchers[0].launch = flaky
            with pytest.raises(grpc.RpcError) as exc:
                client.predict("demo", dense, sparse)
            assert (exc.value.code(), exc.value.details()) == (grpc.StatusCode.INTERNAL, "model execution failed")
            mv.routers["Predict"].batchers[0].launch = inner
            np.testing.assert_array_equal(client.predict("demo", dense, sparse), before)
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


def test_an_engine_that_stops_releases_the_buffers_of_front_ends_still_connected(repo):
    """Its link to a front end ends with the engine too, not only when the front end goes: a buffer
    left page-locked and unmapped makes the next mapping at its address unlockable on CUDA, and
    copies from that mapping read the old pages (test_engine_units.py shows both on a GPU)."""
    server = InProcessServer(repo)
    try:
        links = list(server.engine.links)
        assert len(links) == 1 and not links[0].closed
        server.loop.call_soon_threadsafe(server.engine.request_stop)
        server.engine_runner.result(30)
        assert server.engine.links == []
        assert [(link.closed, link.pinned, link.memory, link.arena.map.closed) for link in links] == \
            [(True, False, None, True)]
    finally:
        server.stop()


@pytest.mark.timeout(900)
def test_make_demo_trains_exports_serves_and_exits_0(tmp_path):
    """What `make demo` runs, as a user runs it: the served AUC is the trained model's, exit code 0."""
    proc = subprocess.run([sys.executable, "-m", "recserve.demo", "--workdir", str(tmp_path / "demo")],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    auc = float(proc.stdout.split("Served held-out AUC over 4096 samples:")[1].split()[0])
    assert auc > 0.75 and "server exited with code 0" in proc.stdout


def test_a_full_front_end_buffer_answers_unavailable_and_frees_itself(repo):
    """A request whose slot fills most of the front end's buffer while its model call is held: the
    next one is refused UNAVAILABLE at once ("buffers are full", retryable, unlike a request larger
    than the whole buffer), the held one is answered exactly, and then the buffer is empty and
    admits the refused request."""
    server = InProcessServer(repo, settings={"frontend_buffer_bytes": 1 << 20}, max_batch_size=4096,
                             max_delay_ms=0, max_queue=64)
    try:
        router = server.model_version("demo").routers["Predict"]
        gate = GatedRuns(router.batchers[0])
        with Client(server.target, timeout=30) as client:
            info = client.model_info("demo").models[0]
            reqs = [random_request(info, 4096, mean_ids=12.0, seed=i) for i in range(2)]
            with ThreadPoolExecutor(1) as pool:
                try:
                    held = pool.submit(client.predict, "demo", *reqs[0])
                    assert wait_for(lambda: gate.entered == 1, timeout=30)
                    assert server.metric("recserve_frontend_buffer_used_bytes") > (1 << 20) // 2
                    with pytest.raises(grpc.RpcError) as exc:
                        client.predict("demo", *reqs[1])
                    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert "request buffers are full" in exc.value.details()
                finally:
                    gate.open.set()
                first = held.result()
            assert wait_for(lambda: server.metric("recserve_frontend_buffer_used_bytes") == 0, timeout=30)
            second = client.predict("demo", *reqs[1])  # room again
            for r, got in zip(reqs, (first, second)):
                np.testing.assert_allclose(got, client.predict("demo", *r), atol=1e-6, rtol=0)
                assert got.std() > 1e-3
    finally:
        server.stop()


def test_requests_while_no_model_has_loaded_are_told_to_retry(tmp_path):
    """A server whose repository holds no model yet answers health NOT_SERVING and every request,
    a model's description too, UNAVAILABLE (not NOT_FOUND: the model may be on its way; at start-up,
    front ends hear of the models one after another), saying that no model loaded: the start-up load
    is over, so not "server is loading models"."""
    (tmp_path / "repo").mkdir()
    server = InProcessServer(tmp_path / "repo")
    try:
        assert health_status(server.target) == NOT_SERVING
        with Client(server.target, timeout=30) as client:
            with pytest.raises(grpc.RpcError) as exc:
                client.predict("demo", np.zeros((1, 8), np.float32), {"user_id": [[1]]})
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            assert exc.value.details() == NO_MODEL_LOADED
            with pytest.raises(grpc.RpcError) as exc:  # its description too, not NOT_FOUND
                client.model_info("demo")
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert exc.value.details() == NO_MODEL_LOADED
    finally:
        server.stop()


def test_an_idle_connection_is_closed_after_idle_timeout(repo):
    """--idle-timeout: a connection with no call for that long is closed by the server (the client's
    channel falls back to IDLE), and the next call reconnects and is answered."""
    server = InProcessServer(repo, settings={"idle_timeout_s": 0.5})
    try:
        with Client(server.target, timeout=30) as client:
            info = client.model_info("demo").models[0]
            dense, sparse = random_request(info, 2, seed=9)
            first = client.predict("demo", dense, sparse)
            states = []
            client.channel.subscribe(states.append, try_to_connect=False)
            assert wait_for(lambda: grpc.ChannelConnectivity.IDLE in states, timeout=20), states
            assert states[0] == grpc.ChannelConnectivity.READY  # it was connected, then closed for idling
            np.testing.assert_array_equal(client.predict("demo", dense, sparse), first)
    finally:
        server.stop()



def test_idle_timeout_0_never_closes_an_http_keep_alive_connection(tmp_path):
    """--idle-timeout 0 is "never" (--help, README); HTTP/REST still closed an idle keep-alive
    connection after an hour (aiohttp's timer, set to 3600 s in its place), dropping a load
    balancer's pooled connections."""
    import math
    import socket

    server = InProcessServer(tmp_path, settings={"http_port": 0, "idle_timeout_s": 0,
                                                 "frontend_buffer_bytes": 32 << 20})
    try:
        with socket.create_connection(("127.0.0.1", server.frontend.http_port), timeout=10) as kept:
            kept.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert kept.recv(4096).split(b"\r\n")[0] == b"HTTP/1.1 200 OK"
            (connection,) = server.frontend._http.server.connections  # the one above, kept alive
            assert connection.keepalive_timeout == math.inf
            kept.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert kept.recv(4096).split(b"\r\n")[0] == b"HTTP/1.1 200 OK"
    finally:
        server.stop()

def _spawned_children(pid: int):
    """The engine and front ends a supervisor started (multiprocessing's spawn children)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                found.append(int(entry))
    return found


def _running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def test_the_engine_and_front_ends_stop_when_the_supervisor_is_killed(repo):
    """SIGKILL (or the OOM killer) takes the supervisor: its children must not serve on without it (no
    /metrics, no exit policy, the port held so that a restart fails)."""
    proc = ServeProcess(repo, "--frontends", "1")
    children = _spawned_children(proc.proc.pid)
    assert len(children) == 2, children  # one engine, one front end
    proc.proc.kill()
    proc.proc.wait()
    assert wait_for(lambda: not any(_running(p) for p in children), timeout=30), \
        [p for p in children if _running(p)]


def test_the_working_folder_goes_when_the_supervisor_is_killed(repo, tmp_path, monkeypatch):
    """A killed supervisor cannot remove its working folder (engine sockets, metric files,
    shm-regions.json): the last of its children to stop does, not one before (the others still use it)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    proc = ServeProcess(repo, "--frontends", "2")
    children = _spawned_children(proc.proc.pid)
    (workdir,) = [p for p in tmp.iterdir() if p.name.startswith("recserve-")]
    assert (workdir / "engine-0.sock").exists()
    proc.proc.kill()
    proc.proc.wait()
    assert wait_for(lambda: not any(_running(p) for p in children), timeout=60), \
        [p for p in children if _running(p)]
    assert wait_for(lambda: not workdir.exists(), timeout=10), sorted(os.listdir(workdir))


def _started_first(pids):
    """Of processes, the one the kernel started first (field 22 of /proc/PID/stat: start time in ticks)."""
    return min(pids, key=lambda pid: int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]))


def test_an_engine_dead_of_a_fatal_signal_leaves_every_threads_stack_in_the_log(repo):
    """An engine that dies of SIGSEGV (a native library's bug) prints the Python stack of each of its
    threads into the server's log (faulthandler); the log said only "exited with code -11". The
    supervisor stops the server as for any child that ends on its own: exit 1."""
    proc = ServeProcess(repo, "--frontends", "1")
    try:
        engine = _started_first(_spawned_children(proc.proc.pid))  # front ends start after the engine is ready
        os.kill(engine, signal.SIGSEGV)
        assert proc.proc.wait(60) == 1, proc.output()[-3000:]
    finally:
        proc.stop(10)
    log = proc.output()
    assert "Fatal Python error: Segmentation fault" in log, log[-3000:]
    assert re.search(r"^Current thread 0x[0-9a-f]+ ", log, re.M), log[-3000:]
    assert re.search(r"^Thread 0x[0-9a-f]+ ", log, re.M), log[-3000:]  # the other threads' stacks too
    assert re.search(r'^  File "[^"]+\.py", line \d+ in \w+', log, re.M), log[-3000:]
    assert "recserve-engine-0 exited with code -11: stopping the server" in log, log[-3000:]


def test_ctrl_c_is_the_supervisors_to_act_on(repo):
    """Ctrl-C sends SIGINT to every process of the terminal's group: the engine and the front ends
    ignore it (the engine stopping on its own would fail what the front ends still drain); the
    supervisor stops them in order, and the server exits 0."""
    proc = ServeProcess(repo, "--frontends", "1")
    request, ctr = golden_request(repo / "demo" / "1")
    children = _spawned_children(proc.proc.pid)
    for pid in children:
        os.kill(pid, signal.SIGINT)
    time.sleep(1.0)
    assert all(_running(p) for p in children)
    with Client(proc.target) as client:
        np.testing.assert_allclose(client.predict("demo", *request), ctr, atol=1e-5, rtol=0)
    proc.proc.send_signal(signal.SIGINT)
    assert proc.proc.wait(30) == 0
    assert not any(_running(p) for p in children)


def _interrupted_while_starting(ready):
    """A server child hit by Ctrl-C before it reaches child_setup (the engine imports torch for seconds
    first): the SIGINT arrives, then the child sets itself up as the engine and the front ends do."""
    from serving.child import child_setup
    from serving.config import ServerConfig

    os.kill(os.getpid(), signal.SIGINT)
    child_setup("INFO", ServerConfig(repo=ROOT), "engine")
    ready.send(("engine", os.getpid()))


def test_ctrl_c_while_a_child_starts_is_the_supervisors_too(tmp_path):
    """Ctrl-C in the first seconds of `recserve serve` reaches children still importing, before
    they ignore SIGINT: such a child must not die of KeyboardInterrupt (the server then failed
    with two tracebacks and exit 1 instead of stopping with 0)."""
    from serving.config import ServerConfig
    from serving.supervisor import Supervisor

    supervisor = Supervisor(ServerConfig(repo=tmp_path), "INFO")
    proc, conn = supervisor._start(_interrupted_while_starting, (), "recserve-engine-0")
    try:
        assert supervisor._await_ready(proc, conn) == ("engine", proc.pid)
        proc.join(30)
        assert proc.exitcode == 0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the supervisor's own is back
    finally:
        if proc.exitcode is None:
            proc.kill()
        shutil.rmtree(supervisor.workdir, ignore_errors=True)


def _report_blocked_signals(ready):
    """A server child, set up as the engine and the front ends are: the signals it blocks."""
    from serving.child import child_setup
    from serving.config import ServerConfig

    child_setup("INFO", ServerConfig(repo=ROOT), "frontend-0")
    ready.send(("frontend", sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))))


def test_children_block_no_signal_they_start_with():
    """The supervisor blocks SIGINT while it starts a child (a Ctrl-C meanwhile waits for its own
    handler), and the mask survives exec: the children kept SIGINT blocked for their whole life, and
    passed it on to every thread and process they started."""
    from serving.config import ServerConfig
    from serving.supervisor import Supervisor

    supervisor = Supervisor(ServerConfig(repo=ROOT), "INFO")
    procs = []
    try:
        for name in ("recserve-engine-0", "recserve-frontend-0"):
            proc, conn = supervisor._start(_report_blocked_signals, (), name)
            procs.append(proc)
            assert supervisor._await_ready(proc, conn) == ("frontend", [])
            proc.join(30)
            assert proc.exitcode == 0
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
        shutil.rmtree(supervisor.workdir, ignore_errors=True)


CTRL_C_AS_THE_FIRST_CHILD_STARTS = """
import os, shutil, signal, sys
from multiprocessing import resource_tracker
from serving.config import ServerConfig
from serving.supervisor import Supervisor

tracker = resource_tracker._resource_tracker
started = tracker.ensure_running  # multiprocessing starts its resource tracker with the first child


def then_ctrl_c():
    started()
    os.kill(os.getpid(), signal.SIGINT)


tracker.ensure_running = then_ctrl_c
supervisor = Supervisor(ServerConfig(repo=sys.argv[1]), "INFO")
signal.signal(signal.SIGINT, supervisor.request_stop)
proc, conn = supervisor._start(bool, (), "recserve-engine-0")  # a child that ends at once
proc.join(30)
shutil.rmtree(supervisor.workdir)
print(supervisor._stopping)
"""


def test_a_ctrl_c_while_the_first_child_starts_reaches_the_supervisor(tmp_path):
    """A Ctrl-C that comes while the supervisor starts a child waits, blocked, for its handler. The
    first child's start also starts multiprocessing's resource tracker, which unblocks SIGINT when
    it is up: a Ctrl-C from then until the engine was started hit the supervisor's SIG_IGN and was
    lost (the server went on starting)."""
    run = subprocess.run([sys.executable, "-c", CTRL_C_AS_THE_FIRST_CHILD_STARTS, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stdout) == (0, "True\n"), run.stderr[-2000:]


def test_a_child_that_dies_while_starting_fails_the_start_in_one_line_and_exit_1(repo):
    """The engine killed while it starts (the OOM killer while it imports or loads): the server
    stops what it started and exits 1 with one line naming the process, not a traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "recserve", "serve", "--repo", str(repo), "--port", "0",
                             "--device", "cpu", "--frontends", "1"], cwd=str(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: _spawned_children(proc.pid), timeout=60, every=0.01)
        engine, = _spawned_children(proc.pid)  # front ends start after the engine is ready
        os.kill(engine, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert "Traceback" not in err, err
    assert "recserve-engine-0 did not start (exit code -9)" in err, err
    assert "listening on" not in out


def test_an_engine_that_dies_while_the_front_ends_start_fails_the_start_at_once(tmp_path, monkeypatch):
    """`--replicas 2`: engine 1 killed after it said it listens, while a front end starts (and
    connects to it). The supervisor waited for the front end alone: 30 s of its connecting to a
    dead socket, then a traceback and a line blaming the front end. It must stop at once, naming
    the engine."""
    from types import SimpleNamespace

    from serving import supervisor as supervisor_module
    from serving.config import ServerConfig

    monkeypatch.setattr(supervisor_module, "START_TIMEOUT_S", 3)  # unfixed: it waits all of it for the front end
    supervisor = supervisor_module.Supervisor(ServerConfig(repo=tmp_path), "INFO")
    try:
        supervisor.engines = [SimpleNamespace(name="recserve-engine-0", exitcode=None),
                              SimpleNamespace(name="recserve-engine-1", exitcode=-9)]
        front = SimpleNamespace(name="recserve-frontend-0", exitcode=None, join=lambda timeout: None)
        supervisor.fronts = [front]
        conn, silent = supervisor.ctx.Pipe(duplex=False)  # the front end, still connecting: says nothing
        started = time.monotonic()
        with pytest.raises(supervisor_module.StartFailed) as exc:
            supervisor._await_ready(front, conn)
        assert time.monotonic() - started < 1.0
        assert str(exc.value) == ("recserve-engine-1 exited with code -9 while recserve-frontend-0 started; its "
                                  "error, if it had time to say one, is above")
        conn.close()
        silent.close()
    finally:
        shutil.rmtree(supervisor.workdir, ignore_errors=True)


class _UnkillableChild:
    """A child stuck in the kernel (a GPU driver call): SIGTERM and SIGKILL change nothing, and a wait
    for it never ends."""

    def __init__(self, name):
        self.name, self.pid, self.exitcode, self.waits = name, 4242, None, []

    def terminate(self):
        pass

    def kill(self):
        pass

    def join(self, timeout=None):
        assert timeout is not None, f"waited for {self.name} with no time limit"
        self.waits.append(timeout)
        time.sleep(timeout)


def test_a_child_that_survives_sigkill_does_not_keep_the_stop_waiting(tmp_path, caplog):
    """The stop waited for a killed child with no time limit: one stuck in the GPU driver kept the
    supervisor from ever exiting. It now waits a bounded time, names the child, and fails the exit."""
    from serving.config import ServerConfig
    from serving.supervisor import Supervisor

    supervisor = Supervisor(ServerConfig(repo=tmp_path, grace_period_s=0.2), "INFO")
    stuck = _UnkillableChild("recserve-engine-0")
    supervisor.engines = [stuck]
    assert supervisor._stop_all() == 1
    assert stuck.waits and sum(stuck.waits) <= 0.2 + 1.0
    assert any(r.levelname == "CRITICAL" and r.getMessage().startswith("recserve-engine-0 (pid 4242) did not exit "
               "after SIGKILL") for r in caplog.records), caplog.text
    assert not os.path.exists(supervisor.workdir)


class _Exited(Exception):
    """os._exit(code), as a test sees it."""


def _serve_exit_code(tmp_path, monkeypatch, start):
    """serve()'s exit code, with ``start`` for Supervisor.start (its signal handlers put back after): it
    leaves through os._exit (the interpreter's own exit took up to a second more), or raises."""
    from serving import supervisor as supervisor_module
    from serving.config import ServerConfig

    def exit_(code):
        raise _Exited(code)

    monkeypatch.setattr(supervisor_module.Supervisor, "start", start)
    monkeypatch.setattr(os, "_exit", exit_)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return supervisor_module.serve(ServerConfig(repo=tmp_path, grace_period_s=0.2))
    except _Exited as exited:
        return f"os._exit({exited.args[0]})"
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def test_the_supervisor_exits_without_joining_a_child_that_survives_sigkill(tmp_path, monkeypatch):
    """multiprocessing joins every child again at exit, with no time limit: serve() leaves through
    os._exit (logs flushed) when a child would not die, with the stop's exit code."""
    def start(self):
        self.fronts = [_UnkillableChild("recserve-frontend-0")]
        self._stopping = True  # as a SIGTERM would

    assert _serve_exit_code(tmp_path, monkeypatch, start) == "os._exit(1)"


class _ExitedChild:
    """A child that has exited with ``code``."""

    def __init__(self, name, code):
        self.name, self.pid, self.exitcode = name, 4243, code

    def kill(self):
        raise AssertionError(f"{self.name} has exited: nothing to kill")

    def join(self, timeout=None):
        pass


def test_an_engine_whose_device_fails_while_the_front_ends_start_exits_3(tmp_path, monkeypatch):
    """The engine loads its models while the front ends start, and a load that leaves the device
    unusable exits it with 3 (serving/engine/loader.py DeviceFailed). The start failed with exit 1
    ("did not start"), not the 3 that tells the operator to restart for the device."""
    from serving.supervisor import StartFailed

    def start(self):
        self.engines = [_ExitedChild("recserve-engine-0", 3)]
        raise StartFailed("recserve-engine-0 exited with code 3 while recserve-frontend-0 started")

    assert _serve_exit_code(tmp_path, monkeypatch, start) == "os._exit(3)"


def test_a_stop_while_starting_that_leaves_a_child_behind_exits_1(tmp_path, monkeypatch):
    """SIGTERM while the processes start exits 0, but a child that SIGKILL does not end is left
    behind with exit 1 (README, Signals and exit codes): the stop while starting exited 0 then too."""
    from serving.supervisor import StoppedWhileStarting

    def start(self):
        self.engines = [_UnkillableChild("recserve-engine-0")]
        raise StoppedWhileStarting()

    assert _serve_exit_code(tmp_path, monkeypatch, start) == "os._exit(1)"


def test_a_second_signal_while_the_server_drains_stops_it_at_once(repo, tmp_path, monkeypatch):
    """Ctrl-C pressed twice: the first starts the drain (here of a request held in the engine: alone, it
    waits --max-delay-ms for batch-mates), the second stops every process at once, the held request
    failing: exit 0 within a second, no process and no working folder left. The second signal changed
    nothing: the server waited for the request, up to --grace-period (60 s here)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    proc = ServeProcess(repo, "--frontends", "1", "--max-batch-size", "4096", "--max-delay-ms", "30000",
                        "--grace-period", "60")
    try:
        children = _spawned_children(proc.proc.pid)
        request, _ = golden_request(repo / "demo" / "1")
        queued = lambda: sum(s.value for s in samples(proc.scrape(), "recserve_queue_depth"))  # noqa: E731
        with Client(proc.target, timeout=60) as client, ThreadPoolExecutor(1) as pool:
            held = pool.submit(client.predict, "demo", *request)
            assert wait_for(lambda: queued() == 1, timeout=30)
            proc.proc.send_signal(signal.SIGINT)
            assert wait_for(lambda: "shutting down" in proc.output(), timeout=10), proc.output()[-2000:]
            time.sleep(0.3)  # the front end is draining: the request is still held
            assert not held.done() and proc.alive()
            signalled = time.monotonic()
            proc.proc.send_signal(signal.SIGINT)
            assert proc.proc.wait(10) == 0, proc.output()[-2000:]
            assert time.monotonic() - signalled < 1.0
            with pytest.raises(grpc.RpcError) as exc:
                held.result(30)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "stopped at once on a second signal" in proc.output()
        assert not any(_running(p) for p in children)
        assert list(tmp.iterdir()) == []
    finally:
        if proc.alive():
            proc.proc.kill()


def test_sigterm_while_a_model_loads_exits_0_within_a_second_leaving_nothing_behind(repo, tmp_path, monkeypatch):
    """SIGTERM with --grace-period 0 while a model still loads (its read hangs: a FIFO as its manifest):
    exit 0 within the grace period plus one second, no process and no working folder left. The
    supervisor stopped its children within a third of a second, then took 0.5-1 s more to exit (the
    interpreter tearing down torch's modules): over the second on a busy machine."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    (repo / "hung" / "1").mkdir(parents=True)
    os.mkfifo(repo / "hung" / "1" / "manifest.json")
    proc = ServeProcess(repo, "--frontends", "1", "--grace-period", "0", wait_ready=False)  # hung: NOT_SERVING
    try:
        children = _spawned_children(proc.proc.pid)
        assert "starting without hung" not in proc.output()
        signalled = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(10) == 0, proc.output()[-2000:]
        assert time.monotonic() - signalled < 1.0, proc.output()[-2000:]
        assert not any(_running(p) for p in children)
        assert list(tmp.iterdir()) == []
    finally:
        if proc.alive():
            proc.proc.kill()


USER_ERROR_WITH_A_CHILD_THAT_WILL_NOT_DIE = """
import multiprocessing as mp, sys, time
from recserve.cli import main
from recserve.errors import UserError
from serving import supervisor

# A child stuck in the kernel (a GPU driver call): neither SIGTERM nor SIGKILL ends it.
mp.process.BaseProcess.terminate = mp.process.BaseProcess.kill = lambda self: None


def start(self):
    engine = self.ctx.Process(target=time.sleep, args=(60,), name="recserve-engine-0")
    engine.start()
    print(engine.pid, flush=True)
    self.engines.append(engine)
    raise UserError("cannot listen on 127.0.0.1:1: the port is in use; choose another --port or --host")


supervisor.Supervisor.start = start
sys.exit(main(["serve", "--repo", sys.argv[1], "--device", "cpu", "--metrics-port", "0"]))
"""


def test_a_start_refused_while_a_child_will_not_die_exits_2_without_waiting_for_it(tmp_path):
    """A front end refuses to start (the user's error: one line, exit 2) while the engine is stuck where
    SIGKILL does not end it: the supervisor named the engine, raised the error, and then waited for the
    engine forever (multiprocessing joins its children at exit with no time limit)."""
    out, err = tmp_path / "out", tmp_path / "err"  # not pipes: the stuck engine holds them open
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", USER_ERROR_WITH_A_CHILD_THAT_WILL_NOT_DIE, str(tmp_path)],
                                cwd=ROOT, stdout=stdout, stderr=stderr, text=True)
    engine = None
    try:
        code = proc.wait(20)
        engine, err = int(out.read_text()), err.read_text()
        assert code == 2, err[-2000:]
        assert err.splitlines()[-1] == ("recserve serve: error: cannot listen on 127.0.0.1:1: the port is in use; "
                                        "choose another --port or --host")
        assert "recserve-engine-0 (pid %d) did not exit after SIGKILL" % engine in err
    finally:
        proc.kill()
        if engine is not None and _running(engine):
            os.kill(engine, signal.SIGKILL)


def test_a_server_removes_the_working_folders_of_servers_killed_whole(tmp_path, monkeypatch):
    """The supervisor and its children SIGKILLed together (a container's OOM kill takes every process
    of it; `kill -9` of the process group): nobody is left to remove the working folder (engine
    sockets, metric files, shm-regions.json), and a /tmp that outlives the process (an emptyDir under a
    read-only root filesystem, a host) gathered one per restart. The next server's start removes those
    of its user that no process holds (the supervisor and every child hold a lock on theirs), and
    leaves alone one held, or made in the last minute (its server still starting)."""
    import fcntl

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    hour_ago = time.time() - 3600
    folders = {}
    for name in ("recserve-held-kil1ed_a", "recserve-held-he1dheld", "recserve-held-y0ungone", "recserve-notours",
                 "recserve-0lderver"):  # the last as a server of a version before ours names it: it holds none
        folder = folders[name] = tmp / name
        (folder / "metrics").mkdir(parents=True)
        (folder / "metrics" / "counter_4242.db").write_bytes(b"\0" * 4096)
        (folder / "shm-regions.json").write_text("{}")
        if name != "recserve-held-y0ungone":
            os.utime(folder, (hour_ago, hour_ago))
    outside = tmp_path / "outside"
    outside.mkdir()
    (folders["recserve-notours"] / "link").symlink_to(outside)  # rmtree must not follow it
    os.rename(folders["recserve-notours"], tmp / "recserve-notours-x")  # not a name of ours
    held = os.open(folders["recserve-held-he1dheld"], os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_SH)  # as a running server's processes hold theirs
    try:
        (tmp_path / "repo").mkdir()
        proc = ServeProcess(tmp_path / "repo", "--frontends", "1", wait_ready=False)
        try:
            ours = [p.name for p in tmp.iterdir() if p.name not in folders and p.name != "recserve-notours-x"]
            assert len(ours) == 1 and WORKDIR_NAME.fullmatch(ours[0]), ours
            assert sorted(p.name for p in tmp.iterdir()) == sorted(
                ["recserve-0lderver", "recserve-held-he1dheld", "recserve-held-y0ungone", "recserve-notours-x", *ours])
            assert proc.terminate() == 0, proc.output()[-2000:]
        finally:
            if proc.alive():
                proc.proc.kill()
    finally:
        os.close(held)
    assert sorted(p.name for p in tmp.iterdir()) == ["recserve-0lderver", "recserve-held-he1dheld", "recserve-held-y0ungone",
                                                     "recserve-notours-x"]
    assert outside.exists()


def test_sigterm_lets_a_request_held_in_the_engine_finish_within_the_grace_period(repo):
    """The engine keeps working while the front ends drain, and is stopped only after them: a request
    held in the engine (alone, it waits --max-delay-ms 3000 for batch-mates) when SIGTERM comes is
    answered in full, and the server exits 0, no process killed, within --grace-period 5 plus a second."""
    proc = ServeProcess(repo, "--frontends", "1", "--max-batch-size", "4096", "--max-delay-ms", "3000",
                        "--grace-period", "5")
    try:
        request, ctr = golden_request(repo / "demo" / "1")
        queued = lambda: sum(s.value for s in samples(proc.scrape(), "recserve_queue_depth"))  # noqa: E731
        with Client(proc.target, timeout=60) as client, ThreadPoolExecutor(1) as pool:
            held = pool.submit(client.predict, "demo", *request)
            assert wait_for(lambda: queued() == 1, timeout=30)
            signalled = time.monotonic()
            proc.proc.send_signal(signal.SIGTERM)
            np.testing.assert_allclose(held.result(30), ctr, atol=1e-5, rtol=0)
            assert proc.proc.wait(30) == 0, proc.output()[-2000:]
            assert time.monotonic() - signalled < 5 + 1.0
        assert "did not stop within the grace period" not in proc.output()
    finally:
        if proc.alive():
            proc.proc.kill()
