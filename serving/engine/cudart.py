"""The four CUDA runtime calls a launch makes per request and per batch, called directly.

A batch's host work on CUDA is a copy in per request, the descriptor's copy, stream ordering by
events, the graph replay and a copy out per request (serving/engine/assemble.py). Through torch
each copy is a slice, a view and a ``copy_`` dispatch, each ordering an ``Event`` and a stream
context. Here each is one ctypes call into the very ``libcudart`` torch loaded (same runtime, same
streams and events: their handles are torch's). On an H200 a launch of one request took 0.16-0.32
ms of the engine thread's CPU through torch, 0.08-0.10 ms this way with the graph replayed outside
the inference and math settings that it does not need (scripts/gpu-launch-probe.py).
NVIDIA's ``cuda-bindings`` would do the same but loads a runtime of its own and is one more
dependency for four calls.

Every call's status is checked: an error raises RuntimeError("CUDA error: ..."), which the batcher
treats as torch's own CUDA errors (serving/engine/runner.py FATAL_DEVICE_ERRORS).
"""
from __future__ import annotations

import ctypes
import functools
import logging
from typing import Optional

log = logging.getLogger("serving.engine.cudart")

HOST_TO_DEVICE, DEVICE_TO_HOST = 1, 2  # cudaMemcpyKind


class Runtime:
    """ctypes functions of one loaded libcudart; pointers, streams and events are plain ints."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, size, i32, u32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint
        self._copy = _function(lib, "cudaMemcpyAsync", vp, vp, size, i32, vp)
        self._record = _function(lib, "cudaEventRecord", vp, vp)
        self._wait = _function(lib, "cudaStreamWaitEvent", vp, vp, u32)
        self._sync = _function(lib, "cudaEventSynchronize", vp)
        self._last_error = _function(lib, "cudaGetLastError")
        self._error_string = lib.cudaGetErrorString
        self._error_string.argtypes, self._error_string.restype = [i32], ctypes.c_char_p

    def copy(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        """Queue a copy of ``nbytes`` on ``stream`` (asynchronous from page-locked host memory)."""
        if rc := self._copy(dst, src, nbytes, kind, stream):
            self._raise("cudaMemcpyAsync", rc)

    def record(self, event: int, stream: int) -> None:
        if rc := self._record(event, stream):
            self._raise("cudaEventRecord", rc)

    def wait(self, stream: int, event: int) -> None:
        """Work queued on ``stream`` from now on waits for ``event``'s last record."""
        if rc := self._wait(stream, event, 0):
            self._raise("cudaStreamWaitEvent", rc)

    def synchronize(self, event: int) -> None:
        if rc := self._sync(event):
            self._raise("cudaEventSynchronize", rc)

    def _raise(self, call: str, rc: int) -> None:
        # A failed call also stays as this thread's last error, which torch's check after its next
        # kernel launch would raise (for a batch that had nothing to do with it): cleared here.
        self._last_error()
        raise RuntimeError(f"CUDA error: {self._error_string(rc).decode()} ({rc}) in {call}")


@functools.cache
def runtime() -> Optional[Runtime]:
    """The runtime torch uses, or None (then launches go through torch's calls; logged): found by
    its path among the process's mappings (torch's CUDA library loads it with torch)."""
    path = _loaded_library("libcudart.so")
    if path is None:
        log.warning("no CUDA runtime library found beside torch: launches use torch's copy calls "
                    "(about 0.1 ms more host time per batch)")
        return None
    try:
        return Runtime(ctypes.CDLL(path))
    except (OSError, AttributeError) as e:
        log.warning("torch's CUDA runtime %s cannot be called directly (%s): launches use torch's copy calls",
                    path, e)
        return None


def _loaded_library(name: str) -> Optional[str]:
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and name in fields[5].rsplit("/", 1)[-1]:
                return fields[5].strip()
    return None


def _function(lib: ctypes.CDLL, name: str, *argtypes):
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return fn
