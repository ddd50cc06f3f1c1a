"""``dlbricks roofline``: layers and models against their roofline lower bounds, with
headroom ranking and what-if scenarios (see :mod:`dlbricks.roofline.analysis`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dlbricks.commands._common import (
    add_graph_arg,
    add_model_args,
    add_output_args,
    add_runner_args,
    add_store_arg,
    emit,
    load_models_and_sources,
    parse_g_list,
    positive_int,
    require_store,
    run_graph,
    runner_config,
    warn,
)
from dlbricks.errors import DlbricksError, UsageError

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.model import Model
    from dlbricks.roofline.results import RooflineAnalysis
    from dlbricks.store import Store
    from dlbricks.timing import RunnerConfig

_GRAPH_WORDS = {"runtime": "the graphs onnxruntime executes", "source": "the models' own graphs",
                "mixed": "runtime graphs; some models' source graphs"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "roofline",
        help="roofline lower bounds, efficiency, headroom and what-if scenarios",
        description=(
            "Per layer: roofline bound max(FLOPs/peak, bytes/bandwidth), arithmetic intensity, "
            "measured time (its G=1 brick's median) and efficiency = bound/measured. Per model: ideal "
            "latency (sequential and critical path) against measured. The layers are those of the graph "
            "bench cuts (--graph, the same default), so its results are the ones read. Peaks are measured "
            "once per system and thread count and cached in a 'peaks' folder next to the store."
        ),
    )
    add_model_args(p)
    add_store_arg(p)
    add_output_args(p)
    p.add_argument("--plot", metavar="PNG", help="draw the roofline plot to this PNG file")
    p.add_argument("--no-plot", action="store_true", help="do not embed the plot in --json output")
    p.add_argument("--no-measure", action="store_true", help="never benchmark bricks or models: use only what the store has (peaks are "
                        "still measured once when none are cached)")
    p.add_argument("--e2e", action="store_true", help="also time whole models end to end when the store lacks them")
    p.add_argument("--batch", type=positive_int, metavar="N",
                   help="what-if: inputs' leading dim set to N (bricks regenerated and measured at N)")
    p.add_argument("-G", dest="gs", metavar="LIST", help="also rank unique bricks at these granularities, e.g. 2,3")
    p.add_argument("--top", type=positive_int, default=15, metavar="N", help="headroom entries shown (default 15)")
    p.add_argument("--noise", type=float, default=0.05, metavar="F",
                   help="relative noise before a layer beating its bound is flagged (default 0.05)")
    p.add_argument("--peaks", metavar="JSON", help="use these peaks (a Peaks JSON) instead of the cached ones")
    p.add_argument("--quick-peaks", action="store_true", help="a quick peaks measurement when none is cached")
    add_graph_arg(p)
    add_runner_args(p)
    p.set_defaults(func=run)


def _load_peaks(path: str):
    from dlbricks.roofline.peaks import Peaks

    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"--peaks {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise DlbricksError(f"--peaks {path}: not a peaks file: {exc}") from None
    if not isinstance(doc, dict):
        raise DlbricksError(f"--peaks {path}: not a peaks file (a JSON object, as `roofline --json` has under \"peaks\")")
    try:
        return Peaks.from_dict(doc)
    except KeyError as exc:
        raise DlbricksError(f"--peaks {path}: not a peaks file (no {exc})") from None
    except (ValueError, TypeError) as exc:
        raise DlbricksError(f"--peaks {path}: not a peaks file: {exc}") from None


def run(args: argparse.Namespace) -> int:
    import onnxruntime

    from dlbricks import __version__
    from dlbricks.pipeline import bench
    from dlbricks.roofline import analysis as rl
    from dlbricks.store import Store, default_store_path
    from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint

    if not args.noise >= 0:
        raise UsageError(f"--noise must be >= 0, got {args.noise}")
    gs = [g for g in parse_g_list(args.gs) if g > 1] if args.gs else []
    config = runner_config(args)
    # The graph bench cuts, optimised with the same session options: the layers' G=1
    # bricks are then the ones bench stored.
    models, sources = load_models_and_sources(args, config)
    if not models:
        raise DlbricksError("no model could be loaded")
    graphs = [args.graphs.get(s.path, "source") for s in sources]
    rl.check_models(models)
    store_path = Path(args.store) if args.store else default_store_path()
    system_id = fingerprint_id(system_fingerprint())
    config_key = config.key()
    progress = sys.stderr.isatty()

    # The peaks file first: its errors name the option, whatever the store.
    given_peaks = _load_peaks(args.peaks) if args.peaks else None
    store: Store | None
    if args.no_measure and args.store is not None and not store_path.exists():
        require_store(args.store)  # a --store that is not there: the user's error, as for every reader
    if args.no_measure and not store_path.exists():
        warn(f"no store at {store_path}: bounds only, nothing measured")
        store = None
    else:
        store = Store(store_path, readonly=args.no_measure)
    try:
        if given_peaks is not None:
            peaks = given_peaks
            peaks_source = str(args.peaks)
        else:
            try:
                peaks = rl.peaks_for_store(store_path, config, quick=args.quick_peaks, system_id=system_id)
            except ValueError as exc:
                raise UsageError(f"peaks: {exc}") from None
            except OSError as exc:
                raise DlbricksError(f"peaks cache {rl.peaks_dir(store_path)}: {exc}") from None
            peaks_source = str(rl.peaks_dir(store_path))
        if store is not None and not args.no_measure:
            summary = bench(models, sorted({1, *gs}), store=store, config=config, e2e=args.e2e,
                            seed=args.seed, progress=progress, e2e_models=sources)
            for f in summary.failures:
                warn(f"{f['kind']} {f['digest'][:12]} failed: {f['error']}")
        try:
            analysis = rl.analyze(models, peaks, store=store, system_id=system_id, config_key=config_key,
                                  noise=args.noise)
        except ValueError as exc:
            raise DlbricksError(str(exc)) from None
        _as_sources(analysis, sources, store=store, system_id=system_id, config_key=config_key)
        if args.batch is not None:
            rl.batch_what_if([s for s, g in zip(sources, graphs) if g == "source"], args.batch, analysis,
                             store=store, system_id=system_id, config_key=config_key, config=config,
                             measure=not args.no_measure, seed=args.seed, progress=progress)
            rl.batch_what_if([s for s, g in zip(sources, graphs) if g == "runtime"], args.batch, analysis,
                             store=store, system_id=system_id, config_key=config_key, config=config,
                             measure=not args.no_measure, seed=args.seed, progress=progress,
                             rebatched=lambda m, b: _runtime_rebatched(m, b, config))
        headroom = rl.layer_headroom(analysis, top=args.top)
        bricks = {}
        if store is not None:
            bricks = {g: rl.brick_headroom(models, analysis, g, store=store, system_id=system_id,
                                           config_key=config_key, top=args.top) for g in gs}
    finally:
        if store is not None:
            store.close()

    png = None
    if args.plot or (args.json and not args.no_plot):
        png = rl.plot_roofline(analysis, args.plot)
        if args.plot:
            print(f"wrote {args.plot}", file=sys.stderr)
    missing = sum(m.layers_missing for m in analysis.models)
    if missing:
        warn(f"{missing} layer(s) have no measurement" + (" (--no-measure)" if args.no_measure else ""))
    if args.json:
        context = {
            "dlbricks": __version__, "onnxruntime": onnxruntime.__version__, "cpu_count": os.cpu_count(),
            "threads": config.intra_op_threads, "system_id": system_id, "config_key": config_key,
            "config": config.to_dict(), "store": str(store_path), "peaks_source": peaks_source,
        }
        obj = rl.to_dict(analysis, headroom=headroom, brick_headroom_by_g=bricks,
                         png=None if args.no_plot else png, context=context)
        # Which graph the layers are (as evaluate says it): per model and for the run.
        obj["graph"] = run_graph(graphs)
        for m, g in zip(obj["models"], graphs):
            m["graph"] = g
        emit(args, None, obj)
    else:
        emit(args, _graph_line(analysis, graphs) + rl.format_text(analysis, headroom, bricks), None)
    return 0


def _graph_line(analysis: RooflineAnalysis, graphs: Sequence[str]) -> str:
    """The text's first line: which graphs' layers the tables are."""
    graph = run_graph(graphs)
    line = f"layers of {_GRAPH_WORDS[graph]} (--graph {'runtime' if graph == 'mixed' else graph})"
    if graph == "mixed":
        line += "; source graphs: " + ", ".join(m.name for m, g in zip(analysis.models, graphs) if g == "source")
    return line + "\n"


def _as_sources(analysis: RooflineAnalysis, sources: Sequence[Model], *, store: Store | None,
                system_id: str, config_key: str) -> None:
    """Each model of ``analysis`` as its source model: its file, and the end-to-end
    result bench stores under the source model's digest. A runtime graph has no file and
    another digest, but timing the source model end to end runs that very graph."""
    from dlbricks.bricks import model_digest
    from dlbricks.versions import model_digest_version

    for mr, src in zip(analysis.models, sources):
        mr.path = src.path
        if store is None or mr.measured_source == "end_to_end":
            continue
        rec = store.get_result("model", model_digest(src), model_digest_version(), system_id, config_key)
        if rec is not None and rec.ok and rec.median_ns:
            mr.measured_s, mr.measured_source = rec.median_ns * 1e-9, "end_to_end"


def _runtime_rebatched(source: Model, batch: int, config: RunnerConfig) -> Model:
    """The runtime graph of a source model re-batched (:func:`~dlbricks.roofline.analysis.rebatch`,
    which names a pinned batch): a runtime graph has no file to re-batch from."""
    from dlbricks.loading.runtime_graph import runtime_models
    from dlbricks.roofline import analysis as rl

    again = rl.rebatch(source, batch)
    shapes = {name: t.shape for name, t in again.inputs if t.shape}
    return runtime_models([again], config=config, input_shapes=shapes)[0]
