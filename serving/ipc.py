"""How front ends and the engine talk: the one module both sides import.

Three things cross, each by the cheapest means that is safe:

- **Request and result arrays**, through each front end's :class:`Arena`: a memfd (anonymous shared
  memory) that the front end maps and allocates from, and that the engine maps too. The front end
  writes a request once, already in the layout the engine's batch needs (:class:`RequestLayout`:
  every model feature in model order, ids checked against their tables and narrowed to the id width,
  lengths as int32 [T, C], dense as float32 [B, F]); the engine writes the result into the slot after
  it. On CUDA the engine page-locks the arena so that the GPU reads requests and writes results by
  DMA. The front end frees a slot only when the engine has answered its request.
- **Descriptors and completions**, through two single-producer single-consumer rings per front end
  in shared memory (:class:`Ring`): fixed-size records, no pickling, no system call to pass one. The
  engine polls the submission rings while it has work in flight (on CUDA also for a moment after its
  last work: serving/engine/core.py IDLE_POLL_S) and sleeps on an eventfd only when idle: a front end
  writes its eventfd after each submission (a write nobody waits for while the engine is busy), so an
  idle server uses no CPU and a busy one takes no wake-up per request. The engine signals a front
  end's completion eventfd once per batch it answers. Why rings and eventfds
  rather than pyzmq or multiprocessing queues: those pickle every message and wake the reader per
  message; these records are a few struct fields. (Ordering: x86-64 keeps stores in order and loads
  in order, which is all a one-producer one-consumer ring needs; the GPU machines and CI are x86-64.)
- **Control messages** (:class:`Hello`, :class:`Models`, :class:`Fatal`; questions a front end asks,
  :class:`StatisticsQuery` and :class:`Control`, and their answers): rare, over the Unix socket
  that also passes the file descriptors (SCM_RIGHTS), as length-prefixed pickles.

Every submitted request gets exactly one completion, whatever happens to it (answered, failed,
cancelled while queued, deadline passed, version unloaded); the engine answers a cancel only through
that request's own completion. So a slot is freed exactly once, by the front end, on its completion.
"""
from __future__ import annotations

import asyncio
import bisect
import functools
import math
import mmap
import os
import pickle
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from recserve.manifest import Manifest

_HEADER = struct.Struct("<I")
MAX_MESSAGE = 1 << 30  # control messages: the model state of a large server is the largest
ALIGN = 256  # every slot starts aligned (DMA and vector loads like it)
MAX_ID32 = (1 << 31) - 1  # tables up to this many rows take int32 ids in a request's block
# Ids are copied into a request's block this many bytes at a time, each piece reduced (its largest
# id) while it is still in the core's cache: one pass over memory for the copy and the range check,
# not two (13-25% less time for those of a B=4096 request on the H200 machines: docs/benchmarks.md).
COPY_CHUNK_BYTES = 256 << 10


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class Schema:
    """What a model accepts, from its manifest."""

    feature_names: Tuple[str, ...]
    rows: Tuple[int, ...]
    dims: Tuple[int, ...]
    dense_features: int
    max_batch_size: int
    max_ids: int

    @staticmethod
    def from_manifest(m: Manifest, max_batch_size: int, max_ids: int) -> "Schema":
        return Schema(
            feature_names=tuple(f.name for f in m.features),
            rows=tuple(f.rows for f in m.features),
            dims=tuple(f.dim for f in m.features),
            dense_features=m.dense_features,
            max_batch_size=max_batch_size,
            max_ids=max_ids,
        )

    @functools.cached_property
    def index(self) -> Dict[str, int]:
        """Feature name -> position in the model (computed once; read on every request)."""
        return {n: i for i, n in enumerate(self.feature_names)}

    @functools.cached_property
    def in_order(self) -> Tuple[int, ...]:
        """Every feature's position, in model order (0, 1, ..., T-1)."""
        return tuple(range(len(self.feature_names)))

    @functools.cached_property
    def row_counts(self) -> np.ndarray:
        """int64 [T]: each feature's rows, the exclusive bound of its ids."""
        return np.array(self.rows, dtype=np.int64)

    @functools.cached_property
    def min_rows(self) -> int:
        """The smallest table's rows: an id below it lies in every table."""
        return min(self.rows, default=0)

    @functools.cached_property
    def id_dtype(self) -> np.dtype:
        """The ids' width in a request block: int32 unless a table has more rows than int32 counts."""
        return np.dtype(np.int32) if max(self.rows, default=0) <= MAX_ID32 + 1 else np.dtype(np.int64)

    @property
    def pooled_width(self) -> int:
        return sum(self.dims)


