"""``recserve export``: checkpoint -> verified INT8, sharded, TorchScript artifact.

The steps (export/pipeline.py), each checked on one sample batch before the next runs:
load checkpoint -> quantize (gate: quantized vs float) -> shard -> restore weights -> trace ->
(gate: sharded vs float) -> script -> save -> reload (gate: each feature's rows are those of the table
model.pt sends its ids to; gate: reloaded vs sharded, exact) -> golden -> manifest -> atomic rename.
"""
from __future__ import annotations

import datetime
import platform
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import fbgemm_gpu
import torch
import torchrec
from tqdm import tqdm

from export import pipeline
from export.checkpoint import load_checkpoint
from export.inputs import read_plan_file, resolve_dense_dtype, version_dir
from export.models import table_configs
from export.plan import (
    ExportPlan,
    check_budget,
    check_placements,
    make_plan,
    placement_of,
    planner_module_plan,
    table_memory,
    torchrec_module_plan,
)
from export.verify import EXACT, Batch, compare, gate, gate_features, gate_table_rows, sample_batch, thresholds_for
from export.write import save_module, save_tensors, staged
from recserve.errors import Interrupted, UserError
from recserve.manifest import (
    FORMAT_VERSION,
    GOLDEN_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    Feature,
    Manifest,
    Shard,
    Sharding,
    TableSharding,
    Verification,
    set_dense_math,
    sha256_file,
)

VERIFY_BATCH = 256
GOLDEN_BATCH = 8


@dataclass
class ExportOptions:
    checkpoint: Path
    repo: Path
    name: str
    version: Optional[int] = None
    dtype: str = "int8"
    plan: Optional[Path] = None
    world_size: Optional[int] = None
    device: str = "cpu"
    device_memory_gb: Optional[float] = None  # per-device budget for TorchRec's planner (no plan file)
    dense_dtype: str = "auto"  # bf16 on cuda (tensor cores; CTR within ~6e-4 of float), fp32 on cpu
    progress: bool = True


@dataclass
class ExportResult:
    path: Path
    manifest: Manifest
    peak_rss_mb: float


def _outputs(servable, batch: Batch):
    with torch.no_grad():
        return servable(batch.dense, batch.values, batch.lengths), servable.lookup(batch.values, batch.lengths)


def _float_outputs(factory, model, ebc_fqn: str, batch: Batch, feature_names):
    with torch.no_grad():
        kjt = batch.kjt()
        ctr = torch.sigmoid(factory.reference(model, batch.dense, kjt)).reshape(-1)
        pooled = model.get_submodule(ebc_fqn)(kjt).to_dict()
        return ctr, torch.cat([pooled[f] for f in feature_names], dim=1)


def _sharding_record(module_plan, plan: ExportPlan, device: str) -> Sharding:
    """Where every shard lives: offsets and sizes in [rows, columns] of the table, in which memory,
    and how many bytes of GPU and host memory the table holds."""
    tables = {}
    for name, ps in module_plan.items():
        shards = [
            Shard(rank=s.placement.rank(), offsets=list(s.shard_offsets), sizes=list(s.shard_sizes),
                  placement=str(s.placement))
            for s in ps.sharding_spec.shards
        ]
        tp = plan.tables[name]
        tp.sharding = ps.sharding_type
        tp.ranks = list(ps.ranks or [])
        tp.placement = placement_of(ps.compute_kernel)
        tp.cache_load_factor = ps.cache_params.load_factor if ps.cache_params else None
        hbm, host = table_memory([s.sizes for s in shards], tp, device)
        tables[name] = TableSharding(type=ps.sharding_type, ranks=tp.ranks, shards=shards, placement=tp.placement,
                                     cache_load_factor=tp.cache_load_factor, hbm_bytes=hbm, host_bytes=host)
    return Sharding(world_size=plan.world_size, device=device, tables=tables)


def _check_device(device: str, world_size: int) -> None:
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device is visible; export with --device cpu")
        if torch.cuda.device_count() < world_size:
            raise UserError(f"world size {world_size} needs {world_size} GPUs; {torch.cuda.device_count()} visible")


