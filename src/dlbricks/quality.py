"""Which stored results to distrust, judged by the model-level precision they feed.

The precision users are promised is a model's (:attr:`RunnerConfig.precision`: the 95%
interval of each model's latency within +/- that fraction), so that is what a result
is judged by, not by a fixed spread of its own: a microsecond brick routinely varies by
more than 5% between runs and still costs a model nothing if it occurs once in a
millisecond model. Two things are flagged:

* an **unconverged result**: the measurement engine stopped it at ``max_rounds``
  (``stop_reason`` is not ``"converged"``) before every model it feeds reached the
  precision;
* an **imprecise model**: the relative half-width of its latency's 95% interval,
  rebuilt from its bricks at some G or measured end to end, exceeds the precision.
  The interval is computed as the engine computes it (each result's standard error
  from the spread between its rounds, a Welch t quantile), so a model the engine
  reported converged passes; results measured before the engine (one contiguous run
  each, ``rounds`` 0) get a standard error from their iteration interval widened by
  their drift, since an interval that ignores drift between measurement slots is not
  a 95% interval.

An imprecise model names the results that carry most of its variance (a brick's share
is occurrences^2 x standard error^2 over the model's variance): re-measuring those is
what narrows it, and they are what ``--remeasure-unstable`` measures again, with every
unconverged result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

from dlbricks.reconstruct import sum_se_ns

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.model import ModelLike
    from dlbricks.store import ResultRecord, Store

__all__ = ["Assessment", "Contributor", "ModelPrecision", "assess", "result_se_ns"]

_Z = 1.959963984540054  # the normal 97.5% quantile: a 95% two-sided interval
# Drift (range of 8 block medians over the median) to a standard error of the median:
# the range of 8 normal draws is ~2.85 sd, and the median of 8 blocks has an error of
# about one block's sd / sqrt(8); 2.85 * sqrt(8) ~ 8.
_DRIFT_TO_SE = 8.0
#: A model names the fewest results that carry this share of its variance...
NAMED_SHARE = 0.8
#: ...and never more than this many.
NAMED_MAX = 10


def result_se_ns(rec: ResultRecord) -> tuple[float, float]:
    """A stored result's standard error (ns) as a term of a model's sum, and its
    degrees of freedom.

    Results of the measurement engine carry both (the spread between rounds, grown by
    their ``common_se_factor``: what moved them with the bricks beside them); older
    single-run results get the larger of their distribution-free interval's half-width
    over 1.96 and their drift converted to a standard error, with infinite degrees of
    freedom.
    """
    meta = rec.meta or {}
    stats = rec.stats or {}
    rounds = int(meta.get("rounds", 0) or 0)
    se = sum_se_ns(meta)
    if rounds >= 2 and se > 0:
        return se, float(rounds - 1)
    median = float(stats.get("median", 0.0) or 0.0)
    lo = float(stats.get("ci_low", median) or median)
    hi = float(stats.get("ci_high", median) or median)
    from_ci = max(median - lo, hi - median, 0.0) / _Z
    from_drift = float(stats.get("drift", 0.0) or 0.0) * median / _DRIFT_TO_SE
    return max(from_ci, from_drift), math.inf


def _converged(rec: ResultRecord) -> bool | None:
    """True/False for engine results; None for results without rounds (no stop rule to judge)."""
    meta = rec.meta or {}
    if int(meta.get("rounds", 0) or 0) <= 0:
        return None
    return meta.get("stop_reason") == "converged"


@dataclass(slots=True)
class Contributor:
    """A result named for a model: its share of the model's variance."""

    kind: str
    digest: str
    label: str
    share: float
    occurrences: int
    stop_reason: str | None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(slots=True)
class ModelPrecision:
    """How precisely one model's latency is known: rebuilt at ``G``, or end to end (``G`` None)."""

    model: str
    path: str | None
    G: int | None
    latency_ns: float
    rel_halfwidth: float
    precision: float
    unconverged: int = 0
    contributors: list[Contributor] = field(default_factory=list)

    @property
    def flagged(self) -> bool:
        # A hair of tolerance: the engine stops at exactly the precision.
        return not self.rel_halfwidth <= self.precision * (1 + 1e-6)

    @property
    def where(self) -> str:
        return "end to end" if self.G is None else f"G={self.G}"

    def describe(self) -> str:
        """One line: the model, its interval against the target, and what carries it."""
        text = f"{self.model} ({self.where}): +/-{self.rel_halfwidth:.1%} > +/-{self.precision:.1%}"
        if self.G is not None and self.contributors:
            c = self.contributors[0]
            text += f"; {c.share:.0%} of its variance from {c.kind} {c.label} {c.digest[:12]}"
            if c.occurrences > 1:
                text += f" (x{c.occurrences})"
        if self.unconverged:
            text += f"; {self.unconverged} result(s) stopped at max rounds"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "path": self.path,
            "G": self.G,
            "latency_s": self.latency_ns * 1e-9,
            "rel_halfwidth": _json_float(self.rel_halfwidth),
            "precision": self.precision,
            "flagged": self.flagged,
            "unconverged": self.unconverged,
            "contributors": [c.to_dict() for c in self.contributors],
        }


