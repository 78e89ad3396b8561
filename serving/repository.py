"""Model lifecycle: Source (the repository on disk) -> Loader (serving/loader.py) -> Manager.

- A version is served only after its manifest and checksums verify, ``model.pt`` loads on its
  device and reproduces ``golden.pt``. Until the first version of any model is ready the server is
  not SERVING.
- The repository is polled; a newer version is loaded and verified while the current one keeps
  serving, then swapped in. The old one stops taking requests and is released when its in-flight
  requests have finished (availability-preserving, as TF Serving's policy).
- A version that fails is refused: logged, counted, and retried only if its directory changes.
- Requests hold a :class:`ModelVersion` handle (``use``) for their whole life, never a global.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator, Callable, Dict, List, Optional, Tuple

import torch

from recserve.errors import UserError
from recserve.manifest import ArtifactError, Manifest, list_models, list_versions
from serving.batcher import Batcher, Router
from serving.config import ServerConfig
from serving.errors import ModelNotFound, Overloaded
from serving.loader import Loader, check_device  # noqa: F401 - check_device: tests/test_scaleout.py imports it here
from serving.metrics import Metrics
from serving.runner import ModelRunner

log = logging.getLogger("serving.repository")


class ModelVersion:
    """One loaded, verified version: its replicas (one runner per device, usually one) and, per RPC,
    a router over one batcher per replica."""

    def __init__(self, name: str, version: int, manifest: Manifest, runners: List[ModelRunner],
                 config: ServerConfig, metrics: Metrics, on_fatal: Callable[[], None]) -> None:
        self.name, self.version, self.manifest, self.runners = name, version, manifest, runners
        self.schema = runners[0].schema
        self.state = "READY"
        self.in_flight = 0
        self.drained = asyncio.Event()
        # One thread per replica: a replica's model calls run one at a time, in submission order.
        self.executors = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-v{version}-{r.device}")
                          for r in runners]

        def observer(rpc: str):
            return lambda size, seconds: metrics.batch_size.labels(rpc=rpc, model=name).observe(size)

        def batchers(rpc: str, run: str) -> Router:
            return Router([Batcher(f"{name} v{version} {rpc} on {r.device}", config.batch, getattr(r, run), ex,
                                   observer(rpc), r.is_fatal, on_fatal) for r, ex in zip(runners, self.executors)])

        self.predict = batchers("Predict", "predict_batch")
        self.lookup = batchers("Lookup", "lookup_batch")
        metrics.queue_depth.labels(rpc="Predict", model=name).set_function(lambda: self.predict.depth)
        metrics.queue_depth.labels(rpc="Lookup", model=name).set_function(lambda: self.lookup.depth)

    @property
    def devices(self) -> str:
        return ",".join(r.device for r in self.runners) if self.runners else ""

    def start(self) -> None:
        self.predict.start()
        self.lookup.start()

    async def close(self) -> None:
        await self.predict.close()
        await self.lookup.close()
        for ex in self.executors:
            ex.shutdown(wait=True)
        self.runners = []
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _dir_signature(path: Path) -> Tuple:
    try:
        return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir()))
    except OSError:
        return ()


class ModelRepository:
    def __init__(self, config: ServerConfig, metrics: Metrics, on_fatal: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.models: Dict[str, ModelVersion] = {}  # name -> the version that takes new requests
        self._draining: List[ModelVersion] = []
        self._refused: Dict[Tuple[str, int], Tuple] = {}  # (name, version) -> directory signature
        self.ready = False
        self.device = resolve_device(config.device)
        self.loader = Loader(config, self.device)

    # -- Source ----------------------------------------------------------------------------------
    def _candidates(self, name: str) -> List[int]:
        """Versions newer than the one serving, newest first, skipping refused unchanged ones."""
        current = self.models[name].version if name in self.models else 0
        out = []
        for v in reversed(list_versions(self.config.repo / name)):
            if v <= current:
                break
            sig = self._refused.get((name, v))
            if sig is not None and sig == _dir_signature(self.config.repo / name / str(v)):
                continue
            out.append(v)
        return out

    async def _try_load(self, name: str, version: int) -> Optional[ModelVersion]:
        path = self.config.repo / name / str(version)
        started = time.monotonic()
        try:
            manifest, runners = await self.loader.load(name, version)
        except Exception as e:  # noqa: BLE001 - a broken version must never stop the server
            reason = type(e).__name__
            self.metrics.load_failures.labels(model=name, reason=reason).inc()
            self._refused[(name, version)] = _dir_signature(path)
            log.error("refused %s version %d: %s", name, version, e if isinstance(e, ArtifactError) else repr(e))
            return None
        mv = ModelVersion(name, version, manifest, runners, self.config, self.metrics, self.on_fatal)
        mv.start()
        graphs = runners[0].forward.disabled_reason
        log.info("loaded %s version %d on %s in %.2fs (golden outputs match; CUDA graphs %s)", name, version,
                 mv.devices, time.monotonic() - started, f"off: {graphs}" if graphs else "on")
        return mv

    # -- Manager ---------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Load what is new: for each model, the newest version that verifies and is newer than the
        one serving; swap it in and let the old one drain."""
        for name in list_models(self.config.repo):
            for version in self._candidates(name):
                mv = await self._try_load(name, version)
                if mv is None:
                    continue
                old = self.models.get(name)
                self.models[name] = mv
                self.metrics.loaded.labels(model=name, version=str(version), state="READY").set(1)
                if old is not None:
                    await self._retire(old)
                break
        self.ready = self.ready or bool(self.models)

    async def _retire(self, old: ModelVersion) -> None:
        old.state = "DRAINING"
        self.metrics.loaded.remove(old.name, str(old.version), "READY")
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

    async def poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - keep polling whatever the disk does
                log.exception("repository poll failed")

    @contextlib.asynccontextmanager
    async def use(self, name: str, version: int) -> AsyncIterator[ModelVersion]:
        """The version a request runs on, held until the request is done."""
        if not self.ready:
            raise Overloaded("server is loading models; retry")
        mv = self.models.get(name)
        if mv is None:
            raise ModelNotFound(f"model {name!r} is not loaded; loaded: {sorted(self.models)}")
        if version and version != mv.version:
            raise ModelNotFound(f"model {name!r} version {version} is not loaded; serving version {mv.version}")
        mv.in_flight += 1
        try:
            yield mv
        finally:
            mv.in_flight -= 1
            if mv.state == "DRAINING" and mv.in_flight == 0:
                mv.drained.set()

    def _all_loaded(self) -> List[ModelVersion]:
        """Serving and draining versions."""
        return list(self.models.values()) + list(self._draining)

    def fail_queued(self, error: Exception) -> None:
        for mv in self._all_loaded():
            mv.predict.fail_queued(error)
            mv.lookup.fail_queued(error)

    def in_flight(self) -> int:
        return sum(mv.in_flight for mv in self._all_loaded())

    def knows(self, name: str) -> bool:
        return name in self.models

    def versions(self, name: str) -> List[ModelVersion]:
        out = [self.models[name]] if name in self.models else []
        return out + [d for d in self._draining if d.name == name]

    async def close(self) -> None:
        for mv in self._all_loaded():
            await mv.close()
        self.models.clear()


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible; use --device cpu or auto")
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device must be auto, cuda or cpu, got {device!r}")
    return device
