"""Time one ONNX model (a brick or a whole model) with onnxruntime on the CPU.

The runner follows the usual rules of trustworthy micro-benchmarking:

* session creation, input synthesis and binding happen before the clock starts;
* inputs are pre-allocated ``OrtValue`` objects and outputs are bound once with
  ``IOBinding``, so an iteration is one call into onnxruntime bracketed by two
  ``time.perf_counter_ns`` reads, with no numpy conversion on the clock;
* discarded warm-up iterations, then an adaptive loop that keeps *every* value and
  stops once the 95% confidence interval of the median is within ``target_ci`` of
  the median (after ``min_iters`` and ``min_time``), or at ``max_time``;
* thread counts, pinning and the denormals-as-zero flag are set explicitly and
  recorded with each :class:`Measurement`.

onnxruntime is imported lazily so that ``import dlbricks`` stays fast.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import numpy as np

from dlbricks.model import DlbricksError

if TYPE_CHECKING:  # pragma: no cover
    import onnx
    import onnxruntime

__all__ = [
    "BoundSession",
    "Failure",
    "Measurement",
    "Runner",
    "RunnerConfig",
    "Stats",
    "bind",
    "count_denormals",
    "create_session",
    "make_inputs",
    "median_ci_ranks",
    "summarize",
]

MEASUREMENT_SCHEMA_VERSION = 1
#: A run whose coefficient of variation exceeds this is flagged ``unstable``.
UNSTABLE_CV = 0.05
# Drift: the spread of the medians of DRIFT_BLOCKS consecutive blocks of iterations,
# relative to the median, above which a measurement is flagged as drifting.
DRIFT_BLOCKS = 8
DRIFT_WARN = 0.05

_EXECUTION_MODES = ("sequential", "parallel")
_GRAPH_OPTIMIZATIONS = ("default", "disable", "basic", "extended", "all")
# Fields of RunnerConfig that change *what* is measured (and so key stored results).
# The stopping rule and the timeout only change how long we sample, so results taken
# with different min/max times are interchangeable and share a key.
_IDENTITY_FIELDS = (
    "intra_op_threads",
    "inter_op_threads",
    "execution_mode",
    "graph_optimization",
    "cores",
    "denormals_as_zero",
)


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class RunnerConfig:
    """How to create sessions and when to stop sampling.

    Attributes:
        intra_op_threads: onnxruntime intra-op threads (0 = onnxruntime's default).
        inter_op_threads: onnxruntime inter-op threads (used in parallel mode).
        execution_mode: ``"sequential"`` or ``"parallel"``.
        graph_optimization: ``"default"`` (leave onnxruntime's default untouched),
            ``"disable"``, ``"basic"``, ``"extended"`` or ``"all"``.
        cores: logical CPUs to pin to, or None for no pinning. The calling thread is
            pinned with ``os.sched_setaffinity``; with more than one intra-op thread the
            pool threads are placed with ``session.intra_op_thread_affinities``.
        warmup_iters: discarded iterations before sampling (at least this many...).
        warmup_time: ...and at least this many seconds of them.
        min_iters: never stop with fewer samples (this floor wins over ``max_time``).
        min_time: never stop before this many seconds of sampling.
        max_time: stop at this many seconds of sampling even if not converged.
        target_ci: stop once the 95% CI of the median is within +/- this fraction
            (0 disables this rule: sample until ``max_time``).
        denormals_as_zero: set ``session.set_denormal_as_zero`` (flush-to-zero).
        timeout_s: per-job limit used by :mod:`dlbricks.workers` (set-up included).
    """

    intra_op_threads: int = 1
    inter_op_threads: int = 1
    execution_mode: str = "sequential"
    graph_optimization: str = "default"
    cores: tuple[int, ...] | None = None
    warmup_iters: int = 5
    warmup_time: float = 0.05
    min_iters: int = 10
    min_time: float = 0.2
    max_time: float = 2.0
    target_ci: float = 0.01
    denormals_as_zero: bool = True
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.cores is not None:
            # Accept any iterable (a JSON list, a range...) but store a sorted tuple so
            # that equal pinning gives equal configs and equal keys.
            cores = tuple(sorted({int(c) for c in self.cores}))
            if not cores or any(c < 0 for c in cores):
                raise DlbricksError(f"RunnerConfig: cores must be non-negative CPU ids, got {self.cores!r}")
            object.__setattr__(self, "cores", cores)
        if self.execution_mode not in _EXECUTION_MODES:
            raise DlbricksError(
                f"RunnerConfig: execution_mode must be one of {_EXECUTION_MODES}, got {self.execution_mode!r}"
            )
        if self.graph_optimization not in _GRAPH_OPTIMIZATIONS:
            raise DlbricksError(
                f"RunnerConfig: graph_optimization must be one of {_GRAPH_OPTIMIZATIONS}, "
                f"got {self.graph_optimization!r}"
            )
        for name in ("intra_op_threads", "inter_op_threads", "warmup_iters", "min_iters"):
            if int(getattr(self, name)) < 0:
                raise DlbricksError(f"RunnerConfig: {name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("warmup_time", "min_time", "max_time", "target_ci"):
            if not float(getattr(self, name)) >= 0:
                raise DlbricksError(f"RunnerConfig: {name} must be >= 0, got {getattr(self, name)!r}")
        if self.max_time < self.min_time:
            raise DlbricksError(f"RunnerConfig: max_time ({self.max_time}) < min_time ({self.min_time})")
        if not self.timeout_s > 0:
            raise DlbricksError(f"RunnerConfig: timeout_s must be > 0, got {self.timeout_s!r}")
        if self.cores is not None and self.intra_op_threads == 0:
            # onnxruntime's default thread count ignores the affinity mask, so pinning
            # would oversubscribe the pinned cores.
            raise DlbricksError("RunnerConfig: set intra_op_threads explicitly when pinning cores")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (``cores`` as a list or None)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["cores"] = list(self.cores) if self.cores is not None else None
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunnerConfig:
        """Inverse of :meth:`to_dict`; unknown keys are ignored (newer writers).

        Raises:
            DlbricksError: a value is invalid.
        """
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        if kwargs.get("cores") is not None:
            kwargs["cores"] = tuple(kwargs["cores"])
        return cls(**kwargs)

    def identity(self) -> dict[str, Any]:
        """The fields that change what is measured (see :meth:`key`).

        Pinning counts as the number of pinned CPUs, not their ids: the same run on
        CPU 0 or CPU 1 of one machine measures the same thing, and parallel workers
        (``bench --jobs``), each pinned to its own CPU, must share one key.
        """
        d = self.to_dict()
        ident = {k: d[k] for k in _IDENTITY_FIELDS}
        ident["cores"] = None if self.cores is None else len(self.cores)
        return ident

    def key(self) -> str:
        """A stable 16-hex-digit key over :meth:`identity`, used to key stored results.

        Thread counts, execution mode, optimisation level, the number of pinned
        cores and the denormals flag count; the stopping rule and the timeout do not.
        """
        canon = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- statistics


@functools.lru_cache(maxsize=256)
def median_ci_ranks(n: int, level: float = 0.95) -> tuple[int, int, bool]:
    """Order-statistic confidence interval for the median of ``n`` samples.

    Distribution-free: the number of samples below the true median is
    Binomial(n, 1/2), so ``[x_(l), x_(n+1-l)]`` (1-based order statistics) covers the
    median with probability ``1 - 2 P(B <= l - 1)``. The largest ``l`` whose coverage
    is at least ``level`` is chosen (exact binomial, computed in log space).

    Args:
        n: the sample size, >= 1.
        level: the coverage, in (0, 1).

    Returns:
        ``(lo, hi, exact)``: 0-based indices into the sorted sample, and whether the
        interval really reaches ``level`` (with fewer than 6 samples at 95% no
        interval does, and ``(0, n - 1)`` is returned with ``exact`` False).

    Raises:
        ValueError: ``n < 1`` or ``level`` outside (0, 1).
    """
    if n < 1:
        raise ValueError(f"median_ci_ranks: need at least one sample, got n={n}")
    if not 0 < level < 1:
        raise ValueError(f"median_ci_ranks: level must be in (0, 1), got {level}")
    k = np.arange(n // 2 + 1, dtype=np.float64)
    # log C(n, k) = sum_{i<k} log((n - i) / (i + 1)); cumsum keeps it exact-ish for any n.
    steps = np.log((n - k[:-1]) / (k[:-1] + 1.0))
    log_comb = np.concatenate(([0.0], np.cumsum(steps)))
    cdf = np.cumsum(np.exp(log_comb - n * math.log(2.0)))
    ok = np.nonzero(2.0 * cdf <= (1.0 - level) + 1e-12)[0]
    if ok.size == 0:
        return 0, n - 1, False
    l = int(ok[-1]) + 1  # 1-based rank of the lower bound
    return l - 1, n - l, True


@dataclass(frozen=True)
class Stats:
    """Summary statistics of a sample of iteration times, in nanoseconds.

    ``ci_low``/``ci_high`` bound the median (distribution-free, ``ci_level``);
    ``cv`` is stddev / mean; ``unstable`` is set when ``cv`` exceeds 5%, with the
    reason in ``warning``. ``drift`` is (largest - smallest) / median over the medians
    of 8 consecutive blocks of iterations (0 with fewer than 40 samples): the median's
    CI assumes the machine ran at one speed throughout, and a large drift says it did
    not (on a shared host, neighbours' load comes and goes), so the CI understates the
    run-to-run uncertainty.
    """

    n: int
    min: float
    max: float
    median: float
    mean: float
    stddev: float
    mad: float
    p25: float
    p75: float
    p90: float
    p99: float
    iqr: float
    ci_low: float
    ci_high: float
    ci_level: float
    ci_exact: bool
    cv: float
    unstable: bool
    warning: str | None = None
    drift: float = 0.0

    @property
    def ci_halfwidth_rel(self) -> float:
        """Largest distance from the median to a CI bound, relative to the median."""
        if self.median <= 0:
            return math.inf
        return max(self.median - self.ci_low, self.ci_high - self.median) / self.median

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Stats:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def summarize(times: Any, *, level: float = 0.95) -> Stats:
    """Summarise iteration times.

    Percentiles use linear interpolation (numpy's default); ``stddev`` is the sample
    standard deviation (ddof=1; 0 for one sample); ``mad`` is the median absolute
    deviation from the median.

    Args:
        times: a 1-D sequence of durations (any unit; dlbricks uses nanoseconds).
        level: the coverage of the median's confidence interval.

    Returns:
        The :class:`Stats`.

    Raises:
        ValueError: ``times`` is empty or not 1-D.
    """
    x = np.asarray(times, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"summarize: need a non-empty 1-D sample, got shape {x.shape}")
    n = int(x.size)
    s = np.sort(x)
    median = float(np.median(s))
    drift = block_drift(x, median)
    mean = float(s.mean())
    stddev = float(s.std(ddof=1)) if n > 1 else 0.0
    p25, p75, p90, p99 = (float(v) for v in np.percentile(s, [25, 75, 90, 99]))
    lo, hi, exact = median_ci_ranks(n, level)
    cv = stddev / mean if mean > 0 else 0.0
    unstable = cv > UNSTABLE_CV
    warning = None
    if unstable:
        warning = (
            f"unstable: stddev is {cv:.1%} of the mean (> {UNSTABLE_CV:.0%}); "
            "the system may be busy or frequency scaling active"
        )
    return Stats(
        n=n,
        min=float(s[0]),
        max=float(s[-1]),
        median=median,
        mean=mean,
        stddev=stddev,
        mad=float(np.median(np.abs(s - median))),
        p25=p25,
        p75=p75,
        p90=p90,
        p99=p99,
        iqr=p75 - p25,
        ci_low=float(s[lo]),
        ci_high=float(s[hi]),
        ci_level=level,
        ci_exact=exact,
        cv=cv,
        unstable=unstable,
        warning=warning,
        drift=drift,
    )


def block_drift(times: Any, median: float | None = None, blocks: int = DRIFT_BLOCKS) -> float:
    """(max - min) / median of the medians of ``blocks`` consecutive blocks of ``times``.

    ``times`` must be in sampling order. Returns 0 when there are fewer than 5 samples
    per block.
    """
    x = np.asarray(times, dtype=np.float64)
    if x.size < 5 * blocks:
        return 0.0
    m = float(np.median(x)) if median is None else median
    if m <= 0:
        return 0.0
    meds = [float(np.median(b)) for b in np.array_split(x, blocks)]
    return (max(meds) - min(meds)) / m


def _ci_converged(times: list[int], target: float) -> bool:
    """True when the median's 95% CI is within +/- ``target`` of the median.

    O(n) with ``np.partition``; called at geometrically spaced checkpoints only.
    """
    n = len(times)
    lo, hi, _ = median_ci_ranks(n)
    a = np.array(times, dtype=np.int64)
    m1, m2 = (n - 1) // 2, n // 2
    a.partition(sorted({lo, m1, m2, hi}))
    median = (float(a[m1]) + float(a[m2])) / 2.0
    half = max(median - float(a[lo]), float(a[hi]) - median)
    return half <= target * median


# --------------------------------------------------------------------------- denormals


def count_denormals(array: Any) -> int:
    """Number of subnormal (denormal) values in a floating-point array.

    Subnormals make x86 arithmetic tens of times slower unless flushed to zero, so a
    brick fed (or producing) them would be timed on a slow path a real model may
    never take. The count reads bit patterns (zero exponent, non-zero mantissa)
    rather than comparing magnitudes: once onnxruntime has set denormals-are-zero
    on this thread, float comparisons would see every subnormal as 0.

    Args:
        array: anything ``np.asarray`` accepts; non-float dtypes have none.

    Returns:
        The count (real and imaginary parts counted separately for complex arrays).
    """
    a = np.asarray(array)
    if a.dtype.kind == "c":
        return count_denormals(a.real) + count_denormals(a.imag)
    if a.dtype.kind != "f":
        return 0
    info = np.finfo(a.dtype)
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}.get(a.dtype.itemsize)
    if uint is None:  # long double: no portable bit layout; fall back to magnitudes
        mag = np.abs(a)
        return int(np.count_nonzero((mag > 0) & (mag < info.tiny)))
    bits = np.ascontiguousarray(a).view(uint)
    mant_bits = info.nmant
    exp_mask = uint(((1 << info.iexp) - 1) << mant_bits)
    mant_mask = uint((1 << mant_bits) - 1)
    return int(np.count_nonzero(((bits & exp_mask) == 0) & ((bits & mant_mask) != 0)))


def _denormals_flushed() -> bool:
    """Whether this thread currently flushes subnormals (FTZ/DAZ in effect)."""
    tiny = np.finfo(np.float32).tiny
    with np.errstate(all="ignore"):
        return bool(np.float32(tiny) * np.float32(0.5) == 0)


class _FloatEnv:
    """Control flush-to-zero on this thread, and restore the thread's FP state after.

    onnxruntime applies ``session.set_denormal_as_zero`` to the calling thread only
    for the *first* session of the process (a ``std::call_once``) and never undoes
    it, so the mode a brick runs in on this thread would depend on history: the
    runner sets FTZ/DAZ itself (x86-64 MXCSR bits 15 and 6, aarch64 FPCR.FZ) through
    glibc's ``fegetenv``/``fesetenv``, and puts the saved environment back after
    timing so later numpy code on the thread is unaffected. Elsewhere it is a no-op
    (the observed mode is still recorded in the measurement).
    """

    _libm: Any = None
    _loaded = False
    # (byte offset of the control register in fenv_t, flush bits) per architecture.
    _LAYOUT = {"x86_64": (28, 0x8040), "amd64": (28, 0x8040), "aarch64": (0, 1 << 24), "arm64": (0, 1 << 24)}

    @classmethod
    def _lib(cls) -> Any:
        if not cls._loaded:
            cls._loaded = True
            try:
                import ctypes
                import ctypes.util

                name = ctypes.util.find_library("m")
                lib = ctypes.CDLL(name) if name else None
                if lib is not None and hasattr(lib, "fegetenv") and hasattr(lib, "fesetenv"):
                    cls._libm = lib
            except OSError:
                cls._libm = None
        return cls._libm

    def __init__(self) -> None:
        import ctypes
        import platform

        self._buf = ctypes.create_string_buffer(256)  # > sizeof(fenv_t) on every glibc ABI
        lib = self._lib()
        self._saved = lib is not None and lib.fegetenv(self._buf) == 0
        self._layout = self._LAYOUT.get(platform.machine().lower()) if sys.platform.startswith("linux") else None

    def set_flush(self, on: bool) -> None:
        """Turn flush-to-zero/denormals-are-zero on or off for this thread."""
        lib = self._lib()
        if lib is None or not self._saved or self._layout is None:
            return
        import ctypes

        offset, bits = self._layout
        env = ctypes.create_string_buffer(256)
        if lib.fegetenv(env) != 0:
            return
        reg = int.from_bytes(env.raw[offset : offset + 4], sys.byteorder)
        reg = (reg | bits) if on else (reg & ~bits & 0xFFFFFFFF)
        ctypes.memmove(ctypes.addressof(env) + offset, reg.to_bytes(4, sys.byteorder), 4)
        lib.fesetenv(env)

    def restore(self) -> None:
        """Put back the environment saved at construction."""
        lib = self._lib()
        if lib is not None and self._saved:
            lib.fesetenv(self._buf)


# --------------------------------------------------------------------------- inputs

# ORT type strings of session inputs -> numpy dtypes.
_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int8)": np.int8,
    "tensor(int16)": np.int16,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
    "tensor(uint8)": np.uint8,
    "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
    "tensor(string)": np.str_,
}
# Floats are drawn from [-1, 1] with magnitudes below this pushed up to it: tiny values
# would be subnormal in float16 (whose smallest normal is ~6.1e-5).
_FLOAT_FLOOR = 1e-3


@dataclass(frozen=True)
class _InputSpec:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]


def _load_proto(source: Any) -> onnx.ModelProto:
    import onnx

    if isinstance(source, onnx.ModelProto):
        return source
    if isinstance(source, (bytes, bytearray)):
        return onnx.load_from_string(bytes(source))
    try:
        # Weights are not needed to read the graph; skip external data.
        return onnx.load(os.fspath(source), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, OSError, ... for bad files
        raise DlbricksError(f"{source}: cannot read ONNX model: {exc}") from exc


def _is_session(obj: Any) -> bool:
    return hasattr(obj, "get_inputs") and hasattr(obj, "run")


def _static_shape(dims: Any) -> tuple[int, ...]:
    # Symbolic or unknown dimensions become 1: bricks are static, and 1 is the only
    # size valid for every dimension a model may constrain (batch, sequence...).
    return tuple(d if isinstance(d, int) and d >= 0 else 1 for d in dims)


def _specs_from_session(session: Any) -> list[_InputSpec]:
    specs = []
    for inp in session.get_inputs():
        dtype = _ORT_TYPES.get(inp.type)
        if dtype is None:
            raise DlbricksError(f"input {inp.name!r}: cannot synthesise values of type {inp.type}")
        specs.append(_InputSpec(inp.name, np.dtype(dtype), _static_shape(inp.shape)))
    return specs


def _proto_dims(type_proto: Any) -> tuple[int | None, ...] | None:
    if not type_proto.HasField("tensor_type") or not type_proto.tensor_type.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else None for d in type_proto.tensor_type.shape.dim)


def _specs_from_proto(model: onnx.ModelProto) -> list[_InputSpec]:
    import onnx.helper

    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        if not vi.type.HasField("tensor_type"):
            raise DlbricksError(f"input {vi.name!r}: only tensor inputs can be synthesised")
        elem = vi.type.tensor_type.elem_type
        try:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
        except Exception as exc:
            raise DlbricksError(f"input {vi.name!r}: unsupported element type {elem}") from exc
        if elem == onnx.TensorProto.STRING:
            dtype = np.dtype(np.str_)
        dims = _proto_dims(vi.type) or ()
        specs.append(_InputSpec(vi.name, dtype, _static_shape(dims)))
    return specs


def _known_shapes(model: onnx.ModelProto, infer: bool) -> dict[str, tuple[int | None, ...]]:
    g = model.graph
    shapes: dict[str, tuple[int | None, ...]] = {}
    for t in g.initializer:
        shapes[t.name] = tuple(t.dims)
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        dims = _proto_dims(vi.type)
        if dims is not None:
            shapes.setdefault(vi.name, dims)
    for node in g.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    shapes[node.output[0]] = tuple(a.t.dims)
    if infer:
        import onnx.shape_inference

        try:
            inferred = onnx.shape_inference.infer_shapes(model)
        except Exception:  # shape inference is a best effort: fall back to what we know
            return shapes
        for vi in inferred.graph.value_info:
            dims = _proto_dims(vi.type)
            if dims is not None:
                shapes.setdefault(vi.name, dims)
    return shapes


def _attr_int(node: Any, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


def _dim(shapes: Mapping[str, tuple[int | None, ...]], tensor: str, axis: int) -> int | None:
    dims = shapes.get(tensor)
    if not dims:
        return None
    if axis < 0:
        axis += len(dims)
    if not 0 <= axis < len(dims):
        return None
    d = dims[axis]
    return d if isinstance(d, int) and d > 0 else None


def _index_bounds(model: onnx.ModelProto, names: set[str]) -> dict[str, tuple[int, int]]:
    """Value ranges [low, high) for integer inputs that index into another tensor.

    Looks at each input's direct consumers: Gather/GatherElements/Scatter* indices
    must lie within the indexed axis of the data operand, GatherND/ScatterND
    indices within the dims they address, TopK's k within [1, axis size]. The
    tightest bound over all consumers wins.
    """
    consumers: dict[str, list[tuple[Any, int]]] = {n: [] for n in names}
    for node in model.graph.node:
        for slot, inp in enumerate(node.input):
            if inp in consumers:
                consumers[inp].append((node, slot))
    need_infer = any(consumers.values())
    shapes = _known_shapes(model, infer=need_infer)
    out: dict[str, tuple[int, int]] = {}
    for name, uses in consumers.items():
        low, high = 0, None
        for node, slot in uses:
            op, data = node.op_type, node.input[0] if node.input else ""
            bound = None
            if op in ("Gather", "GatherElements", "ScatterElements", "Scatter") and slot == 1:
                bound = _dim(shapes, data, _attr_int(node, "axis", 0))
            elif op in ("GatherND", "ScatterND") and slot == 1:
                b = _attr_int(node, "batch_dims", 0)
                idx = shapes.get(name) or ()
                m = idx[-1] if idx and isinstance(idx[-1], int) else None
                ddims = shapes.get(data)
                if m and ddims and len(ddims) >= b + m:
                    sub = [d for d in ddims[b : b + m] if isinstance(d, int) and d > 0]
                    bound = min(sub) if len(sub) == m else None
            elif op == "TopK" and slot == 1:
                size = _dim(shapes, data, _attr_int(node, "axis", -1))
                if size is not None:
                    low, bound = 1, size + 1
            elif op == "OneHot" and slot == 1:
                low = 1  # depth must be positive
            if bound is not None:
                high = bound if high is None else min(high, bound)
        if high is not None:
            out[name] = (low, max(high, low + 1))
        elif low:
            out[name] = (low, low + 1)
    return out


def make_inputs(
    source: Any,
    seed: int = 0,
    *,
    int_bounds: Mapping[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """Synthesise seeded, dtype-correct inputs for a model.

    Floats are uniform in [-1, 1] with magnitudes below 1e-3 raised to 1e-3, so no
    value is subnormal even in float16. Booleans are fair coin flips. Integers must
    often index something, so they are non-negative and bounded: by ``int_bounds``
    when given (values in ``[0, bound)``), else by what the graph shows (Gather's
    indexed axis, TopK's axis for k...; needs a model, not a session), else by the
    smallest static dimension of any input or initializer (valid for every axis).
    Each input draws from its own stream seeded by ``(seed, position)``.
    Symbolic dimensions are taken as 1.

    Args:
        source: an ``onnxruntime.InferenceSession``, an ``onnx.ModelProto``,
            serialized bytes or a path.
        seed: the random seed.
        int_bounds: exclusive upper bounds for named integer inputs.

    Returns:
        Input name -> array, in the model's input order.

    Raises:
        DlbricksError: the model cannot be read or an input type is unsupported.
    """
    int_bounds = dict(int_bounds or {})
    proto = None
    if _is_session(source):
        specs = _specs_from_session(source)
    else:
        proto = _load_proto(source)
        specs = _specs_from_proto(proto)

    def is_int(s: _InputSpec) -> bool:
        return s.dtype.kind in "iu"

    unbounded = {s.name for s in specs if is_int(s) and s.name not in int_bounds}
    graph_bounds = _index_bounds(proto, unbounded) if (proto is not None and unbounded) else {}
    default_high = _default_int_high(proto, specs)

    out: dict[str, np.ndarray] = {}
    for pos, spec in enumerate(specs):
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, pos])
        kind = spec.dtype.kind
        if kind == "f":
            x = rng.uniform(-1.0, 1.0, size=spec.shape)
            small = np.abs(x) < _FLOAT_FLOOR
            x[small] = np.copysign(_FLOAT_FLOOR, x[small])
            out[spec.name] = x.astype(spec.dtype)
        elif kind == "b":
            out[spec.name] = rng.random(size=spec.shape) < 0.5
        elif kind in "iu":
            if spec.name in int_bounds:
                low, high = 0, int(int_bounds[spec.name])
                if high < 1:
                    raise DlbricksError(f"input {spec.name!r}: int bound must be >= 1, got {high}")
            else:
                low, high = graph_bounds.get(spec.name, (0, default_high))
            high = min(high, int(np.iinfo(spec.dtype).max) + 1)
            out[spec.name] = rng.integers(low, high, size=spec.shape, dtype=np.int64).astype(spec.dtype)
        elif kind == "U":
            out[spec.name] = np.full(spec.shape, "a", dtype=object)
        else:
            raise DlbricksError(f"input {spec.name!r}: cannot synthesise values of dtype {spec.dtype}")
    return out


def _default_int_high(proto: Any, specs: list[_InputSpec]) -> int:
    dims = [d for s in specs for d in s.shape if d > 0]
    if proto is not None:
        dims += [int(d) for t in proto.graph.initializer for d in t.dims if d > 0]
    return max(1, min(dims)) if dims else 1


# --------------------------------------------------------------------------- sessions


def _affinity_string(cores: tuple[int, ...], threads: int) -> str:
    # One entry per pool thread (onnxruntime does not place the calling thread);
    # ids are 1-based. The calling thread keeps cores[0], so pool threads start at
    # cores[1] and wrap round when there are more threads than cores.
    return ";".join(str(cores[(i + 1) % len(cores)] + 1) for i in range(threads - 1))


def _model_label(model: Any) -> str:
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    graph = getattr(model, "graph", None)
    return f"<model {graph.name}>" if graph is not None and graph.name else "<model>"


def session_options(cfg: RunnerConfig) -> onnxruntime.SessionOptions:
    """onnxruntime ``SessionOptions`` for a runner configuration (threads, execution
    mode, optimisation level, denormals, pool-thread affinities). Every session that
    dlbricks times is created with these, so the profiler's sessions match the runner's."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = cfg.intra_op_threads
    so.inter_op_num_threads = cfg.inter_op_threads
    so.execution_mode = (
        ort.ExecutionMode.ORT_PARALLEL if cfg.execution_mode == "parallel" else ort.ExecutionMode.ORT_SEQUENTIAL
    )
    if cfg.graph_optimization != "default":
        so.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[cfg.graph_optimization]
    so.log_severity_level = 3  # errors only: warnings would drown the CLI's output
    if cfg.denormals_as_zero:
        so.add_session_config_entry("session.set_denormal_as_zero", "1")
    if cfg.cores is not None and cfg.intra_op_threads > 1:
        so.add_session_config_entry("session.intra_op_thread_affinities", _affinity_string(cfg.cores, cfg.intra_op_threads))
    return so


def create_session(model: Any, config: RunnerConfig | None = None) -> onnxruntime.InferenceSession:
    """Create a CPU ``InferenceSession`` with the options of ``config``.

    Pinning of the calling thread is the caller's business (see :meth:`Runner.time`);
    this only adds the pool-thread affinities.

    Args:
        model: a path, serialized bytes or an ``onnx.ModelProto``.
        config: the runner configuration (defaults to ``RunnerConfig()``).

    Returns:
        The session.

    Raises:
        DlbricksError: onnxruntime rejects the model or the options.
    """
    import onnxruntime as ort

    so = session_options(config or RunnerConfig())
    if isinstance(model, (str, os.PathLike)):
        src: Any = os.fspath(model)
    elif isinstance(model, (bytes, bytearray)):
        src = bytes(model)
    else:
        src = model.SerializeToString()
    try:
        return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own pybind exception types
        raise DlbricksError(f"{_model_label(model)}: onnxruntime cannot load the model: {exc}") from exc


class BoundSession:
    """A session with its inputs and outputs bound once, ready to run repeatedly.

    Inputs live in pre-allocated ``OrtValue`` objects. After the first run the
    produced outputs are bound back, so later runs write into the same buffers and
    an iteration allocates nothing on the Python side. onnxruntime cannot bind
    string tensors; a model with string inputs or outputs falls back to
    ``session.run`` (``uses_iobinding`` is then False).
    """

    def __init__(self, session: onnxruntime.InferenceSession, feeds: Mapping[str, np.ndarray]):
        import onnxruntime as ort

        self.session = session
        self._out_names = [o.name for o in session.get_outputs()]
        arrays = {n: np.ascontiguousarray(a) for n, a in feeds.items()}
        has_strings = any(a.dtype.kind in "OU" for a in arrays.values()) or any(
            o.type == "tensor(string)" for o in session.get_outputs()
        )
        self.uses_iobinding = not has_strings
        if has_strings:
            self._feeds = arrays
            self._last: list[Any] = session.run(None, arrays)
            self.run_fn: Any = session.run
            self.run_args: tuple[Any, Any] = (None, arrays)
            return
        self._values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in arrays.items()}
        self._binding = session.io_binding()
        for name, value in self._values.items():
            self._binding.bind_ortvalue_input(name, value)
        for name in self._out_names:
            self._binding.bind_output(name, "cpu")
        # First run through the public API, which validates that the binding belongs
        # to this session.
        session.run_with_iobinding(self._binding)
        produced = self._binding.get_outputs()
        try:
            self._binding.clear_binding_outputs()
            for name, value in zip(self._out_names, produced):
                self._binding.bind_ortvalue_output(name, value)
            session.run_with_iobinding(self._binding)
        except Exception:  # e.g. sequence outputs cannot be pre-bound: let ORT allocate
            self._binding.clear_binding_outputs()
            for name in self._out_names:
                self._binding.bind_output(name, "cpu")
            session.run_with_iobinding(self._binding)
        # The public run_with_iobinding wraps the C++ call in WebGPU graph-capture
        # bookkeeping (several Python calls); on CPU the raw call does the same work,
        # so use it when available to keep Python off the clock.
        raw_sess = getattr(session, "_sess", None)
        raw_binding = getattr(self._binding, "_iobinding", None)
        if raw_sess is not None and raw_binding is not None and hasattr(raw_sess, "run_with_iobinding"):
            self.run_fn = raw_sess.run_with_iobinding
            self.run_args = (raw_binding, None)
        else:
            self.run_fn = session.run_with_iobinding
            self.run_args = (self._binding, None)

    def run(self) -> None:
        """Run once (the timed loop inlines this call)."""
        a, b = self.run_args
        if self.uses_iobinding:
            self.run_fn(a, b)
        else:
            self._last = self.run_fn(a, b)

    def outputs(self) -> dict[str, np.ndarray]:
        """The outputs of the latest run (of :meth:`run` or the binding runs), as numpy."""
        if not self.uses_iobinding:
            return {n: np.asarray(v) for n, v in zip(self._out_names, self._last)}
        return {n: v.numpy() for n, v in zip(self._out_names, self._binding.get_outputs())}


def bind(session: onnxruntime.InferenceSession, feeds: Mapping[str, np.ndarray]) -> BoundSession:
    """Bind ``feeds`` and the outputs of ``session`` (runs the session twice).

    Raises:
        DlbricksError: a run fails (bad input, kernel error).
    """
    try:
        return BoundSession(session, feeds)
    except Exception as exc:
        raise DlbricksError(f"cannot run the session with IOBinding: {exc}") from exc


@contextlib.contextmanager
def _pinned(cores: tuple[int, ...] | None) -> Iterator[None]:
    if cores is None:
        yield
        return
    if not hasattr(os, "sched_setaffinity"):
        raise DlbricksError("pinning cores needs os.sched_setaffinity (Linux)")
    old = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cores)
    except OSError as exc:
        raise DlbricksError(f"cannot pin to cores {list(cores)} (allowed: {sorted(old)}): {exc}") from exc
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


# --------------------------------------------------------------------------- results


@dataclass
class Measurement:
    """The timing of one model: every sample plus how it was taken.

    Attributes:
        times_ns: all timed iterations, in order (int64 nanoseconds).
        stats: :func:`summarize` of ``times_ns``.
        config: the runner configuration.
        warmup_iters: discarded iterations (the two binding runs included).
        stop_reason: ``"converged"`` (CI reached ``target_ci``) or ``"max_time"``.
        setup_time_s: session creation, input synthesis and binding.
        wall_time_s: the whole call, set-up included.
        denormal_input_fraction / denormal_output_fraction: subnormal share of the
            input / output elements (outputs checked once, after warm-up).
        denormal_fraction: the share over inputs and outputs together.
        denormals_as_zero: whether the session was asked to flush denormals (config).
        denormals_flushed: whether flush-to-zero was observed in effect on the
            calling thread after session creation.
        ort_version: onnxruntime's version.
        seed: the input seed.
        model: the model's path or label.
        sampling_time_s: wall time of the sampling loop; divided by ``stats.n`` and
            compared with ``stats.mean`` it gives the runner's per-iteration cost
            outside the clock.
        io_binding: False when string tensors forced the ``session.run`` path
            (output conversion is then on the clock).
    """

    times_ns: np.ndarray
    stats: Stats
    config: RunnerConfig
    warmup_iters: int
    stop_reason: str
    setup_time_s: float
    wall_time_s: float
    denormal_input_fraction: float
    denormal_output_fraction: float
    denormal_fraction: float
    denormals_as_zero: bool
    denormals_flushed: bool
    ort_version: str
    seed: int = 0
    model: str = ""
    sampling_time_s: float = 0.0
    io_binding: bool = True
    timer_resolution_ns: float = field(default_factory=lambda: time.get_clock_info("perf_counter").resolution * 1e9)

    @property
    def median_ns(self) -> float:
        return self.stats.median

    @property
    def warnings(self) -> list[str]:
        """Human-readable reasons to distrust this measurement."""
        out = []
        if self.stats.warning:
            out.append(self.stats.warning)
        if self.stats.drift > DRIFT_WARN:
            out.append(
                f"drifting: medians of {DRIFT_BLOCKS} consecutive blocks of iterations span "
                f"{self.stats.drift:.1%} of the median; the machine's speed changed while sampling, "
                "so the CI understates run-to-run variation"
            )
        if self.stop_reason == "max_time":
            out.append(
                f"stopped at max_time before the median's CI reached +/-{self.config.target_ci:.1%} "
                f"(it is +/-{self.stats.ci_halfwidth_rel:.1%})"
            )
        if self.denormal_fraction > 0:
            out.append(f"{self.denormal_fraction:.2%} of input/output values are denormal")
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict, with ``schema_version``."""
        return {
            "schema_version": MEASUREMENT_SCHEMA_VERSION,
            "model": self.model,
            "times_ns": [int(t) for t in self.times_ns],
            "stats": self.stats.to_dict(),
            "config": self.config.to_dict(),
            "config_key": self.config.key(),
            "warmup_iters": self.warmup_iters,
            "stop_reason": self.stop_reason,
            "setup_time_s": self.setup_time_s,
            "wall_time_s": self.wall_time_s,
            "denormal_input_fraction": self.denormal_input_fraction,
            "denormal_output_fraction": self.denormal_output_fraction,
            "denormal_fraction": self.denormal_fraction,
            "denormals_as_zero": self.denormals_as_zero,
            "denormals_flushed": self.denormals_flushed,
            "ort_version": self.ort_version,
            "seed": self.seed,
            "sampling_time_s": self.sampling_time_s,
            "io_binding": self.io_binding,
            "timer_resolution_ns": self.timer_resolution_ns,
            "warnings": self.warnings,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Measurement:
        """Inverse of :meth:`to_dict`; unknown keys are ignored.

        Raises:
            DlbricksError: the dict comes from a newer, incompatible schema.
        """
        version = int(d.get("schema_version", 1))
        if version > MEASUREMENT_SCHEMA_VERSION:
            raise DlbricksError(
                f"measurement schema {version} is newer than this dlbricks understands ({MEASUREMENT_SCHEMA_VERSION})"
            )
        times = np.asarray(d["times_ns"], dtype=np.int64)
        return cls(
            times_ns=times,
            stats=Stats.from_dict(d["stats"]) if "stats" in d else summarize(times),
            config=RunnerConfig.from_dict(d["config"]),
            warmup_iters=int(d["warmup_iters"]),
            stop_reason=str(d["stop_reason"]),
            setup_time_s=float(d["setup_time_s"]),
            wall_time_s=float(d["wall_time_s"]),
            denormal_input_fraction=float(d["denormal_input_fraction"]),
            denormal_output_fraction=float(d["denormal_output_fraction"]),
            denormal_fraction=float(d["denormal_fraction"]),
            denormals_as_zero=bool(d["denormals_as_zero"]),
            denormals_flushed=bool(d.get("denormals_flushed", d["denormals_as_zero"])),
            ort_version=str(d["ort_version"]),
            seed=int(d.get("seed", 0)),
            model=str(d.get("model", "")),
            sampling_time_s=float(d.get("sampling_time_s", 0.0)),
            io_binding=bool(d.get("io_binding", True)),
            timer_resolution_ns=float(d.get("timer_resolution_ns", 0.0)),
        )


@dataclass
class Failure:
    """A timing job that produced no measurement.

    Attributes:
        error: one line saying what went wrong.
        reason: ``"error"`` (an exception: bad model, failed run), ``"crash"``
            (the worker process died) or ``"timeout"``.
        exitcode: the worker's exit code for crashes (negative: killed by a signal).
        wall_time_s: time spent on the job before it failed.
    """

    error: str
    reason: str = "error"
    exitcode: int | None = None
    wall_time_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"error": self.error, "reason": self.reason, "exitcode": self.exitcode, "wall_time_s": self.wall_time_s}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Failure:
        return cls(
            error=str(d["error"]),
            reason=str(d.get("reason", "error")),
            exitcode=d.get("exitcode"),
            wall_time_s=float(d.get("wall_time_s", 0.0)),
        )


# --------------------------------------------------------------------------- runner


class Runner:
    """Times models with one :class:`RunnerConfig`.

    Example:
        >>> m = Runner(RunnerConfig(min_time=0.1)).time("brick.onnx")  # doctest: +SKIP
        >>> m.stats.median, m.stats.ci_low, m.stats.ci_high  # doctest: +SKIP
    """

    def __init__(self, config: RunnerConfig | None = None):
        self.config = config or RunnerConfig()

    def time(
        self,
        model: Any,
        *,
        inputs: Mapping[str, np.ndarray] | None = None,
        seed: int = 0,
        int_bounds: Mapping[str, int] | None = None,
    ) -> Measurement:
        """Time one model.

        Args:
            model: a path, serialized bytes or an ``onnx.ModelProto``.
            inputs: values for some or all inputs; the rest are synthesised with
                :func:`make_inputs`.
            seed: the seed for synthesised inputs.
            int_bounds: bounds for synthesised integer inputs (see :func:`make_inputs`).

        Returns:
            The :class:`Measurement`.

        Raises:
            DlbricksError: the model cannot be loaded or run, or pinning fails.
        """
        import onnxruntime as ort

        cfg = self.config
        wall0 = time.perf_counter()
        label = _model_label(model)
        fenv = _FloatEnv()
        try:
            with _pinned(cfg.cores):
                session = create_session(model, cfg)
                # After creation: the first session of the process sets the mode
                # from its own options, and we want this config's.
                fenv.set_flush(cfg.denormals_as_zero)
                # With one intra-op thread the kernels run on this thread, so this
                # observes the mode they run in.
                flushed = _denormals_flushed()
                feeds = self._feeds(session, model, inputs, seed, int_bounds)
                bound = bind(session, feeds)
                n_in = sum(int(np.size(a)) for a in feeds.values())
                den_in = sum(count_denormals(a) for a in feeds.values())
                if cfg.cores is not None and cfg.intra_op_threads > 1:
                    # Pool threads own cores[1:] (see _affinity_string); keep the
                    # calling thread, which also computes, off them.
                    os.sched_setaffinity(0, {cfg.cores[0]})
                setup_s = time.perf_counter() - wall0
                try:
                    warmup = 2 + self._warm_up(bound)  # two binding runs already happened
                    outs = bound.outputs()
                    n_out = sum(int(np.size(a)) for a in outs.values())
                    den_out = sum(count_denormals(a) for a in outs.values())
                    del outs
                    t_sample = time.perf_counter()
                    times, reason = self._sample(bound)
                    sampling_s = time.perf_counter() - t_sample
                except DlbricksError:
                    raise
                except Exception as exc:
                    raise DlbricksError(f"{label}: run failed: {exc}") from exc
        finally:
            fenv.restore()
        times_ns = np.asarray(times, dtype=np.int64)
        return Measurement(
            times_ns=times_ns,
            stats=summarize(times_ns),
            config=cfg,
            warmup_iters=warmup,
            stop_reason=reason,
            setup_time_s=setup_s,
            wall_time_s=time.perf_counter() - wall0,
            denormal_input_fraction=den_in / n_in if n_in else 0.0,
            denormal_output_fraction=den_out / n_out if n_out else 0.0,
            denormal_fraction=(den_in + den_out) / (n_in + n_out) if (n_in + n_out) else 0.0,
            denormals_as_zero=cfg.denormals_as_zero,
            denormals_flushed=flushed,
            ort_version=ort.__version__,
            seed=seed,
            model=label,
            sampling_time_s=sampling_s,
            io_binding=bound.uses_iobinding,
        )

    def _feeds(
        self,
        session: Any,
        model: Any,
        inputs: Mapping[str, np.ndarray] | None,
        seed: int,
        int_bounds: Mapping[str, int] | None,
    ) -> dict[str, np.ndarray]:
        given = dict(inputs or {})
        names = [i.name for i in session.get_inputs()]
        unknown = set(given) - set(names)
        if unknown:
            raise DlbricksError(f"{_model_label(model)}: no input named {sorted(unknown)} (inputs: {names})")
        if all(n in given for n in names):
            return {n: np.asarray(given[n]) for n in names}
        need_graph = any(
            np.dtype(_ORT_TYPES.get(i.type, np.float32)).kind in "iu"
            and i.name not in given
            and i.name not in (int_bounds or {})
            for i in session.get_inputs()
        )
        # The graph tells which integer inputs index what; only read it when needed.
        source = model if need_graph else session
        made = make_inputs(source, seed, int_bounds=int_bounds)
        return {n: np.asarray(given[n]) if n in given else made[n] for n in names}

    def _warm_up(self, bound: BoundSession) -> int:
        cfg = self.config
        run, (a, b) = bound.run_fn, bound.run_args
        clock = time.perf_counter_ns
        start = clock()
        until = start + int(cfg.warmup_time * 1e9)
        cap = start + int(cfg.max_time * 1e9)  # a slow brick is not warmed for ages
        n = 0
        while n < cfg.warmup_iters or clock() < until:
            run(a, b)
            n += 1
            if clock() >= cap:
                break
        return n

    def _sample(self, bound: BoundSession) -> tuple[list[int], str]:
        cfg = self.config
        # Every run_fn takes exactly two arguments, so the call on the clock is a
        # plain two-argument call (no tuple unpacking).
        run, (a, b) = bound.run_fn, bound.run_args
        clock = time.perf_counter_ns
        times: list[int] = []
        append = times.append
        min_iters = max(1, cfg.min_iters)
        target = cfg.target_ci
        start = clock()
        min_t = start + int(cfg.min_time * 1e9)
        max_t = start + int(cfg.max_time * 1e9)
        # The stopping rule is evaluated only when the clock passes check_t, so an
        # ordinary iteration costs two clock reads, one append and one comparison.
        # Checkpoints are spaced at 10% of the elapsed time (>= 1 ms), which keeps
        # the O(n) CI computation amortised O(1) per iteration.
        check_t = min_t
        gc_on = gc.isenabled()
        gc.disable()  # a collection inside the timed region would be a spurious outlier
        try:
            while True:
                t0 = clock()
                run(a, b)
                t1 = clock()
                append(t1 - t0)
                if t1 >= check_t and len(times) >= min_iters:
                    if t1 >= max_t:
                        return times, "max_time"
                    if target > 0 and _ci_converged(times, target):
                        return times, "converged"
                    check_t = min(t1 + max((t1 - start) // 10, 1_000_000), max_t)
        finally:
            if gc_on:
                gc.enable()
