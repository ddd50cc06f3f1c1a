"""The roofline analysis as JSON, as text tables and as a plot."""

from __future__ import annotations

import base64
import io
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dlbricks.files import write_atomically
from dlbricks.roofline.results import RooflineAnalysis

__all__ = ["ROOFLINE_SCHEMA_VERSION", "format_text", "plot_roofline", "to_dict"]

ROOFLINE_SCHEMA_VERSION = 1


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
