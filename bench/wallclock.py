"""What measuring through bricks costs, against measuring every model end to end.

Runs ``dlbricks evaluate`` (a fresh process and a fresh store each run, default
settings) and reports per G the wall-clock of measuring the unique bricks and of
measuring the whole models to the same precision (generation and session set-up
included; both measured in the same interleaved run, so the machine's speed is the
same for both), their ratio (the wall-clock speedup), the paper-defined speedup (sum of
end-to-end latencies over sum of unique brick latencies) beside it, and the whole
command's time.

    python bench/wallclock.py                       # the nine light models, G=1
    python bench/wallclock.py --corpus DIR -G 1,3   # e.g. bench/modern_corpus.py's output
    python bench/wallclock.py --runs 3 -- --threads 2 --cores 0,1

Targets (issue 21): light models G=1 wall-clock speedup >= 0.7x; a modern corpus >= 3x
at G=1 and `evaluate -G 1,3` on 29 models in <= 180 s. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics

from _evaluate import describe_host, evaluate_cli, light_models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", nargs="+", help="model files or folders (default: the light models)")
    ap.add_argument("-G", default="1")
    ap.add_argument("--runs", type=int, default=1, help="independent runs (medians are reported)")
    ap.add_argument("extra", nargs="*", help="more `dlbricks evaluate` options, after --")
    args = ap.parse_args()
    paths = args.corpus or light_models()
    runs = []
    for r in range(args.runs):
        result, wall = evaluate_cli(paths, args.G, args.extra)
        per_g = {
            str(g["G"]): {k: g.get(k) for k in ("unique_bricks", "bricks_wall_s", "e2e_wall_s", "wallclock_speedup",
                                                  "speedup", "geomean_normalized", "within_10pct", "within_5pct")}
            for g in result["per_g"]
        }
        # What else ran meanwhile: a busy host lengthens the models' side most (more rounds).
        runs.append({"evaluate_s": wall, "models": len(result["models"]), "per_g": per_g, "host": result.get("host")})
        host = describe_host(result.get("host"))
        for G, g in per_g.items():
            print(f"run {r + 1}: G={G} bricks {g['bricks_wall_s']:.1f} s, models {g['e2e_wall_s']:.1f} s: "
                  f"wall-clock speedup {g['wallclock_speedup']:.2f}x (paper-defined {g['speedup']:.2f}x); "
                  f"within 10% {g['within_10pct']:.0%}; evaluate {wall:.0f} s" + (f"; {host}" if host else ""),
                  flush=True)
    Gs = list(runs[0]["per_g"])
    summary = {
        G: {
            "wallclock_speedup_median": statistics.median(r["per_g"][G]["wallclock_speedup"] for r in runs),
            "speedup_median": statistics.median(r["per_g"][G]["speedup"] for r in runs),
        }
        for G in Gs
    }
    print(json.dumps({
        "corpus": paths,
        "G": args.G,
        "options": args.extra,
        "runs": runs,
        "median": summary,
        "evaluate_s_median": statistics.median(r["evaluate_s"] for r in runs),
    }))


if __name__ == "__main__":
    main()