@dataclass(slots=True)
class Assessment:
    """The precision check of a corpus' stored results (see the module docstring)."""

    precision: float
    models: list[ModelPrecision] = field(default_factory=list)
    #: (kind, digest) -> (label, stop_reason) of every engine result that did not converge.
    unconverged: dict[tuple[str, str], tuple[str, str | None]] = field(default_factory=dict)

    @property
    def flagged(self) -> list[ModelPrecision]:
        """The imprecise models, widest interval first."""
        return sorted((m for m in self.models if m.flagged), key=lambda m: -m.rel_halfwidth)

    def flagged_names(self) -> set[str]:
        return {m.model for m in self.models if m.flagged}

    def for_model(self, name: str) -> list[ModelPrecision]:
        return [m for m in self.models if m.model == name]

    @property
    def ok(self) -> bool:
        return not self.unconverged and not any(m.flagged for m in self.models)

    def remeasure(self) -> set[str]:
        """Digests to measure again: every unconverged result and the results named by
        the imprecise models."""
        out = {d for _, d in self.unconverged}
        for m in self.models:
            if m.flagged:
                out.update(c.digest for c in m.contributors)
        return out

    def lines(self, limit: int = 5, rerun: str = "rerun with --remeasure-unstable (or a higher --max-rounds)") -> list[str]:
        """Warning lines for stderr: the counts, then the worst cases, then ``rerun``
        (what to do about it); empty when all is well."""
        if self.ok:
            return []
        out = []
        if self.unconverged:
            kinds: dict[str, int] = {}
            for kind, _ in self.unconverged:
                kinds[kind] = kinds.get(kind, 0) + 1
            what = " and ".join(f"{n} {k} result(s)" for k, n in sorted(kinds.items()))
            out.append(f"{what} stopped at the round limit before the models they feed reached +/-{self.precision:.1%}")
        flagged = self.flagged
        if flagged:
            names = {m.model for m in flagged}
            out.append(f"{len(names)} model(s) short of the +/-{self.precision:.1%} precision:")
            seen: set[tuple[str, int | None]] = set()
            shown = 0
            for m in flagged:
                if shown >= limit:
                    break
                if (m.model, m.G) in seen:
                    continue
                seen.add((m.model, m.G))
                out.append("  " + m.describe())
                shown += 1
            rest = len(flagged) - shown
            if rest > 0:
                out.append(f"  ... and {rest} more (see --json)")
        out.append(rerun)
        return out

    def to_dict(self) -> dict[str, Any]:
        flagged = self.flagged
        return {
            "precision": self.precision,
            "models_flagged": len({m.model for m in flagged}),
            "results_unconverged": len(self.unconverged),
            "flagged": [m.to_dict() for m in flagged],
            "unconverged": [{"kind": k, "digest": d, "label": lab, "stop_reason": sr}
                            for (k, d), (lab, sr) in self.unconverged.items()],
        }


