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


# -- cases that reach the model, with a value oracle ------------------------------------------------
# The float model the artifact was exported from (tests/reference.py, plain TorchRec) answers every
# accepted request; the served answer must agree within the export's int8 gates (README: 1e-2).
CTR_ATOL, POOLED_RTOL = 1e-2, 1e-2
OK_CODES = DOCUMENTED | {"CANCELLED"}


class Oracle:
    """The reference model of one checkpoint, built once."""

    def __init__(self, checkpoint, info) -> None:
        from reference import feature_names, float_model

        self.model, self.names = float_model(checkpoint), feature_names(checkpoint)
        self.rows = {f.name: f.rows for f in info.features}
        self.dims = {f.name: f.dim for f in info.features}
        self.dense_features = info.dense_features

    def __call__(self, dense, bags):
        """(ctr [B], {feature: pooled [B, dim]}) for per-sample ``bags`` {feature: [ids of each sample]}."""
        import torch
        from torchrec import KeyedJaggedTensor

        b = dense.shape[0]
        lengths = [len(bags[n][s]) if n in bags else 0 for n in self.names for s in range(b)]
        values = [i for n in self.names if n in bags for bag in bags[n] for i in bag]
        kjt = KeyedJaggedTensor(keys=self.names, values=torch.tensor(values, dtype=torch.int64),
                                lengths=torch.tensor(lengths, dtype=torch.int32))
        with torch.no_grad():
            ctr = torch.sigmoid(self.model(torch.from_numpy(dense), kjt)).reshape(-1).numpy()
            pooled = self.model.sparse_arch.embedding_bag_collection(kjt).to_dict()
        return ctr, {n: pooled[n].numpy() for n in self.names}

    def check(self, kind, answer, dense, bags, keys) -> None:
        ctr, pooled = self(dense, bags)
        if "ctr" in answer:
            err = float(np.abs(answer["ctr"] - ctr).max())
            assert err <= CTR_ATOL, (kind, "ctr", err)
        if "pooled" in answer:
            ref = np.concatenate([pooled[k] for k in keys], axis=1)
            err = float(np.linalg.norm(answer["pooled"] - ref) / max(np.linalg.norm(ref), 1e-9))
            assert err <= POOLED_RTOL, (kind, "pooled", err)


def good_case(rng, oracle):
    """A valid request chosen by ``rng``: recserve.v1 Predict or Lookup (some features shared), or
    OIP ModelInfer (raw or typed contents); returns (kind, send(channel) -> answer, dense, bags, keys)."""
    b = int(rng.integers(1, 9))
    names = list(oracle.names)
    dense = rng.standard_normal((b, oracle.dense_features)).astype(np.float32)
    shared = [n for n in names if rng.random() < 0.25]
    bags = {}
    for n in names:
        if n in shared:
            bag = rng.integers(0, oracle.rows[n], int(rng.integers(0, 6))).tolist()
            bags[n] = [bag] * b
        else:
            bags[n] = [rng.integers(0, oracle.rows[n], int(rng.integers(0, 5))).tolist() for _ in range(b)]
    kind = rng.choice(["Predict", "Lookup", "oip-raw", "oip-typed"])
    per_sample = [n for n in names if n not in shared]
    if kind in ("Predict", "Lookup"):
        sparse = pb.SparseFeatures(
            keys=per_sample, lengths=wire.encode(np.array([len(bag) for n in per_sample for bag in bags[n]], np.int32)),
            values=wire.encode(np.array([i for n in per_sample for bag in bags[n] for i in bag], np.int64)),
            shared_keys=shared, shared_lengths=wire.encode(np.array([len(bags[n][0]) for n in shared], np.int32)),
            shared_values=wire.encode(np.array([i for n in shared for i in bags[n][0]], np.int64)))
        if not per_sample and kind == "Lookup":
            b, dense, bags = 1, dense[:1], {n: bags[n][:1] for n in bags}  # shared bags only: one sample
        if kind == "Predict":
            data = pb.PredictRequest(model_name="demo", dense=wire.encode(dense), sparse=sparse).SerializeToString()
        else:
            data = pb.LookupRequest(model_name="demo", sparse=sparse).SerializeToString()

        def send(channel, timeout=10):
            reply = raw_calls(channel)[kind](data, timeout=timeout)
            if kind == "Predict":
                return {"ctr": wire.decode(pb.PredictResponse.FromString(reply).ctr, "ctr", ("float32",))}
            return {"pooled": wire.decode(pb.LookupResponse.FromString(reply).pooled, "pooled", ("float32",))}

        return kind, send, dense, bags, per_sample + shared, data
    outputs = [o for o in ("ctr", "pooled") if rng.random() < 0.6] or None
    features = {n: (np.array([len(bag) for bag in bags[n]], np.int32),
                    np.array([i for bag in bags[n] for i in bag], np.int64)) for n in names}
    data = oip_request("demo", dense, features, outputs=outputs, typed=kind == "oip-typed")

    def send_oip(channel, timeout=10):
        reply = oip.ModelInferResponse.FromString(oip_call(channel, data, timeout))
        out = {}
        for tensor, raw in zip(reply.outputs, reply.raw_output_contents):
            out[tensor.name] = np.frombuffer(raw, np.float32).reshape(list(tensor.shape))
        return out

    return kind, send_oip, dense, bags, names, data


