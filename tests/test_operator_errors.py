"""What an operator or a user can get wrong, as they would (system tests: the CLI, in this process
where nothing starts, else as a command): each is answered with ONE line that says what to do and
exit code 2, asserted to the exact line where the line is ours; and what a log shipper or a client
host without torch is promised (JSON on every stderr line, `recserve.client` on grpcio, protobuf and
numpy alone)."""
import argparse
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import ROOT, cli_error, run_cli
from servers import InProcessServer
from test_reliability import certs  # noqa: F401 - a CA, server and client certificates

from recserve.cli import build_parser
from recserve.client import Client

# -- the CLI in this process: arguments checked before anything starts --------------------------


def one_line(capsys, *args) -> str:
    """Run the CLI: exit code 2 and exactly one line on stderr (argparse's usage included); that line."""
    capsys.readouterr()
    try:
        code = run_cli(*args)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, (code, err[-3000:])
    return err.strip()


@pytest.mark.parametrize("flags,line", [
    (["--port", "70000"], "recserve serve: error: --port must be a TCP port, 0 to 65535, got 70000"),
    (["--metrics-port", "-1"], "recserve serve: error: --metrics-port must be a TCP port, 0 to 65535, got -1"),
    (["--frontends", "-1"], "recserve serve: error: --frontends must be >= 0, got -1"),
    (["--max-batch-size", "0"], "recserve serve: error: --max-batch-size must be >= 1, got 0"),
    (["--max-message-mb", "-1"], "recserve serve: error: --max-message-mb must be > 0, got -1"),  # gRPC: no limit
    (["--load-timeout", "0"], "recserve serve: error: --load-timeout must be > 0, got 0"),
    (["--load-threads", "0"], "recserve serve: error: --load-threads must be from 1 to 1024, got 0"),
    (["--grace-period", "-1"], "recserve serve: error: --grace-period must be from 0 to 86400 seconds, got -1"),
    # the stop waits for its children at most this long: inf (or 1e7 s, past poll(2)'s milliseconds) was a
    # traceback at SIGTERM, with the engine left running
    (["--grace-period", "inf"], "recserve serve: error: --grace-period must be from 0 to 86400 seconds, got inf"),
    (["--grace-period", "1e7"], "recserve serve: error: --grace-period must be from 0 to 86400 seconds, got 1e+07"),
    (["--poll-interval", "nan"], "recserve serve: error: --poll-interval must be >= 0, got nan"),
    # Values gRPC or the buffer's size cannot take: each was a traceback from a child process (exit 1),
    # or a server that started with a batcher waiting forever (--max-delay-ms inf).
    (["--frontend-buffer-mb", "nan"], "recserve serve: error: --frontend-buffer-mb must be >= 16, got nan"),
    (["--frontend-buffer-mb", "inf"], "recserve serve: error: --frontend-buffer-mb must be a finite number, got inf"),
    (["--max-delay-ms", "inf"], "recserve serve: error: --max-delay-ms must be a finite number, got inf"),
    (["--max-message-mb", "5000"], "recserve serve: error: --max-message-mb must be at most 2047 (gRPC's limit), "
                                   "got 5000"),
    (["--idle-timeout", "inf"], "recserve serve: error: --idle-timeout must be at most 2147483 (gRPC's limit), got inf"),
    (["--idle-timeout", "nan"], "recserve serve: error: --max-connections must be >= 1 and --idle-timeout >= 0"),
    (["--max-connections", "3000000000"], "recserve serve: error: --max-connections must be at most 2147483647 "
                                          "(gRPC's limit), got 3e+09"),
    (["--device", "gpu"], "recserve serve: error: argument --device: invalid choice: 'gpu' (choose from 'auto', "
                          "'cuda', 'cpu') (see recserve serve --help)"),
    (["--port", "abc"], "recserve serve: error: argument --port: invalid int value: 'abc' (see recserve serve --help)"),
])
def test_serve_argument_errors_name_their_flag_in_one_line(flags, line, tmp_path, capsys):
    assert one_line(capsys, "serve", "--repo", tmp_path, *flags) == line


def test_serve_of_a_model_or_version_directory_says_to_pass_the_repository(repo, capsys):
    """--repo REPO/demo started a server of one model "1" with no versions ("starting without 1: no
    version loads (see the errors above)", none above), NOT_SERVING for good; --repo REPO/demo/1 (files
    only) one of no model at all."""
    layout = "(the layout is REPO/NAME/VERSION/manifest.json)"
    shutil.copytree(repo / "demo" / "1", repo / "demo" / "10")
    assert one_line(capsys, "serve", "--repo", repo / "demo", "--port", "0", "--metrics-port", "0") == (
        f"recserve serve: error: --repo {repo / 'demo'} is a model (its versions: 1, 10), not a repository: pass "
        f"the repository that holds it, {repo} {layout}")
    assert one_line(capsys, "serve", "--repo", repo / "demo" / "1", "--port", "0", "--metrics-port", "0") == (
        f"recserve serve: error: --repo {repo / 'demo' / '1'} is a model version (it holds manifest.json): pass the "
        f"repository that holds its model, {repo} {layout}")


def test_load_model_not_in_the_repository_is_refused_at_start(tmp_path, capsys):
    """explicit never polls: the server started, never said a word of the misspelt model, and never
    loaded it."""
    (tmp_path / "demo").mkdir()
    line = one_line(capsys, "serve", "--repo", tmp_path, "--port", "0", "--metrics-port", "0",
                    "--model-control", "explicit", "--load-model", "demo", "--load-model", "dmeo")
    assert line == f"recserve serve: error: --load-model dmeo: no such model in --repo {tmp_path} (its models: demo)"


def test_load_model_that_is_not_a_model_name_says_so_at_start(tmp_path, capsys):
    """A directory "my model" is in --repo, but is never a model (recserve/manifest.py MODEL_NAME_RE):
    the line said "no such model in --repo", as for a misspelt name, and not why."""
    (tmp_path / "demo").mkdir()
    (tmp_path / "my model").mkdir()
    line = one_line(capsys, "serve", "--repo", tmp_path, "--port", "0", "--metrics-port", "0",
                    "--model-control", "explicit", "--load-model", "my model")
    assert line == ("recserve serve: error: --load-model 'my model': not a model name: a model name is 1 to 128 "
                    "ASCII letters, digits, '_', '.' and '-', starting with a letter or digit")


