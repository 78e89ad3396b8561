"""A version's manifest is checked against the artifact it describes before it serves: every field
within what the wire and the kernels accept, and the numbers (rows, dims, feature order, dense
features, dtypes) equal to what model.pt and golden.pt hold. A version that fails is refused with
one line naming the field; the model keeps what it serves and the server keeps polling."""
import asyncio
import json
import logging
import os
import shutil

import grpc
import numpy as np
import pytest
import torch
from conftest import run_cli
from servers import SERVING, InProcessServer, health_status
from test_lifecycle import wait_for
from test_repository import failures, make, publish

import fbgemm_gpu  # noqa: F401  (registers the FBGEMM ops model.pt calls)
from export.models import factory_for
from recserve.client import Client, random_request
from recserve.manifest import MANIFEST_FILE, sha256_file

BIG = 2**62


def edit(field):
    """A manifest edit, named after the field it breaks (the message must name it)."""
    def rows(m, value):
        m["features"][0]["rows"] = value

    def swap(m):
        m["features"][0], m["features"][1] = m["features"][1], m["features"][0]

    def dims(m):
        m["features"][0]["dim"], m["features"][1]["dim"] = 8, 24

    edits = {
        "dense_features=2^62": ("dense_features", lambda m: m.update(dense_features=BIG)),
        "dense_features=0": ("dense_features", lambda m: m.update(dense_features=0)),
        "dense_features=7": ("dense_features", lambda m: m.update(dense_features=7)),
        "rows=2^62": ("features[0].rows", lambda m: rows(m, BIG)),
        "rows+1": ("features[0].rows", lambda m: rows(m, m["features"][0]["rows"] + 1)),
        "rows=-1": ("features[0].rows", lambda m: rows(m, -1)),
        "dim=2^40": ("features[0].dim", lambda m: m["features"][0].update(dim=2**40)),
        "dims swapped": ("features[0].dim", dims),
        "features reordered": ("features[0].rows", swap),
        "world_size=0": ("sharding.world_size", lambda m: m["sharding"].update(world_size=0)),
        "dense_dtype=bogus": ("dense_dtype", lambda m: m.update(dense_dtype="bogus")),
        "dense_dtype=bf16": ("dense_dtype", lambda m: m.update(dense_dtype="bf16")),
        "weight_dtype=int4": ("features[0].weight_dtype", lambda m: [f.update(weight_dtype="int4") for f in m["features"]]),
        "pooling=MAX": ("features[0].pooling", lambda m: m["features"][0].update(pooling="MAX")),
        # a pooling the model does not do: GetModelInfo told clients MEAN of a table that sums
        "pooling=MEAN": ("features[0].pooling", lambda m: m["features"][0].update(pooling="MEAN")),
        "pooling=SUM": ("features[2].pooling", lambda m: m["features"][2].update(pooling="SUM")),
        "no features": ("features", lambda m: m.update(features=[])),
        "rows a string": ("features[0].rows", lambda m: rows(m, "2000")),
        "rows a bool": ("features[0].rows", lambda m: rows(m, True)),
        "unknown table": ("features[0].table", lambda m: m["features"][0].update(table="t_nope")),
        "duplicate feature": ("features[1].name", lambda m: m["features"][1].update(name=m["features"][0]["name"])),
        # `recserve inspect` formatted the factor with :g (a traceback), serving took a typo for host memory
        "placement=uvm_cachin": ("sharding.tables.t_user.placement",
                                 lambda m: m["sharding"]["tables"]["t_user"].update(placement="uvm_cachin")),
        "cache_load_factor a string": ("sharding.tables.t_user.cache_load_factor",
                                       lambda m: m["sharding"]["tables"]["t_user"].update(cache_load_factor="0.2")),
        # verify_files read (and hashed) whatever path the manifest named, outside the version too
        "file outside the version": ("files", lambda m: m["files"].update({"/etc/hostname": "0" * 64})),
    }
    return edits[field]


