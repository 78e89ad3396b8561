"""Prometheus metrics of the server, one definition for every process.

Front ends record requests (``request_done``), the engine records batches (``batch_done``), model
versions and GPU memory; nothing else writes a metric. ``recserve serve`` runs them in several
processes: with ``PROMETHEUS_MULTIPROC_DIR`` set (serving/supervisor.py sets it before starting them),
prometheus_client keeps each process's values in files there and the supervisor serves all of them
on ONE /metrics endpoint (``multiprocess_registry``). In one process (tests) each component's own
registry is read directly.

Besides ours, /metrics has the standard ``process_*`` metrics of every process of the server, each
with a ``process`` label (``supervisor``, ``engine``, ``frontend-0`` ...): prometheus_client's
ProcessCollector reads one pid's /proc, and its multiprocess mode cannot merge per-process values,
so the supervisor reads each child's (``ProcessesCollector``); and ``python_info`` (one interpreter
for all of them). The label is the role, not the pid: a restart does not grow the label set.
"""
from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Callable, Dict, Iterable, List, Tuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector, \
    make_wsgi_app
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
NO_MODEL = "-"  # the model label of requests that named no loaded model (clients cannot grow the label set)
NO_VERSION = "-"  # the version label of requests that no model version answered
METRICS_IDLE_TIMEOUT_S = 30.0  # a scrape is answered at once; a client that sends nothing is not a scraper


