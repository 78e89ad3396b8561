"""Model execution: one loaded ``model.pt`` on its device, and batches merged into and split out of it.

``predict_batch`` / ``lookup_batch`` take the requests of one batch (serving/batcher.py), merge their
KJTs into one (per feature, the bags of every request in order), make one model call, and split the
result back so that every request gets exactly its own rows.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

from recserve.manifest import GOLDEN_FILE, MODEL_FILE, ArtifactError, Manifest, set_dense_math
from serving.batcher import Work
from serving.validate import Schema, SparseBatch, lookup_columns

log = logging.getLogger("serving.runner")

# Served outputs must reproduce golden.pt this closely (same device kind as the export: exact up to
# kernel scheduling; the float reference itself is checked by the export's gates).
GOLDEN_ATOL = 1e-5


def load_fbgemm() -> None:
    """Make the FBGEMM operators that model.pt calls known to TorchScript."""
    import fbgemm_gpu  # noqa: F401


class ModelRunner:
    def __init__(self, version_dir: Path, manifest: Manifest, schema: Schema) -> None:
        load_fbgemm()
        self.manifest = manifest
        self.schema = schema
        set_dense_math(manifest.dense_dtype)
        self.dense_device = torch.device(manifest.dense_device)
        self.sparse_device = torch.device(manifest.sparse_device)
        try:
            self.module = torch.jit.load(str(Path(version_dir) / MODEL_FILE), map_location=self.dense_device)
        except RuntimeError as e:
            raise ArtifactError(f"{version_dir}: model.pt does not load: {str(e).splitlines()[0][:300]}") from e
        self.module.eval()
        self._columns: Dict[Tuple[str, ...], np.ndarray] = {}

    @property
    def device(self) -> str:
        return str(self.dense_device)

    # -- one model call ------------------------------------------------------------------------
    def predict(self, dense: np.ndarray, values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            ctr = self.module(
                torch.from_numpy(dense).to(self.dense_device, non_blocking=True),
                torch.from_numpy(values).to(self.sparse_device, non_blocking=True),
                torch.from_numpy(lengths.reshape(-1)).to(self.sparse_device, non_blocking=True),
            )
            return ctr.cpu().numpy()

    def lookup(self, values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            pooled = self.module.lookup(
                torch.from_numpy(values).to(self.sparse_device, non_blocking=True),
                torch.from_numpy(lengths.reshape(-1)).to(self.sparse_device, non_blocking=True),
            )
            return pooled.cpu().numpy()

    # -- batches -------------------------------------------------------------------------------
    def predict_batch(self, works: List[Work]) -> List[np.ndarray]:
        dense = np.concatenate([w.inputs[0] for w in works]) if len(works) > 1 else np.array(works[0].inputs[0])
        values, lengths = merge_sparse([w.inputs[1] for w in works])
        ctr = self.predict(dense, values, lengths)
        return np.split(ctr, np.cumsum([w.batch_size for w in works])[:-1])

    def lookup_batch(self, works: List[Work]) -> List[np.ndarray]:
        values, lengths = merge_sparse([w.inputs for w in works])
        pooled = self.lookup(values, lengths)
        out = []
        for work, rows in zip(works, np.split(pooled, np.cumsum([w.batch_size for w in works])[:-1])):
            out.append(np.ascontiguousarray(rows[:, self.columns(work.inputs.keys)]))
        return out

    def columns(self, keys: Sequence[str]) -> np.ndarray:
        key = tuple(keys)
        if key not in self._columns:
            self._columns[key] = lookup_columns(self.schema, keys)
        return self._columns[key]

    # -- verification --------------------------------------------------------------------------
    def check_golden(self, version_dir: Path, warmup_runs: int = 3) -> float:
        """Run golden.pt's inputs and compare with its outputs; returns the max abs difference.
        The runs before the checked one warm up TorchScript's profiling executor, which optimises
        a method on its second call: no client request pays for that."""
        golden = torch.load(Path(version_dir) / GOLDEN_FILE, weights_only=True)
        t = len(self.schema.feature_names)
        lengths = golden["lengths"].numpy().reshape(t, -1)
        for _ in range(warmup_runs):
            ctr = self.predict(golden["dense"].numpy(), golden["values"].numpy(), lengths)
            pooled = self.lookup(golden["values"].numpy(), lengths)
        err = max(float(np.abs(ctr - golden["ctr"].numpy()).max()), float(np.abs(pooled - golden["pooled"].numpy()).max()))
        if not err <= GOLDEN_ATOL:
            raise ArtifactError(f"{version_dir}: outputs differ from golden.pt by {err:.3g} (> {GOLDEN_ATOL})")
        if not np.abs(golden["pooled"].numpy()).max() > 0:
            raise ArtifactError(f"{version_dir}: golden.pt pools to zeros; the tables were not restored at export")
        return err


def merge_sparse(batches: List[SparseBatch]) -> Tuple[np.ndarray, np.ndarray]:
    """One KJT from several: lengths [T, sum(B)]; values key-major, per feature request by request."""
    if len(batches) == 1:
        return batches[0].values, batches[0].lengths
    lengths = np.concatenate([b.lengths for b in batches], axis=1)
    t_count = lengths.shape[0]
    pieces = []
    splits = [np.split(b.values, np.cumsum(b.lengths.sum(axis=1))[:-1]) for b in batches]
    for t in range(t_count):
        for per_request in splits:
            pieces.append(per_request[t])
    return np.concatenate(pieces), lengths
