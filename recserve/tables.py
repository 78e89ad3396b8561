"""The FBGEMM tables of a loaded ``model.pt``: how many rows each holds, and which of them a feature's
ids reach.

TorchRec's inference sharders build FBGEMM's table-batched embeddings (TBEs) with
``BoundsCheckMode.NONE``: the lookup kernel reads row ``id`` of its table ``t`` at byte
``weights_offsets[t] + id * row_bytes`` of the weights, whatever the id. The front ends accept ids
below each feature's ``rows`` in the manifest; :func:`check_rows` checks that every such id lands
inside the rows of the table the module sends it to, and that the rows are no fewer than the table
holds. The export runs it on the model.pt it wrote before publishing the version (export/run.py), the
loader on the model.pt it loaded before any id reaches a kernel (serving/engine/loader.py
``check_table_rows``); each words the refusal its own way.

Rows, as the tables are loaded. A traced ``model.pt`` keeps of a TBE only the tensors its graph reads
(``weights_dev`` / ``weights_host`` / ``weights_uvm``, ``weights_offsets``, ``weights_placements``,
``weights_tys``, ``D_offsets``): no row count. The rows are read off the layout, as FBGEMM's own CPU
kernel does: a table spans from its offset to the next table's offset in the same weights tensor (or
that tensor's end) and has room for ``span // row_bytes`` rows, ``row_bytes`` following from its dim,
dtype and the lookup's row alignment (FBGEMM's ``rounded_row_size_in_bytes``). FBGEMM pads each table
to 128 bytes, so the span gives the count to within the rows 128 bytes hold: 2000 INT8 rows of dim 16
(20 bytes each on the CPU) span 40064 bytes, room for 2003, and any count from 1997 up spans the same.
Ids in that padding read its zero bytes, inside the table: never another table's rows or memory past
the weights. A UVM-cached TBE is scripted whole and keeps FBGEMM's ``rows_per_table``: its count, where
the span agrees with it, is exact. Only sizes and offsets are read (small tensors); no weights are copied.

Where a feature's ids go. Which table a feature's ids reach, and as which row (row-wise sharding
renumbers them per shard), is the module's own routing (permutes, splits, block bucketizing, copies to
the GPUs): :func:`land` runs ``lookup`` on bags of probe ids under a dispatch mode that records what each
TBE lookup is given and returns zeros in place of the kernel, and answers the cache's population and
lookup itself (a UVM-cached TBE copies rows into its cache before the lookup). No table is read while
probing, whatever the ids. An FBGEMM operator the probe does not know, or torch's own embedding
operators, stop the probe (:class:`UnknownOperator`): nothing is run on ids it cannot follow.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# FBGEMM's EmbeddingLocation: DEVICE (0) and HOST (3, CPU TBEs) rows are in ``dev_weights``, MANAGED (1,
# uvm) and MANAGED_CACHING (2, uvm_caching) rows in ``uvm_weights`` (the kernels choose so).
DEV_PLACEMENTS = (0, 3)
UVM_PLACEMENTS = (1, 2)
TABLE_ALIGNMENT = 128  # bytes: each table starts on a cache line (FBGEMM's align_to_cacheline)
SCALE_BIAS_BYTES = 4  # an INT8/INT4/INT2 row's fp16 scale and bias (DEFAULT_SCALE_BIAS_SIZE_IN_BYTES)
# FBGEMM's SparseType codes (weights_tys) -> bytes of a row of dim D, before alignment
# (unpadded_row_size_in_bytes); the inference kernels read no other weight types.
ROW_BYTES = {
    0: lambda d: 4 * d,  # fp32
    1: lambda d: 2 * d,  # fp16
    2: lambda d: d + SCALE_BIAS_BYTES,  # int8
    3: lambda d: d // 2 + SCALE_BIAS_BYTES,  # int4
    4: lambda d: d // 4 + SCALE_BIAS_BYTES,  # int2
    6: lambda d: d,  # fp8
}
# output_dtype codes of the lookup -> the dtype of the zeros the probe returns in its place
OUTPUT_DTYPES = {0: torch.float32, 1: torch.float16, 5: torch.bfloat16}

# The operators that read table rows by id, which the probe answers itself: the lookups (recorded,
# zeros returned), the caches' population (skipped) and cache lookups (every id a miss).
LOOKUPS = ("int_nbit_split_embedding_codegen_lookup_function",
           "int_nbit_split_embedding_uvm_caching_codegen_lookup_function")
CACHE_POPULATE = ("lru_cache_populate_byte", "lfu_cache_populate_byte", "direct_mapped_lru_cache_populate_byte")
CACHE_LOOKUP = ("lxu_cache_lookup", "direct_mapped_lxu_cache_lookup")
# FBGEMM operators that move ids or pooled rows without reading tables: run as they are. TorchRec's
# inference paths (KJT permutes and splits, row-wise bucketizing, the pooled outputs' merges across
# GPUs) and FBGEMM's cache index arithmetic.
ROUTING = frozenset({
    "asynchronous_complete_cumsum", "asynchronous_exclusive_cumsum", "asynchronous_inclusive_cumsum",
    "offsets_range", "permute_1D_sparse_data", "permute_2D_sparse_data", "permute_2D_sparse_data_input1D",
    "permute_sparse_data", "invert_permute", "expand_into_jagged_permute",
    "block_bucketize_sparse_features", "block_bucketize_sparse_features_inference",
    "merge_pooled_embeddings", "all_to_one_device", "sum_reduce_to_one",
    "permute_pooled_embs", "permute_pooled_embs_split", "permute_pooled_embs_auto_grad",
    "permute_pooled_embs_auto_grad_split", "permute_multi_embedding", "regroup_keyed_tensor",
    "kt_regroup_arguments", "jagged_to_padded_dense", "segment_sum_csr", "linearize_cache_indices",
})
# torch's embedding operators read rows by id too (a module built on them is no export of recserve's)
TORCH_TABLE_OPS = ("embedding", "embedding_bag", "_embedding_bag", "_embedding_bag_forward_only")

PROBE_SPREAD = 16  # ids spread over [0, rows) per feature: every shard of a row-wise table sees some
PROBE_TAIL = 64  # and the last ids below rows (row-wise sharding sends those past its blocks modulo the ranks)
PROBE_FEATURES = 64  # features per probe call, one sample each


# One probe at a time in the process (versions load on several threads, --load-threads): a Python
# dispatch mode is per thread in torch, but an engine once died of SIGSEGV in CI while 101 versions
# loaded on 4 threads (not reproduced since); what a probe costs (about 0.1 s) is not worth that risk.
_PROBING = threading.Lock()


class Unfollowed(Exception):
    """Where the module sends a feature's ids cannot be told (not a module recserve export writes)."""


