"""Across-stack profiling with levelled measurement (XSP) for onnxruntime on the CPU.

XSP's two ideas, applied to one ONNX model:

1. **Correlate every level of the stack in one trace.** The model run, the kernels
   onnxruntime executes (joined back to dlbricks' layers and brick digests) and the
   per-layer hardware counters (measured on each layer's brick in a worker
   process, whose spans join the same distributed trace) end up as nested spans
   in one Chrome/Perfetto trace and, optionally, one OpenTelemetry trace.
2. **Measure level by level.** Each level is measured in its own run, so the
   overhead of profiling one level never inflates the figures of the level above,
   and the overhead each level adds is itself measured and corrected for.

Levels:

``model``
    End-to-end latency with all profiling off: :class:`dlbricks.timing.Runner` on
    the whole model with synthetic weights (:func:`dlbricks.bricks.whole_model`,
    as end-to-end runs use, seeded like the bricks). The layer level profiles the
    very same bytes.
``layer``
    onnxruntime's profiler, its kernels attributed to the layers of the graph it
    executes and joined back to source layers (:mod:`.join`), and corrected for the profiler's own cost (:mod:`.layer`,
    :mod:`.ort_profile`).
``hw``
    Perf counters and the isolated time of each kernel's brick, in a worker
    process (:mod:`.hw`).

Overheads reported per level: layer level, profiled run time against the model
level (and against the same session with profiling off); hw level, counted runs
against uncounted runs of the same session.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any, Callable, Mapping

from dlbricks.model import Model
from dlbricks.profiling.hw import hw_level
from dlbricks.profiling.join import kernel_records
from dlbricks.profiling.layer import LayerRuns, layer_numbers, profile_runs, record_layer_spans
from dlbricks.profiling.options import ProfileOptions
from dlbricks.profiling.ort_profile import OrtNode, load_executed_graph
from dlbricks.profiling.render import fmt_pct, fmt_us
from dlbricks.profiling.sessions import open_session, timing_env
from dlbricks.profiling.tracing import Recorder, SpanRef, perf_to_epoch_ns

__all__ = ["PROFILE_SCHEMA_VERSION", "profile_model"]

PROFILE_SCHEMA_VERSION = 1

_Msg = Callable[[str], None]


def _context(options: ProfileOptions) -> dict[str, Any]:
    import onnxruntime as ort

    from dlbricks import __version__
    from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint

    fp = system_fingerprint()
    return {
        "dlbricks": __version__,
        "onnxruntime": ort.__version__,
        "python": fp["python"]["version"],
        "cpu": fp["cpu"]["model"],
        "logical_cores": fp["cpu"]["logical_cores"],
        "usable_cores": fp["cpu"]["usable_cores"],
        "system_id": fingerprint_id(fp),
        "intra_op_threads": options.config.intra_op_threads,
        "inter_op_threads": options.config.inter_op_threads,
        "runner_config": options.config.to_dict(),
        "brick_config": options.brick_config.to_dict(),
        "date_unix": time.time(),
    }


def _say_default(line: str) -> None:
    print(f"dlbricks profile: {line}", file=sys.stderr)


def _level_args(level: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in level.items() if isinstance(v, (int, float, str)) or v is None}


def _model_level(
    model_bytes: bytes, int_bounds: Mapping[str, int] | None, opts: ProfileOptions, rec: Recorder, root: SpanRef
) -> dict[str, Any]:
    from dlbricks.timing import Runner

    s1 = rec.start("level 1: model (profiling off)", parent=root)
    m = Runner(opts.config).time(model_bytes, seed=opts.seed, int_bounds=int_bounds)
    st = m.stats
    rec.end(s1, args={"latency_us": st.median / 1e3, "n": st.n, "ci_low_us": st.ci_low / 1e3,
                      "ci_high_us": st.ci_high / 1e3})
    return {
        "latency_us": st.median / 1e3,
        "ci_low_us": st.ci_low / 1e3,
        "ci_high_us": st.ci_high / 1e3,
        "min_us": st.min / 1e3,
        "n": st.n,
        "stop_reason": m.stop_reason,
        "warnings": m.warnings,
    }


def _executed_runs(
    model_bytes: bytes, int_bounds: Mapping[str, int] | None, opts: ProfileOptions, rec: Recorder, root: SpanRef
) -> tuple[LayerRuns | None, SpanRef | None, list[OrtNode]]:
    """The layer level's runs (with its span, left open for the kernel spans) and
    the graph onnxruntime executes, which the hw level needs too."""
    levels = opts.levels
    with tempfile.TemporaryDirectory(prefix="dlbricks-profile-") as tmp:
        graph_path = os.path.join(tmp, "executed.onnx")
        if "layer" in levels:
            s2 = rec.start("level 2: layer (onnxruntime profiler)", parent=root)
            lr = profile_runs(model_bytes, int_bounds, opts, os.path.join(tmp, "ort"), graph_path)
            return lr, s2, load_executed_graph(graph_path)
        if "hw" in levels:
            # Only to learn which layers each kernel covers.
            with timing_env(opts.config):
                open_session(model_bytes, opts.config, executed_graph_path=graph_path)
            return None, None, load_executed_graph(graph_path)
    return None, None, []


def _runtime_graph(
    model: Model, opts: ProfileOptions, rec: Recorder, root: SpanRef, warnings: list[str]
) -> Model | None:
    """The graph onnxruntime executes, loaded as a model with the session options the
    levels run with: its layers are the profile's kernels, under the same names. None,
    with a warning, when it cannot be built (the kernels are then joined to source
    layers only)."""
    from dlbricks.errors import DlbricksError, first_line
    from dlbricks.loading.runtime_graph import runtime_models

    span = rec.start("load the runtime graph (the kernels' layers)", parent=root)
    shapes = {name: tuple(t.shape) for name, t in model.inputs if t.shape}
    runtime: Model | None = None
    try:
        (runtime,) = runtime_models([model], config=opts.config, input_shapes=shapes or None)
    except DlbricksError as exc:
        warnings.append(f"the runtime graph cannot be loaded, so kernels are joined to source layers only: "
                        f"{first_line(exc)}")
    rec.end(span, args={"layers": runtime.n_layers if runtime is not None else 0})
    return runtime


def _op_type_totals(kernels: list[dict[str, Any]], reference_us: float) -> list[dict[str, Any]]:
    totals: dict[str, dict[str, Any]] = {}
    for k in kernels:
        t = totals.setdefault(k["label"], {"op_type": k["label"], "kernels": 0, "corrected_us": 0.0, "raw_us": 0.0})
        t["kernels"] += 1
        t["corrected_us"] += k["corrected_us"]
        t["raw_us"] += k["raw_us"]
    for t in totals.values():
        t["share"] = t["corrected_us"] / reference_us if reference_us else None
    return sorted(totals.values(), key=lambda t: -t["corrected_us"])


def profile_model(
    model: Model,
    options: ProfileOptions | None = None,
    *,
    recorder: Recorder | None = None,
    on_message: _Msg | None = _say_default,
) -> dict[str, Any]:
    """Profile one model level by level (see the module docstring).

    Args:
        model: the loaded model (:func:`dlbricks.loading.load`).
        options: levels, run counts, runner configurations.
        recorder: where spans go (Chrome trace, OpenTelemetry); a fresh one
            without OpenTelemetry when None. The caller writes its trace.
        on_message: receives one-line diagnostics (the hw-counter notice among
            them); they are also listed under ``messages``.

    Returns:
        A JSON-ready dict: ``schema_version``, ``context``, ``model``,
        ``model_level``, ``layer_level``, ``hw_level`` (None for levels not run),
        ``kernels`` (one record per executed kernel, execution order),
        ``op_types``, ``unassigned_layers``, ``messages``, ``warnings``.

    Raises:
        DlbricksError: onnxruntime cannot run the model, or the hw worker cannot start.
    """
    from dlbricks.bricks import whole_model

    opts = options or ProfileOptions()
    rec = recorder or Recorder()
    messages: list[str] = []
    warnings: list[str] = []

    def say(line: str) -> None:
        messages.append(line)
        if on_message is not None:
            on_message(line)

    levels = opts.levels
    root = rec.start(f"dlbricks profile {model.name}", args={"model": model.name, "levels": list(levels)})
    s = rec.start("build whole model (synthetic weights)", parent=root)
    proto, info = whole_model(model, seed=opts.seed)
    model_bytes = proto.SerializeToString()
    int_bounds = dict(info.int_bounds) or None
    del proto
    rec.end(s, args={"bytes": len(model_bytes)})

    result: dict[str, Any] = {
        "schema_version": PROFILE_SCHEMA_VERSION,
        "context": _context(opts),
        "model": {
            "name": model.name,
            "path": model.path,
            "layers": model.n_layers,
            "digest": info.digest,
            "weights": "synthetic (dlbricks.bricks.whole_model)",
        },
        "levels": list(levels),
        "model_level": None,
        "layer_level": None,
        "hw_level": None,
        "kernels": [],
        "op_types": [],
        "unassigned_layers": [],
        "messages": messages,
        "warnings": warnings,
    }

    t_model_us: float | None = None
    if "model" in levels:
        ml = result["model_level"] = _model_level(model_bytes, int_bounds, opts, rec, root)
        t_model_us = ml["latency_us"]
        warnings.extend(f"model level: {w}" for w in ml["warnings"])
        say(f"level 1 (model): {fmt_us(t_model_us)} median of {ml['n']} runs, profiling off")

    lr, s2, nodes = _executed_runs(model_bytes, int_bounds, opts, rec, root)
    kernels: list[dict[str, Any]] = []
    if nodes:
        runtime = _runtime_graph(model, opts, rec, root, warnings)
        kernels, result["join"], result["unassigned_layers"] = kernel_records(
            model, nodes, lr.runs if lr else [], warnings, runtime
        )
        del runtime
    result["kernels"] = kernels
    by_name = {k["kernel"]: k for k in kernels}

    if lr is not None:
        ll = result["layer_level"] = layer_numbers(lr, by_name, t_model_us, opts, warnings)
        say(
            f"level 2 (layer): {len(kernels)} kernels for {model.n_layers} layers; profiled run "
            f"{fmt_us(ll['profiled_wall_us'])} ({fmt_pct(ll.get('overhead_rel'))} vs model level)"
        )

    if "hw" in levels:
        result["hw_level"] = hw_level(model, model_bytes, int_bounds, kernels, opts, rec, root, say, warnings)

    if lr is not None and s2 is not None:
        result["op_types"] = _op_type_totals(kernels, result["layer_level"]["reference_us"])
        # After the hw level: the kernel spans carry its counters.
        record_layer_spans(rec, s2, lr, by_name)
        end_ns = max(perf_to_epoch_ns(lr.unprofiled[-1][1]), s2.start_ns)
        rec.end(s2, end_ns=end_ns, args=_level_args(result["layer_level"]))
    rec.end(root)
    return result
