"""``dlbricks report``: one self-contained HTML file of an analysis, an evaluation and a store."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Mapping

from dlbricks.commands._common import (
    add_model_args,
    add_store_arg,
    graph_models,
    parse_g_list,
    require_store,
    shape_plan,
)
from dlbricks.errors import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="one self-contained HTML report (figures embedded, viewable offline)",
        description="Render the analysis, the evaluation and the results store as one HTML file. "
        "Model PATHs are optional: with them the report analyses the corpus itself (unless --analysis is "
        "given) and ranks bricks by the time they add to the corpus (median x occurrences).",
    )
    add_model_args(p, nargs="*")
    add_store_arg(p)
    p.add_argument("--analysis", metavar="FILE", help="JSON of `dlbricks analyze --json`")
    p.add_argument("--evaluation", metavar="FILE", help="JSON of `dlbricks evaluate --save FILE`")
    p.add_argument("--roofline", metavar="FILE", help="JSON of `dlbricks roofline --json`")
    p.add_argument("-G", default="1,2,3", metavar="LIST",
                   help="granularities when analysing PATHs without an evaluation (default 1,2,3)")
    p.add_argument("--title", default="dlbricks report", help="page title")
    p.add_argument("-o", "--output", default="report.html", metavar="FILE", help="the HTML file (default report.html)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dlbricks.report.html import build_report, write_report

    parse_g_list(args.G)  # checked even where no PATH needs it: a typo is not ignored
    analysis = _read_json(args.analysis, "--analysis", {"models": list, "corpus": dict})
    evaluation = _read_json(args.evaluation, "--evaluation", {"per_g": list, "models": list})
    roofline = _read_json(args.roofline, "--roofline", {"peaks": dict, "models": list})
    models = None
    if args.paths:
        analysis, models = _from_models(args, analysis, evaluation)
    store_path = _store_path(args.store, evaluation)
    if store_path is None and analysis is None and evaluation is None:
        raise UsageError("nothing to report: give --store, --analysis, --evaluation or model PATHs")
    store = None
    if store_path is not None:
        from dlbricks.store import Store

        store = Store(store_path, readonly=True)
    try:
        html = build_report(analysis, evaluation, store=store, roofline=roofline, models=models, title=args.title,
                            roofline_source=args.roofline)
    finally:
        if store is not None:
            store.close()
    if args.output == "-":
        sys.stdout.write(html)
        return 0
    path = write_report(html, args.output)
    print(path)
    return 0


def _read_json(path: str | None, option: str, required: Mapping[str, type]) -> dict[str, Any] | None:
    """The JSON object in ``path`` (None for no path), with each ``required`` key
    holding that type (a list's items objects): another command's output, or not."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except OSError as exc:
        raise UsageError(f"{option} {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{option} {path}: not JSON ({exc})") from None

    def fits(value: Any, kind: type) -> bool:
        if isinstance(value, list):
            return kind is list and all(isinstance(v, dict) for v in value)
        return isinstance(value, kind)

    if not isinstance(doc, dict) or not all(fits(doc.get(k), kind) for k, kind in required.items()):
        needs = ", ".join(f"{k} (a {'list of objects' if kind is list else 'JSON object'})" for k, kind in required.items())
        raise UsageError(f"{option} {path}: not the expected JSON (needs {needs})")
    return doc


def _store_path(option: str | None, evaluation: dict[str, Any] | None) -> Path | None:
    """--store; else the store the evaluation names; else the default store, if any exists."""
    from dlbricks.store import default_store_path

    if option is not None:
        return require_store(option)
    named = (evaluation or {}).get("store")
    for candidate in ([Path(named)] if named else []) + [default_store_path()]:
        if candidate.is_file():
            print(f"dlbricks report: using store {candidate}", file=sys.stderr)
            return candidate
    return None


def _from_models(args: argparse.Namespace, analysis: dict | None, evaluation: dict | None) -> tuple[dict | None, list]:
    """Load the PATHs: the analysis (when not given) and the models the evaluation decomposed."""
    from dlbricks.analysis import analyze, load_corpus, print_err

    plan = shape_plan(args)
    loaded = load_corpus(args.paths, strict=args.strict, on_warning=print_err, shapes_for=plan)
    for e in loaded.errors:
        print_err(f"skipped {e['error']}")
    if analysis is None:
        Gs = [int(g) for g in evaluation["G"]] if evaluation and evaluation.get("G") else parse_g_list(args.G)
        analysis = analyze(loaded.models, Gs)
        analysis["errors"] = loaded.errors
    models = loaded.models
    if evaluation:
        # The models the evaluation decomposed: runtime graphs where it says so.
        from dlbricks.timing import RunnerConfig

        by_path = {m.get("path"): m.get("graph") for m in evaluation.get("models", [])}
        default = "runtime" if evaluation.get("runtime_graph") else evaluation.get("graph", "source")
        graphs = [by_path.get(m.path) or default for m in models]
        # The evaluation's configuration, without its cores: they may not exist here,
        # and pinning does not change the optimised graph.
        config = RunnerConfig.from_dict({**(evaluation.get("config") or {}), "cores": None})
        models = graph_models(models, graphs, config,
                              shapes_for=lambda m: plan.for_file(m.path) if plan and m.path else None)
    return analysis, models
