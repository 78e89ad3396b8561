"""Logging set-up of every recserve process (the CLI, and the server's supervisor, engine and front
ends): ours at the chosen level, third-party libraries at WARNING, as text or as one JSON object
per line (``--log-format json``: fields ts, level, logger, message, pid, role; exc when an
exception is logged), which log shippers read without a parsing rule."""
from __future__ import annotations

import datetime
import json
import logging
import os

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
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(role) if log_format == "json" else logging.Formatter(TEXT))
    handler.addFilter(_quiet_fbgemm_version_table)
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
