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
    onnxruntime's profiler (``SessionOptions.enable_profiling``): per-node kernel
    events of ``runs`` timed runs, each matched to its ``model_run`` event and to
    the ``perf_counter`` interval around the call. onnxruntime fuses nodes
    (Conv+BatchNormalization+Relu, Gemm+Relu, NCHWc layouts), so its node names are
    joined to source layers by :func:`join_layers`: node names, output tensor
    names and op/shape matches anchor kernels on layers, then fused layers join
    the kernel next to them that keeps the executed graph's edges consistent.
    Kernels inserted by onnxruntime (NCHWc reorders) have no source layer.
``hw``
    Each kernel's layers become a brick (:func:`dlbricks.bricks.generate_brick`:
    G=1 for an unfused layer; the fused layers together otherwise, so that
    onnxruntime fuses the brick exactly as it fused the model). A worker process
    (``spawn``) times every brick with the Runner (the *isolated* time) and counts
    its runs with Linux perf events (:mod:`dlbricks.profiling.perfevents`): cycles,
    instructions, cache and branch misses where the machine exposes a PMU, plus
    task clock, page faults and context switches. Without hardware counters one
    line says so and the level carries on with the software counters only. The
    whole model is counted the same way, alternating counted and uncounted runs,
    which gives the level's overhead.

Correction of the layer level (reconciliation with the model level):

onnxruntime's profiler costs ~5-30 us per kernel: formatting shapes and building
the event's arguments happens *inside* the timed kernel span, recording the event
happens *between* spans. So raw kernel times over-state every kernel, and their
sum exceeds the model latency on models with many small kernels. The correction:

