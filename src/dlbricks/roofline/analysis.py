"""Roofline lower bounds and what-if analysis over measured layers (Benanza).

Per layer, from :mod:`dlbricks.roofline.costmodel` and measured :class:`~dlbricks.roofline.peaks.Peaks`:

* **bound** = ``max(flops / peak FLOP/s, bytes_min / bandwidth)`` seconds, and which
  side limits it (``compute``, ``memory``, or ``none`` for views that cost nothing);
* **arithmetic intensity** = flops / bytes_min;
* **measured** = the median of the layer's G=1 brick (its sequence digest at G=1)
  from the store, keyed by this system's fingerprint and the runner configuration;
* **efficiency** = bound / measured. It cannot exceed 1 unless the bound is wrong:
  a layer whose efficiency exceeds ``1 + max(noise, CI half-width of its median)``
  is flagged ``beats_bound`` with the likely reasons (its data stayed in cache while
  the bandwidth peak is DRAM's; a FLOP formula that overcounts; a peak measured
  too low).

Per model: the ideal latency, sequential (sum of bounds) and along the critical path
of the layer graph, against the measured latency: the end-to-end result (kind
``"model"``) when the store has one, else the sum of the layer medians
(``measured_source`` says which).

**Headroom**: unique layers (and, optionally, unique bricks at G > 1, whose bound is
the sum of their layers' bounds) ranked by ``(measured - bound) x occurrences`` over
the corpus: where optimisation effort pays most.

**What-if scenarios**, each a predicted latency and a speedup. Every speedup is
relative to the sum of the model's measured layer medians (``layer_sum_s``), so that
prediction and baseline come from the same G=1 timings:

* ``at_bound``: every layer runs at its bound; latency = the ideal sequential latency.
* ``parallel_branches``: independent branches overlap; latency = the critical path of
  the measured layer medians.
* ``fusion``: elementwise and activation layers (:data:`FUSABLE_OPS`) are fused into
  the layer producing one of their inputs, when that tensor has no other consumer
  and is not a graph output (chains fuse transitively: Conv -> BatchNormalization ->
  Relu becomes one group). Two predictions:

  - ``latency_s`` (measured): the fused layers' medians are dropped, the producer's
    kernel absorbing them for free (optimistic);
  - ``bound_latency_s``: the sum over fusion groups of the group's roofline bound,
    ``max(sum flops / peak, (sum bytes_min - 2 * bytes of each fused tensor) /
    bandwidth)``: a fused tensor is neither written by its producer nor read back;
    the fused layers keep their FLOPs and their other inputs. Its speedup is
    against the unfused ideal (``ideal_sequential_s``).
* ``batch`` (``batch_what_if``): every graph input's leading dim set to N, the
  model reloaded and its G=1 bricks measured at that batch; latency = the sum of
  those medians; ``per_sample_speedup`` compares the time per sample with the
  original batch's. Models whose batch is pinned (a Reshape to a hard-coded shape,
  an input whose shape inference fails) are reported as not re-batchable, with the
  reason.

Peaks are cached as JSON in a ``peaks`` folder next to the store file, one file per
(system fingerprint id, thread count, pinned cores): :func:`peaks_for_store`.
"""

from __future__ import annotations

import base64
import io
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dlbricks.corpus import Corpus
from dlbricks.roofline.costmodel import LayerCost, layer_cost, roofline_terms
from dlbricks.files import write_atomically
from dlbricks.graph import critical_path
from dlbricks.errors import DlbricksError, ModelError
from dlbricks.model import Model

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.roofline.peaks import Peaks
    from dlbricks.store import ResultRecord, Store
    from dlbricks.timing import RunnerConfig

__all__ = [
    "CAUSES",
    "FUSABLE_OPS",
    "ROOFLINE_SCHEMA_VERSION",
    "LayerRoofline",
    "ModelRoofline",
    "RooflineAnalysis",
    "analyze",
    "check_models",
    "batch_what_if",
    "brick_headroom",
    "format_text",
    "fusion_groups",
    "layer_brick_digests",
    "layer_headroom",
    "peaks_dir",
    "peaks_for_store",
    "plot_roofline",
    "rebatch",
    "to_dict",
]

ROOFLINE_SCHEMA_VERSION = 1

#: Default relative measurement noise: an efficiency up to 1 + this is not flagged.
DEFAULT_NOISE = 0.05

#: Elementwise and activation ops that a producer kernel can absorb (default domain).
FUSABLE_OPS = frozenset({
    "Relu", "LeakyRelu", "PRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh",
    "Elu", "Selu", "Celu", "Softplus", "Softsign", "Mish", "Gelu", "ThresholdedRelu",
    "Erf", "Exp", "Log", "Sqrt", "Neg", "Abs", "Reciprocal",
    "Add", "Sub", "Mul", "Div", "Pow", "Sum",
    "BatchNormalization",
})

