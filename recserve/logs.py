"""Logging set-up of every recserve process (the CLI, and the server's supervisor, engine and front
ends): ours at the chosen level, third-party libraries at WARNING, as text or as one JSON object
per line (``--log-format json``: fields ts, level, logger, message, pid, role; exc when an
exception is logged), which log shippers read without a parsing rule. A fatal signal (SIGSEGV and
the like) prints the Python stack of every thread to stderr before the process dies (faulthandler).

Under JSON, what native code writes to the process's stderr is JSON too: gRPC core logs through
abseil straight to file descriptor 2 (``I1124 09:31:40.98 9929 ssl_transport_security.cc:2563]
Handshake failed ...``), as do torch's C++ warnings. File descriptor 2 then leads to a pipe, and a
thread turns each line from it into one JSON object (logger "grpc" for abseil's lines, level from
their first letter; "stderr" for other lines); lines that are JSON already (a child process's,
which inherits the pipe) pass unchanged. Our own records go to the real stderr directly."""
from __future__ import annotations

import atexit
import datetime
import faulthandler
import json
import logging
import os
import re
import sys
import threading
from typing import Optional, TextIO

OURS = ("recserve", "export", "serving", "bench")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        entry = {
            "ts": ts.isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
            "pid": os.getpid(), "role": self.role,
        }
        entry.update(getattr(record, "fields", {}))  # structured fields of a line (the access log's)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


# abseil's prefix: severity letter, MMDD, time, thread id, file:line]
_ABSL = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ ([^\]\s]+:\d+)\] ?(.*)$")
_ABSL_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}


class _StderrToJson:
    """File descriptor 2 of this process -> a pipe -> one JSON object per line on the real stderr. The
    thread is the one writer of the real stderr (our own records reach it through the pipe too, as
    JSON already), so no lock is shared between a writer and the thread that empties the pipe."""

    def __init__(self, formatter: logging.Formatter) -> None:
        self.formatter = formatter
        self.real_fd = os.dup(2)
        self.real: TextIO = os.fdopen(self.real_fd, "w", buffering=1, encoding="utf-8", errors="replace",
                                      closefd=False)
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self.thread = threading.Thread(target=self._pump, args=(read_fd,), name="stderr-to-json", daemon=True)
        self.thread.start()

    def _pump(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb") as pipe:
            for raw in pipe:
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if line.strip():
                    self.real.write(self._as_json(line) + "\n")

    def _as_json(self, line: str) -> str:
        if line.startswith("{"):
            try:
                if isinstance(json.loads(line), dict):
                    return line
            except ValueError:
                pass
        match = _ABSL.match(line)
        level, name, message = (_ABSL_LEVELS[match[1]], "grpc", f"{match[2]}: {match[3]}") if match \
            else (logging.WARNING, "stderr", line)
        return self.formatter.format(logging.LogRecord(name, level, "", 0, message, None, None))

    def close(self) -> None:
        """Point fd 2 back at the real stderr and let the thread write what is still in the pipe."""
        if sys.stderr is not None:
            sys.stderr.flush()
        os.dup2(self.real_fd, 2)
        self.thread.join(1.0)


_routed: Optional[_StderrToJson] = None


def restore_stderr() -> None:
    """Before a process exits (children end with os._exit, which runs no atexit): no line is lost."""
    global _routed
    if _routed is not None:
        routed, _routed = _routed, None
        routed.close()


def _quiet_fbgemm_version_table(record: logging.LogRecord) -> bool:
    # fbgemm_gpu warns once per library (14 times) when its compatibility table lacks the torch
    # version; the version pairs this project supports are tested, so that warning is noise.
    return "_fbgemm_torch_compat_table" not in record.getMessage()


def _quiet_fx_tracing_notice(record: logging.LogRecord) -> bool:
    # torch warns once per process that is_fx_tracing() is also true under torch.export; torchrec's
    # modules call it on every forward. This project traces with fx.symbolic_trace only (export/),
    # where the answer is right, so the notice says nothing to our users.
    return not record.getMessage().startswith("is_fx_tracing will return true")


def setup_logging(level: str = "INFO", log_format: str = "text", role: str = "cli") -> None:
    global _routed
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(role) if log_format == "json" else logging.Formatter(TEXT))
    handler.addFilter(_quiet_fbgemm_version_table)
    if log_format == "json":
        restore_stderr()
        _routed = _StderrToJson(handler.formatter)
        atexit.unregister(restore_stderr)
        atexit.register(restore_stderr)
    # A fatal signal (SIGSEGV, SIGBUS, SIGABRT: a native library's bug) ends the process with no Python
    # traceback, leaving a supervisor's "exit code -11" alone: print every thread's stack first. Under JSON
    # onto the real stderr (a child's: its supervisor's pipe, which turns the lines into JSON): the pipe
    # of this process dies with the thread that empties it.
    faulthandler.enable(_routed.real_fd if _routed is not None else 2, all_threads=True)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    for name in OURS:
        logging.getLogger(name).setLevel(level)
    # On the logger itself: torch gives its loggers their own handlers.
    fx = logging.getLogger("torch.fx._symbolic_trace")
    if _quiet_fx_tracing_notice not in fx.filters:
        fx.addFilter(_quiet_fx_tracing_notice)
    # Python warnings that reach the user (not filtered by the CLI) go through the same format.
    logging.captureWarnings(log_format == "json")
