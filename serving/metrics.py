"""Prometheus metrics of the server (exposed on --metrics-port at /metrics)."""
from __future__ import annotations

import grpc
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("recserve_requests", "Requests by RPC, model and status code",
                                ["rpc", "model", "code"], registry=r)
        self.queue_seconds = Histogram("recserve_queue_seconds", "Time from admission to the start of the batch",
                                       ["rpc", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.compute_seconds = Histogram("recserve_compute_seconds", "Model call time of the batch a request was in",
                                         ["rpc", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.total_seconds = Histogram("recserve_request_seconds", "Time in the server, decode to response",
                                       ["rpc", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("recserve_batch_size", "Samples per model call", ["rpc", "model"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.queue_depth = Gauge("recserve_queue_depth", "Requests waiting for a batch", ["rpc", "model"], registry=r)
        self.loaded = Gauge("recserve_model_version_loaded", "1 for each loaded model version",
                            ["model", "version", "state"], registry=r)
        self.load_failures = Counter("recserve_model_load_failures", "Versions refused at load, by reason",
                                     ["model", "reason"], registry=r)
        self.gpu_memory = Gauge("recserve_gpu_memory_bytes", "GPU memory allocated by this process",
                                ["device"], registry=r)
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                self.gpu_memory.labels(device=f"cuda:{i}").set_function(
                    lambda i=i: torch.cuda.memory_allocated(i))

    def request_done(self, rpc: str, model: str, code: grpc.StatusCode) -> None:
        self.requests.labels(rpc=rpc, model=model or "-", code=code.name).inc()

    def serve_http(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)
