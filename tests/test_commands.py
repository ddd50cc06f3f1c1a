"""The subcommands' shared behaviour: exit codes, model naming, options reaching every model."""

from __future__ import annotations

import pytest

from dlbricks.cli import main

FAST_CLI = ["--no-pin", "--warmup", "1", "--warmup-time", "0", "--min-iters", "5", "--min-time", "0.005", "--max-time", "0.05"]


def test_an_impossible_runner_setting_is_a_usage_error(tmp_path, capsys):
    code = main(["bench", str(tmp_path), "--no-pin", "--min-time", "2", "--max-time", "1", "--store", str(tmp_path / "s.sqlite")])
    err = capsys.readouterr().err
    assert code == 2 and "max_time" in err and len(err.splitlines()) == 1


def test_a_bug_building_the_runner_configuration_is_not_a_usage_error(tmp_path, monkeypatch):
    import dlbricks.timing

    def broken(**kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(dlbricks.timing, "RunnerConfig", broken)
    # Propagates: the console script exits 1 with the traceback, never 2.
    with pytest.raises(RuntimeError, match="a bug"):
        main(["bench", str(tmp_path), "--no-pin", "--store", str(tmp_path / "s.sqlite")])


def _batched_model(path):
    """x[N, 4] -> MatMul -> Relu: a symbolic batch dim for --input-shape to set."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["y"], name="relu")],
        "batched", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], [w],
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), str(path))


@pytest.mark.parametrize("command", [["evaluate", "--bootstrap", "20"], ["bench", "--e2e"]])
def test_input_shapes_reach_the_end_to_end_models_of_a_runtime_graph_run(tmp_path, command):
    from dlbricks.bricks import model_digest
    from dlbricks.loading import load
    from dlbricks.store import Store

    path = tmp_path / "batched.onnx"
    _batched_model(path)
    store_path = tmp_path / "s.sqlite"
    code = main([command[0], str(path), "-G", "1", "--runtime-graph", "--input-shape", "x=8x4", "--store", str(store_path),
                 "--json", *command[1:], *FAST_CLI])
    assert code == 0
    with Store(store_path, readonly=True) as store:
        timed = {d for d, _ in store.models()}
    assert timed == {model_digest(load(path, {"x": (8, 4)}))}  # batch 8, as the bricks; never batch 1
