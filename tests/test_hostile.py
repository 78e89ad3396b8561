"""What a hostile client or a careless operator can do, one property per test: crafted integers
that wrap or cancel out, oversized names, deadlines that pass inside the server, too many
connections, a busy port, SIGTERM while a load hangs. Each asserts the exact outcome and that a good
request is answered exactly as before."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from conftest import ROOT, run_cli
from servers import SERVING, InProcessServer, ServeProcess, health_status
from test_lifecycle import GatedRuns, SlowRuns, wait_for

from recserve import wire
from recserve.client import Client, encode_sparse, random_request
from recserve.v1 import inference_pb2 as pb

PREDICT = "/recserve.v1.Inference/Predict"


def raw_tensor(dtype: str, shape, data: bytes) -> pb.Tensor:
    return pb.Tensor(dtype=dtype, shape=list(shape), data=data)


def crafted(info, case: str) -> bytes:
    """A PredictRequest whose integers are built to fool arithmetic that can wrap."""
    f = info.dense_features
    key = info.features[0].name
    dense = wire.encode(np.zeros((4, f), np.float32))
    ids = wire.encode(np.array([1, 2, 3], np.int64))
    if case == "lengths_sum_wraps_to_the_id_count":  # (2**63-1) * 2 + 2 + 3 == 2**64 + 3
        lengths = raw_tensor("int64", [4], np.array([2**63 - 1, 2**63 - 1, 2, 3], np.int64).tobytes())
    elif case == "lengths_cancel_out":  # 5 - 4 + 1 + 1 == 3 ids
        lengths = raw_tensor("int64", [4], np.array([5, -4, 1, 1], np.int64).tobytes())
    elif case == "int32_cast_of_a_huge_length":  # 2**32 + 1 is 1 as int32
        lengths = raw_tensor("int64", [4], np.array([2**32 + 1, 0, 1, 1], np.int64).tobytes())
    elif case == "shape_product_wraps_to_zero":  # 2**32 * 2**32 == 0 in 64 bits, with no data
        return pb.PredictRequest(model_name="demo", dense=raw_tensor("float32", [2**32, 2**32], b""),
                                 sparse=pb.SparseFeatures(keys=[key], lengths=wire.encode(np.zeros(0, np.int32)),
                                                          values=wire.encode(np.zeros(0, np.int64)))).SerializeToString()
    elif case == "more_fields_than_any_request_has":  # unknown ones, each read (a 64 MiB message: 30 s of CPU)
        return pb.PredictRequest(model_name="demo", dense=dense, sparse=pb.SparseFeatures(
            keys=[key], lengths=wire.encode(np.array([1, 1, 0, 1], np.int32)), values=ids)
        ).SerializeToString() + b"\x78\x00" * 100_000
    elif case == "negative_dimension":
        return pb.PredictRequest(model_name="demo", dense=raw_tensor("float32", [-4, f], b""),
                                 sparse=pb.SparseFeatures(keys=[key])).SerializeToString()
    else:
        raise AssertionError(case)
    return pb.PredictRequest(model_name="demo", dense=dense,
                             sparse=pb.SparseFeatures(keys=[key], lengths=lengths, values=ids)).SerializeToString()


CASES = ["lengths_sum_wraps_to_the_id_count", "lengths_cancel_out", "int32_cast_of_a_huge_length",
         "shape_product_wraps_to_zero", "negative_dimension", "more_fields_than_any_request_has"]


def check_crafted_inputs(server: InProcessServer, model: str = "demo") -> None:
    with Client(server.target, timeout=30) as client:
        info = client.model_info(model).models[0]
        dense, sparse = random_request(info, 8, seed=5)
        before = client.predict(model, dense, sparse)
        predict = client.channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
        good = pb.PredictRequest(model_name=model, dense=wire.encode(dense), sparse=encode_sparse(sparse))
        for case in CASES:
            body = crafted(info, case)
            with pytest.raises(grpc.RpcError) as exc:  # alone
                predict(body, timeout=30)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, exc.value.details())
            with ThreadPoolExecutor(8) as pool:  # among good requests, which get their exact answer
                goods = [pool.submit(client.stub.Predict, good, timeout=30) for _ in range(4)]
                bads = [pool.submit(predict, body, timeout=30) for _ in range(4)]
                for g in goods:  # merged batches may round the last bit differently (another batch size)
                    np.testing.assert_allclose(wire.decode(g.result().ctr, "ctr", ("float32",)), before, atol=1e-6,
                                               rtol=0)
                for b in bads:
                    assert b.exception().code() == grpc.StatusCode.INVALID_ARGUMENT
        assert health_status(server.target) == SERVING
        np.testing.assert_array_equal(client.predict(model, dense, sparse), before)


def test_crafted_integers_are_invalid_argument_and_never_hurt_batch_mates(repo):
    server = InProcessServer(repo, max_batch_size=64, max_delay_ms=5)
    try:
        check_crafted_inputs(server)
        assert server.metric("recserve_requests_total", rpc="Predict", model="demo", code="INTERNAL") == 0
    finally:
        assert server.stop() == 0


@pytest.mark.gpu
def test_crafted_integers_on_cuda(checkpoint, tmp_path):
    assert run_cli("export", "--checkpoint", checkpoint, "--repo", tmp_path, "--name", "demo", "--device", "cuda",
                   "--no-progress") == 0
    server = InProcessServer(tmp_path, max_batch_size=64, max_delay_ms=5)
    try:
        check_crafted_inputs(server)
    finally:
        assert server.stop() == 0


def test_oversized_names_get_their_code_with_a_bounded_message(repo):
    server = InProcessServer(repo)
    try:
        with Client(server.target) as client:
            dense, sparse = random_request(client.model_info("demo").models[0], 2, seed=1)
            before = client.predict("demo", dense, sparse)
            with pytest.raises(grpc.RpcError) as exc:
                client.predict("m" * 16384, dense, sparse)
            assert exc.value.code() == grpc.StatusCode.NOT_FOUND and len(exc.value.details()) < 1100
            keys, lengths, values = sparse
            with pytest.raises(grpc.RpcError) as exc:
                client.predict("demo", dense, (["k" * 16384] + list(keys[1:]), lengths, values))
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(exc.value.details()) < 1100
            np.testing.assert_array_equal(client.predict("demo", dense, sparse), before)
    finally:
        server.stop()


def test_a_deadline_that_passes_in_the_server_is_counted(repo):
    server = InProcessServer(repo, max_batch_size=8)
    try:
        SlowRuns(server.model_version().routers["Predict"].batchers[0], 0.6)
        with Client(server.target, timeout=0.2) as client:
            dense, sparse = random_request(client.model_info("demo").models[0], 2, seed=1)
            with pytest.raises(grpc.RpcError) as exc:
                client.predict("demo", dense, sparse)
            assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_for(lambda: server.metric("recserve_requests_total", rpc="Predict", model="demo",
                                              code="DEADLINE_EXCEEDED") == 1, timeout=10)
    finally:
        server.stop()


def test_connections_beyond_the_cap_are_refused_and_the_others_keep_working(repo):
    server = InProcessServer(repo, settings={"max_connections": 2})
    clients = [Client(server.target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(3)]
    try:
        dense, sparse = random_request(clients[0].model_info("demo").models[0], 2, seed=1)
        before = clients[0].predict("demo", dense, sparse)
        np.testing.assert_array_equal(clients[1].predict("demo", dense, sparse), before)
        with pytest.raises(grpc.RpcError) as exc:
            clients[2].predict("demo", dense, sparse)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        np.testing.assert_array_equal(clients[0].predict("demo", dense, sparse), before)
    finally:
        for c in clients:
            c.close()
        server.stop()


def test_a_busy_port_is_one_line_and_exit_2(repo):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "recserve", "serve", "--repo", str(repo), "--port", str(port),
                               "--device", "cpu", "--metrics-port", "0", "--frontends", "1"],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "cannot listen on" in errors[0] and "Traceback" not in proc.stderr


def test_sigterm_while_a_load_hangs_exits_0_within_the_grace_period(repo):
    hanging = repo / "other" / "1"
    hanging.mkdir(parents=True)
    os.mkfifo(hanging / "manifest.json")  # reading it blocks until someone writes: a hung disk
    proc = ServeProcess(repo, "--grace-period", "2", "--frontends", "2", "--load-timeout", "5", wait_ready=False)
    try:
        # demo serves once the hanging load is given up (start-up ends when every model has loaded or failed)
        assert wait_for(lambda: health_status(proc.target) == SERVING, timeout=60)
        proc.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: "shutting down" in proc.output(), timeout=10)
        proc.proc.send_signal(signal.SIGTERM)  # a second one changes nothing
        # The hung read holds nothing up: every process stops by itself (none is killed at the end
        # of the grace period), with no wall-clock assert that a busy machine could fail.
        assert proc.proc.wait(10) == 0
        assert "did not stop within the grace period" not in proc.output()
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
        fd = os.open(hanging / "manifest.json", os.O_RDWR | os.O_NONBLOCK)  # release anything still reading
        os.close(fd)


def test_a_burst_of_calls_on_one_channel_gets_only_ok_or_unavailable(repo):
    """1500 calls on one channel while the model call is held: one runs, 64 queue, every other one
    is refused UNAVAILABLE (retry), none CANCELLED by the transport; then the held ones are answered."""
    server = InProcessServer(repo, max_batch_size=64, max_queue=64)
    try:
        with Client(server.target, timeout=60) as client:
            dense, sparse = random_request(client.model_info("demo").models[0], 4, seed=1)
            before = client.predict("demo", dense, sparse)
            router = server.model_version("demo").routers["Predict"]
            gate = GatedRuns(router.batchers[0])
            request = pb.PredictRequest(model_name="demo", dense=wire.encode(dense), sparse=encode_sparse(sparse))
            try:
                # One call first, held in the model call: the burst then cannot join its batch (on a
                # busy machine several calls could arrive before the first batch is taken).
                calls = [client.stub.Predict.future(request, timeout=60)]
                assert wait_for(lambda: gate.entered == 1, timeout=60)
                calls += [client.stub.Predict.future(request, timeout=60) for _ in range(1499)]
                assert wait_for(lambda: sum(c.done() for c in calls) >= 1500 - 65, timeout=60)
                assert sum(c.done() for c in calls) == 1500 - 65
                assert (gate.entered, router.depth) == (1, 64)
            finally:
                gate.open.set()
            codes = {}
            for call in calls:
                code = call.code()
                codes[code] = codes.get(code, 0) + 1
                if code == grpc.StatusCode.OK:
                    np.testing.assert_allclose(wire.decode(call.result().ctr, "ctr", ("float32",)), before, atol=1e-6, rtol=0)
            assert codes == {grpc.StatusCode.OK: 65, grpc.StatusCode.UNAVAILABLE: 1500 - 65}
    finally:
        server.stop()


def test_an_http_body_that_stops_arriving_is_cut_off_after_the_idle_timeout(repo):
    """Slowloris over HTTP/REST (which --max-connections does not count): headers, then part of a
    body, then silence. The connection used to stay open for good, its handler waiting; it is
    closed after --idle-timeout without a byte (counted CANCELLED), while a client that sends its
    body slowly but steadily, each piece within the timeout, is answered as before."""
    server = InProcessServer(repo, settings={"http_port": 0, "idle_timeout_s": 1.0})
    try:
        with Client(server.target) as client:
            dense, sparse = random_request(client.model_info("demo").models[0], 2, seed=1)
            before = client.predict("demo", dense, sparse)
        keys, lengths, values = sparse
        lengths = np.asarray(lengths).reshape(len(keys), -1)
        values = np.split(np.asarray(values), np.cumsum(lengths.sum(axis=1))[:-1])
        tensors = [{"name": "dense", "datatype": "FP32", "shape": list(dense.shape), "data": dense.ravel().tolist()}]
        for key, bags, ids in zip(keys, lengths, values):
            tensors += [{"name": f"{key}_lengths", "datatype": "INT32", "shape": [len(bags)], "data": bags.tolist()},
                        {"name": f"{key}_ids", "datatype": "INT64", "shape": [len(ids)], "data": ids.tolist()}]
        body = json.dumps({"inputs": tensors, "outputs": [{"name": "ctr"}]}).encode()
        head = (f"POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        port = server.frontend.http_port
        with socket.create_connection(("127.0.0.1", port)) as stalled:
            stalled.sendall(head + body[:10])
            stalled.settimeout(20)
            assert stalled.recv(4096).split(b"\r\n")[0] in (b"", b"HTTP/1.1 499 Unknown")  # closed, not held
        assert wait_for(lambda: server.metric("recserve_requests_total", rpc="ModelInfer", code="CANCELLED") == 1,
                        timeout=10)
        with socket.create_connection(("127.0.0.1", port)) as steady:
            steady.settimeout(20)
            pieces = [head + body[:len(body) // 3], body[len(body) // 3:2 * len(body) // 3], body[2 * len(body) // 3:]]
            for piece in pieces:  # 1.2 s in all: longer than the timeout, never silent for that long
                steady.sendall(piece)
                time.sleep(0.6)
            answer = b""
            while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < int(
                    answer.split(b"Content-Length: ")[1].split(b"\r\n")[0]):
                answer += steady.recv(65536)
        status, document = answer.split(b"\r\n", 1)[0], json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert status == b"HTTP/1.1 200 OK"
        np.testing.assert_array_equal(np.float32(document["outputs"][0]["data"]), before)
    finally:
        server.stop()