class Fuzzer:
    """Runs cases against a server and checks after each that a good request's answer is unchanged."""

    def __init__(self, channel, oracle, good) -> None:
        self.channel, self.oracle = channel, oracle
        self.good_send, self.good_answer = good
        self.seen = {}

    def run(self, case) -> str:
        kind, payload = case
        import grpc

        try:
            if kind == "garbage":
                code = send_case(raw_calls(self.channel), payload, self.seen)
                self._after()
                return code
            rng = np.random.default_rng(payload)
            name, send, dense, bags, keys, data = good_case(rng, self.oracle)
            if kind == "cancel":
                call = self.channel.unary_unary(_METHOD[name], request_serializer=None, response_deserializer=None
                                                ).future(data, timeout=10)
                for _ in range(int(rng.integers(0, 2000))):  # a random moment: after 0 .. ~ms of work
                    if call.done():
                        break
                call.cancel()
                try:
                    call.result()
                    code = "OK"
                except grpc.FutureCancelledError:
                    code = "CANCELLED"
            else:
                self.oracle.check(name, send(self.channel), dense, bags, keys)
                code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
        self.seen[code] = self.seen.get(code, 0) + 1
        assert code in OK_CODES, (kind, code)
        if kind == "good":
            assert code == "OK", (kind, code)
        self._after()
        return code

    def _after(self) -> None:
        np.testing.assert_array_equal(self.good_send(self.channel)["ctr"], self.good_answer)


_METHOD = {"Predict": "/recserve.v1.Inference/Predict", "Lookup": "/recserve.v1.Inference/Lookup",
           "oip-raw": "/inference.GRPCInferenceService/ModelInfer",
           "oip-typed": "/inference.GRPCInferenceService/ModelInfer"}


def cases():
    """One case: ("good", seed) a valid request with the oracle, ("cancel", seed) one cancelled at a
    random moment, ("garbage", (rpc, bytes)) structured garbage, a mutated or raw request."""
    seeds = st.integers(0, 2**32)
    return st.sampled_from(["good"] * 12 + ["cancel"] * 2 + ["garbage"] * 4).flatmap(
        lambda kind: st.tuples(st.just(kind), requests() if kind == "garbage" else seeds))


def good_request(oracle, seed=11):
    """The request checked after every case: (send, its answer now)."""
    rng = np.random.default_rng(seed)
    while True:
        kind, send, *_ = good_case(rng, oracle)
        if kind == "Predict":
            return send


# -- repository content -------------------------------------------------------------------------
def _manifest_edit(change):
    def publish(source, target):
        import json
        import shutil

        shutil.copytree(source, target)
        path = target / "manifest.json"
        manifest = json.loads(path.read_text())
        change(manifest)
        path.write_text(json.dumps(manifest) if isinstance(manifest, dict) else "{not json")
    return publish


def _half_written(source, target):
    """A plain copy caught half-way: the manifest and half of model.pt, no golden.pt."""
    import shutil

    target.mkdir()
    shutil.copy(source / "manifest.json", target / "manifest.json")
    data = (source / "model.pt").read_bytes()
    (target / "model.pt").write_bytes(data[: len(data) // 2])


def _symlinked_outside(source, target):
    import shutil
    import tempfile
    from pathlib import Path

    outside = Path(tempfile.mkdtemp(prefix="fuzz-outside-")) / target.name
    shutil.copytree(source, outside)
    target.symlink_to(outside, target_is_directory=True)


REPOSITORY_FAULTS = {
    "dense_features=2^62": _manifest_edit(lambda m: m.update(dense_features=2**62)),
    "rows=2^62": _manifest_edit(lambda m: m["features"][0].update(rows=2**62)),
    "rows+1": _manifest_edit(lambda m: m["features"][0].update(rows=m["features"][0]["rows"] + 1)),
    "world_size=0": _manifest_edit(lambda m: m["sharding"].update(world_size=0)),
    "dims swapped": _manifest_edit(lambda m: (m["features"][0].update(dim=8), m["features"][1].update(dim=24))),
    "dense_dtype=bogus": _manifest_edit(lambda m: m.update(dense_dtype="bogus")),
    "half-written": _half_written,
    "symlinked outside": _symlinked_outside,
}


def publish_fault(repo, source, version, fault):
    """A broken version ``version`` of demo, made as ``fault`` says; its version field says so."""
    import json

    path = repo / "demo" / str(version)
    REPOSITORY_FAULTS[fault](source, path)
    manifest_path = path / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
        manifest["version"] = version
        manifest_path.write_text(json.dumps(manifest))
    except ValueError:
        pass
    return path
