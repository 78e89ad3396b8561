"""Beyond one host: a client balancing over several servers (round_robin), surviving one stopping;
and, where 2+ GPUs are visible, models sharded across them and replicas on each."""
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
from conftest import run_cli
from recserve.local import samples
from servers import InProcessServer, ServeProcess
from test_export import PLANS, check_parity
from test_lifecycle import wait_for

from recserve.client import Client, random_request
from recserve.manifest import load_verified, read_manifest


def test_client_spreads_over_two_servers_and_survives_one_stopping(tmp_path, artifact):
    repo = tmp_path / "repo"
    shutil.copytree(artifact, repo / "demo" / "1")
    a, b = ServeProcess(repo), ServeProcess(repo)
    try:
        assert a.target.startswith("127.0.0.1:")
        with Client([a.target.replace("127.0.0.1", "localhost"), b.target]) as client:  # a host name and an address
            info = client.model_info("demo").models[0]
            dense, sparse = random_request(info, 4, seed=5)
            expected = client.predict("demo", dense, sparse)
            # round_robin uses a server once its connection is up: keep calling until both have
            # taken a share (on a fast machine the first calls may all precede the second connection).
            deadline = time.time() + 20
            served = [0.0, 0.0]
            while min(served) < 5 and time.time() < deadline:
                for _ in range(10):
                    np.testing.assert_array_equal(client.predict("demo", dense, sparse), expected)
                served = [_predicts(s) for s in (a, b)]
            assert min(served) >= 5, served  # both servers took a share
            failures, answered, stop = [], [0], threading.Event()

            def load():
                while not stop.is_set():
                    try:
                        np.testing.assert_array_equal(client.predict("demo", dense, sparse), expected)
                        answered[0] += 1
                    except grpc.RpcError as e:
                        failures.append(e.code())

            with ThreadPoolExecutor(1) as pool:
                loading = pool.submit(load)
                try:
                    assert wait_for(lambda: answered[0] >= 10, timeout=30)
                    assert a.terminate() == 0  # one server goes away under load
                    before = answered[0]
                    assert wait_for(lambda: answered[0] > before + 10, timeout=30)
                finally:
                    stop.set()
                loading.result()  # an assertion in the load thread fails the test here
            assert failures == []
    finally:
        for s in (a, b):
            if s.proc.poll() is None:
                s.terminate()


def _predicts(server) -> float:
    return sum(s.value for s in samples(server.scrape(), "recserve_requests_total", rpc="Predict", code="OK"))


# -- several GPUs ------------------------------------------------------------------------------

@pytest.mark.multigpu
@pytest.mark.parametrize("layout", ["table_wise_2", "row_wise_2", "column_wise_2"])
def test_sharded_across_two_gpus_matches_float(layout, checkpoint, tmp_path):
    plan, dtype = PLANS[layout]
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    assert run_cli("export", "--checkpoint", checkpoint, "--repo", tmp_path / "repo", "--name", "m", "--plan",
                   plan_file, "--device", "cuda", "--no-progress") == 0
    path = tmp_path / "repo" / "m" / "1"
    m = load_verified(path)
    placements = {s.placement for ts in m.sharding.tables.values() for s in ts.shards}
    assert {"rank:0/cuda:0", "rank:1/cuda:1"} <= placements
    check_parity(path, checkpoint, batch_sizes=(7, 256))
    server = InProcessServer(tmp_path / "repo")  # served on both GPUs, answers as the artifact does
    try:
        with Client(server.target) as client:
            info = client.model_info("m").models[0]
            dense, sparse = random_request(info, 64, seed=1)
            model = torch.jit.load(str(path / "model.pt"), map_location="cuda:0")
            keys, lengths, values = sparse
            with torch.no_grad():
                want = model(torch.from_numpy(dense).cuda(), torch.from_numpy(values).long().cuda(),
                             torch.from_numpy(lengths).cuda()).cpu().numpy()
            np.testing.assert_allclose(client.predict("m", dense, sparse), want, atol=1e-6, rtol=0)
    finally:
        server.stop()


@pytest.mark.multigpu
def test_planner_spreads_tables_over_two_gpus_under_a_memory_budget(checkpoint, tmp_path):
    assert run_cli("export", "--checkpoint", checkpoint, "--repo", tmp_path, "--name", "m", "--device", "cuda",
                   "--world-size", "2", "--no-progress") == 0
    m = load_verified(tmp_path / "m" / "1")
    assert {r for ts in m.sharding.tables.values() for r in ts.ranks} == {0, 1}
    check_parity(tmp_path / "m" / "1", checkpoint, batch_sizes=(7, 256))


