"""``dlbricks construct``: predict each model's latency from its stored brick results."""

from __future__ import annotations

import argparse

from dlbricks.commands._common import (
    add_model_args,
    add_runner_args,
    add_store_arg,
    emit,
    load_models,
    open_store,
    positive_int,
    runner_config,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("construct", help="reconstruct model latency from brick results in the store")
    add_model_args(p)
    p.add_argument("-G", type=positive_int, default=1, help="granularity (default 1)")
    p.add_argument("--mode", choices=["sequential", "parallel"], default="sequential",
                   help="sum of bricks, or the critical path through the graph of bricks")
    p.add_argument("--measure-missing", action="store_true", help="benchmark bricks missing from the store first")
    p.add_argument("--runtime-graph", action="store_true", help="decompose the graph onnxruntime executes")
    p.add_argument("--bootstrap", type=positive_int, default=400, help="bootstrap replicates for the interval")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_store_arg(p)
    add_runner_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dlbricks.pipeline import bench
    from dlbricks.reconstruct import reconstruct
    from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint

    config = runner_config(args)
    models = load_models(args)
    with open_store(args) as store:
        if args.measure_missing:
            bench(models, [args.G], store=store, config=config, seed=args.seed, progress=True)
        system_id = fingerprint_id(system_fingerprint())
        overhead = None
        if config.call_overhead:
            from dlbricks.timing.calibration import call_overhead_ns

            overhead = call_overhead_ns(store, system_id, config.key())
        preds = reconstruct(
            models,
            args.G,
            store=store,
            system_id=system_id,
            config_key=config.key(),
            call_overhead_ns=overhead,
            modes=[args.mode],
            n_boot=args.bootstrap,
            seed=args.seed,
        )
    result = {
        "schema_version": 1,
        "G": args.G,
        "mode": args.mode,
        "config": config.to_dict(),
        "predictions": [p.to_dict() for p in preds],
    }
    lines = [f"{'model':<28} {'bricks':>7} {'unique':>7} {'latency ms':>11}  95% interval (ms)"]
    for p in preds:
        lines.append(
            f"{p.model:<28} {p.bricks:>7} {p.unique_bricks:>7} {p.latency_s * 1e3:>11.3f}  "
            f"[{p.ci_low_s * 1e3:.3f}, {p.ci_high_s * 1e3:.3f}]"
        )
    emit(args, "\n".join(lines) + "\n", result)
    return 0
