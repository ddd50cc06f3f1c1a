"""The report's figures: matplotlib on :class:`~matplotlib.figure.Figure` objects with
a canvas of their own, never through pyplot (no global backend state, no GUI, no
warnings), embedded as inline SVG (vector: legible at any width, and small, since text
stays text), each figure's ids prefixed with the figure's own. Figures are drawn
inside :func:`style`; dense point clouds are rasterized inside the SVG."""

from __future__ import annotations

import base64
import io
import re
import warnings
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from dlbricks.report.markup import esc, finite

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure
    from matplotlib.typing import RcKeyType

__all__ = ["bar_height", "error_bars", "figure", "label", "log_if_spread", "new_figure", "png", "rows_axis",
           "style", "svg", "time_scale"]


_DPI = 100
# Fonts sized for a figure shown 800 px wide; SVG text as text (no glyph paths), with
# a fixed hash salt so the same report renders byte for byte the same.
_STYLE: dict[RcKeyType, Any] = {"font.size": 11.0, "axes.titlesize": 12.0, "axes.labelsize": 11.0, "xtick.labelsize": 10.0,
          "ytick.labelsize": 10.0, "legend.fontsize": 10.0, "svg.fonttype": "none", "svg.hashsalt": "dlbricks"}


def style() -> Any:
    """A context in which the report's figures are drawn (fonts, SVG settings); matplotlib's
    settings are restored on leaving it."""
    import matplotlib

    return matplotlib.rc_context(_STYLE)


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


def svg(fig: Figure, prefix: str) -> str:
    """The figure as inline SVG markup: no XML prolog or metadata, every id it defines
    prefixed with ``prefix`` (and every reference to one), so that several figures in
    one page never share an id."""
    buf = io.BytesIO()
    with warnings.catch_warnings():
        # Cosmetic complaints only (a glyph missing from the font for an exotic
        # model name): the figure is still right, and the report must not fail on it.
        warnings.filterwarnings("ignore", category=UserWarning, module=r"matplotlib\b")
        fig.savefig(buf, format="svg", dpi=150, bbox_inches="tight", metadata={"Date": None, "Creator": None})
    text = buf.getvalue().decode("utf-8")
    text = text[text.index("<svg"):]
    # Inside HTML the parser puts <svg> in its namespace (and xlink:href in xlink's), so
    # the namespace declarations, the metadata and the comments are dead weight.
    text = _METADATA.sub("", _COMMENT.sub("", text))
    text = text.replace(' xmlns="http://www.w3.org/2000/svg"', "").replace(' xmlns:xlink="http://www.w3.org/1999/xlink"', "")
    ids = set(_ID.findall(text))
    text = _ID.sub(lambda m: f'id="{prefix}-{m.group(1)}"', text)
    text = _REF.sub(lambda m: f"{m.group(1)}{prefix}-{m.group(2)}{m.group(3)}" if m.group(2) in ids else m.group(0), text)
    return text.replace("<svg ", f'<svg role="img" aria-labelledby="{prefix}-caption" ', 1)


_METADATA = re.compile(r"<metadata>.*?</metadata>\s*", re.S)
_COMMENT = re.compile(r"<!--.*?-->\s*", re.S)
_ID = re.compile(r'\bid="([^"]+)"')
_REF = re.compile(r'(url\(#|href="#)([^)"]+)([)"])')


def figure(fig: Figure, fid: str, caption: str, legend: str | None = None) -> str:
    """A ``<figure>``: the SVG inline, its caption and, when given, a line saying what
    its marks mean (HTML, already escaped)."""
    markup = svg(fig, fid)
    note = f'<br><span class="legend">{legend}</span>' if legend else ""
    return f'<figure id="{fid}">{markup}<figcaption id="{fid}-caption">{esc(caption)}{note}</figcaption></figure>'


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
