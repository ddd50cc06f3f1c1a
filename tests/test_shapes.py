"""Input shapes for real model zoos: --input-shape per input name, --dim per named free
dimension, --input-shapes FILE per model path or glob; warnings name the model."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dlbricks.cli import main
from dlbricks.commands._shapes import ShapePlan, read_shapes_file
from dlbricks.errors import UsageError

FAST = ["--no-pin", "--no-call-overhead", "--min-rounds", "2", "--max-rounds", "3"]


def _conv(inp: str) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", [inp, "w"], ["y"], pads=[1, 1, 1, 1])], "conv",
                          [helper.make_tensor_value_info(inp, TensorProto.FLOAT, ["N", 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def _encoder() -> onnx.ModelProto:
    """A Hugging Face-style export: inputs with named free dimensions."""
    w = numpy_helper.from_array(np.ones((16, 16), np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                          "encoder", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


@pytest.fixture
def zoo(tmp_path):
    """Two zoo layouts in one corpus: data_0 and gpu_0/data_0 inputs, and an encoder."""
    for sub, proto in (("a", _conv("data_0")), ("b", _conv("gpu_0/data_0")), ("enc", _encoder())):
        (tmp_path / "zoo" / sub).mkdir(parents=True)
        onnx.save(proto, str(tmp_path / "zoo" / sub / "model.onnx"))
    return tmp_path / "zoo"


def test_an_input_shape_a_model_lacks_warns_naming_it_and_keeps_the_model(zoo, capsys):
    code = main(["analyze", str(zoo / "a"), str(zoo / "b"), "--input-shape", "data_0=2x3x8x8", "--json"])
    captured = capsys.readouterr()
    assert code == 0
    out = json.loads(captured.out)
    assert [m["name"] for m in out["models"]] == ["a/model", "b/model"] and out["errors"] == []
    warning = next(x for x in captured.err.splitlines() if "has no input 'data_0'" in x)
    assert str(zoo / "b" / "model.onnx") in warning and "gpu_0/data_0" in warning and "--input-shape" in warning


def test_dim_sets_a_named_free_dimension_across_the_corpus(zoo, capsys):
    plan = ShapePlan(dims={"sequence": 128, "batch": 2})
    assert plan(zoo / "enc" / "model.onnx") == {"x": (2, 128, 16)}
    assert plan(zoo / "a" / "model.onnx") is None  # no input of it has those names
    # A free leading dim not named is the batch size, 1, as the loader would make it.
    assert ShapePlan(dims={"sequence": 64})(zoo / "enc" / "model.onnx") == {"x": (1, 64, 16)}
    code = main(["analyze", str(zoo), "--dim", "sequence=128", "--dim", "heads=12", "--json"])
    captured = capsys.readouterr()
    assert code == 0 and json.loads(captured.out)["errors"] == []  # the encoder loads now
    assert "--dim heads=12: no model input has a dimension named 'heads'" in captured.err


def test_dim_reaches_the_bricks_and_the_end_to_end_run_alike(zoo, tmp_path):
    from dlbricks.bricks import model_digest
    from dlbricks.loading import load
    from dlbricks.store import Store

    store_path = tmp_path / "s.sqlite"
    path = zoo / "enc" / "model.onnx"
    assert main(["bench", str(path), "-G", "2", "--e2e", "--dim", "sequence=32", "--store", str(store_path),
                 "--json", *FAST]) == 0
    expected = load(path, {"x": (1, 32, 16)})
    with Store(store_path, readonly=True) as store:
        assert {d for d, _ in store.models()} == {model_digest(expected)}
        (brick,) = [d for d, _ in store.bricks()]
    from dlbricks.corpus import Corpus

    assert brick == bytes(Corpus([expected]).split(2).unique_digests[0]).hex()


def test_input_shapes_file_maps_model_paths_and_globs_in_json_and_toml(zoo, tmp_path, capsys):
    spec = {str(zoo / "b" / "model.onnx"): {"gpu_0/data_0": [4, 3, 8, 8]},
            "*/enc/*.onnx": {"x": "2x8x16", "token_type_ids": "2x8"},
            "nowhere/*.onnx": {"x": "1x1x16"}}
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps(spec))
    plan = ShapePlan(per_model=read_shapes_file(str(path)), file=str(path), on_warning=print)
    assert plan(zoo / "b" / "model.onnx") == {"gpu_0/data_0": (4, 3, 8, 8)}
    assert plan(zoo / "enc" / "model.onnx") == {"x": (2, 8, 16)}
    assert "has no input 'token_type_ids'" in capsys.readouterr().out
    plan.report_unused()
    assert "entry 'nowhere/*.onnx' matches no model" in capsys.readouterr().out
    toml = tmp_path / "shapes.toml"
    toml.write_text('["*/enc/*.onnx"]\nx = [3, 4, 16]\n')
    assert ShapePlan(per_model=read_shapes_file(str(toml)))(zoo / "enc" / "model.onnx") == {"x": (3, 4, 16)}
    assert main(["analyze", str(zoo), "--input-shapes", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["errors"] == []


@pytest.mark.parametrize("argv, flag", [
    (["--input-shape", "data_0=1x0x8x8"], "--input-shape"),
    (["--input-shape", "data_0=1x-3"], "--input-shape"),
    (["--dim", "sequence=0"], "--dim"),
    (["--dim", "sequence"], "--dim"),
])
def test_non_positive_or_malformed_dimensions_are_usage_errors_naming_the_flag(zoo, capsys, argv, flag):
    assert main(["analyze", str(zoo), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dlbricks analyze: error: {flag}") and len(err.strip().splitlines()) == 1


def test_a_bad_shapes_file_is_a_usage_error_naming_it(tmp_path, zoo, capsys):
    for text, why in (("{not json", "not JSON"), ('{"a.onnx": {"x": [1, 0]}}', "at least 1"),
                      ('{"a.onnx": "1x3"}', "must map input names")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(UsageError, match=why):
            read_shapes_file(str(bad))
        assert main(["analyze", str(zoo), "--input-shapes", str(bad)]) == 2
        assert f"--input-shapes {bad}" in capsys.readouterr().err


def test_the_jaccard_table_keeps_whole_names(tmp_path, capsys):
    # Names that agree on their first 10 characters, as a zoo's variants do.
    for sub in ("resnet50-v1-12-fp32", "resnet50-v1-12-int8"):
        (tmp_path / "zoo" / sub).mkdir(parents=True)
        onnx.save(_conv("data"), str(tmp_path / "zoo" / sub / "model.onnx"))
    assert main(["analyze", str(tmp_path / "zoo"), "-G", "1"]) == 0
    text = capsys.readouterr().out
    jaccard = text[text.index("Jaccard"):]
    for name in ("resnet50-v1-12-fp32/model", "resnet50-v1-12-int8/model"):
        assert name in jaccard
