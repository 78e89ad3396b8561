"""A small Python client for ``recserve serve``.

    from recserve.client import Client, ClientSecurity
    with Client("127.0.0.1:50051") as c:
        ctr = c.predict("demo", dense, {"user_id": [[3], [7]], "item_id": [[1, 2], []]})
        keys, dims, pooled = c.lookup("demo", {"item_id": [[1, 2], [5]]})
        # one user, two candidates: the user's bag travels once
        ctr = c.predict("demo", dense, {"item_id": [[1, 2], [5]]}, shared={"user_id": [3]})
    # A server started with --tls-cert/--tls-key (--tls-client-ca: mutual TLS) and --auth-token-file:
    security = ClientSecurity(tls_ca="ca.pem", tls_cert="client.pem", tls_key="client.key", token="T")
    with Client("recserve.example:50051", security=security) as c: ...

Sparse features are given as a dict ``feature -> list of bags`` (one bag of ids per sample) or as
the raw KJT triple ``(keys, lengths, values)``; dense as any float array [B, F].

A call the server or gRPC refuses raises :class:`ClientError` (a ``grpc.RpcError``): ``code()`` the
status code, ``details()`` the server's message, ``str()`` both in one line. Retries: see :class:`Client`.
"""
from __future__ import annotations

import argparse
import json
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from recserve import wire
from recserve.errors import UserError
from recserve.ids import UNIFORM, IdDistribution
from recserve.v1 import inference_pb2 as pb
from recserve.v1 import inference_pb2_grpc as pb_grpc

Bags = Mapping[str, Sequence[Sequence[int]]]
RawKJT = Tuple[Sequence[str], np.ndarray, np.ndarray]
SharedBags = Mapping[str, Sequence[int]]  # feature -> the one bag of ids of every sample


def _integers(values, what: str) -> np.ndarray:
    """``values`` as an integer array, refused if they are not integers: numpy's cast would send 1.7
    as 1, True as 1, and a number past int64 not at all (an empty list is float to numpy)."""
    array = np.asarray(values)
    if array.size and array.dtype.kind not in "iu":
        exact = np.asarray(values, dtype=object)  # Python ints past int64 beside others: float64 or objects
        if array.dtype.kind not in "fO" or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                                                   for v in exact.flat):
            raise ValueError(f"{what} must be integers, got {array.dtype} values")
        return exact  # the exact integers, for the caller's range check
    return array


def _ids(values, what: str = "ids") -> np.ndarray:
    """Ids as they travel: int32 or int64 kept (int32 is half the bytes), other integers as int64.
    ``what``: the ids as a refusal names them (``ids of feature 'f'`` where the feature is known)."""
    values = _integers(values, what)
    if values.dtype.kind in "uO" and values.size and not -2**63 <= values.min() <= values.max() < 2**63:
        raise ValueError(f"{what} must fit int64, got {values.max() if values.max() >= 2**63 else values.min()}")
    return values if values.dtype in (np.int32, np.int64) else values.astype(np.int64)


def _lengths(values) -> np.ndarray:
    """Bag lengths as they travel, int32; a length past int32 is refused, not wrapped."""
    values = _integers(values, "lengths")
    if values.size and not (-2**31 <= values.min() and values.max() < 2**31):
        raise ValueError(f"lengths must fit int32, got {values.min()} to {values.max()}")
    return values.astype(np.int32, copy=False)


def _check_kjt(keys: Sequence[str], lengths: np.ndarray, values: np.ndarray) -> None:
    """Lengths that cannot describe ``values``, refused before the call, in the server's words."""
    if isinstance(keys, str):  # list("user_id") would send 7 one-letter keys
        raise ValueError(f"sparse keys: expected a list of feature names, got the string {keys!r}")
    if lengths.size and lengths.min() < 0:
        where = lengths.size // len(keys) if keys and lengths.size % len(keys) == 0 else 0
        feature = f" for feature {keys[int(np.argmax(lengths < 0)) // where]!r}" if where else ""
        raise ValueError(f"sparse.lengths: negative length{feature}")
    total = int(lengths.sum(dtype=np.int64))
    if total != values.size:
        raise ValueError(f"sparse.lengths sum to {total} but sparse.values has {values.size} ids")


