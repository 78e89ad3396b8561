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

    def __exit__(self, *exc) -> None:
        self.steps[self.name] = (self.begin, time.monotonic())


_UNTIMED = contextlib.nullcontext()


def grpc_errors(rpc: str, service: str = "recserve.v1.Inference"):
    """Decorate an async servicer method ``(self, body, context, call) -> bytes``: typed errors ->
    status codes, anything else -> INTERNAL; every request, whatever its outcome, is counted once
    through ``self.metrics.request_done``, and traced where tracing is on (serving/frontend/tracing.py)."""

    def wrap(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(method)
        async def handler(self: Any, body: bytes, context: grpc.aio.ServicerContext) -> T:
            started = time.monotonic()
            call = Call(traced=tracing.enabled())
            code, message, response = grpc.StatusCode.OK, "", None

            def ended(code: grpc.StatusCode, message: str) -> None:
                seconds = time.monotonic() - started
                self.metrics.request_done(rpc, call.model, call.version, code, seconds)
                access.record(rpc, context.peer(), call.model, call.version, call.batch_size, code, seconds)
                if call.steps is not None:
                    tracing.record(f"{service}/{rpc}", rpc, context.invocation_metadata(), call.steps, started,
                                   code, message, call.model, call.version)

            try:
                response = await method(self, body, context, call)
            except ServingError as e:
                code, message = e.code, (str(e) or type(e).__name__)[:MAX_MESSAGE_CHARS]
            except asyncio.CancelledError:  # the client went away or its deadline passed: gRPC ends the call
                remaining = context.time_remaining()
                gone = grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 \
                    else grpc.StatusCode.CANCELLED
                ended(gone, "the client went away")
                raise
            except Exception:  # noqa: BLE001 - the boundary: never leak internals to clients
                log.exception("%s on model %s failed", rpc, call.model)
                code, message = grpc.StatusCode.INTERNAL, "internal error"
            ended(code, message)
            if code != grpc.StatusCode.OK:
                await context.abort(code, message)
            return response

        return handler

    return wrap
