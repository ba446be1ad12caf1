"""A memory bound on a whole process, page cache included: a memory cgroup (no torch).

Why in the package: ``--memory`` promises a bound on the whole process, and both its test
(``tests/runtime/test_memory_budget.py``) and the benchmarks that compare engines at a bound
hold a process to it the same way. The cgroup is v2's ``memory.max``, or v1's
``memory.limit_in_bytes`` where only v1 is mounted and writable; where neither can be made
(an unprivileged container), ``make_cgroup`` says so with None and the caller skips or falls
back.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def make_cgroup(name: str, limit: int) -> Path | None:
    """A memory cgroup of ``limit`` bytes (page cache included), or None where none can be
    made here (no cgroup file system mounted, or not writable)."""
    if (CGROUP_V2 / "cgroup.controllers").is_file():
        path, knob = CGROUP_V2 / name, "memory.max"
    elif (CGROUP_V1 / "memory.limit_in_bytes").is_file():
        path, knob = CGROUP_V1 / name, "memory.limit_in_bytes"
    else:
        return None
    try:
        path.mkdir(exist_ok=True)
        (path / knob).write_text(str(limit))
    except OSError:
        return None
    return path


def enter_cgroup(path: Path) -> None:
    """The calling process joins ``path`` (its memory from now on counts against the bound)."""
    (path / "cgroup.procs").write_text(str(os.getpid()))


def cgroup_peak(path: Path) -> int | None:
    """The most memory the cgroup ever held (RSS and page cache), if the kernel says."""
    for knob in ("memory.peak", "memory.max_usage_in_bytes"):
        if (path / knob).is_file():
            return int((path / knob).read_text().split()[0])
    return None


def remove_cgroup(path: Path) -> None:
    """The cgroup removed; one that still holds a process is left (it goes with it)."""
    with contextlib.suppress(OSError):
        path.rmdir()


def drop_pages(folder: Path) -> None:
    """Drop the page cache's copy of every file in ``folder`` (clean pages: no root needed),
    so none of it is charged to another cgroup or read back for free."""
    for f in folder.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def available_memory() -> int:
    """Bytes the system can give now (MemAvailable), else its physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
