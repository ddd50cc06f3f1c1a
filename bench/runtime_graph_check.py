"""Can every unique G=1 brick of each model's runtime graph be generated and run?

The runtime graph (``dlbricks.loading.runtime_graph``: the graph onnxruntime executes,
its fusions and contrib ops included) is the default decomposition, so each of its
layers must become a brick onnxruntime runs. For each model of a folder (default: the
nine light models shipped with onnx; ``--modern [DIR]``: the corpus
bench/modern_corpus.py builds), this loads the source model, reloads it as its runtime
graph, and for every unique G=1 brick generates it (synthetic weights, as the timed
bricks get them), checks it with the ONNX checker as ``dlbricks generate`` does,
builds an onnxruntime session with the runner's options and runs it once on the
inputs the runner would feed it.

    python bench/runtime_graph_check.py [FOLDER | --modern [DIR]] [--only NAME[,NAME]] [--threads N]

Printed per model: the runtime graph's layers, its unique bricks, and each brick that
failed to generate, check, open or run, with why. Last line: one JSON object, with the
totals and, under ``contrib_op_types``, each op onnx does not define that the runtime
graphs hold, with the models holding it.
Models are loaded one at a time (the modern ones are large).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from dlbricks.bricks import check_brick, generate_brick, iter_unique_bricks
from dlbricks.errors import DlbricksError, first_line
from dlbricks.loading import iter_model_paths, load
from dlbricks.loading.runtime_graph import runtime_models
from dlbricks.timing import RunnerConfig
from dlbricks.timing.inputs import make_inputs
from dlbricks.timing.session import create_session

DEFAULT_MODERN = Path.home() / ".cache" / "dlbricks-bench" / "modern"
STAGES = ("generate", "check", "session", "run")


def light_dir() -> Path:
    import onnx

    return Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def onnx_knows(op_type: str) -> bool:
    import onnx

    return bool(onnx.defs.has(op_type))


def model_name(path: Path) -> str:
    """The model-zoo layout names a model by its folder (``<name>/model.onnx``)."""
    return path.parent.name if path.stem == "model" else path.stem


def check_brick_runs(model: Any, members: Any, digest: str, cfg: RunnerConfig) -> tuple[str, str] | None:
    """(stage, reason) of the first step the brick fails, or None when it runs."""
    stage = "generate"
    try:
        proto, info = generate_brick(model, members, digest=digest, G=1)
        stage = "check"
        check_brick(proto)
        stage = "session"
        session = create_session(proto, cfg)
        stage = "run"
        session.run(None, make_inputs(proto, int_bounds=info.int_bounds))
    except Exception as exc:  # noqa: BLE001 - every failure is a finding, named with its stage
        cause = exc.__cause__ if isinstance(exc, DlbricksError) and exc.__cause__ is not None else exc
        return stage, first_line(cause)[:300]
    return None


def check_model(path: Path, cfg: RunnerConfig) -> dict[str, Any]:
    name = model_name(path)
    out: dict[str, Any] = {"name": name, "path": os.fspath(path)}
    t0 = time.perf_counter()
    try:
        source = load(path, name=name)
        out["source_layers"] = source.n_layers
        (rt,) = runtime_models([source], config=cfg)
        del source
        out["layers"] = rt.n_layers
    except DlbricksError as exc:
        out["runtime_graph_error"] = first_line(exc)[:300]
        out["seconds"] = round(time.perf_counter() - t0, 1)
        return out
    out["op_types"] = dict(collections.Counter(layer.kind for layer in rt.layers))
    failures = []
    unique = 0
    for digest, model, members, _ in iter_unique_bricks([rt], 1):
        unique += 1
        failed = check_brick_runs(model, members, digest, cfg)
        if failed is not None:
            layer = model.layers[int(members[0])]
            failures.append({"digest": digest, "layer": layer.name, "op": layer.kind, "stage": failed[0],
                             "reason": failed[1]})
    out["unique_bricks"] = unique
    out["failed"] = failures
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", nargs="?", type=Path, help="models to check (default: the light models)")
    ap.add_argument("--modern", nargs="?", const=DEFAULT_MODERN, type=Path, metavar="DIR",
                    help=f"the modern corpus (default {DEFAULT_MODERN})")
    ap.add_argument("--only", help="comma-separated model names")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of the runner's sessions (default 1)")
    args = ap.parse_args(argv)
    folder = args.modern or args.folder or light_dir()
    paths = list(iter_model_paths([folder]))
    if args.only:
        wanted = set(args.only.split(","))
        paths = [p for p in paths if model_name(p) in wanted]
    if args.threads > 1:
        cpus = sorted(os.sched_getaffinity(0))
        cfg = RunnerConfig(intra_op_threads=args.threads, cores=tuple(cpus[: args.threads]))
    else:
        cfg = RunnerConfig()
    results = []
    for path in paths:
        r = check_model(path, cfg)
        results.append(r)
        if "runtime_graph_error" in r:
            print(f"{r['name']}: runtime graph not decomposable: {r['runtime_graph_error']}", flush=True)
            continue
        by_stage = collections.Counter(f["stage"] for f in r["failed"])
        failed = ", ".join(f"{by_stage[s]} failed to {s}" for s in STAGES if by_stage[s]) or "all run"
        print(f"{r['name']}: {r['layers']} layers (source {r['source_layers']}), {r['unique_bricks']} unique bricks, "
              f"{failed} ({r['seconds']} s)", flush=True)
        for f in r["failed"]:
            print(f"  {f['digest'][:12]} {f['op']} ({f['layer']}): {f['stage']}: {f['reason']}", flush=True)
    decomposed = [r for r in results if "runtime_graph_error" not in r]
    # The ops onnx does not define (contrib, nchwc, onnxruntime's own ONNX-domain ones):
    # each with the models whose runtime graph has it.
    contrib: dict[str, list[str]] = {}
    for r in decomposed:
        for kind in r["op_types"]:
            if "::" in kind or not onnx_knows(kind):
                contrib.setdefault(kind, []).append(r["name"])
    summary = {
        "schema_version": 1,
        "folder": os.fspath(folder),
        "config": {"intra_op_threads": cfg.intra_op_threads, "cores": cfg.cores},
        "models": len(results),
        "runtime_graph_decomposed": len(decomposed),
        "runtime_graph_failed": {r["name"]: r["runtime_graph_error"] for r in results if r not in decomposed},
        "layers": sum(r["layers"] for r in decomposed),
        "unique_bricks": sum(r["unique_bricks"] for r in decomposed),
        "bricks_failed": {s: sum(1 for r in decomposed for f in r["failed"] if f["stage"] == s) for s in STAGES},
        "contrib_op_types": {kind: contrib[kind] for kind in sorted(contrib)},
        "per_model": {r["name"]: {k: r[k] for k in ("layers", "unique_bricks", "failed") if k in r} for r in results},
    }
    print(json.dumps(summary))
    return 0 if not summary["runtime_graph_failed"] and not any(summary["bricks_failed"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
