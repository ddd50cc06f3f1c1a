"""``dlbricks demo``: the whole job on the nine models shipped with onnx.

analyze -> generate (G=1,2,3) -> bench (bricks and whole models) -> evaluate ->
report, in one work folder, with progress on stderr and the summary on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dlbricks.commands._common import (
    add_graph_arg,
    add_remeasure_arg,
    add_runner_args,
    chosen_graph,
    parse_g_list,
    print_check,
    record_graphs,
    runner_config,
)

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Sequence

    from dlbricks.store import Store
    from dlbricks.timing.config import RunnerConfig



def default_corpus_dir() -> Path:
    """The light model-zoo networks bundled with the onnx package."""
    import onnx

    return Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run the whole job on the nine light models shipped with onnx",
        description="The whole job on the nine light model-zoo networks shipped with onnx (or --models): analyse "
        "them, measure their unique bricks at G=1,2,3 and every model end to end, interleaved, until each model's "
        "latency is known to +/-2% (95% interval) or 60 rounds have run, rebuild each model's latency from its "
        "bricks, draw the roofline, and write report.html, the JSON of each step and the results store into the "
        "work folder. A few minutes on two cores; a rerun on the same folder reuses every stored result.",
    )
    p.add_argument("-o", "--output", "--output-dir", dest="workdir", metavar="DIR",
                   help="work folder, where the report and everything else go (default: a new temporary one)")
    p.add_argument("--models", nargs="+", metavar="PATH", help="other models instead of the bundled ones")
    p.add_argument("-G", default="1,2,3", metavar="LIST", help="granularities (default 1,2,3)")
    p.add_argument("--store", metavar="PATH", help="results store (default: results.sqlite in the work folder)")
    add_remeasure_arg(p)
    add_graph_arg(p)
    p.add_argument("--json", action="store_true", help="print the evaluation as JSON instead of tables")
    add_runner_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dlbricks.analysis import analyze, load_corpus, print_err
    from dlbricks.commands.evaluate import print_excluded, render_evaluation
    from dlbricks.evaluation import evaluate
    from dlbricks.report.html import build_report
    from dlbricks.store import Store
    from dlbricks.timing.sysinfo import system_fingerprint

    t0 = time.perf_counter()
    Gs = parse_g_list(args.G)
    config = runner_config(args)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="dlbricks-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    paths = args.models or [str(default_corpus_dir())]

    def step(text: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    step(f"work folder: {work}")
    loaded = load_corpus(paths, on_warning=print_err)
    for e in loaded.errors:
        print_err(f"skipped {e['error']}")
    models = loaded.models
    step(f"analyze: {len(models)} models")
    analysis = analyze(models, Gs)
    (work / "analysis.json").write_text(json.dumps(analysis, indent=1))
    c = analysis["corpus"]
    step(f"  {c['layers']} layers, {c['unique_layers']} unique ({c['unique_layer_pct']:.1f}%); unique bricks "
         + ", ".join(f"G={G}: {c['sequences'][str(G)]['unique_sequences']}" for G in Gs))

    bricks_models: list = models
    used: Sequence[str] = ["source"] * len(models)
    if chosen_graph(args) == "runtime":
        from dlbricks.loading.runtime_graph import runtime_models_or_sources

        step("runtime graph: optimising every model with onnxruntime")
        bricks_models, used = runtime_models_or_sources(models, config=config, level=args.opt_level,
                                                        on_warning=print_err)
    # Bricks are generated in memory as the measurement engine opens their sessions
    # (`dlbricks generate` writes them to files).

    store_path = Path(args.store) if args.store else work / "results.sqlite"
    with Store(store_path) as store:
        step(f"generate, bench and evaluate (store {store_path}); bricks already measured are reused")
        evaluation = evaluate(
            bricks_models,
            Gs,
            store=store,
            config=config,
            seed=args.seed,
            progress=True,
            e2e_models=models,
            remeasure_unstable=args.remeasure_unstable,
        )
        if evaluation.check is not None:
            print_check(evaluation.check)
        result = evaluation.to_dict()
        print_excluded(result)
        record_graphs(result, {m.path: g for m, g in zip(models, used)})
        result["store"] = str(store_path)
        (work / "evaluation.json").write_text(json.dumps(result, indent=1))
        roofline = None
        if 1 in Gs:
            step("roofline: measuring machine peaks, then bounds and what-ifs from the G=1 bricks")
            roofline = _roofline(bricks_models, store, store_path, config)
            (work / "roofline.json").write_text(json.dumps(roofline, indent=1))
        html = build_report(analysis, result, store=store, fingerprint=system_fingerprint(), models=bricks_models,
                            roofline=roofline, roofline_source=str(work / "roofline.json"))
    report = work / "report.html"
    report.write_text(html, encoding="utf-8")
    step("done")
    if args.json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
    else:
        sys.stdout.write(render_evaluation(result))
        sys.stdout.write(f"\nreport: {report}\nwork folder: {work}  ({time.perf_counter() - t0:.0f} s)\n")
    return 0


def _roofline(models: list, store: Store, store_path: Path, config: RunnerConfig) -> dict:
    """Benanza-style bounds for the corpus from the G=1 results just measured."""
    from dlbricks.roofline import analysis as rl
    from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint

    system_id = fingerprint_id(system_fingerprint())
    peaks = rl.peaks_for_store(store_path, config, system_id=system_id)
    analysis = rl.analyze(models, peaks, store=store, system_id=system_id, config_key=config.key())
    # Per layer: the report draws its own roofline from the layers (and summarises them).
    return rl.to_dict(analysis, headroom=rl.layer_headroom(analysis, top=15), png=rl.plot_roofline(analysis),
                      context={"system_id": system_id, "config_key": config.key()}, per_layer=True)
