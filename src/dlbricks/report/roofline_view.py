"""The report's roofline section, from the JSON of ``dlbricks roofline --json``.

Written like the rest of the report: column names and units a reader knows, a legend
for every mark, every count explained, and long lists summarised (the full data stays
in the roofline JSON, named where it is cut). The plot is drawn from the per-layer
data when the JSON has it, as SVG, by the CLI's own drawing
(:func:`dlbricks.roofline.render.draw_roofline`, with the report's labels and sizes);
otherwise the JSON's own picture is shown.
"""

from __future__ import annotations

import base64
import math
from typing import Any, Callable, Mapping, Sequence

from dlbricks.report.markup import Cell, esc, finite, kv_table, number_cell, seconds_cell, table
from dlbricks.report.plots import figure, label, new_figure
from dlbricks.roofline.render import RooflinePoint, RooflineStyle, draw_roofline

__all__ = ["CAUSES", "roofline_section"]

#: What each cause code of a layer faster than its bound means.
CAUSES = {
    "cache_resident": "its data fits in the last-level cache, while the bandwidth ceiling is DRAM's",
    "bandwidth_peak": "it streams faster than the measured memory-bandwidth peak",
    "flop_formula_or_peak": "it computes faster than the compute peak, or its FLOP formula overcounts",
}
#: The same, in a few words (table cells).
_CAUSES_SHORT = {"cache_resident": "cache-resident data", "bandwidth_peak": "above the bandwidth peak",
                 "flop_formula_or_peak": "above the compute peak, or FLOPs overcounted"}
_TOP = 15  # rows of each long list shown
#: What the JSON's ``graph`` says the layers are.
_GRAPHS = {"runtime": "the graphs onnxruntime executes (its fused and quantized kernels)",
           "source": "the models' own graphs", "mixed": "the graphs onnxruntime executes, some models' source graphs"}
#: Why layers have no point on the plot (the codes of the JSON's ``not_placed``).
_NOT_PLACED = {
    "no_formula": "no formula for their op (their bound counts their bytes alone)",
    "no_arithmetic": "no arithmetic (data movement, views, table lookups: bounded by memory alone, with no place "
                     "on an intensity axis)",
    "no_bytes": "no bytes moved (their intensity is infinite)",
    "not_measured": "no measurement in the store",
}

#: The plot's labels and sizes in the report (a page wider than the CLI's PNG; points
#: rasterized: a thousand vector markers would weigh more than the rest of the report).
_PLOT_STYLE = RooflineStyle(
    roofline="roofline: {gflops:.0f} GFLOP/s, {bandwidth_gbs:.1f} GB/s", ridge="ridge point ({ridge:.1f} FLOP/byte)",
    int8_roofline="int8 roofline: {int8_gops:.0f} GOP/s", int8_marker="int8 kernel (circle: float)", marker_size=22,
    legend_fontsize=9, legend_x=1.01, rasterized=True)


def _ratio(x: Any) -> Cell:
    return number_cell(x, 2, "×")


def _when(source: Any) -> str:
    return {"end_to_end": "end to end", "layer_sum": "sum of its layers"}.get(str(source), "not measured")


def roofline_section(roofline: Mapping[str, Any], section: Callable[..., str], source: str | None = None) -> str:
    """The section; ``section`` wraps the body, ``source`` names the file with the full data."""
    where = source or "the JSON of `dlbricks roofline --json`"  # plain text: captions escape it
    peaks = roofline.get("peaks") or {}
    models = [m for m in roofline.get("models") or [] if isinstance(m, Mapping)]
    int8_layers = sum(_is_int8(r) for m in models for r in _layers(m))
    int8 = (" (and the integer operations of int8 kernels at the int8 peak)"
            if int8_layers or finite(peaks.get("int8_gops")) else "")
    graph = _GRAPHS.get(str(roofline.get("graph")))
    parts = ['<p class="intro">A layer cannot run faster than its roofline bound: its FLOPs at the machine\'s '
             f"compute peak{int8}, or its minimum bytes at the memory-bandwidth peak, whichever takes longer. "
             "Efficiency is bound / measured time (1 = at the bound)."
             + (f" The layers are those of {esc(graph)}." if graph else "") + "</p>"]
    if peaks:
        parts.append(_peaks_table(peaks, int8_layers))
    parts.append(_plot(roofline, models, peaks))
    if models:
        parts.append(_models_table(models))
        parts.append(_what_if_table(models))
    headroom = [h for h in roofline.get("headroom") or [] if isinstance(h, Mapping)]
    if headroom:
        parts.append(_headroom_table(headroom, where))
    for G, rows in sorted((roofline.get("brick_headroom") or {}).items()):
        if rows:
            parts.append(_brick_headroom_table(G, rows))
    parts.append(_beats_bound(roofline.get("beats_bound") or [], roofline.get("noise"), where))
    body = "\n".join(p for p in parts if p)
    return section("roofline", body, note=None if (peaks or models) else "The roofline result is empty.")


