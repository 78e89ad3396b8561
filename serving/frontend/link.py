"""The front end's side of the engine (serving/ipc.py): its shared buffer, its rings, the requests it
has in flight, and the models the engine last said it serves.

A request is written once into a slot of the buffer, in the engine's batch layout, and announced by
one ring record; its answer is one completion record. The slot is freed exactly once, on every path:
by the caller when it has read the answer, or on the completion when the caller has gone (client
cancelled, deadline passed); when the engine is gone, for every request at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import weakref
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from serving import ipc
from serving.errors import ANSWER_ERRORS, DeviceLost, InvalidInput, ModelNotFound, Overloaded, QueueFull, ServingError, \
    TooLarge
from serving.frontend.status import Call
from serving.frontend.validate import SparseBatch, check_ids, lookup_columns, model_kjt, quoted, write_checked
from serving.statistics import VersionStatistics, merge

log = logging.getLogger("serving.frontend")
CONNECT_TIMEOUT_S = 30
# One Schema object per schema, whichever engine sent it (each Models message unpickles its own): a
# request checked against one engine's copy of a version is matched with every engine's on its way
# (Engines.run), and equal copies compared field by field cost tens of microseconds each for a model
# of hundreds of features; the same object compares at once.
_SCHEMAS: "weakref.WeakValueDictionary[ipc.Schema, ipc.Schema]" = weakref.WeakValueDictionary()
RING_CAPACITY = 1 << 14  # records per ring; a front end keeps at most half as many requests in flight
STATISTICS_TIMEOUT_S = 10  # the engine answers between two rounds of its loop; this is for a stuck one


@dataclass
class Answer:
    version: int
    error: Optional[ServingError]
    times: Optional[Tuple[float, float, float]]


class EngineLink:
    def __init__(self, socket_path: str, arena_bytes: int, index: int,
                 on_state: Callable[[], None], on_lost: Callable[[int], None],
                 on_buffer: Callable[[int], None] = lambda used: None, engines: int = 1) -> None:
        self.socket_path = socket_path
        self.index = index
        self.engines = engines  # how many engines the front end's buffer is split between (``arena_bytes`` each)
        self.arena = ipc.Arena(arena_bytes)
        self.arena.touch()
        self.channel = ipc.Channel(RING_CAPACITY)
        self.models: Dict[str, ipc.ServedModel] = {}
        self.repository_index: List[Tuple[str, str, str, str]] = []  # (ipc.Models.index)
        self.ready = False  # the engine serves a model
        self.loaded = False  # the engine has done its start-up load (every model loaded or failed)
        self.accepting = True
        self._on_state = on_state
        self._on_lost = on_lost
        self._on_buffer = on_buffer
        self._pending: Dict[int, Tuple[asyncio.Future, int]] = {}  # rid -> (answer, slot offset)
        self._next_rid = 0
        self._writer: Optional[asyncio.StreamWriter] = None
        self._lost_code = 0
        self._gone = False
        self._queries: Dict[int, asyncio.Future] = {}  # questions to the engine (statistics, model control), by token
        self._next_query = 0

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                sock.connect(self.socket_path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise ConnectionError(f"no engine at {self.socket_path}") from None
                await asyncio.sleep(0.05)
        hello = ipc.Hello(self.index, self.arena.size, self.channel.capacity)
        ipc.send_fds(sock, hello, [self.arena.fd, *self.channel.fds])
        sock.setblocking(False)
        reader, self._writer = await asyncio.open_connection(sock=sock)
        loop = asyncio.get_running_loop()
        loop.add_reader(self.channel.completed, self._completed)
        self._reader_task = loop.create_task(self._read(reader))

    # -- answers -----------------------------------------------------------------------------------
    def _completed(self) -> None:
        ipc.Channel.drain(self.channel.completed)
        for rid, version, code, queued, started, finished, message in self.channel.completions.take():
            error = None
            if code:
                error = ANSWER_ERRORS[code - 1](message.rstrip(b"\0").decode("utf-8", "replace"))
            times = None if queued != queued else (queued, started, finished)
            self._answer(rid, Answer(version, error, times))

    def _answer(self, rid: int, answer: Answer) -> None:
        entry = self._pending.pop(rid, None)
        if entry is None:
            return
        future, offset = entry
        if future.done():  # its caller went away: nobody reads the slot any more
            self._free(offset)
        else:
            future.set_result(answer)

    def _free(self, offset: int) -> None:
        self.arena.free(offset)
        self._on_buffer(self.arena.used_bytes)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await ipc.receive(reader)
                if message is None:
                    break
                if isinstance(message, ipc.Models):
                    _share_schemas(message.models)
                    self.models, self.ready, self.loaded = message.models, message.ready, message.loaded
                    self.repository_index = message.index
                    self._on_state()
                elif isinstance(message, (ipc.Statistics, ipc.ControlDone)):
                    future = self._queries.pop(message.token, None)
                    if future is not None and not future.done():
                        future.set_result(message)
                elif isinstance(message, ipc.Fatal):
                    log.critical("the engine is going down: %s", message.message)
                    self._lost_code = message.exit_code
        except Exception:  # noqa: BLE001 - a broken channel is an engine gone, never a silent reader death
            log.exception("front end %d: the engine's messages cannot be read", self.index)
        self._engine_gone()

    def _engine_gone(self) -> None:
        """Nobody will write to the buffer again: fail and free everything in flight."""
        self._gone = True
        self.ready = self.accepting = self.loaded = False
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.channel.completed)
        for future, offset in self._pending.values():
            self._free(offset)
            if not future.done():
                future.set_exception(DeviceLost("the server's engine stopped; this server is restarting"))
        self._pending.clear()
        for future in self._queries.values():
            if not future.done():
                future.set_exception(DeviceLost("the server's engine stopped; this server is restarting"))
        self._queries.clear()
        self._on_lost(self._lost_code or 1)

    async def _ask(self, question, timeout: Optional[float]):
        """Send the engine a question (ipc.StatisticsQuery, ipc.Control); its answer (ipc.Statistics,
        ipc.ControlDone), matched by token."""
        if self._gone or self._writer is None:
            raise DeviceLost("the server's engine stopped; this server is restarting")
        self._next_query += 1
        question.token = token = self._next_query
        future = asyncio.get_running_loop().create_future()
        self._queries[token] = future
        ipc.send_nowait(self._writer, question)
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._queries.pop(token, None)

    async def statistics(self) -> Dict[Tuple[str, int], VersionStatistics]:
        """The engine's statistics of every version it has loaded (serving/statistics.py)."""
        try:
            return (await self._ask(ipc.StatisticsQuery(0), STATISTICS_TIMEOUT_S)).versions
        except asyncio.TimeoutError:
            raise Overloaded("the engine did not answer the statistics query in time; retry") from None

    # -- requests ----------------------------------------------------------------------------------
    def model(self, name: str, version: int, label: str = "") -> ipc.ModelState:
        """The model version a request names, as the engine serves it now (raises the client's error)."""
        return served_model(self, name, version, label)

    def known(self, name: str) -> ipc.ServedModel:
        return known_model(self, name)

    async def control(self, action: str, model: str) -> str:
        """Ask the engine to load or unload a model; "" once done, else why not. The engine's new
        model state has arrived by then (it is sent first). A load takes what it takes (at most the
        server's --load-timeout per version)."""
        return (await self._ask(ipc.Control(0, action, model), None)).error

    @contextlib.asynccontextmanager
    async def run(self, rpc: str, model: ipc.ModelState, sparse: SparseBatch, dense: Optional[np.ndarray],
                  pinned: bool, deadline: Optional[float], call: Optional[Call] = None,
                  planned: Optional[Plan] = None) -> AsyncIterator[Tuple[int, np.ndarray]]:
        """Run one validated request in the engine; yields (version that answered, its result: CTRs
        float32 [B], or pooled float32 [B, columns of the features sent, per-sample then shared]),
        valid until the block ends. ``pinned``: the client named the version. ``call``: gets the
        engine's queue and model-call times. ``planned``: :func:`plan` of the request, if made already."""
        if self._gone:
            raise DeviceLost("the server's engine stopped; this server is restarting")
        lookup = rpc == "Lookup"
        kjt, layout, out_totals, stored = planned or plan(rpc, model, sparse, dense)
        try:
            if len(self._pending) >= RING_CAPACITY // 2:
                raise QueueFull("too many requests in flight on this front end; retry with backoff")
            offset = self._slot(layout.slot_bytes)
        except QueueFull:  # no copy to check the ids on: a bad request is refused as such, whatever the load
            check_ids(sparse, model.schema)
            raise
        try:
            write_checked(self.arena.slot(offset, layout.block_bytes), sparse, kjt, layout, out_totals, stored,
                          model.schema)
        except BaseException:
            self._free(offset)
            raise
        rid = self._next_rid
        self._next_rid += 1
        submission = ipc.Submission(ipc.RPC_KINDS[rpc], ipc.PINNED if pinned else 0, model.model_id, rid,
                                    model.version, deadline, layout.batch_size, layout.extra, int(out_totals.sum()),
                                    layout.stored, offset, layout.block_bytes, offset + layout.result_at)
        if not self.channel.submissions.put(submission.pack()):  # room: at most half the ring in flight, + cancels
            self._free(offset)
            raise QueueFull("too many requests in flight on this front end; retry with backoff")
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = (future, offset)
        ipc.Channel.signal(self.channel.submitted)
        try:
            answer: Answer = await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._free(offset)  # answered just before the cancel: nobody else frees it
            elif rid in self._pending:  # freed on its completion (the engine may be writing its result)
                self.channel.submissions.put((ipc.CANCEL, 0, 0, rid, 0, float("nan"), 0, 0, 0, 0, 0, 0, 0))
                ipc.Channel.signal(self.channel.submitted)
            raise
        try:
            if call is not None and call.steps is not None and answer.times is not None:
                queued, started, finished = answer.times
                call.steps["queue"], call.steps["model"] = (queued, started), (started, finished)
            if answer.error is not None:
                raise answer.error
            result = self.arena.result(offset + layout.result_at, layout.result_shape)
            if lookup and not sparse.in_model_order:
                result = np.take(result, lookup_columns(model.schema, sparse.all_keys), axis=1)
            yield answer.version, result
        finally:
            self._free(offset)

    def check_fits(self, nbytes: int) -> None:
        """A request that needs more than the whole buffer can never run: RESOURCE_EXHAUSTED (not the
        retryable UNAVAILABLE of a buffer that is full for now). Slots are aligned; the buffer's
        size need not be (--frontend-buffer-mb 16.3, or split between engines)."""
        if ipc.aligned(nbytes) > self.arena.size:
            size = f"{self.arena.size / 2**20:.1f} MiB"
            whole = f"all of its {size} (serve --frontend-buffer-mb)" if self.engines == 1 else \
                f"an engine's share of it, {size} (serve --frontend-buffer-mb, split between {self.engines} engines)"
            raise TooLarge(f"the request needs {nbytes / 2**20:.1f} MiB of a front end's buffer, more than {whole}; "
                           "split the request")

    def _slot(self, nbytes: int) -> int:
        self.check_fits(nbytes)
        offset = self.arena.alloc(nbytes)
        if offset is None:
            raise QueueFull("the server's request buffers are full; retry with backoff")
        self._on_buffer(self.arena.used_bytes)
        return offset

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class Engines:
    """A front end's links to every engine of the server (one engine per GPU, or ``--replicas N``
    on the CPU): the same interface as one link. A request runs on an engine that serves its model
    at the version it was checked against, the one with the fewest of this front end's requests in
    flight of those whose share of the buffer has room for it. Health: SERVING once every engine has
    done its start-up load and one serves a model."""

    def __init__(self, links: List[EngineLink]) -> None:
        self.links = links
        self._merged: Tuple[List[Dict[str, ipc.ServedModel]], Dict[str, ipc.ServedModel]] = ([], {})

    @property
    def models(self) -> Dict[str, ipc.ServedModel]:
        """Every model an engine serves, with every version one serves: engines poll the repository on
        their own, and one may not have (or may have refused) a version another serves. Each version's
        description (GetModelInfo) is that of an engine serving it."""
        views = [link.models for link in self.links]
        if len(views) == len(self._merged[0]) and all(a is b for a, b in zip(views, self._merged[0])):
            return self._merged[1]
        merged: Dict[str, ipc.ServedModel] = {}
        for view in views:
            for name, served in view.items():
                known = merged.get(name)
                if known is None:
                    merged[name] = served
                    continue
                merged[name] = ipc.ServedModel(name, {**served.infos, **known.infos},
                                               {**served.versions, **known.versions},
                                               {**served.labels, **known.labels})
        self._merged = (views, merged)
        return merged

    @property
    def ready(self) -> bool:
        return self.loaded and any(link.ready for link in self.links)

    @property
    def loaded(self) -> bool:
        return all(link.loaded for link in self.links)

    @property
    def accepting(self) -> bool:
        return all(link.accepting for link in self.links)

    @accepting.setter
    def accepting(self, value: bool) -> None:
        for link in self.links:
            link.accepting = value

    @property
    def in_flight(self) -> int:
        return sum(link.in_flight for link in self.links)

    async def connect(self) -> None:
        for link in self.links:
            await link.connect()

    def close(self) -> None:
        for link in self.links:
            link.close()

    def model(self, name: str, version: int, label: str = "") -> ipc.ModelState:
        return served_model(self, name, version, label)

    def known(self, name: str) -> ipc.ServedModel:
        return known_model(self, name)

    @property
    def repository_index(self) -> List[Tuple[str, str, str, str]]:
        """Every engine's index merged as :attr:`models` merges what they serve: every version an
        engine holds (READY on one: READY; draining on one: UNLOADING too), a version refused where
        none holds it UNAVAILABLE with the first engine's reason, and for a model none holds, LOADING
        while one loads it, else UNAVAILABLE with the first engine's reason."""
        rows: Dict[str, Dict[Tuple[str, str], str]] = {}
        for link in self.links:
            for name, version, state, reason in link.repository_index:
                rows.setdefault(name, {}).setdefault((version, state), reason)
        merged = []
        for name, found in sorted(rows.items()):
            held = {version for version, state in found if version and state != "UNAVAILABLE"}
            listed = sorted(((version, state) for version, state in found
                             if version and (state != "UNAVAILABLE" or version not in held)),
                            key=lambda key: (key[1] != "READY", -int(key[0])))
            if held:
                merged += [(name, version, state, found[(version, state)]) for version, state in listed]
            else:
                state = "LOADING" if ("", "LOADING") in found else "UNAVAILABLE"
                merged.append((name, "", state, found[("", state)]))
        return merged

    async def control(self, action: str, model: str) -> str:
        """Every engine loads (unloads) the model; the first error, if any. A load is all or nothing:
        where it left an engine without the model, those where it succeeded unload the model again (a
        client told that the model does not load must not find it served, by some engines only). An
        engine that refused a new version but serves an older one keeps serving it, the others too."""
        errors = await asyncio.gather(*(link.control(action, model) for link in self.links))
        error = next((e for e in errors if e), "")
        if action == "load" and any(e and model not in link.models for link, e in zip(self.links, errors)):
            await asyncio.gather(*(link.control("unload", model) for link, e in zip(self.links, errors) if not e))
        return error

    async def statistics(self) -> Dict[Tuple[str, int], VersionStatistics]:
        """Every engine's statistics, added up (each runs its own share of the requests)."""
        return merge(list(await asyncio.gather(*(link.statistics() for link in self.links))))

    def check_fits(self, nbytes: int) -> None:
        self.links[0].check_fits(nbytes)

    def run(self, rpc: str, model: ipc.ModelState, sparse: SparseBatch, dense: Optional[np.ndarray], pinned: bool,
            deadline: Optional[float], call: Optional[Call] = None, planned: Optional[Plan] = None):
        name = model.name
        # Only an engine whose copy of the version takes the inputs the request was checked against (its
        # ids against those tables' rows, its features by that schema's positions): one that loaded the
        # version number again with other inputs has not, and would get ids outside its tables.
        serving = [link for link in self.links if link.ready and name in link.models
                   and _same_inputs(link.models[name].versions.get(model.version), model)]
        if not serving:
            raise Overloaded("the model changed version while the request was checked; retry")
        # Each engine has its share of this front end's buffer: one whose share is full must not refuse
        # a request that another's has room for. The layout that chooses is the one written.
        planned = planned or plan(rpc, model, sparse, dense)
        nbytes = ipc.aligned(planned.layout.slot_bytes)
        link = min(serving, key=lambda candidate: (not candidate.arena.fits(nbytes), candidate.in_flight))
        return link.run(rpc, link.models[name].versions[model.version], sparse, dense, pinned, deadline, call, planned)


