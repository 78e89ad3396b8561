"""deploy/grafana/recserve.json: every query parses as PromQL (promql-parser, the Prometheus parser's
grammar) and names only metrics and labels the server exports (serving/metrics.py's registry, the
process metrics the supervisor adds per process), so that a renamed metric breaks this test, not
the dashboard."""
import json
import os

import pytest
from servers import ROOT

from serving.metrics import Metrics, ProcessesCollector

# A dev dependency (`make venv` installs it; CI runs this test): only the GPU machines, which run the
# GPU tests from a bare bundle, lack it.
promql_parser = pytest.importorskip("promql_parser")

DASHBOARD = ROOT / "deploy" / "grafana" / "recserve.json"
VARIABLES = {"$__rate_interval": "5m", "$model": "demo"}  # what Grafana substitutes before Prometheus sees a query
SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}


def exported() -> dict:
    """Sample name -> its label names, of everything /metrics serves."""
    names = {}
    for metric in vars(Metrics()).values():  # serving/metrics.py's metrics, samples or not
        if hasattr(metric, "_labelnames"):
            for suffix in SUFFIXES[metric._type]:
                names[metric._name + suffix] = set(metric._labelnames) | ({"le"} if suffix == "_bucket" else set())
    loaded = Metrics()  # recserve_model_version_loaded: a collector of the engine's loaded versions
    loaded.version_states([("m", 1, "READY")])
    for family in [*loaded.states.collect(), *ProcessesCollector(lambda: [("frontend-0", os.getpid())]).collect()]:
        for sample in family.samples:
            names[sample.name] = set(sample.labels)
    return names


def queries():
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


def parsed(expr: str):
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"an unknown Grafana variable in {expr}"
    return promql_parser.parse(expr)


def nodes(expr, kind):
    found = []
    promql_parser.walk(expr, lambda node: found.append(node) if isinstance(node, kind) else None)
    return found


def test_every_query_parses_and_names_exported_metrics_and_labels():
    metrics = exported()
    used = set()
    for title, expr in queries():
        tree = parsed(expr)
        for selector in nodes(tree, promql_parser.VectorSelector):
            assert selector.name in metrics, f"{title}: {selector.name} is not exported"
            used.add(selector.name)
            for matcher in selector.matchers.matchers:
                assert matcher.name in metrics[selector.name], f"{title}: {selector.name} has no label {matcher.name}"
        for aggregate in nodes(tree, promql_parser.AggregateExpr):
            inside = set().union(*(metrics[s.name] for s in nodes(aggregate.expr, promql_parser.VectorSelector)))
            grouping = set(aggregate.modifier.labels) if aggregate.modifier is not None else set()
            assert grouping <= inside, f"{title}: grouping by {grouping - inside}, labels no metric inside has"
    # What the dashboard is for: requests, latency, errors, batches, queue, engine, GPU, cache, front ends.
    assert {"recserve_requests_total", "recserve_request_seconds_bucket", "recserve_queue_seconds_bucket",
            "recserve_compute_seconds_bucket", "recserve_batch_size_bucket", "recserve_batch_size_count",
            "recserve_queue_depth", "recserve_engine_poll_seconds_total", "recserve_gpu_memory_bytes",
            "recserve_embedding_cache_hits_total", "recserve_embedding_cache_misses_total",
            "process_cpu_seconds_total", "recserve_frontend_buffer_used_bytes"} <= used


def test_a_wrong_name_or_label_would_fail():
    """The checks above catch what they are for (a test of the test, on the same parser)."""
    metrics = exported()
    tree = parsed('sum by (device) (rate(recserve_request_total{model=~"$model"}[$__rate_interval]))')
    (selector,) = nodes(tree, promql_parser.VectorSelector)
    assert selector.name not in metrics  # recserve_requests_total is the name
    assert "device" not in metrics["recserve_requests_total"]
    try:
        parsed("sum(rate(recserve_requests_total[5m])")
    except Exception:  # noqa: BLE001 - the parser's own error type
        pass
    else:
        raise AssertionError("an unbalanced query parsed")


def test_the_model_variable_and_datasource_are_templated():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["model"]["query"]["query"] == "label_values(recserve_requests_total, model)"
    assert "model" in exported()["recserve_requests_total"]
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {"${datasource}"}
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
