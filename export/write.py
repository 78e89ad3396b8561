"""Writing an artifact version atomically: into a dot-named work directory, then one rename.

A reader of the repository (the server polls it) never sees a half-written version, and a failed
export leaves nothing behind. An export that dies without cleaning up (SIGKILL, a power cut) leaves
its work directory, and the next export of that model removes it: each export holds a lock on its
own work directory for as long as it runs, so a directory whose lock can be taken is a dead one's.
"""
from __future__ import annotations

import errno
import fcntl
import io
import logging
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from recserve.errors import UserError

log = logging.getLogger(__name__)

# ``.VERSION.incomplete-PID``: the work directory of an export in progress, or of one that died.
WORK_DIR_RE = re.compile(r"^\.[0-9]+\.incomplete-[0-9]+\Z")


# torch.jit.save and torch.save into a path write from C++, where a failed write (a full disk)
# aborts the process (TorchScript) or becomes an opaque "unexpected pos" RuntimeError (torch.save).
# Serialised in memory and written by Python, the same failure is an OSError that staged() reports;
# the price is one more copy of the file in memory while it is written.

def save_module(module: torch.jit.ScriptModule, path: Path) -> None:
    with open(path, "wb") as f:
        torch.jit.save(module, f)


def save_tensors(obj: Any, path: Path) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    path.write_bytes(buffer.getbuffer())


def _is_open_dir(path: Path, fd: int) -> bool:
    """Whether ``path`` is still the directory ``fd`` was opened on (not removed, not renamed away)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (opened.st_dev, opened.st_ino)


def _create_locked(work: Path) -> int:
    """Create ``work`` and return an fd holding its lock until closed (or this process dies)."""
    while True:
        work.mkdir()
        fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            # A filesystem that cannot lock directories: no other export can take this lock either,
            # so remove_dead_work_dirs leaves the directory alone.
            return fd
        if _is_open_dir(work, fd):
            return fd
        # Between mkdir and flock another export took the directory for a dead one and removed it.
        os.close(fd)


def remove_dead_work_dirs(model_dir: Path) -> None:
    """Remove the work directories of exports that died: those whose lock nobody holds."""
    for path in model_dir.iterdir():
        if WORK_DIR_RE.match(path.name):
            _remove_if_dead(path)


def _remove_if_dead(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return  # gone meanwhile: its export finished
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        dead = _is_open_dir(path, fd)
    except OSError:
        dead = False  # held by a running export (or on a filesystem that cannot lock directories)
    try:
        if dead:
            shutil.rmtree(path)
            log.info("removed %s, left by an export that died", path)
    except OSError as e:
        log.warning("cannot remove %s, left by an export that died: %s", path, e)
    finally:
        os.close(fd)


def _sync_directory(path: Path) -> None:
    """fsync a directory after the version was renamed into it: a failure is no reason to call the
    export failed (the version is complete and visible), only to say it may not survive a power cut."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("cannot sync %s to disk (%s): a power cut may lose the version just written", path, e)


@contextmanager
def staged(target: Path) -> Iterator[Path]:
    """Yield a work directory beside ``target``; rename it into place if the block succeeds,
    remove it (and directories this created) if not. A failed write (a full disk) is a UserError."""
    created = [p for p in (target.parent.parent, target.parent) if not p.exists()]
    work = target.parent / f".{target.name}.incomplete-{os.getpid()}"
    lock = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_work_dirs(target.parent)
        lock = _create_locked(work)
        yield work
        # Durable before it is visible: the files, then their names (the directory), then the rename.
        for f in work.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        os.fsync(lock)
        try:
            os.rename(work, target)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):  # an empty directory is replaced: no one's version
                raise UserError(f"{target} was written by another export while this one ran; nothing of this one "
                                "was kept: pass another --version or leave it out for the next one") from e
            raise UserError(f"cannot move the export into {target}: {e}") from e
        _sync_directory(target.parent)
    except BaseException as e:
        if lock is not None:
            shutil.rmtree(work, ignore_errors=True)
        for p in reversed(created):
            try:
                p.rmdir()
            except OSError:
                pass
        if isinstance(e, OSError):
            raise UserError(f"writing {target} failed: {e}; nothing was saved: free disk space (or fix "
                            "permissions) there and export again") from e
        raise
    finally:
        if lock is not None:
            os.close(lock)
