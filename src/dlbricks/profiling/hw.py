"""The hw level: perf counters and isolated times of each kernel's brick, in a worker process.

Each kernel's layers become a brick (:func:`dlbricks.bricks.generate_brick`: G=1 for
an unfused layer; the fused layers together otherwise, so that onnxruntime fuses the
brick exactly as it fused the model). A worker process times every brick
with the Runner (the *isolated* time) and counts its runs with Linux perf events
(:mod:`dlbricks.profiling.perfevents`): cycles, instructions, cache and branch misses
where the machine exposes a PMU, plus task clock, page faults and context switches.
Without hardware counters one line says so and the level carries on with the
software counters only. The whole model is counted the same way, alternating counted
and uncounted runs, which gives the level's overhead.

The worker is a fresh interpreter (``python -m dlbricks.profiling.worker``, as the
measurement engine starts its workers), not a ``multiprocessing`` child: ``spawn``
re-imports the parent's main module, so a user's script would need an
``if __name__ == "__main__":`` guard. Its spans join the parent's trace: it records
under the parent's level span (and OpenTelemetry context) and sends its events back
when it stops.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from dlbricks.errors import DlbricksError
from dlbricks.model import Model
from dlbricks.profiling.options import ProfileOptions
from dlbricks.profiling.sessions import prepared, timed_intervals, warm
from dlbricks.profiling.tracing import Recorder, SpanRef, perf_to_epoch_ns
from dlbricks.timing import RunnerConfig, timed_runs
from dlbricks.timing.session import Runnable

__all__ = ["NO_HW_MESSAGE", "hw_level", "run_hw_jobs"]

#: Printed (with the reason) when the PMU is not available.
NO_HW_MESSAGE = "hardware counters unavailable on this machine ({reason}); skipping the hw level"

_Msg = Callable[[str], None]


def _hw_worker_main(conn: Any, setup: dict[str, Any]) -> None:
    """Worker (:func:`dlbricks.timing.workers.serve`): count and time bricks, one
    ``("result", dict)`` reply per job; its spans join the parent's trace, sent as
    ``("done", events)`` when it stops."""
    from dlbricks.timing.workers import serve

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import onnxruntime  # noqa: F401  (paid before "ready")

    rec, parent = Recorder.child(
        setup.get("otel"), setup.get("carrier"), setup.get("parent_id"), process_name=f"dlbricks hw worker {os.getpid()}"
    )

    def handle(job: Mapping[str, Any]) -> tuple[str, Any]:
        try:
            return "result", _hw_job(job, setup, rec, parent)
        except Exception as exc:  # one bad brick is that brick's failure
            msg = str(exc) if isinstance(exc, DlbricksError) else f"{type(exc).__name__}: {exc}"
            return "result", {"key": job["key"], "error": msg}

    try:
        serve(conn, handle)
    finally:
        rec.shutdown()
        with contextlib.suppress(OSError, EOFError):
            conn.send(("done", rec.events()))


def _median(xs: Sequence[float]) -> float | None:
    return float(np.median(xs)) if len(xs) else None


class _CountedRun:
    """``bound`` with a counter snapshot either side of each run, called the way
    :func:`timed_runs` calls a session (``run_fn(*run_args)``, two arguments), so
    that the snapshots are on the clock: counted less uncounted run time is what
    the hw level costs."""

    def __init__(self, bound: Runnable, counters: Any):
        fn, (a, b) = bound.run_fn, bound.run_args
        snapshot = counters.snapshot
        self.snapshots: list[tuple[Any, Any]] = []
        keep = self.snapshots.append

        def run(x: Any, y: Any) -> None:
            before = snapshot()
            fn(x, y)
            keep((before, snapshot()))

        self.run_fn = run
        self.run_args = (a, b)


def _counter_baseline(counters: Any) -> dict[str, float]:
    """What reading the counters itself counts (the syscalls, the Python between
    them), measured on empty intervals; subtracted from every counted run."""
    from dlbricks.profiling.perfevents import CounterSet

    empty: dict[str, list[float]] = {}
    for _ in range(7):
        for name, v in CounterSet.delta(counters.snapshot(), counters.snapshot()).items():
            empty.setdefault(name, []).append(v)
    return {k: float(np.median(v)) for k, v in empty.items()}


def _isolated(job: Mapping[str, Any], setup: Mapping[str, Any]) -> dict[str, Any]:
    from dlbricks.timing import Runner

    m = Runner(RunnerConfig.from_dict(setup["brick_config"])).time(
        job["bytes"], seed=int(setup["seed"]), int_bounds=job.get("int_bounds") or None
    )
    return {
        "median_us": m.stats.median / 1e3,
        "ci_low_us": m.stats.ci_low / 1e3,
        "ci_high_us": m.stats.ci_high / 1e3,
        "n": m.stats.n,
        "stop_reason": m.stop_reason,
    }


def _hw_job(job: Mapping[str, Any], setup: Mapping[str, Any], rec: Recorder, parent: SpanRef | None) -> dict[str, Any]:
    from dlbricks.profiling.perfevents import CounterSet, PerfUnavailable, derived_metrics

    cfg = RunnerConfig.from_dict(setup["config"])
    runs = int(setup["runs"])
    span = rec.start(f"brick {job['label']}", parent=parent, args={"brick_digest": job["key"], "label": job["label"]})
    out: dict[str, Any] = {"key": job["key"], "error": None}
    try:
        if job.get("isolated", True):
            s = rec.start("isolated timing (runner, counters off)", parent=span)
            out["isolated"] = _isolated(job, setup)
            rec.end(s, args={"median_us": out["isolated"]["median_us"], "n": out["isolated"]["n"]})
        s = rec.start("counted runs (counters on/off alternating)", parent=span)
        uncounted_ns: list[int] = []
        counted: list[tuple[int, int]] = []
        baseline: dict[str, float] = {}
        counted_run: _CountedRun | None = None
        with prepared(
            job["bytes"], cfg, seed=int(setup["seed"]), int_bounds=job.get("int_bounds") or None
        ) as (_, bound):
            warm(bound, int(setup["warmup"]))
            try:
                counters: CounterSet | None = CounterSet(setup["events"])
            except PerfUnavailable as exc:
                counters = None
                out["counters_error"] = str(exc)
            try:
                if counters is not None:
                    baseline = _counter_baseline(counters)
                    counted_run = _CountedRun(bound, counters)
                for _ in range(runs):
                    timed_runs(bound, 1, out=uncounted_ns)
                    if counted_run is not None:
                        counted.extend(timed_intervals(counted_run, 1))
            finally:
                if counters is not None:
                    out["events"] = counters.events
                    out["unavailable"] = counters.unavailable
                    counters.close()
        per_event: dict[str, list[float]] = {}
        for i, ((t0, t1), (before, after)) in enumerate(zip(counted, counted_run.snapshots if counted_run else [])):
            d = CounterSet.delta(before, after)
            d = {k: max(v - baseline.get(k, 0.0), 0.0) if math.isfinite(v) else v for k, v in d.items()}
            for name, v in d.items():
                per_event.setdefault(name, []).append(v)
            rec.add(
                f"counted run {i}",
                perf_to_epoch_ns(t0),
                perf_to_epoch_ns(t1),
                parent=s,
                args={"counters": {k: _finite(v) for k, v in d.items()}},
            )
        med = {k: _median([x for x in v if math.isfinite(x)]) for k, v in per_event.items()}
        out["counters"] = med
        out["counter_baseline"] = baseline
        out["derived"] = derived_metrics({k: v for k, v in med.items() if v is not None})
        out["counted_us"] = _median([(t1 - t0) / 1e3 for t0, t1 in counted])
        out["uncounted_us"] = _median([t / 1e3 for t in uncounted_ns])
        rec.end(s, args={"counted_us": out["counted_us"], "uncounted_us": out["uncounted_us"], "counters": med})
    finally:
        rec.end(span, args={k: out.get(k) for k in ("counters", "derived", "isolated", "error")})
    return out


def _finite(v: float) -> float | None:
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def run_hw_jobs(
    jobs: Sequence[dict[str, Any]],
    setup: dict[str, Any],
    rec: Recorder,
    timeout_s: float,
    say: _Msg,
    start_timeout_s: float = 120.0,
) -> tuple[dict[str, dict[str, Any]], list[int]]:
    """Run jobs in a worker (:func:`dlbricks.timing.workers.run_with_restart`: a fresh
    one after a crash or a timeout), started as a ``python -m`` interpreter
    (:class:`~dlbricks.profiling.worker.ModuleContext`); returns key -> result and the
    worker pids."""
    from dlbricks.profiling.worker import ModuleContext
    from dlbricks.timing.workers import Reply, Worker, run_with_restart

    results: dict[str, dict[str, Any]] = {}
    pids: list[int] = []
    ctx = ModuleContext()

    def start() -> Worker:
        worker = Worker(ctx, _hw_worker_main, (setup,), name="dlbricks-hw-worker", what="hw worker",
                        start_timeout_s=start_timeout_s)
        pids.append(int(worker.ready))
        return worker

    def on_reply(job: dict[str, Any], reply: Reply) -> None:
        if reply.lost is not None or reply.tag != "result":
            results[job["key"]] = {"key": job["key"], "error": f"worker crashed or timed out (exit code {reply.exitcode})"}
            return
        results[job["key"]] = reply.payload
        if len(results) % 25 == 0:
            say(f"hw level: {len(results)}/{len(jobs)} bricks")

    def stop(worker: Worker) -> None:
        """Stop the worker and merge the spans it sends as it stops."""
        last = worker.stop(last_message_s=60.0, join_s=10.0)
        events = last[1] if last is not None and last[0] == "done" else []
        rec.merge(events, process_name=f"dlbricks hw worker {int(worker.ready)}")

    run_with_restart(jobs, start, on_reply, timeout_s=timeout_s, stop=stop)
    return results, pids


def _overhead(r: Mapping[str, Any]) -> float | None:
    """Counted less uncounted run time of one job's result, when it has both."""
    if r.get("counted_us") is None or r.get("uncounted_us") is None:
        return None
    return r["counted_us"] - r["uncounted_us"]


