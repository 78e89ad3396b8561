"""The Open Inference Protocol over HTTP/REST (serve --http-port; serving/frontend/oip/rest.py):
tritonclient.http (binary tensors both ways) and plain HTTP (JSON, and Triton's binary extension by
hand) must get exactly what recserve.v1 answers, and the same checks, with HTTP statuses."""
import json
import logging
import shutil
import socket
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest
from servers import ROOT, InProcessServer
from test_oip import (B, TRITON_PYTHON, batch, cases, check_packed_cases, check_shared_cases, inputs, kjt_of,  # noqa: F401
                      manifest, model_calls, out_of_range_message, output)

from recserve.client import Client

HTTP_STATUS = {"OK": "OK", "INVALID_ARGUMENT": "400", "NOT_FOUND": "404", "DEADLINE_EXCEEDED": "504"}
SMALL_BUFFER = 32 << 20  # the front end's shared buffer: these requests are small (CI shares its memory)


@pytest.fixture(scope="module")
def served(tmp_path_factory, artifact):
    repo = tmp_path_factory.mktemp("oip-http")
    shutil.copytree(artifact, repo / "demo" / "1")
    server = InProcessServer(repo, settings={"http_port": 0, "frontend_buffer_bytes": SMALL_BUFFER}, max_batch_size=512,
                             max_delay_ms=5, max_queue=64)
    server.url = f"http://127.0.0.1:{server.frontend.http_port}"
    yield server
    server.stop()


