"""The Open Inference Protocol (KServe v2 gRPC) through tritonclient, against an in-process server:
what tritonclient gets must be what recserve.v1's own client gets for the same inputs.

tritonclient pins protobuf<7 and cannot share this environment: tests/oip_client.py runs it under
.venv-triton/bin/python (``make test`` creates that venv) and prints the server's answers as JSON."""
import base64
import json
import shutil
import subprocess

import numpy as np
import pytest
from servers import ROOT, InProcessServer

from bench import oip_input
from recserve.client import Client, random_request
from recserve.manifest import read_manifest

TRITON_PYTHON = ROOT / ".venv-triton" / "bin" / "python"
B = 7
SHARED_IDS = [3, 1, 4, 1]  # one bag of the first feature, for every sample
NUMPY = {"FP32": np.float32, "INT32": np.int32, "INT64": np.int64}


@pytest.fixture(scope="module")
def served(tmp_path_factory, artifact):
    repo = tmp_path_factory.mktemp("oip")
    shutil.copytree(artifact, repo / "demo" / "1")
    server = InProcessServer(repo, max_batch_size=512, max_delay_ms=5, max_queue=64)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def manifest(artifact):
    return read_manifest(artifact)


@pytest.fixture(scope="module")
def batch(manifest):
    """dense [B, F] and, per feature, (lengths [B], ids) of a valid request."""
    from export.verify import sample_batch

    b = sample_batch([(f.name, f.rows) for f in manifest.features], manifest.dense_features, B, seed=14)
    lengths = b.lengths.numpy().reshape(len(manifest.features), B)
    ids = np.split(b.values.numpy(), np.cumsum(lengths.sum(axis=1))[:-1])
    return b.dense.numpy(), {f.name: (lengths[k], ids[k]) for k, f in enumerate(manifest.features)}


def kjt_of(features, keys=None):
    """recserve.v1's (keys, lengths, values) of the batch's features (``keys``: these, in this order)."""
    keys = list(features) if keys is None else keys
    return keys, np.concatenate([features[k][0] for k in keys]), np.concatenate([features[k][1] for k in keys])


def raw_infer_request(dense, features, model="demo"):
    """A gRPC ModelInferRequest of the batch, each input in raw_input_contents (no outputs named)."""
    from recserve.oip import grpc_predict_v2_pb2 as oip

    r = oip.ModelInferRequest(model_name=model)
    for name, datatype, array in [("dense", "FP32", dense)] + [
            (f"{f}_{part}", "INT32", np.int32(a)) for f, (lengths, ids) in features.items()
            for part, a in (("lengths", lengths), ("ids", ids))]:
        r.inputs.add(name=name, datatype=datatype, shape=array.shape)
        r.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    return r


def tensor(name, datatype, array, typed=False):
    array = np.asarray(array)
    return {"name": name, "datatype": datatype, "shape": list(array.shape), "data": array.ravel().tolist(), "typed": typed}


def inputs(dense, features, ids_type="INT64", typed=False, skip=()):
    out = [] if dense is None else [tensor("dense", "FP32", dense, typed)]
    for name, (lengths, ids) in features.items():
        if name not in skip:
            out += [tensor(f"{name}_lengths", "INT32", lengths, typed), tensor(f"{name}_ids", ids_type, ids, typed)]
    return out


def packed(dense, features, ids_type="INT64", shared=()):
    """The per-sample features as the packed inputs: ``lengths`` [features, B] in model order and
    ``ids``, feature after feature (the features in ``shared`` left out)."""
    kept = [name for name in features if name not in shared]
    out = [] if dense is None else [tensor("dense", "FP32", dense)]
    return out + [tensor("lengths", "INT32", np.stack([features[k][0] for k in kept])),
                  tensor("ids", ids_type, np.concatenate([features[k][1] for k in kept]))]


