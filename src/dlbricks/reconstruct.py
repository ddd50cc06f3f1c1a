"""A model's latency rebuilt from its bricks' stored results, with a bootstrap interval.

sequential = the sum of the latencies of a model's sequences; parallel = the longest
path through its graph of sequences. Each brick's median comes from the store (keyed
by brick digest, digest version, system fingerprint and runner configuration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from dlbricks.corpus import Corpus
from dlbricks.errors import ArgumentError, DlbricksError
from dlbricks.graph import Graph, critical_path, sequence_graph
from dlbricks.versions import brick_digest_version

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.model import ModelLike
    from dlbricks.store import ResultRecord, Store
    from dlbricks.timing.calibration import CallOverhead

__all__ = ["MissingResults", "Prediction", "bootstrap_medians", "geomean", "predict", "reconstruct", "sum_se_ns"]

MODES = ("sequential", "parallel")


@dataclass(slots=True)
class Prediction:
    """A model's latency rebuilt from its bricks (seconds), with a bootstrap interval."""

    model: str
    G: int
    mode: str
    latency_s: float
    ci_low_s: float
    ci_high_s: float
    bricks: int
    unique_bricks: int
    path: str | None = None

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


class MissingResults(DlbricksError):
    """Bricks needed for a reconstruction have no stored result."""

    def __init__(self, missing: list[str], G: int) -> None:
        shown = ", ".join(d[:12] for d in missing[:5]) + (" ..." if len(missing) > 5 else "")
        super().__init__(
            f"{len(missing)} brick(s) at G={G} have no stored result ({shown}); "
            "run `dlbricks bench` first or pass --measure-missing"
        )
        self.missing = missing