EDITS = ["dense_features=2^62", "dense_features=0", "dense_features=7", "rows=2^62", "rows+1", "rows=-1",
         "dim=2^40", "dims swapped", "features reordered", "world_size=0", "dense_dtype=bogus", "dense_dtype=bf16",
         "weight_dtype=int4", "pooling=MAX", "pooling=MEAN", "pooling=SUM", "no features", "rows a string", "rows a bool", "unknown table",
         "duplicate feature", "placement=uvm_cachin", "cache_load_factor a string",
         "file outside the version"]


def publish_edited(repo, name, version, source, change):
    """``source`` published as ``repo/name/version`` with its manifest changed (checksums still match:
    the manifest is not covered by them)."""
    path = publish(repo, name, version, source)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    change(manifest)
    tmp = path / ".manifest.tmp"
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, path / MANIFEST_FILE)
    return path


def refusal_of_version_2(repo, caplog):
    """A repository's first refresh, where demo version 2 must be refused (ArtifactError, once) and
    version 1 serve on: its log lines refusing version 2."""
    async def scenario():
        r, metrics = make(repo)
        await r.refresh()
        served = {n: mv.version for n, mv in r.models.items()}
        refused = failures(metrics, "demo", "ArtifactError")
        await r.close()
        return served, refused

    with caplog.at_level(logging.ERROR, "serving.engine.repository"):
        served, refused = asyncio.run(scenario())
    assert served == {"demo": 1} and refused == 1
    return [rec.getMessage() for rec in caplog.records if "refused demo version 2" in rec.getMessage()]


def rewrite_checksum(path, file):
    """The manifest of the version at ``path`` names ``file``'s sha256 as it is now."""
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["files"][file] = sha256_file(path / file)
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


@pytest.mark.parametrize("case", EDITS)
def test_manifest_that_does_not_match_the_artifact_is_refused_naming_the_field(case, repo, artifact, caplog):
    field, change = edit(case)
    publish_edited(repo, "demo", 2, artifact, change)

    lines = refusal_of_version_2(repo, caplog)
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert f"manifest field {field}:" in lines[0], lines[0]


def test_bad_manifest_added_while_serving_is_refused_and_polling_goes_on(repo, artifact):
    """A manifest number too large for ModelInfo used to kill the engine's poll loop (ValueError: Value
    out of range) and, at start-up, hold health NOT_SERVING; a wrong row count let ids past the
    table's end reach the kernel."""
    server = InProcessServer(repo)
    try:
        with Client(server.target) as client:
            info = client.model_info("demo").models[0]
            dense, sparse = random_request(info, 6, seed=3)
            before = client.predict("demo", dense, sparse)
            for i, case in enumerate(["dense_features=2^62", "rows=2^62", "dense_features=0", "world_size=0"]):
                publish_edited(repo, f"bad{i}", 1, artifact, edit(case)[1])
            assert wait_for(lambda: all(server.metric("recserve_model_load_failures_total", model=f"bad{i}",
                                                      reason="ArtifactError") == 1 for i in range(4)))
            publish(repo, "demo", 2, artifact)  # the poll loop is alive: a good version still comes in
            assert wait_for(lambda: [v.version for v in client.model_info("demo").models[0].versions] == [2])
            assert [m.name for m in client.model_info().models] == ["demo"]
            assert health_status(server.target) == SERVING
            for i in range(4):
                with pytest.raises(grpc.RpcError) as exc:
                    client.predict(f"bad{i}", dense, sparse)
                assert exc.value.code() == grpc.StatusCode.NOT_FOUND
            np.testing.assert_array_equal(client.predict("demo", dense, sparse), before)
    finally:
        server.stop()