def cases(dense, features, manifest):
    """name -> (request, expected status code). The good ones are compared with recserve.v1 below."""
    item, user = manifest.features[1], manifest.features[0]
    out_of_range = dict(features, **{item.name: (np.array([1] * B, np.int32), np.array([0] * (B - 1) + [item.rows]))})
    short = dict(features, **{item.name: (features[item.name][0][:-1], features[item.name][1])})
    uneven = dict(features, **{item.name: (features[item.name][0], features[item.name][1][:-1])})
    good = {"inputs": inputs(dense, features)}
    return {
        "all_outputs": (good, "OK"),
        "ctr_typed_contents": ({"inputs": inputs(dense, features, typed=True), "outputs": ["ctr"], "id": "r-1"}, "OK"),
        "pooled_int32_ids_no_dense": ({"inputs": inputs(None, features, "INT32"), "outputs": ["pooled"]}, "OK"),
        "feature_left_out": ({"inputs": inputs(dense, features, skip=(item.name,)), "outputs": ["ctr", "pooled"]}, "OK"),
        "narrowed_to_ctr": ({"inputs": inputs(dense, features), "outputs": ["ctr", "pooled"],
                             "parameters": {"outputs": "ctr"}}, "OK"),
        "version_1": ({"inputs": inputs(dense, features), "outputs": ["ctr"], "version": "1"}, "OK"),
        "unknown_model": (dict(good, model="nope"), "NOT_FOUND"),
        "unknown_version": (dict(good, version="9"), "NOT_FOUND"),
        "version_not_a_number": (dict(good, version="²"), "INVALID_ARGUMENT"),
        "dense_fp64": ({"inputs": [dict(tensor("dense", "FP64", dense))] + inputs(None, features)}, "INVALID_ARGUMENT"),
        "dense_wrong_width": ({"inputs": inputs(dense[:, :-1], features)}, "INVALID_ARGUMENT"),
        "lengths_wrong_batch": ({"inputs": inputs(dense, short)}, "INVALID_ARGUMENT"),
        "lengths_ids_disagree": ({"inputs": inputs(dense, uneven)}, "INVALID_ARGUMENT"),
        "id_out_of_range": ({"inputs": inputs(dense, out_of_range)}, "INVALID_ARGUMENT"),
        "unknown_input": ({"inputs": inputs(dense, features) + [tensor("age", "FP32", dense[:, 0])]}, "INVALID_ARGUMENT"),
        "unknown_output": (dict(good, outputs=["logits"]), "INVALID_ARGUMENT"),
        "narrowed_to_unknown": (dict(good, parameters={"outputs": "logits"}), "INVALID_ARGUMENT"),
        "ctr_without_dense": ({"inputs": inputs(None, features), "outputs": ["ctr"]}, "INVALID_ARGUMENT"),
        # Triton's request parameter `timeout` (tritonclient's timeout=, microseconds): the request's
        # deadline over gRPC as over HTTP (gRPC ignored it: the request ran however late)
        "timeout_passed": (dict(good, timeout=1), "DEADLINE_EXCEEDED"),
        "timeout_ample": (dict(good, timeout=60_000_000), "OK"),
        # 0 is Triton's "no timeout" (TRITONSERVER_InferenceRequestSetTimeoutMicroseconds): it was a 400
        "timeout_zero_is_none": (dict(good, timeout=0), "OK"),
        "outputs_parameter_not_a_string": (dict(good, parameters={"outputs": 5}), "INVALID_ARGUMENT"),
        "good_after_bad": (good, "OK"),
        # protos/recserve/oip/grpc_predict_v2.proto: <feature>_shared_ids, one bag for every sample
        "shared_feature": ({"inputs": inputs(dense, features, skip=(user.name,)) + [tensor(f"{user.name}_shared_ids",
                                                                                           "INT64", SHARED_IDS)]}, "OK"),
        "shared_only": ({"inputs": [tensor(f"{user.name}_shared_ids", "INT32", SHARED_IDS)], "outputs": ["pooled"]},
                        "OK"),
        "shared_and_per_sample": ({"inputs": inputs(dense, features) + [tensor(f"{user.name}_shared_ids", "INT64",
                                                                               SHARED_IDS)]}, "INVALID_ARGUMENT"),
        "shared_id_out_of_range": ({"inputs": inputs(dense, features, skip=(user.name,)) + [
            tensor(f"{user.name}_shared_ids", "INT64", [0, user.rows])]}, "INVALID_ARGUMENT"),
        # the packed form: every per-sample feature in `lengths` [features, B] and `ids`
        "packed": ({"inputs": packed(dense, features)}, "OK"),
        "packed_pooled_int32_ids_no_dense": ({"inputs": packed(None, features, "INT32"), "outputs": ["pooled"]}, "OK"),
        "packed_with_shared": ({"inputs": packed(dense, features, shared=(user.name,)) + [
            tensor(f"{user.name}_shared_ids", "INT64", SHARED_IDS)]}, "OK"),
        "packed_and_per_feature": ({"inputs": packed(dense, features) + inputs(None, features)[:2]},
                                   "INVALID_ARGUMENT"),
        "packed_one_row_short": ({"inputs": packed(dense, features, shared=(user.name,))}, "INVALID_ARGUMENT"),
        "packed_lengths_alone": ({"inputs": packed(dense, features)[:2]}, "INVALID_ARGUMENT"),
    }


