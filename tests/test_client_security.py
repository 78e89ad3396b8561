"""The project's own clients against a server with TLS, mutual TLS and bearer tokens: the Client
library, `recserve predict` and the bench's closed-loop clients. Each asserts the exact status code
of a client that lacks what the server asks for, and the values of one that has it."""
import json
import time
from unittest import mock

import grpc
import numpy as np
import pytest
from conftest import run_cli
from servers import InProcessServer
from test_reliability import _info, certs  # noqa: F401 - certs: the module's CA, server and client certificates

from recserve.client import SPREAD_SERVICE_CONFIG, Client, ClientError, ClientSecurity, random_request
from recserve.errors import UserError


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "tokens"
    path.write_text("# the server's file: the client sends the first token\nsecret-1\nsecret-2\n")
    return path


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory, artifact, certs, token_file):  # noqa: F811
    import shutil

    repo = tmp_path_factory.mktemp("secure")
    shutil.copytree(artifact, repo / "demo" / "1")
    server = InProcessServer(repo, settings={"tls_cert": certs / "server.pem", "tls_key": certs / "server.key",
                                             "tls_client_ca": certs / "ca.pem", "auth_token_file": token_file})
    yield server
    server.stop()


def full(certs, **kw):  # noqa: F811
    return ClientSecurity(**{"tls_ca": certs / "ca.pem", "tls_cert": certs / "client.pem",
                             "tls_key": certs / "client.key", "token": "secret-1", **kw})


def reference(mtls_server, certs, dense, sparse):  # noqa: F811
    with Client(mtls_server.target, security=full(certs)) as client:
        return client.predict("demo", dense, sparse)


def test_client_with_ca_certificate_and_token_gets_the_same_values_every_time(mtls_server, certs,  # noqa: F811
                                                                              artifact):
    dense, sparse = random_request(_info(artifact), 5, seed=11)
    with Client(mtls_server.target, security=full(certs)) as client:
        first = client.predict("demo", dense, sparse)
        keys, dims, pooled = client.lookup("demo", sparse)
        assert client.model_info("demo").models[0].name == "demo"
    assert first.shape == (5,) and np.all((first > 0) & (first < 1))
    assert pooled.shape == (5, sum(dims))
    # The other token of the server's file works too.
    with Client(mtls_server.target, security=full(certs, token="secret-2")) as client:
        np.testing.assert_array_equal(client.predict("demo", dense, sparse), first)


@pytest.mark.parametrize("missing, code", [
    ({"tls_ca": None, "tls_cert": None, "tls_key": None}, grpc.StatusCode.UNAVAILABLE),  # plaintext to a TLS port
    ({"tls_cert": None, "tls_key": None}, grpc.StatusCode.UNAVAILABLE),  # no client certificate (mTLS)
    ({"token": None}, grpc.StatusCode.UNAUTHENTICATED),
    ({"token": "secret-3"}, grpc.StatusCode.UNAUTHENTICATED),
])
def test_client_lacking_what_the_server_asks_for_gets_its_code(mtls_server, certs, artifact, missing,  # noqa: F811
                                                               code):
    dense, sparse = random_request(_info(artifact), 2, seed=12)
    with Client(mtls_server.target, security=full(certs, **missing), timeout=10) as client, \
            pytest.raises(grpc.RpcError) as exc:
        client.predict("demo", dense, sparse)
    assert exc.value.code() == code


def test_a_refused_call_is_a_client_error_of_its_code_and_the_servers_message_in_one_line(mtls_server, certs,  # noqa: F811
                                                                                         artifact):
    """gRPC's own error printed four lines (its debug string among them) and had no code or message
    a caller could log as one; the same call is answered as before after the refusal."""
    dense, sparse = random_request(_info(artifact), 2, seed=14)
    with Client(mtls_server.target, security=full(certs)) as client:
        before = client.predict("demo", dense, sparse)
        with pytest.raises(ClientError) as exc:
            client.predict("nope", dense, sparse)
        assert isinstance(exc.value, grpc.RpcError)
        assert (exc.value.code(), exc.value.details(), str(exc.value)) == (
            grpc.StatusCode.NOT_FOUND, "model 'nope' is not loaded; loaded: ['demo']",
            "NOT_FOUND: model 'nope' is not loaded; loaded: ['demo']")
        with pytest.raises(ClientError, match=r"^INVALID_ARGUMENT: dense: expected 2 dimension\(s\), got shape \[8\]$"):
            client.predict("demo", dense[0], sparse)
        with pytest.raises(ClientError, match=r"^NOT_FOUND: "):
            client.model_info("nope")
        with pytest.raises(ClientError, match=r"^NOT_FOUND: "):
            client.lookup("nope", sparse)
        np.testing.assert_array_equal(client.predict("demo", dense, sparse), before)
    from recserve.local import free_port

    with Client(f"127.0.0.1:{free_port()}", timeout=10) as client, pytest.raises(ClientError) as exc:
        client.model_info()
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and str(exc.value).startswith("UNAVAILABLE: ")
    assert "\n" not in str(exc.value)


