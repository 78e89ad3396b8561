"""In-process server tests: a real grpc.aio server on a loopback port, a real client."""
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
from conftest import ROOT, cli_error, run_cli
from reference import errors, golden_request, reference_outputs, write_checkpoint
from servers import InProcessServer

import fbgemm_gpu  # noqa: F401
from recserve import wire
from recserve.client import Client, encode_sparse, ranking_request, repeat_shared
from recserve.manifest import read_manifest
from recserve.v1 import inference_pb2 as pb

from serving.frontend.validate import check_sparse, model_kjt


@pytest.fixture(scope="module")
def repo(tmp_path_factory, artifact):
    repo = tmp_path_factory.mktemp("served")
    shutil.copytree(artifact, repo / "demo" / "1")
    return repo


@pytest.fixture(scope="module")
def server(repo):
    s = InProcessServer(repo, max_batch_size=512, max_delay_ms=20, max_queue=64)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target) as c:
        yield c


def kjt_request(manifest, batch_size, seed):
    from export.verify import sample_batch

    b = sample_batch([(f.name, f.rows) for f in manifest.features], manifest.dense_features, batch_size, seed=seed)
    return b.dense, (manifest.feature_names, b.lengths.numpy(), b.values.numpy()), b


def direct(artifact, b):
    model = torch.jit.load(str(artifact / "model.pt"))
    with torch.no_grad():
        return model(b.dense, b.values, b.lengths).numpy(), model.lookup(b.values, b.lengths).numpy()


@pytest.mark.parametrize("batch_size", [1, 7, 256])
def test_served_values_equal_artifact_and_match_float(batch_size, client, artifact, checkpoint):
    m = read_manifest(artifact)
    dense, sparse, b = kjt_request(m, batch_size, seed=batch_size)
    ctr = client.predict("demo", dense.numpy(), sparse)
    keys, dims, pooled = client.lookup("demo", sparse)
    want_ctr, want_pooled = direct(artifact, b)
    np.testing.assert_array_equal(ctr, want_ctr)
    np.testing.assert_array_equal(pooled, want_pooled)
    assert keys == m.feature_names and dims == [f.dim for f in m.features]
    ref_ctr, ref_pooled = reference_outputs(checkpoint, b.dense, b.values, b.lengths)
    ctr_err, pooled_err = errors(torch.from_numpy(ctr), torch.from_numpy(pooled), ref_ctr, ref_pooled)
    assert ctr_err < 1e-2
    if batch_size > 1:
        assert pooled_err < 1e-2 and np.abs(pooled).sum() > 0


def test_lookup_keys_in_request_order_and_missing_features_empty(client, artifact):
    m = read_manifest(artifact)
    bags = {"item_id": [[1, 2, 4999], [7]], "user_id": [[3], []]}
    keys, dims, pooled = client.lookup("demo", bags)
    assert keys == ["item_id", "user_id"] and pooled.shape == (2, 32)
    # The same bags in model order, with the missing feature as empty bags, through the artifact.
    model = torch.jit.load(str(artifact / "model.pt"))
    lengths = torch.tensor([1, 0, 3, 1, 0, 0], dtype=torch.int32)  # user_id, item_id, topics
    values = torch.tensor([3, 1, 2, 4999, 7])
    full = model.lookup(values, lengths).detach().numpy()
    np.testing.assert_array_equal(pooled[:, :16], full[:, 16:32])
    np.testing.assert_array_equal(pooled[:, 16:], full[:, 0:16])
    assert np.all(pooled[1, 16:] == 0)
    # Predict with a feature left out equals predict with its bags empty.
    dense = np.random.default_rng(0).standard_normal((2, m.dense_features)).astype(np.float32)
    with_empty = {**bags, "topics": [[], []]}
    np.testing.assert_array_equal(client.predict("demo", dense, bags), client.predict("demo", dense, with_empty))


