"""A seeded fuzz run over both protocols and the repository (the long run: scripts/fuzz.py).

Cases (tests/fuzzing.py): valid recserve.v1 Predict/Lookup (some features shared) and OIP ModelInfer
(raw and typed), each answer checked against the float reference model; the same cancelled at a
random moment; structured garbage, mutated and raw bytes; and, every 250 cases, a broken version in
the repository (bad manifest numbers, half-written, symlinked outside). Every case ends in an answer
or a documented code, the server keeps serving version 1, and a good request is answered exactly as
before after each case."""
import shutil

import numpy as np
import pytest
from fuzzing import REPOSITORY_FAULTS, Fuzzer, Oracle, cases, good_request, publish_fault
from hypothesis import HealthCheck, given, settings
from servers import SERVING, InProcessServer, health_status
from test_lifecycle import wait_for

from recserve.client import Client

CASES = 2000
REPOSITORY_EVERY = 250


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, artifact):
    repo = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(artifact, repo / "demo" / "1")
    server = InProcessServer(repo)  # the default limits
    yield server
    server.stop()


def refusals(server):
    return server.metric("recserve_model_load_failures_total", model="demo")


def test_fuzzed_cases_reach_the_model_and_never_break_the_server(fuzz_server, checkpoint, artifact):
    repo = fuzz_server.config.repo
    faults = sorted(REPOSITORY_FAULTS)
    with Client(fuzz_server.target) as client:
        oracle = Oracle(checkpoint, client.model_info("demo").models[0])
        send = good_request(oracle)
        fuzzer = Fuzzer(client.channel, oracle, (send, send(client.channel)["ctr"]))
        count = [0]

        @settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(cases())
        def case(item):
            count[0] += 1
            if count[0] % REPOSITORY_EVERY == 0:
                before = refusals(fuzz_server)
                path = publish_fault(repo, artifact, 2, faults[(count[0] // REPOSITORY_EVERY) % len(faults)])
                assert wait_for(lambda: refusals(fuzz_server) > before), path
                assert [v.version for v in client.model_info("demo").models[0].versions] == [1]
                path.unlink() if path.is_symlink() else shutil.rmtree(path)
            fuzzer.run(item)

        case()
    seen = fuzzer.seen
    total = sum(seen.values())
    assert total >= CASES and seen.get("OK", 0) >= 0.3 * total, seen
    assert seen.get("INVALID_ARGUMENT", 0) > 100 and seen.get("CANCELLED", 0) > 0, seen
    assert health_status(fuzz_server.target) == SERVING
    assert fuzz_server.metric("recserve_requests_total", code="INTERNAL") == 0
    # No slot leaked, whatever ended each case (answered, refused, cancelled at a random moment).
    assert wait_for(lambda: fuzz_server.metric("recserve_frontend_buffer_used_bytes") == 0, timeout=30)
    assert np.isfinite(fuzzer.good_answer).all()
    print(f"fuzz: {total} cases, {seen}")
