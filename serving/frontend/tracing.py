"""OpenTelemetry spans per request, off unless ``serve --otlp-endpoint`` (OpenTelemetry is an
optional dependency: ``pip install 'recserve[tracing]'``).

Each RPC gives one SERVER span, ``<service>/<rpc>`` (an HTTP/REST request: its OIP method's name),
child of the caller's span where the request metadata (HTTP: headers) carries a W3C
``traceparent`` (a malformed one: a new trace, nothing logged), with one child span per step of the
request path: ``decode`` (read and check the request, front end), ``queue`` (waiting for a batch,
engine), ``model`` (the batch's model call, engine) and ``encode`` (the response, front end). The
engine measures its two steps and sends their times back with the answer (serving/ipc.py
``COMPLETE`` records); the front end creates all spans after the request, with the measured start
and end times, so that tracing adds no IPC and no work inside the engine. CLOCK_MONOTONIC is one
clock for all processes of a host.

The tracer is this process's own (not OpenTelemetry's global provider): the server's settings
decide it, whatever else the process has configured.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional
from urllib.parse import urlsplit

import grpc

from recserve.errors import UserError

log = logging.getLogger("serving.tracing")
SHUTDOWN_S = 0.5  # of the grace period's margin (the supervisor waits grace + 0.5 s for a front end)
_tracer: Any = None
# OpenTelemetry warns of each malformed traceparent or tracestate a caller sends, quoting its text:
# a line of the client's choosing in the server's log per request. W3C's answer is a new trace, quietly.
CALLER_CONTEXT_LOGGERS = ("opentelemetry.trace.propagation.tracecontext", "opentelemetry.trace.span")
_provider: Any = None


def check(endpoint: Optional[str]) -> None:
    """UserError where :func:`configure` would fail: OpenTelemetry not installed, an endpoint that does
    not parse as a URL (the exporter's traceback otherwise)."""
    if not endpoint:
        return
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: F401
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: F401
    except ImportError:
        raise UserError("--otlp-endpoint needs OpenTelemetry: pip install 'recserve[tracing]'") from None
    try:
        urlsplit(endpoint)
    except ValueError as e:
        raise UserError(f"--otlp-endpoint {endpoint}: not a URL ({e})") from None


def configure(endpoint: Optional[str], sample_ratio: float = 1.0) -> None:
    """Spans to an OTLP/gRPC collector at ``endpoint`` (None: tracing off)."""
    if not endpoint:
        return
    check(endpoint)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    use(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)), sample_ratio)


def use(processor, sample_ratio: float = 1.0) -> None:
    """Spans to ``processor`` (an OpenTelemetry SpanProcessor; tests pass an in-memory one)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    global _tracer, _provider
    for name in CALLER_CONTEXT_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    _provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
                               resource=Resource.create({"service.name": "recserve"}), shutdown_on_exit=False)
    _provider.add_span_processor(processor)
    _tracer = _provider.get_tracer("recserve.serving")


def enabled() -> bool:
    return _tracer is not None


def shutdown(timeout_s: float = SHUTDOWN_S) -> bool:
    """Send what is buffered and stop (the process exits by os._exit: no atexit hook runs), waiting
    at most ``timeout_s``: an exporter retrying a collector that is down (with backoff, seconds)
    must not keep a stopping front end past the grace period. False: spans were left out."""
    global _tracer, _provider
    provider, _tracer, _provider = _provider, None, None
    if provider is None:
        return True
    flush = threading.Thread(target=provider.shutdown, name="otlp-flush", daemon=True)
    flush.start()
    flush.join(timeout_s)
    if flush.is_alive():
        log.warning("the last spans were not sent within %.1f s of stopping (is the OTLP collector reachable?); "
                    "left out", timeout_s)
    return not flush.is_alive()


def record(name: str, rpc: str, metadata, steps: dict, started: float, code: grpc.StatusCode, message: str,
           model: str, version: str, transport: str = "grpc") -> None:
    """The spans of one finished request: ``steps`` maps a step's name to its (start, end) and
    ``started`` is the request's receipt, all ``time.monotonic()``."""
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    now, now_ns = time.monotonic(), time.time_ns()

    def ns(t: float) -> int:
        return now_ns - int((now - t) * 1e9)

    parent = TraceContextTextMapPropagator().extract({k: v for k, v in metadata or () if isinstance(v, str)})
    span = _tracer.start_span(name, context=parent, kind=SpanKind.SERVER, start_time=ns(started), attributes={
        "rpc.system": transport, "rpc.method": rpc, "rpc.grpc.status_code": code.value[0],
        "recserve.model": model, "recserve.version": version})
    inside = trace.set_span_in_context(span)
    for step, (begin, end) in steps.items():
        _tracer.start_span(step, context=inside, start_time=ns(begin)).end(end_time=ns(end))
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"))
    span.end(end_time=now_ns)
