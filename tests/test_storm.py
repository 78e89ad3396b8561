"""A seeded storm of concurrent requests through the whole served path (recserve.v1, OIP over gRPC and
HTTP): good ones of random sizes (some features shared), checked against the float reference model;
bad ones, each with its exact status; ones cancelled at a random moment; ones with tiny deadlines.
Every good request gets its reference answer, every bad one its code, none hangs, and afterwards the
front end's buffer, the engine's queues and in-flight counts are empty and a good request is
answered exactly as before."""
import json
import shutil
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from fuzzing import CTR_ATOL, POOLED_RTOL, Oracle, oip_request, raw_calls
from servers import InProcessServer
from test_lifecycle import wait_for

from recserve import wire
from recserve.client import Client
from recserve.oip import grpc_predict_v2_pb2 as oip
from recserve.v1 import inference_pb2 as pb

CASES = 1500
MAX_BATCH, MAX_IDS, BUFFER = 32, 20_000, 64 << 10
# What a bad request gets: its gRPC code, and its HTTP status.
BAD = {"id_out_of_range": "INVALID_ARGUMENT", "negative_id": "INVALID_ARGUMENT", "lengths_mismatch": "INVALID_ARGUMENT",
       "dense_width": "INVALID_ARGUMENT", "unknown_feature": "INVALID_ARGUMENT", "empty_batch": "INVALID_ARGUMENT",
       "too_many_samples": "INVALID_ARGUMENT", "too_many_ids": "INVALID_ARGUMENT", "unknown_model": "NOT_FOUND",
       "too_big": "RESOURCE_EXHAUSTED"}