def _bag_lengths(sparse: Bags, keys: Sequence[str]) -> np.ndarray:
    """Each feature's bag lengths, key-major; a bag that is not a list of ids (``{"f": [3, 7]}`` for
    ``{"f": [[3], [7]]}``) is refused, naming it."""
    lengths = []
    for k in keys:
        for i, bag in enumerate(sparse[k]):
            if isinstance(bag, (str, bytes)) or not hasattr(bag, "__len__"):
                raise ValueError(f"sparse[{k!r}][{i}]: expected a bag (a list of ids) per sample, got {bag!r}; "
                                 "a sample of one id is [id]")
            lengths.append(len(bag))
    return np.array(lengths, dtype=np.int32)


def encode_sparse(sparse: Union[Bags, RawKJT], shared: Optional[SharedBags] = None) -> pb.SparseFeatures:
    """``sparse``: per-sample bags; ``shared``: feature -> one bag of ids for every sample of the request
    (sent once, expanded by the server)."""
    if isinstance(sparse, tuple):
        keys, lengths, values = sparse
        lengths, values = _lengths(lengths), _ids(values)
        _check_kjt(keys, lengths, values)
        message = pb.SparseFeatures(keys=list(keys), lengths=wire.encode(lengths), values=wire.encode(values))
    else:
        keys = list(sparse)
        counts = {k: len(bags) for k, bags in sparse.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(f"every feature needs one bag per sample, as many as the others; got bag counts {counts}")
        lengths = _bag_lengths(sparse, keys)
        ids = [_ids([i for bag in sparse[k] for i in bag], f"ids of feature {k!r}") for k in keys]
        values = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        message = pb.SparseFeatures(keys=keys, lengths=wire.encode(lengths), values=wire.encode(values))
    if shared:
        bags = [_ids(bag, f"ids of shared feature {k!r}").reshape(-1) for k, bag in shared.items()]
        message.shared_keys.extend(shared)
        message.shared_lengths.CopyFrom(wire.encode(np.array([len(b) for b in bags], dtype=np.int32)))
        dtype = np.int32 if all(b.dtype == np.int32 for b in bags) else np.int64
        message.shared_values.CopyFrom(wire.encode(np.concatenate(bags).astype(dtype, copy=False) if bags
                                                   else np.zeros(0, dtype)))
    return message


# A target without a scheme is HOST:PORT; these schemes are gRPC's own, taken as they are.
_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")


def check_target(target: str) -> str:
    """``target`` if it names a port: without one gRPC dials 443, which no recserve server listens on
    unless told to (Triton's and TF Serving's clients take explicit ports too)."""
    if target.startswith(_SCHEMES):
        return target
    scheme, slashes, _ = target.partition("://")
    if slashes:  # a URL: gRPC has no http scheme and failed every call, UNAVAILABLE
        raise UserError(f"target {target!r}: a gRPC target has no {scheme}:// scheme: pass HOST:PORT (TLS: "
                        "--tls-ca, not https://)")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit() or (":" in host and not host.startswith("[")):
        raise UserError(f"target {target!r} names no port: pass HOST:PORT (recserve serve listens on port 50051 "
                        "unless --port says otherwise)")
    if not 0 < int(port) < 65536:  # gRPC would dial the port modulo 65536: another one
        raise UserError(f"target {target!r}: port {port} is not a TCP port (1 to 65535)")
    return target


def spread_target(targets: Sequence[str]) -> str:
    """Several HOST:PORT targets as one gRPC target (``ipv4:`` or ``ipv6:`` and a list): those schemes
    take addresses only, so host names are resolved here, once (for servers that come and go, pass
    one ``dns:///`` name that resolves to all of them)."""
    found = []
    for t in targets:
        if t.startswith(_SCHEMES):
            raise UserError(f"target {t!r}: give several servers as HOST:PORT each, or one dns:/// name")
        host, _, port = t.rpartition(":")
        host = host[1:-1] if host.startswith("[") else host
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            raise UserError(f"target {t!r}: cannot resolve {host!r} ({e})") from None
        found.append(([i[4][0] for i in infos if i[0] == socket.AF_INET],
                      [i[4][0] for i in infos if i[0] == socket.AF_INET6], port))
    if all(v4 for v4, _, _ in found):
        return "ipv4:" + ",".join(f"{v4[0]}:{port}" for v4, _, port in found)
    if all(v6 for _, v6, _ in found):
        return "ipv6:" + ",".join(f"[{v6[0]}]:{port}" for _, v6, port in found)
    raise UserError(f"targets {list(targets)}: some hosts have IPv4 addresses only, some IPv6 only; gRPC balances "
                    "over one family: give addresses of one")


_REQUEST_KEYS = ("dense", "sparse", "shared")


def _id_list(ids, where: str) -> List[int]:
    if not isinstance(ids, list):
        raise UserError(f"{where}: expected a list of integer ids, got {json.dumps(ids)[:40]}")
    for i, value in enumerate(ids):
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{where}[{i}]: {json.dumps(value)[:40]} is not an integer id")
        if not -2**63 <= value < 2**63:  # ids travel as int64: no table has such a row
            raise UserError(f"{where}[{i}]: {json.dumps(value)[:40]} is outside int64, the ids' type")
    return ids


def request_from_json(payload) -> Tuple[np.ndarray, Bags, Optional[SharedBags]]:
    """(dense, sparse, shared) from the JSON of ``recserve predict --input``: ``{"dense": [[...], ...],
    "sparse": {"feature": [[ids of sample 0], ...]}, "shared": {"feature": [ids]}}`` ("shared" optional).
    Every key known, ids integers (1.9 or true is refused, never truncated), numbers in "dense"."""
    if not isinstance(payload, dict):
        raise UserError("expected a JSON object with \"dense\" and \"sparse\"")
    unknown = [k for k in payload if k not in _REQUEST_KEYS]
    missing = [k for k in _REQUEST_KEYS[:2] if k not in payload]
    if unknown or missing:
        what = f"unknown key {unknown[0]!r}" if unknown else f"{missing[0]!r} is missing"
        raise UserError(f"{what}; the keys are {list(_REQUEST_KEYS)} (\"shared\" optional)")
    dense = payload["dense"]
    if not isinstance(dense, list) or not dense or not all(
            isinstance(row, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in row)
            for row in dense) or len({len(row) for row in dense}) > 1:
        raise UserError("\"dense\": expected a list of samples, each a list of the same count of numbers")
    try:
        with np.errstate(over="raise"):  # 3.5e38 would be inf, and a RuntimeWarning on stderr
            dense = np.asarray(dense, dtype=np.float32).reshape(len(dense), -1)
    except (OverflowError, FloatingPointError):  # beyond any float's range; beyond float32's
        raise UserError("\"dense\": a number is too large to be a float") from None
    sparse = payload["sparse"]
    if not isinstance(sparse, dict):
        raise UserError("\"sparse\": expected an object mapping each feature to its bags of ids, one per sample")
    for name, bags in sparse.items():
        if not isinstance(bags, list):
            raise UserError(f"\"sparse\"[{name!r}]: expected a list of bags of ids, one per sample")
        if len(bags) != len(dense):
            raise UserError(f"\"sparse\"[{name!r}]: {len(bags)} bags for {len(dense)} samples in \"dense\" (one bag "
                            "per sample; an empty one is [])")
        for b, bag in enumerate(bags):
            _id_list(bag, f"\"sparse\"[{name!r}][{b}]")
    shared = payload.get("shared")
    if shared is not None:
        if not isinstance(shared, dict):
            raise UserError("\"shared\": expected an object mapping each feature to one bag of ids")
        for name, bag in shared.items():
            _id_list(bag, f"\"shared\"[{name!r}]")
    return dense, sparse, shared


# A call's deadline is an absolute time in int64 nanoseconds inside gRPC: a longer timeout (inf, 1e10 s)
# wraps into the past and the call fails DEADLINE_EXCEEDED without reaching the server.
MAX_TIMEOUT_S = 86400


def check_timeout(timeout: float, what: str = "timeout") -> None:
    if not 0 < timeout <= MAX_TIMEOUT_S:  # NaN too
        raise UserError(f"{what} must be > 0 and at most {MAX_TIMEOUT_S} seconds, got {timeout:g}")


# Several servers: spread calls over all of them, skip those that are down, retry a call that one
# of them refused with UNAVAILABLE (queue full, shutting down) on another.
SPREAD_SERVICE_CONFIG = json.dumps({
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [{
        "name": [{"service": "recserve.v1.Inference"}],
        "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.2s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
    }],
})


def _read(path: Union[str, Path], flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read ({e.strerror})") from e


def load_tls_files(context: ssl.SSLContext, cert, key, ca, ca_flag: str) -> None:
    """Load the TLS files into ``context`` as OpenSSL takes them, one line naming the file where they
    are not usable: gRPC takes any bytes and fails later (a server when it listens, as if the port
    were taken; a client on each call, UNAVAILABLE, as if the server were down). The server's and the
    clients' files alike (``ca_flag``: the flag that names the CA file)."""
    if cert:
        try:
            # No password: an encrypted key is refused here, where OpenSSL would otherwise prompt for one.
            context.load_cert_chain(str(cert), str(key), password=b"")
        except ssl.SSLError as e:
            why = "the key does not match the certificate: pass the key it was made for" \
                if "KEY_VALUES_MISMATCH" in str(e) else f"expected a PEM certificate chain and its unencrypted PEM " \
                f"key (OpenSSL: {e.reason or e})"
            raise UserError(f"--tls-cert {cert} / --tls-key {key}: {why}") from None
    if ca:
        try:
            context.load_verify_locations(cafile=str(ca))
        except ssl.SSLError as e:
            raise UserError(f"{ca_flag} {ca}: expected PEM CA certificates (OpenSSL: {e.reason or e})") from None


def read_tokens(path: Union[str, Path]) -> List[str]:
    """The bearer tokens of an ``--auth-token-file``, as the server and the clients read one: a
    token per line, ``#`` comments; a byte order mark (some editors write one) is not part of the
    first token."""
    try:
        text = _read(path, "--auth-token-file").decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"--auth-token-file {path}: not UTF-8 text (one token per line)") from None
    tokens = []
    for number, line in enumerate(text.splitlines(), 1):
        token = line.strip()
        if not token or token.startswith("#"):
            continue
        if not (token.isascii() and token.isprintable()):  # gRPC fails every call that sends one: INTERNAL
            raise UserError(f"--auth-token-file {path}: line {number}: a token must be printable ASCII characters "
                            "(it travels in an HTTP/2 header, which carries no others)")
        tokens.append(token)
    if not tokens:
        raise UserError(f"--auth-token-file {path}: no token in it (one token per line)")
    return tokens


@dataclass(frozen=True)
class ClientSecurity:
    """What a client needs for a server that serves TLS or asks for tokens (serve --tls-cert,
    --tls-client-ca, --auth-token-file). Nothing set: plaintext, no token.

    - ``tls_ca``: PEM bundle of the CA that signed the server's certificate; turns TLS on
      (``tls=True`` alone: TLS checked against the system's CAs).
    - ``tls_cert`` + ``tls_key``: the client's certificate and key, for a server that requires them
      (mutual TLS).
    - ``token``: sent as ``authorization: Bearer <token>`` on every call.
    - ``server_name``: the name the server's certificate carries, where the target's host differs
      (an IP address, a load balancer).
    """

    tls_ca: Optional[Union[str, Path]] = None
    tls_cert: Optional[Union[str, Path]] = None
    tls_key: Optional[Union[str, Path]] = None
    token: Optional[str] = None
    tls: bool = False
    server_name: Optional[str] = None

    def __post_init__(self) -> None:
        if self.token is not None and not (self.token.isascii() and self.token.isprintable()):
            # gRPC fails every call that sends one, INTERNAL "Invalid metadata" (a token read from a file
            # with its newline, say)
            raise UserError("token: a bearer token must be printable ASCII characters (it travels in an HTTP/2 "
                            "header); strip the newline of a token read from a file, or use read_tokens")

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls or self.tls_ca or self.tls_cert or self.tls_key or self.server_name)

    def metadata(self) -> List[Tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []

    def channel(self, target: str, options: Sequence = ()) -> grpc.Channel:
        """A channel to ``target``: TLS as configured, else plaintext. Files are read here, so that
        a wrong path is one line (UserError) before any call."""
        check_target(target)
        if not self.uses_tls:
            return grpc.insecure_channel(target, options=list(options))
        if bool(self.tls_cert) != bool(self.tls_key):
            raise UserError("a client certificate needs both --tls-cert and --tls-key")
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca, "--tls-ca") if self.tls_ca else None,
            private_key=_read(self.tls_key, "--tls-key") if self.tls_key else None,
            certificate_chain=_read(self.tls_cert, "--tls-cert") if self.tls_cert else None)
        load_tls_files(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), self.tls_cert, self.tls_key, self.tls_ca,
                       "--tls-ca")  # readable, as just read
        name = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return grpc.secure_channel(target, credentials, options=[*options, *name])

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
        """The client-side flags of every command that talks to a server (predict, bench, locust:
        ``prefix="grpc-"`` there, since locust's own --tls-cert is for its web UI)."""
        def flag(name: str, **kw) -> None:
            parser.add_argument(f"--{prefix}{name}", dest=f"{prefix}{name}".replace("-", "_"), default=None, **kw)

        flag("tls-ca", type=Path, help="PEM CA bundle that signed the server's certificate: connect over TLS")
        flag("tls-cert", type=Path,
             help="PEM client certificate, for a server that requires one (mutual TLS; with --tls-key)")
        flag("tls-key", type=Path, help="PEM private key of the client certificate")
        flag("tls-server-name", help="the name in the server's certificate, where it differs from the target's host")
        flag("auth-token-file", type=Path, help="file whose first line is the bearer token to send (a file, not a "
                                                "flag: command lines are visible to every user of the host)")

    @classmethod
    def from_args(cls, args: argparse.Namespace, prefix: str = "") -> "ClientSecurity":
        def value(name: str):
            return getattr(args, f"{prefix}{name}".replace("-", "_"))

        token_file = value("auth-token-file")
        token = None if token_file is None else read_tokens(token_file)[0]
        return cls(tls_ca=value("tls-ca"), tls_cert=value("tls-cert"), tls_key=value("tls-key"), token=token,
                   server_name=value("tls-server-name"))


