"""The engine: one process that owns the devices and the loaded model versions.

Front ends (serving/frontend/) connect over a Unix socket and hand over their shared buffer, their
rings and their eventfds (serving/ipc.py). One loop (:meth:`Engine._pump`) does the request path,
in one direction, without a task, a future or a pickle per request:

    take submissions from every front end's ring -> admit each (its version, its batcher) ->
    batchers launch due batches and answer finished ones (serving/engine/batcher.py) ->
    completion records into the front ends' rings, one eventfd signal per front end and round.

While work is on the device the loop polls (the rings and the device's events) and yields to the
event loop between rounds (model loads, state publication); when nothing can launch because a
batcher has its pipeline full on the device, it blocks in the oldest batch's wait instead (the CUDA
runtime's blocking wait: no CPU; what arrives meanwhile could not start before that batch ends);
with nothing in flight (on CUDA: for IDLE_POLL_S after its last work, polling on meanwhile) it sleeps
until a front end signals, a CPU batch ends, or a batching delay expires: an idle engine uses no CPU.

Every submission is answered exactly once (serving/ipc.py). The engine tells the front ends which
models it serves whenever that changes (:class:`ipc.Models`) and, if its device fails, that it is
going down (:class:`ipc.Fatal`).
"""
from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import math
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import torch

from recserve.errors import UserError
from recserve.manifest import MODEL_FILE
from recserve.v1 import inference_pb2 as pb
from serving import ipc
from serving.config import ServerConfig, default_frontends
from serving.machine import usable_cores
from serving.engine.assemble import Item
from serving.engine.batcher import Work, saturated, stats
from serving.model_config import ModelConfig, describe
from serving.engine.repository import DRAINING, ModelRepository, ModelVersion
from serving.engine.runner import device_unusable, load_fbgemm
from serving.errors import ANSWER_ERRORS, DeviceLost, ExecutionFailed, ModelNotFound, Overloaded, ServingError
from serving.metrics import Metrics
from serving.statistics import VersionStatistics

log = logging.getLogger("serving.engine")
EXIT_DEVICE_LOST = 3  # the process must be restarted (its CUDA context is unusable)
STATE_INTERVAL_S = 0.2  # how often model state and gauges are compared and published
CACHE_INTERVAL_S = 2.0  # how often UVM cache counts are read (each read waits for the device's queued work)
# After its last work the loop keeps polling the rings this long before it sleeps: a client that sends
# its next request as soon as it has the answer (one client, closed loop) finds the engine awake
# instead of paying the eventfd wake-up (epoll, a callback, the task resumed). An idle server still
# sleeps: this is spent once after each burst, not while idle.
IDLE_POLL_S = 0.002
RPCS = {ipc.PREDICT: "Predict", ipc.LOOKUP: "Lookup"}
NO_TIMES = (math.nan, math.nan, math.nan)


@dataclass(eq=False)
class FrontEndLink:
    """One connected front end: its shared buffer, its rings, its requests admitted and not answered."""

    index: int
    arena: ipc.Arena
    channel: ipc.Channel
    memory: torch.Tensor  # uint8 view of the arena (page-locked on CUDA)
    pinned: bool
    writer: asyncio.StreamWriter
    works: Dict[int, Work] = field(default_factory=dict)  # rid -> its work
    answered: bool = False  # completions written since the last signal
    closed: bool = False


