"""Property tests of the pure functions on the request path, each against a reference written here
independently: ``check_sparse`` and batch assembly against a KJT built by hand with numpy,
``protowire`` against the protobuf library's own parser, and the Open Inference Protocol's
translation against recserve.v1 for the same tensors. Bounded and, in CI, derandomized
(tests/conftest.py)."""
import os
from typing import List, Optional

import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from bench.decode import place_in_region
from recserve import wire
from recserve.oip import grpc_predict_v2_pb2 as oip
from recserve.v1 import inference_pb2 as pb
from serving.errors import InvalidInput
from serving.frontend.oip.protocol import expected_inputs, to_batch
from serving.frontend.oip import wire as oip_wire
from serving.frontend.oip.shm import SharedMemory
from serving.frontend.oip.wire import arrays, parse_infer
from serving.frontend.protowire import parse_request
from serving.frontend.validate import check_sparse, decode_predict, model_kjt
from test_engine_units import front_end_checked, staged_batch
from serving.ipc import Schema

SCHEMA = Schema(feature_names=("a", "b", "c"), rows=(10, 20, 30), dims=(2, 3, 4), dense_features=2,
                max_batch_size=8, max_ids=100)
T = len(SCHEMA.feature_names)


class Kjt:
    """A request's sparse part as plain Python: per key, per sample, its bag; per shared key, one bag."""

    def __init__(self, positions, bags, shared_positions, shared_bags, batch_size, lengths_dtype, ids_dtype):
        self.positions, self.bags = tuple(positions), bags  # bags[k][s]: list of ids
        self.shared_positions, self.shared_bags = tuple(shared_positions), shared_bags
        self.batch_size, self.lengths_dtype, self.ids_dtype = batch_size, lengths_dtype, ids_dtype

    @property
    def keys(self):
        return [SCHEMA.feature_names[t] for t in self.positions]

    @property
    def shared_keys(self):
        return [SCHEMA.feature_names[t] for t in self.shared_positions]

    def arrays(self):
        """(lengths key-major, values) as a client sends them, and the shared part."""
        lengths = np.array([len(bag) for per_sample in self.bags for bag in per_sample], self.lengths_dtype)
        values = np.array([i for per_sample in self.bags for bag in per_sample for i in bag], self.ids_dtype)
        shared = (self.shared_keys, np.array([len(b) for b in self.shared_bags], self.lengths_dtype),
                  np.array([i for b in self.shared_bags for i in b], self.ids_dtype))
        return lengths, values, shared if self.shared_positions else None

    def bag(self, t: int, s: int) -> List[int]:
        """The ids the model sees for feature ``t`` of sample ``s`` (a shared bag in every sample)."""
        if t in self.positions:
            return self.bags[self.positions.index(t)][s]
        if t in self.shared_positions:
            return self.shared_bags[self.shared_positions.index(t)]
        return []

    def expanded_ids(self) -> int:
        return sum(len(self.bag(t, s)) for t in range(T) for s in range(self.batch_size))

    def has_bad_id(self) -> bool:
        return any(not 0 <= i < SCHEMA.rows[t] for t in range(T) for s in range(self.batch_size)
                   for i in self.bag(t, s))


# Mostly ids every table has; one draw in six anywhere in [-3, 33]: below 0, or past a's 10 and b's 20 rows.
ids = st.one_of(*[st.integers(0, 9)] * 5, st.integers(-3, 33))
bag = st.lists(ids, max_size=4)


@st.composite
def kjts(draw, min_keys=0):
    order = draw(st.permutations(range(T)))
    n_keys = draw(st.integers(min_keys, T))
    n_shared = draw(st.integers(0, T - n_keys))
    b = draw(st.integers(1, SCHEMA.max_batch_size))
    bags = [draw(st.lists(bag, min_size=b, max_size=b)) for _ in range(n_keys)]
    shared_bags = [draw(bag) for _ in range(n_shared)]
    return Kjt(order[:n_keys], bags, order[n_keys:n_keys + n_shared], shared_bags, b,
               draw(st.sampled_from([np.int32, np.int64])), draw(st.sampled_from([np.int32, np.int64])))


