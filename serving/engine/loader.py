"""Loader: read, verify and load one version of a model (TF Serving's ``core/loader.h``).

``load`` gives a version's manifest and one warmed-up runner per replica, or raises. It checks, in
order: every file matches its sha256 in the manifest, the manifest names the version's directory,
the artifact runs on this server's device, the manifest's numbers are those of the artifact
(:func:`check_golden_shapes`, :func:`check_module`: the manifest is not covered by the checksums, and
the front ends check requests against it; each feature's rows against the tables model.pt sends its
ids to, as loaded, before any id reaches a kernel: :func:`check_table_rows`), ``model.pt`` loads and
reproduces ``golden.pt``.

At most ``ServerConfig.load_threads`` versions load at once (a hundred models loading together
on a few cores took each past its timeout, and held every model's bytes in memory at once); the
others wait for a turn. A load takes at most ``ServerConfig.load_timeout_s`` from its turn, then it
is abandoned with :class:`LoadTimeout` (Python cannot stop a thread) and its turn passes on. Each
step runs in a thread of its own, never one shared with other loads, so that a stuck one holds up
nothing else beyond its turn:

- reading and checksumming the files, the step that can block forever (a FIFO as
  ``manifest.json``, a hung network mount), runs in a daemon thread: the process can still exit
  (the workers of a ThreadPoolExecutor, or asyncio's default executor, would be joined first);
- loading and warming up, from files that have just verified, runs in an ordinary thread, which
  the interpreter waits for at exit: a daemon thread stopped at exit inside torch's C++ code
  aborts the process ("terminate called without an active exception", exit 134).

When the server stops (:meth:`Loader.stop`), a load under way gives up at its next step (loading
model.pt, checking it, its golden check, its warm-up): each holds the GIL for tenths of a second at a
time, which the loop that stops the engine would wait for, again and again, until the grace period ran out.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from pathlib import Path
from typing import AsyncIterator, Callable, List, Optional, Tuple, TypeVar

import torch

from recserve import tables
from recserve.manifest import GOLDEN_FILE, ArtifactError, Manifest, dense_math, load_verified, read_manifest
from serving.config import ServerConfig
from serving.model_config import ModelConfig
from serving.engine import uvm
from serving.engine.runner import ModelRunner, device_unusable, read_golden
from serving.ipc import Schema

log = logging.getLogger("serving.engine.loader")
T = TypeVar("T")


class ServedElsewhere(ArtifactError):
    """Not this engine's to serve (a model sharded over GPUs belongs to the engine that sees them)."""


class LoadTimeout(ArtifactError):
    """A version did not finish loading within ``load_timeout_s``."""


class LoadAbandoned(ArtifactError):
    """The server stops: the load gave up between two of its steps."""


class DeviceFailed(ArtifactError):
    """A load's checks or warm-up left the device unusable (a CUDA error that poisons the process):
    the engine goes down for a restart, as after a batch that did (serving/engine/batcher.py)."""