class Engine:
    def __init__(self, config: ServerConfig, socket_path: str) -> None:
        load_fbgemm()  # what every model needs: missing, the server does not start
        self.config = config
        self.socket_path = socket_path
        self.metrics = Metrics(config.engine_index)
        self.repo = ModelRepository(config, self.metrics, on_fatal=self.device_lost, wake=self._wake_threadsafe)
        self.links: List[FrontEndLink] = []
        self.exit_code = 0
        # A model_id names a model AND the layout its requests are written in (schema, shared pooling):
        # a version reloaded under its number with other inputs gets another id, so a request written
        # for the old copy is never run on the new one.
        self._model_ids: Dict[Tuple[str, Tuple], int] = {}  # (name, layout) -> model_id
        self._names: Dict[int, str] = {}  # model_id -> name; each version published holds its layout's id
        self._published: Optional[Tuple] = None
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._listener: Optional[socket.socket] = None
        self._tasks: Set[asyncio.Task] = set()
        self._cache_counted: Dict[Tuple[int, str], Tuple[int, int]] = {}  # UVM cache (hits, misses) exported
        # Front ends' buffers are page-locked and unlocked on a thread of their own (page_lock).
        self._pinning = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-pinning")
        self._cache_read_at = 0.0
        self._depth_models: Set[str] = set()  # models whose queue depth was exported (one unloaded goes back to 0)

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Listen for front ends (at once: they answer health while models load), then load."""
        self._loop = asyncio.get_running_loop()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.socket_path)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._spawn(self._accept())
        self._spawn(self._publish_loop())
        self._pump_task = self._spawn(self._pump())

    async def load(self) -> None:
        await self.repo.refresh()
        if self._stop.is_set():  # cut short (ModelRepository.refresh says so): nothing to tell
            return
        self.publish()
        loaded = {n: mv.version for n, mv in self.repo.models.items()}
        log.info("engine on %s: models %s", self.repo.device, loaded)

    async def run_until_stopped(self) -> None:
        if self.config.poll_interval_s > 0 and self.config.model_control == "poll":
            self._spawn(self._poll())
        await self._stop.wait()
        await self.shutdown()

    def request_stop(self) -> None:
        """SIGTERM: loads stop now, not once the requests in flight have drained (their threads would take
        the GIL from the loop that answers those requests and stops the engine)."""
        self.repo.stop_loading()
        self._stop.set()

    async def shutdown(self) -> None:
        """Front ends stop sending first (they drain); what is still in flight here finishes."""
        deadline = time.monotonic() + self.config.grace_period_s
        while any(link.works for link in self.links) and time.monotonic() < deadline and not self.exit_code:
            await asyncio.sleep(0.01)
        self.repo.fail_queued(Overloaded("server is shutting down; retry on another replica"))
        self._signal_answered()  # the pump may be asleep: the front ends must read these answers now
        pump = self._pump_task
        for task in list(self._tasks):
            if task is not pump:
                task.cancel()
        if self._listener:
            self._listener.close()
        idle = True
        try:  # the loop answers what is still on the device while the versions close
            await asyncio.wait_for(self.repo.close(), max(1.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            idle = False
            log.error("model versions still busy after the grace period; stopping without them")
        pump.cancel()
        for link in list(self.links):
            link.writer.close()
            if idle:  # else the device may still read a buffer: it stays locked and mapped until the process exits
                await self._release(link)
        self._pinning.shutdown(wait=False)
        log.info("engine stopped")

    def device_lost(self) -> None:
        """A model call left the device unusable: fail what waits, tell the front ends, exit 3."""
        if self.exit_code:
            return
        log.critical("device unusable: the server goes NOT_SERVING and exits with code %d for a restart",
                     EXIT_DEVICE_LOST)
        self.exit_code = EXIT_DEVICE_LOST
        self.repo.fail_queued(DeviceLost())
        self._signal_answered()
        for link in self.links:
            if not link.closed:
                ipc.send_nowait(link.writer, ipc.Fatal(DeviceLost.MESSAGE, EXIT_DEVICE_LOST))
        self._stop.set()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.critical("engine task %s failed; the server goes down", task.get_coro(), exc_info=task.exception())
            self.exit_code = self.exit_code or 1
            self._stop.set()

    async def _poll(self) -> None:
        """A refresh every interval, not after the last one ended: a refresh waits for the loads it
        started, and one that hangs (up to --load-timeout) would hold up every other model's next poll.
        A model still busy from an earlier refresh is left to it (ModelRepository.refresh)."""
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            self._spawn(self._poll_once())

    async def _poll_once(self) -> None:
        try:
            await self.repo.refresh()
        except Exception:  # noqa: BLE001 - keep polling whatever the disk does
            log.exception("repository poll failed")
        self.publish()

    # -- the request path ------------------------------------------------------------------------
    def _wake_threadsafe(self) -> None:
        """A CPU batch ended (called from its thread)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _pump(self) -> None:
        polled = self.metrics.poll_seconds
        idle_round: Optional[float] = None  # when the last round that found nothing to do began
        worked = 0.0  # when the last round that did something began
        # Not on the CPU, nor while a CPU model's batch runs on its thread on a CUDA server: the loop would
        # take the cores (and the GIL) from that batch.
        idle_poll = IDLE_POLL_S if self.repo.device == "cuda" else 0.0
        while True:
            began = now = time.monotonic()
            if idle_round is not None:
                polled.inc(now - idle_round)  # polling: the whole round and the yield after it
                idle_round = None
            progressed = False
            for link in self.links:
                if not link.closed:
                    for record in link.channel.submissions.take():
                        self._take(link, ipc.Submission.unpack(record))
                        progressed = True
            batchers = self.repo.batchers()
            now = time.monotonic()
            for b in batchers:
                progressed = b.pump(now) or progressed
            self._signal_answered()
            polling, due = stats(batchers, now)
            if progressed:
                worked = began
            if progressed or polling or (began - worked < idle_poll and not any(b.on_thread for b in batchers)):
                if not progressed:
                    full = saturated(batchers) if due is None else None
                    if full is not None:
                        full.wait_oldest()  # no CPU until it ends: nothing could launch before
                    else:
                        idle_round = began
                await asyncio.sleep(0)  # other tasks run; then poll again
                continue
            await self._sleep(due)

    async def _sleep(self, timeout: Optional[float]) -> None:
        """Until a front end submits, a CPU batch ends, or ``timeout`` (a batching delay) passes."""
        self._wake.clear()
        if any(len(link.channel.submissions) for link in self.links if not link.closed):
            return
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _take(self, link: FrontEndLink, s: ipc.Submission) -> None:
        if s.kind == ipc.CANCEL:
            work = link.works.get(s.rid)
            if work is not None and work.owner is not None:
                work.owner.cancel(work)
            return
        mv: Optional[ModelVersion] = None
        try:
            mv = self._version_for(s)
            work = Work(inputs=self._item(link, s, mv), batch_size=s.batch_size, deadline=s.deadline, ids=s.ids,
                        answer=self._answered, tag=(link, s.rid, mv))
            mv.acquire()
            link.works[s.rid] = work
            try:
                mv.submit(RPCS[s.kind], work)
            except ServingError:
                link.works.pop(s.rid, None)
                mv.release()
                raise
        except ServingError as e:
            if mv is not None:  # refused by its batcher (queue full, closed)
                mv.statistics.failed(time.monotonic())
            self._complete(link, s.rid, mv.version if mv is not None else s.version, e, NO_TIMES)

    def _item(self, link: FrontEndLink, s: ipc.Submission, mv: ModelVersion) -> Item:
        """The request's block in its front end's buffer, its bounds checked (a front end is trusted
        to lay requests out, not to stay inside its buffer)."""
        width = 1 if s.kind == ipc.PREDICT else mv.schema.pooled_width
        if (s.kind not in RPCS or not 0 < s.batch_size <= mv.schema.max_batch_size or s.extra > 1
                or s.slot + s.block_bytes > s.result_at or s.result_at + 4 * s.batch_size * width > link.arena.size):
            log.error("front end %d sent a malformed request descriptor: %s", link.index, s)
            raise ExecutionFailed("internal error")
        return Item(link.memory, s.slot, s.block_bytes, s.result_at, s.batch_size, s.extra, s.stored, s.ids)

    def _answered(self, work: Work, error: Optional[ServingError]) -> None:
        link, rid, mv = work.tag
        link.works.pop(rid, None)
        mv.release()
        times = (work.enqueued, work.started, work.finished) if work.started else NO_TIMES
        if error is None:
            mv.statistics.answered(work.batch_size, work.enqueued, work.started, work.finished)
        else:
            mv.statistics.failed(work.enqueued)
        self._complete(link, rid, mv.version, error, times)

    def _complete(self, link: FrontEndLink, rid: int, version: int, error: Optional[ServingError],
                  times: Tuple[float, float, float]) -> None:
        if link.closed:
            return
        code, message = 0, b""
        if error is not None:
            code = 1 + ANSWER_ERRORS.index(type(error)) if type(error) in ANSWER_ERRORS else \
                1 + ANSWER_ERRORS.index(ExecutionFailed)
            message = ipc.clip_message(str(error))
        if not link.channel.completions.put((rid, version, code, *times, message)):
            log.error("front end %d's completion ring is full; request %d goes unanswered", link.index, rid)
        link.answered = True

    def _signal_answered(self) -> None:
        for link in self.links:
            if link.answered:
                link.answered = False
                ipc.Channel.signal(link.channel.completed)

    def _version_for(self, s: ipc.Submission) -> ModelVersion:
        """The version to run on: the one the front end laid the request out for while it takes
        requests or drains (a request in flight at a swap finishes on the version it was checked
        against, and the model calls of one OIP request asking for both outputs on one version), else
        (the client named no version) the model's default version now if it takes the same layout."""
        if self.exit_code:
            raise DeviceLost()
        if not self.repo.ready:
            raise Overloaded("server is loading models; retry")
        layout = s.model_id  # a version takes the request if it was published with this layout's id
        name = self._names.get(layout, "")
        asked = self.repo.version(name, s.version)
        if asked is not None and asked.layout_id == layout:
            return asked
        for old in self.repo.versions(name):  # the copy it was laid out for, since replaced or unloaded, drains
            if old.version == s.version and old.state == DRAINING and old.layout_id == layout \
                    and not old.drained.is_set():
                return old
        mv = self.repo.models.get(name)
        if mv is not None and not s.flags & ipc.PINNED and mv.layout_id == layout:
            return mv
        if mv is None:
            raise ModelNotFound(f"model {name!r} is not loaded; loaded: {sorted(self.repo.models)}")
        if s.flags & ipc.PINNED and asked is None:
            raise ModelNotFound(f"model {name!r} version {s.version} is not loaded; serving versions "
                                f"{sorted(self.repo.served.get(name, {}))}")
        raise Overloaded(f"model {name!r} changed its inputs while the request was in flight; retry")

    # -- front ends ------------------------------------------------------------------------------
    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            fds: List[int] = []
            arena: Optional[ipc.Arena] = None
            channel: Optional[ipc.Channel] = None
            pinned = False
            try:
                sock.settimeout(10)
                hello, fds = await loop.run_in_executor(None, ipc.receive_fds, sock, 4)
                sock.setblocking(False)
                arena = ipc.Arena(hello.arena_bytes, fds[0])
                channel = ipc.Channel(hello.channel_capacity, fds[1:])
                pinned = self.repo.device == "cuda" and await loop.run_in_executor(self._pinning, page_lock, arena)
                reader, writer = await asyncio.open_connection(sock=sock)
            except (OSError, ConnectionError, ValueError, AttributeError, RuntimeError) as e:
                log.error("a front end could not connect: %s", e)
                if pinned:  # unlocked before it is unmapped (see _release)
                    await loop.run_in_executor(self._pinning, page_unlock, arena)
                _close_passed(fds, arena, channel)
                sock.close()
                # RuntimeError: CUDA's, from page_lock (its first CUDA call may start the runtime here)
                if isinstance(e, RuntimeError) and device_unusable(e, torch.device(self.repo.device)):
                    self.device_lost()
                continue
            link = FrontEndLink(hello.index, arena, channel, torch.from_numpy(arena.bytes), pinned, writer)
            self.links.append(link)
            loop.add_reader(channel.submitted, self._submitted, channel.submitted)
            ipc.send_nowait(writer, self._models_state())
            self._spawn(self._serve(link, reader))

    def _submitted(self, fd: int) -> None:
        ipc.Channel.drain(fd)
        self._wake.set()

    async def _serve(self, link: FrontEndLink, reader: asyncio.StreamReader) -> None:
        """The front end's questions (statistics, model load and unload), until it goes."""
        try:
            while (message := await ipc.receive(reader)) is not None:
                if isinstance(message, ipc.StatisticsQuery):
                    ipc.send_nowait(link.writer, ipc.Statistics(message.token, self.statistics()))
                elif isinstance(message, ipc.Control):
                    self._spawn(self._control(link, message))
        except ConnectionError as e:
            log.error("front end %d: %s", link.index, e)
        # The front end is gone (it stopped, or died): its requests still run to their end, since
        # the device may be reading its buffer; the mapping is dropped with the last of them.
        asyncio.get_running_loop().remove_reader(link.channel.submitted)
        while link.works:
            for work in list(link.works.values()):
                if work.owner is not None:
                    work.owner.cancel(work)
            await asyncio.sleep(0.01)
        await self._release(link)

    async def _release(self, link: FrontEndLink) -> None:
        """Unlock and unmap a front end's buffer once nothing of it is on the device. Whatever ends
        the engine's link (the front end went, or the engine stops) comes here: a buffer unmapped but
        still registered with CUDA would make a later mapping at its address unlockable (error 712),
        and the device would copy that mapping's requests from the old pages."""
        link.closed = True
        if link.pinned:  # cleared once done: a release cancelled here is done again by the engine's stop
            await asyncio.get_running_loop().run_in_executor(self._pinning, page_unlock, link.arena)
            link.pinned = False
        if link in self.links:
            self.links.remove(link)
            link.memory = None  # type: ignore[assignment]
            link.arena.close()
            link.channel.close()

    async def _control(self, link: FrontEndLink, control: ipc.Control) -> None:
        error = ""
        try:
            if control.action == "load":
                await self.repo.load_model(control.model)
            else:
                await self.repo.unload_model(control.model)
        except UserError as e:
            error = str(e)
        self.publish()  # before the answer: the front end then knows the new state
        if not link.closed:
            ipc.send_nowait(link.writer, ipc.ControlDone(control.token, error))

    # -- what the front ends know --------------------------------------------------------------
    def statistics(self) -> Dict[Tuple[str, int], VersionStatistics]:
        """Every loaded version's statistics (serving/statistics.py). A version served and draining at
        once (unloaded and loaded again, or deleted and published again) is the copy served: the
        draining one is listed after it."""
        statistics: Dict[Tuple[str, int], VersionStatistics] = {}
        for name in self.repo.models:
            for mv in self.repo.versions(name):
                statistics.setdefault((name, mv.version), mv.statistics)
        return statistics

    def _models_state(self, index: Optional[List[Tuple[str, str, str, str]]] = None) -> ipc.Models:
        models = {}
        for name, served in self.repo.served.items():
            if not served:
                continue
            versions = {}
            for version, mv in served.items():
                model_id = self._model_ids.setdefault((name, _layout(mv)), len(self._model_ids))
                self._names[model_id] = name
                mv.layout_id = model_id
                versions[version] = ipc.ModelState(name, model_id, version, mv.schema, mv.pool_shared_once)
            config = self.repo.configs.get(name)
            labels = dict(config.version_labels) if config is not None else {}
            listed = self.repo.versions(name)
            infos = {version: model_info(name, listed, config, mv) for version, mv in served.items()}
            models[name] = ipc.ServedModel(name, infos, versions, labels)
        return ipc.Models(ready=self.repo.ready and not self.exit_code, models=models, loaded=self.repo.loaded,
                          index=self.repo.index() if index is None else index)

    def publish(self) -> None:
        """Send the model state to every front end if it changed since the last time."""
        index = self.repo.index()
        fingerprint = (self.repo.ready, self.repo.loaded, tuple(index),
                       tuple((mv.name, mv.version, mv.state, mv.manifest.files.get(MODEL_FILE), _layout(mv))
                             for name in sorted(self.repo.served) for mv in self.repo.versions(name)),
                       tuple((name, hash(config)) for name, config in sorted(self.repo.configs.items())))
        if fingerprint == self._published:
            return
        self._published = fingerprint
        state = self._models_state(index)
        for link in self.links:
            if not link.closed:
                ipc.send_nowait(link.writer, state)

    async def _publish_loop(self) -> None:
        failed = False
        reading: Optional[asyncio.Task] = None  # the index's models on disk, read in a thread
        while True:
            await asyncio.sleep(STATE_INTERVAL_S)
            try:
                self.publish()
                self._gauges()
                # Not awaited: a read that hangs (a dead mount) must not stop the state and gauges; one at a time.
                if reading is None or reading.done():
                    previous, reading = reading, asyncio.get_running_loop().create_task(self.repo.read_models())
                    if previous is not None:
                        previous.result()  # its failure is logged below
            except Exception:  # noqa: BLE001 - front ends must keep hearing of swaps; say it once
                if not failed:
                    log.exception("publishing the model state failed")
                failed = True

    def _gauges(self) -> None:
        self._depth_models |= set(self.repo.served)
        for name in self._depth_models:  # versions(): a model unloaded still has its draining versions
            for rpc in RPCS.values():
                depth = sum(mv.routers[rpc].depth for mv in self.repo.versions(name))
                self.metrics.queue_depth.labels(rpc=rpc, model=name).set(depth)
        self.metrics.host_memory.set(_resident_bytes())
        self._cache_counters()
        if self.repo.device == "cuda":
            for i in range(torch.cuda.device_count()):
                self.metrics.gpu_memory.labels(device=self._gpu(i)).set(torch.cuda.memory_allocated(i))
            pools = {self._gpu(i): 0 for i in range(torch.cuda.device_count())}  # 0 where no model is left
            for name in self.repo.models:
                for mv in self.repo.versions(name):
                    for runner in mv.runners:
                        gpu = self._gpu(torch.device(runner.device).index)
                        pools[gpu] = pools.get(gpu, 0) + runner.forward.pool_bytes()
            for device, nbytes in pools.items():
                self.metrics.graph_pool.labels(device=device).set(nbytes)

    def _gpu(self, index: int) -> str:
        """The server's name of this engine's cuda:``index``: engine i > 0 sees only GPU i, as its
        cuda:0 (serving/supervisor.py), and the engines' gauges meet in one series per label."""
        return f"cuda:{self.config.engine_index + index}"


    def _cache_counters(self) -> None:
        """FBGEMM's cumulative cache counts of every loaded version (all replicas) into the counters."""
        if time.monotonic() - self._cache_read_at < CACHE_INTERVAL_S:
            return
        self._cache_read_at = time.monotonic()
        counted: Dict[Tuple[int, str], Tuple[int, int]] = {}
        for name in self.repo.models:
            for mv in self.repo.versions(name):
                totals: Dict[str, Tuple[int, int]] = {}
                for runner in mv.runners:
                    for tables, (hits, misses) in runner.cache_stats.read().items():
                        h, m = totals.get(tables, (0, 0))
                        totals[tables] = (h + hits, m + misses)
                for tables, (hits, misses) in totals.items():
                    # Keyed by the loaded module: a version number loaded again starts its counts anew.
                    key = (id(mv), tables)
                    seen_hits, seen_misses = self._cache_counted.get(key, (0, 0))
                    labels = dict(model=name, version=str(mv.version), tables=tables)
                    self.metrics.cache_hits.labels(**labels).inc(max(0, hits - seen_hits))
                    self.metrics.cache_misses.labels(**labels).inc(max(0, misses - seen_misses))
                    counted[key] = (hits, misses)
        self._cache_counted = counted  # versions no longer loaded are forgotten


