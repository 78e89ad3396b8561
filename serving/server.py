"""``recserve serve``: the gRPC server, its health and reflection services, metrics, and lifecycle.

Start: bind the port (health says NOT_SERVING), load and verify every model, then SERVING.
SIGTERM/SIGINT: health NOT_SERVING at once, new requests UNAVAILABLE, in-flight requests get up to
the grace period, exit code 0.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import time
from typing import Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from recserve.v1 import inference_pb2 as pb
from serving.config import ServerConfig
from serving.errors import DeviceLost
from serving.metrics import Metrics
from serving.repository import ModelRepository
from serving.security import BearerTokenInterceptor, load_tokens, server_credentials
from serving.servicer import InferenceServicer, add_to_server

log = logging.getLogger("serving.server")
EXIT_DEVICE_LOST = 3  # the process must be restarted (its CUDA context is unusable)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name


class Server:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.repo = ModelRepository(config, self.metrics, on_fatal=self.device_lost)
        self.exit_code = 0
        self.servicer = InferenceServicer(self.repo, self.metrics)
        self.health = health.aio.HealthServicer()
        self.port = 0
        self._stop = asyncio.Event()
        self._grpc: grpc.aio.Server = None  # type: ignore[assignment]

    async def start(self, announce: bool = True) -> None:
        limit = self.config.max_message_bytes
        tokens = load_tokens(self.config.auth_token_file)
        credentials = server_credentials(self.config)
        interceptors = [BearerTokenInterceptor(tokens, self._count_unauthenticated)] if tokens else []
        self._grpc = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # Several workers share a port on purpose; a lone server must not share it by accident.
            ("grpc.so_reuseport", 1 if self.config.reuse_port else 0),
        ])
        add_to_server(self.servicer, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self._grpc)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.config.host}:{self.config.port}"
        self.port = (self._grpc.add_secure_port(address, credentials) if credentials
                     else self._grpc.add_insecure_port(address))
        if self.port == 0:
            raise OSError(f"cannot bind {self.config.host}:{self.config.port}")
        await self._grpc.start()
        if self.config.metrics_port:
            self.metrics.serve_http(self.config.host, self.config.metrics_port)
        await self.repo.refresh()
        if self.repo.ready:
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        loaded = {n: mv.version for n, mv in self.repo.models.items()}
        log.info("serving on %s:%d, models %s, metrics on :%s", self.config.host, self.port, loaded,
                 self.config.metrics_port or "-")
        if announce:
            print(f"recserve: listening on {self.config.host}:{self.port}", flush=True)

    def _count_unauthenticated(self, method: str) -> None:
        self.metrics.requests.labels(rpc=method.rsplit("/", 1)[-1], model="", code="UNAUTHENTICATED").inc()

    async def _set_health(self, status) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def run_until_stopped(self) -> None:
        poll = None
        if self.config.poll_interval_s > 0:
            poll = asyncio.get_running_loop().create_task(self._poll())
        await self._stop.wait()
        if poll:
            poll.cancel()
        await self.shutdown()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            try:
                await self.repo.refresh()
                if self.repo.ready and not self._stop.is_set():
                    await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            except Exception:  # noqa: BLE001 - keep polling whatever the disk does
                log.exception("repository poll failed")

    def request_stop(self) -> None:
        self._stop.set()

    def device_lost(self) -> None:
        """A model call left the device unusable: stop taking requests, answer every waiting one
        with UNAVAILABLE, go NOT_SERVING, and exit non-zero so that a supervisor restarts us."""
        if self.exit_code:
            return
        log.critical("device unusable: going NOT_SERVING and exiting with code %d for a restart", EXIT_DEVICE_LOST)
        self.exit_code = EXIT_DEVICE_LOST
        self.servicer.accepting = False
        self.repo.fail_queued(DeviceLost("the model's device failed; this server is restarting"))
        asyncio.get_running_loop().create_task(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))
        self._stop.set()

    async def shutdown(self) -> None:
        log.info("shutting down: NOT_SERVING, refusing new requests, %.1fs grace", self.config.grace_period_s)
        await self.health.enter_graceful_shutdown()
        self.servicer.accepting = False
        # After a device failure nothing in flight can finish: give handlers a moment to answer.
        grace = min(self.config.grace_period_s, 1.0) if self.exit_code else self.config.grace_period_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        # Drain first, refusing new requests with UNAVAILABLE ourselves: stopping gRPC while requests
        # still arrive would cancel some of them instead (CANCELLED, which clients must not retry blindly).
        while self.repo.in_flight() and loop.time() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(min(0.2, max(0.0, deadline - loop.time())))
        await self._grpc.stop(max(0.0, deadline - loop.time()))
        await self.repo.close()
        log.info("stopped")


async def _main(config: ServerConfig, ready: Optional["mp.Queue"] = None) -> int:
    server = Server(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_stop)
    await server.start(announce=ready is None)
    if ready is not None:
        ready.put(server.port)
    await server.run_until_stopped()
    return server.exit_code


def serve(config: ServerConfig, workers: int = 1) -> int:
    if workers <= 1:
        return asyncio.run(_main(config))
    return _serve_workers(config, workers)


def _worker(config: ServerConfig, ready: "mp.Queue") -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(asyncio.run(_main(config, ready)))


def _serve_workers(config: ServerConfig, workers: int) -> int:
    """``workers`` server processes on one port: the kernel spreads connections over them
    (SO_REUSEPORT). One Python process moves about 0.5 GB/s of request bytes through gRPC; several
    move more. Each worker loads every model: GPU memory grows by one model copy per worker."""
    port = config.port or _free_port(config.host)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    procs = []
    for i in range(workers):
        worker_config = dataclasses.replace(config, port=port, reuse_port=True,
                                            metrics_port=config.metrics_port + i if config.metrics_port else 0)
        procs.append(ctx.Process(target=_worker, args=(worker_config, ready), name=f"recserve-worker-{i}"))
    for p in procs:
        p.start()

    def forward(signum, _frame):
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    started = 0
    while started < workers:
        try:
            ready.get(timeout=1.0)
            started += 1
        except queue.Empty:
            if any(p.exitcode is not None for p in procs):
                break  # a worker died while starting: take the rest down below
    if started == workers:
        print(f"recserve: listening on {config.host}:{port} ({workers} workers)", flush=True)
    # The set lives and dies together: when one worker exits (a device failure exits 3), stop the
    # others and exit with its code, so that a supervisor restarts the whole server.
    while all(p.exitcode is None for p in procs):
        time.sleep(0.2)
    failed = [p.exitcode for p in procs if p.exitcode]
    forward(signal.SIGTERM, None)
    for p in procs:
        p.join()
    return failed[0] if failed else max(p.exitcode or 0 for p in procs)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
