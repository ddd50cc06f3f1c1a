"""The report's first section: the answer, readable in ten seconds.

How good the prediction is per model (the share within +/-5% and +/-10%, the worst
models, every model's error in one sorted plot), what the run cost against measuring
every model end to end (wall-clock, with the paper's latency-ratio speedup beside it,
each labelled), what came from the store, and whether every latency reached the
stated precision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from dlbricks.report.markup import Cell, esc, finite, fmt_seconds, number_cell, seconds_cell, table
from dlbricks.report.plots import bar_height, figure, label, new_figure, rows_axis

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.report.sections import Context

__all__ = ["WORST", "errors_by_model", "summary_section"]

#: How many of the worst-predicted models the summary names per G.
WORST = 3
_PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6"]
_MARKERS = "os^Dv<>p"


def errors_by_model(models: Sequence[Mapping[str, Any]], G: int) -> list[tuple[str, float, bool]]:
    """(name, relative error of the sequential prediction, flagged) per model at ``G``,
    largest error first; models without a prediction at ``G`` are left out."""
    out = []
    for m in models:
        p = ((m.get("per_g") or {}).get(str(G)) or {}).get("sequential") or {}
        n = p.get("normalized")
        if finite(n):
            out.append((str(m["name"]), float(n) - 1.0, bool(m.get("flagged"))))
    out.sort(key=lambda e: (-abs(e[1]), e[0]))
    return out


def _pct(x: Any, digits: int = 1, sign: bool = False) -> str:
    if not finite(x):
        return "n/a"
    return f"{100.0 * x:+.{digits}f}%" if sign else f"{100.0 * x:.{digits}f}%"


def _worst_cell(errors: list[tuple[str, float, bool]]) -> str:
    return ", ".join(f"{name}{' ⚠' if flagged else ''} {_pct(e, sign=True)}" for name, e, flagged in errors[:WORST])


def summary_section(ctx: Context, section: Callable[..., str]) -> str:
    """The summary; ``section`` wraps a body as the report's sections are wrapped."""
    ev = ctx.evaluation
    if ev is None or not ev.get("per_g"):
        return section("summary", note="No evaluation given: pass the file of `dlbricks evaluate --save` "
                                       "(--evaluation) for the accuracy and cost of the prediction.")
    pg = sorted(ev["per_g"], key=lambda g: int(g["G"]))
    models = list(ev.get("models", []))
    parts: list[str] = [_headline(pg, models, ev)]
    parts.append(_error_figure(models, [int(g["G"]) for g in pg]))
    acc, cost = [], []
    for g in pg:
        errors = errors_by_model(models, int(g["G"]))
        acc.append([
            g["G"],
            number_cell(100.0 * g["within_5pct"] if finite(g.get("within_5pct")) else None, 0, "%"),
            number_cell(100.0 * g["within_10pct"] if finite(g.get("within_10pct")) else None, 0, "%"),
            number_cell(100.0 * g["rmspe"] if finite(g.get("rmspe")) else None, 1, "%"),
            number_cell(g.get("geomean_normalized")),
            _worst_cell(errors),
        ])
        cost.append([
            g["G"], g.get("unique_bricks"), seconds_cell(g.get("bricks_wall_s")), seconds_cell(g.get("e2e_wall_s")),
            number_cell(g.get("wallclock_speedup"), 2, "×"), number_cell(g.get("speedup"), 2, "×"),
        ])
    parts.append('<div class="cols">' + table(
        ["G", "within ±5%", "within ±10%", "RMS error", "geomean predicted / measured", f"worst {WORST} (error)"],
        acc, tid="table-summary", sortable=False, caption="Accuracy per G") + table(
        ["G", "unique bricks", "measuring the bricks", "measuring every model", "wall-clock speedup",
         "paper speedup (latency ratio)"],
        cost, tid="table-summary-cost", sortable=False, caption="Cost per G (wall-clock)") + "</div>")
    parts.append(
        '<p class="note">Error: the latency rebuilt from the bricks (their sum) over the latency measured end to '
        "end, minus 1. Wall-clock speedup: the seconds spent measuring every model end to end over the seconds "
        "spent measuring the unique bricks, set-up included, both to the same precision. Paper speedup (the "
        "DLBricks paper's definition): the sum of the models' end-to-end latencies over the sum of the unique "
        "bricks' latencies, which leaves out how long each measurement takes.</p>"
    )
    return section("summary", "\n".join(parts))


