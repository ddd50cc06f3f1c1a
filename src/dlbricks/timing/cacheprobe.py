"""The shared-cache probe: how much of this core's data other tenants' memory traffic
pushes out of the last-level cache while the core waits a few milliseconds.

A whole model keeps its weights and activations in the shared last-level cache between
the layers that use them; a neighbour that streams through memory (another process, or
another virtual machine on the same socket, which no counter of this machine shows)
evicts them, and the model slows while its bricks, whose data stays in the core's own
caches, do not (``bench/host_drift.py --neighbour``). So a run records that state.

A reading: a buffer of four times the core's L2 cache (so it lives in the last-level
cache) is read, the core spins for :data:`IDLE_S` touching nothing, and the buffer is
read again, timed; then twice more, right away. The reading is the timed read after the
wait over the faster of the two right after it: 1 when nothing took the buffer from the
cache meanwhile, DRAM's time over the cache's when everything did (about 2 here), and more
when the others' traffic also slows DRAM (up to 6 here). Being a ratio
of two reads a few microseconds apart, it does not depend on the core's speed at the time.
Measured beside ShuffleNet and its bricks on a 2-vCPU EPYC VM, read once per pass over
them (``python bench/host_drift.py --seconds 100``, twenty 5 s windows, no other process on
the VM): over the windows the reading (median 3.3, range 57%) correlated with ShuffleNet's
latency at 0.75 and with its bricks' reconstruction over it at -0.96; with a process
streaming memory on the other CPU in every other window (``--neighbour``, 60 s), 0.70 and
-0.90.
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["IDLE_S", "SharedCacheProbe", "probe_nbytes"]

#: How long the core waits between touching the buffer and reading it again: about a
#: small model's run, the time a layer's weights wait in the cache for the next run.
IDLE_S = 0.005
#: The buffer is this many times the core's L2 cache, so that it lives in the
#: last-level cache, not the core's own...
_L2_MULTIPLE = 4
#: ...and at most this share of the last-level cache.
_LLC_SHARE = 4
_DEFAULT_L2 = 1 << 20
_CACHE_LINE = 64


def probe_nbytes() -> int:
    """The probe buffer's size for this machine's caches."""
    from dlbricks.roofline.peaks import data_cache_bytes

    l2 = data_cache_bytes(2) or _DEFAULT_L2
    llc = data_cache_bytes() or _L2_MULTIPLE * _LLC_SHARE * l2
    return int(max(_CACHE_LINE, min(_L2_MULTIPLE * l2, llc // _LLC_SHARE)))


class SharedCacheProbe:
    """Readings of the shared-cache probe (see the module's doc); the buffer is
    allocated on the first reading."""

    def __init__(self, nbytes: int | None = None, idle_s: float = IDLE_S) -> None:
        self.nbytes = nbytes
        self.idle_s = idle_s
        self._buffer: np.ndarray | None = None

    def _read_ns(self) -> int:
        assert self._buffer is not None
        t0 = time.perf_counter_ns()
        np.add.reduce(self._buffer[::_CACHE_LINE])  # one byte of every cache line
        return time.perf_counter_ns() - t0

    def _wait(self) -> None:
        # Spin, not sleep: a sleeping core's wake-up (its TLB, its clock) would slow the
        # read after it whatever the cache held.
        until = time.perf_counter() + self.idle_s
        while time.perf_counter() < until:
            pass

    def read(self) -> float:
        """One reading: near 1 when the buffer stayed cached, larger the more of it others evicted."""
        if self._buffer is None:
            self._buffer = np.ones(self.nbytes or probe_nbytes(), dtype=np.uint8)
        self._read_ns()
        self._wait()
        after = self._read_ns()
        hot = min(self._read_ns(), self._read_ns())
        return after / hot if hot > 0 else 1.0