def run_export(opts: ExportOptions) -> ExportResult:
    started = time.monotonic()
    # disable=None: a bar only on a terminal; a log file gets no carriage returns.
    steps = tqdm(total=9, desc="export", unit="step", disable=None if opts.progress else True, file=sys.stderr,
                 bar_format="{desc}: {n}/{total} {bar:20} [{elapsed}] {postfix}")

    def step(label: str) -> None:
        steps.set_postfix_str(label)
        steps.update(1)

    target = version_dir(opts.repo, opts.name, opts.version)
    try:
        steps.set_postfix_str("load checkpoint")
        ckpt = load_checkpoint(opts.checkpoint)
        tables = table_configs(ckpt.config, torch.device("meta"))
        raw_plan = read_plan_file(opts.plan)
        plan = make_plan(raw_plan, tables, opts.world_size, opts.dtype)
        # Without a placement in the plan file, TorchRec's planner places the tables when there is a
        # choice to make: several devices, or a memory budget to respect.
        use_planner = not raw_plan.get("tables") and (plan.world_size > 1 or opts.device_memory_gb is not None)
        _check_device(opts.device, plan.world_size)
        check_placements(plan, opts.device)
        dense_dtype = resolve_dense_dtype(opts.dense_dtype, opts.device)
        float_model = ckpt.build_float_model()
        factory = ckpt.factory
        feature_names = [f for t in tables for f in t.feature_names]
        rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
        dense_features = int(ckpt.config["dense_in_features"])
        compute = torch.device("cuda:0" if opts.device == "cuda" else "cpu")
        verify_batch = sample_batch([(f, rows[f]) for f in feature_names], dense_features, VERIFY_BATCH, seed=0)
        float_out = _float_outputs(factory, float_model, factory.ebc_fqn, verify_batch, feature_names)
        thresholds = thresholds_for((tp.dtype for tp in plan.tables.values()), dense_dtype)
        feature_dtypes = [(f, t.embedding_dim, plan.tables[t.name].dtype) for t in tables for f in t.feature_names]
        step("quantize")

        quant_model = pipeline.quantize(ckpt.build_float_model(), plan, dense_dtype)
        quant_out = _float_outputs(factory, quant_model, factory.ebc_fqn, verify_batch, feature_names)
        quantized_vs_float = compare(quant_out[0], float_out[0], quant_out[1], float_out[1])
        gate("quantized vs float", quantized_vs_float, thresholds)
        gate_features("quantized vs float", quant_out[1], float_out[1], feature_dtypes, dense_dtype)
        weights = pipeline.quantized_weights(quant_model)
        step("shard")

        float_ebc = float_model.get_submodule(factory.ebc_fqn)
        if use_planner:
            memory = int(opts.device_memory_gb * 2**30) if opts.device_memory_gb else None
            module_plan = planner_module_plan(float_ebc, plan, opts.device, memory)
        else:
            module_plan = torchrec_module_plan(float_ebc, plan, opts.device)
            if opts.device_memory_gb is not None:
                check_budget(module_plan, plan, opts.device, int(opts.device_memory_gb * 2**30))
        sharded = pipeline.shard(quant_model, module_plan, factory, plan, opts.device)
        step("restore weights")

        pipeline.restore_weights(sharded.get_submodule(factory.ebc_fqn), weights, plan)
        del weights
        step("trace")

        head = factory.head(sharded, tables).to(compute)
        on_device = verify_batch.to(compute, compute)
        set_dense_math(dense_dtype)
        servable = pipeline.build_servable(sharded, head, factory, feature_names, on_device, dense_dtype)
        sharded_out = _outputs(servable, on_device)
        sharded_vs_float = compare(sharded_out[0], float_out[0], sharded_out[1], float_out[1])
        hint = "the sharded tables do not hold the trained weights"
        gate("sharded vs float", sharded_vs_float, thresholds, hint=hint)
        gate_features("sharded vs float", sharded_out[1], float_out[1], feature_dtypes, dense_dtype, hint=hint)
        step("script")

        scripted = pipeline.script(servable)
        features = [Feature(name=f, table=t.name, rows=t.num_embeddings, dim=t.embedding_dim, pooling=t.pooling.name,
                            weight_dtype=plan.tables[t.name].dtype) for t in tables for f in t.feature_names]
        with staged(target) as work:
            save_module(scripted, work / MODEL_FILE)
            step("reload")
            reloaded = torch.jit.load(str(work / MODEL_FILE), map_location=compute)
            # before any id reaches the reloaded tables, as the server's load checks it
            gate_table_rows(reloaded, features, compute)
            held = pipeline.artifact_bytes(reloaded)
            reloaded_out = _outputs(reloaded, on_device)
            reloaded_vs_sharded = compare(reloaded_out[0], sharded_out[0], reloaded_out[1], sharded_out[1])
            gate("reloaded model.pt vs sharded module", reloaded_vs_sharded, EXACT)
            step("golden")

            golden_batch = sample_batch([(f, rows[f]) for f in feature_names], dense_features, GOLDEN_BATCH, seed=1)
            golden_float = _float_outputs(factory, float_model, factory.ebc_fqn, golden_batch, feature_names)
            golden_ctr, golden_pooled = _outputs(reloaded, golden_batch.to(compute, compute))
            save_tensors(
                {
                    "dense": golden_batch.dense, "values": golden_batch.values, "lengths": golden_batch.lengths,
                    "ctr": golden_ctr.cpu(), "pooled": golden_pooled.cpu(),
                    "float_ctr": golden_float[0], "float_pooled": golden_float[1],
                },
                work / GOLDEN_FILE,
            )
            step("manifest")

            manifest = Manifest(
                format_version=FORMAT_VERSION,
                name=opts.name,
                version=int(target.name),
                model_family=str(getattr(factory, "name", ckpt.config.get("model"))),  # a user's factory: optional
                model_config=ckpt.config,
                features=features,
                dense_features=dense_features,
                sharding=_sharding_record(module_plan, plan, opts.device),
                dense_device=str(compute),
                dense_dtype=dense_dtype,
                sparse_device=str(compute),
                versions={"torch": torch.__version__, "torchrec": getattr(torchrec, "__version__", "unknown"),
                          "fbgemm_gpu": fbgemm_gpu.__version__, "python": platform.python_version()},
                fbgemm_libraries=[f"{lib}.so" for lib in fbgemm_gpu.fbgemm_gpu_libraries],
                files={n: sha256_file(work / n) for n in (MODEL_FILE, GOLDEN_FILE)},
                verification=Verification(
                    batch_size=VERIFY_BATCH,
                    thresholds=thresholds,
                    quantized_vs_float=quantized_vs_float,
                    sharded_vs_float=sharded_vs_float,
                    reloaded_vs_sharded=reloaded_vs_sharded,
                ),
                table_bytes=held["table_bytes"],
                dense_bytes=held["dense_bytes"],
                export_seconds=round(time.monotonic() - started, 3),
                created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            )
            (work / MANIFEST_FILE).write_text(manifest.to_json())
        step("done")
    except Interrupted as e:
        # staged() has removed what it wrote, unless the version was already renamed into place.
        written = target.exists()
        e.outcome = f" after {target} was written (it is complete)" if written else f"; {target} was not written"
        raise
    finally:
        steps.close()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return ExportResult(path=target, manifest=manifest, peak_rss_mb=peak_mb)
