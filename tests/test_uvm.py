"""Tables in host memory (issue 16): the plan's ``placement``, TorchRec's planner's choice under a
budget, the manifest's record and ``recserve inspect`` on CPU; on a GPU, served answers of ``uvm`` /
``uvm_caching`` exports against the all-HBM export of the same checkpoint, and version swaps."""
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, run_cli

from export.models import table_configs
from export.plan import make_plan, planner_module_plan, table_memory, torchrec_module_plan
from recserve.errors import UserError
from recserve.manifest import list_versions, load_verified, read_manifest


def small_tables(n=3, rows=1000, dim=16):
    cfg = {"model": "dlrm", "tables": [{"name": f"t{i}", "num_embeddings": rows, "embedding_dim": dim,
                                        "feature_names": [f"f{i}"], "pooling": "SUM"} for i in range(n)]}
    return table_configs(cfg, torch.device("meta"))


def float_ebc(tables):
    from torchrec import EmbeddingBagCollection

    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


# -- the plan --------------------------------------------------------------------------------------

def test_plan_reads_placement_and_cache_load_factor_with_defaults():
    tables = small_tables()
    plan = make_plan({"tables": {"t0": {"placement": "uvm_caching", "cache_load_factor": 0.05},
                                 "t1": {"placement": "uvm_caching"}, "t2": {"placement": "uvm"}}}, tables, None, "int8")
    assert [(tp.placement, tp.cache_load_factor) for tp in plan.tables.values()] == [
        ("uvm_caching", 0.05), ("uvm_caching", 0.2), ("uvm", None)]
    assert make_plan({}, tables, None, "int8").tables["t0"].placement == "hbm"


@pytest.mark.parametrize("spec,message", [
    ({"placement": "ssd"}, "placement 'ssd' is not one of ['hbm', 'uvm', 'uvm_caching']"),
    ({"placement": "uvm", "cache_load_factor": 0.1}, "cache_load_factor needs \"placement\": \"uvm_caching\""),
    ({"placement": "uvm_caching", "cache_load_factor": 0}, "cache_load_factor 0 must be a number in (0, 1]"),
    ({"placement": "uvm_caching", "cache_load_factor": "0.1"}, "cache_load_factor '0.1' must be a number"),
])
def test_plan_refuses_bad_placements(spec, message):
    with pytest.raises(UserError) as e:
        make_plan({"tables": {"t1": spec}}, small_tables(), None, "int8")
    assert message in str(e.value) and "'t1'" in str(e.value)


def test_plan_placements_become_torchrec_compute_kernels_and_cache_params():
    tables = small_tables()
    plan = make_plan({"tables": {"t0": {"placement": "uvm_caching", "cache_load_factor": 0.05},
                                 "t1": {"placement": "uvm"}}}, tables, None, "int8")
    module_plan = torchrec_module_plan(float_ebc(tables), plan, "cuda")
    assert {n: ps.compute_kernel for n, ps in module_plan.items()} == {
        "t0": "quant_uvm_caching", "t1": "quant_uvm", "t2": "quant"}
    assert module_plan["t0"].cache_params.load_factor == 0.05
    assert module_plan["t1"].cache_params is None and module_plan["t2"].cache_params is None


def test_planner_sends_what_does_not_fit_the_gpu_budget_to_uvm_caching():
    """Three INT8 tables of 1M x 64 (~65 MiB each): a 100 MiB budget holds one in HBM, not three."""
    tables = small_tables(rows=1_000_000, dim=64)
    plan = make_plan({}, tables, 1, "int8")
    tight = planner_module_plan(float_ebc(tables), plan, "cuda", 100 * 2**20)
    kernels = sorted(ps.compute_kernel for ps in tight.values())
    assert "quant_uvm_caching" in kernels and len(kernels) == 3
    assert all(ps.cache_params.load_factor == 0.2 for ps in tight.values() if ps.compute_kernel == "quant_uvm_caching")
    roomy = planner_module_plan(float_ebc(tables), plan, "cuda", 4 * 2**30)
    assert {ps.compute_kernel for ps in roomy.values()} == {"quant"}
    on_cpu = planner_module_plan(float_ebc(tables), plan, "cpu", 4 * 2**30)
    assert {ps.compute_kernel for ps in on_cpu.values()} == {"quant"}


