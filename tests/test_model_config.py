"""Per-model config.json (version policy, labels, batching, warm-up) and model control: what a model
serves as its config.json changes, what requests naming versions and labels get over both
protocols, and models loaded and unloaded by request (serve --model-control explicit)."""
import asyncio
import json
import logging
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import ROOT, run_cli
from reference import golden_request, write_checkpoint
from servers import InProcessServer, ServeProcess
from test_lifecycle import wait_for
from test_repository import DRAINING, READY, failures, gauge, make, publish, until_released

from recserve.client import Client, encode_sparse
from recserve.errors import UserError
from recserve.oip import grpc_predict_v2_pb2 as oip
from recserve.oip.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub
from recserve.v1 import inference_pb2 as pb
from recserve import wire
from serving.config import BatchSettings, ServerConfig
from serving.model_config import ModelConfigError, VersionPolicy, parse_model_config

pytestmark = pytest.mark.timeout(300)
SERVER = ServerConfig(repo=Path("."))


def write_config(repo, name, config) -> None:
    (repo / name / "config.json").write_text(json.dumps(config) if not isinstance(config, str) else config)


# -- the file ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, message", [
    ({"max_batch_sise": 8}, "max_batch_sise: unknown key (known: max_batch_size, max_delay_ms, max_queue, oip_inputs, "
                            "replicas, version_labels, version_policy, warmup_batch_sizes)"),
    ({"max_batch_size": 0}, "max_batch_size: must be an integer from 1 to 2147483647, got 0"),
    ({"max_batch_size": True}, "max_batch_size: must be an integer from 1 to 2147483647, got true"),
    ({"max_queue": 2.0}, "max_queue: must be an integer from 1 to 2147483647, got 2.0"),
    ({"max_delay_ms": -1}, "max_delay_ms: must be a number of milliseconds from 0 to 60000, got -1"),
    ({"replicas": 0}, "replicas: must be an integer from 1 to 65536, got 0"),
    ({"version_policy": {"latest": 0}}, "version_policy.latest: must be an integer from 1 to 1024, got 0"),
    ({"version_policy": {"latest": 1, "all": True}},
     'version_policy: must be one of {"latest": N}, {"all": true}, {"specific": [versions]}, got '
     '{"latest": 1, "all": true}'),
    ({"version_policy": {"newest": 1}}, "version_policy.newest: unknown policy (known: latest, all, specific)"),
    ({"version_policy": {"all": 1}}, "version_policy.all: must be true, got 1"),
    ({"version_policy": {"specific": []}}, "version_policy.specific: must be a non-empty list of version numbers, got []"),
    ({"version_labels": {"1st": 2}}, "version_labels.1st: a label is letters, digits, _ and -, starting with a letter"),
    ({"version_labels": {"stable": "3"}}, 'version_labels.stable: must be a version number, got "3"'),
    ({"max_batch_size": 16, "warmup_batch_sizes": [8, 32]},
     "warmup_batch_sizes: must be a list of batch sizes from 1 to max_batch_size (16), got [8, 32]"),
    ({"oip_inputs": "per_feature"}, 'oip_inputs: must be one of all, packed, got "per_feature"'),
])
def test_config_json_refuses_unknown_keys_and_bad_values_naming_the_key(raw, message):
    with pytest.raises(ModelConfigError) as e:
        parse_model_config(raw, SERVER)
    assert str(e.value) == f"config.json: {message}"


def test_config_json_keys_override_the_server_flags_and_the_others_stay():
    server = ServerConfig(repo=Path("."), batch=BatchSettings(max_batch_size=64, max_delay_ms=1.5, max_queue=9))
    config = parse_model_config({"max_queue": 7, "version_labels": {"stable": 2}, "warmup_batch_sizes": [4, 1, 4]},
                                server)
    assert (config.batch.max_batch_size, config.batch.max_delay_ms, config.batch.max_queue) == (64, 1.5, 7)
    assert (config.version_policy, config.version_labels, config.warmup_batch_sizes, config.replicas) == \
        (VersionPolicy(latest=1), {"stable": 2}, (1, 4), 0)
    with pytest.raises(ModelConfigError, match="must be a JSON object, got list"):
        parse_model_config([], server)


# -- the repository ---------------------------------------------------------------------------------

