"""deploy/kserve/: the ServingRuntime and the InferenceService, read by KServe's own SDK model classes
(kserve 0.21 in .venv-kserve, tests/kserve_check.py: a misspelt field fails), and consistent with
each other and with the server: the container's arguments are `recserve serve`'s own, and the ports
and probes are the ones those arguments open."""
import json
import subprocess

import pytest
from servers import ROOT

from recserve.cli import build_parser

KSERVE_PYTHON = ROOT / ".venv-kserve" / "bin" / "python"
RUNTIME = ROOT / "deploy" / "kserve" / "servingruntime.yaml"
SERVICE = ROOT / "deploy" / "kserve" / "inferenceservice.yaml"


def check(*paths):
    if not KSERVE_PYTHON.exists():
        pytest.fail(f"{KSERVE_PYTHON} is missing: `make test` creates it (kserve in its own venv)")
    run = subprocess.run([str(KSERVE_PYTHON), str(ROOT / "tests" / "kserve_check.py"), *map(str, paths)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.fixture(scope="module")
def manifests():
    runtime, service = check(RUNTIME, SERVICE)
    assert (runtime["class"], runtime["errors"]) == ("V1alpha1ServingRuntime", [])
    assert (service["class"], service["errors"]) == ("V1beta1InferenceService", [])
    return runtime["object"], service["object"]


def test_the_runtime_runs_recserve_serve_on_kserve_ports(manifests):
    runtime, _ = manifests
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container" and container["command"][0] == ".venv/bin/recserve"
    args = build_parser().parse_args(container["command"][1:] + container["args"])
    assert (args.http_port, args.port, args.repo.as_posix(), args.host) == (8080, 8081, "/mnt/models", "0.0.0.0")
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/port"] == str(args.metrics_port)
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": args.http_port}
    assert set(runtime["spec"]["protocolVersions"]) == {"v2", "grpc-v2"}


def test_the_inference_service_uses_the_runtime_and_its_ports(manifests):
    runtime, service = manifests
    (container,) = runtime["spec"]["containers"]
    args = build_parser().parse_args(container["command"][1:] + container["args"])
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"] == {k: v for k, v in runtime["spec"]["supportedModelFormats"][0].items()
                                    if k in ("name", "version")}
    assert [(p["name"], p["containerPort"]) for p in model["ports"]] == [("http1", args.http_port), ("h2c", args.port)]
    assert model["storageUri"].startswith("pvc://")
    assert model["startupProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": args.http_port}
    assert model["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": args.http_port}
    assert service["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"


def test_a_misspelt_field_or_a_wrong_type_fails(tmp_path):
    typo = tmp_path / "typo.yaml"
    typo.write_text(SERVICE.read_text().replace("storageUri:", "storageURI:").replace('nvidia.com/gpu: "1"}',
                                                                                       "nvidia.com/gpu: 1}", 1))
    (report,) = check(typo)
    assert report["errors"][:2] == [
        "InferenceService.spec.predictor.model.storageURI: V1beta1ModelSpec has no field 'storageURI'",
        "InferenceService.spec.predictor.model.resources.requests.nvidia.com/gpu: 1 is not a str"]
