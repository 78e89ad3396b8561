"""The fuzz target: request decoding and validation, and the server behind them.

Random and mutated Predict/Lookup messages must only ever produce an answer or one of the documented
status codes; never a crash, a hang, or another code. Shared by the short run in `make test`
(tests/test_fuzz.py) and the long run (scripts/fuzz.py, >= 10,000 cases).
"""
import numpy as np
from hypothesis import strategies as st

from recserve import wire
from recserve.oip import grpc_predict_v2_pb2 as oip
from recserve.v1 import inference_pb2 as pb

DOCUMENTED = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}
FEATURES = ["user_id", "item_id", "topics"]
DTYPES = ["float32", "float64", "int32", "int64", "", "uint8", "float16", "x" * 40]


def tensors(max_len=64):
    return st.builds(
        lambda dtype, shape, data: pb.Tensor(dtype=dtype, shape=shape, data=data),
        st.sampled_from(DTYPES),
        st.lists(st.integers(min_value=-3, max_value=1 << 40) | st.integers(0, 16), max_size=4),
        st.binary(max_size=max_len * 8),
    )


@st.composite
def well_formed_parts(draw):
    """A request that is valid but for what the mutations below change."""
    b = draw(st.integers(1, 6))
    keys = draw(st.lists(st.sampled_from(FEATURES + ["nope", ""]), max_size=4))
    lengths = np.array(draw(st.lists(st.integers(-2, 4), min_size=len(keys) * b, max_size=len(keys) * b)),
                       dtype=draw(st.sampled_from([np.int32, np.int64])))
    n = int(np.clip(lengths, 0, None).sum()) + draw(st.integers(-1, 1))
    values = np.array(draw(st.lists(st.integers(-5, 6000) | st.integers(-(1 << 62), 1 << 62),
                                    min_size=max(n, 0), max_size=max(n, 0))), dtype=np.int64)
    dense = np.array(draw(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32),
                                   min_size=b * 8, max_size=b * 8)), dtype=np.float32).reshape(b, 8)
    return keys, lengths, values, dense


@st.composite
def requests(draw):
    """(rpc, message bytes): structured garbage, mutated well-formed requests, raw bytes."""
    kind = draw(st.sampled_from(["structured", "mutated", "raw"]))
    rpc = draw(st.sampled_from(["Predict", "Lookup"]))
    # Mostly the real model and version, so that most cases reach validation.
    model = draw(st.sampled_from(["demo"] * 8 + ["nope", "../demo"]))
    version = draw(st.sampled_from([0] * 8 + [1, 7, -1, 1 << 62]))
    if kind == "raw":
        return rpc, draw(st.binary(max_size=512))
    if kind == "structured":
        sparse = pb.SparseFeatures(keys=draw(st.lists(st.text(max_size=8), max_size=4)),
                                   lengths=draw(tensors()), values=draw(tensors()))
        dense = draw(tensors())
    else:
        keys, lengths, values, dense_arr = draw(well_formed_parts())
        sparse = pb.SparseFeatures(keys=keys, lengths=wire.encode(lengths), values=wire.encode(values))
        dense = wire.encode(dense_arr)
    if rpc == "Predict":
        msg = pb.PredictRequest(model_name=model, model_version=version, dense=dense, sparse=sparse)
    else:
        msg = pb.LookupRequest(model_name=model, model_version=version, sparse=sparse)
    data = bytearray(msg.SerializeToString())
    if kind == "mutated" and data and draw(st.booleans()):
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return rpc, bytes(data)


def raw_calls(channel):
    """Predict and Lookup callables that send bytes as they are (no client-side serialization)."""
    return {rpc: channel.unary_unary(f"/recserve.v1.Inference/{rpc}", request_serializer=None,
                                     response_deserializer=None) for rpc in ("Predict", "Lookup")}


def send_case(calls, item, seen) -> str:
    """Send one fuzz case; count and return its status code name; fail on an undocumented one."""
    import grpc

    rpc, data = item
    try:
        calls[rpc](data, timeout=10)
        code = "OK"
    except grpc.RpcError as e:
        code = e.code().name
    seen[code] = seen.get(code, 0) + 1
    assert code in DOCUMENTED, (code, data[:80])
    return code


OIP_DATATYPES = {"float32": "FP32", "int32": "INT32", "int64": "INT64", "float64": "FP64", "uint8": "UINT8"}
_TYPED = {"FP32": "fp32_contents", "INT32": "int_contents", "INT64": "int64_contents", "FP64": "fp64_contents",
          "UINT8": "uint_contents"}


def per_feature(sparse):
    """A RawKJT (keys, key-major lengths, ids) as {feature: (lengths [B], ids)}, OIP's layout."""
    keys, lengths, values = sparse
    lengths = np.asarray(lengths).reshape(len(keys), -1)
    ids = np.split(np.asarray(values), np.cumsum(lengths.sum(axis=1))[:-1])
    return {k: (lengths[i].astype(np.int32), ids[i].astype(np.int64)) for i, k in enumerate(keys)}


def oip_request(model, dense, features, outputs=None, version="", typed=False, parameters=None) -> bytes:
    """ModelInferRequest bytes: ``dense`` [B, F] (or None) and, per feature, (lengths, ids) arrays, as
    raw_input_contents or (``typed``) typed contents."""
    request = oip.ModelInferRequest(model_name=model, model_version=version)
    arrays = ([] if dense is None else [("dense", np.asarray(dense))])
    for name, (lengths, ids) in features.items():
        arrays += [(f"{name}_lengths", np.asarray(lengths)), (f"{name}_ids", np.asarray(ids))]
    for name, array in arrays:
        datatype = OIP_DATATYPES.get(array.dtype.name, "BYTES")
        tensor = request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        if typed:
            getattr(tensor.contents, _TYPED[datatype]).extend(array.ravel().tolist())
        else:
            request.raw_input_contents.append(array.tobytes())
    for name in outputs or ():
        request.outputs.add(name=name)
    for key, value in (parameters or {}).items():
        request.parameters[key].string_parameter = value
    return request.SerializeToString()


def oip_call(channel, data: bytes, timeout: float = 10) -> bytes:
    """ModelInfer with ``data`` sent as it is; the response bytes."""
    return channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=None,
                               response_deserializer=None)(data, timeout=timeout)
