"""CUDA only: where one model call's time goes, from a torch.profiler trace of repeated calls.

Every GPU activity of the calls is put in one class by its kernel name: the embedding lookups
(FBGEMM's TBE), dense matmuls (cuBLAS/CUTLASS GEMMs), copies and memsets, and all other kernels
(elementwise, concatenation, casts, cumsums). What the GPU does not spend busy during a call's wall
time (host work, kernel launches, synchronisations) is "GPU idle". Per call, in milliseconds.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import torch

CLASSES = ("lookups", "dense matmuls", "other kernels", "copies", "GPU idle")
LOOKUP_MARKERS = ("nbit", "embedding", "tbe")
MATMUL_MARKERS = ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "splitk")
COPY_MARKERS = ("memcpy", "memset")


def kernel_class(name: str) -> str:
    lowered = name.lower()
    if any(m in lowered for m in COPY_MARKERS):
        return "copies"
    if any(m in lowered for m in LOOKUP_MARKERS):
        return "lookups"
    if any(m in lowered for m in MATMUL_MARKERS):
        return "dense matmuls"
    return "other kernels"


@dataclass
class Breakdown:
    batch_size: int
    wall_ms: float  # mean wall time per call while profiled (host start to device synchronised)
    ms: Dict[str, float]  # per class, per call; sums to wall_ms
    kernels_per_call: float
    top: List[Tuple[str, str, float]] = field(default_factory=list)  # (class, kernel, ms per call)


def _union_ms(intervals: List[Tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy / 1000.0


def profile_calls(call: Callable[[int], None], batch_size: int, calls: int = 20, top: int = 8) -> Breakdown:
    from torch.profiler import ProfilerActivity, profile

    for i in range(3):
        call(i)
    torch.cuda.synchronize()
    wall = 0.0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            start = time.perf_counter()
            call(i)
            torch.cuda.synchronize()
            wall += time.perf_counter() - start
    per_class: Dict[str, float] = defaultdict(float)
    per_kernel: Dict[Tuple[str, str], float] = defaultdict(float)
    intervals: List[Tuple[float, float]] = []
    count = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start, end = e.time_range.start, e.time_range.end
        cls = kernel_class(e.name)
        per_class[cls] += (end - start) / 1000.0 / calls
        per_kernel[(cls, e.name)] += (end - start) / 1000.0 / calls
        intervals.append((start, end))
        count += 1
    wall_ms = wall * 1000.0 / calls
    busy_ms = _union_ms(intervals) / calls
    # Kernels of one call may overlap (several streams): scale the classes to the busy time.
    total = sum(per_class.values()) or 1.0
    ms = {c: per_class.get(c, 0.0) * busy_ms / total for c in CLASSES[:-1]}
    ms["GPU idle"] = max(0.0, wall_ms - busy_ms)
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    return Breakdown(batch_size, wall_ms, ms, count / calls, [(c, n[:90], t) for (c, n), t in ranked])


def print_breakdowns(rows: List[Breakdown], label: str) -> None:
    print(f"\nwhere the time goes per call ({label}), ms:")
    print(f"{'batch':>6s} {'wall':>8s} " + " ".join(f"{c:>14s}" for c in CLASSES) + f" {'kernels':>8s}")
    for b in rows:
        print(f"{b.batch_size:6d} {b.wall_ms:8.3f} " + " ".join(f"{b.ms[c]:14.3f}" for c in CLASSES)
              + f" {b.kernels_per_call:8.0f}")
    for b in rows:
        print(f"  B={b.batch_size} largest kernels:")
        for cls, name, t in b.top:
            print(f"    {t:8.3f} ms  {cls:14s} {name}")