def test_version_policy_and_labels_choose_the_served_versions_and_a_change_drains_the_others(repo, artifact):
    for version in (2, 3):
        publish(repo, "demo", version, artifact)

    async def scenario():
        r, metrics = make(repo)
        await r.refresh()
        assert sorted(r.served["demo"]) == [3]  # no config.json: the latest one
        write_config(repo, "demo", {"version_policy": {"latest": 2}, "version_labels": {"stable": 1}})
        await r.refresh()
        assert sorted(r.served["demo"]) == [1, 2, 3] and r.models["demo"].version == 3
        assert [gauge(metrics, "demo", v, READY) for v in (1, 2, 3)] == [1, 1, 1]
        write_config(repo, "demo", {"version_policy": {"specific": [2]}})
        await r.refresh()
        assert sorted(r.served["demo"]) == [2] and r.models["demo"].version == 2
        for version in (1, 3):
            await until_released(r, "demo", version)
            assert gauge(metrics, "demo", version, READY) is None and gauge(metrics, "demo", version, DRAINING) is None
        write_config(repo, "demo", {"version_policy": {"all": True}})
        await r.refresh()
        assert sorted(r.served["demo"]) == [1, 2, 3]
        await r.close()

    asyncio.run(scenario())


def test_latest_n_skips_a_broken_version_and_serves_the_next_lower(repo, artifact):
    for version in (2, 3):
        publish(repo, "demo", version, artifact)
    (repo / "demo" / "3" / "model.pt").write_bytes(b"not a model")
    write_config(repo, "demo", {"version_policy": {"latest": 2}})

    async def scenario():
        r, metrics = make(repo)
        await r.refresh()
        assert sorted(r.served["demo"]) == [1, 2]
        assert failures(metrics, "demo", "ArtifactError") == 1
        await r.close()

    asyncio.run(scenario())


def test_while_a_serving_models_config_is_invalid_its_versions_follow_the_disk_under_the_last_good_one(repo, artifact):
    """A served model whose config.json turns invalid keeps its last good configuration: deleting
    its served version still rolls back to the one left, and a new version still loads under it."""
    publish(repo, "demo", 2, artifact)

    async def scenario():
        r, metrics = make(repo)
        await r.refresh()
        assert r.models["demo"].version == 2
        write_config(repo, "demo", {"max_queue": 0})
        shutil.rmtree(repo / "demo" / "2")  # a bad version rolled back while config.json is being edited
        await r.refresh()
        assert r.models["demo"].version == 1 and failures(metrics, "demo", "InvalidConfig") == 1
        publish(repo, "demo", 3, artifact)
        await r.refresh()
        assert r.models["demo"].version == 3 and r.models["demo"].batchers[0].settings.max_queue == 256
        await r.close()

    asyncio.run(scenario())


def test_an_invalid_config_refuses_that_model_only_and_a_serving_model_keeps_its_last_good_one(repo, artifact,
                                                                                              caplog):
    publish(repo, "other", 1, artifact)
    write_config(repo, "other", {"max_batch_sise": 8})

    async def scenario():
        r, metrics = make(repo)
        await r.refresh()
        assert sorted(r.served) == ["demo"] and failures(metrics, "other", "InvalidConfig") == 1
        write_config(repo, "demo", {"max_queue": 0})
        await r.refresh()
        await r.refresh()
        assert sorted(r.served) == ["demo"] and failures(metrics, "demo", "InvalidConfig") == 1  # logged once
        assert r.models["demo"].batchers[0].settings.max_queue == 256  # the last good configuration
        write_config(repo, "other", {"max_batch_size": 8})
        await r.refresh()
        assert sorted(r.served) == ["demo", "other"] and r.models["other"].schema.max_batch_size == 8
        await r.close()

    with caplog.at_level(logging.ERROR, logger="serving.engine.repository"):
        asyncio.run(scenario())
    errors = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.ERROR]
    assert errors == [
        f"{repo}/other/config.json: max_batch_sise: unknown key (known: max_batch_size, max_delay_ms, max_queue, "
        "oip_inputs, replicas, version_labels, version_policy, warmup_batch_sizes); other is not loaded until it is "
        "fixed",
        f"{repo}/demo/config.json: max_queue: must be an integer from 1 to 2147483647, got 0; demo keeps serving "
        "with its last good configuration"]


