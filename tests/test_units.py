"""Unit tests: one module alone (batcher, validation, assembly), no server."""

import os

import grpc
import numpy as np
import pytest

from recserve import wire
from recserve.v1 import inference_pb2 as pb
from serving.errors import InvalidInput
from serving.frontend.protowire import parse_request
from serving.ipc import Schema
from serving.frontend.validate import decode_predict, decode_sparse

SCHEMA = Schema(feature_names=("a", "b", "c"), rows=(10, 20, 30), dims=(2, 3, 4), dense_features=2,
                max_batch_size=8, max_ids=100)


def sparse_msg(keys, lengths, values, ldt=np.int32, vdt=np.int64):
    """A LookupRequest's bytes, located (serving/frontend/protowire.py): what decode_sparse reads."""
    body = pb.LookupRequest(model_name="m", sparse=pb.SparseFeatures(
        keys=keys, lengths=wire.encode(np.array(lengths, ldt)), values=wire.encode(np.array(values, vdt)))
    ).SerializeToString()
    return body, parse_request(body, predict=False)


def decode(keys, lengths, values, **kw):
    return decode_sparse(*sparse_msg(keys, lengths, values, **kw), SCHEMA, None)


# -- validation --------------------------------------------------------------------------------

def test_decode_keeps_request_order_and_views_the_bytes():
    s = decode(["c", "a"], [1, 0, 2, 1], [29, 0, 9, 3])
    assert s.keys == ["c", "a"] and s.positions == (2, 0) and s.batch_size == 2
    assert s.totals.tolist() == [1, 3] and not s.in_model_order
    assert not s.values.flags.writeable  # a view of the message bytes, not a copy


@pytest.mark.parametrize("keys,lengths,values,message", [
    (["a"], [1, -1], [1], "negative length for feature 'a'"),
    (["a"], [1, 1], [1], "sum to 2 but sparse.values has 1"),
    (["a", "a"], [0, 0, 0, 0], [], "appears more than once"),
    (["z"], [0, 0], [], "unknown feature 'z'"),
    (["a", "b"], [0, 0, 0], [], "not a multiple of 2 keys"),
    (["a"], [0] * 9, [], "exceeds the server's max batch size 8"),
    (["a"], [101, 0], list(range(101)), "101 ids exceed the server's limit of 100"),
])
def test_decode_rejects_with_a_message_naming_the_problem(keys, lengths, values, message):
    with pytest.raises(InvalidInput) as exc:
        decode(keys, lengths, values)
    assert message in str(exc.value)


def test_a_request_at_exactly_the_servers_limits_is_accepted():
    """max_ids and max_batch_size are inclusive: 8 samples holding 100 ids (and 2 + 2 x 49 expanded
    ids with a shared bag) are served, not refused as over the limit."""
    s = decode(["a"], [100] + [0] * 7, [i % 10 for i in range(100)])
    assert (s.batch_size, s.expanded_ids, s.totals.tolist()) == (8, 100, [100])
    shared = decode_shared(["a"], [1, 1], [1, 2], ["b"], [49], list(range(19)) * 2 + list(range(11)))
    assert (shared.batch_size, shared.expanded_ids, shared.shared_lengths.tolist()) == (2, 100, [49])


def decode_shared(keys, lengths, values, shared_keys, shared_lengths, shared_values, batch_size=None):
    body = pb.LookupRequest(model_name="m", sparse=pb.SparseFeatures(
        keys=keys, lengths=wire.encode(np.array(lengths, np.int32)), values=wire.encode(np.array(values, np.int64)),
        shared_keys=shared_keys, shared_lengths=wire.encode(np.array(shared_lengths, np.int32)),
        shared_values=wire.encode(np.array(shared_values, np.int64)))).SerializeToString()
    return decode_sparse(body, parse_request(body, predict=False), SCHEMA, batch_size)


def test_shared_bags_stay_one_bag_and_the_request_is_not_in_model_order():
    s = decode_shared(["a", "c"], [1, 0, 0, 2], [3, 28, 29], ["b"], [3], [1, 2, 19])
    assert s.shared_keys == ["b"] and s.shared_positions == (1,) and s.shared_lengths.tolist() == [3]
    assert s.all_keys == ["a", "c", "b"] and s.all_positions == (0, 2, 1) and not s.in_model_order
    only_shared = decode_shared([], [], [], ["c", "a"], [1, 2], [5, 1, 2])
    assert only_shared.batch_size == 1 and only_shared.keys == [] and only_shared.shared_lengths.tolist() == [1, 2]


@pytest.mark.parametrize("shared_keys,shared_lengths,shared_values,message", [
    (["a"], [1], [1], "feature 'a' appears more than once"),  # also per-sample
    (["z"], [0], [], "sparse.shared_keys: unknown feature 'z'"),
    (["b"], [1, 0], [1], "2 entries for 1 shared keys"),
    (["b"], [-1], [], "sparse.shared_lengths: negative length for feature 'b'"),
    (["b"], [2], [1], "sparse.shared_lengths: a bag of 2 ids, but sparse.shared_values has 1"),
    (["b", "c"], [1, 1], [1], "sparse.shared_lengths sum to 2 but sparse.shared_values has 1"),
    # 2 per-sample ids + 2 samples x 50 shared ids = 102 > 100: the expanded count is what is bounded
    (["b"], [50], list(range(50)), "102 ids exceed the server's limit of 100 per request (50 shared ids count once"),
])
def test_shared_bags_are_checked_like_per_sample_ones(shared_keys, shared_lengths, shared_values, message):
    with pytest.raises(InvalidInput) as exc:
        decode_shared(["a"], [1, 1], [1, 2], shared_keys, shared_lengths, shared_values)
    assert message in str(exc.value)


def test_decode_accepts_a_predict_of_dense_features_alone():
    empty = pb.SparseFeatures(lengths=wire.encode(np.zeros(0, np.int32)), values=wire.encode(np.zeros(0, np.int64)))
    body = pb.PredictRequest(model_name="m", dense=wire.encode(np.zeros((3, 2), np.float32)),
                             sparse=empty).SerializeToString()
    request = parse_request(body, predict=True)
    dense, sparse = decode_predict(body, request, SCHEMA)
    assert sparse.batch_size == 3 and sparse.keys == [] and sparse.expanded_ids == 0
    with pytest.raises(InvalidInput, match="at least one key is required"):
        decode([], [], [])  # a Lookup needs a key


