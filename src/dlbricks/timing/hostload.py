"""What else ran on the machine while the engine timed: other processes' CPU time and the
hypervisor's steal, read from the kernel's counters around a run.

The engine's rounds cancel a change of the core's speed, which hits bricks and whole
models alike; they cannot cancel a neighbour's memory traffic, which slows a whole model
(its weights and activations live in the shared last-level cache) and hardly its bricks
(whose data stays in the core's own caches). On a 2-vCPU VM a process streaming through
memory on the other CPU slowed ShuffleNet by 11% and its bricks by 1% (``bench/host_drift.py
--neighbour``), so its normalized latency read 9% low. No counter shows that traffic, but
on Linux the run can see the CPU time of whoever makes it, when that is a process of the same
machine: the run then says so, and how busy the machine was, beside its results. (Its
effect on the cache, whoever makes it, is what the shared-cache probe reads:
:mod:`dlbricks.timing.cacheprobe`.)

Other processes' time is the machine's busy time (``/proc/stat``) less this process's and
its waited-for children's (``os.times``): the engine's workers and opening processes are
its children and are waited for before the second reading.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["BUSY_OTHER_CPUS", "BUSY_STEAL", "HostLoad", "LoadReading", "busy_warning", "combine_loads", "host_load",
           "read_load"]

#: Other processes busier than this many CPUs on average make the run's figures suspect...
BUSY_OTHER_CPUS = 0.3
#: ...as does the hypervisor taking more than this share of the machine's CPU time.
BUSY_STEAL = 0.05


@dataclass(frozen=True)
class LoadReading:
    """The kernel's counters at one moment (seconds of CPU time, summed over CPUs)."""

    wall_s: float
    busy_s: float
    steal_s: float
    total_s: float
    own_s: float


@dataclass(frozen=True)
class HostLoad:
    """What ran beside a measurement, averaged over its ``seconds``."""

    seconds: float
    #: CPUs' worth of time other processes were busy (0.5: half a CPU on average).
    other_cpus: float
    #: The share of the machine's CPU time the hypervisor gave to other guests.
    steal: float
    #: The shared-cache probe over the run's rounds (:mod:`dlbricks.timing.cacheprobe`):
    #: median, lowest and highest reading; None where no round read it. What other
    #: tenants' memory traffic, which no counter here shows, took from the cache.
    shared_cache: tuple[float, float, float] | None = None

    @property
    def busy(self) -> bool:
        """Whether enough else ran to make the run's whole-model latencies suspect."""
        return self.other_cpus >= BUSY_OTHER_CPUS or self.steal >= BUSY_STEAL

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seconds": self.seconds, "other_cpus": self.other_cpus, "steal": self.steal,
                               "busy": self.busy}
        if self.shared_cache is not None:
            med, lo, hi = self.shared_cache
            out["shared_cache"] = med
            out["shared_cache_range"] = [lo, hi]
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HostLoad:
        """Back from :meth:`to_dict` (``busy`` is derived again)."""
        cache = None
        if d.get("shared_cache") is not None:
            lo, hi = d.get("shared_cache_range") or (d["shared_cache"], d["shared_cache"])
            cache = (float(d["shared_cache"]), float(lo), float(hi))
        return cls(float(d["seconds"]), float(d["other_cpus"]), float(d["steal"]), cache)

    def describe(self) -> str:
        """One line for a warning."""
        steal = f", the hypervisor took {self.steal:.0%} of its CPU time" if self.steal >= 0.005 else ""
        return (f"the machine was busy while timing: other processes kept {self.other_cpus:.2f} CPUs busy "
                f"on average over {self.seconds:.0f} s{steal}; a neighbour's memory traffic slows whole "
                "models more than their bricks, so normalized latency may read low and not reproduce: "
                "time on a quiet machine")


def busy_warning(host: Mapping[str, Any] | None) -> str | None:
    """The warning line for a load in its JSON form (:meth:`HostLoad.to_dict`, as
    ``--json`` and the report carry it): None unless the machine was busy."""
    if not host:
        return None
    load = HostLoad.from_dict(host)
    return load.describe() if load.busy else None


def combine_loads(loads: Sequence[HostLoad]) -> HostLoad | None:
    """Several runs' loads on one machine as one (None for none): their seconds summed,
    other processes' CPUs and the steal averaged over them, the shared-cache readings'
    median of medians and their lowest and highest."""
    if not loads:
        return None
    seconds = sum(x.seconds for x in loads)
    if seconds <= 0:
        return None
    caches = [x.shared_cache for x in loads if x.shared_cache is not None]
    cache = (statistics.median(c[0] for c in caches), min(c[1] for c in caches), max(c[2] for c in caches)) \
        if caches else None
    return HostLoad(seconds=seconds, other_cpus=sum(x.other_cpus * x.seconds for x in loads) / seconds,
                    steal=sum(x.steal * x.seconds for x in loads) / seconds, shared_cache=cache)


def _stat_line(text: str) -> list[int] | None:
    for line in text.splitlines():
        if line.startswith("cpu "):
            return [int(x) for x in line.split()[1:]]
    return None


def read_load(stat_path: str = "/proc/stat") -> LoadReading | None:
    """The counters now, or None where the kernel does not offer them (not Linux, or a
    container that hides ``/proc/stat``)."""
    try:
        with open(stat_path) as f:
            fields = _stat_line(f.read())
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    if fields is None or len(fields) < 8 or tick <= 0:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields[:8]
    busy = user + nice + system + irq + softirq  # guest time is inside user
    own = os.times()
    return LoadReading(
        wall_s=time.monotonic(),
        busy_s=busy / tick,
        steal_s=steal / tick,
        total_s=(busy + idle + iowait + steal) / tick,
        own_s=own.user + own.system + own.children_user + own.children_system,
    )


def host_load(before: LoadReading | None, after: LoadReading | None,
              cache_readings: Sequence[float] = ()) -> HostLoad | None:
    """Other processes' load and the steal between two readings (None without both),
    with the shared-cache probe's ``cache_readings`` taken meanwhile."""
    if before is None or after is None:
        return None
    seconds = after.wall_s - before.wall_s
    total = after.total_s - before.total_s
    if seconds <= 0 or total <= 0:
        return None
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    cache = (statistics.median(cache_readings), min(cache_readings), max(cache_readings)) if cache_readings else None
    return HostLoad(seconds=seconds, other_cpus=max(0.0, others / seconds),
                    steal=max(0.0, (after.steal_s - before.steal_s) / total), shared_cache=cache)
