"""Run-to-run reproducibility of brick timings.

Three bricks -- Conv 3x3 64->64 on 1x64x56x56, Gemm 1x4096 @ 4096x1000, and
Add+Relu on two 1x256x56x56 tensors -- are each measured in ``--runs`` separate
runs. Every run is a fresh worker process with a fresh session (one
:func:`dlbricks.timing.workers.run_isolated` call per run), pinned to one core; runs of
the three bricks are interleaved so slow drifts of the machine hit them alike.
Reported per brick: the medians of the runs and their coefficient of variation
(stddev / mean of the medians). Target: CV <= 2%.

Also reported, to tell the method's noise from the machine's: each run's drift (the
spread of the medians of 8 consecutive blocks of its iterations, relative to its
median: how much the machine's speed moved *within* one run), and the CV across runs
of two other estimators, the minimum and the 10th percentile. When one run's own
block medians already spread by more than 2%, no estimator of "the" median can
reproduce to 2% between runs: the machine, not the method, sets the floor.

Prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dlbricks.timing import RunnerConfig
from dlbricks.timing.workers import Job, run_isolated


def _save(path: Path, nodes, inputs, output, inits) -> str:
    graph = helper.make_graph(
        nodes,
        path.stem,
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(output[0], TensorProto.FLOAT, output[1])],
        initializer=[numpy_helper.from_array(a, n) for n, a in inits],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return str(path)


def make_bricks(folder: Path) -> dict[str, str]:
    """Write the three bricks with seeded random weights; returns name -> path."""
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    return {
        "conv3x3_64_56": _save(
            folder / "conv.onnx",
            [helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])],
            [("x", [1, 64, 56, 56])],
            ("y", [1, 64, 56, 56]),
            [("w", w(64, 64, 3, 3)), ("b", w(64))],
        ),
        "gemm_1x4096x1000": _save(
            folder / "gemm.onnx",
            [helper.make_node("Gemm", ["x", "w", "b"], ["y"])],
            [("x", [1, 4096])],
            ("y", [1, 1000]),
            [("w", w(4096, 1000)), ("b", w(1000))],
        ),
        "add_relu_256x56x56": _save(
            folder / "add_relu.onnx",
            [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
            [("a", [1, 256, 56, 56]), ("b", [1, 256, 56, 56])],
            ("y", [1, 256, 56, 56]),
            [],
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)))
    ap.add_argument("--min-time", type=float, default=0.5)
    ap.add_argument("--max-time", type=float, default=3.0)
    args = ap.parse_args()
    cfg = RunnerConfig(cores=(args.core,), min_time=args.min_time, max_time=args.max_time, warmup_time=0.2)

    load_start = os.getloadavg()[0]  # other processes on the machine skew every figure
    medians: dict[str, list[float]] = {}
    minima: dict[str, list[float]] = {}
    p10s: dict[str, list[float]] = {}
    drifts: dict[str, list[float]] = {}
    notes: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        bricks = make_bricks(Path(tmp))
        for run in range(args.runs):
            for name, path in bricks.items():

                def keep(job, result, name=name):
                    if not hasattr(result, "stats"):
                        raise SystemExit(f"{name}: {result.error}")
                    medians.setdefault(name, []).append(result.stats.median)
                    minima.setdefault(name, []).append(result.stats.min)
                    p10s.setdefault(name, []).append(float(np.percentile(result.times_ns, 10)))
                    drifts.setdefault(name, []).append(result.stats.drift)
                    notes.setdefault(name, []).append(f"{result.stop_reason} n={result.stats.n}")

                # One call per run: a fresh worker process and a fresh session each time.
                run_isolated([Job(f"{name}#{run}", path)], cfg, on_result=keep)
                print(
                    f"run {run} {name}: median {medians[name][-1] / 1e3:.1f} us, min {minima[name][-1] / 1e3:.1f} us, "
                    f"drift {drifts[name][-1]:.1%} ({notes[name][-1]})",
                    flush=True,
                )

    def cv(xs: list[float]) -> float:
        return statistics.stdev(xs) / statistics.fmean(xs) if len(xs) > 1 else 0.0

    per_brick = {}
    for name, ms in medians.items():
        per_brick[name] = {
            "medians_us": [round(m / 1e3, 2) for m in ms],
            "cv": round(cv(ms), 4),
            "cv_of_min": round(cv(minima[name]), 4),
            "cv_of_p10": round(cv(p10s[name]), 4),
            "within_run_drift": [round(d, 4) for d in drifts[name]],
        }
    all_drifts = [d for ds in drifts.values() for d in ds]
    result = {
        "bench": "reproducibility",
        "core": args.core,
        "runs": args.runs,
        "bricks": per_brick,
        "max_cv": max(b["cv"] for b in per_brick.values()),
    }
    result["all_within_2pct"] = result["max_cv"] <= 0.02
    # The machine's own floor: how far one run's block medians spread, median over runs.
    result["median_within_run_drift"] = round(statistics.median(all_drifts), 4)
    result["max_cv_of_min"] = max(b["cv_of_min"] for b in per_brick.values())
    result["loadavg_1min"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
