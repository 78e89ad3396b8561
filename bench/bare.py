"""The bare artifact: the server's model call (``model.pt`` through serving/engine/graphs.py: CUDA graph
replay where shapes allow, else eager) with inputs already on the device - no gRPC, no host copies -
one call at a time. Latency per call is timed with the device synchronised after each call;
throughput is batch size over the median latency."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from bench.rows import Row, percentiles
from recserve.ids import UNIFORM, IdDistribution
from recserve.manifest import Manifest
from serving.engine import uvm
from serving.engine.runner import ModelRunner
from serving.ipc import Schema

WARMUP_CALLS = 10
MIN_CALLS = 20
INPUT_SETS = 4  # rotated, so that repeated calls do not just re-read one batch from cache


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


def device_inputs(manifest: Manifest, batch_size: int, ids_per_bag: float,
                  ids: IdDistribution = UNIFORM) -> List[Tuple[torch.Tensor, ...]]:
    """INPUT_SETS batches on the model's device, lengths as [T, B]."""
    device = torch.device(manifest.dense_device)
    sets = []
    for s in range(INPUT_SETS):
        dense, values, lengths = random_inputs(manifest, batch_size, ids_per_bag, seed=s, ids=ids)
        sets.append((dense.to(device), values.to(device), lengths.reshape(len(manifest.features), -1).to(device)))
    return sets


def bench_bare(version_dir: Path, manifest: Manifest, batch_sizes: List[int], seconds: float, ids_per_bag: float,
               log: Optional[Callable[[str], None]] = None, cuda_graphs: bool = True,
               breakdown_sizes: Sequence[int] = (), ids: IdDistribution = UNIFORM,
               bare_memory: Optional[dict] = None) -> Tuple[List[Row], list]:
    """Rows per batch size, and (CUDA) a time breakdown per size in ``breakdown_sizes``; GPU memory
    held after the runs (model, caches, graph pool) into ``bare_memory`` where given."""
    bare_memory = {} if bare_memory is None else bare_memory
    device = torch.device(manifest.dense_device)
    schema = Schema.from_manifest(manifest, max(list(batch_sizes) + list(breakdown_sizes)), max_ids=1 << 62)
    runner = ModelRunner(version_dir, manifest, schema, cuda_graphs=cuda_graphs)
    forward = runner.forward
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows, breakdowns = [], []
    for b in sorted(set(batch_sizes) | set(breakdown_sizes)):
        sets = device_inputs(manifest, b, ids_per_bag, ids)

        def call(i: int) -> None:
            with torch.inference_mode():
                forward(*sets[i % INPUT_SETS])

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
        del sets
    if device.type == "cuda":
        bare_memory["bare_gpu_memory_bytes"] = torch.cuda.memory_allocated(device)
        bare_memory["bare_cuda_graph_pool_bytes"] = forward.pool_bytes()
    if log:
        log(f"bare model call: CUDA graphs {'off: ' + forward.disabled_reason if forward.disabled_reason else 'on'}"
            f" ({forward.captured} captured)")
    return rows, breakdowns
