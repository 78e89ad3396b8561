"""Costs bounded before work, in the front end: what a request may ask for is checked before the
server spends time, memory or buffer on it. Each test asserts the exact code and message class, and
that a good request is answered exactly as before, meanwhile."""
import contextlib
import shutil
import socket

import grpc
import numpy as np
import pytest
from fuzzing import oip_call, oip_request, per_feature
from servers import SERVING, InProcessServer, health_status

from recserve import wire
from serving import ipc
from recserve.client import Client, encode_sparse, random_request
from recserve.oip import grpc_predict_v2_pb2 as oip
from recserve.v1 import inference_pb2 as pb
from serving.frontend.main import HANDSHAKE_TIMEOUT_S


@pytest.fixture(scope="module")
def server(tmp_path_factory, artifact):
    repo = tmp_path_factory.mktemp("limits")
    shutil.copytree(artifact, repo / "demo" / "1")
    server = InProcessServer(repo, settings={"frontend_buffer_bytes": 16 << 20})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target) as client:
        yield client


@pytest.fixture(scope="module")
def good_answer(client):
    info = client.model_info("demo").models[0]
    dense, sparse = random_request(info, 4, seed=21)
    return dense, sparse, client.predict("demo", dense, sparse)


@pytest.fixture
def good(client, good_answer):
    """A good request, answered exactly as before after each test."""
    dense, sparse, answer = good_answer
    yield dense, sparse
    np.testing.assert_array_equal(client.predict("demo", dense, sparse), answer)


def rpc_error(call):
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return exc.value.code(), exc.value.details()


def oip_good(dense, sparse, **kw):
    """The recserve.v1 request as ModelInferRequest bytes."""
    return oip_request("demo", dense, per_feature(sparse), **kw)


