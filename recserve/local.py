"""Servers started on this machine and talked to over loopback, as the bench, the load test and the
tests run them: a free port, the ``listening on HOST:PORT`` line a server prints once it answers,
and the samples of its Prometheus ``/metrics``.

Imports nothing from ``export/``, ``serving/`` or ``bench/``: every one of them may use it.
"""
from __future__ import annotations

import re
import signal
import socket
import subprocess
import threading
import urllib.request
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from recserve.errors import UserError

# "recserve: listening on 127.0.0.1:50051" and, for a server of several processes on one port,
# "... (4 workers)" / "... (4 frontends)": the count says how many processes share the port.
# "listening on HOST:PORT (8 frontends, 1 engine)": the first count is the processes that share the port.
LISTENING = re.compile(r"listening on (\S+:\d+)(?: \((\d+) \w+[,)])?")
# "recserve serve: error: --max-delay-ms must be >= 0, got -1": the command's one-line refusal.
REFUSED = re.compile(r"^recserve \S+: error: (.*)$")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (another process may still take it before the caller binds)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_listening(line: str) -> Optional[Tuple[str, int]]:
    """(HOST:PORT, processes sharing it) from a server's ready line; None for any other line."""
    m = LISTENING.search(line)
    return (m.group(1), int(m.group(2) or 1)) if m else None


class ListeningProcess:
    """A command that prints ``listening on HOST:PORT`` once it answers. Its output (stdout and
    stderr) is read all along, so that a chatty server never blocks on a full pipe."""

    def __init__(self, argv: Sequence[str], ready_timeout_s: float = 600, env: Optional[Dict[str, str]] = None,
                 cwd: Optional[str] = None) -> None:
        self.proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, cwd=cwd)
        self.lines: List[str] = []
        self.target: Optional[str] = None
        self.processes = 1
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self._ready.wait(ready_timeout_s)
        if self.target is None:
            self.stop(10)
            refused = [m.group(1) for m in map(REFUSED.match, self.lines) if m]
            if refused:  # what the caller asked of it (a flag it passed on): the caller's user error
                raise UserError(refused[-1])
            raise RuntimeError(f"{' '.join(map(str, argv[:4]))} ... did not start:\n" + "".join(self.lines[-30:]))

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            listening = None if self.target else parse_listening(line)
            if listening:
                self.target, self.processes = listening
                self._ready.set()
        self._ready.set()  # the output ended: the process is gone, started or not

    def output(self) -> str:
        return "".join(self.lines)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, as a supervisor stops it; its exit code (killed after ``timeout`` seconds)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def wait_serving(target: str, timeout_s: float = 600, alive: Callable[[], bool] = lambda: True) -> bool:
    """Wait until the server's health says SERVING (it listens at once, and serves once its models
    are verified); False if it did not within ``timeout_s``, or at once once ``alive()`` is False (the
    server's process is gone: no need to wait out the timeout)."""
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and alive():
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    return False


def scrape(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> str:
    """The text of ``http://HOST:PORT/metrics``."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as r:
        return r.read().decode()


def samples(text: str, name: str, **labels: str) -> list:
    """The samples (``.labels``, ``.value``) called ``name`` whose labels include ``labels``; a
    counter's samples are called NAME_total."""
    from prometheus_client.parser import text_string_to_metric_families

    return [s for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

