"""Roofline lower bounds and what-if analysis over measured layers (Benanza).

Per layer, from :mod:`dlbricks.roofline.costmodel` and measured :class:`~dlbricks.roofline.peaks.Peaks`:

* **bound** = ``max(flops / peak FLOP/s + int_ops / int8 peak, bytes_min / bandwidth)``
  seconds (:func:`~dlbricks.roofline.costmodel.roofline_terms`), and which side
  limits it (``compute``, ``memory``, or ``none`` for views that cost nothing). The
  layers are the graph's, source or runtime: onnxruntime's fused, blocked-layout
  (NCHWc) and quantized kernels have formulas like the standard ops; a quantized
  kernel's integer work is bounded by the measured int8 peak (memory alone when the
  peaks predate it, as the text output says);
* **arithmetic intensity** = (flops + int_ops) / bytes_min;
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

The result types live in :mod:`.results` and the JSON, text and plot output in
:mod:`.render`; this module re-exports them, so it is the one callers import.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from dlbricks.corpus import Corpus
from dlbricks.cpuset import usable_cpus
from dlbricks.errors import DlbricksError, ModelError
from dlbricks.graph import critical_path
from dlbricks.loading.names import is_default_domain
from dlbricks.model import Model
from dlbricks.roofline.costmodel import layer_cost, roofline_terms
from dlbricks.roofline.formulas import VIEW_OPS
from dlbricks.roofline.render import (
    ROOFLINE_SCHEMA_VERSION,
    format_text,
    not_placed_lines,
    plot_roofline,
    roofline_figure,
    to_dict,
)
from dlbricks.roofline.results import NOT_PLACED, LayerRoofline, ModelRoofline, RooflineAnalysis

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.roofline.peaks import Peaks
    from dlbricks.store import ResultRecord, Store
    from dlbricks.timing import RunnerConfig

__all__ = [
    "CAUSES",
    "FUSABLE_OPS",
    "NOT_PLACED",
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
    "not_placed_lines",
    "peaks_dir",
    "peaks_for_store",
    "plot_roofline",
    "rebatch",
    "roofline_figure",
    "to_dict",
]

#: Default relative measurement noise: an efficiency up to 1 + this is not flagged.
DEFAULT_NOISE = 0.05

#: Elementwise and activation op kinds that a producer kernel can absorb: default-domain
#: ops, and onnxruntime's own activations left unfused in the graph it runs.
FUSABLE_OPS = frozenset({
    "Relu", "LeakyRelu", "PRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh",
    "Elu", "Selu", "Celu", "Softplus", "Softsign", "Mish", "Gelu", "ThresholdedRelu",
    "Erf", "Exp", "Log", "Sqrt", "Neg", "Abs", "Reciprocal",
    "Add", "Sub", "Mul", "Div", "Pow", "Sum",
    "BatchNormalization",
    "com.microsoft::Gelu", "com.microsoft::FastGelu", "com.microsoft::BiasGelu", "com.microsoft::QuickGelu",
    "com.microsoft::BiasAdd",
})


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
        threads = len(usable_cpus())
    root = peaks_dir(store_path) if store_path is not None else None
    return load_or_measure_peaks(root, system_id, threads=threads, cores=config.cores, quick=quick)


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
    if row.is_int8 and peaks.int8_gops is not None:
        return "flop_formula_or_peak", [
            f"the int8 compute peak ({peaks.int8_gops:.1f} GOP/s) is below what this kernel reaches",
            f"the op count for {row.kind} overcounts (its integer and float steps overlap)",
        ]
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
        if layer.kind not in FUSABLE_OPS:
            continue
        for slot in layer.activation_slots():
            name = layer.inputs[slot]
            if name not in producers or name in graph_outputs:
                continue
            if len({c for c, _ in consumers.get(name, [])}) != 1:
                continue
            p, _ = producers[name]
            prod = model.layers[p]
            if prod.op_type in VIEW_OPS and is_default_domain(prod.domain):
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
    out: list[dict[str, Any]] = []
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
    rebatched: Callable[[Model, int], Model] | None = None,
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
        rebatched: makes the model to measure from one of ``models`` and the batch
            (default :func:`rebatch`; e.g. the runtime graph of the re-batched source),
            raising :class:`ModelError` when it cannot be re-batched.

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
            batched.append((rebatched or rebatch)(m, batch))
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