def test_a_predict_without_dense_says_dense_is_missing():
    """A PredictRequest without its dense tensor was told "dense: dtype '' not accepted; expected one of
    ['float32']", as if it had sent a tensor of a wrong dtype."""
    empty = pb.SparseFeatures(lengths=wire.encode(np.zeros(0, np.int32)), values=wire.encode(np.zeros(0, np.int64)))
    body = pb.PredictRequest(model_name="m", sparse=empty).SerializeToString()
    with pytest.raises(InvalidInput, match=r"^dense: missing; send a tensor of dtype float32$"):
        decode_predict(body, parse_request(body, predict=True), SCHEMA)
    wrong = pb.PredictRequest(model_name="m", dense=wire.encode(np.zeros((3, 2), np.float64)), sparse=empty)
    with pytest.raises(InvalidInput, match=r"^dense: dtype 'float64' not accepted; expected one of \['float32'\]$"):
        decode_predict(wrong.SerializeToString(), parse_request(wrong.SerializeToString(), predict=True), SCHEMA)




def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _key(number: int, kind: int) -> bytes:
    return _varint(number << 3 | kind)


@pytest.mark.parametrize("extra", [
    _key(99, 3) + _key(1, 0) + b"\x01" + _key(7, 3) + _key(7, 4) + _key(2, 2) + b"\x01x" + _key(99, 4),  # nested group
    _key(99, 3) + _key(99, 4),  # an empty group
    _key(1 << 29, 0) + b"\x01",  # a field number past protobuf's
    _key((1 << 29) - 1, 0) + b"\x01",  # the largest it has
    _key(99, 4),  # an end without a start
    _key(99, 3) + _key(98, 4),  # an end that is another group's
    _key(99, 3) + _key(1, 0) + b"\x01",  # no end
    b"\x9a\x86\x80\x80\x80\x00" + b"\x01x",  # a key padded to 6 bytes (protobuf reads at most 5)
    _key(99, 2) + b"\x81\x80\x80\x80\x80\x00x",  # a length padded to 6 bytes
    _key(15, 2) + b"\x81\x80\x80\x80\x80\x00x",  # the same after a one-byte key (OIP's fast path)
    b"\x9a\x86\x80\x80\x00" + b"\x81\x80\x80\x80\x00x",  # both padded to 5: valid
    _key(99, 3) + b"\x88\x80\x80\x80\x80\x00\x01" + _key(99, 4),  # a group's field's key padded to 6
])
def test_unknown_fields_and_groups_are_read_as_protobuf_reads_them(extra):
    """Unknown fields are skipped, groups (deprecated, but valid protobuf) included, and what
    protobuf refuses is refused: the hand-written reader (serving/frontend/protowire.py) and the
    OIP reader's two paths answer as the generated message does."""
    from google.protobuf.message import DecodeError

    from recserve.oip import grpc_predict_v2_pb2 as oip
    from serving.frontend.oip.wire import _parse_slow, parse_infer

    body = pb.LookupRequest(model_name="m", sparse=pb.SparseFeatures(
        keys=["a"], lengths=wire.encode(np.array([1], np.int32)), values=wire.encode(np.array([3])))).SerializeToString()
    oip_body = oip.ModelInferRequest(model_name="m", inputs=[oip.ModelInferRequest.InferInputTensor(
        name="a_ids", datatype="INT64", shape=[1])], raw_input_contents=[np.int64(3).tobytes()]).SerializeToString()
    for buf, message, reads in ((body + extra, pb.LookupRequest, lambda b: parse_request(b, predict=False)),
                                (oip_body + extra, oip.ModelInferRequest, parse_infer),
                                (oip_body + extra, oip.ModelInferRequest, _parse_slow)):
        try:
            message.FromString(buf)
            valid = True
        except DecodeError:
            valid = False
        try:
            reads(buf)
            read = True
        except InvalidInput as e:
            assert str(e).startswith("the request body is not a valid protobuf message (")
            read = False
        assert read == valid, (message.__name__, reads.__name__, valid)


def test_a_request_of_more_fields_than_any_request_needs_is_refused_before_it_is_read_through():
    """A 64 MiB message of two-byte fields held a front end's event loop for half a minute (about a
    microsecond a field, unknown ones and each key included): past MAX_FIELDS (every field of the
    request's messages and skipped groups counted) the request is refused, and one at the limit read."""
    from serving.frontend.protowire import MAX_FIELDS

    body, _ = sparse_msg(["a"], [1], [3])
    own = 2 + 3 + 2 * 3  # model_name, sparse; keys, lengths, values; each tensor's dtype, shape, data
    unknown = _key(15, 0) + b"\x00"
    assert parse_request(body + unknown * (MAX_FIELDS - own), predict=False).keys == ["a"]
    group = _key(99, 3) + unknown * (MAX_FIELDS - own - 1) + _key(99, 4)  # its end is not a field
    assert parse_request(body + group, predict=False).keys == ["a"]
    too_many = f"^the request has more than {MAX_FIELDS} protobuf fields; no request needs that many$"
    for extra in (unknown * (MAX_FIELDS - own + 1), _key(99, 3) + unknown * MAX_FIELDS + _key(99, 4)):
        with pytest.raises(InvalidInput, match=too_many):
            parse_request(body + extra, predict=False)
    keys = pb.LookupRequest(model_name="m", sparse=pb.SparseFeatures(keys=["k"] * (MAX_FIELDS - 2))).SerializeToString()
    assert len(parse_request(keys, predict=False).keys) == MAX_FIELDS - 2
    for sparse in (pb.SparseFeatures(keys=["k"] * MAX_FIELDS), pb.SparseFeatures(keys=["k" * 200] * MAX_FIELDS)):
        with pytest.raises(InvalidInput, match=too_many):  # one-byte sizes (read in bulk) and longer ones
            parse_request(pb.LookupRequest(model_name="m", sparse=sparse).SerializeToString(), predict=False)


def test_an_oip_request_of_more_fields_than_any_request_needs_is_refused_before_it_is_read_through():
    """As recserve.v1's reader (above): the OIP reader took about a microsecond a field too, so a 64 MiB
    ModelInferRequest of two-byte fields (top-level ones, or inside an input's record or parameters)
    held a front end's event loop for about 20 s."""
    from recserve.oip import grpc_predict_v2_pb2 as oip
    from serving.frontend.oip.wire import parse_infer
    from serving.frontend.protowire import MAX_FIELDS, encode_varint

    tensor = oip.ModelInferRequest.InferInputTensor
    good = oip.ModelInferRequest(model_name="m", inputs=[tensor(name="a_lengths", datatype="INT32", shape=[1])],
                                 raw_input_contents=[np.int32(1).tobytes()]).SerializeToString()
    unknown = _key(15, 0) + b"\x00"
    assert parse_infer(good + unknown * 1000).model_name == "m"
    too_many = f"^the request has more than {MAX_FIELDS} protobuf fields; no request needs that many$"
    record = oip.ModelInferRequest(inputs=[tensor(name="a_lengths", datatype="INT32", shape=[1])]).SerializeToString()
    inner = unknown * MAX_FIELDS
    in_an_input = _key(5, 2) + encode_varint(len(record) - 2 + len(inner)) + record[2:] + inner
    for extra in (unknown * MAX_FIELDS, in_an_input):
        with pytest.raises(InvalidInput, match=too_many):
            parse_infer(good + extra)
    assert parse_infer(good).model_name == "m"


