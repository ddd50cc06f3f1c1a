"""Measured machine peaks for the roofline: compute (GFLOP/s) and memory bandwidth (GB/s).

* **Compute**: a float32 MatMul run through onnxruntime's CPU provider with
  ``intra_op_num_threads = threads``, at a few square sizes; the best of several
  repetitions at the best size. Small sizes that fit in L2 run closest to the FMA
  peak, so several are tried rather than one large one.
* **Int8 compute** (``int8_gops``): the same with MatMulInteger of a uint8
  activation and a constant int8 weight (int32 out), the MLAS kernel that
  onnxruntime's quantized contractions run (QLinearConv, QLinearMatMul, QGemm,
  MatMulIntegerToFloat, DynamicQuantizeMatMul: VNNI where the CPU has it), counted
  as 2 ops a multiply-accumulate. The roofline bounds int ops by it. Peaks from
  before it existed read it as None; :func:`load_or_measure_peaks` then measures
  again.
* **Bandwidth**, on arrays twice the last-level cache (64-256 MiB: see
  :func:`stream_array_bytes`), counting bytes
  the STREAM way (arrays read plus arrays written; write-allocate traffic is not
  counted):

  - ``copy_gbs``: ``numpy.copyto`` (1 read, 1 write), single-threaded;
  - ``triad_gbs``: ``a = x + s*y`` in numpy (2 reads, 1 write), done in cache-sized
    chunks so the temporary never reaches DRAM; single-threaded;
  - ``ort_scale_gbs``: onnxruntime ``Mul(x, s)`` (1 read, 1 write) at ``threads``;
  - ``ort_add_gbs``: onnxruntime ``Add(x, y)`` (2 reads, 1 write) at ``threads``.

  :attr:`Peaks.bandwidth_gbs`, the best of them, is what the roofline uses.
* **Caches** from ``/sys/devices/system/cpu/cpu0/cache`` (``lscpu`` as a fallback).

Results can be cached as JSON keyed by a machine fingerprint string
(:func:`load_or_measure_peaks`); :meth:`Peaks.to_dict` is the stored form.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlbricks.cpuset import parse_ranges
from dlbricks.errors import DlbricksError
from dlbricks.timing.config import RunnerConfig
from dlbricks.timing.fpenv import FloatEnv
from dlbricks.timing.session import BoundSession, bind, create_session, pinned, timed_runs

__all__ = [
    "CacheLevel",
    "Peaks",
    "PEAKS_SCHEMA_VERSION",
    "cache_levels",
    "data_cache_bytes",
    "load_or_measure_peaks",
    "measure_peaks",
]

PEAKS_SCHEMA_VERSION = 1

_SYS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")


@dataclass(frozen=True, slots=True)
class CacheLevel:
    """One cache as seen from CPU 0."""

    level: int
    type: str  # "Data", "Instruction" or "Unified"
    size_bytes: int
    shared_cpus: int  # CPUs sharing this instance (0 when unknown)
    line_bytes: int  # 0 when unknown

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CacheLevel:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


@dataclass(slots=True)
class Peaks:
    """Measured peaks at one thread count. Rates are in 1e9 units (GFLOP/s, GB/s)."""

    threads: int
    gflops: float
    copy_gbs: float
    triad_gbs: float
    ort_scale_gbs: float
    ort_add_gbs: float
    gflops_by_size: dict[str, float] = field(default_factory=dict)  # MatMul n -> GFLOP/s
    int8_gops: float | None = None  # MatMulInteger u8 x s8, GOP/s; None: not measured
    int8_gops_by_size: dict[str, float] = field(default_factory=dict)  # MatMulInteger n -> GOP/s
    stream_bytes: int = 0  # bytes of one bandwidth array
    caches: list[CacheLevel] = field(default_factory=list)
    cores: list[int] | None = None  # CPUs the measurement was pinned to
    quick: bool = False
    elapsed_s: float = 0.0
    fingerprint: str | None = None
    context: dict[str, Any] = field(default_factory=dict)
    schema_version: int = PEAKS_SCHEMA_VERSION

    @property
    def bandwidth_gbs(self) -> float:
        """The best sustained memory bandwidth measured, the roofline's slope."""
        return max(self.copy_gbs, self.triad_gbs, self.ort_scale_gbs, self.ort_add_gbs)

    @property
    def last_level_cache_bytes(self) -> int:
        """Size of the highest-level data or unified cache; 0 when unknown."""
        usable = [c for c in self.caches if c.type != "Instruction"]
        return max(usable, key=lambda c: (c.level, c.size_bytes)).size_bytes if usable else 0

    @property
    def ridge_point(self) -> float:
        """Arithmetic intensity (FLOP/byte) where compute and memory bounds meet."""
        return self.gflops / self.bandwidth_gbs

    @property
    def int8_ridge_point(self) -> float | None:
        """The same for int8 work (op/byte); None when the int8 peak was not measured."""
        return None if self.int8_gops is None else self.int8_gops / self.bandwidth_gbs

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (what a store keeps)."""
        d = asdict(self)
        d["bandwidth_gbs"] = self.bandwidth_gbs  # derived; from_dict ignores it
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Peaks:
        """Inverse of :meth:`to_dict`; unknown keys are ignored.

        Raises:
            ValueError: a different ``schema_version``.
            KeyError: a required field is missing.
        """
        version = d.get("schema_version", PEAKS_SCHEMA_VERSION)
        if version != PEAKS_SCHEMA_VERSION:
            raise ValueError(f"peaks schema_version {version}, expected {PEAKS_SCHEMA_VERSION}")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in d]
        if missing:
            raise KeyError(", ".join(missing))
        kwargs = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        kwargs["caches"] = [CacheLevel.from_dict(c) for c in d.get("caches", [])]
        kwargs["gflops_by_size"] = {str(k): float(v) for k, v in d.get("gflops_by_size", {}).items()}
        kwargs["int8_gops_by_size"] = {str(k): float(v) for k, v in (d.get("int8_gops_by_size") or {}).items()}
        if kwargs.get("int8_gops") is not None:
            kwargs["int8_gops"] = float(kwargs["int8_gops"])
        if kwargs.get("cores") is not None:
            kwargs["cores"] = [int(c) for c in kwargs["cores"]]
        return cls(**kwargs)


# ---------------------------------------------------------------------------
# caches


def _parse_size(text: str) -> int:
    """'32K' / '512 KiB' / '33554432' -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse cache size {text!r}")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]