def test_every_option_of_every_command_has_a_description():
    missing = []

    def walk(parser: argparse.ArgumentParser, command: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, name)
            elif not (action.help or "").strip():
                missing.append(f"{command} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "recserve")
    assert missing == []


def test_help_says_no_default_where_the_default_is_empty(capsys):
    """An empty default (predict --shared-features, models' model, serve --load-model) was printed as
    "(default: )" or "(default: [])"."""
    empty = {}
    for command in ("serve", "predict", "models", "bench"):
        with pytest.raises(SystemExit):
            run_cli(command, "--help")
        text = capsys.readouterr().out
        empty[command] = re.findall(r"\(default: (?:\[\])?\)", text)
    assert empty == {"serve": [], "predict": [], "models": [], "bench": []}


BAD_REQUESTS = {
    "unknown key": ({"dense": [[0.0] * 8], "sparse": {"user_id": [[1]]}, "Shared": {"item_id": [2]}},
                    "unknown key 'Shared'; the keys are ['dense', 'sparse', 'shared'] (\"shared\" optional)"),
    "float id": ({"dense": [[0.0] * 8], "sparse": {"user_id": [[1.9]]}},
                 "\"sparse\"['user_id'][0][0]: 1.9 is not an integer id"),
    "boolean id": ({"dense": [[0.0] * 8], "sparse": {"user_id": [[True]]}},
                   "\"sparse\"['user_id'][0][0]: true is not an integer id"),
    # These three were tracebacks (OverflowError), the fourth "not valid JSON (cannot reshape ...)"
    "id past int64": ({"dense": [[0.0] * 8], "sparse": {"user_id": [[2**64]]}},
                      "\"sparse\"['user_id'][0][0]: 18446744073709551616 is outside int64, the ids' type"),
    "shared id past int64": ({"dense": [[0.0] * 8], "sparse": {}, "shared": {"item_id": [-2**63 - 1]}},
                             "\"shared\"['item_id'][0]: -9223372036854775809 is outside int64, the ids' type"),
    "dense past float": ({"dense": [[10**400] + [0.0] * 7], "sparse": {}},
                         "\"dense\": a number is too large to be a float"),
    # float32's range ends at 3.4e38: this was sent as inf, the server's "non-finite value" after numpy's warning
    "dense past float32": ({"dense": [[3.5e38] + [0.0] * 7], "sparse": {}},
                           "\"dense\": a number is too large to be a float"),
    "no samples": ({"dense": [], "sparse": {}},
                   "\"dense\": expected a list of samples, each a list of the same count of numbers"),
    "boolean shared id": ({"dense": [[0.0] * 8], "sparse": {"user_id": [[1]]}, "shared": {"item_id": [False]}},
                          "\"shared\"['item_id'][0]: false is not an integer id"),
    "bags per sample": ({"dense": [[0.0] * 8] * 2, "sparse": {"user_id": [[1]]}},
                        "\"sparse\"['user_id']: 1 bags for 2 samples in \"dense\" (one bag per sample; an empty one "
                        "is [])"),
    "no sparse": ({"dense": [[0.0] * 8]}, "'sparse' is missing; the keys are ['dense', 'sparse', 'shared'] "
                                          "(\"shared\" optional)"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_predict_refuses_malformed_input_json_before_any_call(case, tmp_path, capsys):
    payload, message = BAD_REQUESTS[case]
    path = tmp_path / "request.json"
    path.write_text(json.dumps(payload))
    # Port 9 (discard): nothing listens; the input is refused before any connection is made.
    assert one_line(capsys, "predict", "--target", "127.0.0.1:9", "--model", "demo", "--input", path) == \
        f"recserve predict: error: --input {path}: {message}"


RANDOM_ONLY = ("recserve predict: error: --shared-features and --id-distribution shape --random requests; with "
               '--input the file says which features are shared ("shared") and what the ids are')


@pytest.mark.parametrize("args,line", [
    (["--random", "-1"], "recserve predict: error: --random must be >= 1 (samples to send), got -1"),
    (["--random", "2", "--target", "recserve.example"],
     "recserve predict: error: target 'recserve.example' names no port: pass HOST:PORT (recserve serve listens on "
     "port 50051 unless --port says otherwise)"),
    # gRPC dialed port 99999 - 65536 = 34463; an empty target was an IndexError traceback
    (["--random", "2", "--target", "localhost:99999"],
     "recserve predict: error: target 'localhost:99999': port 99999 is not a TCP port (1 to 65535)"),
    # a URL was "names no port" although it names one: gRPC targets take no scheme
    (["--random", "2", "--target", "http://localhost:50051"],
     "recserve predict: error: target 'http://localhost:50051': a gRPC target has no http:// scheme: pass HOST:PORT "
     "(TLS: --tls-ca, not https://)"),
    (["--random", "2", "--target", ""],
     "recserve predict: error: no target in '': pass HOST:PORT (recserve serve listens on port 50051 unless --port "
     "says otherwise)"),
    (["--random", "2", "--version", "99999999999999999999"],
     "recserve predict: error: --version must be 0 (the default), a version number (1 to 9223372036854775807) or a "
     "version label, got '99999999999999999999'"),
    # with --input both were ignored: the features named were sent per sample, the ids as the file has them
    (["--input", "in.json", "--shared-features", "user_id"], RANDOM_ONLY),
    (["--input", "in.json", "--id-distribution", "zipf:1.05"], RANDOM_ONLY),
    (["--random", "2", "--version", "²"],
     "recserve predict: error: --version must be 0 (the default), a version number (1 to 9223372036854775807) or a "
     "version label, got '²'"),
])
def test_predict_argument_errors(args, line, capsys):
    assert one_line(capsys, "predict", "--model", "demo", *args) == line


@pytest.mark.parametrize("command", [["predict", "--model", "demo", "--random", "2"], ["models", "list"]])
@pytest.mark.parametrize("timeout", ["inf", "1e10", "nan", "0"])
def test_a_timeout_grpc_cannot_keep_is_refused_before_any_call(command, timeout, capsys):
    """gRPC keeps a deadline as int64 nanoseconds since 1970: --timeout inf or 1e10 (and, for models,
    0 or nan, which it never checked) failed DEADLINE_EXCEEDED at once, a running server never asked."""
    line = one_line(capsys, *command, "--target", "127.0.0.1:1", "--timeout", timeout)
    assert line == f"recserve {command[0]}: error: --timeout must be > 0 and at most 86400 seconds, got {float(timeout):g}"


@pytest.mark.parametrize("flags,problem", [
    (["--tls-ca", "client.key"], "--tls-ca {d}/client.key: expected PEM CA certificates (OpenSSL: "
                                 "NO_CERTIFICATE_OR_CRL_FOUND)"),
    (["--tls-ca", "ca.pem", "--tls-cert", "client.key", "--tls-key", "client.pem"],
     "--tls-cert {d}/client.key / --tls-key {d}/client.pem: expected a PEM certificate chain and its unencrypted PEM "
     "key (OpenSSL: [SSL] PEM lib (_ssl.c:"),
])
def test_client_tls_files_that_are_not_what_they_say_are_one_line(flags, problem, certs, capsys):  # noqa: F811
    """gRPC took them and failed the call 'UNAVAILABLE: failed to connect to all addresses', as if the
    server were down, after native 'Handshaker factory creation failed' lines."""
    flags = [str(certs / f) if f.endswith((".key", ".pem")) else f for f in flags]
    line = one_line(capsys, "predict", "--model", "demo", "--random", "1", "--target", "127.0.0.1:9", *flags)
    assert line.startswith("recserve predict: error: " + problem.format(d=certs)), line


def test_client_refuses_a_target_without_a_port_and_takes_the_forms_grpc_knows():
    from recserve.errors import UserError

    for target in ("localhost", "10.0.0.1", "[::1]", "::1", "host:"):
        with pytest.raises(UserError, match="names no port"):
            Client(target)
    for target in ("localhost:0", "localhost:65536", "[::1]:99999", ["a:1", "b:70000"]):
        with pytest.raises(UserError, match="is not a TCP port"):
            Client(target)
    for target in ("", " , ", []):
        with pytest.raises(UserError, match="no target in"):
            Client(target)
    for target in ("localhost:50051", "[::1]:50051", "unix:/tmp/recserve.sock", "dns:///recserve:50051"):
        Client(target).close()


def test_inspect_of_a_model_directory_says_which_version_to_pass(repo, capsys):
    assert one_line(capsys, "inspect", repo / "demo") == (
        f"recserve inspect: error: {repo / 'demo'} is a model, not a version: pass REPO/NAME/VERSION, e.g. "
        f"{repo / 'demo' / '1'} (versions: 1)")


def test_inspect_of_what_is_no_version_directory_says_what_to_pass(repo, tmp_path, capsys):
    """An empty folder, a missing one, a repository and a file were each "PATH/manifest.json: no
    manifest" (or "cannot read (Not a directory)"): what is missing, not what to pass."""
    (tmp_path / "empty").mkdir()
    error, what = "recserve inspect: error:", "pass an artifact's version directory, REPO/NAME/VERSION"
    assert one_line(capsys, "inspect", tmp_path / "empty") == (
        f"{error} {tmp_path / 'empty'} holds no manifest.json, so it is no artifact's version directory; pass "
        "REPO/NAME/VERSION (recserve export --repo REPO --name NAME writes one)")
    assert one_line(capsys, "inspect", tmp_path / "nope") == f"{error} {tmp_path / 'nope'}: no such directory; {what}"
    assert one_line(capsys, "inspect", repo) == (
        f"{error} {repo} is a model repository, not a version: pass REPO/NAME/VERSION, e.g. {repo / 'demo' / '1'} "
        "(models: demo)")
    assert one_line(capsys, "inspect", repo / "demo" / "1" / "model.pt") == (
        f"{error} {repo / 'demo' / '1' / 'model.pt'} is a file; {what}")
    capsys.readouterr()
    assert run_cli("inspect", repo / "demo" / "1") == 0
    assert capsys.readouterr().out.startswith("demo version 1 (dlrm)")


def test_bench_says_what_to_pass(repo, tmp_path, capsys):
    assert one_line(capsys, "bench", "--name", "demo") == (
        "recserve bench: error: pass --repo REPO (the model repository holding --name) or --target HOST:PORT (a "
        "running recserve serve)")
    missing = tmp_path / "nowhere"
    assert one_line(capsys, "bench", "--repo", missing, "--name", "demo") == (
        f"recserve bench: error: --repo {missing} is not a directory; pass the model repository holding 'demo' "
        "(REPO/NAME/VERSION/)")
    assert one_line(capsys, "bench", "--repo", repo, "--name", "other") == (
        f"recserve bench: error: no version of 'other' in {repo}; its models: ['demo'] (pass one as --name, or "
        "export one there first)")
    assert one_line(capsys, "bench", "--repo", repo, "--name", "demo", "--target", "127.0.0.1:9") == (
        "recserve bench: error: --repo is for a server the bench starts; with --target the running server's model "
        "is measured: drop --repo")
    for flags, line in [(["--batch-sizes", "256,-4"], "--batch-sizes must be >= 1, got -4"),
                        (["--concurrency", "0"], "--concurrency must be >= 1, got 0"),
                        (["--duration", "-1"], "--duration must be > 0 seconds, got -1"),
                        (["--ids-per-bag", "-1"], "--ids-per-bag must be >= 0 (a mean number of ids), got -1")]:
        assert one_line(capsys, "bench", "--repo", repo, "--name", "demo", *flags) == "recserve bench: error: " + line


def test_bench_output_in_a_missing_directory_is_refused_before_the_run(repo, tmp_path, capsys):
    """The figures were written after the whole run: a FileNotFoundError traceback, the JSON lost."""
    out = tmp_path / "nowhere" / "figures.json"
    line = one_line(capsys, "bench", "--repo", repo, "--name", "demo", "--no-served", "--batch-sizes", "4",
                    "--duration", "0.1", "--json", out)
    assert line == f"recserve bench: error: --json {out}: {out.parent} is not a directory"


def test_bench_passes_on_the_servers_refusal_of_a_flag_in_one_line(repo, capsys):
    """A bench flag that `recserve serve` refuses (the bench passes it on) is the bench's one-line user
    error, exit 2: it was a RuntimeError traceback with the server's output, exit 1. (--replicas beyond
    the cores: the bench checks only its form, the server the count.)"""
    from serving.machine import usable_cores

    assert cli_error(capsys, "bench", "--repo", repo, "--name", "demo", "--device", "cpu", "--batch-sizes", "4",
                     "--concurrency", "1", "--duration", "0.1", "--no-floor", "--replicas", "1000") == (
        f"recserve bench: error: --replicas 1000: more CPU engines than the {usable_cores()} cores this server may "
        "use; each loads its own copy of every model: give at most that many")


def test_bench_target_measures_the_server_without_a_repo_or_a_local_model(repo, capsys, monkeypatch):
    import bench.bare

    def no_local_model(*args, **kwargs):
        raise AssertionError("bench --target ran the model locally")

    monkeypatch.setattr(bench.bare, "bench_bare", no_local_model)
    server = InProcessServer(repo)
    try:
        capsys.readouterr()
        assert run_cli("bench", "--target", server.target, "--name", "demo", "--batch-sizes", "4",
                       "--concurrency", "1", "--duration", "0.5") == 0
    finally:
        server.stop()
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("served", "bare", "floor"))]
    assert [row[:3] for row in rows] == [["served", "4", "1"]], out
    assert f"demo v1 on cpu (served by {server.target})" in out


def test_bench_target_refusal_is_one_line(repo, capsys):
    """A model the server does not serve (or a bad token, a server that is down) was the RpcError's traceback."""
    server = InProcessServer(repo)
    try:
        line = one_line(capsys, "bench", "--target", server.target, "--name", "nosuch", "--duration", "0.5")
    finally:
        server.stop()
    assert line == "recserve bench: error: NOT_FOUND: model 'nosuch' is not loaded; loaded: ['demo']"


@pytest.mark.parametrize("command", [["train-demo", "--steps", "1"], ["bench-checkpoint", "--rows-per-table", "8"]])
def test_a_checkpoint_command_refuses_to_overwrite_a_checkpoint_unless_forced(command, tmp_path, capsys):
    """bench-checkpoint overwrote a checkpoint in --out without a word, where train-demo asks for --force."""
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "model_config.json").write_text("{}")
    assert one_line(capsys, *command, "--out", out) == (
        f"recserve {command[0]}: error: --out {out} already holds a checkpoint (model_config.json); pass --force "
        "to overwrite it or choose another --out")
    assert (out / "model_config.json").read_text() == "{}"
    assert run_cli(*command, "--out", out, "--force") == 0
    assert json.loads((out / "model_config.json").read_text())["tables"]