@pytest.fixture(scope="module")
def perf_analyzer_request(served):
    """A request as scripts/gpu-perf-analyzer.sh gives perf_analyzer (bench/oip_input.py), and the
    same request as recserve.v1 carries it."""
    with Client(served.target) as c:
        info = c.model_info("demo").models[0]
    dense, (keys, lengths, values) = random_request(info, B, 3.0, seed=5)
    datatype = oip_input.ids_datatype(served.target, "demo")
    decoded = []
    for packed in (False, True):  # a tensor per feature; `--packed`: lengths [features, B] and ids
        step = oip_input.step(dense, keys, lengths, values, datatype, packed)
        datatypes = {name: "FP32" if name == "dense" else "INT32" for name in step}  # ModelMetadata's: ids INT32 here
        decoded.append([tensor(name, datatypes[name], np.frombuffer(base64.b64decode(t["b64"]), NUMPY[datatypes[name]])
                               .reshape(t["shape"])) for name, t in step.items()])
    return decoded, (dense, (keys, lengths, values))


def add_perf_analyzer_cases(named, perf_analyzer_request):
    """The perf_analyzer inputs (both forms) as infer cases, asking for ctr as the script does."""
    for name, tensors in zip(("perf_analyzer_input", "perf_analyzer_packed_input"), perf_analyzer_request[0]):
        named[name] = ({"inputs": tensors, "outputs": ["ctr", "pooled"], "parameters": {"outputs": "ctr"}}, "OK")