def test_bad_manifest_at_startup_does_not_hold_health_not_serving(repo, artifact):
    publish_edited(repo, "bad", 1, artifact, edit("dense_features=2^62")[1])
    server = InProcessServer(repo)
    try:
        assert health_status(server.target) == SERVING
        with Client(server.target) as client:
            assert [m.name for m in client.model_info().models] == ["demo"]
            info = client.model_info("demo").models[0]
            dense, sparse = random_request(info, 2, seed=4)
            assert client.predict("demo", dense, sparse).shape == (2,)
    finally:
        server.stop()


def test_symlinked_version_outside_the_repository_is_refused(repo, artifact, tmp_path, caplog):
    outside = tmp_path / "elsewhere" / "2"
    shutil.copytree(repo / "demo" / "1", outside)
    manifest = json.loads((outside / MANIFEST_FILE).read_text())
    manifest["version"] = 2
    (outside / MANIFEST_FILE).write_text(json.dumps(manifest))
    (repo / "demo" / "2").symlink_to(outside, target_is_directory=True)
    inside = repo / ".store" / "3"  # a link that stays inside the repository is fine
    shutil.copytree(outside, inside)
    manifest["version"] = 3
    (inside / MANIFEST_FILE).write_text(json.dumps(manifest))

    async def scenario(allow, link_inside):
        if link_inside:
            (repo / "demo" / "3").symlink_to(inside, target_is_directory=True)
        r, metrics = make(repo, allow_symlinks=allow)
        await r.refresh()
        served = r.models["demo"].version
        refused = failures(metrics, "demo", "SymlinkOutsideRepository")
        await r.close()
        return served, refused

    with caplog.at_level(logging.ERROR, "serving.engine.repository"):
        assert asyncio.run(scenario(False, False)) == (1, 1)
        assert asyncio.run(scenario(True, False)) == (2, None)
        assert asyncio.run(scenario(False, True)) == (3, 1)  # 2 is still refused
    lines = [rec.getMessage() for rec in caplog.records if "SymlinkOutsideRepository" in rec.getMessage()]
    assert len(lines) == 2 and all(str(outside) in line and "--allow-symlinks" in line for line in lines), lines


def test_serving_only_once_every_model_has_loaded_or_failed_at_startup(repo, artifact, caplog):
    """A poll during the first load used to set ready after 1 of 31 models had loaded, and warn
    "starting without" the others, still loading."""
    publish(repo, "slow", 1, artifact)
    publish_edited(repo, "broken", 1, artifact, edit("rows=2^62")[1])

    async def scenario():
        r, _ = make(repo)
        gate, real = asyncio.Event(), r.loader.load

        async def load(name, version, config):
            if name == "slow":
                await gate.wait()
            return await real(name, version, config)

        r.loader.load = load
        first = asyncio.create_task(r.refresh())  # the start-up load
        while "demo" not in r.models or "broken" in r._busy:
            await asyncio.sleep(0.01)
        await r.refresh()  # a poll while "slow" is still loading
        during = r.ready
        gate.set()
        await first
        after = r.ready, sorted(r.models)
        await r.close()
        return during, after

    with caplog.at_level(logging.WARNING, "serving.engine.repository"):
        during, after = asyncio.run(scenario())
    assert during is False
    assert after == (True, ["demo", "slow"])
    warnings = [rec.getMessage() for rec in caplog.records if "starting without" in rec.getMessage()]
    assert warnings == ["starting without broken: no version loads (see the errors above)"]


def test_a_model_of_one_sparse_feature_loads_and_serves_what_model_pt_computes(tmp_path):
    """The load's column check took max() of the columns outside feature 0's, which are none when there
    is one feature: every such model was refused ("max(): Expected reduction dim ...")."""
    config = {"tables": [{"name": "t", "num_embeddings": 40, "embedding_dim": 8, "feature_names": ["f"]}],
              "dense_in_features": 2, "dense_arch_layer_sizes": [8], "over_arch_layer_sizes": [4, 1]}
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    torch.save(factory_for(config).build(config, torch.device("cpu")).state_dict(), ckpt / "weights.pt")
    repo = tmp_path / "repo"
    assert run_cli("export", "--checkpoint", ckpt, "--repo", repo, "--name", "one", "--no-progress") == 0
    server = InProcessServer(repo)
    try:
        with Client(server.target) as client:
            dense, (keys, lengths, values) = random_request(client.model_info("one").models[0], 5, seed=2)
            ctr = client.predict("one", dense, (keys, lengths, values))
    finally:
        server.stop()
    with torch.no_grad():
        want = torch.jit.load(str(repo / "one" / "1" / "model.pt"))(
            torch.from_numpy(dense), torch.from_numpy(values.astype(np.int64)), torch.from_numpy(lengths))
    np.testing.assert_array_equal(ctr, want.numpy())


