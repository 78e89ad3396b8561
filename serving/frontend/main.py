"""A front end: one process that runs gRPC (Inference, health, reflection), reads and checks requests,
and writes responses. It holds no model: every request runs in the engine (serving/engine/core.py),
reached through :class:`EngineLink`. Several front ends share the server's port (SO_REUSEPORT; the
kernel spreads connections over them) and one engine.

Health follows the engine: NOT_SERVING until it has a verified model, and from SIGTERM on. If the
engine goes away (its device failed, or it died) the front end answers UNAVAILABLE, goes
NOT_SERVING and exits non-zero; the supervisor (serving/supervisor.py) then takes the server down.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import AsyncIterator, Callable, Dict, Optional, Tuple

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from recserve.errors import UserError
from recserve.v1 import inference_pb2 as pb
from serving import ipc
from serving.frontend import tracing
from serving.config import ServerConfig
from serving.errors import BY_NAME, DeviceLost, ModelNotFound, Overloaded
from serving.frontend.status import Call
from serving.metrics import NO_MODEL, NO_VERSION, Metrics
from serving.frontend.oip import servicer as oip
from serving.frontend.protowire import RawRequest
from serving.frontend.security import BearerTokenInterceptor, load_tokens, server_credentials
from serving.frontend.servicer import InferenceServicer, add_to_server
from serving.frontend.validate import SparseBatch, quoted

log = logging.getLogger("serving.frontend")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
CONNECT_TIMEOUT_S = 30
MAX_STREAMS_PER_CONNECTION = 256
# A connection must finish its handshake (TLS, and the HTTP/2 preface) within this: a socket that
# connects and stays silent would otherwise hold one of --max-connections for gRPC's default 120 s.
HANDSHAKE_TIMEOUT_S = 5


class EngineLink:
    """The front end's side of the engine: the shared buffer, the requests in flight, and the
    models the engine last said it serves."""

    def __init__(self, socket_path: str, arena_bytes: int, index: int,
                 on_state: Callable[[], None], on_lost: Callable[[int], None]) -> None:
        self.socket_path = socket_path
        self.index = index
        self.arena = ipc.Arena(arena_bytes)
        self.models: Dict[str, ipc.ModelState] = {}
        self.ready = False
        self.accepting = True
        self._on_state = on_state
        self._on_lost = on_lost
        self._pending: Dict[int, Tuple[asyncio.Future, int]] = {}
        self._next_rid = 0
        self._writer: Optional[asyncio.StreamWriter] = None
        self._lost_code = 0

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                sock.connect(self.socket_path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise ConnectionError(f"no engine at {self.socket_path}") from None
                await asyncio.sleep(0.05)
        ipc.send_fd(sock, {"index": self.index, "arena_bytes": self.arena.size}, self.arena.fd)
        sock.setblocking(False)
        reader, self._writer = await asyncio.open_connection(sock=sock)
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            message = await ipc.receive(reader)
            if message is None:
                break
            if isinstance(message, ipc.Done):
                future, offset = self._pending.pop(message.rid)
                if future.done():  # its caller went away: nobody reads the slot any more
                    self.arena.free(offset)
                else:
                    future.set_result(message)
            elif isinstance(message, ipc.Models):
                self.models, self.ready = message.models, message.ready
                self._on_state()
            elif isinstance(message, ipc.Fatal):
                log.critical("the engine is going down: %s", message.message)
                self._lost_code = message.exit_code
        # The engine is gone: nobody will write to the buffer again.
        self.ready = self.accepting = False
        for future, offset in self._pending.values():
            self.arena.free(offset)
            if not future.done():
                future.set_exception(DeviceLost("the server's engine stopped; this server is restarting"))
        self._pending.clear()
        self._on_lost(self._lost_code or 1)

    def model(self, name: str, version: int) -> ipc.ModelState:
        """The model a request names, as the engine serves it now (raises the client's error)."""
        if not self.accepting:
            raise Overloaded("server is shutting down; retry on another replica")
        if not self.ready:
            raise Overloaded("server is loading models; retry")
        state = self.known(name)
        if version and version != state.version:
            raise ModelNotFound(f"model {quoted(name)} version {version} is not loaded; serving version {state.version}")
        return state

    def known(self, name: str) -> ipc.ModelState:
        state = self.models.get(name)
        if state is None:
            raise ModelNotFound(f"model {quoted(name)} is not loaded; loaded: {sorted(self.models)}")
        return state

    @contextlib.asynccontextmanager
    async def run(self, rpc: str, request: RawRequest, model: ipc.ModelState, sparse: SparseBatch,
                  dense: Optional[np.ndarray], out_columns: Tuple[int, ...], deadline: Optional[float],
                  call: Optional[Call] = None) -> AsyncIterator[Tuple[int, np.ndarray]]:
        """Run one request in the engine; yields (version that answered, a view of its result),
        valid until the block ends. ``call``: gets the engine's queue and model-call times."""
        b = sparse.batch_size
        out_shape = (b, *out_columns)
        ids = (sparse.values, sparse.shared_values) if sparse.shared_keys else (sparse.values,)
        ids_dtype = np.result_type(*ids)  # int32 only if every id came as int32 (ids are never narrowed)
        id_totals = (sparse.totals, sparse.shared_lengths) if sparse.shared_keys else (sparse.totals,)
        sizes = [ids_dtype.itemsize * sum(a.shape[0] for a in ids), 4 * sparse.lengths.size,
                 8 * sum(a.shape[0] for a in id_totals), 0 if dense is None else dense.nbytes,
                 4 * int(np.prod(out_shape))]
        offset = self._slot(sum(ipc.aligned(n) for n in sizes))
        try:
            positions = np.cumsum([offset] + [ipc.aligned(n) for n in sizes]).tolist()
            a = self.arena
            message = ipc.Infer(
                rid=self._next_rid, rpc=rpc, model=request.model_name, version=model.version,
                pinned=request.model_version != 0, deadline=deadline, keys=tuple(sparse.keys),
                positions=sparse.positions, batch_size=b, in_model_order=sparse.in_model_order,
                values=a.put_joined(positions[0], ids, ids_dtype.name),
                lengths=a.put(positions[1], sparse.lengths, "int32"),  # each length <= ids sent < 2**31 (validated)
                totals=a.put_joined(positions[2], id_totals, "int64"),
                dense=None if dense is None else a.put(positions[3], dense),
                shared_keys=tuple(sparse.shared_keys), shared_positions=sparse.shared_positions,
                out=ipc.ArrayRef(positions[4], "float32", out_shape))
        except BaseException:
            self.arena.free(offset)
            raise
        self._next_rid += 1
        future = asyncio.get_running_loop().create_future()
        self._pending[message.rid] = (future, offset)
        ipc.send_nowait(self._writer, message)
        try:
            done = await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self.arena.free(offset)  # answered just before the cancel: nobody else frees it
            elif not self._writer.is_closing():  # the slot is freed when the engine answers (it may be writing)
                ipc.send_nowait(self._writer, ipc.Cancel(message.rid))
            raise
        if call is not None and call.steps is not None and done.times is not None:
            queued, started, finished = done.times
            call.steps["queue"], call.steps["model"] = (queued, started), (started, finished)
        try:
            if done.error is not None:
                kind, text = done.error
                raise BY_NAME[kind](text)
            yield done.version, self.arena.array(message.out)
        finally:
            self.arena.free(offset)

    def _slot(self, nbytes: int) -> int:
        offset = self.arena.alloc(nbytes)
        if offset is None:
            if nbytes > self.arena.size:
                raise Overloaded(f"the request needs {nbytes >> 20} MiB of buffer, more than a front end's "
                                 f"{self.arena.size >> 20} MiB (serve --frontend-buffer-mb); split the request")
            raise Overloaded("the server's request buffers are full; retry with backoff")
        return offset

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class FrontEnd:
    def __init__(self, config: ServerConfig, socket_path: str, index: int = 0, frontends: int = 1) -> None:
        self.config = config
        self.index = index
        self.reuse_port = frontends > 1
        self.max_connections = max(1, -(-config.max_connections // frontends))
        self.metrics = Metrics()
        self.engine = EngineLink(socket_path, config.frontend_buffer_bytes, index, self._on_state, self._engine_lost)
        self.servicer = InferenceServicer(self.engine, self.metrics, config.frontend_buffer_bytes)
        self.health = health.aio.HealthServicer()
        self.exit_code = 0
        self.port = 0
        self._stop = asyncio.Event()
        self._stopping = False
        self._grpc: grpc.aio.Server = None  # type: ignore[assignment]

    async def start(self) -> None:
        limit = self.config.max_message_bytes
        tokens = load_tokens(self.config.auth_token_file)
        credentials = server_credentials(self.config)
        interceptors = [BearerTokenInterceptor(tokens, self._count_unauthenticated)] if tokens else []
        self._grpc = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # Front ends share the port on purpose; a lone one must not share it by accident.
            ("grpc.so_reuseport", 1 if self.reuse_port else 0),
            # Streams beyond this wait in the client (HTTP/2 flow control) instead of being reset by
            # gRPC core under a burst (clients saw CANCELLED for ~3% of 1500 calls on one channel).
            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
            # Idle sockets cost file descriptors: cap them (each front end its share), close idle ones.
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_S * 1000),
            *([("grpc.max_connection_idle_ms", int(self.config.idle_timeout_s * 1000))]
              if self.config.idle_timeout_s > 0 else []),
        ])
        add_to_server(self.servicer, self._grpc)
        oip_service = oip.add_to_server(oip.OipServicer(self.engine, self.metrics, self.config.frontend_buffer_bytes), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection(
            [SERVICE_NAME, oip_service, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self._grpc)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.config.host}:{self.config.port}"
        if self.index == 0 and self.config.port:
            _check_free(self.config.host, self.config.port)
        try:
            self.port = (self._grpc.add_secure_port(address, credentials) if credentials
                         else self._grpc.add_insecure_port(address))
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise UserError(f"cannot listen on {address}: the port is in use or the address is not local; "
                            "choose another --port or --host")
        await self._grpc.start()
        await self.engine.connect()

    def _count_unauthenticated(self, method: str) -> None:
        rpc = method.rsplit("/", 1)[-1]
        self.metrics.request_done(rpc, NO_MODEL, NO_VERSION, grpc.StatusCode.UNAUTHENTICATED, 0.0)

    async def _set_health(self, status) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    def _on_state(self) -> None:
        if self.engine.ready and not self._stopping:
            asyncio.get_running_loop().create_task(self._set_health(health_pb2.HealthCheckResponse.SERVING))

    def _engine_lost(self, code: int) -> None:
        if self._stopping:
            return
        log.critical("front end %d: the engine is gone; NOT_SERVING, exiting with code %d", self.index, code)
        self.exit_code = code
        self._stop.set()

    def request_stop(self) -> None:
        self._stop.set()

    async def run_until_stopped(self) -> None:
        await self._stop.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        self._stopping = True
        await self.health.enter_graceful_shutdown()
        self.engine.accepting = False
        loop = asyncio.get_running_loop()
        # After the engine is gone nothing in flight can finish: answer at once.
        grace = min(self.config.grace_period_s, 1.0) if self.exit_code else self.config.grace_period_s
        deadline = loop.time() + grace
        # Drain first, refusing new requests with UNAVAILABLE ourselves: stopping gRPC while requests
        # still arrive would cancel some of them instead (CANCELLED, which clients must not retry blindly).
        while self.engine.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(min(0.2, max(0.0, deadline - loop.time())))
        await self._grpc.stop(max(0.0, deadline - loop.time()))
        self.engine.close()


def _check_free(host: str, port: int) -> None:
    """Refuse a port someone listens on in one line, before gRPC logs its own error about it."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port or --host") from None


def main(config: ServerConfig, socket_path: str, index: int, frontends: int, log_level: str, ready) -> None:
    """A front-end process (serving/supervisor.py starts it)."""
    from serving.child import child_setup

    child_setup(log_level, config, f"frontend-{index}")

    async def run() -> int:
        frontend = FrontEnd(config, socket_path, index, frontends)
        loop = asyncio.get_running_loop()
        for sig in (15, 2):
            loop.add_signal_handler(sig, frontend.request_stop)
        try:
            tracing.configure(config.otlp_endpoint, config.trace_sample_ratio)
            await frontend.start()
        except UserError as e:
            ready.send(("error", str(e)))
            return 2
        ready.send(("frontend", frontend.port))
        await frontend.run_until_stopped()
        return frontend.exit_code

    code = asyncio.run(run())
    tracing.shutdown()
    logging.shutdown()
    os._exit(code)
