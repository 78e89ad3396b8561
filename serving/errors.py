"""Typed errors raised anywhere on the request path, and their gRPC status codes and HTTP statuses
(the one place where that mapping lives; serving/frontend/status.py applies it at the boundary of
both transports). Unknown exceptions become INTERNAL (HTTP 500) with a generic message."""
from __future__ import annotations

import grpc


class ServingError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http_status: int = 500


class InvalidInput(ServingError):
    """The request is malformed; the message names the field or feature."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class ModelNotFound(ServingError):
    code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class Overloaded(ServingError):
    """The server is loading or shutting down, or a model changed under the request: retry elsewhere or
    later (HTTP 503)."""

    code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class QueueFull(Overloaded):
    """A queue or buffer is full for now: retry with backoff (HTTP 429 Too Many Requests)."""

    http_status = 429


class TooLarge(ServingError):
    """The request needs more than the server can ever give it (a front end's whole buffer): do not
    retry it as it is; split it."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 413


class DeadlineExpired(ServingError):
    """The client's deadline passed before the request ran; it was not executed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class DeviceLost(ServingError):
    """The model's device failed in a way that poisons the process (a CUDA error): this server is
    going down to be restarted; retry on another replica."""

    code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    MESSAGE = "the model's device failed; this server is restarting"

    def __init__(self, message: str = MESSAGE) -> None:
        super().__init__(message)


class ControlOff(ServingError):
    """Model load/unload asked of a server that polls its repository (serve --model-control poll)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 400


class AlreadyExists(ServingError):
    """A name the client registers is taken (a shared-memory region)."""

    code = grpc.StatusCode.ALREADY_EXISTS
    http_status = 409


class NotFound(ServingError):
    """A name the client asks about is not registered (a shared-memory region)."""

    code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class NoSpace(ServingError):
    """A write into the client's memory found no space: its shared-memory object is in a file system
    that is full (a page of it the client never wrote is allocated by the server's write). The request
    ran; retrying helps only once space is freed (HTTP 507 Insufficient Storage)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 507


class SharedMemoryFailed(ServingError):
    """Reading or writing a client's shared-memory region failed in the kernel (EIO): the message
    says which region; the server logs it."""

    code = grpc.StatusCode.INTERNAL
    http_status = 500


class Unsupported(ServingError):
    """A protocol extension this server runs without (its flag is off)."""

    code = grpc.StatusCode.UNIMPLEMENTED
    http_status = 501


class ExecutionFailed(ServingError):
    """Model execution failed for the batch this request was in."""

    code = grpc.StatusCode.INTERNAL
    http_status = 500


class Cancelled(ServingError):
    """The client went away before its request ran (the engine dropped it)."""

    code = grpc.StatusCode.CANCELLED
    http_status = 499


# Errors travel from the engine to the front ends as a number in a completion record (serving/ipc.py):
# 1 + the class's index here (0: answered).
ANSWER_ERRORS = (InvalidInput, ModelNotFound, Overloaded, DeadlineExpired, DeviceLost, ExecutionFailed, Cancelled,
                 QueueFull)
