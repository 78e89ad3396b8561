"""CUDA only: FBGEMM's inference lookup kernel (the one the artifact's tables run on) for INT8, FP16
and INT4 tables, against the device-to-device copy bandwidth measured in the same run.

Bytes counted per lookup: one table row as stored (data plus INT8/INT4 scale and bias); the kernel
at memory roofline would move ``lookups x row bytes`` at the copy bandwidth."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

ROWS, TABLES, DIM, BATCH, POOLING = 1_000_000, 26, 128, 16384, 20


@dataclass
class KernelRow:
    weight_dtype: str
    lookups_per_s: float
    bytes_per_s: float
    fraction_of_copy: float
    ms: float


def _median_ms(fn: Callable[[], None], iters: int = 30) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, bytes read plus written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), iters=10)
    src = dst = None  # free before the kernel runs
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms / 1000.0)


def bench_kernels(log: Optional[Callable[[str], None]] = None, int8_variants: bool = False) -> dict:
    import fbgemm_gpu  # noqa: F401
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    bandwidth = copy_bandwidth()
    if log:
        log(f"device copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    rows: List[KernelRow] = []
    g = torch.Generator(device="cuda").manual_seed(0)
    indices = torch.randint(0, ROWS, (TABLES * BATCH * POOLING,), device="cuda", generator=g, dtype=torch.int32)
    offsets = torch.arange(0, TABLES * BATCH + 1, device="cuda", dtype=torch.int32) * POOLING
    variants = [("int8", SparseType.INT8, SparseType.FP32, None), ("fp16", SparseType.FP16, SparseType.FP32, None),
                ("int4", SparseType.INT4, SparseType.FP32, None)]
    if int8_variants:
        # Does the INT8 kernel's distance from the roofline depend on what it writes or how rows align?
        variants += [("int8 out=fp16", SparseType.INT8, SparseType.FP16, None),
                     ("int8 out=bf16", SparseType.INT8, SparseType.BF16, None),
                     ("int8 align=32", SparseType.INT8, SparseType.FP32, 32),
                     ("int8 align=64", SparseType.INT8, SparseType.FP32, 64),
                     ("int8 align=128", SparseType.INT8, SparseType.FP32, 128)]
    for name, sparse_type, output_dtype, alignment in variants:
        tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(f"t{i}", ROWS, DIM, sparse_type, EmbeddingLocation.DEVICE) for i in range(TABLES)],
            device="cuda", pooling_mode=PoolingMode.SUM, output_dtype=output_dtype, row_alignment=alignment)
        tbe.fill_random_weights()
        row_bytes = tbe.weights_dev.numel() / (TABLES * ROWS)
        ms = _median_ms(lambda: tbe(indices, offsets))
        lookups = TABLES * BATCH * POOLING / (ms / 1000.0)
        moved = lookups * row_bytes
        rows.append(KernelRow(name, lookups, moved, moved / bandwidth, ms))
        if log:
            log(f"TBE {name:14s} {lookups / 1e9:6.2f} G lookups/s  {moved / 1e12:5.2f} TB/s of rows "
                f"({100 * moved / bandwidth:4.1f}% of copy)  {ms:.3f} ms per batch of {BATCH} x {TABLES} x {POOLING}")
        tbe = None  # free before the next dtype
        torch.cuda.empty_cache()
    return {"copy_bytes_per_s": bandwidth, "shape": {"tables": TABLES, "rows": ROWS, "dim": DIM, "batch": BATCH,
                                                     "pooling": POOLING},
            "rows": [r.__dict__ for r in rows]}
