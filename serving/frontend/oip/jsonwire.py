"""The Open Inference Protocol's HTTP/REST bodies (KServe v2 REST, with Triton's binary tensor data
extension) read into arrays and written from them: what serving/frontend/oip/wire.py is for gRPC.

Request: a JSON document ``{"id", "parameters", "inputs": [{"name", "shape", "datatype", "data" |
"parameters": {"binary_data_size": n}}], "outputs": [{"name", "parameters": {"binary_data": bool}}]}``.
With the header ``Inference-Header-Content-Length: L`` the body is that document (L bytes, 1 or more:
Triton's L = 0, the whole body one input's bytes, is for models of one input, and these have several)
followed by the raw little-endian bytes of each input that gives ``binary_data_size``, in input order:
those become numpy views of the received body, no copy (as gRPC's raw_input_contents). JSON ``data``
may be flat or nested (row-major); its numbers must fit the datatype (no float for an INT input).
The document is parsed only up to the server's JSON limit (oip/rest.py says why).

Response: the same document form; an output is written as binary data when its requested output
says ``binary_data: true``, or, for outputs not listed, when the request parameter
``binary_data_output`` is true (tritonclient sets it when it requests no output by name).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from serving.errors import InvalidInput, TooLarge
from serving.frontend.oip.shm import NO_SHARED_MEMORY, Placement, SharedMemory, placement
from serving.frontend.oip.wire import DTYPES, check_input, element_count, input_view, no_classification, shared_input
from serving.frontend.protowire import check_dims
from serving.frontend.validate import quoted

HEADER_LENGTH = "Inference-Header-Content-Length"
_NUMERIC_KINDS = {"FP32": "iuf", "INT32": "iu", "INT64": "iu"}
_IS_BOOL = np.frompyfunc(lambda v: isinstance(v, bool), 1, 1)
# JSON integers have no size: past 64 bits numpy keeps them as Python objects (and 10**20 among floats too).
_IS_NUMBER = {"FP32": np.frompyfunc(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), 1, 1),
              "INT32": np.frompyfunc(lambda v: isinstance(v, int) and not isinstance(v, bool), 1, 1)}
_IS_NUMBER["INT64"] = _IS_NUMBER["INT32"]


@dataclass
class JsonInput:
    name: str
    datatype: str
    shape: List[int]
    data: Any = None  # the JSON data, or None when the bytes are binary
    binary: Optional[Tuple[int, int]] = None  # (start, end) in the body
    where: Optional[Placement] = None  # in a shared-memory region (its parameters name one)


@dataclass
class JsonInfer:
    id: str = ""
    parameters: Dict[str, Any] = field(default_factory=dict)
    inputs: List[JsonInput] = field(default_factory=list)
    outputs: List[Tuple[str, Optional[bool]]] = field(default_factory=list)  # (name, binary_data or None)
    output_places: Dict[str, Placement] = field(default_factory=dict)  # outputs to write into regions
    body: bytes = b""
    literals: bool = False  # the JSON document has true or false somewhere: data is checked for booleans

    @property
    def output_names(self) -> List[str]:
        return [name for name, _ in self.outputs]

    def binary_output(self, name: str) -> bool:
        for output, binary in self.outputs:
            if output == name and binary is not None:
                return binary
        return self.parameters.get("binary_data_output") is True


def _object(value: Any, what: str) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidInput(f"{what} must be a JSON object")
    return value


def _optional(document: Dict[str, Any], key: str, default: Any) -> Any:
    """An optional field; null is absent (clients built on the protocol's pydantic models write it)."""
    value = document.get(key)
    return default if value is None else value


def _string(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidInput(f"{what} must be a string")
    return value


def json_too_large(size: int, limit: int) -> TooLarge:
    """An inference body whose JSON is past the server's limit for it (oip/rest.py): one line that says
    what to send instead."""
    return TooLarge(f"the request's JSON is {size} bytes, more than the {limit} this server parses (serve "
                    "--max-json-mb); send the tensors as binary data (the binary tensor extension: "
                    f"{HEADER_LENGTH}, tritonclient's default) or over gRPC")


def _stated_length(header_length: str) -> Optional[int]:
    """The number an Inference-Header-Content-Length states (None: not a length at all)."""
    if header_length.isascii() and header_length.isdigit() and len(header_length) <= 18:
        return int(header_length)
    return None


def refuse_stated_json(header_length: Optional[str], most_json_bytes: int) -> None:
    """A binary request whose header states more JSON than the limit, refused before its body is read
    (a length that is no number is :func:`document`'s error, once the body is here)."""
    stated = None if header_length is None else _stated_length(header_length)
    if stated is not None and stated > most_json_bytes:
        raise json_too_large(stated, most_json_bytes)


def document(body: bytes, header_length: Optional[str], most_json_bytes: Optional[int] = None
             ) -> Tuple[Dict[str, Any], int]:
    """The JSON document of a request body and where its binary data starts; a document longer than
    ``most_json_bytes`` is refused before it is parsed."""
    end = len(body)
    if header_length is not None:
        stated = _stated_length(header_length)
        if stated is None or stated > len(body):
            raise InvalidInput(f"{HEADER_LENGTH}: {header_length[:32]!r} is not a length within the body of "
                               f"{len(body)} bytes")
        end = stated
        if end == 0:
            raise InvalidInput(f"{HEADER_LENGTH}: 0 makes the whole body one input's bytes (Triton's raw binary "
                               "request, for models of one input; these have several): give the length of the "
                               "JSON document that comes first")
    if most_json_bytes is not None and end > most_json_bytes:
        raise json_too_large(end, most_json_bytes)
    try:
        parsed = json.loads(body[:end])
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidInput(f"the request body is not valid JSON ({str(e)[:200]})") from None
    except RecursionError:
        raise InvalidInput("the request body's JSON is nested too deeply") from None
    return _object(parsed, "the request body"), end


def parse_infer(body: bytes, header_length: Optional[str], most_json_bytes: Optional[int] = None) -> JsonInfer:
    """An inference request's document (at most ``most_json_bytes`` of JSON), its binary inputs located
    in ``body`` (checked to cover it exactly)."""
    doc, at = document(body, header_length, most_json_bytes)
    request = JsonInfer(body=body)
    request.id = _string(_optional(doc, "id", ""), "id")
    request.parameters = _object(_optional(doc, "parameters", {}), "parameters")
    if not isinstance(request.parameters.get("binary_data_output", False), bool):
        raise InvalidInput("parameters.binary_data_output must be true or false")
    request.literals = body.find(b"true", 0, at) >= 0 or body.find(b"false", 0, at) >= 0  # data may hold booleans
    inputs = doc.get("inputs")
    if not isinstance(inputs, list):
        raise InvalidInput("inputs must be a list of tensors")
    for i, tensor in enumerate(inputs):
        tensor = _object(tensor, f"inputs[{i}]")
        name = _string(tensor.get("name"), f"inputs[{i}].name")
        shape = tensor.get("shape")
        if not isinstance(shape, list) or not all(type(d) is int for d in shape) or len(shape) > 8:
            raise InvalidInput(f"input {quoted(name)}: shape must be a list of at most 8 integers")
        check_dims(shape, f"input {name!r}")
        parameters = _object(_optional(tensor, "parameters", {}), f"input {quoted(name)} parameters")
        item = JsonInput(name, _string(tensor.get("datatype"), f"input {quoted(name)} datatype"), shape)
        item.where = placement(parameters, f"input {quoted(name)}",
                               has_data=tensor.get("data") is not None or "binary_data_size" in parameters)
        if item.where is not None:  # its bytes are in a region: read by arrays()
            request.inputs.append(item)
            continue
        size = parameters.get("binary_data_size")
        if size is not None:
            if tensor.get("data") is not None:  # as gRPC refuses raw and typed contents together
                raise InvalidInput(f"input {quoted(name)}: its data is both in \"data\" and in the binary data "
                                   "(binary_data_size); send it one way")
            if type(size) is not int or size < 0:
                raise InvalidInput(f"input {quoted(name)}: parameters.binary_data_size must be an integer >= 0 "
                                   f"(got {json.dumps(size)[:32]})")
            if at + size > len(body):
                raise InvalidInput(f"input {quoted(name)}: binary_data_size {str(size)[:32]} goes past the end of "
                                   f"the body ({len(body)} bytes)")
            item.binary, at = (at, at + size), at + size
        elif tensor.get("data") is None:
            raise InvalidInput(f"input {quoted(name)}: no data (send \"data\", or binary data with "
                               "parameters.binary_data_size)")
        else:
            item.data = tensor["data"]
        request.inputs.append(item)
    if at != len(body):
        raise InvalidInput(f"the body has {len(body) - at} bytes after the binary data of the inputs")
    outputs = _optional(doc, "outputs", [])
    if not isinstance(outputs, list):
        raise InvalidInput("outputs must be a list")
    for i, tensor in enumerate(outputs):
        tensor = _object(tensor, f"outputs[{i}]")
        parameters = _object(_optional(tensor, "parameters", {}), f"outputs[{i}].parameters")
        binary = parameters.get("binary_data")
        name = _string(tensor.get("name"), f"outputs[{i}].name")
        if binary is not None and not isinstance(binary, bool):
            raise InvalidInput(f"outputs[{i}].parameters.binary_data must be true or false")
        no_classification(name, parameters)
        request.outputs.append((name, binary))
        where = placement(parameters, f"output {quoted(name)}")
        if where is not None:
            request.output_places[name] = where
    return request


def arrays(request: JsonInfer, expected: Dict[str, Tuple[Tuple[str, ...], int, int]],
           shared: SharedMemory = NO_SHARED_MEMORY) -> Dict[str, np.ndarray]:
    """Each input as an array, with gRPC's checks (oip/wire.py): binary data is viewed in place;
    JSON data is converted once, after its shape's element count is checked against the limit;
    an input in shared memory is read from its region."""
    out: Dict[str, np.ndarray] = {}
    if any(t.where is not None for t in request.inputs):
        shared.refresh()  # once per request
    for t in request.inputs:
        check_input(t.name, t.datatype, expected, out)
        if t.where is not None:
            data = shared_input(shared, t.where, t.name, t.datatype, expected)
            start, end = 0, len(data)
        elif t.binary is not None:
            data, (start, end) = request.body, t.binary
        else:
            element_count(t.name, t.shape, expected[t.name][2])
            data = _from_json(t, request.literals)
            start, end = 0, len(data)
        out[t.name] = input_view(data, start, end, t.name, t.datatype, t.shape, expected)
    return out


def _from_json(t: JsonInput, literals: bool = True) -> bytes:
    """JSON numbers as the datatype's little-endian bytes; a value that does not fit is refused, not rounded.
    ``literals``: the document may hold true or false (numpy takes [true, 1] as integers)."""
    try:
        values = np.asarray(t.data)
    except ValueError:  # ragged nesting
        raise InvalidInput(f"input {t.name!r}: data is not a regular array") from None
    if values.dtype.kind == "f" and t.datatype != "FP32":  # an integer past INT64 made them floats
        values = np.asarray(t.data, dtype=object)
    if values.dtype == object and values.size and _each(_IS_NUMBER[t.datatype], values).all():
        try:  # an INT input's integer past 64 bits is out of its range; an FP32 one's, a number like any
            values = values.astype(np.float64 if t.datatype == "FP32" else DTYPES[t.datatype])
        except OverflowError:
            raise InvalidInput(f"input {t.name!r}: a value is outside the range of {t.datatype}") from None
    if values.size and (values.dtype.kind not in _NUMERIC_KINDS[t.datatype]
                        or literals and _each(_IS_BOOL, np.asarray(t.data, dtype=object)).any()):
        kind = "integers" if t.datatype != "FP32" else "numbers"
        raise InvalidInput(f"input {t.name!r}: data must be {kind} for datatype {t.datatype}")
    dtype = np.dtype(DTYPES[t.datatype]).newbyteorder("<")
    if values.size and dtype.kind == "i":
        info = np.iinfo(dtype)
        if values.min() < info.min or values.max() > info.max:
            raise InvalidInput(f"input {t.name!r}: a value is outside the range of {t.datatype}")
    with np.errstate(over="ignore"):  # a finite number past FP32's range becomes inf: refused here
        cast = values.astype(dtype)
    if dtype.kind == "f" and not np.isfinite(cast).all() and np.isfinite(values[~np.isfinite(cast)]).any():
        raise InvalidInput(f"input {t.name!r}: a value is outside the range of {t.datatype}")
    return cast.tobytes()


def _each(test, values: np.ndarray) -> np.ndarray:
    """``test`` (a np.frompyfunc) of every element, as booleans: data that is one value (a 0-d
    array) gives a Python bool, not an array."""
    return np.asarray(test(values), dtype=bool)


def infer_response(outputs: Sequence[Tuple[str, np.ndarray]], request: JsonInfer, name: str, version: str,
                   shared: SharedMemory = NO_SHARED_MEMORY) -> Tuple[bytes, Optional[int]]:
    """(body, JSON document length where binary data follows it, else None); an output placed in
    shared memory is written there and has no data in the body."""
    tensors, binary = [], []
    if request.output_places:
        shared.refresh()  # once per answer
    for output_name, array in outputs:
        tensor: Dict[str, Any] = {"name": output_name, "datatype": "FP32", "shape": list(array.shape)}
        where = request.output_places.get(output_name)
        if where is not None:
            shared.write(where, array, f"output {output_name!r}")
        elif request.binary_output(output_name):
            tensor["parameters"] = {"binary_data_size": array.nbytes}
            binary.append(np.ascontiguousarray(array, dtype="<f4").tobytes())
        else:
            tensor["data"] = array.ravel().tolist()
        tensors.append(tensor)
    response: Dict[str, Any] = {"model_name": name, "model_version": version, "outputs": tensors}
    if request.id:
        response["id"] = request.id
    head = json.dumps(response, separators=(",", ":")).encode()
    return (head + b"".join(binary), len(head)) if binary else (head, None)