# -- the request block ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestLayout:
    """Where a request's arrays lie in its slot, in bytes from the slot's start. The block holds every
    model feature, in model order (features not sent: empty bags):

    ==========  =====================  ================================================================
    header      int32 [2, T]           ids of each feature in the model's KJT (``out_totals``), then
                                       ids of each feature stored here (``stored``): they differ for a
                                       shared bag, stored once and expanded (or pooled once) on device
    values      id dtype [S]           the stored ids, feature by feature (S = sum of ``stored``)
    lengths     int32 [T, C]           bag sizes, C = B samples (+ 1 extra sample that holds the
                                       shared bags when they are pooled once)
    dense       float32 [B, F]         Predict only (F = 0 for Lookup)
    result      float32 [B] / [B, D]   written by the engine: CTRs, or pooled rows of every feature
    ==========  =====================  ================================================================
    """

    features: int  # T
    batch_size: int  # B
    extra: int  # 1 if the shared bags sit in one extra sample (pooled once), else 0
    dense_features: int  # F (0 for Lookup)
    stored: int  # S
    id_bytes: int  # 4 or 8
    result_width: int  # 1 (Predict: a CTR per sample) or D (Lookup: every feature's pooled columns)

    @property
    def columns(self) -> int:
        return self.batch_size + self.extra

    @property
    def values_at(self) -> int:
        return 8 * self.features

    @property
    def lengths_at(self) -> int:
        return self.values_at + self.stored * self.id_bytes

    @property
    def dense_at(self) -> int:
        return self.lengths_at + 4 * self.features * self.columns

    @property
    def block_bytes(self) -> int:
        """What travels to the device: header, values, lengths, dense."""
        return self.dense_at + 4 * self.batch_size * self.dense_features

    @property
    def result_at(self) -> int:
        return aligned(self.block_bytes)

    @property
    def result_shape(self) -> Tuple[int, ...]:
        return (self.batch_size,) if self.result_width == 1 else (self.batch_size, self.result_width)

    @property
    def slot_bytes(self) -> int:
        return self.result_at + 4 * self.batch_size * self.result_width


@dataclass
class ModelKJT:
    """A validated request in model feature order, what :func:`write_request` lays out: per model
    feature its ids (None: not sent, an empty bag in every sample) and its bag sizes, per sample
    (int [B]) or one bag shared by every sample (an int)."""

    batch_size: int
    ids: List[Optional[np.ndarray]]  # [T]
    lengths: List[Any]  # [T]: np.ndarray [B], an int (a shared bag's size), or None (not sent)
    dense: Optional[np.ndarray] = None  # float32 [B, F] (Predict)
    # The same as whole arrays where the request already is the model's KJT (every feature, model
    # order, per sample: what clients send): ids [N] (or a list of each feature's ids, where they came
    # as a tensor per feature: the Open Inference Protocol), lengths [T, B], ids per feature int64 [T].
    # Laid out with a few copies instead of two per feature (a 26-feature request: 3 numpy calls, not 80).
    whole: Optional[Tuple[Any, np.ndarray, np.ndarray]] = None

    def per_feature(self) -> Tuple[List[Optional[np.ndarray]], List[Any]]:
        """(ids, lengths) per model feature, whichever form the request is held in."""
        if self.whole is None:
            return self.ids, self.lengths
        ids, lengths, totals = self.whole
        return list(ids) if isinstance(ids, list) else np.split(ids, np.cumsum(totals)[:-1]), list(lengths)


def layout_of(kjt: ModelKJT, schema: Schema, pool_shared_once: bool, lookup: bool) -> Tuple[RequestLayout, np.ndarray, np.ndarray]:
    """The request's layout and its header rows (out_totals, stored: int64 [T])."""
    t = len(schema.feature_names)
    if kjt.whole is not None:
        stored = kjt.whole[2]
        return _layout(schema, kjt.batch_size, False, False, lookup, int(stored.sum())), stored, stored
    stored = np.zeros(t, np.int64)
    out = np.zeros(t, np.int64)
    shared = False
    for i, (ids, lengths) in enumerate(zip(kjt.ids, kjt.lengths)):
        if ids is None:
            continue
        stored[i] = ids.shape[0]
        if isinstance(lengths, np.ndarray):
            out[i] = ids.shape[0]
        else:
            shared = True
            out[i] = ids.shape[0] if pool_shared_once else ids.shape[0] * kjt.batch_size
    return _layout(schema, kjt.batch_size, shared, pool_shared_once, lookup, int(stored.sum())), out, stored


