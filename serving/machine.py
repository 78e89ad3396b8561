"""What this machine gives the server: its cores and memory as a container sees them.

`os.cpu_count()` and the physical pages are the host's: in a container limited to 4 cores of a
64-core host, 8 front ends and 56 engine threads would share 4 cores. The cores are this process's
CPU affinity (cpuset) capped by a cgroup CPU quota; the memory is the physical memory capped by a
cgroup memory limit. cgroup v2 limits are read on the process's cgroup and each of its ancestors (a
parent's limit binds its children); cgroup v1 ones where a container mounts them.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterator, Optional

CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """Cores this process may use: its affinity, at most the cgroup CPU quota rounded up; at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quotas = [quota / period for quota, period in _cpu_quotas(root, proc_cgroup) if quota > 0 and period > 0]
    return max(1, min([cores] + [math.ceil(q) for q in quotas]))


def usable_memory(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """Bytes of memory this process's cgroup may hold: the physical memory, at most the cgroup limits."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min([physical] + [limit for limit in _memory_limits(root, proc_cgroup) if limit > 0])


def _v2_dirs(root: Path, proc_cgroup: Path) -> Iterator[Path]:
    """The process's cgroup v2 directory and its ancestors up to the mount (the unified line "0::/path")."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        if line.startswith("0::"):
            directory = root / line[3:].lstrip("/")
            while True:
                yield directory
                if directory == root or root not in directory.parents:
                    return
                directory = directory.parent


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
    for v1 in ("cpu", "cpu,cpuacct"):  # -1: no limit
        quota, period = _read(root / v1 / "cpu.cfs_quota_us"), _read(root / v1 / "cpu.cfs_period_us")
        if quota and period and quota.lstrip("-").isdigit() and period.isdigit():
            yield int(quota), int(period)


def _memory_limits(root: Path, proc_cgroup: Path) -> Iterator[int]:
    for directory in _v2_dirs(root, proc_cgroup):  # "max" or bytes
        value = _read(directory / "memory.max")
        if value and value.isdigit():
            yield int(value)
    value = _read(root / "memory" / "memory.limit_in_bytes")  # v1; no limit reads as about 2**63
    if value and value.isdigit():
        yield int(value)