def test_batching_settings_apply_in_place_and_a_new_max_batch_size_loads_the_version_again(repo):
    async def scenario():
        r, _ = make(repo)
        await r.refresh()
        first = r.models["demo"]
        write_config(repo, "demo", {"max_delay_ms": 2.5, "max_queue": 3})
        await r.refresh()
        assert r.models["demo"] is first
        assert {(b.settings.max_delay_ms, b.settings.max_queue) for b in first.batchers} == {(2.5, 3)}
        write_config(repo, "demo", {"max_batch_size": 8})
        await r.refresh()
        second = r.models["demo"]
        assert second is not first and second.schema.max_batch_size == 8 and first.state == DRAINING
        # Nothing holds the old copy, yet it still takes what the front ends laid out for it before they
        # heard of the swap (another max_batch_size: another layout), for RETIRE_GRACE_S.
        assert not first.drained.is_set() and first.runners
        await until_released(r, "demo", 1)
        assert r.versions("demo") == [second]
        await r.close()

    asyncio.run(scenario())


def test_a_configuration_whose_build_fails_is_not_advertised_and_the_last_good_one_serves(repo, monkeypatch):
    """A new max_batch_size needs the version built again; that build fails: the loaded copy serves on
    with its configuration, and that is the one the model's state gives (ModelInfo, OIP config),
    not the one that failed."""
    async def scenario():
        r, metrics = make(repo)
        await r.refresh()
        first, good = r.models["demo"], r.configs["demo"]

        async def broken(name, version, config):
            raise RuntimeError("out of device memory")

        monkeypatch.setattr(r.loader, "load", broken)
        write_config(repo, "demo", {"max_batch_size": 8, "max_delay_ms": 5})
        await r.refresh()
        assert r.models["demo"] is first and first.schema.max_batch_size == good.batch.max_batch_size != 8
        assert r.configs["demo"] is good and {b.settings.max_delay_ms for b in first.batchers} == {good.batch.max_delay_ms}
        await r.close()

    asyncio.run(scenario())


def test_a_config_json_that_is_not_a_regular_file_is_refused_at_once(tmp_path):
    """A FIFO named config.json: opening it to read would wait for a writer, and with it the model's
    refresh and the server's start."""
    import os

    from serving.model_config import read_model_config

    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(ModelConfigError, match=r"config.json: not a regular file$"):
        read_model_config(tmp_path, ServerConfig(repo=tmp_path))
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(" " * (1 << 20) + "{}")
    with pytest.raises(ModelConfigError, match=r"config.json: larger than 1048576 bytes$"):
        read_model_config(tmp_path, ServerConfig(repo=tmp_path))
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)  # json.loads: a RecursionError
    with pytest.raises(ModelConfigError, match=r"config.json: not JSON \(nested too deeply\)$"):
        read_model_config(tmp_path, ServerConfig(repo=tmp_path))


def test_warm_up_runs_each_configured_batch_size_before_the_version_serves(repo, caplog):
    write_config(repo, "demo", {"warmup_batch_sizes": [3, 17]})
    seen = []

    async def scenario():
        r, _ = make(repo)
        from serving.engine import runner as runner_module
        run = runner_module.ModelRunner.run

        def counted(self, rpc, requests):
            seen.append((rpc, tuple(k.batch_size for k in requests)))
            return run(self, rpc, requests)

        runner_module.ModelRunner.run = counted
        try:
            await r.refresh()
        finally:
            runner_module.ModelRunner.run = run
        assert r.models["demo"].version == 1
        await r.close()

    with caplog.at_level(logging.INFO, logger="serving.engine.repository"):
        asyncio.run(scenario())
    warm = [s for s in seen if s[1][0] in (3, 17)]
    assert warm == [("Predict", (3,)), ("Lookup", (3,))] * 2 + [("Predict", (17,)), ("Lookup", (17,))] * 2
    assert any("warmed up at batch sizes [3, 17]" in rec.getMessage() for rec in caplog.records)


# -- requests naming versions and labels --------------------------------------------------------------

def predict(client: Client, dense, sparse, version=0, label=""):
    request = pb.PredictRequest(model_name="demo", model_version=version, model_version_label=label,
                                dense=wire.encode(np.asarray(dense, dtype=np.float32)), sparse=encode_sparse(sparse))
    response = client.stub.Predict(request, timeout=30)
    return response.model_version, wire.decode(response.ctr, "ctr", ("float32",), ndim=1)