class UnknownOperator(Unfollowed):
    """The lookup calls an operator that reads rows by id and that the probe cannot answer."""


class Unreached(Unfollowed):
    """Feature ``feature`` (its index)'s ids reach no FBGEMM table."""

    def __init__(self, feature: int) -> None:
        super().__init__(feature)
        self.feature = feature

    def __str__(self) -> str:
        return f"the ids of feature {self.feature} reach no FBGEMM table"


class RowsMismatch(Exception):
    """Feature ``feature`` (its index)'s ``rows`` are not those of the table its ids reach; ``problem``
    says so from the rows on ("2100, more than the 1997 to 2003 rows ... holds (...)")."""

    def __init__(self, feature: int, problem: str) -> None:
        super().__init__(feature, problem)
        self.feature = feature
        self.problem = problem


def attributes(module: torch.jit.ScriptModule) -> List[Tuple[str, object]]:
    """Every attribute of a scripted module and its submodules, by dotted name: FBGEMM's TBEs keep
    their rows and layout in plain tensor attributes, which ``named_buffers`` does not list."""
    return list(torch._C._jit_debug_module_iterators(module._c)["named_attributes_r"])


def owner_of(module: torch.jit.ScriptModule, name: str) -> Tuple[torch._C.ScriptModule, str]:
    """The submodule holding the attribute ``name`` (dotted) and the attribute's own name there."""
    held = module._c
    *path, leaf = name.split(".")
    for part in path:
        held = held.getattr(part)
    return held, leaf


