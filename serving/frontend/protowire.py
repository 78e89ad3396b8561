"""The request messages of ``recserve.v1`` read straight from the received bytes, and the responses
written straight to bytes: the protobuf wire format, read once.

A generated message class would copy every ``bytes`` field on each access (upb builds a new Python
object each time), so a 5 MB request would be copied several times before reaching the engine. Here
each payload array is located by offset and read as a numpy view of the bytes gRPC received: the
only copy the front end makes is the one into the engine's shared buffer (serving/ipc.py).

Strictness: a singular message field given twice is refused (protobuf would merge them; no encoder
of ours or of the protobuf libraries writes that). Unknown fields are skipped, as protobuf does.
Every length and offset is checked against the buffer before use; nothing here can read past it. A
request of more than MAX_FIELDS fields is refused: this reader takes about a microsecond a field
(protobuf's C parser, a hundredth of that), and a 64 MiB message of two-byte fields would hold the
front end's event loop for half a minute.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np

from recserve import wire
from serving.errors import InvalidInput

_VARINT, _I64, _LEN, _SGROUP, _EGROUP, _I32 = 0, 1, 2, 3, 4, 5
MAX_GROUP_DEPTH = 100  # protobuf's own recursion limit
MAX_DIM = (1 << 31) - 1  # no dimension of any request array can be larger (the message limit is far below)
KEY_BYTES = 5  # protobuf reads a field's key and a length in at most 5 bytes (32 bits) and refuses longer ones
# Fields in one recserve.v1 request, its messages' and skipped groups' included: a request has a key per
# feature sent and a few fields more.
MAX_FIELDS = 1 << 16


@dataclass
class RawTensor:
    """A ``recserve.v1.Tensor`` as located in the request bytes (no copy)."""

    dtype: str = ""
    shape: List[int] = field(default_factory=list)
    data: Tuple[int, int] = (0, 0)  # [start, end) of the raw elements in the request bytes


@dataclass
class RawRequest:
    """PredictRequest or LookupRequest (``dense`` is None for Lookup)."""

    model_name: str = ""
    model_version: int = 0
    model_version_label: str = ""
    dense: Optional[RawTensor] = None
    keys: List[str] = field(default_factory=list)
    lengths: Optional[RawTensor] = None
    values: Optional[RawTensor] = None
    shared_keys: List[str] = field(default_factory=list)
    shared_lengths: Optional[RawTensor] = None
    shared_values: Optional[RawTensor] = None


def _varint(buf: bytes, pos: int, end: int, most_bytes: int = 10) -> Tuple[int, int]:
    if pos < end and buf[pos] < 0x80:  # one byte: every key and most lengths (the hot path)
        return buf[pos], pos + 1
    result = shift = 0
    while True:
        if pos >= end or shift >= 7 * most_bytes:
            raise InvalidInput("the request body is not a valid protobuf message (bad varint)")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _fields(buf: bytes, pos: int, end: int, budget: Optional[List[int]] = None):
    """(field number, wire type, value) for each field in buf[pos:end]; LEN values are (start, end).
    ``budget``: [fields the request may still have], counted down (InvalidInput below 0)."""
    while pos < end:
        if budget is not None:  # inline: a call per field is a tenth of the time of a request's parse
            budget[0] -= 1
            if budget[0] < 0:
                raise _too_many_fields()
        key, pos = _varint(buf, pos, end, KEY_BYTES)
        number, kind = key >> 3, key & 7
        if kind == _LEN:  # the usual field, read here (a call less per field on the request path)
            size, pos = _varint(buf, pos, end, KEY_BYTES)
            if size > end - pos:
                raise InvalidInput("the request body is not a valid protobuf message (field past the end)")
            value, pos = (pos, pos + size), pos + size
        else:
            value, pos = _value(buf, pos, end, number, kind, budget=budget)
        if not 0 < number < 1 << 29:
            raise InvalidInput(f"the request body is not a valid protobuf message (field number {number})")
        yield number, kind, value


def _too_many_fields() -> InvalidInput:
    return InvalidInput(f"the request has more than {MAX_FIELDS} protobuf fields; no request needs that many")


def _value(buf: bytes, pos: int, end: int, number: int, kind: int, depth: int = 0,
           budget: Optional[List[int]] = None):
    """(value, where the field ends) of a field whose key ends at ``pos``: a varint's value, a LEN
    field's (start, end), None for fixed-width fields and groups (deprecated; skipped whole, as
    protobuf skips an unknown one)."""
    if kind == _VARINT:
        return _varint(buf, pos, end)
    if kind == _LEN:
        size, pos = _varint(buf, pos, end, KEY_BYTES)
        if size > end - pos:
            raise InvalidInput("the request body is not a valid protobuf message (field past the end)")
        return (pos, pos + size), pos + size
    if kind in (_I64, _I32):
        pos += 8 if kind == _I64 else 4
        if pos > end:
            raise InvalidInput("the request body is not a valid protobuf message (field past the end)")
        return None, pos
    if kind == _SGROUP and depth < MAX_GROUP_DEPTH:
        while pos < end:
            key, pos = _varint(buf, pos, end, KEY_BYTES)
            if key == (number << 3 | _EGROUP):
                return None, pos
            if budget is not None:
                budget[0] -= 1
                if budget[0] < 0:
                    raise _too_many_fields()
            _, pos = _value(buf, pos, end, key >> 3, key & 7, depth + 1, budget)
        raise InvalidInput("the request body is not a valid protobuf message (unterminated group)")
    raise InvalidInput("the request body is not a valid protobuf message (unsupported wire type)")


def _text(buf: bytes, span: Tuple[int, int], what: str) -> str:
    try:
        return str(buf[span[0]:span[1]], "utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(f"{what}: not valid UTF-8") from None


def _once(seen: set, number: int, what: str) -> None:
    if number in seen:
        raise InvalidInput(f"{what} is given twice")
    seen.add(number)


def _tensor(buf: bytes, span: Tuple[int, int], what: str, budget: List[int]) -> RawTensor:
    t = RawTensor(data=(span[0], span[0]))
    for number, kind, value in _fields(buf, *span, budget):
        if number == 1 and kind == _LEN:
            t.dtype = _text(buf, value, f"{what}.dtype")[:16]
        elif number == 2:
            shape_field(buf, kind, value, t.shape, what)
        elif number == 3 and kind == _LEN:
            t.data = value
    check_dims(t.shape, what)
    return t


def shape_field(buf: bytes, kind: int, value, shape: List[int], what: str) -> None:
    """One occurrence of a tensor's ``repeated int64 shape`` (a varint, or packed varints), appended."""
    if kind == _VARINT:
        shape.append(_int64(value))
    elif kind == _LEN:
        pos, end = value
        while pos < end:
            v, pos = _varint(buf, pos, end)
            shape.append(_int64(v))
    if len(shape) > 8:
        raise InvalidInput(f"{what}.shape: more than 8 dimensions")


