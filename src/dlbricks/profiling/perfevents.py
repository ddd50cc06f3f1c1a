"""Linux perf event counters through ``perf_event_open(2)``, with ctypes only.

The hardware level of ``dlbricks profile`` counts what a brick does on the CPU:
cycles, instructions, cache misses and branch misses (IPC derived), plus the
kernel's software counters (task clock, page faults, context switches).

Counters are opened on every thread of the calling process (onnxruntime's pool
threads included) with ``inherit`` set, so threads started later are counted too;
a :class:`CounterSet` sums them. Each event is opened on its own (not as a group),
so one unsupported event does not take the others down, and each read carries
``time_enabled``/``time_running`` so that a multiplexed hardware counter is scaled
up to the whole interval, as ``perf stat`` does.

Only user-space work is counted when the kernel forbids more (``exclude_kernel``
is retried on ``EACCES``, which is what ``perf_event_paranoid`` >= 2 gives an
unprivileged user). Where counters cannot be opened at all (other OSes, VMs without
a virtual PMU, containers whose seccomp profile blocks the syscall), :func:`probe`
says why, per event, and callers carry on without them.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import sys
from typing import Iterable, Mapping

from dlbricks.errors import DlbricksError

__all__ = [
    "EVENTS",
    "HARDWARE_EVENTS",
    "SOFTWARE_EVENTS",
    "CounterSet",
    "PerfUnavailable",
    "derived_metrics",
    "probe",
    "syscall_number",
]

#: ``perf_event_open`` syscall numbers by ``platform.machine()``.
_SYSCALL_NR = {
    "x86_64": 298,
    "amd64": 298,
    "aarch64": 241,
    "arm64": 241,
    "riscv64": 241,
    "loongarch64": 241,
    "ppc64le": 319,
    "ppc64": 319,
    "s390x": 331,
    "i386": 336,
    "i686": 336,
    "armv7l": 364,
}

# perf_event_attr.type
_TYPE_HARDWARE = 0
_TYPE_SOFTWARE = 1
# attr.read_format bits
_FORMAT_TOTAL_TIME_ENABLED = 1 << 0
_FORMAT_TOTAL_TIME_RUNNING = 1 << 1
# attr flag bits (the bitfield that follows read_format)
_FLAG_DISABLED = 1 << 0
_FLAG_INHERIT = 1 << 1
_FLAG_EXCLUDE_KERNEL = 1 << 5
_FLAG_EXCLUDE_HV = 1 << 6
# ioctls: _IO('$', n)
_IOC_ENABLE = 0x2400
_IOC_DISABLE = 0x2401
_IOC_RESET = 0x2403
# perf_event_open flags
_PERF_FLAG_FD_CLOEXEC = 1 << 3

#: name -> (type, config), as ``perf list`` names them.
EVENTS: dict[str, tuple[int, int]] = {
    "cycles": (_TYPE_HARDWARE, 0),
    "instructions": (_TYPE_HARDWARE, 1),
    "cache-references": (_TYPE_HARDWARE, 2),
    "cache-misses": (_TYPE_HARDWARE, 3),
    "branches": (_TYPE_HARDWARE, 4),
    "branch-misses": (_TYPE_HARDWARE, 5),
    "task-clock": (_TYPE_SOFTWARE, 1),
    "page-faults": (_TYPE_SOFTWARE, 2),
    "context-switches": (_TYPE_SOFTWARE, 3),
    "cpu-migrations": (_TYPE_SOFTWARE, 4),
}
#: The hardware counters the hw level asks for.
HARDWARE_EVENTS = ("cycles", "instructions", "cache-misses", "branch-misses")
#: The software counters it adds (these work where the PMU is not exposed).
SOFTWARE_EVENTS = ("task-clock", "page-faults", "context-switches")


class PerfUnavailable(DlbricksError):
    """No requested counter could be opened; ``reasons`` maps event -> why."""

    def __init__(self, reasons: Mapping[str, str]):
        self.reasons = dict(reasons)
        super().__init__(_summarize_reasons(self.reasons))


class _Attr(ctypes.Structure):
    """``struct perf_event_attr`` up to ``config3`` (PERF_ATTR_SIZE_VER8, 136 bytes).

    Older kernels accept a larger struct as long as the tail they do not know is
    zero, so one layout serves every kernel since 4.1.
    """

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("wakeup_events", ctypes.c_uint32),
        ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64),
        ("config2", ctypes.c_uint64),
        ("branch_sample_type", ctypes.c_uint64),
        ("sample_regs_user", ctypes.c_uint64),
        ("sample_stack_user", ctypes.c_uint32),
        ("clockid", ctypes.c_int32),
        ("sample_regs_intr", ctypes.c_uint64),
        ("aux_watermark", ctypes.c_uint32),
        ("sample_max_stack", ctypes.c_uint16),
        ("reserved_2", ctypes.c_uint16),
        ("aux_sample_size", ctypes.c_uint32),
        ("reserved_3", ctypes.c_uint32),
        ("sig_data", ctypes.c_uint64),
        ("config3", ctypes.c_uint64),
    ]


_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc


def syscall_number() -> int | None:
    """The ``perf_event_open`` syscall number on this machine, or None (not Linux,
    or an architecture this module does not know)."""
    if not sys.platform.startswith("linux"):
        return None
    return _SYSCALL_NR.get(platform.machine().lower())


def _errname(code: int) -> str:
    return errno.errorcode.get(code, f"errno {code}")


def _open_one(name: str, tid: int, exclude_kernel: bool) -> int:
    """Open one counting event on thread ``tid``; returns the fd.

    Raises:
        OSError: with the kernel's errno.
    """
    nr = syscall_number()
    if nr is None:
        raise OSError(errno.ENOSYS, f"perf_event_open is not available on {sys.platform}/{platform.machine()}")
    etype, config = EVENTS[name]
    attr = _Attr()
    attr.type = etype
    attr.size = ctypes.sizeof(_Attr)
    attr.config = config
    attr.read_format = _FORMAT_TOTAL_TIME_ENABLED | _FORMAT_TOTAL_TIME_RUNNING
    flags = _FLAG_DISABLED | _FLAG_INHERIT | _FLAG_EXCLUDE_HV
    if exclude_kernel:
        flags |= _FLAG_EXCLUDE_KERNEL
    attr.flags = flags
    fd = _lib().syscall(nr, ctypes.byref(attr), tid, -1, -1, _PERF_FLAG_FD_CLOEXEC)
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(fd)


def _open_event(name: str, tid: int, exclude_kernel: bool | None) -> tuple[int, bool]:
    """Open ``name`` on ``tid``, counting kernel work where allowed.

    Returns:
        (fd, exclude_kernel actually used).
    """
    if exclude_kernel is None:
        try:
            return _open_one(name, tid, False), False
        except OSError as exc:
            # perf_event_paranoid >= 2 forbids counting kernel work for an
            # unprivileged user; user-space counts are still allowed.
            if exc.errno not in (errno.EACCES, errno.EPERM):
                raise
        return _open_one(name, tid, True), True
    return _open_one(name, tid, exclude_kernel), exclude_kernel


def _reason(name: str, exc: OSError) -> str:
    code = exc.errno or 0
    hint = {
        errno.ENOENT: "not supported by this CPU or hypervisor",
        errno.EOPNOTSUPP: "not supported by this CPU or hypervisor",
        errno.ENODEV: "no PMU for this event",
        errno.EACCES: "not permitted (see /proc/sys/kernel/perf_event_paranoid)",
        errno.EPERM: "not permitted (perf_event_paranoid or a seccomp filter)",
        errno.ENOSYS: "no perf_event_open syscall",
        errno.EINVAL: "rejected by the kernel",
    }.get(code, exc.strerror or "failed")
    return f"{_errname(code)}: {hint}"


def _summarize_reasons(reasons: Mapping[str, str]) -> str:
    by_reason: dict[str, list[str]] = {}
    for name, why in reasons.items():
        by_reason.setdefault(why, []).append(name)
    return "; ".join(f"{', '.join(names)}: {why}" for why, names in by_reason.items())


def probe(events: Iterable[str] = HARDWARE_EVENTS + SOFTWARE_EVENTS) -> dict[str, str | None]:
    """Try to open each event on this thread and close it again.

    Args:
        events: event names (keys of :data:`EVENTS`).

    Returns:
        event -> None when it can be counted, else a one-line reason such as
        ``"ENOENT: not supported by this CPU or hypervisor"``.

    Raises:
        KeyError: an unknown event name.
    """
    out: dict[str, str | None] = {}
    for name in events:
        if name not in EVENTS:
            raise KeyError(f"unknown perf event {name!r} (known: {sorted(EVENTS)})")
        try:
            fd, _ = _open_event(name, 0, None)
        except OSError as exc:
            out[name] = _reason(name, exc)
        else:
            os.close(fd)
            out[name] = None
    return out


def _thread_ids() -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:
        return [0]  # 0 = the calling thread


_READ = struct.Struct("=QQQ")  # value, time_enabled, time_running


class CounterSet:
    """Counters on every thread of this process, read as deltas between snapshots.

    Example:
        >>> with CounterSet(["task-clock", "page-faults"]) as cs:  # doctest: +SKIP
        ...     before = cs.snapshot(); work(); after = cs.snapshot()
        ...     cs.delta(before, after)
        {'task-clock': 1234567.0, 'page-faults': 12.0}

    Args:
        events: the events to count; those that cannot be opened are left out and
            listed in :attr:`unavailable` with the reason.
        threads: ``"process"`` (every thread now in the process, plus those they
            start later) or ``"self"`` (the calling thread and its later children).

    Raises:
        PerfUnavailable: not one of ``events`` could be opened.
        KeyError: an unknown event name.
    """

    def __init__(self, events: Iterable[str], *, threads: str = "process"):
        names = list(dict.fromkeys(events))
        for name in names:
            if name not in EVENTS:
                raise KeyError(f"unknown perf event {name!r} (known: {sorted(EVENTS)})")
        if threads not in ("process", "self"):
            raise ValueError(f"threads must be 'process' or 'self', got {threads!r}")
        tids = _thread_ids() if threads == "process" else [0]
        self.unavailable: dict[str, str] = {}
        self.exclude_kernel: dict[str, bool] = {}
        self._fds: dict[str, list[int]] = {}
        try:
            for name in names:
                fds: list[int] = []
                try:
                    fd, excl = _open_event(name, tids[0], None)
                    fds.append(fd)
                    for tid in tids[1:]:
                        try:
                            fds.append(_open_one(name, tid, excl))
                        except OSError as exc:
                            if exc.errno == errno.ESRCH:  # the thread exited meanwhile
                                continue
                            raise
                except OSError as exc:
                    for fd in fds:
                        os.close(fd)
                    self.unavailable[name] = _reason(name, exc)
                    continue
                self._fds[name] = fds
                self.exclude_kernel[name] = excl
        except BaseException:
            self.close()
            raise
        if not self._fds:
            raise PerfUnavailable(self.unavailable)
        self.threads = len(tids)
        self._ioctl_all(_IOC_RESET)
        self._ioctl_all(_IOC_ENABLE)

    @property
    def events(self) -> list[str]:
        """The events being counted."""
        return list(self._fds)

    def _ioctl_all(self, request: int) -> None:
        import fcntl

        for fds in self._fds.values():
            for fd in fds:
                fcntl.ioctl(fd, request, 0)

    def snapshot(self) -> dict[str, tuple[int, int, int]]:
        """Raw (value, time_enabled, time_running) per event, summed over threads."""
        out: dict[str, tuple[int, int, int]] = {}
        read = os.read
        unpack = _READ.unpack
        for name, fds in self._fds.items():
            v = e = r = 0
            for fd in fds:
                dv, de, dr = unpack(read(fd, 24))
                v += dv
                e += de
                r += dr
            out[name] = (v, e, r)
        return out

    @staticmethod
    def delta(before: Mapping[str, tuple[int, int, int]], after: Mapping[str, tuple[int, int, int]]) -> dict[str, float]:
        """Counts between two snapshots, scaled for multiplexing.

        A counter that ran for only part of the interval (the PMU had more events
        than registers) is scaled by enabled/running time; one that never ran
        gives NaN.
        """
        out: dict[str, float] = {}
        for name, (v1, e1, r1) in after.items():
            v0, e0, r0 = before[name]
            dv, de, dr = v1 - v0, e1 - e0, r1 - r0
            if dr <= 0:
                out[name] = float("nan") if de > 0 else float(dv)
            elif dr < de:
                out[name] = dv * (de / dr)
            else:
                out[name] = float(dv)
        return out

    def close(self) -> None:
        """Close every counter (idempotent)."""
        for fds in self._fds.values():
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fds = {}

    def __enter__(self) -> CounterSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - safety net for leaked sets
        if getattr(self, "_fds", None):
            self.close()


def derived_metrics(counts: Mapping[str, float]) -> dict[str, float]:
    """Ratios of interest from one set of counts.

    Returns:
        ``ipc`` (instructions per cycle), ``branch_miss_per_kinstr`` and
        ``cache_miss_per_kinstr`` where their inputs are present and non-zero,
        and ``cpu_ghz`` (cycles per task-clock nanosecond).
    """
    out: dict[str, float] = {}
    cycles = counts.get("cycles")
    instr = counts.get("instructions")
    if cycles and instr is not None and cycles > 0:
        out["ipc"] = instr / cycles
    if instr and instr > 0:
        if counts.get("branch-misses") is not None:
            out["branch_miss_per_kinstr"] = 1000.0 * counts["branch-misses"] / instr
        if counts.get("cache-misses") is not None:
            out["cache_miss_per_kinstr"] = 1000.0 * counts["cache-misses"] / instr
    clock = counts.get("task-clock")
    if cycles and clock and clock > 0:
        out["cpu_ghz"] = cycles / clock
    return out
