"""Per-iteration overhead of the Runner against a plain ``session.run`` loop.

A 1-element Identity network does almost no work, so what is timed is the cost of
calling into onnxruntime. The Runner (IOBinding, pre-bound outputs, adaptive stop)
and a plain Python loop of ``session.run(None, feeds)`` timed with
``perf_counter_ns`` are run alternately in the same process, pinned to the same
core, for ``--rounds`` rounds. Reported per method: the median of the per-round
timed medians, the wall time per iteration, and that wall time minus the mean
timed iteration (what each loop costs off the clock). Target: runner median <= plain-loop median.

Prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
from onnx import TensorProto, helper

from dlbricks.timing import Runner, RunnerConfig, create_session


def identity_model():
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity1",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def plain_loop(session, feeds, seconds: float) -> tuple[np.ndarray, float]:
    """Time ``session.run`` calls for ``seconds``; returns (times, wall per iteration)."""
    run, clock = session.run, time.perf_counter_ns
    for _ in range(1000):  # warm-up
        run(None, feeds)
    times = []
    append = times.append
    start = clock()
    end = start + int(seconds * 1e9)
    while True:
        t0 = clock()
        run(None, feeds)
        t1 = clock()
        append(t1 - t0)
        if t1 >= end:
            break
    wall = (clock() - start) / len(times)
    return np.asarray(times, dtype=np.int64), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="sampling time per round and method")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)))
    args = ap.parse_args()

    model = identity_model()
    cfg = RunnerConfig(cores=(args.core,), min_time=args.seconds, max_time=args.seconds, target_ci=0.0)
    runner = Runner(cfg)
    feeds = {"x": np.ones(1, dtype=np.float32)}
    os.sched_setaffinity(0, {args.core})
    session = create_session(model, cfg)

    load_start = os.getloadavg()[0]  # other processes on the machine skew every figure
    r_med, r_wall, p_med, p_wall, r_n, p_n, r_off, p_off = [], [], [], [], [], [], [], []
    for _ in range(args.rounds):
        m = runner.time(model, inputs=feeds)
        r_med.append(m.stats.median)
        r_wall.append(m.sampling_time_s * 1e9 / m.stats.n)
        r_n.append(m.stats.n)
        r_off.append(r_wall[-1] - m.stats.mean)
        times, wall = plain_loop(session, feeds, args.seconds)
        p_med.append(float(np.median(times)))
        p_wall.append(wall)
        p_n.append(len(times))
        p_off.append(wall - float(times.mean()))
        print(
            f"round: runner median {r_med[-1]:.0f} ns (wall/iter {r_wall[-1]:.0f}), "
            f"plain median {p_med[-1]:.0f} ns (wall/iter {p_wall[-1]:.0f})",
            flush=True,
        )

    result = {
        "bench": "runner_overhead",
        "core": args.core,
        "rounds": args.rounds,
        "seconds_per_round": args.seconds,
        "runner_median_ns": statistics.median(r_med),
        "plain_median_ns": statistics.median(p_med),
        "runner_wall_per_iter_ns": statistics.median(r_wall),
        "plain_wall_per_iter_ns": statistics.median(p_wall),
        # Wall time per iteration minus the mean timed iteration: the loop's own cost.
        "runner_off_clock_ns": statistics.median(r_off),
        "plain_off_clock_ns": statistics.median(p_off),
        "runner_iters_per_round": statistics.median(r_n),
        "plain_iters_per_round": statistics.median(p_n),
    }
    result["runner_le_plain"] = result["runner_median_ns"] <= result["plain_median_ns"]
    result["loadavg_1min"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
