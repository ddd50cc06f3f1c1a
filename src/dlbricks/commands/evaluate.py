"""``dlbricks evaluate``: constructed vs end-to-end latency, accuracy and speedup per G."""

from __future__ import annotations

import argparse

from dlbricks.commands._common import (
    add_model_args,
    add_runner_args,
    add_store_arg,
    emit,
    load_models_and_sources,
    open_store,
    parse_g_list,
    positive_int,
    runner_config,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="the paper's experiments: normalized latency and speedup per G")
    add_model_args(p)
    p.add_argument("-G", default="1,2,3", metavar="LIST", help="granularities (default 1,2,3)")
    p.add_argument("--no-measure", action="store_true", help="use only what the store has; error if anything is missing")
    p.add_argument("--runtime-graph", action="store_true", help="decompose the graph onnxruntime executes")
    p.add_argument("-o", "--output-dir", dest="workdir", metavar="DIR", help="keep generated bricks here")
    p.add_argument("--bootstrap", type=positive_int, default=400, help="bootstrap replicates for intervals")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--save", metavar="FILE", help="also write the JSON result to FILE (input of `dlbricks report`)")
    add_store_arg(p)
    add_runner_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from dlbricks.evaluation import evaluate

    Gs = parse_g_list(args.G)
    config = runner_config(args)
    models, sources = load_models_and_sources(args)
    with open_store(args) as store:
        result = evaluate(
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
        )
        result["runtime_graph"] = bool(args.runtime_graph)
        result["store"] = str(store.path)
    if args.save:
        with open(args.save, "w") as fh:
            json.dump(result, fh, indent=1)
    emit(args, render_evaluation(result), result)
    return 0


def render_evaluation(result: dict) -> str:
    """The summary tables: per model and G, then per G."""
    Gs = result["G"]
    lines = []
    head = f"{'model':<22} {'e2e ms':>9}" + "".join(f" {'G=' + str(G) + ' seq/par':>17}" for G in Gs)
    lines.append("normalized latency (constructed / end-to-end)")
    lines.append(head)
    for m in result["models"]:
        cells = []
        for G in Gs:
            g = m["per_g"].get(str(G), {})
            cells.append(f" {g['sequential']['normalized']:>8.3f}/{g['parallel']['normalized']:<8.3f}" if g else " " * 18)
        lines.append(f"{m['name'][:22]:<22} {m['e2e_s'] * 1e3:>9.3f}" + "".join(cells))
    lines.append("")
    lines.append(f"{'G':>3} {'unique bricks':>14} {'geomean norm':>13} {'min':>7} {'max':>7} {'speedup':>9} {'wall-clock speedup':>19}")
    for g in result["per_g"]:
        lines.append(
            f"{g['G']:>3} {g['unique_bricks']:>14} {g['geomean_normalized']:>13.3f} {g['min_normalized']:>7.3f} "
            f"{g['max_normalized']:>7.3f} {g['speedup']:>8.2f}x {g['wallclock_speedup']:>18.2f}x"
        )
    return "\n".join(lines) + "\n"
