"""``dlbricks evaluate``: constructed vs end-to-end latency, accuracy and speedup per G."""

from __future__ import annotations

import argparse
from typing import Any, Mapping

from dlbricks.analysis import print_err
from dlbricks.commands._common import (
    add_attribution_arg,
    add_bricks_dir_arg,
    add_graph_arg,
    add_model_args,
    add_output_args,
    add_remeasure_arg,
    add_runner_args,
    add_store_arg,
    emit,
    load_models_and_sources,
    open_store,
    parse_g_list,
    positive_int,
    print_check,
    record_graphs,
    runner_config,
    time_unit,
)
from dlbricks.errors import UsageError
from dlbricks.files import write_atomically


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="the paper's experiments: normalized latency and speedup per G")
    add_model_args(p)
    p.add_argument("-G", default="1,2,3", metavar="LIST", help="granularities (default 1,2,3)")
    p.add_argument("--no-measure", action="store_true", help="use only what the store has; error if anything is missing")
    add_remeasure_arg(p)
    add_graph_arg(p)
    add_attribution_arg(p)
    add_bricks_dir_arg(p)
    p.add_argument("--bootstrap", type=positive_int, default=400, help="bootstrap replicates for intervals")
    add_output_args(p)
    p.add_argument("--save", metavar="FILE", help="also write the JSON result to FILE (input of `dlbricks report`)")
    add_store_arg(p)
    add_runner_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from dlbricks.evaluation import AttributionUnavailable, evaluate

    if args.attribution and getattr(args, "ray", None):
        raise UsageError("--attribution does not apply with --ray: its variants are measured on this machine")
    Gs = parse_g_list(args.G)
    config = runner_config(args)
    models, sources = load_models_and_sources(args, config)
    # --no-measure only reads: a mistyped --store is an error, not a new empty store.
    with open_store(args, must_exist=args.no_measure) as store:
        try:
            evaluation = evaluate(
                models,
                Gs,
                store=store,
                config=config,
                measure_missing=not args.no_measure,
                workdir=args.workdir,
                seed=args.seed,
                progress=True,
                n_boot=args.bootstrap,
                e2e_models=sources,
                remeasure_unstable=args.remeasure_unstable,
                attribution=args.attribution,
            )
        except AttributionUnavailable as exc:
            raise UsageError(f"--attribution: {exc}") from None
    result = evaluation.to_dict()
    record_graphs(result, args.graphs)
    result["store"] = str(store.path)
    if evaluation.check is not None:
        print_check(evaluation.check)
    print_excluded(result)
    if args.save:
        write_atomically(args.save, json.dumps(result, indent=1) + "\n")
    emit(args, render_evaluation(result), result)
    return 0


def print_excluded(result: Mapping[str, Any]) -> None:
    """Warn of each model the evaluation left out, and why, and of a busy machine."""
    for e in result.get("excluded", []):
        print_err(f"left out {e['name']}: {e['error']}")
    from dlbricks.timing.hostload import busy_warning

    busy = busy_warning(result.get("host"))
    if busy is not None:
        print_err(busy)


def render_evaluation(result: Mapping[str, Any]) -> str:
    """The summary tables: accuracy and cost per G first, then per model and G ("!"
    marks a model the precision check flags)."""
    Gs = result["G"]
    lines = [
        "accuracy and cost per G (normalized = constructed / end-to-end latency)",
        f"{'G':>3} {'within 5%':>9} {'within 10%':>10} {'RMSPE':>7} {'geomean':>8} {'min':>7} {'max':>7} "
        f"{'unique bricks':>13} {'wall-clock speedup':>18} {'paper speedup':>13}",
    ]
    for g in result["per_g"]:
        lines.append(
            f"{g['G']:>3} {g.get('within_5pct', float('nan')):>9.0%} {g.get('within_10pct', float('nan')):>10.0%} "
            f"{g.get('rmspe', float('nan')):>7.3f} {g['geomean_normalized']:>8.3f} {g['min_normalized']:>7.3f} "
            f"{g['max_normalized']:>7.3f} {g['unique_bricks']:>13} {g['wallclock_speedup']:>17.2f}x {g['speedup']:>12.2f}x"
        )
    lines.append("  wall-clock speedup: seconds measuring every model end to end / seconds measuring the unique bricks;")
    lines.append("  paper speedup: sum of end-to-end latencies / sum of unique brick latencies")
    lines.append("")
    width = max([5, *(len(m["name"]) for m in result["models"])])
    scale, unit = time_unit([m["e2e_s"] for m in result["models"]])
    head = f"  {'model':<{width}} {'e2e ' + unit:>9}" + "".join(f" {'G=' + str(G) + ' seq/par':>17}" for G in Gs)
    graph = {"runtime": "the graphs onnxruntime executes", "source": "the models' own graphs",
             "mixed": "runtime graphs; some models' source graphs"}.get(result.get("graph", ""), "")
    lines.append("normalized latency per model (constructed / end-to-end, the model's latency in the rounds its "
                 "bricks were measured in)" + (f"; bricks cut from {graph}" if graph else ""))
    lines.append(head)
    for m in result["models"]:
        cells = []
        for G in Gs:
            g = m["per_g"].get(str(G), {})
            cells.append(f" {g['sequential']['normalized']:>8.3f}/{g['parallel']['normalized']:<8.3f}" if g else " " * 18)
        mark = "!" if m.get("flagged") else " "
        flags = ("  " + "; ".join(m["flags"])) if m.get("flags") else ""
        if result.get("graph") == "mixed" and m.get("graph") == "source":
            flags += "  (cut from its source graph)"
        lines.append(f"{mark} {m['name']:<{width}} {m['e2e_s'] / scale:>9.3f}" + "".join(cells) + flags)
    for e in result.get("excluded", []):
        lines.append(f"! {e['name']:<{width}} left out: {e['error']}")
    if result.get("attribution"):
        lines += ["", *render_attribution(result["attribution"])]
    reuse = result.get("reuse") or {}
    if reuse.get("bricks_total") is not None:
        lines.append("")
        lines.append(
            f"reused from the store: {reuse.get('bricks_reused')} of {reuse.get('bricks_total')} unique bricks, "
            f"{reuse.get('models_reused')} of {reuse.get('models_total')} models"
        )
    return "\n".join(lines) + "\n"


def render_attribution(att: Mapping[str, Any]) -> list[str]:
    """The attribution table: per model, the normalized latency after each step (each
    adds one correction to the one before; the last is the evaluation itself)."""
    from dlbricks.evaluation import ATTRIBUTION_HEADS

    steps = list(att["steps"])
    labels = att.get("labels") or {}
    heads = [ATTRIBUTION_HEADS.get(s, s) for s in steps]
    width = max([5, *(len(m["name"]) for m in att["models"])])
    col = max([10, *(len(h) for h in heads)])
    lines = [f"where each model's error comes from at G={att['G']} (normalized latency after each step; "
             "one end-to-end latency per model)"]
    lines += [f"  {h}: {labels.get(s, s)}" for s, h in zip(steps, heads)]
    lines.append(f"  {'model':<{width}}" + "".join(f" {h:>{col}}" for h in heads))
    for m in att["models"]:
        lines.append(f"  {m['name']:<{width}}" + "".join(f" {v:>{col}.3f}" for v in m["normalized"]))
    reuse = att.get("reuse") or {}
    if reuse.get("bricks_total"):
        lines.append(f"  warm-cache variants: {reuse.get('bricks_reused')} of {reuse.get('bricks_total')} unique "
                     f"bricks reused from the store, {reuse.get('bricks_measured')} measured")
    return lines