@pytest.fixture(scope="module")
def answers(served, batch, manifest, perf_analyzer_request):
    """What tritonclient got: the report of tests/oip_client.py, each infer case by name."""
    if not TRITON_PYTHON.exists():
        pytest.fail(f"{TRITON_PYTHON} is missing: `make test` creates it (tritonclient[grpc] in its own venv)")
    named = cases(*batch, manifest)
    add_perf_analyzer_cases(named, perf_analyzer_request)
    job = {"target": served.target, "model": "demo", "cases": [request for request, _ in named.values()]}
    run = subprocess.run([str(TRITON_PYTHON), str(ROOT / "tests" / "oip_client.py")], input=json.dumps(job),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    report["infer"] = dict(zip(named, report["infer"]))
    report["expected"] = {name: code for name, (_, code) in named.items()}
    return report


@pytest.fixture(scope="module")
def recserve_v1(served, batch):
    """recserve.v1's answers (Predict ctr, Lookup pooled of every feature) for the same inputs."""
    dense, features = batch
    sparse = kjt_of(features)
    with Client(served.target) as c:
        return c.predict("demo", dense, sparse), c.lookup("demo", sparse)[2]


def output(answer, name):
    o = answer["outputs"][name]
    return np.asarray(o["data"], dtype=np.float32).reshape(o["shape"])


def test_live_ready_and_server_metadata(answers):
    assert (answers["live"], answers["ready"]) == (True, True)
    assert (answers["model_ready"], answers["model_ready_v1"]) == (True, True)
    assert (answers["model_ready_v9"], answers["unknown_model_ready"]) == (False, False)
    assert answers["server_metadata"]["name"] == "recserve"
    assert answers["server_metadata"]["extensions"] == ["model_configuration", "statistics", "model_repository"]


def test_model_metadata_is_the_tensor_contract(answers, manifest):
    m = answers["metadata"]
    assert (m["name"], m["versions"], m["platform"]) == ("demo", ["1"], "recserve")
    want = [("dense", "FP32", ["-1", str(manifest.dense_features)])]
    for f in manifest.features:
        want += [(f"{f.name}_lengths", "INT32", ["-1"]), (f"{f.name}_ids", "INT32", ["-1"]),  # tables < 2**31 rows
                 (f"{f.name}_shared_ids", "INT32", ["-1"])]
    want += [("lengths", "INT32", ["-1", "-1"]), ("ids", "INT32", ["-1"])]  # the packed form
    assert [(t["name"], t["datatype"], t["shape"]) for t in m["inputs"]] == want
    assert [(t["name"], t["datatype"], t["shape"]) for t in m["outputs"]] == [
        ("ctr", "FP32", ["-1"]), ("pooled", "FP32", ["-1", str(sum(f.dim for f in manifest.features))])]


def test_model_config_is_what_perf_analyzer_reads(answers, manifest):
    c = answers["config"]["config"]
    assert "max_batch_size" not in c  # 0 (proto3 leaves it out): inputs carry their whole shape
    assert c["parameters"]["max_batch_size"]["string_value"] == "512"
    assert [(i["name"], i["data_type"], i["dims"], i.get("optional", False)) for i in c["input"]][:3] == [
        ("dense", "TYPE_FP32", ["-1", str(manifest.dense_features)], False),
        (f"{manifest.features[0].name}_lengths", "TYPE_INT32", ["-1"], True),
        (f"{manifest.features[0].name}_ids", "TYPE_INT32", ["-1"], True)]
    assert [o["name"] for o in c["output"]] == ["ctr", "pooled"]


def test_infer_answers_exactly_as_predict_and_lookup(answers, recserve_v1, manifest):
    ctr, pooled = recserve_v1
    infer = answers["infer"]
    for name in ("all_outputs", "good_after_bad"):
        assert list(infer[name]["outputs"]) == ["ctr", "pooled"], name
        np.testing.assert_array_equal(output(infer[name], "ctr"), ctr)
        np.testing.assert_array_equal(output(infer[name], "pooled"), pooled)
    for name in ("ctr_typed_contents", "version_1", "narrowed_to_ctr"):
        assert list(infer[name]["outputs"]) == ["ctr"], name
        np.testing.assert_array_equal(output(infer[name], "ctr"), ctr)
    assert list(infer["pooled_int32_ids_no_dense"]["outputs"]) == ["pooled"]
    np.testing.assert_array_equal(output(infer["pooled_int32_ids_no_dense"], "pooled"), pooled)
    check_packed_cases(infer, ctr, pooled, manifest)
    assert infer["ctr_typed_contents"]["id"] == "r-1"
    assert {infer[n]["version"] for n in ("all_outputs", "version_1")} == {"1"}


def check_packed_cases(infer, ctr, pooled, manifest):
    """The packed form's answers (both transports) against recserve.v1's, and its errors."""
    assert list(infer["packed"]["outputs"]) == ["ctr", "pooled"]
    np.testing.assert_array_equal(output(infer["packed"], "ctr"), ctr)
    np.testing.assert_array_equal(output(infer["packed"], "pooled"), pooled)
    np.testing.assert_array_equal(output(infer["packed_pooled_int32_ids_no_dense"], "pooled"), pooled)
    for name in ("ctr", "pooled"):  # shared bags: as the per-feature form sends them
        np.testing.assert_array_equal(output(infer["packed_with_shared"], name), output(infer["shared_feature"], name))
    t, first = len(manifest.features), manifest.features[0].name
    assert [infer[name]["message"] for name in ("packed_and_per_feature", "packed_one_row_short",
                                                 "packed_lengths_alone")] == [
        "inputs 'lengths' and 'ids' carry every per-sample feature; send them or the per-feature inputs "
        f"(got '{first}_lengths'), not both",
        f"input 'lengths': {t - 1} rows, but the request has {t} per-sample features (one row each, in model order)",
        "inputs 'lengths' and 'ids' go together; send both"]


def test_perf_analyzer_input_file_is_answered_as_predict(served, answers, perf_analyzer_request):
    dense, sparse = perf_analyzer_request[1]
    with Client(served.target) as c:
        ctr = c.predict("demo", dense, sparse)
    for name in ("perf_analyzer_input", "perf_analyzer_packed_input"):
        answer = answers["infer"][name]
        assert list(answer["outputs"]) == ["ctr"], name
        np.testing.assert_array_equal(output(answer, "ctr"), ctr)


def test_a_feature_left_out_has_empty_bags(served, answers, batch, manifest):
    dense, features = batch
    left_out = manifest.features[1]
    keys = [f.name for f in manifest.features]
    lengths = np.concatenate([features[k][0] * (k != left_out.name) for k in keys]).astype(np.int32)
    values = np.concatenate([features[k][1] for k in keys if k != left_out.name])
    with Client(served.target) as c:
        ctr = c.predict("demo", dense, (keys, lengths, values))
        pooled = c.lookup("demo", (keys, lengths, values))[2]
    answer = answers["infer"]["feature_left_out"]
    np.testing.assert_array_equal(output(answer, "ctr"), ctr)
    np.testing.assert_array_equal(output(answer, "pooled"), pooled)


def test_bad_inputs_get_the_documented_codes(answers):
    got = {name: answer["code"] for name, answer in answers["infer"].items()}
    assert got == answers["expected"]
    infer = answers["infer"]
    assert "'dense': datatype 'FP64' not accepted" in infer["dense_fp64"]["message"]
    assert infer["unknown_model"]["message"] == "model 'nope' is not loaded; loaded: ['demo']"
    assert answers["unknown_metadata"]["code"] == "NOT_FOUND"


def out_of_range_message(served, batch, manifest) -> str:
    """recserve.v1's INVALID_ARGUMENT message for the request of the case ``id_out_of_range``."""
    import grpc

    dense, features = batch
    item = manifest.features[1]
    keys = [f.name for f in manifest.features]
    lengths = np.concatenate([np.ones(B, np.int32) if k == item.name else features[k][0] for k in keys])
    values = np.concatenate([np.array([0] * (B - 1) + [item.rows]) if k == item.name else features[k][1] for k in keys])
    with Client(served.target) as c, pytest.raises(grpc.RpcError) as e:
        c.predict("demo", dense, (keys, lengths, values))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return e.value.details()


def test_errors_keep_recserve_v1_messages(served, answers, batch, manifest):
    """The same out-of-range id through recserve.v1 gets the same message."""
    assert answers["infer"]["id_out_of_range"]["message"] == out_of_range_message(served, batch, manifest)


def test_requests_are_counted_by_rpc_and_code(served, answers):
    ok = sum(code == "OK" for code in answers["expected"].values())
    assert served.metric("recserve_requests_total", rpc="ModelInfer", model="demo", code="OK") == ok
    assert served.metric("recserve_requests_total", rpc="ModelInfer", model="-", code="NOT_FOUND") == 2  # unknown model, unknown version


def test_shared_feature_answers_exactly_as_shared_predict_and_lookup(served, answers, batch, manifest):
    """`<feature>_shared_ids` is recserve.v1's shared_keys/shared_lengths/shared_values: one bag for
    every sample; ``pooled`` stays in model order (recserve.v1's Lookup puts shared columns last)."""
    check_shared_cases(served, answers, batch, manifest)


def check_shared_cases(served, answers, batch, manifest):
    """The shared-feature cases' answers against recserve.v1's shared Predict and Lookup (both transports)."""
    dense, features = batch
    user = manifest.features[0].name
    keys = [k for k in features if k != user]
    sparse = kjt_of(features, keys)
    with Client(served.target) as c:
        ctr = c.predict("demo", dense, sparse, shared={user: SHARED_IDS})
        got_keys, _, pooled = c.lookup("demo", sparse, shared={user: SHARED_IDS})
        only_keys, _, only_pooled = c.lookup("demo", ([], np.zeros(0, np.int32), np.zeros(0)), shared={user: SHARED_IDS})
    assert got_keys == keys + [user] and only_keys == [user]
    dims = {f.name: f.dim for f in manifest.features}
    model_order = np.concatenate([pooled[:, sum(dims[k] for k in keys):], pooled[:, :sum(dims[k] for k in keys)]], axis=1)
    answer = answers["infer"]["shared_feature"]
    np.testing.assert_array_equal(output(answer, "ctr"), ctr)
    np.testing.assert_array_equal(output(answer, "pooled"), model_order)
    shared_only = output(answers["infer"]["shared_only"], "pooled")
    assert shared_only.shape == (1, sum(dims.values()))
    np.testing.assert_array_equal(shared_only[:, :dims[user]], only_pooled)
    assert answers["infer"]["shared_and_per_sample"]["message"] == (
        f"feature '{user}' is sent both per sample ('{user}_ids') and shared ('{user}_shared_ids'); send one of them")
    assert answers["infer"]["shared_id_out_of_range"]["message"] == (
        f"sparse.shared_values: id {manifest.features[0].rows} of feature '{user}' is outside [0, {manifest.features[0].rows})")


def model_calls(named_cases):
    """(model calls, samples) of the cases answered OK: each output requested is one model call."""
    from serving.frontend.oip.protocol import outputs_to_run

    calls = samples = 0
    for request, code in named_cases:
        if code == "OK":
            run = outputs_to_run(request.get("outputs") or [], (request.get("parameters") or {}).get("outputs"))
            b = next((t["shape"][t["name"] == "lengths"] for t in request["inputs"]
                      if t["name"] in ("dense", "lengths") or t["name"].endswith("_lengths")), 1)
            calls, samples = calls + len(run), samples + len(run) * b
    return calls, samples


def test_statistics_count_every_model_call(answers, batch, manifest, perf_analyzer_request):
    """tritonclient's get_inference_statistics (what perf_analyzer reads for its server-side split),
    right after the infer cases: the engine counted each model call they made, and nothing else."""
    named = cases(*batch, manifest)
    add_perf_analyzer_cases(named, perf_analyzer_request)
    calls, samples = model_calls(named.values())
    (stats,) = answers["statistics"]["model_stats"]
    assert answers["statistics_v1"]["model_stats"] == [stats]
    assert answers["all_statistics"]["model_stats"] == [stats]
    assert answers["unknown_statistics"] == {"code": "NOT_FOUND", "message": "model 'nope' is not loaded; loaded: ['demo']"}
    assert (stats["name"], stats["version"]) == ("demo", "1")
    inference = stats["inference_stats"]

    def count(field):
        return int(inference[field].get("count", 0)), int(inference[field].get("ns", 0))

    assert count("success")[0] == count("queue")[0] == count("compute_infer")[0] == calls
    assert count("compute_input") == count("compute_output") == (calls, 0)
    # The bad requests were refused by the front end's checks; timeout_passed's two model calls (ctr and
    # pooled) reached the engine and expired there.
    assert count("fail")[0] == 2
    assert int(stats["inference_count"]) == samples
    assert count("success")[1] >= count("queue")[1] + count("compute_infer")[1] > count("queue")[1] > 0
    batches = [(int(b["batch_size"]), int(b["compute_infer"]["count"]), int(b["compute_infer"]["ns"]))
               for b in stats["batch_stats"]]
    assert sum(n for _, n, _ in batches) == int(stats["execution_count"]) <= calls
    assert sum(size * n for size, n, _ in batches) == samples
    assert all(ns > 0 for _, _, ns in batches)


def test_oip_floor_answers_infer_at_once_and_passes_the_rest_to_the_server(served):
    """bench.floor --oip-proxy (perf_analyzer's transport floor, scripts/gpu-perf-analyzer.sh): the
    model's metadata as the served server gives it, a constant ctr of B values, no model call."""
    import grpc

    from bench.floor import FloorProcess
    from recserve.oip import grpc_predict_v2_pb2 as oip
    from recserve.oip.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub

    infers = served.metric("recserve_requests_total", rpc="ModelInfer", code="OK")
    floor = FloorProcess(batch_size=5, processes=1, model="demo", oip_proxy=served.target)  # version: the served one
    try:
        with grpc.insecure_channel(floor.target) as via_floor, grpc.insecure_channel(served.target) as direct:
            asked = oip.ModelMetadataRequest(name="demo")
            metadata = GRPCInferenceServiceStub(via_floor).ModelMetadata(asked, timeout=30)
            assert metadata == GRPCInferenceServiceStub(direct).ModelMetadata(asked, timeout=30)
            with pytest.raises(grpc.RpcError) as unknown:
                GRPCInferenceServiceStub(via_floor).ModelMetadata(oip.ModelMetadataRequest(name="nope"), timeout=30)
            infer = via_floor.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=None,
                                          response_deserializer=oip.ModelInferResponse.FromString)
            answer = infer(b"never decoded", timeout=10)
    finally:
        code = floor.stop()
    assert code == 0
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND  # the server's own answer, passed on
    assert (answer.model_name, answer.model_version, answer.outputs[0].name) == ("demo", "1", "ctr")
    assert np.frombuffer(answer.raw_output_contents[0], "<f4").tolist() == [0.5] * 5
    assert served.metric("recserve_requests_total", rpc="ModelInfer", code="OK") == infers  # no model call