class Loader:
    def __init__(self, config: ServerConfig, device: str) -> None:
        self.config = config
        self.device = device
        self._turns = asyncio.Semaphore(config.load_threads)
        self._stopping = threading.Event()  # set from the loop, read by the load threads

    def stop(self) -> None:
        """The server stops: loads under way give up at their next step (a thread cannot be interrupted)."""
        self._stopping.set()

    def _next_step(self, path: Path) -> None:
        """Called by a load thread before each of its steps."""
        if self._stopping.is_set():
            raise LoadAbandoned(f"{path}: the server stops; load abandoned")

    def path(self, name: str, version: int) -> Path:
        return self.config.repo / name / str(version)

    async def load(self, name: str, version: int, config: ModelConfig) -> Tuple[Manifest, List[ModelRunner]]:
        """The version's manifest and its runners, verified and warmed up for ``config``."""
        path = self.path(name, version)
        async with self._turns, self._deadline(path):
            manifest = await in_thread(f"verify-{name}-v{version}", True, load_verified, path)
            if manifest.name != name or manifest.version != version:
                raise ArtifactError(f"{path}: manifest says {manifest.name} version {manifest.version}")
            if self.config.engine_index > 0 and manifest.sharding.world_size > 1:
                raise ServedElsewhere(f"{name} v{version} spans {manifest.sharding.world_size} GPUs: engine 0, which "
                                      "sees them all, serves it")
            check_device(manifest, self.device)
            await in_thread(f"golden-{name}-v{version}", True, check_golden_shapes, path, manifest)
            return manifest, await in_thread(f"load-{name}-v{version}", False, self._runners, path, manifest, config)

    async def manifest(self, name: str, version: int) -> Manifest:
        """Only the manifest, as it is on disk now (not verified)."""
        path = self.path(name, version)
        async with self._deadline(path):
            return await in_thread(f"manifest-{name}-v{version}", True, read_manifest, path)

    def _runners(self, path: Path, manifest: Manifest, config: ModelConfig) -> List[ModelRunner]:
        schema = Schema.from_manifest(manifest, config.batch.max_batch_size, config.batch.max_ids_per_request)
        runners = []
        for device in replica_devices(manifest, self.config.replicas):
            self._next_step(path)
            try:
                runners.append(self._runner(path, manifest, schema, device, config, check=not runners))
            except Exception as e:
                failure = e.__cause__ or e  # a RuntimeError, if ArtifactError wrapped one
                if device_unusable(failure, torch.device(device or manifest.dense_device)):
                    raise DeviceFailed(f"{path}: the device failed while this version loaded ({_reason(failure)}); "
                                       "the engine exits for a restart") from e
                raise
        return runners

    def _runner(self, path: Path, manifest: Manifest, schema: Schema, device: Optional[str], config: ModelConfig,
                check: bool) -> ModelRunner:
        runner = ModelRunner(path, manifest, schema, device, cuda_graphs=self.config.cuda_graphs,
                             shared_pooling=self.config.shared_pooling)
        try:
            if check:
                self._next_step(path)
                check_module(runner.module, manifest, path, runner.assembler.device)
            self._next_step(path)
            runner.check_golden(path)
            self._next_step(path)
            runner.warm_up(path, config.warmup_batch_sizes)
        except (RuntimeError, torch.jit.Error) as e:
            raise ArtifactError(f"{path}: model.pt fails on golden.pt's inputs ({_reason(e)})") from e
        return runner

    @contextlib.asynccontextmanager
    async def _deadline(self, path: Path) -> AsyncIterator[None]:
        timeout = self.config.load_timeout_s
        try:
            async with asyncio.timeout(timeout):
                yield
        except TimeoutError:
            raise LoadTimeout(f"{path}: not loaded within {timeout:g}s (a FIFO? a hung network mount?); "
                              "abandoned") from None


def in_thread(thread_name: str, daemon: bool, fn: Callable[..., T], *args) -> "asyncio.Future[T]":
    """``fn(*args)`` in a new thread; its outcome, if it ever comes, resolves the future."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(setter, value) -> None:
        if not future.done():  # cancelled: the caller stopped waiting
            setter(value)

    def run() -> None:
        try:
            outcome = (future.set_result, fn(*args))
        except Exception as e:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (future.set_exception, e)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:
            pass  # the loop is closed: nobody waits for this any more

    threading.Thread(target=run, name=thread_name, daemon=daemon).start()
    return future


def _reason(exc: BaseException) -> str:
    """The line of a load's failure that says what failed: in a TorchScript trace the error's, after the
    code; of a CUDA error ("CUDA error: ..."), that one, not the advice c10 appends to every one."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    errors = [line for line in lines if "Error: " in line or "error: " in line]
    return (errors or lines)[-1][:300]


def _mismatch(field: str, problem: str) -> ArtifactError:
    return ArtifactError(f"manifest field {field}: {problem}; the manifest does not describe this artifact")