def test_concurrent_requests_are_merged_and_each_gets_its_own_rows(server, client, artifact):
    m = read_manifest(artifact)
    requests = [kjt_request(m, bs, seed=1000 + i) for i, bs in enumerate([1, 3, 8, 2, 16, 5, 1, 9] * 3)]
    before_count = server.metric("recserve_batch_size_count", rpc="Predict", model="demo")
    before_sum = server.metric("recserve_batch_size_sum", rpc="Predict", model="demo")
    barrier = threading.Barrier(len(requests))

    def send(req):
        dense, sparse, _ = req
        barrier.wait()
        return client.predict("demo", dense.numpy(), sparse)

    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(send, requests))
    for (dense, sparse, b), ctr in zip(requests, results):
        np.testing.assert_allclose(ctr, direct(artifact, b)[0], rtol=0, atol=1e-6)
    calls = server.metric("recserve_batch_size_count", rpc="Predict", model="demo") - before_count
    samples = server.metric("recserve_batch_size_sum", rpc="Predict", model="demo") - before_sum
    assert samples == sum(r[2].batch_size for r in requests)
    assert calls < len(requests)  # merged: fewer model calls than requests


@pytest.fixture(scope="module")
def once_client(repo):
    """A server that pools each shared bag once per request (serve --shared-pooling once)."""
    s = InProcessServer(repo, settings={"shared_pooling": "once"}, max_batch_size=512, max_delay_ms=20, max_queue=64)
    with Client(s.target) as c:
        yield c
    s.stop()


@pytest.mark.parametrize("pooling", ["expand", "once"])
@pytest.mark.parametrize("batch_size", [1, 5, 64])
def test_shared_features_answer_bitwise_like_their_bags_sent_per_sample(batch_size, pooling, request):
    client = request.getfixturevalue("client" if pooling == "expand" else "once_client")
    info = client.model_info("demo").models[0]
    dense, sparse, shared = ranking_request(info, batch_size, ["user_id", "topics"], mean_ids=2.0,
                                            shared_mean_ids=6.0, seed=batch_size)
    repeated = repeat_shared(sparse, shared, batch_size)
    ctr = client.predict("demo", dense, sparse, shared=shared)
    np.testing.assert_array_equal(ctr, client.predict("demo", dense, repeated))
    keys, dims, pooled = client.lookup("demo", sparse, shared=shared)
    want_keys, want_dims, want_pooled = client.lookup("demo", repeated)
    assert keys == want_keys == ["item_id", "user_id", "topics"] and dims == want_dims
    np.testing.assert_array_equal(pooled, want_pooled)
    shared_columns = pooled[:, dims[0]:]
    assert np.abs(shared_columns).sum() > 0 and (shared_columns == shared_columns[0]).all()


@pytest.mark.parametrize("pooling", ["expand", "once"])
def test_merged_requests_keep_their_shared_bags_apart(pooling, server, client, once_client):
    info = client.model_info("demo").models[0]
    # Mixed: some requests share user_id, some topics and user_id, some send everything per sample.
    requests = [ranking_request(info, 1 + i % 5, [["user_id"], ["user_id", "topics"], []][i % 3], shared_mean_ids=3.0,
                                seed=300 + i) for i in range(16)]
    sender = client if pooling == "expand" else once_client
    before = server.metric("recserve_batch_size_count", rpc="Predict", model="demo")
    barrier = threading.Barrier(len(requests))

    def send(req):
        dense, sparse, shared = req
        barrier.wait()
        return sender.predict("demo", dense, sparse, shared=shared)

    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(send, requests))
    if pooling == "expand":
        calls = server.metric("recserve_batch_size_count", rpc="Predict", model="demo") - before
        assert calls < len(requests)  # merged
    for (dense, sparse, shared), ctr in zip(requests, results):
        alone = client.predict("demo", dense, repeat_shared(sparse, shared, dense.shape[0]))
        np.testing.assert_allclose(ctr, alone, rtol=0, atol=1e-6)  # merged batches may round the last bit


def test_lookup_of_shared_bags_only_has_one_sample(client):
    keys, dims, pooled = client.lookup("demo", {}, shared={"item_id": [1, 2, 4999]})
    _, _, want = client.lookup("demo", {"item_id": [[1, 2, 4999]]})
    assert keys == ["item_id"] and pooled.shape == (1, dims[0])
    np.testing.assert_array_equal(pooled, want)


