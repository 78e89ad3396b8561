"""Model lifecycle: Source (the repository on disk) -> Loader (serving/engine/loader.py) -> Manager.

- Source: every poll lists each model's directory on its own. A model directory that cannot be
  read, or a directory in it not named by a version number (1 .. 2**63-1, ASCII digits), is
  refused for that model only: logged once with its path and counted
  (``recserve_model_load_failures_total{model,reason}``); the model keeps what it serves.
- Manager, per model and independently of the others (TF Serving's availability-preserving
  policy): serve the highest version on disk that loads and verifies. A new one is loaded,
  verified and warmed while the current one keeps serving, then swapped in; the old one stops
  taking requests and is released when its in-flight requests have finished. So deleting the
  served version rolls back to the highest one left; a version number republished with another
  ``model.pt`` (its sha256 in the manifest) is loaded again and swapped in.
- A model with no version left on disk keeps serving its last one from memory, in state
  ``READY_REMOVED_FROM_DISK``, until a version appears again.
- A version that fails is refused: logged, counted, and retried only if its directory changes.
- Requests hold a :class:`ModelVersion` handle (``use``) for their whole life, never a global.
"""
from __future__ import annotations

import asyncio
import functools
import gc
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from recserve.errors import UserError
from recserve.manifest import MAX_VERSION, MODEL_FILE, Manifest, VersionListing, list_models, scan_versions
from serving.engine.batcher import Batcher, Router, Work
from serving.config import ServerConfig
from serving.engine.loader import Loader, ServedElsewhere
from serving.metrics import Metrics
from serving.statistics import VersionStatistics
from serving.engine.runner import ModelRunner

log = logging.getLogger("serving.engine.repository")

READY, DRAINING = "READY", "DRAINING"
# Serving from memory: its directory is gone and no other version of the model on disk loads.
READY_REMOVED_FROM_DISK = "READY_REMOVED_FROM_DISK"


class ModelVersion:
    """One loaded, verified version: its replicas (one runner per device, usually one) and, per RPC,
    a router over one batcher per replica. ``submit(rpc, work)`` queues one request (its answer
    comes through ``work.answer``); requests are counted in ``in_flight`` from ``acquire`` until
    ``release`` (their answer), and a draining version is closed only when that count is 0."""

    def __init__(self, name: str, version: int, manifest: Manifest, runners: List[ModelRunner],
                 config: ServerConfig, metrics: Metrics, on_fatal: Callable[[], None],
                 wake: Callable[[], None] = lambda: None) -> None:
        self.name, self.version, self.manifest, self.runners = name, version, manifest, runners
        self.schema = runners[0].schema
        self.pool_shared_once = runners[0].pool_shared_once
        self.state = "READY"
        self.in_flight = 0
        self.drained = asyncio.Event()
        # One thread per replica where launching blocks (the CPU: launching is the computation); on
        # CUDA launching only queues work, on the engine's thread. A replica's batches run in order.
        self.executors = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-v{version}-{r.device}")
                          if r.dense_device.type != "cuda" else None for r in runners]

        self.statistics = VersionStatistics()  # serving/statistics.py: the OIP statistics extension

        def observer(rpc: str):
            def on_batch(works, seconds, launched):
                self.statistics.batch(sum(w.batch_size for w in works), seconds)
                metrics.batch_done(rpc, name, sum(w.batch_size for w in works),
                                   [w.started - w.enqueued for w in works], seconds, launched.device_calls)
            return on_batch

        def router(rpc: str) -> Router:
            return Router([Batcher(f"{name} v{version} {rpc} on {r.device}", config.batch,
                                   functools.partial(_launch, r, rpc), r.ready, r.finish, ex, observer(rpc),
                                   r.is_fatal, on_fatal, wake)
                           for r, ex in zip(runners, self.executors)])

        self.routers: Dict[str, Router] = {"Predict": router("Predict"), "Lookup": router("Lookup")}
        self.batchers: List[Batcher] = [b for r in self.routers.values() for b in r.batchers]

    def submit(self, rpc: str, work: Work) -> None:
        self.routers[rpc].submit(work)

    def acquire(self) -> None:
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        if self.state == DRAINING and self.in_flight == 0:
            self.drained.set()

    @property
    def devices(self) -> str:
        return ",".join(r.device for r in self.runners) if self.runners else ""

    async def close(self, release: bool = True) -> None:
        """Stop taking requests; once what is queued and running has been answered, stop.
        ``release``: give the memory back now (a swap; at shutdown the process exit does it: a full
        collection per version took 4 s for 101 models)."""
        for b in self.batchers:
            b.closed = True
        while any(b.busy for b in self.batchers):
            await asyncio.sleep(0.005)  # the engine's loop answers them
        for ex in self.executors:
            if ex is not None:
                ex.shutdown(wait=True)
        self.runners = []
        if release:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def _launch(runner: ModelRunner, rpc: str, works: List[Work]):
    return runner.launch(rpc, [w.inputs for w in works])