def checked(kjt: Kjt):
    """Checked as a front end checks a request: read, then written into a slot (ids checked there)."""
    lengths, values, shared = kjt.arrays()
    return front_end_checked(check_sparse(kjt.keys, lengths, values, SCHEMA, kjt.batch_size, shared), SCHEMA)


@given(kjts(min_keys=1))
def test_check_sparse_keeps_every_bag_and_bounds_the_expanded_ids(kjt):
    event("over the id limit" if kjt.expanded_ids() > SCHEMA.max_ids else "within the id limit")
    if kjt.expanded_ids() > SCHEMA.max_ids:
        with pytest.raises(InvalidInput, match=f"{kjt.expanded_ids()} ids exceed the server's limit of 100"):
            checked(kjt)
        return
    if kjt.has_bad_id():  # ids are checked against their tables here too, in the front end
        with pytest.raises(InvalidInput) as exc:
            checked(kjt)
        assert str(exc.value) == first_bad_id(kjt)
        return
    s = checked(kjt)
    assert (s.keys, s.positions, s.batch_size) == (kjt.keys, kjt.positions, kjt.batch_size)
    assert s.lengths.tolist() == [[len(b) for b in per_sample] for per_sample in kjt.bags]
    assert s.totals.tolist() == [sum(len(b) for b in per_sample) for per_sample in kjt.bags]
    assert s.values.tolist() == [i for per_sample in kjt.bags for b in per_sample for i in b]
    assert (s.shared_keys, s.shared_positions) == (kjt.shared_keys, kjt.shared_positions)
    assert s.shared_lengths.tolist() == [len(b) for b in kjt.shared_bags]
    assert s.in_model_order == (kjt.positions == tuple(range(T)) and not kjt.shared_positions)
    assert s.expanded_ids == kjt.expanded_ids()


@given(kjts(min_keys=1), st.sampled_from(["negative length", "one id too many"]), st.data())
def test_check_sparse_refuses_lengths_that_disagree_with_the_ids(kjt, corruption, data):
    lengths, values, shared = kjt.arrays()
    if corruption == "negative length":
        at = data.draw(st.integers(0, lengths.shape[0] - 1))
        lengths[at] = -1
        first = int(np.argmax(lengths < 0)) // kjt.batch_size  # key-major: the first key with one
        message = f"sparse.lengths: negative length for feature {kjt.keys[first]!r}"
    else:
        values = np.append(values, values.dtype.type(1))
        message = f"sparse.lengths sum to {values.shape[0] - 1} but sparse.values has {values.shape[0]} ids"
    with pytest.raises(InvalidInput) as exc:
        check_sparse(kjt.keys, lengths, values, SCHEMA, kjt.batch_size, shared)
    assert str(exc.value) == message


@given(st.lists(kjts(), min_size=1, max_size=4), st.booleans())
def test_assembly_equals_a_kjt_built_by_hand(batch, once):
    """Requests checked, laid out as a front end writes them and merged into one batch by the gather:
    per model feature, request by request, sample by sample, each bag (a shared one repeated for
    every sample of its request, or pooled once in an extra sample after them). A request holding an
    id outside its table is refused by the check, naming that id, and never reaches a batch."""
    assume(all(k.expanded_ids() <= SCHEMA.max_ids for k in batch))
    event(f"{sum(k.has_bad_id() for k in batch)} of {len(batch)} requests hold a bad id")
    for k in batch:
        if k.has_bad_id():
            with pytest.raises(InvalidInput) as exc:
                checked(k)
            assert str(exc.value) == first_bad_id(k)
    batch = [k for k in batch if not k.has_bad_id()]
    assume(batch)
    staged, (values, lengths, _, _, _) = staged_batch([checked(k) for k in batch], schema=SCHEMA, once=once)
    want_lengths, want_values = [], []
    for t in range(T):
        row = []
        for k in batch:
            shared_once = once and k.shared_positions
            for s in range(k.batch_size):
                bag = [] if shared_once and t in k.shared_positions else k.bag(t, s)
                row.append(len(bag))
                want_values += bag
            if shared_once:  # the extra sample: the shared bags once
                bag = k.bag(t, 0) if t in k.shared_positions else []
                row.append(len(bag))
                want_values += bag
        want_lengths.append(row)
    assert lengths.tolist() == want_lengths
    assert values.tolist() == want_values and values.dtype == torch.int64