def test_predict_cli_sends_shared_bags_from_its_json_input(server, client, tmp_path, capsys):
    dense = np.random.default_rng(4).standard_normal((3, 8)).astype(np.float32)
    payload = {"dense": dense.tolist(), "sparse": {"item_id": [[1, 2], [5], []]}, "shared": {"user_id": [3, 9]}}
    (tmp_path / "in.json").write_text(json.dumps(payload))
    assert run_cli("predict", "--target", server.target, "--model", "demo", "--input", tmp_path / "in.json") == 0
    printed = [float(line.split("\t")[1]) for line in capsys.readouterr().out.splitlines()]
    want = client.predict("demo", dense, {"item_id": [[1, 2], [5], []], "user_id": [[3, 9]] * 3})
    np.testing.assert_allclose(printed, want, atol=1e-6, rtol=0)  # printed with 6 decimals


def test_predict_random_shares_all_features_by_count_as_by_name(server, capsys):
    """--shared-features 3 (every feature of the model) was refused ("at least one must stay
    per-sample") while the same features by name were sent and served."""
    answers = []
    for spec in ("3", "user_id,item_id,topics"):
        assert run_cli("predict", "--target", server.target, "--model", "demo", "--random", "4",
                       "--shared-features", spec) == 0
        answers.append([line.split("\t")[0] for line in capsys.readouterr().out.splitlines()])
    assert answers == [["0", "1", "2", "3"]] * 2
    line = cli_error(capsys, "predict", "--target", server.target, "--model", "demo", "--random", "4",
                     "--shared-features", "4")
    assert line == "recserve predict: error: --shared-features 4: the model has 3 features"


def test_predict_random_beyond_the_models_batch_size_is_one_line_before_building_it(server, capsys):
    """recserve predict --random N built N random samples before the server could say that it takes at
    most max_batch_size: a mistyped N was a numpy MemoryError traceback (or, for one that fits in
    virtual memory, a client filling the machine's memory) instead of the one line of a user error."""
    line = cli_error(capsys, "predict", "--target", server.target, "--model", "demo", "--random", str(10**12))
    assert line == ("recserve predict: error: --random 1000000000000: the server's max batch size for model "
                    "'demo' is 512 samples per request; ask for at most that many")

