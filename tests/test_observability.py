"""What an operator reads off the server: OpenTelemetry spans per request (in-process with the SDK's
in-memory exporter, and `recserve serve --otlp-endpoint` into a collector), JSON logs from every
process, and the one /metrics endpoint of a server of several processes."""
import json
import os
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from servers import ROOT, InProcessServer
from test_reliability import _info

from recserve.client import Client, random_request
from recserve.local import ListeningProcess, free_port, samples, scrape, wait_serving
from serving.frontend import tracing

otel = pytest.importorskip("opentelemetry.sdk.trace", reason="the [tracing] extra is not installed")

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def _traceparent(sampled: bool = True):
    return (("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-{'01' if sampled else '00'}"),)


@pytest.fixture
def spans():
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.use(SimpleSpanProcessor(exporter))
    yield exporter
    tracing.shutdown()


def test_spans_per_request_follow_the_callers_trace_context(repo, artifact, spans):
    server = InProcessServer(repo)
    try:
        dense, sparse = random_request(_info(artifact), 3, seed=21)
        with Client(server.target, metadata=_traceparent()) as client:
            client.predict("demo", dense, sparse)
        [decode, queue, model, encode, root] = spans.get_finished_spans()
        assert root.name == "recserve.v1.Inference/Predict" and root.kind.name == "SERVER"
        assert format(root.context.trace_id, "032x") == TRACE_ID and format(root.parent.span_id, "016x") == PARENT_ID
        assert [s.name for s in (decode, queue, model, encode)] == ["decode", "queue", "model", "encode"]
        assert all(s.parent.span_id == root.context.span_id and s.context.trace_id == root.context.trace_id
                   for s in (decode, queue, model, encode))
        # The steps follow each other: receipt, decode, queued in the engine, model call, encode, response.
        times = [root.start_time, decode.start_time, decode.end_time, queue.start_time, queue.end_time,
                 model.start_time, model.end_time, encode.start_time, encode.end_time, root.end_time]
        assert times == sorted(times) and queue.end_time == model.start_time
        assert dict(root.attributes) == {"rpc.system": "grpc", "rpc.method": "Predict", "rpc.grpc.status_code": 0,
                                         "recserve.model": "demo", "recserve.version": "1"}
        assert root.status.is_ok

        # A refused request: its status and the steps it went through; a lookup without caller: a new trace.
        spans.clear()
        with Client(server.target) as client:
            with pytest.raises(grpc.RpcError):
                client.predict("nope", dense, sparse)
            client.lookup("demo", sparse)
        [decode, root_error, *lookup] = spans.get_finished_spans()
        assert (decode.name, root_error.status.status_code.name) == ("decode", "ERROR")
        assert root_error.status.description.startswith("NOT_FOUND: model 'nope' is not loaded")
        assert root_error.attributes["recserve.model"] == "-" and root_error.attributes["rpc.grpc.status_code"] == 5
        assert [s.name for s in lookup] == ["decode", "queue", "model", "encode", "recserve.v1.Inference/Lookup"]
        assert lookup[-1].parent is None and format(lookup[-1].context.trace_id, "032x") != TRACE_ID

        # A caller that did not sample its trace: nothing recorded.
        spans.clear()
        with Client(server.target, metadata=_traceparent(sampled=False)) as client:
            client.predict("demo", dense, sparse)
        assert spans.get_finished_spans() == ()
    finally:
        server.stop()


