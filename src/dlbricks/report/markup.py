"""The HTML pieces of the report: escaping, number formats, sortable tables and their cells."""

from __future__ import annotations

import html
import math
from typing import Any, Iterable, Mapping, Sequence, TypeGuard

__all__ = ["Cell", "esc", "finite", "flatten", "fmt", "fmt_seconds", "kv_table", "kv_value", "number_cell", "quoted",
           "seconds_cell", "table"]


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def finite(x: Any) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def fmt_seconds(seconds: Any) -> str:
    """A duration with a unit that keeps 3-4 significant digits readable."""
    if not finite(seconds):
        return "n/a"
    a = abs(seconds)
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if a >= scale:
            return f"{seconds / scale:.3g} {unit}" if a / scale >= 100 else f"{seconds / scale:.3f} {unit}"
    return f"{seconds * 1e9:.1f} ns"


def fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return ""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return f"{x:.{digits}f}" if math.isfinite(x) else "n/a"
    return str(x)


class Cell:
    """A table cell: what is shown, and the value it sorts by."""

    __slots__ = ("text", "sort", "cls")

    def __init__(self, text: str, sort: Any = None, cls: str | None = None) -> None:
        self.text = text
        self.sort = sort
        self.cls = cls


def seconds_cell(x: Any) -> Cell:
    return Cell(fmt_seconds(x), x if finite(x) else None, "num")


def number_cell(x: Any, digits: int = 3, suffix: str = "") -> Cell:
    text = fmt(x, digits)
    return Cell(text + (suffix if text not in ("", "n/a") else ""), x if finite(x) else None, "num")


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]], *, tid: str | None = None,
           caption: str | None = None, sortable: bool = True, foot: Sequence[Any] | None = None) -> str:
    kind = "sortable" if sortable else "plain"
    out = [f'<div class="tablewrap"><table{f" id={quoted(tid)}" if tid else ""} class="{kind}">']
    if caption:
        out.append(f"<caption>{esc(caption)}</caption>")
    def cell(v: Any) -> Cell:
        return v if isinstance(v, Cell) else (number_cell(v) if finite(v) else Cell(fmt(v)))

    grid = [[cell(v) for v in row] for row in rows]
    # A column whose filled cells are all numbers is right-aligned, heading included.
    numeric = [
        any(r[i].text for r in grid if i < len(r))
        and all(r[i].cls == "num" for r in grid if i < len(r) and r[i].text not in ("", "n/a"))
        for i in range(len(columns))
    ]
    out.append("<thead><tr>" + "".join(f'<th scope="col"{" class=num" if n else ""}>{esc(c)}</th>'
                                       for c, n in zip(columns, numeric)) + "</tr></thead><tbody>")
    for row in grid:
        out.append(_tr(row))
    out.append("</tbody>")
    if foot is not None:
        # A total row stays put when the body is sorted.
        out.append(f"<tfoot>{_tr([cell(v) for v in foot])}</tfoot>")
    out.append("</table></div>")
    return "".join(out)


def _tr(row: Sequence[Cell]) -> str:
    cells = []
    for c in row:
        attrs = ""
        if c.sort is not None:
            attrs += f' data-sort="{esc(repr(float(c.sort)))}"'
        if c.cls:
            attrs += f' class="{c.cls}"'
        cells.append(f"<td{attrs}>{esc(c.text)}</td>")
    return "<tr>" + "".join(cells) + "</tr>"


def quoted(value: str) -> str:
    return f'"{esc(value)}"'


def kv_value(v: Any, none: str = "unknown") -> str:
    if v is None:
        return none
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def kv_table(rows: Sequence[tuple[str, Any]], bold: Sequence[str], tid: str) -> str:
    out = [f'<div class="tablewrap kvwrap"><table id={quoted(tid)} class="plain kv"><tbody>']
    for k, v in rows:
        cls = ' class="id"' if k in bold else ""
        out.append(f"<tr{cls}><th scope=\"row\">{esc(k)}</th><td>{esc(v)}</td></tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def flatten(d: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out += flatten(v, key + ".")
        elif isinstance(v, (list, tuple)):
            out.append((key, ", ".join(str(x) for x in v) if v else "(none)"))
        else:
            out.append((key, v))
    return out