HTTP = {"UNAVAILABLE": 429, "OK": 200, "INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 413, "DEADLINE_EXCEEDED": 504}


# (clients at once, server settings, shared pooling): batches that wait 2 ms for company, shared bags
# expanded; and a server kept busy by more clients than its front end's buffer holds (no delay, bags
# pooled once), where a good request may also be told to retry (UNAVAILABLE).
STORMS = {"batching": (8, {"max_delay_ms": 2, "max_queue": 256}, "expand"),
          "saturated": (48, {"max_delay_ms": 0, "max_queue": 256}, "once")}


@pytest.fixture(scope="module", params=sorted(STORMS))
def storm_server(request, tmp_path_factory, artifact):
    threads, batch, pooling = STORMS[request.param]
    repo = tmp_path_factory.mktemp("storm")
    shutil.copytree(artifact, repo / "demo" / "1")
    server = InProcessServer(repo, settings={"http_port": 0, "frontend_buffer_bytes": BUFFER, "shared_pooling": pooling},
                             max_batch_size=MAX_BATCH, max_ids_per_request=MAX_IDS, **batch)
    server.url = f"http://127.0.0.1:{server.frontend.http_port}"
    server.threads, server.busy = threads, threads > 8
    yield server
    server.stop()


class Request:
    """One request of the storm: the model's inputs (per-sample bags, shared bags), how it goes wrong
    (``bad``), how it is sent (``protocol``, ``rpc``) and what is done to it (``fate``)."""

    def __init__(self, rng, oracle, index):
        self.index = index
        self.protocol = str(rng.choice(["v1", "oip", "http"]))
        self.rpc = str(rng.choice(["Predict", "Lookup"]))
        self.fate = str(rng.choice(["good"] * 6 + ["bad"] * 3 + ["cancel", "deadline"]))
        bads = sorted(set(BAD) - ({"dense_width"} if self.rpc == "Lookup" else set()))
        self.bad = str(rng.choice(bads)) if self.fate == "bad" else None
        self.model = "nope" if self.bad == "unknown_model" else "demo"
        self.timeout = float(rng.uniform(0.0005, 0.01)) if self.fate == "deadline" else 30.0
        self.cancel_after = int(rng.integers(0, 3000))
        self.both = self.protocol != "v1" and self.rpc == "Predict" and rng.random() < 0.3  # OIP: ctr and pooled
        names = oracle.names
        b = {"empty_batch": 0, "too_many_samples": MAX_BATCH + 1}.get(
            self.bad, int(rng.integers(1, 9 if rng.random() < 0.8 else MAX_BATCH + 1)))
        self.dense = rng.standard_normal((b, oracle.dense_features + (self.bad == "dense_width"))).astype(np.float32)
        self.shared = [n for n in names if self.protocol != "http" and rng.random() < 0.25]
        # No per-sample feature: a Predict of dense features (and shared bags) alone; a Lookup of
        # shared bags alone (one sample).
        self.minimal = (not self.bad and rng.random() < 0.15
                        and (self.rpc == "Predict" or self.protocol != "http" and self.shared))
        if self.minimal and self.rpc == "Lookup":
            b, self.dense = 1, self.dense[:1]
        self.bags, self.shared_bags = {}, {}
        for n in names:
            count = (lambda: int(rng.integers(0, 6 if rng.random() < 0.9 else 40)))
            if n in self.shared:
                self.shared_bags[n] = rng.integers(0, oracle.rows[n], count()).tolist()
                self.bags[n] = [self.shared_bags[n]] * b
            else:
                self.bags[n] = [rng.integers(0, oracle.rows[n], count()).tolist() for _ in range(b)]
        per_sample = [n for n in names if n not in self.shared]
        if not per_sample and not self.minimal:  # keep a per-sample feature: a Lookup's B comes from its lengths
            self.shared = self.shared[1:]
            per_sample = [n for n in names if n not in self.shared]
        # Some per-sample features left out (empty bags), the others in any order (recserve.v1).
        sent = [] if self.minimal else [n for n in per_sample if rng.random() < 0.8] or per_sample[:1]
        for n in per_sample:
            if n not in sent:
                self.bags[n] = [[] for _ in range(b)]
        self.per_sample = [sent[i] for i in rng.permutation(len(sent))] if self.protocol == "v1" else sent
        self.keys = self.per_sample + self.shared
        self.ids_dtype = np.int32 if rng.random() < 0.3 else np.int64
        self.lengths_dtype = np.int64 if rng.random() < 0.3 else np.int32
        self.packed = self.protocol == "oip" and rng.random() < 0.3 and sent == per_sample and not self.minimal
        self.typed = self.protocol == "oip" and not self.packed and not self.shared and rng.random() < 0.3
        self.ids = {n: [list(bag) for bag in self.bags[n]] for n in names}
        victim = self.per_sample[int(rng.integers(0, len(self.per_sample)))] if self.per_sample else None
        if self.bad in ("id_out_of_range", "negative_id") and b:
            self.ids[victim][0] = self.ids[victim][0] + [oracle.rows[victim] if self.bad == "id_out_of_range" else -1]
        if self.bad == "too_many_ids":
            self.ids[victim][0] = [0] * (MAX_IDS + 1)
        if self.bad == "too_big":  # fits the id limit, not the front end's buffer
            self.ids[victim][0] = [0] * (MAX_IDS - 2000)
        self.lengths = {n: [len(bag) for bag in self.ids[n]] for n in names}
        if self.bad == "lengths_mismatch" and b:
            self.lengths[victim][0] += 1
        self.unknown = self.bad == "unknown_feature"

    # -- the request in each protocol's form -------------------------------------------------------
    def _flat(self, names):
        return (np.array([x for n in names for x in self.lengths[n]], self.lengths_dtype),
                np.array([i for n in names for bag in self.ids[n] for i in bag], self.ids_dtype))

    def v1_bytes(self):
        lengths, values = self._flat(self.per_sample)
        keys = list(self.per_sample)
        if self.unknown:
            keys, lengths = keys + ["nope"], np.concatenate([lengths, np.zeros(self.dense.shape[0], np.int32)])
        shared_lengths = np.array([len(self.shared_bags[n]) for n in self.shared], self.lengths_dtype)
        shared_values = np.array([i for n in self.shared for i in self.shared_bags[n]], self.ids_dtype)
        sparse = pb.SparseFeatures(keys=keys, lengths=wire.encode(lengths), values=wire.encode(values),
                                   shared_keys=self.shared, shared_lengths=wire.encode(shared_lengths),
                                   shared_values=wire.encode(shared_values))
        if self.rpc == "Predict":
            return pb.PredictRequest(model_name=self.model, dense=wire.encode(self.dense), sparse=sparse).SerializeToString()
        return pb.LookupRequest(model_name=self.model, sparse=sparse).SerializeToString()

    def _features(self):
        features = {n: (np.array(self.lengths[n], self.lengths_dtype),
                        np.array([i for bag in self.ids[n] for i in bag], self.ids_dtype)) for n in self.per_sample}
        if self.unknown:
            features["nope"] = (np.zeros(self.dense.shape[0], np.int32), np.zeros(0, np.int64))
        return features

    def oip_bytes(self):
        features = {} if self.packed else self._features()
        data = oip_request(self.model, self.dense if self.rpc == "Predict" else None, features, outputs=self.outputs,
                           typed=self.typed)
        request = oip.ModelInferRequest.FromString(data)
        if self.packed:  # the model's KJT in two tensors: lengths [features, B], ids
            lengths, ids = self._flat(self.per_sample)
            lengths = lengths.reshape(len(self.per_sample), -1)
            for name, array in (("lengths", lengths), ("ids", ids)):
                request.inputs.add(name=name, datatype="INT32" if array.dtype == np.int32 else "INT64",
                                   shape=list(array.shape))
                request.raw_input_contents.append(array.tobytes())
            if self.unknown:
                request.inputs.add(name="nope_ids", datatype="INT64", shape=[0])
                request.raw_input_contents.append(b"")
        for n in self.shared:
            ids = np.array(self.shared_bags[n], self.ids_dtype)
            request.inputs.add(name=f"{n}_shared_ids", datatype="INT32" if ids.dtype == np.int32 else "INT64",
                               shape=[len(ids)])
            request.raw_input_contents.append(ids.tobytes())
        if self.fate == "deadline" and self.index % 2:  # Triton's timeout parameter (microseconds)
            request.parameters["timeout"].int64_param = max(1, int(self.timeout * 1e6))
        return request.SerializeToString()

    @property
    def outputs(self):
        return ["ctr", "pooled"] if self.both else ["ctr" if self.rpc == "Predict" else "pooled"]

    def http_body(self):
        arrays = ([("dense", "FP32", self.dense)] if self.rpc == "Predict" else [])
        for n, (lengths, ids) in self._features().items():
            arrays += [(f"{n}_lengths", "INT32" if lengths.dtype == np.int32 else "INT64", lengths),
                       (f"{n}_ids", "INT32" if ids.dtype == np.int32 else "INT64", ids)]
        binary = self.bad == "too_big" or self.index % 2
        inputs, tail = [], b""
        for name, datatype, array in arrays:
            tensor = {"name": name, "datatype": datatype, "shape": list(array.shape)}
            if binary:
                tensor["parameters"] = {"binary_data_size": array.nbytes}
                tail += array.tobytes()
            else:
                tensor["data"] = array.ravel().tolist()
            inputs.append(tensor)
        document = {"inputs": inputs, "outputs": [{"name": name} for name in self.outputs]}
        if self.index % 3 == 0:  # outputs as binary data after the document
            document["parameters"] = {"binary_data_output": True}
        if self.fate == "deadline":
            document.setdefault("parameters", {})["timeout"] = max(1, int(self.timeout * 1e6))
        head = json.dumps(document).encode()
        return head + tail, ({"Inference-Header-Content-Length": str(len(head))} if binary else {})

    # -- sending --------------------------------------------------------------------------------------
    def send(self, channel, url):
        """(code name, answer array or None)."""
        if self.protocol == "http":
            return self._send_http(url)
        if self.protocol == "v1":
            method, data = raw_calls(channel)[self.rpc], self.v1_bytes()
        else:
            method = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=None,
                                         response_deserializer=None)
            data = self.oip_bytes()
        try:
            if self.fate == "cancel":
                call = method.future(data, timeout=30)
                for _ in range(self.cancel_after):
                    if call.done():
                        break
                call.cancel()
                try:
                    reply = call.result(timeout=30)
                except grpc.FutureCancelledError:
                    return "CANCELLED", None
            else:
                reply = method(data, timeout=self.timeout)
        except grpc.RpcError as e:
            return e.code().name, e.details()
        return "OK", self._answer(reply)

    def _answer(self, reply):
        if self.protocol == "v1" and self.rpc == "Predict":
            return wire.decode(pb.PredictResponse.FromString(reply).ctr, "ctr", ("float32",))
        if self.protocol == "v1":
            return wire.decode(pb.LookupResponse.FromString(reply).pooled, "pooled", ("float32",))
        response = oip.ModelInferResponse.FromString(reply)
        return {t.name: np.frombuffer(raw, np.float32).reshape(list(t.shape))
                for t, raw in zip(response.outputs, response.raw_output_contents)}

    def _send_http(self, url):
        body, headers = self.http_body()
        if self.fate == "cancel":  # the client closes its connection at a random moment
            host, port = url.rsplit("/", 1)[1].split(":")
            head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": host, "Content-Type": "application/json",
                                                           "Content-Length": len(body), **headers}.items())
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(f"POST /v2/models/{self.model}/infer HTTP/1.1\r\n{head}\r\n".encode() + body)
                time.sleep(self.cancel_after / 1e6)
            return "CANCELLED", None
        request = urllib.request.Request(f"{url}/v2/models/{self.model}/infer", data=body, method="POST",
                                         headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                status, reply, length = r.status, r.read(), r.headers.get("Inference-Header-Content-Length")
        except urllib.error.HTTPError as e:
            status, reply, length = e.code, e.read(), None
        if status != 200:
            return {v: k for k, v in HTTP.items()}.get(status, str(status)), reply[:200]
        at = len(reply) if length is None else int(length)
        answer = {}
        for t in json.loads(reply[:at])["outputs"]:
            if "data" in t:
                answer[t["name"]] = np.array(t["data"], np.float32).reshape(t["shape"])
            else:
                size = t["parameters"]["binary_data_size"]
                answer[t["name"]] = np.frombuffer(reply[at:at + size], "<f4").reshape(t["shape"])
                at += size
        return "OK", answer

    # -- the property -------------------------------------------------------------------------------
    def expected(self, busy):
        """The codes this request may get (``busy``: a good one may be told to retry)."""
        if self.bad:
            return {BAD[self.bad]}
        extra = {"UNAVAILABLE"} if busy else set()
        if self.fate == "cancel":
            return {"OK", "CANCELLED"} | extra
        if self.fate == "deadline":
            return {"OK", "DEADLINE_EXCEEDED"} | extra
        return {"OK"} | extra

    def check(self, oracle, code, answer, busy):
        assert code in self.expected(busy), (self.index, self.protocol, self.rpc, self.fate, self.bad, code, answer)
        if code != "OK":
            return
        ctr, pooled = oracle(self.dense, self.bags)
        if self.protocol == "v1":
            answer = {"ctr" if self.rpc == "Predict" else "pooled": answer}
        assert sorted(answer) == sorted(self.outputs), (self.index, sorted(answer))
        if "ctr" in answer:
            err = float(np.abs(answer["ctr"].reshape(-1) - ctr).max())
            assert err <= CTR_ATOL, (self.index, self.protocol, "ctr", err)
        if "pooled" in answer:
            keys = self.keys if self.protocol == "v1" else oracle.names  # OIP: model order
            ref = np.concatenate([pooled[k] for k in keys], axis=1)
            # Relative where the rows are large; on a few small rows int8's error is absolute.
            err = float(np.linalg.norm(answer["pooled"] - ref) / max(np.linalg.norm(ref), 1.0))
            assert err <= POOLED_RTOL, (self.index, self.protocol, "pooled", err)


def drained(server):
    """Nothing of any request is left anywhere: the front end's buffer and pending answers, the
    engine's admitted works, the batchers' queues and batches, the versions' in-flight counts."""
    engine = server.engine
    return (server.metric("recserve_frontend_buffer_used_bytes") == 0 and server.frontend.engine.in_flight == 0
            and all(not link.works for link in engine.links) and not any(b.busy for b in engine.repo.batchers())
            and engine.repo.in_flight() == 0)


def test_a_storm_of_mixed_requests_gets_exact_answers_and_leaves_nothing_behind(storm_server, checkpoint):
    server = storm_server
    with Client(server.target) as client:
        info = client.model_info("demo").models[0]
        oracle = Oracle(checkpoint, info)
        probe = next(r for r in (Request(np.random.default_rng(seed), oracle, 0) for seed in range(100))
                     if (r.protocol, r.rpc, r.fate) == ("v1", "Predict", "good"))
        before = probe.send(client.channel, server.url)
        rng = np.random.default_rng(20240611)
        requests = [Request(rng, oracle, i) for i in range(CASES)]
        with ThreadPoolExecutor(server.threads) as pool:
            outcomes = list(pool.map(lambda r: r.send(client.channel, server.url), requests, timeout=120))
        seen = {}
        for r, (code, answer) in zip(requests, outcomes):
            seen[(r.fate, code)] = seen.get((r.fate, code), 0) + 1
            r.check(oracle, code, answer, server.busy)
        assert wait_for(lambda: drained(server), timeout=10), seen
        # The refused requests counted exactly as the clients saw them (a request cancelled or past its
        # deadline before gRPC handed it over is not the server's to count).
        for code in ("INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED"):
            assert server.metric("recserve_requests_total", code=code) == sum(
                1 for r in requests if r.bad and BAD[r.bad] == code), code
        after = probe.send(client.channel, server.url)
        assert before[0] == after[0] == "OK"
        np.testing.assert_array_equal(after[1], before[1])
        assert server.metric("recserve_requests_total", code="INTERNAL") == 0
