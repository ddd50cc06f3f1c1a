"""The HTML report: built from a small real run, self-contained, well formed, loads in a browser."""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dlbricks.analysis import analyze
from dlbricks.cli import main
from dlbricks.loading import load
from dlbricks.report.html import SECTIONS, TOP_BRICKS, brick_contributions, build_report, write_report
from dlbricks.report.sections import RESULT_ROWS
from dlbricks.store import Store
from dlbricks.timing import RunnerConfig
from dlbricks.timing.calibration import call_overhead
from dlbricks.versions import brick_digest_version

GS = (1, 2, 3)
FIGURES = {
    "summary": "fig-error",
    "unique-layers": "fig-unique-layers",
    "repeated-types": "fig-repeated-types",
    "jaccard": "fig-jaccard",
    "e2e": "fig-e2e",
    "normalized": "fig-normalized",
    "geomean": "fig-geomean",
    "speedup": "fig-speedup",
    "top-bricks": "fig-top-bricks",
    "uncertainty": "fig-uncertainty",
}
_JS_ERROR = re.compile(r"<html[^>]*\bdata-js-error=")
ANALYSIS_SECTIONS = ("unique-layers", "repeated-types", "jaccard")
EVALUATION_SECTIONS = ("summary", "e2e", "normalized", "geomean", "speedup", "uncertainty")


# ------------------------------------------------------------------------------ models


