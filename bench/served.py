"""The served artifact: ``recserve serve`` in its own process, closed-loop gRPC clients in separate
processes (each sends a request, waits for the answer, sends the next). Throughput is all samples
answered over the measuring window; latency is per request, at the client."""
from __future__ import annotations

import multiprocessing as mp
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable, Dict, List, Optional

from bench.bare import Row, percentiles
from recserve.errors import UserError

READY_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, repo: Path, device: str, max_batch_size: int, max_delay_ms: float, metrics_port: int,
                 workers: int = 1, replicas: str = "1", poll_interval: float = 0.0, cuda_graphs: bool = True) -> None:
        self.metrics_port = metrics_port
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "recserve", "--log-level", "WARNING", "serve", "--repo", str(repo), "--port", "0",
             "--device", device, "--metrics-port", str(metrics_port), "--max-batch-size", str(max_batch_size),
             "--max-delay-ms", str(max_delay_ms), "--max-queue", "1024", "--poll-interval", str(poll_interval),
             "--max-message-mb", "1024", "--max-ids-per-request", str(1 << 28), "--workers", str(workers),
             "--replicas", str(replicas)]
            + ([] if cuda_graphs else ["--no-cuda-graphs"]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.target = None
        output = []
        end = time.time() + READY_TIMEOUT_S
        while time.time() < end:
            line = self.proc.stdout.readline()
            if not line:
                break
            output.append(line)
            m = re.search(r"listening on ([\d.]+:\d+)", line)
            if m:
                self.target = m.group(1)
                break
        if self.target is None:
            raise RuntimeError("recserve serve did not start:\n" + "".join(output[-30:]))

    def metric(self, name: str) -> Dict[str, float]:
        """{labels: value} of one metric from /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                key, value = line.rsplit(" ", 1)
                out[key[len(name):]] = float(value)
        return out

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def _client(target: str, model: str, batch_size: int, ids_per_bag: float, seed: int, warmup_s: float,
            seconds: float, start_at: float, results: "mp.Queue") -> None:
    import grpc

    from recserve import wire
    from recserve.client import encode_sparse, random_request
    from recserve.v1 import inference_pb2 as pb
    from recserve.v1 import inference_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 1 << 30),
                                                     ("grpc.max_receive_message_length", 1 << 30)])
    stub = pb_grpc.InferenceStub(channel)
    info = stub.GetModelInfo(pb.GetModelInfoRequest(model_name=model), timeout=60).models[0]
    requests = []
    for i in range(4):
        dense, (keys, lengths, values) = random_request(info, batch_size, mean_ids=ids_per_bag, seed=seed * 100 + i)
        requests.append(pb.PredictRequest(model_name=model, dense=wire.encode(dense),
                                          sparse=encode_sparse((keys, lengths, values))).SerializeToString())
    predict = channel.unary_unary("/recserve.v1.Inference/Predict", request_serializer=None,
                                  response_deserializer=pb.PredictResponse.FromString)
    while time.time() < start_at:
        time.sleep(0.001)
    latencies, i = [], 0
    try:
        warm_end = time.perf_counter() + warmup_s
        while time.perf_counter() < warm_end:
            predict(requests[i % 4], timeout=60)
            i += 1
        begin = time.perf_counter()
        end = begin + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            predict(requests[i % 4], timeout=60)
            latencies.append(time.perf_counter() - t0)
            i += 1
        results.put((latencies, time.perf_counter() - begin))
    except grpc.RpcError as e:
        results.put(f"{e.code().name}: {e.details()}")
    finally:
        channel.close()


def bench_served(server: ServerProcess, model: str, batch_sizes: List[int], concurrency: int, seconds: float,
                 ids_per_bag: float, log: Optional[Callable[[str], None]] = None) -> List[Row]:
    ctx = mp.get_context("spawn")
    rows = []
    for b in batch_sizes:
        results = ctx.Queue()
        start_at = time.time() + 3.0  # after every client has imported and built its requests
        procs = [ctx.Process(target=_client, args=(server.target, model, b, ids_per_bag, c, 1.0, seconds, start_at,
                                                   results)) for c in range(concurrency)]
        for p in procs:
            p.start()
        gathered = [results.get(timeout=seconds + 300) for _ in procs]
        for p in procs:
            p.join(30)
        failed = [g for g in gathered if isinstance(g, str)]
        if failed:
            raise UserError(f"served B={b}: the server answered {failed[0]}")
        latencies = [lat for lats, _ in gathered for lat in lats]
        window = max(elapsed for _, elapsed in gathered)
        p50, p99 = percentiles(latencies)
        rows.append(Row("served", b, len(latencies) * b / window, p50, p99, len(latencies), concurrency))
        if log:
            log(f"served B={b:6d}  {rows[-1].samples_per_s:12,.0f} samples/s  p50 {p50:8.3f} ms  p99 {p99:8.3f} ms"
                f"  ({concurrency} clients)")
    return rows