# -- the plan file: every key known ------------------------------------------------------------

@pytest.mark.parametrize("plan,message", [
    ({"table": {"t_user": {"rank": 0}}}, "unknown key 'table'; the keys are ['tables', 'world_size']"),
    ({"tables": {"t_user": {"shardng": "row_wise"}}},
     "table 't_user' (table_wise): unknown key 'shardng'; the keys are ['cache_load_factor', 'dtype', 'placement', "
     "'rank', 'sharding']"),
    ({"world_size": 2, "tables": {"t_user": {"sharding": "table_wise", "ranks": [1]}}},
     "table 't_user' (table_wise): unknown key 'ranks'; the keys are ['cache_load_factor', 'dtype', 'placement', "
     "'rank', 'sharding']"),
    ({"world_size": 2, "tables": {"t_user": {"sharding": "column_wise", "rank": 1}}},
     "table 't_user' (column_wise): unknown key 'rank'; the keys are ['cache_load_factor', 'dtype', 'placement', "
     "'ranks', 'sharding']"),
    ({"world_size": True}, "\"world_size\" must be an integer, got True"),
])
def test_plan_file_keys_are_all_known(plan, message, checkpoint, tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    repo = tmp_path / "repo"
    assert one_line(capsys, "export", "--checkpoint", checkpoint, "--repo", repo, "--name", "m", "--no-progress",
                    "--plan", path) == f"recserve export: error: plan file {path}: {message}"
    assert not repo.exists()


@pytest.mark.parametrize("value", ["nan", "inf", "0"])
def test_export_memory_budget_must_be_a_finite_positive_number(value, checkpoint, tmp_path, capsys):
    """nan and inf were a ValueError / OverflowError traceback from int(budget * 2**30)."""
    repo = tmp_path / "repo"
    assert one_line(capsys, "export", "--checkpoint", checkpoint, "--repo", repo, "--name", "m", "--no-progress",
                    "--device-memory-gb", value) == \
        f"recserve export: error: --device-memory-gb must be a finite number > 0, got {value}"
    assert not repo.exists()


# -- commands as a user runs them --------------------------------------------------------------

def run_python(code: str, *, env: dict = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, **(env or {})})