def bad_requests(m):
    good_dense = np.zeros((2, m.dense_features), np.float32)
    good = encode_sparse({"user_id": [[1], [2]], "item_id": [[3], []]})

    def predict(dense=None, sparse=None, **kw):
        return pb.PredictRequest(model_name=kw.get("model", "demo"), model_version=kw.get("version", 0),
                                 dense=dense if dense is not None else wire.encode(good_dense),
                                 sparse=sparse if sparse is not None else good)

    def sparse(keys, lengths, values, ldt="int32", vdt="int64"):
        return pb.SparseFeatures(keys=keys, lengths=wire.encode(np.array(lengths, ldt)),
                                 values=wire.encode(np.array(values, vdt)))

    def shared(keys, lengths, values):
        message = pb.SparseFeatures()
        message.CopyFrom(good)
        message.shared_keys.extend(keys)
        message.shared_lengths.CopyFrom(wire.encode(np.array(lengths, np.int32)))
        message.shared_values.CopyFrom(wire.encode(np.array(values, np.int64)))
        return message

    return {
        "dense dtype": (predict(dense=wire.encode(good_dense.astype(np.float64))), "dense: dtype"),
        "dense shape": (predict(dense=wire.encode(np.zeros((2, 3), np.float32))), "dense: expected 8 features"),
        "dense rank": (predict(dense=wire.encode(np.zeros(16, np.float32))), "dense: expected 2 dimension"),
        "byte count": (predict(dense=pb.Tensor(dtype="float32", shape=[2, 8], data=b"\0" * 60)), "needs 64 bytes"),
        "dense nan": (predict(dense=wire.encode(np.full((2, 8), np.nan, np.float32))), "non-finite"),
        "dense inf": (predict(dense=wire.encode(np.full((2, 8), np.inf, np.float32))), "non-finite"),
        "negative length": (predict(sparse=sparse(["user_id"], [-1, 2], [1])), "negative length"),
        "lengths sum": (predict(sparse=sparse(["user_id"], [1, 1], [1, 2, 3])), "sum to 2"),
        "lengths count": (predict(sparse=sparse(["user_id"], [1, 1, 1], [1, 2, 3])), "dense has 2 samples"),
        "id too big": (predict(sparse=sparse(["item_id"], [1, 1], [4, 5000])), "id 5000 of feature 'item_id'"),
        "id negative": (predict(sparse=sparse(["user_id"], [1, 0], [-3])), "id -3 of feature 'user_id'"),
        "values dtype": (predict(sparse=sparse(["user_id"], [1, 0], [1], vdt="float32")), "sparse.values: dtype"),
        "unknown key": (predict(sparse=sparse(["nope"], [1, 0], [1])), "unknown feature 'nope'"),
        "repeated key": (predict(sparse=sparse(["user_id", "user_id"], [1, 0, 1, 0], [1, 2])), "more than once"),
        "batch too big": (predict(dense=wire.encode(np.zeros((513, 8), np.float32)),
                                  sparse=sparse([], [], [])), "exceeds the server's max batch size 512"),
        "empty batch": (predict(dense=wire.encode(np.zeros((0, 8), np.float32)), sparse=sparse([], [], [])),
                        "batch size must be >= 1"),
        "shared id too big": (predict(sparse=shared(["topics"], [2], [4, 300])),
                              "sparse.shared_values: id 300 of feature 'topics'"),
        "shared and per-sample": (predict(sparse=shared(["user_id"], [1], [4])), "feature 'user_id' appears more"),
        "shared lengths count": (predict(sparse=shared(["topics"], [1, 0], [4])), "2 entries for 1 shared keys"),
        "shared lengths sum": (predict(sparse=shared(["topics"], [1], [4, 5])), "sum to 1 but sparse.shared_values"),
        "unknown model": (predict(model="nope"), "not loaded"),
        "unknown version": (predict(version=99), "version 99 is not loaded"),
    }


CODES = {"unknown model": grpc.StatusCode.NOT_FOUND, "unknown version": grpc.StatusCode.NOT_FOUND}


@pytest.mark.parametrize("case", sorted(bad_requests(type("M", (), {"dense_features": 8})())))
def test_bad_request_gets_exact_code_and_server_keeps_serving(case, client, artifact):
    m = read_manifest(artifact)
    request, message = bad_requests(m)[case]
    dense, sparse, _ = kjt_request(m, 4, seed=7)
    before = client.predict("demo", dense.numpy(), sparse)
    with pytest.raises(grpc.RpcError) as exc:
        client.stub.Predict(request, timeout=10)
    assert exc.value.code() == CODES.get(case, grpc.StatusCode.INVALID_ARGUMENT)
    assert message in exc.value.details()
    np.testing.assert_array_equal(client.predict("demo", dense.numpy(), sparse), before)


def test_bad_requests_never_affect_batch_mates(client, artifact):
    m = read_manifest(artifact)
    goods = [kjt_request(m, 3, seed=50 + i) for i in range(12)]
    bads = list(bad_requests(m).values())[:12]
    barrier = threading.Barrier(len(goods) + len(bads))

    def good(req):
        barrier.wait()
        return client.predict("demo", req[0].numpy(), req[1])

    def bad(item):
        barrier.wait()
        try:
            client.stub.Predict(item[0], timeout=10)
        except grpc.RpcError as e:
            return e.code()

    with ThreadPoolExecutor(len(goods) + len(bads)) as pool:
        good_futures = [pool.submit(good, g) for g in goods]
        bad_futures = [pool.submit(bad, b) for b in bads]
    for g, f in zip(goods, good_futures):
        np.testing.assert_allclose(f.result(), direct(artifact, g[2])[0], atol=1e-6, rtol=0)
    assert [f.result() for f in bad_futures] == [CODES.get(case, grpc.StatusCode.INVALID_ARGUMENT)
                                                 for case in list(bad_requests(m))[:12]]