def test_client_over_tls_without_client_certificate(repo, certs, artifact):  # noqa: F811
    server = InProcessServer(repo, settings={"tls_cert": certs / "server.pem", "tls_key": certs / "server.key"})
    try:
        dense, sparse = random_request(_info(artifact), 3, seed=13)
        with Client(server.target, security=ClientSecurity(tls_ca=certs / "ca.pem")) as client:
            first = client.predict("demo", dense, sparse)
            np.testing.assert_array_equal(client.predict("demo", dense, sparse), first)
        # The certificate is for 127.0.0.1 and localhost: another name is refused unless overridden.
        port = server.target.rsplit(":", 1)[1]
        with Client(f"localhost:{port}", security=ClientSecurity(tls_ca=certs / "ca.pem")) as client:
            np.testing.assert_array_equal(client.predict("demo", dense, sparse), first)
        with Client(server.target, security=ClientSecurity(tls_ca=certs / "ca.pem", server_name="other.example")) \
                as client, pytest.raises(grpc.RpcError) as exc:
            client.predict("demo", dense, sparse)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_predict_cli_over_mtls_with_token_prints_the_clients_values(mtls_server, certs, token_file, artifact,
                                                                    tmp_path, capsys):  # noqa: F811
    dense = np.random.default_rng(0).standard_normal((2, _info(artifact).dense_features)).astype(np.float32)
    bags = {"user_id": [[3], [7]], "item_id": [[1, 2], []]}
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"dense": dense.tolist(), "sparse": bags}))
    want = reference(mtls_server, certs, dense, bags)
    args = ["predict", "--target", mtls_server.target, "--model", "demo", "--input", request,
            "--tls-ca", certs / "ca.pem", "--tls-cert", certs / "client.pem", "--tls-key", certs / "client.key"]
    capsys.readouterr()
    assert run_cli(*args, "--auth-token-file", token_file) == 0
    lines = capsys.readouterr().out.split()
    assert lines == [str(x) for i, p in enumerate(want) for x in (i, f"{p:.6f}")]
    # Without the token: one line naming the code, exit 2.
    assert run_cli(*args) == 2
    # (The in-process server logs the denied call on the same stderr: serving/frontend/access.py.)
    err = [line for line in capsys.readouterr().err.splitlines() if " serving.access: " not in line]
    assert err == ["recserve predict: error: UNAUTHENTICATED: missing or invalid bearer token"]
    # A certificate without its key is the user's error, said before any call.
    assert run_cli(*args[:-2], "--auth-token-file", token_file) == 2
    assert "needs both --tls-cert and --tls-key" in capsys.readouterr().err


def test_clients_read_a_token_file_as_the_server_does(mtls_server, certs, artifact, tmp_path, capsys):  # noqa: F811
    """The server's file with a byte order mark (some editors write one): the server strips it, the
    clients sent it as part of the token (gRPC: INTERNAL "Invalid metadata" on every call); a file
    that is not UTF-8 was a UnicodeDecodeError traceback."""
    (tmp_path / "bom").write_bytes(b"\xef\xbb\xbfsecret-1\nsecret-2\n")
    (tmp_path / "latin1").write_bytes(b"secr\xe9t\n")
    args = ["predict", "--target", mtls_server.target, "--model", "demo", "--random", "2",
            "--tls-ca", certs / "ca.pem", "--tls-cert", certs / "client.pem", "--tls-key", certs / "client.key"]
    capsys.readouterr()
    assert run_cli(*args, "--auth-token-file", tmp_path / "bom") == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert run_cli(*args, "--auth-token-file", tmp_path / "latin1") == 2
    assert capsys.readouterr().err.splitlines() == [
        f"recserve predict: error: --auth-token-file {tmp_path / 'latin1'}: not UTF-8 text (one token per line)"]