CLI_WITHOUT = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # `import name` raises ModuleNotFoundError, as where it is not installed
from recserve.cli import main
code = main({argv!r})
print("torch imported" if "torch" in sys.modules else "torch not imported")
sys.exit(code)
"""


# "repo is a file": the whole export ran, then "writing REPO/m/1 failed: Not a directory; ... free disk space"
@pytest.mark.parametrize("case", ["plan key", "world size", "dense dtype on cpu", "device", "checkpoint", "name",
                                  "version 0", "existing version", "repo is a file"])
def test_export_argument_errors_come_before_torch_is_imported(case, checkpoint, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"tables": {"t_user": {"placment": "uvm"}}}))
    if case == "repo is a file":
        (tmp_path / "repo").write_text("notes")
    else:
        (tmp_path / "repo" / "m" / "1").mkdir(parents=True)
    args = {"plan key": ["--plan", plan], "world size": ["--world-size", "0"],
            "dense dtype on cpu": ["--dense-dtype", "tf32"], "device": ["--device", "gpu"],
            "checkpoint": [], "name": ["--name", "a/b"], "version 0": ["--version", "0"],
            "existing version": ["--version", "1"], "repo is a file": []}[case]
    ckpt = tmp_path / "nowhere" if case == "checkpoint" else checkpoint
    argv = ["export", "--checkpoint", str(ckpt), "--repo", str(tmp_path / "repo"), "--name", "m", *map(str, args)]
    proc = run_python(CLI_WITHOUT.format(blocked=[], argv=argv))
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("recserve export: error: "), proc.stderr
    assert proc.stdout.strip() in ("torch not imported", ""), proc.stdout  # "": argparse exits before the print
    if case == "repo is a file":
        assert lines[0] == f"recserve export: error: --repo {tmp_path / 'repo'} is not a directory"


def test_train_demo_without_torchrec_names_what_to_install(tmp_path):
    """It said pip install ".[cpu]" (a source checkout only) and torchrec>=1.6.1,<1.9, which picks
    torchrec 1.8 next to torch 2.11: versions built for another torch."""
    torch = importlib.metadata.version("torch")
    minor = ".".join(torch.split(".")[:2])
    built = {"2.11": "1.6", "2.12": "1.7", "2.13": "1.8"}[minor]
    proc = run_python(CLI_WITHOUT.format(blocked=["torchrec"], argv=["train-demo", "--out", str(tmp_path / "c")]))
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"recserve train-demo: error: this command needs torchrec, which is not installed: pip install "
        f"\"fbgemm-gpu-cpu=={built}.*\" (\"fbgemm-gpu=={built}.*\" with a GPU), then pip install --no-deps "
        f"\"torchrec=={built}.*\" (built for torch {minor})"], proc.stderr


CLI_WITH_VERSIONS = """
import importlib.metadata, sys
installed = {versions!r}
def version(name):
    if installed.get(name) is None:
        raise importlib.metadata.PackageNotFoundError(name)
    return installed[name]
