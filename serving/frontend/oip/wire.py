"""``inference.ModelInferRequest`` read straight from the received bytes and ``ModelInferResponse``
written straight to bytes (protos/recserve/oip/grpc_predict_v2.proto), for the reason
serving/frontend/protowire.py gives: each ``raw_input_contents`` entry becomes a numpy view of the bytes gRPC
received, not a copy per access. Typed ``contents`` (varints) are decoded by the generated message.

A request has a tensor per feature (53 for a 26-feature model), so what Python does per tensor is
most of its cost. :func:`parse_infer` reads the top level here and hands the ``inputs`` records
(names, datatypes, shapes: a few KiB, never the data) to the generated message in one call, which
parses them in C; a request that this fast path does not take whole (typed contents, records
larger than :data:`FAST_INPUT_BYTES`, anything malformed) is read field by field as before, so the
answer, the error included, does not depend on the path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from google.protobuf.message import DecodeError

from recserve import wire
from recserve.oip import grpc_predict_v2_pb2 as oip
from serving.errors import InvalidInput
from serving.frontend.validate import quoted
from serving.frontend.oip.shm import BYTE_SIZE, NO_SHARED_MEMORY, OFFSET, REGION, Placement, SharedMemory, placement
from serving.frontend.protowire import (KEY_BYTES, LEN, MAX_DIM, MAX_FIELDS, VARINT, check_dims, encode_varint, fields,
                                        int64, len_field, once, shape_field, string_field, text, varint)

DTYPES = {"FP32": "float32", "INT32": "int32", "INT64": "int64"}  # OIP datatype -> recserve.wire dtype
_CONTENTS = {"FP32": "fp32_contents", "INT32": "int_contents", "INT64": "int64_contents"}
Span = Tuple[int, int]


@dataclass
class InferInput:
    """One ``InferInputTensor`` as located in the request bytes."""

    name: str = ""
    datatype: str = ""
    shape: List[int] = field(default_factory=list)
    contents: Optional[Span] = None
    where: Optional[Placement] = None  # in a shared-memory region (its parameters name one)


@dataclass
class InferRequest:
    model_name: str = ""
    model_version: str = ""
    id: str = ""
    inputs: List[InferInput] = field(default_factory=list)
    outputs: List[str] = field(default_factory=list)  # requested output names
    parameters: Dict[str, object] = field(default_factory=dict)  # the request's string and int64 parameters
    raw: List[Span] = field(default_factory=list)  # raw_input_contents
    in_shared_memory: int = 0  # inputs placed in shared-memory regions (they have no raw entry)
    output_places: Dict[str, Placement] = field(default_factory=dict)  # outputs to write into regions


def _input(buf: bytes, span: Span, budget: List[int]) -> InferInput:
    t = InferInput()
    parameters: Dict[str, object] = {}
    for number, kind, value in fields(buf, *span, budget):
        if number == 1 and kind == LEN:
            t.name = text(buf, value, "inputs.name")
        elif number == 2 and kind == LEN:
            t.datatype = text(buf, value, f"input {t.name!r} datatype")[:16]
        elif number == 3:
            shape_field(buf, kind, value, t.shape, f"input {t.name!r}")
        elif number == 4 and kind == LEN:
            _parameter(buf, value, parameters, budget, ints=True)
        elif number == 5 and kind == LEN:
            t.contents = value
    check_dims(t.shape, f"input {t.name!r}")
    t.where = placement(parameters, f"input {t.name!r}", has_data=t.contents is not None)
    return t


def _parameter(buf: bytes, span: Span, parameters: Dict[str, object], budget: List[int],
               ints: bool = False) -> None:
    """One map entry (key = 1, InferParameter value = 2); string parameters are kept, and int64 ones
    with ``ints`` (an input's or output's place in shared memory, the request's timeout)."""
    key, value = "", None
    for number, kind, v in fields(buf, *span, budget):
        if number == 1 and kind == LEN:
            key = text(buf, v, "parameters key")
        elif number == 2 and kind == LEN:
            for n, k, p in fields(buf, *v, budget):
                if n == 3 and k == LEN:
                    value = text(buf, p, f"parameters[{key[:64]!r}]")
                elif n == 2 and k == VARINT and ints:
                    value = int64(p)
    if value is not None:
        parameters[key] = value


FAST_INPUT_BYTES = 64 << 10  # the most inputs-record bytes the generated message parses in one go
_INPUTS_KEY, _RAW_KEY = 0x2A, 0x3A  # fields 5 (inputs) and 7 (raw_input_contents), wire type LEN
_REGION = REGION.encode()
_PLACEMENT = (REGION, BYTE_SIZE, OFFSET)


def parse_infer(buf: bytes) -> InferRequest:
    """The request's fields, located in ``buf`` (InvalidInput if it is not a ModelInferRequest)."""
    try:
        request = _parse_fast(buf)
    except (InvalidInput, DecodeError):
        request = None
    return request if request is not None else _parse_slow(buf)


def _parse_fast(buf: bytes) -> Optional[InferRequest]:
    """As :func:`_parse_slow`, the inputs parsed by the generated message; None (or an error) where
    it would not give the same answer: the caller then reads the request field by field. Every
    top-level field of the message is length-delimited with a one-byte key: anything else is left
    to the slow path."""
    request = InferRequest()
    runs: List[List[int]] = []  # [start, end) of consecutive ``inputs`` records
    other: List[Tuple[int, Span]] = []
    pos, end, size, left = 0, len(buf), 0, MAX_FIELDS
    while pos < end:
        left -= 1
        if left < 0:  # the slow path refuses it
            return None
        key = buf[pos]
        length = buf[pos + 1] if pos + 1 < end else 0x80
        if length < 0x80:
            start = pos + 2
        elif pos + 2 < end and buf[pos + 2] < 0x80:  # two bytes: a tensor under 16 KiB
            length, start = (length & 0x7F) | buf[pos + 2] << 7, pos + 3
        else:
            length, start = varint(buf, pos + 1, end, KEY_BYTES)
        stop = start + length
        if not 8 <= key < 0x80 or key & 7 != LEN or stop > end:  # field 0, a longer key, another wire type
            return None
        if key == _RAW_KEY:
            request.raw.append((start, stop))
        elif key == _INPUTS_KEY:
            size += stop - pos
            if runs and runs[-1][1] == pos:
                runs[-1][1] = stop
            else:
                runs.append([pos, stop])
        else:
            other.append((key >> 3, (start, stop)))
        pos = stop
    if size > FAST_INPUT_BYTES:
        return None
    records = b"".join(buf[a:b] for a, b in runs)
    shared = _REGION in records
    if not (request.raw or shared):  # typed contents: read field by field
        return None
    seen: set = set()
    budget = [left]
    for number, value in other:
        _field(buf, number, value, request, seen, budget)
    inputs = oip.ModelInferRequest.FromString(records).inputs
    if shared:
        return _shared_inputs(request, inputs)
    # The generated messages stand for InferInput (same attributes; with raw contents, as here, an
    # input's ``contents`` is never read and no input is in shared memory): no Python object per input.
    for t in inputs:  # check_dims' checks, cheapest for the usual rank 1
        if t.HasField("contents"):  # typed contents beside raw ones: the slow path refuses them
            return None
        shape = t.shape
        if len(shape) == 1 and 0 <= shape[0] <= MAX_DIM:
            continue
        if len(shape) > 8 or (shape and not 0 <= min(shape) <= max(shape) <= MAX_DIM):
            return None
    request.inputs = inputs  # type: ignore[assignment]
    return request


def _shared_inputs(request: InferRequest, inputs) -> Optional[InferRequest]:
    """The fast path's end for a request with inputs in shared memory (a few tensors, as perf_analyzer
    sends them): an InferInput each, from the generated messages; None where the slow path must read
    it (typed contents: their place in the bytes)."""
    for t in inputs:
        if t.HasField("contents"):
            return None
        parameters: Dict[str, object] = {}
        for key in _PLACEMENT:  # as _parameter keeps them: string and int64 parameters
            value = t.parameters.get(key)
            kind = value.WhichOneof("parameter_choice") if value is not None else None
            if kind in ("string_param", "int64_param"):
                parameters[key] = getattr(value, kind)
        name = t.name
        shape = list(t.shape)
        check_dims(shape, f"input {name!r}")
        where = placement(parameters, f"input {name!r}")
        request.inputs.append(InferInput(name, t.datatype[:16], shape, None, where))
        request.in_shared_memory += where is not None
    return request


def _parse_slow(buf: bytes) -> InferRequest:
    request = InferRequest()
    seen: set = set()
    budget = [MAX_FIELDS]  # read a field at a time: a message of tiny fields would hold the event loop
    for number, kind, value in fields(buf, 0, len(buf), budget):
        if kind != LEN:
            continue
        if number == 5:
            request.inputs.append(_input(buf, value, budget))
            request.in_shared_memory += request.inputs[-1].where is not None
        elif number == 7:
            request.raw.append(value)
        else:
            _field(buf, number, value, request, seen, budget)
    if request.raw:
        for t in request.inputs:
            if t.contents is not None:  # as Triton refuses it: which of the two was meant cannot be told
                raise InvalidInput(f"input {t.name!r}: its data is both in raw_input_contents and in contents; "
                                   "send it one way")
    return request


def _field(buf: bytes, number: int, value: Span, request: InferRequest, seen: set, budget: List[int]) -> None:
    """One length-delimited top-level field other than inputs (5) and raw_input_contents (7)."""
    if number == 1:
        request.model_name = text(buf, value, "model_name")
    elif number == 2:
        request.model_version = text(buf, value, "model_version")
    elif number == 3:
        once(seen, number, "id")
        request.id = text(buf, value, "id")
    elif number == 4:  # string and int64 ones (outputs; timeout)
        _parameter(buf, value, request.parameters, budget, ints=True)
    elif number == 6:
        name, parameters = "", {}
        for n, k, v in fields(buf, *value, budget):
            if n == 1 and k == LEN:
                name = text(buf, v, "outputs.name")
            elif n == 2 and k == LEN:
                _parameter(buf, v, parameters, budget, ints=True)
        no_classification(name, parameters)
        request.outputs.append(name)
        where = placement(parameters, f"output {name[:64]!r}")
        if where is not None:
            request.output_places[name] = where


def no_classification(name: str, parameters: Dict[str, object]) -> None:
    """tritonclient's ``class_count=k`` (the classification extension, which this server does not
    offer): refused, not answered with scores of another type and shape than the client expects."""
    if parameters.get("classification") not in (None, 0):
        raise InvalidInput(f"output {quoted(name)}: classification is not supported (the server has no "
                           "classification extension); request the output without it and rank its scores")


def arrays(buf: bytes, request: InferRequest, expected: Dict[str, Tuple[Tuple[str, ...], int, int]],
           shared: SharedMemory = NO_SHARED_MEMORY) -> Dict[str, np.ndarray]:
    """Each input as an array, checked by :func:`check_input`; ``expected`` maps an input name to
    (accepted recserve.wire dtypes, rank, most elements the server accepts). Inputs in shared memory
    are read from their region (``shared``); the others from raw_input_contents, one entry each, in
    order, or from typed contents."""
    raw = request.raw
    plain = len(request.inputs) - request.in_shared_memory
    if raw and len(raw) != plain:
        raise InvalidInput(f"raw_input_contents has {len(raw)} entries for {plain} inputs"
                           f"{' not in shared memory' if request.in_shared_memory else ''}; send one per input, in order")
    out: Dict[str, np.ndarray] = {}
    if not raw or request.in_shared_memory:
        if request.in_shared_memory:
            shared.refresh()  # once per request
        spans = iter(raw)
        for t in request.inputs:
            check_input(t.name, t.datatype, expected, out)
            if t.where is not None:
                data = shared_input(shared, t.where, t.name, t.datatype, expected)
                start, end = 0, len(data)
            elif raw:
                data, (start, end) = buf, next(spans)
            else:
                data = _typed(buf, t, expected[t.name][2])
                start, end = 0, len(data)
            out[t.name] = input_view(data, start, end, t.name, t.datatype, t.shape, expected)
        return out
    for t, (start, end) in zip(request.inputs, raw):
        # A tensor per feature: the usual one (raw, rank 1, as expected) takes only these tests, in
        # this order; any other, or one that fails them, :func:`_raw_input`.
        name, datatype, shape = t.name, t.datatype, t.shape
        spec = expected.get(name)
        if spec is not None and len(shape) == spec[1] == 1 and DTYPES.get(datatype) in spec[0]:
            dtype = _NUMPY[datatype]
            if shape[0] * dtype.itemsize == end - start and name not in out:
                out[name] = np.frombuffer(buf, dtype, shape[0], start)
                continue
        out[name] = _raw_input(buf, (start, end), t, expected, out)
    return out


_NUMPY = {name: wire.DTYPES[dtype] for name, dtype in DTYPES.items()}


def _raw_input(buf: bytes, span: Span, t: InferInput, expected: Dict[str, Tuple[Tuple[str, ...], int, int]],
               seen: Dict[str, np.ndarray]) -> np.ndarray:
    """A raw input as an array, checked by :func:`check_input` and :func:`input_view`."""
    check_input(t.name, t.datatype, expected, seen)
    return input_view(buf, span[0], span[1], t.name, t.datatype, t.shape, expected)


def shared_input(shared: SharedMemory, where: Placement, name: str, datatype: str,
                 expected: Dict[str, Tuple[Tuple[str, ...], int, int]]) -> np.ndarray:
    """The bytes of an input placed in shared memory (a private copy), at most the server's limit
    of elements for it (both transports; checked by :func:`check_input` first)."""
    return shared.read(where, f"input {name!r}", expected[name][2] * _NUMPY[datatype].itemsize)


def check_input(name: str, datatype: str, expected: Dict[str, Tuple[Tuple[str, ...], int, int]],
                seen: Dict[str, np.ndarray]) -> None:
    """An input's name (known to the model, not given twice) and datatype, before its data is read
    (both transports: gRPC here, HTTP/REST in oip/jsonwire.py)."""
    if name not in expected:
        raise InvalidInput(f"unknown input {name[:64]!r}; the model takes {sorted(expected)}")
    if name in seen:
        raise InvalidInput(f"input {name!r} is given twice")
    allowed = expected[name][0]
    if DTYPES.get(datatype) not in allowed:
        accepted = [k for k, v in DTYPES.items() if v in allowed]
        raise InvalidInput(f"input {name!r}: datatype {datatype[:16]!r} not accepted; expected one of {accepted}")


def input_view(data, start: int, end: int, name: str, datatype: str, shape: List[int],
               expected: Dict[str, Tuple[Tuple[str, ...], int, int]]) -> np.ndarray:
    """An input's little-endian bytes ``data[start:end]`` as an array of its shape (no copy), its
    rank and byte count checked."""
    allowed, ndim, _ = expected[name]
    try:
        return wire.view(data, start, end, DTYPES[datatype], shape, f"input {name!r}", allowed, ndim)
    except wire.WireError as e:
        raise InvalidInput(str(e).replace(DTYPES[datatype], datatype)) from None


# Most bytes one element of typed contents can take on the wire: a tag (unpacked encoding) and a
# varint of up to 10 bytes (a negative int32 is sign-extended), or 4 bytes of FP32.
_MAX_ELEMENT_BYTES = {"FP32": 1 + 4, "INT32": 1 + 10, "INT64": 1 + 10}


def _typed(buf: bytes, t: InferInput, limit: int) -> bytes:
    """The typed contents of one input, as raw little-endian bytes. Decoding varints costs time and
    memory in proportion to the bytes sent: the element count its shape declares is checked against
    the server's limit, and the contents' length prefix against that count, before any decoding."""
    if t.contents is None:
        return b""
    count = element_count(t.name, t.shape, limit)
    nbytes = t.contents[1] - t.contents[0]
    if nbytes > _MAX_ELEMENT_BYTES[t.datatype] * count + 16:
        raise InvalidInput(f"input {t.name!r}: {nbytes} bytes of contents cannot hold the {count} elements of shape "
                           f"{t.shape}")
    return decode_contents(bytes(buf[t.contents[0]:t.contents[1]]), t)


def element_count(name: str, shape: List[int], limit: int) -> int:
    """The elements an input's shape declares, within the server's limit for that input (checked
    before data that costs time in proportion to it is decoded: varints, JSON numbers)."""
    count = int(np.prod(shape, dtype=object))
    if count > limit:
        raise InvalidInput(f"input {name!r}: shape {shape} has {count} elements, more than the server's limit "
                           f"of {limit}; split the request")
    return count


def decode_contents(data: bytes, t: InferInput) -> bytes:
    try:
        contents = oip.InferTensorContents.FromString(data)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError: the bytes are not the message
        raise InvalidInput(f"input {t.name!r}: contents is not a valid InferTensorContents") from None
    return np.asarray(getattr(contents, _CONTENTS[t.datatype]), dtype=wire.DTYPES[DTYPES[t.datatype]]).tobytes()


def infer_response(outputs: Sequence[Tuple[str, np.ndarray]], name: str, version: str, request_id: str,
                   places: Optional[Dict[str, Placement]] = None, shared: SharedMemory = NO_SHARED_MEMORY) -> bytes:
    """ModelInferResponse bytes: float32 outputs, data in raw_output_contents (as Triton answers);
    an output placed in shared memory is written there, and its raw entry is empty (entries stay
    one per output, in order, as clients index them)."""
    head = [string_field(1, name), string_field(2, version), string_field(3, request_id) if request_id else b""]
    tensors, raw = [], []
    if places:
        shared.refresh()  # once per answer
    for output_name, array in outputs:
        dims = b"".join(encode_varint(d) for d in array.shape)
        body = string_field(1, output_name) + string_field(2, "FP32") + len_field(3, len(dims)) + dims
        tensors.append(len_field(5, len(body)) + body)
        where = places.get(output_name) if places else None
        if where is not None:
            shared.write(where, array, f"output {output_name!r}")
            raw.append(len_field(6, 0))
        else:
            raw += [len_field(6, array.nbytes), array]
    return b"".join(head + tensors + raw)