def test_model_ready_with_a_malformed_version_is_invalid_argument(served):
    """ModelReady answered ready: false for a version string that names no version at all ("01", as
    Triton refuses it: INVALID_ARGUMENT), as if such a version might become ready later."""
    import grpc

    from recserve.oip import grpc_predict_v2_pb2 as oip
    from recserve.oip.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub

    with grpc.insecure_channel(served.target) as channel:
        stub = GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelReady(oip.ModelReadyRequest(name="demo", version="01"), timeout=30)
        assert (e.value.code(), e.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT, "model_version: '01' is neither a version number (1 to "
            "9223372036854775807, no leading zeros) nor a version label; send \"\" for the default version")
        ready = [stub.ModelReady(oip.ModelReadyRequest(name=name, version=version), timeout=30).ready
                 for name, version in (("demo", "9"), ("nope", ""), ("demo", "1"), ("demo", ""))]
        assert ready == [False, False, True, True]


def test_classification_is_refused_not_ignored_over_grpc(served, batch):
    """tritonclient's gRPC ``InferRequestedOutput(name, class_count=k)`` (an int64 parameter
    "classification") was answered with the plain FP32 scores, a tensor of another type and shape
    than the client reads, as over HTTP before; now INVALID_ARGUMENT, and the request without it
    is answered as before."""
    import grpc

    from recserve.oip import grpc_predict_v2_pb2 as oip
    from recserve.oip.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub

    def request(classification=None):
        r = raw_infer_request(*batch)
        ctr = r.outputs.add(name="ctr")
        if classification is not None:
            ctr.parameters["classification"].int64_param = classification
        return r

    with grpc.insecure_channel(served.target) as channel:
        stub = GRPCInferenceServiceStub(channel)
        good = stub.ModelInfer(request(), timeout=30).raw_output_contents[0]
        assert len(good) == 4 * B
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(request(2), timeout=30)
        assert (e.value.code(), e.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT, "output 'ctr': classification is not supported (the server has no "
            "classification extension); request the output without it and rank its scores")
        assert stub.ModelInfer(request(), timeout=30).raw_output_contents[0] == good
        assert stub.ModelInfer(request(0), timeout=30).raw_output_contents[0] == good  # 0: no classification


