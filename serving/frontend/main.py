"""A front end: one process that runs gRPC (Inference, the Open Inference Protocol, health,
reflection) and, with ``--http-port``, the Open Inference Protocol over HTTP/REST in the same event
loop (serving/frontend/oip/rest.py), reads and checks requests, and writes responses. It holds no
model: every request runs in an engine (serving/engine/core.py), reached through its
:class:`EngineLink` (serving/frontend/link.py; ``Engines`` with one engine per GPU). Several front
ends share the server's ports (SO_REUSEPORT; the kernel spreads connections over them) and the engines.

Health follows the engines: NOT_SERVING until they have loaded (a verified model), and from SIGTERM
on. If an engine goes away (its device failed, or it died) the front end answers UNAVAILABLE, goes
NOT_SERVING and exits non-zero; the supervisor (serving/supervisor.py) then takes the server down.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
from typing import List, Optional, Sequence, Union

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from recserve.errors import UserError
from recserve.v1 import inference_pb2 as pb
from serving.frontend import access, tracing
from serving.config import ServerConfig
from serving.metrics import NO_MODEL, NO_VERSION, Metrics
from serving.frontend.oip import servicer as oip
from serving.frontend.oip.shm import SharedMemory
from serving.frontend.security import (
    BearerTokenInterceptor,
    TokenFile,
    load_tokens,
    server_credentials,
    server_ssl_context,
    warn_tokens_in_clear,
)
from serving.frontend.servicer import InferenceServicer, add_to_server
from serving.frontend.link import EngineLink, Engines

log = logging.getLogger("serving.frontend")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
MAX_STREAMS_PER_CONNECTION = 256
# A connection must finish its handshake (TLS, and the HTTP/2 preface) within this: a socket that
# connects and stays silent would otherwise hold one of --max-connections for gRPC's default 120 s
# (and an HTTPS one a descriptor for asyncio's default 60 s).
HANDSHAKE_TIMEOUT_S = 5
TOKEN_FILE_POLL_S = 0.5  # --auth-token-file is read again within two of these of a change (security.TokenFile)


class FrontEnd:
    def __init__(self, config: ServerConfig, socket_paths: Union[str, Sequence[str]], index: int = 0,
                 frontends: int = 1) -> None:
        """``socket_paths``: the engine's socket, or each engine's (one per GPU): the buffer is split
        between them."""
        self.config = config
        self.index = index
        self.reuse_port = frontends > 1
        # Its share of --max-connections (the shares add up to it): a connection lands on a front end
        # by the kernel's hash (SO_REUSEPORT), and is refused where that one's share is full.
        share, extra = divmod(config.max_connections, frontends)
        self.max_connections = max(1, share + (index < extra))
        self.metrics = Metrics()
        access.configure(config.access_log_ratio)
        paths = [socket_paths] if isinstance(socket_paths, str) else list(socket_paths)
        gauge = self.metrics.buffer_used.labels(frontend=str(index))
        links: List[EngineLink] = []
        links += [EngineLink(path, config.frontend_buffer_bytes // len(paths), index, self._on_state,
                             self._engine_lost, lambda _: gauge.set(sum(link.arena.used_bytes for link in links)),
                             len(paths))
                  for path in paths]
        self.engine = links[0] if len(links) == 1 else Engines(links)
        self.servicer = InferenceServicer(self.engine, self.metrics)
        # Triton's system shared memory extension: the regions are kept beside the engines' sockets.
        self.shared = SharedMemory(os.path.dirname(os.path.abspath(paths[0])) if config.shared_memory == "system"
                                   else None)
        self.health = health.aio.HealthServicer()
        self.exit_code = 0
        self.port = 0
        self.http_port: Optional[int] = None  # where HTTP/REST listens (serve --http-port)
        self._http = None  # its aiohttp runner
        self._http_listener: Optional[asyncio.Server] = None  # its listening socket
        self._stop = asyncio.Event()
        self._stopping = False
        self._grpc: grpc.aio.Server = None  # type: ignore[assignment]
        self._watch: Optional[asyncio.Task] = None  # the files read again (:meth:`_watch_files`)

    async def start(self) -> None:
        limit = self.config.max_message_bytes
        token_file = TokenFile(self.config.auth_token_file) if self.config.auth_token_file else None
        tokens = token_file.tokens if token_file else None  # auth is on iff the file was given, for good
        credentials = server_credentials(self.config)
        interceptors = [BearerTokenInterceptor(tokens, self._count_unauthenticated)] if token_file else []
        self._grpc = grpc.aio.server(interceptors=interceptors, options=[
            # A request's limit only: an answer is as large as the request asks (B x the model's columns),
            # so a limit on it would fail requests after they ran.
            ("grpc.max_receive_message_length", limit),
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
        oip_service = oip.add_to_server(oip.OipServicer(self.engine, self.metrics, self.config.model_control,
                                                        self.shared), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection(
            [SERVICE_NAME, oip_service, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self._grpc)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = host_port(self.config.host, self.config.port)
        if self.index == 0:  # --port 0 too: an address not of this machine is then ours to say, not gRPC core's
            check_free(self.config.host, self.config.port, "--port")
        try:
            self.port = (self._grpc.add_secure_port(address, credentials) if credentials
                         else self._grpc.add_insecure_port(address))
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise UserError(f"cannot listen on {address}: the port is in use or the address is not local; "
                            "choose another --port or --host")
        await self._grpc.start()
        if self.config.http_port is not None:
            await self._start_http(tokens)
        if token_file or self.shared.enabled:
            self._watch = asyncio.get_running_loop().create_task(self._watch_files(token_file))
        await self.engine.connect()

    async def _watch_files(self, token_file: Optional[TokenFile]) -> None:
        """Token rotation without a restart (security.TokenFile), and the shared-memory registry looked
        at though no request comes: a region unregistered through another front end has its object's
        file closed here too, so that the memory of the object its client unlinks is freed."""
        while True:  # an error is logged and the next round tries again: ended, rotation would stop unseen
            await asyncio.sleep(TOKEN_FILE_POLL_S)
            try:
                if token_file and token_file.poll():
                    log.info("front end %d: read --auth-token-file again: %d tokens", self.index,
                             len(token_file.tokens))
            except UserError as e:
                log.error("front end %d: %s; the previous tokens stay in force", self.index, e)
            except Exception:  # noqa: BLE001
                log.exception("front end %d: reading --auth-token-file again failed; the previous tokens stay in "
                              "force", self.index)
            try:
                self.shared.refresh()
            except (OSError, ValueError) as e:  # the next request's refresh answers its client with it
                log.error("front end %d: cannot read the shared memory registry: %s", self.index, e)
            except Exception:  # noqa: BLE001
                log.exception("front end %d: reading the shared memory registry failed", self.index)

    async def _start_http(self, tokens) -> None:
        """The Open Inference Protocol over HTTP/REST (serving/frontend/oip/rest.py) in this loop."""
        from aiohttp import web

        from serving.frontend.oip.rest import RestServicer, connections

        if self.index == 0 and self.config.http_port:
            check_free(self.config.host, self.config.http_port, "--http-port")
        rest = RestServicer(self.engine, self.metrics, self.config.max_message_bytes, tokens,
                            lambda rpc, peer: self._count_unauthenticated(f"/{rpc}", peer), self.config.model_control,
                            self.shared, self.config.idle_timeout_s, self.config.max_json_bytes)
        connection = dict(access_log=None, keepalive_timeout=self.config.idle_timeout_s or math.inf,  # its 0: none
                          logger=_HttpServerLog(logging.getLogger("aiohttp.server"), {}))
        # handler_cancellation: a client that closes its connection cancels its request, as over gRPC
        # (counted CANCELLED, its queue place freed); aiohttp would otherwise run it to an answer nobody reads.
        self._http = web.AppRunner(rest.app(), handle_signals=False, handler_cancellation=True, **connection)
        await self._http.setup()
        tls = server_ssl_context(self.config)
        try:  # not aiohttp's TCPSite: it leaves the TLS handshake asyncio's default 60 s
            self._http_listener = await asyncio.get_running_loop().create_server(
                connections(self._http.server, **connection), self.config.host, self.config.http_port,
                reuse_port=self.reuse_port, ssl=tls, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if tls else None)
        except OSError as e:
            raise _cannot_listen(self.config.host, self.config.http_port, "--http-port", e) from None
        self.http_port = self._http_listener.sockets[0].getsockname()[1]

    def _count_unauthenticated(self, method: str, peer: str) -> None:
        rpc = method.rsplit("/", 1)[-1]
        self.metrics.request_done(rpc, NO_MODEL, NO_VERSION, grpc.StatusCode.UNAUTHENTICATED, 0.0)
        access.record(rpc, peer, NO_MODEL, NO_VERSION, 0, grpc.StatusCode.UNAUTHENTICATED, 0.0)

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
        if self._watch is not None:
            self._watch.cancel()
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
        if self._http is not None:
            self._http_listener.close()
            # aiohttp waits up to 60 s for a request still open (a body still arriving): no longer than
            # the grace period; what it leaves is cancelled when the loop ends.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._http.cleanup(), max(0.0, deadline - loop.time()))
        self.engine.close()


class _HttpServerLog(logging.LoggerAdapter):
    """aiohttp's server log, where a request that does not parse as HTTP (a control character in a
    header, a line too long: answered 400) is the client's fault, at DEBUG as aiohttp logs a bad method:
    at ERROR with a traceback, any client (no token needed) could fill the server's log with them."""

    def exception(self, msg, *args, exc_info=True, **kwargs) -> None:
        from aiohttp.http_exceptions import HttpProcessingError

        if isinstance(exc_info, HttpProcessingError):
            self.debug(msg, *args, exc_info=exc_info, **kwargs)
        else:
            self.error(msg, *args, exc_info=exc_info, **kwargs)


