"""The layer level: onnxruntime's profiler on the whole model, and its correction.

onnxruntime's profiler (``SessionOptions.enable_profiling``) records per-node kernel
events of ``runs`` timed runs; each is matched to its ``model_run`` event and to the
``perf_counter`` interval around the call. Then, in the same session and buffers
with profiling off, as many runs again: the reference that separates the
profiler's cost from session-to-session differences.

Correction (reconciliation with the model level). The profiler formats shapes and
builds each event's arguments *inside* the timed kernel span, and records the event
*between* spans, so raw kernel times over-state every kernel and their sum exceeds
the model latency on models with many small kernels. With the calibrated costs
``c_in`` and ``c_out`` (:func:`~dlbricks.profiling.ort_profile.calibrate_profiler`):

* every kernel span of the model holds ``c_in`` too, so ``c_in`` is capped at the
  model's smallest kernel time less the trivial kernel's own cost;
* the profiled runs, once the profiler's cost is out, split the run into kernel
  time ``K`` = sum over kernels of ``max(raw_k - c_in, 0)`` (raw_k the median of
  kernel k's per-run times) and framework time ``F`` = median gaps between
  kernels - ``c_out`` per kernel + the call time outside ``model_run``. Both
  come from the same runs, under the same machine load;
* **scale** ``s`` = model-level latency / (K + F) carries over what differs
  between the two levels' runs other than profiling (the sessions' memory
  placement, load that changed between the levels): ideally 1, and a warning
  says when it is off by more than 10%;
* corrected time of kernel k = ``s * max(raw_k - c_in, 0)``; the **framework
  overhead** is the rest of the model latency, ``s * F``. The reconciliation
  error before correction is (sum of raw_k - model latency) / model latency;
  after, (sum of corrected - model latency) / model latency = -F / (K + F).
  ``run_variation_us`` (the median run's kernel time less the sum of per-kernel
  medians) shows how much the runs varied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from dlbricks.profiling.options import ProfileOptions
from dlbricks.profiling.ort_profile import calibrate_profiler, parse_ort_profile, read_profile
from dlbricks.profiling.sessions import prepared, timed_intervals, warm
from dlbricks.profiling.tracing import Recorder, SpanRef, perf_to_epoch_ns

__all__ = ["LayerRuns", "layer_numbers", "profile_runs", "record_layer_spans"]


@dataclass
class LayerRuns:
    """The layer level's runs.

    Attributes:
        runs: onnxruntime's view of each profiled run (:func:`parse_ort_profile`).
        profiled: each profiled run's ``(start, end)`` in ``perf_counter_ns``.
        unprofiled: the same for the runs with profiling off.
        profile_start_ns: onnxruntime's profiling start (Unix epoch ns), the
            origin of its event times.
    """

    runs: list[dict[str, Any]]
    profiled: list[tuple[int, int]]
    unprofiled: list[tuple[int, int]]
    profile_start_ns: int


def profile_runs(
    model_bytes: bytes,
    int_bounds: Mapping[str, int] | None,
    opts: ProfileOptions,
    profile_prefix: str,
    executed_graph_path: str,
) -> LayerRuns:
    """Run the model under onnxruntime's profiler, then with it off in the same session;
    the graph onnxruntime executes is saved to ``executed_graph_path``.

    Raises:
        DlbricksError: onnxruntime cannot load or run the model, or its profile is short.
    """
    with prepared(
        model_bytes,
        opts.config,
        seed=opts.seed,
        int_bounds=int_bounds,
        profile_prefix=profile_prefix,
        executed_graph_path=executed_graph_path,
    ) as (session, bound):
        start_ns = int(session.get_profiling_start_time_ns())
        warm(bound, opts.warmup)
        profiled = timed_intervals(bound, opts.runs)
        events = read_profile(session.end_profiling())
        warm(bound, opts.warmup)
        unprofiled = timed_intervals(bound, opts.runs)
    return LayerRuns(parse_ort_profile(events, opts.runs), profiled, unprofiled, start_ns)


def layer_numbers(
    lr: LayerRuns,
    by_name: Mapping[str, dict[str, Any]],
    t_model_us: float | None,
    opts: ProfileOptions,
    warnings: list[str],
) -> dict[str, Any]:
    """Per-kernel raw and corrected times, overheads and the reconciliation (see
    the module docstring).

    Args:
        lr: the layer level's runs.
        by_name: kernel name -> its record; ``raw_us``, ``raw_runs_us``,
            ``corrected_us``, ``share``, ``gflops`` (FLOPs per second) and
            ``gops`` (FLOPs and integer ops per second) are set in it.
        t_model_us: the model level's latency (None: the unprofiled runs are the
            reference).
        opts: the profile's options (``calibrate``, ``config``).
        warnings: a scale far from 1 is reported here.

    Returns:
        The ``layer_level`` dict of the profile.
    """
    runs, prof_times, unprof_times = lr.runs, lr.profiled, lr.unprofiled
    n = len(runs)
    per_kernel: dict[str, list[float]] = {name: [0.0] * n for name in by_name}
    for i, r in enumerate(runs):
        for k in r["kernels"]:
            per_kernel.setdefault(k["name"], [0.0] * n)[i] += k["dur"]
    wall = [(b - a) / 1e3 for a, b in prof_times]
    wall_off = [(b - a) / 1e3 for a, b in unprof_times]
    dur = [float(r["dur"]) for r in runs]
    ksum = [float(sum(k["dur"] for k in r["kernels"])) for r in runs]
    gaps = [d - s for d, s in zip(dur, ksum)]
    call = [w - d for w, d in zip(wall, dur)]
    w_prof = float(np.median(wall))
    w_off = float(np.median(wall_off))
    kernels_per_run = float(np.median([len(r["kernels"]) for r in runs]))

    cal = calibrate_profiler(opts.config) if opts.calibrate else None
    c_in = cal["in_span_us"] if cal else 0.0
    c_out = cal["out_span_us"] if cal else 0.0
    raws = {name: float(np.median(per_kernel.get(name, [0.0] * n))) for name in by_name}
    capped = False
    if cal and raws:
        # Every kernel span of this model holds c_in: the smallest one bounds it.
        bound = max(min(raws.values()) - cal["trivial_kernel_us"], 0.0)
        if bound < c_in:
            c_in, capped = bound, True
    # K and F (see the module docstring), scaled to the reference.
    reference = t_model_us if t_model_us is not None else w_off
    kernel_time = sum(max(raw - c_in, 0.0) for raw in raws.values())
    framework_seen = max(float(np.median(gaps)) - kernels_per_run * c_out, 0.0) + max(float(np.median(call)), 0.0)
    unprofiled_estimate = kernel_time + framework_seen
    scale = reference / unprofiled_estimate if unprofiled_estimate > 0 else 1.0
    if abs(scale - 1.0) > 0.10:
        where = "model level" if t_model_us is not None else "unprofiled runs"
        warnings.append(
            f"the profiled runs less the profiler's cost came to {1 / scale - 1:+.1%} against the {where} "
            "(machine load changed between the levels, or the sessions differ); layer times are scaled to it"
        )
    raw_sum = corr_sum = 0.0
    for name, k in by_name.items():
        xs = per_kernel.get(name, [0.0] * n)
        raw = raws[name]
        corrected = scale * max(raw - c_in, 0.0)
        k["raw_us"] = raw
        k["raw_runs_us"] = xs
        k["corrected_us"] = corrected
        k["share"] = corrected / reference if reference > 0 else None
        k["gflops"] = k["flops"] / (corrected * 1e3) if corrected > 0 and k["flops"] else None
        # The rate of all its work: FLOPs and, for an int8 kernel, its integer ops.
        work = k["flops"] + k.get("int_ops", 0)
        k["gops"] = work / (corrected * 1e3) if corrected > 0 and work else None
        raw_sum += raw
        corr_sum += corrected
    framework = reference - corr_sum
    # A kernel's median and the median run need not coincide: on a busy machine
    # each run loses time in a different kernel, which no per-kernel median shows.
    variation = float(np.median(ksum)) - raw_sum
    level = {
        "runs": n,
        "kernels_per_run": kernels_per_run,
        "profiled_wall_us": w_prof,
        "profiled_model_run_us": float(np.median(dur)),
        "unprofiled_same_session_us": w_off,
        "reference_us": reference,
        "reference": "model level" if t_model_us is not None else "same session, profiling off",
        "overhead_us": w_prof - reference,
        "overhead_rel": (w_prof - reference) / reference if reference > 0 else None,
        "overhead_same_session_us": w_prof - w_off,
        # Profiling adds fixed work, machine noise only adds time: the fastest
        # runs give the steadier estimate on a busy machine.
        "overhead_same_session_min_us": min(wall) - min(wall_off),
        "profiled_wall_min_us": min(wall),
        "unprofiled_same_session_min_us": min(wall_off),
        "overhead_per_kernel_us": (w_prof - w_off) / kernels_per_run if kernels_per_run else None,
        "scale": scale,
        "profiler_cost_us": kernels_per_run * (c_in + c_out),
        "instrumentation": None if cal is None else {
            **cal, "calibrated_in_span_us": cal["in_span_us"], "in_span_us": c_in, "capped_by_model": capped},
        "raw_sum_us": raw_sum,
        "corrected_sum_us": corr_sum,
        "framework_overhead_us": framework,
        "framework_overhead_rel": framework / reference if reference > 0 else None,
        "framework_seen_in_profile_us": framework_seen,
        "run_variation_us": variation,
        "gap_us": float(np.median(gaps)),
        "call_us": float(np.median(call)),
        "error_before": (raw_sum - reference) / reference if reference > 0 else None,
        "error_after": (corr_sum - reference) / reference if reference > 0 else None,
    }
    return level


def record_layer_spans(
    rec: Recorder, level_span: SpanRef, lr: LayerRuns, by_name: Mapping[str, Mapping[str, Any]]
) -> None:
    """Spans: model run (the call) > onnxruntime model_run > one span per kernel,
    each kernel's span carrying its record; then one span for the unprofiled runs."""
    runs, prof_times, unprof_times, profile_start_ns = lr.runs, lr.profiled, lr.unprofiled, lr.profile_start_ns
    static_keys = ("kernel", "op", "provider", "match", "label", "brick_digest", "input_shapes", "output_shapes",
                   "flops", "int_ops", "bytes_min", "raw_us", "corrected_us", "share", "gops", "isolated_us",
                   "in_model_over_isolated", "counters", "derived", "hw_overhead_us")
    static: dict[str, dict[str, Any]] = {}
    for name, k in by_name.items():
        a = {key: k.get(key) for key in static_keys if k.get(key) is not None}
        a["layers"] = [m["name"] for m in k.get("layers", [])]
        a["op_types"] = [m["op_type"] for m in k.get("layers", [])]
        a["brick_digests"] = [m["brick_digest"] for m in k.get("layers", [])]
        rt = k.get("runtime_layer")
        if rt:
            a["runtime_layer"] = rt["name"]
            a["runtime_op_type"] = rt["op_type"]
        static[name] = a
    for i, ((t0, t1), r) in enumerate(zip(prof_times, runs)):
        start, end = perf_to_epoch_ns(t0), perf_to_epoch_ns(t1)
        ksum = sum(k["dur"] for k in r["kernels"])
        run_span = rec.add(
            f"model run {i} (profiled)", start, end, parent=level_span,
            args={"wall_us": (t1 - t0) / 1e3, "model_run_us": r["dur"], "kernels_us": ksum, "gap_us": r["dur"] - ksum},
        )
        # onnxruntime's clock (epoch us since its profiling start) against ours:
        # place its model_run inside our call interval, where it must lie.
        dur_ns = r["dur"] * 1000
        guess = profile_start_ns + r["ts"] * 1000
        shift = min(max(guess, start), max(end - dur_ns, start)) - guess
        mr_start = guess + shift
        mr_end = min(mr_start + dur_ns, end)
        mr = rec.add("onnxruntime model_run", mr_start, mr_end, parent=run_span, cat="onnxruntime",
                     args={"dur_us": r["dur"]})
        for k in r["kernels"]:
            ks = min(max(profile_start_ns + k["ts"] * 1000 + shift, mr_start), mr_end)
            ke = min(ks + k["dur"] * 1000, mr_end)
            args = dict(static.get(k["name"], {"kernel": k["name"], "op": k["op"]}))
            args["dur_us"] = k["dur"]
            rec.add(static.get(k["name"], {}).get("label", k["op"]) or k["name"], ks, ke, parent=mr, cat="kernel",
                    args=args)
    if unprof_times:
        t0, t1 = perf_to_epoch_ns(unprof_times[0][0]), perf_to_epoch_ns(unprof_times[-1][1])
        rec.add(
            f"same session, profiling off ({len(unprof_times)} runs)", t0, t1, parent=level_span,
            args={"median_us": float(np.median([(y - x) / 1e3 for x, y in unprof_times]))},
        )

