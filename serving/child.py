"""What every child process of the server (engine, front ends) does first."""
from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import logging
import multiprocessing
import os
import shutil
import signal
import sys
from typing import Optional

from serving.config import ServerConfig

log = logging.getLogger("serving.child")
# glibc's mallopt parameters: blocks of at least this size get their own mapping (default: 128 KiB,
# raised by glibc up to 32 MiB as such blocks are freed), and free memory at the heap's top beyond
# this is given back to the system.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest on 64-bit
TRIM_THRESHOLD_BYTES = 256 << 20
PR_SET_PDEATHSIG = 1  # prctl(2)


def child_setup(level: str, config: ServerConfig, role: str, workdir: Optional[str] = None) -> None:
    """Logging (the supervisor's level and format), a short GIL switch interval (each process has an
    event loop and helper threads, gRPC's poller, the engine's finish thread, that hand work to each
    other; with the default 5 ms a thread that was woken can wait that long for the interpreter),
    the allocator's thresholds (:func:`keep_large_blocks`), and a share of the server's working folder
    ``workdir`` (:func:`leave_workdir`)."""
    from recserve.logs import setup_logging

    sys.setswitchinterval(0.0002)
    # Ctrl-C reaches every process of the terminal's group: only the supervisor acts on it, and stops
    # the front ends (drain) before the engines with SIGTERM, as it does on its own SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The supervisor starts each child with SIGINT blocked (serving/supervisor.py _sigint_ignored) and
    # the mask survives exec: unblocked here, or every thread and process this one starts inherits it.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    setup_logging(level, config.log_format, role)
    keep_large_blocks()
    if workdir is not None:
        _hold_workdir(workdir)
    stop_with_parent()


_workdir: Optional[tuple] = None  # (path, descriptor holding a shared flock on it) of this child


def hold_workdir(path: str) -> Optional[int]:
    """A shared lock on a server's working folder, held while the returned descriptor stays open (the
    kernel drops it when the process ends, however it ends): the supervisor and every child hold one,
    and a folder that nobody holds is nobody's (serving/supervisor.py). None if the folder is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _hold_workdir(path: str) -> None:
    """This child's lock for its life: :func:`leave_workdir` takes it exclusively only when no other
    child holds it any more."""
    global _workdir
    fd = hold_workdir(path)
    if fd is not None:  # None: the supervisor died and the last child removed it; we stop too (stop_with_parent)
        _workdir = (path, fd)


def leave_workdir() -> None:
    """Call last. The supervisor removes the working folder (engine sockets, metric files,
    shm-regions.json) when it stops; if it was killed (SIGKILL, the OOM killer), the last of its
    children to stop does, and none before (the others still use it)."""
    global _workdir
    parent = multiprocessing.parent_process()
    if _workdir is None or parent is None or os.getppid() == parent.pid:  # the supervisor is alive: it removes it
        return
    path, fd = _workdir
    _workdir = None
    try:  # a conversion to exclusive drops our shared lock first: of two children leaving at once, one wins
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # another child still holds it: the last one removes it
        return
    shutil.rmtree(path, ignore_errors=True)  # does not follow symlinks inside it
    os.close(fd)


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def stop_with_parent() -> bool:
    """Have the kernel send this process SIGTERM when the supervisor dies (SIGKILL, the OOM killer):
    an engine or front end must not serve on without it (no /metrics, no exit policy, the port kept).
    If it died before this call, stop now. False where prctl is missing (not Linux)."""
    parent = multiprocessing.parent_process()
    try:
        prctl = _libc().prctl
    except (OSError, AttributeError):
        return False
    if prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent.pid:
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def keep_large_blocks() -> bool:
    """Make glibc's malloc serve blocks up to 32 MiB from its heaps and keep what is freed there (up
    to 256 MiB at a heap's top) for the next request. By default it maps each block of 128 KiB or
    more anew (raising that as such blocks are freed) and gives back free memory beyond twice that
    at a heap's top: a front end with several B=4096 requests at once (each several 5 MB blocks:
    gRPC's received message, protobuf's copy of it, the arrays read from it) keeps returning pages
    and faulting them in again on first touch, which on the GPU machines (VMs) costs milliseconds
    per request (docs/benchmarks.md, "Large blocks kept"). False where the C library has no
    ``mallopt`` (not glibc): nothing changes."""
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not done:
        log.warning("the C library refused the allocator thresholds (mallopt); large requests map fresh memory")
    return done
