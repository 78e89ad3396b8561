"""The model call of a staged batch: the gather (serving/engine/assemble.py) and ``model.pt``'s method,
replayed from a CUDA graph where shapes allow, else eager.

What is captured, per (RPC, shared bags pooled once or not, column bucket, id bucket, row bucket):
the gather from the staging buffer and the descriptor table (both fixed device buffers) into the
model's inputs, then the whole method (KJT construction, INT8 lookups, the dense head). A batch then
costs the host one graph launch, however many requests it merges and however many kernels run.

- sizes are padded up to their bucket (1, 1.25, 1.5 and 1.75 times powers of two, so at most 25%
  padding): padding samples have only empty bags and their rows are never read; ids past the last
  bag are never read either (offsets come from the lengths);
- the descriptor has MAX_REQUESTS rows; rows past the batch's are zero (no block, no samples).

What is not: CPU models, artifacts sharded over several GPUs (their input distribution synchronises
with the host), UVM-cached tables (their cache keeps host-side state), batches beyond the largest
bucket, and any artifact whose capture fails: those run the same gather and method eagerly; the
reason is logged once.

Graphs share one memory pool: a replay's temporaries are free again when it ends; replays of one
model run one after another on one stream, and each batch's results are copied out (on that stream)
before the next replay is queued, so the pool is as large as the largest batch's activations.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from serving.engine.assemble import Assembler, Staged, broadcast_pooled, gather

log = logging.getLogger("serving.graphs")

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


@dataclass(frozen=True)
class Shape:
    rpc: str  # "Predict" | "Lookup"
    once: bool  # shared bags pooled once, in extra samples
    repeats: bool  # shared bags expanded to their samples
    columns: int
    ids: int
    rows: int


@dataclass
class Captured:
    graph: "torch.cuda.CUDAGraph"
    result: torch.Tensor


class ModelCall:
    """``call(rpc, staged) -> result``: CTRs float32 [>= rows] (Predict) or pooled float32
    [>= rows, D] (Lookup) of a staged batch, on the model's device; only the first ``staged.rows``
    rows are the batch's."""

    def __init__(self, module: torch.jit.ScriptModule, assembler: Assembler, dense_device: torch.device,
                 max_batch_size: int, max_graphs: int = 96, enabled: bool = True) -> None:
        self.module = module
        self.assembler = assembler
        self.dense_device = dense_device
        self.features = len(assembler.schema.feature_names)
        self.dense_features = assembler.schema.dense_features
        self.max_batch_size = max_batch_size
        self.max_graphs = max_graphs
        self.disabled_reason: Optional[str] = None
        if not enabled:
            self.disabled_reason = "switched off (--no-cuda-graphs)"
        elif dense_device.type != "cuda":
            self.disabled_reason = f"the model runs on {dense_device.type}"
        self._graphs: Dict[Shape, Captured] = {}
        self._generation = -1
        self._full_logged = False
        self._pool = None
        self._pool_bytes = 0
        self._stream: Optional["torch.cuda.Stream"] = None  # warm-ups and captures (see _capture)

    @property
    def captured(self) -> int:
        return len(self._graphs)

    @property
    def graphed(self) -> bool:
        """Batches are staged for graphs (a fixed-shape descriptor)."""
        return self.disabled_reason is None

    def pool_bytes(self) -> int:
        """GPU memory reserved for the graphs' private pool (their activations and outputs)."""
        return self._pool_bytes

    def disable(self, reason: str) -> None:
        if self.disabled_reason is None:
            log.warning("CUDA graphs off for this model, it runs eagerly: %s", reason)
        self.disabled_reason = reason

    def replay(self, rpc: str, staged: Staged) -> Optional[torch.Tensor]:
        """The batch's result from a graph captured already, or None (then call this object, under
        the model's inference and math settings: it captures or runs eagerly). A replay needs neither
        setting: the graph holds the kernels chosen at its capture."""
        shape = self._shape(rpc, staged)
        if shape is None or self._generation != self.assembler.generation:
            return None
        captured = self._graphs.get(shape)
        if captured is None:
            return None
        captured.graph.replay()
        return captured.result

    def __call__(self, rpc: str, staged: Staged) -> torch.Tensor:
        shape = self._shape(rpc, staged)
        if shape is not None:
            captured = self._graph_for(shape)
            if captured is not None:
                captured.graph.replay()
                return captured.result
        return self._compute(rpc, staged.once, staged.repeats, staged.descriptor, staged.columns, staged.ids,
                             staged.rows)

    def _shape(self, rpc: str, staged: Staged) -> Optional[Shape]:
        """The graph a batch replays from, None if it runs eagerly."""
        if self.disabled_reason is not None or staged.columns > bucket(self.max_batch_size) + staged.requests:
            return None
        return Shape(rpc, staged.once, staged.repeats, bucket(staged.columns), bucket(staged.ids, MIN_ID_BUCKET),
                     bucket(staged.rows))

    def _compute(self, rpc: str, once: bool, repeats: bool, descriptor: torch.Tensor, columns: int, ids: int,
                 rows: int) -> torch.Tensor:
        predict = rpc == "Predict"
        values, lengths, dense, extra_rows, extra_weight = gather(
            self.assembler.words, descriptor, self.features, self.dense_features if predict else 0,
            self.assembler.wide_ids, columns, ids, rows, repeats)
        if dense is not None and dense.device != self.dense_device:
            dense = dense.to(self.dense_device)
        if once:
            pooled = self.module.pooled(values, lengths.reshape(-1))
            pooled = broadcast_pooled(pooled, descriptor, rows, extra_rows, extra_weight)
            return self.module.predict_pooled(dense, pooled) if predict else pooled.float()
        if predict:
            return self.module(dense, values, lengths.reshape(-1))
        return self.module.lookup(values, lengths.reshape(-1))

    def _graph_for(self, shape: Shape) -> Optional[Captured]:
        if self._generation != self.assembler.generation:
            # The staging buffer was replaced: every graph read the old one.
            self._graphs.clear()
            self._full_logged = False
            self._pool = torch.cuda.graph_pool_handle()  # reusing a pool whose graphs are gone asserts
            self._generation = self.assembler.generation
        captured = self._graphs.get(shape)
        if captured is not None or self.disabled_reason is not None:
            return captured
        if len(self._graphs) >= self.max_graphs:
            if not self._full_logged:
                log.info("%d CUDA graphs captured (the most allowed): other buckets run eagerly", len(self._graphs))
                self._full_logged = True
            return None
        try:
            captured = self._capture(shape)
            self._pool_bytes = sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                                   if tuple(seg.get("segment_pool_id", ())) == tuple(self._pool))
        except (RuntimeError, torch.jit.Error) as e:  # jit.Error: a raise or assert in TorchScript, no RuntimeError
            torch.cuda.synchronize(self.dense_device)  # a failed capture must leave the device usable
            self.disable(f"capture failed: {str(e).splitlines()[0][:200]}")
            # Off for good: the graphs captured before are never replayed again, and their pool (the
            # largest batch's activations) goes back to the allocator, for the eager calls.
            self._graphs.clear()
            self._pool_bytes = 0
            return None
        self._graphs[shape] = captured
        log.debug("captured a CUDA graph for %s", shape)
        return captured

    def _capture(self, shape: Shape) -> Captured:
        args = (shape.rpc, shape.once, shape.repeats, self.assembler.descriptor, shape.columns, shape.ids, shape.rows)
        current = torch.cuda.current_stream(self.dense_device)
        # One stream for every warm-up and capture of this model: cuBLAS keeps a workspace (32 MiB on
        # Hopper) per stream for the life of the process, so a new stream per capture held 33 MiB
        # of GPU memory per captured graph (264 MiB of the served model's excess at 8 graphs).
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.dense_device)
        side = self._stream
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._compute(*args)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other models' loads (golden checks) run on other threads meanwhile; "global"
        # would make their CUDA calls fail, and so this capture. One capture at a time in the process.
        with _CAPTURING, torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
            result = self._compute(*args)
        current.wait_stream(side)
        return Captured(graph, result)

