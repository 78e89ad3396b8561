"""Triton's system shared memory extension, for clients on the server's host (``serve
--shared-memory system``): a client puts a tensor in a POSIX shared-memory object (``shm_open``: a
file of /dev/shm), registers a range of it as a named region, and names the region in its requests
instead of sending the bytes; the server reads inputs from, and writes outputs into, that range.
perf_analyzer (``--shared-memory system``) and ``tritonclient.utils.shared_memory`` work this way.

Every front end answers: the regions are the server's, kept in one small JSON file in the server's
private directory, changed under a lock (``fcntl.flock``) and replaced whole (``os.replace``), so a
front end sees another's registration at its next request (one ``stat`` of the file before a
request's inputs are read, one before its outputs are written: :meth:`SharedMemory.refresh`).

Unregistering applies to the requests that come after it, as in Triton's server (since 2.53,
containers 24.12; before, unregistering a region in use failed): a request that names the region then
is refused (NOT_FOUND, Triton's code for an unknown region), and the name can be registered again at
once. A request in flight keeps what it was checked against: its inputs were read (copied) before
the model runs, and its outputs' places checked and pinned (:meth:`SharedMemory.reserve`), so each
output is written into that registration (that object and range, never one registered since under the
name), the front end keeping the object's file open until the request ends
(:meth:`SharedMemory.release`). Triton differs in two ways, on purpose: its status still lists the
region, and new requests still use it, until its requests in flight end, and registering the name
again fails meanwhile (ALREADY_EXISTS); here what a request gets does not depend on what else is in
flight.

Reading and writing go through ``os.preadv`` / ``os.pwrite`` on the object's file, never a mapping:
a client that truncates the object under the server gets a short read (the input's error), not a
SIGBUS that would take the front end down (Triton maps regions: a truncated object, or a /dev/shm
that is full when the server's write reaches a page the client never touched, would be one there).
An output is not written past the object's end as it was just before the write (``fstat``): a
truncation that lands between that check and the write cannot be kept out (pwrite extends a file,
and none of its flags does otherwise), so the object may be grown back, to the end of the output's
range and never further (within what was registered), and the request's answer is then the same
error as for an object found short. A write that finds no space (the file system of /dev/shm full: a
page the client never wrote is allocated by the server's write) is RESOURCE_EXHAUSTED, another
failed read or write INTERNAL, each with a message naming the region; a short write is carried on,
never taken as done. What is read is the front end's private copy, so the checks that follow hold
for the bytes the engine gets, whatever the client writes meanwhile. A region's file is opened once
per front end and registration (``O_NOFOLLOW``, a regular file of /dev/shm only): keep the object
until it is unregistered. Every front end closes it within a second of that, requests or none
(serving/frontend/main.py refreshes each half second), or when its last request in flight that
writes there ends, so that an object its client then unlinks is freed.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import stat
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Tuple

import numpy as np

from serving.errors import AlreadyExists, InvalidInput, NoSpace, NotFound, SharedMemoryFailed, TooLarge, Unsupported

log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
REGISTRY = "shm-regions.json"
MAX_REGIONS = 256  # each is an open file in every front end that uses it
KEY_RE = re.compile(r"/?[^/\x00]{1,255}")  # shm_open's names: one path component of /dev/shm
MAX_NAME_BYTES = 255  # a region's name, as a key: every front end reads the registry whole at each change
# Parameters of an input or a requested output that place it in a region (Triton's names).
REGION, BYTE_SIZE, OFFSET = "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"
OFF = "system shared memory is off on this server (start it with `recserve serve --shared-memory system`)"


@dataclass(frozen=True)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    serial: str  # this registration (a name registered again is another region)


@dataclass(frozen=True)
class Placement:
    """Where an input or output lies: (region name, bytes, offset into the region)."""

    region: str
    byte_size: int
    offset: int = 0
    serial: str = ""  # the registration an output was checked against and pinned to (:meth:`SharedMemory.reserve`)


def placement(parameters: Dict[str, object], what: str, has_data: bool = False) -> Optional[Placement]:
    """The region an input's or output's parameters name, or None (not in shared memory).
    ``has_data``: the input also carries its data in the request (refused, as Triton does: which of
    the two was meant cannot be told)."""
    region = parameters.get(REGION)
    if region is None:
        return None
    if has_data:
        raise InvalidInput(f"{what}: its data is both in the request and in shared memory region "
                           f"{str(region)[:64]!r}; send it one way")
    size, offset = parameters.get(BYTE_SIZE), parameters.get(OFFSET, 0)
    if not isinstance(region, str) or type(size) is not int or type(offset) is not int:
        raise InvalidInput(f"{what}: {REGION} is a string, {BYTE_SIZE} and {OFFSET} are int64 parameters")
    if size < 0 or offset < 0:
        raise InvalidInput(f"{what}: {BYTE_SIZE} and {OFFSET} cannot be negative")
    return Placement(region, size, offset)


class SharedMemory:
    """The registered regions as one front end uses them (``directory`` None: the extension is off)."""

    def __init__(self, directory: Optional[str]) -> None:
        self.enabled = directory is not None
        self._path = os.path.join(directory, REGISTRY) if directory else ""
        self._stamp: Optional[Tuple[int, int, int]] = None
        self._taken = None  # the registry file last taken, kept open: its inode number is not reused
        self._regions: Dict[str, Region] = {}
        self._files: Dict[str, int] = {}  # serial -> the object's open file
        # serial -> (its registration, requests in flight that will write there): kept open, whatever
        # the registry says meanwhile, until the last of them ends (:meth:`reserve`, :meth:`release`)
        self._pinned: Dict[str, Tuple[Region, int]] = {}

    # -- the extension's operations ------------------------------------------------------------
    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._require()
        if not name:
            raise InvalidInput("a shared memory region needs a name")
        name_bytes = len(name.encode("utf-8", "surrogatepass"))
        if name_bytes > MAX_NAME_BYTES:
            raise InvalidInput(f"a shared memory region name is at most {MAX_NAME_BYTES} bytes (UTF-8); this one "
                               f"has {name_bytes}")
        fd = _open(key)
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise InvalidInput(f"shared memory region {name!r}: offset {offset} + byte_size {byte_size} is past "
                                   f"the end of {key!r} ({size} bytes)")
            with self._locked():
                regions = self._read()
                if name in regions:
                    raise AlreadyExists(f"shared memory region {name!r} is registered already; unregister it first")
                if len(regions) >= MAX_REGIONS:
                    raise TooLarge(f"{MAX_REGIONS} shared memory regions are registered; unregister some first")
                region = Region(name, key, offset, byte_size, uuid.uuid4().hex)
                regions[name] = region
                self._write(regions)
        except BaseException:
            os.close(fd)
            raise
        self._files[region.serial] = fd
        self.refresh()

    def unregister(self, name: str) -> None:
        """Forget a region (name "": every region); an unknown name is no error (as Triton answers)."""
        self._require()
        with self._locked():
            regions = self._read()
            if name:
                regions.pop(name, None)
            else:
                regions.clear()
            self._write(regions)
        self.refresh()

    def status(self, name: str) -> List[Region]:
        self._require()
        self.refresh()
        if not name:
            return sorted(self._regions.values(), key=lambda r: r.name)
        if name not in self._regions:
            raise NotFound(f"no shared memory region {name!r} is registered")
        return [self._regions[name]]

    # CUDA shared memory is not served (a region would be another process's device memory); clients
    # that clear every region at start and exit (perf_analyzer) find none and succeed.
    def cuda_register(self) -> None:
        self._require()
        raise Unsupported("CUDA shared memory is not served; use system shared memory")

    def cuda_status(self, name: str) -> List[Region]:
        self._require()
        if name:
            raise NotFound(f"no CUDA shared memory region {name!r} is registered")
        return []

    def cuda_unregister(self, name: str) -> None:
        self._require()

    # -- requests --------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Take the registry again if any front end changed it (one ``stat``), and close the files
        of regions gone. A request calls it once before reading its inputs and once before writing
        its outputs: :meth:`read` and :meth:`write` use the registry as of the last call, in the same
        synchronous step (another request's refresh may close a file once this one awaits)."""
        if not self.enabled:
            return
        try:
            st = os.stat(self._path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp and stamp is not None:
            return
        self._regions, self._stamp = self._take()
        serials = {r.serial for r in self._regions.values()}
        for serial in [s for s in self._files if s not in serials and s not in self._pinned]:
            os.close(self._files.pop(serial))

    def read(self, where: Placement, what: str, most_bytes: int) -> np.ndarray:
        """A private copy of an input's bytes (at most ``most_bytes``: the server's limit for it), in
        memory not zeroed first (a 5 MB input: no pass over it before the read's)."""
        if where.byte_size > most_bytes:
            raise InvalidInput(f"{what}: {where.byte_size} bytes in shared memory, more than the {most_bytes} the "
                               "server takes for it; split the request")
        fd, start = self._locate(where, what)
        data = np.empty(where.byte_size, np.uint8)
        try:
            got = os.preadv(fd, [data], start)
        except OSError as e:
            raise _failed("read", where, what, e) from None
        if got != where.byte_size:
            raise _shrunk(where, what)
        return data

    def reserve(self, where: Placement, nbytes: int, what: str) -> Placement:
        """An output's placement checked before the model runs (its region registered, the range inside
        it, ``nbytes`` fitting), pinned to the region's registration: :meth:`write` writes there only,
        whether the region is unregistered (or registered again) meanwhile or not, and its file stays
        open until :meth:`release` (call it once the request ends, whatever its outcome)."""
        self.refresh()
        self._locate(where, what)
        _fits(where, nbytes, what)
        region = self._regions[where.region]
        _, count = self._pinned.get(region.serial, (region, 0))
        self._pinned[region.serial] = (region, count + 1)
        return replace(where, serial=region.serial)

    def release(self, places: Dict[str, Placement]) -> None:
        """The end of a request whose outputs :meth:`reserve` pinned (``places``; those not pinned, as
        when a check failed, are passed over): a registration gone meanwhile has its file closed once
        no request in flight holds it."""
        for where in places.values():
            if where.serial not in self._pinned:
                continue
            region, count = self._pinned.pop(where.serial)
            if count > 1:
                self._pinned[where.serial] = (region, count - 1)
            elif self._regions.get(region.name) != region and where.serial in self._files:
                os.close(self._files.pop(where.serial))  # unregistered meanwhile: no later request uses it

    def write(self, where: Placement, array: np.ndarray, what: str) -> None:
        """An output into its place: the registration :meth:`reserve` pinned it to (unregistered since
        or not), or, not pinned, the region's registration as of the last :meth:`refresh`."""
        _fits(where, array.nbytes, what)
        if where.serial in self._pinned:
            region = self._pinned[where.serial][0]
            fd, start = self._files[where.serial], region.offset + where.offset
        else:
            fd, start = self._locate(where, what)
        end = start + array.nbytes
        try:
            before = os.fstat(fd).st_size
            if before < end:  # pwrite would grow the object back
                raise _shrunk(where, what)
            data = memoryview(np.ascontiguousarray(array)).cast("B")
            at = start
            while at < end:  # a short write (a file system filling up) is not the whole output
                written = os.pwrite(fd, data[at - start:], at)
                if not written:  # not for a regular file; never loop on it
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                at += written
            after = os.fstat(fd).st_size
        except OSError as e:
            raise _failed("write", where, what, e) from None
        if after <= end < before:  # truncated into the range while it was written (and grown back to its end)
            raise _shrunk(where, what)

    # -- internals -------------------------------------------------------------------------------
    def _require(self) -> None:
        if not self.enabled:
            raise Unsupported(OFF)

    def _locate(self, where: Placement, what: str) -> Tuple[int, int]:
        """(the region's file, where the placement starts in it), as of the last :meth:`refresh`."""
        if not self.enabled:
            raise InvalidInput(f"{what}: {OFF}")
        region = self._regions.get(where.region)
        if region is None:  # NOT_FOUND, as Triton answers (its status of an unknown name too)
            raise NotFound(f"{what}: no shared memory region {where.region!r} is registered")
        if where.offset + where.byte_size > region.byte_size:
            raise InvalidInput(f"{what}: offset {where.offset} + byte_size {where.byte_size} is past the end of "
                               f"shared memory region {where.region!r} ({region.byte_size} bytes)")
        fd = self._files.get(region.serial)
        if fd is None:
            try:
                fd = _open(region.key)
            except InvalidInput as e:
                raise InvalidInput(f"{what}: shared memory region {where.region!r}: {e}") from None
            self._files[region.serial] = fd
        return fd, region.offset + where.offset

    def _read(self) -> Dict[str, Region]:
        try:
            with open(self._path, "rb") as f:
                return _regions(f)
        except FileNotFoundError:
            return {}

    def _take(self) -> Tuple[Dict[str, Region], Optional[Tuple[int, int, int]]]:
        """The registry and its stamp, its file kept open until the next is taken: a file system that
        gives a freed inode number to the next file (ext4), with a clock coarser than the calls, would
        otherwise give a later registry of the same size this one's stamp."""
        if self._taken is not None:
            self._taken.close()
            self._taken = None
        try:
            self._taken = open(self._path, "rb")
        except FileNotFoundError:
            return {}, None
        st = os.fstat(self._taken.fileno())
        return _regions(self._taken), (st.st_ino, st.st_mtime_ns, st.st_size)

    def _write(self, regions: Dict[str, Region]) -> None:
        temporary = f"{self._path}.{os.getpid()}"
        with open(temporary, "w") as f:
            json.dump([asdict(r) for r in regions.values()], f)
        os.replace(temporary, self._path)

    @contextmanager
    def _locked(self):
        with open(self._path + ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield


def _regions(registry) -> Dict[str, Region]:
    return {r["name"]: Region(**r) for r in json.load(registry)}


def _fits(where: Placement, nbytes: int, what: str) -> None:
    if nbytes > where.byte_size:
        raise InvalidInput(f"{what}: its {nbytes} bytes do not fit the {where.byte_size} bytes of shared memory given "
                           "for it")


def _shrunk(where: Placement, what: str) -> InvalidInput:
    return InvalidInput(f"{what}: shared memory region {where.region!r} is shorter than registered")


def _failed(action: str, where: Placement, what: str, e: OSError) -> Exception:
    """A read or write of a region that the kernel refused: no space (the client's object is in a full
    /dev/shm) is RESOURCE_EXHAUSTED, anything else (EIO) INTERNAL, logged; both say which region."""
    message = f"{what}: cannot {action} shared memory region {where.region!r}: {e.strerror or e}"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace(f"{message} (the file system of {SHM_DIR} is full: free space there, or write the region's "
                       "pages once when creating it)")
    log.error("%s", message)
    return SharedMemoryFailed(message)


def _open(key: str) -> int:
    """The open file of a POSIX shared-memory object (shm_open's name: "/name" or "name")."""
    if not KEY_RE.fullmatch(key) or key.lstrip("/") in (".", "..") or not _encodable(key):
        raise InvalidInput(f"shared memory key {key[:64]!r} is not a POSIX shared memory name ('/name': no "
                           "other '/', at most 255 characters)")
    path = os.path.join(SHM_DIR, key.lstrip("/"))
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise InvalidInput(f"cannot open shared memory {key!r}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidInput(f"shared memory {key!r} is not a shared memory object")
    return fd


def _encodable(key: str) -> bool:
    """A name the file system can be given (JSON can carry lone surrogates, which no file name holds)."""
    try:
        key.encode()
    except UnicodeEncodeError:
        return False
    return True


NO_SHARED_MEMORY = SharedMemory(None)  # the extension off
