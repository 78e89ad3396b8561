"""Model lifecycle: Source (the repository on disk) -> Loader (serving/engine/loader.py) -> Manager.

- Source: every poll lists each model's directory on its own and reads its optional
  ``config.json`` (serving/model_config.py). A model directory that cannot be read, a
  directory in it not named by a version number (1 .. 2**63-1, ASCII digits), or an invalid
  config.json is refused for that model only: logged once with its path and counted
  (``recserve_model_load_failures_total{model,reason,engine}``); the model keeps what it serves (with an
  invalid config.json, its last good configuration, under which its versions follow the disk).
- Manager, per model and independently of the others (TF Serving's availability-preserving
  policy): serve the versions its version policy and labels ask for (default: the highest version
  on disk that loads and verifies). A new one is loaded, verified and warmed while the current ones
  keep serving, then takes requests; a version no longer asked for stops taking requests (DRAINING)
  and is released when its in-flight requests have finished. So deleting the served version rolls
  back to the highest one left; a version number republished with another ``model.pt`` (its sha256
  in the manifest) is loaded again and swapped in, and so is a version whose config.json asks for
  another build (``max_batch_size``, warm-up).
- A model with no version left on disk keeps serving what it has from memory, in state
  ``READY_REMOVED_FROM_DISK``, until a version appears again.
- A version that fails is refused: logged, counted, and retried only if its directory or its
  configuration changes (or, under ``serve --model-control explicit``, when it is asked for again).
  One whose load left the device unusable (loader.DeviceFailed) also takes the engine down
  (``on_fatal``), as a batch that does.
- ``serve --model-control explicit``: only the models asked for (``--load-model``, then
  ``load_model``/``unload_model``) are served, and the repository is read when one is asked for,
  not polled.
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
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch

from recserve.errors import UserError
from recserve.manifest import (MAX_VERSION, MODEL_FILE, MODEL_NAME_RULE, Manifest, VersionListing, scan_models,
                               scan_versions)
from serving.engine.batcher import Batcher, Router, Work
from serving.config import BatchSettings, ServerConfig
from serving.model_config import (CONFIG_FILE, ModelConfig, ModelConfigError, VersionPolicy, read_model_config,
                                   wanted_versions)
from serving.engine.loader import DeviceFailed, Loader, ServedElsewhere
from serving.metrics import Metrics
from serving.statistics import VersionStatistics
from serving.engine.runner import ModelRunner
from serving.errors import Overloaded

log = logging.getLogger("serving.engine.repository")

READY, DRAINING = "READY", "DRAINING"
# A retired copy still takes what front ends laid out for it before they heard of the swap (the
# engine publishes each swap at once: milliseconds; a swap that changes the inputs' layout, e.g. a
# new max_batch_size, would otherwise answer those requests UNAVAILABLE).
RETIRE_GRACE_S = 0.5
# Serving from memory: its directory is gone and no other version of the model on disk loads.
READY_REMOVED_FROM_DISK = "READY_REMOVED_FROM_DISK"


class ModelVersion:
    """One loaded, verified version: its replicas (one runner per device, usually one) and, per RPC,
    a router over one batcher per replica. ``submit(rpc, work)`` queues one request (its answer
    comes through ``work.answer``); requests are counted in ``in_flight`` from ``acquire`` until
    ``release`` (their answer), and a draining version is closed only when that count is 0."""

    def __init__(self, name: str, version: int, manifest: Manifest, runners: List[ModelRunner],
                 config: ModelConfig, metrics: Metrics, on_fatal: Callable[[], None],
                 wake: Callable[[], None] = lambda: None) -> None:
        self.name, self.version, self.manifest, self.runners = name, version, manifest, runners
        self.load_key = config.load_key()  # what it was loaded for (serving/model_config.py)
        self.schema = runners[0].schema
        self.pool_shared_once = runners[0].pool_shared_once
        self.state = "READY"
        self.in_flight = 0
        self.drained = asyncio.Event()  # retired, its grace over and no request holds it: it is released
        self.layout_id: Optional[int] = None  # the engine's model_id for its request layout, once published
        self._grace_over = False
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
        router = self.routers.get(rpc)
        if router is None:  # closed (its routers dropped)
            raise Overloaded(f"{self.name} version {self.version} is unloading; retry")
        router.submit(work)

    def configure(self, batch: BatchSettings) -> None:
        """New batching delay and queue limit (its model's config.json changed): from the next batch."""
        for b in self.batchers:
            b.settings = batch

    def acquire(self) -> None:
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        if self.state == DRAINING and self.in_flight == 0 and self._grace_over:
            self.drained.set()

    def retire(self, grace_s: float) -> None:
        """Stop taking new requests; requests laid out for this copy before the front ends heard of the
        swap (within ``grace_s``) still run on it, then it drains."""
        self.state = DRAINING

        def grace_over() -> None:
            self._grace_over = True
            if self.in_flight == 0:
                self.drained.set()

        asyncio.get_running_loop().call_later(grace_s, grace_over)

    @property
    def devices(self) -> str:
        return ",".join(r.device for r in self.runners) if self.runners else ""

    async def close(self, release: bool = True) -> None:
        """Stop taking requests; once what is queued and running has been answered, stop.
        ``release``: give the memory back now (a swap). At shutdown the process exit does it: a full
        collection per version took 4 s for 101 models, and freeing each module (GIL held) 3 s."""
        for b in self.batchers:
            b.closed = True
        while any(b.busy for b in self.batchers):
            await asyncio.sleep(0.005)  # the engine's loop answers them
        for ex in self.executors:
            if ex is not None:
                ex.shutdown(wait=True)
        if not release:
            return
        # The batchers hold the runners (and, through their observers, this version: a cycle): dropped
        # here, the module, its tables and its graph pools go with the last reference, not at some
        # later full collection.
        self.runners, self.routers, self.batchers = [], {}, []
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _launch(runner: ModelRunner, rpc: str, works: List[Work]):
    return runner.launch(rpc, [w.inputs for w in works])


def _scan_model(model_dir: Path, repo: Path, allow_symlinks: bool) \
        -> Tuple[VersionListing, List[Tuple[int, Path, Path]], Path]:
    """On a disk thread: a model's version listing (none if its directory is gone), the version
    directories that are (or sit under) symlinks leading out of the repository (version, path, where
    it leads; none with ``allow_symlinks``), and the repository's resolved path."""
    try:
        listing = scan_versions(model_dir)
    except FileNotFoundError:
        return VersionListing([], []), [], repo
    if allow_symlinks:
        return listing, [], repo
    root, outside = repo.resolve(), []
    for v in listing.versions:
        path = model_dir / str(v)
        target = path.resolve()
        if not target.is_relative_to(root):
            outside.append((v, path, target))
    return listing, outside, root


def _read_config(model_dir: Path, server: ServerConfig, known: bool) -> Optional[ModelConfig]:
    """On a disk thread: the model's configuration; None if the directory of a model already
    configured is gone (it then serves as it was configured)."""
    if known and not model_dir.is_dir():
        return None
    return read_model_config(model_dir, server)


def _dir_signature(path: Path) -> Optional[Tuple]:
    """What changes when a directory's content is replaced: its files' names, sizes and times; None
    if the directory is gone (deleted since it was listed)."""
    try:
        return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir()))
    except FileNotFoundError:
        return None if not path.is_dir() else ()
    except OSError:
        return ()