def test_an_oip_input_with_raw_and_typed_contents_is_refused_as_triton_refuses_it():
    from recserve.oip import grpc_predict_v2_pb2 as oip
    from serving.frontend.oip.wire import parse_infer

    tensor = oip.ModelInferRequest.InferInputTensor
    both = oip.ModelInferRequest(model_name="m", inputs=[
        tensor(name="a_lengths", datatype="INT32", shape=[1]),
        tensor(name="a_ids", datatype="INT64", shape=[1], contents=oip.InferTensorContents(int64_contents=[0]))],
        raw_input_contents=[np.int32(1).tobytes(), np.int64(3).tobytes()]).SerializeToString()
    with pytest.raises(InvalidInput, match=r"^input 'a_ids': its data is both in raw_input_contents and in "
                                           r"contents; send it one way$"):
        parse_infer(both)



def test_an_oip_feature_named_like_another_features_shared_input_is_that_feature():
    """Features "u" and "u_shared" (legal in a model_config.json): "u_shared_ids" is u_shared's ids,
    sent with its lengths; it is not also a shared bag of "u", which keeps its empty bags."""
    from serving.frontend.oip.protocol import expected_inputs, model_inputs, to_batch
    from serving.frontend.validate import model_kjt

    schema = Schema(feature_names=("u", "u_shared"), rows=(20, 20), dims=(4, 4), dense_features=2, max_batch_size=8,
                    max_ids=100)
    names = [name for name, _, _, _ in model_inputs(schema, {})]
    assert names == ["dense", "u_lengths", "u_ids", "u_shared_lengths", "u_shared_ids", "u_shared_shared_ids",
                     "lengths", "ids"]
    assert "u_shared_ids" in expected_inputs(schema)
    inputs = {"dense": np.zeros((2, 2), np.float32), "u_shared_lengths": np.array([1, 2], np.int32),
              "u_shared_ids": np.array([3, 4, 5], np.int64)}
    _, sparse = to_batch(inputs, schema, need_dense=True)
    assert sparse.shared_keys == [] and sparse.all_keys == ["u", "u_shared"]
    kjt = model_kjt(sparse, None, schema)
    ids, lengths = kjt.per_feature()
    assert [a.tolist() for a in ids] == [[], [3, 4, 5]] and [list(l) for l in lengths] == [[0, 0], [1, 2]]

def test_statistics_of_two_engines_add_up_per_version():
    """serving/statistics.py: what each engine counts, and the sum a front end answers with."""
    from serving.statistics import VersionStatistics, merge

    a, b = VersionStatistics(), VersionStatistics()
    a.answered(samples=4, enqueued=1.0, started=1.5, finished=1.75)
    a.batch(4, 0.25)
    b.answered(samples=2, enqueued=2.0, started=2.0, finished=2.5)
    b.answered(samples=2, enqueued=2.25, started=2.25, finished=2.5)
    b.batch(4, 0.5)
    b.batch(2, 0.125)
    b.failed(enqueued=0.0)  # admitted at monotonic 0: counted, with a duration
    total = merge([{("m", 1): a}, {("m", 1): b, ("m", 2): VersionStatistics()}])
    m1 = total[("m", 1)]
    assert (m1.success, m1.queue, m1.compute_infer) == ([3, 1_500_000_000], [3, 500_000_000], [3, 1_000_000_000])
    assert (m1.inference_count, m1.execution_count, m1.batches) == (8, 3, {4: [2, 750_000_000], 2: [1, 125_000_000]})
    assert m1.fail[0] == 1 and m1.last_inference_ms == max(a.last_inference_ms, b.last_inference_ms) > 0
    assert total[("m", 2)].success == [0, 0] and a.batches == {4: [1, 250_000_000]}  # the inputs are not changed


def test_server_processes_keep_freed_large_blocks_for_the_next_request():
    """serving/child.py ``keep_large_blocks``: three 5 MB blocks (a B=4096 request's) freed stay in
    the heap for the next ones (glibc's free bytes), where by default they go back to the system and
    the next request's pages fault again; in a fresh interpreter."""
    import subprocess
    import sys

    probe = """
import ctypes
from serving.child import keep_large_blocks
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype, libc.malloc.restype = Info, ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
def kept_mib():
    for block in [libc.malloc(5 << 20) for _ in range(3)]:
        libc.free(block)
    return libc.mallinfo2().fordblks >> 20
print(kept_mib(), kept_mib(), keep_large_blocks(), kept_mib(), kept_mib())
"""
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    default, again, done, kept, kept_again = run.stdout.split()
    assert int(default) < 5 and int(again) < 5 and done == "True" and int(kept) >= 15 and int(kept_again) >= 15


def test_the_client_sends_ids_and_lengths_as_given_or_refuses_them():
    """numpy's casts would send an id of 1.7 as 1, True as id 1, and a length of 2**32 + 1 as 1: the
    client refuses what is not an integer of the wire's width instead of sending another request."""
    from recserve.client import encode_sparse

    def sent(message):
        return (wire.decode(message.lengths, "lengths", ["int32"]).tolist(),
                wire.decode(message.values, "values", ["int32", "int64"]).tolist())

    assert sent(encode_sparse({"a": [[3, 2**40], []], "b": [[7], [0]]})) == ([2, 0, 1, 1], [3, 2**40, 7, 0])
    assert sent(encode_sparse((["a"], np.array([2, 0], np.uint8), np.array([5, 6], np.uint16)))) == ([2, 0], [5, 6])
    assert sent(encode_sparse((["a"], [0, 0], []))) == ([0, 0], [])
    refused = [({"a": [[1.7]]}, "ids of feature 'a' must be integers, got float64"),
               ({"a": [[True]]}, "ids of feature 'a' must be integers, got bool"),
               ({"a": [[2**64]]}, "ids of feature 'a' must fit int64, got 18446744073709551616"),
               ((["a"], [1], np.array([1.0])), "ids must be integers, got float64"),
               ((["a"], [1.0], [4]), "lengths must be integers, got float64"),
               ((["a"], [2**32 + 1], [4]), "lengths must fit int32, got 4294967297 to 4294967297")]
    for sparse, message in refused:
        with pytest.raises(ValueError, match=message):
            encode_sparse(sparse)
    with pytest.raises(ValueError, match="ids of shared feature 's' must be integers, got float64"):
        encode_sparse({"a": [[1]]}, shared={"s": [0.5]})