def check_dims(shape: List[int], what: str) -> None:
    for d in shape:
        if d < 0 or d > MAX_DIM:
            raise InvalidInput(f"{what}.shape: dimension {d} is outside [0, {MAX_DIM}]")


_SPARSE_TENSORS = {2: "lengths", 3: "values", 5: "shared_lengths", 6: "shared_values"}


_KEY_TAG = (1 << 3) | _LEN  # SparseFeatures.keys


def _sparse(buf: bytes, span: Tuple[int, int], request: RawRequest, budget: List[int]) -> None:
    seen: set = set()
    pos, end = span
    keys = request.keys
    # The keys first, the way encoders write them: each a one-byte tag and a one-byte size (a
    # request names every feature; a field at a time through _fields costs 3 calls per key).
    left = budget[0]
    while pos + 1 < end and buf[pos] == _KEY_TAG and buf[pos + 1] < 0x80 and left:
        left -= 1
        start = pos + 2
        pos = start + buf[pos + 1]
        if pos > end:
            raise InvalidInput("the request body is not a valid protobuf message (field past the end)")
        keys.append(_text(buf, (start, pos), "sparse.keys"))
    budget[0] = left  # a key more goes through _fields, which refuses it
    for number, kind, value in _fields(buf, pos, end, budget):
        if number == 1 and kind == _LEN:
            request.keys.append(_text(buf, value, "sparse.keys"))
        elif number == 4 and kind == _LEN:
            request.shared_keys.append(_text(buf, value, "sparse.shared_keys"))
        elif number in _SPARSE_TENSORS and kind == _LEN:
            name = _SPARSE_TENSORS[number]
            _once(seen, number, f"sparse.{name}")
            setattr(request, name, _tensor(buf, value, f"sparse.{name}", budget))