* **in-span instrumentation** ``c_in`` is measured, not guessed: a calibration
  graph of 100 trivial kernels (Sin and three-input Sum on a few elements) is run
  profiled and then, in the same session after ``end_profiling()``, unprofiled.
  ``c_in`` = median kernel span - unprofiled in-run time per node (an upper bound
  on a trivial kernel's own cost). ``c_total`` = profiled - unprofiled time per
  node (fastest runs: noise only adds time) is the whole per-kernel cost, and
  ``c_out = c_total - c_in`` lands in the gaps. Every kernel span of the model
  holds ``c_in`` too, so ``c_in`` is capped at the model's smallest kernel time
  less the trivial kernel's own cost.
* the profiled runs, once the profiler's cost is out, split the run into kernel
  time ``K`` = sum over kernels of ``max(raw_k - c_in, 0)`` (raw_k the median of
  kernel k's per-run times) and framework time ``F`` = median gaps between
  kernels - ``c_out`` per kernel + the call time outside ``model_run``. Both
  come from the same runs, under the same machine load.
* **scale** ``s`` = model-level latency / (K + F) carries over what differs
  between the two levels' runs other than profiling (the sessions' memory
  placement, load that changed between the levels): ideally 1, and a warning
  says when it is off by more than 10%.
* corrected time of kernel k = ``s * max(raw_k - c_in, 0)``; the **framework
  overhead** is the rest of the model latency, ``s * F``. The reconciliation
  error before correction is (sum of raw_k - model latency) / model latency;
  after, (sum of corrected - model latency) / model latency = -F / (K + F).
  ``run_variation_us`` (the median run's kernel time less the sum of per-kernel
  medians) shows how much the runs varied.

Overheads reported per level: layer level, profiled run time against the model
level (and against the same session with profiling off); hw level, counted runs
against uncounted runs of the same session.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import math
import multiprocessing as mp
import os
import signal
import sys
from collections import Counter
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from dlbricks.errors import DlbricksError, UsageError
from dlbricks.model import Model
from dlbricks.timing import RunnerConfig
from dlbricks.profiling.tracing import Recorder, SpanRef, perf_to_epoch_ns

__all__ = [
    "LEVELS",
    "NO_HW_MESSAGE",
    "PROFILE_SCHEMA_VERSION",
    "Join",
    "OrtNode",
    "ProfileOptions",
    "calibrate_profiler",
    "join_layers",
    "load_executed_graph",
    "parse_levels",
    "parse_ort_profile",
    "profile_model",
    "render_profile",
]

PROFILE_SCHEMA_VERSION = 1
#: The levels, bottom of the stack last.
LEVELS = ("model", "layer", "hw")
#: Printed (with the reason) when the PMU is not available.
NO_HW_MESSAGE = "hardware counters unavailable on this machine ({reason}); skipping the hw level"
#: Kernels onnxruntime inserts that correspond to no source layer.
RUNTIME_OPS = frozenset({"ReorderInput", "ReorderOutput", "MemcpyFromHost", "MemcpyToHost"})
#: Calibration graph size (kernels).
_CAL_NODES = 100

_Msg = Callable[[str], None]


def parse_levels(text: str | Iterable[str]) -> tuple[str, ...]:
    """Parse ``model,layer,hw`` (any subset, any order) into canonical order.

    Raises:
        UsageError: an unknown level or none.
    """
    items = text.split(",") if isinstance(text, str) else list(text)
    chosen = {s.strip().lower() for s in items if s.strip()}
    bad = sorted(chosen - set(LEVELS))
    if bad:
        raise UsageError(f"--levels: unknown level {bad[0]!r} (choose from {', '.join(LEVELS)})")
    if not chosen:
        raise UsageError("--levels: no level given")
    return tuple(level for level in LEVELS if level in chosen)


def _default_brick_config() -> RunnerConfig:
    # Bricks are many: sample each briefly (a 5% CI is plenty to compare a layer's
    # isolated time with its in-model time).
    return RunnerConfig(warmup_iters=2, warmup_time=0.01, min_iters=5, min_time=0.02, max_time=0.25, target_ci=0.05)


@dataclass(frozen=True)
class ProfileOptions:
    """What to measure and how.

    Attributes:
        levels: a subset of :data:`LEVELS`.
        runs: profiled runs at the layer level (as many unprofiled runs follow).
        warmup: discarded runs before each timed block.
        brick_runs: counted runs per brick at the hw level (as many uncounted
            runs are interleaved).
        hw_bricks: run every kernel's brick at the hw level; False counts the
            whole model only.
        config: runner configuration of the model and layer levels.
        brick_config: runner configuration of the isolated brick timings.
        seed: input (and weight) seed.
        hw_events: perf events to count at the hw level.
        calibrate: measure the profiler's in-span cost (else it is taken as 0).
        worker_timeout_s: limit per hw-level job (session creation included).
    """

    levels: tuple[str, ...] = LEVELS
    runs: int = 10
    warmup: int = 3
    brick_runs: int = 10
    hw_bricks: bool = True
    config: RunnerConfig = field(default_factory=RunnerConfig)
    brick_config: RunnerConfig = field(default_factory=_default_brick_config)
    seed: int = 0
    hw_events: tuple[str, ...] = ()
    calibrate: bool = True
    worker_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", parse_levels(self.levels))
        for name in ("runs", "brick_runs"):
            if int(getattr(self, name)) < 1:
                raise UsageError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        if int(self.warmup) < 0:
            raise UsageError(f"warmup must be >= 0, got {self.warmup!r}")
        if not self.hw_events:
            from dlbricks.profiling.perfevents import HARDWARE_EVENTS, SOFTWARE_EVENTS

            object.__setattr__(self, "hw_events", HARDWARE_EVENTS + SOFTWARE_EVENTS)


# --------------------------------------------------------------------------- sessions


def _create_session(
    model_bytes: bytes,
    cfg: RunnerConfig,
    *,
    profile_prefix: str | None = None,
    executed_graph_path: str | None = None,
) -> Any:
    """A CPU session with the runner's options, optionally profiling and/or saving
    the graph onnxruntime executes (weights go to a side file, never read back).

    Raises:
        DlbricksError: onnxruntime rejects the model.
    """
    import onnxruntime as ort

    from dlbricks.timing import session_options

    so = session_options(cfg)
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    if executed_graph_path is not None:
        so.optimized_model_filepath = executed_graph_path
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", os.path.basename(executed_graph_path) + ".data"
        )
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    try:
        return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own pybind types
        raise DlbricksError(f"onnxruntime cannot load the model: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextlib.contextmanager
def _timing_env(cfg: RunnerConfig) -> Any:
    """Pinning and flush-to-zero as the Runner sets them around its loop."""
    from dlbricks.timing.fpenv import FloatEnv
    from dlbricks.timing.session import pinned

    fenv = FloatEnv()
    try:
        with pinned(cfg.cores):
            yield fenv
    finally:
        fenv.restore()


def _timed_runs(bound: Any, n: int) -> list[tuple[int, int]]:
    """``n`` runs, each bracketed by two ``perf_counter_ns`` reads (GC off)."""
    run, args = bound.run_fn, bound.run_args
    clock = time.perf_counter_ns
    out: list[tuple[int, int]] = []
    append = out.append
    gc_on = gc.isenabled()
    gc.disable()
    try:
        for _ in range(n):
            t0 = clock()
            run(*args)
            t1 = clock()
            append((t0, t1))
    finally:
        if gc_on:
            gc.enable()
    return out


def _warm(bound: Any, n: int) -> None:
    for _ in range(n):
        bound.run_fn(*bound.run_args)


# --------------------------------------------------------------------------- onnxruntime's profile


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


def _read_profile(path: str) -> list[dict[str, Any]]:
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


# --------------------------------------------------------------------------- calibration

_CALIBRATION_CACHE: dict[str, dict[str, float]] = {}


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
    """Measure what onnxruntime's profiler costs per kernel, inside and outside spans.

    A graph of trivial kernels is run ``runs`` times profiled, then, in the same
    session after ``end_profiling()``, ``runs`` times unprofiled. Cached per
    runner configuration and process.

    Returns:
        ``in_span_us`` (c_in), ``out_span_us`` (c_out), ``total_us`` (c_total),
        ``trivial_kernel_us`` (unprofiled in-run time per node), ``span_us`` (median
        profiled span), ``nodes``, ``runs``.

    Raises:
        DlbricksError: onnxruntime fails.
    """
    from dlbricks.timing import bind, make_inputs

    cfg = config or RunnerConfig()
    key = f"{cfg.key()}:{runs}"
    if not refresh and key in _CALIBRATION_CACHE:
        return dict(_CALIBRATION_CACHE[key])
    data = _calibration_graph()
    with tempfile.TemporaryDirectory(prefix="dlbricks-cal-") as tmp, _timing_env(cfg) as fenv:
        session = _create_session(data, cfg, profile_prefix=os.path.join(tmp, "cal"))
        fenv.set_flush(cfg.denormals_as_zero)
        bound = bind(session, make_inputs(data, 0))
        _warm(bound, 5)
        prof = _timed_runs(bound, runs)
        events = _read_profile(session.end_profiling())
        _warm(bound, 5)
        unprof = _timed_runs(bound, runs)
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


# --------------------------------------------------------------------------- joining kernels to layers


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
        raise DlbricksError(f"cannot read onnxruntime's executed graph {path}: {_first_line(exc)}") from exc
    return [
        OrtNode(n.name, n.op_type, n.domain, tuple(n.input), tuple(n.output)) for n in proto.graph.node
    ]


@dataclass
class Join:
    """Which source layers each executed kernel covers.

    Attributes:
        layers: kernel (onnxruntime node name) -> source layer indices, ascending.
        how: kernel -> ``"name"`` (its name names a layer or a layer's output),
            ``"output"`` (it produces a layer's output tensor), ``"shape"`` (the
            only unjoined layer of its op type and output shape), ``"runtime"``
            (inserted by onnxruntime: layout reorders, copies) or ``"unmatched"``.
        unassigned: source layers no kernel covers (removed by onnxruntime, or
            not joined).
        violations: source edges between two kernels that the executed graph
            does not connect in the same direction (0 for a consistent join).
    """

    layers: dict[str, list[int]]
    how: dict[str, str]
    unassigned: list[int]
    violations: int

    def kernel_of_layer(self) -> dict[int, str]:
        return {li: k for k, ls in self.layers.items() for li in ls}


def _name_forms(name: str) -> list[str]:
    """``"fused n16"`` -> n16...; ``"r8_bn_nchwc"`` -> r8_bn_nchwc, r8_bn, r8."""
    forms: list[str] = []
    bases = [name]
    parts = name.split()
    if len(parts) > 1:
        bases.append(parts[-1])
    for base in bases:
        s = base
        while True:
            if s not in forms:
                forms.append(s)
            if "_" not in s:
                break
            s = s.rsplit("_", 1)[0]
    return forms


def _nearest_of_op(
    model: Model, start: Sequence[int], op: str, nbrs: Sequence[Sequence[int]], assign: Mapping[int, int], depth: int = 4
) -> int | None:
    """Breadth-first from ``start`` along ``nbrs`` through unclaimed layers: the
    first unclaimed layer of type ``op`` within ``depth`` steps."""
    frontier = list(start)
    seen = set(start)
    for _ in range(depth):
        nxt = []
        for li in frontier:
            for n in nbrs[li]:
                if n in seen or n in assign:
                    continue
                seen.add(n)
                if model.layers[n].op_type == op:
                    return n
                nxt.append(n)
        frontier = nxt
    return None


def _canonical_op(op: str) -> str:
    return op[len("Fused") :] if op.startswith("Fused") and len(op) > len("Fused") else op


def join_layers(
    model: Model,
    nodes: Sequence[OrtNode],
    output_shapes: Mapping[str, Sequence[Sequence[int]]] | None = None,
) -> Join:
    """Join the nodes onnxruntime executes to the model's source layers.

    1. Anchors: (a) a node whose name (or a prefix of it up to an ``_``, or its
       last word: ``r1_nchwc``, ``fused n16``) is a layer's name or a layer's output
       tensor; (b) a node producing a layer's output tensor; (c) a node whose op
       type (``Fused`` stripped) and output shape match exactly one unjoined layer
       placed consistently; (d) a kernel holding no layer of its own op type (it
       was named after a fused activation) takes the nearest unjoined layer of
       that type, upstream first.
    2. Fused layers: only op types with more layers than kernels can have been
       fused away. Such a layer joins the kernel of a producer (fusions absorb the
       ops after a Conv/Gemm), else of a consumer, choosing only kernels that keep
       every joined neighbour on the right side in the executed graph; repeated
       to a fixed point.

    Args:
        model: the source model (the same graph onnxruntime was given).
        nodes: the executed graph's nodes (:func:`load_executed_graph`).
        output_shapes: kernel -> output shapes seen in the profile (for step 1c).

    Returns:
        The :class:`Join`.
    """
    n_nodes = len(nodes)
    producer = model.producers()
    layer_by_name = {layer.name: layer.index for layer in model.layers}
    # Executed-graph edges and descendant sets (Python ints as bitsets).
    ort_prod: dict[str, int] = {}
    for k, node in enumerate(nodes):
        for t in node.outputs:
            if t:
                ort_prod[t] = k
    succs: list[set[int]] = [set() for _ in nodes]
    indeg = [0] * n_nodes
    for k, node in enumerate(nodes):
        for t in set(node.inputs):
            j = ort_prod.get(t)
            if j is not None and j != k and k not in succs[j]:
                succs[j].add(k)
                indeg[k] += 1
    order = [k for k in range(n_nodes) if indeg[k] == 0]
    for k in order:  # Kahn; appending while iterating visits every node once
        for s in sorted(succs[k]):
            indeg[s] -= 1
            if indeg[s] == 0:
                order.append(s)
    desc = [0] * n_nodes
    for k in reversed(order):
        bits = 0
        for s in succs[k]:
            bits |= desc[s] | (1 << s)
        desc[k] = bits

    def reaches(a: int, b: int) -> bool:
        return a == b or bool((desc[a] >> b) & 1)

    assign: dict[int, int] = {}
    how: dict[int, str] = {}
    runtime = {k for k, node in enumerate(nodes) if node.op_type in RUNTIME_OPS}
    for k in runtime:
        how[k] = "runtime"
    # 1a. names
    for k, node in enumerate(nodes):
        if k in runtime:
            continue
        for form in _name_forms(node.name):
            li = layer_by_name.get(form)
            if li is None and form in producer:
                li = producer[form][0]
            if li is None:
                continue
            if li not in assign:
                assign[li] = k
                how[k] = "name"
            break
    # 1b. output tensors
    for k, node in enumerate(nodes):
        if k in runtime:
            continue
        for t in node.outputs:
            p = producer.get(t)
            if p is not None and p[0] not in assign:
                assign[p[0]] = k
                how.setdefault(k, "output")

    preds_l: list[list[int]] = [[] for _ in model.layers]
    succs_l: list[list[int]] = [[] for _ in model.layers]
    for s, d in zip(model.edge_src.tolist(), model.edge_dst.tolist()):
        if s != d:
            if s not in preds_l[d]:
                preds_l[d].append(s)
            if d not in succs_l[s]:
                succs_l[s].append(d)

    def consistent(li: int, g: int) -> bool:
        for p in preds_l[li]:
            h = assign.get(p)
            if h is not None and h != g and not reaches(h, g):
                return False
        for s in succs_l[li]:
            h = assign.get(s)
            if h is not None and h != g and not reaches(g, h):
                return False
        return True

    # 1c. op type and output shape
    shapes = output_shapes or {}
    for k, node in enumerate(nodes):
        if k in how:
            continue
        op = _canonical_op(node.op_type)
        want = shapes.get(node.name)
        cands = []
        for layer in model.layers:
            if layer.index in assign or layer.op_type != op or not consistent(layer.index, k):
                continue
            if want and "nchwc" not in node.domain:
                got = [tuple(t.shape) for t in layer.output_types if t is not None]
                if got[:1] != [tuple(want[0])]:
                    continue
            cands.append(layer.index)
        if len(cands) == 1:
            assign[cands[0]] = k
            how[k] = "shape"

    # 1d. the kernel's own op: a kernel named after a fused activation (r63_nchwc
    # is Conv+Relu, named after the Relu's output) also holds the nearest layer of
    # its op type, upstream first, through layers no kernel has claimed.
    members_of: dict[int, list[int]] = {}
    for li, k in assign.items():
        members_of.setdefault(k, []).append(li)
    for k, lis in sorted(members_of.items()):
        op = _canonical_op(nodes[k].op_type)
        if any(model.layers[li].op_type == op for li in lis):
            continue
        for nbrs in (preds_l, succs_l):
            found = _nearest_of_op(model, lis, op, nbrs, assign)
            if found is not None and consistent(found, k):
                assign[found] = k
                break

    # 2. fused layers, to a fixed point. Only op types with more layers than
    # kernels can have been fused away (a model with 26 Conv layers and 26 Conv
    # kernels fused none of them into anything else).
    kernel_ops = Counter(_canonical_op(node.op_type) for k, node in enumerate(nodes) if k not in runtime)
    layer_ops = Counter(layer.op_type for layer in model.layers)
    absorbable = {op for op, n in layer_ops.items() if n > kernel_ops.get(op, 0)}
    from dlbricks.graph import topo_order

    topo = [int(i) for i in topo_order(model) if model.layers[int(i)].op_type in absorbable]
    position = {k: i for i, k in enumerate(order)}
    changed = True
    while changed:
        changed = False
        for li in topo:
            if li in assign:
                continue
            groups = list(dict.fromkeys(assign[p] for p in preds_l[li] if p in assign))
            ok = [g for g in groups if consistent(li, g)]
            if ok:
                # Several consistent producers: the most downstream one.
                assign[li] = max(ok, key=position.__getitem__)
                changed = True
        for li in reversed(topo):
            if li in assign:
                continue
            groups = list(dict.fromkeys(assign[s] for s in succs_l[li] if s in assign))
            ok = [g for g in groups if consistent(li, g)]
            if ok:
                assign[li] = min(ok, key=position.__getitem__)
                changed = True

    violations = 0
    for s, d in zip(model.edge_src.tolist(), model.edge_dst.tolist()):
        gs, gd = assign.get(s), assign.get(d)
        if gs is not None and gd is not None and gs != gd and not reaches(gs, gd):
            violations += 1
    layers: dict[str, list[int]] = {node.name: [] for node in nodes}
    for li, k in assign.items():
        layers[nodes[k].name].append(li)
    for v in layers.values():
        v.sort()
    how_named = {
        node.name: how.get(k, "unmatched" if not layers[node.name] else "fused") for k, node in enumerate(nodes)
    }
    unassigned = sorted(set(range(model.n_layers)) - set(assign))
    return Join(layers=layers, how=how_named, unassigned=unassigned, violations=violations)


# --------------------------------------------------------------------------- per-kernel records


def _brick_digests(model: Model) -> list[str]:
    """Each layer's G=1 brick digest (the sequence digest the store keys bricks by)."""
    from dlbricks.graph import split

    sp = split(model, 1)
    of = sp.sequence_of_layer()
    hexes = sp.hex_digests()
    return [hexes[int(of[i])] for i in range(model.n_layers)]


def _group_key(model: Model, members: Sequence[int], g1: Sequence[str]) -> str:
    """The brick digest of a kernel: the G=1 digest for one layer; for fused layers
    a BLAKE2b-128 over their G=1 digests and internal edges (a local key that
    dedups identical fused bricks within the run)."""
    if len(members) == 1:
        return g1[members[0]]
    pos = {m: i for i, m in enumerate(members)}
    h = hashlib.blake2b(digest_size=16)
    h.update(b"DLBFUSED" + len(members).to_bytes(4, "little"))
    for m in members:
        h.update(bytes.fromhex(g1[m]))
    edges = sorted(
        (pos[s], ss, pos[d], ds)
        for s, ss, d, ds in zip(
            model.edge_src.tolist(), model.edge_src_slot.tolist(), model.edge_dst.tolist(), model.edge_dst_slot.tolist()
        )
        if s in pos and d in pos
    )
    for e in edges:
        h.update(b"".join(int(x).to_bytes(4, "little") for x in e))
    return h.hexdigest()


def _layer_record(model: Model, li: int, g1: Sequence[str]) -> dict[str, Any]:
    from dlbricks.roofline.costmodel import layer_cost

    layer = model.layers[li]
    try:
        cost = layer_cost(layer)
        flops, bytes_min, has_formula = cost.flops, cost.bytes_min, cost.has_formula
    except (TypeError, ValueError):
        flops, bytes_min, has_formula = 0, 0, False
    return {
        "index": li,
        "name": layer.name,
        "op_type": layer.kind,
        "inputs": [str(t) for t in layer.input_types if t is not None],
        "outputs": [str(t) for t in layer.output_types if t is not None],
        "brick_digest": g1[li],
        "flops": int(flops),
        "bytes_min": int(bytes_min),
        "has_formula": bool(has_formula),
    }


def _event_shapes(event: Mapping[str, Any], key: str) -> list[list[int]]:
    """Shapes from a kernel event's ``input_type_shape``/``output_type_shape``
    argument (a list of ``{"float": [1, 64, 56, 56]}``)."""
    items = (event.get("args") or {}).get(key) or []
    return [list(next(iter(x.values()))) for x in items if isinstance(x, dict) and x]


def _label(members: Sequence[Mapping[str, Any]], op: str) -> str:
    if not members:
        return op or "?"
    return "+".join(dict.fromkeys(m["op_type"] for m in members))


# --------------------------------------------------------------------------- hw level worker


def _hw_worker_main(conn: Any, setup: dict[str, Any]) -> None:
    """Worker: count and time bricks; reply per job; its spans join the parent's trace."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import onnxruntime  # noqa: F401  (paid before "ready")

    rec, parent = Recorder.child(
        setup.get("otel"), setup.get("carrier"), setup.get("parent_id"), process_name=f"dlbricks hw worker {os.getpid()}"
    )
    conn.send(("ready", os.getpid()))
    try:
        while True:
            try:
                job = conn.recv()
            except EOFError:
                return
            if job is None:
                break
            try:
                result = _hw_job(job, setup, rec, parent)
            except Exception as exc:  # one bad brick is that brick's failure
                msg = str(exc) if isinstance(exc, DlbricksError) else f"{type(exc).__name__}: {exc}"
                result = {"key": job["key"], "error": msg}
            conn.send(("result", result))
    finally:
        rec.shutdown()
        with contextlib.suppress(OSError, EOFError):
            conn.send(("done", rec.events()))


def _median(xs: Sequence[float]) -> float | None:
    return float(np.median(xs)) if len(xs) else None


def _hw_job(job: Mapping[str, Any], setup: Mapping[str, Any], rec: Recorder, parent: SpanRef | None) -> dict[str, Any]:
    from dlbricks.profiling.perfevents import CounterSet, PerfUnavailable, derived_metrics
    from dlbricks.timing import Runner, bind, make_inputs

    cfg = RunnerConfig.from_dict(setup["config"])
    runs = int(setup["runs"])
    span = rec.start(f"brick {job['label']}", parent=parent, args={"brick_digest": job["key"], "label": job["label"]})
    out: dict[str, Any] = {"key": job["key"], "error": None}
    try:
        if job.get("isolated", True):
            s = rec.start("isolated timing (runner, counters off)", parent=span)
            m = Runner(RunnerConfig.from_dict(setup["brick_config"])).time(
                job["bytes"], seed=int(setup["seed"]), int_bounds=job.get("int_bounds") or None
            )
            out["isolated"] = {
                "median_us": m.stats.median / 1e3,
                "ci_low_us": m.stats.ci_low / 1e3,
                "ci_high_us": m.stats.ci_high / 1e3,
                "n": m.stats.n,
                "stop_reason": m.stop_reason,
            }
            rec.end(s, args={"median_us": out["isolated"]["median_us"], "n": m.stats.n})
        s = rec.start("counted runs (counters on/off alternating)", parent=span)
        with _timing_env(cfg) as fenv:
            session = _create_session(job["bytes"], cfg)
            fenv.set_flush(cfg.denormals_as_zero)
            bound = bind(session, make_inputs(job["bytes"], int(setup["seed"]), int_bounds=job.get("int_bounds") or None))
            _warm(bound, int(setup["warmup"]))
            try:
                counters: CounterSet | None = CounterSet(setup["events"])
            except PerfUnavailable as exc:
                counters = None
                out["counters_error"] = str(exc)
            counted: list[float] = []
            uncounted: list[float] = []
            per_event: dict[str, list[float]] = {}
            # What reading the counters itself counts (the syscalls, the Python
            # between them): measured on empty intervals and subtracted per run.
            baseline: dict[str, float] = {}
            if counters is not None:
                empty: dict[str, list[float]] = {}
                for _ in range(7):
                    d0 = CounterSet.delta(counters.snapshot(), counters.snapshot())
                    for name, v in d0.items():
                        empty.setdefault(name, []).append(v)
                baseline = {k: float(np.median(v)) for k, v in empty.items()}
            run_spans: list[tuple[int, int, dict[str, float]]] = []
            clock = time.perf_counter_ns
            fn, args = bound.run_fn, bound.run_args
            gc_on = gc.isenabled()
            gc.disable()
            try:
                for _ in range(runs):
                    t0 = clock()
                    fn(*args)
                    t1 = clock()
                    uncounted.append((t1 - t0) / 1e3)
                    if counters is not None:
                        t0 = clock()
                        before = counters.snapshot()
                        fn(*args)
                        after = counters.snapshot()
                        t1 = clock()
                        d = CounterSet.delta(before, after)
                        d = {k: max(v - baseline.get(k, 0.0), 0.0) if math.isfinite(v) else v for k, v in d.items()}
                        for name, v in d.items():
                            per_event.setdefault(name, []).append(v)
                        counted.append((t1 - t0) / 1e3)
                        run_spans.append((t0, t1, d))
            finally:
                if gc_on:
                    gc.enable()
                if counters is not None:
                    out["events"] = counters.events
                    out["unavailable"] = counters.unavailable
                    counters.close()
        for i, (t0, t1, d) in enumerate(run_spans):
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
        out["counted_us"] = _median(counted)
        out["uncounted_us"] = _median(uncounted)
        rec.end(s, args={"counted_us": out["counted_us"], "uncounted_us": out["uncounted_us"], "counters": med})
    finally:
        rec.end(span, args={k: out.get(k) for k in ("counters", "derived", "isolated", "error")})
    return out


def _finite(v: float) -> float | None:
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


class _HwWorker:
    def __init__(self, setup: dict[str, Any], start_timeout_s: float = 120.0):
        from dlbricks.timing.workers import start_worker

        self.proc, self.conn, pid = start_worker(
            mp.get_context("spawn"), _hw_worker_main, (setup,), name="dlbricks-hw-worker", what="hw worker",
            start_timeout_s=start_timeout_s,
        )
        self.pid = int(pid)

    def run(self, job: Mapping[str, Any], timeout_s: float) -> dict[str, Any] | None:
        """The job's result, or None when the worker died or timed out (then it is gone)."""
        try:
            self.conn.send(dict(job))
            ready = self.conn.poll(timeout_s)
        except (OSError, EOFError):
            ready = True
        if not ready:
            self.kill()
            return None
        try:
            tag, payload = self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            return None
        return payload if tag == "result" else None

    def finish(self, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Stop the worker and collect its spans."""
        events: list[dict[str, Any]] = []
        try:
            self.conn.send(None)
            if self.conn.poll(timeout_s):
                tag, payload = self.conn.recv()
                if tag == "done":
                    events = payload
        except (OSError, EOFError):
            pass
        self.proc.join(10.0)
        self.kill()
        return events

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)
        self.conn.close()


def _run_hw_jobs(
    jobs: Sequence[dict[str, Any]],
    setup: dict[str, Any],
    rec: Recorder,
    timeout_s: float,
    say: _Msg,
) -> tuple[dict[str, dict[str, Any]], list[int]]:
    """Run jobs in a worker (restarted after a crash); returns key -> result and the worker pids."""
    results: dict[str, dict[str, Any]] = {}
    pids: list[int] = []
    worker: _HwWorker | None = None
    try:
        for i, job in enumerate(jobs):
            if worker is None:
                worker = _HwWorker(setup)
                pids.append(worker.pid)
            res = worker.run(job, timeout_s)
            if res is None:
                code = worker.proc.exitcode
                results[job["key"]] = {"key": job["key"], "error": f"worker crashed or timed out (exit code {code})"}
                worker = None
                continue
            results[job["key"]] = res
            if (i + 1) % 25 == 0:
                say(f"hw level: {i + 1}/{len(jobs)} bricks")
    finally:
        if worker is not None:
            rec.merge(worker.finish(), process_name=f"dlbricks hw worker {worker.pid}")
    return results, pids


# --------------------------------------------------------------------------- the profile


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


def profile_model(
    model: Model,
    options: ProfileOptions | None = None,
    *,
    recorder: Recorder | None = None,
    on_message: _Msg | None = _say_default,
) -> dict[str, Any]:
    """Profile one model level by level (see the module docstring).

    Args:
        model: the loaded model (:func:`dlbricks.loading.onnx_io.load`).
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
    from dlbricks.timing import Runner, bind, make_inputs

    opts = options or ProfileOptions()
    rec = recorder or Recorder()
    messages: list[str] = []
    warnings: list[str] = []

    def say(line: str) -> None:
        messages.append(line)
        if on_message is not None:
            on_message(line)

    levels = opts.levels
    cfg = opts.config
    root = rec.start(f"dlbricks profile {model.name}", args={"model": model.name, "levels": list(levels)})
    s = rec.start("build whole model (synthetic weights)", parent=root)
    proto, info = whole_model(model, seed=opts.seed)
    model_bytes = proto.SerializeToString()
    int_bounds = dict(info.int_bounds) or None
    del proto
    rec.end(s, args={"bytes": len(model_bytes)})
    g1 = _brick_digests(model)

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

    # ---- level 1: model
    t_model_us: float | None = None
    if "model" in levels:
        s1 = rec.start("level 1: model (profiling off)", parent=root)
        m = Runner(cfg).time(model_bytes, seed=opts.seed, int_bounds=int_bounds)
        t_model_us = m.stats.median / 1e3
        result["model_level"] = {
            "latency_us": t_model_us,
            "ci_low_us": m.stats.ci_low / 1e3,
            "ci_high_us": m.stats.ci_high / 1e3,
            "min_us": m.stats.min / 1e3,
            "n": m.stats.n,
            "stop_reason": m.stop_reason,
            "warnings": m.warnings,
        }
        warnings.extend(f"model level: {w}" for w in m.warnings)
        rec.end(s1, args={"latency_us": t_model_us, "n": m.stats.n, "ci_low_us": m.stats.ci_low / 1e3,
                          "ci_high_us": m.stats.ci_high / 1e3})
        say(f"level 1 (model): {_fmt_us(t_model_us)} median of {m.stats.n} runs, profiling off")

    tmp = tempfile.TemporaryDirectory(prefix="dlbricks-profile-")
    try:
        graph_path = os.path.join(tmp.name, "executed.onnx")
        runs: list[dict[str, Any]] = []
        prof_times: list[tuple[int, int]] = []
        unprof_times: list[tuple[int, int]] = []
        profile_start_ns = 0
        # ---- level 2: layer (onnxruntime's profiler)
        s2: SpanRef | None = None
        if "layer" in levels:
            s2 = rec.start("level 2: layer (onnxruntime profiler)", parent=root)
            with _timing_env(cfg) as fenv:
                session = _create_session(
                    model_bytes, cfg, profile_prefix=os.path.join(tmp.name, "ort"), executed_graph_path=graph_path
                )
                profile_start_ns = int(session.get_profiling_start_time_ns())
                fenv.set_flush(cfg.denormals_as_zero)
                bound = bind(session, make_inputs(model_bytes, opts.seed, int_bounds=int_bounds))
                if cfg.cores is not None and cfg.intra_op_threads > 1:
                    os.sched_setaffinity(0, {cfg.cores[0]})
                _warm(bound, opts.warmup)
                prof_times = _timed_runs(bound, opts.runs)
                events = _read_profile(session.end_profiling())
                # Same session, same buffers, profiling now off: the reference that
                # separates the profiler's cost from session-to-session differences.
                _warm(bound, opts.warmup)
                unprof_times = _timed_runs(bound, opts.runs)
                del bound, session
            runs = parse_ort_profile(events, opts.runs)
            del events
        elif "hw" in levels:
            # The hw level needs the executed graph to know which layers each kernel covers.
            with _timing_env(cfg):
                _create_session(model_bytes, cfg, executed_graph_path=graph_path)
        nodes = load_executed_graph(graph_path) if ("layer" in levels or "hw" in levels) else []
    finally:
        tmp.cleanup()

    # ---- join kernels to layers
    kernels: list[dict[str, Any]] = []
    if nodes:
        shapes = {k["name"]: _event_shapes(k, "output_type_shape") for r in runs[:1] for k in r["kernels"]}
        join = join_layers(model, nodes, shapes)
        node_by_name = {n.name: n for n in nodes}
        if runs:
            names = list(dict.fromkeys(k["name"] for k in runs[0]["kernels"]))
            for r in runs[1:]:
                for k in r["kernels"]:
                    if k["name"] not in names:
                        names.append(k["name"])
        else:
            names = [n.name for n in nodes]
        first_event = {k["name"]: k for r in reversed(runs) for k in r["kernels"]}
        for name in names:
            members = [_layer_record(model, li, g1) for li in join.layers.get(name, [])]
            node = node_by_name.get(name)
            ev = first_event.get(name, {})
            op = ev.get("op") or (node.op_type if node else "")
            how = join.how.get(name, "unmatched")
            kernels.append(
                {
                    "kernel": name,
                    "op": op,
                    "domain": node.domain if node else "",
                    "provider": ev.get("provider", ""),
                    "match": how,
                    "label": _label(members, op) if how != "runtime" else f"{op} (runtime)",
                    "layers": members,
                    "brick_digest": _group_key(model, [m["index"] for m in members], g1) if members else None,
                    "input_shapes": _event_shapes(ev, "input_type_shape"),
                    "output_shapes": _event_shapes(ev, "output_type_shape"),
                    "flops": sum(m["flops"] for m in members),
                    "bytes_min": sum(m["bytes_min"] for m in members),
                }
            )
        result["unassigned_layers"] = [model.layers[i].name for i in join.unassigned]
        result["join"] = {
            "kernels": len(kernels),
            "by_match": {h: sum(1 for k in kernels if k["match"] == h) for h in sorted({k["match"] for k in kernels})},
            "unassigned_layers": len(join.unassigned),
            "violations": join.violations,
        }
        if join.violations:
            warnings.append(f"{join.violations} source edge(s) disagree with the executed graph after the join")
        unmatched = [k["kernel"] for k in kernels if k["match"] == "unmatched"]
        if unmatched:
            warnings.append(f"{len(unmatched)} kernel(s) not joined to a layer: {', '.join(unmatched[:5])}")
    result["kernels"] = kernels
    by_name = {k["kernel"]: k for k in kernels}

    # ---- level 2 numbers and correction
    if runs and s2 is not None:
        _layer_numbers(result, runs, prof_times, unprof_times, by_name, t_model_us, opts, warnings)
        ll = result["layer_level"]
        say(
            f"level 2 (layer): {len(kernels)} kernels for {model.n_layers} layers; profiled run "
            f"{_fmt_us(ll['profiled_wall_us'])} ({_fmt_pct(ll.get('overhead_rel'))} vs model level)"
        )

    # ---- level 3: hw
    if "hw" in levels:
        result["hw_level"] = _hw_level(model, model_bytes, int_bounds, kernels, opts, rec, root, say, warnings)
        hw = result["hw_level"]
        for k in kernels:
            b = hw.get("bricks_by_key", {}).get(k.get("brick_digest") or "")
            if b is None:
                continue
            k["isolated_us"] = (b.get("isolated") or {}).get("median_us")
            k["counters"] = b.get("counters")
            k["derived"] = b.get("derived")
            k["hw_overhead_us"] = (
                b["counted_us"] - b["uncounted_us"]
                if b.get("counted_us") is not None and b.get("uncounted_us") is not None
                else None
            )
            if k.get("corrected_us") is not None and k.get("isolated_us"):
                k["in_model_over_isolated"] = k["corrected_us"] / k["isolated_us"]
        hw.pop("bricks_by_key", None)

    # ---- op-type totals
    if runs:
        totals: dict[str, dict[str, Any]] = {}
        for k in kernels:
            t = totals.setdefault(k["label"], {"op_type": k["label"], "kernels": 0, "corrected_us": 0.0, "raw_us": 0.0})
            t["kernels"] += 1
            t["corrected_us"] += k["corrected_us"]
            t["raw_us"] += k["raw_us"]
        denom = result["layer_level"]["reference_us"]
        for t in totals.values():
            t["share"] = t["corrected_us"] / denom if denom else None
        result["op_types"] = sorted(totals.values(), key=lambda t: -t["corrected_us"])

    # ---- spans for the profiled runs (after the hw level: they carry its counters)
    if runs and s2 is not None:
        _record_layer_spans(rec, s2, runs, prof_times, unprof_times, by_name, profile_start_ns)
        rec.end(s2, end_ns=max(perf_to_epoch_ns(unprof_times[-1][1]), s2.start_ns), args=_level_args(result["layer_level"]))
    rec.end(root)
    return result


def _fmt_us(us: float | None) -> str:
    if us is None or not math.isfinite(us):
        return "-"
    if abs(us) >= 1e6:
        return f"{us / 1e6:.3g} s"
    if abs(us) >= 1e3:
        return f"{us / 1e3:.3g} ms"
    return f"{us:.3g} us"


def _fmt_pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:+.1%}"


def _level_args(level: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in level.items() if isinstance(v, (int, float, str)) or v is None}


def _layer_numbers(
    result: dict[str, Any],
    runs: list[dict[str, Any]],
    prof_times: list[tuple[int, int]],
    unprof_times: list[tuple[int, int]],
    by_name: dict[str, dict[str, Any]],
    t_model_us: float | None,
    opts: ProfileOptions,
    warnings: list[str],
) -> None:
    """Per-kernel raw and corrected times, overheads and the reconciliation."""
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
    # The model-level latency is split in proportion to what the profiled runs
    # show once the profiler's cost is taken out: kernel time (each kernel's
    # median less c_in) and framework time (median gaps less c_out per kernel,
    # plus the call outside model_run). Both come from the same runs, under the
    # same machine load; the scale carries over what differs between the two
    # levels' runs other than profiling (sessions' memory placement, load that
    # changed between the levels).
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
    result["layer_level"] = level


def _hw_level(
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
    results, pids = _run_hw_jobs(jobs, setup, rec, opts.worker_timeout_s, say)
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
        "overhead_us": (whole["counted_us"] - whole["uncounted_us"])
        if whole.get("counted_us") is not None and whole.get("uncounted_us") is not None else None,
        "counters": whole.get("counters"),
        "derived": whole.get("derived"),
    }
    ov = level["model"]["overhead_us"]
    level["overhead_rel"] = ov / whole["uncounted_us"] if ov is not None and whole.get("uncounted_us") else None
    level["bricks_by_key"] = {k: v for k, v in results.items() if k != "model"}
    brick_ov = [v["counted_us"] - v["uncounted_us"] for v in level["bricks_by_key"].values()
                if v.get("counted_us") is not None and v.get("uncounted_us") is not None]
    level["overhead_per_brick_run_us"] = _median(brick_ov)
    rec.end(s3, args={"bricks": level["bricks"], "failed": level["failed"], "events": events,
                      "model_overhead_us": level["model"]["overhead_us"]})
    return level


def _record_layer_spans(
    rec: Recorder,
    level_span: SpanRef,
    runs: list[dict[str, Any]],
    prof_times: list[tuple[int, int]],
    unprof_times: list[tuple[int, int]],
    by_name: Mapping[str, Mapping[str, Any]],
    profile_start_ns: int,
) -> None:
    """Spans: model run (the call) > onnxruntime model_run > one span per kernel."""
    static_keys = ("kernel", "op", "provider", "match", "label", "brick_digest", "input_shapes", "output_shapes",
                   "flops", "bytes_min", "raw_us", "corrected_us", "share", "isolated_us", "in_model_over_isolated",
                   "counters", "derived", "hw_overhead_us")
    static: dict[str, dict[str, Any]] = {}
    for name, k in by_name.items():
        a = {key: k.get(key) for key in static_keys if k.get(key) is not None}
        a["layers"] = [m["name"] for m in k.get("layers", [])]
        a["op_types"] = [m["op_type"] for m in k.get("layers", [])]
        a["brick_digests"] = [m["brick_digest"] for m in k.get("layers", [])]
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
        a, b = perf_to_epoch_ns(unprof_times[0][0]), perf_to_epoch_ns(unprof_times[-1][1])
        rec.add(
            f"same session, profiling off ({len(unprof_times)} runs)", a, b, parent=level_span,
            args={"median_us": float(np.median([(y - x) / 1e3 for x, y in unprof_times]))},
        )


# --------------------------------------------------------------------------- text summary


def render_profile(result: Mapping[str, Any], *, top: int = 15) -> str:
    """The text summary: levels and overheads, the reconciliation, top kernels by
    corrected time (with in-model against isolated brick time and counters),
    per-op-type totals."""
    lines: list[str] = []
    m = result["model"]
    ctx = result["context"]
    lines.append(
        f"dlbricks profile: {m['name']} ({m['layers']} layers; onnxruntime {ctx['onnxruntime']}, "
        f"intra-op threads {ctx['intra_op_threads']})"
    )
    ml, ll, hw = result.get("model_level"), result.get("layer_level"), result.get("hw_level")
    lines.append("")
    lines.append("levels (each measured in its own run)")
    if ml:
        lines.append(
            f"  model  latency {_fmt_us(ml['latency_us'])} (median of {ml['n']}, 95% CI "
            f"{_fmt_us(ml['ci_low_us'])}..{_fmt_us(ml['ci_high_us'])}), profiling off"
        )
    if ll:
        cal = ll.get("instrumentation") or {}
        lines.append(
            f"  layer  profiled run {_fmt_us(ll['profiled_wall_us'])}: overhead {_fmt_us(ll['overhead_us'])} "
            f"({_fmt_pct(ll['overhead_rel'])}) vs {ll['reference']}; same session unprofiled "
            f"{_fmt_us(ll['unprofiled_same_session_us'])} (profiler {_fmt_us(ll['overhead_per_kernel_us'])}/kernel)"
        )
        if cal:
            lines.append(
                f"         profiler cost per kernel (calibrated): {cal['in_span_us']:.1f} us inside the span, "
                f"{cal['out_span_us']:.1f} us between spans (profiler cost {_fmt_us(ll['profiler_cost_us'])} per run)"
            )
    if hw:
        if hw.get("message"):
            lines.append(f"  hw     {hw['message']}")
        mo = hw.get("model") or {}
        if mo.get("counted_us") is not None:
            lines.append(
                f"  hw     counters {', '.join(hw['events']) or 'none'}: whole model {_fmt_us(mo['counted_us'])} "
                f"counted vs {_fmt_us(mo['uncounted_us'])} not (overhead {_fmt_us(mo['overhead_us'])}, "
                f"{_fmt_pct(hw.get('overhead_rel'))}); {hw['bricks']} bricks, {hw['failed']} failed"
            )
    if ll:
        ref = ll["reference_us"]
        lines.append("")
        lines.append(f"reconciliation against {ll['reference']} {_fmt_us(ref)}")
        lines.append(f"  sum of raw kernel times       {_fmt_us(ll['raw_sum_us']):>10}  ({_fmt_pct(ll['error_before'])})")
        lines.append(f"  sum of corrected layer times  {_fmt_us(ll['corrected_sum_us']):>10}  ({_fmt_pct(ll['error_after'])})")
        lines.append(
            f"  framework overhead            {_fmt_us(ll['framework_overhead_us']):>10}  "
            f"({_fmt_pct(ll['framework_overhead_rel'])}: time between kernels less the profiler's share, "
            f"and the call into onnxruntime)"
        )
        lines.append(
            f"  scale to the reference {ll['scale']:.3f}; run-to-run variation {_fmt_us(ll['run_variation_us'])} "
            f"(median run's kernel time less the sum of per-kernel medians)"
        )
    kernels = list(result.get("kernels") or [])
    if kernels and (ll or hw):
        has_iso = any(k.get("isolated_us") is not None for k in kernels)
        has_ipc = any((k.get("derived") or {}).get("ipc") is not None for k in kernels)
        lines.append("")
        lines.append(f"top {min(top, len(kernels))} layers by {'corrected' if ll else 'isolated brick'} time")
        hdr = f"  {'#':>3} {'layer(s)':<24} {'op':<30} {'corrected':>10} {'share':>6} {'raw':>9} {'GFLOP/s':>8}"
        if has_iso:
            hdr += f" {'isolated':>9} {'in/iso':>6}"
        if has_ipc:
            hdr += f" {'IPC':>5}"
        hdr += "  counters"
        lines.append(hdr)
        def time_of(k: Mapping[str, Any]) -> float:
            return float(k.get("corrected_us") if k.get("corrected_us") is not None else k.get("isolated_us") or 0.0)

        for i, k in enumerate(sorted(kernels, key=lambda k: -time_of(k))[:top], 1):
            names = ",".join(x["name"] for x in k["layers"]) or k["kernel"]
            if len(names) > 24:
                names = names[:21] + "..."
            label = k["label"] if len(k["label"]) <= 30 else k["label"][:27] + "..."
            row = (
                f"  {i:>3} {names:<24} {label:<30} {_fmt_us(k.get('corrected_us')):>10} "
                f"{_fmt_share(k.get('share')):>6} {_fmt_us(k.get('raw_us')):>9} "
                f"{_fmt_num(k.get('gflops')):>8}"
            )
            if has_iso:
                iso = k.get("isolated_us")
                ratio = k.get("in_model_over_isolated")
                row += f" {_fmt_us(iso):>9} {_fmt_num(ratio):>6}"
            if has_ipc:
                ipc = (k.get("derived") or {}).get("ipc")
                row += f" {_fmt_num(ipc):>5}"
            c = k.get("counters") or {}
            row += "  " + (", ".join(_fmt_counter(name, v) for name, v in c.items() if v is not None) or "-")
            lines.append(row)
        iso_pairs = [(k["corrected_us"], k["isolated_us"]) for k in kernels
                     if k.get("isolated_us") and k.get("corrected_us") is not None]
        if iso_pairs:
            a = sum(p[0] for p in iso_pairs)
            b = sum(p[1] for p in iso_pairs)
            lines.append(
                f"  in-model vs isolated bricks: {_fmt_us(a)} in the model against {_fmt_us(b)} isolated "
                f"over {len(iso_pairs)} kernels (ratio {a / b:.2f})"
            )
    if result.get("op_types"):
        lines.append("")
        lines.append("per op type (fused layers together)")
        for t in result["op_types"][:top]:
            lines.append(
                f"  {t['op_type']:<44} {t['kernels']:>4} kernels {_fmt_us(t['corrected_us']):>10} "
                f"{(t['share'] or 0):>6.1%}"
            )
    join = result.get("join")
    if join:
        lines.append("")
        lines.append(
            f"join: {join['kernels']} kernels ({', '.join(f'{v} {h}' for h, v in join['by_match'].items())}); "
            f"{join['unassigned_layers']} layers without a kernel"
        )
    for w in result.get("warnings") or []:
        lines.append(f"warning: {w}")
    return "\n".join(lines) + "\n"


def _fmt_share(v: float | None) -> str:
    return f"{v:.1%}" if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def _fmt_num(v: float | None) -> str:
    return f"{v:.2f}" if isinstance(v, (int, float)) and math.isfinite(v) and v else "-"


def _fmt_counter(name: str, v: float) -> str:
    # task-clock counts nanoseconds of CPU time; the others are event counts.
    return f"{name}={_fmt_us(v / 1e3)}" if name == "task-clock" else f"{name}={_fmt_count(v)}"


def _fmt_count(v: float) -> str:
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return "-"
    if abs(v) >= 1e9:
        return f"{v / 1e9:.3g}G"
    if abs(v) >= 1e6:
        return f"{v / 1e6:.3g}M"
    if abs(v) >= 1e3:
        return f"{v / 1e3:.3g}k"
    return f"{v:.3g}"
