"""Tables in host memory (issue 16): the plan's ``placement``, TorchRec's planner's choice under a
budget, the manifest's record and ``recserve inspect`` on CPU; on a GPU, served answers of ``uvm`` /
``uvm_caching`` exports against the all-HBM export of the same checkpoint, and version swaps."""
import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, run_cli

from export.models import table_configs
from export.plan import make_plan, planner_module_plan, table_memory, torchrec_module_plan
from recserve.errors import UserError
from recserve.manifest import load_verified, read_manifest


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
    assert "placement" in out and "HBM MiB" in out and "host MiB" in out
    total = sum(ts.host_bytes for ts in m.sharding.tables.values())
    assert f"(0.00 MiB in GPU memory, {total / 2**20:.2f} MiB in host memory)" in out


def test_manifest_without_placement_reads_as_hbm(artifact, tmp_path):
    d = json.loads((artifact / "manifest.json").read_text())
    for ts in d["sharding"]["tables"].values():
        for key in ("placement", "cache_load_factor", "hbm_bytes", "host_bytes"):
            del ts[key]
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    m = read_manifest(tmp_path)
    assert {ts.placement for ts in m.sharding.tables.values()} == {"hbm"}
