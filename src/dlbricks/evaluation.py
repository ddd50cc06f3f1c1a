"""The paper's experiments: constructed against end-to-end latency, and speedups, per G.

:func:`evaluate` measures what the store lacks (through :func:`dlbricks.pipeline.bench`),
then compares each model's latency rebuilt from its bricks
(:mod:`dlbricks.reconstruct`) with its end-to-end latency.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, cast

import numpy as np

from dlbricks.corpus import Corpus
from dlbricks.errors import ArgumentError, DlbricksError
from dlbricks.model import distinct_names, layer_kinds
from dlbricks.quality import assess, model_flags
from dlbricks.reconstruct import geomean, predict
from dlbricks.timing.calibration import CallOverhead, call_overhead
from dlbricks.timing.stats import MIN_SHARED_ROUNDS
from dlbricks.versions import brick_digest_version, model_digest_version

if TYPE_CHECKING:  # pragma: no cover
    import pandas

    from dlbricks.model import Model
    from dlbricks.quality import Assessment
    from dlbricks.store import ResultRecord, Store
    from dlbricks.timing.config import RunnerConfig

__all__ = ["ATTRIBUTION_HEADS", "ATTRIBUTION_STEPS", "AttributionUnavailable", "Evaluation", "GAccuracy", "ModelEvaluation",
           "brick_results", "evaluate", "same_rounds_latency", "same_rounds_references"]

#: The chain of variants ``evaluate(..., attribution=True)`` reconstructs, each adding
#: one correction to the one before; the last is the evaluation itself.
ATTRIBUTION_STEPS = ("baseline", "call_overhead", "runtime_graph", "cache_state")
#: How tables and figures head each step.
ATTRIBUTION_HEADS = {"baseline": "baseline", "call_overhead": "+ call overhead", "runtime_graph": "+ runtime graph",
                     "cache_state": "+ cache state"}


class AttributionUnavailable(DlbricksError):
    """The store lacks results an attribution needs, and measuring was not allowed."""


@dataclass(frozen=True, slots=True)
class GAccuracy:
    """One granularity's results over the corpus (``per_g`` in the JSON form).

    ``speedup`` is the paper's (sum of end-to-end latencies over the sum of the unique
    bricks' latencies); ``wallclock_speedup`` what the runs cost (seconds spent
    measuring every model end to end over seconds spent measuring the unique bricks,
    generation and set-up included: each session's share of the real wall-clock its
    batch took to build, where generation here and set-up in the workers overlap).
    """

    G: int
    unique_bricks: int
    bricks: int
    geomean_normalized: float
    min_normalized: float
    max_normalized: float
    geomean_normalized_parallel: float
    within_5pct: float
    within_10pct: float
    rmspe: float
    spearman: float
    speedup: float
    wallclock_speedup: float
    e2e_total_s: float
    bricks_total_s: float
    e2e_wall_s: float
    bricks_wall_s: float


@dataclass(frozen=True, slots=True)
class ModelEvaluation:
    """One model: its end-to-end latency and, per G and mode, the prediction (``models``
    in the JSON form; ``per_g[G][mode]`` has ``latency_s``, ``ci_low_s``, ``ci_high_s``,
    ``normalized`` and ``normalized_ci``)."""

    name: str
    path: str | None
    layers: int
    e2e_s: float
    e2e_ci_s: tuple[float, float]
    per_g: Mapping[int, Mapping[str, Any]]
    flagged: bool
    flags: tuple[str, ...]

    def normalized(self, G: int, mode: str = "sequential") -> float:
        """Predicted over measured latency at ``G`` (NaN when not evaluated)."""
        entry = self.per_g.get(int(G), {}).get(mode)
        return float(entry["normalized"]) if entry else math.nan


class Evaluation(Mapping[str, Any]):
    """What :func:`evaluate` returns: typed views (:attr:`per_g`, :attr:`models`,
    :meth:`accuracy`, :meth:`to_dataframe`) over the JSON form (:meth:`to_dict`), which
    it also reads as (``result["per_g"]``), so code written for the dict keeps working."""

    def __init__(self, data: Mapping[str, Any], check: Assessment | None = None) -> None:
        self._data = dict(data)
        #: The precision check behind ``precision_check`` and each model's ``flags``
        #: (None for an evaluation read back from JSON).
        self.check = check

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return (f"Evaluation({len(self._data.get('models', []))} models, G={self._data.get('G')}, "
                f"system {self._data.get('system_id')})")

    @property
    def Gs(self) -> list[int]:
        return [int(g) for g in self._data.get("G", [])]

    @property
    def system_id(self) -> str:
        return str(self._data["system_id"])

    @property
    def config_key(self) -> str:
        return str(self._data["config_key"])

    @property
    def call_overhead_ns(self) -> float | None:
        return self._data.get("call_overhead_ns")

    @property
    def attribution(self) -> dict[str, Any] | None:
        """What each correction explains per model (``evaluate(..., attribution=True)``), or None."""
        value = self._data.get("attribution")
        return copy.deepcopy(value) if value is not None else None

    @property
    def per_g(self) -> list[GAccuracy]:
        names = GAccuracy.__slots__
        return [GAccuracy(**{k: g.get(k, math.nan) for k in names}) for g in self._data.get("per_g", [])]

    def accuracy(self, G: int) -> GAccuracy:
        """The :class:`GAccuracy` of one granularity.

        Raises:
            KeyError: ``G`` was not evaluated.
        """
        for g in self.per_g:
            if g.G == int(G):
                return g
        raise KeyError(f"G={G} was not evaluated (G: {self.Gs})")

    @property
    def models(self) -> list[ModelEvaluation]:
        out = []
        for m in self._data.get("models", []):
            ci = m.get("e2e_ci_s") or [math.nan, math.nan]
            out.append(ModelEvaluation(
                name=m["name"], path=m.get("path"), layers=int(m.get("layers", 0)), e2e_s=float(m["e2e_s"]),
                e2e_ci_s=(float(ci[0]), float(ci[1])),
                per_g={int(G): {k: v for k, v in g.items() if k in ("sequential", "parallel")}
                       for G, g in m.get("per_g", {}).items()},
                flagged=bool(m.get("flagged", False)), flags=tuple(m.get("flags", ())),
            ))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form (a copy; schema in README)."""
        return copy.deepcopy(self._data)

    def to_dataframe(self) -> pandas.DataFrame:
        """One row per model, G and mode: ``model``, ``path``, ``G``, ``mode``,
        ``latency_s``, ``ci_low_s``, ``ci_high_s``, ``e2e_s``, ``normalized``,
        ``normalized_ci_low``, ``normalized_ci_high``, ``flagged``.

        Raises:
            DlbricksError: pandas is not installed.
        """
        try:
            import pandas as pd
        except ImportError as exc:
            raise DlbricksError("to_dataframe needs pandas: pip install pandas") from exc
        rows = []
        for m in self.models:
            for G, modes in sorted(m.per_g.items()):
                for mode, p in modes.items():
                    nci = p.get("normalized_ci") or [math.nan, math.nan]
                    rows.append({"model": m.name, "path": m.path, "G": G, "mode": mode, "latency_s": p["latency_s"],
                                 "ci_low_s": p["ci_low_s"], "ci_high_s": p["ci_high_s"], "e2e_s": m.e2e_s,
                                 "normalized": p["normalized"], "normalized_ci_low": nci[0],
                                 "normalized_ci_high": nci[1], "flagged": m.flagged})
        return pd.DataFrame(rows, columns=["model", "path", "G", "mode", "latency_s", "ci_low_s", "ci_high_s", "e2e_s",
                                           "normalized", "normalized_ci_low", "normalized_ci_high", "flagged"])


