"""The report's roofline section, from the JSON of ``dlbricks roofline --json``.

Written like the rest of the report: column names and units a reader knows, a legend
for every mark, every count explained, and long lists summarised (the full data stays
in the roofline JSON, named where it is cut). The plot is drawn here from the
per-layer data when the JSON has it, as SVG; otherwise the JSON's own picture is shown.
"""

from __future__ import annotations

import base64
import math
from typing import Any, Callable, Mapping, Sequence

from dlbricks.report.markup import Cell, esc, finite, kv_table, number_cell, seconds_cell, table
from dlbricks.report.plots import figure, label, new_figure

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


def _ratio(x: Any) -> Cell:
    return number_cell(x, 2, "×")


def _when(source: Any) -> str:
    return {"end_to_end": "end to end", "layer_sum": "sum of its layers"}.get(str(source), "not measured")


def roofline_section(roofline: Mapping[str, Any], section: Callable[..., str], source: str | None = None) -> str:
    """The section; ``section`` wraps the body, ``source`` names the file with the full data."""
    where = source or "the JSON of `dlbricks roofline --json`"  # plain text: captions escape it
    parts = ['<p class="intro">A layer cannot run faster than its roofline bound: its FLOPs at the machine\'s '
             "compute peak, or its minimum bytes at the memory-bandwidth peak, whichever takes longer. Efficiency is "
             "bound / measured time (1 = at the bound).</p>"]
    peaks = roofline.get("peaks") or {}
    if peaks:
        parts.append(_peaks_table(peaks))
    models = [m for m in roofline.get("models") or [] if isinstance(m, Mapping)]
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


def _peaks_table(peaks: Mapping[str, Any]) -> str:
    caches = [c for c in peaks.get("caches") or [] if isinstance(c, Mapping) and c.get("type") != "Instruction"]
    llc = max(caches, key=lambda c: (c.get("level", 0), c.get("size_bytes", 0))) if caches else None
    sizes = peaks.get("gflops_by_size") or {}
    rows: list[tuple[str, Any]] = [
        ("Compute peak (MatMul)", f"{peaks.get('gflops', math.nan):.1f} GFLOP/s"),
        ("Memory-bandwidth peak (best of copy, triad, onnxruntime)", f"{peaks.get('bandwidth_gbs', math.nan):.1f} GB/s"),
    ]
    if finite(peaks.get("gflops")) and finite(peaks.get("bandwidth_gbs")) and peaks["bandwidth_gbs"] > 0:
        rows.append(("Ridge point (compute-bound above)", f"{peaks['gflops'] / peaks['bandwidth_gbs']:.1f} FLOP/byte"))
    if sizes:
        rows.append(("Compute by MatMul size n×n", ", ".join(f"{k}: {float(v):.1f}" for k, v in
                                                            sorted(sizes.items(), key=lambda kv: int(kv[0]))) +
                     " GFLOP/s"))
    if llc:
        rows.append(("Last-level cache", f"L{llc.get('level')} {int(llc.get('size_bytes', 0)) >> 20} MiB"))
    rows.append(("Threads", peaks.get("threads")))
    if peaks.get("cores"):
        rows.append(("Pinned to CPUs", ", ".join(str(c) for c in peaks["cores"])))
    rows.append(("Measurement", "quick" if peaks.get("quick") else "full"))
    return kv_table([(k, str(v)) for k, v in rows], (), "roofline-peaks")


def _placeable(layer: Mapping[str, Any]) -> bool:
    return bool(layer.get("measured_s")) and (layer.get("flops") or 0) > 0 and finite(layer.get("arithmetic_intensity"))


def _plot(roofline: Mapping[str, Any], models: Sequence[Mapping[str, Any]], peaks: Mapping[str, Any]) -> str:
    have_layers = any(m.get("layers") for m in models)
    if not have_layers:
        img = roofline.get("plot_png_base64")
        if isinstance(img, str) and img:
            try:
                base64.b64decode(img, validate=True)
            except ValueError:
                return ""
            return (f'<figure id="fig-roofline"><img src="data:image/png;base64,{img}" alt="Roofline plot">'
                    "<figcaption>Roofline: each point a layer, at its arithmetic intensity and achieved rate; the "
                    "line is the roofline, red edges mark layers faster than their bound. Layers without FLOPs "
                    "(data movement such as Reshape) or without a measurement cannot be placed.</figcaption></figure>")
        return ""
    gflops, bw = peaks.get("gflops"), peaks.get("bandwidth_gbs")
    fig = new_figure(8.0, 5.5)
    ax = fig.add_subplot()
    xs_all: list[float] = []
    no_flops = unmeasured = total = 0
    for k, m in enumerate(models):
        layers = [r for r in m.get("layers") or [] if isinstance(r, Mapping)]
        total += len(layers)
        pts = []
        for r in layers:
            if not (r.get("flops") or 0) > 0 or not finite(r.get("arithmetic_intensity")):
                no_flops += 1
            elif not r.get("measured_s"):
                unmeasured += 1
            else:
                pts.append((float(r["arithmetic_intensity"]), r["flops"] / r["measured_s"] / 1e9, bool(r.get("beats_bound"))))
        if not pts:
            continue
        x, y, flag = zip(*pts)
        xs_all += x
        colour = f"C{k % 10}"
        # Rasterized: a thousand vector markers would weigh more than the rest of the report.
        ax.scatter(x, y, s=22, color=colour, alpha=0.75, label=label(m.get("name", "?"), 24), rasterized=True,
                   edgecolors=["red" if f else colour for f in flag], linewidths=[1.5 if f else 0.5 for f in flag])
    if finite(gflops) and finite(bw) and bw > 0 and xs_all:
        import numpy as np

        ridge = gflops / bw
        grid = np.geomspace(min([*xs_all, ridge]) / 4, max([*xs_all, ridge]) * 4, 200)
        ax.plot(grid, np.minimum(gflops, grid * bw), color="black", lw=1.5,
                label=f"roofline: {gflops:.0f} GFLOP/s, {bw:.1f} GB/s")
        ax.axvline(ridge, color="grey", lw=0.8, ls=":", label=f"ridge point ({ridge:.1f} FLOP/byte)")
    ax.scatter([], [], s=22, facecolors="white", edgecolors="red", linewidths=1.5, label="faster than its bound")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.grid(True, which="both", alpha=0.2)
    ax.legend(fontsize=9, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    placed = total - no_flops - unmeasured
    note = (f"{placed} of {total} layers drawn, one point each at its arithmetic intensity and achieved rate, "
            "coloured by model.")
    if no_flops:
        note += (f" {no_flops} move data without arithmetic (no FLOPs: Reshape, Transpose, Concat...) and have no "
                 "place on this plot.")
    if unmeasured:
        note += f" {unmeasured} have no measurement in the store."
    return figure(fig, "fig-roofline", "Roofline: layers against the machine's ceilings", legend=esc(note))


def _models_table(models: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for m in models:
        rows.append([
            m.get("name"), m.get("n_layers"), seconds_cell(m.get("measured_s")), _when(m.get("measured_source")),
            seconds_cell(m.get("ideal_sequential_s")), seconds_cell(m.get("ideal_critical_path_s")),
            number_cell(m.get("efficiency")), m.get("layers_measured"), m.get("beats_bound"),
            ", ".join(m.get("kinds_without_formula") or []),
        ])
    cols = ["model", "layers", "measured latency", "measured", "at the bound (layers in sequence)",
            "at the bound (critical path)", "efficiency (bound / measured)", "layers measured",
            "layers faster than their bound", "op types without a FLOP formula"]
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
