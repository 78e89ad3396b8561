"""The export plan: per-table weight dtype and placement, and its translation to TorchRec.

Plan file (JSON), every key optional, an unknown key refused (export/inputs.py)::

    {"world_size": 2,
     "tables": {"t0": {"sharding": "table_wise", "rank": 1, "dtype": "int4"},
                "t1": {"sharding": "row_wise"},                  # rows split evenly over all ranks
                "t2": {"sharding": "column_wise", "ranks": [0, 1]},
                "t3": {"placement": "uvm_caching", "cache_load_factor": 0.1}}}

``placement`` (CUDA exports only) says where a table's rows live: ``"hbm"`` (GPU memory, the
default), ``"uvm"`` (host memory, read by the GPU over PCIe) or ``"uvm_caching"`` (host memory behind
an HBM cache of ``cache_load_factor`` x rows, default 0.2, LRU). They are TorchRec's compute kernels
``quant`` / ``quant_uvm`` / ``quant_uvm_caching`` (FBGEMM's DEVICE / MANAGED / MANAGED_CACHING).

Tables the plan does not name are table-wise, spread over the ranks largest-first onto the rank
with the fewest bytes so far (on one device: all on rank 0), in the export's ``--dtype``. A plan that
places no table at all, with several ranks or a ``--device-memory-gb`` budget, leaves placement to
TorchRec's planner instead (export/run.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torchrec import EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import CacheParams, EmbeddingModuleShardingPlan

from recserve.errors import UserError

WEIGHT_DTYPES: Dict[str, torch.dtype] = {"int8": torch.int8, "int4": torch.quint4x2, "fp16": torch.half}
# Bytes per element, for placing tables by size (scale/bias per row left out).
DTYPE_BYTES = {"int8": 1.0, "int4": 0.5, "fp16": 2.0}
QUANT_KERNEL = "quant"
# placement -> TorchRec's inference compute kernel
PLACEMENT_KERNELS = {"hbm": QUANT_KERNEL, "uvm": "quant_uvm", "uvm_caching": "quant_uvm_caching"}
# TorchRec's planner plans on the float EBC: its kernels, and the placement each stands for.
_FLOAT_KERNEL_PLACEMENT = {"dense": "hbm", "fused": "hbm", "fused_uvm": "uvm", "fused_uvm_caching": "uvm_caching"}
# TorchRec's planner's and FBGEMM's default cache size (torchrec.distributed.planner.constants.UVM_CACHING_RATIO).
DEFAULT_CACHE_LOAD_FACTOR = 0.2


@dataclass
class TablePlan:
    sharding: str = "table_wise"
    ranks: List[int] = field(default_factory=lambda: [0])
    dtype: str = "int8"
    placement: str = "hbm"
    cache_load_factor: Optional[float] = None  # uvm_caching only


@dataclass
class ExportPlan:
    world_size: int
    tables: Dict[str, TablePlan]


def _check_rank(table: str, rank: object, world_size: int) -> int:
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise UserError(f"plan: table {table!r}: rank {rank!r} is not in [0, {world_size}) "
                        f"(world size {world_size}); pass --world-size or fix the plan")
    return rank


def _check_dtype(where: str, dtype: object) -> str:
    if not isinstance(dtype, str) or dtype not in WEIGHT_DTYPES:
        raise UserError(f"{where}: unsupported dtype {dtype!r}; use one of {sorted(WEIGHT_DTYPES)}")
    return str(dtype)


def _check_placement(table: str, spec: dict) -> "tuple[str, Optional[float]]":
    placement = spec.get("placement", "hbm")
    if not isinstance(placement, str) or placement not in PLACEMENT_KERNELS:
        raise UserError(f"plan: table {table!r}: placement {placement!r} is not one of {list(PLACEMENT_KERNELS)}")
    load_factor = spec.get("cache_load_factor")
    if load_factor is None:
        return placement, DEFAULT_CACHE_LOAD_FACTOR if placement == "uvm_caching" else None
    if placement != "uvm_caching":
        raise UserError(f"plan: table {table!r}: cache_load_factor needs \"placement\": \"uvm_caching\"")
    if isinstance(load_factor, bool) or not isinstance(load_factor, (int, float)) or not 0 < load_factor <= 1:
        raise UserError(f"plan: table {table!r}: cache_load_factor {load_factor!r} must be a number in (0, 1]")
    return placement, float(load_factor)


def _check_row_alignment(table: EmbeddingBagConfig, dtype: str) -> None:
    """FBGEMM quantizes a row into a whole number of 2-byte halves (its scale and bias are fp16):
    an INT8 table needs an even dim, an INT4 table a multiple of 4."""
    if table.embedding_dim * DTYPE_BYTES[dtype] % 2:
        raise UserError(f"table {table.name!r}: embedding_dim {table.embedding_dim} cannot be stored as {dtype} "
                        f"(FBGEMM needs a multiple of {int(2 / DTYPE_BYTES[dtype])}); export it in another dtype "
                        "(--dtype, or the plan's \"dtype\" for this table)")


def check_placements(plan: "ExportPlan", device: str) -> None:
    """Host-memory placements are FBGEMM's unified memory, which only a CUDA export has."""
    uvm = sorted(n for n, tp in plan.tables.items() if tp.placement != "hbm")
    if uvm and device != "cuda":
        raise UserError(f"plan: table(s) {uvm} are placed in uvm/uvm_caching, which needs --device cuda; "
                        "on a CPU export every table lives in host memory already: drop \"placement\"")