def test_bench_clients_over_mtls_with_token(mtls_server, certs, artifact):  # noqa: F811
    from bench.clients import RequestShape, closed_loop
    from bench.served import model_info

    info = model_info(mtls_server.target, "demo", full(certs))

    def answered():
        return mtls_server.metric("recserve_requests_total", rpc="Predict", model="demo", code="OK")

    opened = []  # the server's count as the measured window opens: its figures must leave the warm-up out
    row = closed_loop("served", mtls_server.target, info, 4, 2, 0.3, RequestShape(2.0), security=full(certs),
                      on_measure=lambda: opened.append(answered()))
    assert row.calls > 0 and (row.batch_size, row.concurrency) == (4, 2)
    assert opened[0] > 0 and answered() - opened[0] == row.calls
    with pytest.raises(UserError, match="UNAUTHENTICATED"):
        closed_loop("served", mtls_server.target, info, 4, 1, 0.3, RequestShape(2.0), security=full(certs, token=None))

    def unreadable():
        raise RuntimeError("the server's counters could not be read")

    began = time.monotonic()
    with pytest.raises(RuntimeError, match="counters"):  # the clients waiting to measure are let go, not killed late
        closed_loop("served", mtls_server.target, info, 4, 2, 0.3, RequestShape(2.0), security=full(certs),
                    on_measure=unreadable)
    assert time.monotonic() - began < 20


def test_open_inference_probes_need_no_token_but_inference_does(mtls_server, certs):  # noqa: F811
    from recserve.oip import grpc_predict_v2_pb2 as oip
    from recserve.oip import grpc_predict_v2_pb2_grpc as oip_grpc

    with full(certs, token=None).channel(mtls_server.target) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(oip.ServerLiveRequest(), timeout=10).live
        assert stub.ServerReady(oip.ServerReadyRequest(), timeout=10).ready
        assert stub.ModelReady(oip.ModelReadyRequest(name="demo"), timeout=10).ready
        for version in ("9", "canary"):  # not ready, and no message: nothing of the model's versions or labels
            call = stub.ModelReady.with_call(oip.ModelReadyRequest(name="demo", version=version), timeout=10)
            assert (call[0].ready, call[1].code(), call[1].details()) == (False, grpc.StatusCode.OK, "")
        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelMetadata(oip.ModelMetadataRequest(name="demo"), timeout=10)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_several_targets_become_one_address_list_with_host_names_resolved(monkeypatch):
    """gRPC's ipv4:/ipv6: schemes take addresses only: "host1:50051,host2:50051" (README) resolves
    its names once; hosts of two families without one in common, or a scheme in the list, are one line."""
    import socket

    from recserve.client import spread_target

    table = {"a.example": ["10.0.0.5"], "b.example": ["10.0.0.6", "fd00::6"], "c.example": ["fd00::7"]}

    def getaddrinfo(host, port, type=0):
        if host.startswith(("10.", "fd00")):
            addresses = [host]
        elif host in table:
            addresses = table[host]
        else:
            raise socket.gaierror(-2, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, type, 6, "", (a, port)) for a in addresses]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    assert spread_target(["a.example:50051", "b.example:50052", "10.0.0.9:1"]) == \
        "ipv4:10.0.0.5:50051,10.0.0.6:50052,10.0.0.9:1"
    assert spread_target(["b.example:1", "c.example:2", "[fd00::8]:3"]) == "ipv6:[fd00::6]:1,[fd00::7]:2,[fd00::8]:3"
    with pytest.raises(UserError, match=r"some hosts have IPv4 addresses only, some IPv6 only"):
        spread_target(["a.example:1", "c.example:2"])
    with pytest.raises(UserError, match=r"target 'nope.example:1': cannot resolve 'nope.example'"):
        spread_target(["a.example:1", "nope.example:1"])
    with pytest.raises(UserError, match=r"give several servers as HOST:PORT each, or one dns:/// name"):
        spread_target(["a.example:1", "dns:///b.example:1"])