# Views cost nothing (costmodel charges them 0 bytes); nothing fuses into them.
_VIEWS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"})


# --------------------------------------------------------------------------- peaks


def peaks_dir(store_path: str | os.PathLike[str]) -> Path:
    """Where peaks are cached for a store: ``<store folder>/peaks``.

    The store's SQLite schema has no peaks table; the JSON files there are keyed by
    system fingerprint id, thread count and pinned cores (see
    :func:`dlbricks.roofline.peaks.load_or_measure_peaks`).
    """
    return Path(store_path).parent / "peaks"


def peaks_for_store(
    store_path: str | os.PathLike[str] | None,
    config: RunnerConfig,
    *,
    quick: bool = False,
    system_id: str | None = None,
) -> Peaks:
    """Peaks matching a runner configuration, cached next to the store.

    Measured at ``config.intra_op_threads`` threads (all allowed CPUs when it is 0,
    onnxruntime's default) pinned to ``config.cores``, the conditions the bricks are
    timed under.

    Args:
        store_path: the store file; None measures without caching.
        config: the runner configuration.
        quick: a quick (less accurate) measurement.
        system_id: the fingerprint id (default: this machine's).

    Returns:
        The peaks.

    Raises:
        ValueError: the cores cannot be used.
        OSError: the cache folder cannot be written.
    """
    from dlbricks.roofline.peaks import load_or_measure_peaks

    if system_id is None:
        from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint

        system_id = fingerprint_id(system_fingerprint())
    threads = config.intra_op_threads
    if threads < 1:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    root = peaks_dir(store_path) if store_path is not None else None
    return load_or_measure_peaks(root, system_id, threads=threads, cores=config.cores, quick=quick)


# --------------------------------------------------------------------------- results


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


@dataclass(slots=True)
class LayerRoofline:
    """One layer against its roofline bound (times in seconds)."""

    model: str
    index: int
    name: str
    kind: str
    digest: str  # its G=1 brick digest (hex)
    cost: LayerCost
    compute_s: float
    memory_s: float
    bound_s: float
    limit: str  # "compute", "memory" or "none"
    measured_s: float | None = None
    ci_rel: float | None = None  # half-width of the median's CI, relative
    efficiency: float | None = None
    beats_bound: bool = False
    cause: str | None = None  # one of CAUSES when beats_bound
    reasons: list[str] = field(default_factory=list)
    fused_into: int | None = None  # producer layer index under the fusion what-if

    @property
    def intensity(self) -> float:
        return self.cost.arithmetic_intensity

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "name": self.name, "kind": self.kind, "digest": self.digest,
            "flops": self.cost.flops, "macs": self.cost.macs, "bytes_min": self.cost.bytes_min,
            "has_formula": self.cost.has_formula,
            "arithmetic_intensity": _finite(self.intensity),
            "compute_s": self.compute_s, "memory_s": self.memory_s, "bound_s": self.bound_s,
            "limit": self.limit, "measured_s": self.measured_s, "ci_rel": self.ci_rel,
            "efficiency": self.efficiency, "beats_bound": self.beats_bound, "cause": self.cause,
            "reasons": list(self.reasons),
            "fused_into": self.fused_into,
        }


@dataclass(slots=True)
class ModelRoofline:
    """A model's ideal latencies against measured ones, and its scenarios (seconds)."""

    name: str
    path: str | None
    batch: int | None
    layers: list[LayerRoofline]
    ideal_sequential_s: float
    ideal_critical_path_s: float
    layer_sum_s: float | None  # None unless every layer is measured
    measured_s: float | None
    measured_source: str | None  # "end_to_end", "layer_sum" or None
    layers_missing: int
    scenarios: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def efficiency(self) -> float | None:
        if not self.measured_s:
            return None
        return self.ideal_sequential_s / self.measured_s

    def to_dict(self, *, per_layer: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name, "path": self.path, "batch": self.batch, "n_layers": len(self.layers),
            "flops": sum(r.cost.flops for r in self.layers),
            "bytes_min": sum(r.cost.bytes_min for r in self.layers),
            "ideal_sequential_s": self.ideal_sequential_s,
            "ideal_critical_path_s": self.ideal_critical_path_s,
            "layer_sum_s": self.layer_sum_s, "measured_s": self.measured_s,
            "measured_source": self.measured_source, "efficiency": self.efficiency,
            "layers_measured": len(self.layers) - self.layers_missing,
            "layers_missing": self.layers_missing,
            "beats_bound": sum(r.beats_bound for r in self.layers),
            "kinds_without_formula": sorted({r.kind for r in self.layers if not r.cost.has_formula}),
            "scenarios": self.scenarios,
        }
        # Flat copies of the scenario speedups, for table renderers that skip nested values.
        sc = self.scenarios
        for key, scenario, field_ in (("speedup_at_bound", "at_bound", "speedup"),
                                      ("speedup_parallel", "parallel_branches", "speedup"),
                                      ("speedup_fusion", "fusion", "speedup"),
                                      ("speedup_fusion_bound", "fusion", "bound_speedup"),
                                      ("speedup_batch_per_sample", "batch", "per_sample_speedup")):
            if scenario in sc:
                d[key] = sc[scenario].get(field_)
        if per_layer:
            d["layers"] = [r.to_dict() for r in self.layers]
        return d


