"""Locust load test for `recserve serve` over gRPC.

    locust -f loadtest/locustfile.py --host 127.0.0.1:50051 --model demo [--batch-size 64]
           [--ids-per-bag 3] [--id-distribution zipf:1.05] [--lookup-ratio 0.2]
           [--shared-features N|NAMES [--shared-ids-per-bag 50]]
           [--grpc-tls-ca ca.pem [--grpc-tls-cert client.pem --grpc-tls-key client.key]]
           [--grpc-auth-token-file token] [--summary-json final.json]

Every call is reported to locust's events (name, response time, response size, exception). The
request shapes come from the model's schema (GetModelInfo: features, id ranges, dense width) and
the options above. `make loadtest` starts a server and runs this headless for a fixed time.
"""
import json
import time

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import User, events, task

from recserve import wire
from recserve.client import ClientSecurity, encode_sparse, random_request, ranking_request, shared_feature_names
from recserve.ids import SPEC_HELP, IdDistribution
from recserve.v1 import inference_pb2 as pb
from recserve.v1 import inference_pb2_grpc as pb_grpc

grpc_gevent.init_gevent()


@events.init_command_line_parser.add_listener
def _options(parser):
    parser.add_argument("--model", default="demo", help="model name to load-test")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per request")
    parser.add_argument("--ids-per-bag", type=float, default=3.0, help="mean ids per bag (Poisson)")
    parser.add_argument("--shared-features", default="", help="ranking requests: these features (the model's "
                        "first N, or comma-separated names) are sent once per request, as shared bags")
    parser.add_argument("--shared-ids-per-bag", type=float, default=50.0, help="mean ids per shared bag")
    parser.add_argument("--id-distribution", default="uniform", help=SPEC_HELP)
    parser.add_argument("--lookup-ratio", type=float, default=0.2, help="share of Lookup calls (rest: Predict)")
    parser.add_argument("--request-timeout", type=float, default=10.0, help="gRPC deadline per call, seconds")
    parser.add_argument("--summary-json", default="", help="write locust's final totals here as JSON, when it "
                        "quits (its CSV files are snapshots taken every few seconds, the last one before the end)")
    ClientSecurity.add_arguments(parser, prefix="grpc-")


_run = {}


@events.init.add_listener
def _keep_environment(environment, **_):
    _run["environment"] = environment


@events.quit.add_listener
def _write_summary(**_):
    """Locust's own final totals (what its closing table prints), for loadtest/run.py's summary line."""
    environment = _run.get("environment")
    path = environment.parsed_options.summary_json if environment and environment.parsed_options else ""
    if not path:
        return
    total = environment.stats.total
    with open(path, "w") as f:
        json.dump({"requests": total.num_requests, "failures": total.num_failures, "requests_per_s": total.total_rps,
                   "p50_ms": total.get_response_time_percentile(0.5),
                   "p99_ms": total.get_response_time_percentile(0.99),
                   "by_name": {e.name: e.num_requests for e in environment.stats.entries.values()}}, f)


class RecserveUser(User):
    """Closed loop: each user sends one request, waits for the answer, sends the next."""

    def on_start(self):
        opts = self.environment.parsed_options
        self.timeout = opts.request_timeout
        security = ClientSecurity.from_args(opts, prefix="grpc-")
        self.metadata = security.metadata()
        self.channel = security.channel(self.host, options=[("grpc.max_send_message_length", 1 << 30),
                                                            ("grpc.max_receive_message_length", 1 << 30)])
        self.stub = pb_grpc.InferenceStub(self.channel)
        info = self.stub.GetModelInfo(pb.GetModelInfoRequest(model_name=opts.model), timeout=30,
                                      metadata=self.metadata).models[0]
        self.predicts, self.lookups = [], []
        ids = IdDistribution.parse(opts.id_distribution)
        shared_features = shared_feature_names(opts.shared_features, info) if opts.shared_features else ()
        for seed in range(8):
            if shared_features:
                dense, kjt, shared = ranking_request(info, opts.batch_size, shared_features, opts.ids_per_bag,
                                                     opts.shared_ids_per_bag, seed=seed, ids=ids)
                sparse = encode_sparse(kjt, shared)
            else:
                dense, kjt = random_request(info, opts.batch_size, opts.ids_per_bag, seed=seed, ids=ids)
                sparse = encode_sparse(kjt)
            self.predicts.append(pb.PredictRequest(model_name=opts.model, dense=wire.encode(dense), sparse=sparse))
            self.lookups.append(pb.LookupRequest(model_name=opts.model, sparse=sparse))
        self.calls = 0
        self.predict_weight = 1.0 - opts.lookup_ratio

    def _call(self, name, method, request):
        start = time.perf_counter()
        size, exception = 0, None
        try:
            size = method(request, timeout=self.timeout, metadata=self.metadata).ByteSize()
        except grpc.RpcError as e:
            exception = e
        self.environment.events.request.fire(
            request_type="grpc", name=name, response_time=(time.perf_counter() - start) * 1000.0,
            response_length=size, exception=exception, context={})

    @task
    def infer(self):
        self.calls += 1
        i = self.calls % len(self.predicts)
        # Deterministic interleave in the chosen ratio, so short runs hit both RPCs.
        if (self.calls * self.predict_weight) % 1.0 < self.predict_weight:
            self._call("Predict", self.stub.Predict, self.predicts[i])
        else:
            self._call("Lookup", self.stub.Lookup, self.lookups[i])

    def on_stop(self):
        self.channel.close()