def _count_cpus(cpu_list: str) -> int:
    """'0-3,8' -> 5."""
    return len(parse_ranges(cpu_list))


def _caches_from_sys(root: Path) -> list[CacheLevel]:
    out = []
    for d in sorted(root.glob("index*")):
        def read(name: str, d: Path = d) -> str:
            p = d / name
            return p.read_text().strip() if p.exists() else ""

        if not read("size"):
            continue
        out.append(CacheLevel(
            level=int(read("level")), type=read("type"), size_bytes=_parse_size(read("size")),
            shared_cpus=_count_cpus(read("shared_cpu_list")) if read("shared_cpu_list") else 0,
            line_bytes=int(read("coherency_line_size") or 0),
        ))
    return out


def _caches_from_lscpu() -> list[CacheLevel]:
    try:
        res = subprocess.run(["lscpu", "-J", "-B", "-C"], capture_output=True, text=True,
                             timeout=10, check=True)
        rows = json.loads(res.stdout).get("caches", [])
    except (OSError, subprocess.SubprocessError, ValueError):
        return []
    out = []
    for r in rows:
        try:
            one, total = int(r["one-size"]), int(r.get("all-size") or r["one-size"])
            out.append(CacheLevel(
                level=int(r["level"]), type=str(r.get("type", "Unified")), size_bytes=one,
                # lscpu gives instance counts, not sharing; derive CPUs per instance.
                shared_cpus=(os.cpu_count() or 0) * one // total if total else 0,
                line_bytes=int(r.get("coherency-size") or 0),
            ))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def cache_levels(sys_root: str | os.PathLike[str] | None = None) -> list[CacheLevel]:
    """The CPU caches seen from CPU 0, from sysfs, else from ``lscpu``.

    Args:
        sys_root: the ``cpu0/cache`` directory (default the real one); for tests.

    Returns:
        Caches sorted by (level, type); empty when neither source is available.
    """
    root = Path(sys_root) if sys_root is not None else _SYS_CACHE
    caches = _caches_from_sys(root) if root.is_dir() else []
    if not caches:
        caches = _caches_from_lscpu()
    return sorted(caches, key=lambda c: (c.level, c.type))


