"""Artifacts with tables in host memory (``placement`` ``uvm`` / ``uvm_caching`` in the manifest):
loading them without holding their rows in GPU memory, and reading FBGEMM's cache statistics.

``model.pt`` stores every tensor with the device it had at export; host-memory rows (FBGEMM's
``weights_uvm``: unified memory the GPU reads over PCIe) are reloaded as ordinary GPU memory by
``torch.jit.load(map_location=cuda)``. So such an artifact loads on the CPU first, then its
``weights_uvm`` tensors move to unified host memory (FBGEMM's own allocator,
``new_unified_tensor``, mapped as at export) and every other tensor to the GPU. The GPU then holds
the HBM tables, the caches and the dense part; host memory holds the uvm rows, once.

Each loaded module has its own TBEs and so its own cache (``lxu_cache_weights`` and its state): a
new version never reads rows that an older one cached.
"""
from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from recserve import tables
from recserve.manifest import Manifest

# FBGEMM's uvm_cache_stats: calls, requested ids, unique ids, unique misses, conflict unique misses,
# conflict misses (split_table_batched_embeddings_ops_inference.py), counted per batch.
_UNIQUE_IDS, _UNIQUE_MISSES = 2, 3


def placements(manifest: Manifest) -> Dict[str, str]:
    return {t: ts.placement for t, ts in manifest.sharding.tables.items()}


def has_host_tables(manifest: Manifest) -> bool:
    return any(p != "hbm" for p in placements(manifest).values())


def not_capturable(manifest: Manifest) -> Optional[str]:
    """Why CUDA graphs cannot replay this artifact's forward, or None."""
    cached = sorted(t for t, p in placements(manifest).items() if p == "uvm_caching")
    if cached:
        return (f"table(s) {', '.join(cached)} are UVM-cached: FBGEMM's cache keeps host-side state per "
                "call (LRU timestep, prefetch queue) that a graph replay would freeze")
    return None


def cache_tables(module: torch.jit.ScriptModule) -> List[str]:
    """The TBEs of a loaded module that hold a UVM cache (whatever its manifest says)."""
    return [name.rsplit(".", 1)[0] for name, value in tables.attributes(module)
            if name.endswith(".lxu_cache_weights") and isinstance(value, torch.Tensor) and value.numel()]


@functools.lru_cache(maxsize=None)
def compile_fbgemm_types() -> None:
    """A UVM-cached TBE is scripted whole (export/pipeline.py), so model.pt holds values of FBGEMM's
    TorchScript enums (SparseType, EmbeddingLocation). On an H200 with torch 2.11 / fbgemm-gpu 1.6 a
    fresh process refused it ("Unknown reference to ScriptClass
    __torch__.fbgemm_gpu.split_embedding_configs.SparseType") while the exporting process, which had
    scripted a TBE, loaded it: scripting a one-row CPU TBE compiles the same types, once per process."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        EmbeddingLocation,
        IntNBitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = IntNBitTableBatchedEmbeddingBagsCodegen([("t", 1, 4, SparseType.INT8, EmbeddingLocation.HOST)], device="cpu")
    tbe.initialize_weights()
    with warnings.catch_warnings():  # TorchScript's notes on FBGEMM's annotations, not ours to act on
        warnings.simplefilter("ignore")
        torch.jit.script(tbe)


def load_with_host_tables(path: Path, device: torch.device) -> torch.jit.ScriptModule:
    """``torch.jit.load`` of an artifact with uvm tables onto ``device``, their rows in host memory."""
    import fbgemm_gpu  # noqa: F401  (new_unified_tensor)

    compile_fbgemm_types()
    module = torch.jit.load(str(path), map_location="cpu")
    # One tensor at a time, each CPU copy freed as its replacement is set: host memory peaks at the
    # model plus its largest TBE, not at twice the model.
    # A tensor held under two names (as torch.jit.load keeps it) moves once.
    names = [name for name, value in tables.attributes(module) if isinstance(value, torch.Tensor)]
    moved_by_key: Dict[tuple, torch.Tensor] = {}
    for name in names:
        owner, leaf = tables.owner_of(module, name)
        value = owner.getattr(leaf)
        key = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride()) if value.numel() else None
        moved = moved_by_key.get(key) if key else None
        if moved is None:
            if leaf == "weights_uvm" and value.numel():
                moved = torch.ops.fbgemm.new_unified_tensor(torch.zeros(1, device=device, dtype=value.dtype),
                                                            list(value.shape), True)
                moved.copy_(value)
            else:
                moved = value.to(device)
            if key:
                moved_by_key[key] = moved
        del value
        owner.setattr(leaf, moved)
    return module


class CacheStats:
    """Cumulative (hits, misses) of one module's UVM caches, by the tables each cache serves.
    FBGEMM counts per TBE (one cache per group of tables), on ids deduplicated within a batch."""

    def __init__(self, module: torch.jit.ScriptModule, manifest: Manifest) -> None:
        table_of = {f.name: f.table for f in manifest.features}
        self._stats: List[Tuple[str, torch.jit.ScriptModule, str]] = []
        for name, value in tables.attributes(module):
            if not name.endswith(".lxu_cache_weights") or not isinstance(value, torch.Tensor) or not value.numel():
                continue
            owner, _ = tables.owner_of(module, name)
            if not owner.hasattr("uvm_cache_stats") or not owner.getattr("gather_uvm_cache_stats"):
                continue
            features = owner.getattr("feature_names_per_table") if owner.hasattr("feature_names_per_table") else None
            label = ",".join(sorted({table_of.get(f, f) for fs in features for f in fs})) if features else name
            self._stats.append((label, owner, "uvm_cache_stats"))

    def __bool__(self) -> bool:
        return bool(self._stats)

    def read(self) -> Dict[str, Tuple[int, int]]:
        out: Dict[str, Tuple[int, int]] = {}
        for label, owner, attr in self._stats:  # the caches of one table on several GPUs share a label
            stats = owner.getattr(attr).tolist()
            hits, misses = out.get(label, (0, 0))
            out[label] = (hits + int(stats[_UNIQUE_IDS] - stats[_UNIQUE_MISSES]), misses + int(stats[_UNIQUE_MISSES]))
        return out


def hit_ratio(before: Dict[str, Tuple[int, int]], after: Dict[str, Tuple[int, int]]) -> Optional[float]:
    """Hits / lookups (unique ids per batch) over all caches between two ``CacheStats.read``s."""
    hits = sum(after[k][0] - before.get(k, (0, 0))[0] for k in after)
    misses = sum(after[k][1] - before.get(k, (0, 0))[1] for k in after)
    return hits / (hits + misses) if hits + misses else None