def test_get_model_info_reports_schema_and_versions(client, artifact):
    info = client.model_info("demo").models[0]
    m = read_manifest(artifact)
    assert [f.name for f in info.features] == m.feature_names
    assert [f.rows for f in info.features] == [f.rows for f in m.features]
    assert info.dense_features == 8 and info.max_batch_size == 512
    assert [(v.version, v.state, v.device) for v in info.versions] == [(1, "READY", "cpu")]
    with pytest.raises(grpc.RpcError) as exc:
        client.model_info("nope")
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND


def test_metrics_exposed_and_moving(server, client, artifact):
    m = read_manifest(artifact)
    dense, sparse, _ = kjt_request(m, 2, seed=3)
    before = server.metric("recserve_requests_total", rpc="Predict", model="demo", code="OK")
    client.predict("demo", dense.numpy(), sparse)
    text = server.scrape()
    after = server.metric("recserve_requests_total", rpc="Predict", model="demo", code="OK")
    assert after == before + 1
    for name in ("recserve_requests_total", "recserve_queue_seconds_bucket", "recserve_compute_seconds_bucket",
                 "recserve_request_seconds_bucket", "recserve_batch_size_bucket", "recserve_queue_depth",
                 "recserve_model_version_loaded"):
        assert name in text, name
    # A bad model name is counted without becoming a label value.
    with pytest.raises(grpc.RpcError):
        client.predict("no-such-model", dense.numpy(), sparse)
    assert 'model="no-such-model"' not in server.scrape()



ONE_FEATURE = {"model": "dlrm", "tables": [{"name": "t", "num_embeddings": 2, "embedding_dim": 4, "feature_names": ["f"],
                                           "pooling": "SUM"}],
               "dense_in_features": 2, "dense_arch_layer_sizes": [4], "over_arch_layer_sizes": [4, 1]}


def test_a_model_of_one_feature_serves_and_matches_float(tmp_path):
    """A legal model with a single sparse feature (a 2-row table: ids 0 and its last row) exports,
    loads and answers as the float model."""
    checkpoint = write_checkpoint(tmp_path / "ckpt", ONE_FEATURE)
    assert run_cli("export", "--checkpoint", checkpoint, "--repo", tmp_path / "repo", "--name", "one",
                   "--no-progress") == 0
    server = InProcessServer(tmp_path / "repo", max_batch_size=16, max_delay_ms=1)
    try:
        assert server.repo.models["one"].version == 1
        with Client(server.target) as client:
            dense = np.array([[0.5, -1.0], [2.0, 0.25], [0.0, 1.0]], np.float32)
            bags = {"f": [[0], [1, 1, 0], []]}
            ctr = client.predict("one", dense, bags)
            keys, dims, pooled = client.lookup("one", bags)
        values, lengths = torch.tensor([0, 1, 1, 0]), torch.tensor([1, 3, 0], dtype=torch.int32)
        ref_ctr, ref_pooled = reference_outputs(checkpoint, torch.from_numpy(dense), values, lengths)
        assert keys == ["f"] and dims == [4] and pooled.shape == (3, 4) and not pooled[2].any()
        ctr_err, pooled_err = errors(torch.from_numpy(ctr), torch.from_numpy(pooled), ref_ctr, ref_pooled)
        assert ctr_err < 1e-2 and pooled_err < 1e-2
    finally:
        server.stop()

