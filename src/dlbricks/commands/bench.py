"""``dlbricks bench``: time the unique bricks (and whole models) not yet in the store."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dlbricks.commands._common import (
    SCHEMA_VERSION,
    add_bricks_dir_arg,
    add_graph_arg,
    add_model_args,
    add_output_args,
    add_remeasure_arg,
    add_runner_args,
    add_store_arg,
    check_precision,
    emit,
    flagged_for_remeasure,
    load_models_and_sources,
    model_latencies,
    open_store,
    parse_g_list,
    positive_int,
    print_check,
    ray_shapes,
    render_latencies,
    runner_config,
    warn,
)
from dlbricks.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.pipeline import BenchSummary
    from dlbricks.quality import Assessment
    from dlbricks.timing import RunnerConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark unique bricks (and --e2e whole models); results go to the store")
    add_model_args(p)
    p.add_argument("-G", default="1", metavar="LIST", help="granularities, e.g. 1 or 1,2,3 (default 1)")
    p.add_argument("--e2e", action="store_true", help="also time every whole model end to end")
    p.add_argument("--force", action="store_true", help="re-measure what the store already has")
    add_remeasure_arg(p)
    p.add_argument("--jobs", type=positive_int, default=1, help="timing workers at once, each on its own core (default 1)")
    add_bricks_dir_arg(p)
    add_graph_arg(p, ray=True)
    add_output_args(p)
    add_store_arg(p)
    add_runner_args(p)
    g = p.add_argument_group("ray (pip install 'dlbricks[ray]')")
    g.add_argument("--ray", metavar="ADDRESS",
                   help="time the bricks on the Ray cluster at ADDRESS (host:port, auto or local): one brick at a time "
                        "on every node offering the dlbricks_timing_slot resource; results per system kind")
    g.add_argument("--ray-resources", metavar="JSON", default=None,
                   help='only nodes offering these Ray resources time, e.g. \'{"avx512": 1}\'')
    g.add_argument("--ray-label", action="append", default=[], metavar="KEY=VALUE",
                   help="only nodes with this Ray node label time (repeatable)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dlbricks.pipeline import bench
    from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint

    Gs = parse_g_list(args.G)
    config = runner_config(args, jobs=args.jobs)
    if args.ray:
        return _run_ray(args, Gs, config)
    if args.ray_resources is not None or args.ray_label:
        raise UsageError(f"{'--ray-resources' if args.ray_resources is not None else '--ray-label'} applies only "
                         "with --ray ADDRESS")
    models, sources = load_models_and_sources(args, config)
    e2e_models = sources if args.e2e else None
    with open_store(args) as store:
        system_id = fingerprint_id(system_fingerprint())
        remeasure = flagged_for_remeasure(args, models, Gs, store, system_id, config, e2e_models)
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
            e2e_models=sources,
            remeasure=remeasure,
        )
        check = check_precision(models, Gs, store, summary.system_id, config, e2e_models)
        latencies = model_latencies(store, sources, summary.system_id, summary.config_key, check) if args.e2e else []
    return _report(args, summary, store.path, Gs, config, check=check, latencies=latencies)


def _report(
    args: argparse.Namespace,
    summary: BenchSummary,
    store_path: Path,
    Gs: list[int],
    config: RunnerConfig,
    details: str = "",
    *,
    check: Assessment | None = None,
    latencies: list[dict] | None = None,
    latency_table: bool = True,
) -> int:
    """Emit a bench summary (local, or Ray's with its per-system ``details``) as text or
    JSON; returns the exit code. ``latencies`` are the JSON's ``models``, and printed
    unless not ``latency_table`` (a Ray run over several system kinds prints each
    kind's table in ``details``)."""
    out = {"schema_version": SCHEMA_VERSION, **summary.to_dict()}
    out["store"] = str(store_path)
    out["G"] = Gs
    out["config"] = config.to_dict()
    if check is not None:
        out["precision_check"] = check.to_dict()
    if latencies:
        out["models"] = latencies
    text = (
        f"bricks: {summary.bricks_total} unique, {summary.bricks_reused} reused from the store, "
        f"{summary.bricks_measured} measured, {summary.bricks_failed} failed\n"
    )
    if args.e2e:
        text += (
            f"models: {summary.models_total}, {summary.models_reused} reused, "
            f"{summary.models_measured} measured, {summary.models_failed} failed\n"
        )
    if latencies and latency_table:
        text += render_latencies(latencies)
    text += details + f"store: {out['store']}  ({summary.wall_s:.1f} s)\n"
    emit(args, text, out)
    return 1 if summary.bricks_failed or summary.models_failed else 0


def _run_ray(args: argparse.Namespace, Gs: list[int], config: RunnerConfig) -> int:
    from dlbricks.analysis import print_err
    from dlbricks.distributed import bench_on_ray, connect, load_corpus_ray
    from dlbricks.quality import assess

    if args.graph == "runtime":
        # A runtime graph is specific to a machine's onnxruntime and CPU (its layouts,
        # e.g. the NCHWc block size), and nodes may differ: Ray cuts the source graph.
        raise UsageError("--graph runtime cannot be combined with --ray: the nodes decompose the source graph")
    if args.jobs != 1:
        raise UsageError("--jobs does not apply with --ray: each node times one brick at a time")
    if args.workdir:
        raise UsageError("--bricks-dir does not apply with --ray: bricks are generated on the nodes")
    try:
        resources = json.loads(args.ray_resources) if args.ray_resources else {}
        if not isinstance(resources, dict) or not all(isinstance(v, (int, float)) for v in resources.values()):
            raise ValueError
    except ValueError:
        raise UsageError(f"--ray-resources {args.ray_resources!r}: expected a JSON object of numbers") from None
    labels = {}
    for item in args.ray_label:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--ray-label {item!r}: expected KEY=VALUE")
        labels[key] = value
    shapes = ray_shapes(args)
    with connect(args.ray), open_store(args) as store:
        loaded = load_corpus_ray(args.paths, shapes, strict=args.strict, on_warning=print_err)
        for e in loaded.errors:
            print_err(f"skipped {e['error']}")
        models = loaded.models
        e2e_models = models if args.e2e else None
        summary = bench_on_ray(
            models,
            Gs,
            store=store,
            config=config,
            force=args.force,
            e2e=args.e2e,
            seed=args.seed,
            resources=resources,
            labels=labels,
            progress=sys.stderr.isatty(),
            on_event=warn,
            # Each system kind's own results are checked, when its first node reports.
            remeasure=(lambda sid: flagged_for_remeasure(args, models, Gs, store, sid, config, e2e_models))
            if args.remeasure_unstable else None,
        )
        # The precision check of each system kind's results, as after a local bench
        # (with several kinds, each kind's warnings under its name).
        checks = {}
        for sid, per in summary.systems.items():
            if len(summary.systems) == 1:
                checks[sid] = check_precision(models, Gs, store, sid, config, e2e_models)
                continue
            checks[sid] = check = assess(models, Gs, store=store, system_id=sid, config_key=config.key(),
                                         precision=config.precision, e2e_models=e2e_models)
            if not check.ok:
                warn(f"system {sid} ({per['cpu']}):")
            print_check(check)
        # Each system kind's end-to-end latencies, as a local bench --e2e reports them.
        latencies = {sid: model_latencies(store, models, sid, summary.config_key, checks[sid])
                     for sid in summary.systems} if args.e2e else {}
    several = len(summary.systems) > 1
    details = ""
    for sid, per in summary.systems.items():
        details += (
            f"system {sid} ({per['cpu']}): {per['nodes']} node(s), {per.get('bricks_measured', 0)} measured, "
            f"{per.get('bricks_reused', 0)} reused, {per.get('bricks_failed', 0)} failed\n"
        )
        per["precision_check"] = checks[sid].to_dict()
        if sid in latencies:
            per["models"] = latencies[sid]
            if several and latencies[sid]:
                details += render_latencies(latencies[sid])
    if summary.nodes_lost:
        details += f"nodes lost: {summary.nodes_lost}, bricks retried: {summary.retries}, not measured: {summary.lost}\n"
    return _report(args, summary, store.path, Gs, config, details, check=checks.get(summary.system_id),
                   latencies=latencies.get(summary.system_id), latency_table=not several)