def test_the_clients_refusals_of_bags_name_the_feature():
    """A float among a dict of bags' ids was "ids must be integers, got float64 values", with no word of
    which feature (the server's messages name it: "id 5 of feature 'a'"); so were ids past int64, a
    shared bag's, and bag counts that differ ("got bag counts [2, 3]"). A raw KJT's values are one
    array of every feature: its refusal names none."""
    from recserve.client import encode_sparse

    refused = [({"user_id": [[3], [7]], "item_id": [[1.5, 2], []]}, None,
                "ids of feature 'item_id' must be integers, got float64 values"),
               ({"a": [[1]], "b": [[-2**63 - 1]]}, None, "ids of feature 'b' must fit int64, got -9223372036854775809"),
               ({"a": [[1]]}, {"s": [7], "user_id": [0.5]},
                "ids of shared feature 'user_id' must be integers, got float64 values"),
               ({"user_id": [[3], [7]], "item_id": [[1], [2], []]}, None,
                "every feature needs one bag per sample, as many as the others; got bag counts "
                "{'user_id': 2, 'item_id': 3}"),
               ((["a", "b"], [1, 1], np.array([1.0, 2.0])), None, "ids must be integers, got float64 values")]
    for sparse, shared, message in refused:
        with pytest.raises(ValueError) as exc:
            encode_sparse(sparse, shared)
        assert str(exc.value) == message


def test_the_client_refuses_bags_and_lengths_that_cannot_describe_the_ids_in_the_servers_words():
    """{"user_id": [3, 7]} (bags left out) was "object of type 'int' has no len()"; keys given as one
    string went as one key per letter; lengths that do not add up to the ids went to the server."""
    from recserve.client import encode_sparse

    refused = [({"user_id": [3, 7]}, "sparse['user_id'][0]: expected a bag (a list of ids) per sample, got 3; a "
                                     "sample of one id is [id]"),
               (("user_id", [1], [4]), "sparse keys: expected a list of feature names, got the string 'user_id'"),
               ((["a", "b"], [1, 1, 2, 0], [4, 5, 6]), "sparse.lengths sum to 4 but sparse.values has 3 ids"),
               ((["a", "b"], [1, 1, -1, 0], [4]), "sparse.lengths: negative length for feature 'b'"),
               ((["a", "b"], [1, -1, 1], [4]), "sparse.lengths: negative length")]
    for sparse, message in refused:
        with pytest.raises(ValueError) as exc:
            encode_sparse(sparse)
        assert str(exc.value) == message
    message = encode_sparse((["a", "b"], [1, 0, 2, 0], [4, 5, 6]))
    assert (wire.decode(message.lengths, "lengths", ["int32"]).tolist(),
            wire.decode(message.values, "values", ["int64"]).tolist()) == ([1, 0, 2, 0], [4, 5, 6])


def test_the_client_refuses_ids_past_int64_instead_of_sending_them_negative():
    """Ids from 2**63 to 2**64 - 1 (64-bit hashes) are uint64 to numpy, and its cast to the wire's int64
    wrapped them: the server answered "id -9223372036854775803 of feature 'a' is outside [0, rows)",
    an id the caller never sent."""
    from recserve.client import encode_sparse

    for sparse, ids in (({"a": [[], [2**63 + 5]]}, "ids of feature 'a'"),
                        ((["a"], [1, 1], np.array([3, 2**63 + 5], np.uint64)), "ids")):
        with pytest.raises(ValueError, match=f"^{ids} must fit int64, got 9223372036854775813$"):
            encode_sparse(sparse)
    with pytest.raises(ValueError, match="^ids of shared feature 's' must fit int64, got 18446744073709551615$"):
        encode_sparse({"a": [[1]]}, shared={"s": np.array([2**64 - 1], np.uint64)})
    # Beside ids below 2**63, numpy holds such an id as float64 (or object past 2**64): it was refused as
    # "ids must be integers, got float64 values", as if the caller had sent a fraction.
    for sparse, shared, ids, big in (({"a": [[3, 2**63 + 5]]}, None, "ids of feature 'a'", 2**63 + 5),
                                     ({"a": [[3], [2**64]]}, None, "ids of feature 'a'", 2**64),
                                     ({"a": [[1]], "b": [[-2**63 - 1]]}, None, "ids of feature 'b'", -2**63 - 1),
                                     ({"a": [[1]]}, {"s": [7, 2**63]}, "ids of shared feature 's'", 2**63)):
        with pytest.raises(ValueError, match=f"^{ids} must fit int64, got {big}$"):
            encode_sparse(sparse, shared)
    with pytest.raises(ValueError, match="^lengths must fit int32, got 1 to 18446744073709551616$"):
        encode_sparse((["a"], [1, 2**64], [3]))


def test_a_client_timeout_grpc_cannot_keep_is_refused_when_the_client_is_made():
    """gRPC keeps a deadline as int64 nanoseconds: timeout=inf or 1e10 wrapped into the past and every
    call failed DEADLINE_EXCEEDED without reaching the server (the CLI checked its --timeout; the
    library did not)."""
    from recserve.client import Client
    from recserve.errors import UserError

    for timeout in (float("inf"), 1e10, float("nan"), 0, -1):
        with pytest.raises(UserError, match="timeout must be > 0 and at most 86400 seconds"):
            Client("localhost:50051", timeout=timeout)
    Client("localhost:50051", timeout=None).close()  # no deadline at all stays allowed


def test_the_server_stops_front_ends_first_and_exits_with_the_engines_code(tmp_path, monkeypatch):
    """serving/supervisor.py: front ends stop before the engines (they drain through them); a server
    brought down by one process exits with its engine's failure code (3: the device failed) even when
    a front end noticed first, else 1 - never 0, never a signal's negative number."""
    from types import SimpleNamespace

    from serving import supervisor as supervisor_module
    from serving.config import ServerConfig

    stopped = []

    def terminate(procs, deadline, at_once=None):
        stopped.append([p.name for p in procs])
        return [p.exitcode for p in procs]

    monkeypatch.setattr(supervisor_module, "_terminate", terminate)
    supervisor = supervisor_module.Supervisor(ServerConfig(repo=tmp_path), "INFO")
    front = SimpleNamespace(name="recserve-frontend-0", exitcode=1)  # its engine went: it exits first
    supervisor.fronts = [front]
    supervisor.engines = [SimpleNamespace(name="recserve-engine-0", exitcode=3)]
    assert supervisor._take_down(front) == 3
    assert stopped == [["recserve-frontend-0"], ["recserve-engine-0"]]
    front.exitcode, supervisor.engines[0].exitcode = -9, 0  # a front end killed (OOM); the engine stops cleanly
    assert supervisor._take_down(front) == 1
    front.exitcode = 0
    assert supervisor._stop_all() == 0
    supervisor.engines[0].exitcode = -9  # killed after the grace period
    assert supervisor._stop_all() == 1


