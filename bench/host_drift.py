"""How far the machine itself moves a model's normalized latency over minutes: the floor
under ``bench/reproducibility.py`` on this host.

In one process pinned to the timing CPU (the CLI's default, the last one), with the
settings the measurement engine times with, it cycles for ``--seconds`` through a whole
model (synthesised weights, as ``evaluate`` times it), each of its unique G=1 bricks
(by default timed warm after two discarded runs, as the engine's default cache state
times a brick whose weights fit the core's L2 cache) and the engine's speed probe (a MatMul that stays
in the core's caches: the core's own speed). Per window of ``--window`` seconds it takes
each one's median and reports the model's latency, its reconstruction (the bricks'
medians times their occurrences), their ratio, the probe and the engine's shared-cache
probe (``timing/cacheprobe.py``, read once a pass: how much of a last-level-cache working
set others evicted while the core waited 5 ms), with the correlation over the windows of
the model's latency and of the ratio with that reading.

Everything here is measured in the same windows, interleaved, so whatever moves the ratio
between windows is a state of the machine that the bricks and the model meet differently,
and which an ``evaluate`` run of a few seconds takes whole into its result: e.g. a
neighbour's traffic in a shared last-level cache, which slows a model whose weights and
activations live there, and not bricks whose data stays in the core's own caches. The
ratio's spread between windows is then about what three ``evaluate`` runs can differ by.

``--brick-state model-order`` times each brick once per pass over all of them in the
model's order, so that the other bricks' runs come between two of its own as the other
layers do in the model: the bricks then find their data where the model's layers do, and
each run also pays a cold call of its own session (ShuffleNet on a 2-vCPU EPYC VM: the
ratio's robust CV over 5 s windows 1.0%, 1.4% and 2.1% in three runs of a minute, against
4.2% and 3.0% warm, but the bricks summed to 2.5-2.6x the model).

``--neighbour`` makes the state on demand: in every other window a process on another CPU
streams through a buffer twice the last-level cache (the traffic of a memory-bound
neighbour), so the windows alternate quiet, busy, quiet, ... and the summary gives the
ratio in each. On a 2-vCPU EPYC VM, four `evaluate -G 1` runs beside such a neighbour
(a niced process on the other CPU), each paired with one without it, gave ShuffleNet normalized
latency 0.87-0.99 (median 0.92) against 0.91-1.02 (0.98), SqueezeNet 0.93-0.97 (0.95)
against 0.97-0.99 (0.98), and ResNet-50, whose large layers are timed cold, 1.006-1.014 in
both; onnxruntime's profile of ShuffleNet's model put half of its slowdown in the
convolutions.

    python bench/host_drift.py [--model shufflenet|PATH] [--seconds 120] [--window 5] [--cpu N]
                               [--brick-state warm|model-order] [--neighbour]

Bricks are cut from the source graph (``evaluate`` cuts them from the runtime graph by
default), so the ratio's level is not ``evaluate``'s; its movement is the point. Last line:
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from pathlib import Path

import numpy as np
from _evaluate import light_models

import dlbricks
from dlbricks.bricks import generate_brick, whole_model
from dlbricks.corpus import Corpus
from dlbricks.cpuset import usable_cpus
from dlbricks.timing import RunnerConfig
from dlbricks.timing.cacheprobe import SharedCacheProbe
from dlbricks.timing.engine_worker import _probe_model
from dlbricks.timing.fpenv import FloatEnv
from dlbricks.timing.session import pin_process, prepare_session, timed_runs

#: Timed runs per visit, after the discarded ones (two for a brick, one for the model).
RUNS = 3


def _spread(values: list[float]) -> dict[str, float]:
    m = statistics.median(values)
    return {"median": m, "relative_range": (max(values) - min(values)) / m,
            "robust_cv": 1.4826 * statistics.median(abs(v / m - 1) for v in values)}


def _stream(cpu: int, nbytes: int, busy: multiprocessing.synchronize.Event, stop: multiprocessing.synchronize.Event) -> None:
    """The neighbour: while ``busy`` is set, read a buffer of ``nbytes`` over and over."""
    os.sched_setaffinity(0, {cpu})
    buffer = np.ones(nbytes, dtype=np.uint8)
    while not stop.is_set():
        if busy.wait(0.05):
            np.add.reduce(buffer[::64])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="shufflenet", help="a light model's short name or an ONNX path")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--window", type=float, default=5.0)
    ap.add_argument("--cpu", type=int, default=None, help="CPU to time on (default: the last usable one)")
    ap.add_argument("--brick-state", choices=("warm", "model-order"), default="warm",
                    help="warm: each brick's runs in a row after two discarded ones (the engine's state "
                         "for small bricks); model-order: one run of every brick in turn, in the model's order")
    ap.add_argument("--neighbour", action="store_true",
                    help="in every other window, stream through memory on another CPU (a memory-bound neighbour)")
    args = ap.parse_args()

    path = args.model if Path(args.model).exists() else light_models([args.model])[0]
    cpu = args.cpu if args.cpu is not None else usable_cpus()[-1]
    config = RunnerConfig(cores=(cpu,))
    neighbour = None
    if args.neighbour:
        from dlbricks.roofline.peaks import data_cache_bytes

        others = [c for c in usable_cpus() if c != cpu]
        if not others:
            ap.error("--neighbour needs a second usable CPU")
        busy, stop = multiprocessing.Event(), multiprocessing.Event()
        llc = data_cache_bytes() or 32 << 20
        neighbour = multiprocessing.Process(target=_stream, args=(others[0], 2 * min(llc, 64 << 20), busy, stop), daemon=True)
        neighbour.start()
    pin_process(config)
    clock = time.thread_time_ns if config.measure_clock() == "thread" else time.perf_counter_ns
    fenv = FloatEnv()

    model = dlbricks.load(path)
    split = Corpus([model]).split(1)
    occurrences = split.occurrences()[0]

    def open_session(built) -> object:
        proto, info = built  # info.int_bounds: the ranges integer inputs must keep (indices)
        return prepare_session(proto.SerializeToString(), config, fenv, int_bounds=dict(info.int_bounds) or None).bound

    whole = open_session(whole_model(model))
    bricks = []
    for u, digest in enumerate(split.unique_digests):
        _, members = split.first_occurrence(u)
        bricks.append(open_session(generate_brick(model, members, digest=bytes(digest), G=1)))
    probe = prepare_session(_probe_model(), config, fenv).bound
    shared_cache = SharedCacheProbe()
    # A model-zoo layout (NAME/model.onnx) is named by its folder, as the CLI names it.
    name = Path(path).parent.name if Path(path).stem == "model" else model.name
    print(f"{name}: {len(bricks)} unique G=1 bricks, {model.n_layers} layers; timing on CPU {cpu} "
          f"for {args.seconds:.0f} s in {args.window:.0f} s windows", flush=True)

    windows = []
    t_end = time.perf_counter() + args.seconds
    while time.perf_counter() < t_end:
        busy_window = neighbour is not None and len(windows) % 2 == 1
        if neighbour is not None:
            (busy.set if busy_window else busy.clear)()
        w_end = min(t_end, time.perf_counter() + args.window)
        model_t: list[int] = []
        probe_t: list[int] = []
        cache_readings: list[float] = []
        brick_t: list[list[int]] = [[] for _ in bricks]
        while time.perf_counter() < w_end:
            whole.run()
            timed_runs(whole, RUNS, out=model_t, clock=clock)
            if args.brick_state == "warm":
                for b, out in zip(bricks, brick_t):
                    b.run()
                    b.run()
                    timed_runs(b, RUNS, out=out, clock=clock)
            else:  # model order: every other brick runs between two runs of one
                for _ in range(RUNS):
                    for b, out in zip(bricks, brick_t):
                        timed_runs(b, 1, out=out, clock=clock)
            timed_runs(probe, RUNS, out=probe_t, clock=clock)
            cache_readings.append(shared_cache.read())
        model_ms = statistics.median(model_t) / 1e6
        bricks_ms = float(np.dot(occurrences, [statistics.median(t) for t in brick_t])) / 1e6
        row = {"t_s": round(args.seconds - (t_end - time.perf_counter()), 1), "model_ms": model_ms,
               "bricks_ms": bricks_ms, "ratio": bricks_ms / model_ms, "probe_us": statistics.median(probe_t) / 1e3,
               "shared_cache": statistics.median(cache_readings), "neighbour": busy_window}
        windows.append(row)
        print(f"{row['t_s']:6.1f} s  model {model_ms:8.3f} ms  bricks {bricks_ms:8.3f} ms  "
              f"ratio {row['ratio']:.3f}  probe {row['probe_us']:7.1f} us  shared cache {row['shared_cache']:.2f}"
              + ("  (neighbour)" if busy_window else ""),
              flush=True)
    if neighbour is not None:
        stop.set()
        neighbour.join()

    keys = ("model_ms", "bricks_ms", "ratio", "probe_us", "shared_cache")
    summary = {k: _spread([w[k] for w in windows]) for k in keys}
    for k, v in summary.items():
        print(f"{k}: median {v['median']:.4g}, range {v['relative_range']:.1%}, robust cv {v['robust_cv']:.1%}")
    correlation = {}
    if len(windows) >= 3:
        cache = [w["shared_cache"] for w in windows]
        correlation = {k: float(np.corrcoef(cache, [w[k] for w in windows])[0, 1]) for k in ("model_ms", "ratio")}
        print(f"over the windows, the shared-cache reading's correlation with the model: "
              f"{correlation['model_ms']:.2f}, with the ratio: {correlation['ratio']:.2f}")
    by_state = {}
    if neighbour is not None:
        for state, label in ((False, "quiet"), (True, "neighbour")):
            rows = [w for w in windows if w["neighbour"] == state]
            if rows:
                by_state[label] = {k: statistics.median(w[k] for w in rows) for k in keys}
                print(f"{label}: " + ", ".join(f"{k} {v:.4g}" for k, v in by_state[label].items()))
    print(json.dumps({"model": name, "cpu": cpu, "brick_state": args.brick_state, "bricks": len(bricks), "window_s": args.window,
                      "seconds": args.seconds, "windows": windows, "summary": summary, "by_state": by_state,
                      "shared_cache_correlation": correlation, "loadavg": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
