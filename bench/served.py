"""The served artifact: ``recserve serve`` in its own process, for the closed-loop client processes
of bench/clients.py to drive."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Dict, Optional

from recserve.local import ListeningProcess, samples, scrape, wait_serving


READY_TIMEOUT_S = 600


class ServerProcess(ListeningProcess):
    """``frontends``: passed as ``serve --frontends N`` only when given, else the server chooses.
    ``model``: the one model of ``repo`` to serve (``--model-control explicit``), so that the
    server's memory is that model's; default every model of ``repo``."""

    def __init__(self, repo: Path, device: str, max_batch_size: int, max_delay_ms: float, metrics_port: int,
                 frontends: Optional[int] = None, replicas: str = "1", poll_interval: float = 0.0,
                 cuda_graphs: bool = True, shared_pooling: str = "expand", model: Optional[str] = None) -> None:
        self.metrics_port = metrics_port
        super().__init__(
            [sys.executable, "-m", "recserve", "--log-level", "WARNING", "serve", "--repo", str(repo), "--port", "0",
             "--device", device, "--metrics-port", str(metrics_port), "--max-batch-size", str(max_batch_size),
             "--max-delay-ms", str(max_delay_ms), "--max-queue", "1024", "--poll-interval", str(poll_interval),
             "--max-message-mb", "1024", "--max-ids-per-request", str(1 << 28), "--replicas", str(replicas),
             "--shared-pooling", shared_pooling]
            + ([] if frontends is None else ["--frontends", str(frontends)])
            + ([] if model is None else ["--model-control", "explicit", "--load-model", model])
            + ([] if cuda_graphs else ["--no-cuda-graphs"]),
            READY_TIMEOUT_S, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if not wait_serving(self.target, READY_TIMEOUT_S, self.alive):
            self.stop(10)
            raise RuntimeError("recserve serve did not load its model:\n" + "".join(self.lines[-30:]))

    def memory(self) -> Dict[str, float]:
        return memory_figures(scrape(self.metrics_port))

    def times(self) -> Dict[str, float]:
        return time_sums(scrape(self.metrics_port))


def memory_figures(metrics_text: str) -> Dict[str, float]:
    """From the server's /metrics: the GPU memory it holds on the device where it holds most and,
    where it reports them, its CUDA graph pools on the device where they are largest, and the
    engine's resident host memory (uvm tables included); bytes."""
    out = {}
    for key, name in (("served_gpu_memory_bytes", "recserve_gpu_memory_bytes"),
                      ("served_cuda_graph_pool_bytes", "recserve_cuda_graph_pool_bytes"),
                      ("served_host_memory_bytes", "recserve_host_memory_bytes")):
        per_device: Dict[str, float] = {}
        for s in samples(metrics_text, name):  # a pool may have a sample per model on one device
            device = s.labels.get("device", "")
            per_device[device] = per_device.get(device, 0.0) + s.value
        if per_device:
            out[key] = max(per_device.values())
    return out


def model_info(target: str, model: str, security=None, retry_s: float = 30.0) -> bytes:
    """The server's own ``pb.ModelInfo`` of ``model``, serialized: what every client shapes its
    requests from, for the served and the floor run alike. UNAVAILABLE is asked again for
    ``retry_s`` (a server just started); 0 for a server that should already be up."""
    import grpc

    from recserve.client import PLAINTEXT, Client

    deadline = time.monotonic() + retry_s
    with Client(target, timeout=60, security=security or PLAINTEXT) as client:
        while True:
            try:
                return client.model_info(model).models[0].SerializeToString()
            except grpc.RpcError as e:
                # Health said SERVING on one front end; the one answering may not have heard yet.
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)



def time_sums(metrics_text: str) -> Dict[str, float]:
    """Sums and counts of the server's Predict time histograms (bench/rows.py ``server_ms`` ...)."""
    out = {}
    for key, name in (("server", "recserve_request_seconds"), ("queue", "recserve_queue_seconds"),
                      ("compute", "recserve_compute_seconds")):
        for part in ("sum", "count"):
            out[f"{key}_{part}"] = sum(s.value for s in samples(metrics_text, f"{name}_{part}", rpc="Predict"))
    for key in ("hits", "misses"):
        out[f"cache_{key}"] = sum(s.value for s in samples(metrics_text, f"recserve_embedding_cache_{key}_total"))
    out["engine_cpu"] = sum(s.value for s in samples(metrics_text, "process_cpu_seconds_total")
                            if s.labels.get("process", "").startswith("engine"))
    out["engine_poll"] = sum(s.value for s in samples(metrics_text, "recserve_engine_poll_seconds_total"))
    out["answered"] = sum(s.value for s in samples(metrics_text, "recserve_requests_total", code="OK"))
    out["device_calls"] = sum(s.value for s in samples(metrics_text, "recserve_device_calls_total", rpc="Predict"))
    out["graphed_batches"] = sum(s.value for s in samples(metrics_text, "recserve_graphed_batches_total", rpc="Predict"))
    return out


def time_split(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, Optional[float]]:
    """Mean ms per request of each part between two ``time_sums``."""
    split = {}
    for key in ("server", "queue", "compute"):
        count = after[f"{key}_count"] - before[f"{key}_count"]
        split[f"{key}_ms"] = 1000.0 * (after[f"{key}_sum"] - before[f"{key}_sum"]) / count if count else None
    hits, misses = (after[f"cache_{k}"] - before[f"cache_{k}"] for k in ("hits", "misses"))
    split["cache_hit_ratio"] = hits / (hits + misses) if hits + misses else None
    # The engine process's CPU time over the requests answered (every front end's), and what it
    # asked of the device per graphed batch.
    answered = after["answered"] - before["answered"]
    split["engine_cpu_ms_per_request"] = 1000.0 * (after["engine_cpu"] - before["engine_cpu"]) / answered \
        if answered else None
    # Of which polling the device with nothing else to do (the loop spins while work is in flight).
    split["engine_poll_ms_per_request"] = 1000.0 * (after["engine_poll"] - before["engine_poll"]) / answered \
        if answered else None
    batches = after["graphed_batches"] - before["graphed_batches"]
    split["device_launches_per_batch"] = (after["device_calls"] - before["device_calls"]) / batches if batches else None
    return split
