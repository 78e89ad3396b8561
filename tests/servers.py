"""Helpers to run a real server: in-process (engine and front end on their own event loop thread, for
tests that look inside them) or as the `recserve serve` command (system tests)."""
import asyncio
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recserve.local import ListeningProcess, free_port, scrape, wait_serving
from serving.config import BatchSettings, ServerConfig
from serving.engine.core import Engine
from serving.frontend.main import FrontEnd
from serving.metrics import serve_metrics, union_registry

ROOT = Path(__file__).resolve().parent.parent
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class InProcessServer:
    """The engine and one front end of `recserve serve` in this process, on one event loop thread
    (same classes, same socket and shared buffer between them; no child processes)."""

    def __init__(self, repo: Path, settings: dict = None, **batch) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.metrics_port = free_port()
        self.config = ServerConfig(repo=Path(repo), port=0, metrics_port=self.metrics_port,
                                   batch=BatchSettings(**batch), poll_interval_s=0.2, grace_period_s=5,
                                   **(settings or {}))
        self.workdir = tempfile.mkdtemp(prefix="recserve-test-")
        socket_path = os.path.join(self.workdir, "engine.sock")
        self.engine = self.call(self._make(Engine, self.config, socket_path))
        self.call(self.engine.start())
        self.frontend = self.call(self._make(FrontEnd, self.config, socket_path))
        self.call(self.frontend.start())
        self.call(self.engine.load())
        self.polls = 0  # repository polls finished: tests wait for polls instead of sleeping
        refresh = self.engine.repo.refresh

        async def counted_refresh():
            await refresh()
            self.polls += 1

        self.engine.repo.refresh = counted_refresh
        self.engine_runner = asyncio.run_coroutine_threadsafe(self.engine.run_until_stopped(), self.loop)
        self.frontend_runner = asyncio.run_coroutine_threadsafe(self.frontend.run_until_stopped(), self.loop)
        self.target = f"127.0.0.1:{self.frontend.port}"
        self.registry = union_registry([self.frontend.metrics.registry, self.engine.metrics.registry])
        # Bound here on a port of the kernel's choosing: the port free_port() found at the start may have
        # been taken while the models loaded (seconds; a client socket's ephemeral port, say).
        self._http = serve_metrics(0, "127.0.0.1", self.registry)
        self.metrics_port = self._http.server_port

    @staticmethod
    async def _make(cls, *args):
        return cls(*args)

    def call(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def repo(self):
        return self.engine.repo

    def model_version(self, name: str = "demo"):
        return self.engine.repo.models[name]

    def metric(self, name: str, **labels) -> float:
        """The sum of the samples called ``name`` whose labels include ``labels`` (0 if none)."""
        return sum(s.value for family in self.registry.collect() for s in family.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def scrape(self) -> str:
        return scrape(self.metrics_port)

    def stop(self) -> int:
        """Stop as SIGTERM would (front end first, then the engine); returns the exit code."""
        self.loop.call_soon_threadsafe(self.frontend.request_stop)
        self.frontend_runner.result(30)
        self.loop.call_soon_threadsafe(self.engine.request_stop)
        self.engine_runner.result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self._http.shutdown()
        shutil.rmtree(self.workdir, ignore_errors=True)
        return self.frontend.exit_code or self.engine.exit_code


def health_status(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


class ServeProcess(ListeningProcess):
    """`recserve serve` as a user runs it."""

    def __init__(self, repo: Path, *args: str, wait_ready: bool = True, log_format: str = "text") -> None:
        self.metrics_port = free_port()
        super().__init__([sys.executable, "-m", "recserve", "--log-format", log_format, "serve", "--repo", str(repo),
                          "--port", "0",
                          "--device", "cpu", "--metrics-port", str(self.metrics_port), *args],
                         ready_timeout_s=120, env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=str(ROOT))
        if wait_ready:
            assert wait_serving(self.target, 120), self.output()

    def terminate(self, timeout: float = 30) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def scrape(self) -> str:
        return scrape(self.metrics_port)
