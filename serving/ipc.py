"""How front ends and the engine talk: payloads through shared memory, descriptors through a socket.

Each front end owns one :class:`Arena`: a memfd (anonymous shared memory, not bounded by the size
of /dev/shm) that it maps and that the engine maps too, after receiving the file descriptor over
the Unix socket (SCM_RIGHTS). A request's arrays are copied once, from the received gRPC bytes into
a slot of the arena; its result is written by the engine into the same slot. On CUDA the engine
page-locks the whole arena (cudaHostRegister), so that the GPU reads requests from and writes
results to it by DMA: there is no other host copy. The front end frees a slot when the engine has
answered its request, so a slot is never reused while the engine can still read or write it.

Over the socket travel only small messages (:class:`Infer`, :class:`Cancel`, :class:`Done`,
:class:`Models`, :class:`Fatal`): length-prefixed pickles of a few hundred bytes. Why not pyzmq or
multiprocessing queues: one stream per front end needs neither routing nor brokers, asyncio reads
it without a thread, and passing the memfd needs a Unix socket anyway.
"""
from __future__ import annotations

import asyncio
import bisect
import mmap
import os
import pickle
import socket
import struct
import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from recserve.manifest import Manifest

_HEADER = struct.Struct("<I")
MAX_MESSAGE = 64 << 20  # descriptors are small; the models state of a large server is the largest
ALIGN = 256  # every array starts aligned (DMA and vector loads like it)


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



# -- messages ------------------------------------------------------------------------------------
@dataclass
class ArrayRef:
    """An array in an arena."""

    offset: int
    dtype: str
    shape: Tuple[int, ...]


@dataclass
class Infer:
    """Front end -> engine: run one validated request. Its arrays are in the sender's arena."""

    rid: int
    rpc: str  # "Predict" | "Lookup"
    model: str
    version: int  # the version whose schema the request was validated against
    pinned: bool  # the client asked for exactly that version
    deadline: Optional[float]  # time.monotonic() (system-wide), by which it must have started
    keys: Tuple[str, ...]
    positions: Tuple[int, ...]  # each key's index among the model's features
    totals: ArrayRef  # int64 [K + S]: ids per key, then per shared key
    batch_size: int
    in_model_order: bool  # every model feature, in model order
    lengths: ArrayRef  # int32 [K, B]
    values: ArrayRef  # int32 or int64 [N + M]: the keys' ids, then the shared bags' (one array)
    dense: Optional[ArrayRef]  # float32 [B, F] (Predict)
    shared_keys: Tuple[str, ...]  # shared features: one bag each for every sample
    shared_positions: Tuple[int, ...]
    out: ArrayRef  # float32 [B] (Predict) or [B, columns] (Lookup): where the engine writes the result


@dataclass
class Cancel:
    """Front end -> engine: the client of request ``rid`` is gone; drop it if it has not started."""

    rid: int


@dataclass
class Done:
    """Engine -> front end: request ``rid`` is answered; result in its ``out`` unless ``error``."""

    rid: int
    version: int
    error: Optional[Tuple[str, str]] = None  # (ServingError subclass name, message)
    # time.monotonic() of admission, batch start and batch end, for the request's spans
    # (serving/frontend/tracing.py); None where it never reached a batch.
    times: Optional[Tuple[float, float, float]] = None


@dataclass
class ModelState:
    """What a front end needs of a model to validate and answer: its schema and its GetModelInfo."""

    version: int  # the version that takes new requests
    schema: Any  # serving.frontend.validate.Schema
    info: bytes  # serialized recserve.v1.ModelInfo


@dataclass
class Models:
    """Engine -> front ends, on every change: the models served and whether the engine is ready."""

    ready: bool
    models: Dict[str, ModelState]


@dataclass
class Fatal:
    """Engine -> front ends: the engine is going down (device lost); answer UNAVAILABLE and exit."""

    message: str
    exit_code: int


def send_nowait(writer: asyncio.StreamWriter, message: Any) -> None:
    """Queue a message without waiting for the socket: the peer reads continuously, and a request's
    descriptor is a few hundred bytes (asyncio buffers what the socket does not take at once)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_HEADER.pack(len(payload)) + payload)


async def receive(reader: asyncio.StreamReader) -> Any:
    """The next message, or None when the peer has closed the connection."""
    try:
        (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
        if size > MAX_MESSAGE:
            raise ConnectionError(f"message of {size} bytes on the engine socket")
        return pickle.loads(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionResetError):
        return None


# -- shared memory ---------------------------------------------------------------------------------
class Arena:
    """A shared buffer with a first-fit allocator (front end side), or its mapping (engine side).

    First fit keeps the slots in use near the start, so the same pages are reused (resident and, on
    CUDA, already page-locked) instead of touching fresh ones."""

    def __init__(self, size: int, fd: Optional[int] = None) -> None:
        self.size = size
        self.fd = os.memfd_create("recserve-arena", os.MFD_CLOEXEC) if fd is None else fd
        if fd is None:
            os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._free: List[Tuple[int, int]] = [(0, size)]  # (offset, size), sorted by offset
        self._used: Dict[int, int] = {}

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
                return offset
        return None

    def free(self, offset: int) -> None:
        nbytes = self._used.pop(offset)
        i = bisect.bisect_left(self._free, (offset, 0))
        self._free.insert(i, (offset, nbytes))
        # Coalesce with the neighbours.
        if i + 1 < len(self._free) and offset + nbytes == self._free[i + 1][0]:
            self._free[i] = (offset, nbytes + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]

    def array(self, ref: ArrayRef) -> np.ndarray:
        """A writable numpy view of an array in the arena."""
        dtype = np.dtype(ref.dtype)
        count = int(np.prod(ref.shape, dtype=np.int64))
        return np.frombuffer(self.map, dtype=dtype, count=count, offset=ref.offset).reshape(ref.shape)

    def put(self, offset: int, array: np.ndarray, dtype: Optional[str] = None) -> ArrayRef:
        """Copy ``array`` (converted to ``dtype`` if given: the caller checked that it fits) to ``offset``."""
        ref = ArrayRef(offset, dtype or array.dtype.name, tuple(array.shape))
        np.copyto(self.array(ref), array, casting="unsafe")
        return ref

    def put_joined(self, offset: int, arrays: Sequence[np.ndarray], dtype: str) -> ArrayRef:
        """1-D ``arrays`` back to back at ``offset``, as one array of ``dtype`` (which holds every value)."""
        ref = ArrayRef(offset, dtype, (sum(a.shape[0] for a in arrays),))
        target, start = self.array(ref), 0
        for a in arrays:
            np.copyto(target[start:start + a.shape[0]], a, casting="safe")
            start += a.shape[0]
        return ref

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # views still alive (a late reader): the mapping goes with the process
            pass
        os.close(self.fd)


def send_fd(sock: socket.socket, hello: Any, fd: int) -> None:
    payload = pickle.dumps(hello)
    socket.send_fds(sock, [_HEADER.pack(len(payload)) + payload], [fd])


def receive_fd(sock: socket.socket) -> Tuple[Any, int]:
    data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 1)
    if not fds:
        raise ConnectionError("a front end connected without its shared buffer")
    (size,) = _HEADER.unpack(data[:_HEADER.size])
    return pickle.loads(data[_HEADER.size:_HEADER.size + size]), fds[0]
