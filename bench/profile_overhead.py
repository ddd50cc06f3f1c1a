"""Overhead of each profiling level, and the reconciliation before and after correction.

For every light model shipped with onnx (or those named with ``--models``) this runs
:func:`dlbricks.profiling.profile_model` with all three levels, the hw level
counting the whole model only (``hw_bricks=False``; per-brick counting is the same
mechanism repeated per layer), and reports:

* model latency with each level on versus off: ``model`` (the Runner, profiling
  off), ``layer`` (runs under onnxruntime's profiler, against the model level and
  against the same session once profiling is off) and ``hw`` (runs with perf
  counters read around every run, against uncounted runs of the same session);
* the reconciliation error of the layer times against the model latency: raw
  kernel sums (before) and corrected layer sums (after), with the framework
  overhead that remains.

Prints one line per model, then one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import onnx

from dlbricks.loading import load
from dlbricks.profiling.tracing import to_jsonable
from dlbricks.profiling.xsp import ProfileOptions, profile_model
from dlbricks.timing import RunnerConfig

LIGHT_DIR = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"


def _rel(a: float | None, b: float | None) -> float | None:
    return None if a is None or b in (None, 0) else (a - b) / b


def bench_one(path: Path, runs: int, threads: int) -> dict:
    opts = ProfileOptions(
        runs=runs,
        brick_runs=runs,
        hw_bricks=False,
        config=RunnerConfig(intra_op_threads=threads, max_time=1.0),
    )
    t0 = time.perf_counter()
    res = profile_model(load(path), opts, on_message=None)
    ml, ll, hw = res["model_level"], res["layer_level"], res["hw_level"]
    model_us = ml["latency_us"]
    hw_model = hw["model"]
    return {
        "layers": res["model"]["layers"],
        "kernels": len(res["kernels"]),
        "latency_us": {
            "model_off": model_us,
            "layer_on": ll["profiled_wall_us"],
            "layer_off_same_session": ll["unprofiled_same_session_us"],
            "hw_on": hw_model["counted_us"],
            "hw_off_same_session": hw_model["uncounted_us"],
        },
        "overhead_rel": {
            "layer_vs_model": _rel(ll["profiled_wall_us"], model_us),
            "layer_same_session": _rel(ll["profiled_wall_us"], ll["unprofiled_same_session_us"]),
            "layer_same_session_min": _rel(ll["profiled_wall_min_us"], ll["unprofiled_same_session_min_us"]),
            "hw_same_session": _rel(hw_model["counted_us"], hw_model["uncounted_us"]),
            "hw_vs_model": _rel(hw_model["counted_us"], model_us),
        },
        "profiler_per_kernel_us": ll["overhead_per_kernel_us"],
        "in_span_us": ll["instrumentation"]["in_span_us"],
        "scale": ll["scale"],
        "profiler_cost_us": ll["profiler_cost_us"],
        "reconciliation": {
            "raw_sum_us": ll["raw_sum_us"],
            "corrected_sum_us": ll["corrected_sum_us"],
            "error_before": ll["error_before"],
            "error_after": ll["error_after"],
            "framework_overhead_us": ll["framework_overhead_us"],
            "run_variation_us": ll["run_variation_us"],
        },
        "hw_events": hw["events"],
        "hardware_counters": hw["hardware_counters"],
        "join": res["join"],
        "model_cv": None if not ml.get("warnings") else "; ".join(ml["warnings"]),
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", help="light model names (default: all nine)")
    p.add_argument("--runs", type=int, default=10, help="profiled / counted runs per level (default 10)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    args = p.parse_args()
    paths = sorted(LIGHT_DIR.glob("light_*.onnx"))
    if args.models:
        paths = [LIGHT_DIR / f"light_{m}.onnx" for m in args.models]
    out: dict = {"models": {}}
    load_before = os.getloadavg()
    for path in paths:
        name = path.stem.removeprefix("light_")
        r = bench_one(path, args.runs, args.threads)
        out["models"][name] = r
        rec = r["reconciliation"]
        ov = r["overhead_rel"]
        print(
            f"{name:<14} model {r['latency_us']['model_off'] / 1e3:9.2f} ms | layer on {ov['layer_vs_model']:+7.1%} "
            f"(same session {ov['layer_same_session']:+6.1%}, fastest runs {ov['layer_same_session_min']:+6.1%}) | "
            f"hw on {ov['hw_same_session']:+6.1%} | "
            f"error before {rec['error_before']:+7.1%} after {rec['error_after']:+7.1%} | {r['wall_s']:.0f} s",
            file=sys.stderr,
        )
    ms = list(out["models"].values())

    def med(key: str, sub: str) -> float:
        return statistics.median(m[key][sub] for m in ms)

    def med_abs(key: str, sub: str) -> float:
        return statistics.median(abs(m[key][sub]) for m in ms)

    out["summary"] = {
        "models": len(ms),
        "median_layer_overhead_vs_model": med("overhead_rel", "layer_vs_model"),
        "median_layer_overhead_same_session": med("overhead_rel", "layer_same_session"),
        "median_layer_overhead_same_session_min": med("overhead_rel", "layer_same_session_min"),
        "median_hw_overhead_same_session": med("overhead_rel", "hw_same_session"),
        "median_abs_error_before": med_abs("reconciliation", "error_before"),
        "median_abs_error_after": med_abs("reconciliation", "error_after"),
        "max_abs_error_after": max(abs(m["reconciliation"]["error_after"]) for m in ms),
        "hardware_counters": all(m["hardware_counters"] for m in ms),
    }
    out["context"] = {"runs": args.runs, "threads": args.threads, "cpu_count": os.cpu_count(),
                      "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    print(json.dumps(to_jsonable(out), separators=(",", ":")))


if __name__ == "__main__":
    main()
