"""Roofline analysis of the light models shipped with onnx.

Measures this machine's peaks (compute and memory bandwidth, at one thread pinned to
the last CPU), times every unique G=1 brick and every whole model (short runner
settings by default), and reports per model the ideal latency (sequential and
critical path) against the measured one, the what-if speedups, how many layers beat
their bound, and the top headroom layers across the corpus.

Prints a table, then one JSON object on its last line.

    python bench/roofline.py [--models squeezenet,resnet50] [--store FILE] [--max-time 0.2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import onnx

from dlbricks.loading import load
from dlbricks.pipeline import bench
from dlbricks.roofline import analysis as rl
from dlbricks.store import Store
from dlbricks.timing import RunnerConfig
from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint

LIGHT = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="", help="comma-separated light model names (default: all nine)")
    ap.add_argument("--store", help="results store (default: a temporary one)")
    ap.add_argument("--min-time", type=float, default=0.05)
    ap.add_argument("--max-time", type=float, default=0.3)
    ap.add_argument("--min-iters", type=int, default=10)
    ap.add_argument("--quick-peaks", action="store_true", help="quick peaks measurement")
    ap.add_argument("--batch", type=int, default=0, help="also run the batch what-if at this batch size")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()

    names = [n for n in args.models.split(",") if n] or sorted(p.stem[len("light_"):] for p in LIGHT.glob("light_*.onnx"))
    models = [load(LIGHT / f"light_{n}.onnx") for n in names]
    cpu = sorted(os.sched_getaffinity(0))[-1] if hasattr(os, "sched_getaffinity") else 0
    config = RunnerConfig(cores=(cpu,), min_time=args.min_time, max_time=args.max_time, min_iters=args.min_iters,
                          warmup_time=0.02)
    system_id = fingerprint_id(system_fingerprint())

    with tempfile.TemporaryDirectory(prefix="dlbricks-roofline-") as tmp:
        store_path = Path(args.store) if args.store else Path(tmp) / "results.sqlite"
        t0 = time.perf_counter()
        peaks = rl.peaks_for_store(store_path, config, quick=args.quick_peaks, system_id=system_id)
        peaks_s = time.perf_counter() - t0
        with Store(store_path) as store:
            t0 = time.perf_counter()
            summary = bench(models, [1], store=store, config=config, e2e=True, progress=sys.stderr.isatty())
            bench_s = time.perf_counter() - t0
            analysis = rl.analyze(models, peaks, store=store, system_id=system_id, config_key=config.key())
            if args.batch > 1:
                rl.batch_what_if(models, args.batch, analysis, store=store, system_id=system_id,
                                 config_key=config.key(), config=config)
        headroom = rl.layer_headroom(analysis, top=args.top)

    print(rl.format_text(analysis, headroom, max_flagged=5), end="")
    causes: dict[str, int] = {}
    for r in analysis.beats_bound():
        causes[r.cause or "?"] = causes.get(r.cause or "?", 0) + 1
    result = {
        "peaks": {
            "gflops": peaks.gflops, "bandwidth_gbs": peaks.bandwidth_gbs, "copy_gbs": peaks.copy_gbs,
            "triad_gbs": peaks.triad_gbs, "ort_scale_gbs": peaks.ort_scale_gbs, "ort_add_gbs": peaks.ort_add_gbs,
            "gflops_by_size": peaks.gflops_by_size, "ridge_point": peaks.ridge_point, "threads": peaks.threads,
            "quick": peaks.quick, "last_level_cache_bytes": peaks.last_level_cache_bytes, "measure_s": peaks_s,
        },
        "config": {"cores": list(config.cores or ()), "min_time": config.min_time, "max_time": config.max_time},
        "bench": {"bricks": summary.bricks_total, "failed": summary.bricks_failed, "wall_s": bench_s},
        "models": [
            {
                "name": m.name, "layers": len(m.layers), "measured_ms": _ms(m.measured_s),
                "measured_source": m.measured_source, "layer_sum_ms": _ms(m.layer_sum_s),
                "ideal_sequential_ms": _ms(m.ideal_sequential_s), "ideal_critical_path_ms": _ms(m.ideal_critical_path_s),
                "efficiency": m.efficiency, "layers_missing": m.layers_missing,
                "beats_bound": sum(r.beats_bound for r in m.layers),
                "speedup": {k: v.get("speedup", v.get("per_sample_speedup")) for k, v in m.scenarios.items()},
                "fusion_bound_speedup": m.scenarios["fusion"]["bound_speedup"],
            }
            for m in analysis.models
        ],
        "beats_bound_by_cause": causes,
        "top_headroom": [
            {"kind": h["kind"], "example": h["example"], "occurrences": h["occurrences"],
             "measured_ms": _ms(h["measured_s"]), "bound_ms": _ms(h["bound_s"]),
             "efficiency": h["efficiency"], "total_headroom_ms": _ms(h["total_headroom_s"])}
            for h in headroom
        ],
    }
    print(json.dumps(result))
    return 0


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 4)


if __name__ == "__main__":
    sys.exit(main())