def first_bad_id(k: Kjt) -> str:
    """The message naming a request's first key (per-sample keys, then shared ones) holding an id
    outside its table: its smallest id if negative, else its largest."""
    for field, positions, key_ids in (
            ("sparse.values", k.positions, [[i for b in per_sample for i in b] for per_sample in k.bags]),
            ("sparse.shared_values", k.shared_positions, k.shared_bags)):
        for t, found in zip(positions, key_ids):
            if any(not 0 <= i < SCHEMA.rows[t] for i in found):
                bad = min(found) if min(found) < 0 else max(found)
                return f"{field}: id {bad} of feature {SCHEMA.feature_names[t]!r} is outside [0, {SCHEMA.rows[t]})"
    raise AssertionError("no bad id")


# -- protowire against protobuf -------------------------------------------------------------------

names = st.text(max_size=12)
tensors = st.builds(pb.Tensor, dtype=st.sampled_from(["float32", "int32", "int64", "float64", "", "x" * 16]),
                    shape=st.lists(st.integers(0, 2**31 - 1), max_size=4), data=st.binary(max_size=24))


@st.composite
def sparse_features(draw):
    message = pb.SparseFeatures(keys=draw(st.lists(names, max_size=3)),
                                shared_keys=draw(st.lists(names, max_size=2)))
    for field in ("lengths", "values", "shared_lengths", "shared_values"):
        if draw(st.booleans()):
            getattr(message, field).CopyFrom(draw(tensors))
    return message


@st.composite
def requests(draw):
    predict = draw(st.booleans())
    cls = pb.PredictRequest if predict else pb.LookupRequest
    message = cls(model_name=draw(names), model_version=draw(st.integers(-2**63, 2**63 - 1)))
    if predict and draw(st.booleans()):
        message.dense.CopyFrom(draw(tensors))
    if draw(st.booleans()):
        message.sparse.CopyFrom(draw(sparse_features()))
    return predict, message


def assert_located_like(buf: bytes, raw, tensor: Optional[pb.Tensor]):
    if tensor is None:
        assert raw is None
        return
    start, end = raw.data
    assert (raw.dtype, raw.shape, buf[start:end]) == (tensor.dtype, list(tensor.shape), tensor.data)


def assert_parsed_like(buf: bytes, raw, message) -> None:
    assert (raw.model_name, raw.model_version) == (message.model_name, message.model_version)
    if isinstance(message, pb.PredictRequest):
        assert_located_like(buf, raw.dense, message.dense if message.HasField("dense") else None)
    sparse = message.sparse
    assert (raw.keys, raw.shared_keys) == (list(sparse.keys), list(sparse.shared_keys))
    for field in ("lengths", "values", "shared_lengths", "shared_values"):
        want = getattr(sparse, field) if sparse.HasField(field) else None
        if want is None and not sparse.keys and field in ("lengths", "values"):
            # No per-sample feature: none sent means empty ones (a Lookup of shared bags alone).
            want = pb.Tensor(dtype="int32" if field == "lengths" else "int64", shape=[0])
        assert_located_like(buf, getattr(raw, field), want)


@settings(max_examples=300)
@given(requests())
def test_protowire_locates_what_protobuf_parses(request):
    predict, message = request
    buf = message.SerializeToString()
    assert_parsed_like(buf, parse_request(buf, predict=predict), message)