def test_working_folders_removed_at_start_are_never_those_of_servers_that_do_not_lock_theirs(tmp_path):
    """serving/supervisor.py _remove_stale: a working folder no process holds (flock) and a minute old
    is that of a server killed whole only where its server locks it. A server of a version before the
    supervisor and its children locked their folder (any recserve before this one) holds no lock while
    it runs, and its folder, named as every version names it (``recserve-`` and mkdtemp's 8
    characters), changes only as its processes start: it was removed from under the live server (its
    engine sockets, metric files, shm-regions.json). Only folders named as servers that lock theirs
    name them are removed."""
    import tempfile
    import time
    from pathlib import Path

    from serving import supervisor as supervisor_module

    hour_ago = time.time() - 3600
    older_server = tmp_path / "recserve-k3j2h1g0"  # tempfile.mkdtemp(prefix="recserve-"), alive, unlocked
    killed = Path(tempfile.mkdtemp(prefix=supervisor_module.WORKDIR_PREFIX, dir=tmp_path))  # this version's:
    for folder in (older_server, killed):  # its server was killed whole
        (folder / "metrics").mkdir(parents=True, exist_ok=True)
        (folder / "engine-0.sock").write_bytes(b"")
        os.utime(folder, (hour_ago, hour_ago))

    supervisor_module._remove_stale(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recserve-k3j2h1g0"]
    assert sorted(p.name for p in older_server.iterdir()) == ["engine-0.sock", "metrics"]


def test_a_request_runs_on_the_least_loaded_engine_serving_its_version(monkeypatch):
    """serving/frontend/link.py Engines.run: of the engines that serve the version the request was
    checked against, the one with the fewest of this front end's requests in flight; none: retry."""
    from types import SimpleNamespace

    from serving.errors import Overloaded
    from serving.frontend.link import Engines

    layout = SimpleNamespace(layout=SimpleNamespace(slot_bytes=64))  # every request: 64 bytes of the buffer
    monkeypatch.setattr("serving.frontend.link.plan", lambda *request: layout)

    def link(name, in_flight, versions, ready=True):
        state = {v: SimpleNamespace(name="m", version=v, engine=name, schema=SCHEMA, pool_shared_once=False)
                 for v in versions}
        return SimpleNamespace(ready=ready, in_flight=in_flight, models={"m": SimpleNamespace(versions=state)},
                               run=lambda rpc, model, *rest: model.engine,
                               arena=SimpleNamespace(fits=lambda nbytes: True))

    engines = Engines([link("0", 3, [2]), link("1", 1, [2]), link("2", 0, [1]), link("3", 0, [2], ready=False)])
    checked = SimpleNamespace(name="m", version=2, schema=SCHEMA, pool_shared_once=False)
    assert engines.run("Predict", checked, None, None, False, None) == "1"
    engines.links[0].in_flight = 0
    assert engines.run("Predict", checked, None, None, False, None) == "0"
    with pytest.raises(Overloaded, match="changed version"):
        engines.run("Predict", SimpleNamespace(name="m", version=3), None, None, False, None)


def test_a_request_goes_to_an_engine_whose_share_of_the_buffer_has_room():
    """`--replicas 2`: each engine has its share of a front end's buffer. Engine 0's share held by
    one large request, engine 1's almost free, one request in flight on each: the next request went
    to engine 0 (the first of the least loaded) and got UNAVAILABLE "buffers are full" while half
    of the front end's buffer was free. It must run on engine 1."""
    import asyncio

    from serving import ipc
    from serving.frontend.link import EngineLink, Engines

    async def scenario():
        links = [EngineLink("unused.sock", 1 << 20, 0, on_state=lambda: None, on_lost=lambda code: None)
                 for _ in range(2)]
        state = ipc.ModelState("m", 0, 1, SCHEMA, False)
        loop = asyncio.get_running_loop()
        for link, held in zip(links, (1 << 20, 64)):
            link.ready = True
            link.models = {"m": ipc.ServedModel("m", {}, {1: state}, {})}
            link._pending[-1] = (loop.create_future(), link.arena.alloc(held))
        sparse = decode(["a", "b", "c"], [1] * 24, [1] * 24)
        run = asyncio.ensure_future(Engines(links).run("Lookup", state, sparse, None, False, None).__aenter__())
        await asyncio.sleep(0.05)  # submitted: waits for an engine that is not there
        assert not run.done(), run.exception()
        run.cancel()
        return [link.in_flight for link in links]

    assert asyncio.run(scenario()) == [1, 2]


def test_a_request_runs_only_on_engines_whose_copy_of_its_version_takes_the_inputs_it_was_checked_for():
    """`--replicas 2`: engine 1 loaded version 1 again with smaller tables (the version's directory
    replaced; engine 0 has not polled yet). A request checked against engine 0's copy (its int64 ids
    against those rows) went to engine 1, the least loaded, laid out for engine 1's copy with its ids
    unchecked there: an id past engine 1's table reached its kernel. It runs on engine 0; where only
    engine 1 could take it, it is told to retry."""
    import asyncio

    from serving import ipc
    from serving.errors import Overloaded
    from serving.frontend.link import EngineLink, Engines

    smaller = Schema(feature_names=SCHEMA.feature_names, rows=(5, 20, 30), dims=SCHEMA.dims,
                     dense_features=SCHEMA.dense_features, max_batch_size=SCHEMA.max_batch_size, max_ids=SCHEMA.max_ids)

    async def scenario():
        links = [EngineLink("unused.sock", 1 << 20, 0, on_state=lambda: None, on_lost=lambda code: None)
                 for _ in range(2)]
        loop = asyncio.get_running_loop()
        for i, (link, schema) in enumerate(zip(links, (SCHEMA, smaller))):
            link.ready = link.loaded = True
            link.models = {"m": ipc.ServedModel("m", {}, {1: ipc.ModelState("m", i, 1, schema, False)}, {})}
        links[0]._pending[-1] = (loop.create_future(), links[0].arena.alloc(64))  # engine 1 is the least loaded
        engines = Engines(links)
        checked = engines.model("m", 0)
        assert checked.schema == SCHEMA
        sparse = decode(["a", "b", "c"], [1, 0, 0], [7])  # in engine 0's table "a" (10 rows), not engine 1's (5)
        run = asyncio.ensure_future(engines.run("Lookup", checked, sparse, None, False, None).__aenter__())
        await asyncio.sleep(0.05)  # submitted: waits for an engine that is not there
        assert not run.done(), run.exception()
        run.cancel()
        in_flight = [link.in_flight for link in links]
        links[0].ready = False
        with pytest.raises(Overloaded, match="^the model changed version while the request was checked; retry$"):
            engines.run("Lookup", checked, sparse, None, False, None)
        return in_flight

    assert asyncio.run(scenario()) == [2, 0]


def test_engines_serving_one_version_share_its_schema_so_a_request_compares_none(monkeypatch):
    """`--replicas N`: each engine's Models message unpickles its own copy of a version's schema, and
    Engines.run matched the request's copy with every engine's field by field: tens of microseconds
    per engine per request for a model of hundreds of features. Equal schemas are now one object
    (read from the engines' messages), and a request compares none."""
    import asyncio
    import pickle

    from serving import ipc
    from serving.frontend.link import EngineLink, Engines

    def message(engine):
        state = ipc.ModelState("m", engine, 1, pickle.loads(pickle.dumps(SCHEMA)), False)
        payload = pickle.dumps(ipc.Models(True, {"m": ipc.ServedModel("m", {}, {1: state}, {})}))
        return ipc._HEADER.pack(len(payload)) + payload

    async def scenario():
        links = [EngineLink("unused.sock", 1 << 20, 0, on_state=lambda: None, on_lost=lambda code: None)
                 for _ in range(2)]
        readers = []
        for engine, link in enumerate(links):
            reader = asyncio.StreamReader()
            reader.feed_data(message(engine))
            readers.append(asyncio.ensure_future(link._read(reader)))
        await asyncio.sleep(0.05)  # each reader took its message; they wait for the next
        assert all(link.ready and link.loaded for link in links)
        schemas = [link.models["m"].versions[1].schema for link in links]
        assert schemas[0] == SCHEMA and schemas[0] is schemas[1]
        compared = []
        monkeypatch.setattr(Schema, "__eq__", lambda a, b: compared.append(1) or NotImplemented)
        engines = Engines(links)
        run = asyncio.ensure_future(engines.run("Lookup", engines.model("m", 0), decode(["a"], [1], [7]), None,
                                                False, None).__aenter__())
        await asyncio.sleep(0)
        run.cancel()
        for reader in readers:
            reader.cancel()
        return [link.in_flight for link in links], compared

    assert asyncio.run(scenario()) == ([1, 0], [])


def test_a_request_over_several_engines_is_laid_out_once(monkeypatch):
    """`--replicas 2`: Engines.run laid the request out (model_kjt, ipc.layout_of) to find an engine
    whose share of the buffer has room, then the chosen link laid it out again: twice per request on
    the front end's hot path. Once: the layout that chose the engine is the one written."""
    import asyncio

    from serving import ipc
    from serving.frontend.link import EngineLink, Engines

    layouts = []
    real = ipc.layout_of
    monkeypatch.setattr(ipc, "layout_of", lambda *args: layouts.append(args) or real(*args))

    async def scenario():
        links = [EngineLink("unused.sock", 1 << 20, 0, on_state=lambda: None, on_lost=lambda code: None)
                 for _ in range(2)]
        for i, link in enumerate(links):
            link.ready = True
            link.models = {"m": ipc.ServedModel("m", {}, {1: ipc.ModelState("m", i, 1, SCHEMA, False)}, {})}
        sparse = decode(["a", "b", "c"], [1] * 6, [1] * 6)
        run = asyncio.ensure_future(Engines(links).run("Lookup", links[0].models["m"].versions[1], sparse, None,
                                                       False, None).__aenter__())
        await asyncio.sleep(0.05)  # submitted: waits for an engine that is not there
        assert not run.done(), run.exception()
        run.cancel()
        return [link.in_flight for link in links]

    assert asyncio.run(scenario()) == [1, 0]
    assert len(layouts) == 1


def test_engines_that_disagree_on_a_models_versions_serve_each_version_one_of_them_serves(monkeypatch):
    """`--replicas 2`: engine 0 refused version 2 (its load timed out) while engine 1 loaded it and
    released version 1. Only engine 0's view counted: a request pinned to version 2 got NOT_FOUND
    while engine 1 served it, and every unpinned request ran on engine 0 for good."""
    from types import SimpleNamespace

    from serving import ipc
    from serving.errors import ModelNotFound
    from serving.frontend.link import Engines

    layout = SimpleNamespace(layout=SimpleNamespace(slot_bytes=64))  # every request: 64 bytes of the buffer
    monkeypatch.setattr("serving.frontend.link.plan", lambda *request: layout)

    def link(name, versions, labels):
        states = {v: ipc.ModelState("m", 7, v, SCHEMA, False) for v in versions}
        return SimpleNamespace(ready=True, loaded=True, accepting=True, in_flight=0, name=name,
                               models={"m": ipc.ServedModel("m", {v: f"info {name} v{v}".encode() for v in versions},
                                                            states, labels)},
                               run=lambda rpc, model, *rest, name=name: (name, model.version),
                               slot_bytes=lambda *request: 64, arena=SimpleNamespace(fits=lambda nbytes: True))

    engines = Engines([link("0", [1], {"stable": 1}), link("1", [2], {"stable": 1, "canary": 2})])
    pinned = engines.model("m", 2)
    assert pinned.version == 2
    assert engines.run("Predict", pinned, None, None, True, None) == ("1", 2)
    assert engines.run("Predict", engines.model("m", 1), None, None, True, None) == ("0", 1)
    unpinned = engines.model("m", 0)
    assert (unpinned.version, engines.run("Predict", unpinned, None, None, False, None)) == (2, ("1", 2))
    assert engines.model("m", 0, "canary").version == 2
    assert engines.known("m").info == b"info 1 v2"  # GetModelInfo: the default version's, from an engine serving it
    assert engines.known("m").infos[1] == b"info 0 v1"
    with pytest.raises(ModelNotFound, match=r"serving versions \[1, 2\]"):
        engines.model("m", 3)


def test_the_repository_index_of_several_engines_lists_what_any_of_them_serves():
    """`--replicas 2`: engines poll on their own, and one may refuse a version another serves. The
    OIP repository index showed engine 0's view alone: model m UNAVAILABLE while engine 1 served
    (and answered requests for) its version 2, and n without the version 2 that engine 1 had loaded."""
    from types import SimpleNamespace

    from serving.frontend.link import Engines

    engines = Engines([SimpleNamespace(repository_index=[("m", "", "UNAVAILABLE", "version 2: load timed out"),
                                                         ("n", "1", "READY", ""), ("o", "", "UNAVAILABLE", "why 0")]),
                       SimpleNamespace(repository_index=[("m", "2", "READY", ""), ("n", "2", "READY", ""),
                                                         ("n", "1", "UNLOADING", ""), ("o", "", "LOADING", "")])])
    assert engines.repository_index == [("m", "2", "READY", ""), ("n", "2", "READY", ""), ("n", "1", "READY", ""),
                                        ("n", "1", "UNLOADING", ""), ("o", "", "LOADING", "")]


def test_a_load_that_fails_on_one_engine_is_undone_on_the_others():
    """`--replicas 2 --model-control explicit`: engine 0's load of a model failed (its load timed
    out), engine 1's succeeded. The client got INVALID_ARGUMENT "does not load" while engine 1 then
    served the model, and the engines disagreed for good."""
    import asyncio
    from types import SimpleNamespace

    from serving.frontend.link import Engines

    def link(load_error):
        engine = SimpleNamespace(models={}, asked=[])

        async def control(action, model):
            engine.asked.append(action)
            if action == "load" and not load_error:
                engine.models[model] = SimpleNamespace(name=model, versions={1: object()}, labels={}, info=b"")
            elif action == "unload":
                engine.models.pop(model, None)
            return load_error if action == "load" else ""

        engine.control = control
        return engine

    engines = Engines([link("model 'm' does not load: version 1: load timed out"), link("")])
    assert asyncio.run(engines.control("load", "m")) == "model 'm' does not load: version 1: load timed out"
    assert "m" not in engines.models
    assert [link.asked for link in engines.links] == [["load"], ["load", "unload"]]

    # A load refused by an engine that still serves the model (its new version 2 refused, version 1
    # serves on) leaves the model where it serves: the others keep what they loaded.
    engines = Engines([link("model 'm' does not load: version 2: load timed out; it serves version 1"), link("")])
    engines.links[0].models["m"] = SimpleNamespace(name="m", versions={1: object()}, labels={}, info=b"")
    assert asyncio.run(engines.control("load", "m")).endswith("it serves version 1")
    assert [link.asked for link in engines.links] == [["load"], ["load"]]
    assert all("m" in link.models for link in engines.links)


@pytest.mark.parametrize("gauge,labels", [("host_memory", {}), ("gpu_memory", {"device": "cuda:1"}),
                                          ("graph_pool", {"device": "cuda:1"})])
def test_memory_on_the_metrics_endpoint_adds_up_every_engines(gauge, labels):
    """`--replicas 2`: each engine process holds its own copy of every model in host memory;
    recserve_host_memory_bytes showed the largest engine's (multiprocess "livemax"), half of what
    the engines held. So did the GPU gauges where two engines allocate on one GPU (engine 0 sees
    every GPU, for a model sharded over them; engine 1 holds its copies on GPU 1). Two engines in
    fresh interpreters, read as the supervisor's /metrics does."""
    import os
    import subprocess
    import sys
    import tempfile

    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    from serving.metrics import Metrics

    with tempfile.TemporaryDirectory() as directory:
        for engine, resident in ((0, 3 << 30), (1, 2 << 30)):
            probe = (f"from serving.metrics import Metrics; g = Metrics({engine}).{gauge}; "
                     f"(g.labels(**{labels!r}) if {bool(labels)} else g).set({resident})")
            run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": directory})
            assert run.returncode == 0, run.stderr
        registry = CollectorRegistry()
        MultiProcessCollector(registry, directory)
        assert registry.get_sample_value(getattr(Metrics(), gauge)._name, labels) == 5 << 30


def test_the_repository_index_of_several_engines_lists_a_version_refused_where_none_serves_it():
    """Each engine lists a version its policy asks for and that it refused, UNAVAILABLE with why; the
    front end's merge showed it as held (state and reason lost) and beside another engine's READY."""
    from types import SimpleNamespace

    from serving.frontend.link import Engines

    engines = Engines([SimpleNamespace(repository_index=[("m", "1", "READY", ""), ("m", "2", "UNAVAILABLE", "bad 0"),
                                                         ("m", "3", "UNAVAILABLE", "bad 0")]),
                       SimpleNamespace(repository_index=[("m", "2", "READY", ""), ("m", "1", "UNLOADING", ""),
                                                         ("m", "3", "UNAVAILABLE", "bad 1")])])
    assert engines.repository_index == [("m", "2", "READY", ""), ("m", "1", "READY", ""),
                                        ("m", "3", "UNAVAILABLE", "bad 0"), ("m", "1", "UNLOADING", "")]


def _cgroup_tree(tmp_path, files: dict, proc_line: str = "0::/kubepods/pod1/c1"):
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"{proc_line}\n")
    return root, proc