def evaluate(
    models: Sequence[Model],
    Gs: Sequence[int],
    *,
    store: Store,
    config: RunnerConfig,
    measure_missing: bool = True,
    workdir: str | Path | None = None,
    seed: int = 0,
    progress: bool = False,
    n_boot: int = 400,
    e2e_models: Sequence[Model] | None = None,
    brick_dirs: Sequence[str | Path] = (),
    remeasure_unstable: bool = False,
    attribution: bool = False,
) -> Evaluation:
    """The paper's experiments: constructed vs end-to-end latency and speedups per G.

    Measures what is missing first (bricks and whole models), then reports per model
    and G the end-to-end latency, the sequential and parallel constructed latencies,
    normalized latency (constructed / end-to-end, the latter in the rounds the bricks
    were measured in: :func:`same_rounds_latency`) with its interval; per G the
    geometric mean of normalized latency, the paper's speedup (sum of end-to-end
    latencies / sum of unique brick latencies) and the wall-clock speedup (time to
    benchmark every model end to end / time to benchmark the unique bricks, same
    statistical rules, set-up included).

    Models are told apart by position (and their end-to-end results by whole-model
    digest), never by name: two files both called ``model.onnx`` stay two models. Each
    model entry carries a distinct display ``name`` (:func:`dlbricks.model.distinct_names`)
    and its ``path``.

    Args:
        models: the models decomposed into bricks.
        Gs: granularities.
        store, config: the results store and the runner configuration.
        measure_missing: bench what the store lacks first (else a missing result is an error).
        workdir, seed, progress, brick_dirs: as for :func:`dlbricks.pipeline.bench`.
        n_boot: bootstrap replicates of each interval.
        e2e_models: ``e2e_models[i]`` is timed end to end for ``models[i]`` (runtime-graph
            decomposition times the source models); default: the models themselves.
        remeasure_unstable: measure again, first, the stored results the precision
            check flags (:meth:`dlbricks.quality.Assessment.remeasure`).
        attribution: also reconstruct, at ``Gs[0]``, the chain of variants of
            :data:`ATTRIBUTION_STEPS` (the source graph with warm caches and no
            call-overhead correction; + the correction; + the graphs ``models`` are cut
            from; + ``config.cache_state``, which is this evaluation) against the same
            end-to-end latencies, measuring only the bricks the store lacks; the result
            then has an ``attribution`` entry (see :func:`_attribution`).

    Returns:
        an :class:`Evaluation` (``to_dict()`` is the JSON form, schema in README; it
        also reads as that mapping). Each model carries ``flagged`` and ``flags``
        (:mod:`dlbricks.quality`), the result a ``precision_check`` and a ``reuse``
        count of what came from the store.

    Raises:
        DlbricksError: ``e2e_models`` does not pair with ``models``; a result is missing
            without ``measure_missing``; no model could be measured end to end. (A model
            whose end-to-end run fails is left out and listed under ``excluded``.)
        AttributionUnavailable: ``attribution`` without ``measure_missing``, and the store
            lacks a result one of its variants needs.
    """
    from dlbricks.bricks import model_digest
    from dlbricks.pipeline import bench, paired_e2e_models
    from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint

    if not models:
        raise ArgumentError("evaluate: no models given")
    sources = cast("list[Model]", paired_e2e_models(models, e2e_models))
    paths = [m.path if m.path is not None else s.path for m, s in zip(models, sources)]
    names = distinct_names([m.name for m in models], paths)
    system_id = fingerprint_id(system_fingerprint())
    config_key = config.key()
    remeasure: set[str] = set()
    if remeasure_unstable:
        remeasure = assess(models, Gs, store=store, system_id=system_id, config_key=config_key,
                           precision=config.precision, e2e_models=sources, names=names).remeasure()
    reuse: dict[str, Any]
    host: dict[str, Any] | None = None
    if measure_missing:
        summary = bench(models, Gs, store=store, config=config, workdir=workdir, e2e=True, seed=seed,
                        progress=progress, e2e_models=sources, brick_dirs=brick_dirs, remeasure=remeasure)
        reuse = {k: getattr(summary, k) for k in ("bricks_total", "bricks_reused", "bricks_measured", "bricks_failed",
                                                  "models_total", "models_reused", "models_measured", "models_failed",
                                                  "wall_s")}
        reuse["remeasured"] = len(remeasure)
        host = summary.host
    else:
        reuse = {"bricks_total": None, "bricks_reused": None, "bricks_measured": 0, "bricks_failed": 0,
                 "models_total": len(sources), "models_reused": len(sources), "models_measured": 0,
                 "models_failed": 0, "wall_s": 0.0, "remeasured": 0}
    mver = model_digest_version()
    corpus = Corpus(models)

    e2e: list[ResultRecord] = []
    missing_models = []
    for name, source in zip(names, sources):
        rec = store.get_result("model", model_digest(source), mver, system_id, config_key)
        if rec is None or not rec.ok:
            missing_models.append(name)
        e2e.append(rec)  # type: ignore[arg-type]  # None only when reported just below
    if missing_models and not measure_missing:
        raise DlbricksError(
            f"no end-to-end result for {len(missing_models)} model(s) ({', '.join(missing_models[:5])}); "
            "run `dlbricks bench --e2e` first or drop --no-measure"
        )
    # Left out, and listed with the reason, while the others are still evaluated: a
    # model whose end-to-end run was measured just now and failed, and one a brick of
    # which failed (its session crashed, hung, or could not be built). Both failures
    # are stored with their reasons.
    e2e_failed = [i for i, rec in enumerate(e2e) if rec is None or not rec.ok]
    excluded: list[dict[str, Any]] = [
        {"name": names[i], "path": paths[i],
         "error": f"its end-to-end run failed: {e2e[i].error or 'failed'}" if e2e[i] is not None
         else "no end-to-end result"}
        for i in e2e_failed
    ]
    if e2e_failed and len(e2e_failed) == len(models):
        raise DlbricksError(f"no model could be measured end to end ({excluded[0]['name']}: {excluded[0]['error']})")
    bricks_failed = {i: why for i, why in _models_with_failed_bricks(corpus, Gs, store, system_id,
                                                                      config_key).items() if i not in e2e_failed}
    excluded += [{"name": names[i], "path": paths[i], "error": bricks_failed[i]} for i in sorted(bricks_failed)]
    if excluded:
        keep = [i for i in range(len(models)) if i not in bricks_failed and i not in e2e_failed]
        if not keep:
            first = min(bricks_failed)
            raise DlbricksError(f"no model could be reconstructed ({names[first]}: {bricks_failed[first]})")
        models = [models[i] for i in keep]
        sources = [sources[i] for i in keep]
        names = [names[i] for i in keep]
        paths = [paths[i] for i in keep]
        e2e = [e2e[i] for i in keep]
        corpus = Corpus(models)
    e2e_s = [_median_ns(rec) * 1e-9 for rec in e2e]

    rows: list[dict[str, Any]] = [
        {"name": names[i], "path": paths[i], "layers": m.n_layers, "per_g": {}} for i, m in enumerate(models)
    ]
    per_g = []
    bricks_out: list[dict] = []
    calibrated = call_overhead(store, system_id, config_key) if config.call_overhead else None
    overhead = calibrated.ns if calibrated else None
    e2e_total = sum(e2e_s)
    e2e_wall = sum(_wall_s(rec) for rec in e2e)
    # Kinds without building Layer objects: a fast-loaded model has them already.
    kinds = [layer_kinds(m.layers) for m in models]
    for G in Gs:
        per_model = predict(models, G, store=store, system_id=system_id, config_key=config_key,
                            n_boot=n_boot, seed=seed, corpus=corpus, names=names, call_overhead=calibrated)
        sp = corpus.split(G)
        unique, recs, brick_ns = brick_results(sp, store, system_id, config_key)  # predict checked every brick
        occurrences = sp.occurrences()
        norm_seq: list[float] = []
        norm_par: list[float] = []
        pred_seq: list[float] = []
        references = same_rounds_references(e2e, recs, brick_ns, occurrences)
        for i, preds in enumerate(per_model):
            reference = references[i]
            assert reference is not None  # models without an end-to-end result were excluded
            e, e_rounds = reference
            e *= 1e-9
            # The reference's interval: the model's over the rounds the comparison uses.
            e_rel = _relative_halfwidth(e2e[i]) * math.sqrt(max(1.0, len(_round_medians(e2e[i])) / max(e_rounds, 1.0)))
            entry = rows[i]["per_g"].setdefault(str(G), {"e2e_s": e2e_s[i]})
            entry["e2e_same_rounds_s"] = e
            for p in preds:
                n = p.latency_s / e
                # The ratio's interval carries both uncertainties (independent errors
                # add in quadrature on the relative scale).
                lo_rel = math.hypot(1 - p.ci_low_s / p.latency_s, e_rel) if p.latency_s > 0 else math.inf
                hi_rel = math.hypot(p.ci_high_s / p.latency_s - 1, e_rel) if p.latency_s > 0 else math.inf
                entry[p.mode] = {
                    "latency_s": p.latency_s,
                    "ci_low_s": p.ci_low_s,
                    "ci_high_s": p.ci_high_s,
                    "normalized": n,
                    "normalized_ci": [n * max(0.0, 1 - lo_rel), n * (1 + hi_rel)],
                }
                entry["bricks"] = p.bricks
                entry["unique_bricks"] = p.unique_bricks
                (norm_seq if p.mode == "sequential" else norm_par).append(p.latency_s / e)
                if p.mode == "sequential":
                    pred_seq.append(p.latency_s)
        occurrences = occurrences.sum(axis=0)
        for u, (d, rec) in enumerate(zip(unique, recs)):
            m, members = sp.first_occurrence(u)
            median_s = float(brick_ns[u]) * 1e-9
            bricks_out.append({
                "G": G,
                "digest": d,
                "occurrences": int(occurrences[u]),
                "median_s": median_s,
                "ci_low_s": rec.stats["ci_low"] * 1e-9,  # type: ignore[union-attr,index]
                "ci_high_s": rec.stats["ci_high"] * 1e-9,  # type: ignore[union-attr,index]
                "op_types": [kinds[m][i] for i in members],
                "contribution_s": median_s * int(occurrences[u]),
                "stop_reason": (rec.meta or {}).get("stop_reason"),  # type: ignore[union-attr]
                "rounds": (rec.meta or {}).get("rounds", 0),  # type: ignore[union-attr]
            })
        brick_total = float(brick_ns.sum()) * 1e-9
        brick_wall = sum(_wall_s(r) for r in recs)
        per_g.append(
            {
                "G": G,
                "unique_bricks": len(unique),
                "bricks": sp.n_sequences,
                "geomean_normalized": geomean(norm_seq),
                **accuracy_metrics(norm_seq, e2e_s, pred_seq),
                "min_normalized": float(min(norm_seq)),
                "max_normalized": float(max(norm_seq)),
                "geomean_normalized_parallel": geomean(norm_par),
                "speedup": e2e_total / brick_total if brick_total > 0 else float("nan"),
                "wallclock_speedup": e2e_wall / brick_wall if brick_wall > 0 else float("nan"),
                "e2e_total_s": e2e_total,
                "bricks_total_s": brick_total,
                "e2e_wall_s": e2e_wall,
                "bricks_wall_s": brick_wall,
            }
        )
    check = assess(models, Gs, store=store, system_id=system_id, config_key=config_key, precision=config.precision,
                   e2e_models=sources, names=names)
    if reuse["bricks_total"] is None:
        reuse["bricks_total"] = reuse["bricks_reused"] = len({b["digest"] for b in bricks_out})
    for r, rec, e in zip(rows, e2e, e2e_s):
        r["e2e_s"] = e
        r["e2e_ci_s"] = [rec.stats["ci_low"] * 1e-9, rec.stats["ci_high"] * 1e-9]  # type: ignore[index]
        r["flags"] = model_flags(check, r["name"])
        r["flagged"] = bool(r["flags"])
        g1 = r["per_g"].get("1")
        if g1:  # the paper's Section 2: layer latencies summed, and along the critical path
            r["layer_sum_s"] = g1["sequential"]["latency_s"]
            r["layer_critical_path_s"] = g1["parallel"]["latency_s"]
    extra: dict[str, Any] = {}
    if attribution:
        extra["attribution"] = _attribution(
            models, sources, rows, int(Gs[0]), store=store, config=config, system_id=system_id,
            measure_missing=measure_missing, workdir=workdir, seed=seed, progress=progress, n_boot=n_boot,
            brick_dirs=brick_dirs)
    return Evaluation({
        "schema_version": 1,
        "system_id": system_id,
        "config_key": config_key,
        "config": config.to_dict(),
        "G": list(Gs),
        "call_overhead_ns": overhead,
        "call_overhead_se_ns": calibrated.se_ns if calibrated else None,
        "per_g": per_g,
        "models": rows,
        "bricks": bricks_out,
        "precision_check": check.to_dict(),
        "reuse": reuse,
        "host": host,
        "excluded": excluded,
        **extra,
    }, check)


