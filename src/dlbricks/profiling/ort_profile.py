"""What onnxruntime reports about a run: its profiler's events, what the profiler
itself costs per kernel, and the graph it executed.

The calibration: onnxruntime's profiler does work inside each kernel span
(formatting shapes, building the event's arguments) and between spans (recording
the event). A calibration graph of trivial kernels (Sin and three-input Sum on a
few elements) is run profiled and then, in the same session after
``end_profiling()``, unprofiled. ``c_in`` = median kernel span - unprofiled in-run
time per node (an upper bound on a trivial kernel's own cost); ``c_total`` =
profiled - unprofiled time per node (fastest runs: noise only adds time) is the
whole per-kernel cost, and ``c_out = c_total - c_in`` lands in the gaps.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from dlbricks.errors import DlbricksError, first_line
from dlbricks.profiling.sessions import prepared, timed_intervals, warm
from dlbricks.timing import RunnerConfig

__all__ = ["OrtNode", "calibrate_profiler", "load_executed_graph", "parse_ort_profile", "read_profile"]

#: Calibration graph size (kernels).
_CAL_NODES = 100
_CALIBRATION_CACHE: dict[str, dict[str, float]] = {}


def parse_ort_profile(events: Sequence[Mapping[str, Any]], n_runs: int) -> list[dict[str, Any]]:
    """Split an onnxruntime profile into its last ``n_runs`` runs.

    Args:
        events: the JSON list onnxruntime writes (``end_profiling()``'s file).
        n_runs: how many runs, counted from the end (earlier ones were warm-up).

    Returns:
        One dict per run, in order: ``ts``/``dur`` of its ``model_run`` event (us,
        onnxruntime's clock) and ``kernels``, its ``*_kernel_time`` node events in
        start order as dicts ``name`` (node name), ``op``, ``provider``, ``ts``,
        ``dur``, ``args``.

    Raises:
        DlbricksError: fewer ``model_run`` events than ``n_runs``.
    """
    runs = sorted(
        (e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e["ts"]
    )
    if len(runs) < n_runs:
        raise DlbricksError(f"onnxruntime's profile holds {len(runs)} model runs, expected at least {n_runs}")
    runs = runs[len(runs) - n_runs :]
    nodes = sorted(
        (e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")),
        key=lambda e: e["ts"],
    )
    starts = np.array([e["ts"] for e in nodes], dtype=np.int64)
    out = []
    for r in runs:
        lo = int(np.searchsorted(starts, r["ts"], side="left"))
        hi = int(np.searchsorted(starts, r["ts"] + r["dur"], side="right"))
        kernels = []
        for e in nodes[lo:hi]:
            args = e.get("args") or {}
            kernels.append(
                {
                    "name": e["name"][: -len("_kernel_time")],
                    "op": args.get("op_name", ""),
                    "provider": args.get("provider", ""),
                    "ts": int(e["ts"]),
                    "dur": int(e["dur"]),
                    "args": args,
                }
            )
        out.append({"ts": int(r["ts"]), "dur": int(r["dur"]), "kernels": kernels})
    return out


def read_profile(path: str) -> list[dict[str, Any]]:
    """The events of the profile file ``end_profiling()`` wrote; the file is removed.

    Raises:
        DlbricksError: the file cannot be read or is not a list of events.
    """
    try:
        with open(path) as f:
            events = json.load(f)
    except (OSError, ValueError) as exc:
        raise DlbricksError(f"cannot read onnxruntime's profile {path}: {exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if not isinstance(events, list):
        raise DlbricksError(f"onnxruntime's profile {path} is not a list of events")
    return events


def _calibration_graph() -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    shape = [1, 1, 2, 4]
    nodes = []
    for i in range(_CAL_NODES):
        # Alternate a one-input kernel and a three-input one (an activation plus two
        # constants, like Conv's X, W, B), so the shape strings the profiler formats
        # inside the span are typical.
        if i % 2:
            nodes.append(helper.make_node("Sum", [f"t{i}", "a", "b"], [f"t{i + 1}"], name=f"cal{i}"))
        else:
            nodes.append(helper.make_node("Sin", [f"t{i}"], [f"t{i + 1}"], name=f"cal{i}"))
    inits = [
        numpy_helper.from_array(np.full(shape, 0.25, np.float32), "a"),
        numpy_helper.from_array(np.full(shape, -0.25, np.float32), "b"),
    ]
    graph = helper.make_graph(
        nodes,
        "dlbricks_profiler_calibration",
        [helper.make_tensor_value_info("t0", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(f"t{_CAL_NODES}", TensorProto.FLOAT, shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="dlbricks")
    model.ir_version = 8
    return model.SerializeToString()


def calibrate_profiler(config: RunnerConfig | None = None, runs: int = 30, *, refresh: bool = False) -> dict[str, float]:
    """Measure what onnxruntime's profiler costs per kernel, inside and outside spans
    (see the module docstring). Cached per runner configuration and process.

    Returns:
        ``in_span_us`` (c_in), ``out_span_us`` (c_out), ``total_us`` (c_total),
        ``trivial_kernel_us`` (unprofiled in-run time per node), ``span_us`` (median
        profiled span), ``nodes``, ``runs``.

    Raises:
        DlbricksError: onnxruntime fails.
    """
    cfg = config or RunnerConfig()
    key = f"{cfg.key()}:{runs}"
    if not refresh and key in _CALIBRATION_CACHE:
        return dict(_CALIBRATION_CACHE[key])
    data = _calibration_graph()
    with tempfile.TemporaryDirectory(prefix="dlbricks-cal-") as tmp, prepared(
        data, cfg, profile_prefix=os.path.join(tmp, "cal")
    ) as (session, bound):
        warm(bound, 5)
        prof = timed_intervals(bound, runs)
        events = read_profile(session.end_profiling())
        warm(bound, 5)
        unprof = timed_intervals(bound, runs)
    parsed = parse_ort_profile(events, runs)
    spans = [k["dur"] for r in parsed for k in r["kernels"]]
    # The profiler's cost is deterministic CPU work, and machine noise only adds
    # time: run totals use their minimum; spans (integer microseconds) their median.
    w_prof = min((b - a) / 1e3 for a, b in prof)
    w_unprof = min((b - a) / 1e3 for a, b in unprof)
    call = min((b - a) / 1e3 - r["dur"] for (a, b), r in zip(prof, parsed))
    trivial = max(w_unprof - max(call, 0.0), 0.0) / _CAL_NODES
    span = float(np.median(spans)) if spans else 0.0
    c_in = max(span - trivial, 0.0)
    c_total = max((w_prof - w_unprof) / _CAL_NODES, 0.0)
    result = {
        "in_span_us": c_in,
        "out_span_us": max(c_total - c_in, 0.0),
        "total_us": c_total,
        "trivial_kernel_us": trivial,
        "span_us": span,
        "nodes": float(_CAL_NODES),
        "runs": float(runs),
    }
    _CALIBRATION_CACHE[key] = result
    return dict(result)


@dataclass(frozen=True)
class OrtNode:
    """A node of the graph onnxruntime executes."""

    name: str
    op_type: str
    domain: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def load_executed_graph(path: str) -> list[OrtNode]:
    """The nodes of an optimised model saved by onnxruntime (weights not read).

    Raises:
        DlbricksError: the file cannot be read.
    """
    import onnx

    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception as exc:
        raise DlbricksError(f"cannot read onnxruntime's executed graph {path}: {first_line(exc)}") from exc
    return [OrtNode(n.name, n.op_type, n.domain, tuple(n.input), tuple(n.output)) for n in proto.graph.node]
