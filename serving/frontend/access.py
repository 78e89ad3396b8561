"""The access log of a front end: one line per request, logger ``serving.access``.

- ``serve --access-log RATIO``: that share of requests (1: every one), at INFO: time, peer, method,
  model, version, batch size, status code, server time. Under ``--log-format json`` each line is one
  JSON object with those as fields (``peer``, ``method``, ``model``, ``version``, ``batch_size``,
  ``code``, ``server_ms``; recserve/logs.py).
- Denied requests (UNAUTHENTICATED, RESOURCE_EXHAUSTED) are logged at WARNING, sampled or not: even
  without it, at most ``DENIED_PER_S`` lines a second per front end; the next line says how many were left out. A
  client hammering with a bad token cannot flood the log, and an operator still sees it.
"""
from __future__ import annotations

import logging
import random
import time
from typing import Optional

import grpc

log = logging.getLogger("serving.access")
DENIED = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED})
DENIED_PER_S = 1.0


class AccessLog:
    def __init__(self, ratio: float = 0.0, clock=time.monotonic) -> None:
        self.ratio = ratio
        self.clock = clock
        self._allowance = 1.0  # token bucket of denied lines
        self._refilled = clock()
        self._left_out = 0

    def record(self, method: str, peer: str, model: str, version: str, batch_size: int,
               code: grpc.StatusCode, seconds: float) -> None:
        sampled = self.ratio > 0 and (self.ratio >= 1 or random.random() < self.ratio)
        if not sampled and not (code in DENIED and self._denied_allowed()):
            return
        fields = {"peer": peer, "method": method, "model": model, "version": version, "batch_size": batch_size,
                  "code": code.name, "server_ms": round(seconds * 1000, 3)}
        note = ""
        if not sampled and self._left_out:
            fields["denied_left_out"] = self._left_out
            note = f" ({self._left_out} denied requests not logged before this)"
            self._left_out = 0
        text = " ".join(f"{k}={v}" for k, v in fields.items() if k != "denied_left_out")
        log.log(logging.WARNING if code in DENIED else logging.INFO, "%s%s", text, note, extra={"fields": fields})

    def _denied_allowed(self) -> bool:
        now = self.clock()
        self._allowance = min(1.0, self._allowance + (now - self._refilled) * DENIED_PER_S)
        self._refilled = now
        if self._allowance >= 1.0:
            self._allowance -= 1.0
            return True
        self._left_out += 1
        return False


_log: Optional[AccessLog] = None


def configure(ratio: float) -> AccessLog:
    """The process's access log (one per front-end process, like its tracer)."""
    global _log
    _log = AccessLog(ratio)
    return _log


def record(method: str, peer: str, model: str, version: str, batch_size: int, code: grpc.StatusCode,
           seconds: float) -> None:
    if _log is not None:
        _log.record(method, peer, model, version, batch_size, code, seconds)
