"""Model execution: one loaded ``model.pt`` on its device, and the batches the batcher hands it.

``predict_batch`` / ``lookup_batch`` take the requests of one batch (serving/batcher.py), put them on
the device and merge them (serving/assemble.py), make one model call, and split the result so that
every request gets exactly its own rows - or its own error, if its ids failed the device check.
"""
from __future__ import annotations

import logging
from pathlib import Path
import contextlib
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from recserve.manifest import GOLDEN_FILE, MODEL_FILE, ArtifactError, Manifest, set_dense_math
from serving.assemble import Assembler, split_rows
from serving.batcher import Work
from serving.errors import InvalidInput
from serving.graphs import GraphedForward
from serving.validate import Schema, SparseBatch, lookup_columns

log = logging.getLogger("serving.runner")

# Errors after which a CUDA context is unusable for the rest of the process.
FATAL_DEVICE_ERRORS = ("CUDA error", "device-side assert", "illegal memory access", "unspecified launch failure",
                       "CUBLAS_STATUS_EXECUTION_FAILED", "illegal instruction", "misaligned address")

# Served outputs must reproduce golden.pt this closely (same device kind as the export: exact up to
# kernel scheduling; the float reference itself is checked by the export's gates).
GOLDEN_ATOL = 1e-5


def load_fbgemm() -> None:
    """Make the FBGEMM operators that model.pt calls known to TorchScript."""
    import fbgemm_gpu  # noqa: F401


class ModelRunner:
    def __init__(self, version_dir: Path, manifest: Manifest, schema: Schema, device: Optional[str] = None,
                 cuda_graphs: bool = True) -> None:
        """``device``: load a single-device artifact on another device of the same kind (a replica
        on cuda:1 of an artifact exported for cuda:0); None: where it was exported for.
        ``cuda_graphs``: replay the forward from CUDA graphs where it can (serving/graphs.py)."""
        load_fbgemm()
        set_dense_math(manifest.dense_dtype)
        self.manifest = manifest
        self.schema = schema
        self.dense_device = torch.device(device or manifest.dense_device)
        self.assembler = Assembler(schema, torch.device(device or manifest.sparse_device))
        try:
            with torch.cuda.device(self.dense_device) if self.dense_device.type == "cuda" else contextlib.nullcontext():
                self.module = torch.jit.load(str(Path(version_dir) / MODEL_FILE), map_location=self.dense_device)
        except RuntimeError as e:
            raise ArtifactError(f"{version_dir}: model.pt does not load: {str(e).splitlines()[0][:300]}") from e
        self.module.eval()
        self.forward = GraphedForward(self.module, self.dense_device, len(schema.feature_names), schema.dense_features,
                                      schema.max_batch_size, enabled=cuda_graphs)
        if manifest.sharding.world_size > 1:
            self.forward.disable("the artifact is sharded over several GPUs")
        self._columns: Dict[Tuple[str, ...], torch.Tensor] = {}

    @property
    def device(self) -> str:
        return str(self.dense_device)

    def is_fatal(self, exc: BaseException) -> bool:
        """Did this failure leave the device unusable? (Then only a restart helps.)"""
        if any(marker in str(exc) for marker in FATAL_DEVICE_ERRORS):
            return True
        if self.dense_device.type == "cuda":
            try:
                torch.ones(1, device=self.dense_device).add_(1).item()
            except RuntimeError:
                return True
        return False

    # -- batches -------------------------------------------------------------------------------
    def predict_batch(self, works: List[Work]) -> List[Union[np.ndarray, Exception]]:
        with self._on_device():
            return self._predict_batch(works)

    def lookup_batch(self, works: List[Work]) -> List[Union[np.ndarray, Exception]]:
        with self._on_device():
            return self._lookup_batch(works)

    def _on_device(self):
        return torch.cuda.device(self.dense_device) if self.dense_device.type == "cuda" else contextlib.nullcontext()

    def _predict_batch(self, works: List[Work]) -> List[Union[np.ndarray, Exception]]:
        requests, errors = self.assembler.prepare([w.inputs[1] for w in works], [w.inputs[0] for w in works])
        results: List[Union[np.ndarray, Exception]] = [InvalidInput(e) if e else None for e in errors]
        good = [i for i, r in enumerate(requests) if r is not None]
        if good:
            with torch.inference_mode():
                values, lengths = self.assembler.merge([requests[i] for i in good])
                dense = torch.cat([requests[i].dense for i in good]) if len(good) > 1 else requests[good[0]].dense
                ctr = self.forward(dense.to(self.dense_device), values, lengths).cpu().numpy()
            for i, rows in zip(good, split_rows(ctr, [works[i].batch_size for i in good])):
                results[i] = rows
        return results

    def _lookup_batch(self, works: List[Work]) -> List[Union[np.ndarray, Exception]]:
        requests, errors = self.assembler.prepare([w.inputs for w in works])
        results: List[Union[np.ndarray, Exception]] = [InvalidInput(e) if e else None for e in errors]
        good = [i for i, r in enumerate(requests) if r is not None]
        if good:
            with torch.inference_mode():
                values, lengths = self.assembler.merge([requests[i] for i in good])
                pooled = self.module.lookup(values, lengths.reshape(-1))
                start = 0
                for i in good:
                    rows = pooled[start : start + works[i].batch_size]
                    start += works[i].batch_size
                    if not works[i].inputs.in_model_order:
                        rows = rows.index_select(1, self.columns(works[i].inputs.keys))
                    results[i] = rows.cpu().numpy()
        return results

    def columns(self, keys: Sequence[str]) -> torch.Tensor:
        key = tuple(keys)
        if key not in self._columns:
            self._columns[key] = torch.from_numpy(lookup_columns(self.schema, keys)).to(self.dense_device)
        return self._columns[key]

    # -- verification --------------------------------------------------------------------------
    def check_golden(self, version_dir: Path, warmup_runs: int = 3) -> float:
        """Run golden.pt's inputs through the batch path and compare with its outputs; returns the
        max abs difference. The runs before the checked one warm up TorchScript's profiling
        executor, which optimises a method on its second call: no client request pays for that."""
        golden = torch.load(Path(version_dir) / GOLDEN_FILE, weights_only=True)
        t = len(self.schema.feature_names)
        lengths = golden["lengths"].numpy().reshape(t, -1)
        sparse = SparseBatch(keys=list(self.schema.feature_names), positions=tuple(range(t)), lengths=lengths,
                             values=golden["values"].numpy(), totals=lengths.sum(axis=1, dtype=np.int64),
                             batch_size=lengths.shape[1], in_model_order=True)
        work = Work(inputs=(golden["dense"].numpy(), sparse), batch_size=sparse.batch_size, deadline=None)
        lookup = Work(inputs=sparse, batch_size=sparse.batch_size, deadline=None)
        for _ in range(warmup_runs):
            ctr = self.predict_batch([work])[0]
            pooled = self.lookup_batch([lookup])[0]
        err = max(float(np.abs(ctr - golden["ctr"].numpy()).max()), float(np.abs(pooled - golden["pooled"].numpy()).max()))
        if not err <= GOLDEN_ATOL:
            raise ArtifactError(f"{version_dir}: outputs differ from golden.pt by {err:.3g} (> {GOLDEN_ATOL})")
        if not np.abs(golden["pooled"].numpy()).max() > 0:
            raise ArtifactError(f"{version_dir}: golden.pt pools to zeros; the tables were not restored at export")
        return err