def _layout(schema: Schema, batch_size: int, shared: bool, pool_shared_once: bool, lookup: bool,
            stored: int) -> RequestLayout:
    return RequestLayout(features=len(schema.feature_names), batch_size=batch_size,
                         extra=int(shared and pool_shared_once), dense_features=0 if lookup else schema.dense_features,
                         stored=stored, id_bytes=schema.id_dtype.itemsize,
                         result_width=schema.pooled_width if lookup else 1)


def unsigned(ids: np.ndarray) -> np.ndarray:
    """Integer ids viewed unsigned: a negative id is huge, so one maximum bounds both ends."""
    return ids.view(ids.dtype.str.replace("i", "u"))  # same width and byte order


def _copy_ids(dst: np.ndarray, src: np.ndarray) -> int:
    """``src`` copied into ``dst`` (narrowed to its dtype); the largest id written, viewed unsigned."""
    written = unsigned(dst)
    step = COPY_CHUNK_BYTES // dst.itemsize
    high = 0
    for start in range(0, src.shape[0], step):
        np.copyto(dst[start:start + step], src[start:start + step], casting="unsafe")
        high = max(high, int(written[start:start + step].max()))
    return high


def _copy_parts(dst: np.ndarray, parts: List[np.ndarray]) -> int:
    """``parts`` copied one after another into ``dst``, as :func:`_copy_ids` copies one array: parts
    smaller than a piece go together, one call for all of them and one for their largest id."""
    step = COPY_CHUNK_BYTES // dst.itemsize
    high = start = size = 0
    group: List[np.ndarray] = []
    for part in parts:
        n = part.shape[0]
        if group and size + n > step:
            high = max(high, _concatenate(dst[start:start + size], group))
            start, size, group = start + size, 0, []
        if n > step:
            high = max(high, _copy_ids(dst[start:start + n], part))
            start += n
        else:
            group.append(part)
            size += n
    if group:
        high = max(high, _concatenate(dst[start:start + size], group))
    return high


def _concatenate(dst: np.ndarray, parts: List[np.ndarray]) -> int:
    np.concatenate(parts, out=dst, casting="unsafe")
    return int(unsigned(dst).max()) if dst.shape[0] else 0


def write_request(slot: np.ndarray, kjt: ModelKJT, layout: RequestLayout, out_totals: np.ndarray,
                  stored: np.ndarray, id_dtype: np.dtype) -> Tuple[np.ndarray, int]:
    """Write a request's block into ``slot`` (uint8 [>= layout.block_bytes]); returns the ids as
    written (``id_dtype`` [sum of ``stored``], model feature order) and the largest of them viewed
    unsigned (:func:`unsigned`). Ids wider than ``id_dtype`` must have been checked against their
    tables (so that narrowing them cannot wrap)."""
    t, b = layout.features, layout.batch_size
    header = slot[:layout.values_at].view(np.int32).reshape(2, t)
    header[0] = out_totals
    header[1] = stored
    values = slot[layout.values_at:layout.lengths_at].view(id_dtype)
    lengths = slot[layout.lengths_at:layout.dense_at].view(np.int32).reshape(t, layout.columns)
    start = high = 0
    if kjt.whole is not None:
        ids, bags, totals = kjt.whole
        start = int(totals.sum())
        high = _copy_parts(values[:start], ids) if isinstance(ids, list) else _copy_ids(values[:start], ids)
        np.copyto(lengths[:, :b], bags, casting="unsafe")  # each <= ids sent < 2**31 (validated)
        lengths[:, b:] = 0
    else:
        # Every feature's ids at once, in model order (small features in one concatenate): a call per
        # feature cost a ranking request of 26 features 0.1 ms of the front end's CPU.
        parts = [ids for ids in kjt.ids if ids is not None]
        start = int(stored.sum())
        high = _copy_parts(values[:start], parts)
        for i, (ids, bags) in enumerate(zip(kjt.ids, kjt.lengths)):
            if ids is None:
                lengths[i] = 0
            elif isinstance(bags, np.ndarray):
                np.copyto(lengths[i, :b], bags, casting="unsafe")  # each <= ids sent < 2**31 (validated)
                lengths[i, b:] = 0
            elif layout.extra:
                lengths[i, :b] = 0
                lengths[i, b] = bags
            else:
                lengths[i] = bags
    if layout.dense_features:
        np.copyto(slot[layout.dense_at:layout.block_bytes].view(np.float32).reshape(b, layout.dense_features),
                  kjt.dense)
    return values[:start], high


