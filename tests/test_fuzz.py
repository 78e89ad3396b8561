"""A short fuzz run over request decoding, validation and the server (the long run:
scripts/fuzz.py). Every case must end in an answer or a documented status code, the server must keep
answering, and a good request afterwards must be answered exactly as before."""
import shutil

import numpy as np
import pytest
from fuzzing import raw_calls, requests, send_case
from hypothesis import HealthCheck, given, settings
from servers import InProcessServer, health_status

from recserve.client import Client, random_request


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, artifact):
    repo = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(artifact, repo / "demo" / "1")
    server = InProcessServer(repo, max_batch_size=64)
    yield server
    server.stop()


def test_fuzzed_requests_only_get_documented_codes_and_server_keeps_serving(fuzz_server):
    with Client(fuzz_server.target) as client:
        info = client.model_info("demo").models[0]
        dense, sparse = random_request(info, 5, seed=11)
        before = client.predict("demo", dense, sparse)
        calls, seen = raw_calls(client.channel), {}

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
        @given(requests())
        def case(item):
            send_case(calls, item, seen)

        case()
        assert seen.get("INVALID_ARGUMENT", 0) > 10 and seen.get("NOT_FOUND", 0) > 0, seen
        assert health_status(fuzz_server.target) == 1  # SERVING
        np.testing.assert_array_equal(client.predict("demo", dense, sparse), before)
        assert fuzz_server.metric("recserve_requests_total", rpc="Predict", model="demo", code="INTERNAL") == 0
