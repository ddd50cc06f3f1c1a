"""The paper's experiments: constructed against end-to-end latency, and speedups, per G.

:func:`evaluate` measures what the store lacks (through :func:`dlbricks.pipeline.bench`),
then compares each model's latency rebuilt from its bricks
(:mod:`dlbricks.reconstruct`) with its end-to-end latency.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from dlbricks.corpus import Corpus
from dlbricks.errors import DlbricksError
from dlbricks.model import distinct_names, layer_kinds
from dlbricks.reconstruct import geomean, predict
from dlbricks.timing.calibration import call_overhead_ns
from dlbricks.versions import brick_digest_version, model_digest_version

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.model import Model
    from dlbricks.store import ResultRecord, Store
    from dlbricks.timing.config import RunnerConfig

__all__ = ["evaluate"]


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
) -> dict:
    """The paper's experiments: constructed vs end-to-end latency and speedups per G.

    Measures what is missing first (bricks and whole models), then reports per model
    and G the end-to-end latency, the sequential and parallel constructed latencies,
    normalized latency (constructed / end-to-end) with its interval; per G the
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

    Returns:
        the JSON-ready result (schema in README).

    Raises:
        DlbricksError: ``e2e_models`` does not pair with ``models``; a result is missing
            without ``measure_missing``.
    """
    from dlbricks.bricks import model_digest
    from dlbricks.pipeline import bench
    from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint

    sources = list(e2e_models) if e2e_models is not None else list(models)
    if len(sources) != len(models):
        raise DlbricksError(f"{len(models)} models but {len(sources)} end-to-end models: give one per model")
    paths = [m.path if m.path is not None else s.path for m, s in zip(models, sources)]
    names = distinct_names([m.name for m in models], paths)
    if measure_missing:
        bench(models, Gs, store=store, config=config, workdir=workdir, e2e=True, seed=seed, progress=progress,
              e2e_models=sources, brick_dirs=brick_dirs)
    system_id = fingerprint_id(system_fingerprint())
    config_key = config.key()
    mver = model_digest_version()
    bver = brick_digest_version()
    corpus = Corpus(models)

    e2e: list[ResultRecord] = []
    missing_models = []
    for name, source in zip(names, sources):
        rec = store.get_result("model", model_digest(source), mver, system_id, config_key)
        if rec is None or not rec.ok:
            missing_models.append(name)
        e2e.append(rec)  # type: ignore[arg-type]  # None only when reported just below
    if missing_models:
        raise DlbricksError(
            f"no end-to-end result for {len(missing_models)} model(s) ({', '.join(missing_models[:5])}); "
            "run `dlbricks bench --e2e` first or drop --no-measure"
        )
    e2e_s = [rec.median_ns * 1e-9 for rec in e2e]

    rows: list[dict[str, Any]] = [
        {"name": names[i], "path": paths[i], "layers": m.n_layers, "per_g": {}} for i, m in enumerate(models)
    ]
    per_g = []
    bricks_out: list[dict] = []
    overhead = call_overhead_ns(store, system_id, config_key) if config.call_overhead else None
    e2e_total = sum(e2e_s)
    e2e_wall = sum(_wall_s(rec) for rec in e2e)
    # Kinds without building Layer objects: a fast-loaded model has them already.
    kinds = [layer_kinds(m.layers) for m in models]
    for G in Gs:
        per_model = predict(models, G, store=store, system_id=system_id, config_key=config_key,
                            n_boot=n_boot, seed=seed, corpus=corpus, names=names, call_overhead_ns=overhead)
        norm_seq, norm_par, pred_seq = [], [], []
        for i, preds in enumerate(per_model):
            e = e2e_s[i]
            e_rel = _relative_halfwidth(e2e[i])
            entry = rows[i]["per_g"].setdefault(str(G), {"e2e_s": e})
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
        sp = corpus.split(G)
        unique = [bytes(d).hex() for d in sp.unique_digests]
        recs = [store.get_result("brick", d, bver, system_id, config_key) for d in unique]
        occurrences = sp.occurrences().sum(axis=0)
        for u, (d, rec) in enumerate(zip(unique, recs)):
            m, members = sp.first_occurrence(u)
            median_s = rec.median_ns * 1e-9  # type: ignore[union-attr]  # predict checked every brick
            bricks_out.append({
                "G": G,
                "digest": d,
                "occurrences": int(occurrences[u]),
                "median_s": median_s,
                "ci_low_s": rec.stats["ci_low"] * 1e-9,  # type: ignore[union-attr,index]
                "ci_high_s": rec.stats["ci_high"] * 1e-9,  # type: ignore[union-attr,index]
                "op_types": [kinds[m][i] for i in members],
                "contribution_s": median_s * int(occurrences[u]),
            })
        brick_total = sum(r.median_ns for r in recs) * 1e-9  # type: ignore[union-attr]
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
    for r, rec, e in zip(rows, e2e, e2e_s):
        r["e2e_s"] = e
        r["e2e_ci_s"] = [rec.stats["ci_low"] * 1e-9, rec.stats["ci_high"] * 1e-9]  # type: ignore[index]
        g1 = r["per_g"].get("1")
        if g1:  # the paper's Section 2: layer latencies summed, and along the critical path
            r["layer_sum_s"] = g1["sequential"]["latency_s"]
            r["layer_critical_path_s"] = g1["parallel"]["latency_s"]
    return {
        "schema_version": 1,
        "system_id": system_id,
        "config_key": config_key,
        "config": config.to_dict(),
        "G": list(Gs),
        "call_overhead_ns": overhead,
        "per_g": per_g,
        "models": rows,
        "bricks": bricks_out,
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
