"""The model call (serving/engine/graphs.py): bucketing, and merged batches on CPU; CUDA graph capture,
replay and the eager fallback on a GPU."""
import numpy as np
import pytest
import torch
from conftest import run_cli

import fbgemm_gpu  # noqa: F401
from bench.bare import random_inputs
from recserve.manifest import read_manifest
from serving.engine.graphs import bucket
from serving.engine.runner import ModelRunner
from serving.ipc import ModelKJT, Schema


def test_buckets_pad_by_at_most_a_quarter():
    assert [bucket(n) for n in (1, 4, 5, 7, 8, 9, 256, 257, 4096, 4097, 65536)] == \
        [1, 4, 5, 7, 8, 10, 256, 320, 4096, 5120, 65536]
    for n in range(1, 5000):
        assert n <= bucket(n) <= 1.25 * n + 4
    assert bucket(10, minimum=1024) == 1024


def inputs(manifest, batch_size, seed, device="cpu"):
    dense, values, lengths = random_inputs(manifest, batch_size, ids_per_bag=3.0, seed=seed)
    return dense.to(device), values.to(device), lengths.reshape(len(manifest.features), -1).to(device)


def as_request(dense, values, lengths) -> ModelKJT:
    """(dense, values, lengths [T, B]) as a request in model order, in host memory."""
    lengths = lengths.cpu().numpy()
    ends = np.concatenate(([0], np.cumsum(lengths.sum(axis=1))))
    values = values.cpu().numpy()
    return ModelKJT(lengths.shape[1], [values[ends[t]:ends[t + 1]] for t in range(lengths.shape[0])], list(lengths),
                    dense.cpu().numpy())


def runner_for(path, max_batch_size, device=None):
    m = read_manifest(path)
    return ModelRunner(path, m, Schema.from_manifest(m, max_batch_size, 1 << 30), device), m


