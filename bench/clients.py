"""Closed-loop gRPC clients in separate processes (each sends a request, waits for the answer, sends
the next), the same for every server the bench measures (``served``, ``floor``). Requests are built
and serialized before the clock starts: the clients spend their time in gRPC, not in protobuf.
Throughput is all samples answered over the measuring window; latency is per request, at the client;
CPU is each client process's own (all its threads), over the same window."""
from __future__ import annotations

import multiprocessing as mp
import queue
import time
from typing import Callable, Optional

from bench.rows import Row, percentiles
from recserve.errors import UserError

PREDICT = "/recserve.v1.Inference/Predict"
REQUEST_SETS = 4  # rotated per client
WARMUP_S = 1.0
START_TIMEOUT_S = 300


def _client(target: str, model_info: bytes, batch_size: int, ids_per_bag: float, seed: int, seconds: float,
            ready: "mp.Queue", go: "mp.Event", results: "mp.Queue", ids: str = "uniform") -> None:
    import grpc

    from recserve import wire
    from recserve.client import encode_sparse, random_request
    from recserve.ids import IdDistribution
    from recserve.v1 import inference_pb2 as pb

    info = pb.ModelInfo.FromString(model_info)
    requests = []
    for i in range(REQUEST_SETS):
        dense, sparse = random_request(info, batch_size, mean_ids=ids_per_bag, seed=seed * 100 + i,
                                       ids=IdDistribution.parse(ids))
        requests.append(pb.PredictRequest(model_name=info.name, dense=wire.encode(dense),
                                          sparse=encode_sparse(sparse)).SerializeToString())
    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 1 << 30),
                                                     ("grpc.max_receive_message_length", 1 << 30)])
    predict = channel.unary_unary(PREDICT, request_serializer=None,
                                  response_deserializer=pb.PredictResponse.FromString)
    ready.put(seed)
    go.wait()
    latencies, i = [], 0
    try:
        warm_end = time.perf_counter() + WARMUP_S
        while time.perf_counter() < warm_end:
            predict(requests[i % REQUEST_SETS], timeout=60)
            i += 1
        cpu, begin = time.process_time(), time.perf_counter()
        end = begin + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            predict(requests[i % REQUEST_SETS], timeout=60)
            latencies.append(time.perf_counter() - t0)
            i += 1
        results.put((latencies, time.perf_counter() - begin, time.process_time() - cpu))
    except grpc.RpcError as e:
        results.put(f"{e.code().name}: {e.details()}")
    finally:
        channel.close()


def _take(q: "mp.Queue", procs: list, timeout_s: float) -> list:
    """One item from each client; a client that crashed fails the run at once, not at the timeout."""
    items, deadline = [], time.monotonic() + timeout_s
    while len(items) < len(procs):
        try:
            items.append(q.get(timeout=1.0))
        except queue.Empty:
            crashed = [p.exitcode for p in procs if p.exitcode]
            if crashed or time.monotonic() > deadline:
                raise RuntimeError(f"a client process exited with code {crashed[0]}" if crashed
                                   else f"the clients did not report within {timeout_s:.0f}s")
    return items


def closed_loop(mode: str, target: str, model_info: bytes, batch_size: int, clients: int, seconds: float,
                ids_per_bag: float, log: Optional[Callable[[str], None]] = None, ids: str = "uniform") -> Row:
    """One row: ``clients`` processes sending Predict requests of ``batch_size`` samples to
    ``target`` for ``seconds`` each (after a warm-up), shaped from the serialized ``pb.ModelInfo``."""
    ctx = mp.get_context("spawn")
    ready, go, results = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(target, model_info, batch_size, ids_per_bag, c, seconds, ready, go,
                                               results, ids)) for c in range(clients)]
    for p in procs:
        p.start()
    try:
        # Every client has imported gRPC and built its requests before any of them sends one.
        _take(ready, procs, START_TIMEOUT_S)
        go.set()
        gathered = _take(results, procs, WARMUP_S + seconds + START_TIMEOUT_S)
    finally:
        for p in procs:
            p.join(30)
            if p.exitcode is None:
                p.kill()
    failed = [g for g in gathered if isinstance(g, str)]
    if failed:
        raise UserError(f"{mode} B={batch_size}: the server answered {failed[0]}")
    latencies = [lat for lats, _, _ in gathered for lat in lats]
    window = max(elapsed for _, elapsed, _ in gathered)
    p50, p99 = percentiles(latencies)
    row = Row(mode, batch_size, len(latencies) * batch_size / window, p50, p99, len(latencies), clients,
              client_cpu=sum(cpu for _, _, cpu in gathered) / window)
    if log:
        log(f"{mode:6s} B={batch_size:6d}  {row.samples_per_s:12,.0f} samples/s  p50 {p50:8.3f} ms  "
            f"p99 {p99:8.3f} ms  clients {clients}, client CPU {row.client_cpu:.2f}")
    return row