def _close_passed(fds: List[int], arena: Optional[ipc.Arena], channel: Optional[ipc.Channel]) -> None:
    """What a front end passed before its connection failed: the mappings made of it and its descriptors."""
    for opened in (arena, channel):
        if opened is not None:
            opened.close()
    for fd in (fds[:1] if arena is None else []) + (fds[1:] if channel is None else []):
        os.close(fd)


def _layout(mv: ModelVersion) -> Tuple:
    """What a front end lays a request out for: the version's schema and how it pools shared bags."""
    return mv.schema, mv.pool_shared_once


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


HOST_MEMORY_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


def page_lock(arena: ipc.Arena) -> bool:
    """Page-lock a front end's buffer so that the GPU reads and writes it by DMA; False (and the
    requests travel through pageable memory, at about 0.3 ms of the engine's CPU per 5 MB) if the
    driver refuses. Called on the engine's pinning thread, never on the thread that launches
    batches: the CUDA runtime keeps a failed call's error per host thread, and that thread's next
    kernel launch check raises it (seen on an H200: a refused cudaHostRegister came back as the
    error of the next copy's kernel), failing a batch that had nothing to do with it."""
    err = torch.cuda.cudart().cudaHostRegister(_address(arena), arena.size, 1)  # cudaHostRegisterPortable
    if int(err) == HOST_MEMORY_ALREADY_REGISTERED:  # pageable copies from it would read the old pages
        raise OSError("its buffer overlaps memory page-locked earlier and never unlocked (cudaHostRegister "
                      "error 712): the device would copy its requests from other pages")
    if int(err) != 0:
        log.warning("cannot page-lock a front end's buffer (cudaHostRegister error %s): requests travel "
                    "through pageable memory", int(err))
        return False
    return True


