"""One measured row of the bench (a mode at one batch size and client count) and its percentiles.
Light on imports: the client processes load it without torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np


@dataclass
class Row:
    mode: str  # "bare" | "floor" | "served"
    batch_size: int
    samples_per_s: float
    p50_ms: float
    p99_ms: float
    calls: int
    concurrency: int = 1  # closed-loop clients (bare: one caller)
    # CPU-seconds of all client processes per wall second of the measuring window (bare: None).
    # Near the machine's free cores, the clients and not the server bound the row.
    client_cpu: Optional[float] = None
    # Served rows: the server's own mean times per request over the row (from its /metrics): receipt
    # to response in a front end, waiting for a batch in the engine, and the batch's model call
    # (launch to outputs written). What the client sees beyond server_ms is gRPC and the client.
    server_ms: Optional[float] = None
    queue_ms: Optional[float] = None
    compute_ms: Optional[float] = None
    # Served and floor rows: "per-sample" (every bag per sample) or "shared" (the shared features' bags
    # once per request); the mean serialized request size.
    form: str = "per-sample"
    request_bytes: Optional[float] = None
    # UVM-cached tables: hits / lookups of FBGEMM's caches over the row (unique ids per batch).
    cache_hit_ratio: Optional[float] = None
    # Served rows: the engine process's CPU time per request answered, and (CUDA, batches replayed
    # from graphs) the copies, graph launches and events the engine asked of the device per batch.
    engine_cpu_ms_per_request: Optional[float] = None
    engine_poll_ms_per_request: Optional[float] = None  # of which spent polling an otherwise idle loop
    device_launches_per_batch: Optional[float] = None


def percentiles(latencies_s: List[float]) -> Tuple[float, float]:
    ms = np.asarray(latencies_s) * 1000.0
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))
