"""The report's figures: matplotlib on :class:`~matplotlib.figure.Figure` objects with
the Agg canvas directly, never through pyplot (no global backend state, no GUI, no
warnings), embedded as base64 PNGs."""

from __future__ import annotations

import base64
import io
import warnings
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from dlbricks.report.markup import esc, finite

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["bar_height", "error_bars", "figure", "label", "log_if_spread", "new_figure", "png", "rows_axis",
           "time_scale"]


_DPI = 100


def label(text: Any, width: int = 28) -> str:
    """A matplotlib-safe label: short, and no ``$`` (which would start mathtext)."""
    s = str(text)
    if len(s) > width:
        s = s[: width - 1] + "…"
    return s.replace("\\", "\\\\").replace("$", r"\$")


def new_figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=_DPI)
    FigureCanvasAgg(fig)
    return fig


def png(fig: Figure) -> str:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        # Cosmetic complaints only (a glyph missing from the font for an exotic
        # model name): the figure is still right, and the report must not fail on it.
        warnings.filterwarnings("ignore", category=UserWarning, module=r"matplotlib\b")
        fig.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight", metadata={"Software": None})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def figure(fig: Figure, fid: str, caption: str) -> str:
    data = png(fig)
    return (
        f'<figure id="{fid}"><img src="data:image/png;base64,{data}" alt="{esc(caption)}">'
        f"<figcaption>{esc(caption)}</figcaption></figure>"
    )


def bar_height(n: int) -> float:
    return min(2.0 + 0.32 * n, 40.0)


def error_bars(values: Sequence[float], lows: Sequence[float], highs: Sequence[float]) -> list[list[float]]:
    # Bootstrap bounds can sit a hair on the wrong side of the point estimate; matplotlib
    # refuses negative error lengths, so clip at zero.
    lo = [max(0.0, v - lo) if finite(v) and finite(lo) else 0.0 for v, lo in zip(values, lows)]
    hi = [max(0.0, hi - v) if finite(v) and finite(hi) else 0.0 for v, hi in zip(values, highs)]
    return [lo, hi]


def log_if_spread(ax: Any, values: Iterable[float], axis: str = "x", ratio: float = 100.0) -> bool:
    v = [x for x in values if finite(x)]
    if v and min(v) > 0 and max(v) / min(v) > ratio:
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
        return True
    return False


def rows_axis(ax: Any, labels: Sequence[str], fontsize: float | None = None) -> None:
    """One labelled row per item, the first on top; set explicitly because autoscaling a
    log-scaled bar chart leaves empty rows."""
    ax.set_yticks(range(len(labels)), labels, fontsize=fontsize)
    ax.set_ylim(len(labels) - 0.5, -0.5)


def time_scale(values: Iterable[float]) -> tuple[float, str]:
    v = [abs(x) for x in values if finite(x) and x != 0]
    top = max(v) if v else 1.0
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if top >= scale:
            return scale, unit
    return 1e-9, "ns"
