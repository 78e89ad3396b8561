"""Model execution: one loaded ``model.pt`` on its device, and the batches the batcher hands it.

``launch_predict`` / ``launch_lookup`` take the requests of one batch (serving/engine/batcher.py), put them
on the device and merge them (serving/engine/assemble.py), make one model call, and queue the copy of each
request's rows into its own output - all without waiting for the device. ``finish`` waits, and gives
each request None (its output is written) or its own error, if its ids failed the device check.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from recserve.manifest import GOLDEN_FILE, MODEL_FILE, ArtifactError, Manifest, dense_math, disable_texpr_fuser
from serving.engine.assemble import CACHED_KEY_SETS, Assembler, DeviceRequest, Request
from serving.engine.batcher import Work
from serving.errors import InvalidInput
from serving.engine import uvm
from serving.engine.graphs import GraphedForward
from serving.ipc import Schema
from serving.frontend.validate import SparseBatch, id_error, lookup_columns

log = logging.getLogger("serving.engine.runner")

# Errors after which a CUDA context is unusable for the rest of the process.
FATAL_DEVICE_ERRORS = ("CUDA error", "device-side assert", "illegal memory access", "unspecified launch failure",
                       "CUBLAS_STATUS_EXECUTION_FAILED", "illegal instruction", "misaligned address")

# Served outputs must reproduce golden.pt this closely (same device kind as the export: exact up to
# kernel scheduling; the float reference itself is checked by the export's gates).
GOLDEN_ATOL = 1e-5
ONCE_CTR_ATOL = 2e-3  # --shared-pooling once against expand: bf16 dense, eager against graph replays


@dataclass
class Launched:
    """A batch whose work is queued on the device: its requests, their id-check flags (filled by
    a copy that ``done`` marks complete) and the event after its last copy (None on CPU)."""

    requests: List[Request]
    flags: torch.Tensor
    done: Optional["torch.cuda.Event"]


def load_fbgemm() -> None:
    """Make the FBGEMM operators that model.pt calls known to TorchScript."""
    import fbgemm_gpu  # noqa: F401


class ModelRunner:
    def __init__(self, version_dir: Path, manifest: Manifest, schema: Schema, device: Optional[str] = None,
                 cuda_graphs: bool = True, shared_pooling: str = "expand") -> None:
        """``device``: load a single-device artifact on another device of the same kind (a replica
        on cuda:1 of an artifact exported for cuda:0); None: where it was exported for.
        ``cuda_graphs``: replay the forward from CUDA graphs where it can (serving/engine/graphs.py).
        ``shared_pooling``: how batches with shared bags run: "expand" (each bag repeated for every
        sample of its request, on the device: the same KJT as the per-sample form, bitwise the same
        results) or "once" (each bag pooled once and its pooled row copied to the samples, eagerly;
        artifacts without ``pooled``/``predict_pooled`` expand)."""
        load_fbgemm()
        disable_texpr_fuser()
        self.manifest = manifest
        self.schema = schema
        self.dense_device = torch.device(device or manifest.dense_device)
        self.assembler = Assembler(schema, torch.device(device or manifest.sparse_device))
        try:
            with torch.cuda.device(self.dense_device) if self.dense_device.type == "cuda" else contextlib.nullcontext():
                path = Path(version_dir) / MODEL_FILE
                if uvm.has_host_tables(manifest):
                    self.module = uvm.load_with_host_tables(path, self.dense_device)
                else:
                    self.module = torch.jit.load(str(path), map_location=self.dense_device)
        except RuntimeError as e:
            raise ArtifactError(f"{version_dir}: model.pt does not load: {str(e).splitlines()[0][:300]}") from e
        self.module.eval()
        self.forward = GraphedForward(self.module, self.dense_device, len(schema.feature_names), schema.dense_features,
                                      schema.max_batch_size, enabled=cuda_graphs)
        if manifest.sharding.world_size > 1:
            self.forward.disable("the artifact is sharded over several GPUs")
        if reason := uvm.not_capturable(manifest):
            self.forward.disable(reason)
        self.cache_stats = uvm.CacheStats(self.module, manifest)  # empty without UVM caches
        self._columns = functools.lru_cache(CACHED_KEY_SETS)(self._device_columns)
        self.pool_shared_once = shared_pooling == "once" and hasattr(self.module, "predict_pooled")

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

    # -- batches: launch on the launch thread, finish on the finish thread (serving/engine/batcher.py) ---
    def launch_predict(self, works: List[Work]) -> "Launched":
        with self._on_device(), torch.inference_mode(), dense_math(self.manifest.dense_dtype):
            requests = [w.inputs for w in works]
            moved, bad = self.assembler.prepare(requests)
            dense = torch.cat([m.dense for m in moved]) if len(moved) > 1 else moved[0].dense
            dense = dense.to(self.dense_device)
            if self._pools_once(moved):
                values, lengths = self.assembler.merge_pooling_once(moved)
                pooled = self.assembler.broadcast_shared(self.module.pooled(values, lengths.reshape(-1)), moved)
                ctr = self.module.predict_pooled(dense, pooled)
            else:
                values, lengths = self.assembler.merge(moved)
                ctr = self.forward(dense, values, lengths)
            start = 0
            for r in requests:
                b = r.sparse.batch_size
                self._write(r, ctr[start:start + b])
                start += b
            return self._launched(requests, bad)

    def launch_lookup(self, works: List[Work]) -> "Launched":
        with self._on_device(), torch.inference_mode(), dense_math(self.manifest.dense_dtype):
            requests = [w.inputs for w in works]
            moved, bad = self.assembler.prepare(requests)
            if self._pools_once(moved):
                values, lengths = self.assembler.merge_pooling_once(moved)
                pooled = self.assembler.broadcast_shared(self.module.pooled(values, lengths.reshape(-1)), moved).float()
            else:
                values, lengths = self.assembler.merge(moved)
                pooled = self.module.lookup(values, lengths.reshape(-1))
            start = 0
            for r in requests:
                b = r.sparse.batch_size
                rows = pooled[start:start + b]
                start += b
                if not r.sparse.in_model_order:
                    rows = rows.index_select(1, self.columns(r.sparse.all_keys))
                self._write(r, rows)
            return self._launched(requests, bad)

    def _pools_once(self, moved: List[DeviceRequest]) -> bool:
        return self.pool_shared_once and any(m.shared for m in moved)

    def _write(self, request: Request, result: torch.Tensor) -> None:
        """The request's rows into its output, by DMA when that is page-locked (no wait)."""
        out = torch.from_numpy(request.out)
        out.copy_(result.reshape(out.shape), non_blocking=request.pinned and result.is_cuda)

    def _launched(self, requests: List[Request], bad: torch.Tensor) -> "Launched":
        flags = torch.empty(bad.shape, dtype=torch.bool, pin_memory=bad.is_cuda)
        flags.copy_(bad, non_blocking=True)
        done = None
        if self.dense_device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.dense_device))
        return Launched(requests, flags, done)

    def ready(self, launched: "Launched") -> bool:
        """Has the device done a launched batch's work (without waiting)?"""
        return launched.done is None or launched.done.query()

    def finish(self, launched: "Launched") -> List[Optional[Exception]]:
        """Wait for a launched batch; None per request whose output is written, or its own error."""
        if launched.done is not None:
            launched.done.synchronize()
        return [InvalidInput(id_error(r.sparse, self.schema)) if flag else None
                for r, flag in zip(launched.requests, launched.flags.tolist())]

    def run(self, requests: List[Request], rpc: str = "Predict") -> List[Optional[Exception]]:
        """Launch and finish one batch here (verification, benchmarks)."""
        works = [Work(inputs=r, batch_size=r.sparse.batch_size, deadline=None) for r in requests]
        return self.finish((self.launch_predict if rpc == "Predict" else self.launch_lookup)(works))

    def _on_device(self):
        return torch.cuda.device(self.dense_device) if self.dense_device.type == "cuda" else contextlib.nullcontext()

    def columns(self, keys: Sequence[str]) -> torch.Tensor:
        return self._columns(tuple(keys))

    def _device_columns(self, keys: Tuple[str, ...]) -> torch.Tensor:
        return torch.from_numpy(lookup_columns(self.schema, keys)).to(self.dense_device)

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
        predict = Request(sparse, golden["dense"].numpy(), np.empty(sparse.batch_size, np.float32), pinned=False)
        lookup = Request(sparse, None, np.empty((sparse.batch_size, sum(self.schema.dims)), np.float32), pinned=False)
        for _ in range(warmup_runs):
            errors = self.run([predict]) + self.run([lookup], "Lookup")
            if any(errors):
                raise ArtifactError(f"{version_dir}: golden.pt's inputs fail the id check: {errors}")
        ctr, pooled = predict.out, lookup.out
        err = max(float(np.abs(ctr - golden["ctr"].numpy()).max()), float(np.abs(pooled - golden["pooled"].numpy()).max()))
        if not err <= GOLDEN_ATOL:
            raise ArtifactError(f"{version_dir}: outputs differ from golden.pt by {err:.3g} (> {GOLDEN_ATOL})")
        if not np.abs(golden["pooled"].numpy()).max() > 0:
            raise ArtifactError(f"{version_dir}: golden.pt pools to zeros; the tables were not restored at export")
        if self.pool_shared_once:
            self._check_pooling_once(version_dir, sparse, golden["dense"].numpy(), warmup_runs)
        return err

    def _check_pooling_once(self, version_dir: Path, sparse: SparseBatch, dense: np.ndarray, runs: int) -> None:
        """``--shared-pooling once`` (``pooled`` + ``predict_pooled``) against the expanded path, on the
        golden inputs with the first feature's bag of sample 0 shared by every sample; warms it up."""
        n = int(sparse.lengths[0, 0])
        bag, b = sparse.values[:n], sparse.batch_size
        rest = sparse.values[int(sparse.totals[0]):]
        shared = SparseBatch(keys=list(sparse.keys[1:]), positions=sparse.positions[1:], lengths=sparse.lengths[1:],
                             values=rest, totals=sparse.totals[1:], batch_size=b, in_model_order=False,
                             shared_keys=[sparse.keys[0]], shared_positions=(0,),
                             shared_lengths=np.array([n], np.int64), shared_values=bag)
        lengths = np.concatenate([np.full((1, b), n, sparse.lengths.dtype), sparse.lengths[1:]])
        expanded = SparseBatch(keys=list(sparse.keys), positions=sparse.positions, lengths=lengths,
                               values=np.concatenate([np.tile(bag, b), rest]),
                               totals=lengths.sum(axis=1, dtype=np.int64), batch_size=b, in_model_order=True)
        width = sum(self.schema.dims)
        outputs = []
        for s in (shared, expanded):
            predict = Request(s, dense, np.empty(b, np.float32), pinned=False)
            lookup = Request(s, None, np.empty((b, width), np.float32), pinned=False)
            for _ in range(runs if s is shared else 1):
                self.run([predict]) + self.run([lookup], "Lookup")
            outputs.append((predict.out, lookup.out))
        d0 = self.schema.dims[0]  # Lookup's columns follow the request: the shared feature's come last
        (ctr, pooled), (want_ctr, want_pooled) = outputs
        # Pooled rows come from the same kernel: equal. CTRs: eager against CUDA-graph replays of other
        # shapes, within the rounding of the dense part's dtype.
        for what, err, atol in (
                ("pooled", float(np.abs(pooled - np.concatenate([want_pooled[:, d0:], want_pooled[:, :d0]], 1)).max()),
                 GOLDEN_ATOL),
                ("ctr", float(np.abs(ctr - want_ctr).max()), ONCE_CTR_ATOL)):
            if not err <= atol:
                raise ArtifactError(f"{version_dir}: pooling shared bags once differs from expanding them by {err:.3g} "
                                    f"in {what} (> {atol}); serve it with --shared-pooling expand")