def _conv_net() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32), "w2")
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Conv", ["b", "w2"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["d"]),
        helper.make_node("Conv", ["d", "w2"], ["e"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["e"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "convnet",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])],
        [w1, w2],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal((16,)).astype(np.float32), "b"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["a"]),
        helper.make_node("Add", ["a", "b"], ["c"]),
        helper.make_node("Relu", ["c"], ["d"]),
        helper.make_node("MatMul", ["d", "w"], ["e"]),
        helper.make_node("Add", ["e", "b"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A real (very short) evaluation of two tiny models, its analysis and its store."""
    from dlbricks.pipeline import evaluate

    root = tmp_path_factory.mktemp("report")
    protos = {"convnet": _conv_net(), "mlp": _mlp()}
    paths = []
    for name, proto in protos.items():
        onnx.save(proto, str(root / f"{name}.onnx"))
        paths.append(root / f"{name}.onnx")
    models = [load(proto, name=name) for name, proto in protos.items()]
    config = RunnerConfig(min_time=0.01, max_time=0.05, warmup_time=0.0, warmup_iters=1, min_iters=5)
    store_path = root / "results.sqlite"
    with Store(store_path) as store:
        evaluation = evaluate(models, GS, store=store, config=config, n_boot=50).to_dict()
    evaluation["store"] = str(store_path)
    analysis = analyze(models, GS)
    with Store(store_path, readonly=True) as store:
        html_text = build_report(analysis, evaluation, store=store, models=models)
    return {"root": root, "models": models, "paths": paths, "store": store_path, "evaluation": evaluation,
            "analysis": analysis, "html": html_text}


# ----------------------------------------------------------------------------- parsing

_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class _Doc(HTMLParser):
    """Checks nesting while collecting ids, links, images, tables and notes."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.ids: list[str] = []
        self.urls: list[str] = []
        self.imgs: dict[str, str] = {}  # figure id -> its img src, or "svg" for an inline SVG
        self.svg_tags: dict[str, int] = {}  # figure id -> elements of its SVG
        self.tables: dict[str, list[list[str]]] = {}
        self.sections: dict[str, dict] = {}
        self.body_attrs: dict[str, str | None] = {}
        self._figure: str | None = None
        self._table: str | None = None
        self._cell: list[str] | None = None
        self._section: str | None = None
        self._in_note = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag not in _VOID:
            self.stack.append(tag)
        if a.get("id"):
            self.ids.append(a["id"])  # type: ignore[arg-type]
        for key in ("src", "href", "srcset", "action", "poster"):
            if a.get(key) is not None:
                self.urls.append(a[key])  # type: ignore[arg-type]
        if tag == "section":
            self._section = a.get("id")
            self.sections[self._section or ""] = {"notes": [], "figures": []}
        if tag == "figure":
            self._figure = a.get("id")
            if self._section:
                self.sections[self._section]["figures"].append(self._figure)
        if tag == "img":
            self.imgs[self._figure or f"img{len(self.imgs)}"] = a.get("src") or ""
        if tag == "svg" and self._figure and self._figure not in self.imgs:
            self.imgs[self._figure] = "svg"
            self.svg_tags[self._figure] = 0
        if self._figure in self.svg_tags:
            self.svg_tags[self._figure] += 1
        if tag == "table":
            self._table = a.get("id") or f"table{len(self.tables)}"
            self.tables[self._table] = []
        if tag == "tr" and self._table:
            self.tables[self._table].append([])
        if tag in ("td", "th") and self._table:
            self._cell = []
        if tag == "p" and "missing" in (a.get("class") or ""):
            self._in_note = True
            if self._section:
                self.sections[self._section]["notes"].append("")
        if tag == "body":
            self.body_attrs = a

    def handle_endtag(self, tag: str) -> None:
        if tag in _VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
            return
        self.stack.pop()
        if tag in ("td", "th") and self._table and self._cell is not None:
            self.tables[self._table][-1].append("".join(self._cell).strip())
            self._cell = None
        if tag == "table":
            self._table = None
        if tag == "figure":
            self._figure = None
        if tag == "section":
            self._section = None
        if tag == "p":
            self._in_note = False

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._in_note and self._section:
            self.sections[self._section]["notes"][-1] += data


def _parse(text: str) -> _Doc:
    doc = _Doc()
    doc.feed(text)
    doc.close()
    return doc


def _body_rows(doc: _Doc, tid: str) -> list[list[str]]:
    return doc.tables[tid][1:]  # the first row is the heading


# ------------------------------------------------------------------------------- tests


def test_report_has_every_section_with_an_embedded_figure(run: dict) -> None:
    doc = _parse(run["html"])
    for sid, _head in SECTIONS:
        if sid in ("roofline", "attribution"):
            assert sid not in doc.sections  # only when a roofline result, or an attribution, is given
            continue
        assert sid in doc.sections, sid
        assert doc.sections[sid]["notes"] == [], (sid, doc.sections[sid]["notes"])
    for sid, fid in FIGURES.items():
        assert fid in doc.sections[sid]["figures"], (sid, doc.sections[sid])
        assert doc.imgs[fid] == "svg" and doc.svg_tags[fid] > 20, fid  # vector, inline
    # The system and the runner settings that produced the results.
    sid = run["evaluation"]["system_id"]
    fp = {row[0]: row[1] for row in doc.tables[f"fingerprint-{sid}"]}
    assert fp["cpu.logical_cores"] and fp["versions.onnxruntime"]
    cfg = {row[0]: row[1] for row in doc.tables[f"config-{run['evaluation']['config_key']}"]}
    assert cfg["min_time"] == "0.01" and cfg["intra_op_threads"] == "1" and cfg["max_rounds"] == "60"


def test_report_opens_with_the_answer_and_ends_with_the_system(run: dict) -> None:
    doc = _parse(run["html"])
    order = list(doc.sections)
    assert order[0] == "summary" and order[-1] == "system"
    ev = run["evaluation"]
    acc = _body_rows(doc, "table-summary")
    assert [int(r[0]) for r in acc] == list(GS)
    for row, g in zip(acc, ev["per_g"]):
        assert row[1] == f"{100 * g['within_5pct']:.0f}%" and row[2] == f"{100 * g['within_10pct']:.0f}%"
        worst = max(ev["models"], key=lambda m: abs(m["per_g"][str(g["G"])]["sequential"]["normalized"] - 1))
        assert row[5].startswith(worst["name"])
    head, *cost = doc.tables["table-summary-cost"]
    assert "wall-clock speedup" in head and "paper speedup (latency ratio)" in head
    assert [float(r[4].rstrip("×")) for r in cost] == pytest.approx([g["wallclock_speedup"] for g in ev["per_g"]],
                                                                     abs=5e-3)
    text = run["html"]
    summary = text[text.index('<section id="summary">'):text.index('<section id="e2e">')]
    assert "within ±5%" in summary and "Paper speedup" in summary and "came from the results store" in summary
    assert summary.index("Accuracy") < summary.index("Cost") < summary.index("Reuse")


def test_models_short_of_the_precision_are_flagged_in_the_summary_and_tables(run: dict) -> None:
    ev = copy.deepcopy(run["evaluation"])
    name = ev["models"][0]["name"]
    # The fixture's real run may itself flag a model on a busy host: this test renders
    # exactly one flagged model.
    for m in ev["models"]:
        m.update(flagged=False, flags=[])
    ev["models"][0].update(flagged=True, flags=["end to end: +/-3.1% > +/-2.0%"])
    ev["precision_check"] = {"precision": 0.02, "models_flagged": 1, "results_unconverged": 2,
                             "flagged": [{"model": name, "G": None, "rel_halfwidth": 0.031}], "unconverged": []}
    text = build_report(None, ev)
    doc = _parse(text)
    summary = text[text.index('<section id="summary">'):text.index('<section id="e2e">')]
    assert "1 model(s) short of ±2.0%" in summary and "2 result(s) stopped at the round limit" in summary
    e2e = {r[0]: r[-1] for r in _body_rows(doc, "table-e2e")}
    assert e2e[name].startswith("⚠") and "3.1%" in e2e[name]
    assert all(v == "" for k, v in e2e.items() if k != name)
    assert _parse(run["html"]).tables["table-normalized"][0][-1] == "precision"
    for m in ev["models"]:
        m.update(flagged=False, flags=[])
    ev["precision_check"] = {"precision": 0.02, "models_flagged": 0, "results_unconverged": 0, "flagged": [],
                             "unconverged": []}
    text = build_report(None, ev)
    clean = text[text.index('<section id="summary">'):text.index('<section id="e2e">')]
    assert "⚠" not in clean.split("<svg", 1)[0]


def test_the_results_table_is_a_summary_of_a_large_store(tmp_path: Path) -> None:
    from test_store import SYSTEM, _measurement

    cfg = RunnerConfig()
    with Store(tmp_path / "big.sqlite") as st:
        st.put_bricks((f"{i:032x}", 1, {"g": 1, "op_types": ["Relu"]}) for i in range(400))
        for i in range(400):
            m = _measurement(times=(100 + i % 7, 101, 102, 120 + i % 13, 99))
            if i % 100 == 0:
                m.rounds, m.stop_reason, m.median_se_ns = 60, "max_rounds", 3.0
            st.put_result("brick", f"{i:032x}", 1, SYSTEM, cfg, m)
        text = build_report(None, None, store=st)
    doc = _parse(text)
    rows = _body_rows(doc, "table-results")
    assert len(rows) == RESULT_ROWS
    assert [r[-1] for r in rows[:4]] == ["stopped at the round limit"] * 4 and rows[4][-1] == ""
    intro = text[text.index('<section id="results">'):text.index("table-results")]
    assert "400 results" in intro and "4 stopped at the round limit" in intro and "dlbricks results" in intro
    assert len(text.encode()) < 200_000


def test_report_is_well_formed_and_self_contained(run: dict) -> None:
    text = run["html"]
    doc = _parse(text)
    assert doc.errors == [] and doc.stack == []
    assert len(doc.ids) == len(set(doc.ids)), "duplicate ids"
    for url in doc.urls:
        assert url.startswith(("data:", "#")), url
        if url.startswith("#"):
            assert url[1:] in doc.ids, f"dangling link {url}"
    lowered = text.lower()
    for needle in ("http://", "https://", "//cdn", "@import", "<link", "<iframe"):
        assert needle not in lowered, needle
    # An SVG refers to its own clip paths and markers only, by prefixed id.
    for ref in re.findall(r"url\(([^)]*)\)", text) + re.findall(r'xlink:href="(#[^"]*)"', text):
        assert ref.startswith("#") and ref[1:] in doc.ids, ref


def test_report_tables_carry_the_evaluation_numbers(run: dict) -> None:
    doc = _parse(run["html"])
    ev = run["evaluation"]
    rows = _body_rows(doc, "table-geomean")
    assert [int(r[0]) for r in rows] == list(GS)
    for row, g in zip(rows, ev["per_g"]):
        assert float(row[3]) == pytest.approx(g["geomean_normalized"], abs=5e-4)
    # Every model x G x mode has a row with its interval.
    unc = _body_rows(doc, "table-uncertainty")
    assert len(unc) == len(ev["models"]) * len(GS) * 2
    assert {(r[0], int(r[1]), r[2]) for r in unc} == {
        (m["name"], G, mode) for m in ev["models"] for G in GS for mode in ("sequential", "parallel")
    }
    unique = {r[0]: float(r[3]) for r in _body_rows(doc, "table-unique-layers")}
    for m in run["analysis"]["models"]:
        assert unique[m["name"]] == pytest.approx(m["unique_layer_pct"], abs=0.05)


def test_top_bricks_weight_each_median_by_its_occurrences(run: dict) -> None:
    ev = run["evaluation"]
    with Store(run["store"], readonly=True) as store:
        bricks = brick_contributions(run["models"], 1, store=store, system_id=ev["system_id"],
                                     config_key=ev["config_key"])
    g1 = next(g for g in ev["per_g"] if g["G"] == 1)
    assert len(bricks) == g1["unique_bricks"]
    assert sum(b["occurrences"] for b in bricks) == g1["bricks"]
    contributions = [b["contribution_s"] for b in bricks]
    assert contributions == sorted(contributions, reverse=True)
    for b in bricks:
        assert b["contribution_s"] == pytest.approx(b["median_s"] * b["occurrences"])
        assert len(b["op_types"]) == 1  # G=1: one layer per brick
    # Summed over the corpus they are the sequential predictions summed over the models, once each
    # brick's fixed per-call cost (in its own rounds) is counted once per model instead (at the
    # whole run's: the call-overhead correction).
    predicted = sum(m["per_g"]["1"]["sequential"]["latency_s"] for m in ev["models"])
    c = (ev.get("call_overhead_ns") or 0.0) * 1e-9
    with Store(run["store"], readonly=True) as store:
        cal = call_overhead(store, ev["system_id"], ev["config_key"])
        metas = {b["digest"]: store.get_result("brick", b["digest"], brick_digest_version(), ev["system_id"],
                                               ev["config_key"]).meta for b in bricks}
    paid = {d: cal.in_rounds(m.get("engine_run", ""), m.get("round_nos") or ()) * 1e-9 if cal else 0.0
            for d, m in metas.items()}
    corrected = sum(b["occurrences"] * max(b["median_s"] - paid[b["digest"]], 0.0) for b in bricks) \
        + c * len(ev["models"])
    assert corrected == pytest.approx(predicted, rel=1e-9)
    rows = _body_rows(_parse(run["html"]), "table-top-bricks")
    assert len(rows) == min(TOP_BRICKS, len(bricks))
    assert [r[1] for r in rows] == [b["digest"][:12] for b in bricks[: len(rows)]]
    assert [int(r[4]) for r in rows] == [b["occurrences"] for b in bricks[: len(rows)]]
    assert float(rows[-1][11]) == pytest.approx(100.0, abs=0.05)  # cumulative share


def test_top_bricks_warn_when_the_models_are_not_the_evaluated_ones(run: dict) -> None:
    ev = copy.deepcopy(run["evaluation"])
    ev.pop("bricks", None)  # without evaluate()'s own list, the report recounts from the models
    with Store(run["store"], readonly=True) as store:
        text = build_report(None, ev, store=store, models=run["models"][:1])
    doc = _parse(text)
    assert len(_body_rows(doc, "table-top-bricks")) < next(g["unique_bricks"] for g in run["evaluation"]["per_g"]
                                                          if g["G"] == 1)
    assert "are not the ones evaluated" in text
    assert "are not the ones evaluated" not in run["html"]


def test_top_bricks_come_from_an_evaluation_bricks_list_when_present(run: dict) -> None:
    ev = copy.deepcopy(run["evaluation"])
    ev["bricks"] = [
        {"G": 1, "digest": "aa" * 16, "occurrences": 1, "median_s": 5e-3, "op_types": ["Conv"]},
        {"G": 1, "digest": "bb" * 16, "occurrences": 100, "median_s": 1e-4, "op_types": ["Relu"]},
        {"G": 2, "digest": "cc" * 16, "occurrences": 1, "median_s": 1.0, "op_types": ["Conv", "Relu"]},
    ]
    doc = _parse(build_report(None, ev))
    rows = _body_rows(doc, "table-top-bricks")
    # 100 x 0.1 ms outweighs 1 x 5 ms; the G=2 brick is not at the smallest G.
    assert [r[1] for r in rows] == ["bb" * 6, "aa" * 6]
    assert [r[3] for r in rows] == ["Relu", "Conv"]
    assert rows[0][9] == "10.000 ms"


def test_store_only_report_shows_settings_results_and_bricks_by_median(run: dict) -> None:
    with Store(run["store"], readonly=True) as store:
        text = build_report(None, None, store=store)
        n_results = store.count()
        n_bricks = store.count(kind="brick", status="ok")
    doc = _parse(text)
    assert doc.errors == []
    assert any(i.startswith("fingerprint-") for i in doc.ids)
    assert f"config-{run['evaluation']['config_key']}" in doc.ids
    assert len(_body_rows(doc, "table-results")) == min(n_results, RESULT_ROWS)
    rows = _body_rows(doc, "table-top-bricks")
    assert len(rows) == min(TOP_BRICKS, n_bricks)
    assert all(r[4] == "" for r in rows)  # no occurrence counts without the models
    for sid in ANALYSIS_SECTIONS + EVALUATION_SECTIONS:
        assert doc.sections[sid]["notes"], sid
        assert not doc.sections[sid]["figures"], sid
    assert "fig-top-bricks" in doc.imgs


def test_missing_inputs_leave_each_section_with_a_note(run: dict) -> None:
    doc = _parse(build_report(None, None))
    assert doc.errors == [] and doc.imgs == {}
    for sid, _head in SECTIONS:
        if sid in ("roofline", "attribution"):
            assert sid not in doc.sections
            continue
        assert doc.sections[sid]["notes"] and doc.sections[sid]["notes"][0].strip(), sid
    doc = _parse(build_report(run["analysis"], None))
    for sid in ANALYSIS_SECTIONS:
        assert FIGURES[sid] in doc.imgs and not doc.sections[sid]["notes"]
    for sid in EVALUATION_SECTIONS + ("top-bricks", "results"):
        assert doc.sections[sid]["notes"] and not doc.sections[sid]["figures"], sid


def _with_attribution(ev: dict) -> dict:
    """The evaluation with an attribution of the shape `evaluate --attribution` gives,
    its numbers made up so that each model's steps differ."""
    ev = copy.deepcopy(ev)
    steps = ["baseline", "call_overhead", "runtime_graph", "cache_state"]
    models = []
    for i, m in enumerate(ev["models"]):
        final = m["per_g"]["1"]["sequential"]["normalized"]
        norm = [final + 0.3 - 0.1 * i, final + 0.1, final - 0.02 * (i + 1), final]
        models.append({"name": m["name"], "path": m.get("path"), "e2e_s": m["e2e_s"],
                       "latency_s": [v * m["e2e_s"] for v in norm], "normalized": norm,
                       "explained": {s: norm[k] - norm[k - 1] for k, s in enumerate(steps) if k}})
    ev["attribution"] = {"G": 1, "steps": steps, "labels": {"cache_state": "+ cache state auto"},
                         "models": models}
    return ev


def test_the_attribution_section_shows_each_step_per_model_when_the_evaluation_has_one(run: dict) -> None:
    ev = _with_attribution(run["evaluation"])
    text = build_report(run["analysis"], ev)
    doc = _parse(text)
    assert doc.errors == []
    order = list(doc.sections)
    assert order.index("normalized") + 1 == order.index("attribution")
    assert "#attribution" in doc.urls and "<h2>Where each model&#x27;s error comes from</h2>" in text
    sec = doc.sections["attribution"]
    assert sec["notes"] == [] and sec["figures"] == ["fig-attribution"]
    assert doc.imgs["fig-attribution"] == "svg" and doc.svg_tags["fig-attribution"] > 20
    head, *rows = doc.tables["table-attribution"]
    assert head[:6] == ["model", "end-to-end", "after baseline", "after + call overhead", "after + runtime graph",
                        "after + cache state"]
    # Sorted by the final error, the worst first; every step's value and change per model.
    att = {m["name"]: m for m in ev["attribution"]["models"]}
    worst_first = sorted(att, key=lambda n: -abs(att[n]["normalized"][-1] - 1))
    assert [r[0] for r in rows] == worst_first
    for r in rows:
        m = att[r[0]]
        assert [float(x) for x in r[2:6]] == pytest.approx(m["normalized"], abs=6e-4)
        assert [float(x) for x in r[6:9]] == pytest.approx(list(m["explained"].values()), abs=6e-4)
    assert "+ cache state auto" in build_report(None, ev)


def test_there_is_no_attribution_section_without_an_attribution(run: dict) -> None:
    doc = _parse(run["html"])
    assert "attribution" not in doc.sections and "#attribution" not in doc.urls
    assert "fig-attribution" not in doc.imgs and "table-attribution" not in doc.tables


def test_text_from_the_inputs_is_escaped() -> None:
    hostile = '<script>alert("x")</script> $\\alpha$ & "q"'
    analysis = {
        "G": [1],
        "models": [{"name": hostile, "layers": 2, "unique_layers": 1, "unique_layer_pct": 50.0,
                    "sequences": {"1": {"sequences": 2, "unique_sequences": 1}},
                    "repeated_layer_types": {"<b>Op</b>": 1}}],
        "corpus": {"models": 1, "layers": 2, "unique_layers": 1, "unique_layer_pct": 50.0,
                   "sequences": {"1": {"sequences": 2, "unique_sequences": 1}},
                   "jaccard": {"names": [hostile], "matrix": [[1.0]]}},
    }
    text = build_report(analysis, None, title="</title><img src=x>")
    assert "<script>alert" not in text and "<b>Op</b>" not in text and "<img src=x>" not in text
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in text
    doc = _parse(text)
    assert doc.errors == []
    assert [r[0] for r in _body_rows(doc, "table-unique-layers")][0] == hostile
    assert all(u.startswith(("data:", "#")) for u in doc.urls)


def _roofline_json() -> dict:
    layer = {"index": 0, "name": "n0", "kind": "Conv", "flops": 2_000_000, "arithmetic_intensity": 20.0,
             "measured_s": 1e-4, "bound_s": 5e-5, "limit": "compute", "efficiency": 0.5, "beats_bound": False}
    fast = {**layer, "index": 1, "name": "n1", "kind": "Relu", "flops": 1000, "arithmetic_intensity": 0.25,
            "measured_s": 1e-6, "bound_s": 3e-6, "limit": "memory", "efficiency": 3.0, "beats_bound": True}
    reshape = {**layer, "index": 2, "name": "n2", "kind": "Reshape", "flops": 0, "arithmetic_intensity": None}
    beats = [{"model": "convnet", "name": f"n{i}", "kind": "Relu", "limit": "memory", "bound_s": 3e-6,
              "measured_s": 1e-6, "efficiency": 3.0 - i / 100, "cause": "cache_resident"} for i in range(40)]
    return {
        "schema_version": 1,
        "peaks": {"gflops": 50.0, "bandwidth_gbs": 10.0, "threads": 1, "quick": True,
                  "gflops_by_size": {"256": 48.0, "512": 50.0},
                  "caches": [{"level": 3, "type": "Unified", "size_bytes": 32 << 20}]},
        "noise": 0.05,
        "models": [{"name": "convnet", "n_layers": 3, "measured_s": 2e-4, "measured_source": "end_to_end",
                    "ideal_sequential_s": 5.3e-5, "ideal_critical_path_s": 5.3e-5, "efficiency": 0.265,
                    "layers_measured": 2, "beats_bound": 1, "kinds_without_formula": [], "layer_sum_s": 1.01e-4,
                    "scenarios": {"at_bound": {"latency_s": 5.3e-5, "speedup": 1.9}},
                    "layers": [layer, fast, reshape]}],
        "headroom": [{"kind": "Conv", "occurrences": 2, "models": ["convnet"], "measured_s": 1e-4, "bound_s": 5e-5,
                      "limit": "compute", "efficiency": 0.5, "total_headroom_s": 1e-4, "example": "convnet:n0"}],
        "brick_headroom": {},
        "beats_bound": beats,
    }


def test_roofline_reads_like_the_rest_of_the_report() -> None:
    roofline = _roofline_json()
    text = build_report(None, None, roofline=roofline, roofline_source="work/roofline.json")
    doc = _parse(text)
    assert doc.errors == [] and "roofline" in doc.sections and "#roofline" in doc.urls
    assert doc.imgs["fig-roofline"] == "svg"  # drawn from the layers, as vector
    section = text[text.index('<section id="roofline">'):text.index('<section id="system">')]
    # Every count explained, every mark in the legend, no raw JSON keys.
    assert "2 of 3 layers drawn" in section and "1 layer with no arithmetic" in section and "Reshape 1" in section
    for mark in ("faster than its bound", "ridge point", "roofline: 50 GFLOP/s"):
        assert mark in section, mark
    for raw in ("gflops_by_size", "peaks.", "measured_source", "ideal_sequential_s", "plot_png_base64"):
        assert raw not in section, raw
    peaks = {r[0]: r[1] for r in doc.tables["roofline-peaks"]}
    assert peaks["Compute peak (MatMul)"] == "50.0 GFLOP/s"
    assert peaks["Ridge point (compute-bound above)"] == "5.0 FLOP/byte"
    head, row = doc.tables["table-roofline"]
    assert head[:3] == ["model", "layers", "measured latency"] and row[3] == "end to end"
    # A long list is summarised, and says where the rest is.
    assert len(_body_rows(doc, "table-roofline-beats")) == 15
    assert "all 40 are in work/roofline.json" in section and "40 layers ran faster than their bound" in section
    # Without per-layer data the JSON's own picture is shown, its marks explained.
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 64).decode()
    plain = _parse(build_report(None, None, roofline={**roofline, "models": [
        {k: v for k, v in roofline["models"][0].items() if k != "layers"}], "plot_png_base64": png}))
    assert plain.imgs["fig-roofline"].startswith("data:image/png;base64,")
    bad = _parse(build_report(None, None, roofline={"plot_png_base64": "not base64!"}))
    assert "fig-roofline" not in bad.imgs and bad.sections["roofline"]["notes"]


def _int8_roofline_json() -> dict:
    """A runtime graph's roofline: an int8 kernel whose work is nearly all integer
    operations, the int8 peak, and the JSON's own account of the layers not drawn."""
    roofline = _roofline_json()
    qconv = {**roofline["models"][0]["layers"][0], "index": 3, "name": "q0", "kind": "com.microsoft::QLinearConv",
             "flops": 1000, "int_ops": 4_000_000, "arithmetic_intensity": 40.0, "measured_s": 2e-5,
             "has_formula": True, "beats_bound": False}
    roofline["peaks"].update(int8_gops=400.0, int8_gops_by_size={"256": 380.0, "512": 400.0})
    roofline["graph"] = "runtime"
    model = roofline["models"][0]
    model.update(graph="runtime", n_layers=4, layers=[*model["layers"], qconv])
    roofline["not_placed"] = [{"reason": "no_arithmetic", "explanation": "no arithmetic", "layers": 1,
                               "kinds": {"com.microsoft.nchwc::ReorderOutput": 1}}]
    return roofline


def test_roofline_draws_int8_kernels_against_the_int8_ceiling_and_names_what_is_not_drawn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import dlbricks.report.roofline_view as view

    drawn = []
    real_figure = view.figure

    def keep(fig, *args, **kwargs):
        drawn.append(fig)
        return real_figure(fig, *args, **kwargs)

    monkeypatch.setattr(view, "figure", keep)
    roofline = _int8_roofline_json()
    text = build_report(None, None, roofline=roofline)
    doc = _parse(text)
    assert doc.errors == [] and doc.imgs["fig-roofline"] == "svg"
    section = text[text.index('<section id="roofline">'):text.index('<section id="system">')]
    peaks = {r[0]: r[1] for r in doc.tables["roofline-peaks"]}
    assert peaks["Int8 compute peak (MatMulInteger, uint8 × int8)"] == "400.0 GOP/s"
    assert peaks["Int8 ridge point (int8 kernels compute-bound above)"] == "40.0 op/byte"
    assert peaks["Int8 compute by MatMulInteger size n×n"] == "256: 380.0, 512: 400.0 GOP/s"
    # The int8 kernel is drawn, its work its integer operations and FLOPs together.
    assert "3 of 4 layers drawn" in section
    (fig,) = drawn
    ax = fig.axes[0]
    triangles = [c for c in ax.collections if len(c.get_offsets()) and c.get_paths()[0].vertices.shape[0] == 4]
    (tri,) = triangles
    x, y = tri.get_offsets()[0]
    assert (x, y) == pytest.approx((40.0, (1000 + 4_000_000) / 2e-5 / 1e9))
    # ... under the int8 ceiling: min(400 GOP/s, intensity x 10 GB/s), beside the float one.
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    int8_line = lines["int8 roofline: 400 GOP/s"]
    assert max(int8_line.get_ydata()) == pytest.approx(400.0) and "int8 ridge point (40.0 op/byte)" in lines
    assert max(lines["roofline: 50 GFLOP/s, 10.0 GB/s"].get_ydata()) == pytest.approx(50.0)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "int8 kernel (circle: float)" in labels and "faster than its bound" in labels
    # The note on layers not drawn is the JSON's not_placed, not a count of its own.
    assert "1 layer with no arithmetic" in section and "com.microsoft.nchwc::ReorderOutput 1" in section
    assert "Reshape" not in section.split("Not drawn:", 1)[1].split("</span>", 1)[0]
    head, row = doc.tables["table-roofline"]
    assert head[-1] == "layers of the graph" and row[-1] == "onnxruntime's"
    assert "The layers are those of the graphs onnxruntime executes" in section
    # Peaks from before the int8 peak: no int8 ceiling, and the table and note say why.
    drawn.clear()
    old = _int8_roofline_json()
    del old["peaks"]["int8_gops"], old["peaks"]["int8_gops_by_size"]
    text = build_report(None, None, roofline=old)
    peaks = {r[0]: r[1] for r in _parse(text).tables["roofline-peaks"]}
    assert peaks["Int8 compute peak"].startswith("not measured") and "the 1 int8 layers" in peaks["Int8 compute peak"]
    assert not [ln for ln in drawn[0].axes[0].get_lines() if "int8" in str(ln.get_label())]
    assert "int8 kernels have no ceiling of their own here" in text


@pytest.mark.browser
def test_report_with_an_int8_roofline_loads_in_headless_chromium(tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    page = write_report(build_report(None, None, roofline=_int8_roofline_json()), tmp_path / "roofline.html")
    base = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*base, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-ready="1"' in dom.stdout and not _JS_ERROR.search(dom.stdout), dom.stdout[:500]
    assert 'id="fig-roofline"' in dom.stdout and "int8 roofline: 400 GOP/s" in dom.stdout


def test_write_report_replaces_the_file_atomically(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "r.html"
    assert write_report("<p>one</p>", target) == target
    write_report("<p>two</p>", target)
    assert target.read_text() == "<p>two</p>"
    assert sorted(p.name for p in target.parent.iterdir()) == ["r.html"]


def test_cli_writes_the_report_from_json_inputs(run: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    an, ev = tmp_path / "analysis.json", tmp_path / "evaluation.json"
    an.write_text(json.dumps(run["analysis"]))
    ev.write_text(json.dumps(run["evaluation"]))
    out = tmp_path / "out" / "report.html"
    rc = main(["report", "--store", str(run["store"]), "--analysis", str(an), "--evaluation", str(ev),
               "-o", str(out)])
    assert rc == 0
    assert capsys.readouterr().out.strip() == str(out)
    doc = _parse(out.read_text())
    assert set(FIGURES.values()) <= set(doc.imgs)
    # Without the models the bricks come from the evaluation's own list, occurrences included.
    listed = sorted((b for b in run["evaluation"]["bricks"] if b["G"] == 1), key=lambda b: -b["contribution_s"])
    rows = _body_rows(doc, "table-top-bricks")
    assert [int(r[4]) for r in rows] == [b["occurrences"] for b in listed[: len(rows)]]


def test_cli_with_model_paths_analyses_them_and_counts_occurrences(run: dict, tmp_path: Path) -> None:
    ev = tmp_path / "evaluation.json"
    ev.write_text(json.dumps(run["evaluation"]))
    out = tmp_path / "report.html"
    rc = main(["report", *map(str, run["paths"]), "--evaluation", str(ev), "-o", str(out)])
    assert rc == 0  # the store comes from the evaluation's "store" entry
    doc = _parse(out.read_text())
    assert "fig-jaccard" in doc.imgs and "table-results" in doc.tables
    rows = _body_rows(doc, "table-top-bricks")
    assert sum(int(r[4]) for r in rows) == next(g["bricks"] for g in run["evaluation"]["per_g"] if g["G"] == 1)


def test_cli_usage_errors_exit_2(run: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no default store
    out = str(tmp_path / "r.html")
    assert main(["report", "-o", out]) == 2
    assert "nothing to report" in capsys.readouterr().err
    assert main(["report", "--store", str(tmp_path / "none.sqlite"), "-o", out]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["report", "--evaluation", str(bad), "-o", out]) == 2
    swapped = tmp_path / "analysis.json"
    swapped.write_text(json.dumps(run["analysis"]))
    assert main(["report", "--evaluation", str(swapped), "-o", out]) == 2
    assert "not the expected JSON" in capsys.readouterr().err
    assert not Path(out).exists()


@pytest.mark.browser
def test_report_loads_in_headless_chromium(run: dict, tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    page = write_report(run["html"], tmp_path / "report.html")
    base = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*base, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    # The inline script ran to its end, and no error reached window.onerror.
    assert 'data-ready="1"' in dom.stdout, dom.stdout[:500]
    assert not _JS_ERROR.search(dom.stdout)
    # The error trap works: the same page with a failing script is caught.
    head = run["html"].split("<main>", 1)[0]
    broken = write_report(head + "<script>no_such_function();</script></body></html>", tmp_path / "broken.html")
    dom = subprocess.run([*base, "--dump-dom", broken.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0 and _JS_ERROR.search(dom.stdout), dom.stdout[:300]
    shot = tmp_path / "shot.png"
    res = subprocess.run([*base, f"--screenshot={shot}", "--window-size=1280,4000", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    from PIL import Image

    with Image.open(shot) as im:
        assert im.size == (1280, 4000)
        gray = np.asarray(im.convert("L"))
    # Rendered content, not a blank page: dark text and many distinct shades (figures).
    assert (gray < 100).mean() > 0.002
    assert np.unique(gray).size > 50
