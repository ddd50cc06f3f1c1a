"""The roofline analysis as JSON, as text tables and as a plot."""

from __future__ import annotations

import base64
import io
import os
import textwrap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dlbricks.files import write_atomically
from dlbricks.roofline.results import RooflineAnalysis

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["ROOFLINE_SCHEMA_VERSION", "format_text", "not_placed_lines", "plot_roofline", "roofline_figure", "to_dict"]

ROOFLINE_SCHEMA_VERSION = 1


# The NOT_PLACED reasons as the predicate of "N layers ...", for the plot's note and the text.
_NOT_PLACED_PHRASE = {
    "no_formula": "have no formula for their op (their bound counts their bytes alone)",
    "no_arithmetic": "do no arithmetic (data movement, views, table lookups: bounded by memory alone)",
    "no_bytes": "move no bytes (their intensity is infinite)",
    "not_measured": "have no measurement in the store",
}
#: Cause codes of layers faster than their bound, in words.
_CAUSE_WORDS = {"cache_resident": "data in cache", "bandwidth_peak": "above the bandwidth peak",
                "flop_formula_or_peak": "above the compute peak, or operations overcounted"}


def _kinds_list(kinds: Mapping[str, int], most: int = 6) -> str:
    items = [f"{k} {n}" for k, n in list(kinds.items())[:most]]
    if len(kinds) > most:
        items.append(f"{len(kinds) - most} more op types")
    return ", ".join(items)


def not_placed_lines(analysis: RooflineAnalysis) -> list[str]:
    """One sentence per reason layers have no point on the roofline plot, naming the
    op types (most frequent first), and one when int8 layers have no int8 ceiling."""
    lines = [f"{e['layers']} layer(s) {_NOT_PLACED_PHRASE[e['reason']]}: {_kinds_list(e['kinds'])}"
             for e in analysis.not_placed()]
    int8 = sum(r.is_int8 for m in analysis.models for r in m.layers)
    if int8 and analysis.peaks.int8_gops is None:
        lines.append(f"int8 peak not measured (peaks from an older version): the {int8} int8 layers are bounded "
                     "by memory and their float work alone")
    return lines


def plot_roofline(analysis: RooflineAnalysis, path: str | os.PathLike[str] | None = None) -> bytes:
    """The roofline plot (:func:`roofline_figure`) as a PNG.

    Args:
        analysis: from :func:`analyze`.
        path: also write the PNG here.

    Returns:
        The PNG bytes.
    """
    fig = roofline_figure(analysis)
    buf = io.BytesIO()
    # A tight box takes in the legend beside the axes and the note below them.
    fig.savefig(buf, format="png", bbox_inches="tight", pad_inches=0.15)
    data = buf.getvalue()
    if path is not None:
        write_atomically(path, data)
    return data