def _attribution(
    models: Sequence[Model],
    sources: Sequence[Model],
    rows: Sequence[Mapping[str, Any]],
    G: int,
    *,
    store: Store,
    config: RunnerConfig,
    system_id: str,
    measure_missing: bool,
    workdir: str | Path | None,
    seed: int,
    progress: bool,
    n_boot: int,
    brick_dirs: Sequence[str | Path],
) -> dict[str, Any]:
    """How much of each model's error each correction explains, at ``G``.

    The chain (:data:`ATTRIBUTION_STEPS`): ``baseline``, the source graphs' bricks timed
    warm, summed without the call-overhead correction; ``call_overhead``, the same
    bricks with the calibrated overhead of that (warm) configuration counted once per
    model (if ``config.call_overhead``); ``runtime_graph``, the bricks of ``models``
    (the graphs this evaluation decomposed), still warm; ``cache_state``, this
    evaluation (``config.cache_state``). Warm bricks, and the warm configuration's
    calibration probes, are measured where the store lacks them; whole models never:
    every step is normalized by the evaluation's own end-to-end reference (whole models
    are timed as warm loops of the source model whatever the bricks' cache state).

    Returns:
        ``{"G", "steps", "labels", "config_key", "call_overhead_ns", "models": [{"name",
        "path", "e2e_s", "e2e_same_rounds_s" (what every step divides by, as the
        evaluation does), "latency_s": [per step], "normalized": [per step], "explained":
        {step: change in normalized latency}}], "reuse"}`` (``reuse``: the warm
        variants' unique bricks, ``bricks_total``, ``bricks_reused``, ``bricks_measured``,
        ``bricks_failed``, and the seconds spent, ``wall_s``).

    Raises:
        AttributionUnavailable: without ``measure_missing``, a brick or the warm
            calibration is not in the store.
    """
    from dataclasses import replace

    from dlbricks.pipeline import bench
    from dlbricks.reconstruct import MissingResults

    warm = replace(config, cache_state="warm")
    warm_key = warm.key()
    # The graphs this evaluation cut that are not the source graph (a model whose
    # runtime graph could not be used is its own source).
    cut = [m for m, s in zip(models, sources) if m is not s]
    reuse: dict[str, Any] = {"bricks_total": 0, "bricks_reused": 0, "bricks_measured": 0, "bricks_failed": 0,
                             "wall_s": 0.0}
    if measure_missing:
        summary = bench([*sources, *cut], [G], store=store, config=warm, workdir=workdir, e2e=False, seed=seed,
                        progress=progress, brick_dirs=brick_dirs)
        reuse = {k: getattr(summary, k) for k in reuse}
    calibrated = call_overhead(store, system_id, warm_key) if config.call_overhead else None
    overhead = calibrated.ns if calibrated else None
    if config.call_overhead and overhead is None and not measure_missing:
        raise AttributionUnavailable(
            f"attribution at G={G}: the store has no call-overhead calibration for warm caches; "
            "measure it (drop --no-measure) or pass --no-call-overhead")

    def sums(group: Sequence[Model], cal: CallOverhead | None) -> list[float]:
        try:
            preds = predict(group, G, store=store, system_id=system_id, config_key=warm_key, modes=("sequential",),
                            n_boot=min(n_boot, 50), seed=seed, call_overhead=cal)
        except MissingResults as exc:
            if measure_missing:
                raise
            raise AttributionUnavailable(
                f"attribution at G={G}: {len(exc.missing)} brick(s) timed with warm caches are not in the store; "
                "drop --no-measure to measure them") from None
        return [p[0].latency_s for p in preds]

    base = sums(sources, None)
    with_call = sums(sources, calibrated)
    runtime = with_call if not cut else sums(models, calibrated)
    out_models = []
    for i, r in enumerate(rows):
        # The evaluation's own reference, so that the last step is the evaluation.
        e = float(r["per_g"][str(G)]["e2e_same_rounds_s"])
        latency = [base[i], with_call[i], runtime[i], float(r["per_g"][str(G)]["sequential"]["latency_s"])]
        norm = [x / e for x in latency]
        out_models.append({
            "name": r["name"],
            "path": r["path"],
            "e2e_s": float(r["e2e_s"]),
            "e2e_same_rounds_s": e,
            "latency_s": latency,
            "normalized": norm,
            "explained": {step: norm[k] - norm[k - 1] for k, step in enumerate(ATTRIBUTION_STEPS) if k},
        })
    return {
        "G": G,
        "steps": list(ATTRIBUTION_STEPS),
        "labels": {
            "baseline": "source graph, warm caches, no call-overhead correction",
            "call_overhead": "+ call-overhead correction" + ("" if config.call_overhead else " (off: --no-call-overhead)"),
            "runtime_graph": "+ runtime graph",
            "cache_state": f"+ cache state {config.cache_state}",
        },
        "config_key": warm_key,
        "call_overhead_ns": overhead,
        "models": out_models,
        "reuse": reuse,
    }