def bootstrap_medians(times_ns: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """``n_boot`` bootstrap replicates of the median of ``times_ns`` (nanoseconds).

    Small samples (n <= 400) are resampled exactly. For larger ones the replicate's
    median is drawn by rank: the rank of a resample's median among the sorted samples
    is asymptotically normal around n/2 with standard deviation sqrt(n)/2 (the binomial
    count of draws below a point), which avoids materialising n_boot x n resamples.

    Raises:
        DlbricksError: an empty sample.
    """
    t = np.sort(np.asarray(times_ns, dtype=np.float64))
    n = t.shape[0]
    if n == 0:
        raise DlbricksError("cannot bootstrap an empty sample")
    if n <= 400:
        idx = rng.integers(0, n, size=(n_boot, n))
        return np.median(t[idx], axis=1)
    ranks = np.rint((n - 1) / 2 + 0.5 * np.sqrt(n) * rng.standard_normal(n_boot)).astype(np.int64)
    return t[np.clip(ranks, 0, n - 1)]


def sum_se_ns(meta: Mapping[str, Any]) -> float:
    """A stored engine result's standard error as a term of a sum of results (its
    ``median_se_ns`` grown by its ``common_se_factor``, :class:`Measurement`'s
    ``sum_se_ns``); 0 for results without one."""
    return float(meta.get("median_se_ns", 0.0) or 0.0) * float(meta.get("common_se_factor", 1.0) or 1.0)


def result_replicates(rec: ResultRecord, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """``n_boot`` replicates of a stored result's latency estimate (nanoseconds).

    Results of the measurement engine carry the standard error of their estimate from
    the spread between rounds (drift included): replicates are the estimate plus that
    error (grown by what moved it together with the bricks measured beside it:
    ``Measurement.common_se_factor``) times Student-t draws with (rounds - 1) degrees
    of freedom, the sampling distribution of a mean of few rounds. Older results, one
    contiguous run each, are
    bootstrapped from their iteration times (:func:`bootstrap_medians`).
    """
    meta = rec.meta or {}
    rounds = int(meta.get("rounds", 0))
    se = sum_se_ns(meta)
    if rounds >= 2 and se > 0:
        # A latency is never negative; the t tail can be, for an estimate of few rounds.
        return np.maximum(float(rec.median_ns or 0.0) + se * rng.standard_t(rounds - 1, size=n_boot), 0.0)
    assert rec.times_ns is not None
    return bootstrap_medians(rec.times_ns, n_boot, rng)


def predict(
    models: Sequence[ModelLike],
    G: int,
    *,
    store: Store,
    system_id: str,
    config_key: str,
    modes: Sequence[str] = MODES,
    n_boot: int = 400,
    seed: int = 0,
    corpus: Corpus | None = None,
    names: Sequence[str] | None = None,
    call_overhead: CallOverhead | None = None,
) -> list[list[Prediction]]:
    """:func:`reconstruct`, grouped by model: ``out[i]`` holds model ``i``'s prediction
    per mode, in the order of ``modes``. ``names`` label the predictions (default: the
    models' names)."""
    for mode in modes:
        if mode not in MODES:
            raise DlbricksError(f"unknown reconstruction mode {mode!r} (sequential or parallel)")
    if n_boot < 1:
        raise ArgumentError(f"n_boot must be at least 1, got {n_boot}")
    if corpus is None:
        corpus = Corpus(models)
    elif len(corpus.graphs) != len(models) or any(g is not m for g, m in zip(corpus.graphs, models)):
        # Its split would be read as these models': another model's bricks, silently.
        raise ArgumentError("corpus= must be the Corpus of exactly these models, in this order")
    names = [m.name for m in models] if names is None else list(names)
    if len(names) != len(models):
        raise ArgumentError(f"{len(names)} names for {len(models)} models")
    sp = corpus.split(G)
    bver = brick_digest_version()
    digests = [bytes(d).hex() for d in sp.unique_digests]
    records = {}
    missing = []
    for d in digests:
        rec = store.get_result("brick", d, bver, system_id, config_key)
        if rec is None or not rec.ok:
            missing.append(d)
        else:
            records[d] = rec
    if missing:
        raise MissingResults(missing, G)
    rng = np.random.default_rng(seed)
    medians = np.array([records[d].median_ns for d in digests], dtype=np.float64)
    boots = np.stack([result_replicates(records[d], n_boot, rng) for d in digests]) if digests else np.zeros((0, n_boot))
    overhead = call_overhead.ns if call_overhead is not None else 0.0
    overheads = np.zeros(n_boot)
    if call_overhead is not None and overhead > 0:
        # Each brick paid one call's fixed cost; the model pays it once (added below).
        # The cost is one estimate shared by every brick: each replicate draws its own
        # error, so it counts once per brick (less the one the model pays). A brick
        # pays the cost of the rounds it was measured in, where they are known.
        error = call_overhead.se_ns * rng.standard_normal(n_boot)
        overheads = np.maximum(overhead + error, 0.0)
        metas = [records[d].meta or {} for d in digests]
        paid = np.array([call_overhead.in_rounds(str(m.get("engine_run") or ""), m.get("round_nos") or ())
                         for m in metas], dtype=np.float64)
        medians = np.maximum(medians - paid, 0.0)
        boots = np.maximum(boots - np.maximum(paid[:, None] + error[None, :], 0.0), 0.0)
    out: list[list[Prediction]] = []
    for i, model in enumerate(models):
        seq_ids = sp.model_seq_ids(i)
        per_mode = []
        for mode in modes:
            if mode == "sequential":
                point = float(medians[seq_ids].sum()) + overhead
                reps = boots[seq_ids].sum(axis=0) + overheads
            else:
                src, dst = sequence_graph(model, sp.model_split(i))
                sg = Graph(np.zeros((len(seq_ids), 16), np.uint8), src, dst)
                point = float(critical_path(sg, medians[seq_ids])[0]) + overhead
                reps = np.array([critical_path(sg, boots[seq_ids, b])[0] for b in range(n_boot)]) + overheads
            lo, hi = np.percentile(reps, [2.5, 97.5])
            per_mode.append(
                Prediction(names[i], G, mode, point * 1e-9, float(lo) * 1e-9, float(hi) * 1e-9,
                           int(seq_ids.shape[0]), int(np.unique(seq_ids).shape[0]), model.path)
            )
        out.append(per_mode)
    return out


def reconstruct(
    models: Sequence[ModelLike],
    G: int,
    *,
    store: Store,
    system_id: str,
    config_key: str,
    modes: Sequence[str] = MODES,
    n_boot: int = 400,
    seed: int = 0,
    corpus: Corpus | None = None,
    call_overhead: CallOverhead | None = None,
) -> list[Prediction]:
    """Predict each model's latency from its bricks' stored medians.

    sequential = the sum of its sequences' latencies; parallel = the longest path
    through its graph of sequences. The interval is the 2.5-97.5 percentile range over
    bootstrap replicates: each brick's median is resampled from its own kept iteration
    times (independently per brick; every occurrence of a brick shares its replicate).

    Args:
        models: the models (their bricks at ``G`` must be in the store).
        G: granularity.
        store, system_id, config_key: where and under which key the results are.
        modes: ``"sequential"`` and/or ``"parallel"``.
        n_boot: bootstrap replicates.
        seed: seed of the bootstrap.
        corpus: the models' :class:`Corpus`, when the caller has one already.
        call_overhead: one call's fixed cost (:mod:`dlbricks.timing.calibration`):
            each brick less the cost in the rounds it was measured in
            (:meth:`~dlbricks.timing.calibration.CallOverhead.in_rounds`), the model's
            one call at the whole estimate; its standard error drawn per bootstrap
            replicate (None: no correction).

    Returns:
        one :class:`Prediction` per model and mode, model by model.

    Raises:
        MissingResults: some bricks have no ok result (lists them).
        DlbricksError: an unknown mode.
    """
    per_model = predict(models, G, store=store, system_id=system_id, config_key=config_key, modes=modes,
                        n_boot=n_boot, seed=seed, corpus=corpus, call_overhead=call_overhead)
    return [p for preds in per_model for p in preds]


def geomean(values: Sequence[float]) -> float:
    """Geometric mean of the positive ``values`` (NaN when there are none)."""
    v = np.asarray([x for x in values if x > 0], dtype=np.float64)
    return float(np.exp(np.log(v).mean())) if v.size else float("nan")