importlib.metadata.version = version
from recserve.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("versions,line", [
    ({"torch": "2.13.0+cpu", "fbgemm-gpu-cpu": "1.6.0", "torchrec": "1.8.0"},
     "fbgemm-gpu-cpu 1.6.0 was built for another torch than the installed 2.13.0+cpu: pip install "
     "\"fbgemm-gpu-cpu==1.8.*\" (\"fbgemm-gpu==1.8.*\" with a GPU), then pip install --no-deps \"torchrec==1.8.*\" "
     "(built for torch 2.13)"),
    ({"torch": "2.11.0", "fbgemm-gpu": "1.8.0", "torchrec": "1.8.0"},
     "fbgemm-gpu 1.8.0 and torchrec 1.8.0 were built for another torch than the installed 2.11.0: pip install "
     "\"fbgemm-gpu-cpu==1.6.*\" (\"fbgemm-gpu==1.6.*\" with a GPU), then pip install --no-deps \"torchrec==1.6.*\" "
     "(built for torch 2.11)"),
    # Both fbgemm builds installed (one module, fbgemm_gpu), one stale: pip install of the fitting one, as
    # told, found it installed already and the same line came back for good.
    ({"torch": "2.13.0", "fbgemm-gpu": "1.7.0", "fbgemm-gpu-cpu": "1.8.0", "torchrec": "1.8.0"},
     "fbgemm-gpu 1.7.0 was built for another torch than the installed 2.13.0: pip uninstall -y fbgemm-gpu-cpu "
     "fbgemm-gpu (both are installed, one module: fbgemm_gpu), then pip install \"fbgemm-gpu-cpu==1.8.*\" "
     "(\"fbgemm-gpu==1.8.*\" with a GPU), then pip install --no-deps \"torchrec==1.8.*\" (built for torch 2.13)"),
])
def test_fbgemm_or_torchrec_built_for_another_torch_is_one_line_before_anything_runs(versions, line, tmp_path):
    """pip pairs any fbgemm with any torch (neither wheel names its torch): fbgemm 1.8 next to torch 2.11
    failed every export with an "undefined symbol" traceback from torch.ops.load_library, and every
    model of serve with it in a log line."""
    proc = run_python(CLI_WITH_VERSIONS.format(versions=versions, argv=["train-demo", "--out", str(tmp_path / "c")]))
    assert proc.returncode == 2 and proc.stderr.splitlines() == [f"recserve train-demo: error: {line}"], proc.stderr
    assert not (tmp_path / "c").exists()


def test_bench_plot_without_matplotlib_says_so_before_the_run(repo, tmp_path):
    """matplotlib is a dev extra: the plot was drawn after the whole run, a ModuleNotFoundError traceback."""
    argv = ["bench", "--repo", str(repo), "--name", "demo", "--no-served", "--batch-sizes", "4", "--duration", "0.1",
            "--plot", str(tmp_path / "plot.png")]
    proc = run_python(CLI_WITHOUT.format(blocked=["matplotlib"], argv=argv))
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "recserve bench: error: --plot needs matplotlib, which is not installed: pip install matplotlib"], proc.stderr
    assert proc.stdout.strip() == "torch not imported"


def test_bench_checkpoint_draws_no_progress_bar_into_a_pipe(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "recserve", "bench-checkpoint", "--out", str(tmp_path / "c"),
                           "--rows-per-table", "4", "--model", "dlrm"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "\r" not in proc.stderr and "random weights" not in proc.stderr, proc.stderr[-2000:]


def serve(repo: Path, *flags: str, env: dict = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recserve", "--log-level", "WARNING", "serve", "--repo", str(repo),
                           "--port", "0", "--device", "cpu", "--frontends", "1", *flags], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout, env={**os.environ, **(env or {})})


def test_serve_without_fbgemm_stops_at_start_in_one_line(tmp_path):
    """fbgemm was first imported by a model's load: serve started, refused every model with a
    ModuleNotFoundError log line and served on with none."""
    (tmp_path / "shadow" / "fbgemm_gpu").mkdir(parents=True)  # found first: `import fbgemm_gpu` fails as if absent
    (tmp_path / "shadow" / "fbgemm_gpu" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'fbgemm_gpu'\", name='fbgemm_gpu')\n")
    (tmp_path / "repo").mkdir()
    proc = serve(tmp_path / "repo", "--metrics-port", "0", env={"PYTHONPATH": str(tmp_path / "shadow")}, timeout=90)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(
        "recserve serve: error: this command needs fbgemm_gpu, which is not installed: pip install "
        "\"fbgemm-gpu-cpu=="), proc.stderr


def test_a_busy_metrics_port_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = serve(tmp_path, "--metrics-port", str(port))
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"recserve serve: error: cannot listen on 127.0.0.1:{port} (Address already in use); choose another "
        "--metrics-port or --host"], proc.stderr


def test_device_cuda_without_a_gpu_is_the_engines_one_line(tmp_path):
    proc = serve(tmp_path, "--metrics-port", "0", "--device", "cuda", env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "recserve serve: error: --device cuda: no CUDA device is visible; use --device cpu or auto"], proc.stderr


def test_a_tls_key_that_does_not_match_its_certificate_is_said_so(tmp_path, certs):  # noqa: F811
    proc = serve(tmp_path, "--metrics-port", "0", "--tls-cert", str(certs / "server.pem"),
                 "--tls-key", str(certs / "client.key"))
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"recserve serve: error: --tls-cert {certs / 'server.pem'} / --tls-key {certs / 'client.key'}: the key does "
        "not match the certificate: pass the key it was made for"], proc.stderr