def infer(stub, dense, sparse_keys, lengths, values, version=""):
    """An OIP ModelInfer of golden's inputs; (version that answered, ctr)."""
    b = dense.shape[0]
    lengths = lengths.reshape(len(sparse_keys), b)
    ends = np.concatenate(([0], np.cumsum(lengths.sum(axis=1))))
    tensors, raw = [("dense", "FP32", dense.astype(np.float32))], []
    for i, key in enumerate(sparse_keys):
        tensors += [(f"{key}_lengths", "INT32", lengths[i].astype(np.int32)),
                    (f"{key}_ids", "INT64", values[ends[i]:ends[i + 1]].astype(np.int64))]
    request = oip.ModelInferRequest(model_name="demo", model_version=version, outputs=[
        oip.ModelInferRequest.InferRequestedOutputTensor(name="ctr")])
    for name, datatype, array in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        raw.append(array.tobytes())
    request.raw_input_contents.extend(raw)
    response = stub.ModelInfer(request, timeout=30)
    return response.model_version, np.frombuffer(response.raw_output_contents[0], np.float32)


def test_requests_name_versions_and_labels_over_both_protocols(repo, artifact):
    publish(repo, "demo", 2, artifact)
    write_config(repo, "demo", {"version_policy": {"latest": 2}, "version_labels": {"stable": 1, "canary": 2},
                                "max_queue": 7})
    (dense, (keys, lengths, values)), want = golden_request(repo / "demo" / "1")
    server = InProcessServer(repo)
    try:
        with Client(server.target) as client, grpc.insecure_channel(server.target) as channel:
            sparse = (keys, lengths, values)
            for version, label, answered in [(0, "", 2), (1, "", 1), (2, "", 2), (0, "stable", 1), (0, "canary", 2)]:
                got_version, ctr = predict(client, dense, sparse, version, label)
                assert got_version == answered
                np.testing.assert_allclose(ctr, want, atol=1e-5)
            for version, label, code, message in [
                    (0, "beta", grpc.StatusCode.NOT_FOUND,
                     "model 'demo' has no version label 'beta'; labels: ['canary', 'stable']"),
                    (3, "", grpc.StatusCode.NOT_FOUND, "model 'demo' version 3 is not loaded; serving versions [1, 2]"),
                    (1, "stable", grpc.StatusCode.INVALID_ARGUMENT,
                     "name the model version or a version label, not both")]:
                with pytest.raises(grpc.RpcError) as e:
                    predict(client, dense, sparse, version, label)
                assert (e.value.code(), e.value.details()) == (code, message)
            assert predict(client, dense, sparse)[0] == 2  # a good request after the bad ones: as before

            info = client.model_info("demo").models[0]
            assert [(v.version, v.state) for v in info.versions] == [(2, "READY"), (1, "READY")]
            assert dict(info.version_labels) == {"stable": 1, "canary": 2}
            assert json.loads(info.config_json) == {
                "version_policy": "latest 2", "version_labels": {"stable": 1, "canary": 2}, "max_batch_size": 4096,
                "max_delay_ms": 0.0, "max_queue": 7, "replicas": 0, "warmup_batch_sizes": [], "oip_inputs": "all"}

            stub = GRPCInferenceServiceStub(channel)
            for version, answered in [("", "2"), ("1", "1"), ("stable", "1"), ("canary", "2")]:
                got_version, ctr = infer(stub, dense, keys, lengths, values, version)
                assert got_version == answered
                np.testing.assert_allclose(ctr, want, atol=1e-5)
            with pytest.raises(grpc.RpcError) as e:
                infer(stub, dense, keys, lengths, values, "beta")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            config = stub.ModelConfig(oip.ModelConfigRequest(name="demo", version="stable"), timeout=10).config
            assert {k: v.string_value for k, v in config.parameters.items()} == {
                "max_batch_size": "4096", "version_policy": '"latest 2"', "version_labels": '{"stable": 1, "canary": 2}',
                "max_delay_ms": "0.0", "max_queue": "7", "replicas": "0", "warmup_batch_sizes": "[]",
                "oip_inputs": '"all"'}
            metadata = stub.ModelMetadata(oip.ModelMetadataRequest(name="demo", version="canary"), timeout=10)
            assert list(metadata.versions) == ["2", "1"]
    finally:
        assert server.stop() == 0


