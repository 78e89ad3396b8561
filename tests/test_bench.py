"""`recserve bench` in make-test size (bare, floor and served), the floor server, the local-server
helpers (ready line, /metrics), the locust smoke run, dense precision options, and the
DLRM-v2-shaped benchmark model (DLRM_DCN) through the export."""
import json
import os
import shutil
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch
from conftest import ROOT, cli_error, run_cli
from test_export import check_parity

from recserve.manifest import read_manifest


def test_bench_cpu_bare_floor_and_served(artifact, tmp_path, capsys):
    repo = tmp_path / "repo"
    shutil.copytree(artifact, repo / "demo" / "1")
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert run_cli("bench", "--repo", repo, "--name", "demo", "--device", "cpu", "--batch-sizes", "8,64",
                   "--duration", "0.5", "--concurrency", "2", "--ids-per-bag", "3", "--frontends", "2",
                   "--json", out_json, "--plot", out_png) == 0
    figures = json.loads(out_json.read_text())
    rows = {(r["mode"], r["batch_size"]): r for r in figures["rows"]}
    assert set(rows) == {(mode, b) for mode in ("bare", "floor", "served") for b in (8, 64)}
    for r in rows.values():
        assert r["samples_per_s"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"] and r["calls"] >= 1
        assert r["concurrency"] == (1 if r["mode"] == "bare" else 2)
        # gRPC clients use CPU, at most every core of the machine per wall second; the bare call has none.
        assert (r["client_cpu"] is None) if r["mode"] == "bare" else (0 < r["client_cpu"] <= os.cpu_count())
    assert figures["server_exit_code"] == 0 and figures["floor_exit_code"] == 0
    assert figures["server_frontends"] == 2 and figures["floor_processes"] == 2  # the floor as wide as the server
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    captured = capsys.readouterr()
    assert "served/bare" in captured.out and "p50 - (floor + bare)" in captured.out
    assert "CUDA graphs off: the model runs on cpu" in captured.err  # said, not silently ignored
    assert figures["cuda_graphs"] is True and figures["breakdown"] == []


def test_bench_runs_ranking_requests_in_both_forms(artifact, tmp_path, capsys):
    repo = tmp_path / "repo"
    shutil.copytree(artifact, repo / "demo" / "1")
    out_json = tmp_path / "bench.json"
    assert run_cli("bench", "--repo", repo, "--name", "demo", "--device", "cpu", "--batch-sizes", "32",
                   "--duration", "0.3", "--concurrency", "1", "--shared-features", "user_id,topics",
                   "--shared-ids-per-bag", "20", "--frontends", "1", "--json", out_json) == 0
    rows = {(r["mode"], r["form"]): r for r in json.loads(out_json.read_text())["rows"] if r["mode"] != "bare"}
    assert set(rows) == {(m, f) for m in ("floor", "served") for f in ("per-sample", "shared")}
    for mode in ("floor", "served"):
        # 2 shared bags of ~20 ids sent once instead of 32 times: far fewer bytes for the same samples
        assert rows[mode, "shared"]["request_bytes"] < 0.5 * rows[mode, "per-sample"]["request_bytes"]
        assert all(rows[mode, f]["samples_per_s"] > 0 for f in ("per-sample", "shared"))
    out = capsys.readouterr().out
    assert "ranking requests: features user_id,topics one bag per request" in out and "shared/per-sample" in out
    assert "s-shared" in out and "f-shared" in out
    assert run_cli("bench", "--repo", repo, "--name", "demo", "--device", "cpu", "--batch-sizes", "8",
                   "--no-floor", "--shared-features", "4", "--duration", "0.1") == 2
    assert "--shared-features 4: the model has 3 features" in capsys.readouterr().err


def test_floor_answers_raw_bytes_with_b_ctr_values_from_every_process():
    from bench.floor import FloorProcess
    from recserve import wire
    from recserve.v1 import inference_pb2 as pb

    floor = FloorProcess(batch_size=5, processes=2, model="demo", version=3)
    try:
        assert floor.processes == 2  # both bound the one port (SO_REUSEPORT), or it would not say "listening"
        with grpc.insecure_channel(floor.target) as channel:
            predict = channel.unary_unary("/recserve.v1.Inference/Predict", request_serializer=None,
                                          response_deserializer=pb.PredictResponse.FromString)
            answer = predict(b"not a PredictRequest: the floor never decodes it", timeout=10)
    finally:
        code = floor.stop()
    assert code == 0
    assert (answer.model_name, answer.model_version) == ("demo", 3)
    assert wire.decode(answer.ctr, "ctr", ("float32",), ndim=1).tolist() == [0.5] * 5


def test_local_parses_listening_lines_and_metrics():
    from bench.served import memory_figures
    from recserve.local import parse_listening, samples

    assert parse_listening("recserve: listening on 127.0.0.1:5051\n") == ("127.0.0.1:5051", 1)
    assert parse_listening("recserve: listening on 0.0.0.0:80 (4 workers)") == ("0.0.0.0:80", 4)
    assert parse_listening("bench.floor: listening on 127.0.0.1:9 (3 processes)") == ("127.0.0.1:9", 3)
    # recserve serve's own line: its front ends share the port (bench's floor runs as many processes)
    assert parse_listening("recserve: listening on 127.0.0.1:5051 (8 frontends, 1 engine); HTTP/REST on "
                           "127.0.0.1:8000") == ("127.0.0.1:5051", 8)
    assert parse_listening("recserve: listening on 127.0.0.1:5051 (1 frontend, 2 engines)") == ("127.0.0.1:5051", 1)
    assert parse_listening("INFO serving.supervisor: serving on 127.0.0.1:5051") is None
    text = """# HELP recserve_requests Requests
# TYPE recserve_requests counter
recserve_requests_total{code="OK",model="demo",rpc="Predict"} 7.0
recserve_requests_total{code="INTERNAL",model="demo",rpc="Predict"} 2.0
# HELP recserve_gpu_memory_bytes GPU memory
# TYPE recserve_gpu_memory_bytes gauge
recserve_gpu_memory_bytes{device="cuda:0"} 3.0e+09
recserve_gpu_memory_bytes{device="cuda:1"} 5.0e+09
# HELP recserve_cuda_graph_pool_bytes pools
# TYPE recserve_cuda_graph_pool_bytes gauge
recserve_cuda_graph_pool_bytes{device="cuda:0",model="a"} 1.0e+08
recserve_cuda_graph_pool_bytes{device="cuda:0",model="b"} 2.0e+08
recserve_cuda_graph_pool_bytes{device="cuda:1",model="a"} 2.5e+08
"""
    assert [s.value for s in samples(text, "recserve_requests_total", code="INTERNAL")] == [2.0]
    assert sum(s.value for s in samples(text, "recserve_requests_total", rpc="Predict")) == 9.0
    assert memory_figures(text) == {"served_gpu_memory_bytes": 5e9, "served_cuda_graph_pool_bytes": 3e8}
    assert memory_figures(text.split("# HELP recserve_cuda")[0]) == {"served_gpu_memory_bytes": 5e9}


def test_bench_breakdown_needs_cuda_and_says_so(artifact, tmp_path, capsys):
    repo = tmp_path / "repo"
    shutil.copytree(artifact, repo / "demo" / "1")
    assert run_cli("bench", "--repo", repo, "--name", "demo", "--device", "cpu", "--breakdown", "64",
                   "--no-served") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "recserve bench: error: --breakdown profiles CUDA kernels; it needs a CUDA artifact and GPU"


def test_locust_smoke_run(artifact, tmp_path):
    out = tmp_path / "loadtest"
    shutil.copytree(artifact, out / "repo" / "demo" / "1")
    proc = subprocess.run([sys.executable, "loadtest/run.py", "--out", str(out), "--users", "2", "--duration", "4s",
                           "--batch-size", "16", "--shared-features", "user_id"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import csv

    with open(out / "locust_stats.csv") as f:
        stats = {row["Name"]: row for row in csv.DictReader(f)}
    assert int(stats["Predict"]["Request Count"]) > 0 and int(stats["Lookup"]["Request Count"]) > 0
    assert int(stats["Aggregated"]["Failure Count"]) == 0
    assert (out / "report.html").stat().st_size > 1000
    # The summary line says what locust's own closing table says (its CSV is a snapshot from before the end).
    import re

    table = re.findall(r"^\s+Aggregated\s+(\d+)\s+(\d+)\(", proc.stdout + proc.stderr, re.M)
    summary = re.findall(r"^(\d+) requests, (\d+) failures, ", proc.stdout, re.M)
    assert len(table) == 1 and summary == table, (table, summary, proc.stdout[-2000:])


DENSE = ["bf16", pytest.param("tf32", marks=pytest.mark.gpu), pytest.param("fp16", marks=pytest.mark.gpu),
         pytest.param("bf16-cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("dense_dtype", DENSE)
def test_dense_dtype_matches_float(dense_dtype, checkpoint, tmp_path, capsys):
    dtype, _, device = dense_dtype.partition("-")
    device = device or ("cuda" if dtype in ("tf32", "fp16") else "cpu")
    assert run_cli("export", "--checkpoint", checkpoint, "--repo", tmp_path, "--name", "m", "--dense-dtype", dtype,
                   "--device", device, "--no-progress") == 0
    m = read_manifest(tmp_path / "m" / "1")
    assert m.dense_dtype == dtype
    check_parity(tmp_path / "m" / "1", checkpoint, batch_sizes=(7, 256))
    print(f"dense {dtype} on {device}: sharded vs float ctr max abs err "
          f"{m.verification.sharded_vs_float['ctr_max_abs_err']:.2e}", file=sys.stderr)


def test_dense_dtype_rejected_where_unsupported(checkpoint, tmp_path, capsys):
    line = cli_error(capsys, "export", "--checkpoint", checkpoint, "--repo", tmp_path, "--name", "m", "--dense-dtype",
                     "fp8", "--no-progress")
    assert "argument --dense-dtype: invalid choice: 'fp8'" in line
    if not torch.cuda.is_available():
        assert run_cli("export", "--checkpoint", checkpoint, "--repo", tmp_path, "--name", "m", "--dense-dtype",
                       "tf32", "--no-progress") == 2
        assert "needs --device cuda" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_dlrm_v2_shaped_checkpoint_exports_and_matches_float(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert run_cli("bench-checkpoint", "--out", ckpt, "--rows-per-table", "1000") == 0
    cfg = json.loads((ckpt / "model_config.json").read_text())
    assert cfg["model"] == "dlrm_dcn" and len(cfg["tables"]) == 26 and cfg["dense_in_features"] == 13
    assert run_cli("export", "--checkpoint", ckpt, "--repo", tmp_path / "repo", "--name", "v2", "--no-progress") == 0
    check_parity(tmp_path / "repo" / "v2" / "1", ckpt, batch_sizes=(1, 64))


def test_decode_bench_reads_one_request_alike_in_both_protocols(capsys):
    """bench.decode times the same request over both protocols (OIP in both forms): every read gives
    the same batch."""
    from bench import decode
    from recserve.oip import grpc_predict_v2_pb2 as oip
    from serving import ipc

    schema = ipc.Schema(("a", "b", "c"), (50, 60, 70), (4, 4, 4), decode.DENSE, 16, 1 << 20)
    v1, per_feature, packed = decode.requests(schema, batch_size=5, ids_per_bag=3.0)
    with decode.in_shared_memory(packed) as shm:
        steps = decode.steps(schema, v1, per_feature, packed, shm)
        dense_v1, sparse_v1 = steps["recserve.v1 read"]()
        assert sparse_v1.totals.sum() > 0
        for name in ("OIP read", "OIP packed read", "OIP shm read"):
            dense, sparse = steps[name]()
            np.testing.assert_array_equal(dense_v1, dense)
            np.testing.assert_array_equal(sparse_v1.lengths, sparse.lengths)
            values = np.concatenate(sparse.values.parts) if name == "OIP read" else sparse.values
            np.testing.assert_array_equal(np.asarray(sparse_v1.values), values)
        assert oip.ModelInferRequest.FromString(shm[1]).raw_input_contents == []  # the tensors are in the region
    ranking = decode.ranking_request(schema, 5, 3.0, shared_features=2, shared_ids_per_bag=4.0)
    dense, sparse = decode.steps(schema, v1, per_feature, packed, ranking=ranking)["v1 shared read"]()
    assert dense.shape == (5, decode.DENSE) and sparse.keys == ["c"] and sparse.shared_keys == ["a", "b"]
    assert sparse.lengths.shape == (1, 5) and sparse.shared_lengths.sum() == sparse.shared_values.shape[0] > 0
    assert decode.main(["--batch-sizes", "4,8", "--features", "3", "--rows", "50", "--number", "2",
                        "--repeats", "1", "--shared-features", "2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[0], " ".join(r[1:-2] if r[1] == "OIP" else r[1:-1])) for r in rows] == [
        (b, step) for b in ("4", "8") for step in ("recserve.v1 read", "OIP read", "OIP packed read", "OIP shm read",
                                                   "v1 shared read", "recserve.v1 read+write", "OIP read+write",
                                                   "OIP packed read+write", "OIP shm read+write",
                                                   "v1 shared read+write")]


def test_oip_floor_without_its_server_says_so_in_one_line():
    from recserve.local import free_port

    run = subprocess.run([sys.executable, "-m", "bench.floor", "--batch-size", "4", "--model", "demo",
                          "--oip-proxy", f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.stderr.splitlines()) == 1 and "start it (recserve serve)" in run.stderr


def test_transport_probe_times_every_server_setting_and_size(capsys):
    """bench.transport: a row per (server settings, size, round), each call answered."""
    from bench import transport

    assert transport.main(["--sizes", "1000,20000", "--calls", "3", "--rounds", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(" ".join(r[:-5]), int(r[-5])) for r in rows] == [
        (name, size) for size in (1000, 20000) for name in transport.SETTINGS]
    assert all(float(r[-3]) > 0 for r in rows)
    with pytest.raises(SystemExit) as exc:
        transport.main(["--sizes", "big"])
    assert exc.value.code == 2


def _floor_row(artifact, seconds: float, clients: int = 2, batch_size: int = 4):
    """One closed-loop row against the floor (no model, starts in a second)."""
    from bench.clients import RequestShape, closed_loop
    from bench.floor import FloorProcess
    from test_reliability import _info

    floor = FloorProcess(batch_size, 1, "demo", 1)
    try:
        return closed_loop("floor", floor.target, _info(artifact).SerializeToString(), batch_size, clients, seconds,
                           RequestShape(3.0))
    finally:
        assert floor.stop() == 0


def test_closed_loop_row_with_a_window_shorter_than_a_call_times_one_call_per_client(artifact):
    """--duration 1e-9: the window closes before a call could end; each client still times its one
    call (as bare times MIN_CALLS), not a row of no calls whose percentiles are a traceback."""
    row = _floor_row(artifact, 1e-9)
    assert row.calls == 2 and row.concurrency == 2
    assert row.samples_per_s > 0 and 0 < row.p50_ms <= row.p99_ms


@pytest.mark.parametrize("flag", ["--batch-sizes", "--concurrency"])
def test_bench_without_a_batch_size_or_client_count_says_so_in_one_line(repo, capsys, flag):
    """--batch-sizes , was max() of an empty list (a traceback); --concurrency "" started a server and
    measured no served row."""
    assert cli_error(capsys, "bench", "--repo", repo, "--name", "demo", "--device", "cpu", flag, ",") == \
        f"recserve bench: error: {flag} needs at least one value"


@pytest.mark.parametrize("mean", ["-1", "nan", "inf"])
def test_decode_bench_refuses_a_mean_ids_per_bag_that_is_no_count_in_one_line(capsys, mean):
    """It was numpy's 'lam < 0 or lam is NaN' traceback from deep in the request builder."""
    from bench import decode

    with pytest.raises(SystemExit) as exc:
        decode.main(["--batch-sizes", "4", "--ids-per-bag", mean])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        f"python -m bench.decode: error: --ids-per-bag must be >= 0 (a mean number of ids), got {mean}"


@pytest.mark.parametrize("module", ["bench.decode", "bench.floor", "bench.oip_input", "bench.transport",
                                    "bench.json_body", "recserve.demo"])
def test_module_commands_name_themselves_as_they_are_run(module, capsys, monkeypatch):
    """bench.oip_input's and recserve.demo's --help and errors said "usage: oip_input.py" / "demo.py",
    a file name that runs nothing (they need python -m from the source root)."""
    main = __import__(module, fromlist=["main"]).main
    monkeypatch.setattr(sys, "argv", [f"{module.replace('.', '/')}.py", "--bogus"])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[0].startswith(f"usage: python -m {module} ")


def test_json_body_bench_times_a_body_of_the_size_asked_for_as_a_front_end_reads_it(capsys):
    """bench.json_body (README, --max-json-mb): its body is a request jsonwire reads (every input an
    array of its shape), about the size asked for, and it prints one row per size."""
    import json

    from bench import json_body
    from serving.frontend.oip import jsonwire

    raw = json_body.body(0.25)
    assert abs(len(raw) / 2**20 - 0.25) < 0.01
    request = jsonwire.parse_infer(raw, None)
    assert [(t.name, t.datatype) for t in request.inputs] == [("dense", "FP32"), ("lengths", "INT32"), ("ids", "INT64")]
    assert len(json.loads(raw)["inputs"][2]["data"]) == request.inputs[2].shape[0]
    json_body.main(["--mib", "0.2,0.3", "--repeats", "1"])
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:3] == ["body", "MiB", "json.loads"] and [row.split()[0] for row in rows] == ["0.2", "0.3"]


def test_bench_of_an_older_version_does_not_pass_off_the_newest_as_its_served_rows(repo, capsys):
    """--version 1 beside a v2: bare measured v1, the server served v2 (its policy: the newest), and
    the table said 'demo v1' over both with their served/bare ratio."""
    from test_repository import publish

    publish(repo, "demo", 2, repo / "demo" / "1")
    assert cli_error(capsys, "bench", "--repo", repo, "--name", "demo", "--device", "cpu", "--version", "1",
                     "--batch-sizes", "4", "--concurrency", "1", "--duration", "0.05", "--no-floor") == (
        "recserve bench: error: demo v1 is measured bare but the server serves v2 (its version policy): "
        "measure v1 with --no-served, or the served v2 with --version 2")


def test_launches_per_batch_splits_a_batch_only_into_requests_of_a_sample_or_more(artifact):
    """--batch-sizes 8 on CUDA profiled '16 request(s) per batch' of 8 // 16 = 0 samples each: batches
    no server sees (a request has B >= 1)."""
    from bench.bare import launches_per_batch
    from recserve.manifest import load_verified
    from serving.engine.runner import ModelRunner
    from serving.ipc import Schema

    m = load_verified(artifact)
    runner = ModelRunner(artifact, m, Schema.from_manifest(m, 8, max_ids=1 << 20), cuda_graphs=False)
    assert [count for count, _ in launches_per_batch(runner, m, 8, 3.0)] == [1, 4]
    assert [count for count, _ in launches_per_batch(runner, m, 3, 3.0)] == [1]


def test_the_bare_call_runs_in_the_models_dense_math_like_the_server(artifact, monkeypatch):
    """The bare row is the server's model call: for a tf32 artifact the server runs (and captures) it
    with TF32 matmuls on (recserve.manifest.dense_math); the bare call ran it with the process's
    default, full float32 - slower matmuls, and graphs captured with other kernels than served."""
    import dataclasses

    from bench.bare import bench_bare
    from recserve.manifest import load_verified
    from serving.engine.graphs import ModelCall

    m = dataclasses.replace(load_verified(artifact), dense_dtype="tf32")
    seen = []
    call = ModelCall.__call__

    def spy(self, rpc, staged):
        seen.append(torch.backends.cuda.matmul.allow_tf32)
        return call(self, rpc, staged)

    monkeypatch.setattr(ModelCall, "__call__", spy)
    torch.backends.cuda.matmul.allow_tf32 = False
    rows, _ = bench_bare(artifact, m, [4], 0.0, 3.0, cuda_graphs=False)
    assert rows[0].batch_size == 4 and len(seen) >= 20 and set(seen) == {True}
    assert torch.backends.cuda.matmul.allow_tf32 is False  # put back after each call


def test_bench_server_serves_only_the_measured_model(repo, capsys, monkeypatch):
    """The bench's server loaded every model of --repo: its GPU memory (served_gpu_memory_bytes, and
    the ratio to the measured model's bytes) counted the other models' tables too."""
    import bench.served
    from recserve.client import Client
    from test_repository import publish

    publish(repo, "other", 1, repo / "demo" / "1")
    served, memory = [], bench.served.ServerProcess.memory

    def memory_and_models(server):
        with Client(server.target) as client:
            served.append(sorted(m.name for m in client.model_info().models))
        return memory(server)

    monkeypatch.setattr(bench.served.ServerProcess, "memory", memory_and_models)
    assert run_cli("bench", "--repo", repo, "--name", "demo", "--device", "cpu", "--batch-sizes", "4",
                   "--concurrency", "1", "--duration", "0.1", "--no-floor") == 0
    assert served == [["demo"]]


def test_soak_samples_the_engines_resident_memory(monkeypatch):
    """scripts/soak.py read VmRSS of the process it started, the supervisor: the engine, which loads
    and releases a version every minute (the leak a soak looks for), was not measured at all."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("soak", ROOT / "scripts" / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    metrics = "\n".join(f'process_resident_memory_bytes{{process="{process}"}} {mib * 2**20}'
                        for process, mib in [("supervisor", 60), ("engine", 300), ("frontend-0", 40)]) + "\n"
    monkeypatch.setattr(soak, "scrape", lambda port: metrics)
    state = soak.server_state(0)
    assert state["rss_mib"] == 300.0
    assert state["rss_mib_by_process"] == {"supervisor": 60.0, "engine": 300.0, "frontend-0": 40.0}


@pytest.mark.parametrize("flags,message", [
    (["--version", "0"], "--version 0: demo has no such version in REPO (its versions: 1)"),
    (["--version", "7"], "--version 7: demo has no such version in REPO (its versions: 1)"),
    (["--replicas", "0"], "--replicas must be auto or a number >= 1, got '0'"),
    (["--max-delay-ms", "-1"], "--max-delay-ms must be a number of milliseconds >= 0, got -1"),
    (["--shared-features", "nosuch"],
     "--shared-features: unknown features ['nosuch']; the model has ['user_id', 'item_id', 'topics']"),
])
def test_bench_refuses_a_wrong_flag_before_measuring_anything(repo, capsys, monkeypatch, flags, message):
    """--version 0 measured the newest version as if none was given, and --version 7 was 'REPO/demo/7/manifest.json:
    no manifest'; --replicas, --max-delay-ms and --shared-features were refused only once the bare rows had
    been measured and a server started (minutes, for a large model on a GPU)."""
    import bench.bare

    monkeypatch.setattr(bench.bare, "bench_bare", lambda *a, **k: pytest.fail("measured before refusing"))
    line = cli_error(capsys, "bench", "--repo", repo, "--name", "demo", "--device", "cpu", "--batch-sizes", "4",
                     "--concurrency", "1", "--duration", "0.05", *flags)
    assert line == "recserve bench: error: " + message.replace("REPO", str(repo))


@pytest.mark.parametrize("flags,message", [
    (["--users", "0"], "--users must be >= 1, got 0"),
    (["--batch-size", "-1"], "--batch-size must be >= 1, got -1"),
    (["--ids-per-bag", "nan"], "--ids-per-bag must be >= 0 (a mean number of ids), got nan"),
    (["--device", "cuda"], "--device cuda: no CUDA device is visible"),
])
def test_loadtest_refuses_a_wrong_flag_in_one_line(tmp_path, capsys, monkeypatch, flags, message):
    """--users 0 ran for --duration and reported 0 requests as a success, --batch-size 0 sent only requests
    the server refuses; the server's refusal (--device cuda on a machine without a GPU) was a UserError
    traceback."""
    import importlib.util

    from recserve.errors import UserError

    spec = importlib.util.spec_from_file_location("loadtest_run", ROOT / "loadtest" / "run.py")
    loadtest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loadtest)

    class Refusing:
        def __init__(self, *args, **kwargs):
            raise UserError("--device cuda: no CUDA device is visible")

    monkeypatch.setattr(loadtest, "ServerProcess", Refusing)
    (tmp_path / "repo" / "demo").mkdir(parents=True)  # an artifact there: no training first
    assert loadtest.main(["--out", str(tmp_path), *flags]) == 2
    assert capsys.readouterr().err == f"loadtest/run.py: error: {message}\n"


@pytest.mark.parametrize("script,flags,message", [
    ("soak", ["--minutes", "1"], "--minutes must be more than 1 (the memory slopes leave out the first minute), got 1"),
    ("soak", ["--users", "0"], "--users must be >= 1, got 0"),
    ("soak", ["--publish-every", "0"], "--publish-every must be > 0 seconds, got 0"),
    ("fuzz", ["--cases", "0"], "--cases must be >= 1, got 0"),
])
def test_long_run_scripts_refuse_a_wrong_flag_before_starting(script, flags, message, tmp_path, capsys):
    """soak.py --minutes 1 (or less) ran its minute and could end in a TypeError formatting its memory figures
    (no sample after the first minute); fuzz.py --cases 0 trained, exported and started a server before hypothesis's
    InvalidArgument traceback."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{script}_script", ROOT / "scripts" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = ["--out" if script == "soak" else "--work", str(tmp_path / "work")]
    assert module.main([*out, *flags]) == 2
    assert capsys.readouterr().err == f"scripts/{script}.py: error: {message}\n"
    assert not (tmp_path / "work").exists()


def test_bench_refuses_an_artifact_the_server_refuses_in_one_line(repo, capsys):
    """A manifest whose rows are not the artifact's (hand-edited: 5 rows more) passed the bench's
    checksums; its bare call then drew ids past the tables, which the CPU kernel refused with a
    TorchScript traceback (a CUDA kernel reads past the table: no bounds are checked). The bench now
    makes the server's checks of the manifest against model.pt and golden.pt first."""
    path = repo / "demo" / "1" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["features"][0]["rows"] += 5
    path.write_text(json.dumps(manifest))
    rows = manifest["features"][0]["rows"]
    line = cli_error(capsys, "bench", "--repo", repo, "--name", "demo", "--device", "cpu", "--batch-sizes", "4",
                     "--concurrency", "1", "--duration", "0.05", "--no-served")
    assert line == (f"recserve bench: error: manifest field features[0].rows: {rows}, but the table of feature 0 in "
                    f"the artifact has {rows - 5} rows (golden.pt's largest id); the manifest does not describe this "
                    "artifact")


def test_wait_serving_stops_waiting_once_the_server_is_gone():
    """A server that died while it loaded (its engine crashed) was waited for the whole 600 s, silently,
    by `recserve bench`, the demo and the fuzzer."""
    from recserve.local import free_port, wait_serving

    asked = []
    assert wait_serving(f"127.0.0.1:{free_port()}", 600, lambda: asked.append(1) or False) is False
    assert asked == [1]


@pytest.mark.parametrize("device, placements, where", [
    ("cpu", ["hbm"], "tables in host memory,"),  # a CPU artifact's manifest says "hbm" (the default), its rows are host memory
    ("cuda", ["hbm", "uvm_caching"], "tables in hbm/uvm_caching,"),
])
def test_bench_table_says_where_the_tables_live(device, placements, where, capsys):
    from bench.report import print_table
    print_table({"model": "demo", "version": 1, "device": device, "gpu": "x", "ids_per_bag": 10,
                 "date": "2026-01-01", "placements": placements, "rows": []})
    header = capsys.readouterr().out.splitlines()[1]
    assert where in header and header.count("tables in") == 1