def test_json_logs_are_json_on_every_stderr_line_grpc_cores_included(repo, certs, tmp_path):  # noqa: F811
    """A TLS handshake that fails makes gRPC core log through abseil, straight to file descriptor 2."""
    server = subprocess.Popen(
        [sys.executable, "-m", "recserve", "--log-format", "json", "serve", "--repo", str(repo), "--port", "0",
         "--device", "cpu", "--frontends", "1", "--metrics-port", "0", "--tls-cert", str(certs / "server.pem"),
         "--tls-key", str(certs / "server.key")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        listening = server.stdout.readline()
        port = int(re.search(r"listening on [\d.]+:(\d+)", listening)[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # plaintext to a TLS port
            with pytest.raises(grpc.FutureTimeoutError):
                grpc.channel_ready_future(channel).result(timeout=2)
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            raw.recv(100)
        time.sleep(0.5)
    finally:
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=60)
    assert server.returncode == 0, err[-3000:]
    entries = [json.loads(line) for line in err.splitlines()]  # every line, or this raises
    assert all(isinstance(e, dict) and {"ts", "level", "logger", "message", "pid", "role"} <= set(e) for e in entries)
    handshakes = [e for e in entries if e["logger"] == "grpc" and "Handshake failed" in e["message"]]
    assert handshakes and {e["role"] for e in handshakes} == {"frontend-0"}, err[-3000:]
    assert any(e["role"] == "engine" and e["message"].startswith("loaded demo version 1") for e in entries)


def test_a_user_error_under_json_logs_is_one_json_line(tmp_path, certs):  # noqa: F811
    proc = subprocess.run([sys.executable, "-m", "recserve", "--log-format", "json", "serve", "--repo", str(tmp_path),
                           "--port", "0", "--device", "cpu", "--frontends", "1", "--metrics-port", "0",
                           "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "client.key")],
                          capture_output=True, text=True, cwd=ROOT, timeout=180)
    entries = [json.loads(line) for line in proc.stderr.splitlines()]
    errors = [e for e in entries if e["level"] == "ERROR"]
    assert proc.returncode == 2 and len(errors) == 1 and errors[0]["message"].startswith(
        "recserve serve: error: --tls-cert ") and errors[0]["role"] == "supervisor", proc.stderr
    # argparse's errors too, though they come before the arguments are parsed
    proc = subprocess.run([sys.executable, "-m", "recserve", "--log-format", "json", "serve", "--repo", str(tmp_path),
                           "--port", "abc"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and [json.loads(line)["message"] for line in proc.stderr.splitlines()] == [
        "recserve serve: error: argument --port: invalid int value: 'abc' (see recserve serve --help)"]


EXPORT_DIES_OF_SIGSEGV = """
import os, signal, sys
import export.cli
export.cli._export = lambda args: os.kill(os.getpid(), signal.SIGSEGV)  # a native library's bug mid-export
from recserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_an_export_dead_of_a_fatal_signal_prints_the_python_stack(log_format, tmp_path):
    """Under JSON too: there file descriptor 2 is a pipe that this process empties, gone with it."""
    proc = subprocess.run([sys.executable, "-c", EXPORT_DIES_OF_SIGSEGV, "--log-format", log_format, "export",
                           "--checkpoint", str(tmp_path), "--repo", str(tmp_path / "repo"), "--name", "m"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == -signal.SIGSEGV, proc.stderr[-3000:]
    assert "Fatal Python error: Segmentation fault" in proc.stderr, proc.stderr[-3000:]
    assert re.search(r'^  File "[^"]+/recserve/cli\.py", line \d+ in main$', proc.stderr, re.M), proc.stderr[-3000:]


def test_docs_commands_and_the_serve_synopsis_match_the_parser():
    parser = build_parser()
    # docs/benchmarks.md's opening commands are what a reader runs first: they must parse today.
    opening = (ROOT / "docs" / "benchmarks.md").read_text().split("\n## ")[0]
    commands = re.findall(r"^\s+recserve (.+)$", opening.replace("\\\n", " "), re.M)
    assert len(commands) >= 3
    for command in commands:
        parser.parse_args(command.split())
    # The README's serve synopsis names every flag of serve.
    readme = (ROOT / "README.md").read_text()
    synopsis = readme[readme.index("recserve [--log-level"):readme.index("recserve predict [")]
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    flags = {f for a in serve._actions for f in a.option_strings if f.startswith("--") and f != "--help"}
    assert sorted(f for f in flags if f not in synopsis) == []



def test_the_readme_names_every_flag_of_every_command():
    """README's synopses lacked flags --help shows (predict --timeout, models --timeout, bench
    --duration, --ids-per-bag, --no-served ...): a reader of the README did not learn that a slow
    load needs models --timeout, or how long a bench runs."""
    readme = (ROOT / "README.md").read_text()
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = sorted(f"{name} {flag}" for name, parser in commands.items() for action in parser._actions
                     for flag in action.option_strings if flag.startswith("--") and flag != "--help"
                     and not re.search(re.escape(flag) + r"(?![\w-])", readme))
    assert missing == []


# -- the client on a host without torch --------------------------------------------------------

CLIENT_SCRIPT = """
import json, sys
import numpy as np
from recserve.client import Client
try:
    import torch  # noqa: F401
    sys.exit("torch is importable in this venv")
except ImportError:
    pass
dense = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
with Client(sys.argv[1]) as client:
    ctr = client.predict("demo", dense, {"user_id": [[3], [7]], "item_id": [[1, 2], []], "topics": [[5], [6, 7]]},
                         shared=None)
    info = client.model_info("demo").models[0]
print(json.dumps({"ctr": ctr.tolist(), "features": [f.name for f in info.features],
                  "heavy": sorted(m for m in ("torch", "torchrec", "fbgemm_gpu") if m in sys.modules)}))
"""


def _with_requirements(names):
    """The installed distributions ``names`` and what they require (extras left out)."""
    from packaging.requirements import Requirement

    found, todo = {}, list(names)
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        if dist.metadata["Name"].lower() not in found:
            found[dist.metadata["Name"].lower()] = dist
            todo += [r.name for r in map(Requirement, dist.requires or ())
                     if not r.marker or r.marker.evaluate({"extra": ""})]
    return list(found.values())


def test_client_works_in_a_venv_with_only_grpcio_protobuf_and_numpy(repo, tmp_path):
    """A real venv holding grpcio, protobuf and numpy (linked from this installation: no network) and
    the recserve package as installed files, nothing else: torch cannot be imported there."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    for dist in _with_requirements(["grpcio", "protobuf", "numpy"]):
        for top in {f.parts[0] for f in dist.files if f.parts[0] != ".."}:
            (site / top).symlink_to(dist.locate_file(top))
    shutil.copytree(ROOT / "recserve", site / "recserve", ignore=shutil.ignore_patterns("__pycache__"))
    server = InProcessServer(repo)
    try:
        proc = subprocess.run([str(venv / "bin" / "python"), "-c", CLIENT_SCRIPT, server.target], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path, env={"PATH": os.environ["PATH"]})
        assert proc.returncode == 0, proc.stderr[-3000:]
        dense = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
        with Client(server.target) as client:
            expected = client.predict("demo", dense, {"user_id": [[3], [7]], "item_id": [[1, 2], []],
                                                      "topics": [[5], [6, 7]]})
    finally:
        server.stop()
    result = json.loads(proc.stdout)
    assert result["heavy"] == [] and result["features"] == ["user_id", "item_id", "topics"]
    assert np.array_equal(np.asarray(result["ctr"], np.float32), expected)


def test_reflection_needs_no_token_like_health_and_inference_does(repo, tmp_path):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    tokens = tmp_path / "tokens"
    tokens.write_text("secret\n")
    server = InProcessServer(repo, settings={"auth_token_file": tokens})
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            answers = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                     timeout=10))
            services = {s.name for s in answers[0].list_services_response.service}
            assert "recserve.v1.Inference" in services
            with pytest.raises(grpc.RpcError) as exc, Client(server.target) as client:
                client.model_info("demo")
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop()


def test_a_host_that_does_not_resolve_is_named_in_one_line(tmp_path, capsys):
    """It said "cannot listen on nosuch.invalid:9400 (Unknown error -2)" (the resolver's error number
    read as an errno), or, with --metrics-port 0, blamed a busy port after gRPC core's own log line."""
    try:
        socket.getaddrinfo("nosuch.invalid", None)
    except socket.gaierror as e:
        reason = e.strerror
    line = one_line(capsys, "serve", "--repo", tmp_path, "--host", "nosuch.invalid", "--metrics-port", "0")
    assert line == (f"recserve serve: error: --host nosuch.invalid does not resolve ({reason}); give an address "
                    "or name of this machine (127.0.0.1, or 0.0.0.0 for every interface)")


def test_a_host_not_of_this_machine_is_one_line_with_any_free_port(tmp_path):
    """--port 0 was not checked before gRPC bound it: gRPC core's own log line came first, then ours
    blaming "the port is in use or the address is not local"."""
    proc = serve(tmp_path, "--host", "192.0.2.1", "--metrics-port", "0")  # TEST-NET-1: never an address of a host
    # The engine may have read the (empty) repository first and said so: a line of its own, not about this.
    lines = [line for line in proc.stderr.splitlines() if "starting with no model" not in line]
    assert proc.returncode == 2 and lines == [
        "recserve serve: error: cannot listen on 192.0.2.1:0 (Cannot assign requested address); choose another "
        "--port or --host"], proc.stderr


def test_front_end_buffers_larger_than_the_machine_are_refused_before_start(tmp_path, capsys):
    """A front end failed mapping its buffer (ENOMEM) with a traceback, or, a little below that,
    faulted the whole of it in and woke the OOM killer."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    line = one_line(capsys, "serve", "--repo", tmp_path, "--frontends", "2", "--frontend-buffer-mb", "100000000",
                    "--port", "0", "--metrics-port", "0")
    assert line == ("recserve serve: error: --frontend-buffer-mb 1e+08 x 2 front ends is more than the memory this "
                    f"server may use ({memory / 2**30:.1f} GiB: the machine's, or its container's limit); every front "
                    "end's buffer is resident: give a smaller --frontend-buffer-mb or fewer --frontends")


def test_front_end_buffers_larger_than_the_containers_memory_limit_are_refused(tmp_path, capsys, monkeypatch):
    """The check compared with the host's physical memory: in a container limited to 4 GiB, 2 x 3000 MB
    of buffers passed it and the front ends faulting them in met the cgroup's OOM killer."""
    import serving.machine

    monkeypatch.setattr(serving.machine, "usable_memory", lambda: 4 * 2**30)
    line = one_line(capsys, "serve", "--repo", tmp_path, "--frontends", "2", "--frontend-buffer-mb", "3000",
                    "--port", "0", "--metrics-port", "0")
    assert line == ("recserve serve: error: --frontend-buffer-mb 3000 x 2 front ends is more than the memory this "
                    "server may use (4.0 GiB: the machine's, or its container's limit); every front end's buffer is "
                    "resident: give a smaller --frontend-buffer-mb or fewer --frontends")


def test_bench_target_at_a_dead_port_says_so_at_once(capsys, monkeypatch):
    """It asked again for 30 s (the retry meant for a server the bench has just started) before its line."""
    import bench.served

    def no_retry(seconds):
        raise AssertionError("bench --target asked a dead port again")

    monkeypatch.setattr(bench.served.time, "sleep", no_retry)
    from recserve.local import free_port

    target = f"127.0.0.1:{free_port()}"
    line = one_line(capsys, "bench", "--target", target, "--name", "demo", "--duration", "0.5")
    assert line.startswith("recserve bench: error: UNAVAILABLE: ") and target in line, line


@pytest.mark.parametrize("flags", [["--shared-pooling", "once"], ["--max-delay-ms", "1"], ["--max-batch-size", "64"],
                                   ["--frontends", "2"], ["--replicas", "auto"], ["--no-cuda-graphs"],
                                   ["--device", "cuda"]])
def test_bench_target_refuses_the_flags_of_a_server_it_starts(flags, capsys):
    """They were ignored: the running server's settings applied, and the report said the flags' values."""
    line = one_line(capsys, "bench", "--target", "127.0.0.1:9", "--name", "demo", *flags)
    assert line == (f"recserve bench: error: {flags[0]} sets up the server the bench starts; with --target the "
                    "running server's own settings apply: drop it")


def test_bench_target_does_not_report_a_shared_pooling_it_cannot_know(repo, capsys):
    """The ranking-requests line said 'server --shared-pooling expand' of a server running 'once'."""
    server = InProcessServer(repo, {"shared_pooling": "once"})
    try:
        capsys.readouterr()
        assert run_cli("bench", "--target", server.target, "--name", "demo", "--batch-sizes", "4",
                       "--concurrency", "1", "--duration", "0.2", "--shared-features", "1") == 0
    finally:
        server.stop()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ranking requests")]
    assert lines == ["ranking requests: features 1 one bag per request (50 ids mean), the others 10 ids per sample; "
                     "server --shared-pooling as the target runs it"], lines


@pytest.mark.parametrize("rows", ["0", "-5"])
def test_bench_checkpoint_with_no_rows_says_so_and_leaves_no_folder(rows, tmp_path, capsys):
    """--out was made first: the refusal (naming model_config.json's num_embeddings, a file the user
    never wrote) left an empty folder behind."""
    out = tmp_path / "ckpt"
    assert one_line(capsys, "bench-checkpoint", "--out", out, "--rows-per-table", rows) == (
        f"recserve bench-checkpoint: error: --rows-per-table must be >= 1, got {rows}")
    assert not out.exists()


@pytest.mark.parametrize("device, replicas, cores, gpus, message", [
    ("cuda", "4", 16, ["0", "1"], "--replicas 4: 2 GPU(s) visible; one engine runs per GPU: give at most 2, or auto"),
    ("cpu", "1000", 16, [], "--replicas 1000: more CPU engines than the 16 cores this server may use; each loads "
                            "its own copy of every model: give at most that many"),
])
def test_serve_refuses_more_replicas_than_the_machine_can_run(device, replicas, cores, gpus, message, tmp_path,
                                                             capsys, monkeypatch):
    """On CUDA, --replicas 4 with 2 GPUs visible started 2 engines without a word; on the CPU,
    --replicas 1000 (a typo) started 1000 engine processes, each loading its own copy of every model."""
    import serving.machine
    import serving.supervisor

    monkeypatch.setattr(serving.supervisor, "visible_gpus", lambda device: gpus)
    monkeypatch.setattr(serving.machine, "usable_cores", lambda: cores)
    monkeypatch.setattr(serving.supervisor, "serve", lambda config, log_level: 0)  # not started here
    assert cli_error(capsys, "serve", "--repo", tmp_path, "--device", device, "--replicas", replicas) == (
        f"recserve serve: error: {message}")


def test_serve_refuses_fewer_max_connections_than_front_ends(tmp_path, capsys, monkeypatch):
    """--max-connections is split over the front ends, each taking at least one: --max-connections 2
    with 4 front ends let 4 connections in, twice the cap the operator set."""
    import serving.supervisor

    monkeypatch.setattr(serving.supervisor, "serve", lambda config, log_level: 0)  # not started here
    assert cli_error(capsys, "serve", "--repo", tmp_path, "--max-connections", "2", "--frontends", "4") == (
        "recserve serve: error: --max-connections 2 is fewer than the 4 front ends, which take at least one "
        "connection each: give at least 4, or fewer --frontends")


def _never_started(*args, **kwargs):
    raise AssertionError("the server started")


@pytest.mark.parametrize("flags,problem", [
    (["--tls-cert", "{d}/missing.pem", "--tls-key", "{d}/server.key"],
     "--tls-cert {d}/missing.pem: cannot read (No such file or directory)"),
    (["--tls-cert", "{d}/server.pem", "--tls-key", "{d}/client.key"],
     "--tls-cert {d}/server.pem / --tls-key {d}/client.key: the key does not match the certificate: pass the key it "
     "was made for"),
    (["--tls-cert", "{d}/server.key", "--tls-key", "{d}/server.pem"],
     "--tls-cert {d}/server.key / --tls-key {d}/server.pem: expected a PEM certificate chain and its unencrypted PEM "
     "key (OpenSSL: "),  # then OpenSSL's words, which differ between its versions
    (["--tls-cert", "{d}/server.pem"], "TLS needs both --tls-cert and --tls-key (--tls-client-ca adds client "
                                       "certificates)"),
    (["--tls-cert", "{d}/server.pem", "--tls-key", "{d}/server.key", "--tls-client-ca", "{d}/server.key"],
     "--tls-client-ca {d}/server.key: expected PEM CA certificates (OpenSSL: NO_CERTIFICATE_OR_CRL_FOUND)"),
    (["--auth-token-file", "{d}/missing"], "--auth-token-file {d}/missing: cannot read (No such file or directory)"),
    (["--auth-token-file", "{d}/empty"], "--auth-token-file {d}/empty: no token in it (one token per line)"),
    (["--otlp-endpoint", "http://[::1"], "--otlp-endpoint http://[::1: not a URL (Invalid IPv6 URL)"),
])
def test_tls_token_and_otlp_errors_are_one_line_before_anything_starts(flags, problem, certs, tmp_path, capsys,
                                                                      monkeypatch):  # noqa: F811
    """Front end 0 found these only after the engine had started (10-20 s with models to load)."""
    from serving import supervisor

    monkeypatch.setattr(supervisor, "serve", _never_started)
    (certs / "empty").write_text("# no token yet\n")
    d = str(certs)
    line = one_line(capsys, "serve", "--repo", tmp_path, "--device", "cpu", *(f.format(d=d) for f in flags))
    expected = f"recserve serve: error: {problem.format(d=d)}"
    assert line.startswith(expected) if expected.endswith("(OpenSSL: ") else line == expected


def test_otlp_endpoint_without_opentelemetry_is_one_line_before_anything_starts(tmp_path, capsys, monkeypatch):
    from serving import supervisor

    monkeypatch.setattr(supervisor, "serve", _never_started)
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    assert one_line(capsys, "serve", "--repo", tmp_path, "--device", "cpu", "--otlp-endpoint",
                    "http://collector:4317") == ("recserve serve: error: --otlp-endpoint needs OpenTelemetry: pip "
                                                 "install 'recserve[tracing]'")


def test_a_tmpdir_too_long_for_the_engines_sockets_is_one_line_and_exit_2(tmp_path):
    """The engines' Unix sockets live in a folder under TMPDIR: beyond 107 bytes the engine failed with
    a traceback (AF_UNIX path too long) and the server exited 1."""
    tmp = tmp_path / ("t" * max(1, 100 - len(str(tmp_path))))
    tmp.mkdir()
    (tmp_path / "repo").mkdir()
    proc = serve(tmp_path / "repo", "--metrics-port", "0", env={"TMPDIR": str(tmp)})
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and re.fullmatch(
        rf"recserve serve: error: the engines' sockets would be {re.escape(str(tmp))}/recserve-held-\w+/engine-0\.sock, "
        r"\d+ bytes, beyond the 107 bytes of a Unix socket's path: set TMPDIR to a shorter directory \(as "
        r"TMPDIR=/tmp\)", lines[0]), proc.stderr
    assert list(tmp.iterdir()) == []  # the server's folder, removed


@pytest.mark.parametrize("host, tls, warned", [
    ("0.0.0.0", False, True), ("10.1.2.3", False, True), ("::", False, True),
    ("127.0.0.1", False, False), ("localhost", False, False), ("::1", False, False), ("0.0.0.0", True, False),
])
def test_tokens_without_tls_off_loopback_are_one_warning_at_start(host, tls, warned, repo, certs, tmp_path,  # noqa: F811
                                                                  capsys, monkeypatch):
    """--auth-token-file on --host 0.0.0.0 without TLS started silently, the clients' bearer tokens then
    crossing the network in the clear; now one warning line says so and what to do."""
    (tmp_path / "tokens").write_text("secret-1\n")
    monkeypatch.setattr("serving.supervisor.serve", lambda config, log_level: 0)
    flags = ["--tls-cert", certs / "server.pem", "--tls-key", certs / "server.key"] if tls else []
    capsys.readouterr()
    assert run_cli("serve", "--repo", repo, "--host", host, "--auth-token-file", tmp_path / "tokens", *flags) == 0
    lines = [line.split(" WARNING ", 1)[1] for line in capsys.readouterr().err.splitlines() if " WARNING " in line]
    assert lines == ([f"serving.frontend.security: --auth-token-file without TLS on --host {host}, which is not "
                      "loopback: the clients' bearer tokens cross the network in the clear; serve with --tls-cert "
                      "and --tls-key, or terminate TLS in front of the server (a proxy on this host, the server on "
                      "--host 127.0.0.1)"] if warned else [])


def test_tokens_without_tls_off_loopback_no_warning_without_tokens(repo, capsys, monkeypatch):
    monkeypatch.setattr("serving.supervisor.serve", lambda config, log_level: 0)
    capsys.readouterr()
    assert run_cli("serve", "--repo", repo, "--host", "0.0.0.0") == 0
    assert [line for line in capsys.readouterr().err.splitlines() if " WARNING " in line] == []