def roofline_figure(analysis: RooflineAnalysis) -> Figure:
    """Draw the roofline: measured layers as points, the ceilings as lines.

    x is arithmetic intensity (operations per byte), y the achieved rate (layer
    operations / measured time), both logarithmic; a ceiling is
    ``min(peak, intensity x bandwidth)``. Float layers are circles under the float32
    ceiling; quantized (int8) kernels are triangles under the int8 ceiling, their
    operations the int ops and FLOPs together. Layers beating their bound have a red
    edge. Every mark has a legend entry; a note under the plot names the op types of
    the layers that cannot be placed, and why (:meth:`RooflineAnalysis.not_placed`).

    Args:
        analysis: from :func:`analyze`.

    Returns:
        A matplotlib Figure with an Agg canvas (save it in any format it supports).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    peaks = analysis.peaks
    fig = Figure(figsize=(8, 5.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    xs_all: list[float] = []
    # The int8 ceiling and labels only where the graphs hold quantized kernels.
    has_int8 = any(r.is_int8 for m in analysis.models for r in m.layers)
    int8_peak = peaks.int8_gops if has_int8 else None
    any_int8 = any_flagged = False
    for k, m in enumerate(analysis.models):
        pts = [(r.intensity, r.cost.ops / r.measured_s / 1e9, r.beats_bound, r.is_int8) for r in m.layers
               if r.not_placed() is None and r.measured_s]
        colour = f"C{k % 10}"
        for int8, marker in ((False, "o"), (True, "^")):
            sel = [p for p in pts if p[3] == int8]
            if not sel:
                continue
            x, y, flag, _ = zip(*sel)
            xs_all.extend(x)
            any_int8 |= int8
            any_flagged |= any(flag)
            ax.scatter(x, y, s=18, marker=marker, color=colour, alpha=0.75,
                       edgecolors=["red" if f else colour for f in flag], linewidths=[1.5 if f else 0.5 for f in flag])
        if pts:
            ax.scatter([], [], s=18, marker="o", color=colour, label=m.name)
    int8_ridge = peaks.int8_ridge_point if int8_peak is not None else None
    ridges = [peaks.ridge_point] + ([int8_ridge] if int8_ridge is not None else [])
    lo = min([*xs_all, *ridges]) / 4
    hi = max([*xs_all, *ridges]) * 4
    grid = np.geomspace(lo, hi, 200)
    ax.plot(grid, np.minimum(peaks.gflops, grid * peaks.bandwidth_gbs), color="black", lw=1.5,
            label=f"float32 roofline ({peaks.gflops:.1f} GFLOP/s, {peaks.bandwidth_gbs:.1f} GB/s)")
    ax.axvline(peaks.ridge_point, color="grey", lw=0.8, ls=":",
               label=f"float32 ridge point ({peaks.ridge_point:.1f} FLOP/byte)")
    if int8_peak is not None and int8_ridge is not None:
        ax.plot(grid, np.minimum(int8_peak, grid * peaks.bandwidth_gbs), color="dimgrey", lw=1.2, ls="--",
                label=f"int8 roofline ({int8_peak:.1f} GOP/s)")
        ax.axvline(int8_ridge, color="grey", lw=0.8, ls="-.", label=f"int8 ridge point ({int8_ridge:.1f} op/byte)")
    if any_int8:
        ax.scatter([], [], s=18, marker="^", color="grey", label="int8 kernel (triangle; circle: float)")
    if any_flagged:
        ax.scatter([], [], s=18, facecolors="white", edgecolors="red", linewidths=1.5, label="faster than its bound")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte" + ("; int8 kernels: op/byte)" if has_int8 else ")"))
    ax.set_ylabel("achieved GFLOP/s" + (" (int8 kernels: GOP/s)" if has_int8 else ""))
    ax.set_title(f"roofline, {peaks.threads} thread(s)")
    ax.grid(True, which="both", alpha=0.2)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
    lines = not_placed_lines(analysis)
    if lines:
        note = "\n".join(textwrap.fill(line, 110, subsequent_indent="    ")
                         for line in ["Layers not drawn:", *(f"- {x}" for x in lines)])
        ax.text(0.0, -0.13, note, transform=ax.transAxes, va="top", ha="left", fontsize=7)
    return fig


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
    ``headroom``, ``brick_headroom`` (by G), ``beats_bound``, ``not_placed`` (the
    layers without a point on the plot, by reason: :meth:`RooflineAnalysis.not_placed`)
    and, when a plot was drawn, ``plot_png_base64``."""
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
        "not_placed": analysis.not_placed(),
    }
    if png is not None:
        d["plot_png_base64"] = base64.b64encode(png).decode("ascii")
    return d


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _table(header: Sequence[tuple[str, int]], rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns as wide as the wider of their header and cells; a positive width
    right-aligns (numbers), a negative one left-aligns (names)."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, (h, _) in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if a > 0 else c.ljust(w) for c, w, (_, a) in zip(cells, widths, header)).rstrip()
    return [line([h for h, _ in header]), *(line(r) for r in rows)]


_SOURCE_WORDS = {"end_to_end": "end to end", "layer_sum": "sum of layers"}


def format_text(
    analysis: RooflineAnalysis,
    headroom: Sequence[Mapping[str, Any]] = (),
    brick_headroom_by_g: Mapping[int, Sequence[Mapping[str, Any]]] | None = None,
    *,
    max_flagged: int = 10,
) -> str:
    """The human-readable tables: peaks, models, scenarios, headroom, the layers
    without a point on the plot (by reason, naming their op types), and the layers
    that beat their bound (the ``max_flagged`` most efficient of them, with a count
    per cause)."""
    p = analysis.peaks
    int8 = (f", int8 {p.int8_gops:.1f} GOP/s (ridge {p.int8_ridge_point:.1f} op/byte)"
            if p.int8_gops is not None and p.int8_ridge_point is not None else ", int8 not measured")
    lines = [
        f"peaks: float32 {p.gflops:.1f} GFLOP/s{int8}, memory {p.bandwidth_gbs:.1f} GB/s, "
        f"float32 ridge {p.ridge_point:.1f} FLOP/byte ({p.threads} thread(s){', quick' if p.quick else ''})",
        "",
    ]
    rows = []
    for m in analysis.models:
        rows.append([
            m.name, str(len(m.layers)), _ms(m.measured_s), _SOURCE_WORDS.get(m.measured_source or "", "-"),
            _ms(m.ideal_sequential_s), _ms(m.ideal_critical_path_s),
            "-" if m.efficiency is None else f"{m.efficiency:.3f}", str(m.layers_missing),
            str(sum(r.beats_bound for r in m.layers)),
        ])
    lines += _table([("model", -1), ("layers", 1), ("measured (ms)", 1), ("measured as", -1),
                     ("bound, sequential (ms)", 1), ("bound, critical path (ms)", 1),
                     ("efficiency", 1), ("unmeasured", 1), ("faster than bound", 1)], rows)
    rows = []
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
        rows.append([
            m.name, _ms(m.layer_sum_s), f"{_ms(ab['latency_s'])} {_x(ab['speedup'])}",
            f"{_ms(pb['latency_s'])} {_x(pb['speedup'])}", f"{_ms(fu['latency_s'])} {_x(fu['speedup'])}",
            f"{_ms(fu['bound_latency_s'])} {_x(fu['bound_speedup'])}", batch,
        ])
    lines += ["", "what-if: latency (ms) and speedup over the sum of the layers"]
    lines += _table([("model", -1), ("sum of layers", 1), ("every layer at its bound", 1),
                     ("branches in parallel", 1), ("elementwise layers fused", 1), ("fused, at the bound", 1),
                     ("another batch (ms per sample)", 1)], rows)
    for m in analysis.models:
        bt = m.scenarios.get("batch")
        if bt is not None and not bt["rebatchable"]:
            lines.append(f"  {bt['error']}")
    if headroom:
        rows = [[h["kind"], str(h["occurrences"]), _ms(h["measured_s"]), _ms(h["bound_s"]),
                 "-" if h["efficiency"] is None else f"{h['efficiency']:.3f}", _ms(h["total_headroom_s"]),
                 h["example"]] for h in headroom]
        lines += ["", "headroom: unique layers by (measured - bound) x occurrences"]
        lines += _table([("op type", -1), ("occurrences", 1), ("measured (ms)", 1), ("bound (ms)", 1),
                         ("efficiency", 1), ("above the bound, all occurrences (ms)", 1), ("example", -1)], rows)
    for g, bricks in (brick_headroom_by_g or {}).items():
        rows = [["+".join(h["kinds"]), str(h["occurrences"]), _ms(h["measured_s"]), _ms(h["bound_s"]),
                 _ms(h["total_headroom_s"])] for h in bricks]
        lines += ["", f"headroom: unique bricks at G={g}"]
        lines += _table([("op types", -1), ("occurrences", 1), ("measured (ms)", 1), ("bound (ms)", 1),
                         ("above the bound, all occurrences (ms)", 1)], rows)
    unplaced = not_placed_lines(analysis)
    if unplaced:
        lines += ["", "layers without a point on the roofline plot:"] + [f"  {x}" for x in unplaced]
    flagged = analysis.beats_bound()
    if flagged:
        counts: dict[str, int] = {}
        for r in flagged:
            counts[r.cause or "?"] = counts.get(r.cause or "?", 0) + 1
        causes = sorted(counts.items(), key=lambda kv: -kv[1])
        lines += ["", f"{len(flagged)} layer(s) beat their bound (efficiency > 1 + noise), by likely cause: "
                      + ", ".join(f"{_CAUSE_WORDS.get(k, k)} {v}" for k, v in causes)]
        shown = sorted(flagged, key=lambda r: -(r.efficiency or 0.0))[:max_flagged]
        for r in shown:
            lines.append(f"  {r.model}:{r.name} ({r.kind}, {r.limit}-bound) efficiency {r.efficiency:.2f}: "
                         f"{r.reasons[0] if r.reasons else ''}")
        if len(flagged) > len(shown):
            lines.append(f"  ... and {len(flagged) - len(shown)} more (see --json)")
    return "\n".join(lines) + "\n"
