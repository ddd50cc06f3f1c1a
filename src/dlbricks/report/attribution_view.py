"""The report's section on where each model's error comes from (``evaluate --attribution``):
per model, the normalized latency after each correction in turn, as a figure and a table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

from dlbricks.evaluation import ATTRIBUTION_HEADS
from dlbricks.report.markup import esc, finite, number_cell, seconds_cell, table
from dlbricks.report.plots import bar_height, figure, label, new_figure, rows_axis

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.report.sections import Context

__all__ = ["attribution_section", "has_attribution"]


def has_attribution(evaluation: Mapping[str, Any] | None) -> bool:
    """Whether an evaluation carries an attribution (``evaluate --attribution``)."""
    return bool(evaluation and (evaluation.get("attribution") or {}).get("models"))


_STEP_STYLE = (("#9aa4af", "o"), ("#f58518", "s"), ("#54a24b", "^"), ("#4c78a8", "D"))


def attribution_section(ctx: Context, section: Callable[..., str]) -> str:
    """The attribution section; ``section`` wraps a body as the report's sections are wrapped."""
    att = (ctx.evaluation or {})["attribution"]
    steps = [str(s) for s in att.get("steps", [])]
    labels = att.get("labels") or {}
    heads = [ATTRIBUTION_HEADS.get(s, s) for s in steps]

    def final_error(m: Mapping[str, Any]) -> float:
        v = (m.get("normalized") or [float("nan")])[-1]
        return abs(float(v) - 1.0) if finite(v) else -1.0

    # The worst-predicted model first, as in the summary.
    ms = sorted(att["models"], key=lambda m: (-final_error(m), str(m["name"])))
    fig = new_figure(8.5, bar_height(len(ms)))
    ax = fig.add_subplot()
    ax.axvspan(0.9, 1.1, color="#54a24b", alpha=0.08, lw=0)
    ax.axvspan(0.95, 1.05, color="#54a24b", alpha=0.16, lw=0)
    ax.axvline(1.0, color="black", lw=1)
    y = list(range(len(ms)))
    allx: list[float] = []
    for i, m in enumerate(ms):
        xs = [float(v) for v in m.get("normalized", []) if finite(v)]
        allx += xs
        if len(xs) > 1:
            ax.plot(xs, [i] * len(xs), color="#c3c9d0", lw=1.2, zorder=1)
    for k, head in enumerate(heads):
        color, marker = _STEP_STYLE[k % len(_STEP_STYLE)]
        xs = [float(m["normalized"][k]) if k < len(m.get("normalized", [])) and finite(m["normalized"][k])
              else float("nan") for m in ms]
        ax.scatter(xs, y, color=color, marker=marker, s=36 if k < len(heads) - 1 else 48, zorder=2 + k,
                   label=label(head, 32))
    rows_axis(ax, [label(m["name"], 32) for m in ms])
    if allx:
        lo, hi = min([0.9, *allx]), max([1.1, *allx])
        pad = 0.05 * (hi - lo)
        ax.set_xlim(lo - pad, hi + pad)
    ax.set_xlabel("normalized latency (rebuilt from bricks / measured end to end)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    G = att.get("G")
    legend = ("Each row is a model, the worst-predicted at the top; the markers are its normalized latency after "
              "each step, from the baseline (grey) to the evaluation itself (blue); the shaded bands are ±5% "
              "and ±10%.")
    cols = ["model", "end-to-end"] + [f"after {h}" for h in heads] + [f"change by {h}" for h in heads[1:]]
    rows = []
    for m in ms:
        norm = list(m.get("normalized", []))
        explained = m.get("explained") or {}
        rows.append([m["name"], seconds_cell(m.get("e2e_s"))] + [number_cell(v) for v in norm]
                    + [number_cell(explained.get(s), 3) for s in steps[1:]])
    steps_text = "; ".join(f"<b>{esc(h)}</b>: {esc(labels.get(s, s))}" for s, h in zip(steps, heads))
    intro = (f"At G={esc(G)}, each model's latency rebuilt from its bricks after each correction in turn, over "
             "the same end-to-end latency (the whole model is timed once; only the bricks differ between "
             f"steps). Each step adds one correction to the one before, so its change is what that correction "
             f"explains of the model's error. Steps: {steps_text}.")
    return section("attribution", figure(fig, "fig-attribution", f"Normalized latency after each step per model "
                                          f"(G={G}), sorted by final error", legend=legend)
                    + table(cols, rows, tid="table-attribution"), intro=intro)
