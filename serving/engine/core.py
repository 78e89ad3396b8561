"""The engine: one process that owns the devices and the loaded model versions.

Front ends (serving/frontend/main.py) connect over a Unix socket and hand over their shared buffer
(serving/ipc.py). Each :class:`ipc.Infer` becomes a :class:`serving.engine.assemble.Request` whose arrays
are views of that buffer, and runs on its model version (serving/engine/repository.py ``ModelVersion``):
batched with every other front end's requests, on the device. The engine answers each Infer with
exactly one :class:`ipc.Done`, after the request's output is written (or with its error).

It tells the front ends which models it serves, with their schemas, whenever that changes
(:class:`ipc.Models`), and, if its device fails, that it is going down (:class:`ipc.Fatal`).
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import torch

from recserve.v1 import inference_pb2 as pb
from serving import ipc
from serving.engine.assemble import Request
from serving.config import ServerConfig
from serving.errors import DeviceLost, ExecutionFailed, ModelNotFound, Overloaded, ServingError
from serving.metrics import Metrics
from serving.engine.repository import ModelRepository, ModelVersion
from serving.ipc import Schema
from serving.frontend.validate import SparseBatch

log = logging.getLogger("serving.engine")
EXIT_DEVICE_LOST = 3  # the process must be restarted (its CUDA context is unusable)
STATE_INTERVAL_S = 0.2  # how often model state and gauges are compared and published
CACHE_INTERVAL_S = 2.0  # how often UVM cache counts are read (each read waits for the device's queued work)


@dataclass
class FrontEndLink:
    """One connected front end: its shared buffer and its requests in flight."""

    index: int
    arena: ipc.Arena
    pinned: bool
    writer: asyncio.StreamWriter
    tasks: Dict[int, asyncio.Task] = field(default_factory=dict)


class Engine:
    def __init__(self, config: ServerConfig, socket_path: str) -> None:
        self.config = config
        self.socket_path = socket_path
        self.metrics = Metrics()
        self.repo = ModelRepository(config, self.metrics, on_fatal=self.device_lost)
        self.links: List[FrontEndLink] = []
        self.exit_code = 0
        self._schemas: Dict[Tuple[str, int], Schema] = {}  # every version served: what requests were checked against
        self._published: Optional[Tuple] = None
        self._stop = asyncio.Event()
        self._listener: Optional[socket.socket] = None
        self._tasks: Set[asyncio.Task] = set()
        self._cache_counted: Dict[Tuple[int, str], Tuple[int, int]] = {}  # UVM cache (hits, misses) exported
        self._cache_read_at = 0.0

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Listen for front ends (at once: they answer health while models load), then load."""
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.socket_path)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._spawn(self._accept())
        self._spawn(self._publish_loop())

    async def load(self) -> None:
        await self.repo.refresh()
        self.publish()
        loaded = {n: mv.version for n, mv in self.repo.models.items()}
        log.info("engine on %s: models %s", self.repo.device, loaded)

    async def run_until_stopped(self) -> None:
        if self.config.poll_interval_s > 0:
            self._spawn(self._poll())
        await self._stop.wait()
        await self.shutdown()

    def request_stop(self) -> None:
        self._stop.set()

    async def shutdown(self) -> None:
        """Front ends stop sending first (they drain); what is still in flight here finishes."""
        deadline = time.monotonic() + self.config.grace_period_s
        while any(link.tasks for link in self.links) and time.monotonic() < deadline and not self.exit_code:
            await asyncio.sleep(0.01)
        for task in list(self._tasks):
            task.cancel()
        if self._listener:
            self._listener.close()
        await self.repo.close()
        for link in self.links:
            link.writer.close()
        log.info("engine stopped")

    def device_lost(self) -> None:
        """A model call left the device unusable: fail what waits, tell the front ends, exit 3."""
        if self.exit_code:
            return
        log.critical("device unusable: the server goes NOT_SERVING and exits with code %d for a restart",
                     EXIT_DEVICE_LOST)
        self.exit_code = EXIT_DEVICE_LOST
        self.repo.fail_queued(DeviceLost())
        for link in self.links:
            ipc.send_nowait(link.writer, ipc.Fatal(DeviceLost.MESSAGE, EXIT_DEVICE_LOST))
        self._stop.set()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            try:
                await self.repo.refresh()
            except Exception:  # noqa: BLE001 - keep polling whatever the disk does
                log.exception("repository poll failed")
            self.publish()

    # -- front ends ------------------------------------------------------------------------------
    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            try:
                sock.settimeout(10)
                hello, fd = await loop.run_in_executor(None, ipc.receive_fd, sock)
                sock.setblocking(False)
                arena = ipc.Arena(hello["arena_bytes"], fd)
                pinned = self._pin(arena)
                reader, writer = await asyncio.open_connection(sock=sock)
            except (OSError, ConnectionError, ValueError) as e:
                log.error("a front end could not connect: %s", e)
                sock.close()
                continue
            link = FrontEndLink(hello["index"], arena, pinned, writer)
            self.links.append(link)
            ipc.send_nowait(writer, self._models_state())
            self._spawn(self._serve(link, reader))

    def _pin(self, arena: ipc.Arena) -> bool:
        """Page-lock a front end's buffer so that the GPU reads and writes it by DMA."""
        if self.repo.device != "cuda":
            return False
        err = torch.cuda.cudart().cudaHostRegister(_address(arena), arena.size, 1)  # cudaHostRegisterPortable
        if int(err) != 0:
            log.warning("cannot page-lock a front end's buffer (cudaHostRegister error %s): requests are staged "
                        "through a copy", int(err))
            return False
        return True

    async def _serve(self, link: FrontEndLink, reader: asyncio.StreamReader) -> None:
        while True:
            message = await ipc.receive(reader)
            if message is None:
                break
            if isinstance(message, ipc.Infer):
                task = asyncio.get_running_loop().create_task(self._infer(link, message))
                link.tasks[message.rid] = task
            elif isinstance(message, ipc.Cancel):
                task = link.tasks.get(message.rid)
                if task is not None:
                    task.cancel()
        # The front end is gone (it stopped, or died): its requests still run to their end, since
        # the device may be reading its buffer; the mapping is dropped with the last of them.
        if link.tasks:
            await asyncio.wait(list(link.tasks.values()))
        self.links.remove(link)
        if link.pinned:
            torch.cuda.cudart().cudaHostUnregister(_address(link.arena))
        link.arena.close()

    async def _infer(self, link: FrontEndLink, message: ipc.Infer) -> None:
        version, error, times = message.version, None, None
        try:
            mv = self._version_for(message)
            version = mv.version
            request = _request(link, message)
            async with self.repo.use(mv.name, mv.version):
                work = await (mv.predict if message.rpc == "Predict" else mv.lookup)(request, message.deadline)
            times = (work.enqueued, work.started, work.finished)
        except ServingError as e:
            error = (type(e).__name__, str(e))
        except asyncio.CancelledError:
            error = ("Cancelled", "the client went away")
        except Exception:  # noqa: BLE001 - never leave a front end without its answer
            log.exception("request %d on %s failed", message.rid, message.model)
            error = (ExecutionFailed.__name__, "internal error")
        link.tasks.pop(message.rid, None)
        if not link.writer.is_closing():
            ipc.send_nowait(link.writer, ipc.Done(message.rid, version, error, times))

    def _version_for(self, message: ipc.Infer) -> ModelVersion:
        """The version to run on: the one the front end validated against if it still takes requests,
        else (a swap happened meanwhile, the client asked for no version) the new one if it has the
        same schema."""
        if self.exit_code:
            raise DeviceLost()
        mv = self.repo.models.get(message.model)
        if mv is None:
            raise ModelNotFound(f"model {message.model!r} is not loaded")
        if mv.version == message.version:
            return mv
        if message.pinned:
            raise ModelNotFound(f"model {message.model!r} version {message.version} is not loaded; "
                                f"serving version {mv.version}")
        if self._schemas.get((message.model, message.version)) != mv.schema:
            raise Overloaded(f"model {message.model!r} changed its inputs while the request was in flight; retry")
        return mv

    # -- what the front ends know --------------------------------------------------------------
    def _models_state(self) -> ipc.Models:
        models = {}
        for name, mv in self.repo.models.items():
            self._schemas[(name, mv.version)] = mv.schema
            models[name] = ipc.ModelState(mv.version, mv.schema, model_info(name, self.repo.versions(name)))
        return ipc.Models(ready=self.repo.ready and not self.exit_code, models=models)

    def publish(self) -> None:
        """Send the model state to every front end if it changed since the last time."""
        fingerprint = (self.repo.ready, tuple((mv.name, mv.version, mv.state) for name in sorted(self.repo.models)
                                              for mv in self.repo.versions(name)))
        if fingerprint == self._published:
            return
        self._published = fingerprint
        state = self._models_state()
        for link in self.links:
            ipc.send_nowait(link.writer, state)

    async def _publish_loop(self) -> None:
        failed = False
        while True:
            await asyncio.sleep(STATE_INTERVAL_S)
            try:
                self.publish()
                self._gauges()
            except Exception:  # noqa: BLE001 - front ends must keep hearing of swaps; say it once
                if not failed:
                    log.exception("publishing the model state failed")
                failed = True

    def _gauges(self) -> None:
        for name in self.repo.models:
            for mv in self.repo.versions(name)[:1]:
                for rpc, router in mv.routers.items():
                    self.metrics.queue_depth.labels(rpc=rpc, model=name).set(router.depth)
        self.metrics.host_memory.set(_resident_bytes())
        self._cache_counters()
        if self.repo.device == "cuda":
            for i in range(torch.cuda.device_count()):
                self.metrics.gpu_memory.labels(device=f"cuda:{i}").set(torch.cuda.memory_allocated(i))
            pools = {}
            for name in self.repo.models:
                for mv in self.repo.versions(name):
                    for runner in mv.runners:
                        pools[runner.device] = pools.get(runner.device, 0) + runner.forward.pool_bytes()
            for device, nbytes in pools.items():
                self.metrics.graph_pool.labels(device=device).set(nbytes)


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


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _address(arena: ipc.Arena) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(arena.map))


