"""The access log (serving/frontend/access.py): one line per request under serve --access-log, JSON
under --log-format json; denied requests logged without it, at most one line a second."""
import json
import logging

import grpc
import numpy as np
from reference import golden_request
from servers import ServeProcess

from recserve.client import Client, ClientSecurity
from serving.frontend.access import AccessLog

UNAUTHENTICATED, RESOURCE_EXHAUSTED, OK = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           grpc.StatusCode.OK)


def test_denied_requests_are_logged_at_most_once_a_second_and_say_how_many_were_left_out(caplog):
    now = [100.0]
    access = AccessLog(0.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="serving.access"):
        for _ in range(5):
            access.record("Predict", "ipv4:10.0.0.7:5000", "-", "-", 0, UNAUTHENTICATED, 0.0001)
        access.record("Predict", "ipv4:10.0.0.7:5000", "demo", "1", 8, OK, 0.002)  # not sampled: ratio 0
        now[0] += 1.0
        access.record("Lookup", "ipv4:10.0.0.8:5000", "demo", "1", 4096, RESOURCE_EXHAUSTED, 0.0)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "peer=ipv4:10.0.0.7:5000 method=Predict model=- version=- batch_size=0 code=UNAUTHENTICATED "
                    "server_ms=0.1"),
        ("WARNING", "peer=ipv4:10.0.0.8:5000 method=Lookup model=demo version=1 batch_size=4096 "
                    "code=RESOURCE_EXHAUSTED server_ms=0.0 (4 denied requests not logged before this)")]


def test_a_denied_request_is_a_warning_in_the_sampled_log_too(caplog):
    """With --access-log 1 every request is logged: a denied one still at WARNING (an operator who
    watches warnings for bad tokens must not lose them by turning the access log on)."""
    access = AccessLog(1.0)
    with caplog.at_level(logging.INFO, logger="serving.access"):
        access.record("Predict", "ipv4:10.0.0.7:5000", "-", "-", 0, UNAUTHENTICATED, 0.0001)
        access.record("Predict", "ipv4:10.0.0.7:5000", "demo", "1", 8, OK, 0.002)
    assert [(r.levelname, r.getMessage().split(" code=")[1]) for r in caplog.records] == [
        ("WARNING", "UNAUTHENTICATED server_ms=0.1"), ("INFO", "OK server_ms=2.0")]


def test_access_log_writes_one_json_object_per_request_with_its_fields(repo, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("secret\n")
    (dense, sparse), want = golden_request(repo / "demo" / "1")
    server = ServeProcess(repo, "--access-log", "--auth-token-file", str(tokens), "--frontends", "1",
                          log_format="json")
    try:
        with Client(server.target, security=ClientSecurity(token="secret")) as client:
            np.testing.assert_allclose(client.predict("demo", dense, sparse), want, atol=1e-5)
            try:
                client.predict("nope", dense, sparse)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.NOT_FOUND
        with Client(server.target, security=ClientSecurity(token="wrong")) as client:
            try:
                client.predict("demo", dense, sparse)
            except grpc.RpcError as e:
                assert e.code() == UNAUTHENTICATED
    finally:
        assert server.terminate() == 0
    entries = [json.loads(line) for line in server.output().splitlines() if '"logger": "serving.access"' in line]
    fields = [{k: e[k] for k in ("method", "model", "version", "batch_size", "code")} for e in entries]
    assert fields == [
        {"method": "Predict", "model": "demo", "version": "1", "batch_size": len(dense), "code": "OK"},
        {"method": "Predict", "model": "-", "version": "-", "batch_size": 0, "code": "NOT_FOUND"},
        {"method": "Predict", "model": "-", "version": "-", "batch_size": 0, "code": "UNAUTHENTICATED"}]
    assert all(e["peer"].startswith("ipv4:127.0.0.1:") and e["server_ms"] >= 0 and e["ts"] for e in entries)


def test_a_request_that_is_not_http_is_answered_400_without_a_traceback_in_the_log(tmp_path, caplog):
    """aiohttp logged every request it could not parse (a control character in a header, a line too
    long) at ERROR with a traceback quoting the bytes: any client, with no token, could fill the
    server's log with them. The client's fault is answered 400 and logged at DEBUG (as aiohttp does
    for a bad method); the next request is answered as before."""
    import socket
    import urllib.request

    from servers import InProcessServer

    server = InProcessServer(tmp_path, settings={"http_port": 0, "frontend_buffer_bytes": 32 << 20})
    try:
        port = server.frontend.http_port
        with caplog.at_level(logging.INFO):
            for head in (b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Request-Id: a\x01\x1b[31mb\r\n\r\n",
                         b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n"):
                with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
                    raw.sendall(head)
                    assert raw.makefile("rb").readline().split()[1] == b"400"
        # (the start-up load's line on the empty repository aside)
        assert [(r.name, r.levelname) for r in caplog.records if r.levelno >= logging.WARNING
                and not r.getMessage().startswith("starting with no model")] == []
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/live", timeout=10) as response:
            assert (response.status, json.loads(response.read())) == (200, {"live": True})
    finally:
        server.stop()