@dataclass(slots=True)
class RooflineAnalysis:
    """The result of :func:`analyze`."""

    peaks: Peaks
    models: list[ModelRoofline]
    noise: float
    occurrences: dict[str, int]  # G=1 brick digest -> occurrences over the corpus

    def beats_bound(self) -> list[LayerRoofline]:
        """Every layer flagged as faster than its bound."""
        return [r for m in self.models for r in m.layers if r.beats_bound]


# --------------------------------------------------------------------------- helpers


def layer_brick_digests(corpus: Corpus, i: int) -> list[str]:
    """The G=1 brick digest (hex) of every layer of model ``i``, in layer order."""
    sp = corpus.split(1)
    ids = sp.model_seq_ids(i)
    of = sp.model_split(i).sequence_of_layer()
    return [bytes(sp.unique_digests[ids[s]]).hex() for s in of.tolist()]


def _ci_rel(rec: ResultRecord) -> float:
    s = rec.stats or {}
    med = float(s.get("median", 0.0))
    if med <= 0:
        return 0.0
    return max(med - float(s.get("ci_low", med)), float(s.get("ci_high", med)) - med) / med


#: Short codes of the most likely reason a layer beats its bound.
CAUSES = ("cache_resident", "bandwidth_peak", "flop_formula_or_peak")


def _reasons(row: LayerRoofline, peaks: Peaks) -> tuple[str, list[str]]:
    """Why a layer may beat its bound: a cause code (:data:`CAUSES`) and the
    candidate reasons, most likely first."""
    llc = peaks.last_level_cache_bytes
    if row.limit == "memory":
        if llc and row.cost.bytes_min <= llc:
            cause = "cache_resident"
            first = (
                f"cache-resident: its {row.cost.bytes_min} bytes fit in the {llc}-byte last-level "
                f"cache, while the bandwidth peak ({peaks.bandwidth_gbs:.1f} GB/s) is DRAM's"
            )
        else:
            cause = "bandwidth_peak"
            first = (
                f"bandwidth peak ({peaks.bandwidth_gbs:.1f} GB/s) below what this layer streams at "
                "(data partly cache-resident, or the peak measurement was disturbed)"
            )
        return cause, [first, "bytes_min overcounts this layer's traffic (an aliased, broadcast or partly read input)"]
    return "flop_formula_or_peak", [
        f"the compute peak ({peaks.gflops:.1f} GFLOP/s) is below what this kernel reaches",
        f"the FLOP formula for {row.kind} overcounts (e.g. Winograd or FFT convolution does fewer FLOPs)",
    ]


def fusion_groups(model: Model) -> tuple[np.ndarray, list[int | None], list[int]]:
    """Fusion of elementwise/activation layers into their producers (see the module docstring).

    A layer whose op is in :data:`FUSABLE_OPS` joins the group of the layer producing
    its first activation input that has no other consumer and is not a graph output
    (the producer must not be a view).

    Returns:
        ``(group, fused_into, saved_bytes)``: a group id per layer (the index of the
        group's first layer), each layer's producer (None when not fused), and per
        layer the bytes of the fused tensor it no longer reads (0 when not fused).
    """
    n = model.n_layers
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    producers = model.producers()
    consumers = model.consumers()
    graph_outputs = {name for name, _ in model.outputs}
    fused_into: list[int | None] = [None] * n
    saved = [0] * n
    for layer in model.layers:
        if layer.domain not in ("", "ai.onnx") or layer.op_type not in FUSABLE_OPS:
            continue
        for slot in layer.activation_slots():
            name = layer.inputs[slot]
            if name not in producers or name in graph_outputs:
                continue
            if len({c for c, _ in consumers.get(name, [])}) != 1:
                continue
            p, _ = producers[name]
            prod = model.layers[p]
            if prod.op_type in _VIEWS and prod.domain in ("", "ai.onnx"):
                continue
            t = layer.input_types[slot]
            fused_into[layer.index] = p
            saved[layer.index] = t.nbytes if t is not None else 0
            a, b = find(layer.index), find(p)
            parent[max(a, b)] = min(a, b)
            break
    group = np.array([find(i) for i in range(n)], dtype=np.int64)
    return group, fused_into, saved


