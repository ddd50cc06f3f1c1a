"""The main job, `dlbricks demo`, on small models with short timings."""

from __future__ import annotations

import json

import onnx
from test_pipeline import FAST_CLI, chain_model, diamond_model

from dlbricks.cli import main
from dlbricks.commands.demo import default_corpus_dir


def test_default_corpus_is_the_nine_light_models():
    names = sorted(p.stem for p in default_corpus_dir().glob("light_*.onnx"))
    assert len(names) == 9 and "light_resnet50" in names and "light_vgg19" in names


def test_demo_runs_every_step_and_writes_the_report(tmp_path, capsys):
    a, b = tmp_path / "chain.onnx", tmp_path / "diamond.onnx"
    onnx.save(chain_model(3), str(a))
    onnx.save(diamond_model(), str(b))
    work = tmp_path / "work"
    code = main(["demo", "--models", str(a), str(b), "-G", "1,2", "-o", str(work), *FAST_CLI])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    for name in ("analysis.json", "evaluation.json", "roofline.json", "report.html", "results.sqlite"):
        assert (work / name).is_file(), name
    assert not (work / "bricks").exists()  # bricks go to the engine as bytes, not files
    evaluation = json.loads((work / "evaluation.json").read_text())
    assert [g["G"] for g in evaluation["per_g"]] == [1, 2]
    assert "geomean" in captured.out and f"report: {work / 'report.html'}" in captured.out
    for step in ("analyze:", "generate, bench and evaluate", "roofline", "done"):
        assert step in captured.err
    html = (work / "report.html").read_text()
    assert "chain" in html and "diamond" in html and "data:image/png;base64," in html

    assert "benchmarking:" in captured.err  # progress lines while measuring

    # A second run on the same work folder reuses every stored result: nothing to time.
    code = main(["demo", "--models", str(a), str(b), "-G", "1,2", "-o", str(work), *FAST_CLI])
    again = capsys.readouterr()
    assert code == 0
    assert "benchmarking:" not in again.err
    assert json.loads((work / "evaluation.json").read_text())["per_g"][0]["unique_bricks"] == evaluation["per_g"][0]["unique_bricks"]