@pytest.mark.multigpu
def test_replicas_on_every_gpu_answer_alike_and_share_the_load(checkpoint, tmp_path):
    assert run_cli("export", "--checkpoint", checkpoint, "--repo", tmp_path, "--name", "m", "--device", "cuda",
                   "--no-progress") == 0
    server = InProcessServer(tmp_path, max_batch_size=256)
    try:
        mv = server.model_version("m")
        assert [r.device for r in mv.runners] == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        calls = [0] * len(mv.runners)
        for i, b in enumerate(mv.routers["Predict"].batchers):
            inner = b.launch

            def counted(works, i=i, inner=inner):
                calls[i] += 1
                time.sleep(0.005)
                return inner(works)

            b.launch = counted
        with Client(server.target) as client:
            info = client.model_info("m").models[0]
            dense, sparse = random_request(info, 32, seed=3)
            expected = client.predict("m", dense, sparse)
            with ThreadPoolExecutor(8) as pool:
                for answers in [pool.submit(lambda: [client.predict("m", dense, sparse) for _ in range(20)])
                                for _ in range(8)]:
                    for ctr in answers.result():
                        np.testing.assert_allclose(ctr, expected, atol=1e-6, rtol=0)
        assert all(c > 10 for c in calls), calls
    finally:
        server.stop()


def test_serving_refuses_an_artifact_needing_more_gpus_than_visible(artifact):
    """A manifest for 8 GPUs, more than any machine here has: refused with its message, never loaded;
    and a CUDA artifact on a CPU server is refused with its own."""
    from recserve.manifest import ArtifactError
    from serving.engine.loader import check_device

    m = read_manifest(artifact)
    m.sharding.device, m.sharding.world_size = "cuda", 8
    with pytest.raises(ArtifactError) as exc:
        check_device(m, "cuda")
    assert str(exc.value) == f"demo v1 needs 8 GPUs; {torch.cuda.device_count()} visible"
    with pytest.raises(ArtifactError) as exc:
        check_device(m, "cpu")
    assert str(exc.value) == ("demo v1 was exported for cuda; this server runs on cpu (re-export with "
                              "--device cpu, or serve with --device cuda)")


def _engine_pids(server_pid: int) -> list:
    """The server's engine processes: its children that loaded torch (front ends never do)."""
    import os

    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == server_pid and "libtorch" in open(f"/proc/{entry}/maps").read():
                pids.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def test_two_cpu_engines_share_the_load_and_one_dying_takes_the_server_down(tmp_path, artifact):
    """`--replicas 2 --device cpu`: two engine processes, each with its copy of the model; both front
    ends send requests to both (answers exactly as from one engine), and when one engine dies the
    server stops with a non-zero code and clients get UNAVAILABLE, not a hang."""
    import os
    import signal

    repo = tmp_path / "repo"
    shutil.copytree(artifact, repo / "demo" / "1")
    proc = ServeProcess(repo, "--replicas", "2", "--frontends", "2")
    try:
        assert "(2 frontends, 2 engines)" in proc.output()
        with Client(proc.target) as client:
            info = client.model_info("demo").models[0]
            requests = [random_request(info, 32, seed=i) for i in range(4)]
            expected = [client.predict("demo", *r) for r in requests]

            def calls(i):
                for k in range(40):
                    np.testing.assert_allclose(client.predict("demo", *requests[k % 4]), expected[k % 4],
                                               atol=1e-6, rtol=0)

            with ThreadPoolExecutor(8) as pool:
                for f in [pool.submit(calls, i) for i in range(8)]:
                    f.result()
            text = proc.scrape()
            batches = {s.labels["engine"]: s.value for s in samples(text, "recserve_batch_size_count", rpc="Predict")}
            assert set(batches) == {"0", "1"} and min(batches.values()) >= 20, batches
            engines = _engine_pids(proc.proc.pid)
            assert len(engines) == 2
            os.kill(engines[1], signal.SIGKILL)
            assert proc.proc.wait(30) not in (0, None)
            with pytest.raises(grpc.RpcError) as exc:
                Client(proc.target, timeout=5).predict("demo", *requests[0])
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        if proc.proc.poll() is None:
            proc.terminate()


def test_a_model_whose_config_asks_for_one_replica_runs_on_engine_0_only(tmp_path, artifact):
    """config.json ``replicas: 1`` under `--replicas 2`: one engine holds the model and takes all its
    batches; the other model, without a config.json, runs on both."""
    repo = tmp_path / "repo"
    shutil.copytree(artifact, repo / "demo" / "1")
    shutil.copytree(artifact, repo / "one" / "1")
    manifest = json.loads((repo / "one" / "1" / "manifest.json").read_text())
    manifest["name"] = "one"
    (repo / "one" / "1" / "manifest.json").write_text(json.dumps(manifest))
    (repo / "one" / "config.json").write_text(json.dumps({"replicas": 1}))
    proc = ServeProcess(repo, "--replicas", "2", "--frontends", "2")
    try:
        with Client(proc.target) as client:
            info = client.model_info("one").models[0]
            assert json.loads(info.config_json)["replicas"] == 1
            request = random_request(info, 16, seed=3)
            want = client.predict("demo", *request)

            def calls(i):
                for _ in range(20):
                    for model in ("one", "demo"):
                        np.testing.assert_allclose(client.predict(model, *request), want, atol=1e-6, rtol=0)

            with ThreadPoolExecutor(8) as pool:
                for f in [pool.submit(calls, i) for i in range(8)]:
                    f.result()
        text = proc.scrape()
        batches = {(s.labels["model"], s.labels["engine"]) for s in samples(text, "recserve_batch_size_count",
                                                                             rpc="Predict") if s.value}
        assert {e for m, e in batches if m == "one"} == {"0"} and {e for m, e in batches if m == "demo"} == {"0", "1"}
    finally:
        assert proc.terminate() == 0
