"""A fingerprint of the machine that produced a measurement.

Benchmark results are only comparable between identical systems, so every stored
result carries the id of the system it was taken on. :func:`system_fingerprint`
records what trustworthy benchmark tools record (pyperf's metadata, google/benchmark's
context): CPU model and ISA flags, core counts, memory, OS and kernel, versions of
Python and the libraries that do the work, and the frequency-scaling state.
:func:`fingerprint_id` hashes the subset of it that decides whether two systems
should be expected to give the same timings.

Only the standard library is used: ``/proc/cpuinfo``, ``/proc/meminfo`` and ``/sys``
on Linux, ``os`` and ``platform`` everywhere. Files that are missing or unreadable
(containers, other OSes) leave the corresponding field None.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping

__all__ = ["FLAGS_OF_INTEREST", "IDENTITY_FIELDS", "fingerprint_id", "system_fingerprint"]

FINGERPRINT_SCHEMA_VERSION = 1

#: ISA extensions that change which kernels onnxruntime (MLAS) picks.
FLAGS_OF_INTEREST = (
    "sse4_1",
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    # aarch64 equivalents
    "asimd",
    "asimddp",
    "sve",
    "sve2",
    "i8mm",
    "bf16",
)

#: Fields of the fingerprint that :func:`fingerprint_id` hashes, as dotted paths.
#: They decide which kernels run and how fast: CPU model, architecture, ISA flags,
#: core counts, memory (rounded to GiB, since the reported total wobbles by a few MB
#: between boots), the onnxruntime version (kernels change between releases), the
#: OS name and the kernel's major version. Hostname, Python/numpy/onnx versions,
#: frequency settings and load are recorded but do not count: they either do not
#: affect onnxruntime's kernels or describe run conditions rather than the system.
IDENTITY_FIELDS = (
    "cpu.model",
    "cpu.vendor",
    "cpu.arch",
    "cpu.flags",
    "cpu.logical_cores",
    "cpu.physical_cores",
    "memory.total_gib",
    "versions.onnxruntime",
    "os.system",
    "os.kernel_major",
)

_SYS_CPU = Path("/sys/devices/system/cpu")


def _read(path: Path | str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _cpuinfo() -> list[dict[str, str]]:
    """``/proc/cpuinfo`` as one dict per processor ([] where unavailable)."""
    text = _read("/proc/cpuinfo")
    if not text:
        return []
    procs: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if current:
                procs.append(current)
                current = {}
            continue
        key, _, value = line.partition(":")
        current[key.strip()] = value.strip()
    if current:
        procs.append(current)
    return procs


def _cpu_section() -> dict[str, Any]:
    procs = _cpuinfo()
    first = procs[0] if procs else {}
    model = first.get("model name") or first.get("Model") or first.get("Processor") or platform.processor() or None
    vendor = first.get("vendor_id") or first.get("CPU implementer")
    flags_field = first.get("flags") or first.get("Features") or ""
    all_flags = set(flags_field.split())
    # Physical cores: distinct (package, core) pairs; where cpuinfo lacks them
    # (aarch64, some VMs) fall back to the topology in /sys.
    pairs = {(p.get("physical id"), p.get("core id")) for p in procs if "core id" in p}
    physical: int | None = len(pairs) if pairs else None
    if physical is None:
        cores = set()
        for cpu in _SYS_CPU.glob("cpu[0-9]*"):
            pkg = _read(cpu / "topology/physical_package_id")
            core = _read(cpu / "topology/core_id")
            if core is not None:
                cores.add((pkg, core))
        physical = len(cores) or None
    try:
        usable = sorted(os.sched_getaffinity(0))
    except AttributeError:
        usable = None
    caches = {}
    for idx in sorted(_SYS_CPU.glob("cpu0/cache/index*")):
        level, ctype, size = (_read(idx / f) for f in ("level", "type", "size"))
        if level and size:
            caches[f"L{level}{'' if ctype == 'Unified' else ctype[0].lower() if ctype else ''}"] = size
    return {
        "model": model,
        "vendor": vendor,
        "arch": platform.machine(),
        "flags": sorted(f for f in FLAGS_OF_INTEREST if f in all_flags),
        "hypervisor": "hypervisor" in all_flags,
        "logical_cores": os.cpu_count(),
        "physical_cores": physical,
        "usable_cores": usable,
        "caches": caches or None,
    }


def _memory_section() -> dict[str, Any]:
    total = None
    text = _read("/proc/meminfo") or ""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            total = int(line.split()[1]) * 1024
            break
    if total is None and hasattr(os, "sysconf"):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            total = None
    return {"total_bytes": total, "total_gib": round(total / 2**30) if total else None,
            "transparent_hugepages": transparent_hugepages_mode(), "huge_pages_available": huge_pages_available()}


_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_hugepages_mode() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or
    None where the kernel does not say."""
    text = _read(_THP_ENABLED)
    if not text or "[" not in text:
        return None
    return text.split("[", 1)[1].split("]", 1)[0]


