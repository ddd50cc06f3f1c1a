"""Keep freed memory in the process that freed it, for what it allocates next.

Why: benchmarking a corpus builds and drops gigabytes of weights (generated, handed to
a worker, parsed, packed by onnxruntime), model after model. glibc's malloc returns
large blocks to the kernel as soon as they are freed (each allocation above its mmap
threshold is its own mapping; the top of the heap is trimmed), so the next model's
weights land on pages the kernel must find and zero again. On virtual machines that
hand freed guest memory back to the host (free page reporting, ballooning) that is
far dearer than zeroing: on the 2-vCPU Firecracker VM these figures were measured on,
touching memory freed a few seconds earlier ran at 60-110 MB/s (a fresh 4 GiB numpy
array took 38-60 s; in memory the process had kept, 0.2 s per GiB). Kept
in malloc's free lists, the same pages serve the next model at memory speed.

So the engine's processes (the CLI and its measurement workers) ask glibc never to
map large blocks on their own and never to trim the heap: freed memory stays mapped
and is reused. The engine's memory budget counts all that its workers hold
(:func:`resident_bytes`), kept memory included: sessions of a later batch are built
in what earlier ones freed. Elsewhere than glibc nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

__all__ = ["TUNABLES", "keep_freed_memory", "resident_bytes", "with_tunables"]

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


def resident_bytes() -> int:
    """This process's resident size (0 if unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
