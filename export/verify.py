"""Verification gates of the export, and the sample batches they run on.

Each gate compares two models on the same batch by
- ``ctr_max_abs_err``: max |ctr - ctr_ref| over the batch (probabilities in [0, 1]);
- ``pooled_rel_err``: ||pooled - pooled_ref||_2 / ||pooled_ref||_2 over the whole [B, sum(dims)].

Thresholds (per table dtype; a model with mixed dtypes takes the loosest of its tables for these
two figures, and :func:`gate_features` holds each feature's columns of pooled to its own table's):

=====  ===============  ==============
dtype  ctr_max_abs_err  pooled_rel_err
=====  ===============  ==============
fp16   1e-3             1e-3
int8   1e-2             1e-2
int4   5e-2             1.5e-1
=====  ===============  ==============

A bf16 dense part holds 8 significant bits, as INT8 rows do, and the lookup then writes its pooled
embeddings in bf16: its model is held to int8's thresholds at least (fp16 tables' pooled error is
bf16's rounding there, about 2e-3).

The reloaded ``model.pt`` must equal the in-memory sharded module exactly (both thresholds 0), and
each feature's rows in the manifest must be those of the table the reloaded ``model.pt`` sends its ids
to (:func:`gate_table_rows`: the check the server's load runs, recserve/tables.py).
Unrestored (zero) tables give pooled_rel_err = 1, so the sharded-vs-float gate always catches them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torchrec import KeyedJaggedTensor

from recserve import tables
from recserve.errors import UserError
from recserve.manifest import Feature

THRESHOLDS: Dict[str, Dict[str, float]] = {
    "fp16": {"ctr_max_abs_err": 1e-3, "pooled_rel_err": 1e-3},
    "int8": {"ctr_max_abs_err": 1e-2, "pooled_rel_err": 1e-2},
    "int4": {"ctr_max_abs_err": 5e-2, "pooled_rel_err": 1.5e-1},
}
EXACT = {"ctr_max_abs_err": 0.0, "pooled_rel_err": 0.0}


class GateFailed(UserError):
    """A verification gate failed: the export stops and writes nothing."""


@dataclass
class Batch:
    """Model inputs in the artifact's layout (key-major lengths in feature order)."""

    dense: torch.Tensor  # float32 [B, F]
    values: torch.Tensor  # int64 [N]
    lengths: torch.Tensor  # int32 [T*B]
    feature_names: List[str]

    @property
    def batch_size(self) -> int:
        return self.dense.shape[0]

    def kjt(self) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(keys=self.feature_names, values=self.values, lengths=self.lengths)

    def to(self, dense_device: torch.device, sparse_device: torch.device) -> "Batch":
        return Batch(self.dense.to(dense_device), self.values.to(sparse_device),
                     self.lengths.to(sparse_device), self.feature_names)


def sample_batch(
    features: Iterable[Tuple[str, int]],
    dense_features: int,
    batch_size: int,
    seed: int = 0,
    max_bag: int = 8,
) -> Batch:
    """Random bags over each feature's full id range, with the edge cases every gate must see:
    sample 0 has only empty bags, every feature has an empty bag at sample 1 and its largest valid
    id (rows - 1) and id 0 in sample ``B - 1``."""
    g = torch.Generator().manual_seed(seed)
    features = list(features)
    names = [n for n, _ in features]
    lengths = torch.randint(0, max_bag + 1, (len(features), batch_size), generator=g, dtype=torch.int32)
    lengths[:, 0] = 0
    if batch_size > 1:
        lengths[:, 1] = 0
        lengths[:, -1] = torch.clamp(lengths[:, -1], min=2)
    values = []
    for k, (_, rows) in enumerate(features):
        ids = torch.randint(0, rows, (int(lengths[k].sum()),), generator=g, dtype=torch.int64)
        if batch_size > 1:
            ids[-1] = rows - 1
            ids[-2] = 0
        values.append(ids)
    dense = torch.randn(batch_size, dense_features, generator=g)
    return Batch(dense, torch.cat(values), lengths.reshape(-1).contiguous(), names)