def _golden_edit(case):
    """golden.pt rewritten (its checksum in the manifest updated), named after what it breaks."""
    def one(name, fn):
        return lambda g: {**g, name: fn(g)}

    def first_id(value):
        def change(g):
            values = g["values"].clone()
            values[0] = value
            return values
        return one("values", change)

    edits = {
        "truncated": None,
        "empty": None,
        "a list": lambda g: [1, 2],
        "no pooled": lambda g: {k: v for k, v in g.items() if k != "pooled"},
        "dense 1-D": one("dense", lambda g: g["dense"].reshape(-1)),
        "values int32": one("values", lambda g: g["values"].int()),
        "a length negative": one("lengths", lambda g: torch.cat([g["lengths"][:-1], -g["lengths"][-1:]])),
        "lengths past the ids": one("lengths", lambda g: g["lengths"] + 1),
        "ctr of fewer samples": one("ctr", lambda g: g["ctr"][:1]),
        "an id negative": first_id(-5),
        "an id past the table": first_id(2**40),
    }
    return edits[case]


GOLDEN_CASES = {
    "truncated": "does not load (RuntimeError: PytorchStreamReader failed reading zip archive",
    "empty": "does not load (EOFError",
    "a list": "a list, not a dict of tensors",
    "no pooled": "pooled is NoneType, not a 2-D float32 tensor",
    "dense 1-D": "dense is float32 [64], not a 2-D float32 tensor",
    "values int32": "values is int32 [76], not a 1-D int64 tensor",
    "a length negative": "a length is -",
    "lengths past the ids": "the lengths add up to 100, the ids are 76",
    "ctr of fewer samples": "8 samples of dense, 1 of ctr, 8 of pooled and 24 lengths",
    "an id negative": "feature 0 has id -5",
    "an id past the table": "manifest field features[0].rows: 2000, but the table of feature 0 in the artifact has "
                            "1099511627777 rows",
}