def huge_pages_available() -> bool:
    """Whether ``RunnerConfig.huge_pages`` takes effect here: glibc 2.35 or later (its
    ``glibc.malloc.hugetlb`` tunable) and transparent huge pages not ``never``."""
    lib, version = platform.libc_ver()
    try:
        glibc_ok = lib == "glibc" and tuple(int(x) for x in version.split(".")[:2]) >= (2, 35)
    except ValueError:
        glibc_ok = False
    return glibc_ok and transparent_hugepages_mode() in ("always", "madvise")


def _frequency_section() -> dict[str, Any]:
    governors = set()
    max_khz = set()
    for cpu in _SYS_CPU.glob("cpu[0-9]*"):
        g = _read(cpu / "cpufreq/scaling_governor")
        if g:
            governors.add(g)
        f = _read(cpu / "cpufreq/scaling_max_freq")
        if f and f.isdigit():
            max_khz.add(int(f))
    boost = _read(_SYS_CPU / "cpufreq/boost")
    no_turbo = _read(_SYS_CPU / "intel_pstate/no_turbo")
    return {
        "governors": sorted(governors) or None,
        "scaling_max_khz": sorted(max_khz) or None,
        "boost": boost,
        "intel_no_turbo": no_turbo,
        "smt_active": _read(_SYS_CPU / "smt/active"),
        "isolated_cpus": _read(_SYS_CPU / "isolated") or None,
    }


def _version(dist: str, module: str | None = None) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
    if module is None:
        return None
    # onnxruntime also ships as onnxruntime-gpu, -openvino...: ask the module itself.
    try:
        mod = __import__(module)
    except ImportError:
        return None
    return getattr(mod, "__version__", None)


def system_fingerprint() -> dict[str, Any]:
    """Describe this machine and software stack.

    Returns:
        A JSON-friendly dict with sections ``cpu``, ``memory``, ``os``, ``python``,
        ``versions``, ``frequency`` and ``hostname``, plus ``schema_version``.
        Unknown values are None.
    """
    release = platform.release()
    major = release.split(".", 1)[0] if release else None
    from dlbricks import __version__ as dlbricks_version

    return {
        "schema_version": FINGERPRINT_SCHEMA_VERSION,
        "cpu": _cpu_section(),
        "memory": _memory_section(),
        "os": {
            "system": platform.system(),
            "kernel": release,
            "kernel_major": major,
            "platform": platform.platform(),
        },
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "versions": {
            "dlbricks": dlbricks_version,
            "onnxruntime": _version("onnxruntime", "onnxruntime"),
            "onnx": _version("onnx", "onnx"),
            "numpy": _version("numpy", "numpy"),
        },
        "frequency": _frequency_section(),
        "hostname": socket.gethostname(),
    }


def _get(fp: Mapping[str, Any], dotted: str) -> Any:
    cur: Any = fp
    for part in dotted.split("."):
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(part)
    return cur


def fingerprint_id(fp: Mapping[str, Any]) -> str:
    """A stable 16-hex-digit id over the :data:`IDENTITY_FIELDS` of a fingerprint.

    Args:
        fp: a dict from :func:`system_fingerprint` (missing fields count as None).

    Returns:
        The id; equal for fingerprints that agree on every identity field.
    """
    ident = {f: _get(fp, f) for f in IDENTITY_FIELDS}
    canon = json.dumps(ident, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]