def accuracy_metrics(normalized: Sequence[float], measured: Sequence[float] | None = None,
                     predicted: Sequence[float] | None = None) -> dict[str, float]:
    """Per-model accuracy as the field reports it, from normalized latencies
    (predicted / measured): the share of models within +/-5% and +/-10%, the root mean
    square percentage error and, given the latencies themselves, Spearman's rank
    correlation of predicted against measured (NaN for fewer than three models)."""
    x = np.asarray(normalized, dtype=np.float64)
    if x.size == 0:
        return {"within_5pct": math.nan, "within_10pct": math.nan, "rmspe": math.nan, "spearman": math.nan}
    err = x - 1.0
    out = {
        "within_5pct": float(np.mean(np.abs(err) <= 0.05)),
        "within_10pct": float(np.mean(np.abs(err) <= 0.10)),
        "rmspe": float(np.sqrt(np.mean(err**2))),
        "spearman": math.nan,
    }
    if measured is not None and predicted is not None and len(measured) >= 3:
        from scipy.stats import spearmanr

        rho = spearmanr(np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64))[0]
        out["spearman"] = float(rho)
    return out


def _models_with_failed_bricks(
    corpus: Corpus, Gs: Sequence[int], store: Store, system_id: str, config_key: str
) -> dict[int, str]:
    """Model index -> why it cannot be reconstructed: the first of its bricks, at any
    G, whose stored result is a failure."""
    out: dict[int, str] = {}
    for G in Gs:
        sp = corpus.split(G)
        digests, recs, _ = brick_results(sp, store, system_id, config_key)
        bad = [(u, rec) for u, rec in enumerate(recs) if rec is not None and not rec.ok]
        if not bad:
            continue
        occ = sp.occurrences()
        for u, rec in bad:
            for i in np.nonzero(occ[:, u])[0]:
                out.setdefault(int(i), f"brick {digests[u][:12]} (G={G}) failed: {rec.error or 'failed'}")
    return out


