"""``dlbricks generate``: write every unique brick at G as a runnable ONNX model."""

from __future__ import annotations

import argparse
import sys

from dlbricks.commands._common import add_graph_arg, add_model_args, emit, positive_int, run_graph


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="write each unique brick as a standalone ONNX model + manifest.json")
    add_model_args(p)
    p.add_argument("-G", type=positive_int, required=True, help="granularity (layers per brick, at most)")
    p.add_argument("-o", "--output", "--output-dir", dest="output_dir", required=True, metavar="DIR",
                   help="folder for the bricks (the command's output)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    add_graph_arg(p)
    p.add_argument("--opt-level", choices=["default", "basic", "extended", "all"], default="default",
                   help="onnxruntime's graph optimisation level for the runtime graph")
    p.add_argument("--no-check", action="store_true", help="skip the full ONNX check of each brick")
    p.add_argument("--json", action="store_true", help="print the manifest summary as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dlbricks.bricks import generate_bricks
    from dlbricks.commands._common import load_models
    from dlbricks.progress import Progress

    models = load_models(args)
    with Progress(sys.stderr.isatty(), "generating") as bar:
        from dlbricks.corpus import Corpus

        bar.set_total(Corpus(models).split(args.G).n_unique)
        infos = generate_bricks(models, args.G, args.output_dir, seed=args.seed, check=not args.no_check, progress=bar)
    summary = {
        "schema_version": 1,
        "G": args.G,
        "output_dir": args.output_dir,
        "models": len(models),
        "graph": run_graph(list(args.graphs.values())),
        "bricks": len(infos),
        "weight_bytes": sum(i.weight_bytes for i in infos),
        "manifest": f"{args.output_dir}/manifest.json",
    }
    text = f"wrote {len(infos)} bricks (G={args.G}) from {len(models)} models to {args.output_dir}/ (manifest.json)\n"
    emit(args, text, summary)
    return 0