def _request(link: FrontEndLink, m: ipc.Infer) -> Request:
    arena = link.arena
    ids, id_totals, k = arena.array(m.values), arena.array(m.totals), len(m.keys)
    n = int(id_totals[:k].sum()) if m.shared_keys else ids.shape[0]
    sparse = SparseBatch(keys=list(m.keys), positions=m.positions, lengths=arena.array(m.lengths), values=ids[:n],
                         totals=id_totals[:k], batch_size=m.batch_size, in_model_order=m.in_model_order,
                         shared_keys=list(m.shared_keys), shared_positions=m.shared_positions,
                         shared_lengths=id_totals[k:], shared_values=ids[n:])
    return Request(sparse, arena.array(m.dense) if m.dense else None, arena.array(m.out), link.pinned, ids, id_totals)


def model_info(name: str, versions: List[ModelVersion]) -> bytes:
    """recserve.v1.ModelInfo of a model, serialized: what GetModelInfo answers for it."""
    m = versions[0].manifest
    return pb.ModelInfo(
        name=name,
        features=[pb.FeatureInfo(name=f.name, table=f.table, rows=f.rows, dim=f.dim, pooling=f.pooling,
                                 weight_dtype=f.weight_dtype) for f in m.features],
        dense_features=m.dense_features,
        versions=[pb.ModelVersionInfo(version=v.version, state=v.state, device=v.devices,
                                      model_sha256=v.manifest.files.get("model.pt", "")) for v in versions],
        max_batch_size=versions[0].schema.max_batch_size,
        manifest_json=m.to_json(),
    ).SerializeToString()


def main(config: ServerConfig, socket_path: str, log_level: str, ready) -> None:
    """The engine process (serving/supervisor.py starts it)."""
    from serving.child import child_setup

    child_setup(log_level, config, "engine")

    async def run() -> int:
        engine = Engine(config, socket_path)
        loop = asyncio.get_running_loop()
        for sig in (15, 2):  # SIGTERM, SIGINT: the supervisor stops the front ends first, then us
            loop.add_signal_handler(sig, engine.request_stop)
        await engine.start()
        ready.send(("engine", os.getpid()))
        loading = loop.create_task(engine.load())
        await engine.run_until_stopped()  # a SIGTERM while models load stops at once
        loading.cancel()
        return engine.exit_code

    code = asyncio.run(run())
    logging.shutdown()
    os._exit(code)  # a load thread stuck in a read must not keep the process alive
