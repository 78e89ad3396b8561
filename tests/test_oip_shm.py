"""Triton's system shared memory extension (``serve --shared-memory system``) through tritonclient
and its shared-memory utilities, as perf_analyzer ``--shared-memory system`` uses it: answers equal
to recserve.v1's for the same inputs, each error with its exact code and message, and a good
request answered exactly as before after each bad one. The registry's sharing between front ends
is tested on two ``SharedMemory`` objects of one directory (what two front-end processes hold)."""
import json
import os
import shutil
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest
from servers import ROOT, InProcessServer
from test_oip import (B, TRITON_PYTHON, batch, inputs, kjt_of, manifest,  # noqa: F401 - batch, manifest: fixtures
                      raw_infer_request)

from recserve.client import Client
from serving.errors import AlreadyExists, InvalidInput, NotFound, Unsupported
from serving.frontend.oip.shm import Placement, SharedMemory

HTTP_STATUS = {e.code.name: e.http_status for e in (AlreadyExists, InvalidInput, NotFound, Unsupported)}


@pytest.fixture(scope="module", params=["grpc", "http"])
def report(request, tmp_path_factory, artifact, batch):
    """tests/oip_client.py's shared-memory report against a server with the extension on (tritonclient
    over gRPC and over HTTP/REST), and recserve.v1's Predict and Lookup of the same inputs."""
    if not TRITON_PYTHON.exists():
        pytest.fail(f"{TRITON_PYTHON} is missing: `make test` creates it (tritonclient[grpc] in its own venv)")
    repo = tmp_path_factory.mktemp("oip-shm")
    shutil.copytree(artifact, repo / "demo" / "1")
    server = InProcessServer(repo, settings={"shared_memory": "system", "http_port": 0}, max_batch_size=512)
    try:
        dense, features = batch
        specs = inputs(dense, features, ids_type="INT32")
        http = request.param == "http"
        job = {"target": f"127.0.0.1:{server.frontend.http_port}" if http else server.target, "model": "demo",
               "http": http,
               "shared_memory": {"inputs": specs, "batch_size": B, "tag": os.getpid(),
                                 "raw": [s["name"] for s in specs[1:4]]}}
        run = subprocess.run([str(TRITON_PYTHON), str(ROOT / "tests" / "oip_client.py")], input=json.dumps(job),
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        kjt = kjt_of(features)
        with Client(server.target) as c:
            expected = c.predict("demo", dense, kjt), c.lookup("demo", kjt)[2]
        yield json.loads(run.stdout), expected, specs, http
    finally:
        server.stop()


def _same(answer, expected):
    ctr, pooled = expected
    assert answer["code"] == "OK", answer
    answer = answer["value"]
    np.testing.assert_array_equal(np.float32(answer["ctr"]), ctr)
    np.testing.assert_array_equal(np.float32(answer["pooled"]), pooled.ravel())
    assert answer["in_body"] == [False, True]  # ctr went to its region (gRPC: its raw entry is empty)


def test_inputs_read_from_and_ctr_written_to_regions_equal_recserve_v1(report):
    r, expected, specs, _ = report
    assert r["register_inputs"]["code"] == r["register_outputs"]["code"] == "OK"
    assert "system_shared_memory" in r["extensions"]
    key = f"/recserve_test_{os.getpid()}"
    sizes = 4 * sum(len(s["data"]) for s in specs)
    assert r["status"]["value"] == {"inputs": [key + "_in", 32, sizes], "outputs": [key + "_out", 0, 4 * B]}
    _same(r["infer"], expected)
    _same(r["mixed"], expected)  # three inputs raw, the rest in the region


def test_shared_memory_errors_have_exact_codes_and_messages(report):
    r, expected, specs, http = report
    key = r["status"]["value"]["inputs"][0]
    want = {
        "again": ("ALREADY_EXISTS", "shared memory region 'inputs' is registered already; unregister it first"),
        "no_such_key": ("INVALID_ARGUMENT", f"cannot open shared memory '{key[:-3]}_none': No such file or directory"),
        "past_the_end": ("INVALID_ARGUMENT", f"shared memory region 'x': offset 0 + byte_size {4 * B + 1} is past the "
                                             f"end of '{key[:-3]}_out' ({4 * B} bytes)"),
        "bad_key": ("INVALID_ARGUMENT", "shared memory key '../etc/passwd' is not a POSIX shared memory name ('/name': "
                                        "no other '/', at most 255 characters)"),
        "long_name": ("INVALID_ARGUMENT", "a shared memory region name is at most 255 bytes (UTF-8); this one has "
                                          "256"),
        "no_such_region": ("NOT_FOUND", "input 'dense': no shared memory region 'nope' is registered"),  # Triton's
        "output_too_small": ("INVALID_ARGUMENT", f"output 'ctr': its {4 * B} bytes do not fit the {4 * B - 4} bytes "
                                                 "of shared memory given for it"),
        "data_and_region": ("INVALID_ARGUMENT", "input 'dense': its data is both in the request and in shared memory "
                                                "region 'inputs'; send it one way"),
        "unknown_status": ("NOT_FOUND", "no shared memory region 'nope' is registered"),
        "truncated": ("INVALID_ARGUMENT", "input 'dense': shared memory region 'inputs' is shorter than registered"),
        "unregistered": ("NOT_FOUND", "input 'dense': no shared memory region 'inputs' is registered"),
        "cuda_register": ("UNIMPLEMENTED", "CUDA shared memory is not served; use system shared memory"),
    }
    sizes = [4 * len(s["data"]) for s in specs]  # FP32 and INT32 inputs, laid out one after another
    want["input_past_region"] = ("INVALID_ARGUMENT", f"input {specs[-1]['name']!r}: offset {sum(sizes[:-1]) + 4} + "
                                 f"byte_size {sizes[-1]} is past the end of shared memory region 'inputs' ({sum(sizes)} "
                                 "bytes)")
    for case, (code, message) in want.items():
        code = str(HTTP_STATUS[code]) if http else code
        assert (r[case]["code"], r[case]["message"]) == (code, message), case
    _same(r["after_errors"], expected)  # a good request after the bad ones: the same answer
    _same(r["restored"], expected)  # and after the client shrank and restored its object
    assert r["unregister"]["code"] == r["unregister_all"]["code"] == "OK"
    assert r["status_after"]["value"] == {}
    assert (r["cuda_unregister"]["code"], r["cuda_status"]) == ("OK", {"code": "OK", "value": []})


def _object(tmp_name, data: bytes) -> str:
    path = f"/dev/shm/{tmp_name}"
    with open(path, "wb") as f:
        f.write(data)
    return path


@pytest.fixture
def out_region(tmp_path):
    """A 64-byte shared-memory object of zeros registered as region "out" of a front end's SharedMemory:
    (that SharedMemory, the object's path). The object is removed after the test."""
    key = f"recserve_out_{os.getpid()}"
    path = _object(key, bytes(64))
    try:
        shared = SharedMemory(str(tmp_path))
        shared.register("out", "/" + key, 0, 64)
        yield shared, path
    finally:
        os.unlink(path)


def test_regions_registered_through_one_front_end_are_used_and_dropped_by_another(tmp_path):
    """Two front ends (two SharedMemory objects of one server directory): a registration made
    through either is read by the other at its next refresh (each request's, before its reads and
    before its writes), and an unregistration too; without one, nothing changes under a step."""
    key = f"recserve_unit_{os.getpid()}"
    path = _object(key, bytes(range(64)))
    try:
        first, second = SharedMemory(str(tmp_path)), SharedMemory(str(tmp_path))
        first.register("r", "/" + key, 16, 32)
        assert [(r.name, r.key, r.offset, r.byte_size) for r in second.status("")] == [("r", "/" + key, 16, 32)]
        assert bytes(second.read(Placement("r", 8, 4), "input 'x'", 1 << 20)) == bytes(range(20, 28))
        second.write(Placement("r", 4, 0), np.array([7], np.int32), "output 'y'")
        first.refresh()
        assert bytes(first.read(Placement("r", 4, 0), "input 'x'", 1 << 20)) == np.int32(7).tobytes()
        with pytest.raises(AlreadyExists):
            second.register("r", "/" + key, 0, 8)
        with pytest.raises(InvalidInput, match="more than the 4 the server takes"):
            first.read(Placement("r", 8, 0), "input 'x'", 4)
        second.unregister("r")
        first.read(Placement("r", 4, 0), "input 'x'", 1 << 20)  # the step that began before it ends as it began
        first.refresh()
        with pytest.raises(NotFound, match="input 'x': no shared memory region 'r' is registered"):
            first.read(Placement("r", 4, 0), "input 'x'", 1 << 20)
        with pytest.raises(NotFound):
            first.status("r")
        first.register("r", "/" + key, 0, 64)  # the name again: another region, read from its start
        second.refresh()
        assert bytes(second.read(Placement("r", 4, 0), "input 'x'", 1 << 20)) == bytes(range(4))
    finally:
        os.unlink(path)


def test_region_names_are_at_most_255_bytes_as_keys_are(tmp_path):
    """Every front end reads the registry whole at each change: a name is capped as a key is (256
    regions of megabyte names would make it hundreds of megabytes)."""
    key = f"recserve_name_{os.getpid()}"
    path = _object(key, bytes(64))
    try:
        shared = SharedMemory(str(tmp_path))
        for name in ("é" * 128, "n" * (4 << 20)):
            with pytest.raises(InvalidInput) as refused:
                shared.register(name, "/" + key, 0, 8)
            assert str(refused.value) == ("a shared memory region name is at most 255 bytes (UTF-8); this one has "
                                          f"{len(name.encode())}")
        shared.register("n" * 255, "/" + key, 0, 8)
        assert [(r.name, r.byte_size) for r in shared.status("")] == [("n" * 255, 8)]
    finally:
        os.unlink(path)


def test_an_idle_front_end_lets_go_of_a_region_unregistered_through_another(tmp_path):
    """A front end that registered a region keeps its object's file open; once another front end
    unregisters it, the idle one closes the file within a second or two (its periodic look at the
    registry), not at its next shared-memory call, so that the object the client unlinks is freed."""
    import time

    key = f"recserve_idle_{os.getpid()}"
    path = _object(key, bytes(64))
    server = InProcessServer(tmp_path, settings={"shared_memory": "system", "http_port": 0})
    url = f"http://127.0.0.1:{server.frontend.http_port}/v2/systemsharedmemory"

    def post(route, body=b""):
        with urllib.request.urlopen(urllib.request.Request(url + route, data=body, method="POST"), timeout=10) as r:
            return r.status, json.loads(r.read())

    def holds_object() -> bool:  # an open file of this process is the object's (unlinked: "... (deleted)")
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith(path):
                    return True
            except OSError:  # closed meanwhile
                pass
        return False

    try:
        assert post("/region/r/register", json.dumps({"key": "/" + key, "byte_size": 64}).encode()) == (200, {})
        assert holds_object()
        SharedMemory(server.workdir).unregister("r")  # through another front end
        os.unlink(path)
        deadline = time.monotonic() + 5
        while holds_object() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not holds_object()
        with urllib.request.urlopen(url + "/status", timeout=10) as r:
            assert (r.status, json.loads(r.read())) == (200, [])
        path = _object(key, bytes(64))
        assert post("/region/r/register", json.dumps({"key": "/" + key, "byte_size": 64}).encode()) == (200, {})
        assert post("/unregister") == (200, {})
    finally:
        server.stop()
        if os.path.exists(path):
            os.unlink(path)


def test_keys_that_are_not_shared_memory_objects_are_refused(tmp_path):
    target = tmp_path / "secret"
    target.write_bytes(b"x" * 64)
    link = f"recserve_link_{os.getpid()}"
    os.symlink(target, f"/dev/shm/{link}")
    try:
        shared = SharedMemory(str(tmp_path))
        with pytest.raises(InvalidInput, match="cannot open shared memory"):  # O_NOFOLLOW
            shared.register("r", "/" + link, 0, 8)
        for key in ("/a/b", "..", "/..", "", "x" * 256, "/a\x00b", "/\ud800"):  # a lone surrogate: JSON has them
            with pytest.raises(InvalidInput, match="is not a POSIX shared memory name"):
                shared.register("r", key, 0, 8)
        assert shared.status("") == []
    finally:
        os.unlink(f"/dev/shm/{link}")


def test_the_extension_off_answers_unimplemented(tmp_path, artifact):
    import grpc

    from recserve.oip import grpc_predict_v2_pb2 as oip
    from recserve.oip import grpc_predict_v2_pb2_grpc as oip_grpc

    with pytest.raises(Unsupported, match=r"start it with `recserve serve --shared-memory system`"):
        SharedMemory(None).status("")
    with pytest.raises(InvalidInput) as exc:  # an output placed anyway: the extension's error, whatever its size
        SharedMemory(None).reserve(Placement("r", 0), 4, "output 'ctr'")
    assert str(exc.value) == ("output 'ctr': system shared memory is off on this server (start it with `recserve "
                              "serve --shared-memory system`)")
    shutil.copytree(artifact, tmp_path / "demo" / "1")
    server = InProcessServer(tmp_path)
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = oip_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                stub.SystemSharedMemoryRegister(oip.SystemSharedMemoryRegisterRequest(name="r", key="/r", byte_size=8))
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "system shared memory is off on this server" in e.value.details()
            assert "system_shared_memory" not in stub.ServerMetadata(oip.ServerMetadataRequest()).extensions
    finally:
        server.stop()


def test_readme_shared_memory_example_runs_against_the_server(tmp_path, artifact):
    """README's system shared memory snippet as a user pastes it: the ctr it reads from its region is
    recserve.v1's Predict of the same request."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("**System shared memory**"):]
    start = section.index("```python") + len("```python")
    shutil.copytree(artifact, tmp_path / "demo" / "1")
    server = InProcessServer(tmp_path, settings={"shared_memory": "system"})
    try:
        snippet = section[start:section.index("```", start)].replace("127.0.0.1:50051", server.target)
        snippet = snippet.replace("/demo_", f"/demo_{os.getpid()}_")
        run = subprocess.run([str(TRITON_PYTHON), "-c", snippet + "\nimport json; print(json.dumps(ctr.tolist()))"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        with Client(server.target) as c:
            info = c.model_info("demo").models[0]
            keys = [f.name for f in info.features]
            assert keys == ["user_id", "item_id", "topics"]  # the snippet's model order
            lengths = np.array([0, 0, 2, 0, 0, 0], np.int32)
            expected = c.predict("demo", np.zeros((2, 8), np.float32), (keys, lengths, np.array([1, 5], np.int64)))
        np.testing.assert_array_equal(np.float32(json.loads(run.stdout)), expected)
    finally:
        server.stop()


def test_a_model_advertising_the_packed_form_has_no_optional_input_and_takes_every_form(tmp_path, artifact, batch):
    """config.json ``oip_inputs: packed`` (what perf_analyzer --shared-memory needs: it refuses
    optional inputs): ModelMetadata and ModelConfig list dense, lengths and ids, none optional; a
    request with a tensor per feature is still answered as recserve.v1's Predict."""
    import grpc

    from recserve.oip import grpc_predict_v2_pb2 as oip
    from recserve.oip import grpc_predict_v2_pb2_grpc as oip_grpc

    shutil.copytree(artifact, tmp_path / "demo" / "1")
    (tmp_path / "demo" / "config.json").write_text(json.dumps({"oip_inputs": "packed"}))
    server = InProcessServer(tmp_path)
    try:
        dense, features = batch
        request = oip.ModelInferRequest(model_name="demo", outputs=[oip.ModelInferRequest.InferRequestedOutputTensor(
            name="ctr")])
        arrays = [("dense", "FP32", dense)] + [(f"{f}_{part}", "INT32", np.int32(a)) for f, (lengths, ids) in
                                                features.items() for part, a in (("lengths", lengths), ("ids", ids))]
        for name, datatype, array in arrays:
            request.inputs.add(name=name, datatype=datatype, shape=array.shape)
            request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
        with grpc.insecure_channel(server.target) as channel:
            stub = oip_grpc.GRPCInferenceServiceStub(channel)
            metadata = stub.ModelMetadata(oip.ModelMetadataRequest(name="demo"))
            assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
                ("dense", "FP32", [-1, dense.shape[1]]), ("lengths", "INT32", [-1, -1]), ("ids", "INT32", [-1])]
            config = stub.ModelConfig(oip.ModelConfigRequest(name="demo")).config
            assert [(t.name, t.optional) for t in config.input] == [("dense", False), ("lengths", False), ("ids", False)]
            ctr = np.frombuffer(stub.ModelInfer(request).raw_output_contents[0], np.float32)
        kjt = kjt_of(features)
        with Client(server.target) as c:
            np.testing.assert_array_equal(ctr, c.predict("demo", dense, kjt))
    finally:
        server.stop()


