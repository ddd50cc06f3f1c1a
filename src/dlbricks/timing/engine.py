"""The measurement engine: many sessions measured in interleaved rounds, to a stated
precision of every model's latency, at the least total time.

Why rounds. A host's speed drifts (neighbours, frequency, memory traffic). Timing each
brick, and each whole model, in its own contiguous slot puts every result at the mercy
of its slot; a round gives every live session a short burst, so a change of speed hits
bricks and models alike and their ratios hold. The spread of a session's per-round
medians is then an honest measure of its uncertainty, drift included, and it is what
the intervals are built from. The bricks of one round also move *together* (a slow
phase slows them all), which a model's interval, summing its bricks' errors as
independent, would miss: what the per-round sums of a model's bricks vary by beyond
that widens their intervals (:func:`_common_round_var`). And the core's own speed
changes faster than a round of a thousand sessions lasts (an SMT sibling's work slows
compute-bound kernels by 1.5x for a second at a time): a speed probe read around every
burst brings each session's rounds to one reference speed (:class:`_Speed`).

Why allocation. Users read the precision of a *model's* latency, and a model's
reconstructed latency is a weighted sum ``sum_b c_b * t_b`` over its bricks (``c_b``
occurrences). With ``sigma_b`` the per-run spread of brick ``b`` and ``t_b`` its run
time, the least total time ``sum_b n_b t_b`` giving ``Var = sum_b c_b^2 sigma_b^2 / n_b``
at most ``V*`` is reached at ``n_b = c_b sigma_b / sqrt(t_b) * S / V*`` with
``S = sum_b c_b sigma_b sqrt(t_b)`` (a Lagrange multiplier). A brick that is 0.1% of
every model it is in needs few runs; one used 72 times needs many. Each item gets the
largest count any of its groups asks for. Whole models measured as references are
groups of one item under the same rule.

Why not longer bursts. Those counts assume independent runs, and on a shared host
runs are not: a burst's runs share the state of the machine in that burst, and the
next burst finds another. Each session's spread is split into what varies between
bursts and what varies within one (:meth:`_Track.variance_components`), and a burst
gets no more runs than buy precision cheaper than another round would
(:func:`runs_per_burst`); on a quiet host nothing varies between bursts and the
allocation alone sets them.

Isolation. Sessions live in long-lived worker processes
(:mod:`dlbricks.timing.engine_worker`, started and watched through
:mod:`dlbricks.timing.engine_process`). A session that crashes or hangs its worker is
recorded as failed (the worker says which through a shared beacon), the worker is
replaced, its other sessions are reopened, and the run goes on: a killed worker loses
at most its current round. Results are handed to ``on_result`` as soon as they are
final (every group they feed has reached its precision, or the rounds ran out).
"""

from __future__ import annotations

import math
import secrets
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from dlbricks.errors import DlbricksError
from dlbricks.timing.config import RunnerConfig
from dlbricks.timing.engine_process import WorkerDied, WorkerProcess
from dlbricks.timing.engine_worker import discarded_runs, eviction_bytes
from dlbricks.timing.hostload import HostLoad, host_load, read_load
from dlbricks.timing.runner import Failure, Measurement
from dlbricks.timing.session import source_nbytes
from dlbricks.timing.stats import numbered_rounds, summarize

__all__ = ["EngineItem", "EngineProgress", "EngineSummary", "Group", "WorkerDied", "measure", "t_quantile"]

#: The most iteration times kept per result: an evenly spaced, order-preserving subset
#: (the per-round medians, kept whole, carry the uncertainty).
KEEP_TIMES = 1024
#: How long a fresh worker may take to import onnxruntime and report ready.
START_TIMEOUT_S = 120.0
#: Spread assumed (relative to the run time) before a session has rounds of its own.
_PRIOR_CV = 0.05
#: A round is allowed this many times its expected duration, plus the per-job timeout.
_ROUND_SLACK = 20.0
_LEVEL = 0.95
#: Final items needed before the rounds they took stand for those of items with no
#: spread yet, in the progress estimate.
_MIN_TYPICAL = 10
#: Before that, such an item is taken to need this many times ``min_rounds`` (36
#: modern architectures at G=1,3: bricks took 5-10 rounds, whole models a median of 8).
_PRIOR_ROUNDS = 2
#: Open requests in flight per worker: enough to overlap generation here with session
#: building there, few enough that a crash re-sends little.
_OPEN_AHEAD = 3
#: The most extra processes opening sessions on CPUs that time nothing (over all
#: lanes): beyond a few, generating the bricks here is what the opening waits for.
_MAX_OPENERS = 3
#: Iteration times a checkpoint keeps per result (the per-round medians are kept whole).
_CHECKPOINT_TIMES = 128
#: The least time between two progress reports while sessions are being opened.
_OPENING_REPORT_S = 0.5
#: Runs a burst needs to say how runs vary within it; also the fewest runs per round
#: once that is known (so that it stays known).
_MIN_BURST_RUNS = 3
#: Within-burst variances kept per session (the latest ones).
_KEEP_BURST_VARS = 16
#: Rounds of this run before a session's spread is split into between and within bursts.
_MIN_SPLIT_ROUNDS = 4
#: The least a round costs a session besides its runs (the worker's bookkeeping and
#: the parent's), when the measured overhead per session is smaller.
_ITEM_ROUND_S = 20e-6


@dataclass
class EngineItem:
    """One session to measure.

    Attributes:
        id: unique key (e.g. ``"brick:<digest>"``).
        source: serialized model bytes or a path, or a callable returning one, or
            ``(source, int_bounds)`` (called when the session is opened, and again if
            its worker has to be replaced, so generated bricks need not all be held
            in memory).
        int_bounds: exclusive bounds for integer inputs.
        seed: the input seed.
        warm: time it as a warm loop whatever ``config.cache_state`` says (whole
            models: the reference a user measures end to end is a warm loop).
        prep_s: seconds spent preparing it (generation), counted in its cost.
        label: how messages name it.
        resume: a checkpointed state of an earlier, interrupted run (see
            ``on_checkpoint`` of :func:`measure`): its rounds count as this run's.
        reference: measured in every round for as long as any other item is
            open, so that its estimate spans the same rounds, the same
            states of the machine, as what it is compared with (whole models against
            their bricks, the call-overhead probes against every brick). Its cost
            (``sampling_time_s``) counts only the rounds it needed for its precision.
        kind: what sort of session it is (``"brick"``, ``"model"``): the progress
            estimate prices a session not opened yet at what opened ones of its kind
            cost (a whole model costs a hundred bricks), and a whole model's rounds
            span ``config.model_span_s``, not ``min_span_s``.
        compute_bound: its layers do enough arithmetic per byte of weights to hide
            reading those weights from memory (:func:`dlbricks.pipeline.compute_bound`):
            cache state ``"auto"`` times it warm whatever its size.
    """

    id: str
    source: Any
    int_bounds: Mapping[str, int] | None = None
    seed: int = 0
    warm: bool = False
    prep_s: float = 0.0
    label: str = ""
    resume: Mapping[str, Any] | None = None
    reference: bool = False
    kind: str = ""
    compute_bound: bool = False


def _min_span_s(item: EngineItem, config: RunnerConfig) -> float:
    """How many seconds ``item``'s rounds must span before its result is final."""
    return config.model_span_s if item.kind == "model" else config.min_span_s


@dataclass
class Group:
    """A quantity whose precision is stated: ``sum(coef * latency(item))``."""

    name: str
    terms: Mapping[str, float]


@dataclass(frozen=True)
class EngineProgress:
    """Where a :func:`measure` call stands, for a progress display.

    Attributes:
        final: items with a result (measured or failed).
        total: all items.
        opened: sessions opened so far (reopened ones count again).
        rounds: rounds run so far.
        phase: ``"opening"`` (building and warming up sessions) or ``"measuring"``.
        eta_s: the seconds still to go: each open session's cost per round times the
            rounds its models' precision still needs (its interval narrows as one over
            the square root of its rounds), plus the sessions not yet opened at the
            cost so far of the opened sessions of their kind (``EngineItem.kind``);
            None while the first sessions are opened (nothing is known yet of the
            rounds their precision will need).
    """

    final: int
    total: int
    opened: int
    rounds: int
    phase: str
    eta_s: float | None


@dataclass
class EngineSummary:
    """What one :func:`measure` call did."""

    measured: int = 0
    failed: int = 0
    rounds: int = 0
    #: Times sessions were opened between rounds (the first fill of the memory
    #: budget, then each time closed sessions made room).
    batches: int = 0
    worker_starts: int = 0
    converged_groups: int = 0
    groups: int = 0
    wall_s: float = 0.0
    #: What else ran on the machine meanwhile (None where the kernel does not say).
    host: HostLoad | None = None


def t_quantile(df: float, level: float = _LEVEL) -> float:
    """Two-sided Student t quantile (``df`` degrees of freedom; infinite df is normal)."""
    from scipy.stats import t

    if not df > 0:
        return math.inf
    return float(t.ppf(0.5 + level / 2, df))


# --------------------------------------------------------------------------- state


