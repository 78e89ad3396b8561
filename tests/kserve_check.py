"""KServe's SDK (kserve 0.21, its own venv: .venv-kserve) reads Kubernetes manifests, strictly: run by
tests/test_kserve.py under .venv-kserve/bin/python with manifest paths as arguments. Each document
becomes KServe's (or Kubernetes') model class of its kind, field by field from the classes'
``attribute_map`` and ``openapi_types``: a field name no class has (a typo), a value of the wrong
type, or a value the class refuses is an error. Prints, as JSON, each document's kind and the
fields the test checks, and the errors. Imports nothing of recserve."""
import json
import re
import sys

import kubernetes.client.models as k8s
import yaml
from kserve import models as kserve

KINDS = {("serving.kserve.io/v1alpha1", "ServingRuntime"): "V1alpha1ServingRuntime",
         ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): "V1alpha1ClusterServingRuntime",
         ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService"}
PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float)}


def load(value, type_name: str, path: str, errors: list):
    """``value`` (parsed YAML) as ``type_name`` (an openapi type of the SDK's classes)."""
    if type_name == "object":  # IntOrString, quantities, free-form
        return value
    if type_name in PRIMITIVES:
        wrong = not isinstance(value, PRIMITIVES[type_name]) or (type_name == "int" and isinstance(value, bool))
        if wrong:
            errors.append(f"{path}: {value!r} is not a {type_name}")
        return value
    listed = re.fullmatch(r"[lL]ist\[(.+)\]", type_name)
    if listed:
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list")
            return []
        return [load(v, listed.group(1), f"{path}[{i}]", errors) for i, v in enumerate(value)]
    mapped = re.fullmatch(r"dict\((\w+), (.+)\)|Dict\[(\w+), (.+)\]", type_name)
    if mapped:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping")
            return {}
        item = mapped.group(2) or mapped.group(4)
        return {k: load(v, item, f"{path}.{k}", errors) for k, v in value.items()}
    cls = getattr(kserve, type_name, None) or getattr(k8s, type_name)
    if not isinstance(value, dict):
        errors.append(f"{path}: expected a {type_name} (a mapping)")
        return None
    fields = {key: attribute for attribute, key in cls.attribute_map.items()}
    kwargs = {}
    for key, v in value.items():
        if key not in fields:
            errors.append(f"{path}.{key}: {type_name} has no field {key!r}")
            continue
        kwargs[fields[key]] = load(v, cls.openapi_types[fields[key]], f"{path}.{key}", errors)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        errors.append(f"{path}: {type_name}: {e}")
        return None


def main() -> None:
    report = []
    for path in sys.argv[1:]:
        with open(path) as f:
            for document in yaml.safe_load_all(f):
                errors: list = []
                name = KINDS.get((document.get("apiVersion"), document.get("kind")))
                if name is None:
                    errors.append(f"{path}: not a KServe kind: {document.get('apiVersion')} {document.get('kind')}")
                    obj = None
                else:
                    obj = load(document, name, document["kind"], errors)
                report.append({"file": path, "kind": document.get("kind"), "class": type(obj).__name__,
                               "errors": errors, "object": kserve_dict(obj)})
    json.dump(report, sys.stdout)


def kserve_dict(obj):
    """The SDK object back as the API's JSON (camelCase keys), for the test's checks."""
    if obj is None:
        return None
    from kserve import ApiClient

    return ApiClient().sanitize_for_serialization(obj)


if __name__ == "__main__":
    main()