def http(url: str, body=None, headers=None, method=None):
    """(status, headers, body bytes) of one HTTP request."""
    request = urllib.request.Request(url, data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def post_json(url: str, document: dict, headers=None):
    status, head, body = http(url, json.dumps(document).encode(), {"Content-Type": "application/json", **(headers or {})})
    return status, json.loads(body)


def triton_http(served, named, **job):
    if not TRITON_PYTHON.exists():
        pytest.fail(f"{TRITON_PYTHON} is missing: `make test` creates it (tritonclient[grpc,http] in its own venv)")
    job = {"target": f"127.0.0.1:{served.frontend.http_port}", "model": "demo", "http": True,
           "cases": [request for request, _ in named.values()], **job}
    run = subprocess.run([str(TRITON_PYTHON), str(ROOT / "tests" / "oip_client.py")], input=json.dumps(job),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    report["infer"] = dict(zip(named, report["infer"]))
    return report


@pytest.fixture(scope="module")
def answers(served, batch, manifest):
    return triton_http(served, cases(*batch, manifest))


@pytest.fixture(scope="module")
def recserve_v1(served, batch):
    dense, features = batch
    sparse = kjt_of(features)
    with Client(served.target) as c:
        return c.predict("demo", dense, sparse), c.lookup("demo", sparse)[2]


def test_tritonclient_http_gets_recserve_v1_answers_and_statuses(answers, batch, manifest, recserve_v1):
    ctr, pooled = recserve_v1
    infer = answers["infer"]
    named = cases(*batch, manifest)
    assert {name: answer["code"] for name, answer in infer.items()} == {
        name: HTTP_STATUS[code] for name, (_, code) in named.items()}
    assert list(infer["feature_left_out"]["outputs"]) == ["ctr", "pooled"]
    for name in ("all_outputs", "good_after_bad"):
        assert list(infer[name]["outputs"]) == ["ctr", "pooled"], name
        np.testing.assert_array_equal(output(infer[name], "ctr"), ctr)
        np.testing.assert_array_equal(output(infer[name], "pooled"), pooled)
    for name in ("ctr_typed_contents", "version_1", "narrowed_to_ctr"):  # typed: the JSON "data" form
        assert list(infer[name]["outputs"]) == ["ctr"], name
        np.testing.assert_array_equal(output(infer[name], "ctr"), ctr)
    np.testing.assert_array_equal(output(infer["pooled_int32_ids_no_dense"], "pooled"), pooled)
    check_packed_cases(infer, ctr, pooled, manifest)
    assert infer["ctr_typed_contents"]["id"] == "r-1" and infer["version_1"]["version"] == "1"
    assert infer["unknown_model"]["message"] == "model 'nope' is not loaded; loaded: ['demo']"
    assert "'dense': datatype 'FP64' not accepted" in infer["dense_fp64"]["message"]


def test_shared_feature_over_http_equals_recserve_v1(served, answers, batch, manifest):
    check_shared_cases(served, answers, batch, manifest)


def test_errors_keep_recserve_v1_messages(served, answers, batch, manifest):
    assert answers["infer"]["id_out_of_range"]["message"] == out_of_range_message(served, batch, manifest)


def test_metadata_config_and_server_metadata(answers, manifest):
    m = answers["metadata"]
    assert (m["name"], m["versions"], m["platform"]) == ("demo", ["1"], "recserve")
    assert m["inputs"][:4] == [
        {"name": "dense", "datatype": "FP32", "shape": [-1, manifest.dense_features]},
        {"name": f"{manifest.features[0].name}_lengths", "datatype": "INT32", "shape": [-1]},
        {"name": f"{manifest.features[0].name}_ids", "datatype": "INT32", "shape": [-1]},
        {"name": f"{manifest.features[0].name}_shared_ids", "datatype": "INT32", "shape": [-1]}]
    assert answers["config"]["parameters"]["max_batch_size"] == {"string_value": "512"}
    assert answers["server_metadata"]["extensions"] == ["model_configuration", "statistics", "model_repository",
                                                           "binary_tensor_data"]
    assert (answers["live"], answers["ready"], answers["model_ready"], answers["model_ready_v9"]) == (True, True, True, False)
    assert answers["unknown_metadata"] == {"code": "404", "message": "model 'nope' is not loaded; loaded: ['demo']"}


def test_statistics_over_rest_count_the_http_model_calls(served, answers, batch, manifest):
    calls, samples = model_calls(cases(*batch, manifest).values())
    (stats,) = answers["statistics"]["model_stats"]
    assert answers["statistics_v1"]["model_stats"] == answers["all_statistics"]["model_stats"] == [stats]
    assert stats["inference_stats"]["success"]["count"] == calls and stats["inference_count"] == samples
    inference = stats["inference_stats"]
    assert inference["success"]["ns"] >= inference["compute_infer"]["ns"] + inference["queue"]["ns"]
    assert inference["compute_infer"]["ns"] > 0 and inference["queue"]["ns"] > 0
    assert answers["unknown_statistics"] == {"code": "404", "message": "model 'nope' is not loaded; loaded: ['demo']"}
    status, body = post_json(served.url + "/v2/models/demo/versions/9/stats", {})
    assert status == 405
    status, _, body = http(served.url + "/v2/models/demo/versions/9/stats")
    assert (status, json.loads(body)) == (404, {"error": "model 'demo' version 9 is not loaded; serving versions [1]"})


def test_plain_json_and_binary_requests(served, batch, recserve_v1):
    """By hand, as curl would: JSON data in and out; then Triton's binary extension both ways."""
    ctr, pooled = recserve_v1
    tensors = [{k: t[k] for k in ("name", "datatype", "shape", "data")} for t in inputs(*batch)]
    status, answer = post_json(served.url + "/v2/models/demo/infer", {"id": "a", "inputs": tensors})
    assert status == 200 and (answer["model_name"], answer["model_version"], answer["id"]) == ("demo", "1", "a")
    got = {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in answer["outputs"]}
    np.testing.assert_array_equal(got["ctr"], ctr)
    np.testing.assert_array_equal(got["pooled"], pooled)

    numpy = {"FP32": "<f4", "INT32": "<i4", "INT64": "<i8"}
    raw = [np.asarray(t["data"], numpy[t["datatype"]]).tobytes() for t in tensors]
    head = json.dumps({"inputs": [dict(t, data=None, parameters={"binary_data_size": len(r)})
                                  for t, r in zip(tensors, raw)],
                       "outputs": [{"name": "ctr", "parameters": {"binary_data": True}}]}).encode()
    head = head.replace(b'"data": null, ', b"")
    status, headers, body = http(served.url + "/v2/models/demo/versions/1/infer", head + b"".join(raw),
                                 {"Inference-Header-Content-Length": str(len(head))})
    assert status == 200 and headers["Content-Type"] == "application/octet-stream"
    length = int(headers["Inference-Header-Content-Length"])
    (tensor,) = json.loads(body[:length])["outputs"]
    assert tensor == {"name": "ctr", "datatype": "FP32", "shape": [B], "parameters": {"binary_data_size": 4 * B}}
    np.testing.assert_array_equal(np.frombuffer(body[length:], "<f4"), ctr)


def test_bad_bodies_get_exact_statuses_and_messages(served, batch, manifest):
    tensors = [{k: t[k] for k in ("name", "datatype", "shape", "data")} for t in inputs(*batch)]
    ids = tensors[2]["name"]
    infer = served.url + "/v2/models/demo/infer"
    floats = [dict(t, data=[0.5] * len(t["data"])) if t["name"] == ids else t for t in tensors]
    huge = [dict(t, data=[2**40] * len(t["data"]), datatype="INT32") if t["name"] == ids else t for t in tensors]
    for document, want in [
        ({"inputs": floats}, f"input '{ids}': data must be integers for datatype INT64"),
        ({"inputs": huge}, f"input '{ids}': a value is outside the range of INT32"),
        ({"inputs": [dict(tensors[0], shape=[B, 2])] + tensors[1:]},
         f"input 'dense': shape [{B}, 2] of FP32 needs {8 * B} bytes, data has {4 * B * manifest.dense_features}"),
        ({"inputs": "dense"}, "inputs must be a list of tensors"),
        ({"inputs": tensors, "parameters": {"timeout": -1}}, "parameters['timeout'] must be an integer "
                                                             "(microseconds; 0: none) from 0 to 2^63 - 1"),
        ({"inputs": tensors, "parameters": {"timeout": 10**400}}, "parameters['timeout'] must be an integer "
                                                                  "(microseconds; 0: none) from 0 to 2^63 - 1"),
        ({"inputs": [dict(tensors[0], shape=[-1, 1])]}, "input 'dense'.shape: dimension -1 is outside [0, 2147483647]"),
        # numpy takes [true, 1] as integers: booleans among numbers are refused as booleans alone are
        ({"inputs": [dict(t, data=[True] + t["data"][1:]) if t["name"] == ids else t for t in tensors]},
         f"input '{ids}': data must be integers for datatype INT64"),
        ({"inputs": [dict(tensors[0], data=[False] + tensors[0]["data"][1:])] + tensors[1:]},
         "input 'dense': data must be numbers for datatype FP32"),
        ({"inputs": [dict(tensors[0], parameters={"binary_data_size": 4 * len(tensors[0]["data"])})] + tensors[1:]},
         "input 'dense': its data is both in \"data\" and in the binary data (binary_data_size); send it one way"),
        ({"inputs": tensors, "outputs": [{"name": "ctr", "parameters": {"binary_data": "yes"}}]},
         "outputs[0].parameters.binary_data must be true or false"),
        ({"inputs": tensors, "parameters": {"binary_data_output": 1}}, "parameters.binary_data_output must be true or false"),
    ]:
        assert post_json(infer, document) == (400, {"error": want}), want
    status, _, body = http(infer, b"{not json", {"Content-Type": "application/json"})
    assert status == 400 and json.loads(body)["error"].startswith("the request body is not valid JSON (")
    head = json.dumps({"inputs": [dict(tensors[0], data=None, parameters={"binary_data_size": 10**6})]}).encode()
    status, _, body = http(infer, head + b"\0" * 8, {"Inference-Header-Content-Length": str(len(head))})
    assert (status, json.loads(body)) == (400, {"error": "input 'dense': binary_data_size 1000000 goes past the end of "
                                                         f"the body ({len(head) + 8} bytes)"})
    for length in ("9" * 5000, "-1"):  # int() fails past 4300 digits, or takes a sign
        status, _, body = http(infer, head, {"Inference-Header-Content-Length": length})
        assert (status, json.loads(body)) == (400, {"error": f"Inference-Header-Content-Length: {length[:32]!r} is not "
                                                             f"a length within the body of {len(head)} bytes"})
    status, _, body = http(infer, b"xx", {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 400 and json.loads(body)["error"].startswith("the request body cannot be read (")
    deep = b"[" * 100000 + b"]" * 100000  # json.loads: RecursionError
    status, _, body = http(infer, deep, {"Content-Type": "application/json"})
    assert (status, json.loads(body)) == (400, {"error": "the request body's JSON is nested too deeply"})
    for path in ("/v2/repository/index", "/v2/repository/models/demo/load", "/v2/systemsharedmemory/region/r/register"):
        status, _, body = http(served.url + path, deep, {"Content-Type": "application/json"})
        assert (status, json.loads(body)) == (400, {"error": "the request body must be a JSON object"}), path
    for parameters in (5, True, [1, "a"]):
        assert post_json(served.url + "/v2/repository/models/demo/unload", {"parameters": parameters}) == (
            400, {"error": "'parameters' must be a JSON object"})
    assert http(served.url + "/v2/models/nope/infer", json.dumps({"inputs": tensors}).encode())[0] == 404
    assert post_json(served.url + "/v2/models/demo/versions/%C2%B2/infer", {"inputs": tensors}) == (400, {
        "error": "model_version: '²' is neither a version number (1 to 9223372036854775807, no leading zeros) nor "
                 "a version label; send \"\" for the default version"})
    status, headers, body = http(infer)  # GET
    assert (status, json.loads(body)["error"]) == (405, "Method Not Allowed: GET /v2/models/demo/infer")
    status, _, body = http(served.url + "/v2/nothing/here")
    assert (status, json.loads(body)) == (404, {"error": "Not Found: GET /v2/nothing/here"})


def test_json_integers_past_64_bits_are_numbers_for_fp32_and_out_of_range_for_ints(served, batch):
    """JSON numbers have no size: 10**20 is an FP32 value as 1e20 is (gRPC and recserve.v1 take it),
    and 2**64 in an INT64 input is out of its range, not "not an integer" (numpy makes them objects)."""
    dense, features = batch
    dense = dense.copy()
    dense[0, 0] = 1e20  # exactly 10**20 in float64, whose nearest float32 both sides cast to
    with Client(served.target) as c:
        ctr = c.predict("demo", dense, kjt_of(features))
    tensors = [{k: t[k] for k in ("name", "datatype", "shape", "data")} for t in inputs(dense, features)]
    tensors[0]["data"][0] = 10**20
    status, answer = post_json(served.url + "/v2/models/demo/infer", {"inputs": tensors, "outputs": [{"name": "ctr"}]})
    assert status == 200, answer
    np.testing.assert_array_equal(np.asarray(answer["outputs"][0]["data"], np.float32), ctr)
    ids = tensors[2]["name"]
    for value in (2**64, -2**63 - 1):
        bad = [dict(t, data=[value] + t["data"][1:]) if t["name"] == ids else t for t in tensors]
        assert post_json(served.url + "/v2/models/demo/infer", {"inputs": bad}) == (
            400, {"error": f"input '{ids}': a value is outside the range of INT64"}), value


def test_access_log_gives_an_oip_request_its_model_version_and_batch_size(served, batch, caplog):
    from serving.frontend import access

    tensors = [{k: t[k] for k in ("name", "datatype", "shape", "data")} for t in inputs(*batch)]
    access.configure(1.0)
    try:
        with caplog.at_level(logging.INFO, "serving.access"):
            assert post_json(served.url + "/v2/models/demo/infer", {"inputs": tensors})[0] == 200
    finally:
        access.configure(0.0)
    lines = [r.getMessage() for r in caplog.records if r.name == "serving.access"]
    assert len(lines) == 1 and f"method=ModelInfer model=demo version=1 batch_size={B} code=OK" in lines[0], lines


def test_requests_are_counted_by_rpc_and_code(served):
    before = served.metric("recserve_requests_total", rpc="ModelInfer", model="demo", code="INVALID_ARGUMENT")
    assert post_json(served.url + "/v2/models/demo/infer", {"inputs": []})[0] == 400
    assert served.metric("recserve_requests_total", rpc="ModelInfer", model="demo", code="INVALID_ARGUMENT") == before + 1
    ready = served.metric("recserve_requests_total", rpc="ServerReady", code="OK")
    assert http(served.url + "/v2/health/ready")[:1] == (200,)
    assert served.metric("recserve_requests_total", rpc="ServerReady", code="OK") == ready + 1


def test_a_client_that_closes_its_connection_is_counted_cancelled_and_frees_its_queue_place(repo, manifest):
    """As over gRPC (README, Operating: CANCELLED is counted; a client that cancels frees its queue
    place): the request waits for a batch (3 s of delay), its client hangs up, it never runs."""
    from test_lifecycle import wait_for

    server = InProcessServer(repo, settings={"http_port": 0}, max_delay_ms=3000)
    try:
        body = json.dumps({"inputs": [{"name": "dense", "datatype": "FP32", "shape": [1, manifest.dense_features],
                                       "data": [0.25] * manifest.dense_features}],
                           "outputs": [{"name": "ctr"}]}).encode()
        with socket.create_connection(("127.0.0.1", server.frontend.http_port)) as client:
            client.sendall(b"POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert wait_for(lambda: server.metric("recserve_queue_depth", rpc="Predict", model="demo") == 1, 30)
        assert wait_for(lambda: server.engine.statistics()[("demo", 1)].fail[0] == 1, 10)
        stats = server.engine.statistics()[("demo", 1)]
        assert (stats.success[0], stats.execution_count) == (0, 0)  # never executed
        assert {code: server.metric("recserve_requests_total", rpc="ModelInfer", model="demo", code=code)
                for code in ("OK", "CANCELLED")} == {"OK": 0, "CANCELLED": 1}
        assert wait_for(lambda: server.metric("recserve_queue_depth", rpc="Predict", model="demo") == 0, 30)
        assert server.metric("recserve_frontend_buffer_used_bytes") == 0
    finally:
        server.stop()


def test_metrics_port_answers_404_off_metrics(served):
    port = served.metrics_port
    assert http(f"http://127.0.0.1:{port}/metrics")[0] == 200
    status, _, body = http(f"http://127.0.0.1:{port}/v2/health/ready")
    assert (status, body) == (404, b"404 Not Found: this port serves the Prometheus metrics at /metrics only\n")
    assert http(f"http://127.0.0.1:{port}/v2/models/demo/infer", b"{}")[0] == 404


def test_metrics_port_drops_a_client_that_sends_no_request():
    """A socket that connects to the metrics port and sends nothing (a client that vanished, a scanner)
    held one of the server's threads and a descriptor for good: 200 of them, 200 threads, never freed.
    Now the server closes it; a scrape is still answered."""
    import socket
    import time

    from prometheus_client import CollectorRegistry

    from recserve.local import free_port
    from serving.metrics import serve_metrics

    port = free_port()
    server = serve_metrics(port, "127.0.0.1", CollectorRegistry(), idle_timeout_s=0.5)
    try:
        silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(20)]
        began = time.monotonic()
        assert [s.recv(1) for s in silent] == [b""] * 20  # closed by the server, not by recv's own timeout
        assert time.monotonic() - began < 3  # (its thread ends as it closes the socket)
        assert http(f"http://127.0.0.1:{port}/metrics")[0] == 200
    finally:
        server.shutdown()
        for s in silent:
            s.close()


def test_errors_map_to_http_statuses_in_one_place():
    """serving/errors.py gives each typed error its gRPC code and HTTP status; anything else is 500
    with a generic message; every outcome is counted under the gRPC method's name."""
    import asyncio
    from types import SimpleNamespace

    from serving.errors import (AlreadyExists, ControlOff, DeadlineExpired, DeviceLost, InvalidInput, ModelNotFound,
                                NotFound, Overloaded, QueueFull, TooLarge, Unsupported)
    from serving.frontend.status import http_errors
    from serving.metrics import Metrics

    class Servicer:
        metrics = Metrics()

        @http_errors("ModelInfer")
        async def infer(self, request, call):
            raise request.error

    expected = [(QueueFull("queue full; retry with backoff"), 429, "UNAVAILABLE"),
                (Overloaded("server is loading models; retry"), 503, "UNAVAILABLE"),
                (TooLarge("split the request"), 413, "RESOURCE_EXHAUSTED"),
                (DeadlineExpired("too late"), 504, "DEADLINE_EXCEEDED"),
                (DeviceLost(), 503, "UNAVAILABLE"),
                (InvalidInput("dense: non-finite value in sample 0"), 400, "INVALID_ARGUMENT"),
                (ModelNotFound("model 'nope' is not loaded"), 404, "NOT_FOUND"),
                (ControlOff("model load is off"), 400, "FAILED_PRECONDITION"),
                # the shared-memory extension (README: 409, 404, 501)
                (AlreadyExists("registered already"), 409, "ALREADY_EXISTS"),
                (NotFound("no region 'x'"), 404, "NOT_FOUND"),
                (Unsupported("shared memory is off"), 501, "UNIMPLEMENTED"),
                (RuntimeError("a secret detail"), 500, "INTERNAL")]
    servicer = Servicer()
    for error, status, code in expected:
        response = asyncio.run(servicer.infer(SimpleNamespace(headers={}, error=error)))
        message = "internal error" if status == 500 else str(error)
        assert (response.status, json.loads(response.text)) == (status, {"error": message})
    for _, _, code in expected:
        assert Servicer.metrics.requests.labels(rpc="ModelInfer", model="-", version="-", code=code)._value.get() >= 1


def test_bearer_token_body_limit_and_readiness_before_and_after_load(tmp_path, artifact):
    """Live answers at once; ready and model ready say 503/404 until a model has loaded, then 200;
    with --auth-token-file only the probes go without a token (401 and a count otherwise)."""
    import time

    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    repo = tmp_path / "repo"
    repo.mkdir()
    server = InProcessServer(repo, settings={"http_port": 0, "auth_token_file": tokens, "max_message_bytes": 1 << 16,
                                             "frontend_buffer_bytes": SMALL_BUFFER})
    url = f"http://127.0.0.1:{server.frontend.http_port}"
    token = {"Authorization": "Bearer s3cret"}
    try:
        assert http(url + "/v2/health/live")[:1] == (200,)
        status, _, body = http(url + "/v2/health/ready")
        assert (status, json.loads(body)) == (503, {"error": "the server is not ready: loading models, or shutting down"})
        assert http(url + "/v2/models/demo/ready")[0] == 503  # loading: no model is served yet
        shutil.copytree(artifact, repo / "demo" / "1")
        deadline = time.monotonic() + 60
        while http(url + "/v2/health/ready")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert http(url + "/v2/health/ready")[:1] == (200,)
        assert json.loads(http(url + "/v2/models/demo/ready")[2]) == {"name": "demo", "ready": True}
        # Model ready needs no token: its 404 must not list the loaded models, as GetModelInfo (token) does.
        status, _, body = http(url + "/v2/models/nope/ready")
        assert (status, json.loads(body)) == (404, {"error": "model 'nope' is not loaded"})
        # Nor, without a valid token, a known model's versions or labels: an unknown version of it gets
        # the message an unknown model gets (a valid token: the versions or labels served).
        unknown = {"/v2/models/{}/versions/9/ready": "model '{}' version 9 is not loaded",
                   "/v2/models/{}/versions/canary/ready": "model '{}' version label 'canary' is not loaded"}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            for path, message in unknown.items():
                for name in ("nope", "demo"):
                    status, _, body = http(url + path.format(name), headers=headers)
                    assert (status, json.loads(body)) == (404, {"error": message.format(name)}), (path, name)
        detailed = {"/v2/models/demo/versions/9/ready": "model 'demo' version 9 is not loaded; serving versions [1]",
                    "/v2/models/demo/versions/canary/ready": "model 'demo' has no version label 'canary'; labels: []",
                    "/v2/models/nope/versions/9/ready": "model 'nope' version 9 is not loaded"}
        for path, message in detailed.items():
            status, _, body = http(url + path, headers=token)
            assert (status, json.loads(body)) == (404, {"error": message}), path
        assert json.loads(http(url + "/v2/models/demo/versions/1/ready")[2]) == {"name": "demo", "ready": True}

        status, headers, body = http(url + "/v2/models/demo")
        assert (status, json.loads(body), headers["WWW-Authenticate"]) == (
            401, {"error": "missing or invalid bearer token"}, "Bearer")
        assert http(url + "/v2/models/demo/stats", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert server.metric("recserve_requests_total", rpc="ModelMetadata", code="UNAUTHENTICATED") == 1
        assert server.metric("recserve_requests_total", rpc="ModelStatistics", code="UNAUTHENTICATED") == 1
        assert http(url + "/v2/models/demo/stats", headers={"Authorization": "Bearer \xff"})[0] == 401  # not UTF-8
        assert http(url + "/v2/models/demo", headers=token)[0] == 200
        assert post_json(url + "/v2/models/demo/infer", {"inputs": []})[0] == 401
        status, answer = post_json(url + "/v2/models/demo/infer", {"inputs": [
            {"name": "dense", "datatype": "FP32", "shape": [1, 1 << 14], "data": [0.0] * (1 << 14)}]}, token)
        assert (status, answer) == (413, {"error": "the request body is larger than the server's limit of 65536 bytes "
                                                   "(serve --max-message-mb); split the request"})
        for path in ("/v2/repository/index", "/v2/systemsharedmemory/region/r/register"):  # not only infer's body
            assert post_json(url + path, {"pad": "x" * (1 << 16)}, token) == (413, answer), path
    finally:
        server.stop()


def test_serve_http_port_with_two_frontends_one_set_of_statistics(repo):
    """`recserve serve --http-port 0 --frontends 2 --replicas 2`: both front ends take HTTP connections
    on the one port, and every one of them answers the same statistics: the engines count, and a front
    end adds up what each of them says."""
    import re
    import sys

    from servers import ServeProcess

    server = ServeProcess(repo, "--http-port", "0", "--frontends", "2", "--replicas", "2")
    try:
        (line,) = [line for line in server.lines if "listening on" in line]
        url = "http://" + re.search(r"; HTTP/REST on (\S+:\d+)$", line.strip()).group(1)
        assert http(url + "/v2/health/ready")[0] == 200
        dense = {"name": "dense", "datatype": "FP32", "shape": [2, 13], "data": [0.5] * 26}
        with Client(server.target) as c:
            info = c.model_info("demo").models[0]
        dense["shape"], dense["data"] = [2, info.dense_features], [0.5] * (2 * info.dense_features)
        for _ in range(12):  # a connection each: the kernel spreads them over the front ends
            status, answer = post_json(url + "/v2/models/demo/infer", {"inputs": [dense], "outputs": [{"name": "ctr"}]})
            assert status == 200 and answer["outputs"][0]["shape"] == [2]
        counts = set()
        for _ in range(6):
            (stats,) = json.loads(http(url + "/v2/models/demo/stats")[2])["model_stats"]
            counts.add((stats["inference_stats"]["success"]["count"], stats["inference_count"]))
        assert counts == {(12, 24)}
        assert http(f"http://127.0.0.1:{server.metrics_port}/v2/health/ready")[0] == 404
        text = server.scrape()
        assert 'recserve_requests_total{code="OK",model="demo",rpc="ModelInfer",version="1"} 12.0' in text
    finally:
        assert server.terminate() == 0

    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "recserve", "serve", "--repo", str(repo), "--port", "0",
                               "--http-port", str(port), "--device", "cpu", "--metrics-port", "0", "--frontends", "1"],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"recserve serve: error: cannot listen on 127.0.0.1:{port} (Address already in use); "
                      "choose another --http-port or --host"], proc.stderr


def test_http_port_out_of_range_is_one_line(repo, capsys):
    from conftest import cli_error

    assert cli_error(capsys, "serve", "--repo", repo, "--http-port", "70000") == (
        "recserve serve: error: --http-port must be a port number (0 to 65535), got 70000")


def test_readme_http_examples_run_against_the_server(served, batch):
    """README's tritonclient.http snippet (under the triton venv) and its curl body, as a user pastes them."""
    import re

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("**HTTP/REST**"):]
    start = section.index("```python") + len("```python")
    snippet = section[start:section.index("```", start)].replace("127.0.0.1:8080", f"127.0.0.1:{served.frontend.http_port}")
    run = subprocess.run([str(TRITON_PYTHON), "-c", snippet + "\nprint(list(ctr.shape), ctr.dtype)"],
                         capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stdout) == (0, "[2] float32\n"), run.stderr
    curl = re.search(r"or with curl: `curl -s localhost:8080(\S+) -d '(.*?)'`", section, re.S)
    status, answer = post_json(served.url + curl.group(1), json.loads(curl.group(2)))
    assert status == 200 and [o["shape"] for o in answer["outputs"]] == [[1]]


def test_server_ready_503_is_counted_unavailable_not_ok(tmp_path):
    """HTTP ready answered 503 while loading but counted it (and access-logged it) as code OK: a
    dashboard of errors by code showed no failed probe."""
    server = InProcessServer(tmp_path, settings={"http_port": 0, "frontend_buffer_bytes": SMALL_BUFFER})
    try:
        status, _, body = http(f"http://127.0.0.1:{server.frontend.http_port}/v2/health/ready")
        assert (status, json.loads(body)) == (503, {"error": "the server is not ready: loading models, or shutting down"})
        assert {code: server.metric("recserve_requests_total", rpc="ServerReady", code=code)
                for code in ("OK", "UNAVAILABLE")} == {"OK": 0, "UNAVAILABLE": 1}
    finally:
        server.stop()


def test_json_data_that_is_no_array_of_numbers_is_a_400_not_a_500(served, batch):
    """``"data": null``, an object, or a number alone where the document holds true or false
    somewhere reached numpy as a 0-d object array and answered 500 "internal error"; integers past
    INT64 among smaller ones (numpy makes them floats) were "not integers" rather than out of range.
    Each is now its 400, and the good request after each is answered exactly as before."""
    tensors = [{k: t[k] for k in ("name", "datatype", "shape", "data")} for t in inputs(*batch)]
    infer = served.url + "/v2/models/demo/infer"
    status, good = post_json(infer, {"inputs": tensors})
    assert status == 200
    ids = tensors[2]["name"]

    def with_ids(data, **changes):
        return [dict(t, data=data, **changes) if t["name"] == ids else t for t in tensors]

    no_data = f"input {ids!r}: no data (send \"data\", or binary data with parameters.binary_data_size)"
    for document, want in [
        ({"inputs": with_ids(None)}, no_data),
        ({"inputs": [dict(tensors[0], data=None)] + tensors[1:]},
         "input 'dense': no data (send \"data\", or binary data with parameters.binary_data_size)"),
        ({"inputs": with_ids({})}, f"input {ids!r}: data must be integers for datatype INT64"),
        ({"inputs": [dict(tensors[0], data={"a": 1})] + tensors[1:]}, "input 'dense': data must be numbers for datatype FP32"),
        ({"inputs": with_ids("x")}, f"input {ids!r}: data must be integers for datatype INT64"),
        ({"inputs": with_ids(7, shape=[2]), "parameters": {"binary_data_output": False}},
         f"input {ids!r}: shape [2] of INT64 needs 16 bytes, data has 8"),
        ({"inputs": with_ids([2**63] + [1] * (len(tensors[2]["data"]) - 1))},
         f"input {ids!r}: a value is outside the range of INT64"),
        ({"inputs": with_ids([2**63] + [1] * (len(tensors[2]["data"]) - 1), datatype="INT32")},
         f"input {ids!r}: a value is outside the range of INT32"),
        ({"inputs": with_ids([2**63, 0.5] + [1] * (len(tensors[2]["data"]) - 2))},
         f"input {ids!r}: data must be integers for datatype INT64"),
    ]:
        assert post_json(infer, document) == (400, {"error": want}), want
        assert post_json(infer, {"inputs": tensors}) == (200, good)


def test_classification_is_refused_not_ignored(served, batch):
    """tritonclient's ``InferRequestedOutput(name, class_count=k)`` asks for Triton's classification
    extension (the top k as BYTES "score:index"), which this server does not offer (not in its
    extensions): the request was answered with the plain FP32 scores, a tensor of another type and
    shape than the client reads. Now it is refused (400), and the request without it is answered."""
    tensors = [{k: t[k] for k in ("name", "datatype", "shape", "data")} for t in inputs(*batch)]
    infer = served.url + "/v2/models/demo/infer"
    status, good = post_json(infer, {"inputs": tensors, "outputs": [{"name": "ctr"}]})
    assert status == 200
    for classification in (2, "2", True):
        document = {"inputs": tensors, "outputs": [{"name": "ctr", "parameters": {"classification": classification}}]}
        assert post_json(infer, document) == (400, {"error": "output 'ctr': classification is not supported (the "
                                                             "server has no classification extension); request the "
                                                             "output without it and rank its scores"})
        assert post_json(infer, {"inputs": tensors, "outputs": [{"name": "ctr"}]}) == (200, good)
    document = {"inputs": tensors, "outputs": [{"name": "ctr", "parameters": {"classification": 0}}]}
    assert post_json(infer, document) == (200, good)  # 0: no classification
    assert "classification" not in json.loads(http(served.url + "/v2")[2])["extensions"]


def test_a_json_number_past_fp32_is_out_of_range_not_non_finite(served, batch):
    """1e39 in an FP32 input is a finite JSON number that FP32 cannot hold: numpy's cast made it inf
    (with a RuntimeWarning on the server's stderr) and the client was told its value was non-finite.
    It is now out of the range of FP32, as 10**400 is; Infinity and NaN stay non-finite."""
    import warnings

    tensors = [{k: t[k] for k in ("name", "datatype", "shape", "data")} for t in inputs(*batch)]
    infer = served.url + "/v2/models/demo/infer"
    status, good = post_json(infer, {"inputs": tensors})
    assert status == 200
    for value in (1e39, -1e300):
        document = {"inputs": [dict(tensors[0], data=[0.5, value] + tensors[0]["data"][2:])] + tensors[1:]}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the server runs in this process
            assert post_json(infer, document) == (400, {"error": "input 'dense': a value is outside the range of FP32"})
        assert post_json(infer, {"inputs": tensors}) == (200, good)
    body = json.dumps({"inputs": [dict(tensors[0], data=[0.5, float("inf")] + tensors[0]["data"][2:])] + tensors[1:]})
    status, _, answer = http(infer, body.encode())
    assert (status, json.loads(answer)) == (400, {"error": "dense: non-finite value in sample 0"})


def test_binary_data_size_that_is_no_integer_says_so(served, batch):
    """``"binary_data_size": "96"`` (or 96.0, true, -1) was "binary_data_size 96 goes past the end of the
    body" for a body that holds those 96 bytes: the message now says what the value must be."""
    tensors = [{k: t[k] for k in ("name", "datatype", "shape", "data")} for t in inputs(*batch)]
    infer = served.url + "/v2/models/demo/infer"
    status, good = post_json(infer, {"inputs": tensors})
    raw = np.asarray(tensors[0]["data"], "<f4").tobytes()
    for size in ("96", float(len(raw)), True, -1):
        head = json.dumps({"inputs": [{k: tensors[0][k] for k in ("name", "datatype", "shape")}
                                      | {"parameters": {"binary_data_size": size}}] + tensors[1:]}).encode()
        status, _, body = http(infer, head + raw, {"Inference-Header-Content-Length": str(len(head))})
        assert (status, json.loads(body)) == (400, {"error": "input 'dense': parameters.binary_data_size must be an "
                                                             f"integer >= 0 (got {json.dumps(size)})"}), size
        assert post_json(infer, {"inputs": tensors}) == (200, good)


def test_null_optional_fields_are_absent_ones(served, batch):
    """Clients built on the protocol's pydantic models (KServe's, MLServer's) write an optional field
    they do not set as null: ``"id": null``, ``"parameters": null``, ``"outputs": null``, an input's or
    output's ``"parameters": null`` were 400s ("must be a string", "must be a JSON object"). They are
    answered as if left out."""
    tensors = [{k: t[k] for k in ("name", "datatype", "shape", "data")} for t in inputs(*batch)]
    infer = served.url + "/v2/models/demo/infer"
    status, everything = post_json(infer, {"inputs": tensors})
    assert status == 200 and "id" not in everything
    assert post_json(infer, {"id": None, "parameters": None, "outputs": None,
                             "inputs": [dict(t, parameters=None) for t in tensors]}) == (200, everything)
    status, ctr = post_json(infer, {"inputs": tensors, "outputs": [{"name": "ctr"}]})
    assert status == 200
    assert post_json(infer, {"inputs": tensors, "outputs": [{"name": "ctr", "parameters": None}]}) == (200, ctr)


def test_http_auth_is_decided_at_start_and_never_opens_when_the_token_list_empties():
    """Auth is on iff --auth-token-file was given (tokens not None), as gRPC's interceptor is: an
    auth-on app whose token list becomes empty refuses every token with 401, as gRPC refuses, and
    never serves; the probes still answer; auth off (None) serves without a token."""
    import asyncio
    from types import SimpleNamespace

    from aiohttp.test_utils import TestClient, TestServer

    from serving.frontend.oip.rest import RestServicer
    from serving.metrics import Metrics

    engine = SimpleNamespace(ready=True, accepting=True)

    async def statuses(tokens, headers):
        app = RestServicer(engine, Metrics(), 1 << 20, tokens).app()
        async with TestClient(TestServer(app)) as client:
            answers = []
            for path in ("/v2", "/v2/health/live", "/v2"):
                async with client.get(path, headers=headers) as r:
                    answers.append((r.status, (await r.json()).get("error")))
                tokens is not None and tokens.clear()
            return answers

    token = {"Authorization": "Bearer s3cret"}
    refused = (401, "missing or invalid bearer token")
    assert asyncio.run(statuses([b"s3cret"], token)) == [(200, None), (200, None), refused]
    assert asyncio.run(statuses([b"s3cret"], {})) == [refused, (200, None), refused]
    assert asyncio.run(statuses(None, {})) == [(200, None), (200, None), (200, None)]


def raw_http(port: int, request: bytes):
    """(status, headers with lower-case names, body) of the one answer to ``request``, sent as it is."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request)
        answer = b""
        while chunk := s.recv(1 << 16):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def test_inference_header_content_length_that_is_no_json_length_is_400_with_the_error_body(served, batch):
    """0 is Triton's raw binary request (the body is the one input of a model that has one): it was
    "the request body is not valid JSON (Expecting value ...)"; it now says what 0 means and what to
    send. A length that is negative, no number, empty or past the body: 400, the same JSON body."""
    tensors = [{k: t[k] for k in ("name", "datatype", "shape", "data")} for t in inputs(*batch)]
    body = json.dumps({"inputs": tensors}).encode()
    infer = served.url + "/v2/models/demo/infer"
    status, _, answer = http(infer, body, {"Inference-Header-Content-Length": "0"})
    assert (status, json.loads(answer)) == (400, {"error": (
        "Inference-Header-Content-Length: 0 makes the whole body one input's bytes (Triton's raw binary request, for "
        "models of one input; these have several): give the length of the JSON document that comes first")})
    for length in ("-3", "abc", "", "1e3", "0x10", "+12", str(len(body) + 1)):
        status, _, answer = http(infer, body, {"Inference-Header-Content-Length": length})
        assert (status, json.loads(answer)) == (400, {"error": f"Inference-Header-Content-Length: {length[:32]!r} is "
                                                              f"not a length within the body of {len(body)} bytes"}), length
    status, _, answer = http(infer, body, {"Inference-Header-Content-Length": str(len(body))})  # all JSON: fine
    assert status == 200, answer


def test_head_is_answered_on_every_get_path_as_its_get_without_the_body(served):
    """HEAD (HTTP requires it of every GET resource; some load balancers probe with it) was 405."""
    for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/demo", "/v2/models/demo/ready",
                 "/v2/models/demo/versions/1/config", "/v2/models/stats", "/v2/models/nope"):
        got, want = http(served.url + path, method="HEAD"), http(served.url + path)
        assert (got[0], got[1]["Content-Type"], int(got[1]["Content-Length"]), got[2]) == (
            want[0], "application/json; charset=utf-8", len(want[2]), b""), path
    status, headers, body = http(served.url + "/v2/models/demo/infer", method="HEAD")
    assert (status, headers["Allow"], body) == (405, "POST", b"")
    assert http(served.url + "/v2/health/live", method="DELETE")[1]["Allow"] == "GET,HEAD"


def test_what_aiohttp_answers_itself_has_the_protocol_error_body(served):
    """aiohttp answers some requests before any handler: a request that is not HTTP, a header it
    refuses, a line too long (400), an Expect other than 100-continue (417). Those were text/plain
    ("Invalid method encountered:\\n\\n  b'GARBAGE'\\n     ^"); KServe's REST errors are JSON objects
    with "error": now each is, in one line (aiohttp's first, quoting at most 200 characters)."""
    port = served.frontend.http_port
    infer = b"POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\n"
    for request, status, error in [
            (b"GARBAGE\r\n\r\n", 400, "Bad Request: Invalid method encountered"),
            (b"GET /v2 HTTP/1.1\r\nHost: x\r\nX\x01: y\r\n\r\n", 400, "Bad Request: Invalid header token"),
            (infer + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}", 400,
             "Bad Request: Transfer-Encoding can't be present with Content-Length"),
            (b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n", 400, None),
            (infer + b"Expect: teapot\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}", 417,
             "Expectation Failed: Unknown Expect: teapot"),
            (b"POST /nope HTTP/1.1\r\nHost: x\r\nExpect: teapot\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", 417,
             "Expectation Failed: Unknown Expect: teapot"),
            (b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404, "Not Found: GET /nope"),
            (b"PUT /v2/health/live HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", 405,
             "Method Not Allowed: PUT /v2/health/live"),
            (infer + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"  # past --max-json-mb, no length
             + (b"100000\r\n" + b" " * (1 << 20) + b"\r\n") * 5 + b"0\r\n\r\n", 413,
             "the request's JSON is 5242880 bytes, more than the 4194304 this server parses (serve --max-json-mb); "
             "send the tensors as binary data (the binary tensor extension: Inference-Header-Content-Length, "
             "tritonclient's default) or over gRPC")]:
        got, headers, body = raw_http(port, request)
        assert (got, headers["content-type"]) == (status, "application/json; charset=utf-8"), request[:64]
        answer = json.loads(body)
        if error is None:  # aiohttp's message quotes the line: bounded
            assert answer["error"].startswith("Bad Request: Got more than 8190 bytes") and len(answer["error"]) <= 214
        else:
            assert answer == {"error": error}, request[:64]
    assert http(served.url + "/v2/health/live")[0] == 200  # and the front end answers as before


def test_an_exception_that_escapes_a_handler_is_a_json_500_that_tells_nothing(caplog):
    """What reaches aiohttp's own catch-all (nothing of rest.py's: every handler answers its errors)
    is answered as serving/frontend/status.py answers: 500 {"error": "internal error"}, logged."""
    import asyncio

    from aiohttp import web

    from serving.frontend.oip.rest import connections

    async def answer() -> tuple:
        async def fails(request):
            raise RuntimeError("a secret detail")

        app = web.Application()
        app.router.add_get("/x", fails)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        listener = await asyncio.get_running_loop().create_server(connections(runner.server, access_log=None),
                                                                  "127.0.0.1", 0)
        try:
            port = listener.sockets[0].getsockname()[1]
            return await asyncio.to_thread(raw_http, port, b"GET /x HTTP/1.1\r\nHost: x\r\nAccept: text/html\r\n\r\n")
        finally:
            listener.close()
            await runner.cleanup()

    with caplog.at_level(logging.ERROR):
        status, headers, body = asyncio.run(answer())
    assert (status, headers["content-type"], json.loads(body)) == (
        500, "application/json; charset=utf-8", {"error": "internal error"})
    assert any("a secret detail" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


def test_json_past_its_own_limit_is_413_and_says_to_send_binary_tensors_or_use_grpc(tmp_path, artifact, batch):
    """A JSON body is parsed in the front end's event loop, which answers nothing else meanwhile
    (python -m bench.json_body: a 64 MiB body, --max-message-mb's default, stopped it for 1.3 s on a
    2-core Xeon; in a thread as long, json.loads holding the GIL). JSON has a limit of its own,
    --max-json-mb, below the body's: past it, 413 with a message that names the way out, refused before
    the body is read where its length is known (after, for a compressed or chunked one); the same
    tensors as binary data are answered. A binary request's JSON document counts alone."""
    import gzip

    shutil.copytree(artifact, tmp_path / "demo" / "1")
    server = InProcessServer(tmp_path, settings={"http_port": 0, "frontend_buffer_bytes": SMALL_BUFFER,
                                                 "max_json_bytes": 1 << 12})
    url = f"http://127.0.0.1:{server.frontend.http_port}"
    try:
        dense, features = batch
        dense = np.repeat(dense, 8, axis=0)
        features = {f: (np.tile(lengths, 8), np.tile(ids, 8)) for f, (lengths, ids) in features.items()}
        tensors = [{k: t[k] for k in ("name", "datatype", "shape", "data")} for t in inputs(dense, features)]
        body = json.dumps({"inputs": tensors, "outputs": [{"name": "ctr"}]}).encode()
        assert len(body) > 1 << 12
        too_large = {"error": f"the request's JSON is {len(body)} bytes, more than the 4096 this server parses "
                              "(serve --max-json-mb); send the tensors as binary data (the binary tensor extension: "
                              "Inference-Header-Content-Length, tritonclient's default) or over gRPC"}
        before = server.metric("recserve_requests_total", rpc="ModelInfer", code="RESOURCE_EXHAUSTED")
        status, _, answer = http(url + "/v2/models/demo/infer", body, {"Content-Type": "application/json"})
        assert (status, json.loads(answer)) == (413, too_large)
        status, _, answer = http(url + "/v2/models/demo/infer", gzip.compress(body), {"Content-Encoding": "gzip"})
        assert (status, json.loads(answer)) == (413, too_large)
        assert server.metric("recserve_requests_total", rpc="ModelInfer", code="RESOURCE_EXHAUSTED") == before + 2

        numpy = {"FP32": "<f4", "INT32": "<i4", "INT64": "<i8"}
        raw = [np.asarray(t["data"], numpy[t["datatype"]]).tobytes() for t in tensors]
        head = json.dumps({"inputs": [{k: t[k] for k in ("name", "datatype", "shape")} |
                                      {"parameters": {"binary_data_size": len(r)}} for t, r in zip(tensors, raw)],
                           "outputs": [{"name": "ctr"}]}).encode()
        status, _, answer = http(url + "/v2/models/demo/infer", head + b"".join(raw),
                                 {"Inference-Header-Content-Length": str(len(head))})
        assert status == 200 and len(head) + sum(map(len, raw)) > 1 << 12, answer
        with Client(server.target) as c:
            expected = c.predict("demo", dense, kjt_of(features))
        np.testing.assert_array_equal(np.float32(json.loads(answer)["outputs"][0]["data"]), expected)
        padded = head + b" " * (1 << 12)  # the JSON document itself past the limit: refused before it is parsed
        status, _, answer = http(url + "/v2/models/demo/infer", padded + b"".join(raw),
                                 {"Inference-Header-Content-Length": str(len(padded))})
        assert (status, json.loads(answer)) == (413, {"error": too_large["error"].replace(str(len(body)),
                                                                                           str(len(padded)))})
        status, answer = post_json(url + "/v2/repository/index", {"pad": "x" * (1 << 12)})
        assert (status, answer) == (413, {"error": f"the request's JSON is {(1 << 12) + 11} bytes, more than "
                                                   "the 4096 this server parses (serve --max-json-mb)"})
    finally:
        server.stop()


def test_serve_max_json_mb_is_checked_and_at_most_the_body_limit(repo, capsys, monkeypatch):
    from conftest import cli_error, run_cli

    for value in ("0", "-1", "nan", "inf"):
        assert cli_error(capsys, "serve", "--repo", repo, "--max-json-mb", value) == (
            f"recserve serve: error: --max-json-mb must be > 0, got {float(value):g}")
    configs = []
    monkeypatch.setattr("serving.supervisor.serve", lambda config, log_level: configs.append(config) or 0)
    assert run_cli("serve", "--repo", repo, "--max-message-mb", "2", "--max-json-mb", "8") == 0
    assert run_cli("serve", "--repo", repo) == 0
    assert [(c.max_message_bytes, c.max_json_bytes) for c in configs] == [(2 << 20, 2 << 20), (64 << 20, 4 << 20)]


def test_a_binary_request_whose_json_header_is_past_the_json_limit_is_413_before_its_body_is_read(served):
    """Inference-Header-Content-Length gives the JSON's length before the body: past --max-json-mb the
    request was still read whole (up to --max-message-mb) before its 413; now it is refused at once, as
    a JSON body whose Content-Length says as much. The client here sends no byte of its body (it waited
    for the body, --idle-timeout: 300 s)."""
    length = (4 << 20) + 1
    with socket.create_connection(("127.0.0.1", served.frontend.http_port), timeout=30) as s:
        s.sendall(b"POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"Content-Length: %d\r\nInference-Header-Content-Length: %d\r\n\r\n" % (length + 8, length))
        answer = b""
        while chunk := s.recv(1 << 16):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert (head.split(b"\r\n")[0], json.loads(body)) == (b"HTTP/1.1 413 Request Entity Too Large", {"error": (
        f"the request's JSON is {length} bytes, more than the 4194304 this server parses (serve --max-json-mb); "
        "send the tensors as binary data (the binary tensor extension: Inference-Header-Content-Length, "
        "tritonclient's default) or over gRPC")})


def _answer_to_headers(port: int, head: bytes) -> bytes:
    """What the server answers a request's headers alone (the client waits, as on ``Expect: 100-continue``,
    before it sends a byte of its body): up to the end of the first response's headers."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := s.recv(1 << 16)):
            answer += chunk
    return answer


@pytest.mark.parametrize("rpc, path, length, binary", [
    ("ModelInfer", "/v2/models/demo/infer", (4 << 20) + 1, b""),  # JSON past --max-json-mb
    ("ModelInfer", "/v2/models/demo/infer", (64 << 20) + 1, b"Inference-Header-Content-Length: 100\r\n"),
    ("RepositoryIndex", "/v2/repository/index", (4 << 20) + 1, b""),
])
def test_expect_100_continue_past_a_limit_is_413_before_the_client_sends_its_body(served, rpc, path, length, binary):
    """curl and tritonclient's HTTP client send ``Expect: 100-continue`` with a large body and wait for the
    server's word: it said "100 Continue" whatever the length, so the client sent all of it to be refused
    after. Past --max-json-mb (a JSON body) or --max-message-mb (any body), the 413 is the first answer, and
    the connection closes after it."""
    before = served.metric("recserve_requests_total", rpc=rpc, code="RESOURCE_EXHAUSTED")
    answer = _answer_to_headers(served.frontend.http_port, b"POST %s HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                                b"Content-Length: %d\r\n%s\r\n" % (path.encode(), length, binary))
    assert answer.split(b"\r\n")[0] == b"HTTP/1.1 413 Request Entity Too Large", answer[:300]
    # The body the headers announce never comes: the connection closes after the 413 and says so, else the
    # client's next request on it would be read as that body (and go unanswered).
    assert b"\r\nconnection: close\r\n" in answer.lower(), answer[:300]
    assert served.metric("recserve_requests_total", rpc=rpc, code="RESOURCE_EXHAUSTED") == before + 1


def test_expect_100_continue_within_the_limits_is_continued_and_answered(served, batch):
    dense, features = batch
    tensors = [{k: t[k] for k in ("name", "datatype", "shape", "data")} for t in inputs(dense[:1], {
        f: (lengths[:1], ids[:lengths[0]]) for f, (lengths, ids) in features.items()})]
    body = json.dumps({"inputs": tensors}).encode()
    with socket.create_connection(("127.0.0.1", served.frontend.http_port), timeout=30) as s:
        s.sendall(b"POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\nExpect: 100-continue\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        assert s.recv(1 << 16) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        answer = b""
        while chunk := s.recv(1 << 16):
            answer += chunk
    assert answer.split(b"\r\n")[0] == b"HTTP/1.1 200 OK", answer[:300]


def test_expect_100_continue_without_a_valid_token_is_401_before_the_client_sends_its_body():
    """With --auth-token-file, a request with ``Expect: 100-continue`` and no or a wrong token got
    "100 Continue", so the client sent its whole body to be refused 401 after. The 401 (its usual body
    and WWW-Authenticate, counted once) is now the first answer, and the connection closes after it; a
    valid token, or a probe, still gets "100 Continue"."""
    import asyncio
    from types import SimpleNamespace

    from aiohttp.test_utils import TestServer

    from serving.frontend.oip.rest import RestServicer
    from serving.metrics import Metrics

    refused = []
    servicer = RestServicer(SimpleNamespace(ready=True, accepting=True), Metrics(), 1 << 20, [b"s3cret"],
                            on_unauthenticated=lambda rpc, peer: refused.append(rpc))

    async def first_answer(port, method, path, authorization):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"%s %s HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n%s\r\n"
                     % (method, path, authorization))
        head = await reader.readuntil(b"\r\n\r\n")
        body = b""
        if not head.startswith(b"HTTP/1.1 100 "):
            body = await reader.read()  # to the end: the connection closes after the 401
        writer.close()
        return head.decode().lower(), body

    async def answers():
        async with TestServer(servicer.app()) as server:
            return [await first_answer(server.port, method, path, authorization)
                    for method, path, authorization in (
                        (b"POST", b"/v2/models/demo/infer", b""),
                        (b"POST", b"/v2/models/demo/infer", b"Authorization: Bearer wrong\r\n"),
                        (b"POST", b"/v2/repository/index", b""),
                        (b"POST", b"/v2/systemsharedmemory/unregister", b""),
                        (b"GET", b"/v2/models/demo", b""),
                        (b"POST", b"/v2/models/demo/infer", b"Authorization: Bearer s3cret\r\n"),
                        (b"GET", b"/v2/health/live", b""))]

    *unauthenticated, (trusted, _), (probe, _) = asyncio.run(answers())
    for head, body in unauthenticated:
        assert head.startswith("http/1.1 401 unauthorized\r\n"), head
        assert "\r\nconnection: close\r\n" in head and "\r\nwww-authenticate: bearer\r\n" in head, head
        assert json.loads(body) == {"error": "missing or invalid bearer token"}
    assert refused == ["ModelInfer", "ModelInfer", "RepositoryIndex", "SystemSharedMemoryUnregister", "ModelMetadata"]
    assert trusted == probe == "http/1.1 100 continue\r\n\r\n"