def _fused_bound(rows: Sequence[LayerRoofline], group: np.ndarray, saved: Sequence[int], peaks: Peaks) -> float:
    flops: dict[int, int] = {}
    nbytes: dict[int, int] = {}
    for r, g, s in zip(rows, group.tolist(), saved):
        flops[g] = flops.get(g, 0) + r.cost.flops
        # The producer no longer writes the tensor, the fused layer no longer reads it.
        nbytes[g] = nbytes.get(g, 0) + r.cost.bytes_min - 2 * s
    peak, bw = peaks.gflops * 1e9, peaks.bandwidth_gbs * 1e9
    return float(sum(max(flops[g] / peak, max(nbytes[g], 0) / bw) for g in flops))


def _critical(model: Model, weights: Sequence[float]) -> float:
    return float(critical_path(model, np.asarray(weights, dtype=np.float64))[0])


def _speedup(base: float | None, new: float | None) -> float | None:
    if base is None or new is None or not new > 0:
        return None
    return base / new


def _batch_of(model: Model) -> int | None:
    for _, t in model.inputs:
        if t.shape:
            return int(t.shape[0])
    return None


# --------------------------------------------------------------------------- analysis


def analyze(
    models: Sequence[Model],
    peaks: Peaks,
    *,
    store: Store | None = None,
    system_id: str | None = None,
    config_key: str | None = None,
    noise: float = DEFAULT_NOISE,
) -> RooflineAnalysis:
    """Bounds, measured times, efficiencies and scenarios for every layer and model.

    Args:
        models: loaded models.
        peaks: the machine peaks the bounds use.
        store: where the G=1 brick results (and end-to-end results) are read; None
            gives bounds only.
        system_id, config_key: the result key (required with ``store``).
        noise: relative measurement noise tolerated before a layer that beats its
            bound is flagged (the median's own CI half-width is used when larger).

    Returns:
        The :class:`RooflineAnalysis`; headroom comes from :func:`layer_headroom`.

    Raises:
        ValueError: no models, a peak is not positive, ``noise`` is negative, or
            ``store`` is given without ``system_id`` and ``config_key``.
        DlbricksError: two models share a name.
    """
    from dlbricks.bricks import model_digest
    from dlbricks.versions import brick_digest_version, model_digest_version

    if not noise >= 0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    if store is not None and (system_id is None or config_key is None):
        raise ValueError("analyze: a store needs system_id and config_key")
    models = list(models)
    if not models:
        raise ValueError("analyze: no models")
    check_models(models)
    corpus = Corpus(models)
    sp = corpus.split(1)
    occ = sp.occurrences().sum(axis=0)
    occurrences = {bytes(sp.unique_digests[u]).hex(): int(occ[u]) for u in range(sp.n_unique)}
    bver = brick_digest_version()
    records: dict[str, ResultRecord | None] = {}
    out: list[ModelRoofline] = []
    for i, model in enumerate(models):
        digests = layer_brick_digests(corpus, i)
        group, fused_into, saved = fusion_groups(model)
        rows: list[LayerRoofline] = []
        for layer, d in zip(model.layers, digests):
            cost = layer_cost(layer)
            c, m = roofline_terms(cost, peaks)
            limit = "none" if c == m == 0 else ("compute" if c >= m else "memory")
            row = LayerRoofline(model.name, layer.index, layer.name, layer.kind, d, cost, c, m, max(c, m), limit,
                                fused_into=fused_into[layer.index])
            if store is not None:
                if d not in records:
                    records[d] = store.get_result("brick", d, bver, system_id, config_key)  # type: ignore[arg-type]
                rec = records[d]
                if rec is not None and rec.ok and rec.median_ns and rec.median_ns > 0:
                    row.measured_s = rec.median_ns * 1e-9
                    row.ci_rel = _ci_rel(rec)
                    row.efficiency = row.bound_s / row.measured_s
                    if row.efficiency > 1.0 + max(noise, row.ci_rel):
                        row.beats_bound = True
                        row.cause, row.reasons = _reasons(row, peaks)
            rows.append(row)
        bounds = [r.bound_s for r in rows]
        missing = sum(r.measured_s is None for r in rows)
        times = [r.measured_s or 0.0 for r in rows]
        layer_sum = float(sum(times)) if missing == 0 else None
        measured, source = layer_sum, ("layer_sum" if layer_sum is not None else None)
        if store is not None:
            e2e = store.get_result("model", model_digest(model), model_digest_version(), system_id, config_key)  # type: ignore[arg-type]
            if e2e is not None and e2e.ok and e2e.median_ns:
                measured, source = e2e.median_ns * 1e-9, "end_to_end"
        ideal_seq = float(sum(bounds))
        mr = ModelRoofline(
            name=model.name, path=model.path, batch=_batch_of(model), layers=rows,
            ideal_sequential_s=ideal_seq, ideal_critical_path_s=_critical(model, bounds),
            layer_sum_s=layer_sum, measured_s=measured, measured_source=source, layers_missing=missing,
        )
        parallel = _critical(model, times) if layer_sum is not None else None
        fused_measured = (
            layer_sum - sum(t for t, f in zip(times, fused_into) if f is not None) if layer_sum is not None else None
        )
        fused_bound = _fused_bound(rows, group, saved, peaks)
        mr.scenarios = {
            "at_bound": {"latency_s": ideal_seq, "speedup": _speedup(layer_sum, ideal_seq)},
            "parallel_branches": {"latency_s": parallel, "speedup": _speedup(layer_sum, parallel),
                                  "ideal_latency_s": mr.ideal_critical_path_s},
            "fusion": {
                "fused_layers": sum(f is not None for f in fused_into),
                "groups": int(np.unique(group).shape[0]),
                "latency_s": fused_measured, "speedup": _speedup(layer_sum, fused_measured),
                "bound_latency_s": fused_bound, "bound_speedup": _speedup(ideal_seq, fused_bound),
            },
        }
        out.append(mr)
    return RooflineAnalysis(peaks=peaks, models=out, noise=noise, occurrences=occurrences)