def _same_inputs(state: Optional[ipc.ModelState], model: ipc.ModelState) -> bool:
    """``state`` (an engine's copy of a version) takes requests checked and laid out for ``model``."""
    return (state is not None and (state.schema is model.schema or state.schema == model.schema)
            and state.pool_shared_once == model.pool_shared_once)


def _share_schemas(models: Dict[str, ipc.ServedModel]) -> None:
    """Each version's schema replaced by the one object of that schema (:data:`_SCHEMAS`)."""
    for served in models.values():
        for state in served.versions.values():
            state.schema = _SCHEMAS.setdefault(state.schema, state.schema)


class Plan(NamedTuple):
    """A request laid out for its model version (what :meth:`EngineLink.run` writes)."""

    kjt: ipc.ModelKJT
    layout: ipc.RequestLayout
    out_totals: np.ndarray
    stored: np.ndarray


def plan(rpc: str, model: ipc.ModelState, sparse: SparseBatch, dense: Optional[np.ndarray]) -> Plan:
    """The request in model order and its layout in the shared buffer, as ``model`` takes it."""
    kjt = model_kjt(sparse, dense, model.schema)
    return Plan(kjt, *ipc.layout_of(kjt, model.schema, model.pool_shared_once, rpc == "Lookup"))


def served_model(engine, name: str, version: int, label: str = "") -> ipc.ModelState:
    """The model version a request names (a number, a label, or neither: the highest served) as
    ``engine`` (a link, or the links to every engine) serves it now; raises the client's error."""
    if not engine.accepting:
        raise Overloaded("server is shutting down; retry on another replica")
    if not engine.ready:
        raise not_ready(engine)
    return resolve_version(known_model(engine, name), version, label)