def test_an_output_object_shrunk_under_the_server_is_invalid_argument_and_not_grown_back(out_region):
    """An object truncated after registration: reading an input from it was refused, but an output
    was written past its end, growing the object again (pwrite extends a file) and answering OK."""
    shared, path = out_region
    os.truncate(path, 8)
    with pytest.raises(InvalidInput) as exc:
        shared.write(Placement("out", 16, 4), np.ones(4, np.float32), "output 'ctr'")
    assert str(exc.value) == "output 'ctr': shared memory region 'out' is shorter than registered"
    assert os.path.getsize(path) == 8
    shared.write(Placement("out", 4, 4), np.ones(1, np.float32), "output 'ctr'")  # what still fits is written
    assert open(path, "rb").read() == bytes(4) + np.float32(1).tobytes()


def test_an_output_placement_that_cannot_take_the_output_is_refused_before_the_model_runs(tmp_path, artifact, batch):
    """An output region too small or past its region's end (INVALID_ARGUMENT), or not registered
    (NOT_FOUND): refused before any model call (the engine counted a model call for a request answered
    with an error, and spent it), and a good request answered as before."""
    import grpc

    from recserve.oip import grpc_predict_v2_pb2 as oip
    from recserve.oip import grpc_predict_v2_pb2_grpc as oip_grpc

    key = f"recserve_early_{os.getpid()}"
    path = _object(key, bytes(4 * B))
    shutil.copytree(artifact, tmp_path / "demo" / "1")
    server = InProcessServer(tmp_path, settings={"shared_memory": "system", "http_port": 0})
    dense, features = batch
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = oip_grpc.GRPCInferenceServiceStub(channel)
            stub.SystemSharedMemoryRegister(oip.SystemSharedMemoryRegisterRequest(name="out", key="/" + key,
                                                                                  byte_size=4 * B))

            def http_infer(region="out", byte_size=4 * B, offset=0):
                """The same request over HTTP/JSON: (status, body)."""
                inputs = [{"name": "dense", "datatype": "FP32", "shape": list(dense.shape),
                           "data": dense.ravel().tolist()}] + [
                    {"name": f"{f}_{part}", "datatype": "INT32", "shape": [len(a)], "data": np.int32(a).tolist()}
                    for f, (lengths, ids) in features.items() for part, a in (("lengths", lengths), ("ids", ids))]
                body = {"inputs": inputs, "outputs": [{"name": "ctr", "parameters": {
                    "shared_memory_region": region, "shared_memory_byte_size": byte_size,
                    "shared_memory_offset": offset}}]}
                post = urllib.request.Request(f"http://127.0.0.1:{server.frontend.http_port}/v2/models/demo/infer",
                                              json.dumps(body).encode(), {"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(post, timeout=30) as answer:
                        return answer.status, json.loads(answer.read())
                except urllib.error.HTTPError as e:
                    return e.code, json.loads(e.read())

            def request(region="out", byte_size=4 * B, offset=0):
                r = raw_infer_request(dense, features)
                ctr = r.outputs.add(name="ctr")
                ctr.parameters["shared_memory_region"].string_param = region
                ctr.parameters["shared_memory_byte_size"].int64_param = byte_size
                ctr.parameters["shared_memory_offset"].int64_param = offset
                return r

            def model_calls():
                stats = stub.ModelStatistics(oip.ModelStatisticsRequest(name="demo")).model_stats[0]
                return stats.inference_stats.success.count, stats.inference_stats.fail.count

            stub.ModelInfer(request())
            with Client(server.target) as c:
                expected = c.predict("demo", dense, kjt_of(features))
            np.testing.assert_array_equal(np.fromfile(path, np.float32), expected)
            os.truncate(path, 0)
            os.truncate(path, 4 * B)
            before = model_calls()
            invalid, unknown = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND  # Triton's codes
            bad = {"too_small": (request(byte_size=4 * B - 4), invalid, f"output 'ctr': its {4 * B} bytes do not fit "
                                                                        f"the {4 * B - 4} bytes of shared memory given for it"),
                   "past_the_end": (request(offset=4), invalid, f"output 'ctr': offset 4 + byte_size {4 * B} is past the "
                                                                f"end of shared memory region 'out' ({4 * B} bytes)"),
                   "unknown": (request(region="nope"), unknown, "output 'ctr': no shared memory region 'nope' is "
                                                                "registered")}
            for case, (r, code, message) in bad.items():
                with pytest.raises(grpc.RpcError) as e:
                    stub.ModelInfer(r)
                assert (e.value.code(), e.value.details()) == (code, message), case
            for case, place in {"too_small": {"byte_size": 4 * B - 4}, "past_the_end": {"offset": 4},
                                "unknown": {"region": "nope"}}.items():  # HTTP checked them after the model ran
                status = 404 if bad[case][1] == unknown else 400
                assert http_infer(**place) == (status, {"error": bad[case][2]}), case
            assert model_calls() == before  # refused before any model call
            assert np.fromfile(path, np.float32).tolist() == [0.0] * B
            stub.ModelInfer(request())
            np.testing.assert_array_equal(np.fromfile(path, np.float32), expected)
            os.truncate(path, 0)
            os.truncate(path, 4 * B)
            status, answer = http_infer()
            assert status == 200 and "data" not in answer["outputs"][0]
            np.testing.assert_array_equal(np.fromfile(path, np.float32), expected)
    finally:
        server.stop()
        os.unlink(path)


def _held(path: str) -> int:
    """How many open files of this process are the object at ``path`` (unlinked: "... (deleted)")."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            held += os.readlink(f"/proc/self/fd/{fd}").startswith(path)
        except OSError:  # closed meanwhile
            pass
    return held


def test_an_output_region_unregistered_while_its_request_runs_is_written_where_it_was_checked(tmp_path):
    """As Triton's server does (since 2.53, containers 24.12), unregistering applies to the requests that come after it:
    a request whose output's place was checked before it writes the output into that registration
    (that object, that range), also when the name is registered again meanwhile for another object,
    which is never written. The front end keeps the first object's file open until the last such
    request ends, then closes it (so an object its client unlinks is freed). The request used to fail
    with INVALID_ARGUMENT after its model had run, a valid request blamed for a race it lost."""
    first_key, second_key = f"recserve_pin1_{os.getpid()}", f"recserve_pin2_{os.getpid()}"
    paths = [_object(first_key, bytes(16)), _object(second_key, bytes(16))]
    try:
        one, other = SharedMemory(str(tmp_path)), SharedMemory(str(tmp_path))  # two front ends
        one.register("out", "/" + first_key, 4, 12)
        early = {"ctr": one.reserve(Placement("out", 8, 4), 8, "output 'ctr'")}  # two requests in flight
        late = {"ctr": one.reserve(Placement("out", 4, 0), 4, "output 'ctr'")}
        other.unregister("out")
        other.register("out", "/" + second_key, 0, 16)
        one.refresh()  # another request's: the registration they were checked against stays open
        assert _held(paths[0]) == 1
        one.write(early["ctr"], np.float32([1, 2]), "output 'ctr'")
        one.release(early)
        assert _held(paths[0]) == 1  # the other request still writes there
        one.write(late["ctr"], np.float32([3]), "output 'ctr'")
        one.release(late)
        assert _held(paths[0]) == 0
        assert open(paths[0], "rb").read() == bytes(4) + np.float32([3, 1, 2]).tobytes()
        assert open(paths[1], "rb").read() == bytes(16)
        after = {"ctr": one.reserve(Placement("out", 4, 0), 4, "output 'ctr'")}  # a request that came after
        one.write(after["ctr"], np.float32([5]), "output 'ctr'")
        one.release(after)
        assert open(paths[1], "rb").read() == np.float32(5).tobytes() + bytes(12)
        assert _held(paths[1]) == 2  # registered, not unregistered: each front end keeps its file
        other.unregister("out")
        with pytest.raises(NotFound) as exc:
            one.reserve(Placement("out", 4, 0), 4, "output 'ctr'")
        assert str(exc.value) == "output 'ctr': no shared memory region 'out' is registered"
        one.release({"ctr": Placement("out", 4, 0)})  # a request refused before its place was pinned: nothing
        assert _held(paths[1]) == 0  # each front end closed it at its refresh (none held it for a request)
    finally:
        for p in paths:
            os.unlink(p)


def test_an_output_region_unregistered_while_the_model_runs_gets_its_output_over_grpc_and_http(tmp_path, artifact,
                                                                                                batch):
    """The whole request: an output region is unregistered while the request waits for its batch;
    the answer is OK and the output is in the object, over gRPC and HTTP; the region is gone for the
    next request (NOT_FOUND) and the front end lets go of the object once the request is answered."""
    import threading
    import time

    import grpc

    from recserve.oip import grpc_predict_v2_pb2 as oip
    from recserve.oip import grpc_predict_v2_pb2_grpc as oip_grpc

    dense, features = batch
    key = f"recserve_inflight_{os.getpid()}"
    path = _object(key, bytes(4 * B))
    shutil.copytree(artifact, tmp_path / "demo" / "1")
    server = InProcessServer(tmp_path, settings={"shared_memory": "system", "http_port": 0}, max_delay_ms=1500,
                             max_batch_size=4 * B)
    try:
        with Client(server.target) as c:
            expected = c.predict("demo", dense, kjt_of(features))
        with grpc.insecure_channel(server.target) as channel:
            stub = oip_grpc.GRPCInferenceServiceStub(channel)

            def grpc_infer():
                r = raw_infer_request(dense, features)
                ctr = r.outputs.add(name="ctr")
                ctr.parameters["shared_memory_region"].string_param = "out"
                ctr.parameters["shared_memory_byte_size"].int64_param = 4 * B
                return stub.ModelInfer.future(r, timeout=30)

            def http_infer(answers):
                tensors = [{k: t[k] for k in ("name", "datatype", "shape", "data")} for t in inputs(dense, features)]
                body = {"inputs": tensors, "outputs": [{"name": "ctr", "parameters": {
                    "shared_memory_region": "out", "shared_memory_byte_size": 4 * B}}]}
                post = urllib.request.Request(f"http://127.0.0.1:{server.frontend.http_port}/v2/models/demo/infer",
                                              json.dumps(body).encode(), {"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(post, timeout=30) as answer:
                        answers.append((answer.status, json.loads(answer.read())))
                except urllib.error.HTTPError as e:
                    answers.append((e.code, json.loads(e.read())))

            def queued() -> float:
                return server.metric("recserve_queue_depth", rpc="Predict", model="demo")

            for transport in ("grpc", "http"):
                deadline = time.monotonic() + 20
                while queued():  # the gauge of the request before has come down
                    assert time.monotonic() < deadline, "the queue never emptied"
                    time.sleep(0.01)
                os.truncate(path, 0)
                os.truncate(path, 4 * B)
                stub.SystemSharedMemoryRegister(oip.SystemSharedMemoryRegisterRequest(name="out", key="/" + key,
                                                                                      byte_size=4 * B))
                answers = []
                if transport == "grpc":
                    pending = grpc_infer()
                else:
                    pending = threading.Thread(target=http_infer, args=(answers,))
                    pending.start()
                deadline = time.monotonic() + 20
                while queued() < 1:
                    assert time.monotonic() < deadline, "the request never reached the queue"
                    time.sleep(0.01)
                stub.SystemSharedMemoryUnregister(oip.SystemSharedMemoryUnregisterRequest(name="out"))
                assert list(stub.SystemSharedMemoryStatus(oip.SystemSharedMemoryStatusRequest()).regions) == []
                if transport == "grpc":
                    answer = pending.result()
                    assert answer.raw_output_contents[0] == b""  # in the region
                else:
                    pending.join(30)
                    ((status, answer),) = answers
                    assert status == 200 and "data" not in answer["outputs"][0], answer
                np.testing.assert_array_equal(np.fromfile(path, np.float32), expected)
                assert _held(path) == 0, transport
                with pytest.raises(grpc.RpcError) as e:
                    grpc_infer().result()
                assert (e.value.code(), e.value.details()) == (
                    grpc.StatusCode.NOT_FOUND, "output 'ctr': no shared memory region 'out' is registered")
    finally:
        server.stop()
        os.unlink(path)


def test_an_output_object_truncated_while_it_is_written_is_invalid_argument_grown_back_at_most_to_the_range(
        out_region, monkeypatch):
    """A truncation that lands between the size check (fstat) and the write cannot be refused: pwrite
    extends a file, and no flag of it does otherwise (a mapping would SIGBUS instead). The object is
    then grown back to the end of the output's range, never further, and the answer is the error of
    an object found short, not OK (it was OK, the module's contract saying it could not happen)."""
    import serving.frontend.oip.shm as shm

    shared, path = out_region
    real = os.pwrite
    for size in (8, 20):  # before the range; inside it
        def truncated_first(fd, data, offset, size=size):
            os.truncate(path, size)  # the client, between the check and the write
            return real(fd, data, offset)

        monkeypatch.setattr(shm.os, "pwrite", truncated_first)
        with pytest.raises(InvalidInput) as exc:
            shared.write(Placement("out", 16, 16), np.ones(4, np.float32), "output 'ctr'")
        assert str(exc.value) == "output 'ctr': shared memory region 'out' is shorter than registered"
        assert os.path.getsize(path) == 32  # the range's end, not the registered 64
        os.truncate(path, 64)
    monkeypatch.setattr(shm.os, "pwrite", real)
    shared.write(Placement("out", 16, 16), np.ones(4, np.float32), "output 'ctr'")  # a shrink elsewhere: none
    assert open(path, "rb").read(32) == bytes(16) + np.ones(4, np.float32).tobytes()


def test_a_write_that_finds_no_space_is_resource_exhausted_and_a_short_write_is_carried_on(out_region, monkeypatch,
                                                                                           caplog):
    """A client's object in a full /dev/shm (its pages are allocated as the server first writes them:
    tritonclient creates regions with ftruncate, never touching an output's): the write fails, or
    writes part of the output and returns its count. That count was taken as the whole output (OK
    with part of it written), and ENOSPC or EIO became INTERNAL "internal error", the region unnamed.
    Now a short write is carried on; no space is RESOURCE_EXHAUSTED (HTTP 507) and other kernel errors
    INTERNAL, logged, each naming the region; so are reads."""
    import errno
    import logging

    import serving.frontend.oip.shm as shm
    from serving.errors import NoSpace, SharedMemoryFailed

    shared, path = out_region
    real = os.pwrite
    calls = []

    def three_bytes_at_a_time(fd, data, offset):
        calls.append(offset)
        return real(fd, bytes(data[:3]), offset)

    monkeypatch.setattr(shm.os, "pwrite", three_bytes_at_a_time)
    shared.write(Placement("out", 16, 8), np.float32([1, 2, 3, 4]), "output 'ctr'")
    assert open(path, "rb").read() == bytes(8) + np.float32([1, 2, 3, 4]).tobytes() + bytes(40)
    assert calls == list(range(8, 24, 3))

    def full_after_a_page(fd, data, offset):
        if offset >= 12:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, bytes(data[:4]), offset)

    monkeypatch.setattr(shm.os, "pwrite", full_after_a_page)
    with pytest.raises(NoSpace) as exc:
        shared.write(Placement("out", 16, 8), np.float32([5, 6, 7, 8]), "output 'ctr'")
    assert str(exc.value) == ("output 'ctr': cannot write shared memory region 'out': No space left on device (the "
                              "file system of /dev/shm is full: free space there, or write the region's pages once "
                              "when creating it)")
    assert (exc.value.code.name, exc.value.http_status) == ("RESOURCE_EXHAUSTED", 507)

    def failing(*args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(shm.os, "pwrite", failing)
    monkeypatch.setattr(shm.os, "preadv", failing)
    with caplog.at_level(logging.ERROR, "serving.frontend.oip.shm"):
        with pytest.raises(SharedMemoryFailed) as exc:
            shared.write(Placement("out", 16, 8), np.float32([5, 6, 7, 8]), "output 'ctr'")
        assert str(exc.value) == "output 'ctr': cannot write shared memory region 'out': Input/output error"
        with pytest.raises(SharedMemoryFailed) as exc:
            shared.read(Placement("out", 16, 8), "input 'dense'", 64)
        assert str(exc.value) == "input 'dense': cannot read shared memory region 'out': Input/output error"
    assert (exc.value.code.name, exc.value.http_status) == ("INTERNAL", 500)
    assert [r.getMessage() for r in caplog.records] == [
        "output 'ctr': cannot write shared memory region 'out': Input/output error",
        "input 'dense': cannot read shared memory region 'out': Input/output error"]


def test_a_region_registered_again_within_one_clock_tick_is_seen_by_every_front_end(tmp_path):
    """A front end takes the registry again when its file's (inode, mtime, size) changes. A file
    system that reuses a freed inode number at once (ext4), with a clock coarser than the calls (the
    mtime set here, as such a clock would give it), gave a region unregistered and registered again
    for another object, under the same name and a key as long, the stamp the front end had: it read
    and wrote the old object."""
    keys = [f"recserve_tick{n}_{os.getpid()}" for n in (1, 2)]
    paths = [_object(key, bytes([n]) * 8) for n, key in enumerate(keys)]
    registry = str(tmp_path / "shm-regions.json")
    try:
        one, other = SharedMemory(str(tmp_path)), SharedMemory(str(tmp_path))
        for _ in range(20):  # freed inode numbers are taken again at once where they are reused
            other.register("r", "/" + keys[0], 0, 8)
            os.utime(registry, ns=(1, 1))
            one.refresh()
            assert bytes(one.read(Placement("r", 8), "input 'x'", 8)) == bytes([0]) * 8
            other.unregister("r")
            other.register("r", "/" + keys[1], 0, 8)
            os.utime(registry, ns=(1, 1))
            one.refresh()
            assert bytes(one.read(Placement("r", 8), "input 'x'", 8)) == bytes([1]) * 8
            other.unregister("r")
            one.refresh()
    finally:
        for p in paths:
            os.unlink(p)