def test_batches_of_several_requests_give_each_sample_its_own_ctr(artifact):
    """What the server runs: requests merged by the gather into one call. Each sample's CTR must be
    the one the model gives it called alone, whatever its batch-mates."""
    runner, m = runner_for(artifact, 1024)
    assert runner.forward.disabled_reason == "the model runs on cpu"
    requests = [inputs(m, b, seed) for seed, b in enumerate((300, 1, 29))]
    got = runner.run("Predict", [as_request(*r) for r in requests])
    with torch.inference_mode():
        for (dense, values, lengths), ctr in zip(requests, got):
            want = runner.module(dense, values, lengths.reshape(-1)).numpy()
            assert want.std() > 1e-3 or len(want) == 1
            np.testing.assert_allclose(ctr, want, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def one_group_cuda_artifact(tmp_path_factory):
    """DLRM-v2 shape, small tables: every table in one TBE, the forward is capturable."""
    work = tmp_path_factory.mktemp("graphs")
    assert run_cli("bench-checkpoint", "--out", work / "ckpt", "--rows-per-table", "2000") == 0
    assert run_cli("export", "--checkpoint", work / "ckpt", "--repo", work / "repo", "--name", "v2", "--device",
                   "cuda", "--dense-dtype", "bf16", "--no-progress") == 0
    return work / "repo" / "v2" / "1"


@pytest.mark.gpu
def test_graph_replays_equal_eager_calls_per_bucket(one_group_cuda_artifact):
    runner, m = runner_for(one_group_cuda_artifact, 2048, "cuda:0")
    model = runner.module
    with torch.inference_mode():
        for i, sizes in enumerate(((2048,), (1,), (9,), (300,), (290, 1, 9), (1000,), (9,), (700, 700))):
            requests = [inputs(m, b, seed=10 * i + k, device="cuda:0") for k, b in enumerate(sizes)]
            got = runner.run("Predict", [as_request(*r) for r in requests])
            for (dense, values, lengths), ctr in zip(requests, got):
                want = model(dense, values, lengths.reshape(-1)).cpu().numpy()
                # Padded rows change the GEMMs' shapes, so bf16 kernels may differ in the last bit.
                np.testing.assert_allclose(ctr, want, atol=2e-3, rtol=0)
            pooled = runner.run("Lookup", [as_request(*r) for r in requests])
            for (dense, values, lengths), rows in zip(requests, pooled):
                np.testing.assert_array_equal(rows, model.lookup(values, lengths.reshape(-1)).cpu().numpy())
    assert runner.forward.disabled_reason is None and runner.forward.captured >= 10


@pytest.mark.gpu
def test_capture_failure_falls_back_to_eager_and_device_stays_usable(artifact, checkpoint, tmp_path):
    """The demo model pools one table by MEAN: TorchRec splits its KJT between two TBEs, a host
    synchronisation, which a graph cannot capture."""
    assert run_cli("export", "--checkpoint", checkpoint, "--repo", tmp_path, "--name", "d", "--device", "cuda",
                   "--no-progress") == 0
    runner, m = runner_for(tmp_path / "d" / "1", 512, "cuda:0")
    dense, values, lengths = inputs(m, 100, seed=0, device="cuda:0")
    (got,) = runner.run("Predict", [as_request(dense, values, lengths)])
    with torch.inference_mode():
        want = runner.module(dense, values, lengths.reshape(-1)).cpu().numpy()
    assert runner.forward.disabled_reason and "capture failed" in runner.forward.disabled_reason
    np.testing.assert_array_equal(got, want)
    assert torch.ones(1, device="cuda:0").add(1).item() == 2


@pytest.mark.gpu
def test_warmed_batch_sizes_capture_nothing_on_their_first_request(one_group_cuda_artifact, tmp_path):
    """config.json's warmup_batch_sizes: the version captures those sizes' graphs before it serves."""
    import json
    import shutil

    from servers import InProcessServer

    from recserve.client import Client
    from serving.engine.runner import golden_kjt, repeat_samples

    repo = tmp_path / "repo"
    shutil.copytree(one_group_cuda_artifact, repo / "v2" / "1")
    (repo / "v2" / "config.json").write_text(json.dumps({"warmup_batch_sizes": [64, 1000]}))
    golden = golden_kjt(torch.load(one_group_cuda_artifact / "golden.pt", weights_only=True),
                        len(read_manifest(one_group_cuda_artifact).features))
    keys = [f.name for f in read_manifest(one_group_cuda_artifact).features]
    server = InProcessServer(repo)
    try:
        forward = server.model_version("v2").runners[0].forward
        assert forward.disabled_reason is None
        captured = forward.captured
        with Client(server.target) as client:
            for size, new_graphs in ((64, 0), (1000, 0), (2000, 1)):  # 2000 was not warmed: it captures
                request = repeat_samples(golden, size)
                ctr = client.predict("v2", request.dense, (keys, np.concatenate(request.lengths),
                                                           np.concatenate(request.ids)))
                assert ctr.shape == (size,) and forward.captured == captured + new_graphs, size
                captured = forward.captured
    finally:
        assert server.stop() == 0


def test_the_load_time_check_of_pooling_shared_bags_once_sees_a_wrong_broadcast(artifact, monkeypatch):
    """--shared-pooling once is checked against the expanded form when a version loads. A broadcast
    that adds the shared bag's pooled row twice must be refused: the check shared golden.pt's sample
    0's bag, which is empty (pooled row 0, so twice 0 passed)."""
    import serving.engine.graphs as graphs
    from recserve.manifest import ArtifactError
    from serving.engine.assemble import sample_rows

    m = read_manifest(artifact)
    schema = Schema.from_manifest(m, 64, 1 << 20)
    ModelRunner(artifact, m, schema, shared_pooling="once").check_golden(artifact)  # the right broadcast passes

    def twice(pooled, descriptor, rows, extra_rows, extra_weight):
        own = pooled.index_select(0, sample_rows(rows, descriptor, pooled.shape[0]))
        return torch.where(extra_weight.unsqueeze(1) > 0, own + 2 * pooled.index_select(0, extra_rows), own)

    monkeypatch.setattr(graphs, "broadcast_pooled", twice)
    with pytest.raises(ArtifactError, match="pooling shared bags once differs from expanding them"):
        ModelRunner(artifact, m, schema, shared_pooling="once").check_golden(artifact)


def test_a_failed_capture_releases_the_graphs_captured_before_it(monkeypatch):
    """A capture that fails (out of memory at a new, larger bucket, say) turns graphs off for the model:
    every batch runs eagerly from then on. The graphs captured before it were kept, never replayed
    again, and so was their pool (the largest batch's activations), which the eager calls could then
    not use; the pool gauge went on counting it."""
    from types import SimpleNamespace

    from serving.engine import graphs
    from serving.engine.graphs import Captured, ModelCall

    assembler = SimpleNamespace(schema=SimpleNamespace(feature_names=["a"], dense_features=2), generation=1)
    forward = ModelCall(None, assembler, torch.device("cuda:0"), max_batch_size=1024)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (7, 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [{"segment_pool_id": (7, 0), "total_size": 1 << 30}])

    def capture(self, shape):
        if shape.rows > 256:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return Captured(SimpleNamespace(replay=lambda: None), torch.zeros(shape.rows))

    monkeypatch.setattr(ModelCall, "_capture", capture)
    small, large = (graphs.Shape("Predict", False, True, b, 1024, b) for b in (256, 1024))
    assert forward._graph_for(small) is not None and forward.captured == 1 and forward.pool_bytes() == 1 << 30
    assert forward._graph_for(large) is None
    assert forward.disabled_reason.startswith("capture failed: CUDA out of memory")
    assert (forward.captured, forward.pool_bytes()) == (0, 0)


def test_an_assert_in_torchscript_failing_in_a_capture_falls_back_to_eager_like_any_capture_failure(monkeypatch):
    """A ``raise`` or ``assert`` in model.pt's TorchScript (FBGEMM's and torchrec's code has many) fails
    as torch.jit.Error, which is no RuntimeError: failing in a capture's warm-up (on the bucket's padded
    shapes), it escaped the eager fallback and failed its batch, and every later batch of that bucket
    tried the capture again and failed the same way."""
    from types import SimpleNamespace

    from serving.engine import graphs
    from serving.engine.graphs import ModelCall

    assembler = SimpleNamespace(schema=SimpleNamespace(feature_names=["a"], dense_features=2), generation=1)
    forward = ModelCall(None, assembler, torch.device("cuda:0"), max_batch_size=1024)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (7, 0))
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))

    def capture(self, shape):
        raise torch.jit.Error("The following operation failed in the TorchScript interpreter.\n"
                              "RuntimeError: AssertionError: offsets and lengths disagree")

    monkeypatch.setattr(ModelCall, "_capture", capture)
    assert not issubclass(torch.jit.Error, RuntimeError)
    assert forward._graph_for(graphs.Shape("Predict", False, True, 256, 1024, 256)) is None
    assert forward.disabled_reason == "capture failed: The following operation failed in the TorchScript interpreter."
    assert (forward.captured, forward.graphed, synchronized) == (0, False, [torch.device("cuda:0")])


def test_batches_with_shared_bags_pooled_once_replay_cuda_graphs_as_serve_help_says():
    """`serve --help` said that --shared-pooling once runs without CUDA graphs: an operator weighing it
    against expand expected a graph launch lost per batch. A batch with bags pooled once has a graph
    shape of its own (Shape.once) and is captured and replayed like any other."""
    import argparse
    from types import SimpleNamespace

    from recserve.cli import build_parser
    from serving.engine.graphs import ModelCall, Shape

    assembler = SimpleNamespace(schema=SimpleNamespace(feature_names=["a"], dense_features=2), generation=1)
    forward = ModelCall(None, assembler, torch.device("cuda:0"), max_batch_size=1024)
    staged = SimpleNamespace(once=True, repeats=False, columns=65, ids=2000, rows=64, requests=1)
    assert forward._shape("Predict", staged) == Shape("Predict", True, False, 80, 2048, 64)
    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    text = " ".join(next(a for a in serve._actions if "--shared-pooling" in a.option_strings).help.split())
    assert "without CUDA graphs" not in text and "CUDA graphs as expand" in text, text
