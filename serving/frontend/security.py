"""Transport security and authentication: TLS / mutual TLS credentials (gRPC, and the same for the
HTTP/REST port), and a bearer-token check on every RPC except the health service, the Open Inference
Protocol's liveness and readiness calls (load balancers and kubelets probe without credentials) and
server reflection (it tells the services' schemas, which are this project's public .proto files, as
health tells their state; grpcurl and Postman then list and describe the server without a token, and
every call they make needs one); oip/rest.py checks the same tokens on HTTP."""
from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import ssl
import stat
from pathlib import Path
from typing import Callable, List, Optional, Union

import grpc
from grpc_reflection.v1alpha import reflection

from recserve.client import load_tls_files, read_tokens
from recserve.errors import UserError
from serving.config import ServerConfig

log = logging.getLogger(__name__)

OPEN_SERVICES = tuple(f"/{service}/" for service in (
    "grpc.health.v1.Health", reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection"))
# The Open Inference Protocol's probes (KServe and Triton clients check these without credentials).
OPEN_PROBES = frozenset("/inference.GRPCInferenceService/" + m for m in ("ServerLive", "ServerReady", "ModelReady"))


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"{what} {path}: cannot read ({e.strerror})") from e


def _tls(config: ServerConfig) -> bool:
    """Whether the server serves TLS (a key pair given; one file of the pair alone is refused)."""
    if not (config.tls_cert or config.tls_key or config.tls_client_ca):
        return False
    if not (config.tls_cert and config.tls_key):
        raise UserError("TLS needs both --tls-cert and --tls-key (--tls-client-ca adds client certificates)")
    return True


def warn_tokens_in_clear(config: ServerConfig) -> None:
    """One warning at start where bearer tokens would cross a network unencrypted: --auth-token-file
    without TLS, on a --host that is not loopback (0.0.0.0, or a name or address of an interface)."""
    if config.auth_token_file is None or _tls(config) or _loopback(config.host):
        return
    log.warning("--auth-token-file without TLS on --host %s, which is not loopback: the clients' bearer tokens "
                "cross the network in the clear; serve with --tls-cert and --tls-key, or terminate TLS in front "
                "of the server (a proxy on this host, the server on --host 127.0.0.1)", config.host)


def _loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback one (a name that does not resolve: no)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def server_credentials(config: ServerConfig) -> Optional[grpc.ServerCredentials]:
    """TLS credentials from the config, or None for a plaintext port."""
    if not _tls(config):
        return None
    key, cert = _read(config.tls_key, "--tls-key"), _read(config.tls_cert, "--tls-cert")
    ca = _read(config.tls_client_ca, "--tls-client-ca") if config.tls_client_ca else None
    _openssl_context(config)  # gRPC takes any bytes and fails only when it listens, as if the port were taken
    return grpc.ssl_server_credentials(
        [(key, cert)],
        root_certificates=ca, require_client_auth=ca is not None)


def _openssl_context(config: ServerConfig) -> ssl.SSLContext:
    """The server's TLS files as OpenSSL (Python's ssl) takes them, for the HTTP/REST port, and to
    check them before gRPC does: it takes any bytes and fails only when it listens, as if the port
    were in use. One line naming the file where they are not usable."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    load_tls_files(context, config.tls_cert, config.tls_key, config.tls_client_ca, "--tls-client-ca")
    if config.tls_client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def load_tokens(path: Optional[Path]) -> List[bytes]:
    if path is None:
        return []
    try:  # read on the front end's event loop, again at each change: a FIFO's read would block it for good
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        regular = True  # read_tokens says why it does not read
    if not regular:
        raise UserError(f"--auth-token-file {path}: not a regular file; the server reads it again whenever it "
                        "changes: pass a file")
    return [t.encode() for t in read_tokens(path)]


class TokenFile:
    """--auth-token-file, read again after it changes (rotation without a restart): ``tokens`` (the list
    gRPC's interceptor and HTTP check) is replaced in place. A change is read once two polls in a row
    see the file alike: one poll could catch it mid-write (``echo new > f; echo old >> f``: only the
    new token for a moment), and take a half-written file for the whole, refusing clients that hold
    a token still in force. A version that does not read keeps the previous tokens."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # the version in force and the one the last poll saw, taken before the read: a change made while
        # it reads is read again (taken after, it would pass for the version read)
        self._read = self._seen = _file_state(path)
        self.tokens = load_tokens(path)

    def poll(self) -> bool:
        """Call once per poll interval. True: the file was read again (UserError: that version does not
        read; the previous tokens stay in force)."""
        state = _file_state(self.path)
        settled, self._seen = state == self._seen, state
        if not settled or state == self._read:
            return False
        self._read = state
        self.tokens[:] = load_tokens(self.path)
        return True


def _file_state(path) -> Optional[tuple]:
    """What changes when a file is rewritten or replaced (a Kubernetes Secret's volume swaps a symlink)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def authorized(tokens: List[bytes], value: Union[str, bytes, None]) -> bool:
    """An ``authorization`` value (gRPC metadata, HTTP header) of ``Bearer <one of tokens>``. The
    SHA-256 digests are compared, with every token: comparing the tokens themselves would tell their
    lengths, and stopping at the first match which of them matched, by the time taken."""
    # surrogateescape: the bytes of a header that is not UTF-8 (aiohttp hands them over as surrogates)
    presented = (value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value) or b""
    if presented[:7].lower() != b"bearer ":  # the scheme is case-insensitive (RFC 7235)
        return False
    digest = hashlib.sha256(presented[7:].strip()).digest()
    matched = False
    for t in tokens:
        matched |= hmac.compare_digest(digest, _digest(t))
    return matched


@functools.lru_cache(maxsize=None)
def _digest(token: bytes) -> bytes:
    """A configured token's SHA-256, computed once, not per request and token (a file of a hundred
    tokens: some 80 us a request). Only configured tokens are kept, never what a client sends."""
    return hashlib.sha256(token).digest()


def server_ssl_context(config: ServerConfig) -> Optional[ssl.SSLContext]:
    """The TLS settings of :func:`server_credentials` for the HTTP/REST port, or None for plain HTTP."""
    return _openssl_context(config) if _tls(config) else None


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` metadata matching one of the tokens (several
    allow rotation); otherwise UNAUTHENTICATED before the request body reaches any handler."""

    def __init__(self, tokens: List[bytes], on_reject: Callable[[str, str], None] = lambda method, peer: None) -> None:
        """``on_reject(method, peer)``: called as each refused call is answered."""
        self._tokens = tokens
        self._on_reject = on_reject

    def _authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                return authorized(self._tokens, value)
        return False

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_SERVICES) or method in OPEN_PROBES or self._authorized(
                handler_call_details.invocation_metadata):
            return handler
        return _denying(handler, lambda peer: self._on_reject(method, peer))


def _denying(handler: grpc.RpcMethodHandler, on_deny: Callable[[str], None]) -> grpc.RpcMethodHandler:
    """A handler of the same shape (unary or streaming) as ``handler`` that only refuses."""

    async def _deny(request_or_iterator, context):
        on_deny(context.peer())
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(_deny, request_deserializer=lambda b: None, response_serializer=handler.response_serializer)