def make_plan(
    raw: dict,
    tables: List[EmbeddingBagConfig],
    world_size: Optional[int],
    default_dtype: str,
) -> ExportPlan:
    """Validate the plan file (``raw``: as export/inputs.py read it, its keys and shape checked) against
    the model's tables and fill in the tables it leaves out."""
    _check_dtype("--dtype", default_dtype)
    plan_ws = raw.get("world_size")
    if world_size is None:
        world_size = int(plan_ws) if plan_ws is not None else 1
    elif plan_ws is not None and int(plan_ws) != world_size:
        raise UserError(f"plan says world_size {plan_ws} but --world-size is {world_size}")
    if world_size < 1:
        raise UserError(f"world size must be >= 1, got {world_size}")
    by_name = {t.name: t for t in tables}
    raw_tables = raw.get("tables", {}) or {}
    unknown = sorted(set(raw_tables) - set(by_name))
    if unknown:
        raise UserError(f"plan names unknown table(s) {unknown}; the checkpoint has {sorted(by_name)}")

    out: Dict[str, TablePlan] = {}
    for name, spec in raw_tables.items():
        sharding = spec.get("sharding", "table_wise")
        dtype = _check_dtype(f"plan: table {name!r}", spec.get("dtype", default_dtype))
        if sharding == "table_wise":
            ranks = [_check_rank(name, spec.get("rank", 0), world_size)]
        elif sharding == "row_wise":
            ranks = list(range(world_size))
        else:
            ranks = [_check_rank(name, r, world_size) for r in spec.get("ranks", list(range(world_size)))]
            dim = by_name[name].embedding_dim
            if not ranks or dim % len(ranks) or (dim // len(ranks)) % 4:
                raise UserError(f"plan: table {name!r}: column_wise over {len(ranks)} shard(s) needs "
                                f"dim {dim} divisible into shards of a multiple of 4 columns")
        placement, load_factor = _check_placement(name, spec)
        out[name] = TablePlan(sharding=sharding, ranks=ranks, dtype=dtype, placement=placement,
                              cache_load_factor=load_factor)

    if any(tp.dtype == "fp16" for tp in out.values()) or (default_dtype == "fp16" and len(out) < len(tables)):
        split = sorted(n for n, tp in out.items() if tp.sharding != "table_wise")
        if split:
            raise UserError(f"plan: table(s) {split} are row/column-wise in a model with fp16 tables; TorchRec's "
                            "inference sharder supports fp16 only table-wise: use int8 or table_wise")

    load = [0.0] * world_size
    for name, tp in out.items():
        t = by_name[name]
        for r in tp.ranks:
            load[r] += t.num_embeddings * t.embedding_dim * DTYPE_BYTES[tp.dtype] / len(tp.ranks)
    rest = sorted((t for t in tables if t.name not in out), key=lambda t: -t.num_embeddings * t.embedding_dim)
    for t in rest:
        rank = min(range(world_size), key=lambda r: load[r])
        load[rank] += t.num_embeddings * t.embedding_dim * DTYPE_BYTES[default_dtype]
        out[t.name] = TablePlan(sharding="table_wise", ranks=[rank], dtype=default_dtype)
    for t in tables:
        _check_row_alignment(t, out[t.name].dtype)
    return ExportPlan(world_size=world_size, tables={t.name: out[t.name] for t in tables})


def torchrec_module_plan(
    float_ebc: torch.nn.Module, plan: ExportPlan, device_type: str
) -> EmbeddingModuleShardingPlan:
    """The TorchRec plan for the EBC, built on the float module so shard sizes are in [rows, dim]."""
    generators = {}
    for name, tp in plan.tables.items():
        kernel = PLACEMENT_KERNELS[tp.placement]
        if tp.sharding == "table_wise":
            generators[name] = table_wise(rank=tp.ranks[0], compute_kernel=kernel)
        elif tp.sharding == "row_wise":
            generators[name] = row_wise(compute_kernel=kernel)
        else:
            generators[name] = column_wise(ranks=tp.ranks, compute_kernel=kernel)
    module_plan = construct_module_sharding_plan(
        float_ebc,
        per_param_sharding=generators,
        sharder=EmbeddingBagCollectionSharder(),
        local_size=plan.world_size,
        world_size=plan.world_size,
        device_type=device_type,
    )
    for name, ps in module_plan.items():
        if plan.tables[name].cache_load_factor is not None:
            ps.cache_params = CacheParams(load_factor=plan.tables[name].cache_load_factor)
    return module_plan


class _Holder(torch.nn.Module):
    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc


def planner_module_plan(
    float_ebc: torch.nn.Module, plan: ExportPlan, device_type: str, device_memory_bytes: Optional[int]
) -> EmbeddingModuleShardingPlan:
    """TorchRec's planner places the tables over ``plan.world_size`` devices: table-wise, or row-wise
    for a table too large for one device (FP16 tables only table-wise); on CUDA, a table that does not
    fit the budget goes to host memory behind an HBM cache (``uvm_caching``, load factor 0.2). It plans
    on the float EBC (shard sizes in [rows, dim]) and sizes float tables, so each device's budget (and
    the host's memory) is scaled by the float-to-stored byte ratio of the most compact dtype in the
    plan (x4 for INT8)."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.planner.types import ParameterConstraints, PlannerError

    fp16 = any(tp.dtype == "fp16" for tp in plan.tables.values())
    scale = 4 / min(DTYPE_BYTES[tp.dtype] for tp in plan.tables.values())
    cap = int(device_memory_bytes * scale) if device_memory_bytes is not None else None
    host = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * scale / plan.world_size)
    cuda = device_type == "cuda"
    topology = _topology(plan.world_size, device_type, hbm_cap=cap if cuda else None, ddr_cap=host if cuda else cap)
    kernels = ["fused", "fused_uvm_caching"] if cuda else None
    constraints = {name: ParameterConstraints(sharding_types=["table_wise"] if fp16 else ["table_wise", "row_wise"],
                                              compute_kernels=kernels,
                                              cache_params=CacheParams(load_factor=DEFAULT_CACHE_LOAD_FACTOR))
                   for name in plan.tables}
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints,
                                       storage_reservation=FixedPercentageStorageReservation(percentage=0.0))
    try:
        module_plan = planner.plan(_Holder(float_ebc), [EmbeddingBagCollectionSharder()]).plan["ebc"]
    except PlannerError as e:
        raise UserError(f"TorchRec's planner found no placement on {plan.world_size} device(s) of "
                        f"{device_memory_bytes / 2**30 if device_memory_bytes else 0:g} GB: raise "
                        f"--device-memory-gb or --world-size ({str(e).splitlines()[0][:160]})") from e
    for ps in module_plan.values():
        placement = _FLOAT_KERNEL_PLACEMENT.get(ps.compute_kernel, "hbm") if cuda else "hbm"
        ps.compute_kernel = PLACEMENT_KERNELS[placement]
        ps.cache_params = CacheParams(load_factor=DEFAULT_CACHE_LOAD_FACTOR) if placement == "uvm_caching" else None
    return module_plan


def _topology(world_size: int, device_type: str, hbm_cap: Optional[int], ddr_cap: Optional[int]):
    """TorchRec's Topology of ``world_size`` devices on one host: from its TopologyFactory where it has
    one (torchrec 1.8: a Topology built directly logs that "the job will fail"), else directly."""
    from torchrec.distributed.planner import types

    if not hasattr(types, "TopologyFactory"):  # torchrec 1.6.1 (the GPU machines) has none
        return types.Topology(world_size=world_size, local_world_size=world_size, compute_device=device_type,
                              hbm_cap=hbm_cap, ddr_cap=ddr_cap)
    return types.TopologyFactory.create_topology(
        types.TrainerConfig(world_size=world_size, local_world_size=world_size, hbm_cap_bytes=hbm_cap,
                            ddr_cap_bytes=ddr_cap),
        kernel_config=types.KernelConfig(compute_device=device_type))


def placement_of(compute_kernel: str) -> str:
    """The plan's placement for a TorchRec inference compute kernel."""
    return {kernel: placement for placement, kernel in PLACEMENT_KERNELS.items()}[compute_kernel]


def check_budget(module_plan: EmbeddingModuleShardingPlan, plan: ExportPlan, device: str, budget_bytes: int) -> None:
    """A plan that places tables itself must still fit ``--device-memory-gb`` on every device, as
    TorchRec's planner's own plans do by construction: on CUDA each GPU's tables and caches, on the
    CPU each rank's tables (all in host memory, the planner's budget there)."""
    cuda = device == "cuda"
    per_rank: Dict[int, int] = {}
    for name, ps in module_plan.items():
        for s in ps.sharding_spec.shards:
            hbm, host = table_memory([list(s.shard_sizes)], plan.tables[name], device)
            per_rank[s.placement.rank()] = per_rank.get(s.placement.rank(), 0) + (hbm if cuda else host)
    rank, held = max(per_rank.items(), key=lambda kv: kv[1])
    if held > budget_bytes:
        remedy = ("place tables in \"uvm_caching\" or \"uvm\", or lower their cache_load_factor" if cuda
                  else "raise it, or spread the tables over more ranks (--world-size)")
        size = f"{held / 2**30:.2f} GiB" if held >= 2**30 / 100 else f"{held / 2**20:.2f} MiB"
        raise UserError(f"the plan puts {size} of tables{' and caches' if cuda else ''} in the memory "
                        f"of rank {rank}, above --device-memory-gb {budget_bytes / 2**30:g}: {remedy}")


def table_memory(shard_sizes: List[List[int]], tp: TablePlan, device: str) -> "tuple[int, int]":
    """(GPU bytes, host bytes) a table's shards hold: rows as FBGEMM stores them (INT8/INT4 rows carry
    a 4-byte scale and bias and are padded to 16 bytes on CUDA), and for ``uvm_caching`` its share of
    the HBM cache (load factor x rows; FBGEMM sizes one cache per TBE from the sum of its tables)."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import rounded_row_size_in_bytes

    weight_ty = {"int8": SparseType.INT8, "int4": SparseType.INT4, "fp16": SparseType.FP16}[tp.dtype]
    alignment = 16 if device == "cuda" else 1
    rows_bytes = sum(rows * rounded_row_size_in_bytes(cols, weight_ty, alignment) for rows, cols in shard_sizes)
    if device != "cuda":
        return 0, rows_bytes
    if tp.placement == "hbm":
        return rows_bytes, 0
    if tp.placement == "uvm":
        return 0, rows_bytes
    return int(rows_bytes * tp.cache_load_factor), rows_bytes
