"""Prometheus metrics of the server, one definition for every process.

Front ends record requests (``request_done``), the engine records batches (``batch_done``), model
versions and GPU memory; nothing else writes a metric. ``recserve serve`` runs them in several
processes: with ``PROMETHEUS_MULTIPROC_DIR`` set (serving/server.py sets it before starting them),
prometheus_client keeps each process's values in files there and the supervisor serves all of them
on ONE /metrics endpoint (``multiprocess_registry``). In one process (tests) each component's own
registry is read directly.
"""
from __future__ import annotations

from typing import Iterable

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
NO_MODEL = "-"  # the model label of requests that named no loaded model (clients cannot grow the label set)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("recserve_requests", "Requests by RPC, model and status code",
                                ["rpc", "model", "code"], registry=r)
        self.total_seconds = Histogram("recserve_request_seconds", "Time in the server, receipt to response",
                                       ["rpc", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("recserve_queue_seconds", "Time from admission to the start of the batch",
                                       ["rpc", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.compute_seconds = Histogram("recserve_compute_seconds", "Model call time of the batch a request was in",
                                         ["rpc", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("recserve_batch_size", "Samples per model call", ["rpc", "model"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.queue_depth = Gauge("recserve_queue_depth", "Requests waiting for a batch", ["rpc", "model"],
                                 registry=r, multiprocess_mode="livesum")
        self.loaded = Gauge("recserve_model_version_loaded", "1 for each loaded model version",
                            ["model", "version", "state"], registry=r, multiprocess_mode="livesum")
        self.load_failures = Counter("recserve_model_load_failures", "Versions refused at load, by reason",
                                     ["model", "reason"], registry=r)
        self.gpu_memory = Gauge("recserve_gpu_memory_bytes", "GPU memory allocated by the engine", ["device"],
                                registry=r, multiprocess_mode="livemax")
        self.host_memory = Gauge("recserve_host_memory_bytes", "Resident host memory of the engine process "
                                 "(uvm tables included)", registry=r, multiprocess_mode="livemax")
        # FBGEMM counts per cache (one per group of UVM-cached tables: the `tables` label), on ids
        # deduplicated within a batch.
        self.cache_hits = Counter("recserve_embedding_cache_hits", "UVM cache hits (unique ids per batch)",
                                  ["model", "version", "tables"], registry=r)
        self.cache_misses = Counter("recserve_embedding_cache_misses", "UVM cache misses (unique ids per batch)",
                                    ["model", "version", "tables"], registry=r)
        self.graph_pool = Gauge("recserve_cuda_graph_pool_bytes", "GPU memory held by the CUDA graphs' pool",
                                ["device"], registry=r, multiprocess_mode="livemax")

    # -- front ends ------------------------------------------------------------------------------
    def request_done(self, rpc: str, model: str, code: grpc.StatusCode, seconds: float) -> None:
        self.requests.labels(rpc=rpc, model=model or NO_MODEL, code=code.name).inc()
        if code == grpc.StatusCode.OK:
            self.total_seconds.labels(rpc=rpc, model=model).observe(seconds)

    # -- engine ----------------------------------------------------------------------------------
    def version_state(self, model: str, version: int, old: str = "", new: str = "") -> None:
        """A loaded version moves from state ``old`` to ``new`` ("" for none). The old series is set
        to 0 before it is dropped: in multiprocess mode the files keep a dropped series' last value."""
        if old:
            self.loaded.labels(model=model, version=str(version), state=old).set(0)
            self.loaded.remove(model, str(version), old)
        if new:
            self.loaded.labels(model=model, version=str(version), state=new).set(1)

    def batch_done(self, rpc: str, model: str, samples: int, queue_s: Iterable[float], compute_s: float) -> None:
        """One model call: ``samples`` executed (requests refused by the id check excluded)."""
        self.batch_size.labels(rpc=rpc, model=model).observe(samples)
        compute = self.compute_seconds.labels(rpc=rpc, model=model)
        queue = self.queue_seconds.labels(rpc=rpc, model=model)
        for q in queue_s:
            queue.observe(q)
            compute.observe(compute_s)


class _Union:
    """A collector that yields what several registries hold (one process, several components)."""

    def __init__(self, registries) -> None:
        self.registries = registries

    def collect(self):
        for r in self.registries:
            yield from r.collect()


def union_registry(registries) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_Union(registries))
    return registry


def multiprocess_registry() -> CollectorRegistry:
    """Every process's metrics, read from PROMETHEUS_MULTIPROC_DIR (the supervisor's /metrics)."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return registry