class Metrics:
    def __init__(self, engine: int = 0) -> None:
        self.engine = str(engine)  # the engine process these metrics are recorded in (one per GPU)
        r = self.registry = CollectorRegistry()
        self.requests = Counter("recserve_requests", "Requests by RPC, model, version that answered and status code",
                                ["rpc", "model", "version", "code"], registry=r)
        self.total_seconds = Histogram("recserve_request_seconds", "Time in the server, receipt to response",
                                       ["rpc", "model", "version"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("recserve_queue_seconds", "Time from admission to the start of the batch",
                                       ["rpc", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.compute_seconds = Histogram("recserve_compute_seconds", "Model call time of the batch a request was in",
                                         ["rpc", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("recserve_batch_size", "Samples per model call", ["rpc", "model", "engine"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.queue_depth = Gauge("recserve_queue_depth", "Requests waiting for a batch", ["rpc", "model"],
                                 registry=r, multiprocess_mode="livesum")
        # recserve_model_version_loaded: from the engine's list of loaded versions (VersionStates), not
        # a Gauge: a multiprocess Gauge can neither drop a series nor forget a dead process's values.
        self.states = VersionStates()
        r.register(self.states)
        self.load_failures = Counter("recserve_model_load_failures", "Versions refused at load, by reason and engine",
                                     ["model", "reason", "engine"], registry=r)
        self.gpu_memory = Gauge("recserve_gpu_memory_bytes", "GPU memory allocated by the engines on the device",
                                ["device"], registry=r, multiprocess_mode="livesum")
        self.host_memory = Gauge("recserve_host_memory_bytes", "Resident host memory of the engine processes "
                                 "(uvm tables included)", registry=r, multiprocess_mode="livesum")
        # FBGEMM counts per cache (one per group of UVM-cached tables: the `tables` label), on ids
        # deduplicated within a batch.
        self.cache_hits = Counter("recserve_embedding_cache_hits", "UVM cache hits (unique ids per batch)",
                                  ["model", "version", "tables"], registry=r)
        self.cache_misses = Counter("recserve_embedding_cache_misses", "UVM cache misses (unique ids per batch)",
                                    ["model", "version", "tables"], registry=r)
        self.device_calls = Counter("recserve_device_calls", "Copies, graph launches and events the engine asked of "
                                    "the device for batches replayed from CUDA graphs", ["rpc", "model"], registry=r)
        self.graphed_batches = Counter("recserve_graphed_batches", "Batches replayed from CUDA graphs",
                                       ["rpc", "model"], registry=r)
        self.poll_seconds = Counter("recserve_engine_poll_seconds", "Time the engine's loop spent polling the "
                                    "device and its rings with nothing else to do (it polls while work is in flight, "
                                    "and on CUDA for 2 ms after its last work; not while it blocks on a model's full "
                                    "pipeline)", registry=r)
        self.buffer_used = Gauge("recserve_frontend_buffer_used_bytes", "Bytes of a front end's shared buffer held "
                                 "by requests in flight", ["frontend"], registry=r, multiprocess_mode="livesum")
        self.graph_pool = Gauge("recserve_cuda_graph_pool_bytes", "GPU memory held by the CUDA graphs' pool",
                                ["device"], registry=r, multiprocess_mode="livesum")
        self._batch_series: Dict[Tuple[str, str], Tuple] = {}  # (rpc, model): batch_done's labelled series
        self._request_series: Dict[Tuple, Tuple] = {}  # (rpc, model, version, code): request_done's

    # -- front ends ------------------------------------------------------------------------------
    def request_done(self, rpc: str, model: str, version: str, code: grpc.StatusCode, seconds: float) -> None:
        """One request ended; ``model``/``version``: NO_MODEL/NO_VERSION where none was involved."""
        key = (rpc, model, version, code)
        series = self._request_series.get(key)
        if series is None:  # looked up once per label set (bounded: loaded models' names and versions)
            series = self._request_series[key] = (
                self.requests.labels(rpc=rpc, model=model, version=version, code=code.name),
                self.total_seconds.labels(rpc=rpc, model=model, version=version) if code == grpc.StatusCode.OK
                else None)
        series[0].inc()
        if series[1] is not None:
            series[1].observe(seconds)

    # -- engine ----------------------------------------------------------------------------------
    def version_states(self, loaded: List[Tuple[str, int, str]]) -> None:
        """The engine's loaded versions now: (model, version, state) each."""
        self.states.set(loaded, self.engine)

    def load_failed(self, model: str, reason: str) -> None:
        """This engine refused a version of ``model`` (or its config.json, or a directory in it). Each
        engine that tries counts its own: a broken version is refused by every engine that loads the
        model (``--replicas``), one that fails on one GPU only by that one's."""
        self.load_failures.labels(model=model, reason=reason, engine=self.engine).inc()

    def batch_done(self, rpc: str, model: str, samples: int, queue_s: Iterable[float], compute_s: float,
                   device_calls: int = 0) -> None:
        """One model call: ``samples`` executed and answered; ``device_calls`` where it was replayed
        from a CUDA graph (serving/engine/runner.py ``Launched``)."""
        if not samples:
            return
        series = self._batch_series.get((rpc, model))
        if series is None:  # looked up once: a labels() lookup per metric was a few us per batch
            series = self._batch_series[(rpc, model)] = (
                self.device_calls.labels(rpc=rpc, model=model), self.graphed_batches.labels(rpc=rpc, model=model),
                self.batch_size.labels(rpc=rpc, model=model, engine=self.engine),
                self.compute_seconds.labels(rpc=rpc, model=model), self.queue_seconds.labels(rpc=rpc, model=model))
        calls, graphed, batch_size, compute, queue = series
        if device_calls:
            calls.inc(device_calls)
            graphed.inc()
        batch_size.observe(samples)
        for q in queue_s:
            queue.observe(q)
            compute.observe(compute_s)


class VersionStates:
    """``recserve_model_version_loaded{model,version,state}``: 1 per loaded version and state, per
    engine holding it (summed over engines). Each engine's list lives in this collector and, under
    ``PROMETHEUS_MULTIPROC_DIR``, in a file there that the supervisor's /metrics reads
    (``VersionStateFiles``): a version released leaves no series behind."""

    NAME, HELP = "recserve_model_version_loaded", "1 for each loaded model version (per engine holding it)"

    def __init__(self) -> None:
        self.loaded: List[Tuple[str, int, str]] = []

    def set(self, loaded: List[Tuple[str, int, str]], engine: str) -> None:
        self.loaded = list(loaded)
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory:
            path = Path(directory) / f"versions_engine{engine}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.loaded))
            tmp.replace(path)

    def collect(self) -> Iterable[Metric]:
        return [_states_family([self.loaded])] if self.loaded else []  # a front end's: always empty


class VersionStateFiles:
    """The supervisor's side of :class:`VersionStates`: every engine's file."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def collect(self) -> Iterable[Metric]:
        lists = []
        for path in sorted(self.directory.glob("versions_engine*.json")):
            try:
                lists.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue  # being replaced
        return [_states_family(lists)]


def _states_family(lists) -> GaugeMetricFamily:
    counts: Dict[Tuple[str, str, str], int] = {}
    for loaded in lists:
        for model, version, state in loaded:
            key = (model, str(version), state)
            counts[key] = counts.get(key, 0) + 1
    family = GaugeMetricFamily(VersionStates.NAME, VersionStates.HELP, labels=["model", "version", "state"])
    for labels, count in sorted(counts.items()):
        family.add_metric(list(labels), count)
    return family


class _Union:
    """A collector that yields what several registries hold (one process, several components)."""

    def __init__(self, registries) -> None:
        self.registries = registries

    def collect(self):
        for r in self.registries:
            yield from r.collect()


def union_registry(registries) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_Union(registries))
    return registry


class ProcessesCollector:
    """The standard ``process_*`` metrics of several processes, one ``process`` label each.
    ``processes()``: (role, pid) of each process now (a restarted child has a new pid)."""

    def __init__(self, processes: Callable[[], List[Tuple[str, int]]]) -> None:
        self.processes = processes

    def collect(self) -> Iterable[Metric]:
        families: Dict[str, Metric] = {}
        for role, pid in self.processes():
            for family in ProcessCollector(pid=lambda pid=pid: pid, registry=None).collect():
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                merged.samples += [s._replace(labels={**s.labels, "process": role}) for s in family.samples]
        return list(families.values())


def multiprocess_registry(processes: Callable[[], List[Tuple[str, int]]]) -> CollectorRegistry:
    """The supervisor's /metrics: every process's recserve metrics, read from
    PROMETHEUS_MULTIPROC_DIR, their process metrics, and python_info."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    registry.register(VersionStateFiles(os.environ["PROMETHEUS_MULTIPROC_DIR"]))
    registry.register(ProcessesCollector(processes))
    PlatformCollector(registry=registry)
    return registry


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's signature
        pass

    def handle(self) -> None:
        try:
            super().handle()
        except (TimeoutError, ConnectionError):  # a client silent past ``timeout``, or gone: its thread ends
            self.close_connection = True


def serve_metrics(port: int, host: str, registry: CollectorRegistry,
                  idle_timeout_s: float = METRICS_IDLE_TIMEOUT_S) -> WSGIServer:
    """``GET /metrics`` on ``host:port`` (prometheus_client's exposition, on a thread), 404 on any other
    path: an HTTP probe or client sent to this port by mistake (``/v2/health/ready``) must fail,
    not read the metrics as a 200. A connection silent for ``idle_timeout_s`` is closed: each one holds
    a thread. Returns the server (``shutdown()`` stops it)."""
    metrics = make_wsgi_app(registry)

    def app(environ, start_response):
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"404 Not Found: this port serves the Prometheus metrics at /metrics only\n"]
        return metrics(environ, start_response)

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]  # an IPv6 --host too
    server_class = type("MetricsServer", (_ThreadingServer,), {"address_family": family})
    handler_class = type("MetricsHandler", (_Quiet,), {"timeout": idle_timeout_s})
    server = make_server(host, port, app, server_class, handler_class=handler_class)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
