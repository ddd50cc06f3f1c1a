"""``dlbricks bench``: time the unique bricks (and whole models) not yet in the store."""

from __future__ import annotations

import argparse
import sys

from dlbricks.commands._common import (
    add_model_args,
    add_runner_args,
    add_store_arg,
    emit,
    load_models,
    open_store,
    parse_g_list,
    positive_int,
    runner_config,
    warn,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark unique bricks (and --e2e whole models); results go to the store")
    add_model_args(p)
    p.add_argument("-G", default="1", metavar="LIST", help="granularities, e.g. 1 or 1,2,3 (default 1)")
    p.add_argument("--e2e", action="store_true", help="also time every whole model end to end")
    p.add_argument("--force", action="store_true", help="re-measure what the store already has")
    p.add_argument("--jobs", type=positive_int, default=1, help="timing workers at once, each on its own core (default 1)")
    p.add_argument("-o", "--output-dir", dest="workdir", metavar="DIR", help="keep generated bricks here (default: temporary)")
    p.add_argument("--runtime-graph", action="store_true", help="decompose the graph onnxruntime executes")
    p.add_argument("--json", action="store_true", help="print a machine summary")
    add_store_arg(p)
    add_runner_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dlbricks.pipeline import bench

    Gs = parse_g_list(args.G)
    config = runner_config(args, jobs=args.jobs)
    models = load_models(args)
    e2e_models = None
    if args.runtime_graph and args.e2e:
        from dlbricks.analysis import load_corpus

        e2e_models = load_corpus(args.paths, strict=args.strict).models
    with open_store(args) as store:
        summary = bench(
            models,
            Gs,
            store=store,
            config=config,
            workdir=args.workdir,
            force=args.force,
            e2e=args.e2e,
            jobs=args.jobs,
            seed=args.seed,
            progress=True,
            on_event=warn,
            e2e_models=e2e_models,
        )
        out = summary.to_dict()
        out["store"] = str(store.path)
        out["G"] = Gs
        out["config"] = config.to_dict()
    text = (
        f"bricks: {summary.bricks_total} unique, {summary.bricks_reused} reused from the store, "
        f"{summary.bricks_measured} measured, {summary.bricks_failed} failed\n"
    )
    if args.e2e:
        text += (
            f"models: {summary.models_total}, {summary.models_reused} reused, "
            f"{summary.models_measured} measured, {summary.models_failed} failed\n"
        )
    text += f"store: {out['store']}  ({summary.wall_s:.1f} s)\n"
    emit(args, text, out)
    return 1 if summary.bricks_failed or summary.models_failed else 0
