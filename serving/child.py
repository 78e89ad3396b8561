"""What every child process of the server (engine, front ends) does first."""
from __future__ import annotations

import sys

from serving.config import ServerConfig


def child_setup(level: str, config: ServerConfig, role: str) -> None:
    """Logging (the supervisor's level and format), and a short GIL switch interval: each process has
    an event loop and helper threads (gRPC's poller, the engine's finish thread) that hand work to
    each other; with the default 5 ms a thread that was woken can wait that long for the interpreter."""
    from recserve.logs import setup_logging

    sys.setswitchinterval(0.0002)
    setup_logging(level, config.log_format, role)
