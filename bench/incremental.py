"""Incremental benchmarking: the light zoo minus one model, then with it.

The second run must measure only the new model's unique bricks that the first run
did not already have. Prints both counts and times; last line is one JSON object.

    python bench/incremental.py [--added resnet50] [-G 1] [--min-time 0.05]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from dlbricks.commands.demo import default_corpus_dir
from dlbricks.corpus import Corpus
from dlbricks.loading import load
from dlbricks.pipeline import bench
from dlbricks.store import Store
from dlbricks.timing import RunnerConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--added", default="resnet50", help="the model added in the second run (light_<name>)")
    ap.add_argument("-G", type=int, default=1)
    ap.add_argument("--min-time", type=float, default=0.05)
    ap.add_argument("--max-time", type=float, default=0.5)
    args = ap.parse_args()

    paths = sorted(default_corpus_dir().glob("light_*.onnx"))
    added = [p for p in paths if p.stem == f"light_{args.added}"]
    if not added:
        sys.exit(f"no light model named {args.added}")
    base = [p for p in paths if p not in added]
    base_models = [load(p) for p in base]
    new_model = load(added[0])
    config = RunnerConfig(cores=(max(__import__("os").sched_getaffinity(0)),), min_time=args.min_time,
                          max_time=args.max_time, warmup_time=0.02)

    # What the second run should measure: the added model's unique bricks not in the base corpus.
    before = {bytes(d).hex() for d in Corpus(base_models).split(args.G).unique_digests}
    after = {bytes(d).hex() for d in Corpus(base_models + [new_model]).split(args.G).unique_digests}
    expected_new = len(after - before)

    with tempfile.TemporaryDirectory() as tmp:
        with Store(Path(tmp) / "store.sqlite") as store:
            t0 = time.perf_counter()
            first = bench(base_models, [args.G], store=store, config=config)
            t1 = time.perf_counter()
            second = bench(base_models + [new_model], [args.G], store=store, config=config)
            t2 = time.perf_counter()
    result = {
        "G": args.G,
        "added_model": new_model.name,
        "first_run": {"models": len(base_models), "unique_bricks": first.bricks_total,
                      "measured": first.bricks_measured, "failed": first.bricks_failed, "seconds": t1 - t0},
        "second_run": {"models": len(base_models) + 1, "unique_bricks": second.bricks_total,
                       "reused": second.bricks_reused, "measured": second.bricks_measured,
                       "failed": second.bricks_failed, "seconds": t2 - t1},
        "expected_new_bricks": expected_new,
        "only_new_measured": second.bricks_measured + second.bricks_failed == expected_new,
    }
    print(f"first run:  {first.bricks_measured} bricks measured in {t1 - t0:.1f} s")
    print(f"second run: {second.bricks_reused} reused, {second.bricks_measured} measured in {t2 - t1:.1f} s "
          f"(expected {expected_new} new)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