def host_port(host: str, port: int) -> str:
    """``HOST:PORT`` as gRPC and clients read it: an IPv6 address in brackets (``[::1]:50051``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_free(host: str, port: int, flag: str) -> None:
    """Refuse a port someone listens on in one line, before gRPC (or the metrics or HTTP server) fails on it."""
    try:
        with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET):
            pass
    except OSError as e:
        raise _cannot_listen(host, port, flag, e) from None


def check_settings(config: ServerConfig) -> None:
    """What a front end refuses at start, checked before the server starts anything (front end 0 finds
    it only once the engines are up): the TLS files (readable, PEM, the key the certificate's), the
    tokens of --auth-token-file (and a warning where they would cross the network in the clear),
    --otlp-endpoint. The front ends check again: the files may change."""
    server_credentials(config)
    load_tokens(config.auth_token_file)
    warn_tokens_in_clear(config)
    tracing.check(config.otlp_endpoint)


def _cannot_listen(host: str, port: int, flag: str, e: OSError) -> UserError:
    reason = os.strerror(e.errno) if e.errno else e.strerror  # not Python's "(while attempting to bind ...)"
    return UserError(f"cannot listen on {host_port(host, port)} ({reason}); choose another {flag} or --host")


def main(config: ServerConfig, socket_path: Sequence[str], index: int, frontends: int, log_level: str, ready) -> None:
    """A front-end process (serving/supervisor.py starts it)."""
    from recserve.logs import restore_stderr
    from serving.child import child_setup, leave_workdir

    child_setup(log_level, config, f"frontend-{index}", os.path.dirname(socket_path[0]))

    async def run() -> int:
        frontend = FrontEnd(config, socket_path, index, frontends)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, frontend.request_stop)
        try:
            tracing.configure(config.otlp_endpoint, config.trace_sample_ratio)
            await frontend.start()
        except UserError as e:
            ready.send(("error", str(e)))
            return 2
        ready.send(("frontend", frontend.port, frontend.http_port))
        await frontend.run_until_stopped()
        return frontend.exit_code

    try:
        code = asyncio.run(run())
    finally:
        leave_workdir()
    tracing.shutdown()
    restore_stderr()
    logging.shutdown()
    os._exit(code)