def _headline(pg: Sequence[Mapping[str, Any]], models: Sequence[Mapping[str, Any]], ev: Mapping[str, Any]) -> str:
    g = pg[0]
    G = int(g["G"])
    errors = errors_by_model(models, G)
    n = len(errors)
    in5 = sum(abs(e) <= 0.05 for _, e, _ in errors)
    in10 = sum(abs(e) <= 0.10 for _, e, _ in errors)
    items = [
        f"<li><b>Accuracy</b> (G={G}): <b>{in5} of {n}</b> models predicted within ±5%, <b>{in10} of {n}</b> "
        f"within ±10%; RMS error {esc(_pct(g.get('rmspe')))}. Worst: {esc(_worst_cell(errors)) or 'n/a'}.</li>"
    ]
    if len(pg) > 1:
        others = "; ".join(
            f"G={int(x['G'])}: {esc(_pct(x.get('within_5pct'), 0))} within ±5%, "
            f"{esc(_pct(x.get('within_10pct'), 0))} within ±10%" for x in pg[1:])
        items.append(f"<li>Other granularities: {others}.</li>")
    wall = g.get("wallclock_speedup")
    if finite(g.get("bricks_wall_s")) and finite(g.get("e2e_wall_s")):
        faster = "faster" if finite(wall) and wall >= 1 else "slower"
        items.append(
            f"<li><b>Cost</b> (G={G}): measuring the {g.get('unique_bricks')} unique bricks took "
            f"{esc(fmt_seconds(g['bricks_wall_s']))} against {esc(fmt_seconds(g['e2e_wall_s']))} to measure every "
            f"model end to end: <b>{esc(number_cell(wall, 2).text)}× {faster}</b> in wall-clock time. "
            f"Paper speedup (latency ratio, not time spent): {esc(number_cell(g.get('speedup'), 2).text)}×.</li>"
        )
    reuse = ev.get("reuse") or {}
    if reuse.get("bricks_total") is not None:
        text = (f"<li><b>Reuse</b>: {reuse.get('bricks_reused')} of {reuse.get('bricks_total')} unique bricks and "
                f"{reuse.get('models_reused')} of {reuse.get('models_total')} models came from the results store; "
                f"this run measured {reuse.get('bricks_measured')} bricks and {reuse.get('models_measured')} models")
        if reuse.get("remeasured"):
            text += f" ({reuse['remeasured']} measured again because the precision check flagged them)"
        if finite(reuse.get("wall_s")) and reuse.get("wall_s"):
            text += f" in {esc(fmt_seconds(reuse['wall_s']))}"
        items.append(text + ".</li>")
    check = ev.get("precision_check")
    if check:
        target = _pct(check.get("precision"), 1)
        flagged = check.get("flagged") or []
        if not flagged and not check.get("results_unconverged"):
            items.append(f"<li><b>Precision</b>: every model's latency, rebuilt and end to end, is known to "
                         f"±{esc(target)} (95% interval).</li>")
        else:
            names = sorted({f["model"] for f in flagged})
            shown = ", ".join(esc(x) for x in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            text = f'<li class="warn"><b>Precision</b>: {len(names)} model(s) short of ±{esc(target)}'
            text += f" ({shown})" if names else ""
            if check.get("results_unconverged"):
                text += f"; {check['results_unconverged']} result(s) stopped at the round limit"
            items.append(text + "; marked ⚠ below, and `--remeasure-unstable` measures them again.</li>")
    from dlbricks.timing.hostload import busy_warning

    busy = busy_warning(ev.get("host"))
    if busy is not None:
        items.append(f'<li class="warn"><b>Busy machine</b>: {esc(busy)}.</li>')
    return '<ul class="headline">' + "".join(items) + "</ul>"


def _error_figure(models: Sequence[Mapping[str, Any]], Gs: Sequence[int]) -> str:
    """Every model's error at every G, sorted by the error at the smallest G, with
    the +/-5% and +/-10% bands; the smallest G carries its 95% interval."""
    G0 = Gs[0]
    order = sorted(errors_by_model(models, G0), key=lambda e: e[1])
    if not order:
        return ""
    by_name = {str(m["name"]): m for m in models}
    names = [e[0] for e in order]
    fig = new_figure(8.0, bar_height(len(names)))
    ax = fig.add_subplot()
    ax.axvspan(-10, 10, color="#54a24b", alpha=0.08, lw=0)
    ax.axvspan(-5, 5, color="#54a24b", alpha=0.16, lw=0)
    ax.axvline(0, color="black", lw=1)
    y = list(range(len(names)))
    allx: list[float] = []
    for gi, G in enumerate(Gs):
        xs, lo, hi = [], [], []
        for nm in names:
            p = ((by_name[nm].get("per_g") or {}).get(str(G)) or {}).get("sequential") or {}
            v = p.get("normalized")
            ci = p.get("normalized_ci") or [v, v]
            x = 100.0 * (float(v) - 1.0) if finite(v) else float("nan")
            xs.append(x)
            lo.append(max(0.0, x - 100.0 * (float(ci[0]) - 1.0)) if finite(v) and finite(ci[0]) else 0.0)
            hi.append(max(0.0, 100.0 * (float(ci[1]) - 1.0) - x) if finite(v) and finite(ci[1]) else 0.0)
        allx += [x for x in xs if finite(x)] + [x + h for x, h in zip(xs, hi) if finite(x)] + \
            [x - lo_ for x, lo_ in zip(xs, lo) if finite(x)]
        offset = (gi - (len(Gs) - 1) / 2) * 0.18
        kw: dict[str, Any] = {"xerr": [lo, hi], "capsize": 2, "elinewidth": 0.8} if gi == 0 else {}
        ax.errorbar(xs, [v + offset for v in y], fmt=_MARKERS[gi % len(_MARKERS)], color=_PALETTE[gi % len(_PALETTE)],
                    label=f"G={G}" + (" (95% interval)" if gi == 0 else ""), ms=6, **kw)
    labels = [label(nm, 32) + (" ⚠" if by_name[nm].get("flagged") else "") for nm in names]
    rows_axis(ax, labels)
    span = max([12.0, *(abs(x) * 1.05 for x in allx)])
    ax.set_xlim(-span, span)
    ax.set_xlabel("prediction error (%): rebuilt from bricks / measured end to end − 1")
    ax.grid(axis="x", alpha=0.3)
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    handles += [Patch(color="#54a24b", alpha=0.3, label="within ±5%"), Patch(color="#54a24b", alpha=0.12,
                                                                              label="within ±10%")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    legend = ("Each row is a model, sorted by its error at G=" + esc(G0) + "; markers are the granularities, "
              "the shaded bands ±5% and ±10%, ⚠ a model whose latency misses the stated precision.")
    return figure(fig, "fig-error", "Prediction error per model, sorted", legend=legend)


def flag_cell(m: Mapping[str, Any]) -> Cell:
    """A table cell: ⚠ and the model's precision flags, or empty."""
    flags = m.get("flags") or []
    return Cell("⚠ " + "; ".join(flags) if flags else "", 1 if flags else 0)