def _dir_signature(path: Path) -> Tuple:
    """What changes when a directory's content is replaced: its files' names, sizes and times."""
    try:
        return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir()))
    except OSError:
        return ()


class ModelRepository:
    def __init__(self, config: ServerConfig, metrics: Metrics, on_fatal: Callable[[], None] = lambda: None,
                 wake: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.wake = wake  # a CPU batch ended (called from its thread)
        self.models: Dict[str, ModelVersion] = {}  # name -> the version that takes new requests
        self.ready = False
        self.loaded = False  # the start-up load is done (every model loaded or failed)
        self.device = resolve_device(config.device)
        self.loader = Loader(config, self.device)
        self._draining: List[ModelVersion] = []
        self._signatures: Dict[str, Tuple] = {}  # name -> directory signature its serving version was loaded from
        self._refused: Dict[Tuple[str, int], Tuple] = {}  # (name, version) -> directory signature
        self._reported: Dict[Tuple[str, str], str] = {}  # (name, path) -> what is wrong there, logged once
        self._busy: Dict[str, asyncio.Task] = {}  # name -> its refresh under way
        self._refresh_started = False
        self._refreshed_once = False
        self._closed = False

    # -- Source ----------------------------------------------------------------------------------
    def _model_names(self) -> List[str]:
        """Models on disk, and those serving whose directory is gone (they keep serving)."""
        try:
            on_disk = list_models(self.config.repo)
        except OSError as e:
            self._report_once("", self.config.repo, type(e).__name__, str(e), count=False)
            on_disk = []
        else:
            self._reported.pop(("", str(self.config.repo)), None)
        return sorted(set(on_disk) | set(self.models))

    def _list(self, name: str) -> Optional[VersionListing]:
        """The model's versions on disk; None if its directory cannot be read (then it keeps what it serves)."""
        model_dir = self.config.repo / name
        try:
            listing = scan_versions(model_dir)
        except FileNotFoundError:
            listing = VersionListing([], [])
        except OSError as e:
            self._report_once(name, model_dir, type(e).__name__, str(e))
            return None
        outside = [] if self.config.allow_symlinks else self._outside_repository(model_dir, listing.versions)
        wrong = {str(model_dir / entry) for entry in listing.not_versions} | {str(p) for _, p in outside}
        for key in [k for k in self._reported if k[0] == name and k[1] not in wrong]:
            del self._reported[key]  # fixed: report it again if it comes back
        for entry in listing.not_versions:
            self._report_once(name, model_dir / entry, "InvalidVersionName",
                              f"not a version: versions are named by a number from 1 to {MAX_VERSION} in ASCII digits")
        for _, path in outside:
            self._report_once(name, path, "SymlinkOutsideRepository",
                              f"resolves to {path.resolve()}, outside the repository {self.config.repo.resolve()}; "
                              "move it inside, or serve with --allow-symlinks")
        skipped = {v for v, _ in outside}
        return VersionListing([v for v in listing.versions if v not in skipped], listing.not_versions)

    def _outside_repository(self, model_dir: Path, versions: List[int]) -> List[Tuple[int, Path]]:
        """Version directories that are (or sit under) symlinks leading out of the repository."""
        root = self.config.repo.resolve()
        out = []
        for v in versions:
            path = model_dir / str(v)
            if not path.resolve().is_relative_to(root):
                out.append((v, path))
        return out

    def _report_once(self, name: str, path: Path, reason: str, message: str, count: bool = True) -> None:
        if self._reported.get((name, str(path))) == f"{reason}: {message}":
            return
        self._reported[(name, str(path))] = f"{reason}: {message}"
        if count:
            self.metrics.load_failures.labels(model=name, reason=reason).inc()
        log.error("%s: %s: %s; ignored%s", path, reason, message, f" ({name} keeps what it serves)" if name else "")

    # -- Manager ---------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Bring every model to the version it should serve, each in a task of its own: a model's
        failing or hanging load never holds up another's. Waits for the tasks it starts (a load at
        most ``load_timeout_s``); a model still busy from an earlier call is left to that one."""
        names = self._model_names()
        started = []
        for name in names:
            if name not in self._busy and not self._closed:
                self._busy[name] = task = asyncio.get_running_loop().create_task(self._refresh_model(name))
                task.add_done_callback(lambda _, name=name: self._busy.pop(name, None))
                started.append(task)
        first, self._refresh_started = not self._refresh_started, True
        if started:
            await asyncio.wait(started)
        if first:  # the start-up load: every model has loaded or failed (a poll meanwhile skipped those busy)
            self._refreshed_once = True
            missing = [n for n in names if n not in self.models]
            if missing:
                log.warning("starting without %s: no version loads (see the errors above)", ", ".join(missing))
        if self._refreshed_once:
            self.ready = self.ready or bool(self.models)
            self.loaded = True

    async def _refresh_model(self, name: str) -> None:
        try:
            listing = self._list(name)
            if listing is not None:
                await self._serve_highest(name, listing)
                self._mark_removed_from_disk(name, listing)
        except Exception:  # noqa: BLE001 - one model's surprise must never stop the others
            log.exception("refreshing model %s failed; it keeps what it serves", name)

    async def _serve_highest(self, name: str, listing: VersionListing) -> None:
        """Serve the highest version on disk that loads. Above the serving one: an upgrade; below
        it, when the serving one's directory is gone: a rollback."""
        current = self.models.get(name)
        for version in reversed(listing.versions):
            signature = _dir_signature(self.loader.path(name, version))
            if current is not None and version == current.version:
                await self._reload_if_replaced(current, signature)
                return
            if self._refused.get((name, version)) != signature and await self._load_and_swap(name, version, signature):
                return

    async def _reload_if_replaced(self, current: ModelVersion, signature: Tuple) -> None:
        """The serving version's directory changed: load it again if it now holds another model."""
        name, version = current.name, current.version
        if signature in (self._signatures.get(name), self._refused.get((name, version))):
            return
        try:
            manifest = await self.loader.manifest(name, version)
        except Exception as e:  # noqa: BLE001 - a broken replacement is refused; the loaded copy serves on
            self._refuse(name, version, signature, e)
            return
        if manifest.files.get(MODEL_FILE) == current.manifest.files.get(MODEL_FILE):
            self._signatures[name] = signature  # the same model, its files touched or copied again
            return
        log.info("%s version %d was replaced on disk by another model.pt; loading it", name, version)
        await self._load_and_swap(name, version, signature)

    async def _load_and_swap(self, name: str, version: int, signature: Tuple) -> bool:
        """Load, verify and warm up a version, then make it the one taking the model's requests."""
        started = time.monotonic()
        try:
            manifest, runners = await self.loader.load(name, version)
        except Exception as e:  # noqa: BLE001 - a broken version must never stop the server
            self._refuse(name, version, signature, e)
            return False
        if self._closed:
            return False
        mv = ModelVersion(name, version, manifest, runners, self.config, self.metrics, self.on_fatal, self.wake)
        graphs = runners[0].forward.disabled_reason
        log.info("loaded %s version %d on %s in %.2fs (golden outputs match; CUDA graphs %s)", name, version,
                 mv.devices, time.monotonic() - started, f"off: {graphs}" if graphs else "on")
        self._swap(mv, signature)
        return True

    def _refuse(self, name: str, version: int, signature: Tuple, error: Exception) -> None:
        self._refused[(name, version)] = signature
        if isinstance(error, ServedElsewhere):
            log.info("%s version %d: %s", name, version, error)
            return
        self.metrics.load_failures.labels(model=name, reason=type(error).__name__).inc()
        log.error("refused %s version %d (%s): %s", name, version, self.loader.path(name, version),
                  error if isinstance(error, UserError) else repr(error))

    def _swap(self, mv: ModelVersion, signature: Tuple) -> None:
        old = self.models.get(mv.name)
        self.models[mv.name] = mv
        self._signatures[mv.name] = signature
        if old is not None:
            self._retire(old)  # first: a version republished under its number shares its gauge labels
        self.metrics.version_state(mv.name, mv.version, new=mv.state)

    def _mark_removed_from_disk(self, name: str, listing: VersionListing) -> None:
        mv = self.models.get(name)
        if mv is None:
            return
        state = READY if mv.version in listing.versions else READY_REMOVED_FROM_DISK
        if state == mv.state:
            return
        self.metrics.version_state(mv.name, mv.version, mv.state, state)
        mv.state = state
        if state == READY_REMOVED_FROM_DISK:
            log.warning("%s version %d: its directory %s is gone and no other version of %s loads; it keeps "
                        "serving from memory (%s)", name, mv.version, self.loader.path(name, mv.version), name, state)
        else:
            log.info("%s version %d is on disk again", name, mv.version)

    def _retire(self, old: ModelVersion) -> None:
        self.metrics.version_state(old.name, old.version, old.state)
        old.state = DRAINING
        self._draining.append(old)
        log.info("%s version %d replaced; releasing it after %d in-flight request(s)", old.name, old.version,
                 old.in_flight)
        if old.in_flight == 0:
            old.drained.set()
        asyncio.get_running_loop().create_task(self._release_when_drained(old))

    async def _release_when_drained(self, old: ModelVersion) -> None:
        await old.drained.wait()
        await old.close()
        self._draining.remove(old)
        log.info("released %s version %d", old.name, old.version)

    def _all_loaded(self) -> List[ModelVersion]:
        """Serving and draining versions."""
        return list(self.models.values()) + list(self._draining)

    def fail_queued(self, error: Exception) -> None:
        for mv in self._all_loaded():
            for router in mv.routers.values():
                router.fail_queued(error)

    def in_flight(self) -> int:
        return sum(mv.in_flight for mv in self._all_loaded())

    def batchers(self) -> List[Batcher]:
        """Every batcher of every loaded version (serving and draining)."""
        return [b for mv in self._all_loaded() for b in mv.batchers]

    def knows(self, name: str) -> bool:
        return name in self.models

    def versions(self, name: str) -> List[ModelVersion]:
        out = [self.models[name]] if name in self.models else []
        return out + [d for d in self._draining if d.name == name]

    async def close(self) -> None:
        """Release every version. Loads under way are abandoned, not awaited (one may never return)."""
        self._closed = True
        for task in list(self._busy.values()):
            task.cancel()
        await asyncio.gather(*(mv.close(release=False) for mv in self._all_loaded()))
        self.models.clear()


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible; use --device cpu or auto")
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device must be auto, cuda or cpu, got {device!r}")
    return device

