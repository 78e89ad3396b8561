"""Export-side subcommands: ``train-demo``, ``export``, ``inspect``."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from recserve.errors import UserError
from recserve.manifest import DENSE_DTYPES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-demo", help="train a small DLRM on synthetic clicks and write a checkpoint")
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=400, help="training steps of 512 samples (default 400)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data and of the weights")
    p.add_argument("--force", action="store_true", help="overwrite a checkpoint already in --out")
    p.set_defaults(handler=_train_demo)

    p = sub.add_parser("export", help="checkpoint -> verified INT8 sharded TorchScript artifact")
    p.add_argument("--checkpoint", type=Path, required=True, help="directory with model_config.json and weights.pt")
    p.add_argument("--repo", type=Path, required=True, help="model repository (REPO/NAME/VERSION/)")
    p.add_argument("--name", required=True, help="model name")
    p.add_argument("--version", type=int, default=None, help="default: one above the newest present")
    p.add_argument("--dtype", default="int8", choices=["int8", "int4", "fp16"],
                   help="table weight dtype: int8 (default), int4 or fp16")
    p.add_argument("--plan", type=Path, default=None, help="JSON plan: per-table sharding, dtype and placement (hbm, uvm, uvm_caching)")
    p.add_argument("--world-size", type=int, default=None, help="number of ranks (devices) to shard over")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu or cuda (ranks on cuda:0..N-1)")
    p.add_argument("--device-memory-gb", type=float, default=None,
                   help="per-device memory budget for TorchRec's planner (used when the plan places no table); "
                        "on cuda, tables that do not fit go to host memory behind an HBM cache (uvm_caching); a plan "
                        "that places tables must fit it too")
    p.add_argument("--dense-dtype", default="auto", choices=["auto", *DENSE_DTYPES],
                   help="precision of the dense layers: auto (default: bf16 on cuda, fp32 on cpu), fp32, tf32, bf16 "
                        "or fp16 (tf32/fp16: cuda only); the export's gates check each against the float model")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (there is none where stderr is not a terminal)")
    p.set_defaults(handler=_export)

    p = sub.add_parser("inspect", help="print an artifact's manifest summary and verify its checksums")
    p.add_argument("path", type=Path, help="REPO/NAME/VERSION")
    p.set_defaults(handler=_inspect)


def _train_demo(args: argparse.Namespace) -> int:
    from export.inputs import check_overwrite

    if args.steps < 1:
        raise UserError(f"--steps must be >= 1, got {args.steps}")
    if not 0 <= args.seed < 2**64:  # numpy's and torch's seeds
        raise UserError(f"--seed must be from 0 to 2**64 - 1, got {args.seed}")
    check_overwrite(args.out, args.force)
    from export.train_demo import train_demo

    train_demo(args.out, steps=args.steps, seed=args.seed)
    return 0


def _export(args: argparse.Namespace) -> int:
    _check_export_arguments(args)
    from export.run import ExportOptions, run_export

    result = run_export(ExportOptions(
        checkpoint=args.checkpoint, repo=args.repo, name=args.name, version=args.version, dtype=args.dtype,
        plan=args.plan, world_size=args.world_size, device=args.device, dense_dtype=args.dense_dtype,
        device_memory_gb=args.device_memory_gb,
        progress=not args.no_progress,
    ))
    m = result.manifest
    v = m.verification
    print(f"exported {m.name} version {m.version} to {result.path}")
    for gate in ("quantized_vs_float", "sharded_vs_float", "reloaded_vs_sharded"):
        figures = getattr(v, gate)
        print(f"  {gate:20s} ctr max abs err {figures['ctr_max_abs_err']:.2e}   "
              f"pooled rel err {figures['pooled_rel_err']:.2e}")
    print(f"  tables {m.table_bytes / 2**20:.2f} MiB, dense {m.dense_bytes / 2**20:.2f} MiB; "
          f"export time {m.export_seconds:.1f}s; peak host memory {result.peak_rss_mb:.0f} MiB")
    return 0


def _check_export_arguments(args: argparse.Namespace) -> None:
    """What can be wrong in the arguments alone, said before torch is imported (seconds)."""
    from export.inputs import read_checkpoint_config, read_plan_file, resolve_dense_dtype, version_dir

    read_checkpoint_config(args.checkpoint)
    if args.repo.exists() and not args.repo.is_dir():
        raise UserError(f"--repo {args.repo} is not a directory")
    if args.world_size is not None and args.world_size < 1:
        raise UserError(f"--world-size must be >= 1, got {args.world_size}")
    if args.device_memory_gb is not None and not 0 < args.device_memory_gb < math.inf:  # nan and inf: no budget
        raise UserError(f"--device-memory-gb must be a finite number > 0, got {args.device_memory_gb:g}")
    resolve_dense_dtype(args.dense_dtype, args.device)
    read_plan_file(args.plan)
    version_dir(args.repo, args.name, args.version)


def _inspect(args: argparse.Namespace) -> int:
    from recserve.manifest import MANIFEST_FILE, list_models, list_versions, load_verified

    what = "pass an artifact's version directory, REPO/NAME/VERSION"
    if not args.path.exists() and args.path.parent.is_dir():
        raise UserError(f"{args.path}: no such directory; {what}")
    if args.path.is_file():
        raise UserError(f"{args.path} is a file; {what}")
    if not (args.path / MANIFEST_FILE).exists() and args.path.is_dir():
        versions = list_versions(args.path)
        if versions:
            raise UserError(f"{args.path} is a model, not a version: pass REPO/NAME/VERSION, e.g. "
                            f"{args.path / str(versions[-1])} (versions: {', '.join(map(str, versions))})")
        models = {name: list_versions(args.path / name) for name in list_models(args.path)}
        models = {name: versions for name, versions in models.items() if versions}
        if models:
            name, versions = next(iter(models.items()))
            raise UserError(f"{args.path} is a model repository, not a version: pass REPO/NAME/VERSION, e.g. "
                            f"{args.path / name / str(versions[-1])} (models: {', '.join(models)})")
        raise UserError(f"{args.path} holds no {MANIFEST_FILE}, so it is no artifact's version directory; pass "
                        "REPO/NAME/VERSION (recserve export --repo REPO --name NAME writes one)")

    m = load_verified(args.path)
    print(f"{m.name} version {m.version} ({m.model_family}), format {m.format_version}, created {m.created_at}")
    print(f"  device {m.sharding.device}, world size {m.sharding.world_size}, dense features {m.dense_features} "
          f"({m.dense_dtype})")
    # A CPU artifact's tables are all in host memory: no placement, no GPU column.
    gpu = m.sharding.device == "cuda"
    where = f"{'placement':16s} {'GPU MiB':>10s} {'host MiB':>10s}" if gpu else f"{'memory MiB':>10s}"
    print(f"  {'feature':16s} {'table':12s} {'rows':>10s} {'dim':>5s} {'pool':5s} {'dtype':5s} {where} sharding")
    for f in m.features:
        ts = m.sharding.tables[f.table]
        placement = ts.placement + (f" ({ts.cache_load_factor:g})" if ts.cache_load_factor is not None else "")
        held = f"{placement:16s} {ts.hbm_bytes / 2**20:10.2f} {ts.host_bytes / 2**20:10.2f}" if gpu \
            else f"{ts.host_bytes / 2**20:10.2f}"
        print(f"  {f.name:16s} {f.table:12s} {f.rows:10d} {f.dim:5d} {f.pooling:5s} {f.weight_dtype:5s} {held} "
              f"{ts.type} ranks {ts.ranks}")
    hbm = sum(ts.hbm_bytes for ts in m.sharding.tables.values())
    host = sum(ts.host_bytes for ts in m.sharding.tables.values())
    split = f" ({hbm / 2**20:.2f} MiB in GPU memory, {host / 2**20:.2f} MiB in host memory)" if gpu else \
        " in host memory"
    print(f"  tables {m.table_bytes / 2**20:.2f} MiB{split}, dense {m.dense_bytes / 2**20:.2f} MiB")
    print("  versions: " + ", ".join(f"{k} {v}" for k, v in m.versions.items()))
    for gate in ("quantized_vs_float", "sharded_vs_float", "reloaded_vs_sharded"):
        figures = getattr(m.verification, gate)
        print(f"  {gate:20s} " + ", ".join(f"{k} {val:.2e}" for k, val in figures.items()))
    print("  checksums OK: " + ", ".join(sorted(m.files)))
    return 0
