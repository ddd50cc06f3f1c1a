"""How sessions are created and when sampling stops: the runner configuration that keys results."""

from __future__ import annotations

import hashlib
import json
import numbers
from dataclasses import dataclass, fields
from typing import Any, Mapping

from dlbricks.errors import DlbricksError

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
    "cache_state",
    "thread_spinning",
    "huge_pages",
)
#: What a timed run finds in the caches (see RunnerConfig.cache_state).
CACHE_STATES = ("warm", "cold", "auto")
#: How a cold run is made cold (:class:`dlbricks.timing.engine_worker._Evictor`): part of
#: the key of every configuration that times cold runs, so that results taken another
#: way are not reused. 2: a fixed amount of data read between two runs of a session.
COLD_METHOD = 2
#: Which sessions cache state ``"auto"`` times cold: part of its key, so that results
#: timed under an earlier rule are not reused. 2: those whose weights outgrow the core's
#: L2 cache and which are not compute-bound (1: the size alone).
AUTO_RULE = 2
#: What a timed run's duration is read from (see RunnerConfig.clock).
CLOCKS = ("auto", "wall", "thread")


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
        timeout_s: per-job limit used by :mod:`dlbricks.timing.workers` (set-up included).
        precision: the measurement engine's target: the 95% interval of every model's
            latency (reconstructed from bricks, and end to end) within +/- this
            fraction. Iterations are allocated across bricks to reach it at the least
            total time (:mod:`dlbricks.timing.engine`).
        min_rounds: the engine measures in rounds (every live session gets a short
            burst per round); no result is final before this many rounds, since its
            interval comes from the spread between rounds.
        max_rounds: stop after this many rounds even if a model's interval is wider.
        min_span_s: no result is final before its rounds span this many seconds. A
            shared host has slow phases of a few tenths of a second to seconds (a whole
            model 45% slower for seven rounds in a row, then as fast as before); a small
            corpus runs a round in tens of milliseconds, so a brick's few rounds can all
            fall in one phase and carry it into the result, and the bricks and the whole
            model do not slow by the same factor. Rounds spread over seconds sample
            many phases (and, for a whole model compared in its bricks' rounds, more of
            its own). The allocation spreads a brick's runs over its rounds, so a longer
            span adds rounds' fixed costs, not runs; a corpus whose rounds are longer
            pays nothing for it.
        model_span_s: the same for a whole model's result (an item of kind
            ``"model"``), which needs the longer span: a model's reconstruction sums
            bricks whose rounds are spread over the whole run, so it averages the
            host's states over all of them, while the model's own estimate rests on
            one session's rounds; and a model slows with what other tenants evict
            from the shared last-level cache, which changes over tens of seconds
            (``bench/host_drift.py``). On a shared 2-vCPU VM, in eight interleaved
            pairs of ``bench/reproducibility.py`` triples, the largest range of a
            model's normalized latency was lower with whole models at 15 s than at
            6 s in seven (medians 0.031 and 0.036). Every result at 15 s did better
            still (lower in eight of ten pairs against all at 6 s; medians 0.021 and
            0.047) but made ``dlbricks demo`` 96 s instead of 73 s.
        cache_state: what a timed run finds in the caches. ``"warm"``: each burst starts
            with discarded runs (two for a session under 0.5 ms, whose second run after
            other sessions' is still up to 50% slow; none for one of 0.5 s or more,
            whose first run is as fast as any), so the timed runs find the brick's
            weights and inputs cached (a brick looped alone). ``"cold"``: between two
            runs of a session, twice the largest cache's size (up to 64 MiB of it: a cloud
            VM reports its host socket's) of other data is read (the
            other cold sessions' runs, topped up from an eviction buffer when they fall
            short), so its weights come from DRAM whatever else is being measured; its
            inputs are read just before the run (as a layer finds the output its
            predecessor just wrote). ``"auto"``: cold for a memory-bound session whose
            weights outgrow the core's L2 cache, warm for the others. A big memory-bound
            layer (a fully connected layer at batch 1) streams its weights from memory
            in a model run too, and so slows with the memory traffic of the machine as
            the model does; a small one is dominated by the fixed cost of a call, which
            a cold session inflates (onnxruntime's own state and code evicted too) and a
            model run does not; and a compute-bound one (a transformer's or a
            convolution's weights reused across many rows or pixels) hides its weights'
            stream under its arithmetic in a model run, which a lone cold run cannot (on
            a 2-vCPU Xeon VM: a chain of 48 MatMuls of 128x768 by 768x768, 113 MB of
            weights, took 7% more per layer than one such MatMul looped warm, and as
            much with 1 GiB read before each run; the lone MatMul after such a read took
            44% more, and the 36 modern architectures read 1.08x their end-to-end
            latency in geometric mean with those timed cold). Part of the result key.
        burst_s: the longest burst one session gets per round; a brick needing more
            iterations gets them over more rounds.
        memory_budget_mb: the most memory the engine's workers' live sessions and the
            spool files of large models may hold at once (0: 2 GiB or half of the
            memory available at start, whichever is less; see
            ``timing.engine.DEFAULT_MEMORY_BUDGET``). Sessions open in order as the
            budget allows and close as they are final; what closed sessions freed
            stays with the workers and the next sessions are built in it.
        clock: what the measurement engine reads a run's duration from. ``"thread"``:
            the calling thread's CPU time, which leaves out the time the thread was
            descheduled, so a run preempted by another process on a shared host does not
            read as slow (a long run is preempted far more often than a short one, which
            would bias bricks against whole models); valid only when the kernels run on
            the calling thread (one intra-op thread, sequential). ``"wall"``: elapsed
            time. ``"auto"`` (default): thread when valid, else wall. Part of the key.
        thread_spinning: let onnxruntime's pool threads spin-wait for work after a
            parallel section (its default). Off by default with more than one intra-op
            thread: the measurement engine holds many sessions, each with its own pool,
            and a pool thread spinning after its run takes the core from the next
            session's run. Part of the key.
        huge_pages: back the measurement worker's heap (onnxruntime's weights, its
            arena, the bound inputs and outputs) with transparent huge pages, through
            glibc's malloc tunable ``glibc.malloc.hugetlb=1``. With 4 KiB pages, where a
            session's buffers land in physical memory differs in every session, and with
            it the cache-set and TLB conflicts of its runs (two sessions of ShuffleNet
            measured in the same rounds: coefficient of variation over ten sessions
            1.4-2.9% on 4 KiB pages, 0.5-0.6% on huge pages). Off by default: what users
            read, normalized latency, reproduced no better with them (largest range over
            three runs of ``bench/reproducibility.py``, six interleaved pairs: median
            0.062 with, 0.053 without), while faulting them in cost every session's
            set-up dearly where the kernel compacts memory to find them or a VM backs
            its memory lazily (on a 2-vCPU VM: nine light models at G=1, ``evaluate``
            72-74 s with, 54-55 s without, two interleaved pairs; 36 modern
            architectures at G=1,3, 292 s and 452 s with, 227 s without). Needs glibc
            >= 2.35 and transparent huge pages in ``madvise`` or ``always`` mode (see
            :func:`dlbricks.timing.sysinfo.huge_pages_available`); without them it changes
            nothing. Part of the key.
        open_cores: CPUs on which the measurement engine builds sessions while no round
            runs, in extra worker processes that move to the timing cores for the rounds
            (a lane's processes take turns, so sessions are still timed one at a time).
            None (the default): the usable CPUs outside ``cores`` on their NUMA node, at
            most three; ``()``: none, every session is built on the timing cores. Only
            with ``cores`` set and one intra-op thread (a pool's thread affinities are
            fixed when its session is built). On a 2-core VM the nine light models'
            802 sessions were built in a median 10.6 s with it, 17.6 s without (3
            interleaved pairs). Changes where sessions are built, not how they are
            timed, so it keys no result.
        call_overhead: reconstruction counts one call's fixed cost once per model, not
            once per brick: it is calibrated on this machine by two probe models
            measured with the bricks (:mod:`dlbricks.timing.calibration`), subtracted
            from every brick and added once. Changes no measurement, so it keys no result.
        speed_probe: bring every session's round medians to one reference speed of the
            core, read by a small MatMul timed around each burst (see
            :class:`dlbricks.timing.engine._Speed`): on a shared host the core's speed
            changes by up to 1.5x for seconds at a time, and the sessions of one round
            meet different speeds. Off by default: the fitted slopes and reference add
            more spread between runs than they take out (2-core Xeon VM, interleaved
            pairs of three runs of four light models: the largest range of a model's
            normalized latency had median 0.050 with it, 0.023 without, lower without
            in 6 of 7 pairs; `evaluate -G 1,3` of the modern corpus, 2 pairs: 422 and
            220 s with it, 202 and 192 s without, 58% and 89% of its models within
            10% against 94% and 94%), though it brought the light models about 1%
            closer to their end-to-end latency (RMSPE 0.046-0.048 against
            0.052-0.053, 3 pairs). Changes how rounds are weighed,
            not what is timed, so it keys no result.
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
    precision: float = 0.02
    min_rounds: int = 5
    max_rounds: int = 60
    min_span_s: float = 6.0
    model_span_s: float = 15.0
    cache_state: str = "auto"
    burst_s: float = 0.02
    memory_budget_mb: int = 0
    call_overhead: bool = True
    speed_probe: bool = False
    clock: str = "auto"
    thread_spinning: bool = False
    huge_pages: bool = False
    open_cores: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if self.cores is not None:
            # Accept any iterable (a JSON list, a range...) but store a sorted tuple so
            # that equal pinning gives equal configs and equal keys.
            cores = tuple(sorted({int(c) for c in self.cores}))
            if not cores or any(c < 0 for c in cores):
                raise DlbricksError(f"RunnerConfig: cores must be non-negative CPU ids, got {self.cores!r}")
            object.__setattr__(self, "cores", cores)
        if self.open_cores is not None:
            opening = tuple(sorted({int(c) for c in self.open_cores}))
            if any(c < 0 for c in opening):
                raise DlbricksError(f"RunnerConfig: open_cores must be non-negative CPU ids, got {self.open_cores!r}")
            object.__setattr__(self, "open_cores", opening)
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
        for name in ("warmup_time", "min_time", "max_time", "target_ci", "min_span_s", "model_span_s"):
            if not float(getattr(self, name)) >= 0:
                raise DlbricksError(f"RunnerConfig: {name} must be >= 0, got {getattr(self, name)!r}")
        if self.max_time < self.min_time:
            raise DlbricksError(f"RunnerConfig: max_time ({self.max_time}) < min_time ({self.min_time})")
        if self.cache_state not in CACHE_STATES:
            raise DlbricksError(f"RunnerConfig: cache_state must be one of {CACHE_STATES}, got {self.cache_state!r}")
        if not 0 < float(self.precision) < 1:
            raise DlbricksError(f"RunnerConfig: precision must be in (0, 1), got {self.precision!r}")
        if not 1 <= int(self.min_rounds) <= int(self.max_rounds):
            raise DlbricksError(
                f"RunnerConfig: need 1 <= min_rounds <= max_rounds, got {self.min_rounds!r} and {self.max_rounds!r}"
            )
        if self.clock not in CLOCKS:
            raise DlbricksError(f"RunnerConfig: clock must be one of {CLOCKS}, got {self.clock!r}")
        if self.clock == "thread" and not self._thread_clock_valid():
            raise DlbricksError("RunnerConfig: clock 'thread' needs intra_op_threads 1 and execution_mode sequential "
                                "(the kernels on the calling thread)")
        if not float(self.burst_s) > 0 or int(self.memory_budget_mb) < 0:
            raise DlbricksError("RunnerConfig: burst_s must be > 0 and memory_budget_mb >= 0")
        if not self.timeout_s > 0:
            raise DlbricksError(f"RunnerConfig: timeout_s must be > 0, got {self.timeout_s!r}")
        if self.cores is not None and self.intra_op_threads == 0:
            # onnxruntime's default thread count ignores the affinity mask, so pinning
            # would oversubscribe the pinned cores.
            raise DlbricksError("RunnerConfig: set intra_op_threads explicitly when pinning cores")

    def _check_types(self) -> None:
        """Each setting of its declared kind: a float count of rounds or a string number
        would otherwise be compared, rounded or keyed as given."""
        # numbers' ABCs take numpy's scalars too; a bool is an Integral, but not a count.
        kinds: dict[str, type] = {"int": numbers.Integral, "float": numbers.Real, "bool": bool, "str": str}
        for f in fields(self):
            value = getattr(self, f.name)
            kind = kinds.get(str(f.type))
            if kind is None:  # the CPU lists: any iterable of ints
                if value is not None and (isinstance(value, (str, bytes)) or not hasattr(value, "__iter__")
                                          or not all(isinstance(c, numbers.Integral) for c in value)):
                    raise DlbricksError(f"RunnerConfig: {f.name} must be CPU ids (ints) or None, got {value!r}")
                continue
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise DlbricksError(f"RunnerConfig: {f.name} must be {'an' if f.type == 'int' else 'a'} "
                                    f"{f.type}, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (``cores`` as a list or None)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["cores"] = list(self.cores) if self.cores is not None else None
        d["open_cores"] = list(self.open_cores) if self.open_cores is not None else None
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

    def _thread_clock_valid(self) -> bool:
        return self.intra_op_threads == 1 and self.execution_mode == "sequential"

    def measure_clock(self) -> str:
        """The clock the engine uses: ``"thread"`` or ``"wall"`` (``auto`` resolved)."""
        if self.clock == "auto":
            return "thread" if self._thread_clock_valid() else "wall"
        return self.clock

    def identity(self) -> dict[str, Any]:
        """The fields that change what is measured (see :meth:`key`).

        Pinning counts as the number of pinned CPUs, not their ids: the same run on
        CPU 0 or CPU 1 of one machine measures the same thing, and parallel workers
        (``bench --jobs``), each pinned to its own CPU, must share one key.
        """
        d = self.to_dict()
        ident = {k: d[k] for k in _IDENTITY_FIELDS}
        ident["cores"] = None if self.cores is None else len(self.cores)
        ident["clock"] = self.measure_clock()
        if self.cache_state != "warm":
            ident["cold_method"] = COLD_METHOD
        if self.cache_state == "auto":
            ident["auto_rule"] = AUTO_RULE
        return ident

    def key(self) -> str:
        """A stable 16-hex-digit key over :meth:`identity`, used to key stored results.

        Thread counts, execution mode, optimisation level, the number of pinned
        cores and the denormals flag count; the stopping rule and the timeout do not.
        """
        canon = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]