@pytest.mark.gpu
def test_served_on_cuda_matches_artifact_and_float(tmp_path, checkpoint):
    assert run_cli("export", "--checkpoint", checkpoint, "--repo", tmp_path, "--name", "g", "--device", "cuda",
                   "--no-progress") == 0
    artifact = tmp_path / "g" / "1"
    server = InProcessServer(tmp_path, max_batch_size=1024, max_delay_ms=2)
    try:
        assert server.repo.device == "cuda"
        m = read_manifest(artifact)
        assert m.dense_dtype == "bf16"  # the default on cuda
        model = torch.jit.load(str(artifact / "model.pt"), map_location="cuda:0")
        with Client(server.target) as client:
            for bs in (1, 7, 256, 1024):
                dense, sparse, b = kjt_request(m, bs, seed=bs)
                ctr = client.predict("g", dense.numpy(), sparse)
                _, _, pooled = client.lookup("g", sparse)
                with torch.no_grad():
                    want_ctr = model(b.dense.cuda(), b.values.cuda(), b.lengths.cuda()).cpu().numpy()
                    want_pooled = model.lookup(b.values.cuda(), b.lengths.cuda()).cpu().numpy()
                np.testing.assert_allclose(ctr, want_ctr, atol=1e-6, rtol=0)
                np.testing.assert_allclose(pooled, want_pooled, atol=1e-6, rtol=0)
                ref_ctr, ref_pooled = reference_outputs(checkpoint, b.dense, b.values, b.lengths)
                ctr_err, pooled_err = errors(torch.from_numpy(ctr), torch.from_numpy(pooled), ref_ctr, ref_pooled)
                assert ctr_err < 1e-2 and (bs == 1 or pooled_err < 1e-2)
            info = client.model_info("g").models[0]
            assert info.versions[0].device == "cuda:0"
            # After its last work the engine polls for IDLE_POLL_S (2 ms), then sleeps: an idle server
            # runs no round of its loop (each polling round adds its time to this counter).
            time.sleep(0.2)
            polled = server.metric("recserve_engine_poll_seconds_total")
            assert polled > 0
            time.sleep(0.5)
            assert server.metric("recserve_engine_poll_seconds_total") == polled
            # Shared bags, expanded on the device, answer bitwise as the same bags sent per sample.
            for bs in (1, 9, 512):
                dense, sparse, shared = ranking_request(info, bs, ["user_id", "topics"], shared_mean_ids=20.0, seed=bs)
                repeated = repeat_shared(sparse, shared, bs)
                np.testing.assert_array_equal(client.predict("g", dense, sparse, shared=shared),
                                              client.predict("g", dense, repeated))
                np.testing.assert_array_equal(client.lookup("g", sparse, shared=shared)[2],
                                              client.lookup("g", repeated)[2])
    finally:
        server.stop()
    # Pooled once (eager, no CUDA graph): pooled rows bitwise, CTRs within the dense part's rounding.
    server = InProcessServer(tmp_path, settings={"shared_pooling": "once"}, max_batch_size=1024, max_delay_ms=2)
    try:
        with Client(server.target) as client:
            for bs in (1, 9, 512):
                dense, sparse, shared = ranking_request(info, bs, ["user_id", "topics"], shared_mean_ids=20.0, seed=bs)
                repeated = repeat_shared(sparse, shared, bs)
                np.testing.assert_allclose(client.predict("g", dense, sparse, shared=shared),
                                           client.predict("g", dense, repeated), atol=2e-3, rtol=0)
                np.testing.assert_array_equal(client.lookup("g", sparse, shared=shared)[2],
                                              client.lookup("g", repeated)[2])
    finally:
        server.stop()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_models_of_different_precision_each_answer_as_their_golden_outputs(device, checkpoint, tmp_path):
    """TF32 is a process-wide switch: each model's own setting must hold for its own calls, whichever
    model loaded last."""
    fast = "tf32" if device == "cuda" else "bf16"  # CPUs have no TF32
    for name, dtype in (("exact", "fp32"), ("fast", fast)):
        assert run_cli("export", "--checkpoint", checkpoint, "--repo", tmp_path, "--name", name, "--device", device,
                       "--dense-dtype", dtype, "--no-progress") == 0
    goldens = {name: golden_request(tmp_path / name / "1") for name in ("exact", "fast")}
    # Not a trivial pass: the same inputs, and answers further apart than the tolerance below, so a
    # model computed in the other's precision fails.
    (exact_inputs, exact_ctr), (fast_inputs, fast_ctr) = goldens["exact"], goldens["fast"]
    assert all(np.array_equal(a, b) for a, b in zip([exact_inputs[0], *exact_inputs[1][1:]],
                                                     [fast_inputs[0], *fast_inputs[1][1:]]))
    assert np.abs(exact_ctr - fast_ctr).max() > 1e-4
    server = InProcessServer(tmp_path, max_batch_size=512)
    try:
        assert sorted(server.repo.models) == ["exact", "fast"]
        with Client(server.target) as client:
            for name in ("exact", "fast", "exact"):  # after both loaded, alternating
                (dense, sparse), ctr = goldens[name]
                np.testing.assert_allclose(client.predict(name, dense, sparse), ctr, atol=1e-5, rtol=0)
    finally:
        server.stop()


