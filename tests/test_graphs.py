"""The model call (serving/engine/graphs.py): bucketing and padding on CPU; CUDA graph capture, replay and
the eager fallback on a GPU."""
import numpy as np
import pytest
import torch
from conftest import run_cli

import fbgemm_gpu  # noqa: F401
from bench.bare import random_inputs
from recserve.manifest import read_manifest
from serving.engine.graphs import GraphedForward, InputBuffers, bucket


def test_buckets_pad_by_at_most_a_quarter():
    assert [bucket(n) for n in (1, 4, 5, 7, 8, 9, 256, 257, 4096, 4097, 65536)] == \
        [1, 4, 5, 7, 8, 10, 256, 320, 4096, 5120, 65536]
    for n in range(1, 5000):
        assert n <= bucket(n) <= 1.25 * n + 4
    assert bucket(10, minimum=1024) == 1024


def inputs(manifest, batch_size, seed, device="cpu"):
    dense, values, lengths = random_inputs(manifest, batch_size, ids_per_bag=3.0, seed=seed)
    return dense.to(device), values.to(device), lengths.reshape(len(manifest.features), -1).to(device)


def test_padded_static_inputs_give_each_sample_its_own_ctr(artifact):
    """What a graph replays: the batch padded with empty-bag samples and spare ids. The real samples'
    CTRs must not change, also when a smaller batch reuses buffers a larger one filled (every bucket's
    inputs are prefixes of the same buffers)."""
    m = read_manifest(artifact)
    model = torch.jit.load(str(artifact / "model.pt"))
    buffers = InputBuffers(bucket(400), 8192, len(m.features), m.dense_features, torch.device("cpu"))
    with torch.inference_mode():
        for batch_size, seed in ((300, 0), (290, 1)):
            dense, values, lengths = inputs(m, batch_size, seed)
            static = buffers.view(bucket(batch_size), bucket(values.numel(), 1024))
            static.fill(dense, values, lengths)
            padded = model(*static.args())[:batch_size]
            want = model(dense, values, lengths.reshape(-1))
            assert padded.abs().sum() > 0 and want.std() > 1e-3
            np.testing.assert_allclose(padded.numpy(), want.numpy(), atol=1e-6, rtol=0)
            assert static.lengths[:, batch_size:].abs().sum() == 0


def test_cpu_model_runs_eagerly_and_says_why(artifact):
    m = read_manifest(artifact)
    model = torch.jit.load(str(artifact / "model.pt"))
    forward = GraphedForward(model, torch.device("cpu"), len(m.features), m.dense_features, max_batch_size=64)
    assert forward.disabled_reason == "the model runs on cpu"
    dense, values, lengths = inputs(m, 5, seed=2)
    with torch.inference_mode():
        out = forward(dense, values, lengths)
        want = model(dense, values, lengths.reshape(-1))
    assert want.std() > 1e-3 and torch.equal(out, want) and forward.captured == 0


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
    m = read_manifest(one_group_cuda_artifact)
    model = torch.jit.load(str(one_group_cuda_artifact / "model.pt"), map_location="cuda:0")
    forward = GraphedForward(model, torch.device("cuda:0"), len(m.features), m.dense_features, max_batch_size=2048)
    buckets = set()
    with torch.inference_mode():
        # The largest first, so that the shared input buffers do not grow in this loop.
        for i, batch_size in enumerate((2048, 1, 9, 300, 290, 1000, 9, 4096)):
            dense, values, lengths = inputs(m, batch_size, seed=i, device="cuda:0")
            if batch_size <= 2048:
                buckets.add((bucket(batch_size), bucket(values.numel(), 1024)))
            got = forward(dense, values, lengths)
            want = model(dense, values, lengths.reshape(-1))
            assert batch_size == 1 or want.std() > 1e-3
            # Padded rows change the GEMMs' shapes, so bf16 kernels may differ in the last bit.
            np.testing.assert_allclose(got.cpu().numpy(), want.cpu().numpy(), atol=2e-3, rtol=0)
            if batch_size in (1, 2048):  # no padding: the same kernels
                np.testing.assert_allclose(got.cpu().numpy(), want.cpu().numpy(), atol=1e-6, rtol=0)
    assert forward.disabled_reason is None
    # One graph per (batch, ids) bucket; 4096 is above max_batch_size and runs eagerly.
    assert forward.captured == len(buckets) >= 5
    # More ids than any batch before: larger buffers, every graph dropped and captured anew.
    dense, values, lengths = random_inputs(m, 2048, ids_per_bag=8.0, seed=99)
    dense, values, lengths = dense.cuda(), values.cuda(), lengths.reshape(len(m.features), -1).cuda()
    with torch.inference_mode():
        got, want = forward(dense, values, lengths), model(dense, values, lengths.reshape(-1))
    np.testing.assert_allclose(got.cpu().numpy(), want.cpu().numpy(), atol=1e-6, rtol=0)
    assert forward.disabled_reason is None and forward.captured == 1


@pytest.mark.gpu
def test_capture_failure_falls_back_to_eager_and_device_stays_usable(artifact, checkpoint, tmp_path):
    """The demo model pools one table by MEAN: TorchRec splits its KJT between two TBEs, a host
    synchronisation, which a graph cannot capture."""
    assert run_cli("export", "--checkpoint", checkpoint, "--repo", tmp_path, "--name", "d", "--device", "cuda",
                   "--no-progress") == 0
    path = tmp_path / "d" / "1"
    m = read_manifest(path)
    model = torch.jit.load(str(path / "model.pt"), map_location="cuda:0")
    forward = GraphedForward(model, torch.device("cuda:0"), len(m.features), m.dense_features, max_batch_size=512)
    dense, values, lengths = inputs(m, 100, seed=0, device="cuda:0")
    with torch.inference_mode():
        got = forward(dense, values, lengths)
        want = model(dense, values, lengths.reshape(-1))
    assert forward.disabled_reason and "capture failed" in forward.disabled_reason
    np.testing.assert_array_equal(got.cpu().numpy(), want.cpu().numpy())
    assert torch.ones(1, device="cuda:0").add(1).item() == 2
