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
                                         request_id=case.get("id", ""), parameters=case.get("parameters"),
                                         timeout=case.get("timeout")))
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


def shared_memory(client: triton.InferenceServerClient, job: dict) -> dict:
    """Triton's system shared memory extension as perf_analyzer uses it: inputs in one region (at an
    offset into a file), the ctr output in another, each step's answer or error by name."""
    import tritonclient.utils.shared_memory as shm

    spec = job["shared_memory"]
    model, b = job["model"], spec["batch_size"]
    arrays = [np.asarray(s["data"], dtype=NUMPY[s["datatype"]]).reshape(s["shape"]) for s in spec["inputs"]]
    sizes = [a.nbytes for a in arrays]
    key = f"/recserve_test_{spec['tag']}"
    inputs_file = shm.create_shared_memory_region("inputs_file", key + "_in", 32 + sum(sizes))
    outputs_file = shm.create_shared_memory_region("outputs_file", key + "_out", 4 * b)
    shm.set_shared_memory_region(inputs_file, arrays, offset=32)
    report = {}

    def tensors(region="inputs", shift=0, raw=(), both=()):
        out, at = [], 0
        for s, a, size in zip(spec["inputs"], arrays, sizes):
            t = triton.InferInput(s["name"], list(a.shape), s["datatype"])
            if s["name"] in raw:
                t.set_data_from_numpy(a)
            else:
                t.set_shared_memory(region, size, at + shift)
            if s["name"] in both:  # its data in the request as well (tritonclient never sends both)
                if JOB.get("http"):
                    t._raw_data, t._parameters["binary_data_size"] = a.tobytes(), a.nbytes
                else:
                    t._get_tensor().contents.fp32_contents.extend(a.ravel().tolist())
            out.append(t)
            at += size
        return out

    def ctr_to(region="outputs", size=4 * b):
        ctr = triton.InferRequestedOutput("ctr")
        ctr.set_shared_memory(region, size)
        return [ctr, triton.InferRequestedOutput("pooled")]

    def run(inputs, outputs):
        def call():
            result = client.infer(model, inputs, outputs=outputs)
            ctr = shm.get_contents_as_numpy(outputs_file, np.float32, [b])
            r = result.get_response()
            if isinstance(r, dict):  # HTTP: data or binary data in the body
                in_body = [("data" in o or "binary_data_size" in o.get("parameters", {})) for o in r["outputs"]]
            else:  # gRPC: one raw entry per output, empty for an output in shared memory
                in_body = [len(raw) > 0 for raw in r.raw_output_contents]
            return {"ctr": ctr.tolist(), "pooled": result.as_numpy("pooled").ravel().tolist(), "in_body": in_body}
        return status(call)

    def regions(name=""):
        found = client.get_system_shared_memory_status(name)
        if isinstance(found, list):  # HTTP: [{"name", "key", "offset", "byte_size"}]
            return {r["name"]: [r["key"], r["offset"], r["byte_size"]] for r in found}
        return {n: [r.key, r.offset, r.byte_size] for n, r in found.regions.items()}

    def cuda_regions():
        found = client.get_cuda_shared_memory_status()
        return list(found) if isinstance(found, list) else list(found.regions)  # HTTP: a list; gRPC: a map

    try:
        report["register_inputs"] = status(lambda: client.register_system_shared_memory(
            "inputs", key + "_in", sum(sizes), offset=32))
        report["register_outputs"] = status(lambda: client.register_system_shared_memory("outputs", key + "_out", 4 * b))
        report["status"] = status(regions)
        report["extensions"] = as_json(client.get_server_metadata)["extensions"]
        report["infer"] = run(tensors(), ctr_to())
        report["mixed"] = run(tensors(raw=spec["raw"]), ctr_to())
        report["again"] = status(lambda: client.register_system_shared_memory("inputs", key + "_in", 8))
        report["no_such_key"] = status(lambda: client.register_system_shared_memory("x", key + "_none", 8))
        report["past_the_end"] = status(lambda: client.register_system_shared_memory("x", key + "_out", 4 * b + 1))
        report["bad_key"] = status(lambda: client.register_system_shared_memory("x", "../etc/passwd", 8))
        report["long_name"] = status(lambda: client.register_system_shared_memory("n" * 256, key + "_out", 8))
        report["no_such_region"] = run(tensors(region="nope"), ctr_to())
        report["input_past_region"] = run(tensors(shift=4), ctr_to())
        report["output_too_small"] = run(tensors(), ctr_to(size=4 * b - 4))
        report["data_and_region"] = run(tensors(both=[spec["inputs"][0]["name"]]), ctr_to())
        report["unknown_status"] = status(lambda: regions("nope"))
        report["after_errors"] = run(tensors(), ctr_to())
        path = "/dev/shm/" + key.lstrip("/") + "_in"
        with open(path, "r+b") as f:  # the client shrinks its object under the server
            f.truncate(16)
        report["truncated"] = run(tensors(), ctr_to())
        with open(path, "r+b") as f:  # and gives it back its size and bytes
            f.truncate(32 + sum(sizes))
        shm.set_shared_memory_region(inputs_file, arrays, offset=32)
        report["restored"] = run(tensors(), ctr_to())
        report["unregister"] = status(lambda: client.unregister_system_shared_memory("inputs"))
        report["unregistered"] = run(tensors(), ctr_to())
        report["unregister_all"] = status(lambda: client.unregister_system_shared_memory())
        report["status_after"] = status(regions)
        # CUDA shared memory is not served; clearing every region (perf_analyzer does) succeeds.
        report["cuda_unregister"] = status(lambda: client.unregister_cuda_shared_memory())
        report["cuda_status"] = status(cuda_regions)
        report["cuda_register"] = status(lambda: client.register_cuda_shared_memory("g", b"\0" * 64, 0, 8))
    finally:
        shm.destroy_shared_memory_region(inputs_file)
        shm.destroy_shared_memory_region(outputs_file)
    return report


def main() -> None:
    job = JOB
    model = job["model"]
    if "shared_memory" in job:
        with triton.InferenceServerClient(job["target"]) as client:
            json.dump(shared_memory(client, job), sys.stdout)
        return
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
