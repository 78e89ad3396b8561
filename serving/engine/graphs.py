"""The model call: ``model.pt``'s forward replayed from CUDA graphs where shapes allow, else eager.

What is captured: the whole forward of a single-device CUDA artifact (KJT construction, the INT8
lookups, the dense head, the sigmoid), one graph per (batch bucket, id bucket), each replayed on its
own fixed device buffers that hold one batch's inputs and its CTRs:

- the batch is padded up to its bucket (buckets: 1, 1.25, 1.5 and 1.75 times powers of two, so at
  most 25% padding); padding samples have only empty bags and their rows are dropped;
- the ids are padded up to the same kind of bucket: the lookup reads a bag's ids through the offsets
  computed from the lengths, so ids past the last bag's end are never read;
- the lengths of the padding samples are zeroed on every call (stale lengths would point past the ids).

What is not: RPC Lookup (the pooled embeddings; eager), batches above ``max_batch_size``, CPU
artifacts, artifacts sharded over several GPUs (their input distribution synchronises with the host)
and any artifact whose capture fails - those run eagerly, and the reason is logged once.

Graphs share one memory pool: a replay's temporaries are free again when it ends, and only one
replay runs at a time (a lock), so the pool is as large as the largest batch's activations. Their
inputs are views of one set of buffers (InputBuffers), sized for the largest bucket.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

log = logging.getLogger("serving.engine.graphs")

BUCKET_STEPS = (4, 5, 6, 7)  # quarters of a power of two: 1, 1.25, 1.5, 1.75
MIN_ID_BUCKET = 1024
_CAPTURING = threading.Lock()
WARMUP_RUNS = 2  # TorchScript's profiling executor optimises a method on its second call


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest 2^k * {1, 1.25, 1.5, 1.75} >= max(n, minimum)."""
    n = max(n, minimum)
    if n <= 4:
        return n
    power = 1 << max(0, (n - 1).bit_length() - 3)
    for step in BUCKET_STEPS + (8,):
        if step * power >= n:
            return step * power
    raise AssertionError(n)


