"""The bare artifact: the server's model call (serving/engine/graphs.py: the gather of a staged batch
and ``model.pt``'s forward, one CUDA graph replay where shapes allow, else eager) with the batch
already on the device - no gRPC, no host copies - one call at a time. Latency per call is timed
with the device synchronised after each call; throughput is batch size over the median latency.

``launches_per_batch`` counts what the engine asks of the device per batch (kernel launches,
graph launches, copies) for batches merging 1, 4, 16 requests: constant but for one copy in and
one copy out per request."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from bench.rows import Row, percentiles
from recserve.ids import UNIFORM, IdDistribution
from recserve.manifest import Manifest, dense_math
from serving.engine import uvm
from serving.engine.assemble import host_item
from serving.engine.loader import check_golden_shapes, check_module
from serving.engine.runner import ModelRunner
from serving.ipc import ModelKJT, Schema

WARMUP_CALLS = 10
MIN_CALLS = 20
INPUT_SETS = 2  # rotated (one per staging half), so that repeated calls do not just re-read one batch from cache


def random_inputs(manifest: Manifest, batch_size: int, ids_per_bag: float, seed: int,
                  ids: IdDistribution = UNIFORM) -> Tuple[torch.Tensor, ...]:
    """Random valid (dense, values, lengths): Poisson bag sizes, ids from ``ids`` over each table."""
    rng = np.random.default_rng(seed)
    lengths = rng.poisson(ids_per_bag, size=(len(manifest.features), batch_size)).astype(np.int32)
    values = np.concatenate([ids.sample(rng, f.rows, int(lengths[k].sum()), k)
                             for k, f in enumerate(manifest.features)])
    dense = rng.standard_normal((batch_size, manifest.dense_features), dtype=np.float32)
    return torch.from_numpy(dense), torch.from_numpy(values), torch.from_numpy(lengths.reshape(-1))


def time_calls(call: Callable[[int], None], seconds: float, sync: Callable[[], None]) -> List[float]:
    for i in range(WARMUP_CALLS):
        call(i)
    sync()
    latencies: List[float] = []
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end or len(latencies) < MIN_CALLS:
        start = time.perf_counter()
        call(i)
        sync()
        latencies.append(time.perf_counter() - start)
        i += 1
    return latencies


def host_requests(runner: ModelRunner, manifest: Manifest, batch_size: int, count: int, ids_per_bag: float,
                  seed: int, ids: IdDistribution = UNIFORM, rpc: str = "Predict") -> list:
    """``count`` random Predict requests of ``batch_size`` laid out in host memory as a front end
    lays them out (page-locked on CUDA, like the front ends' buffers): the runner's Items."""
    items = []
    for k in range(count):
        dense, values, lengths = random_inputs(manifest, batch_size, ids_per_bag, seed=seed + k, ids=ids)
        lengths = lengths.numpy().reshape(len(manifest.features), -1)
        ends = np.concatenate(([0], np.cumsum(lengths.sum(axis=1))))
        kjt = ModelKJT(batch_size, [values.numpy()[ends[t]:ends[t + 1]] for t in range(len(ends) - 1)], list(lengths),
                       dense.numpy())
        item = host_item(kjt, runner.schema, False, rpc == "Lookup")
        if runner.dense_device.type == "cuda":
            item.memory = item.memory.pin_memory()
        items.append(item)
    return items


def launches_per_batch(runner: ModelRunner, manifest: Manifest, batch_size: int, ids_per_bag: float,
                       counts: Sequence[int] = (1, 4, 16)) -> List[Tuple[int, Dict[str, float]]]:
    """(requests merged, {what: per batch}) from a torch.profiler trace of the engine's launch and
    finish of batches of ``batch_size`` samples split into 1, 4, 16 requests: CUDA runtime calls by
    kind (kernels launched one by one, graph launches, copies)."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    for count in (c for c in counts if c <= batch_size):  # a request has a sample at least
        items = host_requests(runner, manifest, batch_size // count, count, ids_per_bag, seed=100)
        for _ in range(3):
            runner.finish(runner.launch("Predict", items))
        calls = 10
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                runner.finish(runner.launch("Predict", items))
        kinds: Dict[str, float] = {"kernels": 0.0, "graphs": 0.0, "copies": 0.0}
        for e in prof.events():
            name = e.name
            if name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
                kinds["kernels"] += 1 / calls
            elif name.startswith("cudaGraphLaunch") or name.startswith("cuGraphLaunch"):
                kinds["graphs"] += 1 / calls
            elif name.startswith("cudaMemcpy") or name.startswith("cuMemcpy"):
                kinds["copies"] += 1 / calls
        out.append((count, kinds))
    return out


def bench_bare(version_dir: Path, manifest: Manifest, batch_sizes: List[int], seconds: float, ids_per_bag: float,
               log: Optional[Callable[[str], None]] = None, cuda_graphs: bool = True,
               breakdown_sizes: Sequence[int] = (), ids: IdDistribution = UNIFORM,
               bare_memory: Optional[dict] = None, launches: Optional[list] = None) -> Tuple[List[Row], list]:
    """Rows per batch size, and (CUDA) a time breakdown per size in ``breakdown_sizes``; GPU memory
    held after the runs (model, caches, graph pool) into ``bare_memory`` where given; device calls
    per batch (CUDA) appended to ``launches`` where given."""
    bare_memory = {} if bare_memory is None else bare_memory
    device = torch.device(manifest.dense_device)
    schema = Schema.from_manifest(manifest, max(list(batch_sizes) + list(breakdown_sizes)), max_ids=1 << 30)
    # The server's checks of the manifest against model.pt and golden.pt (serving/engine/loader.py): ids
    # drawn from a manifest's rows must stay inside the artifact's tables (the kernels check no bounds).
    check_golden_shapes(version_dir, manifest)
    runner = ModelRunner(version_dir, manifest, schema, cuda_graphs=cuda_graphs)
    check_module(runner.module, manifest, version_dir, runner.assembler.device)
    forward, assembler = runner.forward, runner.assembler
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows, breakdowns = [], []
    for b in sorted(set(batch_sizes) | set(breakdown_sizes)):
        # One batch per staging half; each call puts its descriptor back and runs the model call.
        staged = []
        with torch.inference_mode():
            for s in range(INPUT_SETS):
                st = assembler.stage(host_requests(runner, manifest, b, 1, ids_per_bag, seed=s, ids=ids),
                                     exact=not forward.graphed)
                staged.append((st, st.descriptor.clone()))
        sync()

        def call(i: int) -> None:
            st, descriptor = staged[i % INPUT_SETS]
            with torch.inference_mode(), runner._on_device(), dense_math(manifest.dense_dtype):
                st.descriptor.copy_(descriptor, non_blocking=True)
                forward("Predict", st)

        if b in batch_sizes:
            cache_before = runner.cache_stats.read()
            latencies = time_calls(call, seconds, sync)
            p50, p99 = percentiles(latencies)
            hit_ratio = uvm.hit_ratio(cache_before, runner.cache_stats.read()) if runner.cache_stats else None
            rows.append(Row("bare", b, b / (p50 / 1000.0), p50, p99, len(latencies), cache_hit_ratio=hit_ratio))
            if log:
                log(f"bare   B={b:6d}  {rows[-1].samples_per_s:12,.0f} samples/s  p50 {p50:8.3f} ms  p99 {p99:8.3f} ms"
                    + ("" if hit_ratio is None else f"  cache hits {100 * hit_ratio:.1f}%"))
        if b in breakdown_sizes and device.type == "cuda":
            from bench.breakdown import profile_calls

            breakdowns.append(profile_calls(call, b))
        staged.clear()
    if device.type == "cuda":
        bare_memory["bare_gpu_memory_bytes"] = torch.cuda.memory_allocated(device)
        bare_memory["bare_cuda_graph_pool_bytes"] = forward.pool_bytes()
        if launches is not None:
            launches.extend(launches_per_batch(runner, manifest, max(batch_sizes), ids_per_bag))
    if log:
        log(f"bare model call: CUDA graphs {'off: ' + forward.disabled_reason if forward.disabled_reason else 'on'}"
            f" ({forward.captured} captured)")
    return rows, breakdowns
