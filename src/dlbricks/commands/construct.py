"""``dlbricks construct``: predict each model's latency from its stored brick results."""

from __future__ import annotations

import argparse
import math
from typing import Any, Sequence

from dlbricks.commands._common import (
    SCHEMA_VERSION,
    add_graph_arg,
    add_model_args,
    add_output_args,
    add_runner_args,
    add_store_arg,
    check_precision,
    emit,
    load_models_and_sources,
    model_latencies,
    open_store,
    positive_int,
    run_graph,
    runner_config,
    time_unit,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("construct", help="reconstruct model latency from brick results in the store")
    add_model_args(p)
    p.add_argument("-G", type=positive_int, default=1, help="granularity (default 1)")
    p.add_argument("--mode", choices=["sequential", "parallel"], default="sequential",
                   help="sum of bricks, or the critical path through the graph of bricks")
    p.add_argument("--measure-missing", action="store_true", help="benchmark bricks missing from the store first")
    add_graph_arg(p)
    p.add_argument("--bootstrap", type=positive_int, default=400, help="bootstrap replicates for the interval")
    add_output_args(p)
    add_store_arg(p)
    add_runner_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dlbricks.pipeline import bench
    from dlbricks.reconstruct import reconstruct
    from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint

    config = runner_config(args)
    models, sources = load_models_and_sources(args, config)
    # Read-only unless told to measure: a mistyped --store is an error, not a new empty store.
    with open_store(args, readonly=not args.measure_missing) as store:
        if args.measure_missing:
            bench(models, [args.G], store=store, config=config, seed=args.seed, progress=True)
        system_id = fingerprint_id(system_fingerprint())
        overhead = None
        if config.call_overhead:
            from dlbricks.timing.calibration import call_overhead

            overhead = call_overhead(store, system_id, config.key())
        preds = reconstruct(
            models,
            args.G,
            store=store,
            system_id=system_id,
            config_key=config.key(),
            call_overhead=overhead,
            modes=[args.mode],
            n_boot=args.bootstrap,
            seed=args.seed,
        )
        check = check_precision(models, [args.G], store, system_id, config, sources,
                                rerun="`dlbricks bench --remeasure-unstable` (same models and options) measures them again")
        measured = model_latencies(store, sources, system_id, config.key())
        references = _references(models, sources, args.G, store, system_id, config.key())
    rows = []
    for p, source, e2e, reference in zip(preds, sources, measured, references):
        row: dict[str, Any] = p.to_dict()
        row["path"] = row.get("path") or source.path
        row["graph"] = args.graphs.get(source.path, "source")
        ok = e2e["status"] == "ok"
        row["e2e_s"] = e2e["median_s"] if ok else None
        row["e2e_ci_s"] = [e2e["ci_low_s"], e2e["ci_high_s"]] if ok else None
        # As evaluate divides: by the model's latency in the rounds its bricks were measured in.
        row["e2e_same_rounds_s"] = reference * 1e-9 if ok and reference else None
        row["normalized"] = p.latency_s / row["e2e_same_rounds_s"] if row["e2e_same_rounds_s"] else None
        row["error"] = row["normalized"] - 1.0 if row["normalized"] is not None else None
        row["flags"] = [f for m in check.for_model(p.model) if m.flagged and m.G in (None, args.G)
                        for f in [f"{m.where}: +/-{m.rel_halfwidth:.1%} > +/-{m.precision:.1%}"]]
        row["flagged"] = bool(row["flags"])
        rows.append(row)
    result = {
        "schema_version": SCHEMA_VERSION,
        "G": args.G,
        "mode": args.mode,
        "system_id": system_id,
        "config_key": config.key(),
        "config": config.to_dict(),
        "call_overhead_ns": overhead.ns if overhead else None,
        "call_overhead_se_ns": overhead.se_ns if overhead else None,
        "graph": run_graph([r["graph"] for r in rows]),
        "predictions": rows,
        "precision_check": check.to_dict(),
    }
    emit(args, render_predictions(rows, args.G, args.mode), result)
    return 0


def _references(models: Sequence[Any], sources: Sequence[Any], G: int, store: Any, system_id: str,
                config_key: str) -> list[float | None]:
    """Each model's end-to-end latency (ns) in the rounds its bricks at ``G`` were measured
    in (:func:`dlbricks.evaluation.same_rounds_references`); None without one."""
    from dlbricks.bricks import model_digest
    from dlbricks.corpus import Corpus
    from dlbricks.evaluation import brick_results, same_rounds_references
    from dlbricks.versions import model_digest_version

    sp = Corpus(models).split(G)
    _, bricks, brick_ns = brick_results(sp, store, system_id, config_key)
    digests = [model_digest(s) for s in sources]
    whole = store.get_results("model", digests, model_digest_version(), system_id, config_key)
    refs = same_rounds_references([whole.get(d) for d in digests], bricks, brick_ns, sp.occurrences())
    return [r[0] if r is not None else None for r in refs]


def render_predictions(rows: list[dict[str, Any]], G: int, mode: str) -> str:
    """The prediction table; end-to-end latency and error where the store has the model
    measured end to end; "!" marks a model the precision check flags."""
    scale, unit = time_unit([r["latency_s"] for r in rows] + [r["e2e_s"] for r in rows if r["e2e_s"]])
    width = max([5, *(len(r["model"]) for r in rows)])
    any_e2e = any(r["e2e_s"] for r in rows)
    head = (f"  {'model':<{width}} {'G':>2} {'mode':<10} {'bricks':>6} {'unique':>6} {'predicted ' + unit:>13}  "
            f"{'95% interval (' + unit + ')':<24}")
    if any_e2e:
        head += f" {'end-to-end ' + unit:>14} {'error':>7}"
    lines = [f"latency rebuilt from the bricks in the store (G={G}, {mode})", head]
    for r in rows:
        interval = f"[{r['ci_low_s'] / scale:.3f}, {r['ci_high_s'] / scale:.3f}]"
        line = (f"{'!' if r['flagged'] else ' '} {r['model']:<{width}} {r['G']:>2} {r['mode']:<10} {r['bricks']:>6} "
                f"{r['unique_bricks']:>6} {r['latency_s'] / scale:>13.3f}  {interval:<24}")
        if any_e2e:
            if r["e2e_s"]:
                err = r["error"]
                line += f" {r['e2e_s'] / scale:>14.3f} {err:>+7.1%}" if err is not None and math.isfinite(err) else ""
            else:
                line += f" {'-':>14} {'-':>7}"
        if r["flags"]:
            line += "  " + "; ".join(r["flags"])
        lines.append(line)
    if not any_e2e:
        lines.append("(no end-to-end result in the store: `dlbricks bench --e2e` measures the models to compare)")
    else:
        lines.append("(error: against the model's latency in the rounds its bricks were measured in, as `evaluate` "
                     "compares; e2e_same_rounds_s in --json)")
    return "\n".join(lines) + "\n"
