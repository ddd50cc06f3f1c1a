"""One self-contained HTML report of an analysis, an evaluation and a results store.

:func:`build_report` turns what ``dlbricks analyze --json`` and ``dlbricks evaluate
--save`` produce (plus, optionally, the store, the models and a roofline result) into
a single HTML page that works offline: figures are matplotlib SVGs inline, the CSS and the few lines of JavaScript that sort tables are inline,
and nothing is fetched from anywhere. It opens with the answer (the summary: accuracy,
cost, reuse, precision) and ends with the system and runner details; long lists are
summarised, the full data being what ``dlbricks results`` exports. Every text that comes from the inputs is
escaped. A section whose data is missing keeps its heading and says what would fill
it, so two reports of the same corpus always have the same outline.

The page is assembled here; its sections are :mod:`dlbricks.report.sections`, their
tables and cells :mod:`dlbricks.report.markup`, their figures :mod:`dlbricks.report.plots`.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from dlbricks.files import write_atomically
from dlbricks.report.attribution_view import has_attribution
from dlbricks.report.markup import esc
from dlbricks.report.sections import (
    SECTIONS,
    TOP_BRICKS,
    Context,
    brick_contributions,
    render_sections,
)

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.model import Model
    from dlbricks.store import Store

__all__ = ["SECTIONS", "TOP_BRICKS", "brick_contributions", "build_report", "write_report"]


def build_report(
    analysis: Mapping[str, Any] | None,
    evaluation: Mapping[str, Any] | None,
    *,
    store: Store | None = None,
    fingerprint: Mapping[str, Any] | None = None,
    roofline: Mapping[str, Any] | None = None,
    models: Sequence[Model] | None = None,
    title: str = "dlbricks report",
    roofline_source: str | None = None,
) -> str:
    """Render one self-contained HTML page.

    Args:
        analysis: the dict of :func:`dlbricks.analysis.analyze` (``analyze --json``), or None.
        evaluation: the dict of :func:`dlbricks.evaluation.evaluate` (``evaluate --save``), or None.
        store: the results store the evaluation used: system fingerprints, runner
            settings, the stored results table and per-brick medians.
        fingerprint: the system fingerprint to show (default: the store's entry for
            the evaluation's system, or this machine's when its id matches).
        roofline: the JSON of ``dlbricks roofline --json`` (peaks, models, what-ifs,
            headroom, layers faster than their bound; the plot drawn from its per-layer
            data). Omitted when None.
        models: the models the evaluation decomposed. With the store they give each
            brick's number of occurrences, so the top bricks are ranked by the time
            they add to the corpus; without them (and without a ``bricks`` list in
            the evaluation) bricks are ranked by median alone.
        title: the page title.
        roofline_source: the file the roofline JSON came from, named where its long
            lists are cut.

    Returns:
        The HTML document as a string.

    Raises:
        DlbricksError: a brick the models need has a malformed stored result.
    """
    from dlbricks import __version__

    ctx = Context(analysis, evaluation, store, fingerprint, roofline, models, roofline_source)
    body = render_sections(ctx)
    nav = "".join(
        f'<li><a href="#{sid}">{esc(head)}</a></li>'
        for sid, head in SECTIONS
        if (sid != "roofline" or roofline is not None) and (sid != "attribution" or has_attribution(evaluation))
    )
    inputs: list[tuple[str, Any]] = [("generated", datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")), ("dlbricks", __version__)]
    if evaluation is not None:
        inputs += [("system id", evaluation.get("system_id")), ("config key", evaluation.get("config_key")),
                   ("G", ", ".join(str(g) for g in evaluation.get("G", [])))]
        graph = "runtime" if evaluation.get("runtime_graph") else evaluation.get("graph")
        if graph:
            inputs.append(("decomposed", {"runtime": "the graphs onnxruntime executes",
                                          "source": "the models' own graphs (--graph source)",
                                          "mixed": "runtime graphs, source graphs where those failed"}.get(graph, graph)))
    elif analysis is not None:
        inputs.append(("G", ", ".join(str(g) for g in analysis.get("G", []))))
    if store is not None:
        inputs.append(("store", str(store.path)))
    header = " &middot; ".join(f"<span><b>{esc(k)}</b> {esc(v)}</span>" for k, v in inputs if v not in (None, ""))
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{esc(title)}</title>\n"
        f"<style>{_CSS}</style>\n"
        # Installed first so that an error anywhere later is visible to a headless check.
        "<script>window.addEventListener('error',function(e){"
        "document.documentElement.setAttribute('data-js-error',String(e.message));});</script>\n"
        "</head>\n<body>\n"
        f'<header><h1>{esc(title)}</h1><p class="meta">{header}</p>'
        f'<nav aria-label="sections"><ol>{nav}</ol></nav></header>\n<main>\n'
        + "\n".join(body)
        + "\n</main>\n"
        '<footer><p class="note">Tables sort by clicking a column heading. Latencies are medians; '
        "intervals are 95%.</p></footer>\n"
        f"<script>{_JS}</script>\n</body>\n</html>\n"
    )


def write_report(html_text: str, path: str | os.PathLike) -> Path:
    """Write ``html_text`` to ``path`` atomically (a temporary file, then a rename).

    Returns:
        The path written.
    """
    write_atomically(path, html_text)
    return Path(path)


# ------------------------------------------------------------------------ CSS and JS

_CSS = """
:root{--fg:#1d232b;--muted:#5b6572;--line:#d7dce2;--band:#f4f6f8;--accent:#2f5d8a}
*{box-sizing:border-box}
body{margin:0;font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:#fff}
header,main,footer{max-width:1200px;margin:0 auto;padding:0 24px}
header{padding-top:20px;border-bottom:1px solid var(--line)}
h1{margin:0 0 4px;font-size:26px}
h2{margin:36px 0 8px;font-size:20px;border-bottom:2px solid var(--accent);padding-bottom:4px}
h3{margin:18px 0 6px;font-size:16px}
.meta{color:var(--muted);margin:0 0 8px}
nav ol{display:grid;grid-template-columns:repeat(auto-fill,minmax(340px,1fr));gap:0 24px;
  margin:8px 0 16px;padding-left:22px}
nav a{color:var(--accent);text-decoration:none}
nav a:hover{text-decoration:underline}
.intro{color:var(--muted);max-width:900px}
.note{color:var(--muted);font-style:italic}
.missing{background:var(--band);padding:8px 12px;border-left:3px solid #c9a227}
figure{margin:12px 0;text-align:center}
figure img,figure svg{max-width:100%;height:auto}
figcaption{color:var(--muted);font-size:13px;max-width:900px;margin:0 auto}
figcaption .legend{font-size:12px}
ul.headline{font-size:16px;line-height:1.6;max-width:1000px;padding-left:20px}
ul.headline li.warn{color:#8a4b00}
.tablewrap{display:inline-block;max-width:100%;overflow:auto;max-height:640px;margin:10px 0;
  border:1px solid var(--line);vertical-align:top}
.tablewrap.kvwrap{max-height:none}
.cols{display:flex;flex-wrap:wrap;gap:0 32px;align-items:flex-start}
table{border-collapse:collapse;font-size:13px}
caption{text-align:left;font-weight:600;padding:4px 8px}
th,td{padding:4px 8px;border-bottom:1px solid var(--line);text-align:left;vertical-align:top}
thead th{position:sticky;top:0;background:#e9edf2;white-space:nowrap}
thead th.num{text-align:right}
tbody tr:nth-child(even){background:var(--band)}
tfoot td{font-weight:600;border-top:2px solid var(--line)}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.mono,code{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12px}
table.kv th{font-weight:normal;color:var(--muted);white-space:nowrap}
table.kv tr.id th,table.kv tr.id td{font-weight:700;color:var(--fg)}
table.sortable thead th{cursor:pointer;user-select:none}
table.sortable thead th:after{content:" \\2195";color:#9aa4af;font-size:11px}
table.sortable thead th[aria-sort=ascending]:after{content:" \\25B2";color:var(--accent)}
table.sortable thead th[aria-sort=descending]:after{content:" \\25BC";color:var(--accent)}
footer{margin:40px auto 30px;border-top:1px solid var(--line)}
"""


# Sorts by each cell's data-sort (numbers) or its text; a second click reverses.
_JS = """
(function(){
  function key(td){
    var v=td.getAttribute('data-sort');
    if(v!==null&&v!==''&&isFinite(Number(v)))return {n:Number(v)};
    return {s:td.textContent.trim().toLowerCase()};
  }
  function cmp(a,b){
    if('n' in a&&'n' in b)return a.n-b.n;
    if('n' in a)return -1;
    if('n' in b)return 1;
    return a.s<b.s?-1:(a.s>b.s?1:0);
  }
  var tables=document.querySelectorAll('table.sortable');
  Array.prototype.forEach.call(tables,function(table){
    if(!table.tHead||!table.tBodies.length)return;
    var heads=table.tHead.rows[0].cells;
    Array.prototype.forEach.call(heads,function(th,col){
      th.tabIndex=0;
      th.title='sort by this column';
      function sort(){
        var dir=th.getAttribute('aria-sort')==='ascending'?-1:1;
        Array.prototype.forEach.call(heads,function(h){h.removeAttribute('aria-sort');});
        th.setAttribute('aria-sort',dir===1?'ascending':'descending');
        var body=table.tBodies[0],rows=Array.prototype.slice.call(body.rows);
        rows.sort(function(r1,r2){return dir*cmp(key(r1.cells[col]),key(r2.cells[col]));});
        rows.forEach(function(r){body.appendChild(r);});
      }
      th.addEventListener('click',sort);
      th.addEventListener('keydown',function(e){if(e.key==='Enter'||e.key===' '){e.preventDefault();sort();}});
    });
  });
  document.body.dataset.ready='1';
})();
"""
