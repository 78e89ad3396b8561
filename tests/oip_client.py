"""tritonclient against a recserve server, run by tests/test_oip.py under .venv-triton/bin/python
(tritonclient pins protobuf<7, which the server's environment cannot have). Reads a job (JSON) on
stdin, prints what the server answered (JSON) on stdout. Imports nothing of recserve."""
import json
import sys

import numpy as np
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

NUMPY = {"FP32": np.float32, "FP64": np.float64, "INT32": np.int32, "INT64": np.int64}


def infer_input(spec: dict) -> triton.InferInput:
    array = np.asarray(spec["data"], dtype=NUMPY[spec["datatype"]]).reshape(spec["shape"])
    tensor = triton.InferInput(spec["name"], list(array.shape), spec["datatype"])
    if spec.get("typed"):  # tritonclient only sends raw contents: fill the typed field itself
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


def infer(client: triton.InferenceServerClient, job: dict, case: dict) -> dict:
    outputs = None if case.get("outputs") is None else [triton.InferRequestedOutput(n) for n in case["outputs"]]
    result = status(lambda: client.infer(case.get("model", job["model"]), [infer_input(s) for s in case["inputs"]],
                                         model_version=case.get("version", ""), outputs=outputs,
                                         request_id=case.get("id", ""), parameters=case.get("parameters")))
    if result["code"] == "OK":
        response = result.pop("value")
        r = response.get_response()
        result.update(version=r.model_version, id=r.id, outputs={
            o.name: {"datatype": o.datatype, "shape": list(o.shape), "data": response.as_numpy(o.name).ravel().tolist()}
            for o in r.outputs})
    return result


def main() -> None:
    job = json.load(sys.stdin)
    model = job["model"]
    with triton.InferenceServerClient(job["target"]) as client:
        report = {
            "live": client.is_server_live(),
            "ready": client.is_server_ready(),
            "model_ready": client.is_model_ready(model),
            "model_ready_v1": client.is_model_ready(model, "1"),
            "model_ready_v9": client.is_model_ready(model, "9"),
            "unknown_model_ready": client.is_model_ready("nope"),
            "server_metadata": client.get_server_metadata(as_json=True),
            "metadata": client.get_model_metadata(model, as_json=True),
            "config": client.get_model_config(model, as_json=True),
            "unknown_metadata": status(lambda: client.get_model_metadata("nope", as_json=True)),
            "infer": [infer(client, job, case) for case in job["cases"]],
        }
        # After the inferences: what the server counted of them.
        report["statistics"] = client.get_inference_statistics(model, as_json=True)
        report["statistics_v1"] = client.get_inference_statistics(model, "1", as_json=True)
        report["all_statistics"] = client.get_inference_statistics(as_json=True)
        report["unknown_statistics"] = status(lambda: client.get_inference_statistics("nope", as_json=True))
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