def test_model_info_of_a_named_version_gives_that_versions_schema(repo, artifact, checkpoint, tmp_path, capsys):
    """GetModelInfo answered the default version's schema only: `recserve predict --random N --version 1`
    drew ids from version 2's tables and version 1, with smaller ones, refused them (INVALID_ARGUMENT:
    "id 1963 of feature 'user_id' is outside [0, 3)")."""
    config = json.loads((checkpoint / "model_config.json").read_text())
    for table in config["tables"]:
        table["num_embeddings"] = 3
    small = write_checkpoint(tmp_path / "small", config)
    assert run_cli("export", "--checkpoint", small, "--repo", tmp_path / "small-repo", "--name", "demo",
                   "--no-progress") == 0
    shutil.rmtree(repo / "demo" / "1")
    publish(repo, "demo", 1, tmp_path / "small-repo" / "demo" / "1")
    publish(repo, "demo", 2, artifact)
    write_config(repo, "demo", {"version_policy": {"all": True}, "version_labels": {"small": 1}})
    server = InProcessServer(repo)
    try:
        with Client(server.target) as client:
            rows = {(version, label): [f.rows for f in client.model_info("demo", version, label).models[0].features]
                    for version, label in [(0, ""), (1, ""), (2, ""), (0, "small")]}
            assert rows == {(0, ""): [2000, 5000, 300], (1, ""): [3, 3, 3], (2, ""): [2000, 5000, 300],
                            (0, "small"): [3, 3, 3]}
            with pytest.raises(grpc.RpcError) as e:
                client.model_info("demo", 3)
            assert (e.value.code(), e.value.details()) == (
                grpc.StatusCode.NOT_FOUND, "model 'demo' version 3 is not loaded; serving versions [1, 2]")
            with pytest.raises(grpc.RpcError) as e:
                client.model_info("", 1)
            assert (e.value.code(), e.value.details()) == (
                grpc.StatusCode.INVALID_ARGUMENT, "a model version or version label needs the model's name")
        capsys.readouterr()
        for version in ("1", "small"):
            assert run_cli("predict", "--target", server.target, "--model", "demo", "--random", "64",
                           "--version", version) == 0
            assert len(capsys.readouterr().out.splitlines()) == 64
    finally:
        assert server.stop() == 0


# -- model control -----------------------------------------------------------------------------------

def index(stub):
    return [(m.name, m.version, m.state, m.reason)
            for m in stub.RepositoryIndex(oip.RepositoryIndexRequest(), timeout=10).models]


def test_explicit_model_control_loads_and_unloads_by_request(repo, artifact):
    publish(repo, "broken", 1, artifact)
    publish(repo, "my model", 1, artifact)  # not a model name: never a model
    (repo / "broken" / "1" / "model.pt").write_bytes(b"not a model")
    server = InProcessServer(repo, settings={"model_control": "explicit"})
    (dense, sparse), want = golden_request(repo / "demo" / "1")
    try:
        with Client(server.target) as client, grpc.insecure_channel(server.target) as channel:
            stub = GRPCInferenceServiceStub(channel)
            assert stub.ServerReady(oip.ServerReadyRequest(), timeout=10).ready  # ready with no model loaded
            assert index(stub) == [("broken", "", "UNAVAILABLE", "not loaded"), ("demo", "", "UNAVAILABLE", "not loaded")]
            with pytest.raises(grpc.RpcError) as e:
                client.predict("demo", dense, sparse)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND

            stub.RepositoryModelLoad(oip.RepositoryModelLoadRequest(model_name="demo"), timeout=120)
            assert ("demo", "1", "READY", "") in index(stub)
            np.testing.assert_allclose(client.predict("demo", dense, sparse), want, atol=1e-5)

            for request, code, message in [
                    (oip.RepositoryModelLoadRequest(model_name="nope"), grpc.StatusCode.NOT_FOUND,
                     "no model 'nope' in the repository"),
                    (oip.RepositoryModelLoadRequest(model_name="my model"), grpc.StatusCode.NOT_FOUND,
                     "no model 'my model' in the repository: a model name is 1 to 128 ASCII letters, digits, "
                     "'_', '.' and '-', starting with a letter or digit"),
                    (oip.RepositoryModelLoadRequest(model_name="demo", repository_name="other"),
                     grpc.StatusCode.INVALID_ARGUMENT,
                     "repository_name 'other': this server serves one repository; send \"\"")]:
                with pytest.raises(grpc.RpcError) as e:
                    stub.RepositoryModelLoad(request, timeout=120)
                assert (e.value.code(), e.value.details()) == (code, message)
            with pytest.raises(grpc.RpcError) as e:
                stub.RepositoryModelLoad(oip.RepositoryModelLoadRequest(model_name="broken"), timeout=120)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("model 'broken' does not load: version 1: ")
            assert ("broken", "", "UNAVAILABLE", e.value.details().split("does not load: ")[1]) in index(stub)
            # unloaded by request: "not loaded" again, not the failure of a load no longer asked for
            stub.RepositoryModelUnload(oip.RepositoryModelUnloadRequest(model_name="broken"), timeout=60)
            assert ("broken", "", "UNAVAILABLE", "not loaded") in index(stub)

            stub.RepositoryModelUnload(oip.RepositoryModelUnloadRequest(model_name="demo"), timeout=60)
            with pytest.raises(grpc.RpcError) as e:
                client.predict("demo", dense, sparse)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            stub.RepositoryModelLoad(oip.RepositoryModelLoadRequest(model_name="demo"), timeout=120)
            np.testing.assert_allclose(client.predict("demo", dense, sparse), want, atol=1e-5)
    finally:
        assert server.stop() == 0