def parse_request(buf: bytes, predict: bool) -> RawRequest:
    """PredictRequest (``predict``) or LookupRequest fields, located in ``buf``."""
    request = RawRequest()
    sparse_field = 4 if predict else 3
    seen: set = set()
    budget = [MAX_FIELDS]
    for number, kind, value in _fields(buf, 0, len(buf), budget):
        if number == 1 and kind == _LEN:
            request.model_name = _text(buf, value, "model_name")
        elif number == 2 and kind == _VARINT:
            request.model_version = _int64(value)
        elif predict and number == 3 and kind == _LEN:
            _once(seen, number, "dense")
            request.dense = _tensor(buf, value, "dense", budget)
        elif number == sparse_field and kind == _LEN:
            _once(seen, number, "sparse")
            _sparse(buf, value, request, budget)
        elif number == sparse_field + 1 and kind == _LEN:
            request.model_version_label = _text(buf, value, "model_version_label")
    if not request.keys:  # no per-sample features (a Lookup of shared bags, a Predict of dense alone): none sent
        request.lengths = request.lengths or RawTensor(dtype="int32", shape=[0])
        request.values = request.values or RawTensor(dtype="int64", shape=[0])
    return request


def view(buf: bytes, tensor: Optional[RawTensor], what: str, allowed: Tuple[str, ...], ndim: int) -> np.ndarray:
    """A read-only numpy view of a located tensor, checked for dtype, rank and byte count."""
    tensor = tensor or RawTensor()
    try:
        return wire.view(buf, *tensor.data, tensor.dtype, tensor.shape, what, allowed, ndim)
    except wire.WireError as e:
        raise InvalidInput(str(e)) from None


# -- responses -----------------------------------------------------------------------------------
def _key(number: int, kind: int) -> bytes:
    return _encode_varint((number << 3) | kind)


def _encode_varint(value: int) -> bytes:
    value &= 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(number: int, payload_size: int) -> bytes:
    return _key(number, _LEN) + _encode_varint(payload_size)


def _tensor_parts(shape: Tuple[int, ...], data) -> List:
    """The parts of a float32 Tensor message whose raw bytes are ``data`` (any buffer)."""
    dims = b"".join(_encode_varint(d) for d in shape)
    head = (_len_field(1, 7) + b"float32" + _len_field(2, len(dims)) + dims)
    nbytes = memoryview(data).nbytes
    return [head + _len_field(3, nbytes), data]


def _string_field(number: int, value: str) -> bytes:
    encoded = value.encode()
    return _len_field(number, len(encoded)) + encoded


def _message(number: int, parts: List) -> List:
    size = sum(memoryview(p).nbytes for p in parts)
    return [_len_field(number, size)] + parts


def _name_version(name_field: int, name: str, version: int) -> bytes:
    return _string_field(name_field, name) + _key(name_field + 1, _VARINT) + _encode_varint(version)


def predict_response(ctr, batch_size: int, name: str, version: int) -> bytes:
    """PredictResponse bytes; ``ctr`` is any buffer of ``batch_size`` float32 (copied once, here)."""
    return b"".join(_message(1, _tensor_parts((batch_size,), ctr)) + [_name_version(2, name, version)])


def lookup_response(keys: List[str], dims: List[int], pooled, batch_size: int, name: str, version: int) -> bytes:
    """LookupResponse bytes; ``pooled`` is any buffer of float32 [batch_size, sum(dims)]."""
    parts = []
    for k in keys:
        parts.append(_string_field(1, k))
    packed = b"".join(_encode_varint(d) for d in dims)
    parts.append(_len_field(2, len(packed)) + packed)
    parts += _message(3, _tensor_parts((batch_size, sum(dims)), pooled))
    parts.append(_name_version(4, name, version))
    return b"".join(parts)


def model_info_response(infos: List[bytes]) -> bytes:
    """GetModelInfoResponse bytes from serialized ModelInfo messages."""
    return b"".join(_len_field(1, len(info)) + info for info in infos)


# The Open Inference Protocol's reader and writer (serving/frontend/oip/wire.py) use the same primitives.
LEN, VARINT = _LEN, _VARINT
fields, text, once, varint, int64 = _fields, _text, _once, _varint, _int64
len_field, string_field, encode_varint = _len_field, _string_field, _encode_varint