def test_one_dns_name_is_spread_and_retried_as_several_targets_are(monkeypatch):
    """A dns:/// name may resolve to several servers (a headless Service's pods): the client gave it gRPC's
    default, pick_first (every call to one server, no retry on UNAVAILABLE); it now has the channel
    options of several targets (round_robin, UNAVAILABLE retried: SPREAD_SERVICE_CONFIG). One HOST:PORT,
    or one unix: socket, keeps pick_first."""
    opened = []
    monkeypatch.setattr(ClientSecurity, "channel",
                        lambda self, target, options=(): opened.append((target, options)) or mock.MagicMock())
    for target in (["10.0.0.5:50051", "10.0.0.6:50051"], "dns:///recserve.default.svc.cluster.local:50051",
                   "dns://10.0.0.2:53/recserve:50051", "10.0.0.5:50051", "unix:/tmp/recserve.sock"):
        Client(target)
    (_, several), *single = opened
    spread = [("grpc.service_config", SPREAD_SERVICE_CONFIG), ("grpc.enable_retries", 1)]
    assert several[-2:] == spread
    assert single == [("dns:///recserve.default.svc.cluster.local:50051", several),
                      ("dns://10.0.0.2:53/recserve:50051", several),
                      ("10.0.0.5:50051", several[:-2]), ("unix:/tmp/recserve.sock", several[:-2])]


def test_a_dns_name_target_is_answered(repo):
    server = InProcessServer(repo)
    try:
        port = server.target.rpartition(":")[2]
        with Client(server.target) as direct, Client(f"dns:///localhost:{port}") as by_name:
            info = by_name.model_info("demo").models[0]
            dense, sparse = random_request(info, 4, seed=3)
            np.testing.assert_array_equal(by_name.predict("demo", dense, sparse), direct.predict("demo", dense, sparse))
    finally:
        server.stop()


def test_a_token_no_header_can_carry_is_refused_in_one_line_without_echoing_it(tmp_path, capsys):
    """A token with a tab or a non-ASCII letter: the server took it, and every gRPC call of a client
    that sent it failed INTERNAL "Invalid metadata" (gRPC refuses such header values), so no client could
    ever authenticate with it. Both sides now refuse the file, naming the line, never the token."""
    from conftest import cli_error

    from serving.frontend.security import load_tokens

    for name, line in (("tab", "secret\tpart"), ("accent", "sécret")):
        (tmp_path / name).write_text(f"# tokens\nok-token\n{line}\n")
        message = f"--auth-token-file {tmp_path / name}: line 3: a token must be printable ASCII characters " \
                  "(it travels in an HTTP/2 header, which carries no others)"
        with pytest.raises(UserError) as exc:
            load_tokens(tmp_path / name)
        assert str(exc.value) == message and line not in message
        assert cli_error(capsys, "predict", "--target", "127.0.0.1:1", "--model", "demo", "--random", "1",
                         "--auth-token-file", tmp_path / name) == f"recserve predict: error: {message}"
    (tmp_path / "comment").write_text("# tokens, rotated in décembre\nok token\n")  # comments may say anything
    assert load_tokens(tmp_path / "comment") == [b"ok token"]


def test_a_token_file_caught_mid_write_is_not_taken_for_the_whole(tmp_path):
    """The front end read --auth-token-file at the first poll that saw it change: a file caught
    between two writes (``echo new > f; echo old >> f``) held only the new token, and the old one,
    still in force, was refused until the next change. A change is now read once two polls in a
    row see the file alike; a version that does not read keeps the tokens in force."""
    import os

    from serving.frontend.security import TokenFile

    path = tmp_path / "tokens"
    path.write_text("secret-old\n")
    token_file = TokenFile(path)
    tokens = token_file.tokens
    assert tokens == [b"secret-old"] and token_file.poll() is False

    def rewrite(text):  # each version of the file told apart whatever the file system's clock resolution
        path.write_text(text)
        os.utime(path, ns=(0, path.stat().st_mtime_ns + 1_000_000_000 * (len(text) + 1)))

    rewrite("secret-new\n")  # the first half of the rotation
    assert token_file.poll() is False and tokens == [b"secret-old"]
    rewrite("secret-new\nsecret-old\n")  # the second
    assert token_file.poll() is False and tokens == [b"secret-old"]
    assert token_file.poll() is True and tokens == [b"secret-new", b"secret-old"]
    assert token_file.poll() is False
    rewrite("")  # truncated, then refused once it stays so: the tokens in force stay
    assert token_file.poll() is False
    with pytest.raises(UserError, match=r"no token in it"):
        token_file.poll()
    assert tokens == [b"secret-new", b"secret-old"] and token_file.poll() is False
    rewrite("secret-new\n")
    assert token_file.poll() is False and token_file.poll() is True and tokens == [b"secret-new"]