@settings(max_examples=300)
@given(requests(), st.data())
def test_truncated_messages_fail_exactly_where_protobuf_fails(request, data):
    """A message cut anywhere: protowire refuses it (INVALID_ARGUMENT) exactly when protobuf cannot
    parse it, and reads what protobuf reads when the cut falls between fields."""
    predict, message = request
    full = message.SerializeToString()
    buf = full[:data.draw(st.integers(0, max(0, len(full) - 1)))]
    try:
        expected = type(message).FromString(buf)
    except DecodeError:
        expected = None
    try:
        raw = parse_request(buf, predict=predict)
    except InvalidInput:
        raw = None
    event("refused" if expected is None else "parsed")
    assert (raw is None) == (expected is None)
    if expected is not None:
        assert_parsed_like(buf, raw, expected)


# -- Open Inference Protocol against recserve.v1 ---------------------------------------------------

OIP_DTYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64"}
TYPED = {"FP32": "fp32_contents", "INT32": "int_contents", "INT64": "int64_contents"}


@st.composite
def oip_inputs(draw):
    """dense [B, 2] and, for some features, lengths and ids (each its own dtype); all ids in range."""
    b = draw(st.integers(1, SCHEMA.max_batch_size))
    dense = np.array(draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=2 * b, max_size=2 * b)),
                     np.float32).reshape(b, 2)
    inputs = {"dense": dense}
    for t in sorted(draw(st.sets(st.integers(0, T - 1)))):
        lengths = draw(st.lists(st.integers(0, 3), min_size=b, max_size=b))
        f = SCHEMA.feature_names[t]
        inputs[f"{f}_lengths"] = np.array(lengths, draw(st.sampled_from([np.int32, np.int64])))
        inputs[f"{f}_ids"] = np.array(draw(st.lists(st.integers(0, SCHEMA.rows[t] - 1), min_size=sum(lengths),
                                                    max_size=sum(lengths))),
                                      draw(st.sampled_from([np.int32, np.int64])))
    return inputs


def infer_request(inputs, raw: bool) -> bytes:
    message = oip.ModelInferRequest(model_name="m")
    for name, array in inputs.items():
        tensor = message.inputs.add(name=name, datatype=OIP_DTYPES[array.dtype], shape=list(array.shape))
        if raw:
            message.raw_input_contents.append(array.tobytes())
        else:
            getattr(tensor.contents, TYPED[tensor.datatype]).extend(array.ravel().tolist())
    return message.SerializeToString()


def v1_request(inputs) -> bytes:
    """The same tensors as a recserve.v1 PredictRequest: every feature in model order, the ones the
    OIP request left out as empty bags."""
    b = inputs["dense"].shape[0]
    lengths = [inputs.get(f"{f}_lengths", np.zeros(b, np.int64)).astype(np.int64) for f in SCHEMA.feature_names]
    values = [inputs.get(f"{f}_ids", np.zeros(0, np.int64)).astype(np.int64) for f in SCHEMA.feature_names]
    return pb.PredictRequest(model_name="m", dense=wire.encode(inputs["dense"]), sparse=pb.SparseFeatures(
        keys=SCHEMA.feature_names, lengths=wire.encode(np.concatenate(lengths)),
        values=wire.encode(np.concatenate(values)))).SerializeToString()


def ids_of(sparse):
    """Each model feature's ids as the engine gets them (serving/frontend/validate.py ``model_kjt``)."""
    return [None if ids is None else ids.astype(np.int64).tolist()
            for ids in model_kjt(sparse, None, SCHEMA).per_feature()[0]]


@given(oip_inputs(), st.booleans())
def test_oip_inputs_make_the_batch_recserve_v1_makes_of_the_same_tensors(inputs, raw):
    buf = infer_request(inputs, raw)
    dense, sparse = to_batch(arrays(buf, parse_infer(buf), expected_inputs(SCHEMA)), SCHEMA, need_dense=True)
    body = v1_request(inputs)
    want_dense, want = decode_predict(body, parse_request(body, predict=True), SCHEMA)
    assert dense.dtype == np.float32 and np.array_equal(dense, want_dense)
    assert (sparse.keys, sparse.positions, sparse.batch_size, sparse.in_model_order) == \
        (want.keys, want.positions, want.batch_size, want.in_model_order) == \
        (list(SCHEMA.feature_names), (0, 1, 2), inputs["dense"].shape[0], True)
    assert sparse.lengths.tolist() == want.lengths.tolist()
    assert ids_of(sparse) == ids_of(want)
    assert sparse.totals.tolist() == want.totals.tolist()


