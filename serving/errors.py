"""Typed errors raised anywhere on the request path, and their gRPC status codes (the one place
where that mapping lives). Unknown exceptions become INTERNAL with a generic message."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

import grpc

log = logging.getLogger("serving.errors")


class ServingError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidInput(ServingError):
    """The request is malformed; the message names the field or feature."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ModelNotFound(ServingError):
    code = grpc.StatusCode.NOT_FOUND


class Overloaded(ServingError):
    """The model's queue is full, or the server is shutting down: retry elsewhere or later."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExpired(ServingError):
    """The client's deadline passed before the request ran; it was not executed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class DeviceLost(ServingError):
    """The model's device failed in a way that poisons the process (a CUDA error): this server is
    going down to be restarted; retry on another replica."""

    code = grpc.StatusCode.UNAVAILABLE
    MESSAGE = "the model's device failed; this server is restarting"

    def __init__(self, message: str = MESSAGE) -> None:
        super().__init__(message)


class ExecutionFailed(ServingError):
    """Model execution failed for the batch this request was in."""

    code = grpc.StatusCode.INTERNAL


class Cancelled(ServingError):
    """The client went away before its request ran (the engine dropped it)."""

    code = grpc.StatusCode.CANCELLED


# Errors travel from the engine to the front ends by class name (serving/ipc.py ``Done.error``).
BY_NAME = {cls.__name__: cls for cls in (InvalidInput, ModelNotFound, Overloaded, DeadlineExpired, DeviceLost,
                                         ExecutionFailed, Cancelled)}
T = TypeVar("T")
MAX_MESSAGE_CHARS = 1024  # status messages travel as metadata (8 KiB limit): never echo unbounded input


class Call:
    """What the boundary learns of a request while it runs: the model label for the metrics, set
    once the name is known to be a loaded model (clients cannot grow the label set)."""

    model = "-"


def grpc_errors(rpc: str):
    """Decorate an async servicer method ``(self, body, context, call) -> bytes``: typed errors ->
    status codes, anything else -> INTERNAL; every request, whatever its outcome, is counted once
    through ``self.metrics.request_done``."""

    def wrap(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(method)
        async def handler(self: Any, body: bytes, context: grpc.aio.ServicerContext) -> T:
            started = time.monotonic()
            call = Call()
            code, message, response = grpc.StatusCode.OK, "", None
            try:
                response = await method(self, body, context, call)
            except ServingError as e:
                code, message = e.code, (str(e) or type(e).__name__)[:MAX_MESSAGE_CHARS]
            except asyncio.CancelledError:  # the client went away or its deadline passed: gRPC ends the call
                remaining = context.time_remaining()
                gone = grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 \
                    else grpc.StatusCode.CANCELLED
                self.metrics.request_done(rpc, call.model, gone, time.monotonic() - started)
                raise
            except Exception:  # noqa: BLE001 - the boundary: never leak internals to clients
                log.exception("%s on model %s failed", rpc, call.model)
                code, message = grpc.StatusCode.INTERNAL, "internal error"
            self.metrics.request_done(rpc, call.model, code, time.monotonic() - started)
            if code != grpc.StatusCode.OK:
                await context.abort(code, message)
            return response

        return handler

    return wrap