@dataclass(frozen=True)
class Table:
    """Table ``slot`` of the TBE ``tbe`` (its name in model.pt), as a lookup reads it: it holds at
    least ``low`` and at most ``high`` rows (equal where the count is known exactly)."""

    tbe: str
    slot: int
    low: int
    high: int
    bytes: int  # of its span
    row_bytes: int

    @property
    def name(self) -> str:
        return f"{self.tbe} table {self.slot}"


def count(low: int, high: int) -> str:
    return str(low) if low == high else f"{low} to {high}"


def probe_ids(rows: int) -> List[int]:
    """The ids a feature of ``rows`` rows is probed with: 0, ids spread over the range, the last ones."""
    spread = {rows * k // PROBE_SPREAD for k in range(PROBE_SPREAD)}
    return sorted(spread | set(range(max(0, rows - PROBE_TAIL), rows)))


class _Probe(TorchDispatchMode):
    """Records each TBE lookup's arguments (by name) in place of running it."""

    def __init__(self) -> None:
        super().__init__()
        self.lookups: List[Dict[str, object]] = []
        self.unknown: Optional[str] = None
        # An operator's own error, raised here, reaches the caller through TorchScript without its
        # message ("RuntimeError: "): kept to be raised again.
        self.failure: Optional[BaseException] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, _, name = func._schema.name.partition("::")
        if namespace == "fbgemm":
            if name in LOOKUPS:
                call = _named(func, args, kwargs)
                self.lookups.append(call)
                return _zeros(call)
            if name in CACHE_POPULATE:
                return None
            if name in CACHE_LOOKUP:
                linear = _named(func, args, kwargs)["linear_cache_indices"]
                return torch.full(linear.shape, -1, dtype=torch.int32, device=linear.device)
            if name not in ROUTING:
                self.unknown = self.unknown or func._schema.name
                raise UnknownOperator(func._schema.name)
        elif namespace == "aten" and name in TORCH_TABLE_OPS:
            self.unknown = self.unknown or func._schema.name
            raise UnknownOperator(func._schema.name)
        try:
            return func(*args, **kwargs)
        except Exception as e:
            self.failure = self.failure or e
            raise


def _named(func, args: Sequence, kwargs: Dict[str, object]) -> Dict[str, object]:
    named = {a.name: a.default_value for a in func._schema.arguments if a.has_default_value()}
    named.update({a.name: v for a, v in zip(func._schema.arguments, args)})
    named.update(kwargs)
    return named


def _zeros(call: Dict[str, object]) -> torch.Tensor:
    indices, offsets, d_offsets = call["indices"], call["offsets"], call["D_offsets"]
    tables = d_offsets.numel() - 1
    batch = (offsets.numel() - 1) // max(tables, 1)
    dtype = OUTPUT_DTYPES.get(int(call["output_dtype"]), torch.float32)
    return torch.zeros(batch, int(call["total_D"]), dtype=dtype, device=indices.device)


def _exact_rows(module: torch.jit.ScriptModule) -> Dict[Tuple[str, int], Tuple[str, Optional[List[int]]]]:
    """Each TBE of the module by its ``weights_offsets`` tensor: its name, and FBGEMM's ``rows_per_table``
    where the module kept it (a TBE scripted whole)."""
    out = {}
    for name, value in attributes(module):
        if not name.endswith(".weights_offsets") or not isinstance(value, torch.Tensor):
            continue
        tbe, _ = owner_of(module, name)
        rows = None
        if tbe.hasattr("rows_per_table"):
            held = tbe.getattr("rows_per_table")
            if isinstance(held, torch.Tensor) and held.numel() == value.numel():
                rows = [int(r) for r in held.tolist()]
        out[(str(value.device), value.data_ptr())] = (name.rsplit(".", 1)[0], rows)
    return out


class LayoutError(Unfollowed):
    """A TBE whose layout this check cannot read (a placement or weight type FBGEMM's inference
    kernels do not have)."""


def tables_of(call: Dict[str, object], tbes: Dict[Tuple[str, int], Tuple[str, Optional[List[int]]]]) -> List[Table]:
    """The tables of one TBE lookup, from what it was given: sizes and offsets only."""
    dev, uvm_weights = call["dev_weights"], call["uvm_weights"]
    weights_offsets = call["weights_offsets"]
    offsets = [int(o) for o in weights_offsets.tolist()]
    placements = [int(p) for p in call["weights_placements"].tolist()]
    tys = [int(t) for t in call["weights_tys"].tolist()]
    d_offsets = [int(d) for d in call["D_offsets"].tolist()]
    alignment = call.get("row_alignment")
    if alignment is None or int(alignment) <= 0:  # the kernels' defaults
        alignment = 1 if dev.device.type == "cpu" else 16
    alignment = int(alignment)
    tbe, exact = tbes.get((str(weights_offsets.device), weights_offsets.data_ptr()), ("a TBE of model.pt", None))
    if not len(offsets) == len(placements) == len(tys) == len(d_offsets) - 1:
        raise LayoutError(f"{tbe} describes {len(d_offsets) - 1} tables in D_offsets, {len(offsets)} in "
                          f"weights_offsets, {len(placements)} in weights_placements, {len(tys)} in weights_tys")
    buffers = {}
    for slot, placement in enumerate(placements):
        if placement not in DEV_PLACEMENTS + UVM_PLACEMENTS:
            raise LayoutError(f"{tbe} table {slot} has placement {placement}, which FBGEMM's inference kernels "
                              "do not read")
        buffers[slot] = "dev" if placement in DEV_PLACEMENTS else "uvm"
    starts = {b: sorted({offsets[s] for s in buffers if buffers[s] == b}) for b in ("dev", "uvm")}
    sizes = {"dev": dev.numel() * dev.element_size(), "uvm": uvm_weights.numel() * uvm_weights.element_size()}
    tables = []
    for slot in range(len(offsets)):
        dim, ty = d_offsets[slot + 1] - d_offsets[slot], tys[slot]
        if ty not in ROW_BYTES or dim <= 0:
            raise LayoutError(f"{tbe} table {slot} has weight type {ty} and dim {dim}, which FBGEMM's inference "
                              "kernels do not read")
        row_bytes = -(-ROW_BYTES[ty](dim) // alignment) * alignment
        buffer, start = buffers[slot], offsets[slot]
        following = [o for o in starts[buffer] if o > start]
        end = following[0] if following else sizes[buffer]
        span = max(0, end - start) if start >= 0 else 0
        high = span // row_bytes
        low = min(high, max(1 if high else 0, (span - TABLE_ALIGNMENT) // row_bytes + 1))
        if exact is not None and low <= exact[slot] <= high:
            low = high = exact[slot]
        tables.append(Table(tbe, slot, low, high, span, row_bytes))
    return tables


@dataclass
class Landing:
    """Where a feature's probe ids went: each table they reached, and the rows read there."""

    ids: List[int]
    rows: Dict[Table, List[int]]

    def held(self) -> Tuple[int, int]:
        """The rows the feature's table holds, at least and at most: those of each table its ids reach
        as they are (table-wise; column-wise shards each hold every row), or the sum over its shards
        where they are renumbered (row-wise)."""
        tables = list(self.rows)
        if all(rows == self.ids for rows in self.rows.values()):
            return max(t.low for t in tables), min(t.high for t in tables)
        return sum(t.low for t in tables), sum(t.high for t in tables)

    def outside(self) -> Optional[Tuple[Table, int]]:
        """The table and row of the farthest read outside a table (past its end, or before its start: a
        negative row, as ids past 2**31 become where a lookup takes them as int32), if any."""
        reads = [(max(row - t.high + 1, -row), t, row) for t, rows in self.rows.items() for row in rows
                 if row >= t.high or row < 0]
        return max(reads, key=lambda r: r[0])[1:] if reads else None


def land(module: torch.jit.ScriptModule, rows: Sequence[int], device: torch.device) -> List[Landing]:
    """Run ``module.lookup`` on probe ids of each feature (``rows``: the manifest's, in feature order),
    no table read: where each feature's ids land. Raises UnknownOperator (the probe's ``unknown`` op
    named), LayoutError, or what the module raises on its inputs."""
    tbes = _exact_rows(module)
    ids = [probe_ids(r) for r in rows]
    landings = [Landing(i, {}) for i in ids]
    cache: Dict[Tuple, List[Table]] = {}
    for first in range(0, len(rows), PROBE_FEATURES):
        chunk = list(range(first, min(first + PROBE_FEATURES, len(rows))))
        batch = len(chunk)
        lengths = torch.zeros(len(rows), batch, dtype=torch.int32)
        for b, f in enumerate(chunk):
            lengths[f, b] = len(ids[f])
        values = torch.tensor([i for f in chunk for i in ids[f]], dtype=torch.int64)
        probe = _Probe()
        try:
            with _PROBING, torch.inference_mode(), probe:
                module.lookup(values.to(device), lengths.reshape(-1).to(device))
        except Exception as e:
            if probe.unknown:
                raise UnknownOperator(probe.unknown) from e
            if probe.failure is not None:
                raise RuntimeError(f"{type(probe.failure).__name__}: {probe.failure}") from e
            raise
        for call in probe.lookups:
            key = (call["weights_offsets"].data_ptr(), call["dev_weights"].data_ptr(), call["uvm_weights"].data_ptr())
            tables = cache.get(key) or cache.setdefault(key, tables_of(call, tbes))
            offsets = [int(o) for o in call["offsets"].tolist()]
            if len(offsets) != len(tables) * batch + 1:
                raise LayoutError(f"{tables[0].tbe if tables else 'a TBE'} is given {len(offsets) - 1} bags for "
                                  f"{len(tables)} tables of a batch of {batch} samples: the module regroups "
                                  "samples, and where each feature's ids go cannot be told")
            indices = [int(i) for i in call["indices"].tolist()]
            for slot, table in enumerate(tables):
                for b, f in enumerate(chunk):
                    bag = indices[offsets[slot * batch + b]:offsets[slot * batch + b + 1]]
                    if bag:
                        landings[f].rows.setdefault(table, []).extend(bag)
    return landings


def check_rows(module: torch.jit.ScriptModule, rows: Sequence[int], device: torch.device) -> None:
    """Each feature's ``rows`` (the manifest's, in feature order) against the rows of the tables
    ``module.lookup`` sends its ids to (:func:`land`, no table read): FBGEMM's lookups check no bounds,
    so more rows than a table holds would pass ids that read past its end; fewer do not describe the
    table either. Raises RowsMismatch, an Unfollowed, or what the module raises on its inputs."""
    for i, (claimed, landing) in enumerate(zip(rows, land(module, rows, device))):
        if not landing.rows:
            raise Unreached(i)
        low, high = landing.held()
        held = f"the {count(low, high)} rows model.pt's table of feature {i} holds"
        outside = landing.outside()
        if outside is not None or claimed > high:
            table, row = outside or (None, 0)
            where = f" (ids below {claimed} would read row {row} of {table.name}, " \
                    f"{'before its start' if row < 0 else 'past its end'})" if table else ""
            raise RowsMismatch(i, f"{claimed}, more than {held}{where}")
        if claimed < low:
            raise RowsMismatch(i, f"{claimed}, fewer than {held}")