@given(oip_inputs(), st.booleans(), st.sampled_from([np.int32, np.int64]))
def test_oip_packed_inputs_make_the_batch_their_per_feature_inputs_make(inputs, raw, ids_dtype):
    """``lengths`` [features, B] and ``ids``: the same KJT as the per-feature inputs (a feature those
    left out: a row of zeros and no ids), read alike, and written whole."""
    b = inputs["dense"].shape[0]
    packed = {"dense": inputs["dense"],
              "lengths": np.stack([inputs.get(f"{f}_lengths", np.zeros(b, np.int32)).astype(np.int32)
                                   for f in SCHEMA.feature_names]),
              "ids": np.concatenate([inputs.get(f"{f}_ids", np.zeros(0, ids_dtype)).astype(ids_dtype)
                                     for f in SCHEMA.feature_names])}
    read = []
    for tensors in (inputs, packed):
        buf = infer_request(tensors, raw)
        read.append(to_batch(arrays(buf, parse_infer(buf), expected_inputs(SCHEMA)), SCHEMA, need_dense=True))
    (want_dense, want), (dense, sparse) = read
    assert np.array_equal(dense, want_dense) and sparse.in_model_order and want.in_model_order
    assert (sparse.keys, sparse.batch_size, sparse.lengths.tolist(), sparse.totals.tolist(), ids_of(sparse)) == \
        (want.keys, want.batch_size, want.lengths.tolist(), want.totals.tolist(), ids_of(want))
    assert model_kjt(sparse, dense, SCHEMA).whole is not None


@pytest.fixture(scope="module")
def region(tmp_path_factory):
    """A system shared memory region "r" of 1 MiB (serving/frontend/oip/shm.py), and its object's path."""
    path = f"/dev/shm/recserve_properties_{os.getpid()}"
    with open(path, "wb") as f:
        f.truncate(1 << 20)
    shared = SharedMemory(str(tmp_path_factory.mktemp("shm")))
    shared.register("r", "/" + os.path.basename(path), 0, 1 << 20)
    yield shared, path
    os.unlink(path)


def parsed(parse, buf, shared=None):
    """What a parser makes of ``buf``: the located request and its arrays (or their error), or the
    parser's error message. The fast parser keeps the generated messages of the inputs: they are
    compared by what is read of them."""
    try:
        r = parse(buf)
    except InvalidInput as e:
        return str(e)
    inputs = [(t.name, t.datatype[:16], list(t.shape), getattr(t, "where", None)) for t in r.inputs]
    return (r.model_name, r.model_version, r.id, inputs, r.outputs, r.output_places, r.parameters, r.raw,
            answered(arrays, buf, r, shared))


def answered(read, buf, request, shared=None):
    """The arrays ``read`` makes of a located request (its inputs in shared memory from ``shared``),
    or its error message."""
    try:
        out = read(buf, request, expected_inputs(SCHEMA), *([shared] if shared else []))
    except InvalidInput as e:
        return str(e)
    return {name: (array.dtype.str, array.shape, array.tobytes()) for name, array in out.items()}


def each_checked(buf, request, expected, *shared):
    """``arrays`` without its fast test for the usual tensor: every raw input through the general
    checks (check_input, input_view)."""
    if not request.raw or len(request.raw) != len(request.inputs):
        return arrays(buf, request, expected, *shared)
    out = {}
    for t, span in zip(request.inputs, request.raw):
        out[t.name] = oip_wire._raw_input(buf, span, t, expected, out)
    return out


