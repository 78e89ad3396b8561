"""tritonclient against a recserve server, run by tests/test_oip.py (gRPC) and tests/test_oip_http.py
(``"http": true`` in the job: tritonclient.http, binary tensors both ways) under
.venv-triton/bin/python (tritonclient pins protobuf<7, which the server's environment cannot have).
Reads a job (JSON) on stdin, prints what the server answered (JSON) on stdout. Imports nothing of
recserve."""
import json
import sys

import numpy as np
from tritonclient.utils import InferenceServerException

JOB = json.load(sys.stdin)
if JOB.get("http"):
    import tritonclient.http as triton
else:
    import tritonclient.grpc as triton

NUMPY = {"FP32": np.float32, "FP64": np.float64, "INT32": np.int32, "INT64": np.int64}


def infer_input(spec: dict) -> triton.InferInput:
    array = np.asarray(spec["data"], dtype=NUMPY[spec["datatype"]]).reshape(spec["shape"])
    tensor = triton.InferInput(spec["name"], list(array.shape), spec["datatype"])
    if spec.get("typed") and JOB.get("http"):  # the JSON "data" form instead of binary data
        tensor.set_data_from_numpy(array, binary_data=False)
    elif spec.get("typed"):  # tritonclient only sends raw contents: fill the typed field itself
        field = {"FP32": "fp32_contents", "INT32": "int_contents", "INT64": "int64_contents"}[spec["datatype"]]
        getattr(tensor._get_tensor().contents, field).extend(array.ravel().tolist())
    else:
        tensor.set_data_from_numpy(array)
    return tensor


def status(call):
    try:
        return {"code": "OK", "value": call()}
    except InferenceServerException as e:
        return {"code": str(e.status()).replace("StatusCode.", ""), "message": e.message()}


def as_json(method, *args):
    """gRPC's answers as JSON (as_json=True: MessageToJson); HTTP's are JSON already."""
    return method(*args) if JOB.get("http") else method(*args, as_json=True)


def infer(client: triton.InferenceServerClient, job: dict, case: dict) -> dict:
    outputs = None if case.get("outputs") is None else [triton.InferRequestedOutput(n) for n in case["outputs"]]
    result = status(lambda: client.infer(case.get("model", job["model"]), [infer_input(s) for s in case["inputs"]],
                                         model_version=case.get("version", ""), outputs=outputs,
                                         request_id=case.get("id", ""), parameters=case.get("parameters")))
    if result["code"] == "OK":
        response = result.pop("value")
        r = response.get_response()
        if isinstance(r, dict):  # tritonclient.http: the JSON document
            version, request_id, outputs = r["model_version"], r.get("id", ""), r["outputs"]
            names_types_shapes = [(o["name"], o["datatype"], o["shape"]) for o in outputs]
        else:
            version, request_id = r.model_version, r.id
            names_types_shapes = [(o.name, o.datatype, list(o.shape)) for o in r.outputs]
        result.update(version=version, id=request_id, outputs={
            name: {"datatype": datatype, "shape": shape, "data": response.as_numpy(name).ravel().tolist()}
            for name, datatype, shape in names_types_shapes})
    return result


def main() -> None:
    job = JOB
    model = job["model"]
    with triton.InferenceServerClient(job["target"]) as client:
        report = {
            "live": client.is_server_live(),
            "ready": client.is_server_ready(),
            "model_ready": client.is_model_ready(model),
            "model_ready_v1": client.is_model_ready(model, "1"),
            "model_ready_v9": client.is_model_ready(model, "9"),
            "unknown_model_ready": client.is_model_ready("nope"),
            "server_metadata": as_json(client.get_server_metadata),
            "metadata": as_json(client.get_model_metadata, model),
            "config": as_json(client.get_model_config, model),
            "unknown_metadata": status(lambda: as_json(client.get_model_metadata, "nope")),
            "infer": [infer(client, job, case) for case in job["cases"]],
        }
        # After the inferences: what the server counted of them.
        report["statistics"] = as_json(client.get_inference_statistics, model)
        report["statistics_v1"] = as_json(client.get_inference_statistics, model, "1")
        report["all_statistics"] = as_json(client.get_inference_statistics)
        report["unknown_statistics"] = status(lambda: as_json(client.get_inference_statistics, "nope"))
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