def _peaks_table(peaks: Mapping[str, Any], int8_layers: int = 0) -> str:
    caches = [c for c in peaks.get("caches") or [] if isinstance(c, Mapping) and c.get("type") != "Instruction"]
    llc = max(caches, key=lambda c: (c.get("level", 0), c.get("size_bytes", 0))) if caches else None
    sizes = peaks.get("gflops_by_size") or {}
    bw = peaks.get("bandwidth_gbs")
    rows: list[tuple[str, Any]] = [
        ("Compute peak (MatMul)", f"{peaks.get('gflops', math.nan):.1f} GFLOP/s"),
        ("Memory-bandwidth peak (best of copy, triad, onnxruntime)", f"{peaks.get('bandwidth_gbs', math.nan):.1f} GB/s"),
    ]
    if finite(peaks.get("gflops")) and finite(bw) and bw > 0:
        rows.append(("Ridge point (compute-bound above)", f"{peaks['gflops'] / bw:.1f} FLOP/byte"))
    if sizes:
        rows.append(("Compute by MatMul size n×n", _by_size(sizes, "GFLOP/s")))
    int8 = peaks.get("int8_gops")
    if finite(int8):
        rows.append(("Int8 compute peak (MatMulInteger, uint8 × int8)", f"{int8:.1f} GOP/s"))
        if finite(bw) and bw > 0:
            rows.append(("Int8 ridge point (int8 kernels compute-bound above)", f"{int8 / bw:.1f} op/byte"))
        if peaks.get("int8_gops_by_size"):
            rows.append(("Int8 compute by MatMulInteger size n×n", _by_size(peaks["int8_gops_by_size"], "GOP/s")))
    elif int8_layers:
        rows.append(("Int8 compute peak", f"not measured (peaks from an older version): the {int8_layers} int8 "
                                          "layers are bounded by memory and their float work alone"))
    if llc:
        rows.append(("Last-level cache", f"L{llc.get('level')} {int(llc.get('size_bytes', 0)) >> 20} MiB"))
    rows.append(("Threads", peaks.get("threads")))
    if peaks.get("cores"):
        rows.append(("Pinned to CPUs", ", ".join(str(c) for c in peaks["cores"])))
    rows.append(("Measurement", "quick" if peaks.get("quick") else "full"))
    return kv_table([(k, str(v)) for k, v in rows], (), "roofline-peaks")


def _by_size(sizes: Mapping[str, Any], unit: str) -> str:
    return ", ".join(f"{k}: {float(v):.1f}" for k, v in sorted(sizes.items(), key=lambda kv: int(kv[0]))) + f" {unit}"