def check_golden_shapes(path: Path, manifest: Manifest) -> None:
    """golden.pt (checksummed, written by the export from the model's own tables) against the
    manifest: its dense width, its feature count, its pooled width, and each feature's largest id,
    which the export makes the table's last row (export/verify.py ``sample_batch``). golden.pt is
    the export's word, checksummed by the manifest that anyone editing either rewrites: the rows
    themselves are checked against model.pt's tables (:func:`check_table_rows`) before golden.pt's
    ids run through it."""
    golden = read_golden(path)
    dense, lengths, values, pooled = golden["dense"], golden["lengths"], golden["values"], golden["pooled"]
    b, t = dense.shape[0], len(manifest.features)
    if dense.shape[1] != manifest.dense_features:
        raise _mismatch("dense_features", f"{manifest.dense_features}, but golden.pt's inputs have {dense.shape[1]}")
    if lengths.numel() != t * b:
        raise _mismatch("features", f"{t} features, but golden.pt's inputs have {lengths.numel() // max(b, 1)}")
    if pooled.shape[1] != manifest.pooled_dim:
        raise _mismatch("features", f"the dims add up to {manifest.pooled_dim}, but golden.pt pools "
                                    f"{pooled.shape[1]} columns")
    for i, (f, (start, end)) in enumerate(zip(manifest.features, _segments(lengths.reshape(t, b)))):
        if end == start:
            continue
        low, high = int(values[start:end].min()), int(values[start:end].max())
        if low < 0:
            raise ArtifactError(f"{path / GOLDEN_FILE}: feature {i} has id {low}; not the export's sample batch "
                                "(re-export the model)")
        if high >= f.rows or (b > 1 and high != f.rows - 1):
            raise _mismatch(f"features[{i}].rows", f"{f.rows}, but the table of feature {i} in the artifact has "
                                                   f"{high + 1} rows (golden.pt's largest id)")


def _segments(lengths: torch.Tensor) -> List[Tuple[int, int]]:
    """[start, end) of each feature's ids in a key-major KJT whose ``lengths`` are [T, B]."""
    ends = lengths.sum(dim=1).cumsum(0).tolist()
    return list(zip([0] + ends[:-1], ends))


DENSE_TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# FBGEMM's SparseType values, as the TBE modules of model.pt record them per table (``weights_tys``).
SPARSE_TYPES = {0: "fp32", 1: "fp16", 2: "int8", 3: "int4", 4: "int2", 5: "bf16"}


def check_module(module: torch.nn.Module, manifest: Manifest, path: Path, sparse_device: torch.device) -> None:
    """The loaded model.pt against the manifest: its tables' weight dtypes, UVM caches and its dense
    part's dtype, and each feature's columns of ``lookup``: a bag of feature i alone (golden.pt's) pools
    into feature i's columns of the manifest and nowhere else (dims and feature order), and the
    same bags with every id twice pool to twice as much (SUM) or as much (MEAN) as its pooling."""
    stored = {SPARSE_TYPES.get(int(ty), str(int(ty))) for name, buf in module.named_buffers()
              if name.endswith("weights_tys") for ty in buf.flatten().tolist()}
    for i, f in enumerate(manifest.features):
        if stored and f.weight_dtype not in stored:
            raise _mismatch(f"features[{i}].weight_dtype", f"{f.weight_dtype}, but model.pt's tables are "
                                                           f"{sorted(stored)}")
    cached = uvm.cache_tables(module)
    if cached and not uvm.not_capturable(manifest):  # a CUDA graph would freeze the cache's per-call state
        raise _mismatch("sharding.tables", f"no table is uvm_caching, but model.pt's {', '.join(cached)} hold a "
                                           "UVM cache")
    dense_dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if dense_dtypes and dense_dtypes != {DENSE_TORCH_DTYPES[manifest.dense_dtype]}:
        raise _mismatch("dense_dtype", f"{manifest.dense_dtype}, but model.pt's dense parameters are "
                                       f"{sorted(str(d).replace('torch.', '') for d in dense_dtypes)}")
    check_table_rows(module, manifest, path, sparse_device)  # before any id of the manifest's reaches a kernel
    golden = read_golden(path)
    t = len(manifest.features)
    lengths = golden["lengths"].reshape(t, -1)
    columns = [0] + torch.tensor([f.dim for f in manifest.features]).cumsum(0).tolist()
    with torch.inference_mode(), dense_math(manifest.dense_dtype):
        for i, (start, end) in enumerate(_segments(lengths)):
            alone = torch.zeros_like(lengths)
            alone[i] = lengths[i]
            pooled = module.lookup(golden["values"][start:end].to(sparse_device),
                                   alone.reshape(-1).to(sparse_device)).float().cpu()
            outside = torch.cat([pooled[:, :columns[i]], pooled[:, columns[i + 1]:]], dim=1)
            if pooled.shape[1] != columns[-1] or outside.any():  # any(): no columns outside with one feature
                raise _mismatch(f"features[{i}].dim", f"{manifest.features[i].dim} from column {columns[i]}, but "
                                                      f"model.pt pools feature {i} into other columns")
            once = pooled[:, columns[i]:columns[i + 1]]
            twice = module.lookup(golden["values"][start:end].repeat_interleave(2).to(sparse_device),
                                  (2 * alone).reshape(-1).to(sparse_device)).float().cpu()[:, columns[i]:columns[i + 1]]
            pooling = "SUM" if (twice - 2 * once).norm() < (twice - once).norm() else "MEAN"
            if once.any() and pooling != manifest.features[i].pooling:
                raise _mismatch(f"features[{i}].pooling", f"{manifest.features[i].pooling}, but model.pt's table of "
                                                          f"feature {i} pools by {pooling}")