def _round_medians(rec: ResultRecord) -> list[float]:
    return [float(x) for x in (rec.meta or {}).get("round_medians_ns") or ()]


def _numbered_rounds(rec: ResultRecord) -> tuple[str, dict[int, float]]:
    """(engine run id, {round number: that round's median}) of a result of the
    measurement engine; ("", {}) for results without round numbers."""
    from dlbricks.timing.stats import numbered_rounds

    meta = rec.meta or {}
    by_round = numbered_rounds(_round_medians(rec), meta.get("round_nos") or ())
    return (str(meta.get("engine_run") or ""), by_round) if by_round else ("", {})


def same_rounds_latency(
    model: ResultRecord, bricks: Sequence[ResultRecord | None], weights: Sequence[float]
) -> tuple[float, float]:
    """A model's end-to-end latency (ns) as measured in the rounds its bricks were, and
    the number of its rounds that estimate rests on.

    The engine measures bricks and whole models in the same rounds so that a change of
    the machine's speed moves both; but a brick closes as soon as its models' precision
    allows (often after a few rounds) while a whole model may need many more, and the
    host's speed drifts over minutes. Compared with the model's latency over all its
    rounds, the bricks would carry the speed of their own rounds into the ratio. So each
    brick is compared with the model's median over the rounds of this engine run in
    which both were measured (at least :data:`MIN_SHARED_ROUNDS`; otherwise, or for a
    brick from another run of the engine, with the model's whole estimate), weighted by
    its share ``weights`` of the reconstruction. With every brick measured in every one
    of the model's rounds this is the model's own estimate.
    """
    est = float(model.median_ns or 0.0)
    run, by_round = _numbered_rounds(model)
    all_meds = _round_medians(model)
    n_all = float(len(all_meds))
    w = np.asarray(weights, dtype=np.float64)
    if not run or len(by_round) < MIN_SHARED_ROUNDS or not all_meds or w.sum() <= 0:
        return est, n_all
    whole = float(np.median(all_meds))
    ratio = np.ones(len(bricks))
    shared = np.full(len(bricks), n_all)
    cache: dict[tuple[int, ...], tuple[float, float]] = {}
    for k, rec in enumerate(bricks):
        if rec is None:
            continue
        brun, brounds = _numbered_rounds(rec)
        if brun != run:
            continue
        key = tuple(r for r in brounds if r in by_round)
        if len(key) < MIN_SHARED_ROUNDS:
            continue
        if key not in cache:
            cache[key] = (float(np.median([by_round[r] for r in key])) / whole, float(len(key)))
        ratio[k], shared[k] = cache[key]
    share = w / w.sum()
    return est * float(share @ ratio), float(share @ shared)