class ModelRepository:
    def __init__(self, config: ServerConfig, metrics: Metrics, on_fatal: Callable[[], None] = lambda: None,
                 wake: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.wake = wake  # a CPU batch ended (called from its thread)
        self.served: Dict[str, Dict[int, ModelVersion]] = {}  # name -> version -> the versions taking requests
        self.configs: Dict[str, ModelConfig] = {}  # name -> the configuration its served versions follow
        # serve --model-control explicit: the models asked for (load_model); None: every model on disk.
        self.wanted: Optional[Set[str]] = set(config.load_models) if config.model_control == "explicit" else None
        self.ready = False
        self.loaded = False  # the start-up load is done (every model loaded or failed)
        self.device = resolve_device(config.device)
        self.loader = Loader(config, self.device)
        self._draining: List[ModelVersion] = []
        self._signatures: Dict[Tuple[str, int], Tuple] = {}  # a served version -> its directory's signature at load
        # (name, version) -> (directory signature, config load key, why: "" if another engine serves it)
        self._refused: Dict[Tuple[str, int], Tuple[Optional[Tuple], Tuple, str]] = {}
        self._errors: Dict[str, str] = {}  # name -> why it last failed to load (the repository index's reason)
        self._config_errors: Dict[str, str] = {}  # name -> its config.json's error, logged once
        # name -> version -> why: versions its policy asks for that were refused at its last refresh (the index's)
        self._unavailable: Dict[str, Dict[int, str]] = {}
        self._none_asked: Dict[str, str] = {}  # name -> why its policy asks for no version on disk (nothing tried)
        self._elsewhere: Set[str] = set()  # models another engine serves (config.json replicas, a sharded model)
        self._reported: Dict[Tuple[str, str], str] = {}  # (name, path) -> what is wrong there, logged once
        self._busy: Dict[str, asyncio.Task] = {}  # name -> its refresh under way
        self._refresh_started = False
        self._refreshed_once = False
        self._stopping = False  # the server stops: nothing more loads
        self._closed_versions: List[ModelVersion] = []  # close(): kept for the process exit to free
        self._on_disk: Set[str] = set()  # model directories, as last read (index())
        self._listed = False  # whether the last read of the repository succeeded
        # Every read of the repository's directories (listings, config.json, version directories)
        # runs here, never on the engine's loop, which feeds the device: a slow or hung mount stalls a
        # model's refresh, not the requests. Threads of its own, so that reads stuck on a dead mount
        # cannot take the threads other work of the engine runs on.
        self._disk = ThreadPoolExecutor(max_workers=4, thread_name_prefix="repository-disk")
        self._reading: Dict[Tuple[Callable, Path], "asyncio.Future"] = {}  # (what, path) -> its read under way

    # -- Source ----------------------------------------------------------------------------------
    async def read_models(self, report: bool = False) -> Set[str]:
        """The model directories on disk, read in a thread (a slow or hung mount never stalls the
        engine's loop, which feeds the device) and kept for :meth:`index`; empty if unreadable.
        ``report``: log once what cannot be read and each directory not named as a model."""
        repo = self.config.repo
        try:
            listing = await self._read(scan_models, repo)
        except OSError as e:
            if report:
                self._report_once("", repo, type(e).__name__, str(e), count=False)
            on_disk, self._listed = set(), False
        else:
            self._forget_fixed("", {str(repo / entry) for entry in listing.not_models})
            if report:
                for entry in listing.not_models:
                    self._report_once("", repo / entry, "InvalidModelName", f"not a model: {MODEL_NAME_RULE}",
                                      count=False)
            on_disk, self._listed = set(listing.models), True
        self._on_disk = on_disk
        return on_disk

    async def _read(self, fn: Callable, path: Path, *args):
        """``fn(path, *args)`` on the repository's disk threads, waited for at most ``load_timeout_s``:
        then TimeoutError (an OSError), and the model's refresh ends as for an unreadable directory
        instead of holding up the start-up load and every later poll. A read of ``path`` still hung
        is waited on again, not started once more (each would take a disk thread for good)."""
        key = (fn, path)
        read = self._reading.get(key)
        if read is None:
            read = self._reading[key] = asyncio.get_running_loop().run_in_executor(self._disk, fn, path, *args)
            # Its outcome is taken even if every waiter gave up (asyncio would log it as never retrieved).
            read.add_done_callback(lambda done: (self._reading.pop(key, None), done.cancelled() or done.exception()))
        try:
            return await asyncio.wait_for(asyncio.shield(read), self.config.load_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no answer from the disk within {self.config.load_timeout_s:g}s "
                               "(a hung network mount?)") from None

    async def _model_names(self) -> List[str]:
        """Models on disk, and those serving whose directory is gone (they keep serving)."""
        return sorted(await self.read_models(report=True) | set(self.served))

    async def _list(self, name: str) -> Optional[VersionListing]:
        """The model's versions on disk; None if its directory cannot be read (then it keeps what it serves)."""
        model_dir = self.config.repo / name
        try:
            listing, outside, root = await self._read(_scan_model, model_dir, self.config.repo,
                                                      self.config.allow_symlinks)
        except OSError as e:
            self._report_once(name, model_dir, type(e).__name__, str(e))
            return None
        self._forget_fixed(name, {str(model_dir / entry) for entry in listing.not_versions}
                           | {str(p) for _, p, _ in outside})
        for entry in listing.not_versions:
            self._report_once(name, model_dir / entry, "InvalidVersionName",
                              f"not a version: versions are named by a number from 1 to {MAX_VERSION} in ASCII digits")
        for _, path, target in outside:
            self._report_once(name, path, "SymlinkOutsideRepository",
                              f"resolves to {target}, outside the repository {root}; "
                              "move it inside, or serve with --allow-symlinks")
        skipped = {v for v, _, _ in outside}
        return VersionListing([v for v in listing.versions if v not in skipped], listing.not_versions)

    def _forget_fixed(self, name: str, wrong: Set[str]) -> None:
        """Forget what was reported of ``name`` ("": the repository) at paths no longer wrong: fixed, it is
        reported again if it comes back."""
        for key in [k for k in self._reported if k[0] == name and k[1] not in wrong]:
            del self._reported[key]

    def _report_once(self, name: str, path: Path, reason: str, message: str, count: bool = True) -> None:
        if self._reported.get((name, str(path))) == f"{reason}: {message}":
            return
        self._reported[(name, str(path))] = f"{reason}: {message}"
        if count:
            self.metrics.load_failed(name, reason)
        log.error("%s: %s: %s; ignored%s", path, reason, message, f" ({name} keeps what it serves)" if name else "")

    # -- Manager ---------------------------------------------------------------------------------
    @property
    def models(self) -> Dict[str, ModelVersion]:
        """Each model's default version: the highest served (requests that name no version)."""
        return {name: served[max(served)] for name, served in self.served.items() if served}

    async def refresh(self) -> None:
        """Bring every model to the versions it should serve, each in a task of its own: a model's
        failing or hanging load never holds up another's. Waits for the tasks it starts (a load at
        most ``load_timeout_s``); a model still busy from an earlier call is left to that one."""
        names = await self._model_names()
        if self._listed:  # a repository that could not be read says nothing of which models are gone
            self._forget_gone(set(names))
        started = {name: task for name in names if (task := self._start(name)) is not None}
        first, self._refresh_started = not self._refresh_started, True
        if started:
            await asyncio.wait(started.values())
        if self._stopping:  # what did not load was abandoned, not refused: no summary of the refresh
            abandoned = [name for name, task in started.items() if task.cancelled()]
            if abandoned:
                log.info("stopping: %d model%s not loaded (their loads are abandoned): %s", len(abandoned),
                         "s" if len(abandoned) > 1 else "", ", ".join(abandoned))
            return
        if first:  # the start-up load: every model has loaded or failed (a poll meanwhile skipped those busy)
            self._refreshed_once = True
            self._warn_unserved(names, [n for n in names if n not in self.served and n not in self._elsewhere
                                        and (self.wanted is None or n in self.wanted)])
        if self._refreshed_once:
            self.ready = self.ready or bool(self.served) or self.wanted is not None
            self.loaded = True

    def _warn_unserved(self, names: List[str], missing: List[str]) -> None:
        """After the start-up load: one line for the models that failed (their errors are above), and
        one for each model, or a repository, that holds nothing to load (no error says so)."""
        repo = self.config.repo
        if self.wanted is None and self._listed and not names:
            log.warning("starting with no model: %s holds no model directory: export one into it (recserve export "
                        "--repo %s --name NAME writes %s/NAME/1/); %s", repo, repo, repo, self._then("NAME"))
        failed = [n for n in missing if n not in self._none_asked or n in self._errors
                  or any(key[0] == n for key in self._reported)]
        if failed:
            log.warning("starting without %s: no version loads (see the errors above)", ", ".join(failed))
        for name in (n for n in missing if n not in failed):
            log.warning("starting without %s: %s; %s", name, self._none_asked[name], self._then(name))

    def _then(self, name: str) -> str:
        """What serves a version once it is on disk."""
        if self.wanted is not None:
            return f"then load it (recserve models load {name})"
        if self.config.poll_interval_s > 0:
            return "the next poll loads it"
        return "then restart the server (--poll-interval 0: the repository is read only at start)"

    def _forget_gone(self, names: Set[str]) -> None:
        """What was refused and reported of models whose directory is gone: tried, logged and counted
        again if one is published again (a redeploy of the same mistake is not met with silence)."""
        for key in [k for k in self._refused if k[0] not in names]:
            del self._refused[key]
        for key in [k for k in self._reported if k[0] and k[0] not in names]:
            del self._reported[key]
        for errors in (self._errors, self._config_errors, self._unavailable, self._none_asked):
            for name in [n for n in errors if n not in names]:
                del errors[name]

    def _start(self, name: str) -> Optional[asyncio.Task]:
        if name in self._busy or self._stopping:
            return None
        self._busy[name] = task = asyncio.get_running_loop().create_task(self._refresh_model(name))
        task.add_done_callback(lambda _, name=name: self._busy.pop(name, None))
        return task

    async def _refresh_one(self, name: str, ask: Callable[[], None] = lambda: None) -> None:
        """Refresh one model now, after the refresh of it under way (if any). ``ask`` (what a load or
        unload wants of the model) applies only then, so that requests for one model take effect in turn:
        applied while waiting, a later unload would undo an earlier load before its refresh ran."""
        while name in self._busy:
            await asyncio.wait([self._busy[name]])
        ask()
        task = self._start(name)
        if task is not None:
            await task

    async def _refresh_model(self, name: str) -> None:
        try:
            if self.wanted is not None and name not in self.wanted:
                self._unload(name, "unloaded")
                return
            config = await self._model_config(name)
            if config is None:
                return
            if not config.served_by(self.config.engine_index):
                self._elsewhere.add(name)
                self._unload(name, f"its config.json asks for {config.replicas} replica(s); engine "
                                   f"{self.config.engine_index} holds none")
                return
            self._elsewhere.discard(name)
            listing = await self._list(name)
            if listing is not None:
                await self._serve_policy(name, listing, config)
                self._mark_removed_from_disk(name, listing)
        except Exception:  # noqa: BLE001 - one model's surprise must never stop the others
            log.exception("refreshing model %s failed; it keeps what it serves", name)

    async def _model_config(self, name: str) -> Optional[ModelConfig]:
        """The model's config.json over the server's flags; if it is invalid (logged once), the last
        good one of a model serving (its versions still follow the disk), else None."""
        model_dir = self.config.repo / name
        try:
            config = await self._read(_read_config, model_dir, self.config, name in self.configs)
        except TimeoutError as e:  # a hung mount: as a config.json that cannot be read
            return self._invalid_config(name, ModelConfigError(f"{model_dir / CONFIG_FILE}: cannot be read ({e})"))
        except ModelConfigError as e:
            return self._invalid_config(name, e)
        # Valid again, or its directory is gone (reported again if it comes back with the same error).
        if (error := self._config_errors.pop(name, None)) is not None and self._errors.get(name) == error:
            del self._errors[name]  # not why the model does not load any more (the index's reason)
        if config is None:
            return self.configs.get(name)  # its directory is gone: it serves from memory as it was configured
        if error is not None:
            log.info("%s: %s is valid again", name, self.config.repo / name / CONFIG_FILE)
        return config

    def _invalid_config(self, name: str, e: ModelConfigError) -> Optional[ModelConfig]:
        """Logged and counted once while it says the same; the last good configuration of a model
        serving, else None."""
        self._errors[name] = str(e)
        if self._config_errors.get(name) != str(e):
            self._config_errors[name] = str(e)
            self.metrics.load_failed(name, "InvalidConfig")
            log.error("%s; %s", e, f"{name} keeps serving with its last good configuration"
                      if self.served.get(name) else f"{name} is not loaded until it is fixed")
        return self.configs.get(name) if self.served.get(name) else None

    async def _serve_policy(self, name: str, listing: VersionListing, config: ModelConfig) -> None:
        """Serve what the model's version policy and labels ask for, of what is on disk and loads;
        then drain the versions no longer asked for. Nothing loads (every version gone or broken):
        what serves keeps serving."""
        policy, on_disk = config.version_policy, listing.versions
        for key in [k for k in self._refused if k[0] == name and k[1] not in on_disk]:
            del self._refused[key]  # its directory is gone: tried again if it is published again
        want: List[int] = []
        tried: Set[int] = set()
        for version in sorted(set(config.version_labels.values()) & set(on_disk), reverse=True):
            tried.add(version)
            if await self._ensure(name, version, config):
                want.append(version)
        limit = policy.latest if policy.kind == "latest" else len(on_disk)
        count = 0
        for version in wanted_versions(policy, on_disk):
            if count == limit:
                break
            tried.add(version)
            if version in want or await self._ensure(name, version, config):
                want.append(version)
                count += 1
        if self._stopping:
            return
        self._note_none_asked(name, on_disk, policy, tried)
        self._unavailable[name] = {v: why for v in tried - set(want)
                                   if (why := self._refused.get((name, v), (None, None, ""))[2])}
        served = self.served.get(name, {})
        if want:
            for version in [v for v in served if v not in want]:
                self._retire(served.pop(version))
            self._states_changed()
        self._advertise(name, config)

    def _note_none_asked(self, name: str, on_disk: List[int], policy: VersionPolicy, tried: Set[int]) -> None:
        """Why nothing of ``name`` was tried, for :meth:`_warn_unserved`: no version on disk, or none its
        version policy asks for."""
        model_dir = self.config.repo / name
        if tried:
            self._none_asked.pop(name, None)
        elif not on_disk:
            self._none_asked[name] = (f"{model_dir} holds no version directory: export one into it (recserve export "
                                      f"--repo {self.config.repo} --name {name} writes {model_dir}/1/)")
        else:
            self._none_asked[name] = (f"its version_policy in {model_dir / CONFIG_FILE} asks for versions "
                                      f"{list(policy.specific)}, and {model_dir} holds versions {on_disk}: export "
                                      "one of those, or change the policy")

    async def _ensure(self, name: str, version: int, config: ModelConfig) -> bool:
        """Is ``version`` served after this (loaded now if it was not, or loaded again if its
        directory now holds another model.pt or its configuration asks for another build)?"""
        try:
            signature = await self._read(_dir_signature, self.loader.path(name, version))
        except TimeoutError as e:  # a hung mount: refused once while it stays so; what serves serves on
            if not self._is_refused(name, version, None, config):
                self._refuse(name, version, None, config, e)
            return version in self.served.get(name, {})
        if signature is None:  # deleted since the listing: the next poll's listing rolls back, not a failure
            return version in self.served.get(name, {})
        current = self.served.get(name, {}).get(version)
        if current is not None:
            if current.load_key == config.load_key():
                current.configure(config.batch)
                await self._reload_if_replaced(current, signature, config)
            elif not self._is_refused(name, version, signature, config):
                log.info("%s version %d: its configuration changed; loading it again", name, version)
                await self._load_and_install(name, version, signature, config)  # failed: the loaded one serves on
            return True
        if self._is_refused(name, version, signature, config):
            return False
        return await self._load_and_install(name, version, signature, config)

    async def _reload_if_replaced(self, current: ModelVersion, signature: Tuple, config: ModelConfig) -> None:
        """The serving version's directory changed: load it again if it now holds another model."""
        name, version = current.name, current.version
        if signature == self._signatures.get((name, version)) or self._is_refused(name, version, signature, config):
            return
        try:
            manifest = await self.loader.manifest(name, version)
        except Exception as e:  # noqa: BLE001 - a broken replacement is refused; the loaded copy serves on
            self._refuse(name, version, signature, config, e)
            return
        if manifest.files.get(MODEL_FILE) == current.manifest.files.get(MODEL_FILE):
            self._signatures[(name, version)] = signature  # the same model, its files touched or copied again
            return
        log.info("%s version %d was replaced on disk by another model.pt; loading it", name, version)
        await self._load_and_install(name, version, signature, config)

    async def _load_and_install(self, name: str, version: int, signature: Tuple, config: ModelConfig) -> bool:
        """Load, verify and warm up a version, then let it take requests (replacing a loaded version
        of the same number, which drains)."""
        started = time.monotonic()
        try:
            manifest, runners = await self.loader.load(name, version, config)
        except Exception as e:  # noqa: BLE001 - a broken version must never stop the server
            self._refuse(name, version, signature, config, e)
            if isinstance(e, DeviceFailed):  # ... but a poisoned device does, as a batch's would
                self.on_fatal()
            return False
        if self._stopping:
            return False
        mv = ModelVersion(name, version, manifest, runners, config, self.metrics, self.on_fatal, self.wake)
        graphs = runners[0].forward.disabled_reason
        log.info("loaded %s version %d on %s in %.2fs (golden outputs match; CUDA graphs %s%s)", name, version,
                 mv.devices, time.monotonic() - started, f"off: {graphs}" if graphs else "on",
                 f"; warmed up at batch sizes {list(config.warmup_batch_sizes)}" if config.warmup_batch_sizes else "")
        served = self.served.setdefault(name, {})
        old = served.get(version)
        if old is not None:  # the same version built again: its statistics go on (both copies answer for it)
            mv.statistics = old.statistics
        served[version] = mv
        self._advertise(name, config)
        self._signatures[(name, version)] = signature
        self._errors.pop(name, None)
        self._elsewhere.discard(name)
        if old is not None:
            self._retire(old)  # a version republished under its number, or loaded for a new configuration
        self._states_changed()
        return True

    def _refuse(self, name: str, version: int, signature: Optional[Tuple], config: ModelConfig,
                error: Exception) -> None:
        if isinstance(error, ServedElsewhere):
            self._refused[(name, version)] = (signature, config.load_key(), "")
            self._elsewhere.add(name)
            log.info("%s version %d: %s", name, version, error)
            return
        why = str(error) if isinstance(error, UserError) else repr(error)
        self._refused[(name, version)] = (signature, config.load_key(), why)
        self._errors[name] = f"version {version}: {why}"
        self.metrics.load_failed(name, type(error).__name__)
        log.error("refused %s version %d (%s): %s", name, version, self.loader.path(name, version), why)

    def _is_refused(self, name: str, version: int, signature: Optional[Tuple], config: ModelConfig) -> bool:
        """Was this version refused as its directory and configuration are now (not to be tried again)?"""
        return self._refused.get((name, version), (None, None, ""))[:2] == (signature, config.load_key())

    def _mark_removed_from_disk(self, name: str, listing: VersionListing) -> None:
        changed = False
        for mv in self.served.get(name, {}).values():
            state = READY if mv.version in listing.versions else READY_REMOVED_FROM_DISK
            if state == mv.state:
                continue
            mv.state, changed = state, True
            if state == READY_REMOVED_FROM_DISK:
                log.warning("%s version %d: its directory %s is gone and no other version of %s loads; it keeps "
                            "serving from memory (%s)", name, mv.version, self.loader.path(name, mv.version), name,
                            state)
            else:
                log.info("%s version %d is on disk again", name, mv.version)
        if changed:
            self._states_changed()

    def _unload(self, name: str, why: str) -> None:
        served = self.served.pop(name, {})
        self.configs.pop(name, None)
        self._unavailable.pop(name, None)
        for mv in served.values():
            self._retire(mv)
        if served:
            log.info("%s: %s", name, why)
            self._states_changed()

    def _advertise(self, name: str, config: ModelConfig) -> None:
        """``config`` becomes the model's state (GetModelInfo, OIP config) once every version served
        was built for it; while a build it asks for fails, the last good one stays advertised."""
        served = self.served.get(name, {})
        if served and all(mv.load_key == config.load_key() for mv in served.values()):
            self.configs[name] = config

    def _retire(self, old: ModelVersion) -> None:
        old.retire(RETIRE_GRACE_S)
        if self.version(old.name, old.version) is None:  # not replaced by a copy of its own number
            self._signatures.pop((old.name, old.version), None)
        self._draining.append(old)
        log.info("%s version %d stops taking requests; releasing it after %d in-flight request(s)", old.name,
                 old.version, old.in_flight)
        asyncio.get_running_loop().create_task(self._release_when_drained(old))

    async def _release_when_drained(self, old: ModelVersion) -> None:
        await old.drained.wait()
        await old.close()
        self._draining.remove(old)
        self._states_changed()
        log.info("released %s version %d", old.name, old.version)

    def _states_changed(self) -> None:
        self.metrics.version_states([(mv.name, mv.version, mv.state) for mv in self._all_loaded()])

    # -- model control (serve --model-control explicit) -----------------------------------------
    async def load_model(self, name: str) -> None:
        """Load (or load again: new versions, a changed config.json) a model; raises UserError with
        why it does not serve, or why a version or config.json it was asked to take was refused."""
        if self.wanted is None:
            raise UserError("model control is off: the server polls its repository (serve --model-control explicit)")
        if name not in await self.read_models():
            raise UserError(f"no model {name!r} in the repository")

        def ask() -> None:
            self.wanted.add(name)
            for key in [k for k in self._refused if k[0] == name]:
                del self._refused[key]  # asked for explicitly: try again what failed before

        await self._refresh_one(name, ask)
        if name in self._elsewhere:
            return
        if name not in self.served:
            raise UserError(f"model {name!r} does not load: {self._errors.get(name, 'no version on disk')}")
        # It serves, but not all it was asked to (a new version or config.json refused): the operator who
        # asked after publishing must learn it, as from Triton; what served serves on.
        failed = ([self._config_errors[name]] if name in self._config_errors else []) + \
            [f"version {v}: {why}" for (n, v), (_, _, why) in sorted(self._refused.items()) if n == name and why]
        if failed:
            versions = sorted(self.served[name], reverse=True)
            raise UserError(f"model {name!r} does not load: {'; '.join(failed)}; it serves "
                            f"version{'s' if len(versions) > 1 else ''} {', '.join(map(str, versions))}")

    async def unload_model(self, name: str) -> None:
        if self.wanted is None:
            raise UserError("model control is off: the server polls its repository (serve --model-control explicit)")
        if name not in {entry[0] for entry in self.index()}:  # as last read: no disk read (a hung mount)
            raise UserError(f"no model {name!r} in the repository")

        def ask() -> None:
            self.wanted.discard(name)
            self._errors.pop(name, None)  # the index says "not loaded", not why a load no longer asked for failed

        await self._refresh_one(name, ask)

    def index(self) -> List[Tuple[str, str, str, str]]:
        """(name, version, state, reason) of every model in the repository, every loaded version and,
        beside those, every version its policy asks for that was refused (UNAVAILABLE, why): what the
        OIP repository index answers; the models on disk as :meth:`read_models` last read them."""
        out = []
        for name in sorted(self._on_disk | set(self.served) | {mv.name for mv in self._draining}):
            versions = self.versions(name)
            for mv in versions:
                out.append((name, str(mv.version), "UNLOADING" if mv.state == DRAINING else "READY", ""))
            if versions:
                out += [(name, str(v), "UNAVAILABLE", why) for v, why in
                        sorted(self._unavailable.get(name, {}).items(), reverse=True) if self.version(name, v) is None]
            if not versions:
                state = "LOADING" if name in self._busy else "UNAVAILABLE"
                reason = "" if state == "LOADING" else self._errors.get(name, "not loaded" if self.wanted is not None
                                                                         else "no version loads")
                out.append((name, "", state, reason))
        return out

    def _all_loaded(self) -> List[ModelVersion]:
        """Serving and draining versions."""
        return [mv for served in self.served.values() for mv in served.values()] + list(self._draining)

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
        return bool(self.served.get(name))

    def version(self, name: str, version: int) -> Optional[ModelVersion]:
        """A version of ``name`` that takes requests."""
        return self.served.get(name, {}).get(version)

    def versions(self, name: str) -> List[ModelVersion]:
        """The model's loaded versions: those taking requests, newest first, then those draining."""
        served = self.served.get(name, {})
        return [served[v] for v in sorted(served, reverse=True)] + [d for d in self._draining if d.name == name]

    def stop_loading(self) -> None:
        """The server stops: no load starts any more, and those under way are abandoned, not awaited
        (one may never return; each gives up at its next step, serving/engine/loader.py)."""
        self._stopping = True
        self.loader.stop()
        for task in list(self._busy.values()):
            task.cancel()

    async def close(self) -> None:
        """Stop loading, then close every version, kept in memory until the process exits (ModelVersion.close)."""
        self.stop_loading()
        self._closed_versions = self._all_loaded()
        await asyncio.gather(*(mv.close(release=False) for mv in self._closed_versions))
        self.served.clear()
        self._disk.shutdown(wait=False)  # a read stuck on a dead mount must not hold up the exit


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible; use --device cpu or auto")
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device must be auto, cuda or cpu, got {device!r}")
    return device