def layer_headroom(analysis: RooflineAnalysis, top: int | None = None) -> list[dict[str, Any]]:
    """Unique layers ranked by ``(measured - bound) x occurrences`` over the corpus.

    Identical layers (same G=1 brick digest) share shapes and attributes, so one
    bound and one measurement stand for all of them. Unmeasured layers are left out.

    Args:
        analysis: from :func:`analyze`.
        top: keep the first ``top`` (all when None).

    Returns:
        Dicts, largest total headroom first (ties by digest, so the order is stable).
    """
    seen: dict[str, dict[str, Any]] = {}
    for m in analysis.models:
        for r in m.layers:
            if r.measured_s is None:
                continue
            e = seen.get(r.digest)
            if e is None:
                n = analysis.occurrences.get(r.digest, 1)
                per = r.measured_s - r.bound_s
                seen[r.digest] = e = {
                    "digest": r.digest, "kind": r.kind, "example": f"{m.name}:{r.name}",
                    "occurrences": n, "models": [], "measured_s": r.measured_s, "bound_s": r.bound_s,
                    "limit": r.limit, "efficiency": r.efficiency, "headroom_s": per, "total_headroom_s": per * n,
                }
            if m.name not in e["models"]:
                e["models"].append(m.name)
    ranked = sorted(seen.values(), key=lambda e: (-e["total_headroom_s"], e["digest"]))
    return ranked if top is None else ranked[:top]


def brick_headroom(
    models: Sequence[Model],
    analysis: RooflineAnalysis,
    G: int,
    *,
    store: Store,
    system_id: str,
    config_key: str,
    top: int | None = None,
) -> list[dict[str, Any]]:
    """Unique bricks at ``G`` ranked like :func:`layer_headroom`; a brick's bound is the
    sum of its layers' bounds. Bricks without a stored result are left out.

    Args:
        models: the models ``analysis`` was made from, in the same order.
        analysis: from :func:`analyze`.
        G: the granularity.
        store, system_id, config_key: where the brick results are read.
        top: keep the first ``top`` (all when None).

    Returns:
        Dicts, largest total headroom first.
    """
    from dlbricks.versions import brick_digest_version

    corpus = Corpus(list(models))
    sp = corpus.split(G)
    occ = sp.occurrences().sum(axis=0)
    bver = brick_digest_version()
    out = []
    for u in range(sp.n_unique):
        d = bytes(sp.unique_digests[u]).hex()
        rec = store.get_result("brick", d, bver, system_id, config_key)
        if rec is None or not rec.ok or not rec.median_ns:
            continue
        mi, members = sp.first_occurrence(u)
        rows = analysis.models[mi].layers
        bound = float(sum(rows[j].bound_s for j in members.tolist()))
        measured = rec.median_ns * 1e-9
        per = measured - bound
        out.append({
            "digest": d, "G": G, "layers": int(members.shape[0]),
            "kinds": [rows[j].kind for j in members.tolist()],
            "example": f"{models[mi].name}:{rows[int(members[0])].name}",
            "occurrences": int(occ[u]), "measured_s": measured, "bound_s": bound,
            "efficiency": bound / measured, "headroom_s": per, "total_headroom_s": per * int(occ[u]),
        })
    out.sort(key=lambda e: (-e["total_headroom_s"], e["digest"]))
    return out if top is None else out[:top]