def test_a_token_file_changed_while_the_front_end_first_reads_it_is_read_again(tmp_path, monkeypatch):
    """TokenFile noted the file's state after its first read: a rotation written between the two
    passed for the version read, and its new token was refused until the file changed again."""
    import os

    from serving.frontend import security

    path = tmp_path / "tokens"
    path.write_text("secret-old\n")
    read = security.load_tokens

    def read_then_rotate(p):
        tokens = read(p)
        path.write_text("secret-new\nsecret-old\n")
        os.utime(path, ns=(0, path.stat().st_mtime_ns + 1_000_000_000))  # told apart whatever the clock
        return tokens

    monkeypatch.setattr(security, "load_tokens", read_then_rotate)
    token_file = security.TokenFile(path)
    monkeypatch.setattr(security, "load_tokens", read)
    assert token_file.tokens == [b"secret-old"]
    assert [token_file.poll(), token_file.poll()] == [False, True]
    assert token_file.tokens == [b"secret-new", b"secret-old"]


def test_mutual_tls_refuses_a_client_certificate_of_another_ca_over_grpc_and_https(certs, tmp_path):  # noqa: F811
    """--tls-client-ca: a client certificate signed by another CA is refused on both ports, as is
    none; the CA's own is served (HTTPS too: its context trusts that CA only, not the system's)."""
    import http.client
    import ssl
    import subprocess

    from servers import InProcessServer

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other-ca.key", "-out", "other-ca.pem",
            "-days", "2", "-subj", "/CN=another-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "rogue.key", "-out", "rogue.csr", "-subj", "/CN=client")
    (tmp_path / "rogue.ext").write_text("extendedKeyUsage=clientAuth\n")
    openssl("x509", "-req", "-in", "rogue.csr", "-CA", "other-ca.pem", "-CAkey", "other-ca.key", "-CAcreateserial",
            "-out", "rogue.pem", "-days", "2", "-extfile", "rogue.ext")
    pairs = {"own": (certs / "client.pem", certs / "client.key"),
             "other": (tmp_path / "rogue.pem", tmp_path / "rogue.key"), "none": (None, None)}
    repo = tmp_path / "repo"
    repo.mkdir()
    server = InProcessServer(repo, settings={"tls_cert": certs / "server.pem", "tls_key": certs / "server.key",
                                             "tls_client_ca": certs / "ca.pem", "http_port": 0,
                                             "frontend_buffer_bytes": 32 << 20})

    def https(cert, key):
        context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        if cert:
            context.load_cert_chain(cert, key)
        connection = http.client.HTTPSConnection("127.0.0.1", server.frontend.http_port, context=context, timeout=10)
        try:
            connection.request("GET", "/v2/health/live")
            return connection.getresponse().status
        except (ssl.SSLError, ConnectionError):
            return "refused"
        finally:
            connection.close()

    def grpc_live(cert, key):
        from recserve.oip import grpc_predict_v2_pb2 as oip
        from recserve.oip import grpc_predict_v2_pb2_grpc as oip_grpc

        security = ClientSecurity(tls_ca=certs / "ca.pem", tls_cert=cert, tls_key=key)
        with security.channel(server.target) as channel:
            try:
                return oip_grpc.GRPCInferenceServiceStub(channel).ServerLive(oip.ServerLiveRequest(), timeout=10).live
            except grpc.RpcError as e:
                return e.code()

    try:
        assert {name: (https(*pair), grpc_live(*pair)) for name, pair in pairs.items()} == {
            "own": (200, True), "other": ("refused", grpc.StatusCode.UNAVAILABLE),
            "none": ("refused", grpc.StatusCode.UNAVAILABLE)}
    finally:
        server.stop()


def test_a_server_token_file_that_is_a_fifo_is_refused_in_one_line_not_waited_on(tmp_path):
    """serve --auth-token-file is read whole, at start and again at each change: a FIFO there blocked
    the read until a writer came, maybe never (the CLI's check before start, a front end's event loop).
    A client's --auth-token-file may be a pipe (``<(...)``): it is read once."""
    import os
    import threading

    from serving.frontend.security import load_tokens as read_tokens

    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    outcome = []

    def read():
        try:
            read_tokens(fifo)
        except UserError as e:
            outcome.append(str(e))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # blocked in the read: give it a writer, so that the test ends
        with open(fifo, "w") as f:
            f.write("x\n")
        reader.join(10)
    assert outcome == [f"--auth-token-file {fifo}: not a regular file; the server reads it again whenever it "
                       "changes: pass a file"]


