"""The report's sections, one function each, in page order (:data:`SECTIONS`).

Each takes the :class:`Context` (the inputs, and what is derived from them more than
once) and returns the section's HTML; a section without its data keeps its heading
and says what would fill it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from dlbricks.report.markup import (
    Cell,
    esc,
    finite,
    flatten,
    kv_table,
    kv_value,
    number_cell,
    seconds_cell,
    table,
)
from dlbricks.report.plots import (
    bar_height,
    error_bars,
    figure,
    label,
    log_if_spread,
    new_figure,
    rows_axis,
    time_scale,
)
from dlbricks.report.summary import flag_cell

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.model import Model
    from dlbricks.store import Store

__all__ = ["SECTIONS", "TOP_BRICKS", "Context", "brick_contributions", "render_sections"]


#: (id, heading) of every section, in page order. ``roofline`` only appears when given,
#: ``attribution`` only for an evaluation that has one (``evaluate --attribution``).
SECTIONS: tuple[tuple[str, str], ...] = (
    ("summary", "Summary"),
    ("e2e", "End-to-end latency per model"),
    ("normalized", "Normalized constructed latency per model and G"),
    ("attribution", "Where each model's error comes from"),
    ("geomean", "Geometric mean of normalized latency versus G"),
    ("speedup", "Benchmarking speedup versus G"),
    ("uncertainty", "Uncertainty of each prediction"),
    ("top-bricks", "Bricks that contribute most time to the corpus"),
    ("unique-layers", "Unique layers per model"),
    ("repeated-types", "Types of repeated layers"),
    ("jaccard", "Jaccard similarity of models"),
    ("results", "Stored results"),
    ("roofline", "Roofline"),
    ("system", "System and runner settings"),
)


#: How many bricks the "top bricks" section lists.
TOP_BRICKS = 15
#: Rows of the stored-results table (the flagged and least precise first); the full
#: table is what ``dlbricks results`` exports.
RESULT_ROWS = 30
_TOP_TYPES = 8  # repeated-layer types drawn in colour; the rest are "other"


def brick_contributions(
    models: Sequence[Model],
    G: int,
    *,
    store: Store,
    system_id: str,
    config_key: str,
) -> list[dict[str, Any]]:
    """Each unique brick at ``G`` with its median and its total time over the corpus.

    A brick's contribution is its median times the number of times it occurs in
    all models together: the share of the corpus' summed constructed (sequential)
    latency that it accounts for.

    Args:
        models: the models that were decomposed (runtime graphs if the run used them).
        G: the granularity.
        store: the results store.
        system_id, config_key: the key of the results (the evaluation's).

    Returns:
        One dict per unique brick with a stored ok result, largest contribution
        first: ``G``, ``digest`` (hex), ``occurrences``, ``models`` (how many models
        contain it), ``median_s``, ``ci_low_s``, ``ci_high_s``, ``contribution_s``,
        ``op_types``. Bricks without an ok result are left out.
    """
    import numpy as np

    from dlbricks.corpus import Corpus
    from dlbricks.model import layer_kinds
    from dlbricks.versions import brick_digest_version

    sp = Corpus(models).split(int(G))
    occ = sp.occurrences()
    total = occ.sum(axis=0)
    in_models = (occ > 0).sum(axis=0)
    bver = brick_digest_version()
    meta = store.bricks()
    out: list[dict[str, Any]] = []
    for u in range(sp.n_unique):
        d = bytes(np.asarray(sp.unique_digests[u], dtype=np.uint8)).hex()
        rec = store.get_result("brick", d, bver, system_id, config_key)
        if rec is None or not rec.ok or rec.stats is None:
            continue
        ops = (meta.get((d, bver)) or {}).get("op_types")
        if not ops:
            m, members = sp.first_occurrence(u)
            kinds = layer_kinds(models[m].layers)  # without building a fast-loaded model's layers
            ops = [kinds[int(i)] for i in members]
        n = int(total[u])
        med = float(rec.stats["median"]) * 1e-9
        out.append(
            {
                "G": int(G),
                "digest": d,
                "occurrences": n,
                "models": int(in_models[u]),
                "median_s": med,
                "ci_low_s": float(rec.stats.get("ci_low", rec.stats["median"])) * 1e-9,
                "ci_high_s": float(rec.stats.get("ci_high", rec.stats["median"])) * 1e-9,
                "contribution_s": med * n,
                "op_types": list(ops),
            }
        )
    out.sort(key=lambda b: (-b["contribution_s"], b["digest"]))
    return out


class Context:
    """The inputs, and what is derived from them more than once."""

    def __init__(
        self,
        analysis: Mapping[str, Any] | None,
        evaluation: Mapping[str, Any] | None,
        store: Store | None,
        fingerprint: Mapping[str, Any] | None,
        roofline: Mapping[str, Any] | None,
        models: Sequence[Model] | None,
        roofline_source: str | None = None,
    ) -> None:
        self.analysis = analysis
        self.roofline_source = roofline_source
        self.evaluation = evaluation
        self.store = store
        self.fingerprint = fingerprint
        self.roofline = roofline
        self.models = models
        self.system_id: str | None = evaluation.get("system_id") if evaluation else None
        self.config_key: str | None = evaluation.get("config_key") if evaluation else None
        self._brick_meta: dict | None = None
        self._model_names: dict | None = None

    @property
    def Gs(self) -> list[int]:
        src = self.evaluation or self.analysis or {}
        return [int(g) for g in src.get("G", [])]

    def brick_meta(self) -> dict:
        if self._brick_meta is None:
            self._brick_meta = self.store.bricks() if self.store is not None else {}
        return self._brick_meta

    def model_names(self) -> dict:
        if self._model_names is None:
            self._model_names = self.store.models() if self.store is not None else {}
        return self._model_names


def render_sections(ctx: Context) -> list[str]:
    """Every section's HTML, in page order; the roofline only when the context has one,
    the attribution only when the evaluation has one."""
    from dlbricks.report.attribution_view import attribution_section, has_attribution
    from dlbricks.report.plots import style
    from dlbricks.report.roofline_view import roofline_section
    from dlbricks.report.summary import summary_section

    with style():
        body = [
            summary_section(ctx, section),
            _e2e_section(ctx),
            _normalized_section(ctx),
            *([attribution_section(ctx, _section)] if has_attribution(ctx.evaluation) else []),
            _geomean_section(ctx),
            _speedup_section(ctx),
            _uncertainty_section(ctx),
            _top_bricks_section(ctx),
            _unique_layers_section(ctx),
            _repeated_types_section(ctx),
            _jaccard_section(ctx),
            _results_section(ctx),
        ]
        if ctx.roofline is not None:
            body.append(roofline_section(ctx.roofline, section, ctx.roofline_source))
        body.append(_system_section(ctx))
    return body


def section(sid: str, body: str = "", *, note: str | None = None, intro: str | None = None) -> str:
    """A section of the page: its heading (from :data:`SECTIONS`), an intro, a note
    saying what is missing, and the body (HTML, already escaped)."""
    head = dict(SECTIONS)[sid]
    parts = [f'<section id="{sid}">', f"<h2>{esc(head)}</h2>"]
    if intro:
        parts.append(f'<p class="intro">{intro}</p>')
    if note:
        parts.append(f'<p class="note missing">{esc(note)}</p>')
    parts.append(body)
    parts.append("</section>")
    return "\n".join(p for p in parts if p)


_section = section


def _system_section(ctx: Context) -> str:
    from dlbricks.timing.sysinfo import IDENTITY_FIELDS, fingerprint_id

    parts: list[str] = []
    notes: list[str] = []
    fps: dict[str, Mapping[str, Any]] = {}
    if ctx.fingerprint is not None:
        fps[fingerprint_id(ctx.fingerprint)] = ctx.fingerprint
        if ctx.system_id and ctx.system_id not in fps:
            notes.append(f"The fingerprint given (system {next(iter(fps))}) is not the evaluation's system "
                         f"({ctx.system_id}).")
    elif ctx.store is not None:
        systems = ctx.store.systems()
        if ctx.system_id:
            if ctx.system_id in systems:
                fps[ctx.system_id] = systems[ctx.system_id]
        else:
            fps.update(systems)
    if not fps and ctx.system_id:
        from dlbricks.timing.sysinfo import system_fingerprint

        here = system_fingerprint()
        if fingerprint_id(here) == ctx.system_id:
            fps[ctx.system_id] = here
            notes.append("Fingerprint of this machine, which has the evaluation's system id.")
    for sid, fp in fps.items():
        rows = [(k, kv_value(v)) for k, v in flatten(fp)]
        parts.append(f'<div><h3>System <code>{esc(sid)}</code></h3>'
                     f'{kv_table(rows, IDENTITY_FIELDS, f"fingerprint-{sid}")}</div>')
    if not fps:
        notes.append("No system fingerprint: pass the results store (--store) or a fingerprint.")
    produced = _result_settings(ctx)
    configs: list[tuple[str, str, Mapping[str, Any]]] = []
    if produced:
        for i, (cfg, n) in enumerate(produced):
            title = "Runner settings that produced the results" + (f" ({n} of them)" if len(produced) > 1 else "")
            configs.append((title, f"{ctx.config_key or 'store'}-{i}" if len(produced) > 1 else str(ctx.config_key), cfg))
        run_cfg = (ctx.evaluation or {}).get("config")
        if run_cfg:
            differ = sorted({k for cfg, _ in produced for k in set(cfg) | set(run_cfg)
                             if k in cfg and k in run_cfg and cfg[k] != run_cfg[k]})
            if differ:
                notes.append("This evaluation ran with other settings than some of the results it reused "
                             f"({', '.join(differ)}); the tables show the results' own.")
    elif ctx.evaluation is not None and ctx.evaluation.get("config"):
        configs.append(("Runner settings of the evaluation", str(ctx.config_key or "evaluation"), ctx.evaluation["config"]))
    elif ctx.store is not None:
        configs += [("Runner settings recorded with the first result under key", k, c)
                    for k, c in ctx.store.configs().items()]
    for title, key, settings in configs:
        parts.append(f'<div><h3>{esc(title)} <code>{esc(key)}</code></h3>'
                     f'{kv_table([(k, kv_value(v, "none")) for k, v in flatten(settings)], (), f"config-{key}")}</div>')
    if not configs:
        notes.append("No runner settings: pass an evaluation or the results store.")
    intro = ("Fields in bold identify the system: results are only reused between systems that agree on them."
             if fps else None)
    body = f'<div class="cols">{"".join(parts)}</div>' if parts else ""
    return _section("system", body, note=" ".join(notes) or None, intro=intro)


def _result_settings(ctx: Context) -> list[tuple[dict[str, Any], int]]:
    """The runner settings each stored result of the evaluation's key was measured
    with (recorded with the result), distinct ones with their counts, most used first."""
    import json

    if ctx.store is None or not ctx.config_key:
        return []
    counts: dict[str, int] = {}
    for rec in ctx.store.results(system_id=ctx.system_id, config_key=ctx.config_key, with_times=False):
        cfg = (rec.meta or {}).get("config")
        if cfg:
            key = json.dumps(cfg, sort_keys=True)
            counts[key] = counts.get(key, 0) + 1
    return [(json.loads(k), n) for k, n in sorted(counts.items(), key=lambda kv: -kv[1])]


def _analysis_models(ctx: Context) -> list[Mapping[str, Any]] | None:
    if ctx.analysis is None:
        return None
    return list(ctx.analysis.get("models", []))


_NO_ANALYSIS = "No analysis given: pass the JSON of `dlbricks analyze --json` (--analysis) or the models."
_NO_EVALUATION = "No evaluation given: pass the file of `dlbricks evaluate --save` (--evaluation)."


def _unique_layers_section(ctx: Context) -> str:
    ms = _analysis_models(ctx)
    if not ms:
        return _section("unique-layers", note=_NO_ANALYSIS)
    corpus = ctx.analysis.get("corpus", {}) if ctx.analysis else {}
    Gs = [int(g) for g in ctx.analysis.get("G", [])] if ctx.analysis else []
    fig = new_figure(8.5, bar_height(len(ms)))
    ax = fig.add_subplot()
    names = [label(m["name"]) for m in ms]
    pct = [float(m["unique_layer_pct"]) for m in ms]
    y = list(range(len(ms)))
    ax.barh(y, pct, color="#4c78a8")
    rows_axis(ax, names)
    ax.set_xlim(0, 105)
    ax.set_xlabel("unique layers (% of the model's layers)")
    if finite(corpus.get("unique_layer_pct")):
        ax.axvline(corpus["unique_layer_pct"], color="#e45756", ls="--",
                   label=f"whole corpus: {corpus['unique_layer_pct']:.1f}%")
        ax.legend(loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    cols = ["model", "layers", "unique layers", "unique %"]
    for G in Gs:
        cols += [f"bricks G={G}", f"unique G={G}"]
    rows = []
    for m in ms:
        row: list[Any] = [m["name"], m["layers"], m["unique_layers"], number_cell(m["unique_layer_pct"], 1)]
        for G in Gs:
            s = m.get("sequences", {}).get(str(G), {})
            row += [s.get("sequences"), s.get("unique_sequences")]
        rows.append(row)
    total: list[Any] | None = None
    if corpus:
        total = ["whole corpus", corpus.get("layers"), corpus.get("unique_layers"),
                 number_cell(corpus.get("unique_layer_pct"), 1)]
        for G in Gs:
            s = corpus.get("sequences", {}).get(str(G), {})
            total += [s.get("sequences"), s.get("unique_sequences")]
    intro = ("A layer is unique within its model when no other layer of the model has the same digest "
             "(operator, attributes, shapes). The corpus line counts unique layers across all models.")
    return _section("unique-layers", figure(fig, "fig-unique-layers", "Unique layers per model (%)")
                    + table(cols, rows, tid="table-unique-layers", foot=total), intro=intro)


def _repeated_types_section(ctx: Context) -> str:
    ms = _analysis_models(ctx)
    if not ms:
        return _section("repeated-types", note=_NO_ANALYSIS)
    totals: dict[str, int] = {}
    carriers: dict[str, int] = {}
    for m in ms:
        for t, n in m.get("repeated_layer_types", {}).items():
            totals[t] = totals.get(t, 0) + int(n)
            carriers[t] = carriers.get(t, 0) + 1
    if not totals:
        return _section("repeated-types", note="No layer repeats within any model.")
    order = sorted(totals, key=lambda t: (-totals[t], t))
    shown = order[:_TOP_TYPES]
    fig = new_figure(9.0, bar_height(len(ms)))
    ax = fig.add_subplot()
    colors = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6"]
    y = list(range(len(ms)))
    left = [0.0] * len(ms)
    for i, t in enumerate(shown + (["other"] if len(order) > len(shown) else [])):
        if t == "other":
            vals = [float(sum(v for k, v in m.get("repeated_layer_types", {}).items() if k not in shown)) for m in ms]
            color = "#bab0ac"
        else:
            vals = [float(m.get("repeated_layer_types", {}).get(t, 0)) for m in ms]
            color = colors[i % len(colors)]
        ax.barh(y, vals, left=left, color=color, label=label(t, 20))
        left = [a + b for a, b in zip(left, vals)]
    rows_axis(ax, [label(m["name"]) for m in ms])
    ax.set_xlabel("repeated layers (occurrences after the first, within the model)")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    grand = sum(totals.values())
    rows = [[t, totals[t], number_cell(100.0 * totals[t] / grand, 1), carriers[t]] for t in order]
    return _section(
        "repeated-types",
        figure(fig, "fig-repeated-types", "Repeated layers per model, by operator type")
        + table(["operator type", "repeats in corpus", "share %", "models"], rows, tid="table-repeated-types"),
        intro="Counts every occurrence of a layer after its first within the same model.",
    )


def _jaccard_section(ctx: Context) -> str:
    jac = (ctx.analysis or {}).get("corpus", {}).get("jaccard")
    if not jac or not jac.get("names"):
        return _section("jaccard", note=_NO_ANALYSIS)
    names = list(jac["names"])
    mat = [[float(v) for v in row] for row in jac["matrix"]]
    n = len(names)
    side = min(max(4.5, 0.38 * n + 2.5), 14.0)
    fig = new_figure(side + 1.0, side)
    ax = fig.add_subplot()
    im = ax.imshow(mat, vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="Jaccard similarity of layer sets")
    if n <= 80:
        fs = 9 if n <= 20 else 6
        ax.set_xticks(range(n), [label(s, 18) for s in names], rotation=60, ha="right", fontsize=fs)
        ax.set_yticks(range(n), [label(s, 18) for s in names], fontsize=fs)
    if n <= 15:
        for i in range(n):
            for j in range(n):
                ax.text(j, i, f"{mat[i][j]:.2f}", ha="center", va="center", fontsize=9,
                        color="white" if mat[i][j] < 0.6 else "black")
    pairs = sorted(((mat[i][j], names[i], names[j]) for i in range(n) for j in range(i + 1, n)),
                   key=lambda p: (-p[0], p[1], p[2]))
    body = figure(fig, "fig-jaccard", "Jaccard similarity heatmap of the models' layer sets")
    if pairs:
        body += table(["model", "model", "Jaccard"], [[a, b, number_cell(v, 3)] for v, a, b in pairs[:20]],
                       tid="table-jaccard", caption="Most similar pairs")
    return _section("jaccard", body, intro="|A ∩ B| / |A ∪ B| over the sets of unique layer digests of two models.")


def _eval_models(ctx: Context) -> list[Mapping[str, Any]] | None:
    if ctx.evaluation is None:
        return None
    return list(ctx.evaluation.get("models", []))


def _e2e_section(ctx: Context) -> str:
    ms = _eval_models(ctx)
    if not ms:
        return _section("e2e", note=_NO_EVALUATION)
    vals = [float(m.get("e2e_s", float("nan"))) for m in ms]
    cis = [m.get("e2e_ci_s") or [v, v] for m, v in zip(ms, vals)]
    fig = new_figure(8.5, bar_height(len(ms)))
    ax = fig.add_subplot()
    y = list(range(len(ms)))
    scale, unit = time_scale(vals)
    ax.barh(y, [v / scale for v in vals], color="#4c78a8",
            xerr=[[e / scale for e in side] for side in error_bars(vals, [c[0] for c in cis], [c[1] for c in cis])],
            capsize=2, error_kw={"elinewidth": 0.8})
    rows_axis(ax, [label(m["name"]) for m in ms])
    log_if_spread(ax, vals)
    ax.set_xlabel(f"end-to-end latency, median ({unit})")
    ax.grid(axis="x", alpha=0.3)
    rows = []
    for m, v, ci in zip(ms, vals, cis):
        rows.append([m["name"], m.get("layers"), seconds_cell(v), seconds_cell(ci[0]), seconds_cell(ci[1]),
                     seconds_cell(m.get("layer_sum_s")), seconds_cell(m.get("layer_critical_path_s")), flag_cell(m)])
    cols = ["model", "layers", "end-to-end", "CI low", "CI high", "sum of layers (G=1)", "layer critical path (G=1)",
            "precision"]
    return _section("e2e", figure(fig, "fig-e2e", "End-to-end latency per model (median, 95% CI)")
                    + table(cols, rows, tid="table-e2e"),
                    intro="Each whole model timed on its own, with the same runner settings as the bricks.")


def _pred(m: Mapping[str, Any], G: int, mode: str) -> Mapping[str, Any] | None:
    g = m.get("per_g", {}).get(str(G))
    return g.get(mode) if g else None


def _normalized_section(ctx: Context) -> str:
    ms = _eval_models(ctx)
    if not ms:
        return _section("normalized", note=_NO_EVALUATION)
    Gs = ctx.Gs
    k = max(1, len(Gs))
    fig = new_figure(9.0, min(2.0 + 0.22 * len(ms) * k + 0.1 * len(ms), 60.0))
    ax = fig.add_subplot()
    width = 0.8 / k
    palette = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6"]
    series = []
    for G in Gs:
        vals, lo, hi, par = [], [], [], []
        for m in ms:
            p = _pred(m, G, "sequential") or {}
            v = float(p.get("normalized", float("nan")))
            ci = p.get("normalized_ci") or [v, v]
            vals.append(v)
            lo.append(float(ci[0]))
            hi.append(float(ci[1]))
            par.append(float((_pred(m, G, "parallel") or {}).get("normalized", float("nan"))))
        series.append((G, vals, lo, hi, par))
    # Parallel markers only when some model's critical path differs from its sum.
    differs = any(finite(p) and finite(v) and abs(p - v) > 1e-9 * max(1.0, abs(v))
                  for _G, vals, _lo, _hi, par in series for v, p in zip(vals, par))
    allv: list[float] = []
    for gi, (G, vals, lo, hi, par) in enumerate(series):
        pos = [i - 0.4 + width * (gi + 0.5) for i in range(len(ms))]
        allv += vals
        ax.barh(pos, vals, height=width, color=palette[gi % len(palette)], label=f"G={G}",
                xerr=error_bars(vals, lo, hi), capsize=1.5, error_kw={"elinewidth": 0.7})
        if differs:
            ax.plot(par, pos, "k|", markersize=7)
    if differs:
        ax.plot([], [], "k|", label="parallel (critical path)")
    ax.axvline(1.0, color="black", lw=1)
    rows_axis(ax, [label(m["name"]) for m in ms])
    log_if_spread(ax, allv, ratio=20.0)
    ax.set_xlabel("constructed latency / end-to-end latency (sequential sum of bricks)")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    cols = ["model"]
    for G in Gs:
        cols += [f"G={G} sequential", f"G={G} parallel"]
    cols.append("precision")
    rows = []
    for m in ms:
        row: list[Any] = [m["name"]]
        for G in Gs:
            row += [number_cell((_pred(m, G, "sequential") or {}).get("normalized")),
                    number_cell((_pred(m, G, "parallel") or {}).get("normalized"))]
        rows.append(row + [flag_cell(m)])
    intro = ("1.0 means the bricks' latencies add up to exactly the measured end-to-end latency. "
             "Sequential: the sum over the model's bricks; parallel: the longest path through its graph of bricks.")
    return _section("normalized", figure(fig, "fig-normalized", "Normalized constructed latency per model and G "
                                          "(95% bootstrap CI)") + table(cols, rows, tid="table-normalized"),
                    intro=intro)


def _per_g(ctx: Context) -> list[Mapping[str, Any]] | None:
    if ctx.evaluation is None:
        return None
    return sorted(ctx.evaluation.get("per_g", []), key=lambda g: int(g["G"]))


def _geomean_section(ctx: Context) -> str:
    pg = _per_g(ctx)
    if not pg:
        return _section("geomean", note=_NO_EVALUATION)
    Gs = [int(g["G"]) for g in pg]
    fig = new_figure(7.0, 4.0)
    ax = fig.add_subplot()
    seq = [float(g["geomean_normalized"]) for g in pg]
    ax.fill_between(Gs, [float(g["min_normalized"]) for g in pg], [float(g["max_normalized"]) for g in pg],
                    color="#4c78a8", alpha=0.18, label="min to max over models")
    ax.plot(Gs, seq, "o-", color="#4c78a8", label="geometric mean (sequential)")
    par = [float(g.get("geomean_normalized_parallel", float("nan"))) for g in pg]
    if any(finite(p) for p in par):
        ax.plot(Gs, par, "s--", color="#f58518", label="geometric mean (parallel)")
    ax.axhline(1.0, color="black", lw=1)
    ax.set_xticks(Gs)
    ax.set_xlabel("G (layers per brick, at most)")
    ax.set_ylabel("normalized latency")
    ax.legend()
    ax.grid(alpha=0.3)
    rows = [[g["G"], g.get("unique_bricks"), g.get("bricks"), number_cell(g.get("geomean_normalized")),
             number_cell(g.get("min_normalized")), number_cell(g.get("max_normalized")), number_cell(g.get("geomean_normalized_parallel"))]
            for g in pg]
    cols = ["G", "unique bricks", "bricks", "geomean (seq)", "min", "max", "geomean (par)"]
    return _section("geomean", figure(fig, "fig-geomean", "Geometric mean of normalized latency versus G")
                    + table(cols, rows, tid="table-geomean"))


def _speedup_section(ctx: Context) -> str:
    pg = _per_g(ctx)
    if not pg:
        return _section("speedup", note=_NO_EVALUATION)
    Gs = [int(g["G"]) for g in pg]
    fig = new_figure(7.0, 4.0)
    ax = fig.add_subplot()
    sp = [float(g.get("speedup", float("nan"))) for g in pg]
    wall = [float(g.get("wallclock_speedup", float("nan"))) for g in pg]
    ax.plot(Gs, sp, "o-", color="#4c78a8", label="latency speedup (Σ end-to-end / Σ unique bricks)")
    ax.plot(Gs, wall, "s--", color="#54a24b", label="wall-clock speedup (benchmarking time)")
    ax.axhline(1.0, color="black", lw=1)
    log_if_spread(ax, sp + wall, axis="y")
    ax.set_xticks(Gs)
    ax.set_xlabel("G (layers per brick, at most)")
    ax.set_ylabel("speedup (×)")
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    rows = [[g["G"], number_cell(g.get("speedup"), 2, "×"), number_cell(g.get("wallclock_speedup"), 2, "×"),
             seconds_cell(g.get("e2e_total_s")), seconds_cell(g.get("bricks_total_s")), seconds_cell(g.get("e2e_wall_s")),
             seconds_cell(g.get("bricks_wall_s"))] for g in pg]
    cols = ["G", "speedup", "wall-clock speedup", "Σ end-to-end", "Σ unique bricks", "end-to-end benchmarking",
            "brick benchmarking"]
    intro = ("Above 1, benchmarking the unique bricks costs less than benchmarking every model end to end: "
             "the paper's speedup compares summed latencies, the wall-clock speedup the time the runs took.")
    return _section("speedup", figure(fig, "fig-speedup", "Speedup versus G")
                    + table(cols, rows, tid="table-speedup"), intro=intro)


def _top_bricks(ctx: Context) -> tuple[list[dict[str, Any]], str]:
    """The ranked bricks and a sentence on how they were ranked."""
    from dlbricks.versions import brick_digest_version

    Gs = ctx.Gs
    G = min(Gs) if Gs else None
    given = ctx.evaluation.get("bricks") if ctx.evaluation else None
    if given:
        G = min(int(b["G"]) for b in given) if G is None else G
        rows = []
        for b in given:
            if int(b.get("G", G)) != G:
                continue
            med = float(b["median_s"])
            n = int(b.get("occurrences", 1))
            ops = b.get("op_types")
            if not ops:
                for (d, _v), meta in ctx.brick_meta().items():
                    if d == b["digest"] and meta.get("op_types"):
                        ops = meta["op_types"]
                        break
            rows.append({**b, "G": G, "occurrences": n, "op_types": list(ops or []),
                         "contribution_s": float(b.get("contribution_s", med * n))})
        rows.sort(key=lambda b: (-b["contribution_s"], str(b["digest"])))
        return rows, f"G={G}: each unique brick's median times its occurrences in the corpus (from the evaluation)."
    if ctx.store is None:
        return [], ""
    if ctx.models and ctx.system_id and ctx.config_key and G is not None:
        rows = brick_contributions(ctx.models, G, store=ctx.store, system_id=ctx.system_id, config_key=ctx.config_key)
        how = f"G={G}: each unique brick's median times its occurrences in the corpus."
        expected = next((int(g["unique_bricks"]) for g in ctx.evaluation.get("per_g", [])  # type: ignore[union-attr]
                         if int(g["G"]) == G and "unique_bricks" in g), None)
        if expected is not None and len(rows) != expected:
            how += (f" Warning: {len(rows)} bricks have a stored result where the evaluation had {expected} unique "
                    "bricks: the models given are not the ones evaluated, or their digests changed since.")
        return rows, how
    # Only the store: no occurrence counts, so rank by median.
    bver = brick_digest_version()
    meta = ctx.brick_meta()
    rows = []
    for rec in ctx.store.results(kind="brick", system_id=ctx.system_id, config_key=ctx.config_key, status="ok"):
        if rec.digest_version != bver or rec.stats is None:
            continue
        m = meta.get((rec.digest, rec.digest_version)) or {}
        if G is not None and m.get("g") not in (None, G):
            continue
        med = float(rec.stats["median"]) * 1e-9
        rows.append({"G": m.get("g"), "digest": rec.digest, "occurrences": None, "models": None, "median_s": med,
                     "ci_low_s": float(rec.stats.get("ci_low", rec.stats["median"])) * 1e-9,
                     "ci_high_s": float(rec.stats.get("ci_high", rec.stats["median"])) * 1e-9,
                     "contribution_s": med, "op_types": list(m.get("op_types") or [])})
    rows.sort(key=lambda b: (-b["contribution_s"], b["digest"]))
    where = f" first measured at G={G}" if G is not None else ""
    return rows, (f"Stored bricks{where} ranked by median alone: occurrence counts need the models "
                  "(pass their PATHs) or a `bricks` list in the evaluation.")


def _top_bricks_section(ctx: Context) -> str:
    rows, how = _top_bricks(ctx)
    if not rows:
        note = ("No brick results: pass the results store (--store) with the models, or an evaluation with a "
                "`bricks` list." if not how else "No stored brick result matches the evaluation.")
        return _section("top-bricks", note=note)
    weighted = rows[0].get("occurrences") is not None
    grand = sum(b["contribution_s"] for b in rows)
    top = rows[:TOP_BRICKS]
    fig = new_figure(9.0, bar_height(len(top)))
    ax = fig.add_subplot()
    vals = [b["contribution_s"] for b in top]
    scale, unit = time_scale(vals)
    labels = [label(f"#{i + 1} " + "→".join(b["op_types"]) if b["op_types"] else f"#{i + 1} {b['digest'][:12]}", 40)
              for i, b in enumerate(top)]
    y = list(range(len(top)))
    ax.barh(y, [v / scale for v in vals], color="#e45756" if weighted else "#4c78a8")
    rows_axis(ax, labels, fontsize=9)
    ax.set_xlabel(f"{'median × occurrences' if weighted else 'median'} ({unit})")
    ax.grid(axis="x", alpha=0.3)
    cum = 0.0
    trows = []
    for i, b in enumerate(top):
        cum += b["contribution_s"]
        trows.append([
            i + 1, Cell(b["digest"][:12], None, "mono"), b.get("G"), " → ".join(b["op_types"]),
            b.get("occurrences") if weighted else "", b.get("models") if weighted else "",
            seconds_cell(b["median_s"]), seconds_cell(b.get("ci_low_s")), seconds_cell(b.get("ci_high_s")),
            seconds_cell(b["contribution_s"]) if weighted else "",
            number_cell(100.0 * b["contribution_s"] / grand, 1) if weighted and grand > 0 else "",
            number_cell(100.0 * cum / grand, 1) if weighted and grand > 0 else "",
        ])
    cols = ["rank", "digest", "G", "op types", "occurrences", "models", "median", "CI low", "CI high",
            "time in corpus", "share %", "cumulative %"]
    caption = f"Top {len(top)} of {len(rows)} " + ("unique bricks" if weighted else "bricks by median")
    return _section("top-bricks", figure(fig, "fig-top-bricks", caption)
                    + table(cols, trows, tid="table-top-bricks"), intro=esc(how))


def _uncertainty_section(ctx: Context) -> str:
    ms = _eval_models(ctx)
    if not ms:
        return _section("uncertainty", note=_NO_EVALUATION)
    Gs = ctx.Gs
    fig = new_figure(9.0, bar_height(len(ms)))
    ax = fig.add_subplot()
    palette = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6"]
    y = list(range(len(ms)))
    markers = "os^Dv<>p"
    for gi, G in enumerate(Gs):
        rel = []
        for m in ms:
            p = _pred(m, G, "sequential")
            rel.append(_rel_halfwidth(p["latency_s"], p["ci_low_s"], p["ci_high_s"]) if p else float("nan"))
        ax.plot(rel, y, markers[gi % len(markers)], color=palette[gi % len(palette)], label=f"prediction G={G}",
                alpha=0.85)
    e2e_rel = [_rel_halfwidth(m.get("e2e_s"), *(m.get("e2e_ci_s") or [None, None])) for m in ms]
    ax.plot(e2e_rel, y, "k|", markersize=10, label="end-to-end measurement")
    rows_axis(ax, [label(m["name"]) for m in ms])
    ax.set_xlabel("95% interval half-width (% of the estimate)")
    ax.set_xlim(left=0)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    rows = []
    for m in ms:
        for G in Gs:
            g = m.get("per_g", {}).get(str(G)) or {}
            for mode in ("sequential", "parallel"):
                p = g.get(mode)
                if not p:
                    continue
                nci = p.get("normalized_ci") or [None, None]
                rows.append([
                    m["name"], G, mode, g.get("bricks"), seconds_cell(p["latency_s"]), seconds_cell(p["ci_low_s"]),
                    seconds_cell(p["ci_high_s"]), number_cell(_rel_halfwidth(p["latency_s"], p["ci_low_s"], p["ci_high_s"]), 2, "%"),
                    seconds_cell(g.get("e2e_s", m.get("e2e_s"))), number_cell(p.get("normalized")), number_cell(nci[0]), number_cell(nci[1]),
                ])
    cols = ["model", "G", "mode", "bricks", "predicted", "CI low", "CI high", "± %", "end-to-end", "normalized",
            "norm. CI low", "norm. CI high"]
    intro = ("Each brick's latency is known to its standard error, from the spread between the rounds it was "
             "measured in (so drift between measurement slots is included); the prediction is rebuilt from "
             "Student-t replicates of every brick (2.5 to 97.5 percentiles). Normalized intervals add the "
             "end-to-end measurement's own uncertainty.")
    return _section("uncertainty", figure(fig, "fig-uncertainty", "Relative width of each prediction's 95% interval")
                    + table(cols, rows, tid="table-uncertainty"), intro=intro)


def _rel_halfwidth(v: Any, lo: Any, hi: Any) -> float:
    if not (finite(v) and finite(lo) and finite(hi)) or v <= 0:
        return float("nan")
    return 100.0 * max(v - lo, hi - v, 0.0) / v


def _results_section(ctx: Context) -> str:
    if ctx.store is None:
        return _section("results", note="No results store given (--store).")
    records = list(ctx.store.results(system_id=ctx.system_id, config_key=ctx.config_key, with_times=False))
    if not records:
        return _section("results", note="The store holds no results" + (" for this system and configuration."
                                                                         if ctx.system_id else "."))
    meta = ctx.brick_meta()
    names = ctx.model_names()
    unconverged = {(u["kind"], u["digest"]) for u in ((ctx.evaluation or {}).get("precision_check") or {})
                   .get("unconverged", [])}

    def rel(r: Any) -> float:
        s = r.stats or {}
        return _rel_halfwidth(s.get("median"), s.get("ci_low"), s.get("ci_high"))

    def stopped(r: Any) -> bool:
        m = r.meta or {}
        return (r.kind, r.digest) in unconverged or (int(m.get("rounds", 0) or 0) > 0 and m.get("stop_reason") != "converged")

    # The failed and unconverged first, then the least precise: the rows worth a look.
    ranked = sorted(records, key=lambda r: (r.ok, not stopped(r), -(rel(r) if finite(rel(r)) else -1.0)))
    rows = []
    for r in ranked[:RESULT_ROWS]:
        s = r.stats or {}
        m = r.meta or {}
        if r.kind == "brick":
            bm = meta.get((r.digest, r.digest_version)) or {}
            what, g = " → ".join(bm.get("op_types") or []), bm.get("g")
        else:
            what, g = (names.get((r.digest, r.digest_version)) or {}).get("name") or "", None
        med = s.get("median")
        flag = "failed" if not r.ok else ("stopped at the round limit" if stopped(r) else "")
        rows.append([
            r.kind, what, Cell(r.digest[:12], None, "mono"), g, m.get("rounds") or None, s.get("n"),
            seconds_cell(med * 1e-9 if finite(med) else None),
            seconds_cell(s["ci_low"] * 1e-9 if finite(s.get("ci_low")) else None),
            seconds_cell(s["ci_high"] * 1e-9 if finite(s.get("ci_high")) else None),
            number_cell(rel(r), 2, "%"),
            number_cell(100.0 * s["drift"] if finite(s.get("drift")) else None, 1, "%"),
            m.get("stop_reason") or "", flag or r.error or "",
        ])
    cols = ["kind", "layers / model", "digest", "G", "rounds", "runs", "median", "CI low", "CI high", "± %",
            "drift between rounds %", "stop reason", "flag"]
    scope = (f"system {ctx.system_id}, config {ctx.config_key}" if ctx.system_id else "every system and configuration")
    n_failed = sum(1 for r in records if not r.ok)
    n_stopped = sum(1 for r in records if stopped(r))
    kinds = {k: sum(1 for r in records if r.kind == k) for k in ("brick", "model")}
    store_arg = f" --store {ctx.store.path}" if ctx.store is not None else ""
    intro = esc(
        f"{len(records)} results ({kinds['brick']} bricks, {kinds['model']} models; {scope}): {n_failed} failed, "
        f"{n_stopped} stopped at the round limit before the models they feed reached the stated precision. "
        f"Shown: the {min(RESULT_ROWS, len(records))} worth a look first (failed, stopped, least precise). "
        f"Every result, with model names, shapes, statistics and settings: `dlbricks results{store_arg} --format csv`."
    )
    return _section("results", table(cols, rows, tid="table-results"), intro=intro)
