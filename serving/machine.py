"""What this machine gives the server: its cores and memory as a container sees them.

`os.cpu_count()` and the physical pages are the host's: in a container limited to 4 cores of a
64-core host, 8 front ends and 56 engine threads would share 4 cores. The cores are this process's
CPU affinity (cpuset) capped by a cgroup CPU quota; the memory is the physical memory capped by a
cgroup memory limit. The limits are read on the process's cgroup and each of its ancestors (a parent's
limit binds its children), in cgroup v2 and in v1 alike: on a v1 host the process's cgroup (a systemd
unit's, say) sits below the hierarchy's root, where no limit is ever set; in a v1 container the path
is the host's, absent from the container's mount, and the mount's root is the container's cgroup.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterator, List, Optional

CGROUP_ROOT = Path("/sys/fs/cgroup")
_V1_MOUNTS = {"cpu": ("cpu,cpuacct",)}  # v1 hierarchies of a controller, under other names than its own


def usable_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """Cores this process may use: its affinity, at most the cgroup CPU quota rounded up; at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quotas = [quota / period for quota, period in _cpu_quotas(root, proc_cgroup) if quota > 0 and period > 0]
    return max(1, min([cores] + [math.ceil(q) for q in quotas]))


def usable_memory(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """Bytes of memory this process's cgroup may hold: the physical memory, at most the cgroup limits."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min([physical] + [limit for limit in _memory_limits(root, proc_cgroup) if limit > 0])


def _lines(proc_cgroup: Path) -> List[str]:
    try:
        return proc_cgroup.read_text().splitlines()
    except OSError:
        return []


def _walk(mount: Path, path: str) -> Iterator[Path]:
    """mount/path, then each of its ancestors up to the mount itself (never above it)."""
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if ".." in parts:  # not a cgroup path the kernel writes: the mount alone
        parts = []
    for i in range(len(parts), -1, -1):
        yield mount.joinpath(*parts[:i])


def _v2_dirs(root: Path, proc_cgroup: Path) -> Iterator[Path]:
    """The process's cgroup v2 directory and its ancestors up to the mount (the unified line "0::/path")."""
    for line in _lines(proc_cgroup):
        if line.startswith("0::"):
            yield from _walk(root, line[3:])
            return


def _v1_dirs(root: Path, proc_cgroup: Path, controller: str) -> Iterator[Path]:
    """A cgroup v1 controller's directories of this process: its cgroup ("4:cpu,cpuacct:/system.slice/x")
    and each ancestor up to the hierarchy's mount, under the mount's name ("cpu,cpuacct") and the
    controller's ("cpu", a link to it where they are mounted together). Without such a line, the mounts."""
    for line in _lines(proc_cgroup):
        fields = line.split(":", 2)
        if len(fields) == 3 and controller in fields[1].split(","):
            for name in dict.fromkeys((fields[1], controller)):
                yield from _walk(root / name, fields[2])
            return
    yield from (root / name for name in dict.fromkeys((controller, *_V1_MOUNTS.get(controller, ()))))


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _cpu_quotas(root: Path, proc_cgroup: Path) -> Iterator[tuple[int, int]]:
    for directory in _v2_dirs(root, proc_cgroup):  # "max 100000" (no limit) or "200000 100000"
        fields = (_read(directory / "cpu.max") or "").split()
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            yield int(fields[0]), int(fields[1])
    for directory in _v1_dirs(root, proc_cgroup, "cpu"):  # -1: no limit
        quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
        if quota and period and quota.lstrip("-").isdigit() and period.isdigit():
            yield int(quota), int(period)


def _memory_limits(root: Path, proc_cgroup: Path) -> Iterator[int]:
    for directory in _v2_dirs(root, proc_cgroup):  # "max" or bytes
        value = _read(directory / "memory.max")
        if value and value.isdigit():
            yield int(value)
    for directory in _v1_dirs(root, proc_cgroup, "memory"):  # no limit reads as about 2**63
        value = _read(directory / "memory.limit_in_bytes")
        if value and value.isdigit():
            yield int(value)
        if _read(directory.parent / "memory.use_hierarchy") == "0":  # (kernels before 5.11) the parent's
            break  # limit does not take in its children