# --------------------------------------------------------------------------- batch


def rebatch(model: Model, batch: int) -> Model:
    """Reload ``model`` from its file with every graph input's leading dim set to ``batch``.

    Raises:
        ValueError: ``batch`` < 1.
        ModelError: the model has no file, fails to load at that batch, or its batch
            is pinned: a Reshape/Flatten whose input and output sizes disagree (a
            hard-coded shape), or an output that carried the batch no longer does.
    """
    from dlbricks.loading import load

    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if model.path is None:
        raise ModelError(f"{model.name}: no file to reload at another batch size")
    b0 = _batch_of(model)
    shapes = {name: (batch, *t.shape[1:]) for name, t in model.inputs if t.shape}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the same assumptions were reported at first load
        new = load(model.path, shapes, name=model.name)
    for layer in new.layers:
        if layer.op_type in ("Reshape", "Flatten") and layer.input_types and layer.output_types:
            i, o = layer.input_types[0], layer.output_types[0]
            if i is not None and o is not None and i.numel != o.numel:
                raise ModelError(
                    f"{model.name}: batch is pinned at layer {layer.name!r} ({layer.op_type} of {i} to {o}: "
                    "a hard-coded shape)"
                )
    for (name, t0), (_, t1) in zip(model.outputs, new.outputs):
        if t0.shape and b0 is not None and t0.shape[0] == b0 and (not t1.shape or t1.shape[0] != batch):
            raise ModelError(f"{model.name}: output {name!r} is {t1} at batch {batch}: the batch is pinned")
    return new


def batch_what_if(
    models: Sequence[Model],
    batch: int,
    analysis: RooflineAnalysis,
    *,
    store: Store | None,
    system_id: str | None,
    config_key: str | None,
    config: RunnerConfig | None = None,
    measure: bool = True,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, dict[str, Any]]:
    """The batch scenario: each model's latency with its inputs' leading dim at ``batch``.

    Re-batchable models are benchmarked at G=1 (only bricks the store lacks, and only
    with ``measure``); the scenario is then set in ``analysis`` (``scenarios["batch"]``).

    Args:
        models: the models ``analysis`` was made from, in the same order.
        batch: the new batch size.
        analysis: from :func:`analyze`; updated in place.
        store, system_id, config_key: the results store and key.
        config: the runner configuration (needed with ``measure``).
        measure: time bricks the store lacks.
        seed, progress: as for :func:`dlbricks.pipeline.bench`.

    Returns:
        Model name -> its batch scenario dict: ``batch``, ``rebatchable`` and, when
        re-batchable, ``latency_s`` (sum of layer medians at the batch, None when some
        are missing), ``ideal_latency_s``, ``per_sample_latency_s``,
        ``per_sample_speedup``, ``layers_missing``; otherwise ``error``.
    """
    from dlbricks.pipeline import bench

    batched: list[Model] = []
    result: dict[str, dict[str, Any]] = {}
    for m in models:
        try:
            batched.append(rebatch(m, batch))
        except ModelError as exc:
            result[m.name] = {"batch": batch, "rebatchable": False, "error": str(exc)}
    if batched and measure and store is not None:
        if config is None:
            raise ValueError("batch_what_if: measuring needs a runner config")
        bench(batched, [1], store=store, config=config, seed=seed, progress=progress)
    if batched:
        sub = analyze(batched, analysis.peaks, store=store, system_id=system_id, config_key=config_key,
                      noise=analysis.noise)
        for mr in sub.models:
            base = next(x for x in analysis.models if x.name == mr.name)
            b0 = base.batch or 1
            per_sample = mr.layer_sum_s / batch if mr.layer_sum_s is not None else None
            base_per = base.layer_sum_s / b0 if base.layer_sum_s is not None else None
            result[mr.name] = {
                "batch": batch, "rebatchable": True, "latency_s": mr.layer_sum_s,
                "ideal_latency_s": mr.ideal_sequential_s, "per_sample_latency_s": per_sample,
                "per_sample_speedup": _speedup(base_per, per_sample), "layers_missing": mr.layers_missing,
                "beats_bound": sum(r.beats_bound for r in mr.layers),
            }
    for mr in analysis.models:
        if mr.name in result:
            mr.scenarios["batch"] = result[mr.name]
    return result