def data_cache_bytes(level: int | None = None) -> int | None:
    """The largest data (or unified) cache of CPU 0 at ``level``, or at any level when
    ``level`` is None, in bytes; None when the machine does not say."""
    sizes = [c.size_bytes for c in cache_levels() if c.type != "Instruction" and level in (None, c.level)]
    return max(sizes) if sizes else None


# ---------------------------------------------------------------------------
# measurements


def _model(op: str, inputs: Sequence[tuple[str, list[int]]], out_shape: list[int],
           initializers: Sequence[Any] = (), *, in_type: int = 1, out_type: int = 1) -> bytes:
    """One-node model; ``in_type``/``out_type`` are TensorProto element types (FLOAT)."""
    from onnx import helper

    names = [n for n, _ in inputs] + [t.name for t in initializers]
    graph = helper.make_graph(
        [helper.make_node(op, names, ["y"])], f"peaks_{op}",
        [helper.make_tensor_value_info(n, in_type, s) for n, s in inputs],
        [helper.make_tensor_value_info("y", out_type, out_shape)],
        initializer=list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8  # readable by every onnxruntime the project supports
    return model.SerializeToString()


class _Call:
    """A two-argument call in the shape :func:`timed_runs` times a bound session
    (``run_fn(*run_args)``), for the numpy kernels."""

    def __init__(self, fn: Callable[[Any, Any], object], a: Any = None, b: Any = None):
        self.run_fn = fn
        self.run_args = (a, b)


def _best_time(bound: Any, reps: int, budget_s: float) -> float:
    """Min over up to ``reps`` timed runs after one discarded warm-up; stops early
    once ``budget_s`` is spent (at least two timed runs)."""
    timed_runs(bound, 1)
    start = time.perf_counter_ns()
    times = timed_runs(bound, min(2, reps))
    until = start + int(budget_s * 1e9)
    while len(times) < reps and time.perf_counter_ns() < until:
        timed_runs(bound, 1, out=times)
    return min(times) / 1e9


def _ort(model_bytes: bytes, cfg: RunnerConfig, feeds: Mapping[str, np.ndarray]) -> BoundSession:
    """A session created and bound as the runner's are: inputs in place, outputs
    bound after the first runs, so a timed run allocates nothing and faults no page."""
    return bind(create_session(model_bytes, cfg), feeds)


def _matmul_gflops(n: int, cfg: RunnerConfig, reps: int, budget_s: float) -> float:
    rng = np.random.default_rng(0)
    a = rng.random((n, n), dtype=np.float32)
    b = rng.random((n, n), dtype=np.float32)
    bound = _ort(_model("MatMul", [("a", [n, n]), ("b", [n, n])], [n, n]), cfg, {"a": a, "b": b})
    return 2.0 * n**3 / _best_time(bound, reps, budget_s) / 1e9


def _matmul_int8_gops(n: int, cfg: RunnerConfig, reps: int, budget_s: float) -> float:
    from onnx import TensorProto, numpy_helper

    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (n, n), dtype=np.uint8)
    # A constant weight, as in a quantized model: onnxruntime packs it once, at load.
    b = numpy_helper.from_array(rng.integers(-128, 128, (n, n), dtype=np.int8), "b")
    model = _model("MatMulInteger", [("a", [n, n])], [n, n], [b], in_type=TensorProto.UINT8,
                   out_type=TensorProto.INT32)
    bound = _ort(model, cfg, {"a": a})
    return 2.0 * n**3 / _best_time(bound, reps, budget_s) / 1e9


