"""Statistics of iteration times: the median, its distribution-free interval, drift."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    pass

#: A run whose coefficient of variation exceeds this is flagged ``unstable``.
UNSTABLE_CV = 0.05
# Drift: the spread of the medians of DRIFT_BLOCKS consecutive blocks of iterations,
# relative to the median, above which a measurement is flagged as drifting.
DRIFT_BLOCKS = 8
DRIFT_WARN = 0.05


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
    rank = int(ok[-1]) + 1  # 1-based rank of the lower bound
    return rank - 1, n - rank, True


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


def ci_converged(times: list[int], target: float) -> bool:
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


#: Rounds two engine results must share before one's value in those rounds stands for
#: it beside the other (fewer: its whole estimate does): a model's latency in its bricks'
#: rounds, the per-call cost in a brick's.
MIN_SHARED_ROUNDS = 3


def numbered_rounds(round_medians: Sequence[float], round_nos: Sequence[int]) -> dict[int, float]:
    """{round number: that round's median} of one engine result: its numbers belong to the
    last ``len(round_nos)`` of its round medians (rounds resumed from a checkpoint of an
    earlier run come first and have none); {} when there are more numbers than medians."""
    if len(round_nos) > len(round_medians):
        return {}
    return dict(zip((int(r) for r in round_nos), round_medians[len(round_medians) - len(round_nos):]))