# -- control messages ------------------------------------------------------------------------------
@dataclass
class Hello:
    """Front end -> engine, with four file descriptors: its arena, its rings, and two eventfds (it
    writes ``submitted``, the engine writes ``completed``)."""

    index: int
    arena_bytes: int
    channel_capacity: int  # records per ring


@dataclass
class ModelState:
    """One version of a model that takes requests: what a front end needs to validate, lay out and
    answer a request for it."""

    name: str
    model_id: int  # how submissions name the model to its engine (stable for a name while the engine runs)
    version: int
    schema: Schema
    pool_shared_once: bool  # shared bags go in one extra sample (``serve --shared-pooling once``)


@dataclass
class ServedModel:
    """A model as its engine serves it: the versions taking requests, its version labels."""

    name: str
    infos: Dict[int, bytes]  # version -> serialized recserve.v1.ModelInfo, with that version's schema
    versions: Dict[int, ModelState]
    labels: Dict[str, int]  # label -> version (its config.json's version_labels)

    @property
    def default(self) -> ModelState:
        """What a request that names no version gets: the highest version served."""
        return self.versions[max(self.versions)]

    @property
    def info(self) -> bytes:
        """The ModelInfo with the default version's schema."""
        return self.infos[self.default.version]


@dataclass
class Models:
    """Engine -> front ends, on every change: the models served and whether the engine is ready."""

    ready: bool  # serves a model
    models: Dict[str, ServedModel]
    loaded: bool = True  # its start-up load is done: every model loaded or failed
    # (name, version, state, reason) of every model in the repository (the OIP repository index)
    index: List[Tuple[str, str, str, str]] = field(default_factory=list)


@dataclass
class Control:
    """Front end -> engine: load or unload a model (``serve --model-control explicit``), answered by
    :class:`ControlDone` once done."""

    token: int  # the front end's number for the question, echoed in the answer
    action: str  # "load" | "unload"
    model: str


@dataclass
class ControlDone:
    """Engine -> one front end: how a :class:`Control` ended ("" when it did what was asked)."""

    token: int
    error: str


@dataclass
class StatisticsQuery:
    """Front end -> engine: its statistics (serving/statistics.py), answered by :class:`Statistics`."""

    token: int  # the front end's number for the query, echoed in the answer


@dataclass
class Statistics:
    """Engine -> one front end: (model, version) -> serving.statistics.VersionStatistics."""

    token: int
    versions: Dict[Tuple[str, int], Any]


@dataclass
class Fatal:
    """Engine -> front ends: the engine is going down (device lost); answer UNAVAILABLE and exit."""

    message: str
    exit_code: int