def test_usable_cores_are_the_affinity_capped_by_the_tightest_cgroup_quota(tmp_path, monkeypatch):
    """Defaults (front ends, the engine's torch threads, the --replicas check) were sized from
    os.cpu_count(): in a container limited to 2.5 cores of a large host, 8 front ends and dozens of
    engine threads shared those 2.5 cores. (A large host: on one of 3 cores or fewer, the pod's limit
    was never read and the test still passed.)"""
    from serving.machine import usable_cores

    affinity = 64
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)))
    root, proc = _cgroup_tree(tmp_path, {"kubepods/pod1/c1/cpu.max": "max 100000\n",  # the container: no limit
                                         "kubepods/pod1/cpu.max": "250000 100000\n"})  # its pod: 2.5 cores
    assert usable_cores(root, proc) == 3
    root, proc = _cgroup_tree(tmp_path / "none", {"kubepods/pod1/c1/cpu.max": "max 100000\n"})
    assert usable_cores(root, proc) == affinity
    root, proc = _cgroup_tree(tmp_path / "v1", {"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"},
                              proc_line="4:cpu:/")
    assert usable_cores(root, proc) == 1  # half a core: still one
    root, proc = _cgroup_tree(tmp_path / "v1none", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert usable_cores(root, proc) == affinity


def test_usable_memory_is_the_physical_memory_capped_by_the_tightest_cgroup_limit(tmp_path):
    from serving.machine import usable_memory

    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    root, proc = _cgroup_tree(tmp_path, {"kubepods/pod1/c1/memory.max": f"{2**30}\n", "kubepods/memory.max": "max\n"})
    assert usable_memory(root, proc) == min(physical, 2**30)
    root, proc = _cgroup_tree(tmp_path / "v1", {"memory/memory.limit_in_bytes": "9223372036854771712\n"},
                              proc_line="4:memory:/x")
    assert usable_memory(root, proc) == physical  # v1's "no limit"
    assert usable_memory(tmp_path / "nothing", tmp_path / "no_proc_file") == physical


def test_cgroup_v1_limits_of_the_process_own_cgroup_are_read_outside_a_container(tmp_path, monkeypatch):
    """A host whose /sys/fs/cgroup is v1 (no container: each controller's hierarchy mounted whole), the
    server in a systemd unit with CPUQuota=150% and MemoryLimit=2G: the limits are in the unit's cgroup,
    /proc/self/cgroup's "N:cpu,cpuacct:/system.slice/recserve.service", not at the hierarchy's root (no
    limit there, ever). Only the root was read: both limits were missed (the memory check passed
    buffers beyond the unit's limit, and the defaults sized for every core). A parent's limit binds
    too; in a v1 container the path (the host's) is not under the mount, and its root is read."""
    from serving.machine import usable_cores, usable_memory

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    unlimited = "9223372036854771712\n"  # v1's "no limit"
    unit = "system.slice/recserve.service"
    lines = f"12:memory:/{unit}\n4:cpu,cpuacct:/{unit}\n1:name=systemd:/{unit}\n0::/{unit}"
    root, proc = _cgroup_tree(tmp_path, {
        "memory/memory.limit_in_bytes": unlimited, "memory/system.slice/memory.limit_in_bytes": unlimited,
        f"memory/{unit}/memory.limit_in_bytes": f"{2 << 30}\n",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        f"cpu,cpuacct/{unit}/cpu.cfs_quota_us": "150000\n", f"cpu,cpuacct/{unit}/cpu.cfs_period_us": "100000\n",
    }, proc_line=lines)
    assert usable_memory(root, proc) == min(physical, 2 << 30)
    assert usable_cores(root, proc) == 2
    # The limit on the parent slice, none on the unit: the parent's binds.
    root, proc = _cgroup_tree(tmp_path / "parent", {
        "memory/memory.limit_in_bytes": unlimited, f"memory/{unit}/memory.limit_in_bytes": unlimited,
        "memory/system.slice/memory.limit_in_bytes": f"{1 << 30}\n",
        "cpu,cpuacct/system.slice/cpu.cfs_quota_us": "300000\n",
        "cpu,cpuacct/system.slice/cpu.cfs_period_us": "100000\n",
        f"cpu,cpuacct/{unit}/cpu.cfs_quota_us": "-1\n", f"cpu,cpuacct/{unit}/cpu.cfs_period_us": "100000\n",
    }, proc_line=lines)
    assert usable_memory(root, proc) == min(physical, 1 << 30)
    assert usable_cores(root, proc) == 3
    # (Kernels before 5.11) a parent with memory.use_hierarchy 0 does not count its children in: its limit is not ours.
    (root / "memory/system.slice/memory.use_hierarchy").write_text("0\n")
    assert usable_memory(root, proc) == physical
    # A v1 container: /proc/self/cgroup names the host's path, the container's own cgroup is mounted at the root.
    root, proc = _cgroup_tree(tmp_path / "container", {
        "memory/memory.limit_in_bytes": f"{3 << 30}\n",
        "cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n",
    }, proc_line="12:memory:/docker/0123abcd\n4:cpu,cpuacct:/docker/0123abcd\n0::/")
    assert usable_memory(root, proc) == min(physical, 3 << 30)
    assert usable_cores(root, proc) == 4
    # A path that climbs out of the mount ("/.." from a hostile or odd cgroup line) reads nothing outside it.
    (tmp_path / "outside" / "memory.limit_in_bytes").parent.mkdir(parents=True)
    (tmp_path / "outside" / "memory.limit_in_bytes").write_text("1\n")
    root, proc = _cgroup_tree(tmp_path / "escape", {"memory/memory.limit_in_bytes": unlimited},
                              proc_line="12:memory:/../../../outside")
    assert usable_memory(root, proc) == physical


def test_an_oip_timeout_parameter_and_a_grpc_deadline_give_the_request_the_earlier_of_them(monkeypatch):
    """Triton's ``timeout`` parameter (microseconds) is the request's deadline over HTTP; over gRPC the
    transport has one too, and the request must have started by the earlier of the two: a client
    whose own deadline is sooner gets DEADLINE_EXCEEDED from the engine, not a request run too late."""
    from serving.frontend.oip import protocol

    monkeypatch.setattr(protocol, "time", type("Clock", (), {"monotonic": staticmethod(lambda: 100.0)}))
    assert protocol.request_options({"timeout": 2_000_000}, None) == (None, 102.0)
    assert protocol.request_options({"timeout": 2_000_000}, 101.5) == (None, 101.5)
    assert protocol.request_options({"timeout": 2_000_000, "outputs": "ctr"}, 103.0) == ("ctr", 102.0)
    assert protocol.request_options({"timeout": 0}, 103.0) == (None, 103.0)  # 0: Triton's "no timeout"
    assert protocol.request_options({}, None) == (None, None)


class _Refused(grpc.RpcError):
    """What a stub raises (grpc's _InactiveRpcError): an RpcError that is a grpc.Call too."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the server is shutting down"

    def trailing_metadata(self):
        return (("retry-after-ms", "200"),)

    def initial_metadata(self):
        return (("server", "recserve"),)

    def debug_error_string(self):
        return "UNKNOWN:Error received from peer"


def test_a_client_error_pickles_and_keeps_what_callers_of_grpc_errors_read():
    """ClientError(code, details) came back from pickle (a multiprocessing queue, a process pool) as
    TypeError "missing 1 required positional argument: 'details'"; and a caller of the stubs' errors
    that read the status's trailing metadata or gRPC's debug string got AttributeError."""
    import pickle

    from recserve.client import Client, ClientError

    client = Client("127.0.0.1:1", timeout=1)
    try:
        with pytest.raises(ClientError) as exc:
            client._call(lambda request, timeout, metadata: (_ for _ in ()).throw(_Refused()), None)
    finally:
        client.close()
    for error in (exc.value, pickle.loads(pickle.dumps(exc.value))):
        assert (type(error), error.code(), error.details(), str(error), error.trailing_metadata(),
                error.initial_metadata(), error.debug_error_string()) == (
            ClientError, grpc.StatusCode.UNAVAILABLE, "the server is shutting down",
            "UNAVAILABLE: the server is shutting down", (("retry-after-ms", "200"),), (("server", "recserve"),),
            "UNKNOWN:Error received from peer")
