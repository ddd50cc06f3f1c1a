"""Fidelity and speedup of brick reconstruction on the nine light models.

Runs the evaluation at G=1..3 with the source-graph decomposition and with the
runtime-graph decomposition (the graph onnxruntime executes), one pinned thread and
onnxruntime's default optimisations everywhere, and prints per G the geometric mean,
min and max normalized latency (constructed / end-to-end) and both speedups. Both
decompositions share one store, so end-to-end runs are measured once.

    python bench/fidelity.py [-G 1,2,3] [--min-time 0.2] [--store PATH]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from dlbricks.analysis import load_corpus
from dlbricks.commands.demo import default_corpus_dir
from dlbricks.pipeline import evaluate
from dlbricks.loading.runtime_graph import runtime_models
from dlbricks.store import Store
from dlbricks.timing import RunnerConfig


def summarize(result: dict) -> list[dict]:
    return [
        {k: g[k] for k in ("G", "unique_bricks", "geomean_normalized", "min_normalized", "max_normalized",
                           "geomean_normalized_parallel", "speedup", "wallclock_speedup")}
        for g in result["per_g"]
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-G", default="1,2,3")
    ap.add_argument("--min-time", type=float, default=0.2)
    ap.add_argument("--max-time", type=float, default=2.0)
    ap.add_argument("--store", help="reuse a store (default: a temporary one)")
    args = ap.parse_args()
    Gs = [int(g) for g in args.G.split(",")]
    core = max(os.sched_getaffinity(0))
    config = RunnerConfig(intra_op_threads=1, cores=(core,), min_time=args.min_time, max_time=args.max_time)
    models = load_corpus([default_corpus_dir()]).models

    with tempfile.TemporaryDirectory() as tmp:
        store_path = Path(args.store) if args.store else Path(tmp) / "fidelity.sqlite"
        with Store(store_path) as store:
            t0 = time.perf_counter()
            source = evaluate(models, Gs, store=store, config=config, n_boot=200)
            t1 = time.perf_counter()
            rt_models = runtime_models(models)
            runtime = evaluate(rt_models, Gs, store=store, config=config, n_boot=200, e2e_models=models)
            t2 = time.perf_counter()
    per_model = {
        m["name"]: {G: {"source": m["per_g"][str(G)]["sequential"]["normalized"]} for G in Gs} for m in source["models"]
    }
    for m in runtime["models"]:
        for G in Gs:
            per_model[m["name"]][G]["runtime"] = m["per_g"][str(G)]["sequential"]["normalized"]
    print("normalized latency per model (source / runtime graph):")
    for name, row in per_model.items():
        print(f"  {name:<22}" + "".join(f"  G={G}: {v['source']:.3f}/{v['runtime']:.3f}" for G, v in row.items()))
    for label, res in (("source graph", source), ("runtime graph", runtime)):
        print(label)
        for g in summarize(res):
            print(f"  G={g['G']}: geomean {g['geomean_normalized']:.3f} [{g['min_normalized']:.3f}, "
                  f"{g['max_normalized']:.3f}], speedup {g['speedup']:.2f}x, wall-clock {g['wallclock_speedup']:.2f}x")
    print(json.dumps({
        "config": config.to_dict(),
        "source_graph": summarize(source),
        "runtime_graph": summarize(runtime),
        "per_model": per_model,
        "seconds": {"source": t1 - t0, "runtime": t2 - t1},
    }))


if __name__ == "__main__":
    main()