class Collector:
    """An OTLP/gRPC trace collector on a loopback port: keeps every span it is sent."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(inner, request, context):
                with self.lock:
                    self.spans += [s for r in request.resource_spans for ss in r.scope_spans for s in ss.spans]
                return trace_service_pb2.ExportTraceServiceResponse()

        self.spans, self.lock = [], threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


def test_serve_with_otlp_json_logs_and_one_metrics_endpoint_over_two_front_ends(repo, artifact):
    collector = Collector()
    metrics_port = free_port()
    server = ListeningProcess(
        [sys.executable, "-m", "recserve", "--log-format", "json", "serve", "--repo", str(repo), "--port", "0",
         "--device", "cpu", "--metrics-port", str(metrics_port), "--frontends", "2",
         "--otlp-endpoint", f"http://127.0.0.1:{collector.port}"],
        ready_timeout_s=120, env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=str(ROOT))
    try:
        assert wait_serving(server.target, 120), server.output()
        dense, sparse = random_request(_info(artifact), 2, seed=22)
        calls = 12
        for _ in range(calls):  # a connection each: the kernel spreads them over both front ends
            with Client(server.target, metadata=_traceparent()) as client:
                client.predict("demo", dense, sparse)
        text = scrape(metrics_port)
    finally:
        code = server.stop()
        collector.server.stop(0)
    assert code == 0
    # One endpoint has every front end's requests, and each process's standard metrics.
    assert sum(s.value for s in samples(text, "recserve_requests_total", rpc="Predict", model="demo", version="1",
                                        code="OK")) == calls
    cpu = {s.labels["process"] for s in samples(text, "process_cpu_seconds_total")}
    assert cpu == {"supervisor", "engine", "frontend-0", "frontend-1"}
    memory = {s.labels["process"]: s.value for s in samples(text, "process_resident_memory_bytes")}
    assert set(memory) == cpu and all(v > 0 for v in memory.values())
    assert [s.labels["implementation"] for s in samples(text, "python_info")] == ["CPython"]
    # JSON logs: every line but the listening line on stdout is one object, from every process.
    lines = [line for line in server.lines if not line.startswith("recserve: listening on")]
    entries = [json.loads(line) for line in lines]
    assert all(set(e) >= {"ts", "level", "logger", "message", "pid", "role"} for e in entries), lines
    roles = {e["role"]: e["pid"] for e in entries}
    assert {"supervisor", "engine"} <= set(roles) and len(set(roles.values())) == len(roles)
    assert any(e["role"] == "engine" and e["message"].startswith("loaded demo version 1") for e in entries)
    # The spans reached the collector by the time the server stopped (the front ends flush on exit).
    roots = [s for s in collector.spans if s.name == "recserve.v1.Inference/Predict"]
    assert len(roots) == calls and {s.trace_id.hex() for s in roots} == {TRACE_ID}
    assert sorted(s.name for s in collector.spans if s.name != roots[0].name) == sorted(
        ["decode", "queue", "model", "encode"] * calls)


def test_trace_sample_ratio_keeps_new_traces_in_its_share_and_follows_a_sampled_caller(repo, artifact):
    """--trace-sample-ratio 0: a request that starts its own trace leaves no span; one whose caller's
    traceparent says sampled is traced all the same (the caller's decision wins)."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.use(SimpleSpanProcessor(exporter), sample_ratio=0.0)
    server = InProcessServer(repo)
    try:
        dense, sparse = random_request(_info(artifact), 3, seed=22)
        with Client(server.target) as client:
            for _ in range(20):
                client.predict("demo", dense, sparse)
        assert exporter.get_finished_spans() == ()
        with Client(server.target, metadata=_traceparent()) as client:
            client.predict("demo", dense, sparse)
        names = sorted(s.name for s in exporter.get_finished_spans())
        assert names == ["decode", "encode", "model", "queue", "recserve.v1.Inference/Predict"]
    finally:
        server.stop()
        tracing.shutdown()


def test_http_requests_are_traced_as_grpc_ones(repo, artifact, spans):
    """An OIP infer over HTTP/REST (serve --http-port): the caller's traceparent header, the same steps."""
    import urllib.request

    server = InProcessServer(repo, settings={"http_port": 0})
    try:
        info = _info(artifact)
        body = json.dumps({"inputs": [{"name": "dense", "datatype": "FP32", "shape": [1, info.dense_features],
                                       "data": [0.25] * info.dense_features}], "outputs": [{"name": "ctr"}]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{server.frontend.http_port}/v2/models/demo/infer", body,
                                         {"traceparent": dict(_traceparent())["traceparent"]})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
        [decode, queue, model, encode, root] = spans.get_finished_spans()
        assert root.name == "inference.GRPCInferenceService/ModelInfer" and root.kind.name == "SERVER"
        assert format(root.context.trace_id, "032x") == TRACE_ID and format(root.parent.span_id, "016x") == PARENT_ID
        assert [s.name for s in (decode, queue, model, encode)] == ["decode", "queue", "model", "encode"]
        times = [root.start_time, decode.start_time, decode.end_time, queue.start_time, queue.end_time,
                 model.start_time, model.end_time, encode.start_time, encode.end_time, root.end_time]
        assert times == sorted(times)
        assert dict(root.attributes) == {"rpc.system": "http", "rpc.method": "ModelInfer", "rpc.grpc.status_code": 0,
                                         "recserve.model": "demo", "recserve.version": "1"}
    finally:
        server.stop()


def test_stopping_with_a_collector_down_waits_a_bounded_time_for_the_last_spans():
    """The OTLP exporter retries a collector that does not answer with backoff (seconds): a front end
    stopping after its drain must still exit within the supervisor's margin."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tracing.configure(f"http://127.0.0.1:{port}")
    with tracing._tracer.start_as_current_span("unsent"):
        pass
    began = time.monotonic()
    tracing.shutdown(timeout_s=0.3)
    assert time.monotonic() - began < 1.5 and not tracing.enabled()


def test_a_callers_malformed_trace_context_starts_a_new_trace_without_a_log_line(spans, caplog):
    """OpenTelemetry's propagator logged a warning for each malformed traceparent or tracestate, the
    tracestate's text quoted: any client could write a line of its choosing into the server's log
    with every request. The context is ignored (W3C: a new trace starts), and nothing is logged."""
    import logging

    good = f"00-{TRACE_ID}-{PARENT_ID}-01"
    now = time.monotonic()
    with caplog.at_level(logging.DEBUG):
        for metadata in ((("traceparent", "x" * 600),), (("traceparent", good), ("tracestate", "a=ok,INJECTED LINE")),
                         (("traceparent", good), ("tracestate", ",".join(f"k{i}=v" for i in range(40))))):
            tracing.record("recserve.v1.Inference/Predict", "Predict", metadata, {}, now, grpc.StatusCode.OK, "",
                           "demo", "1")
    assert [r for r in caplog.records if r.name.startswith("opentelemetry")] == []
    [fresh, *followed] = spans.get_finished_spans()
    assert fresh.parent is None and format(fresh.context.trace_id, "032x") != TRACE_ID
    assert [format(s.parent.span_id, "016x") for s in followed] == [PARENT_ID, PARENT_ID]