def page_unlock(arena: ipc.Arena) -> None:
    torch.cuda.cudart().cudaHostUnregister(_address(arena))


def _address(arena: ipc.Arena) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(arena.map))


def model_info(name: str, versions: List[ModelVersion], config: Optional[ModelConfig],
               shown: Optional[ModelVersion] = None) -> bytes:
    """recserve.v1.ModelInfo of a model, serialized: what GetModelInfo answers for it, with the schema of
    ``shown`` (default: the first of ``versions``, the default version)."""
    shown = shown or versions[0]
    m = shown.manifest
    return pb.ModelInfo(
        name=name,
        features=[pb.FeatureInfo(name=f.name, table=f.table, rows=f.rows, dim=f.dim, pooling=f.pooling,
                                 weight_dtype=f.weight_dtype) for f in m.features],
        dense_features=m.dense_features,
        versions=[pb.ModelVersionInfo(version=v.version, state=v.state, device=v.devices,
                                      model_sha256=v.manifest.files.get(MODEL_FILE, "")) for v in versions],
        max_batch_size=shown.schema.max_batch_size,
        manifest_json=m.to_json(),
        version_labels=config.version_labels if config is not None else {},
        config_json=json.dumps(describe(config)),
    ).SerializeToString()


def main(config: ServerConfig, socket_path: str, log_level: str, ready) -> None:
    """The engine process (serving/supervisor.py starts it)."""
    from recserve.logs import restore_stderr
    from serving.child import child_setup, leave_workdir

    child_setup(log_level, config, "engine" if config.engine_index == 0 else f"engine-{config.engine_index}",
                os.path.dirname(socket_path))
    # The engines' CPU threads and the front ends share the cores: no more threads than they leave.
    spare = usable_cores() - (config.frontends or default_frontends())
    torch.set_num_threads(max(1, spare // config.engines))

    held: List[Engine] = []  # until os._exit: a collection would free its models (ModelRepository.close)

    async def run() -> int:
        try:
            engine = Engine(config, socket_path)
        except UserError as e:  # the supervisor prints it as the server's one error line
            ready.send(("error", str(e)))
            return 2
        held.append(engine)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, engine.request_stop)  # the supervisor's: front ends first, then us
        await engine.start()
        ready.send(("engine", os.getpid()))
        loading = loop.create_task(engine.load())
        await engine.run_until_stopped()  # a SIGTERM while models load stops at once
        loading.cancel()
        return engine.exit_code

    try:
        code = asyncio.run(run())
    finally:
        leave_workdir()
    restore_stderr()
    logging.shutdown()
    os._exit(code)  # a load thread stuck in a read must not keep the process alive