def test_each_model_call_runs_under_its_own_tf32_switch(artifact):
    """The CPU side of the test above: TF32 changes no CPU math, but the process-wide switch is
    readable here. Each model's calls see its own setting, whichever model ran last, and the switch
    is given back after each call. (On CUDA the test above sees the math itself.)"""
    from serving.engine.runner import ModelRunner
    from serving.ipc import Schema

    seen = {"fp32": [], "tf32": []}
    runners = {}
    for dtype in seen:
        manifest = read_manifest(artifact)
        manifest.dense_dtype = dtype
        runner = runners[dtype] = ModelRunner(artifact, manifest, Schema.from_manifest(manifest, 64, 100_000))
        compute = runner.forward._compute  # the model call itself (eager on CPU)

        def recorded(*args, compute=compute, calls=seen[dtype]):
            calls.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
            return compute(*args)

        runner.forward._compute = recorded
    (dense, (keys, lengths, values)), ctr = golden_request(artifact)
    sparse = check_sparse(keys, lengths, values, runners["fp32"].schema, dense.shape[0])
    request = model_kjt(sparse, dense, runners["fp32"].schema)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for switch in (True, False):  # whatever the process had set before
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = switch
            for dtype in ("tf32", "fp32", "tf32"):
                (got,) = runners[dtype].run("Predict", [request])
                np.testing.assert_allclose(got, ctr, atol=1e-5, rtol=0)
                assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (switch, switch)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    assert seen == {"fp32": [(False, False)] * 2, "tf32": [(True, True)] * 4}


