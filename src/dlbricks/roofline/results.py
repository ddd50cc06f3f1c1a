"""What a roofline analysis returns: one row per layer, one per model, and the whole."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dlbricks.roofline.costmodel import LayerCost

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.roofline.peaks import Peaks

__all__ = ["NOT_PLACED", "LayerRoofline", "ModelRoofline", "RooflineAnalysis"]

#: Why a layer has no point on the roofline plot (:meth:`LayerRoofline.not_placed`),
#: in the order they are checked.
NOT_PLACED = {
    "no_formula": "no formula for its op (or a type the formula needs is unknown): its bound counts its bytes alone",
    "no_arithmetic": "no arithmetic (data movement, views, table lookups): bounded by memory alone, "
                     "with no place on an intensity axis",
    "no_bytes": "moves no bytes: its intensity is infinite",
    "not_measured": "no measurement in the store",
}


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

    @property
    def is_int8(self) -> bool:
        """A quantized kernel: its integer work sets it against the int8 ceiling."""
        return self.cost.int_ops > 0

    def not_placed(self) -> str | None:
        """None when the layer has a point on the roofline plot (a formula, some
        arithmetic, bytes and a measurement); else why not, a :data:`NOT_PLACED` code."""
        if not self.cost.has_formula:
            return "no_formula"
        if self.cost.ops == 0:
            return "no_arithmetic"
        if not math.isfinite(self.intensity):
            return "no_bytes"
        if not self.measured_s:
            return "not_measured"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "name": self.name, "kind": self.kind, "digest": self.digest,
            "flops": self.cost.flops, "macs": self.cost.macs, "int_ops": self.cost.int_ops,
            "bytes_min": self.cost.bytes_min, "has_formula": self.cost.has_formula,
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
            "int_ops": sum(r.cost.int_ops for r in self.layers),
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

    def not_placed(self) -> list[dict[str, Any]]:
        """The layers without a point on the roofline plot, by reason.

        Returns:
            One dict per reason that applies, in :data:`NOT_PLACED` order: ``reason``
            (the code), ``explanation``, ``layers`` (how many) and ``kinds`` (op kind ->
            layers, most first).
        """
        by: dict[str, dict[str, int]] = {}
        for m in self.models:
            for r in m.layers:
                why = r.not_placed()
                if why is not None:
                    kinds = by.setdefault(why, {})
                    kinds[r.kind] = kinds.get(r.kind, 0) + 1
        return [{"reason": code, "explanation": NOT_PLACED[code], "layers": sum(by[code].values()),
                 "kinds": dict(sorted(by[code].items(), key=lambda kv: (-kv[1], kv[0])))}
                for code in NOT_PLACED if code in by]