@dataclass
class _Track:
    item: EngineItem
    #: The process its session is (or was last) opened in...
    worker: int
    #: ...one of its lane's (see :class:`_Engine`).
    lane: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    times: list[int] = field(default_factory=list)
    round_medians: list[float] = field(default_factory=list)
    #: The engine's number of each of this run's rounds (the last ``len(round_nos)``
    #: of ``round_medians``; rounds resumed from a checkpoint have none).
    round_nos: list[int] = field(default_factory=list)
    sampling_s: float = 0.0
    #: When its first round of this run started (``time.perf_counter``); None before it.
    first_round_t: float | None = None
    setup_s: float = 0.0
    open: bool = False
    final: bool = False
    #: Sampling seconds when a reference item first reached its precision.
    needed_s: float | None = None
    #: Timed as a warm loop (the item says so, the cache state is "warm", or "auto"
    #: decided it).
    timed_warm: bool = False
    #: The size of the session's model (its weights, mostly), known once prepared.
    nbytes: int = 0
    #: Runs in each of this run's rounds (parallel to ``round_nos``).
    round_ks: list[int] = field(default_factory=list)
    #: The relative variance of single runs within a burst, one per round of at least
    #: ``_MIN_BURST_RUNS`` runs (the latest ``_KEEP_BURST_VARS``).
    burst_vars: list[float] = field(default_factory=list)
    #: The speed probe's reading in each round (parallel to ``round_medians``; 0: none).
    round_probes: list[float] = field(default_factory=list)
    #: The shared-cache probe's reading in each round (parallel to ``round_medians``; 0: none).
    round_cache: list[float] = field(default_factory=list)
    #: The run's speed reference, shared by every track (see :class:`_Speed`).
    speed: _Speed | None = field(default=None, repr=False)
    _cache: tuple[tuple[int, int, int], tuple[float, float]] | None = field(default=None, repr=False)
    _adjusted: tuple[tuple[int, int], tuple[list[float], float, float]] | None = field(default=None, repr=False)
    _sums: tuple[int, _Sums] | None = field(default=None, repr=False)

    def slope_sums(self) -> _Sums:
        """:func:`_slope_sums` of this session's rounds (cached per round)."""
        if self._sums is None or self._sums[0] != len(self.round_medians):
            self._sums = (len(self.round_medians), _slope_sums(self.round_medians, self.round_probes))
        return self._sums[1]

    def _speed_key(self) -> int:
        # A final result's estimate is what was handed out: later rounds of others
        # move the pooled slope and the reference, not it.
        return -2 if self.final else self.speed.version if self.speed is not None else -1

    @property
    def median(self) -> float:
        """The latency estimate (ns): the median of the per-round medians, so that
        every round weighs the same for every item whatever its burst lengths, and a
        slow phase of the machine shifts bricks and models alike."""
        return self._estimate()[0]

    def se(self) -> float:
        """Standard error of the latency estimate (ns), from the spread between rounds."""
        return self._estimate()[1]

    def adjusted(self) -> list[float]:
        """The round medians with the core's speed in each round taken out: what the
        estimate, its interval and every comparison between rounds are built from."""
        return self._adjust()[0]

    def slope(self) -> float:
        """How this session's run time follows the speed probe's (log on log; 0: not at all)."""
        return self._adjust()[1]

    def reference(self, slope: float) -> float:
        """The probe reading this session's rounds are brought to (ns; 0: none), for
        its run time, cache state and own readings (:meth:`_Speed.reference_of`)."""
        if self.speed is None:
            return 0.0
        return self.speed.reference_of(slope, self.run_s(), self.timed_warm, self.round_probes)

    def run_s(self) -> float:
        """One run's time as the worker found it on opening (s): what the probe's
        offset beside the session is fitted on, fixed for the whole run."""
        run_s = float(self.info.get("run_s", 0.0))
        if run_s <= 0 and self.round_medians:
            run_s = statistics.median(self.round_medians) * 1e-9
        return run_s

    def _adjust(self) -> tuple[list[float], float, float]:
        sp = self.speed
        key = (len(self.round_medians), self._speed_key())
        if self._adjusted is not None and self._adjusted[0] == key:
            return self._adjusted[1]
        meds, slope, extra = self.round_medians, 0.0, 0.0
        if sp is not None and sp.ref_ns > 0:
            slope, var = sp.slope_of(self.slope_sums(), self.run_s())
            ref = self.reference(slope)
            if slope > 0:
                meds = [m * (ref / p) ** slope if p > 0 else m
                        for m, p in zip(self.round_medians, self.round_probes)]
            # What the slope's uncertainty adds to the estimate's relative variance: the
            # typical distance of the rounds' speed from the reference, times it.
            xs = [math.log(p / ref) for p in self.round_probes if p > 0]
            if xs:
                extra = (sum(xs) / len(xs)) ** 2 * var
        self._adjusted = (key, (meds, slope, extra))
        return meds, slope, extra

    def _estimate(self) -> tuple[float, float]:
        # Read for every group each round: computed once per change of the rounds.
        key = (len(self.round_medians), len(self.times), self._speed_key())
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        meds = self.adjusted()
        r = len(meds)
        if r:
            m = statistics.median(meds)
        else:
            m = float(self.info.get("run_s", 1e-6)) * 1e9
        if r < 3:
            se = _PRIOR_CV * m / math.sqrt(max(1, len(self.times)))
        else:
            se = _median_se(meds, m)
        se = math.sqrt(se * se + self._adjust()[2] * m * m)
        self._cache = (key, (float(m), float(se)))
        return self._cache[1]

    def df(self) -> float:
        return max(1, len(self.round_medians) - 1)

    def span_s(self, now: float) -> float:
        """Seconds its rounds span so far; infinite for one resumed from a checkpoint
        (its earlier rounds ran in another process, at another time; see :meth:`restore`)."""
        if self.first_round_t is None:
            return 0.0
        return now - self.first_round_t

    def variance_components(self) -> tuple[float, float] | None:
        """(between, within): the relative variance of a round's median that no number
        of runs in the burst removes (the state of the machine in that burst), and the
        relative variance of one run within a burst; None until
        ``_MIN_SPLIT_ROUNDS`` rounds of this run and two bursts of several runs say.

        A round's median varies by ``between + (pi / 2) within / k`` (a median of ``k``
        runs); the first is what the rounds' spread holds beyond the second."""
        r = len(self.round_nos)
        if r < _MIN_SPLIT_ROUNDS or len(self.burst_vars) < 2:
            return None
        meds = self.adjusted()[-r:]
        m = statistics.median(meds)
        if m <= 0:
            return None
        observed = (1.4826 * statistics.median(abs(x / m - 1.0) for x in meds)) ** 2
        within = statistics.median(self.burst_vars)
        expected = math.pi / 2 * within * sum(1.0 / max(1, k) for k in self.round_ks[-r:]) / r
        # Counted only when the rounds vary more than the runs plausibly make them (as
        # in :func:`_common_round_var`): independent runs must not shorten bursts by chance.
        if observed <= expected * (1.0 + 3.0 * math.sqrt(2.0 / (r - 1))):
            return 0.0, within
        return observed - expected, within

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the per-round medians, a sample of the times, costs."""
        times = self.times
        if len(times) > _CHECKPOINT_TIMES:
            step = len(times) / _CHECKPOINT_TIMES
            times = [times[int(i * step)] for i in range(_CHECKPOINT_TIMES)]
        return {"round_medians": self.round_medians, "round_probes": self.round_probes,
                "round_cache": self.round_cache, "times": times,
                "sampling_s": self.sampling_s,
                "setup_s": self.setup_s, "prep_s": self.item.prep_s, "needed_s": self.needed_s}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.round_medians = [float(x) for x in state.get("round_medians", ())]
        if self.round_medians:
            self.first_round_t = -math.inf  # its rounds ran in another process, long ago
        probes = [float(x) for x in state.get("round_probes", ())]
        self.round_probes = probes if len(probes) == len(self.round_medians) else [0.0] * len(self.round_medians)
        cache = [float(x) for x in state.get("round_cache", ())]
        self.round_cache = cache if len(cache) == len(self.round_medians) else [0.0] * len(self.round_medians)
        self.times = [int(x) for x in state.get("times", ())]
        self.sampling_s = float(state.get("sampling_s", 0.0))
        self.setup_s = float(state.get("setup_s", 0.0))
        needed = state.get("needed_s")
        self.needed_s = None if needed is None else float(needed)
        self.item.prep_s += float(state.get("prep_s", 0.0))


#: How much sessions' slopes differ (sd): compute-bound kernels follow the probe with
#: slopes near 1, kernels streaming from memory near 0.3. A session's own fit weighs
#: against the pooled slope as its precision against this (see :meth:`_Speed.slope_of`).
_SLOPE_SD = 0.3
#: The steepest slope believed (a session slowing 1.5 times as fast as the probe).
_MAX_SLOPE = 1.5


_Sums = tuple[float, float, float, float]

#: The slopes tried for a session's robust starting fit (see :func:`_slope_sums`).
_SLOPE_GRID = np.linspace(0.0, _MAX_SLOPE, 31)
#: The share of rounds a session's starting line is judged on (see :func:`_slope_sums`).
_LINE_QUANTILE = 0.75
#: Tukey's bisquare constant (95% efficiency on normal residuals), in robust sds.
_BISQUARE_C = 4.685


def _slope_sums(meds: Sequence[float], probes: Sequence[float]) -> _Sums:
    """(Sxx, Sxy, Syy, n): the weighted, centred sums of squares and products of
    x = log(probe) and y = log(round median) over the rounds with a reading, and the
    sum of the weights; each deviation from its median clipped to +/-0.5 (a round hit
    by an interrupt must not make the slope).

    Weighted, because a shared host has two kinds of slow rounds. In most, the core's
    phase moves the probe and a short session alike, and not a long one, whose run
    averages over many phases. In a few, a neighbour's heavy job slows everything,
    the probe and the longest model by 20-50% together. A least-squares line through
    both is pulled to the few: whole models of 200 ms got slopes of 0.5, and brought
    to the reference with them their rounds spread 3x wider than as read. So the fit
    starts from the slope whose residuals have the least median deviation (a grid over
    [0, _MAX_SLOPE], judged on three quarters of the rounds) and weighs each round by
    Tukey's bisquare of its residual from that line: rounds far off it weigh nothing.
    Centred, the sums do not depend on the reference speed."""
    pts = [(math.log(p), math.log(m)) for m, p in zip(meds, probes) if p > 0 and m > 0]
    n = len(pts)
    if n < 3:
        return 0.0, 0.0, 0.0, float(n)
    xy = np.asarray(pts, dtype=np.float64)
    xs = np.clip(xy[:, 0] - np.median(xy[:, 0]), -_MAX_DEVIATION, _MAX_DEVIATION)
    ys = np.clip(xy[:, 1] - np.median(xy[:, 1]), -_MAX_DEVIATION, _MAX_DEVIATION)
    resid = ys[None, :] - _SLOPE_GRID[:, None] * xs[None, :]
    dev = np.abs(resid - np.median(resid, axis=1, keepdims=True))
    # The line is judged on three quarters of the rounds, not half: the readings are
    # often bimodal (the core's two speeds), and half the rounds then sit at nearly one
    # reading, where every slope fits them and the noise alone picks one; the rounds at
    # the other reading, off that line, would then weigh nothing.
    spread = np.quantile(dev, _LINE_QUANTILE, axis=1)
    best = int(np.argmin(spread))
    r = resid[best] - np.median(resid[best])
    scale = 1.4826 * float(np.median(np.abs(r)))
    if scale > 0:
        u = r / (_BISQUARE_C * scale)
        w = np.where(np.abs(u) < 1.0, (1.0 - u * u) ** 2, 0.0)
    else:  # more than half the rounds exactly on the line: those are the line
        w = (r == 0).astype(np.float64)
    sw = float(w.sum())
    if sw <= 0:
        return 0.0, 0.0, 0.0, 0.0
    xb, yb = float(w @ xs) / sw, float(w @ ys) / sw
    dx, dy = xs - xb, ys - yb
    return float(w @ (dx * dx)), float(w @ (dx * dy)), float(w @ (dy * dy)), sw


#: Readings per point of the offset curve (:func:`_offset_curve`), and the most points.
_OFFSET_READINGS = 64
_OFFSET_POINTS = 32


def _offset_curve(dev: np.ndarray, log_run_s: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """How the probe's reading (``dev``, log, from the run's median) depends on the
    run time of the session it was read beside: points (log run time, mean reading)
    over runs of consecutive sessions by run time, for :func:`numpy.interp`; None with
    too few readings for two points.

    Each point is shrunk toward the mean of all of them by how much of its distance
    from it its own noise could make (empirical Bayes: the points' spread beyond their
    standard errors is the curve's): the readings of a phase-switching core are
    bimodal, and a curve read from noise would move every session's level with it."""
    n = len(dev)
    k = min(_OFFSET_POINTS, n // _OFFSET_READINGS)
    if k < 2:
        return None
    parts = np.array_split(np.argsort(log_run_s, kind="stable"), k)
    xs = np.array([float(np.median(log_run_s[p])) for p in parts])
    ys = np.array([float(dev[p].mean()) for p in parts])
    se2 = np.array([float(dev[p].var(ddof=1)) / len(p) for p in parts])
    centre = float(ys.mean())
    spread = max(0.0, float(ys.var(ddof=1)) - float(se2.mean()))
    ys = centre + (ys - centre) * (spread / (spread + se2)) if spread > 0 else np.full_like(ys, centre)
    # Sessions of one run time can fill several points: one point per run time.
    ux, inverse = np.unique(xs, return_inverse=True)
    uy = np.bincount(inverse, weights=ys) / np.bincount(inverse)
    return ux, uy


class _Speed:
    """The speed probe's reference for one engine run, and the slope pooled over it.

    The worker times a small MatMul (:func:`dlbricks.timing.engine_worker._probe_model`)
    around every burst. On a shared host the core's speed changes for seconds at a
    time (an SMT sibling's or a neighbour's vector work), by as much as 1.5x, and a
    round of a thousand sessions lasts longer than that: the sessions of one round, a
    whole model and its bricks, meet different speeds, and a median over a few rounds
    lands in whichever phase most of them met. So every session's round medians are
    brought to the run's mix of speeds, read by the probe over the run's first
    ``min_rounds`` rounds (before any result can be final): a round median ``m`` read
    with the probe at ``p`` becomes ``m (ref / p)^b``, where ``b`` is how the session
    follows the probe (log on log), fitted per session (robustly, :func:`_slope_sums`)
    and shrunk toward the slope pooled over the sessions of its run-time class
    (:meth:`slope_of`), and ``ref`` the reading at which
    ``ref^b`` is the mean of ``reading^b`` (:meth:`reference_for`). A compute-bound
    kernel follows the probe closely (``b`` near 1), one streaming its weights from
    memory much less; a session whose rounds all met one speed gets the pooled slope,
    and on a quiet host nothing changes. The reference is the mix, not one speed of
    it (the median reading, say), because a whole model's run spans many phases and
    has their mix in it as read: its slope on a reading taken beside it is small,
    and its rounds barely move when brought to any reference.

    A session also moves the reading taken beside it, in every round alike: on a
    2-core Xeon VM the probe read 1.5x slower after a run of VGG-19 than after one of
    a small brick, for about a millisecond of the probe's own runs (the next session's
    run is slowed too, less). Over a demo run, sessions of 3 ms and more read
    +0.25 (log) beside them, those under 0.1 ms -0.07, whatever the phase. Taken as
    speed, that offset would make every long session look run in a slow phase and
    bring it 25% times its slope too fast. So the offset is fitted over the early
    readings as a curve of the session's run time (one per cache state), shrunk toward
    none by how well the readings show it (:func:`_offset_curve`), and taken out of
    the readings before the reference is set; each session's rounds are brought to
    the reference at its own offset (``ref * exp(offset)``, :meth:`reference_of`)."""

    def __init__(self) -> None:
        self.slope = 0.0
        #: The pooled slope of each run-time class that has one (:func:`_slope_class`).
        self.class_slopes: dict[int, float] = {}
        self.version = 0
        self._early: list[tuple[float, float, bool]] = []
        self._logs = np.zeros(0)
        #: The median of ``_logs``: the run's typical reading (log), offsets taken out.
        self._typical_log = 0.0
        self._refs: dict[float, float] = {}
        self._curves: dict[bool, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def ref_ns(self) -> float:
        """The readings' geometric mean, offsets taken out (0 until the first readings
        arrive)."""
        return self.reference_for(0.0)

    def add_readings(self, readings: Sequence[float], run_s: Sequence[float], warm: Sequence[bool]) -> None:
        """A round's readings, each with the run time and cache state of the session
        it was read beside, while the reference is still being set (the run's first
        ``min_rounds`` rounds, before any result is final)."""
        self._early.extend((math.log(r), math.log(max(s, 1e-9)), bool(w))
                           for r, s, w in zip(readings, run_s, warm) if r > 0)
        if not self._early:
            return
        data = np.asarray(self._early, dtype=np.float64)
        logs, runs, warms = data[:, 0], data[:, 1], data[:, 2] > 0.5
        mid = float(np.median(logs))
        # A reading taken through an interrupt must not move the reference.
        dev = np.clip(logs - mid, -_MAX_DEVIATION, _MAX_DEVIATION)
        self._curves = {}
        offsets = np.zeros_like(dev)
        for state in (True, False):
            mask = warms == state
            curve = _offset_curve(dev[mask], runs[mask])
            if curve is not None:
                self._curves[state] = curve
                offsets[mask] = np.interp(runs[mask], *curve)
        self._logs = mid + np.clip(dev - offsets, -_MAX_DEVIATION, _MAX_DEVIATION)
        self._typical_log = float(np.median(self._logs))
        self._refs = {}

    def offset(self, run_s: float, warm: bool) -> float:
        """How far (log) the probe reads beside a session of this run time and cache
        state from the run's readings, as fitted (0 while there are too few)."""
        curve = self._curves.get(bool(warm))
        return float(np.interp(math.log(max(run_s, 1e-9)), *curve)) if curve is not None else 0.0

    def reference_of(self, slope: float, run_s: float, warm: bool, readings: Sequence[float] = ()) -> float:
        """The probe reading a session's rounds are brought to: :meth:`reference_for`
        at the session's own offset, which is the curve's (:meth:`offset`) but never
        beyond what the session's own ``readings`` show (their median's distance from
        the run's typical reading, on the same side). The curve's points at long run
        times rest on a handful of sessions: on a 2-core Xeon VM it read +0.25-0.3
        from 1 ms on, from cold bricks, while SqueezeNet's whole model, 5 ms, read
        +0.03; at the curve's offset its rounds were brought 17% up (its pooled slope
        0.63), at its own they stay."""
        ref = self.reference_for(slope)
        if ref <= 0:
            return 0.0
        offset = self.offset(run_s, warm)
        own = [math.log(p) for p in readings if p > 0]
        if own and self._logs.size:
            seen = float(np.median(own)) - self._typical_log
            offset = min(offset, max(seen, 0.0)) if offset > 0 else max(offset, min(seen, 0.0))
        return ref * math.exp(offset)

    def reference_for(self, slope: float) -> float:
        """The reference speed for a session of this slope, offsets taken out: the
        reading ``r`` whose ``r ** slope`` is the mean of ``reading ** slope`` over the
        reference readings (their geometric mean at slope 0). A session brought there
        has the latency it takes under the run's mix of the core's speeds, which is
        what a run spanning many phases, a whole model's, has as read: so sessions of
        every slope stay comparable."""
        if not self._logs.size:
            return 0.0
        b = round(float(slope), 3)
        ref = self._refs.get(b)
        if ref is None:
            if b <= 0:
                ref = float(np.exp(self._logs.mean()))
            else:
                top = float(self._logs.max())
                ref = float(np.exp(top + np.log(np.mean(np.exp(b * (self._logs - top)))) / b))
            self._refs[b] = ref
        return ref

    def slope_for(self, run_s: float) -> float:
        """The pooled slope for a session of this run time: its class's, where enough
        sessions of the class have rounds at several speeds, else the whole run's."""
        return self.class_slopes.get(_slope_class(run_s), self.slope)

    def slope_of(self, sums: _Sums, run_s: float) -> tuple[float, float]:
        """A session's slope and its variance, from its :func:`_slope_sums`: its own
        weighted least-squares fit and the pooled slope of its run-time class, weighed by their
        precisions (the fit's: Sxx over its residual variance; the pooled one's: one
        over ``_SLOPE_SD`` squared). A session with fewer than ``_MIN_SLOPE_ROUNDS``
        rounds on the line, or whose rounds all met one speed, gets the pooled slope:
        on a handful of rounds one slow round at a high reading makes any line (VGG-19,
        six rounds, one of them 1.35x slow beside a reading 1.35x slow: a fitted slope
        of 1, where long runs have 0.05). Its variance is then that of a slope not
        known, or, with four rounds or more, the own fit's variance plus its squared
        distance from the pooled slope where that is less."""
        prior = self.slope_for(run_s)
        sxx, sxy, syy, n = sums
        if n < 4 or sxx <= 0:
            return prior, _SLOPE_SD**2
        resid = max((syy - sxy * sxy / sxx) / (n - 2), 1e-6)
        if n < _MIN_SLOPE_ROUNDS:
            # Too few rounds to move the slope, but not to bound how far it can be
            # from the pooled one: a whole model's rounds that stay within 1% while the
            # readings beside it move by 30% (mostly its own wake: :meth:`reference_of`)
            # say its slope is near 0, which is the pooled slope of long sessions. Taken
            # as unknown (``_SLOPE_SD``), the slope's variance times the readings'
            # distance from the reference widened such a model's interval to +/-5-10%
            # until its eighth round (ResNet-18, 24 ms: +/-10% at round 9, +/-1.3% at round 10).
            own = min(max(sxy / sxx, 0.0), _MAX_SLOPE)
            return prior, min(_SLOPE_SD**2, resid / sxx + (own - prior) ** 2)
        w = resid / _SLOPE_SD**2
        return min(max((sxy + w * prior) / (sxx + w), 0.0), _MAX_SLOPE), resid / (sxx + w)

    def pool(self, tracks: Sequence[_Track]) -> None:
        """Refit the pooled slopes over ``tracks`` (those with at least 3 readings on
        their lines): the whole run's, and each run-time class's with at least
        ``_MIN_CLASS_SESSIONS`` such sessions."""
        if self.ref_ns <= 0:
            return
        sums: dict[int, list[float]] = {}
        for t in tracks:
            a, b, _, n = t.slope_sums()
            if n >= 3:
                c = sums.setdefault(_slope_class(t.run_s()), [0.0, 0.0, 0.0])
                c[0], c[1], c[2] = c[0] + a, c[1] + b, c[2] + 1
        sxx = sum(c[0] for c in sums.values())
        if sxx > 0:
            self.slope = min(max(sum(c[1] for c in sums.values()) / sxx, 0.0), _MAX_SLOPE)
        self.class_slopes = {k: min(max(c[1] / c[0], 0.0), _MAX_SLOPE) for k, c in sums.items()
                             if c[0] > 0 and c[2] >= _MIN_CLASS_SESSIONS}
        self.version += 1


#: Rounds on its line (their bisquare weights' sum) before a session's own slope counts.
_MIN_SLOPE_ROUNDS = 8
#: Sessions with slope sums a run-time class needs for a pooled slope of its own.
_MIN_CLASS_SESSIONS = 5
#: Bounds of the run-time classes of pooled slopes (log10 seconds: 0.1 ms, 1 ms, 10 ms).
#: How a session follows a reading taken beside it depends on how many of the core's
#: phases (tens of milliseconds on a shared VM) its run spans: over the demo's
#: sessions, robust slopes had medians 0.14, 0.10, 0.06 and 0.04 in these classes.
_SLOPE_CLASS_BOUNDS = (-4.0, -3.0, -2.0)


def _slope_class(run_s: float) -> int:
    """The run-time class of a session (0: under 0.1 ms ... 3: 10 ms and more)."""
    x = math.log10(max(run_s, 1e-9))
    return sum(x >= b for b in _SLOPE_CLASS_BOUNDS)


def _median_se(values: Sequence[float], m: float) -> float:
    """Standard error of ``m``, the median of ``values`` (one per round, in time order).

    A robust spread (MAD, scaled to a normal sd) so that one round hit by an interrupt
    does not widen the interval; 1.2533 is the median's efficiency factor (its standard
    error over the mean's for normal data); :func:`_persistence` for slow phases."""
    sd = 1.4826 * statistics.median(abs(x - m) for x in values)
    return max(1.2533 * sd * _persistence(values) / math.sqrt(len(values)), 1e-4 * abs(m))


#: Rounds needed before their lag-1 correlation is estimated (fewer: taken as 0).
_MIN_ROUNDS_FOR_PERSISTENCE = 6
#: The largest lag-1 correlation believed (an inflation of sqrt(1.8 / 0.2) = 3).
_MAX_PERSISTENCE = 0.8


def _persistence(values: Sequence[float]) -> float:
    """How much a standard error from ``values`` (a sequence in time) must grow when
    consecutive values are correlated: sqrt((1 + rho) / (1 - rho)) for lag-1
    correlation rho, the variance inflation of an AR(1) sequence's mean.

    A slow phase of a shared host (a neighbour's job) lasts several rounds, so round
    medians come in runs; treated as independent they give an interval that a second
    run, in other phases, falls outside. rho is estimated on ranks, so that a single
    outlying round does not make it, and clipped to [0, 0.8]."""
    r = len(values)
    if r < _MIN_ROUNDS_FOR_PERSISTENCE:
        return 1.0
    order = sorted(range(r), key=values.__getitem__)
    ranks = [0.0] * r
    for k, i in enumerate(order):
        ranks[i] = float(k)
    mean = (r - 1) / 2
    dev = [x - mean for x in ranks]
    den = sum(d * d for d in dev)
    rho = sum(dev[i] * dev[i + 1] for i in range(r - 1)) / den if den > 0 else 0.0
    rho = min(max(rho, 0.0), _MAX_PERSISTENCE)
    return math.sqrt((1 + rho) / (1 - rho))


def _group_state(
    g: Group, tracks: Mapping[str, _Track], precision: float
) -> tuple[bool, float, float, float]:
    """(converged, relative half-width of the 95% interval, the group's latency in ns,
    that half-width at the normal quantile: what it narrows to as rounds add degrees of
    freedom, and what the progress estimate extrapolates from).

    Convergence is judged on the items' separate variances: their common movement is
    the machine's, and more rounds of every brick would buy little against it (a
    shared host's phases last minutes), so it widens the intervals handed out instead
    (:func:`_widening`), and the precision check reports a model that misses the
    requested precision because of it."""
    mu, var, welch = _group_sums(g, tracks)
    if mu <= 0:
        return True, 0.0, 0.0, 0.0
    df = var * var / welch if welch > 0 else math.inf
    half = t_quantile(df) * math.sqrt(var) / mu
    return half <= precision, half, mu, t_quantile(math.inf) * math.sqrt(var) / mu


def _widening(g: Group, tracks: Mapping[str, _Track]) -> float:
    """How much the common movement of a group's items widens its standard error (>= 1)."""
    mu, var, _ = _group_sums(g, tracks)
    if mu <= 0 or var <= 0:
        return 1.0
    common = _common_round_var(g, tracks, mu)
    return math.sqrt(1.0 + common / var) if common is not None else 1.0


def _group_sums(g: Group, tracks: Mapping[str, _Track]) -> tuple[float, float, float]:
    """The group's latency (ns), the sum of its items' separate variances, and the
    Welch-Satterthwaite denominator of that sum."""
    mu = 0.0
    var = 0.0
    welch = 0.0
    for i, c in g.terms.items():
        t = tracks.get(i)
        if t is None or (not t.open and not t.final):
            continue
        mu += c * t.median
        v = (c * t.se()) ** 2
        var += v
        welch += v * v / t.df()
    return mu, var, welch


#: Rounds the items of a group must share before their common movement is estimated.
_MIN_COMMON_ROUNDS = 5
#: A round's relative deviation is clipped to this (a round more than 1.5x off is an
#: interrupt storm, not a state of the machine a model would meet).
_MAX_DEVIATION = 0.5


def _common_round_var(g: Group, tracks: Mapping[str, _Track], mu: float) -> float | None:
    """The variance (ns^2) that the items of a group add to its latency by moving
    together from round to round; None with fewer than
    ``_MIN_COMMON_ROUNDS`` rounds of this run in which every item was measured.

    The bricks of a round are measured in the same state of the machine, so a slow
    phase moves them together: the short bricks of one round are often 20% slower, all
    of them, than those of the next. Errors that move together do not average out over
    a model's bricks, as the sum of their separate variances assumes. With ``d`` each
    item's relative deviation from its estimate in a round and ``w`` its share of the
    group, the weighted sum ``D = sum w d`` varies by ``sum w^2 Var(d)`` (what the
    separate variances hold) plus the covariances; the latter, over the rounds, is what
    is added here (never less than nothing), grown for slow phases as an item's spread
    is (:func:`_persistence`).
    """
    series: list[tuple[float, dict[int, float]]] = []
    common: set[int] | None = None
    for i, c in g.terms.items():
        t = tracks.get(i)
        if t is None or (not t.open and not t.final):
            continue
        if not t.round_nos:
            return None
        m = t.median
        dev = {r: min(max(v / m - 1.0, -_MAX_DEVIATION), _MAX_DEVIATION)
               for r, v in numbered_rounds(t.adjusted(), t.round_nos).items()}
        series.append((c * m / mu, dev))
        common = set(dev) if common is None else common & dev.keys()
        if len(common) < _MIN_COMMON_ROUNDS:
            return None
    if common is None or len(series) < 2:
        return None  # one item: its own spread already is the group's
    rounds = sorted(common)
    n = len(rounds)
    d = np.array([[dev[r] for r in rounds] for _, dev in series])
    w = np.array([wt for wt, _ in series])
    total = w @ d
    separate = float(np.sum(w * w * np.var(d, axis=1, ddof=1)))
    together = float(np.var(total, ddof=1))
    # Counted only when the sums vary more than independent errors plausibly make them
    # (a sample variance's relative spread is sqrt(2 / (n - 1)); three of those): errors
    # that do not move together must not widen an interval by chance.
    if together <= separate * (1.0 + 3.0 * math.sqrt(2.0 / (n - 1))):
        return 0.0
    covariance = together - separate
    return covariance * _persistence(list(total)) ** 2 * mu * mu / n


def _rounds_to_precision(r: int, half_z: float, precision: float, limit: float) -> float:
    """Rounds in all at which a group reaches ``precision``, from its half-width at the
    normal quantile ``half_z`` after ``r`` rounds: the half-width narrows as one over
    the square root of the rounds, and its quantile falls from Student's t towards the
    normal one as they add degrees of freedom (taken as rounds - 1). Extrapolating the
    t half-width of 2 rounds instead (t = 12.7) made every new brick look like it needed
    the round limit."""
    z = t_quantile(math.inf)
    n = float(r)
    for _ in range(3):  # a fixed point from above, close within a round after three
        n = min(r * (half_z * t_quantile(max(n - 1.0, 1.0)) / z / precision) ** 2, limit)
    return n


def runs_per_burst(between: float, within: float, run_s: float, fixed_s: float) -> float:
    """The runs per round that buy a precise median for the least time, for a session
    whose round medians vary by ``between`` whatever the burst (relative variance) and
    whose runs vary by ``within`` inside a burst; ``run_s`` is what one more run costs,
    ``fixed_s`` what a round costs the session besides its timed runs.

    Rounds are the samples that count on a host whose speed changes from burst to
    burst: on a shared 2-core VM the median of a 20 ms burst of a MatMul (263 runs)
    varied by 17% from burst to burst, one run by 21%. Per round the variance is
    ``between + within / k`` at a cost ``fixed + k run``; their product, what a
    precision costs, is least at ``k = sqrt(within fixed / (between run))`` (Cochran's
    two-stage optimum). With no variance between bursts, as many as the allocation asks."""
    if between <= 0:
        return math.inf
    return math.sqrt(within * max(fixed_s, 0.0) / (between * max(run_s, 1e-9)))


def _allocation(
    groups: Sequence[Group], tracks: Mapping[str, _Track], precision: float
) -> dict[str, float]:
    """Runs each live item needs in all (see the module docstring)."""
    need: dict[str, float] = {}
    z = t_quantile(math.inf)
    for g in groups:
        live = [(tracks[i], c) for i, c in g.terms.items() if i in tracks and tracks[i].open]
        if not live:
            continue
        mu = sum(c * t.median for t, c in live)
        if mu <= 0:
            continue
        v_star = (precision * mu / z) ** 2
        parts = []
        for t, c in live:
            n = max(1, len(t.times))
            sigma = t.se() * math.sqrt(n)
            parts.append((t, c, sigma, max(t.median, 1.0)))
        s = sum(c * sigma * math.sqrt(tt) for _, c, sigma, tt in parts)
        for t, c, sigma, tt in parts:
            n_b = c * sigma / math.sqrt(tt) * s / v_star
            key = t.item.id
            need[key] = max(need.get(key, 0.0), n_b)
    return need


def _measurement(track: _Track, config: RunnerConfig, stop_reason: str, se_factor: float = 1.0,
                 engine_run: str = "") -> Measurement:
    """The item's result, with its own standard error and interval; ``se_factor`` is
    what a reconstruction summing its bricks' errors as independent must grow this one
    by to carry what moved them together (see :func:`_common_round_var`). Grown in the
    result's own interval it misleads: on one demo run on a busy shared host, a tenth of
    the bricks had factors above 7, intervals read +/-200% and wider where the bricks'
    own rounds gave at most +/-80%."""
    times = np.asarray(track.times, dtype=np.int64)
    stats = summarize(times)
    meds = np.asarray(track.adjusted(), dtype=np.float64)
    se = track.se()
    r = len(meds)
    t = t_quantile(max(1, r - 1))
    median = track.median
    drift = float((meds.max() - meds.min()) / median) if r >= 2 and median > 0 else 0.0
    from dataclasses import replace

    stats = replace(
        stats,
        median=median,
        ci_low=max(0.0, median - t * se),
        ci_high=median + t * se,
        ci_exact=r >= 3,
        drift=drift,
        warning=None if r >= 3 else stats.warning,
    )
    if times.size > KEEP_TIMES:
        idx = np.linspace(0, times.size - 1, KEEP_TIMES).round().astype(np.int64)
        times = times[idx]
    info = track.info
    den_in, n_in = info.get("denormals_in", (0, 0))
    den_out, n_out = info.get("denormals_out", (0, 0))
    import onnxruntime as ort

    return Measurement(
        times_ns=times,
        stats=stats,
        config=config,
        warmup_iters=int(info.get("warmup_runs", 0)),
        stop_reason=stop_reason,
        setup_time_s=track.setup_s,
        wall_time_s=track.setup_s + track.item.prep_s + (track.needed_s if track.needed_s is not None
                                                         else track.sampling_s),
        denormal_input_fraction=den_in / n_in if n_in else 0.0,
        denormal_output_fraction=den_out / n_out if n_out else 0.0,
        denormal_fraction=(den_in + den_out) / (n_in + n_out) if (n_in + n_out) else 0.0,
        denormals_as_zero=config.denormals_as_zero,
        denormals_flushed=bool(info.get("denormals_flushed", config.denormals_as_zero)),
        ort_version=ort.__version__,
        seed=track.item.seed,
        model=track.item.label or track.item.id,
        sampling_time_s=track.needed_s if track.needed_s is not None else track.sampling_s,
        io_binding=bool(info.get("io_binding", True)),
        rounds=r,
        round_medians_ns=[float(x) for x in meds],
        round_probes_ns=list(track.round_probes),
        round_shared_cache=list(track.round_cache),
        speed_slope=track.slope(),
        speed_ref_ns=track.reference(track.slope()),
        median_se_ns=se,
        common_se_factor=se_factor,
        round_nos=list(track.round_nos),
        engine_run=engine_run,
        timed_cold=not track.timed_warm,
    )


# --------------------------------------------------------------------------- engine


#: How fast the worker reads its eviction buffer (a strided read; about 21 GB/s measured
#: on a Zen 4 server): only to size cold sessions' bursts.
_EVICTION_READ_BPS = 20e9
#: The L2 size assumed when the machine does not say.
_DEFAULT_L2_BYTES = 1 << 20


def _l2_bytes() -> int:
    """The data or unified L2 cache of CPU 0, in bytes."""
    from dlbricks.roofline.peaks import data_cache_bytes

    return data_cache_bytes(2) or _DEFAULT_L2_BYTES


#: The most memory live sessions hold by default. Memory a process touches for the
#: first time costs far more than the same memory reused: on the 2-vCPU VM the figures
#: come from (which returns idle memory to its host), 3-16 s per GiB, against 0.4 s
#: for memory just freed. Closed sessions leave their memory with the worker for the
#: next ones, so the working set, not the corpus, sets what is touched afresh:
#: `dlbricks demo` (about 10 GB of sessions in all, 24 GiB of memory) took 130 and
#: 144 s with half the memory available live, 128 and 113 s with 4 GiB, 119 and 126 s
#: with 1 GiB (sessions then wait out their span in smaller rounds), 109, 86, 84 and
#: 86 s with 2 GiB (interleaved runs, before sessions opened as others closed).
DEFAULT_MEMORY_BUDGET = 2 << 30


def _memory_budget(config: RunnerConfig) -> int:
    """Bytes the live sessions may hold: the configured budget, or by default
    :data:`DEFAULT_MEMORY_BUDGET` or half the memory available, whichever is less."""
    if config.memory_budget_mb:
        return config.memory_budget_mb << 20
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return min(DEFAULT_MEMORY_BUDGET, int(line.split()[1]) * 1024 // 2)
    except (OSError, ValueError):
        pass
    return DEFAULT_MEMORY_BUDGET


def _opening_cpus(config: RunnerConfig, lanes: Sequence[RunnerConfig]) -> list[int]:
    """CPUs where extra worker processes open sessions while no round runs (see
    ``RunnerConfig.open_cores``): the ones given, or by default the usable CPUs outside
    the timing cores on the same NUMA node (weights are allocated where a session is
    built). None with pool threads: their affinities are fixed to the timing cores when
    a session is created, so a session built elsewhere would still warm up on them."""
    if config.intra_op_threads != 1 or config.cores is None:
        return []
    from dlbricks.cpuset import numa_node_of, usable_cpus

    timing = {c for lane in lanes for c in (lane.cores or ())}
    usable = set(usable_cpus())
    if config.open_cores is not None:
        return sorted((set(config.open_cores) & usable) - timing)
    nodes = {numa_node_of(c) for c in timing}
    return sorted(c for c in usable - timing if numa_node_of(c) in nodes)


def _worker_configs(config: RunnerConfig, jobs: int) -> list[RunnerConfig]:
    from dataclasses import replace

    if jobs <= 1:
        return [config]
    per = max(1, config.intra_op_threads)
    cores = list(config.cores) if config.cores else list(range(jobs * per))
    if len(cores) < jobs * per:
        raise DlbricksError(f"--jobs {jobs} needs {jobs * per} cores to pin to, got {len(cores)}")
    return [replace(config, cores=tuple(cores[i * per : (i + 1) * per])) for i in range(jobs)]


class _Engine:
    def __init__(
        self,
        items: Sequence[EngineItem],
        groups: Sequence[Group],
        config: RunnerConfig,
        on_result: Callable[[EngineItem, Measurement | Failure], None],
        on_progress: Callable[[EngineProgress], None] | None,
        jobs: int,
        start_timeout_s: float,
        worker_factory: Callable[[RunnerConfig, float], Any] | None,
        on_checkpoint: Callable[[dict[str, dict[str, Any]]], None] | None = None,
        checkpoint_s: float = 2.0,
    ) -> None:
        self.config = config
        self.on_checkpoint = on_checkpoint
        self.checkpoint_s = checkpoint_s
        self.worker_factory = worker_factory or WorkerProcess
        self.on_result = on_result
        self.on_progress = on_progress
        self.start_timeout_s = start_timeout_s
        # One lane per job: a core set timing its sessions, concurrently with the other
        # lanes. A lane may hold more than one worker process: the extra ones build their
        # sessions on CPUs that time nothing (a session's set-up is mostly onnxruntime's
        # graph work and first-touch page faults, which another core does as well) and
        # come home to the lane's cores for the rounds, where the lane's processes take
        # turns, so that no two of a lane's sessions are ever timed at once.
        self.worker_configs = _worker_configs(config, jobs)
        spare = _opening_cpus(config, self.worker_configs)
        extra = min(len(spare), _MAX_OPENERS) // len(self.worker_configs)
        #: Each process's lane, and the CPUs it opens sessions on (None: its lane's).
        self.proc_lane: list[int] = []
        self.proc_open_cpus: list[tuple[int, ...] | None] = []
        for lane in range(len(self.worker_configs)):
            self.proc_lane.append(lane)
            self.proc_open_cpus.append(None)
            for k in range(extra):
                self.proc_lane.append(lane)
                self.proc_open_cpus.append((spare[lane * extra + k],))
        self.workers: list[WorkerProcess | None] = [None] * len(self.proc_lane)
        #: Processes now on their opening CPUs (moved home before a round).
        self.away: set[int] = set()
        self.tracks: dict[str, _Track] = {}
        self.speed = _Speed()
        for n, it in enumerate(items):
            if it.id in self.tracks:
                raise DlbricksError(f"measurement engine: item {it.id!r} given twice")
            lane = n % len(self.worker_configs)
            self.tracks[it.id] = _Track(it, self.lane_processes(lane)[0], lane=lane, speed=self.speed)
            if it.resume:
                self.tracks[it.id].restore(it.resume)
        known = set(self.tracks)
        self.groups = [Group(g.name, {i: c for i, c in g.terms.items() if i in known and c > 0}) for g in groups]
        # Items no group names still get measured to the precision of their own latency.
        named = {i for g in self.groups for i in g.terms}
        self.groups += [Group(i, {i: 1.0}) for i in self.tracks if i not in named]
        self.groups_of: dict[str, list[Group]] = {i: [] for i in self.tracks}
        for g in self.groups:
            for i in g.terms:
                self.groups_of[i].append(g)
        self.summary = EngineSummary(groups=len(self.groups))
        # cache_state "auto": sessions whose weights outgrow this are timed cold, unless
        # their item is compute-bound.
        self.l2_bytes = _l2_bytes() if config.cache_state == "auto" else 0
        self.eviction_nbytes = eviction_bytes()
        self.eviction_s = 0.0 if config.cache_state == "warm" else self.eviction_nbytes / _EVICTION_READ_BPS
        self.done = 0
        #: Rounds run so far: numbers each track's rounds.
        self.rounds_run = 0
        #: The shared-cache probe's readings, one per lane and round (:mod:`dlbricks.timing.cacheprobe`).
        self.cache_readings: list[float] = []
        # For the progress estimate: sessions opened and the wall time that took, and
        # the time a round costs beyond its workers' (planning, results, checkpoints).
        self.opened = 0
        self.open_wall_s = 0.0
        self.round_overhead_s = 0.0
        #: The latest round's wall time (s): the pace that spanning min_span_s goes at.
        self.last_round_s = 0.0
        self.group_states: dict[int, tuple[bool, float, float, float]] = {}
        self.last_report = 0.0
        #: Tells this run's round numbers from another run's in the results.
        self.run_id = secrets.token_hex(8)

    # ------------------------------------------------------------------ workers

    def worker(self, w: int) -> WorkerProcess:
        wk = self.workers[w]
        if wk is None:
            wk = self.worker_factory(self.worker_configs[self.proc_lane[w]], self.start_timeout_s)
            self.workers[w] = wk
            self.away.discard(w)
            self.summary.worker_starts += 1
        return wk

    def pin(self, w: int, away: bool) -> None:
        """Move process ``w`` to its opening CPUs (``away``) or back to its lane's."""
        cpus = self.proc_open_cpus[w]
        if cpus is None or (w in self.away) == away:
            return
        wk = self.worker(w)
        wk.send(("pin", list(cpus) if away else None))
        try:
            msg = wk.reply(self.config.timeout_s, "moving to other CPUs")
        except WorkerDied:
            self.workers[w] = None
            self.reopen(w)
            return
        if msg[0] != "pinned":
            if away:  # it builds its sessions where it times them, as a lone process would
                self.proc_open_cpus[w] = None
                return
            raise DlbricksError(f"measurement worker cannot return to its cores: {msg[2]}")
        if away:
            self.away.add(w)
        else:
            self.away.discard(w)

    def lane_processes(self, lane: int) -> list[int]:
        return [w for w, x in enumerate(self.proc_lane) if x == lane]

    def pick(self, t: _Track, inflight: Mapping[int, list[Any]], only: int | None) -> int | None:
        """The process to open ``t`` in: of its lane's, the one with the fewest
        requests in flight (the lane's own first); None while all are full."""
        ws = [only] if only is not None else self.lane_processes(t.lane)
        w = min(ws, key=lambda x: len(inflight.get(x, ())))
        return w if len(inflight.get(w, ())) < _OPEN_AHEAD else None

    def next_reply(self, ws: Sequence[int]) -> int:
        """Of processes ``ws`` (each awaiting a reply), one whose reply has come, or
        the first (whose reply then waits, or times out)."""
        conns = [getattr(self.workers[w], "rx", None) for w in ws]
        if len(ws) > 1 and all(c is not None for c in conns):
            from multiprocessing.connection import wait

            ready = wait(conns, timeout=self.config.timeout_s)  # type: ignore[arg-type]
            for w, c in zip(ws, conns):
                if c in ready:
                    return w
        return ws[0]

    def fail(self, track: _Track, reason: str, error: str, wall_s: float = 0.0) -> None:
        track.open = False
        track.final = True
        self.summary.failed += 1
        self.done += 1
        self.on_result(track.item, Failure(error, reason, None, wall_s))

    def prepare(self, track: _Track) -> tuple[Any, Any] | None:
        """The item's (source, int bounds), generating it if need be; None if that failed."""
        it = track.item
        t0 = time.perf_counter()
        try:
            prepared = it.source() if callable(it.source) else it.source
        except DlbricksError as exc:
            self.fail(track, "error", str(exc), time.perf_counter() - t0)
            return None
        if callable(it.source):
            it.prep_s += time.perf_counter() - t0
        # A callable may also say the integer-input bounds it found while generating.
        source, bounds = prepared if isinstance(prepared, tuple) else (prepared, it.int_bounds)
        cache_state = self.config.cache_state
        track.nbytes = source_nbytes(source)
        track.timed_warm = it.warm or cache_state == "warm" or (
            cache_state == "auto" and (it.compute_bound or track.nbytes <= self.l2_bytes))
        return source, dict(bounds) if bounds else None

    def open_many(self, tracks: Sequence[_Track], stop: Callable[[], bool] = lambda: False,
                  only: int | None = None) -> list[_Track]:
        """Open sessions, keeping a few requests in flight per worker so that the next
        brick is generated here while the worker builds and warms up the current one.
        Stops sending once ``stop()`` says so; returns the tracks not sent. ``only``:
        open them all in that process, on its lane's CPUs (a replaced worker's sessions,
        while other processes may have requests in flight or a round under way)."""
        queue = list(tracks)
        inflight: dict[int, list[tuple[_Track, float]]] = {}
        t_start = t_open = time.perf_counter()
        costs: list[tuple[_Track, float, float]] = []  # each track's set-up and generation before
        while queue or any(inflight.values()):
            # Fill every worker's pipeline.
            while queue and not stop():
                t = queue[0]
                w = self.pick(t, inflight, only)
                if w is None:
                    break
                queue.pop(0)
                costs.append((t, t.setup_s, t.item.prep_s))
                prepared = self.prepare(t)
                if prepared is None:
                    continue
                t.worker = w
                if only is None:
                    self.pin(w, away=True)
                wk = self.worker(w)
                slot = wk.next_slot
                wk.next_slot += 1
                wk.slots[slot] = t.item.id
                t.info = {"slot": slot}
                wk.send(("open", t.item.id, prepared[0], prepared[1], t.item.seed, slot))
                inflight.setdefault(t.worker, []).append((t, time.perf_counter()))
            busy = [w for w, v in inflight.items() if v]
            if not busy:
                if stop():
                    break
                continue
            w = self.next_reply(busy)
            t, t_sent = inflight[w].pop(0)
            self.receive_open(w, t, t_sent, inflight)
            now = time.perf_counter()
            self.open_wall_s += now - t_start
            t_start = now
            self.opened += 1
            self.report("opening", len(queue) + sum(len(v) for v in inflight.values()))
        self.share_opening(costs, time.perf_counter() - t_open)
        return queue

    @staticmethod
    def share_opening(costs: Sequence[tuple[_Track, float, float]], wall_s: float) -> None:
        """Scale the set-up and generation times of the sessions just opened so that
        they sum to the wall time it took: generation here overlaps set-up in the
        workers, and several processes may build sessions at once, so each session's
        own times summed would count the same seconds more than once. A session's
        cost is then its share of the opening's real wall-clock."""
        spent = [(t, t.setup_s - s0, t.item.prep_s - p0, s0, p0) for t, s0, p0 in costs]
        total = sum(ds + dp for _, ds, dp, _, _ in spent)
        if total <= wall_s or total <= 0:
            return
        f = wall_s / total
        for t, ds, dp, s0, p0 in spent:
            t.setup_s = s0 + f * ds
            t.item.prep_s = p0 + f * dp

    def receive_open(self, w: int, t: _Track, t_sent: float, inflight: dict[int, list[tuple[_Track, float]]]) -> None:
        wk = self.worker(w)
        label = t.item.label or t.item.id
        try:
            msg = wk.reply(self.config.timeout_s, f"opening {label}")
        except WorkerDied as exc:
            self.workers[w] = None
            culprit = wk.slots.get(exc.slot, t.item.id)
            ct = self.tracks[culprit]
            self.fail(ct, exc.reason, f"{ct.item.label or ct.item.id}: worker {exc.detail}", time.perf_counter() - t_sent)
            # Whatever else was in flight on that worker is opened again in a fresh one.
            again = [x for x, _ in inflight.pop(w, []) if x is not ct] + ([t] if t is not ct else [])
            self.reopen(w)
            self.open_many(again, only=w)
            return
        wk.answered(t.info["slot"])
        if msg[0] == "failed":
            self.fail(t, "error", f"{label}: {msg[2]}", time.perf_counter() - t_sent)
            return
        t.info = msg[2]
        t.setup_s += float(t.info["setup_s"])
        wk.held = int(t.info.get("held", wk.held))
        t.open = True

    def reopen(self, w: int) -> None:
        """After a worker died: open its live sessions again in a fresh one."""
        live = [t for t in self.tracks.values() if t.worker == w and t.open]
        for t in live:
            t.open = False
        self.open_many(live, only=w)

    # ------------------------------------------------------------------ rounds

    def plan(self) -> dict[int, list[tuple[str, int, bool]]]:
        cfg = self.config
        need = _allocation(self.groups, self.tracks, cfg.precision)
        plans: dict[int, list[tuple[str, int, bool]]] = {}
        live = sum(t.open for t in self.tracks.values())
        per_item_s = max(_ITEM_ROUND_S, self.round_overhead_s / max(1, live))
        for t in self.tracks.values():
            if not t.open:
                continue
            run_s = max(t.median * 1e-9, 1e-7)
            warm = t.timed_warm
            # A cold run may follow a read of the worker's eviction buffer (when too
            # few other cold sessions separate its runs): the burst counts it.
            cost_s = run_s if warm else run_s + self.eviction_s
            k_max = max(1, int(cfg.burst_s / cost_s))
            split = t.variance_components()
            if split is not None:
                # A warm session's discarded runs, and the round's bookkeeping, are paid
                # whatever k is.
                discarded_s = run_s * discarded_runs(run_s, t.nbytes, cfg.burst_s, self.eviction_nbytes) if warm else 0.0
                k_best = runs_per_burst(*split, cost_s, discarded_s + per_item_s)
                if k_best < k_max:
                    k_max = min(k_max, max(_MIN_BURST_RUNS, math.ceil(k_best)))
            want = need.get(t.item.id, 1.0) - len(t.times)
            rounds_left = max(1, cfg.min_rounds - len(t.round_medians))
            k = int(min(k_max, max(1, math.ceil(want / rounds_left))))
            plans.setdefault(t.worker, []).append((t.item.id, k, warm))
        return plans

    def run_round(self, round_no: int) -> float:
        """Run one round; returns the longest time a lane spent on it (s)."""
        self.rounds_run += 1
        t_start = time.perf_counter()
        for w in sorted(self.away):
            self.pin(w, away=False)
        plans = self.plan()
        expected: dict[int, float] = {}
        # The lanes run at once; a lane's processes one after another.
        queued: dict[int, list[int]] = {}
        for w in sorted(plans):
            expected[w] = sum((k + 1) * self.tracks[i].median * 1e-9 for i, k, _ in plans[w])
            queued.setdefault(self.proc_lane[w], []).append(w)
        # One shared-cache reading per lane and round, by its first process.
        reads_cache = {ws[0] for ws in queued.values()}
        cache_by_lane: dict[int, float] = {}
        lane_s: dict[int, float] = {}
        running: list[int] = []

        def start_next(lane: int) -> None:
            if queued[lane]:
                w = queued[lane].pop(0)
                self.worker(w).send(("round", plans[w], w in reads_cache))
                running.append(w)

        for lane in queued:
            start_next(lane)
        while running:
            w = self.next_reply(running)
            running.remove(w)
            wk = self.worker(w)
            lane = self.proc_lane[w]
            limit = _ROUND_SLACK * expected[w] + self.config.timeout_s
            try:
                msg = wk.reply(limit, f"running round {round_no + 1}")
            except WorkerDied as exc:
                self.workers[w] = None
                culprit = wk.slots.get(exc.slot)
                if culprit is not None and culprit in self.tracks:
                    t = self.tracks[culprit]
                    self.fail(t, exc.reason, f"{t.item.label or t.item.id}: worker {exc.detail}")
                self.reopen(w)
                start_next(lane)
                continue
            times, wall_s = msg[1], msg[2]
            probes: Mapping[str, float] = msg[3] if len(msg) > 3 else {}
            if len(msg) > 4 and msg[4] is not None:
                self.cache_readings.append(float(msg[4]))
                cache_by_lane[lane] = float(msg[4])
            lane_s[lane] = lane_s.get(lane, 0.0) + wall_s
            start_next(lane)
            total = sum(sum(v) for v in times.values()) or 1
            for item_id, ts in times.items():
                t = self.tracks[item_id]
                if not ts:
                    continue
                t.times.extend(ts)
                if t.first_round_t is None:
                    t.first_round_t = t_start
                med = float(np.median(ts))
                t.round_medians.append(med)
                t.round_probes.append(float(probes.get(item_id, 0.0)))
                t.round_cache.append(cache_by_lane.get(lane, 0.0))
                t.round_nos.append(self.rounds_run)
                t.round_ks.append(len(ts))
                if len(ts) >= _MIN_BURST_RUNS and med > 0:
                    mad = float(np.median(np.abs(np.asarray(ts, dtype=np.float64) - med)))
                    t.burst_vars.append((1.4826 * mad / med) ** 2)
                    del t.burst_vars[:-_KEEP_BURST_VARS]
                # The round's real wall time, shared in proportion to timed work, so
                # the cost includes warm-up runs, input reads and the loop itself.
                t.sampling_s += wall_s * sum(ts) / total
            if self.rounds_run <= self.config.min_rounds and self.config.speed_probe:
                # The readings of the rounds before any result can be final set the
                # speed every round is brought to: several rounds of every session.
                read = [(float(v), self.tracks[i]) for i, v in probes.items() if v > 0 and i in self.tracks]
                self.speed.add_readings([v for v, _ in read], [t.run_s() for _, t in read],
                                        [t.timed_warm for _, t in read])
        self.speed.pool(list(self.tracks.values()))
        return max(lane_s.values(), default=0.0)

    def finalize(self) -> None:
        """Close what is final: converged (its groups' precision, ``min_rounds``,
        ``min_span_s``) or out of rounds (``max_rounds`` of its own)."""
        cfg = self.config
        self.group_states = {id(g): _group_state(g, self.tracks, cfg.precision) for g in self.groups}
        state = {k: v[0] for k, v in self.group_states.items()}
        widening: dict[int, float] = {}  # computed for the groups of what closes only
        closing: dict[int, list[str]] = {}
        others_open = any(t.open and not t.item.reference for t in self.tracks.values())
        now = time.perf_counter()
        for t in self.tracks.values():
            if not t.open:
                continue
            enough = len(t.round_medians) >= cfg.min_rounds
            force = "max_rounds" if len(t.round_medians) >= cfg.max_rounds else None
            # Stopped by the round limit before its span, its precision is what counts.
            converged = enough and all(state[id(g)] for g in self.groups_of[t.item.id]) and (
                force is not None or t.span_s(now) >= _min_span_s(t.item, cfg))
            if t.item.reference and others_open and not force:
                if converged and t.needed_s is None:
                    t.needed_s = t.sampling_s
                continue
            if converged or force:
                t.open = False
                t.final = True
                self.summary.measured += 1
                self.done += 1
                for g in self.groups_of[t.item.id]:
                    if id(g) not in widening:
                        widening[id(g)] = _widening(g, self.tracks)
                widen = max((widening[id(g)] for g in self.groups_of[t.item.id]), default=1.0)
                self.on_result(t.item, _measurement(t, cfg, "converged" if converged else (force or "max_rounds"),
                                                    widen, self.run_id))
                closing.setdefault(t.worker, []).append(t.item.id)
        for w, ids in closing.items():
            wk = self.workers[w]
            if wk is None:
                continue
            wk.send(("close", ids))
            try:
                msg = wk.reply(self.config.timeout_s, "closing sessions")
                wk.held = int(msg[1])
            except WorkerDied:
                self.workers[w] = None

    def checkpoint(self, force: bool = False) -> None:
        if self.on_checkpoint is None:
            return
        now = time.perf_counter()
        if not force and now - getattr(self, "_last_checkpoint", 0.0) < self.checkpoint_s:
            return
        self._last_checkpoint = now
        states = {t.item.id: t.state() for t in self.tracks.values() if t.open and t.round_medians}
        if states:
            self.on_checkpoint(states)

    # ------------------------------------------------------------------ progress

    def report(self, phase: str, opening_left: int = 0) -> None:
        if self.on_progress is None:
            return
        now = time.perf_counter()
        if phase == "opening" and opening_left and now - self.last_report < _OPENING_REPORT_S:
            return  # thousands of sessions open in seconds: a few reports are enough
        self.last_report = now
        self.on_progress(EngineProgress(self.done, len(self.tracks), self.opened, self.summary.rounds, phase,
                                        self.eta_s()))

    def rounds_left(self) -> dict[str, float]:
        """Rounds each open item is expected to run still: the most any of its groups
        needs (:func:`_rounds_to_precision`; a group with no spread yet, what this
        run's final items took, :meth:`typical_rounds`), at least up to ``min_rounds``
        and ``min_span_s``, at most up to ``max_rounds`` (each item's own rounds); a
        reference runs as long as the other items."""
        cfg = self.config

        def cap(t: _Track) -> float:
            return float(max(0, cfg.max_rounds - len(t.round_medians)))

        def floor(t: _Track) -> float:
            return float(max(0, cfg.min_rounds - len(t.round_medians)))

        typical = self.typical_rounds()
        group_left: dict[int, float] = {}
        for g in self.groups:
            live = [self.tracks[i] for i in g.terms if self.tracks[i].open]
            state = self.group_states.get(id(g))
            if not live or state is None:
                continue
            converged, _, _, half_z = state
            r = max(len(t.round_medians) for t in live)
            need = 0.0
            if not converged:
                if r >= 2 and math.isfinite(half_z):
                    need = _rounds_to_precision(r, half_z, cfg.precision, float(cfg.max_rounds)) - r
                else:  # no spread seen yet: what this run's final items took
                    need = (typical if typical is not None else _PRIOR_ROUNDS * cfg.min_rounds) - r
            group_left[id(g)] = float(math.ceil(max(need, 0.0)))
        # Rounds still needed to span ``min_span_s``, at the latest round's pace.
        now = time.perf_counter()
        pace = max(self.last_round_s, 1e-6)

        def spanning(t: _Track) -> float:
            short = _min_span_s(t.item, cfg) - t.span_s(now)
            return float(math.ceil(short / pace)) if short > 0 else 0.0

        left = {
            i: min(cap(t), max(floor(t), spanning(t), *(group_left.get(id(g), 0.0) for g in self.groups_of[i])))
            for i, t in self.tracks.items() if t.open
        }
        longest = max((v for i, v in left.items() if not self.tracks[i].item.reference), default=0.0)
        for i, v in left.items():
            if self.tracks[i].item.reference:
                left[i] = max(v, longest)
        return left

    def typical_rounds(self) -> float | None:
        """The median rounds this run's measured final items took; None with fewer
        than ``_MIN_TYPICAL`` of them."""
        done = [len(t.round_medians) for t in self.tracks.values() if t.final and t.round_medians]
        return float(statistics.median(done)) if len(done) >= _MIN_TYPICAL else None

    def eta_s(self) -> float | None:
        """Seconds still to go (see :class:`EngineProgress`)."""
        measured = [t for t in self.tracks.values() if t.round_nos]
        if not measured:
            # Before the first round nothing says how many rounds the precision needs,
            # nor what the sessions still to open cost (a whole model takes a hundred
            # times a brick's set-up): no estimate rather than a wrong one.
            return None
        left = self.rounds_left()
        # A session not yet in a round costs its run time times what a round's burst
        # has cost the measured ones, per second of their run time.
        run_ratio = sum(t.sampling_s for t in measured) / max(
            1e-9, sum(len(t.round_nos) * t.median * 1e-9 for t in measured))
        per_lane = [0.0] * len(self.worker_configs)
        for i, n in left.items():
            t = self.tracks[i]
            per_round = (t.sampling_s / len(t.round_nos) if t.round_nos
                         else run_ratio * max(t.median * 1e-9, 1e-7))
            per_lane[t.lane] += n * per_round
        measuring = max(per_lane, default=0.0) + self.round_overhead_s * max(left.values(), default=0.0)
        waiting = [t for t in self.tracks.values() if not t.open and not t.final]
        return measuring + self.unopened_cost_s(waiting)

    def unopened_cost_s(self, waiting: Sequence[_Track]) -> float:
        """What the sessions not opened yet (in flight, or waiting for memory) will
        cost: each what an opened one of its kind has cost so far, its opening plus
        its rounds (for a kind none of whose sessions is open yet, the average over
        all). Not
        the rounds an open one is expected to need still: early on that is an
        unconverged slow item's rounds up to the limit, which most sessions to come
        will not run (charged to each of them it read 17 times the time left).

        By kind because the plan goes model by model, so the first sessions opened are
        few and mostly whole models: priced at their average, the 1,900 bricks still
        to open made a 2.5-minute run of 36 models read 9 minutes."""
        if not waiting:
            return 0.0
        started = [t for t in self.tracks.values() if t.round_nos or t.final]
        # Opening costs scaled to the opening's real wall-clock (pipelining, waits).
        own = sum(t.setup_s + t.item.prep_s for t in started)
        scale = self.open_wall_s / own if own > 0 else 0.0
        lanes = len(self.worker_configs)

        def cost(t: _Track) -> float:
            return scale * (t.setup_s + t.item.prep_s) + t.sampling_s / lanes

        overall = statistics.fmean(cost(t) for t in started) if started else self.open_wall_s / max(1, self.opened)
        by_kind: dict[str, list[float]] = {}
        for t in started:
            by_kind.setdefault(t.item.kind, []).append(cost(t))
        per_kind = {k: statistics.fmean(v) for k, v in by_kind.items()}
        return sum(per_kind.get(t.item.kind, overall) for t in waiting)

    def run(self) -> EngineSummary:
        t_start = time.perf_counter()
        load_before = read_load()
        budget = _memory_budget(self.config)

        def full() -> bool:
            held = sum(w.held + w.spool_bytes for w in self.workers if w is not None)
            return held >= budget and any(x.open for x in self.tracks.values())

        pending = list(self.tracks.values())
        try:
            while True:
                # Open, in order, as many sessions as the memory budget holds. Sessions
                # close as they are final, so each round may make room for more: a
                # session waiting out its span (min_span_s) is measured alongside the
                # next ones rather than in a batch of its own.
                if pending and not full():
                    self.summary.batches += 1
                    pending = self.open_many(pending, stop=full)
                if not any(t.open for t in self.tracks.values()):
                    if pending:
                        continue
                    break
                t_round = time.perf_counter()
                worker_s = self.run_round(self.summary.rounds)
                self.summary.rounds += 1
                self.finalize()
                self.checkpoint()
                self.last_round_s = time.perf_counter() - t_round
                extra = max(0.0, self.last_round_s - worker_s)
                self.round_overhead_s = extra if self.summary.rounds == 1 else (
                    0.7 * self.round_overhead_s + 0.3 * extra)
                self.report("measuring")
            self.summary.converged_groups = sum(
                _group_state(g, self.tracks, self.config.precision)[0] for g in self.groups
            )
        finally:
            for wk in self.workers:
                if wk is not None:
                    wk.stop()
        self.summary.wall_s = time.perf_counter() - t_start
        # Read after the workers were waited for: their CPU time is then this process's.
        self.summary.host = host_load(load_before, read_load(), self.cache_readings)
        return self.summary


def measure(
    items: Sequence[EngineItem],
    groups: Sequence[Group],
    config: RunnerConfig,
    *,
    on_result: Callable[[EngineItem, Measurement | Failure], None],
    on_progress: Callable[[EngineProgress], None] | None = None,
    jobs: int = 1,
    start_timeout_s: float = START_TIMEOUT_S,
    worker_factory: Callable[[RunnerConfig, float], Any] | None = None,
    on_checkpoint: Callable[[dict[str, dict[str, Any]]], None] | None = None,
    checkpoint_s: float = 2.0,
) -> EngineSummary:
    """Measure every item to the precision its groups need, in interleaved rounds.

    Args:
        items: the sessions to measure.
        groups: the quantities whose precision is stated (a model's reconstructed
            latency: its bricks with their occurrences; a whole model: itself).
            Items in no group are measured to the precision of their own latency.
        config: the runner configuration (``precision``, ``min_rounds``,
            ``max_rounds``, ``cache_state``, ``burst_s``, ``memory_budget_mb``, pinning).
        on_result: called with each item and its :class:`Measurement` or
            :class:`Failure` as soon as it is final (store it there).
        on_progress: called with an :class:`EngineProgress` after each session opened
            and after each round.
        jobs: worker processes measuring at once, each pinned to its own cores.
        start_timeout_s: how long a worker may take to start.
        worker_factory: makes a worker from (its config, start timeout); by default a
            worker process. Simulations pass an in-process stand-in that answers the
            same requests (see :mod:`dlbricks.timing.engine_worker`) from synthetic
            timing streams, and raises :class:`WorkerDied` as a dead process would.
        on_checkpoint: called at most every ``checkpoint_s`` seconds, after a round,
            with the state of every item not yet final that has rounds (id -> state);
            an item given that state as ``EngineItem.resume`` in a later run goes on
            from there, so a killed run loses at most the rounds since the last one.
        checkpoint_s: the least time between two checkpoints.

    Returns:
        An :class:`EngineSummary`.

    Raises:
        DlbricksError: a worker cannot be started at all, or items repeat.
        Exception: whatever ``on_result`` raises (the workers are stopped first).
    """
    return _Engine(items, groups, config, on_result, on_progress, jobs, start_timeout_s, worker_factory, on_checkpoint,
                   checkpoint_s).run()