@pytest.fixture(scope="module")
def served_packed(tmp_path_factory, artifact):
    """A model whose config.json advertises the packed inputs only (for perf_analyzer --shared-memory)."""
    repo = tmp_path_factory.mktemp("oip_packed")
    shutil.copytree(artifact, repo / "demo" / "1")
    (repo / "demo" / "config.json").write_text('{"oip_inputs": "packed"}')
    server = InProcessServer(repo)
    yield server
    server.stop()


def test_perf_analyzer_input_of_a_model_advertising_the_packed_form_only(served_packed, tmp_path, capsys):
    """bench.oip_input read the ids' datatype from an input named `<feature>_ids`, which such a model
    does not advertise: a StopIteration traceback, --packed (the form it asks for) included."""
    out = tmp_path / "in.json"
    oip_input.main(["--target", served_packed.target, "--model", "demo", "--batch-size", "4", "--steps", "1",
                    "--packed", "--out", str(out)])
    step = json.loads(out.read_text())["data"][0]
    assert list(step) == ["dense", "lengths", "ids"]
    ids = np.frombuffer(base64.b64decode(step["ids"]["b64"]), np.int32)  # ModelMetadata's INT32, 4 bytes an id
    assert ids.shape == tuple(step["ids"]["shape"]) and step["lengths"]["shape"] == [3, 4]
    # A tensor per feature is no input perf_analyzer would find in ModelMetadata: say what to pass.
    with pytest.raises(SystemExit) as exc:
        oip_input.main(["--target", served_packed.target, "--model", "demo", "--batch-size", "4",
                        "--out", str(tmp_path / "per_feature.json")])
    assert exc.value.code == 2 and not (tmp_path / "per_feature.json").exists()
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m bench.oip_input: error: model 'demo' advertises the packed inputs only (dense, lengths, ids: "
        "its config.json says \"oip_inputs\": \"packed\"), and perf_analyzer sends the inputs ModelMetadata lists: "
        "pass --packed")


def test_perf_analyzer_input_for_a_model_not_served_says_so_in_one_line(served_packed, tmp_path, capsys):
    """It was recserve.client.ClientError's traceback."""
    with pytest.raises(SystemExit) as exc:
        oip_input.main(["--target", served_packed.target, "--model", "nope", "--batch-size", "4", "--packed",
                        "--out", str(tmp_path / "in.json")])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        "python -m bench.oip_input: error: NOT_FOUND: model 'nope' is not loaded; loaded: ['demo']"