def _json_float(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _interval(terms: Iterable[tuple[float, float, float, float]]) -> tuple[float, float, float]:
    """(latency ns, variance, relative half-width) of sum(count x median) from
    ``(count, median, se, df)`` terms, with the engine's Welch t quantile."""
    from dlbricks.timing.engine import t_quantile

    mu = var = welch = 0.0
    for c, med, se, df in terms:
        mu += c * med
        v = (c * se) ** 2
        var += v
        if math.isfinite(df):
            welch += v * v / df
    if mu <= 0:
        return mu, var, 0.0
    df_total = var * var / welch if welch > 0 else math.inf
    return mu, var, t_quantile(df_total) * math.sqrt(var) / mu


def assess(
    models: Sequence[ModelLike],
    Gs: Sequence[int],
    *,
    store: Store,
    system_id: str,
    config_key: str,
    precision: float,
    e2e_models: Sequence[ModelLike] | None = None,
    names: Sequence[str] | None = None,
    bricks: bool = True,
) -> Assessment:
    """Check every model's stored results against ``precision``.

    Args:
        models: the models decomposed into bricks.
        Gs: granularities to rebuild each model at.
        store, system_id, config_key: where the results are.
        precision: the target relative half-width (:attr:`RunnerConfig.precision`).
        e2e_models: the models whose end-to-end results to check (``e2e_models[i]``
            for ``models[i]``); None: no end-to-end check.
        names: display names (default: the models' names).
        bricks: check the brick reconstructions (False: end to end only).

    Returns:
        An :class:`Assessment`. Results missing or failed are not judged here (the
        commands report those already).
    """
    from dlbricks.bricks import model_digest
    from dlbricks.corpus import Corpus
    from dlbricks.model import layer_kinds
    from dlbricks.versions import brick_digest_version, model_digest_version

    names = [m.name for m in models] if names is None else list(names)
    out = Assessment(precision=float(precision))
    if bricks and models:
        bver = brick_digest_version()
        corpus = Corpus(models)
        kinds: dict[int, list[str]] = {}
        for G in Gs:
            sp = corpus.split(int(G))
            digests = [bytes(d).hex() for d in sp.unique_digests]
            recs = store.get_results("brick", digests, bver, system_id, config_key)
            occ = sp.occurrences()
            labels: dict[int, str] = {}

            def label(u: int, labels: dict[int, str] = labels, sp: Any = sp) -> str:  # binds this G's split
                if u not in labels:
                    m, members = sp.first_occurrence(u)
                    if m not in kinds:
                        kinds[m] = layer_kinds(models[m].layers)
                    labels[u] = "→".join(kinds[m][int(i)] for i in members)
                return labels[u]

            se = {}
            for u, d in enumerate(digests):
                rec = recs.get(d)
                if rec is None or not rec.ok or rec.stats is None:
                    continue
                se[u] = (float(rec.stats["median"]), *result_se_ns(rec))
                if _converged(rec) is False:
                    out.unconverged.setdefault(("brick", d), (label(u), (rec.meta or {}).get("stop_reason")))
            for i, model in enumerate(models):
                cols = [u for u in np.nonzero(occ[i] > 0)[0].tolist() if u in se]
                if not cols:
                    continue
                terms = [(float(occ[i, u]), *se[u]) for u in cols]
                mu, var, rel = _interval(terms)
                entry = ModelPrecision(names[i], model.path, int(G), mu, rel, out.precision,
                                       unconverged=sum(("brick", digests[u]) in out.unconverged for u in cols))
                if entry.flagged and var > 0:
                    shares = sorted(((float(occ[i, u]) * se[u][1]) ** 2 / var, u) for u in cols)[::-1]
                    cum = 0.0
                    for share, u in shares[:NAMED_MAX]:
                        rec = recs[digests[u]]
                        entry.contributors.append(Contributor("brick", digests[u], label(u), share, int(occ[i, u]),
                                                              (rec.meta or {}).get("stop_reason")))
                        cum += share
                        if cum >= NAMED_SHARE:
                            break
                out.models.append(entry)
    if e2e_models is not None:
        mver = model_digest_version()
        wanted = [model_digest(m) for m in e2e_models]
        recs = store.get_results("model", wanted, mver, system_id, config_key)
        for name, m, d in zip(names, e2e_models, wanted):
            rec = recs.get(d)
            if rec is None or not rec.ok or rec.stats is None:
                continue
            med, s, df = float(rec.stats["median"]), *result_se_ns(rec)
            _, _, rel = _interval([(1.0, med, s, df)])
            entry = ModelPrecision(name, m.path, None, med, rel, out.precision)
            if _converged(rec) is False:
                out.unconverged.setdefault(("model", d), (name, (rec.meta or {}).get("stop_reason")))
                entry.unconverged = 1
            if entry.flagged:
                entry.contributors.append(Contributor("model", d, name, 1.0, 1, (rec.meta or {}).get("stop_reason")))
            out.models.append(entry)
    return out


def model_flags(assessment: Assessment, name: str) -> list[str]:
    """Short reasons to distrust one model's numbers (empty when none)."""
    out = []
    for m in assessment.for_model(name):
        if m.flagged:
            out.append(f"{m.where}: +/-{m.rel_halfwidth:.1%} > +/-{m.precision:.1%}")
        elif m.unconverged:
            out.append(f"{m.where}: {m.unconverged} result(s) stopped at max rounds")
    return out


def mapping_of(assessment: Assessment) -> Mapping[str, list[str]]:
    """Model name -> :func:`model_flags`, for the models with any."""
    out: dict[str, list[str]] = {}
    for m in assessment.models:
        flags = model_flags(assessment, m.model)
        if flags:
            out[m.model] = flags
    return out