def compare(
    ctr: torch.Tensor, ctr_ref: torch.Tensor, pooled: torch.Tensor, pooled_ref: torch.Tensor
) -> Dict[str, float]:
    ctr, ctr_ref = ctr.detach().float().cpu(), ctr_ref.detach().float().cpu()
    pooled, pooled_ref = pooled.detach().float().cpu(), pooled_ref.detach().float().cpu()
    if ctr.shape != ctr_ref.shape or pooled.shape != pooled_ref.shape:
        raise GateFailed(f"shape mismatch: ctr {list(ctr.shape)} vs {list(ctr_ref.shape)}, "
                         f"pooled {list(pooled.shape)} vs {list(pooled_ref.shape)}")
    figures = {"ctr_max_abs_err": (ctr - ctr_ref).abs().max().item() if ctr.numel() else 0.0,
               "pooled_rel_err": _rel_err(pooled, pooled_ref)}
    if not all(torch.isfinite(torch.tensor(list(figures.values())))):
        figures = {k: float("inf") for k in figures}
    return figures


def _rel_err(pooled: torch.Tensor, pooled_ref: torch.Tensor) -> float:
    diff = torch.linalg.vector_norm(pooled - pooled_ref).item()
    ref = torch.linalg.vector_norm(pooled_ref).item()
    return diff / ref if ref > 0 else (0.0 if diff == 0 else float("inf"))


def gate_features(name: str, pooled: torch.Tensor, pooled_ref: torch.Tensor, features: List[Tuple[str, int, str]],
                  dense_dtype: str, hint: Optional[str] = None) -> None:
    """Each feature's columns of pooled (``features``: name, dim, table dtype, in pooled order) against
    its own table's pooled_rel_err threshold: in the norm over all features a wrong table hides among
    many, and a mixed-dtype model's loosest threshold would hold its int8 and fp16 tables too."""
    pooled, pooled_ref = pooled.detach().float().cpu(), pooled_ref.detach().float().cpu()
    start = 0
    for feature, dim, dtype in features:
        err = _rel_err(pooled[:, start:start + dim], pooled_ref[:, start:start + dim])
        limit = thresholds_for([dtype], dense_dtype)["pooled_rel_err"]
        if not err <= limit:
            raise GateFailed(f"verification gate '{name}' failed: feature {feature} ({dtype}) pooled_rel_err="
                             f"{err:.3g} > {limit:.3g}" + (f"; {hint}" if hint else ""))
        start += dim


def thresholds_for(dtypes: Iterable[str], dense_dtype: str = "fp32") -> Dict[str, float]:
    chosen = [THRESHOLDS[d] for d in {*dtypes, *(["int8"] if dense_dtype == "bf16" else [])}]
    return {k: max(t[k] for t in chosen) for k in chosen[0]}


def gate(name: str, figures: Dict[str, float], thresholds: Dict[str, float], hint: Optional[str] = None) -> None:
    failed = [f"{k}={figures[k]:.3g} > {thresholds[k]:.3g}" for k in thresholds if not figures[k] <= thresholds[k]]
    if failed:
        raise GateFailed(f"verification gate '{name}' failed: {', '.join(failed)}" + (f"; {hint}" if hint else ""))


def gate_table_rows(module: torch.jit.ScriptModule, features: List[Feature], device: torch.device) -> None:
    """Each feature's ``rows`` against the table ``module`` (model.pt, reloaded) sends its ids to, as the
    server's load checks them (recserve/tables.py): a version it would refuse is not published."""
    try:
        tables.check_rows(module, [f.rows for f in features], device)
    except tables.RowsMismatch as e:
        raise GateFailed(f"verification gate 'table rows' failed: feature {features[e.feature].name}: rows "
                         f"{e.problem}") from None
    except tables.Unfollowed as e:
        raise GateFailed("verification gate 'table rows' failed: where model.pt sends each feature's ids cannot "
                         f"be told ({type(e).__name__}: {e})") from None