PLAINTEXT = ClientSecurity()
MAX_SEND_BYTES = 256 << 20  # the largest request a Client sends unless its options say otherwise


class ClientError(grpc.RpcError):
    """A call the server or gRPC refused. ``code()``: the ``grpc.StatusCode``; ``details()``: the
    server's message (or gRPC's, for a server it could not reach); ``str()``: ``"CODE: message"``,
    one line (gRPC's own error prints several, its debug string among them). A ``grpc.RpcError``,
    as callers of the stubs catch, with what else they read from one (the status's trailing metadata,
    gRPC's debug string, as ``grpc.Call``); it pickles (a multiprocessing queue, a process pool)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: Sequence[Tuple[str, str]] = (),
                 debug_error_string: str = "", initial_metadata: Sequence[Tuple[str, str]] = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self._debug_error_string = code, details, debug_error_string
        # plain pairs: gRPC's are namedtuples of its C extension
        self._trailing_metadata = tuple((key, value) for key, value in trailing_metadata or ())
        self._initial_metadata = tuple((key, value) for key, value in initial_metadata or ())

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Tuple[Tuple[str, str], ...]:
        return self._trailing_metadata

    def initial_metadata(self) -> Tuple[Tuple[str, str], ...]:
        return self._initial_metadata

    def debug_error_string(self) -> str:
        return self._debug_error_string

    def __reduce__(self):
        return type(self), (self._code, self._details, self._trailing_metadata, self._debug_error_string,
                             self._initial_metadata)


class Client:
    """``target``: "host:port", or several "host:port" (a list, or comma-separated) to balance over
    with gRPC's round_robin policy (each server health-checked by its connection state), or one
    "dns:///name:port", balanced the same way over every address the name resolves to (a headless
    Service's pods; gRPC resolves it again when a connection drops).
    ``timeout``: seconds each call may take, sent as its gRPC deadline (None: no deadline).
    ``security``: TLS and token (:class:`ClientSecurity`); plaintext by default.

    A refused call raises :class:`ClientError`. Retries: with one HOST:PORT target, none (UNAVAILABLE, a
    full queue or a server going down, is the caller's to retry with backoff); with several, or a dns:
    name, gRPC retries a call refused UNAVAILABLE on the next server, at most 3 attempts in all (backoff
    10 ms doubling to 200 ms, jittered: SPREAD_SERVICE_CONFIG), within the call's one deadline. No other
    code is retried (RESOURCE_EXHAUSTED is a request too large ever to run; INVALID_ARGUMENT would fail
    again)."""

    def __init__(self, target: Union[str, Sequence[str]], timeout: Optional[float] = 10.0,
                 metadata: Optional[Sequence[Tuple[str, str]]] = None, options: Sequence = (),
                 security: ClientSecurity = PLAINTEXT) -> None:
        targets = [check_target(t.strip()) for t in (target.split(",") if isinstance(target, str) else target)
                   if t.strip()]
        if not targets:
            raise UserError(f"no target in {target!r}: pass HOST:PORT (recserve serve listens on port 50051 unless "
                            "--port says otherwise)")
        if timeout is not None:
            check_timeout(timeout)
        # one dns: name may resolve to several servers (a headless Service's pods): spread too
        target = spread_target(targets) if len(targets) > 1 else targets[0]
        spread = [("grpc.service_config", SPREAD_SERVICE_CONFIG), ("grpc.enable_retries", 1)] \
            if len(targets) > 1 or target.startswith("dns:") else []
        self.channel = security.channel(target, options=[
            *options,  # first: gRPC takes the first value of an option given twice
            # no limit on answers: a Lookup's is as large as its request asks (B x the model's columns)
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", MAX_SEND_BYTES),
            # a retry (SPREAD_SERVICE_CONFIG) needs the request still held: gRPC keeps 256 KiB by default,
            # less than one B=4096 request, and past that sends the refusal to the caller
            ("grpc.per_rpc_retry_buffer_size", MAX_SEND_BYTES), *spread])
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.timeout = timeout
        self.metadata = [*security.metadata(), *(metadata or [])]

    def predict(self, model: str, dense, sparse: Union[Bags, RawKJT], version: int = 0,
                shared: Optional[SharedBags] = None, label: str = "") -> np.ndarray:
        """The CTRs float32 [B], a read-only view of the answer's bytes (``np.array(ctr)`` for a copy to change
        in place). ``version`` (0: the model's default version) or ``label`` (a version label) picks the version."""
        request = pb.PredictRequest(model_name=model, model_version=version, model_version_label=label,
                                    dense=wire.encode(np.asarray(dense, dtype=np.float32)),
                                    sparse=encode_sparse(sparse, shared))
        response = self._call(self.stub.Predict, request)
        return wire.decode(response.ctr, "ctr", ("float32",), ndim=1)

    def lookup(self, model: str, sparse: Union[Bags, RawKJT], version: int = 0,
               shared: Optional[SharedBags] = None, label: str = "") -> Tuple[List[str], List[int], np.ndarray]:
        """(keys, dims, pooled [B, sum(dims)]): the per-sample features' columns, then the shared ones'.
        ``pooled`` is a read-only view of the answer's bytes (no copy of B x columns floats): ``pooled /= n``
        raises; ``np.array(pooled)`` is a copy to change in place."""
        request = pb.LookupRequest(model_name=model, model_version=version, model_version_label=label,
                                   sparse=encode_sparse(sparse, shared))
        response = self._call(self.stub.Lookup, request)
        return list(response.keys), list(response.dims), wire.decode(response.pooled, "pooled", ("float32",), ndim=2)

    def model_info(self, model: str = "", version: int = 0, label: str = "") -> pb.GetModelInfoResponse:
        """Every loaded model, or ``model``: with the schema of ``version`` or ``label`` (as in predict),
        else of its default version."""
        request = pb.GetModelInfoRequest(model_name=model, model_version=version, model_version_label=label)
        return self._call(self.stub.GetModelInfo, request)

    def _call(self, rpc, request):
        try:
            return rpc(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise ClientError(e.code(), e.details() or "", e.trailing_metadata(), e.debug_error_string(),
                              e.initial_metadata()) from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _random_bags(rng: np.random.Generator, features: Sequence[pb.FeatureInfo], indices: Sequence[int],
                 batch_size: int, mean_ids: float, id_dtype, ids: IdDistribution) -> Tuple[np.ndarray, np.ndarray]:
    """(lengths int32 [K, B] Poisson(mean_ids), values key-major: ids of each feature's table drawn from
    ``ids``; ``indices``: each feature's position in the model, which places its hot rows)."""
    lengths = rng.poisson(mean_ids, size=(len(features), batch_size)).astype(np.int32)
    values = [ids.sample(rng, f.rows, int(lengths[k].sum()), t) for k, (t, f) in enumerate(zip(indices, features))]
    return lengths, (np.concatenate(values) if values else np.zeros(0)).astype(id_dtype)


def _id_dtype(info: pb.ModelInfo):
    """Ids travel as int32 where every table has fewer than 2**31 rows: half the bytes of int64."""
    return np.int32 if max(f.rows for f in info.features) < 2**31 else np.int64


def random_request(info: pb.ModelInfo, batch_size: int, mean_ids: float = 3.0,
                   seed: Optional[int] = None, ids: IdDistribution = UNIFORM) -> Tuple[np.ndarray, RawKJT]:
    """A valid random (dense, sparse) for a model, shaped from its GetModelInfo, ids drawn from
    ``ids`` (recserve/ids.py)."""
    rng = np.random.default_rng(seed)
    lengths, values = _random_bags(rng, info.features, range(len(info.features)), batch_size, mean_ids,
                                   _id_dtype(info), ids)
    dense = rng.standard_normal((batch_size, info.dense_features)).astype(np.float32)
    return dense, ([f.name for f in info.features], lengths.reshape(-1), values)


def ranking_request(info: pb.ModelInfo, batch_size: int, shared_features: Sequence[str], mean_ids: float = 3.0,
                    shared_mean_ids: float = 50.0, seed: Optional[int] = None, ids: IdDistribution = UNIFORM
                    ) -> Tuple[np.ndarray, RawKJT, Dict[str, np.ndarray]]:
    """A valid random ranking request: one user, ``batch_size`` candidates. (dense, the per-sample
    features' KJT, {shared feature: its one bag}); shared bags hold Poisson(``shared_mean_ids``) ids."""
    rng = np.random.default_rng(seed)
    dtype = _id_dtype(info)
    shared_set = set(shared_features)
    per_sample = [(t, f) for t, f in enumerate(info.features) if f.name not in shared_set]
    shared = [(t, f) for t, f in enumerate(info.features) if f.name in shared_set]
    lengths, values = _random_bags(rng, [f for _, f in per_sample], [t for t, _ in per_sample], batch_size,
                                   mean_ids, dtype, ids)
    shared_lengths, shared_values = _random_bags(rng, [f for _, f in shared], [t for t, _ in shared], 1,
                                                 shared_mean_ids, dtype, ids)
    bags = dict(zip((f.name for _, f in shared), np.split(shared_values, np.cumsum(shared_lengths[:, 0])[:-1])))
    dense = rng.standard_normal((batch_size, info.dense_features)).astype(np.float32)
    return dense, ([f.name for _, f in per_sample], lengths.reshape(-1), values), bags


def repeat_shared(sparse: RawKJT, shared: Mapping[str, np.ndarray], batch_size: int) -> RawKJT:
    """The per-sample form of a request with shared bags: each shared bag repeated for every sample."""
    keys, lengths, values = sparse
    bags = [np.asarray(bag) for bag in shared.values()]
    lengths = np.concatenate([np.asarray(lengths, np.int32)] + [np.full(batch_size, len(b), np.int32) for b in bags])
    values = np.concatenate([np.asarray(values)] + [np.tile(b, batch_size) for b in bags])
    return list(keys) + list(shared), lengths, values


def shared_feature_names(spec: str, info: pb.ModelInfo) -> Tuple[str, ...]:
    """``--shared-features``: a count N (the model's first N features) or comma-separated names."""
    names = [f.name for f in info.features]
    if spec.strip().isdigit():
        n = int(spec)
        if n > len(names):  # all of them is a request the server serves, as are all of them by name
            raise ValueError(f"--shared-features {n}: the model has {len(names)} features")
        return tuple(names[:n])
    chosen = tuple(s.strip() for s in spec.split(",") if s.strip())
    unknown = [c for c in chosen if c not in names]
    if unknown:
        raise ValueError(f"--shared-features: unknown features {unknown}; the model has {names}")
    return chosen