def hw_level(
    model: Model,
    model_bytes: bytes,
    int_bounds: Mapping[str, int] | None,
    kernels: list[dict[str, Any]],
    opts: ProfileOptions,
    rec: Recorder,
    root: SpanRef,
    say: _Msg,
    warnings: list[str],
) -> dict[str, Any]:
    """Measure the hw level and add each kernel's counters and isolated brick time
    to its record in ``kernels`` (and, where the layer level ran, the ratio of its
    corrected in-model time to the isolated one).

    Args:
        model: the source model; ``model_bytes`` its whole-model form with
            ``int_bounds`` for its integer inputs.
        kernels: the kernel records (:func:`~dlbricks.profiling.join.kernel_records`).
        opts: the profile's options.
        rec, root: the trace and the span the level's span goes under.
        say, warnings: where one-line diagnostics and warnings go.

    Returns:
        The ``hw_level`` dict of the profile.

    Raises:
        DlbricksError: the worker cannot be started.
    """
    from dlbricks.bricks import generate_brick
    from dlbricks.profiling.perfevents import HARDWARE_EVENTS, probe

    avail = probe(opts.hw_events)
    hw_wanted = [e for e in opts.hw_events if e in HARDWARE_EVENTS]
    hw_missing = {e: why for e, why in avail.items() if e in hw_wanted and why is not None}
    events = [e for e, why in avail.items() if why is None]
    level: dict[str, Any] = {
        "events": events,
        "unavailable": {e: why for e, why in avail.items() if why is not None},
        "hardware_counters": bool(hw_wanted) and not hw_missing,
        "message": None,
    }
    if hw_wanted and len(hw_missing) == len(hw_wanted):
        reasons = sorted(set(hw_missing.values()))
        line = NO_HW_MESSAGE.format(reason="; ".join(reasons))
        if events:
            line += f" (still counting {', '.join(events)} per layer)"
        level["message"] = line
        say(line)
    elif hw_missing:
        warnings.append(f"hw level: not counted: {', '.join(sorted(hw_missing))}")

    s3 = rec.start("level 3: hw (per-layer bricks in a worker process)", parent=root)
    jobs: list[dict[str, Any]] = [
        {"key": "model", "label": f"whole model {model.name}", "bytes": model_bytes, "int_bounds": dict(int_bounds or {}),
         "isolated": False}
    ]
    seen: set[str] = set()
    if opts.hw_bricks:
        for k in kernels:
            key = k.get("brick_digest")
            if not key or key in seen:
                continue
            seen.add(key)
            members = [m["index"] for m in k["layers"]]
            proto, info = generate_brick(model, members, seed=opts.seed, digest=key, G=len(members))
            jobs.append({"key": key, "label": k["label"], "bytes": proto.SerializeToString(),
                         "int_bounds": dict(info.int_bounds), "isolated": True})
    setup = {
        "config": opts.config.to_dict(),
        "brick_config": opts.brick_config.to_dict(),
        "events": events,
        "runs": opts.brick_runs,
        "warmup": opts.warmup,
        "seed": opts.seed,
        "otel": rec.otel_config,
        "carrier": rec.carrier(s3),
        "parent_id": s3.id,
    }
    say(f"level 3 (hw): {len(jobs) - 1} bricks and the whole model in a worker process")
    results, pids = run_hw_jobs(jobs, setup, rec, opts.worker_timeout_s, say)
    failures = {k: r["error"] for k, r in results.items() if r.get("error")}
    for key, err in list(failures.items())[:5]:
        warnings.append(f"hw level: brick {key[:12]}: {err}")
    whole = results.get("model", {})
    level["worker_pids"] = pids
    level["bricks"] = len(jobs) - 1
    level["failed"] = len(failures)
    level["model"] = {
        "counted_us": whole.get("counted_us"),
        "uncounted_us": whole.get("uncounted_us"),
        "overhead_us": _overhead(whole),
        "counters": whole.get("counters"),
        "derived": whole.get("derived"),
    }
    ov = level["model"]["overhead_us"]
    level["overhead_rel"] = ov / whole["uncounted_us"] if ov is not None and whole.get("uncounted_us") else None
    bricks = {k: v for k, v in results.items() if k != "model"}
    level["overhead_per_brick_run_us"] = _median([x for x in map(_overhead, bricks.values()) if x is not None])
    rec.end(s3, args={"bricks": level["bricks"], "failed": level["failed"], "events": events,
                      "model_overhead_us": level["model"]["overhead_us"]})
    for k in kernels:
        b = bricks.get(k.get("brick_digest") or "")
        if b is None:
            continue
        k["isolated_us"] = (b.get("isolated") or {}).get("median_us")
        k["counters"] = b.get("counters")
        k["derived"] = b.get("derived")
        k["hw_overhead_us"] = _overhead(b)
        if k.get("corrected_us") is not None and k.get("isolated_us"):
            k["in_model_over_isolated"] = k["corrected_us"] / k["isolated_us"]
    return level