# --------------------------------------------------------------------------- output


def plot_roofline(analysis: RooflineAnalysis, path: str | os.PathLike[str] | None = None) -> bytes:
    """Draw the roofline: measured layers as points, the ceilings as lines.

    x is arithmetic intensity (FLOP/byte), y the achieved rate (layer FLOPs / measured
    time), both logarithmic; the ceiling is ``min(peak, intensity x bandwidth)``.
    Layers without FLOPs or without a measurement cannot be placed and are counted in
    the title. Layers beating their bound are drawn with a red edge.

    Args:
        analysis: from :func:`analyze`.
        path: also write the PNG here.

    Returns:
        The PNG bytes.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    peaks = analysis.peaks
    fig = Figure(figsize=(8, 5.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    xs_all: list[float] = []
    skipped = 0
    for k, m in enumerate(analysis.models):
        pts = [(r.intensity, r.cost.flops / r.measured_s / 1e9, r.beats_bound) for r in m.layers
               if r.measured_s and r.cost.flops > 0 and math.isfinite(r.intensity)]
        skipped += len(m.layers) - len(pts)
        if not pts:
            continue
        x, y, flag = zip(*pts)
        xs_all.extend(x)
        colour = f"C{k % 10}"
        ax.scatter(x, y, s=18, color=colour, alpha=0.75, label=m.name,
                   edgecolors=["red" if f else colour for f in flag], linewidths=[1.5 if f else 0.5 for f in flag])
    lo = min([*xs_all, peaks.ridge_point]) / 4
    hi = max([*xs_all, peaks.ridge_point]) * 4
    grid = np.geomspace(lo, hi, 200)
    ax.plot(grid, np.minimum(peaks.gflops, grid * peaks.bandwidth_gbs), color="black", lw=1.5,
            label=f"roofline ({peaks.gflops:.1f} GFLOP/s, {peaks.bandwidth_gbs:.1f} GB/s)")
    ax.axvline(peaks.ridge_point, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title(f"roofline, {peaks.threads} thread(s)" + (f"; {skipped} layers not placed" if skipped else ""))
    ax.grid(True, which="both", alpha=0.2)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    data = buf.getvalue()
    if path is not None:
        write_atomically(path, data)
    return data


def to_dict(
    analysis: RooflineAnalysis,
    *,
    headroom: Sequence[Mapping[str, Any]] = (),
    brick_headroom_by_g: Mapping[int, Sequence[Mapping[str, Any]]] | None = None,
    png: bytes | None = None,
    context: Mapping[str, Any] | None = None,
    per_layer: bool = True,
) -> dict[str, Any]:
    """The JSON form (``schema_version`` 1): ``peaks``, ``models`` (one dict per
    model, with its ``scenarios`` and, with ``per_layer``, its ``layers``),
    ``headroom``, ``brick_headroom`` (by G), ``beats_bound`` and, when a plot was
    drawn, ``plot_png_base64``."""
    d: dict[str, Any] = {
        "schema_version": ROOFLINE_SCHEMA_VERSION,
        "context": dict(context or {}),
        "peaks": analysis.peaks.to_dict(),
        "noise": analysis.noise,
        "models": [m.to_dict(per_layer=per_layer) for m in analysis.models],
        "headroom": [dict(h) for h in headroom],
        "brick_headroom": {str(g): [dict(h) for h in v] for g, v in (brick_headroom_by_g or {}).items()},
        "beats_bound": [
            {"model": r.model, **{k: v for k, v in r.to_dict().items()
                                  if k in ("index", "name", "kind", "limit", "bound_s", "measured_s",
                                           "efficiency", "cause", "reasons")}}
            for r in analysis.beats_bound()
        ],
    }
    if png is not None:
        d["plot_png_base64"] = base64.b64encode(png).decode("ascii")
    return d


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def format_text(
    analysis: RooflineAnalysis,
    headroom: Sequence[Mapping[str, Any]] = (),
    brick_headroom_by_g: Mapping[int, Sequence[Mapping[str, Any]]] | None = None,
    *,
    max_flagged: int = 10,
) -> str:
    """The human-readable tables: peaks, models, scenarios, headroom, and the layers
    that beat their bound (the ``max_flagged`` most efficient of them, with a count
    per cause)."""
    p = analysis.peaks
    lines = [
        f"peaks: {p.gflops:.1f} GFLOP/s, {p.bandwidth_gbs:.1f} GB/s, ridge {p.ridge_point:.1f} FLOP/B "
        f"({p.threads} thread(s){', quick' if p.quick else ''})",
        "",
        f"{'model':<22} {'layers':>6} {'measured ms':>11} {'source':<11} {'ideal seq':>9} {'ideal cp':>9} "
        f"{'eff':>6} {'missing':>7} {'>bound':>6}",
    ]
    for m in analysis.models:
        eff = "-" if m.efficiency is None else f"{m.efficiency:.3f}"
        lines.append(
            f"{m.name[:22]:<22} {len(m.layers):>6} {_ms(m.measured_s):>11} {(m.measured_source or '-'):<11} "
            f"{_ms(m.ideal_sequential_s):>9} {_ms(m.ideal_critical_path_s):>9} {eff:>6} {m.layers_missing:>7} "
            f"{sum(r.beats_bound for r in m.layers):>6}"
        )
    lines += ["", "what-if (latency ms / speedup over the layer sum)",
              f"{'model':<22} {'layer sum':>9} {'at bound':>16} {'parallel':>16} {'fused':>16} {'fused bound':>16} "
              f"{'batch (per sample)':>24}"]
    for m in analysis.models:
        s = m.scenarios
        ab, pb, fu = s["at_bound"], s["parallel_branches"], s["fusion"]
        bt = s.get("batch")
        if bt is None:
            batch = "-"
        elif not bt["rebatchable"]:
            batch = f"N={bt['batch']}: not re-batchable"
        else:
            batch = f"N={bt['batch']}: {_ms(bt['per_sample_latency_s'])} {_x(bt['per_sample_speedup'])}"
        lines.append(
            f"{m.name[:22]:<22} {_ms(m.layer_sum_s):>9} "
            f"{_ms(ab['latency_s']) + ' ' + _x(ab['speedup']):>16} "
            f"{_ms(pb['latency_s']) + ' ' + _x(pb['speedup']):>16} "
            f"{_ms(fu['latency_s']) + ' ' + _x(fu['speedup']):>16} "
            f"{_ms(fu['bound_latency_s']) + ' ' + _x(fu['bound_speedup']):>16} {batch:>24}"
        )
    for m in analysis.models:
        bt = m.scenarios.get("batch")
        if bt is not None and not bt["rebatchable"]:
            lines.append(f"  {bt['error']}")
    if headroom:
        lines += ["", "headroom: unique layers by (measured - bound) x occurrences",
                  f"{'kind':<20} {'occ':>4} {'measured ms':>11} {'bound ms':>9} {'eff':>6} {'total ms':>9}  example"]
        for h in headroom:
            eff = "-" if h["efficiency"] is None else f"{h['efficiency']:.3f}"
            lines.append(
                f"{h['kind'][:20]:<20} {h['occurrences']:>4} {_ms(h['measured_s']):>11} {_ms(h['bound_s']):>9} "
                f"{eff:>6} {_ms(h['total_headroom_s']):>9}  {h['example']}"
            )
    for g, rows in (brick_headroom_by_g or {}).items():
        lines += ["", f"headroom: unique bricks at G={g}",
                  f"{'kinds':<32} {'occ':>4} {'measured ms':>11} {'bound ms':>9} {'total ms':>9}"]
        for h in rows:
            lines.append(
                f"{'+'.join(h['kinds'])[:32]:<32} {h['occurrences']:>4} {_ms(h['measured_s']):>11} "
                f"{_ms(h['bound_s']):>9} {_ms(h['total_headroom_s']):>9}"
            )
    flagged = analysis.beats_bound()
    if flagged:
        counts: dict[str, int] = {}
        for r in flagged:
            counts[r.cause or "?"] = counts.get(r.cause or "?", 0) + 1
        lines += ["", f"{len(flagged)} layer(s) beat their bound (efficiency > 1 + noise), by likely cause: "
                      + ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))]
        shown = sorted(flagged, key=lambda r: -(r.efficiency or 0.0))[:max_flagged]
        for r in shown:
            lines.append(f"  {r.model}:{r.name} ({r.kind}, {r.limit}-bound) efficiency {r.efficiency:.2f}: "
                         f"{r.reasons[0] if r.reasons else ''}")
        if len(flagged) > len(shown):
            lines.append(f"  ... and {len(flagged) - len(shown)} more (see --json)")
    return "\n".join(lines) + "\n"


def check_models(models: Sequence[Model]) -> None:
    """Refuse duplicate model names (scenarios and headroom are keyed by name).

    Raises:
        DlbricksError: two models share a name.
    """
    seen: set[str] = set()
    for m in models:
        if m.name in seen:
            raise DlbricksError(f"two models are named {m.name!r}; rename one of the files")
        seen.add(m.name)
