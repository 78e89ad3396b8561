"""The Open Inference Protocol over HTTP/REST (serve --http-port; serving/frontend/oip/rest.py):
tritonclient.http (binary tensors both ways) and plain HTTP (JSON, and Triton's binary extension by
hand) must get exactly what recserve.v1 answers, and the same checks, with HTTP statuses."""
import json
import shutil
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest
from servers import ROOT, InProcessServer
from test_oip import (B, TRITON_PYTHON, batch, cases, check_shared_cases, inputs, manifest,  # noqa: F401
                      model_calls, out_of_range_message, output)

from recserve.client import Client

HTTP_STATUS = {"OK": "OK", "INVALID_ARGUMENT": "400", "NOT_FOUND": "404"}


@pytest.fixture(scope="module")
def served(tmp_path_factory, artifact):
    repo = tmp_path_factory.mktemp("oip-http")
    shutil.copytree(artifact, repo / "demo" / "1")
    server = InProcessServer(repo, settings={"http_port": 0}, max_batch_size=512, max_delay_ms=5, max_queue=64)
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
    keys = list(features)
    sparse = (keys, np.concatenate([features[k][0] for k in keys]), np.concatenate([features[k][1] for k in keys]))
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
        {"name": f"{manifest.features[0].name}_ids", "datatype": "INT64", "shape": [-1]},
        {"name": f"{manifest.features[0].name}_shared_ids", "datatype": "INT64", "shape": [-1]}]
    assert answers["config"]["parameters"]["max_batch_size"] == {"string_value": "512"}
    assert answers["server_metadata"]["extensions"] == ["model_configuration", "statistics", "binary_tensor_data"]
    assert (answers["live"], answers["ready"], answers["model_ready"], answers["model_ready_v9"]) == (True, True, True, False)
    assert answers["unknown_metadata"] == {"code": "404", "message": "model 'nope' is not loaded; loaded: ['demo']"}


def test_statistics_over_rest_count_the_http_model_calls(served, answers, batch, manifest):
    calls, samples = model_calls(cases(*batch, manifest).values())
    (stats,) = answers["statistics"]["model_stats"]
    assert stats["inference_stats"]["success"]["count"] == calls and stats["inference_count"] == samples
    inference = stats["inference_stats"]
    assert inference["success"]["ns"] >= inference["compute_infer"]["ns"] + inference["queue"]["ns"]
    assert inference["compute_infer"]["ns"] > 0 and inference["queue"]["ns"] > 0
    assert answers["unknown_statistics"] == {"code": "404", "message": "model 'nope' is not loaded; loaded: ['demo']"}
    status, body = post_json(served.url + "/v2/models/demo/versions/9/stats", {})
    assert status == 405
    status, _, body = http(served.url + "/v2/models/demo/versions/9/stats")
    assert (status, json.loads(body)) == (404, {"error": "model 'demo' version '9' is not loaded; loaded: ['1']"})


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
        ({"inputs": tensors, "parameters": {"timeout": -1}}, "parameters['timeout'] must be a positive integer "
                                                             "(microseconds)"),
        ({"inputs": [dict(tensors[0], shape=[-1, 1])]}, "input 'dense'.shape: dimension -1 is outside [0, 2147483647]"),
    ]:
        assert post_json(infer, document) == (400, {"error": want}), want
    status, _, body = http(infer, b"{not json", {"Content-Type": "application/json"})
    assert status == 400 and json.loads(body)["error"].startswith("the request body is not valid JSON (")
    head = json.dumps({"inputs": [dict(tensors[0], data=None, parameters={"binary_data_size": 10**6})]}).encode()
    status, _, body = http(infer, head + b"\0" * 8, {"Inference-Header-Content-Length": str(len(head))})
    assert (status, json.loads(body)) == (400, {"error": "input 'dense': binary_data_size 1000000 goes past the end of "
                                                         f"the body ({len(head) + 8} bytes)"})
    assert http(served.url + "/v2/models/nope/infer", json.dumps({"inputs": tensors}).encode())[0] == 404
    assert post_json(served.url + "/v2/models/demo/versions/%C2%B2/infer", {"inputs": tensors}) == (400, {
        "error": "model_version: '²' is not a version number (1 to 9223372036854775807, no leading zeros); "
                 "send \"\" for the newest"})
    status, headers, body = http(infer)  # GET
    assert (status, json.loads(body)["error"]) == (405, "Method Not Allowed: GET /v2/models/demo/infer")
    status, _, body = http(served.url + "/v2/nothing/here")
    assert (status, json.loads(body)) == (404, {"error": "Not Found: GET /v2/nothing/here"})


def test_requests_are_counted_by_rpc_and_code(served):
    before = served.metric("recserve_requests_total", rpc="ModelInfer", model="demo", code="INVALID_ARGUMENT")
    assert post_json(served.url + "/v2/models/demo/infer", {"inputs": []})[0] == 400
    assert served.metric("recserve_requests_total", rpc="ModelInfer", model="demo", code="INVALID_ARGUMENT") == before + 1
    ready = served.metric("recserve_requests_total", rpc="ServerReady", code="OK")
    assert http(served.url + "/v2/health/ready")[:1] == (200,)
    assert served.metric("recserve_requests_total", rpc="ServerReady", code="OK") == ready + 1


def test_metrics_port_answers_404_off_metrics(served):
    port = served.metrics_port
    assert http(f"http://127.0.0.1:{port}/metrics")[0] == 200
    status, _, body = http(f"http://127.0.0.1:{port}/v2/health/ready")
    assert (status, body) == (404, b"404 Not Found: this port serves the Prometheus metrics at /metrics only\n")
    assert http(f"http://127.0.0.1:{port}/v2/models/demo/infer", b"{}")[0] == 404