def resolve_version(model: ipc.ServedModel, version: int, label: str = "") -> ipc.ModelState:
    """The served version of ``model`` that a version number, a label, or neither names."""
    name = model.name
    if label:
        if version:
            raise InvalidInput("name the model version or a version label, not both")
        if label not in model.labels:
            raise ModelNotFound(f"model {quoted(name)} has no version label {quoted(label)}; labels: "
                                f"{sorted(model.labels)}")
        version = model.labels[label]
    if not version:
        return model.default
    state = model.versions.get(version)
    if state is None:
        named = f"version {version}" + (f" (label {quoted(label)})" if label else "")
        raise ModelNotFound(f"model {quoted(name)} {named} is not loaded; serving versions {sorted(model.versions)}")
    return state


def known_model(engine, name: str) -> ipc.ServedModel:
    """A served model by name (a link, or the links to every engine). One the engines do not serve
    before they serve any: the client is told to retry, as for requests (at start-up a front end may
    not have heard of the models yet that the front end which answered the health check had)."""
    state = engine.models.get(name)
    if state is None and not engine.ready:
        raise not_ready(engine)
    if state is None:
        raise ModelNotFound(f"model {quoted(name)} is not loaded; loaded: {sorted(engine.models)}")
    return state


def not_ready(engine) -> Overloaded:
    """Why no model serves yet: still loading, or none could load (until a poll finds a good one)."""
    if engine.loaded:
        return Overloaded("no model has loaded on this server (the server's log says why each failed); retry "
                          "once the repository has a good version")
    return Overloaded("server is loading models; retry")
