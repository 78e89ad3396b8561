"""The bare artifact: ``model.pt`` called directly, inputs already on its device (no server, no
copies), one call at a time. Latency per call is timed with the device synchronised after each call;
throughput is batch size over the median latency."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

from recserve.manifest import MODEL_FILE, Manifest, set_dense_math

WARMUP_CALLS = 10
MIN_CALLS = 20
INPUT_SETS = 4  # rotated, so that repeated calls do not just re-read one batch from cache


@dataclass
class Row:
    mode: str  # "bare" | "served"
    batch_size: int
    samples_per_s: float
    p50_ms: float
    p99_ms: float
    calls: int
    concurrency: int = 1  # closed-loop clients (bare: one caller)


def random_inputs(manifest: Manifest, batch_size: int, ids_per_bag: float, seed: int) -> Tuple[torch.Tensor, ...]:
    """Random valid (dense, values, lengths): Poisson bag sizes, uniform ids over each table."""
    rng = np.random.default_rng(seed)
    lengths = rng.poisson(ids_per_bag, size=(len(manifest.features), batch_size)).astype(np.int32)
    values = np.concatenate([rng.integers(0, f.rows, size=int(lengths[k].sum()), dtype=np.int64)
                             for k, f in enumerate(manifest.features)])
    dense = rng.standard_normal((batch_size, manifest.dense_features), dtype=np.float32)
    return torch.from_numpy(dense), torch.from_numpy(values), torch.from_numpy(lengths.reshape(-1))


def percentiles(latencies_s: List[float]) -> Tuple[float, float]:
    ms = np.asarray(latencies_s) * 1000.0
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def load_model(version_dir: Path, manifest: Manifest) -> torch.jit.ScriptModule:
    import fbgemm_gpu  # noqa: F401  (registers the operators model.pt calls)

    set_dense_math(manifest.dense_dtype)
    return torch.jit.load(str(Path(version_dir) / MODEL_FILE), map_location=manifest.dense_device).eval()


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


def bench_bare(version_dir: Path, manifest: Manifest, batch_sizes: List[int], seconds: float, ids_per_bag: float,
               log: Optional[Callable[[str], None]] = None) -> List[Row]:
    model = load_model(version_dir, manifest)
    device = torch.device(manifest.dense_device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for b in batch_sizes:
        sets = [tuple(t.to(device) for t in random_inputs(manifest, b, ids_per_bag, seed=s)) for s in range(INPUT_SETS)]

        def call(i: int) -> None:
            with torch.inference_mode():
                model(*sets[i % INPUT_SETS])

        latencies = time_calls(call, seconds, sync)
        p50, p99 = percentiles(latencies)
        rows.append(Row("bare", b, b / (p50 / 1000.0), p50, p99, len(latencies)))
        if log:
            log(f"bare   B={b:6d}  {rows[-1].samples_per_s:12,.0f} samples/s  p50 {p50:8.3f} ms  p99 {p99:8.3f} ms")
    return rows