def test_repeated_oip_output_is_invalid_argument(client, good):
    dense, sparse = good
    code, message = rpc_error(lambda: oip_call(client.channel, oip_good(dense, sparse, outputs=["ctr"] * 1000)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "output 'ctr' is requested 1000 times" in message


@pytest.mark.parametrize("version", ["0", "01", "0001", "00"])
def test_oip_version_with_leading_zeros_is_not_version_1(client, good, version):
    dense, sparse = good
    code, message = rpc_error(lambda: oip_call(client.channel, oip_good(dense, sparse, outputs=["ctr"], version=version)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"model_version: '{version}' is neither a version number" in message
    code, message = rpc_error(lambda: client.channel.unary_unary(
        "/inference.GRPCInferenceService/ModelReady", request_serializer=None, response_deserializer=None)(
        oip.ModelReadyRequest(name="demo", version=version).SerializeToString(), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"model_version: '{version}' is neither a version number" in message
    answer = oip.ModelInferResponse.FromString(oip_call(client.channel, oip_good(dense, sparse, outputs=["ctr"],
                                                                                  version="1")))
    assert answer.model_version == "1"


def test_typed_contents_are_size_checked_before_decoding(client, good, monkeypatch):
    from serving.frontend.oip import wire as oip_wire

    decoded = []
    real = oip_wire.decode_contents
    monkeypatch.setattr(oip_wire, "decode_contents", lambda data, t: decoded.append(t.name) or real(data, t))
    dense, sparse = good
    many = 9_000_000  # above the default 8,388,608 ids: 9 MB of 1-byte varints
    request = oip.ModelInferRequest(model_name="demo", outputs=[oip.ModelInferRequest.InferRequestedOutputTensor(name="pooled")])
    request.inputs.add(name="item_id_lengths", datatype="INT32", shape=[1]).contents.int_contents.append(many)
    request.inputs.add(name="item_id_ids", datatype="INT64", shape=[many]).contents.int64_contents.extend([1] * many)
    code, message = rpc_error(lambda: oip_call(client.channel, request.SerializeToString()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'item_id_ids': shape [9000000] has 9000000 elements, more than the server's limit of 8388608" in message
    liar = oip.ModelInferRequest(model_name="demo")  # declares 2 ids, sends 100,000
    liar.inputs.add(name="item_id_lengths", datatype="INT32", shape=[1]).contents.int_contents.append(2)
    liar.inputs.add(name="item_id_ids", datatype="INT64", shape=[2]).contents.int64_contents.extend([1] * 100_000)
    code, message = rpc_error(lambda: oip_call(client.channel, liar.SerializeToString()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'item_id_ids': 100004 bytes of contents cannot hold the 2 elements" in message
    assert "item_id_ids" not in decoded
    np.testing.assert_array_equal(
        oip.ModelInferResponse.FromString(oip_call(client.channel, oip_good(dense, sparse, outputs=["ctr"], typed=True))
                                          ).raw_output_contents[0],
        oip.ModelInferResponse.FromString(oip_call(client.channel, oip_good(dense, sparse, outputs=["ctr"]))
                                          ).raw_output_contents[0])
    assert "item_id_ids" in decoded  # the good typed request was decoded


def test_oip_length_mismatch_names_the_feature(client, good):
    """It used to be reported as totals over all features ("sparse.lengths sum to ...")."""
    dense, sparse = good
    request = oip.ModelInferRequest.FromString(oip_good(dense, sparse, outputs=["ctr"]))
    item = [t.name for t in request.inputs].index("item_id_ids")
    sent = request.inputs[item].shape[0]
    raw = list(request.raw_input_contents)
    raw[item] = raw[item][:-8]  # one id short
    request.inputs[item].shape[0] = sent - 1
    del request.raw_input_contents[:]
    request.raw_input_contents.extend(raw)
    code, message = rpc_error(lambda: oip_call(client.channel, request.SerializeToString()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message == f"input 'item_id_lengths' sums to {sent}, but 'item_id_ids' has {sent - 1} ids"


def test_lookup_of_shared_features_only_without_lengths_is_one_sample(client, good):
    bag = np.array([3, 7, 3], np.int64)
    request = pb.LookupRequest(model_name="demo", sparse=pb.SparseFeatures(
        shared_keys=["topics"], shared_lengths=wire.encode(np.array([3], np.int32)), shared_values=wire.encode(bag)))
    shared = client.stub.Lookup(request, timeout=10)
    keys, _, per_sample = client.lookup("demo", {"topics": [bag.tolist()]})
    np.testing.assert_array_equal(wire.decode(shared.pooled, "pooled", ("float32",)), per_sample)
    assert list(shared.keys) == keys == ["topics"] and per_sample.shape[0] == 1


def test_request_larger_than_the_whole_buffer_is_resource_exhausted(client, good, server):
    """It used to get the retryable UNAVAILABLE ("split the request") from the engine link; the
    front end now refuses it before its slot is taken (serving/frontend/link.py check_fits)."""
    ids = np.zeros(5_000_000, np.int64)  # 40 MB on the wire (under 64 MiB), 20 MB as int32 in a 16 MiB buffer
    lookup = pb.LookupRequest(model_name="demo", sparse=pb.SparseFeatures(
        keys=["item_id"], lengths=wire.encode(np.array([ids.size], np.int32)), values=wire.encode(ids)))
    code, message = rpc_error(lambda: client.stub.Lookup(lookup, timeout=30))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "more than all of its 16.0 MiB (serve --frontend-buffer-mb); split the request" in message
    infer = oip_request("demo", None, {"item_id": (np.array([ids.size], np.int32), ids)}, outputs=["pooled"])
    code, message = rpc_error(lambda: oip_call(client.channel, infer))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "(serve --frontend-buffer-mb)" in message
    assert server.metric("recserve_requests_total", rpc="Lookup", code="RESOURCE_EXHAUSTED") == 1


def test_silent_sockets_cannot_hold_the_connection_quota(tmp_path, artifact):
    """--max-connections 3 and three TCP sockets that never speak HTTP/2 used to lock every new
    client and the health probe out for 50-60 s; the handshake timeout closes them."""
    shutil.copytree(artifact, tmp_path / "repo" / "demo" / "1")
    server = InProcessServer(tmp_path / "repo", settings={"max_connections": 3})
    try:
        with Client(server.target) as client:
            info = client.model_info("demo").models[0]
            dense, sparse = random_request(info, 3, seed=5)
            answer = client.predict("demo", dense, sparse)
        host, port = server.target.rsplit(":", 1)
        silent = [socket.create_connection((host, int(port))) for _ in range(3)]
        try:
            for s in silent:
                s.settimeout(HANDSHAKE_TIMEOUT_S * 6)  # gRPC's default handshake timeout is 120 s
                while s.recv(4096):  # the server's SETTINGS, then end of stream when it closes the socket
                    pass
        finally:
            for s in silent:
                s.close()
        assert health_status(server.target) == SERVING
        with Client(server.target) as client:
            np.testing.assert_array_equal(client.predict("demo", dense, sparse), answer)
    finally:
        server.stop()


def test_oip_request_whose_two_model_calls_meet_two_versions_is_told_to_retry(client, good, server):
    """A ModelInfer asking for ctr and pooled runs two model calls; if a swap lands between them they
    are answered by two versions, and the request gets UNAVAILABLE "changed version ... retry" (its
    outputs would not belong together), never a mixed answer. The swap is simulated by the link
    reporting the next version for the second call."""
    dense, sparse = good
    link = server.frontend.engine
    run = link.run
    calls = []

    @contextlib.asynccontextmanager
    async def second_call_on_the_next_version(*args, **kwargs):
        calls.append(args[0])
        second = len(calls) == 2
        async with run(*args, **kwargs) as (version, result):
            yield version + second, result

    link.run = second_call_on_the_next_version
    try:
        request = oip_request("demo", dense, per_feature(sparse), outputs=["ctr", "pooled"])
        code, message = rpc_error(lambda: oip_call(client.channel, request))
    finally:
        link.run = run
    assert sorted(calls) == ["Lookup", "Predict"]
    assert code == grpc.StatusCode.UNAVAILABLE
    assert message == "model 'demo' changed version during the request; retry"
    answer = oip.ModelInferResponse.FromString(oip_call(client.channel, request))  # as before without a swap
    assert [o.name for o in answer.outputs] == ["ctr", "pooled"] and answer.model_version == "1"


def test_max_message_mb_limits_requests_not_answers(tmp_path, artifact):
    """--max-message-mb is the largest request accepted. It used to bound responses too: a small
    Lookup whose pooled answer was larger (B x every feature's dims) got RESOURCE_EXHAUSTED "Sent
    message larger than max" after it had run, logged as a gRPC core error and counted OK."""
    shutil.copytree(artifact, tmp_path / "repo" / "demo" / "1")
    server = InProcessServer(tmp_path / "repo", settings={"max_message_bytes": 256 << 10})
    try:
        with Client(server.target) as client:
            info = client.model_info("demo").models[0]
            b = 2000  # ~72 KB of request; 2000 x 48 float32 columns = 384 KB of answer
            bags = {f.name: [[i % f.rows] for i in range(b)] for f in info.features}
            keys, dims, pooled = client.lookup("demo", bags)
            assert pooled.shape == (b, sum(dims)) and sum(dims) * b * 4 > 256 << 10
            np.testing.assert_array_equal(pooled[:3], client.lookup("demo", {k: v[:3] for k, v in bags.items()})[2])
        assert server.metric("recserve_requests_total", rpc="Lookup", code="OK") == 2
    finally:
        server.stop()


def test_a_request_in_the_last_alignment_gap_of_the_buffer_is_resource_exhausted():
    """A front end's buffer need not be a multiple of the slot alignment (--frontend-buffer-mb 16.3,
    or 16 MiB split between 3 engines). A request needing a few bytes less than the whole buffer
    passed the "fits at all" check, but its aligned slot never fit: UNAVAILABLE "buffers are full;
    retry" for ever, on an idle server, instead of RESOURCE_EXHAUSTED (split it)."""
    from serving.errors import TooLarge
    from serving.frontend.link import EngineLink

    size = (16 << 20) // 3
    assert size % ipc.ALIGN
    link = EngineLink("unused.sock", size, 0, on_state=lambda: None, on_lost=lambda code: None)
    with pytest.raises(TooLarge, match=r"\(serve --frontend-buffer-mb\); split the request"):
        link._slot(size - 1)
    assert link.arena.used_bytes == 0
    offset = link._slot(size - size % ipc.ALIGN)  # the largest slot there is still fits
    link._free(offset)


def test_a_request_needing_exactly_the_whole_buffer_runs_and_one_byte_more_is_resource_exhausted():
    """The "fits at all" check's boundary: a slot of the whole buffer is taken (on an idle server it
    always fits); one byte more can never fit and is RESOURCE_EXHAUSTED, not a retry for ever."""
    from serving.errors import TooLarge
    from serving.frontend.link import EngineLink

    size = 1 << 20
    link = EngineLink("unused.sock", size, 0, on_state=lambda: None, on_lost=lambda code: None)
    try:
        offset = link._slot(size)
        assert (offset, link.arena.used_bytes) == (0, size)
        link._free(offset)
        with pytest.raises(TooLarge, match=r"needs 1\.0 MiB of a front end's buffer, more than all of its 1\.0 MiB"):
            link._slot(size + 1)
        assert link.arena.used_bytes == 0
    finally:
        link.arena.close()
        link.channel.close()


def test_a_request_over_an_engines_share_of_the_buffer_names_the_split(tmp_path):
    """`--replicas 2 --frontend-buffer-mb 16`: a front end's buffer is split between the engines, so a
    9 MiB request can never run. It was refused with "more than all of its 8.0 MiB (serve
    --frontend-buffer-mb)": the operator, who set 16, could not tell why nor what to raise."""
    import asyncio

    from serving.config import ServerConfig
    from serving.errors import TooLarge
    from serving.frontend.main import FrontEnd

    async def refusal():
        config = ServerConfig(repo=tmp_path, frontend_buffer_bytes=16 << 20)
        frontend = FrontEnd(config, [str(tmp_path / "engine-0.sock"), str(tmp_path / "engine-1.sock")])
        with pytest.raises(TooLarge) as exc:
            frontend.engine.check_fits(9 << 20)
        return str(exc.value)

    assert asyncio.run(refusal()) == ("the request needs 9.0 MiB of a front end's buffer, more than an engine's "
                                      "share of it, 8.0 MiB (serve --frontend-buffer-mb, split between 2 engines); "
                                      "split the request")


def test_a_bad_id_is_invalid_argument_even_while_the_buffer_is_full(server, client, good):
    """Ids that need no narrowing (int32 for int32 tables) are checked on the request's copy in the
    shared buffer. While that buffer was full, a request with an id outside its table got the
    retryable UNAVAILABLE "buffers are full" instead of INVALID_ARGUMENT: its code depended on the
    load, and a client retried a request that can never run."""
    link = server.frontend.engine

    async def fill():
        return link._slot(link.arena.size - link.arena.size % ipc.ALIGN)

    ids = np.array([4999, 5000], np.int32)  # item_id has 5000 rows
    sparse = (["item_id"], np.array([1, 1], np.int32), ids)
    lookup = pb.LookupRequest(model_name="demo", sparse=encode_sparse(sparse)).SerializeToString()
    infer = oip_request("demo", None, per_feature(sparse), outputs=["pooled"])
    lookup_call = client.channel.unary_unary("/recserve.v1.Inference/Lookup", request_serializer=None,
                                             response_deserializer=None)
    held = server.call(fill())
    try:
        for call in (lambda: lookup_call(lookup, timeout=10), lambda: oip_call(client.channel, infer)):
            code, message = rpc_error(call)
            assert (code, message) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       "sparse.values: id 5000 of feature 'item_id' is outside [0, 5000)")
    finally:
        server.loop.call_soon_threadsafe(link._free, held)


@pytest.mark.parametrize("cap, frontends", [(1000, 3), (10, 4), (7, 7), (1000, 1)])
def test_the_front_ends_shares_of_max_connections_add_up_to_it(tmp_path, cap, frontends):
    """Each front end's gRPC server caps its own connections: ceil(N / front ends) each let 1002 of
    --max-connections 1000 in over 3 front ends."""
    from serving.config import ServerConfig
    from serving.frontend.main import FrontEnd

    config = ServerConfig(repo=tmp_path, max_connections=cap, frontend_buffer_bytes=1 << 20)
    shares = []
    for index in range(frontends):
        front_end = FrontEnd(config, str(tmp_path / "engine.sock"), index, frontends)
        shares.append(front_end.max_connections)
        front_end.engine.arena.close()
        front_end.engine.channel.close()
    assert sum(shares) == cap and max(shares) - min(shares) <= 1


def test_an_oip_request_for_two_outputs_is_laid_out_once_per_model_call(client, good, monkeypatch):
    """A ModelInfer asking for ctr and pooled laid the request out four times on the front end's hot
    path (twice to check its two slots fit together, then once in each model call): twice, one per call."""
    from serving.frontend import link

    laid_out = []
    real = link.model_kjt
    monkeypatch.setattr(link, "model_kjt", lambda *request: laid_out.append(request) or real(*request))
    dense, sparse = good
    answer = oip.ModelInferResponse.FromString(oip_call(client.channel, oip_good(dense, sparse,
                                                                                  outputs=["ctr", "pooled"])))
    assert [o.name for o in answer.outputs] == ["ctr", "pooled"]
    assert len(laid_out) == 2