@settings(max_examples=300)
@given(oip_inputs(), st.booleans(), st.data())
def test_oip_fast_parse_answers_as_the_field_by_field_reader(region, inputs, raw, data):
    """``parse_infer`` hands the inputs' records to the generated message (one C call) and reads the
    rest itself; whatever the bytes (a request, cut anywhere, a byte changed, a field added, inputs
    in shared memory), it gives exactly what the field-by-field reader gives, the error message
    included."""
    shared, path = region
    message = oip.ModelInferRequest.FromString(infer_request(inputs, True))
    in_shared_memory = raw and data.draw(st.booleans())
    if in_shared_memory:
        with open(path, "r+b") as f:
            place_in_region(message, "r", f, data.draw(st.lists(st.booleans(), min_size=len(inputs),
                                                                max_size=len(inputs))))
    elif not raw:
        message = oip.ModelInferRequest.FromString(infer_request(inputs, False))
    message.id = data.draw(st.sampled_from(["", "r1"]))
    if data.draw(st.booleans()):
        message.parameters["outputs"].string_param = "ctr"
        message.outputs.add(name="ctr")
    full = message.SerializeToString()
    event(f"raw={raw} shared memory={in_shared_memory}")
    if raw:  # what perf_analyzer and tritonclient send: the fast path reads it whole
        assert oip_wire._parse_fast(full) is not None
        assert parsed(oip_wire._parse_fast, full, shared) == parsed(oip_wire._parse_slow, full, shared)
    edit = data.draw(st.sampled_from(["none", "cut", "byte", "head", "append"]))
    buf = bytearray(full)
    if edit == "cut":
        buf = buf[:data.draw(st.integers(0, len(buf)))]
    elif edit in ("byte", "head"):  # anywhere, or among the first keys and lengths
        buf[data.draw(st.integers(0, len(buf) - 1 if edit == "byte" else min(24, len(buf) - 1)))] = \
            data.draw(st.integers(0, 255))
    elif edit == "append":
        buf += data.draw(st.binary(max_size=12))
    buf = bytes(buf)
    event(edit)
    assert parsed(parse_infer, buf, shared) == parsed(oip_wire._parse_slow, buf, shared)
    try:
        request = parse_infer(buf)
    except InvalidInput:
        return
    assert answered(arrays, buf, request, shared) == answered(each_checked, buf, request, shared)
    if in_shared_memory and edit == "none":  # the same arrays as the request with every input in raw contents
        whole = infer_request(inputs, True)
        assert answered(arrays, buf, request, shared) == answered(arrays, whole, parse_infer(whole))


def http_body(inputs, binary: bool):
    """The same tensors as an HTTP/REST infer body: JSON data, or Triton's binary extension."""
    import json

    tensors, raw = [], []
    for name, array in inputs.items():
        tensor = {"name": name, "datatype": OIP_DTYPES[array.dtype], "shape": list(array.shape)}
        if binary:
            tensor["parameters"] = {"binary_data_size": array.nbytes}
            raw.append(array.tobytes())
        else:
            tensor["data"] = array.tolist()  # nested, row-major
        tensors.append(tensor)
    head = json.dumps({"inputs": tensors}).encode()
    return (head + b"".join(raw), str(len(head))) if binary else (head, None)


@given(oip_inputs(), st.booleans())
def test_http_bodies_make_the_batch_grpc_makes_of_the_same_tensors(inputs, binary):
    from serving.frontend.oip import jsonwire

    buf = infer_request(inputs, raw=True)
    want_dense, want = to_batch(arrays(buf, parse_infer(buf), expected_inputs(SCHEMA)), SCHEMA, need_dense=True)
    body, header_length = http_body(inputs, binary)
    request = jsonwire.parse_infer(body, header_length)
    dense, sparse = to_batch(jsonwire.arrays(request, expected_inputs(SCHEMA)), SCHEMA, need_dense=True)
    assert dense.dtype == np.float32 and np.array_equal(dense, want_dense)
    assert (sparse.keys, sparse.positions, sparse.batch_size) == (want.keys, want.positions, want.batch_size)
    assert sparse.lengths.tolist() == want.lengths.tolist() and ids_of(sparse) == ids_of(want)
    assert [ids.dtype for ids in model_kjt(sparse, dense, SCHEMA).per_feature()[0]] == \
        [ids.dtype for ids in model_kjt(want, want_dense, SCHEMA).per_feature()[0]]
