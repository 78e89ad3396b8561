"""Closed-loop gRPC clients in separate processes (each sends a request, waits for the answer, sends
the next), the same for every server the bench measures (``served``, ``floor``). Requests are built
and serialized before the clock starts: the clients spend their time in gRPC, not in protobuf.
Throughput is all samples answered over the measuring window; latency is per request, at the client;
CPU is each client process's own (all its threads), over the same window."""
from __future__ import annotations

import multiprocessing as mp
import queue
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from bench.rows import Row, percentiles
from recserve.client import PLAINTEXT, ClientSecurity
from recserve.errors import UserError

PREDICT = "/recserve.v1.Inference/Predict"
REQUEST_SETS = 4  # rotated per client
WARMUP_S = 1.0
START_TIMEOUT_S = 300


@dataclass(frozen=True)
class RequestShape:
    """What the clients send: bags of Poisson(``ids_per_bag``) ids. With ``shared_features``, ranking
    requests (one user, B candidates): those features have one bag per request, of
    Poisson(``shared_ids_per_bag``) ids, sent once as shared bags (``shared``) or repeated for every
    sample (the same request in the per-sample form)."""

    ids_per_bag: float
    shared_features: Tuple[str, ...] = ()
    shared_ids_per_bag: float = 50.0
    shared: bool = False
    ids: str = "uniform"  # recserve/ids.py: how ids are drawn

    @property
    def form(self) -> str:
        return "shared" if self.shared else "per-sample"

    def requests(self, info, batch_size: int, seed: int) -> List[bytes]:
        """REQUEST_SETS serialized PredictRequests."""
        from recserve import wire
        from recserve.client import encode_sparse, random_request, ranking_request, repeat_shared
        from recserve.ids import IdDistribution
        from recserve.v1 import inference_pb2 as pb

        out, ids = [], IdDistribution.parse(self.ids)
        for i in range(REQUEST_SETS):
            shared = None
            if self.shared_features:
                dense, sparse, shared = ranking_request(info, batch_size, self.shared_features, self.ids_per_bag,
                                                        self.shared_ids_per_bag, seed=seed * 100 + i, ids=ids)
                if not self.shared:
                    sparse, shared = repeat_shared(sparse, shared, batch_size), None
            else:
                dense, sparse = random_request(info, batch_size, mean_ids=self.ids_per_bag, seed=seed * 100 + i,
                                               ids=ids)
            out.append(pb.PredictRequest(model_name=info.name, dense=wire.encode(dense),
                                         sparse=encode_sparse(sparse, shared)).SerializeToString())
        return out


def _client(target: str, security: ClientSecurity, model_info: bytes, batch_size: int, shape: RequestShape,
            seed: int, seconds: float, ready: "mp.Queue", go: "mp.Event", warmed: "mp.Queue", measure: "mp.Event",
            results: "mp.Queue") -> None:
    import grpc

    from recserve.v1 import inference_pb2 as pb

    info = pb.ModelInfo.FromString(model_info)
    requests = shape.requests(info, batch_size, seed)
    channel = security.channel(target, options=[("grpc.max_send_message_length", 1 << 30),
                                                ("grpc.max_receive_message_length", 1 << 30)])
    call = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=pb.PredictResponse.FromString)
    metadata = security.metadata()

    def predict(request: bytes, timeout: float):
        return call(request, timeout=timeout, metadata=metadata)

    ready.put(seed)
    go.wait()
    latencies, i, warm = [], 0, False
    try:
        warm_end = time.perf_counter() + WARMUP_S
        while time.perf_counter() < warm_end:
            predict(requests[i % REQUEST_SETS], timeout=60)
            i += 1
        warmed.put(seed)  # every client warm, the measured window opens for all at once
        warm = True
        measure.wait()
        cpu, begin = time.process_time(), time.perf_counter()
        end = begin + seconds
        while time.perf_counter() < end or not latencies:  # a window shorter than a call still times one
            t0 = time.perf_counter()
            predict(requests[i % REQUEST_SETS], timeout=60)
            latencies.append(time.perf_counter() - t0)
            i += 1
        results.put((latencies, time.perf_counter() - begin, time.process_time() - cpu,
                     sum(map(len, requests)) / len(requests)))
    except grpc.RpcError as e:
        results.put(f"{e.code().name}: {e.details()}")
    finally:
        if not warm:  # failed in its warm-up: the bench must not wait for it
            warmed.put(seed)
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
                shape: RequestShape, log: Optional[Callable[[str], None]] = None,
                security: ClientSecurity = PLAINTEXT, on_measure: Callable[[], None] = lambda: None) -> Row:
    """One row: ``clients`` processes sending Predict requests of ``batch_size`` samples to
    ``target`` for ``seconds`` each (after a warm-up), shaped from the serialized ``pb.ModelInfo``;
    over TLS and with a token where ``security`` says so. ``on_measure`` is called once every client
    is warm, just before the measured window opens (the server's counters are read there)."""
    ctx = mp.get_context("spawn")
    ready, go, warmed, measure, results = ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(target, security, model_info, batch_size, shape, c, seconds,
                                               ready, go, warmed, measure, results)) for c in range(clients)]
    for p in procs:
        p.start()
    try:
        # Every client has imported gRPC and built its requests before any of them sends one.
        _take(ready, procs, START_TIMEOUT_S)
        go.set()
        _take(warmed, procs, WARMUP_S + START_TIMEOUT_S)
        on_measure()
        measure.set()
        gathered = _take(results, procs, seconds + START_TIMEOUT_S)
    finally:
        measure.set()  # clients left waiting to measure (a failure before the window opened) go on and end
        for p in procs:
            p.join(30)
            if p.exitcode is None:
                p.kill()
    failed = [g for g in gathered if isinstance(g, str)]
    if failed:
        raise UserError(f"{mode} B={batch_size}: the server answered {failed[0]}")
    latencies = [lat for lats, _, _, _ in gathered for lat in lats]
    window = max(elapsed for _, elapsed, _, _ in gathered)
    p50, p99 = percentiles(latencies)
    row = Row(mode, batch_size, len(latencies) * batch_size / window, p50, p99, len(latencies), clients,
              client_cpu=sum(cpu for _, _, cpu, _ in gathered) / window, form=shape.form,
              request_bytes=sum(size for _, _, _, size in gathered) / len(gathered))
    if log:
        log(f"{mode:6s} B={batch_size:6d} {shape.form:10s} {row.samples_per_s:12,.0f} samples/s  p50 {p50:8.3f} ms  "
            f"p99 {p99:8.3f} ms  clients {clients}, client CPU {row.client_cpu:.2f}, "
            f"{row.request_bytes / 1024:,.0f} KiB per request")
    return row
