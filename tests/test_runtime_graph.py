"""Runtime-graph decomposition: the graph is optimised with the timed sessions' options."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import dlbricks.loading.runtime_graph as rg
from dlbricks.errors import ModelError
from dlbricks.loading import load
from dlbricks.timing import RunnerConfig
from dlbricks.timing.fpenv import denormals_flushed


@pytest.fixture(scope="module")
def conv_bn_relu(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(np.ones(8, np.float32), "s"),
        numpy_helper.from_array(np.zeros(8, np.float32), "b"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "s", "b", "b", "s"], ["bn"], name="bn"),
        helper.make_node("Relu", ["bn"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes, "conv_bn_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = tmp_path_factory.mktemp("rt") / "conv_bn_relu.onnx"
    onnx.save(model, str(path))
    return str(path)


def _ops(proto: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in proto.graph.node]


def test_the_graph_is_optimised_with_the_runner_configs_session_options(conv_bn_relu, monkeypatch):
    seen: list[RunnerConfig] = []
    real = rg.session_options

    def spy(cfg: RunnerConfig):  # type: ignore[no-untyped-def]
        seen.append(cfg)
        return real(cfg)

    monkeypatch.setattr(rg, "session_options", spy)
    cfg = RunnerConfig(intra_op_threads=2, execution_mode="parallel", graph_optimization="basic")
    proto = rg.optimized_model(conv_bn_relu, config=cfg)
    assert seen[0] == cfg
    assert "BatchNormalization" not in _ops(proto)  # basic folds it into the Conv


def test_level_overrides_the_config_and_disable_keeps_the_source_graph(conv_bn_relu):
    cfg = RunnerConfig(graph_optimization="all")
    assert _ops(rg.optimized_model(conv_bn_relu, config=cfg, level="disable")) == ["Conv", "BatchNormalization", "Relu"]
    with pytest.raises(ModelError, match="unknown optimisation level 'max'"):
        rg.optimized_model(conv_bn_relu, level="max")


def test_every_intermediate_gets_a_type_and_the_fp_state_is_left_alone(conv_bn_relu):
    flushed = denormals_flushed()
    proto = rg.optimized_model(conv_bn_relu, config=RunnerConfig(graph_optimization="disable"))
    assert denormals_flushed() == flushed
    typed = {vi.name for vi in proto.graph.value_info} | {vi.name for vi in proto.graph.output}
    assert {o for n in proto.graph.node for o in n.output} <= typed


def test_runtime_models_keep_names_but_not_the_source_file(conv_bn_relu):
    (m,) = rg.runtime_models([load(conv_bn_relu)], config=RunnerConfig(graph_optimization="basic"))
    assert m.name == "conv_bn_relu" and m.path is None
    assert [layer.op_type for layer in m.layers] == ["Conv", "Relu"]  # basic folds the BatchNormalization