def check_table_rows(module: torch.nn.Module, manifest: Manifest, path: Path, sparse_device: torch.device) -> None:
    """Each feature's ``rows`` against the rows of the tables model.pt sends its ids to, as loaded
    (recserve/tables.py; the export ran the same check before publishing, but the manifest is not
    covered by the checksums): FBGEMM's lookups check no bounds, so a manifest claiming more rows than
    a table holds would have the front ends pass ids that read past its end. Fewer is refused too: the
    manifest then does not describe the artifact either. No table is read while checking."""
    try:
        tables.check_rows(module, [f.rows for f in manifest.features], sparse_device)
    except tables.RowsMismatch as e:
        raise _mismatch(f"features[{e.feature}].rows", e.problem) from None
    except tables.Unreached as e:
        raise ArtifactError(f"{path}: model.pt's lookup of feature {e.feature} reaches no FBGEMM table; not an "
                            "artifact of recserve export") from None
    except tables.UnknownOperator as e:
        raise ArtifactError(f"{path}: model.pt's lookup calls {e.args[0]}, which reads rows by id and which the "
                            "load's check of table rows does not know; not an artifact of recserve export") from None
    except tables.LayoutError as e:
        raise ArtifactError(f"{path}: model.pt's tables cannot be read: {e}") from None
    except (RuntimeError, torch.jit.Error) as e:
        raise ArtifactError(f"{path}: model.pt fails on a bag of each feature's ids ({_reason(e)})") from e


def replica_devices(manifest: Manifest, replicas: int) -> List[Optional[str]]:
    """Where to load a version: one replica per visible GPU (``replicas`` 0 = all of them, else at
    most that many) for a single-GPU CUDA artifact; otherwise once, where it was exported for."""
    if manifest.sharding.device != "cuda" or manifest.sharding.world_size > 1:
        return [None]
    count = torch.cuda.device_count()
    wanted = count if replicas == 0 else min(replicas, count)
    return [f"cuda:{i}" for i in range(max(1, wanted))]


def check_device(manifest: Manifest, device: str) -> None:
    """An artifact runs where it was exported for: its tables and kernels are placed there."""
    wanted = manifest.sharding.device
    if wanted == "cuda":
        if device != "cuda":
            raise ArtifactError(f"{manifest.name} v{manifest.version} was exported for cuda; this server runs on "
                                f"{device} (re-export with --device cpu, or serve with --device cuda)")
        if torch.cuda.device_count() < manifest.sharding.world_size:
            raise ArtifactError(f"{manifest.name} v{manifest.version} needs {manifest.sharding.world_size} GPUs; "
                                f"{torch.cuda.device_count()} visible")
    elif device == "cuda":
        log.warning("%s v%d was exported for cpu; it runs on the CPU", manifest.name, manifest.version)