@pytest.mark.parametrize("case", list(GOLDEN_CASES))
def test_a_golden_pt_not_as_the_export_writes_it_is_refused_in_one_line(case, repo, artifact, caplog):
    """golden.pt is checksummed, but by the manifest, which anyone rewriting it rewrites too. One that
    did not load, or not as a dict of the export's tensors, was refused with a bare EOFError(),
    KeyError('pooled') or IndexError (reason label to match); one whose ids lay outside their tables
    ran them through the lookup kernels, which read any row they are given."""
    path = publish(repo, "demo", 2, artifact)
    golden = path / "golden.pt"
    if case in ("truncated", "empty"):
        data = golden.read_bytes()
        golden.write_bytes(data[:len(data) // 2] if case == "truncated" else b"")
    else:
        torch.save(_golden_edit(case)(torch.load(golden, weights_only=True)), golden)
    rewrite_checksum(path, "golden.pt")

    lines = refusal_of_version_2(repo, caplog)
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert GOLDEN_CASES[case] in lines[0], lines[0]
    if "manifest field" not in GOLDEN_CASES[case]:
        assert f"{golden}: " in lines[0], lines[0]


class _NoLookup(torch.nn.Module):
    def forward(self, dense, values, lengths):
        return dense.sum(1)


class _OtherFeatures(_NoLookup):
    """A model of two 16-wide features, where the manifest and golden.pt say three."""

    @torch.jit.export
    def lookup(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return torch.zeros(lengths.numel() // 2, 32).view(-1, 32).reshape(lengths.numel() // 3, 32)


class _Asserting(_NoLookup):
    """A model whose TorchScript asserts on its inputs: it fails as torch.jit.Error, no RuntimeError."""

    @torch.jit.export
    def lookup(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        assert lengths.numel() < 3, "more bags than this model takes"
        return torch.zeros(lengths.numel() // 3, 32)


@pytest.mark.parametrize("module, message", [
    (_NoLookup, "model.pt has no lookup method; not an artifact of recserve export"),
    # its lookup first runs on a bag of each feature's ids, one feature a sample (the check of table rows)
    (_OtherFeatures, "model.pt fails on a bag of each feature's ids (RuntimeError: shape '[3, 32]' is invalid for "
                     "input of size 128)"),
    (_Asserting, "model.pt fails on a bag of each feature's ids (RuntimeError: AssertionError: more bags than this "
                 "model takes)"),
])
def test_a_model_pt_of_another_contract_is_refused_in_one_line(module, message, repo, artifact, caplog):
    """A model.pt without ``lookup``, or one that fails on its inputs, was refused as
    AttributeError(...) or as a TorchScript trace of dozens of lines (reason labels to match)."""
    path = publish(repo, "demo", 2, artifact)
    torch.jit.save(torch.jit.script(module()), str(path / "model.pt"))
    rewrite_checksum(path, "model.pt")

    lines = refusal_of_version_2(repo, caplog)
    assert len(lines) == 1 and lines[0].endswith(f"): {path}: {message}"), lines


ROWS_CASES = {
    # FBGEMM's lookups check no bounds: ids up to 2099 would have read past the table's 40064 bytes
    2100: "manifest field features[0].rows: 2100, more than the 1997 to 2003 rows model.pt's table of feature 0 "
          "holds (ids below 2100 would read row 2099 of sparse.ebc.tbes.0 table 0, past its end); the manifest "
          "does not describe this artifact",
    2**40: "manifest field features[0].rows: 1099511627776, more than the 1997 to 2003 rows model.pt's table of "
           "feature 0 holds (ids below 1099511627776 would read row 1099511627775 of sparse.ebc.tbes.0 table 0, "
           "past its end); the manifest does not describe this artifact",
    1000: "manifest field features[0].rows: 1000, fewer than the 1997 to 2003 rows model.pt's table of feature 0 "
          "holds; the manifest does not describe this artifact",
}


@pytest.mark.parametrize("rows", list(ROWS_CASES))
def test_rows_that_golden_pt_agrees_with_but_model_pt_does_not_hold_are_refused(rows, repo, artifact, caplog):
    """A feature's rows were checked against golden.pt's largest id alone; both are checksummed by the
    manifest, which anyone editing one rewrites, so a manifest and a golden.pt saying 2100 rows for a
    table of 2000 let the front ends pass ids the table does not hold. The rows are now checked against
    the tables model.pt sends each feature's ids to, as loaded (2000 INT8 rows of dim 16 span 40064
    bytes on the CPU, FBGEMM's padding included: room for 2003), before any of those ids reaches a kernel."""
    path = publish_edited(repo, "demo", 2, artifact, lambda m: m["features"][0].update(rows=rows))
    golden = torch.load(path / "golden.pt", weights_only=True)
    lengths = golden["lengths"].reshape(3, -1)
    ids = golden["values"][:int(lengths[0].sum())]  # feature 0's: the export's largest is 1999, the last row
    ids[ids == ids.max()] = rows - 1
    ids.clamp_(max=rows - 1)
    torch.save(golden, path / "golden.pt")
    rewrite_checksum(path, "golden.pt")

    lines = refusal_of_version_2(repo, caplog)  # version 1, as exported, serves
    assert len(lines) == 1 and lines[0].endswith(f"): {ROWS_CASES[rows]}"), lines