def _stream(n: int, cfg: RunnerConfig, reps: int, budget_s: float) -> dict[str, float]:
    from onnx import numpy_helper

    # np.full touches every page now, so page faults stay out of the timings.
    x = np.full(n, 1.0, np.float32)
    y = np.full(n, 2.0, np.float32)
    a = np.full(n, 0.0, np.float32)
    nbytes = x.nbytes
    out: dict[str, float] = {}

    out["copy_gbs"] = 2 * nbytes / _best_time(_Call(np.copyto, a, x), reps, budget_s) / 1e9

    chunk = 1 << 15  # 128 KiB of float32: the temporary stays in L2
    tmp = np.empty(chunk, np.float32)

    def triad(_a: Any, _b: Any) -> None:
        for i in range(0, n, chunk):
            t = tmp[: min(chunk, n - i)]
            np.multiply(y[i : i + chunk], 3.0, out=t)
            np.add(x[i : i + chunk], t, out=a[i : i + chunk])

    out["triad_gbs"] = 3 * nbytes / _best_time(_Call(triad), reps, budget_s) / 1e9

    s = numpy_helper.from_array(np.array(3.0, np.float32), "s")
    scale = _ort(_model("Mul", [("x", [n])], [n], [s]), cfg, {"x": x})
    out["ort_scale_gbs"] = 2 * nbytes / _best_time(scale, reps, budget_s) / 1e9
    del scale
    add = _ort(_model("Add", [("x", [n]), ("z", [n])], [n]), cfg, {"x": x, "z": y})
    out["ort_add_gbs"] = 3 * nbytes / _best_time(add, reps, budget_s) / 1e9
    return out


def _context() -> dict[str, Any]:
    import onnxruntime as ort

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "onnxruntime": ort.__version__, "numpy": np.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "cpu_model": model or platform.processor(), "cpu_count": os.cpu_count(),
    }


#: The largest array the bandwidth kernels stream (bytes, each of two or three).
STREAM_MAX_BYTES = 256 << 20


def stream_array_bytes(llc_bytes: int) -> int:
    """Bytes of each array the bandwidth kernels stream: twice the last-level cache, so
    that a pass reads DRAM, at least 64 MiB (cache sizes unknown or understated) and
    at most :data:`STREAM_MAX_BYTES`.

    Why a cap: a VM reports its host socket's L3 (480 MiB on the Xeon these figures are
    from), of which a core of a 2-vCPU guest holds a share, and filling arrays is most
    of the measurement where fresh memory is slow. There the measured bandwidth (numpy's
    copy, the best kernel) read 21.9-24.2 GB/s with 256 MiB arrays (4 runs) and
    23.4-23.6 GB/s with 960 MiB ones (2 runs, interleaved), and the whole measurement
    took 4 s instead of 30-47 s."""
    return min(max(2 * llc_bytes, 64 << 20), STREAM_MAX_BYTES)