def send_nowait(writer: asyncio.StreamWriter, message: Any) -> None:
    """Queue a control message without waiting for the socket (asyncio buffers what it does not take)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(payload) > MAX_MESSAGE:
        raise ValueError(f"a control message of {len(payload)} bytes exceeds {MAX_MESSAGE}")
    writer.write(_HEADER.pack(len(payload)) + payload)


async def receive(reader: asyncio.StreamReader) -> Any:
    """The next control message, or None when the peer has closed the connection. Raises
    ConnectionError if the stream is not made of our messages."""
    try:
        (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
        if size > MAX_MESSAGE:
            raise ConnectionError(f"a message of {size} bytes on the engine socket")
        return pickle.loads(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionResetError):
        return None


def send_fds(sock: socket.socket, hello: Any, fds: Sequence[int]) -> None:
    payload = pickle.dumps(hello)
    socket.send_fds(sock, [_HEADER.pack(len(payload)) + payload], list(fds))


def receive_fds(sock: socket.socket, count: int) -> Tuple[Any, List[int]]:
    data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, count)
    if len(fds) != count:
        for fd in fds:
            os.close(fd)
        raise ConnectionError(f"a front end connected with {len(fds)} of its {count} file descriptors")
    try:
        (size,) = _HEADER.unpack(data[:_HEADER.size])
        return pickle.loads(data[_HEADER.size:_HEADER.size + size]), fds
    except Exception as e:  # noqa: BLE001 - whatever unpickling raises: the connection is refused, not the engine
        for fd in fds:
            os.close(fd)
        raise ConnectionError(f"a front end's hello is unreadable: {e!r}") from e


# -- submissions and completions -------------------------------------------------------------------
PREDICT, LOOKUP, CANCEL = 1, 2, 3
RPC_KINDS = {"Predict": PREDICT, "Lookup": LOOKUP}
PINNED = 1  # flags: the client asked for exactly this version

# kind, flags, model_id, rid, version, deadline (NaN: none), batch_size, extra, ids in the model's KJT,
# stored ids, slot offset, block bytes, result offset.
SUBMIT = struct.Struct("<BBxxIQqdIIQQQQQ")
# rid, version that answered (or was asked for), error (0: OK, else 1 + index in ERRORS), times
# (time.monotonic() of admission, batch start, batch end; NaN where it never reached a batch), message.
COMPLETE = struct.Struct("<QqB7xddd200s")
MESSAGE_BYTES = 200


@dataclass
class Submission:
    kind: int
    flags: int
    model_id: int
    rid: int
    version: int
    deadline: Optional[float]
    batch_size: int
    extra: int
    ids: int  # in the model's KJT (shared bags expanded, or once): what the batch's id budget counts
    stored: int
    slot: int
    block_bytes: int
    result_at: int

    def pack(self) -> Tuple:
        return (self.kind, self.flags, self.model_id, self.rid, self.version,
                math.nan if self.deadline is None else self.deadline, self.batch_size, self.extra, self.ids,
                self.stored, self.slot, self.block_bytes, self.result_at)

    @staticmethod
    def unpack(fields: Tuple) -> "Submission":
        s = Submission(*fields)
        if s.deadline != s.deadline:  # NaN
            s.deadline = None
        return s


def clip_message(message: str) -> bytes:
    """A message as it fits a completion record (whole UTF-8 characters)."""
    return message.encode("utf-8")[:MESSAGE_BYTES].decode("utf-8", "ignore").encode("utf-8")


class Ring:
    """A single-producer single-consumer ring of fixed-size records in shared memory.

    Two uint64 counters, each on its own cache line: ``head`` (records taken, written by the
    consumer only) and ``tail`` (records put, written by the producer only), then the records. The
    producer writes a record, then advances ``tail``; the consumer reads records up to ``tail``,
    then advances ``head``: each side writes one counter, so no lock is needed."""

    CONTROL = 128

    def __init__(self, buffer: mmap.mmap, offset: int, capacity: int, record: struct.Struct) -> None:
        self.buffer, self.record, self.capacity = buffer, record, capacity
        # [0]: head, [8]: tail; a memoryview reads them as Python ints (numpy's scalars took a polling
        # round of the engine's loop a microsecond per ring).
        self._counters = memoryview(buffer)[offset:offset + 128].cast("Q")
        self._records = offset + self.CONTROL

    @staticmethod
    def nbytes(capacity: int, record: struct.Struct) -> int:
        return Ring.CONTROL + capacity * record.size

    def __len__(self) -> int:
        return self._counters[8] - self._counters[0]

    def put(self, fields: Tuple) -> bool:
        """Append a record; False if the ring is full."""
        tail = self._counters[8]
        if tail - self._counters[0] >= self.capacity:
            return False
        self.record.pack_into(self.buffer, self._records + (tail % self.capacity) * self.record.size, *fields)
        self._counters[8] = tail + 1
        return True

    def take(self) -> List[Tuple]:
        """Every record put since the last take, in order."""
        counters = self._counters
        head, tail = counters[0], counters[8]
        if head == tail:
            return []
        size, unpack, buffer, base, cap = self.record.size, self.record.unpack_from, self.buffer, self._records, self.capacity
        records = [unpack(buffer, base + (i % cap) * size) for i in range(head, tail)]
        counters[0] = tail
        return records


class Channel:
    """One front end's two rings (submissions to the engine, completions back) in one memfd, and the
    two eventfds that wake a sleeping reader. Created by the front end; opened by the engine from
    the descriptors it receives."""

    def __init__(self, capacity: int, fds: Optional[Sequence[int]] = None) -> None:
        self.capacity = capacity
        sub_bytes, done_bytes = Ring.nbytes(capacity, SUBMIT), Ring.nbytes(capacity, COMPLETE)
        self.nbytes = sub_bytes + done_bytes
        if fds is None:
            self.fd = os.memfd_create("recserve-rings", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, self.nbytes)
            self.submitted = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self.completed = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:
            self.fd, self.submitted, self.completed = fds
        self.map = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.submissions = Ring(self.map, 0, capacity, SUBMIT)
        self.completions = Ring(self.map, sub_bytes, capacity, COMPLETE)

    @property
    def fds(self) -> List[int]:
        return [self.fd, self.submitted, self.completed]

    @staticmethod
    def signal(fd: int) -> None:
        try:
            os.eventfd_write(fd, 1)
        except OSError:  # the peer is gone; its socket says so
            pass

    @staticmethod
    def drain(fd: int) -> None:
        try:
            os.eventfd_read(fd)
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        self.submissions = self.completions = None  # type: ignore[assignment]
        try:
            self.map.close()
        except BufferError:  # a view still alive: the mapping goes with the process
            pass
        for fd in self.fds:
            os.close(fd)


# -- shared memory ---------------------------------------------------------------------------------
class Arena:
    """A shared buffer with a first-fit allocator (front end side), or its mapping (engine side).

    First fit keeps the slots in use near the start, so the same pages are reused (resident and, on
    CUDA, already page-locked) instead of touching fresh ones. A new arena is written once over its
    whole length (``touch``), so no request pays the first-touch page faults of its pages."""

    def __init__(self, size: int, fd: Optional[int] = None) -> None:
        self.size = size
        self.fd = os.memfd_create("recserve-arena", os.MFD_CLOEXEC) if fd is None else fd
        if fd is None:
            os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.bytes = np.frombuffer(self.map, np.uint8)
        self._free: List[Tuple[int, int]] = [(0, size)]  # (offset, size), sorted by offset
        self._used: Dict[int, int] = {}
        self.used_bytes = 0

    def touch(self) -> None:
        """Fault every page in now (memfd pages are shared: the engine's mapping finds them resident)."""
        self.bytes[::mmap.PAGESIZE] = 0

    def alloc(self, nbytes: int) -> Optional[int]:
        """Offset of a free slot of ``nbytes`` (aligned), or None if none is free."""
        nbytes = aligned(max(nbytes, 1))
        for i, (offset, size) in enumerate(self._free):
            if size >= nbytes:
                if size == nbytes:
                    del self._free[i]
                else:
                    self._free[i] = (offset + nbytes, size - nbytes)
                self._used[offset] = nbytes
                self.used_bytes += nbytes
                return offset
        return None

    def fits(self, nbytes: int) -> bool:
        """Whether :meth:`alloc` would find a slot of ``nbytes`` now."""
        nbytes = aligned(max(nbytes, 1))
        return any(size >= nbytes for _, size in self._free)

    def free(self, offset: int) -> None:
        nbytes = self._used.pop(offset)
        self.used_bytes -= nbytes
        i = bisect.bisect_left(self._free, (offset, 0))
        self._free.insert(i, (offset, nbytes))
        # Coalesce with the neighbours.
        if i + 1 < len(self._free) and offset + nbytes == self._free[i + 1][0]:
            self._free[i] = (offset, nbytes + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]

    def slot(self, offset: int, nbytes: int) -> np.ndarray:
        """uint8 view of ``nbytes`` at ``offset``."""
        return self.bytes[offset:offset + nbytes]

    def result(self, offset: int, shape: Tuple[int, ...]) -> np.ndarray:
        """float32 view of a result."""
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self.map, np.float32, count=count, offset=offset).reshape(shape)

    def close(self) -> None:
        self.bytes = None  # type: ignore[assignment]
        try:
            self.map.close()
        except BufferError:  # views still alive (a late reader): the mapping goes with the process
            pass
        os.close(self.fd)
