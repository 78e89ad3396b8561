"""``recserve bench`` (bare, floor and served throughput and latency in one run, kernel roofline on CUDA)
and ``recserve bench-checkpoint`` (a DLRM-v2-shaped checkpoint to export and measure)."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
from pathlib import Path
from typing import List

from recserve.ids import SPEC_HELP


def register(sub: argparse._SubParsersAction) -> None:
    from recserve.cli import HelpWithDefaults
    from recserve.client import ClientSecurity

    p = sub.add_parser("bench", help="measure the bare artifact and the served model in one run",
                       formatter_class=HelpWithDefaults)
    p.add_argument("--repo", type=Path, default=None,
                   help="model repository holding the artifact to measure (REPO/NAME/VERSION/); not with --target")
    p.add_argument("--name", required=True, help="model name (in --repo, or served by --target)")
    p.add_argument("--version", type=int, default=None, help="default: the newest")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu (must match the artifact)")
    p.add_argument("--batch-sizes", default="256,4096", help="comma-separated samples per request")
    p.add_argument("--concurrency", default="1,8",
                   help="closed-loop client processes, comma-separated: each count is a served run")
    p.add_argument("--duration", type=float, default=5.0, help="seconds measured per batch size and mode")
    p.add_argument("--ids-per-bag", type=float, default=10.0, help="mean ids per bag (Poisson)")
    p.add_argument("--shared-features", default="", metavar="N|NAMES",
                   help="ranking requests (one user, B candidates): these features (the model's first N, or "
                        "comma-separated names) have one bag per request; each served and floor row is run "
                        "twice, the bags sent once (shared) and repeated per sample")
    p.add_argument("--shared-ids-per-bag", type=float, default=50.0, help="mean ids per shared bag (Poisson)")
    p.add_argument("--shared-pooling", choices=["expand", "once"], default="expand",
                   help="the server's --shared-pooling")
    p.add_argument("--id-distribution", default="uniform", help="sparse ids of every request: " + SPEC_HELP)
    p.add_argument("--max-delay-ms", type=float, default=0.0, help="the server's batching delay")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="the server's max batch size (default: the largest of --batch-sizes; larger lets the "
                        "server merge concurrent requests)")
    p.add_argument("--frontends", type=int, default=None,
                   help="gRPC front-end processes: recserve serve --frontends N and N floor processes "
                        "(default: the server's own choice, and as many floor processes as it reports)")
    p.add_argument("--replicas", default="1", help="replicas per model in the server: N or auto (every GPU)")
    p.add_argument("--no-served", action="store_true", help="only the bare model (no floor either)")
    p.add_argument("--no-floor", action="store_true", help="skip the floor: gRPC alone, constant answers")
    p.add_argument("--no-kernels", action="store_true", help="skip the CUDA kernel roofline")
    p.add_argument("--kernel-variants", action="store_true",
                   help="also INT8 with FP16/BF16 output and row alignments 32/64/128")
    p.add_argument("--no-cuda-graphs", action="store_true", help="bare and served model calls run eagerly")
    p.add_argument("--breakdown", default="",
                   help="CUDA: comma-separated batch sizes to profile (lookups, dense, copies, GPU idle per call)")
    p.add_argument("--json", type=Path, default=None, help="write the figures as JSON")
    p.add_argument("--plot", type=Path, default=None, help="write throughput vs p99 latency as PNG")
    p.add_argument("--target", default=None,
                   help="HOST:PORT of a running recserve serve to measure (served rows only: no floor, no "
                        "server-side time split) instead of starting one; with the TLS and token flags below")
    ClientSecurity.add_arguments(p)
    p.set_defaults(handler=_bench)

    p = sub.add_parser("bench-checkpoint", help="write a DLRM-v2-shaped checkpoint with random weights",
                       formatter_class=HelpWithDefaults)
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--rows-per-table", type=int, default=500_000, help="rows of each of the 26 tables")
    p.add_argument("--model", default="dlrm_dcn", choices=["dlrm_dcn", "dlrm"],
                   help="DLRM-v2 with its DCN cross layers (as MLPerf), or plain DLRM")
    p.add_argument("--force", action="store_true", help="overwrite a checkpoint already in --out")
    p.set_defaults(handler=_bench_checkpoint)


def _bench_checkpoint(args: argparse.Namespace) -> int:
    from recserve.errors import UserError

    if args.rows_per_table < 1:
        raise UserError(f"--rows-per-table must be >= 1, got {args.rows_per_table}")
    from export.inputs import check_overwrite

    check_overwrite(args.out, args.force)
    from bench.checkpoint import write_bench_checkpoint

    out = write_bench_checkpoint(args.out, args.rows_per_table, args.model)
    print(f"wrote {out}")
    return 0


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _bench(args: argparse.Namespace) -> int:
    from recserve.errors import UserError

    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
        concurrency = [int(c) for c in args.concurrency.split(",") if c]
        breakdown_sizes = [int(b) for b in args.breakdown.split(",") if b]
    except ValueError:
        raise UserError("--batch-sizes, --concurrency and --breakdown take comma-separated integers") from None
    for flag, values in (("--batch-sizes", batch_sizes), ("--concurrency", concurrency)):
        if not values:
            raise UserError(f"{flag} needs at least one value")
    for flag, values in (("--batch-sizes", batch_sizes), ("--concurrency", concurrency), ("--breakdown", breakdown_sizes),
                         ("--max-batch-size", [args.max_batch_size] if args.max_batch_size is not None else [])):
        if any(v < 1 for v in values):
            raise UserError(f"{flag} must be >= 1, got {min(values)}")
    if not 0 < args.duration < float("inf"):
        raise UserError(f"--duration must be > 0 seconds, got {args.duration:g}")
    for flag, value in (("--ids-per-bag", args.ids_per_bag), ("--shared-ids-per-bag", args.shared_ids_per_bag)):
        if not 0 <= value < float("inf"):
            raise UserError(f"{flag} must be >= 0 (a mean number of ids), got {value:g}")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and not path.parent.is_dir():  # written at the end: say it before the run
            raise UserError(f"{flag} {path}: {path.parent} is not a directory")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401 - a dev extra, not a dependency of recserve
        except ImportError:
            raise UserError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None
    if args.target:
        if args.repo is not None:
            raise UserError("--repo is for a server the bench starts; with --target the running server's model "
                            "is measured: drop --repo")
        return _bench_target(args, batch_sizes, concurrency)
    if args.repo is None:
        raise UserError("pass --repo REPO (the model repository holding --name) or --target HOST:PORT (a running "
                        "recserve serve)")
    if not args.repo.is_dir():
        raise UserError(f"--repo {args.repo} is not a directory; pass the model repository holding {args.name!r} "
                        "(REPO/NAME/VERSION/)")
    return _bench_local(args, batch_sizes, concurrency, breakdown_sizes)


def _bench_local(args: argparse.Namespace, batch_sizes: List[int], concurrency: List[int],
                 breakdown_sizes: List[int]) -> int:
    import torch

    from bench.bare import bench_bare
    from recserve.errors import UserError
    from recserve.ids import IdDistribution
    from recserve.manifest import list_versions, load_verified
    from serving.config import parse_replicas
    from serving.engine.repository import resolve_device

    versions = list_versions(args.repo / args.name)
    if not versions:
        present = sorted(p.name for p in args.repo.iterdir() if p.is_dir())
        raise UserError(f"no version of {args.name!r} in {args.repo}; its models: {present or 'none'} "
                        "(pass one as --name, or export one there first)")
    if args.version is not None and args.version not in versions:
        raise UserError(f"--version {args.version}: {args.name} has no such version in {args.repo} (its versions: "
                        f"{', '.join(map(str, versions))})")
    version = args.version or versions[-1]
    version_dir = args.repo / args.name / str(version)
    manifest = load_verified(version_dir)
    device = resolve_device(args.device)
    if manifest.sharding.device != device:
        raise UserError(f"{args.name} v{version} was exported for {manifest.sharding.device}, not {device}")
    if args.frontends is not None and args.frontends < 1:
        raise UserError("--frontends must be >= 1")
    # The server's flags, refused here before the bare rows are measured, not by the server after them
    parse_replicas(args.replicas)
    if not 0 <= args.max_delay_ms < float("inf"):
        raise UserError(f"--max-delay-ms must be a number of milliseconds >= 0, got {args.max_delay_ms:g}")
    if args.tls_ca or args.tls_cert or args.tls_key or args.auth_token_file:
        raise UserError("--tls-* and --auth-token-file are for --target (a server the bench did not start)")
    ids = IdDistribution.parse(args.id_distribution)
    if breakdown_sizes and device != "cuda":
        raise UserError("--breakdown profiles CUDA kernels; it needs a CUDA artifact and GPU")
    if args.shared_features and not args.no_served:
        from recserve.client import shared_feature_names

        try:
            shared_feature_names(args.shared_features, manifest)  # the served ModelInfo's features, in order
        except ValueError as e:
            raise UserError(str(e)) from None

    figures = {
        "model": args.name, "version": version, "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or platform.machine(),
        "versions": {"torch": torch.__version__, **{k: v for k, v in manifest.versions.items() if k != "torch"}},
        "date": datetime.date.today().isoformat(), "ids_per_bag": args.ids_per_bag, "id_distribution": str(ids),
        "shared_features": args.shared_features, "shared_ids_per_bag": args.shared_ids_per_bag,
        "shared_pooling": args.shared_pooling,
        "placements": sorted({ts.placement for ts in manifest.sharding.tables.values()}),
        "duration_s": args.duration, "server_frontends": args.frontends, "server_replicas": args.replicas,
        "command": " ".join(sys.argv),
        "model_bytes": manifest.table_bytes + manifest.dense_bytes, "dense_dtype": manifest.dense_dtype,
        "cuda_graphs": not args.no_cuda_graphs, "target": None,
    }
    figures["launches"] = []
    rows, breakdowns = bench_bare(version_dir, manifest, batch_sizes, args.duration, args.ids_per_bag, log=_log,
                                  cuda_graphs=not args.no_cuda_graphs, breakdown_sizes=breakdown_sizes, ids=ids,
                                  bare_memory=figures, launches=figures["launches"])
    if device == "cuda":
        torch.cuda.empty_cache()
    if not args.no_served:
        rows += _served(args, device, batch_sizes, concurrency, figures)
    if device == "cuda" and not args.no_kernels:
        from bench.kernels import bench_kernels

        figures["kernels"] = bench_kernels(log=_log, int8_variants=args.kernel_variants)
    figures["breakdown"] = [b.__dict__ for b in breakdowns]
    _report(args, figures, rows)
    if breakdowns:
        from bench.breakdown import print_breakdowns

        print_breakdowns(breakdowns, f"{manifest.dense_dtype} dense, CUDA graphs "
                                     f"{'off' if args.no_cuda_graphs else 'on where captured'}")
    return 0


def _report(args: argparse.Namespace, figures: dict, rows: list) -> None:
    from bench.report import plot, print_table

    figures["rows"] = [r.__dict__ for r in rows]
    print_table(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    if args.plot:
        plot(figures, args.plot)


def _bench_target(args: argparse.Namespace, batch_sizes: List[int], concurrency: List[int]) -> int:
    """Served rows against a server someone else started (TLS and token as given): no artifact read,
    no model run here, nothing that needs torch."""
    import grpc

    from bench.served import model_info
    from recserve.client import ClientSecurity
    from recserve.errors import UserError
    from recserve.ids import IdDistribution
    from recserve.v1 import inference_pb2 as pb

    local_only = [flag for flag, given in (("--breakdown", args.breakdown), ("--no-served", args.no_served),
                                           ("--version", args.version is not None),
                                           ("--kernel-variants", args.kernel_variants)) if given]
    if local_only:
        raise UserError(f"{local_only[0]} measures a model the bench runs itself; with --target only the "
                        "served rows are measured: drop it")
    server_side = [flag for flag, given in (("--device", args.device != "auto"),
                                            ("--shared-pooling", args.shared_pooling != "expand"),
                                            ("--max-delay-ms", args.max_delay_ms != 0.0),
                                            ("--max-batch-size", args.max_batch_size is not None),
                                            ("--frontends", args.frontends is not None),
                                            ("--replicas", args.replicas != "1"),
                                            ("--no-cuda-graphs", args.no_cuda_graphs)) if given]
    if server_side:
        raise UserError(f"{server_side[0]} sets up the server the bench starts; with --target the running "
                        "server's own settings apply: drop it")
    security = ClientSecurity.from_args(args)
    ids = IdDistribution.parse(args.id_distribution)
    try:
        info = model_info(args.target, args.name, security, retry_s=0)
    except grpc.RpcError as e:  # the server's answer, as recserve predict says it
        raise UserError(f"{e.code().name}: {e.details()}") from None
    served = pb.ModelInfo.FromString(info)
    manifest = json.loads(served.manifest_json or "{}")
    figures = {
        "model": args.name, "version": served.versions[0].version if served.versions else 0,
        "device": manifest.get("sharding", {}).get("device", "?"), "gpu": f"served by {args.target}",
        "versions": manifest.get("versions", {}), "date": datetime.date.today().isoformat(),
        "ids_per_bag": args.ids_per_bag, "id_distribution": str(ids), "shared_features": args.shared_features,
        "shared_ids_per_bag": args.shared_ids_per_bag, "shared_pooling": None, "duration_s": args.duration,
        "placements": sorted({t.get("placement", "hbm") for t in manifest.get("sharding", {}).get("tables", {}).values()}),
        "command": " ".join(sys.argv), "target": args.target,
    }
    _report(args, figures, _served_elsewhere(args, batch_sizes, concurrency, security, info))
    return 0


def _served(args: argparse.Namespace, device: str, batch_sizes: List[int], concurrency: List[int], figures: dict):
    """Served rows, then floor rows (the server stopped first, so that the two never share the CPU)."""
    from bench.clients import closed_loop
    from bench.served import ServerProcess, model_info, time_split
    from recserve.errors import UserError
    from recserve.local import free_port
    from recserve.v1 import inference_pb2 as pb

    server = ServerProcess(args.repo, device, max_batch_size=args.max_batch_size or max(batch_sizes),
                           max_delay_ms=args.max_delay_ms,
                           metrics_port=free_port(), frontends=args.frontends, replicas=args.replicas,
                           cuda_graphs=not args.no_cuda_graphs, shared_pooling=args.shared_pooling, model=args.name)
    try:
        info = model_info(server.target, args.name)
        served = pb.ModelInfo.FromString(info).versions[0].version  # what requests naming no version get
        if served != figures["version"]:
            raise UserError(f"{args.name} v{figures['version']} is measured bare but the server serves v{served} "
                            f"(its version policy): measure v{figures['version']} with --no-served, or the served "
                            f"v{served} with --version {served}")
        shapes = _request_shapes(args, info)
        rows = []
        for clients in concurrency:
            for b in batch_sizes:
                for shape in shapes:
                    before = []  # the server's counters as the measured window opens (warm-up left out)
                    row = closed_loop("served", server.target, info, b, clients, args.duration, shape, _log,
                                      on_measure=lambda: before.append(server.times()))
                    rows.append(dataclasses.replace(row, **time_split(before[0], server.times())))
        figures.update(server.memory())
        if "served_gpu_memory_bytes" in figures:
            figures["served_gpu_memory_ratio"] = figures["served_gpu_memory_bytes"] / figures["model_bytes"]
    finally:
        figures["server_exit_code"] = server.stop()
    if args.no_floor:
        return rows
    return _floor(args, info, args.frontends or server.processes, batch_sizes, concurrency, figures) + rows


def _request_shapes(args: argparse.Namespace, info: bytes) -> list:
    """The per-sample form, and with --shared-features the shared form of the same requests."""
    from bench.clients import RequestShape
    from recserve.client import shared_feature_names
    from recserve.errors import UserError
    from recserve.v1 import inference_pb2 as pb

    if not args.shared_features:
        return [RequestShape(args.ids_per_bag, ids=args.id_distribution)]
    try:
        names = shared_feature_names(args.shared_features, pb.ModelInfo.FromString(info))
    except ValueError as e:
        raise UserError(str(e)) from None
    return [RequestShape(args.ids_per_bag, names, args.shared_ids_per_bag, shared, args.id_distribution)
            for shared in (False, True)]


def _served_elsewhere(args: argparse.Namespace, batch_sizes: List[int], concurrency: List[int], security,
                      info: bytes):
    from bench.clients import closed_loop

    return [closed_loop("served", args.target, info, b, clients, args.duration, shape, _log, security)
            for clients in concurrency for b in batch_sizes for shape in _request_shapes(args, info)]


def _floor(args: argparse.Namespace, info: bytes, processes: int, batch_sizes: List[int], concurrency: List[int],
           figures: dict):
    from bench.clients import closed_loop
    from bench.floor import FloorProcess
    from recserve.v1 import inference_pb2 as pb

    version = pb.ModelInfo.FromString(info).versions[0].version
    figures["floor_processes"], figures["floor_exit_code"] = processes, 0
    rows = []
    for b in batch_sizes:  # the answer's size is fixed per process: one floor per batch size
        floor = FloorProcess(b, processes, args.name, version)
        try:
            rows += [closed_loop("floor", floor.target, info, b, clients, args.duration, shape, _log)
                     for clients in concurrency for shape in _request_shapes(args, info)]
        finally:
            code = floor.stop()  # every floor, whatever an earlier one's exit code
            figures["floor_exit_code"] = figures["floor_exit_code"] or code
    return rows