def test_a_token_given_in_code_that_no_header_can_carry_is_refused_at_once():
    """ClientSecurity(token=open(f).read()) kept the newline: every call then failed INTERNAL
    "Invalid metadata", as if the server had failed; the CLI's --auth-token-file path was checked."""
    for token in ("secret\n", "sécret", "a\tb"):
        with pytest.raises(UserError, match=r"^token: a bearer token must be printable ASCII characters"):
            ClientSecurity(token=token)
    assert ClientSecurity(token="secret").metadata() == [("authorization", "Bearer secret")]


def test_the_front_ends_file_watch_outlives_an_unexpected_error(monkeypatch, caplog):
    """The task that reads --auth-token-file again (and the shared-memory registry) caught only the
    errors it expected: any other ended it, and token rotation stopped without a word."""
    import asyncio
    from types import SimpleNamespace

    import serving.frontend.main as frontend

    monkeypatch.setattr(frontend, "TOKEN_FILE_POLL_S", 0)
    polls, refreshes = [], []

    class Tokens:
        tokens = [b"t"]

        def poll(self):
            polls.append(1)
            if len(polls) == 1:
                raise RuntimeError("a surprise")
            return False

    def refresh():
        refreshes.append(1)
        if len(refreshes) == 1:
            raise KeyError("name")

    async def scenario():
        watch = asyncio.get_running_loop().create_task(frontend.FrontEnd._watch_files(
            SimpleNamespace(index=0, shared=SimpleNamespace(refresh=refresh)), Tokens()))
        while len(polls) < 3:
            await asyncio.sleep(0)
            assert not watch.done(), watch.exception()
        watch.cancel()

    asyncio.run(scenario())
    assert len(refreshes) >= 2
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"][:2] == [
        "front end 0: reading --auth-token-file again failed; the previous tokens stay in force",
        "front end 0: reading the shared memory registry failed"]


def test_the_readmes_client_examples_run_as_written(repo, certs, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Every Python block of README's Client and Shared features sections, against a server at the
    target it names (the port swapped for the test server's), the TLS one with its files in the
    working directory; the printed keys, dims and shape are those its comment says."""
    import re
    import shutil

    from conftest import ROOT

    readme = (ROOT / "README.md").read_text()
    blocks = [block for title in ("### Client\n", "### Shared features") for block in
              re.findall(r"```python\n(.*?)```", readme.split(title, 1)[1].split("\n### ", 1)[0], re.S)]
    assert len(blocks) == 3
    server = InProcessServer(repo)
    try:
        for name in ("ca.pem", "client.pem", "client.key"):
            shutil.copy(certs / name, tmp_path / name)
        (tmp_path / "token").write_text("secret-1\n")
        monkeypatch.chdir(tmp_path)
        namespace = {}
        capsys.readouterr()
        exec(blocks[0].replace("127.0.0.1:50051", server.target), namespace)
        printed = capsys.readouterr().out
        assert printed.split("]", 1)[1].strip() == "['item_id'] [16] (2, 16)", printed
        assert namespace["ctr"].shape == (2,)
        exec(blocks[1], namespace)  # TLS files read and checked when the Client is made; no call
        # The shared features' block calls the Client `c` of the first one, inside its `with`.
        shared = "with Client(TARGET) as c:\n" + "".join(f"    {line}\n" for line in blocks[2].splitlines())
        exec(shared, {**namespace, "TARGET": server.target})
    finally:
        server.stop()


def test_a_client_that_cannot_connect_is_told_where_to_look(repo, certs, capsys):  # noqa: F811
    """`recserve predict` without --tls-ca against a TLS server said only 'UNAVAILABLE: failed to
    connect to all addresses; last error: UNAVAILABLE: ipv4:...: Socket closed': nothing of TLS."""
    from conftest import cli_error
    from recserve.local import free_port

    server = InProcessServer(repo, settings={"tls_cert": certs / "server.pem", "tls_key": certs / "server.key"})
    try:
        for command in (["predict", "--model", "demo", "--random", "1"], ["models", "list"]):
            line = cli_error(capsys, *command, "--target", server.target, "--timeout", "5")
            assert line.startswith(f"recserve {command[0]}: error: UNAVAILABLE: failed to connect to all addresses")
            assert line.endswith(f"; is recserve serve running at {server.target}, and without --tls-cert "
                                 "(with it, pass --tls-ca)?")
    finally:
        server.stop()
    closed = f"127.0.0.1:{free_port()}"  # with --tls-ca given, only the address is in question
    line = cli_error(capsys, "predict", "--model", "demo", "--random", "1", "--target", closed,
                     "--tls-ca", certs / "ca.pem", "--timeout", "5")
    assert line.endswith(f"; is recserve serve running at {closed}?") and "Connection refused" in line
