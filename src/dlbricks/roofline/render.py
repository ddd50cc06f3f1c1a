"""The roofline analysis as JSON, as text tables and as a plot."""

from __future__ import annotations

import base64
import io
import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeGuard

from dlbricks.files import write_atomically

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from dlbricks.roofline.results import RooflineAnalysis

__all__ = ["ROOFLINE_SCHEMA_VERSION", "RooflinePoint", "RooflineStyle", "draw_roofline", "format_text", "not_placed_lines",
           "plot_roofline", "roofline_figure", "to_dict"]

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
    """Draw the roofline: measured layers as points, the ceilings as lines
    (:func:`draw_roofline`), titled with the thread count; a note under the plot
    names the op types of the layers that cannot be placed, and why
    (:meth:`RooflineAnalysis.not_placed`).

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
    series = [(m.name, [RooflinePoint(r.intensity, r.cost.ops / r.measured_s / 1e9, r.beats_bound, r.is_int8)
                        for r in m.layers if r.not_placed() is None and r.measured_s])
              for m in analysis.models]
    draw_roofline(ax, series, gflops=peaks.gflops, bandwidth_gbs=peaks.bandwidth_gbs, int8_gops=peaks.int8_gops,
                  int8_layers=any(r.is_int8 for m in analysis.models for r in m.layers))
    ax.set_title(f"roofline, {peaks.threads} thread(s)")
    lines = not_placed_lines(analysis)
    if lines:
        note = "\n".join(textwrap.fill(line, 110, subsequent_indent="    ")
                         for line in ["Layers not drawn:", *(f"- {x}" for x in lines)])
        ax.text(0.0, -0.13, note, transform=ax.transAxes, va="top", ha="left", fontsize=7)
    return fig


class RooflinePoint(NamedTuple):
    """One layer on the roofline plot."""

    #: Arithmetic intensity: operations per byte.
    intensity: float
    #: Achieved rate: the layer's operations / its measured time, in G op/s.
    gops: float
    #: Faster than its bound (drawn with a red edge).
    beats_bound: bool
    #: A quantized kernel, under the int8 ceiling (a triangle; float layers are circles).
    int8: bool


@dataclass(frozen=True, slots=True)
class RooflineStyle:
    """The texts and sizes of a roofline plot that differ between its outputs: the
    defaults are the PNG of ``dlbricks roofline``; the HTML report has its own.

    The ceiling labels are :meth:`str.format` templates over ``gflops``,
    ``bandwidth_gbs``, ``ridge``, ``int8_gops`` and ``int8_ridge``.
    """

    roofline: str = "float32 roofline ({gflops:.1f} GFLOP/s, {bandwidth_gbs:.1f} GB/s)"
    ridge: str = "float32 ridge point ({ridge:.1f} FLOP/byte)"
    int8_roofline: str = "int8 roofline ({int8_gops:.1f} GOP/s)"
    int8_ridge: str = "int8 ridge point ({int8_ridge:.1f} op/byte)"
    #: The legend entry of the triangle marker.
    int8_marker: str = "int8 kernel (triangle; circle: float)"
    marker_size: float = 18
    legend_fontsize: float = 7
    #: Where the legend's left edge is, in axes coordinates (right of the axes).
    legend_x: float = 1.02
    #: Points as a raster image inside a vector output (many markers weigh less).
    rasterized: bool = False


def _usable(x: object) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def draw_roofline(
    ax: Axes,
    series: Sequence[tuple[str, Sequence[RooflinePoint]]],
    *,
    gflops: float | None,
    bandwidth_gbs: float | None,
    int8_gops: float | None = None,
    int8_layers: bool = False,
    style: RooflineStyle = RooflineStyle(),
) -> None:
    """Draw a roofline on ``ax``: the layers as points, the ceilings as lines, a legend
    beside the axes; the one drawing of both the CLI's plot and the HTML report's.

    x is arithmetic intensity (operations per byte), y the achieved rate, both
    logarithmic; a ceiling is ``min(peak, intensity x bandwidth)``. Each model has a
    colour (``C0``, ``C1``... by its place in ``series``) and a legend entry when it
    has points. Float layers are circles under the float32 ceiling; quantized (int8)
    kernels are triangles under the int8 ceiling, their operations the int ops and
    FLOPs together. Layers beating their bound have a red edge. Every mark has a
    legend entry.

    Args:
        ax: the axes to draw on (title and notes are the caller's).
        series: per model, its legend label and its points (possibly none).
        gflops: the float32 compute peak; with ``bandwidth_gbs`` (GB/s) the float32
            ceiling and ridge line, drawn when both are finite and the bandwidth positive.
        int8_gops: the int8 compute peak: its ceiling and ridge line where
            ``int8_layers`` and it is finite.
        int8_layers: the graphs hold int8 kernels (placed or not): the int8 ceiling
            and the axes' int8 units.
        style: the labels and sizes (:class:`RooflineStyle`).
    """
    import numpy as np

    xs_all: list[float] = []
    any_int8 = any_flagged = False
    for k, (name, pts) in enumerate(series):
        if not pts:
            continue
        colour = f"C{k % 10}"
        for int8, marker in ((False, "o"), (True, "^")):
            sel = [p for p in pts if p.int8 == int8]
            if not sel:
                continue
            xs_all.extend(p.intensity for p in sel)
            any_int8 |= int8
            any_flagged |= any(p.beats_bound for p in sel)
            ax.scatter([p.intensity for p in sel], [p.gops for p in sel], s=style.marker_size, marker=marker,
                       color=colour, alpha=0.75, rasterized=style.rasterized,
                       edgecolors=["red" if p.beats_bound else colour for p in sel],
                       linewidths=[1.5 if p.beats_bound else 0.5 for p in sel])
        ax.scatter([], [], s=style.marker_size, marker="o", color=colour, label=name)
    if _usable(gflops) and _usable(bandwidth_gbs) and bandwidth_gbs > 0:
        bw = float(bandwidth_gbs)
        ridge = gflops / bw
        int8_top = float(int8_gops) if int8_layers and _usable(int8_gops) else None
        int8_ridge = int8_top / bw if int8_top is not None else None
        ridges = [ridge] + ([int8_ridge] if int8_ridge is not None else [])
        grid = np.geomspace(min([*xs_all, *ridges]) / 4, max([*xs_all, *ridges]) * 4, 200)
        values = {"gflops": gflops, "bandwidth_gbs": bw, "ridge": ridge, "int8_gops": int8_top,
                  "int8_ridge": int8_ridge}
        ax.plot(grid, np.minimum(gflops, grid * bw), color="black", lw=1.5, label=style.roofline.format(**values))
        ax.axvline(ridge, color="grey", lw=0.8, ls=":", label=style.ridge.format(**values))
        if int8_top is not None and int8_ridge is not None:
            ax.plot(grid, np.minimum(int8_top, grid * bw), color="dimgrey", lw=1.2, ls="--",
                    label=style.int8_roofline.format(**values))
            ax.axvline(int8_ridge, color="grey", lw=0.8, ls="-.", label=style.int8_ridge.format(**values))
    if any_int8:
        ax.scatter([], [], s=style.marker_size, marker="^", color="grey", label=style.int8_marker)
    if any_flagged:
        ax.scatter([], [], s=style.marker_size, facecolors="white", edgecolors="red", linewidths=1.5,
                   label="faster than its bound")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte" + ("; int8 kernels: op/byte)" if int8_layers else ")"))
    ax.set_ylabel("achieved GFLOP/s" + (" (int8 kernels: GOP/s)" if int8_layers else ""))
    ax.grid(True, which="both", alpha=0.2)
    ax.legend(fontsize=style.legend_fontsize, loc="center left", bbox_to_anchor=(style.legend_x, 0.5), frameon=False)


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
