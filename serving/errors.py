"""Typed errors raised anywhere on the request path, and their gRPC status codes (the one place
where that mapping lives). Unknown exceptions become INTERNAL with a generic message."""
from __future__ import annotations

import functools
import logging
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


class ExecutionFailed(ServingError):
    """Model execution failed for the batch this request was in."""

    code = grpc.StatusCode.INTERNAL


class MalformedRequest:
    """What the lenient deserializer hands a handler for bytes that are not the expected message
    (grpc would otherwise answer UNKNOWN before any handler runs)."""

    def __init__(self, message_type: str) -> None:
        self.message_type = message_type


T = TypeVar("T")


def grpc_errors(rpc: str):
    """Decorate an async servicer method: typed errors -> status codes; anything else -> INTERNAL.
    The servicer's ``request_done(rpc, model_name, code)`` is called once per request (metrics)."""

    def wrap(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(method)
        async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
            model = getattr(request, "model_name", "") or ""
            try:
                if isinstance(request, MalformedRequest):
                    raise InvalidInput(f"the request body is not a valid {request.message_type} message")
                response = await method(self, request, context)
            except ServingError as e:
                self.request_done(rpc, model, e.code)
                await context.abort(e.code, str(e) or type(e).__name__)
            except Exception:  # noqa: BLE001 - the boundary: never leak internals to clients
                log.exception("%s on model %r failed", rpc, model)
                self.request_done(rpc, model, grpc.StatusCode.INTERNAL)
                await context.abort(grpc.StatusCode.INTERNAL, "internal error")
            self.request_done(rpc, model, grpc.StatusCode.OK)
            return response

        return handler

    return wrap