@dataclass
class StaticInputs:
    """One bucket's fixed inputs, which a captured graph reads on every replay (views of InputBuffers)."""

    dense: torch.Tensor  # [B_bucket, F]
    values: torch.Tensor  # [N_bucket]
    lengths: torch.Tensor  # [T, B_bucket], contiguous

    def fill(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> None:
        """Copy a batch in: its samples first, then padding samples with only empty bags."""
        b, n = dense.shape[0], values.numel()
        self.dense[:b].copy_(dense, non_blocking=True)
        self.values[:n].copy_(values, non_blocking=True)
        self.lengths[:, :b].copy_(lengths, non_blocking=True)
        self.lengths[:, b:].zero_()

    def args(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.dense, self.values, self.lengths.view(-1)


class InputBuffers:
    """The device buffers every bucket's inputs are views of (prefixes), sized for the largest: all
    graphs together hold one set of inputs."""

    def __init__(self, batch: int, ids: int, feature_count: int, dense_features: int, device: torch.device) -> None:
        self.batch, self.ids, self.feature_count, self.dense_features = batch, ids, feature_count, dense_features
        self.dense = torch.zeros(batch * dense_features, dtype=torch.float32, device=device)
        self.values = torch.zeros(ids, dtype=torch.int64, device=device)
        self.lengths = torch.zeros(feature_count * batch, dtype=torch.int32, device=device)

    def view(self, batch: int, ids: int) -> StaticInputs:
        assert batch <= self.batch and ids <= self.ids
        return StaticInputs(self.dense[:batch * self.dense_features].view(batch, self.dense_features),
                            self.values[:ids], self.lengths[:self.feature_count * batch].view(self.feature_count, batch))


@dataclass
class CapturedForward:
    graph: "torch.cuda.CUDAGraph"
    inputs: StaticInputs
    ctr: torch.Tensor  # [B_bucket], written by each replay


class GraphedForward:
    """``forward(dense f32[B, F], values i64[N], lengths i32[T, B]) -> ctr f32[B]`` on the module's
    device, same contract as ``model.pt``'s forward with the lengths unflattened."""

    def __init__(self, module: torch.jit.ScriptModule, device: torch.device, feature_count: int, dense_features: int,
                 max_batch_size: int, max_graphs: int = 48, enabled: bool = True) -> None:
        self.module = module
        self.device = device
        self.feature_count = feature_count
        self.dense_features = dense_features
        self.max_batch_size = max_batch_size
        self.max_graphs = max_graphs
        self.disabled_reason: Optional[str] = None
        if not enabled:
            self.disabled_reason = "switched off (--no-cuda-graphs)"
        elif device.type != "cuda":
            self.disabled_reason = f"the model runs on {device.type}"
        self._graphs: Dict[Tuple[int, int], CapturedForward] = {}
        self._buffers: Optional[InputBuffers] = None
        self._full_logged = False
        self._pool = None  # created with the input buffers (see _graph_for)
        self._pool_bytes = 0  # the pool's segments, read from the allocator after each capture
        self._lock = threading.Lock()

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def pool_bytes(self) -> int:
        """GPU memory reserved for the graphs' private pool (their activations and outputs)."""
        return self._pool_bytes

    def disable(self, reason: str) -> None:
        if self.disabled_reason is None:
            log.warning("CUDA graphs off for this model, it runs eagerly: %s", reason)
        self.disabled_reason = reason

    def __call__(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        b, n = dense.shape[0], values.numel()
        if self.disabled_reason is None and b <= self.max_batch_size:
            with self._lock:
                call = self._graph_for(bucket(b), bucket(n, MIN_ID_BUCKET))
                if call is not None:
                    call.inputs.fill(dense, values, lengths)
                    call.graph.replay()
                    return call.ctr[:b].clone()
        return self.module(dense, values, lengths.reshape(-1))

    def _graph_for(self, batch: int, ids: int) -> Optional[CapturedForward]:
        call = self._graphs.get((batch, ids))
        if call is not None or self.disabled_reason is not None:
            return call
        if len(self._graphs) >= self.max_graphs:
            if not self._full_logged:
                log.info("%d CUDA graphs captured (the most allowed): other buckets run eagerly", len(self._graphs))
                self._full_logged = True
            return None
        if self._buffers is None or ids > self._buffers.ids:
            # Every graph reads views of the buffers: larger ones mean capturing again.
            grown = max(ids, 2 * self._buffers.ids) if self._buffers else ids
            self._graphs.clear()
            self._full_logged = False
            self._pool = torch.cuda.graph_pool_handle()  # a new pool: reusing one whose graphs are gone asserts
            self._buffers = None  # free the old buffers before allocating the new ones
            self._buffers = InputBuffers(bucket(self.max_batch_size), grown, self.feature_count,
                                         self.dense_features, self.device)
        try:
            call = self._capture(batch, ids)
            self._pool_bytes = sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                                   if tuple(seg.get("segment_pool_id", ())) == tuple(self._pool))
        except RuntimeError as e:
            torch.cuda.synchronize(self.device)  # a failed capture must leave the device usable
            self.disable(f"capture failed: {str(e).splitlines()[0][:200]}")
            return None
        self._graphs[(batch, ids)] = call
        log.debug("captured a CUDA graph for batch bucket %d, id bucket %d", batch, ids)
        return call

    def _capture(self, batch: int, ids: int) -> CapturedForward:
        inputs = self._buffers.view(batch, ids)
        inputs.lengths.zero_()  # the warm-up runs read no ids (the buffers hold another bucket's batch)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.module(*inputs.args())
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine runs other models' batches and loads (golden checks) on other
        # threads meanwhile; "global" would make their CUDA calls fail, and so this capture. One
        # capture at a time in the process.
        with _CAPTURING, torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            ctr = self.module(*inputs.args())
        return CapturedForward(graph, inputs, ctr)