def measure_peaks(threads: int = 1, cores: Sequence[int] | None = None, quick: bool = False) -> Peaks:
    """Measure compute and memory peaks at ``threads`` onnxruntime intra-op threads.

    Args:
        threads: intra-op threads for the onnxruntime kernels (numpy copy and triad
            are single-threaded whatever this is).
        cores: pin the measurement to these CPUs (Linux); restored afterwards.
        quick: fewer repetitions and smaller MatMuls (about a second; for tests);
            the full run takes several seconds.

    Returns:
        The measured :class:`Peaks`.

    Raises:
        ValueError: ``threads`` < 1, or ``cores`` is empty or names no usable CPU.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if cores is not None and not list(cores):
        raise ValueError("cores must not be empty")
    # The runner's session options at ``threads`` intra-op threads. The cores are
    # not in the configuration: the whole process is pinned to them instead, and
    # onnxruntime's pool threads inherit that mask.
    cfg = RunnerConfig(intra_op_threads=threads)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(pinned(tuple(cores) if cores is not None else None))
        except DlbricksError as exc:
            raise ValueError(str(exc)) from None
        fenv = FloatEnv()
        stack.callback(fenv.restore)
        fenv.set_flush(cfg.denormals_as_zero)
        t0 = time.perf_counter()
        caches = cache_levels()
        sizes, reps, budget = ((128, 256, 512), 4, 0.3) if quick else ((256, 512, 1024), 20, 2.0)
        by_size = {str(n): _matmul_gflops(n, cfg, reps, budget) for n in sizes}
        int8_by_size = {str(n): _matmul_int8_gops(n, cfg, reps, budget) for n in sizes}
        usable = [c.size_bytes for c in caches if c.type != "Instruction"]
        llc = max(usable) if usable else 32 << 20
        nbytes = stream_array_bytes(llc)
        # The best of 8 passes read 2-4% below the best of 20 (copy and onnxruntime's
        # Mul and Add, gigabyte arrays, three pairs on a shared VM) in half the time.
        bw = _stream(nbytes // 4, cfg, 3 if quick else 8, 0.5 if quick else 1.0)
        return Peaks(
            threads=threads, gflops=max(by_size.values()), gflops_by_size=by_size,
            int8_gops=max(int8_by_size.values()), int8_gops_by_size=int8_by_size,
            stream_bytes=nbytes, caches=caches, cores=sorted(cores) if cores is not None else None,
            quick=quick, elapsed_s=time.perf_counter() - t0, context=_context(), copy_gbs=bw["copy_gbs"],
            triad_gbs=bw["triad_gbs"], ort_scale_gbs=bw["ort_scale_gbs"], ort_add_gbs=bw["ort_add_gbs"],
        )


def _cache_path(store_dir: Path, fingerprint_id: str, threads: int, cores: Sequence[int] | None) -> Path:
    key = f"{fingerprint_id}|threads={threads}|cores={sorted(cores) if cores is not None else None}"
    return store_dir / f"peaks-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def load_or_measure_peaks(
    store_dir: str | os.PathLike[str] | None,
    fingerprint_id: str,
    *,
    threads: int = 1,
    cores: Sequence[int] | None = None,
    quick: bool = False,
) -> Peaks:
    """Peaks for this machine from a JSON cache, measuring them when absent.

    The cache file is keyed by ``fingerprint_id`` (the caller's machine fingerprint),
    ``threads`` and ``cores``. A cached quick measurement does not satisfy a request
    for a full one, nor one without the int8 peak (written before it was measured);
    an unreadable or stale file is replaced.

    Args:
        store_dir: directory for the cache files; None measures without caching.
        fingerprint_id: identifies the machine (and whatever else should invalidate).
        threads, cores, quick: as for :func:`measure_peaks`.

    Returns:
        The peaks, with ``fingerprint`` set to ``fingerprint_id``.

    Raises:
        ValueError: as for :func:`measure_peaks`.
        OSError: the cache directory cannot be created or written.
    """
    if store_dir is None:
        peaks = measure_peaks(threads=threads, cores=cores, quick=quick)
        peaks.fingerprint = fingerprint_id
        return peaks
    root = Path(store_dir)
    path = _cache_path(root, fingerprint_id, threads, cores)
    try:
        cached = Peaks.from_dict(json.loads(path.read_text()))
        if (cached.fingerprint == fingerprint_id and cached.threads == threads
                and (quick or not cached.quick) and cached.int8_gops is not None):
            return cached
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"dlbricks: ignoring unreadable peaks cache {path}: {exc}", file=sys.stderr)
    peaks = measure_peaks(threads=threads, cores=cores, quick=quick)
    peaks.fingerprint = fingerprint_id
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(peaks.to_dict(), indent=2, sort_keys=True))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new
    return peaks