def test_tritonclient_unload_model_with_its_unload_dependents_parameter_unloads(repo):
    """tritonclient's unload_model, over gRPC and over HTTP, always sends the parameter
    unload_dependents (false by default; a recserve model has no dependents): the model is unloaded,
    as without it. Any other parameter is still refused, and load takes none."""
    from test_oip_http import post_json

    server = InProcessServer(repo, settings={"model_control": "explicit", "load_models": ("demo",), "http_port": 0})
    url = f"http://127.0.0.1:{server.frontend.http_port}/v2/repository/models/demo"
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = GRPCInferenceServiceStub(channel)
            assert index(stub) == [("demo", "1", "READY", "")]
            request = oip.RepositoryModelUnloadRequest(model_name="demo")
            request.parameters["unload_dependents"].bool_param = False  # as tritonclient.grpc writes it
            stub.RepositoryModelUnload(request, timeout=60)
            assert not stub.ModelReady(oip.ModelReadyRequest(name="demo"), timeout=10).ready
            assert post_json(url + "/load", {}) == (200, {})
            assert stub.ModelReady(oip.ModelReadyRequest(name="demo"), timeout=10).ready
            assert post_json(url + "/unload", {"parameters": {"unload_dependents": False}}) == (200, {})
            assert not stub.ModelReady(oip.ModelReadyRequest(name="demo"), timeout=10).ready
            assert post_json(url + "/load", {"parameters": {"unload_dependents": False}}) == (
                400, {"error": "parameters are not supported (got ['unload_dependents'])"})
            assert post_json(url + "/unload", {"parameters": {"unload_dependents": True, "config": "{}"}}) == (
                400, {"error": "parameters are not supported (got ['config'])"})
    finally:
        assert server.stop() == 0


def test_model_control_is_refused_while_the_server_polls(repo):
    server = InProcessServer(repo)
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = GRPCInferenceServiceStub(channel)
            assert index(stub) == [("demo", "1", "READY", "")]
            with pytest.raises(grpc.RpcError) as e:
                stub.RepositoryModelUnload(oip.RepositoryModelUnloadRequest(model_name="demo"), timeout=10)
            assert (e.value.code(), e.value.details()) == (
                grpc.StatusCode.FAILED_PRECONDITION, "model unload is off: this server polls its repository; serve "
                "with --model-control explicit to load and unload models by request")
    finally:
        assert server.stop() == 0


