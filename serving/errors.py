"""Typed errors raised anywhere on the request path, and their gRPC status codes (the one place
where that mapping lives; serving/frontend/status.py applies it at the boundary). Unknown
exceptions become INTERNAL with a generic message."""
from __future__ import annotations


import grpc




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


class TooLarge(ServingError):
    """The request needs more than the server can ever give it (a front end's whole buffer): do not
    retry it as it is; split it."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


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


class ControlOff(ServingError):
    """Model load/unload asked of a server that polls its repository (serve --model-control poll)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ExecutionFailed(ServingError):
    """Model execution failed for the batch this request was in."""

    code = grpc.StatusCode.INTERNAL


class Cancelled(ServingError):
    """The client went away before its request ran (the engine dropped it)."""

    code = grpc.StatusCode.CANCELLED


# Errors travel from the engine to the front ends as a number in a completion record (serving/ipc.py):
# 1 + the class's index here (0: answered).
ANSWER_ERRORS = (InvalidInput, ModelNotFound, Overloaded, DeadlineExpired, DeviceLost, ExecutionFailed, Cancelled)
