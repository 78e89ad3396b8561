"""Model execution: one loaded ``model.pt`` on its device, and the batches the batcher hands it.

``launch(rpc, items)`` takes the requests of one batch (serving/engine/batcher.py), stages their
blocks on the device (serving/engine/assemble.py), makes one model call (serving/engine/graphs.py:
the gather and the method, from a CUDA graph where it can) and queues the copy of each request's
rows into its result slot - all without waiting for the device. ``finish`` waits. Every request's
ids were checked by the front end, so a batch either succeeds whole or fails whole.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np
import torch

from recserve import install
from recserve.errors import UserError
from recserve.manifest import GOLDEN_FILE, MODEL_FILE, ArtifactError, Manifest, dense_math, disable_texpr_fuser
from serving.engine import uvm
from serving.engine.assemble import Assembler, Item, host_item, host_result
from serving.engine.graphs import ModelCall
from serving.ipc import ModelKJT, Schema

log = logging.getLogger("serving.engine.runner")

# Errors after which a CUDA context is unusable for the rest of the process.
FATAL_DEVICE_ERRORS = ("CUDA error", "device-side assert", "illegal memory access", "unspecified launch failure",
                       "CUBLAS_STATUS_EXECUTION_FAILED", "illegal instruction", "misaligned address")
# CUDA errors that leave the context usable (CUDA's non-sticky ones: an allocation refused, a batch or a
# version too large for the memory left; a launch or an argument this device does not take, for one
# request shape or one artifact): whether the device still works is asked of it.
RECOVERABLE_CUDA_ERRORS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "invalid configuration argument",
                           "too many resources requested for launch", "no kernel image is available",
                           "invalid device function", "CUDA error: invalid argument")

# Served outputs must reproduce golden.pt this closely (same device kind as the export: exact up to
# kernel scheduling; the float reference itself is checked by the export's gates).
GOLDEN_ATOL = 1e-5
ONCE_CTR_ATOL = 2e-3  # --shared-pooling once against expand: bf16 dense, run on other shapes (other graphs)


@dataclass
class Launched:
    """A batch whose work is queued on the device: its requests and the event after its last copy
    (None on CPU, where launching is the computation)."""

    items: List[Item]
    done: Optional["torch.cuda.Event"]
    # What the engine asked of the device for this batch when it was replayed from a CUDA graph: a
    # copy in and a copy out per request, the descriptor's copy, the graph launch and its event. 0:
    # eager (its kernels are launched one by one; bench/bare.py counts them with the profiler).
    device_calls: int = 0


def load_fbgemm() -> None:
    """Make the FBGEMM operators that model.pt calls known to TorchScript. A UserError where fbgemm is
    missing or its libraries do not load (the engine asks at start: serve stops there in one line,
    not each model refused by it)."""
    try:
        import fbgemm_gpu  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "fbgemm_gpu":
            raise
        raise UserError(install.not_installed("fbgemm_gpu")) from None
    except OSError as e:  # torch.ops.load_library: a build for another torch ("undefined symbol")
        reason = str(e).splitlines()[0][:200]
        raise UserError(f"fbgemm_gpu does not load ({reason}): {install.install_hint()}") from None


def device_unusable(exc: BaseException, device: torch.device) -> bool:
    """Did this failure (of a batch, or of a load's checks) leave ``device`` unusable for the rest of
    the process? Then only a restart helps."""
    text = str(exc)
    if any(marker in text for marker in FATAL_DEVICE_ERRORS) \
            and not any(m in text for m in RECOVERABLE_CUDA_ERRORS):
        return True
    if device.type == "cuda":
        try:
            torch.ones(1, device=device).add_(1).item()
        except torch.OutOfMemoryError:  # no memory for the probe either: the device answered
            return False
        except RuntimeError:
            return True
    return False


class ModelRunner:
    def __init__(self, version_dir: Path, manifest: Manifest, schema: Schema, device: Optional[str] = None,
                 cuda_graphs: bool = True, shared_pooling: str = "expand") -> None:
        """``device``: load a single-device artifact on another device of the same kind (a replica
        on cuda:1 of an artifact exported for cuda:0); None: where it was exported for.
        ``cuda_graphs``: replay the forward from CUDA graphs where it can (serving/engine/graphs.py).
        ``shared_pooling``: how batches with shared bags run: "expand" (each bag repeated for every
        sample of its request, on the device: the same KJT as the per-sample form, bitwise the same
        results) or "once" (each bag pooled once, in an extra sample, and its pooled row added to its
        request's samples; artifacts without ``pooled``/``predict_pooled`` expand)."""
        load_fbgemm()
        disable_texpr_fuser()
        self.manifest = manifest
        self.schema = schema
        self.dense_device = torch.device(device or manifest.dense_device)
        self.assembler = Assembler(schema, torch.device(device or manifest.sparse_device))
        self._stream = torch.cuda.default_stream(self.dense_device) if self.dense_device.type == "cuda" else None
        try:
            with self._on_device():
                path = Path(version_dir) / MODEL_FILE
                if uvm.has_host_tables(manifest):
                    self.module = uvm.load_with_host_tables(path, self.dense_device)
                else:
                    self.module = torch.jit.load(str(path), map_location=self.dense_device)
        except RuntimeError as e:
            raise ArtifactError(f"{version_dir}: model.pt does not load: {str(e).splitlines()[0][:300]}") from e
        missing = [m for m in ("forward", "lookup") if not self.module._c._has_method(m)]
        if missing:
            raise ArtifactError(f"{version_dir}: model.pt has no {' or '.join(missing)} method; not an artifact of "
                                "recserve export")
        self.module.eval()
        self.forward = ModelCall(self.module, self.assembler, self.dense_device, schema.max_batch_size,
                                 enabled=cuda_graphs)
        if manifest.sharding.world_size > 1 and self.dense_device.type == "cuda":  # on the CPU: off already
            self.forward.disable("the artifact is sharded over several GPUs")
        if reason := uvm.not_capturable(manifest):
            self.forward.disable(reason)
        self.cache_stats = uvm.CacheStats(self.module, manifest)  # empty without UVM caches
        self.pool_shared_once = shared_pooling == "once" and hasattr(self.module, "predict_pooled")

    @property
    def device(self) -> str:
        return str(self.dense_device)

    def is_fatal(self, exc: BaseException) -> bool:
        """Did this failure leave the device unusable? (Then only a restart helps.)"""
        return device_unusable(exc, self.dense_device)

    # -- batches: launch on the engine's thread (CUDA) or a worker thread (CPU), then finish --------
    def launch(self, rpc: str, items: List[Item]) -> Launched:
        with self._on_device():
            staged = self.assembler.stage(items, exact=not self.forward.graphed)
            result = self.forward.replay(rpc, staged)
            replayed = result is not None
            if result is None:  # a graph to capture, or an eager call
                with torch.inference_mode(), dense_math(self.manifest.dense_dtype):
                    result = self.forward(rpc, staged)
            self.assembler.write_results(items, result, staged)
            done = None
            if self.dense_device.type == "cuda":
                done = torch.cuda.Event(blocking=True)  # finish() waits for it without spinning
                done.record(self._stream)
            return Launched(items, done, 2 * len(items) + 3 if replayed else 0)

    def ready(self, launched: Launched) -> bool:
        """Has the device done a launched batch's work (without waiting)?"""
        return launched.done is None or launched.done.query()

    def finish(self, launched: Launched) -> None:
        """Wait for a launched batch: its results are in its requests' slots."""
        if launched.done is not None:
            launched.done.synchronize()

    def run(self, rpc: str, requests: List[ModelKJT]) -> List[np.ndarray]:
        """One batch of requests in host memory, launched and finished here (verification,
        benchmarks): each request's result."""
        lookup = rpc == "Lookup"
        items = [host_item(kjt, self.schema, self.pool_shared_once, lookup) for kjt in requests]
        self.finish(self.launch(rpc, items))
        return [host_result(it, self.schema.pooled_width if lookup else 1) for it in items]

    def _on_device(self):
        # By index: resolving a torch.device here took a launch some microseconds of string work.
        if self.dense_device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.device(self.dense_device.index)

    # -- verification --------------------------------------------------------------------------
    def check_golden(self, version_dir: Path, warmup_runs: int = 3) -> float:
        """Run golden.pt's inputs through the batch path and compare with its outputs; returns the
        max abs difference. The runs before the checked one warm up TorchScript's profiling
        executor, which optimises a method on its second call: no client request pays for that."""
        golden = read_golden(version_dir)
        kjt = golden_kjt(golden, len(self.schema.feature_names))
        for _ in range(warmup_runs):
            (ctr,), (pooled,) = self.run("Predict", [kjt]), self.run("Lookup", [kjt])
        err = max(float(np.abs(ctr - golden["ctr"].numpy()).max()), float(np.abs(pooled - golden["pooled"].numpy()).max()))
        if not err <= GOLDEN_ATOL:
            raise ArtifactError(f"{version_dir}: outputs differ from golden.pt by {err:.3g} (> {GOLDEN_ATOL})")
        if not np.abs(golden["pooled"].numpy()).max() > 0:
            raise ArtifactError(f"{version_dir}: golden.pt pools to zeros; the tables were not restored at export")
        if self.pool_shared_once:
            self._check_pooling_once(version_dir, kjt, warmup_runs)
        return err

    def warm_up(self, version_dir: Path, batch_sizes: Sequence[int]) -> None:
        """Run Predict and Lookup at each of ``batch_sizes`` (a model's ``warmup_batch_sizes``), so
        that TorchScript's optimisation and the CUDA graph captures of those sizes happen now, before
        the version takes requests. The warm-up request repeats golden.pt's samples up to the size:
        a request with about as many ids per sample lands in the same graph (serving/engine/graphs.py
        buckets); one with far more ids falls in another id bucket, captured on first use."""
        if not batch_sizes:
            return
        kjt = golden_kjt(read_golden(version_dir), len(self.schema.feature_names))
        for size in batch_sizes:
            request = repeat_samples(kjt, size)
            for _ in range(2):
                self.run("Predict", [request])
                self.run("Lookup", [request])

    def _check_pooling_once(self, version_dir: Path, kjt: ModelKJT, runs: int) -> None:
        """``--shared-pooling once`` (``pooled`` + ``predict_pooled``) against the expanded path, on the
        golden inputs with the first feature's largest bag shared by every sample (not sample 0's:
        golden.pt's sample 0 has empty bags, and an empty shared bag checks nothing); warms it up."""
        b = kjt.batch_size
        lengths = np.asarray(kjt.lengths[0])
        s = int(lengths.argmax())
        start, n = int(lengths[:s].sum()), int(lengths[s])
        bag = kjt.ids[0][start:start + n]
        shared = ModelKJT(b, [bag] + kjt.ids[1:], [n] + kjt.lengths[1:], kjt.dense)
        expanded = ModelKJT(b, [np.tile(bag, b)] + kjt.ids[1:], [np.full(b, n, np.int32)] + kjt.lengths[1:], kjt.dense)
        outputs = []
        for request in (shared, expanded):
            for _ in range(runs if request is shared else 1):
                (ctr,), (pooled,) = self.run("Predict", [request]), self.run("Lookup", [request])
            outputs.append((ctr, pooled))
        (ctr, pooled), (want_ctr, want_pooled) = outputs
        # Pooled rows come from the same kernel: equal. CTRs: the dense part on other shapes (graphs of
        # other buckets), within the rounding of the dense part's dtype.
        for what, err, atol in (("pooled", float(np.abs(pooled - want_pooled).max()), GOLDEN_ATOL),
                                ("ctr", float(np.abs(ctr - want_ctr).max()), ONCE_CTR_ATOL)):
            if not err <= atol:
                raise ArtifactError(f"{version_dir}: pooling shared bags once differs from expanding them by {err:.3g} "
                                    f"in {what} (> {atol}); serve it with --shared-pooling expand")


def repeat_samples(kjt: ModelKJT, batch_size: int) -> ModelKJT:
    """A request of ``batch_size`` samples: ``kjt``'s samples over and over."""
    reps = -(-batch_size // kjt.batch_size)
    lengths = [np.tile(np.asarray(l), reps)[:batch_size] for l in kjt.lengths]
    ids = [np.tile(np.asarray(v), reps)[:int(l.sum())] for v, l in zip(kjt.ids, lengths)]
    return ModelKJT(batch_size, ids, lengths, np.tile(kjt.dense, (reps, 1))[:batch_size])


GOLDEN_TENSORS = {"dense": 2, "values": 1, "lengths": 1, "ctr": 1, "pooled": 2}  # name -> dimensions
GOLDEN_DTYPES = {"values": torch.int64, "lengths": torch.int32}  # the others float32


def read_golden(version_dir: Path) -> dict:
    """golden.pt's tensors, each of the dtype and rank the export writes, the lengths >= 0 adding up to
    the ids and every sample's outputs there; ArtifactError naming the file where it is not so (it
    is checksummed, but so is anything the manifest that names the checksum says)."""
    path = Path(version_dir) / GOLDEN_FILE
    try:
        golden = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a bad zip (RuntimeError), an empty file (EOFError), a pickle of other things
        reason = (str(e).splitlines() or [""])[0][:200]
        raise ArtifactError(f"{path}: does not load ({type(e).__name__}{': ' + reason if reason else ''})") from None

    def bad(problem: str) -> ArtifactError:
        return ArtifactError(f"{path}: {problem}; not the export's sample batch (re-export the model)")

    if not isinstance(golden, dict):
        raise bad(f"a {type(golden).__name__}, not a dict of tensors")
    for name, dims in GOLDEN_TENSORS.items():
        tensor, dtype = golden.get(name), GOLDEN_DTYPES.get(name, torch.float32)
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != dims or tensor.dtype != dtype:
            got = f"{_dtype(tensor.dtype)} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) \
                else type(tensor).__name__
            raise bad(f"{name} is {got}, not a {dims}-D {_dtype(dtype)} tensor")
    b, lengths = golden["dense"].shape[0], golden["lengths"]
    if b < 1 or golden["ctr"].shape[0] != b or golden["pooled"].shape[0] != b or lengths.numel() % b:
        raise bad(f"{b} samples of dense, {golden['ctr'].shape[0]} of ctr, {golden['pooled'].shape[0]} of pooled "
                  f"and {lengths.numel()} lengths")
    if lengths.numel() and int(lengths.min()) < 0:
        raise bad(f"a length is {int(lengths.min())}")
    if int(lengths.sum(dtype=torch.int64)) != golden["values"].numel():
        raise bad(f"the lengths add up to {int(lengths.sum(dtype=torch.int64))}, the ids are "
                  f"{golden['values'].numel()}")
    return golden


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def golden_kjt(golden: dict, features: int) -> ModelKJT:
    """golden.pt's inputs as a request in model order."""
    lengths = golden["lengths"].numpy().reshape(features, -1)
    totals = np.concatenate(([0], np.cumsum(lengths.sum(axis=1))))
    values = golden["values"].numpy()
    return ModelKJT(lengths.shape[1], [values[totals[t]:totals[t + 1]] for t in range(features)], list(lengths),
                    golden["dense"].numpy())
