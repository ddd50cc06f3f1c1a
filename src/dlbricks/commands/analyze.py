"""``dlbricks analyze``: layers, bricks and dedup statistics of a corpus."""

from __future__ import annotations

import argparse

from dlbricks.commands._common import (
    add_model_args,
    add_output_args,
    emit,
    parse_g_list,
    ray_shapes,
    shape_plan,
    tune_allocator_for_loading,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("analyze", help="decompose models into layers and bricks; dedup statistics")
    add_model_args(p)
    p.add_argument("-G", default="1,2,3", metavar="LIST", help="granularities, e.g. 1,2,3 or 1-5 (default 1,2,3)")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="parse the models as Ray tasks on the cluster at ADDRESS (host:port, auto or local)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="say on stderr which models the fast path left to the full loader, and why")
    add_output_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dlbricks.analysis import analyze, load_corpus, print_err, print_info, render_analysis

    Gs = parse_g_list(args.G)
    plan = shape_plan(args)
    tune_allocator_for_loading()
    if args.ray:
        from dlbricks.distributed import connect, load_corpus_ray

        with connect(args.ray):
            loaded = load_corpus_ray(args.paths, ray_shapes(args), strict=args.strict, on_warning=print_err)
    else:
        loaded = load_corpus(args.paths, strict=args.strict, on_warning=print_err, shapes_for=plan)
        if plan is not None:
            plan.report_unused()
    for e in loaded.errors:
        print_err(f"skipped {e['error']}")
    if args.verbose:
        for line in loaded.fast_path_lines():
            print_info(line)
    result = analyze(loaded.models, Gs)
    result["errors"] = loaded.errors
    result["timing"]["load_s"] = loaded.load_s
    result["timing"].update(loaded.fast_path_report())
    emit(args, None if args.json else render_analysis(result, loaded.errors), result)
    return 0