def models_cli(target, *args):
    return subprocess.run([sys.executable, "-m", "recserve", "models", *args, "--target", target],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_models_cli_lists_loads_and_unloads_on_a_served_repository(repo, artifact):
    publish(repo, "other", 1, artifact)
    server = ServeProcess(repo, "--model-control", "explicit", "--load-model", "demo")
    try:
        listed = models_cli(server.target, "list")
        assert (listed.returncode, listed.stdout) == (0, "demo\t1\tREADY\t\nother\t-\tUNAVAILABLE\tnot loaded\n")
        assert models_cli(server.target, "load", "other").stdout == "loaded other\n"
        assert models_cli(server.target, "unload", "demo").stdout == "unloaded demo\n"
        assert models_cli(server.target, "list").stdout.splitlines()[-1] == "other\t1\tREADY\t"
        missing = models_cli(server.target, "load", "nope")
        assert (missing.returncode, missing.stderr.strip().splitlines()) == (
            2, ["recserve models: error: NOT_FOUND: no model 'nope' in the repository"])
    finally:
        assert server.terminate() == 0


def test_a_hot_swap_warns_nothing_and_leaves_no_stale_version_series(repo, artifact):
    """Under `recserve serve` (several processes, multiprocess metrics): after version 2 replaces 1,
    /metrics has exactly one loaded series, version 2 READY, and nobody warned about label removal."""
    from test_lifecycle import wait_for

    from recserve.local import samples

    server = ServeProcess(repo, "--poll-interval", "0.2")
    try:
        def loaded():
            return sorted((s.labels["version"], s.labels["state"], s.value)
                          for s in samples(server.scrape(), "recserve_model_version_loaded"))

        assert loaded() == [("1", "READY", 1.0)]
        publish(repo, "demo", 2, artifact)
        assert wait_for(lambda: loaded() == [("2", "READY", 1.0)]), loaded()
    finally:
        assert server.terminate() == 0
    assert "Warning" not in server.output() and "warn" not in server.output().lower(), server.output()


def test_model_control_and_labels_over_http(repo, artifact):
    """The repository extension and version labels over KServe v2 REST (serve --http-port)."""
    from test_oip_http import post_json

    publish(repo, "demo", 2, artifact)
    write_config(repo, "demo", {"version_policy": {"all": True}, "version_labels": {"stable": 1}})
    server = InProcessServer(repo, settings={"model_control": "explicit", "http_port": 0})
    url = f"http://127.0.0.1:{server.frontend.http_port}/v2"
    try:
        assert post_json(url + "/repository/index", {}) == (200, [
            {"name": "demo", "version": "", "state": "UNAVAILABLE", "reason": "not loaded"}])
        assert post_json(url + "/repository/models/demo/load", {}) == (200, {})
        assert post_json(url + "/repository/index", {"ready": True}) == (200, [
            {"name": "demo", "version": "2", "state": "READY", "reason": ""},
            {"name": "demo", "version": "1", "state": "READY", "reason": ""}])
        with urllib.request.urlopen(url + "/models/demo/versions/stable", timeout=10) as r:
            assert json.loads(r.read())["versions"] == ["2", "1"]
        assert post_json(url + "/repository/models/nope/load", {}) == (404, {"error": "no model 'nope' in the repository"})
        assert post_json(url + "/repository/models/demo/load", {"parameters": {"config": "{}"}}) == (
            400, {"error": "parameters are not supported (got ['config'])"})
        assert post_json(url + "/repository/models/demo/unload", {}) == (200, {})
        assert post_json(url + "/models/demo/infer", {"inputs": []})[0] == 404
    finally:
        assert server.stop() == 0


def test_a_version_built_again_for_a_new_max_batch_size_keeps_its_statistics(repo):
    """The OIP statistics are per version: a version loaded again under its number (a new
    max_batch_size) stays the same version, so its counts go on from where they were, during the
    swap (both copies answer for it) and after the old copy is released."""
    server = InProcessServer(repo)
    (dense, sparse), _ = golden_request(repo / "demo" / "1")
    try:
        with Client(server.target, timeout=30) as client:
            for _ in range(3):
                client.predict("demo", dense, sparse)
            first = server.model_version("demo")
            write_config(repo, "demo", {"max_batch_size": 64})
            assert wait_for(lambda: server.model_version("demo") is not first)
            client.predict("demo", dense, sparse)  # on the new copy
            assert server.call(_statistics(server)).success[0] == 4  # the old copy still drains
            assert wait_for(lambda: server.repo.versions("demo") == [server.model_version("demo")])
            stats = server.call(_statistics(server))
            assert (stats.success[0], stats.inference_count) == (4, 4 * dense.shape[0])
    finally:
        assert server.stop() == 0


async def _statistics(server):
    return server.engine.statistics()[("demo", 1)]


def test_a_model_copied_into_the_repository_loads_at_once_by_request(repo, artifact):
    """An operator copies a model in and asks for it right away (a deploy script): it loads, whether
    or not the server has listed the repository since; a name that is not there is NOT_FOUND."""
    server = InProcessServer(repo, settings={"model_control": "explicit"})
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = GRPCInferenceServiceStub(channel)
            assert stub.ServerReady(oip.ServerReadyRequest(), timeout=10).ready
            publish(repo, "fresh", 1, artifact)
            stub.RepositoryModelLoad(oip.RepositoryModelLoadRequest(model_name="fresh"), timeout=120)
            assert ("fresh", "1", "READY", "") in index(stub)
            with pytest.raises(grpc.RpcError) as e:
                stub.RepositoryModelLoad(oip.RepositoryModelLoadRequest(model_name="nope"), timeout=120)
            assert (e.value.code(), e.value.details()) == (grpc.StatusCode.NOT_FOUND, "no model 'nope' in the repository")
    finally:
        assert server.stop() == 0


def test_a_load_and_an_unload_of_one_model_at_once_take_effect_in_turn(repo):
    """Three model control requests for one model while its first load runs: load, load, unload. Each
    applies in turn once the refresh before it ends; the second load is answered OK (the model loads:
    it was not told "does not load: no version on disk" because the unload that came after it took
    its place first), and the unload, last, leaves the model unloaded."""
    async def scenario():
        r, _ = make(repo, model_control="explicit")
        await r.refresh()
        gate, load = asyncio.Event(), r.loader.load

        async def gated_load(*args):
            await gate.wait()
            return await load(*args)

        r.loader.load = gated_load
        first = asyncio.create_task(r.load_model("demo"))
        await asyncio.sleep(0.5)  # its load waits at the gate; the second load waits for it
        second = asyncio.create_task(r.load_model("demo"))
        await asyncio.sleep(0.5)
        unload = asyncio.create_task(r.unload_model("demo"))
        await asyncio.sleep(0.1)
        gate.set()
        outcomes = await asyncio.gather(first, second, unload, return_exceptions=True)
        served = sorted(r.served)
        await r.close()
        return [repr(o) for o in outcomes], served

    assert asyncio.run(scenario()) == (["None", "None", "None"], [])


def test_a_load_whose_new_version_or_config_json_is_refused_says_so_and_the_old_version_serves_on(repo, artifact):
    """An operator publishes version 2 (half copied) or edits config.json (a typo), then asks for a
    load to take it: the load answers why it failed, not OK, while version 1 keeps serving; once fixed,
    the next load answers OK."""
    async def scenario():
        r, _ = make(repo, model_control="explicit")
        await r.load_model("demo")
        broken = publish(repo, "demo", 2, artifact)
        (broken / "model.pt").write_bytes(b"half a model")
        outcomes = []
        for fix in (lambda: (shutil.rmtree(broken), write_config(repo, "demo", {"max_batch_sise": 8})),
                    lambda: write_config(repo, "demo", {}),
                    lambda: None):
            try:
                await r.load_model("demo")
                outcomes.append("OK")
            except UserError as e:
                outcomes.append(str(e))
            outcomes.append(sorted(r.served["demo"]))
            fix()
        await r.close()
        return outcomes

    outcomes = asyncio.run(scenario())
    assert outcomes[0].startswith(f"model 'demo' does not load: version 2: {repo / 'demo' / '2' / 'model.pt'}: sha256 ")
    assert outcomes[0].endswith("; it serves version 1"), outcomes[0]
    assert outcomes[1:] == [[1], f"model 'demo' does not load: {repo / 'demo' / 'config.json'}: max_batch_sise: "
                                 "unknown key (known: max_batch_size, max_delay_ms, max_queue, oip_inputs, replicas, "
                                 "version_labels, version_policy, warmup_batch_sizes); it serves version 1", [1],
                            "OK", [1]]


def test_statistics_of_a_version_loaded_again_while_its_old_copy_drains_are_the_new_copys(repo):
    """Unloaded, then loaded again while a request still holds the unloaded copy: the version starts
    from nothing (an unloaded version takes its figures with it), and ModelStatistics reports the
    copy that serves, not the one draining."""
    server = InProcessServer(repo, settings={"model_control": "explicit", "load_models": ("demo",)})
    (dense, sparse), _ = golden_request(repo / "demo" / "1")

    async def hold(mv, held):
        mv.acquire() if held else mv.release()

    try:
        with Client(server.target, timeout=30) as client, grpc.insecure_channel(server.target) as channel:
            stub = GRPCInferenceServiceStub(channel)
            for _ in range(3):
                client.predict("demo", dense, sparse)
            old = server.model_version("demo")
            server.call(hold(old, True))  # a request still in flight on it
            stub.RepositoryModelUnload(oip.RepositoryModelUnloadRequest(model_name="demo"), timeout=60)
            stub.RepositoryModelLoad(oip.RepositoryModelLoadRequest(model_name="demo"), timeout=120)
            client.predict("demo", dense, sparse)
            assert server.repo.versions("demo")[1] is old  # still draining
            assert server.call(_statistics(server)).success[0] == 1
            server.call(hold(old, False))
    finally:
        assert server.stop() == 0
