"""The boundary of every RPC: typed errors (serving/errors.py) -> status codes, anything else ->
INTERNAL with a generic message; every request counted once, traced where tracing is on, and
access-logged where that is on (serving/frontend/access.py)."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Any, Awaitable, Callable, Dict, Optional, Tuple, TypeVar

import grpc

from serving.errors import ServingError
from serving.frontend import access, tracing
from serving.metrics import NO_MODEL, NO_VERSION

log = logging.getLogger("serving.errors")
T = TypeVar("T")
MAX_MESSAGE_CHARS = 1024  # status messages travel as metadata (8 KiB limit): never echo unbounded input


class Call:
    """What the boundary learns of a request while it runs, for the metrics: the model label, set
    once the name is known to be a loaded model (clients cannot grow the label set), and the version
    that answered (or that the request was checked against, if it failed)."""

    model = NO_MODEL
    version = NO_VERSION
    batch_size = 0  # samples, once decoded (the access log's)

    def __init__(self, traced: bool = False) -> None:
        # step -> (start, end), time.monotonic(), for the request's spans; None: not traced.
        self.steps: Optional[Dict[str, Tuple[float, float]]] = {} if traced else None

    def step(self, name: str):
        """``with call.step("decode"): ...`` times a step of the request (where it is traced)."""
        return _Step(self.steps, name) if self.steps is not None else _UNTIMED


class _Step:
    def __init__(self, steps: Dict[str, Tuple[float, float]], name: str) -> None:
        self.steps, self.name = steps, name

    def __enter__(self) -> None:
        self.begin = time.monotonic()

    def __exit__(self, *exc) -> None:  # a step timed in two parts (transport, then protocol) is one span
        begin = self.steps[self.name][0] if self.name in self.steps else self.begin
        self.steps[self.name] = (begin, time.monotonic())


_UNTIMED = contextlib.nullcontext()


class _Boundary:
    """One request at the boundary, whatever the transport: its outcome as a status code and
    message (typed errors -> their code, anything else -> INTERNAL, logged), counted once and traced."""

    def __init__(self, metrics, rpc: str, service: str) -> None:
        self.metrics, self.rpc, self.service = metrics, rpc, service
        self.started = time.monotonic()
        self.call = Call(traced=tracing.enabled())

    def failed(self, e: Exception) -> Tuple[grpc.StatusCode, str]:
        if isinstance(e, ServingError):
            return e.code, (str(e) or type(e).__name__)[:MAX_MESSAGE_CHARS]
        log.error("%s on model %s failed", self.rpc, self.call.model, exc_info=e)
        return grpc.StatusCode.INTERNAL, "internal error"

    def ended(self, code: grpc.StatusCode, message: str, metadata, peer: str, transport: str = "grpc") -> None:
        call = self.call
        seconds = time.monotonic() - self.started
        self.metrics.request_done(self.rpc, call.model, call.version, code, seconds)
        access.record(self.rpc, peer, call.model, call.version, call.batch_size, code, seconds)
        if call.steps is not None:
            tracing.record(f"{self.service}/{self.rpc}", self.rpc, metadata, call.steps, self.started, code, message,
                           call.model, call.version, transport)


def grpc_errors(rpc: str, service: str = "recserve.v1.Inference"):
    """Decorate an async servicer method ``(self, body, context, call) -> bytes``: typed errors ->
    status codes, anything else -> INTERNAL; every request, whatever its outcome, is counted once
    through ``self.metrics.request_done``, and traced where tracing is on (serving/frontend/tracing.py)."""

    def wrap(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(method)
        async def handler(self: Any, body: bytes, context: grpc.aio.ServicerContext) -> T:
            boundary = _Boundary(self.metrics, rpc, service)
            code, message, response = grpc.StatusCode.OK, "", None
            try:
                response = await method(self, body, context, boundary.call)
            except asyncio.CancelledError:  # the client went away or its deadline passed: gRPC ends the call
                remaining = context.time_remaining()
                gone = grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 \
                    else grpc.StatusCode.CANCELLED
                boundary.ended(gone, "the client went away", context.invocation_metadata(), context.peer())
                raise
            except Exception as e:  # noqa: BLE001 - the boundary: never leak internals to clients
                code, message = boundary.failed(e)
            boundary.ended(code, message, context.invocation_metadata(), context.peer())
            if code != grpc.StatusCode.OK:
                await context.abort(code, message)
            return response

        return handler

    return wrap


# HTTP statuses of the codes no typed error carries (serving/errors.py gives each error's own).
HTTP_STATUS = {grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.CANCELLED: 499}


def http_errors(rpc: str, service: str = "inference.GRPCInferenceService"):
    """``grpc_errors`` for an aiohttp handler method ``(self, request, call) -> web.Response``: the
    same counting (under the gRPC method's name and code) and tracing; an error is answered with the
    error's HTTP status (serving/errors.py) and the OIP REST body ``{"error": message}``."""
    from aiohttp import web

    def wrap(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(method)
        async def handler(self: Any, request: "web.Request") -> "web.StreamResponse":
            boundary = _Boundary(self.metrics, rpc, service)
            headers = [(k.lower(), v) for k, v in request.headers.items()]
            try:
                response = await method(self, request, boundary.call)
            except asyncio.CancelledError:  # the connection closed under the request
                boundary.ended(grpc.StatusCode.CANCELLED, "the client went away", headers, peer(request), "http")
                raise
            except Exception as e:  # noqa: BLE001 - the boundary: never leak internals to clients
                code, message = boundary.failed(e)
                boundary.ended(code, message, headers, peer(request), "http")
                status = e.http_status if isinstance(e, ServingError) else HTTP_STATUS[code]
                return web.json_response({"error": message}, status=status)
            boundary.ended(grpc.StatusCode.OK, "", headers, peer(request), "http")
            return response

        return handler

    return wrap


def peer(request) -> str:
    """An HTTP client's address as gRPC writes a peer (``ipv4:10.0.0.7:51234``, ``ipv6:[::1]:51234``)."""
    transport = getattr(request, "transport", None)
    peername = transport.get_extra_info("peername") if transport is not None else None
    if not peername:
        return "unknown"
    host, port = peername[0], peername[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