def test_a_placing_plan_must_fit_the_gpu_budget_too():
    """Three 1M x 64 INT8 tables, 80 B per row on CUDA: 76.3 MiB each in HBM, 15.3 MiB as a 0.2 cache."""
    from export.plan import check_budget

    tables = small_tables(rows=1_000_000, dim=64)
    ebc = float_ebc(tables)
    in_hbm = make_plan({"tables": {"t0": {"placement": "hbm"}}}, tables, None, "int8")
    with pytest.raises(UserError) as e:
        check_budget(torchrec_module_plan(ebc, in_hbm, "cuda"), in_hbm, "cuda", 100 * 2**20)
    assert str(e.value).startswith("the plan puts 0.22 GiB of tables and caches in the memory of rank 0, above "
                                   "--device-memory-gb 0.0976562: place tables in \"uvm_caching\"")
    cached = make_plan({"tables": {t.name: {"placement": "uvm_caching"} for t in tables}}, tables, None, "int8")
    check_budget(torchrec_module_plan(ebc, cached, "cuda"), cached, "cuda", 100 * 2**20)  # 46 MiB of caches


def test_table_memory_counts_fbgemm_rows_and_the_cache_share():
    tables = small_tables(rows=1000, dim=16)
    plan = make_plan({"tables": {"t0": {"placement": "uvm_caching", "cache_load_factor": 0.25},
                                 "t1": {"placement": "uvm"}}}, tables, None, "int8")
    row = 32  # 16 INT8 values + fp16 scale and bias = 20 bytes, padded to 16 on CUDA
    assert table_memory([[1000, 16]], plan.tables["t0"], "cuda") == (1000 * row // 4, 1000 * row)
    assert table_memory([[1000, 16]], plan.tables["t1"], "cuda") == (0, 1000 * row)
    assert table_memory([[600, 16], [400, 16]], plan.tables["t2"], "cuda") == (1000 * row, 0)
    assert table_memory([[1000, 16]], plan.tables["t2"], "cpu") == (0, 1000 * 20)


# -- the CLI on CPU --------------------------------------------------------------------------------

def test_cpu_export_refuses_uvm_placements_in_one_line(checkpoint, tmp_path):
    names = [t["name"] for t in json.loads((checkpoint / "model_config.json").read_text())["tables"]]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"tables": {names[0]: {"placement": "uvm_caching"}}}))
    proc = subprocess.run([sys.executable, "-m", "recserve", "export", "--checkpoint", str(checkpoint), "--repo",
                           str(tmp_path / "repo"), "--name", "m", "--plan", str(plan), "--no-progress"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"recserve export: error: plan: table(s) ['{names[0]}'] are placed in uvm/uvm_caching, which "
                     "needs --device cuda; on a CPU export every table lives in host memory already: drop "
                     "\"placement\""], proc.stderr[-2000:]
    assert not (tmp_path / "repo" / "m" / "1").exists()


def test_manifest_records_placement_and_inspect_prints_memory(artifact, capsys):
    m = load_verified(artifact)
    for ts in m.sharding.tables.values():
        assert ts.placement == "hbm" and ts.cache_load_factor is None and ts.hbm_bytes == 0
    feature = {f.table: f for f in m.features}
    # on CPU every row is host memory: rows x (dim INT8 values + 4 bytes of scale and bias)
    assert {t: ts.host_bytes for t, ts in m.sharding.tables.items()} == {
        t: f.rows * (f.dim + 4) for t, f in feature.items()}
    assert run_cli("inspect", artifact) == 0
    out = capsys.readouterr().out
    # A CPU artifact is described without GPU words: no placement (hbm), no GPU column.
    assert "memory MiB" in out and not any(word in out for word in ("hbm", "HBM", "GPU", "placement"))
    total = sum(ts.host_bytes for ts in m.sharding.tables.values())
    assert f"tables {m.table_bytes / 2**20:.2f} MiB in host memory," in out and total <= m.table_bytes


def test_manifest_without_placement_reads_as_hbm(artifact, tmp_path):
    d = json.loads((artifact / "manifest.json").read_text())
    for ts in d["sharding"]["tables"].values():
        for key in ("placement", "cache_load_factor", "hbm_bytes", "host_bytes"):
            del ts[key]
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    m = read_manifest(tmp_path)
    assert {ts.placement for ts in m.sharding.tables.values()} == {"hbm"}


# -- ids for load generators (recserve/ids.py) -----------------------------------------------------

def test_zipf_ids_are_skewed_spread_over_the_table_and_fixed_per_table():
    import numpy as np

    from recserve.ids import IdDistribution

    zipf = IdDistribution.parse("zipf:1.05")
    rows = 1_000_000
    ids = zipf.sample(np.random.default_rng(0), rows, 200_000, table_index=3)
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < rows
    values, counts = np.unique(ids, return_counts=True)
    top = values[np.argsort(-counts)[:100]]
    # rank r drawn with probability ~ r^-1.05 over 1M rows: the 100 hottest rows carry about 40% of
    # the lookups (uniform ids: 0.01%)
    assert 0.3 < np.sort(counts)[::-1][:100].sum() / ids.size < 0.5
    assert top.max() - top.min() > rows // 2  # hot rows are spread over the table, not at id 0
    again = zipf.sample(np.random.default_rng(1), rows, 200_000, table_index=3)
    hottest = lambda x: np.bincount(x, minlength=rows).argmax()  # noqa: E731
    assert hottest(ids) == hottest(again)  # the same hot row in every client process
    assert hottest(zipf.sample(np.random.default_rng(0), rows, 200_000, table_index=4)) != hottest(ids)
    uniform = IdDistribution.parse("uniform").sample(np.random.default_rng(0), rows, 200_000, 3)
    assert np.sort(np.bincount(uniform))[::-1][:100].sum() / uniform.size < 0.01
    assert str(zipf) == "zipf:1.05" and str(IdDistribution.parse("uniform")) == "uniform"


@pytest.mark.parametrize("spec", ["zipf", "zipf:", "zipf:-1", "zipf:abc", "zipf:nan", "normal:1", ""])
def test_bad_id_distribution_says_what_to_write(spec):
    from recserve.ids import IdDistribution

    with pytest.raises(UserError) as e:
        IdDistribution.parse(spec)
    assert str(e.value) == f"--id-distribution {spec!r}: use uniform or zipf:ALPHA with 0 < ALPHA < 10"


def test_random_request_draws_ids_from_the_distribution(artifact):
    import numpy as np

    from recserve.client import random_request
    from recserve.ids import IdDistribution
    from recserve.v1 import inference_pb2 as pb

    m = read_manifest(artifact)
    info = pb.ModelInfo(name="demo", dense_features=m.dense_features,
                        features=[pb.FeatureInfo(name=f.name, rows=f.rows) for f in m.features])
    uniform = random_request(info, 64, seed=5)
    assert np.array_equal(uniform[1][2], random_request(info, 64, seed=5, ids=IdDistribution())[1][2])
    dense, (keys, lengths, values) = random_request(info, 4096, 8.0, seed=5, ids=IdDistribution.parse("zipf:1.2"))
    first = values[:lengths[:4096].sum()]  # the first feature's ids
    assert first.max() < m.features[0].rows
    assert np.bincount(first).max() > 20 * np.bincount(uniform[1][2][:uniform[1][1][:64].sum()]).max()


# -- serving side on CPU (serving/engine/uvm.py) ----------------------------------------------------------

def test_attribute_walk_reloads_every_tensor_and_keeps_the_answers(artifact):
    """The loader of uvm artifacts rebuilds every tensor attribute of model.pt (here onto the CPU,
    where there are no uvm rows): the module still reproduces golden.pt exactly."""
    import fbgemm_gpu  # noqa: F401

    from serving.engine import uvm

    module = uvm.load_with_host_tables(artifact / "model.pt", torch.device("cpu"))
    golden = torch.load(artifact / "golden.pt", weights_only=True)
    with torch.no_grad():
        assert torch.equal(module(golden["dense"], golden["values"], golden["lengths"]), golden["ctr"])
        assert torch.equal(module.lookup(golden["values"], golden["lengths"]), golden["pooled"])
    assert not uvm.CacheStats(module, read_manifest(artifact))  # no UVM cache: nothing to count


def test_only_uvm_cached_artifacts_run_eagerly(artifact):
    from serving.engine import uvm

    m = read_manifest(artifact)
    assert uvm.not_capturable(m) is None and not uvm.has_host_tables(m)
    first, second = sorted(m.sharding.tables)[:2]
    m.sharding.tables[first].placement = "uvm"
    assert uvm.not_capturable(m) is None and uvm.has_host_tables(m)  # uvm rows: the graph reads them as it is
    m.sharding.tables[second].placement = "uvm_caching"
    assert uvm.not_capturable(m).startswith(f"table(s) {second} are UVM-cached")


def test_a_uvm_cache_the_manifest_does_not_name_refuses_the_version(artifact):
    """Whether a model runs from CUDA graphs was decided by the manifest's placements alone, which the
    checksums do not cover: a manifest saying hbm for a UVM-cached table had its cache, whose per-call
    state a graph freezes, captured and replayed. model.pt's own caches now count: such a version is
    refused, naming the field."""
    import fbgemm_gpu  # noqa: F401

    from recserve import tables
    from recserve.manifest import ArtifactError
    from serving.engine.loader import check_module

    m = read_manifest(artifact)
    module = torch.jit.load(str(artifact / "model.pt"))
    check_module(module, m, artifact, torch.device("cpu"))  # no cache: as exported
    owner, leaf = tables.owner_of(module, "sparse.ebc.tbes.0.lxu_cache_weights")
    owner.setattr(leaf, torch.zeros(64, dtype=torch.uint8))  # what a uvm_caching TBE holds on the GPU
    with pytest.raises(ArtifactError) as e:
        check_module(module, m, artifact, torch.device("cpu"))
    assert str(e.value) == ("manifest field sharding.tables: no table is uvm_caching, but model.pt's "
                            "sparse.ebc.tbes.0 hold a UVM cache; the manifest does not describe this artifact")
    m.sharding.tables[m.features[0].table].placement = "uvm_caching"  # as the export writes it: runs eagerly
    check_module(module, m, artifact, torch.device("cpu"))


def test_hit_ratio_counts_what_changed_between_reads():
    from serving.engine.uvm import hit_ratio

    assert hit_ratio({"t0": (10, 5)}, {"t0": (40, 15), "t1": (10, 0)}) == pytest.approx(40 / 50)
    assert hit_ratio({"t0": (10, 5)}, {"t0": (10, 5)}) is None


def test_predict_random_takes_an_id_distribution(capsys):
    assert run_cli("predict", "--target", "127.0.0.1:1", "--model", "m", "--random", "4",
                   "--id-distribution", "zipf:0") == 2
    assert "--id-distribution 'zipf:0': use uniform or zipf:ALPHA" in capsys.readouterr().err


def test_bench_sends_the_id_distribution_it_is_given(artifact, tmp_path):
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(artifact, repo / "demo" / "1")
    out = tmp_path / "bench.json"
    assert run_cli("bench", "--repo", repo, "--name", "demo", "--device", "cpu", "--batch-sizes", "16",
                   "--duration", "0.2", "--no-served", "--id-distribution", "zipf:1.05", "--json", out) == 0
    figures = json.loads(out.read_text())
    assert figures["id_distribution"] == "zipf:1.05" and figures["placements"] == ["hbm"]
    assert [r["cache_hit_ratio"] for r in figures["rows"]] == [None]  # no UVM cache in this model


# -- on the GPU --------------------------------------------------------------------------------------

def _export(checkpoint, repo, name, placement=None, load_factor=None):
    args = ["export", "--checkpoint", checkpoint, "--repo", repo, "--name", name, "--device", "cuda", "--no-progress"]
    if placement:
        names = [t["name"] for t in json.loads((checkpoint / "model_config.json").read_text())["tables"]]
        spec = {"placement": placement, **({"cache_load_factor": load_factor} if load_factor else {})}
        plan = repo.parent / f"plan-{name}.json"
        plan.write_text(json.dumps({"tables": {n: spec for n in names}}))
        args += ["--plan", plan]
    assert run_cli(*args) == 0
    return repo / name / str(list_versions(repo / name)[-1])


def _batches(path, count=4, batch_size=512):
    from export.verify import sample_batch

    m = read_manifest(path)
    return [sample_batch([(f.name, f.rows) for f in m.features], m.dense_features, batch_size, seed=50 + s).to(
        torch.device("cuda"), torch.device("cuda")) for s in range(count)]


def _answers(module, batches):
    with torch.no_grad():
        return [(module(b.dense, b.values, b.lengths), module.lookup(b.values, b.lengths)) for b in batches]


def _runner(path):
    from serving.engine.runner import ModelRunner
    from serving.ipc import Schema

    m = load_verified(path)
    return ModelRunner(path, m, Schema.from_manifest(m, 1024, max_ids=1 << 20))


@pytest.mark.gpu
def test_uvm_and_uvm_caching_serve_exactly_what_the_hbm_export_serves(checkpoint, tmp_path):
    repo = tmp_path / "repo"
    hbm = _export(checkpoint, repo, "hbm")
    host = _export(checkpoint, repo, "uvm", "uvm")
    cached = _export(checkpoint, repo, "cached", "uvm_caching", 0.1)
    for path, placement in ((hbm, "hbm"), (host, "uvm"), (cached, "uvm_caching")):
        tables = load_verified(path).sharding.tables.values()
        assert {ts.placement for ts in tables} == {placement}
        assert all((ts.hbm_bytes > 0) == (placement != "uvm") and (ts.host_bytes > 0) == (placement != "hbm")
                   for ts in tables)
    batches = _batches(hbm)
    want = _answers(_runner(hbm).module, batches)
    table_bytes = load_verified(host).table_bytes
    for path in (host, cached):
        before = torch.cuda.memory_allocated()
        runner = _runner(path)
        # the rows live in host memory: the GPU holds the cache and the dense part, not the tables
        assert torch.cuda.memory_allocated() - before < load_verified(path).dense_bytes + table_bytes // 2
        for _ in range(2):  # cold, then warm caches
            for (ctr, pooled), (want_ctr, want_pooled) in zip(_answers(runner.module, batches), want):
                assert torch.equal(pooled, want_pooled) and torch.equal(ctr, want_ctr)
        if path == cached:
            stats = runner.cache_stats.read()
            assert stats and all(hits > 0 and misses > 0 for hits, misses in stats.values())
            assert runner.forward.disabled_reason.startswith("table(s)")
        else:
            assert not runner.cache_stats and runner.forward.disabled_reason is None
    # a fresh process (no export imported FBGEMM's Python modules there) loads and measures it
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "recserve", "bench", "--repo", str(repo), "--name", "cached",
                           "--device", "cuda", "--batch-sizes", "256", "--duration", "0.3", "--no-served",
                           "--no-kernels", "--id-distribution", "zipf:1.05", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 0 < json.loads(out.read_text())["rows"][0]["cache_hit_ratio"] < 1


@pytest.mark.gpu
def test_a_new_version_never_reads_the_old_versions_cache(checkpoint, tmp_path):
    """v1 and v2 of one model hold different rows under the same ids: v2, loaded after v1 has filled
    its cache with those ids, answers what v2's all-HBM export answers."""
    other = tmp_path / "other"
    assert run_cli("train-demo", "--out", other, "--steps", "50", "--seed", "7") == 0
    repo = tmp_path / "repo"
    v1 = _export(checkpoint, repo, "m", "uvm_caching", 0.5)
    v2 = _export(other, repo, "m", "uvm_caching", 0.5)
    assert (v1.name, v2.name) == ("1", "2")
    hbm2 = _export(other, repo, "hbm2")
    batches = _batches(v1)
    first = _runner(v1)
    old = _answers(first.module, batches)
    second = _runner(v2)
    for (ctr, pooled), (want_ctr, want_pooled), (old_ctr, _) in zip(
            _answers(second.module, batches), _answers(_runner(hbm2).module, batches), old):
        assert torch.equal(pooled, want_pooled) and torch.equal(ctr, want_ctr) and not torch.equal(ctr, old_ctr)


@pytest.mark.gpu
def test_served_cached_model_answers_like_hbm_and_counts_cache_hits(checkpoint, tmp_path):
    import time

    import numpy as np
    from servers import InProcessServer

    from recserve.client import Client, random_request
    from recserve.ids import IdDistribution

    repo = tmp_path / "repo"
    _export(checkpoint, repo, "hbm")
    _export(checkpoint, repo, "cached", "uvm_caching", 0.1)
    server = InProcessServer(repo, max_batch_size=1024)
    try:
        with Client(server.target) as client:
            info = client.model_info("cached").models[0]
            for seed in range(5):
                dense, sparse = random_request(info, 256, 4.0, seed=seed, ids=IdDistribution.parse("zipf:1.05"))
                # the all-HBM model replays a CUDA graph, the cached one runs eagerly: the same kernels
                np.testing.assert_allclose(client.predict("cached", dense, sparse),
                                           client.predict("hbm", dense, sparse), atol=1e-6, rtol=0)
        deadline = time.monotonic() + 30  # the engine publishes its gauges and counters every few seconds
        text = server.scrape()
        while "recserve_embedding_cache_hits_total{" not in text and time.monotonic() < deadline:
            time.sleep(0.5)
            text = server.scrape()
        hits = [line for line in text.splitlines() if line.startswith("recserve_embedding_cache_hits_total{")]
        misses = [line for line in text.splitlines() if line.startswith("recserve_embedding_cache_misses_total{")]
        assert hits and misses and all('model="cached"' in line for line in hits + misses)
        assert sum(float(line.rsplit(" ", 1)[1]) for line in hits) > 0
        assert "recserve_host_memory_bytes " in text
    finally:
        assert server.stop() == 0


def test_a_tbe_scripted_whole_loads_in_a_fresh_process(checkpoint, tmp_path, monkeypatch):
    """UVM-cached tables keep FBGEMM's TBE a module, scripted whole (its enums in model.pt); the CPU
    has no cache, so the export is told to script it whole here. A new process, where nothing
    scripted a TBE before, loads it through serving/engine/uvm.py and reproduces golden.pt."""
    from export import pipeline

    monkeypatch.setattr(pipeline, "_has_cache", lambda ebc: True)
    assert run_cli("export", "--checkpoint", checkpoint, "--repo", tmp_path, "--name", "m", "--no-progress") == 0
    path = tmp_path / "m" / "1"
    # the lookup kernel is called inside the scripted TBE, not from the traced graph
    assert "int_nbit_split_embedding_codegen_lookup_function" not in torch.jit.load(str(path / "model.pt")).sparse.code
    code = ("import sys, torch\nfrom serving.engine.uvm import load_with_host_tables\n"
            "m = load_with_host_tables(sys.argv[1] + '/model.pt', torch.device('cpu'))\n"
            "g = torch.load(sys.argv[1] + '/golden.pt', weights_only=True)\n"
            "print(torch.equal(m(g['dense'], g['values'], g['lengths']), g['ctr']),"
            " torch.equal(m.lookup(g['values'], g['lengths']), g['pooled']))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "True"]
