"""Every request's slot in a front end's shared buffer is freed exactly once, whatever ends it
(#22 item 1: a request and its Cancel in the same engine read leaked its slot forever)."""
import shutil
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from servers import InProcessServer
from test_lifecycle import wait_for

from recserve.client import Client, encode_sparse, random_request
from recserve.v1 import inference_pb2 as pb


def test_1000_requests_cancelled_at_random_moments_leave_the_buffer_empty(tmp_path, artifact):
    shutil.copytree(artifact, tmp_path / "repo" / "demo" / "1")
    server = InProcessServer(tmp_path / "repo", settings={"frontend_buffer_bytes": 16 << 20})
    try:
        with Client(server.target) as client:
            info = client.model_info("demo").models[0]
            dense, sparse = random_request(info, 4, seed=2)
            answer = client.predict("demo", dense, sparse)
            ids = np.zeros(260_000, np.int64)  # about 2 MiB of the buffer each
            big = pb.LookupRequest(model_name="demo", sparse=encode_sparse(
                (["item_id"], np.array([ids.size], np.int32), ids))).SerializeToString()
            call = client.channel.unary_unary("/recserve.v1.Inference/Lookup", request_serializer=None,
                                              response_deserializer=None)
            rng = np.random.default_rng(0)
            deadlines = rng.uniform(0.005, 0.08, 1000)

            def send(i):
                try:
                    call(big, timeout=float(deadlines[i]))
                except grpc.RpcError:
                    pass

            with ThreadPoolExecutor(4) as pool:
                list(pool.map(send, range(1000)))
            cancelled = server.metric("recserve_requests_total", rpc="Lookup", code="DEADLINE_EXCEEDED")
            assert cancelled > 100  # most of them ended before their answer: the path under test
            assert wait_for(lambda: server.metric("recserve_frontend_buffer_used_bytes") == 0, timeout=30)
            assert server.frontend.engine.in_flight == 0
            np.testing.assert_array_equal(client.predict("demo", dense, sparse), answer)
            assert pb.LookupResponse.FromString(call(big, timeout=30)).pooled.shape == [1, 16]  # it fits again
    finally:
        server.stop()

