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

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from dlbricks.errors import ArgumentTypeError, DlbricksError
from dlbricks.timing.config import RunnerConfig
from dlbricks.timing.fpenv import count_denormals
from dlbricks.timing.session import BoundSession, SerializedModel, model_label, prepared_session, timed_runs
from dlbricks.timing.stats import (
    DRIFT_BLOCKS,
    DRIFT_WARN,
    Stats,
    ci_converged,
    summarize,
)

MEASUREMENT_SCHEMA_VERSION = 1


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
        rounds: for results of the measurement engine, the rounds it was measured in
            (0 for a single contiguous run).
        round_medians_ns: the median of each round's burst, in order, brought to the
            run's reference speed (``median * (speed_ref_ns / probe) ** speed_slope``):
            their spread is the uncertainty of the result, drift between rounds included.
        round_probes_ns: the speed probe's reading in each round (0: none), from which
            the round medians as read are recovered.
        round_shared_cache: the shared-cache probe's reading in each round (0: none;
            :mod:`dlbricks.timing.cacheprobe`).
        speed_slope: how the session's run time follows the probe's (log on log; 0:
            round medians as read).
        speed_ref_ns: the probe reading the rounds were brought to: the one whose power
            ``speed_slope`` is the mean of the engine run's readings to that power,
            at the offset the probe reads with beside a session of this one's run
            time (``dlbricks.timing.engine._Speed``).
        median_se_ns: the standard error of the median estimate from that spread;
            ``stats.ci_low``/``ci_high`` are the matching t-interval.
        common_se_factor: how much ``median_se_ns`` grows where this result is summed
            with the others measured beside it as if their errors were independent (a
            model's reconstruction): the bricks of a round meet the same state of the
            machine and move together (``dlbricks.timing.engine._common_round_var``).
            A property of the result among its group, not of the result alone, so it
            widens :attr:`sum_se_ns` and not the result's own interval. 1: none.
        round_nos: the engine's number of each round of this engine run that the
            result was measured in, for the last ``len(round_nos)`` of
            ``round_medians_ns`` (rounds resumed from a checkpoint of an earlier run
            have none): results of one run measured in the same round met the same
            state of the machine.
        engine_run: an id of the engine run (rounds of two runs are not comparable).
        timed_cold: the caches its timed runs found: True cold, False warm (the engine's
            resolution of ``config.cache_state``), None where not recorded.
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
    rounds: int = 0
    round_medians_ns: list[float] = field(default_factory=list)
    round_probes_ns: list[float] = field(default_factory=list)
    round_shared_cache: list[float] = field(default_factory=list)
    speed_slope: float = 0.0
    speed_ref_ns: float = 0.0
    median_se_ns: float = 0.0
    common_se_factor: float = 1.0
    round_nos: list[int] = field(default_factory=list)
    engine_run: str = ""
    timed_cold: bool | None = None
    timer_resolution_ns: float = field(default_factory=lambda: time.get_clock_info("perf_counter").resolution * 1e9)

    @property
    def median_ns(self) -> float:
        return self.stats.median

    @property
    def sum_se_ns(self) -> float:
        """The standard error this result contributes to a sum of results (a model's
        reconstruction) whose errors are added as independent."""
        return self.median_se_ns * self.common_se_factor

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
            "rounds": self.rounds,
            "round_medians_ns": list(self.round_medians_ns),
            "round_probes_ns": list(self.round_probes_ns),
            "round_shared_cache": list(self.round_shared_cache),
            "speed_slope": self.speed_slope,
            "speed_ref_ns": self.speed_ref_ns,
            "median_se_ns": self.median_se_ns,
            "common_se_factor": self.common_se_factor,
            "round_nos": list(self.round_nos),
            "engine_run": self.engine_run,
            "timed_cold": self.timed_cold,
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
            rounds=int(d.get("rounds", 0)),
            round_medians_ns=[float(x) for x in d.get("round_medians_ns", ())],
            round_probes_ns=[float(x) for x in d.get("round_probes_ns", ())],
            round_shared_cache=[float(x) for x in d.get("round_shared_cache", ())],
            speed_slope=float(d.get("speed_slope", 0.0)),
            speed_ref_ns=float(d.get("speed_ref_ns", 0.0)),
            median_se_ns=float(d.get("median_se_ns", 0.0)),
            common_se_factor=float(d.get("common_se_factor", 1.0)),
            round_nos=[int(x) for x in d.get("round_nos", ())],
            engine_run=str(d.get("engine_run", "")),
            timed_cold=None if d.get("timed_cold") is None else bool(d["timed_cold"]),
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




class Runner:
    """Times models with one :class:`RunnerConfig`.

    Example:
        >>> m = Runner(RunnerConfig(min_time=0.1)).time("brick.onnx")  # doctest: +SKIP
        >>> m.stats.median, m.stats.ci_low, m.stats.ci_high  # doctest: +SKIP
    """

    def __init__(self, config: RunnerConfig | None = None):
        if config is not None and not isinstance(config, RunnerConfig):
            raise ArgumentTypeError(f"Runner() takes a RunnerConfig or None, got {type(config).__name__}")
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
            model: a path, serialized bytes, a :class:`~dlbricks.timing.session.SerializedModel`
                or an ``onnx.ModelProto``.
            inputs: values for some or all inputs; the rest are synthesised with
                :func:`make_inputs`.
            seed: the seed for synthesised inputs.
            int_bounds: bounds for synthesised integer inputs (see :func:`make_inputs`).

        Returns:
            The :class:`Measurement`.

        Raises:
            DlbricksError: the model cannot be loaded or run, or pinning fails.
        """
        import os

        import onnx
        import onnxruntime as ort

        if not isinstance(model, (str, os.PathLike, bytes, onnx.ModelProto, SerializedModel)):
            raise ArgumentTypeError(f"Runner.time() takes a path, serialized bytes or an onnx.ModelProto, "
                                    f"got {type(model).__name__}")
        cfg = self.config
        wall0 = time.perf_counter()
        label = model_label(model)
        with prepared_session(model, cfg, inputs=inputs, seed=seed, int_bounds=int_bounds) as prep:
            bound, feeds = prep.bound, prep.feeds
            # With one intra-op thread the kernels run on this thread, so this is the
            # mode they run in.
            flushed = prep.denormals_flushed
            n_in = sum(int(np.size(a)) for a in feeds.values())
            den_in = sum(count_denormals(a) for a in feeds.values())
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

    def _warm_up(self, bound: BoundSession) -> int:
        cfg = self.config
        start = time.perf_counter_ns()
        # A slow brick is not warmed for ages: warm-up stops at max_time whatever the count.
        cap = start + int(cfg.max_time * 1e9)
        warm = timed_runs(bound, 1, until_ns=min(start + int(cfg.warmup_time * 1e9), cap))
        while len(warm) < cfg.warmup_iters and time.perf_counter_ns() < cap:
            timed_runs(bound, 1, out=warm)
        return len(warm)

    def _sample(self, bound: BoundSession) -> tuple[list[int], str]:
        cfg = self.config
        clock = time.perf_counter_ns
        times: list[int] = []
        min_iters = max(1, cfg.min_iters)
        target = cfg.target_ci
        start = clock()
        min_t = start + int(cfg.min_time * 1e9)
        max_t = start + int(cfg.max_time * 1e9)
        # The stopping rule is evaluated only at checkpoints spaced at 10% of the
        # elapsed time (>= 1 ms), which keeps the O(n) CI computation amortised O(1)
        # per iteration.
        check_t = min_t
        while True:
            timed_runs(bound, max(0, min_iters - len(times)), until_ns=check_t, out=times)
            t1 = clock()
            if t1 >= max_t:
                return times, "max_time"
            if target > 0 and ci_converged(times, target):
                return times, "converged"
            check_t = min(t1 + max((t1 - start) // 10, 1_000_000), max_t)
