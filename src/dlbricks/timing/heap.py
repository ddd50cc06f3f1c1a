"""Keep freed memory in the process that freed it; huge pages only where asked for.

Why: benchmarking a corpus builds and drops gigabytes of weights (parsed and packed by
onnxruntime), model after model. glibc's malloc returns large blocks to the kernel as
soon as they are freed (each allocation above its mmap threshold is its own mapping;
the top of the heap is trimmed), so the next model's weights land on pages the kernel
must find and zero again. So the engine's processes (the CLI and its measurement
workers) ask glibc never to map large blocks on their own and never to trim the heap:
freed memory stays mapped and is reused. The engine's memory budget counts what its
workers' live sessions hold (:func:`held_bytes`: resident memory less what malloc
keeps free for reuse), so sessions opened after others closed fill the budget again,
built in what those freed; counting the kept memory too would leave the budget full
for good once the first sessions had filled it.

With every large block on the heap, numpy's habit of asking for transparent huge pages
on its arrays (``madvise``, for arrays of 4 MiB or more) would turn the heap around
them into huge-page memory, whatever ``RunnerConfig.huge_pages`` says. So numpy's
advice is off in these processes, and the configuration alone decides (through
glibc's own tunable, for the workers' whole heap). Huge pages have a price on some
hosts: where the kernel compacts memory to find one (``defrag=madvise``, a common
default) or a VM's host backs freed guest memory lazily, faulting them in is slow. On
the 2-vCPU VM these figures were measured on, a fresh 1 GiB array took 0.2-17 s on
huge pages (8 runs) and 0.40-0.51 s on 4 KiB pages (8 runs), and zeroing huge pages
was 44% of a ``dlbricks demo``'s CPU time (``perf``, huge pages on). Memory the guest
has not used for a while is dear on any page size there (its host takes freed memory
back): 10 GiB took 122 s, then 31 s at once after; so every byte a process touches
counts, and freed memory is worth keeping.
Elsewhere than glibc and numpy nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any

__all__ = ["TUNABLES", "held_bytes", "keep_freed_memory", "numpy_huge_pages", "resident_bytes", "with_tunables"]

#: glibc tunables (``GLIBC_TUNABLES``, read at process start) that keep freed memory:
#: no block gets a mapping of its own, and the heap's top is never given back.
TUNABLES = ("glibc.malloc.mmap_max=0", "glibc.malloc.trim_threshold=1099511627776")

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):  # not glibc
        return None
    return libc


def with_tunables(env: dict[str, str], tunables: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``env`` with ``tunables`` set in ``GLIBC_TUNABLES``, replacing those of the same name."""
    names = {t.split("=", 1)[0] for t in tunables}
    kept = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and t.split("=", 1)[0] not in names]
    return dict(env, GLIBC_TUNABLES=":".join([*kept, *tunables]))


def keep_freed_memory() -> bool:
    """Set this process's malloc as :data:`TUNABLES` set a new one's (for a process that
    is already running, such as the CLI). Returns whether it could (glibc only)."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def numpy_huge_pages(enabled: bool) -> None:
    """Whether numpy asks for transparent huge pages on its large arrays, in this
    process (``NUMPY_MADVISE_HUGEPAGE`` says it for a new one)."""
    import numpy._core.multiarray as multiarray

    setter = getattr(multiarray, "_set_madvise_hugepage", None)
    if setter is not None:  # a build without it keeps its default
        setter(enabled)


def resident_bytes() -> int:
    """This process's resident size (0 if unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.lru_cache(maxsize=1)
def _mallinfo2() -> Any:
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None  # glibc >= 2.33
    if fn is not None:
        fn.restype, fn.argtypes = _MallInfo2, []
    return fn


def held_bytes() -> int:
    """This process's resident size less the free memory malloc keeps for reuse
    (glibc's ``mallinfo2``, all arenas): what its live data hold. The resident size
    where that cannot be read (not glibc, or glibc before 2.33)."""
    rss = resident_bytes()
    fn = _mallinfo2()
    return rss if fn is None else max(0, rss - int(fn().fordblks))