def brick_results(
    sp: Any, store: Store, system_id: str, config_key: str
) -> tuple[list[str], list[ResultRecord | None], np.ndarray]:
    """The unique bricks of a split (:meth:`dlbricks.corpus.Corpus.split`): their digests
    (hex), stored results (None where the store has none) and medians (ns; 0 for one not
    measured), in the split's order."""
    unique = [bytes(d).hex() for d in sp.unique_digests]
    found = store.get_results("brick", unique, brick_digest_version(), system_id, config_key)
    recs = [found.get(d) for d in unique]
    medians = np.array([float(r.median_ns) if r is not None and r.ok and r.median_ns else 0.0 for r in recs])
    return unique, recs, medians


def same_rounds_references(
    models: Sequence[ResultRecord | None], bricks: Sequence[ResultRecord | None], brick_ns: np.ndarray,
    occurrences: np.ndarray,
) -> list[tuple[float, float] | None]:
    """:func:`same_rounds_latency` of every model at one G (None for a model without a
    measured end-to-end result): ``models`` their end-to-end results, ``bricks`` and
    ``brick_ns`` the G's unique bricks' results and medians (ns; 0 for one not
    measured), ``occurrences`` the split's (models x unique bricks). What ``evaluate``
    and ``construct`` divide by."""
    out: list[tuple[float, float] | None] = []
    for i, rec in enumerate(models):
        if rec is None or not rec.ok or not rec.median_ns:
            out.append(None)
            continue
        used = np.flatnonzero(occurrences[i])
        out.append(same_rounds_latency(rec, [bricks[int(u)] for u in used], occurrences[i, used] * brick_ns[used]))
    return out


def _median_ns(rec: ResultRecord | None) -> float:
    """The median of a result the caller has checked is measured (measured results carry stats)."""
    assert rec is not None and rec.median_ns is not None
    return rec.median_ns


def _relative_halfwidth(rec: Any) -> float:
    """The larger side of a stored result's interval, relative to its median."""
    s = rec.stats or {}
    m = float(s.get("median", 0.0))
    if m <= 0:
        return math.inf
    return max(m - float(s.get("ci_low", m)), float(s.get("ci_high", m)) - m) / m


def _wall_s(rec: object) -> float:
    """Seconds spent measuring one result, set-up and warm-up included (the runner's
    ``wall_time_s``); for results stored without it, samples times their mean."""
    meta = getattr(rec, "meta", None) or {}
    if "wall_time_s" in meta:
        return float(meta["wall_time_s"])
    stats = getattr(rec, "stats", None) or {}
    return float(stats.get("n", 0) * stats.get("mean", 0.0) * 1e-9)