def _layers(model: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [r for r in model.get("layers") or [] if isinstance(r, Mapping)]


def _work(layer: Mapping[str, Any]) -> float:
    """A layer's operations: FLOPs and, for an int8 kernel, its integer operations."""
    return float(layer.get("flops") or 0) + float(layer.get("int_ops") or 0)


def _is_int8(layer: Mapping[str, Any]) -> bool:
    return float(layer.get("int_ops") or 0) > 0


def _why_not_placed(layer: Mapping[str, Any]) -> str | None:
    """The JSON's reason code for a layer without a point (None: it has one), for a
    roofline JSON that predates ``not_placed``."""
    if layer.get("has_formula") is False:
        return "no_formula"
    if not _work(layer) > 0:
        return "no_arithmetic"
    if not finite(layer.get("arithmetic_intensity")):
        return "no_bytes"
    if not layer.get("measured_s"):
        return "not_measured"
    return None


def _not_placed(roofline: Mapping[str, Any], models: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The layers without a point, by reason: the JSON's ``not_placed``, or the same
    worked out from its layers when it has none."""
    given = roofline.get("not_placed")
    if isinstance(given, list):
        return [e for e in given if isinstance(e, Mapping) and e.get("layers")]
    by: dict[str, dict[str, int]] = {}
    for m in models:
        for r in _layers(m):
            why = _why_not_placed(r)
            if why is not None:
                kinds = by.setdefault(why, {})
                kinds[str(r.get("kind"))] = kinds.get(str(r.get("kind")), 0) + 1
    return [{"reason": code, "layers": sum(by[code].values()),
             "kinds": dict(sorted(by[code].items(), key=lambda kv: (-kv[1], kv[0])))} for code in _NOT_PLACED
            if code in by]


def _not_placed_note(entries: Sequence[Mapping[str, Any]], most: int = 6) -> str:
    """The layers not drawn: per reason, how many and their op types (most frequent
    first); HTML."""
    out = []
    for e in entries:
        n = e.get("layers") or 0
        # A reason newer than this report: the JSON's own explanation.
        why = _NOT_PLACED.get(str(e.get("reason"))) or str(e.get("explanation") or e.get("reason"))
        kinds = [(str(k), c) for k, c in (e.get("kinds") or {}).items()]
        named = ", ".join(f"{k} {c}" for k, c in kinds[:most])
        if len(kinds) > most:
            named += f", {len(kinds) - most} more op types"
        out.append(f"{n} {'layer' if n == 1 else 'layers'} with {why}" + (f": {named}" if named else ""))
    return esc("; ".join(out) + ".")


def _plot(roofline: Mapping[str, Any], models: Sequence[Mapping[str, Any]], peaks: Mapping[str, Any]) -> str:
    not_placed = _not_placed(roofline, models)
    have_layers = any(m.get("layers") for m in models)
    if not have_layers:
        img = roofline.get("plot_png_base64")
        if isinstance(img, str) and img:
            try:
                base64.b64decode(img, validate=True)
            except ValueError:
                return ""
            missing = (" Not drawn: " + _not_placed_note(not_placed) if not_placed else "")
            return (f'<figure id="fig-roofline"><img src="data:image/png;base64,{img}" alt="Roofline plot">'
                    "<figcaption>Roofline: each point a layer, at its arithmetic intensity and achieved rate; the "
                    "lines are the rooflines, red edges mark layers faster than their bound, triangles int8 "
                    f"kernels.{missing}</figcaption></figure>")
        return ""
    gflops, bw, int8_peak = peaks.get("gflops"), peaks.get("bandwidth_gbs"), peaks.get("int8_gops")
    series = [(label(m.get("name", "?"), 24),
               [RooflinePoint(float(r["arithmetic_intensity"]), _work(r) / r["measured_s"] / 1e9,
                              bool(r.get("beats_bound")), _is_int8(r)) for r in _layers(m) if _why_not_placed(r) is None])
              for m in models]
    total = sum(len(_layers(m)) for m in models)
    placed = sum(len(pts) for _, pts in series)
    int8_layers = any(_is_int8(r) for m in models for r in _layers(m))
    fig = new_figure(8.0, 5.5)
    # No ceilings on a plot without points.
    draw_roofline(fig.add_subplot(), series, gflops=gflops if placed else None, bandwidth_gbs=bw, int8_gops=int8_peak,
                  int8_layers=int8_layers, style=_PLOT_STYLE)
    note = esc(f"{placed} of {total} layers drawn, one point each at its arithmetic intensity and achieved rate, "
               "coloured by model.")
    if not_placed:
        note += " Not drawn: " + _not_placed_note(not_placed)
    if int8_layers and not finite(int8_peak):
        note += esc(" The int8 peak was not measured (peaks from an older version): int8 kernels have no ceiling "
                    "of their own here.")
    return figure(fig, "fig-roofline", "Roofline: layers against the machine's ceilings", legend=note)


def _models_table(models: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    graphs = any(m.get("graph") for m in models)  # roofline JSONs before --graph have none
    for m in models:
        rows.append([
            m.get("name"), m.get("n_layers"), seconds_cell(m.get("measured_s")), _when(m.get("measured_source")),
            seconds_cell(m.get("ideal_sequential_s")), seconds_cell(m.get("ideal_critical_path_s")),
            number_cell(m.get("efficiency")), m.get("layers_measured"), m.get("beats_bound"),
            ", ".join(m.get("kinds_without_formula") or []),
        ] + ([{"runtime": "onnxruntime's", "source": "the model file's"}.get(str(m.get("graph")), "")]
             if graphs else []))
    cols = ["model", "layers", "measured latency", "measured", "at the bound (layers in sequence)",
            "at the bound (critical path)", "efficiency (bound / measured)", "layers measured",
            "layers faster than their bound", "op types without a formula"] + (["layers of the graph"] if graphs else [])
    return table(cols, rows, tid="table-roofline", caption="Models against their roofline bound")


def _what_if_table(models: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    batch_seen = False
    for m in models:
        sc = m.get("scenarios") or {}
        ab, pb, fu = sc.get("at_bound") or {}, sc.get("parallel_branches") or {}, sc.get("fusion") or {}
        bt = sc.get("batch")
        row = [m.get("name"), seconds_cell(m.get("layer_sum_s")),
               seconds_cell(ab.get("latency_s")), _ratio(ab.get("speedup")),
               seconds_cell(pb.get("latency_s")), _ratio(pb.get("speedup")),
               seconds_cell(fu.get("latency_s")), _ratio(fu.get("speedup")),
               seconds_cell(fu.get("bound_latency_s")), _ratio(fu.get("bound_speedup"))]
        if bt is not None:
            batch_seen = True
            row.append(f"N={bt.get('batch')}: " + (f"{seconds_cell(bt.get('per_sample_latency_s')).text} per sample, "
                                                   f"{_ratio(bt.get('per_sample_speedup')).text}"
                                                   if bt.get("rebatchable") else "not re-batchable"))
        elif batch_seen:
            row.append("")
        rows.append(row)
    cols = ["model", "sum of layers", "every layer at its bound", "speedup", "independent branches in parallel",
            "speedup", "elementwise layers fused", "speedup", "fused and at the bound", "speedup"]
    if batch_seen:
        cols.append("another batch size")
    return table(cols, rows, tid="table-roofline-what-if",
                 caption="What-if: each model's latency under each scenario (speedup over the sum of its layers)")


def _headroom_table(headroom: Sequence[Mapping[str, Any]], where: str) -> str:
    rows = [[h.get("kind"), h.get("occurrences"), len(h.get("models") or []), seconds_cell(h.get("measured_s")),
             seconds_cell(h.get("bound_s")), h.get("limit"), number_cell(h.get("efficiency")),
             seconds_cell(h.get("total_headroom_s")), h.get("example")] for h in headroom[:_TOP]]
    cols = ["layer", "occurrences", "models", "measured", "bound", "limited by", "efficiency",
            "time above the bound, all occurrences", "example"]
    caption = f"Where the time above the bound is: the {len(rows)} unique layers with the most"
    if len(headroom) > len(rows):
        caption += f" (of {len(headroom)}; all in the roofline JSON)"
    return table(cols, rows, tid="table-roofline-headroom", caption=caption)


def _brick_headroom_table(G: Any, rows: Sequence[Mapping[str, Any]]) -> str:
    out = [["+".join(h.get("kinds") or []), h.get("occurrences"), seconds_cell(h.get("measured_s")),
            seconds_cell(h.get("bound_s")), seconds_cell(h.get("total_headroom_s"))] for h in rows[:_TOP]]
    return table(["brick", "occurrences", "measured", "bound", "time above the bound, all occurrences"], out,
                 tid=f"table-roofline-bricks-{esc(G)}", caption=f"Unique bricks at G={G} with the most time above the bound")


def _beats_bound(rows: Sequence[Any], noise: Any, where: str) -> str:
    rows = [r for r in rows if isinstance(r, Mapping)]
    if not rows:
        return '<p class="note">No layer runs faster than its bound.</p>'
    counts: dict[str, int] = {}
    for r in rows:
        counts[str(r.get("cause") or "unknown")] = counts.get(str(r.get("cause") or "unknown"), 0) + 1
    slack = f"{100 * float(noise):.0f}%" if finite(noise) else "the noise margin"
    items = "".join(f"<li><b>{n}</b>: {esc(CAUSES.get(c, c))}</li>" for c, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    shown = sorted(rows, key=lambda r: -(r.get("efficiency") or 0.0))[:_TOP]
    trs = [[r.get("model"), r.get("name"), r.get("kind"), r.get("limit"), seconds_cell(r.get("bound_s")),
            seconds_cell(r.get("measured_s")), number_cell(r.get("efficiency"), 2), _CAUSES_SHORT.get(str(r.get("cause")), str(r.get("cause") or ""))]
           for r in shown]
    text = (f'<h3>Layers faster than their bound</h3><p>{len(rows)} layers ran faster than their bound allows (by '
            f"more than {slack}): the bound is a model of the machine, and these show where it is too simple. "
            f"Likely causes:</p><ul>{items}</ul>")
    rest = f"; all {len(rows)} are in {where} (beats_bound)" if len(rows) > len(shown) else ""
    return text + table(["model", "layer", "op type", "limited by", "bound", "measured", "efficiency", "likely cause"],
                        trs, tid="table-roofline-beats", caption=f"The {len(shown)} most efficient{rest}")