def test_batch_size_counts_only_samples_that_ran_and_were_answered(server, client, artifact):
    """A request whose ids the front end refuses is in no batch: alone, the batch sizes do not move;
    sent together with good requests, only theirs are counted."""
    m = read_manifest(artifact)
    rows = {f.name: f.rows for f in m.features}
    good = [kjt_request(m, bs, seed=2000 + bs) for bs in (3, 5, 7)]
    bad_dense = np.zeros((4, m.dense_features), np.float32)
    bad = {"user_id": [[0], [1], [rows["user_id"]], [2]]}  # one id past the table's end

    def batch_figures():
        return (server.metric("recserve_batch_size_count", rpc="Predict", model="demo"),
                server.metric("recserve_batch_size_sum", rpc="Predict", model="demo"))

    before = batch_figures()
    with pytest.raises(grpc.RpcError) as exc:
        client.predict("demo", bad_dense, bad)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert batch_figures() == before
    barrier = threading.Barrier(2 * len(good))

    def send(i):
        barrier.wait()
        if i % 2:
            with pytest.raises(grpc.RpcError) as e:
                client.predict("demo", bad_dense, bad)
            return e.value.code()
        dense, sparse, _ = good[i // 2]
        return client.predict("demo", dense.numpy(), sparse).shape[0]

    with ThreadPoolExecutor(2 * len(good)) as pool:
        outcomes = list(pool.map(send, range(2 * len(good))))
    assert outcomes == [3, grpc.StatusCode.INVALID_ARGUMENT, 5, grpc.StatusCode.INVALID_ARGUMENT,
                        7, grpc.StatusCode.INVALID_ARGUMENT]
    assert batch_figures()[1] - before[1] == 3 + 5 + 7


def test_request_metrics_carry_the_version_that_answered_and_one_no_model_value(server, client, artifact):
    m = read_manifest(artifact)
    dense, sparse, _ = kjt_request(m, 2, seed=4)

    def count(**labels):
        return server.metric("recserve_requests_total", rpc="Predict", **labels)

    ok, unknown = count(model="demo", version="1", code="OK"), count(model="-", version="-", code="NOT_FOUND")
    seconds = server.metric("recserve_request_seconds_count", rpc="Predict", model="demo", version="1")
    client.predict("demo", dense.numpy(), sparse)
    with pytest.raises(grpc.RpcError):
        client.predict("no-such-model", dense.numpy(), sparse)
    with pytest.raises(grpc.RpcError):
        client.predict("demo", dense.numpy(), sparse, version=9)  # not loaded: no version answered
    assert count(model="demo", version="1", code="OK") == ok + 1
    assert server.metric("recserve_request_seconds_count", rpc="Predict", model="demo", version="1") == seconds + 1
    assert count(model="-", version="-", code="NOT_FOUND") == unknown + 2


def test_readme_client_snippet_runs_against_the_server(server, capsys):
    """The first Python block of README's Client section, as a user would paste it."""
    import re

    from conftest import ROOT

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Client"):]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "127.0.0.1:50051" in snippet
    capsys.readouterr()
    exec(compile(snippet.replace("127.0.0.1:50051", server.target), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "['item_id'] [16] (2, 16)" in printed


def test_client_answers_are_read_only_views_and_say_so(client):
    """ctr and pooled view the answer's bytes (no copy of B x columns floats): `pooled /= norms` raised
    "output array is read-only" where neither the docstrings nor the README said so."""
    ctr = client.predict("demo", np.zeros((2, 8), np.float32), {"item_id": [[1, 2], [5]]})
    pooled = client.lookup("demo", {"item_id": [[1, 2], [5]]})[2]
    assert (ctr.flags.writeable, pooled.flags.writeable, np.array(pooled).flags.writeable) == (False, False, True)
    readme = (ROOT / "README.md").read_text()
    assert ["read-only" in text for text in (Client.predict.__doc__, Client.lookup.__doc__, readme)] == [True] * 3


def test_serve_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        run_cli("serve", "--help")
    text = " ".join(capsys.readouterr().out.split("options:", 1)[1].split())
    for flag, default in (("--host HOST", "127.0.0.1"), ("--port PORT", "50051"), ("--max-batch-size", "4096"),
                          ("--max-delay-ms", "0.0"), ("--frontends", "0"), ("--trace-sample-ratio", "1.0")):
        assert flag in text and f"(default: {default})" in text.split(flag, 1)[1].split(" --", 1)[0], flag


def test_options_given_to_the_client_win_over_its_own(server):
    """gRPC takes the first value of a channel option given twice: the client's own limits came first,
    so a caller could neither lower nor raise them (a server with --max-message-mb 512 could not be sent
    more than 256 MiB)."""
    dense = np.zeros((64, 8), np.float32)  # 2 KiB of dense alone
    with Client(server.target, options=[("grpc.max_send_message_length", 1000)]) as small, \
            pytest.raises(grpc.RpcError) as exc:
        small.predict("demo", dense, {})
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert exc.value.details().startswith("CLIENT: Sent message larger than max (") and \
        exc.value.details().endswith(" vs. 1000)"), exc.value.details()



def test_several_servers_a_large_request_refused_unavailable_is_retried_on_another(server, client):
    """README: a call refused with UNAVAILABLE (queue full, shutting down) is retried on another server.
    gRPC retries only a call whose request it still holds, 256 KiB by default: a larger request, one of
    B=4096 samples, failed UNAVAILABLE each time it met the refusing server."""
    from concurrent import futures

    refused = []

    def refuse(request, context):
        refused.append(len(request))
        context.abort(grpc.StatusCode.UNAVAILABLE, "queue full")

    busy = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.max_receive_message_length", -1)])
    busy.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "recserve.v1.Inference", {"Predict": grpc.unary_unary_rpc_method_handler(refuse)}),))
    port = busy.add_insecure_port("127.0.0.1:0")
    busy.start()
    dense, sparse = np.zeros((1, 8), np.float32), (["item_id"], [40_000], np.arange(40_000, dtype=np.int64) % 5000)
    want = client.predict("demo", dense, sparse)
    try:
        with Client([server.target, f"127.0.0.1:{port}"]) as spread:
            deadline = time.monotonic() + 20
            while len(refused) < 3 and time.monotonic() < deadline:
                np.testing.assert_array_equal(spread.predict("demo", dense, sparse), want)
    finally:
        busy.stop(0)
    assert len(refused) >= 3 and min(refused) > 256 << 10, refused
