"""Runtime-graph decomposition: the graph is optimised with the timed sessions' options."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import dlbricks.loading.runtime_graph as rg
from dlbricks.bricks import generate_brick
from dlbricks.errors import ModelError
from dlbricks.loading import DlbricksWarning, load
from dlbricks.model import TensorType
from dlbricks.timing import RunnerConfig
from dlbricks.timing.fpenv import denormals_flushed
from dlbricks.timing.inputs import make_inputs
from dlbricks.timing.session import create_session


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


def test_deriving_skips_weight_prepacking_and_saves_the_same_graph(conv_bn_relu, monkeypatch):
    seen = []
    real = rg.create_session

    def spy(model, config=None, *, options=None):  # type: ignore[no-untyped-def]
        seen.append(options)
        return real(model, config, options=options)

    monkeypatch.setattr(rg, "create_session", spy)
    derived = rg.optimized_model(conv_bn_relu)
    assert len(seen) >= 2  # the optimising session and the run that reads the types
    assert all(so is not None and so.get_session_config_entry("session.disable_prepacking") == "1" for so in seen)
    monkeypatch.setattr(rg, "_deriving_options", rg.session_options)
    assert rg.optimized_model(conv_bn_relu).SerializeToString() == derived.SerializeToString()


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


def test_a_runtime_graph_is_derived_once_then_read_from_the_cache(conv_bn_relu, tmp_path, monkeypatch):
    monkeypatch.setenv("DLBRICKS_CACHE_DIR", str(tmp_path))
    basic = RunnerConfig(graph_optimization="basic")
    (first,) = rg.runtime_models([load(conv_bn_relu)], config=basic)
    cached = sorted((tmp_path / "runtime-graphs").iterdir())
    assert len(cached) == 1
    real = rg.optimized_model

    def derived_again(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the runtime graph was derived again")

    monkeypatch.setattr(rg, "optimized_model", derived_again)
    (again,) = rg.runtime_models([load(conv_bn_relu)], config=basic)
    assert [layer.op_type for layer in again.layers] == [layer.op_type for layer in first.layers] == ["Conv", "Relu"]
    assert again.digests.tobytes() == first.digests.tobytes()
    assert [layer.name for layer in again.layers] == [layer.name for layer in first.layers]
    assert (again.name, again.path) == ("conv_bn_relu", None)
    # Other session options optimise to another graph: derived, and cached, on its own.
    monkeypatch.setattr(rg, "optimized_model", real)
    (kept,) = rg.runtime_models([load(conv_bn_relu)], config=RunnerConfig(graph_optimization="disable"))
    assert [layer.op_type for layer in kept.layers] == ["Conv", "BatchNormalization", "Relu"]
    assert len(list((tmp_path / "runtime-graphs").iterdir())) == 2


def test_the_same_computation_under_other_names_is_cached_under_its_own_names(conv_bn_relu, tmp_path, monkeypatch):
    monkeypatch.setenv("DLBRICKS_CACHE_DIR", str(tmp_path / "cache"))
    renamed = onnx.load(conv_bn_relu)
    for node in renamed.graph.node:
        node.name = "other_" + node.name
    onnx.save(renamed, str(tmp_path / "conv_bn_relu.onnx"))
    # basic: the fused Conv and the Relu keep their source names (the layout pass renames)
    a, b = rg.runtime_models([load(conv_bn_relu), load(str(tmp_path / "conv_bn_relu.onnx"))],
                             config=RunnerConfig(graph_optimization="basic"))
    assert a.digests.tobytes() == b.digests.tobytes()
    assert [layer.name for layer in a.layers] == ["conv", "relu"]
    assert [layer.name for layer in b.layers] == ["other_conv", "other_relu"]
    assert len(list((tmp_path / "cache" / "runtime-graphs").iterdir())) == 2


def test_a_damaged_or_unwritable_cache_only_costs_the_derivation(conv_bn_relu, tmp_path, monkeypatch):
    monkeypatch.setenv("DLBRICKS_CACHE_DIR", str(tmp_path / "cache"))
    (first,) = rg.runtime_models([load(conv_bn_relu)])
    (entry,) = (tmp_path / "cache" / "runtime-graphs").iterdir()
    entry.write_bytes(entry.read_bytes()[:40])  # cut short, as by a full disk
    (again,) = rg.runtime_models([load(conv_bn_relu)])
    assert again.digests.tobytes() == first.digests.tobytes()
    assert len(onnx.load(str(entry)).graph.node) == len(first.layers)  # written whole again
    blocker = tmp_path / "a_file"
    blocker.write_text("keep")
    monkeypatch.setenv("DLBRICKS_CACHE_DIR", str(blocker))  # a file where the folder should be
    (third,) = rg.runtime_models([load(conv_bn_relu)])
    assert third.digests.tobytes() == first.digests.tobytes() and blocker.read_text() == "keep"


# -- every op onnxruntime's optimiser writes is typed as onnxruntime runs it ------------------

F, U8, I8, I32 = TensorProto.FLOAT, TensorProto.UINT8, TensorProto.INT8, TensorProto.INT32
D = 16


def _vi(name: str, elem: int = F, shape: list | None = None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _c(name: str, value) -> onnx.TensorProto:  # type: ignore[no-untyped-def]
    return numpy_helper.from_array(np.asarray(value), name)


def _model(nodes, inputs, outputs, inits=(), *, opset: int = 17, value_info=()) -> onnx.ModelProto:  # type: ignore[no-untyped-def]
    graph = helper.make_graph(nodes, "m", inputs, outputs, list(inits), value_info=list(value_info))
    opsets = [helper.make_opsetid("", opset)]
    if any(n.domain for n in nodes):
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def _floats(*shape: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 0.1).astype(np.float32)


def _ints(dtype: type, *shape: int) -> np.ndarray:
    return np.random.default_rng(1).integers(-20, 20, shape).astype(dtype)


N = helper.make_node
X = [_vi("x", F, [2, 4, D])]


def _rmsnorm(opset: int = 13) -> onnx.ModelProto:
    """T5's RMSNorm, which onnxruntime fuses into SimplifiedLayerNormalization."""
    nodes = [N("Pow", ["x", "two"], ["p"]), N("ReduceMean", ["p"], ["v"], axes=[-1]), N("Add", ["v", "eps"], ["ve"]),
             N("Sqrt", ["ve"], ["s"]), N("Div", ["x", "s"], ["n"]), N("Mul", ["g", "n"], ["y"])]
    return _model(nodes, X, [_vi("y")], [_c("two", np.float32(2)), _c("eps", np.float32(1e-6)), _c("g", _floats(D))],
                  opset=opset)


def _layernorm(opset: int) -> onnx.ModelProto:
    """LayerNorm spelt out, which onnxruntime fuses into LayerNormalization (below opset
    17 its own, of the ONNX domain); with an Add before it, SkipLayerNormalization."""
    nodes = [N("ReduceMean", ["x"], ["m"], axes=[-1]), N("Sub", ["x", "m"], ["d"]), N("Pow", ["d", "two"], ["p"]),
             N("ReduceMean", ["p"], ["v"], axes=[-1]), N("Add", ["v", "eps"], ["ve"]), N("Sqrt", ["ve"], ["s"]),
             N("Div", ["d", "s"], ["n"]), N("Mul", ["n", "g"], ["ng"]), N("Add", ["ng", "b"], ["y"])]
    inits = [_c("two", np.float32(2)), _c("eps", np.float32(1e-5)), _c("g", _floats(D)), _c("b", _floats(D, seed=1))]
    return _model(nodes, X, [_vi("y")], inits, opset=opset)


def _declared(nodes, inputs, outputs, inits=(), *, opset: int = 17) -> onnx.ModelProto:  # type: ignore[no-untyped-def]
    """A model of ops written directly, every output a graph output with its type (as
    exporters declare them), so that the source graph loads."""
    return _model(nodes, inputs, outputs, inits, opset=opset)


def _qdq() -> onnx.ModelProto:
    """A QDQ network (as quantize_static writes them), which onnxruntime turns into
    QLinearConv, NhwcMaxPool, QLinearAdd, QLinearGlobalAveragePool and QGemm."""
    def dq(i: str, o: str, s: str = "s", z: str = "zu") -> onnx.NodeProto:
        return N("DequantizeLinear", [i, s, z], [o])

    def q(i: str, o: str) -> onnx.NodeProto:
        return N("QuantizeLinear", [i, "s", "zu"], [o])

    nodes = [dq("xq", "x"), dq("wq", "w", "sw", "zi"), dq("bq", "b", "sb", "zb"),
             N("Conv", ["x", "w", "b"], ["cv"], pads=[1, 1, 1, 1]), q("cv", "cvq"),
             dq("cvq", "c2"), N("MaxPool", ["c2"], ["p"], kernel_shape=[2, 2], strides=[2, 2]), q("p", "pq"),
             dq("pq", "p2"), dq("pq", "p3"), N("Add", ["p2", "p3"], ["ad"]), q("ad", "adq"),
             dq("adq", "ad2"), N("GlobalAveragePool", ["ad2"], ["gp"]), q("gp", "gpq"),
             dq("gpq", "gp2"), N("Flatten", ["gp2"], ["fl"]), q("fl", "flq"), dq("flq", "fl2"),
             dq("gwq", "gw", "sw", "zi"), dq("gbq", "gb", "sb", "zb"), N("Gemm", ["fl2", "gw", "gb"], ["gm"], transB=1),
             q("gm", "gmq"), dq("gmq", "y")]
    inits = [_c("s", np.float32(0.05)), _c("zu", np.uint8(128)), _c("sw", np.float32(0.01)), _c("zi", np.int8(0)),
             _c("sb", np.float32(0.0005)), _c("zb", np.int32(0)), _c("wq", _ints(np.int8, 16, 8, 3, 3)),
             _c("bq", _ints(np.int32, 16)), _c("gwq", _ints(np.int8, 10, 16)), _c("gbq", _ints(np.int32, 10))]
    return _model(nodes, [_vi("xq", U8, [1, 8, 8, 8])], [_vi("y")], inits)


def _dynamic_quant(matmuls: int) -> onnx.ModelProto:
    """quantize_dynamic's MatMuls: one DynamicQuantizeLinear feeding MatMulIntegers, which
    onnxruntime fuses into DynamicQuantizeMatMul (one reader) or MatMulIntegerToFloat."""
    nodes = [N("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"])]
    inits, outputs = [], []
    for k in range(matmuls):
        p = f"m{k}"
        nodes += [N("Mul", ["xs", p + "ws"], [p + "sc"]), N("MatMulInteger", ["xq", p + "w", "xz", p + "wz"], [p + "i"]),
                  N("Cast", [p + "i"], [p + "f"], to=F), N("Mul", [p + "f", p + "sc"], [p + "o"]),
                  N("Add", [p + "b", p + "o"], [p + "y"])]
        inits += [_c(p + "w", _ints(np.int8, D, D)), _c(p + "wz", np.int8(0)), _c(p + "ws", np.float32(0.01 * (k + 1))),
                  _c(p + "b", _floats(D, seed=k))]
        outputs.append(_vi(p + "y"))
    return _model(nodes, X, outputs, inits)


def _skip_layer_norm_all_outputs() -> onnx.ModelProto:
    nodes = [N("SkipLayerNormalization", ["x", "r", "g", "b"], ["y", "mean", "inv", "sum"], domain="com.microsoft")]
    outputs = [_vi("y", F, [2, 4, D]), _vi("mean", F, [2, 4, 1]), _vi("inv", F, [2, 4, 1]), _vi("sum", F, [2, 4, D])]
    return _declared(nodes, X + [_vi("r", F, [2, 4, D])], outputs, [_c("g", _floats(D)), _c("b", _floats(D))])


def _simplified_layer_norm_with_inv_std_var() -> onnx.ModelProto:
    nodes = [N("SimplifiedLayerNormalization", ["x", "g"], ["y", "inv"], axis=-1, epsilon=1e-6)]
    return _declared(nodes, X, [_vi("y", F, [2, 4, D]), _vi("inv", F, [2, 4, 1])], [_c("g", _floats(D))])


def _layer_norm_13_with_mean_and_inv_std_var() -> onnx.ModelProto:
    nodes = [N("LayerNormalization", ["x", "g", "b"], ["y", "mean", "inv"], axis=-1)]
    outputs = [_vi("y", F, [2, 4, D]), _vi("mean", F, [2, 4, 1]), _vi("inv", F, [2, 4, 1])]
    return _declared(nodes, X, outputs, [_c("g", _floats(D)), _c("b", _floats(D))], opset=13)


# (source model, the layer kinds onnxruntime makes of it). The first four are ops
# onnxruntime defines in the ONNX domain; the rest, com.microsoft's, cover every contrib
# op its CPU optimiser writes into the light and modern corpora.
RUNTIME_OPS = {
    "rmsnorm": (_rmsnorm, ["SimplifiedLayerNormalization"]),
    "simplified_layer_norm_inv_std_var": (_simplified_layer_norm_with_inv_std_var, ["SimplifiedLayerNormalization"]),
    "layernorm_opset13": (lambda: _layernorm(13), ["LayerNormalization"]),
    "layer_norm_opset13_mean_inv_std_var": (_layer_norm_13_with_mean_and_inv_std_var, ["LayerNormalization"]),
    "gelu": (lambda: _model([N("Div", ["x", "sq2"], ["d"]), N("Erf", ["d"], ["e"]), N("Add", ["e", "one"], ["a"]),
                             N("Mul", ["x", "a"], ["m"]), N("Mul", ["m", "half"], ["y"])], X, [_vi("y")],
                            [_c("sq2", np.float32(1.4142135)), _c("one", np.float32(1)), _c("half", np.float32(0.5))]),
             ["com.microsoft::Gelu"]),
    "fast_gelu": (lambda: _declared([N("FastGelu", ["x", "b"], ["y"], domain="com.microsoft")], X,
                                    [_vi("y", F, [2, 4, D])], [_c("b", _floats(D))]), ["com.microsoft::FastGelu"]),
    "quick_gelu": (lambda: _model([N("Sigmoid", ["x"], ["s"]), N("Mul", ["x", "s"], ["y"])], X, [_vi("y")]),
                   ["com.microsoft::QuickGelu"]),
    "fused_matmul": (lambda: _model([N("Transpose", ["x"], ["t"], perm=[0, 2, 1]), N("MatMul", ["t", "w"], ["m"]),
                                     N("Mul", ["m", "k"], ["y"])], [_vi("x", F, [2, D, 4])], [_vi("y")],
                                    [_c("w", _floats(D, 8)), _c("k", np.float32(0.125))]),
                     ["com.microsoft::FusedMatMul"]),
    "fused_gemm": (lambda: _model([N("Gemm", ["x", "w", "b"], ["g"], transB=1), N("Relu", ["g"], ["y"])],
                                  [_vi("x", F, [2, D])], [_vi("y")], [_c("w", _floats(8, D)), _c("b", _floats(8))]),
                   ["com.microsoft::FusedGemm"]),
    "fused_conv": (lambda: _model([N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1]), N("Relu", ["c"], ["y"])],
                                  [_vi("x", F, [1, 4, 16])], [_vi("y")], [_c("w", _floats(8, 4, 3)), _c("b", _floats(8))]),
                   ["com.microsoft::FusedConv"]),
    "skip_layer_norm": (lambda: _layernorm_after_add(), ["com.microsoft::SkipLayerNormalization"]),
    "skip_layer_norm_all_outputs": (_skip_layer_norm_all_outputs, ["com.microsoft::SkipLayerNormalization"]),
    "nchwc": (lambda: _model([N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), N("Relu", ["c"], ["r"]),
                              N("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
                              N("AveragePool", ["p"], ["a"], kernel_shape=[2, 2], strides=[2, 2]),
                              N("GlobalAveragePool", ["a"], ["y"])], [_vi("x", F, [1, 16, 16, 16])], [_vi("y")],
                             [_c("w", _floats(16, 16, 3, 3)), _c("b", _floats(16))]),
              ["com.microsoft.nchwc::ReorderInput", "com.microsoft.nchwc::Conv", "com.microsoft.nchwc::MaxPool",
               "com.microsoft.nchwc::AveragePool", "com.microsoft.nchwc::GlobalAveragePool",
               "com.microsoft.nchwc::ReorderOutput"]),
    "qdq": (_qdq, ["com.microsoft::QLinearConv", "com.microsoft::NhwcMaxPool", "com.microsoft::QLinearAdd",
                   "com.microsoft::QLinearGlobalAveragePool", "com.microsoft::QGemm"]),
    "dynamic_quantize_matmul": (lambda: _dynamic_quant(1), ["com.microsoft::DynamicQuantizeMatMul"]),
    "matmul_integer_to_float": (lambda: _dynamic_quant(2), ["com.microsoft::MatMulIntegerToFloat"]),
}


def _layernorm_after_add() -> onnx.ModelProto:
    proto = _layernorm(17)
    proto.graph.input.append(_vi("r", F, [2, 4, D]))
    for node in proto.graph.node:
        node.input[:] = ["xr" if t == "x" else t for t in node.input]
    proto.graph.node.insert(0, N("Add", ["x", "r"], ["xr"]))
    return proto


def _ran(session, feeds: dict) -> dict[str, TensorType]:  # type: ignore[no-untyped-def]
    values = session.run(None, feeds)
    return {o.name: TensorType(helper.np_dtype_to_tensor_dtype(v.dtype), tuple(v.shape))
            for o, v in zip(session.get_outputs(), values)}


@pytest.mark.parametrize("case", sorted(RUNTIME_OPS))
def test_each_op_onnxruntime_writes_is_typed_as_onnxruntime_runs_it(case, tmp_path):
    build, kinds = RUNTIME_OPS[case]
    path = tmp_path / f"{case}.onnx"
    onnx.save(build(), str(path))
    (model,) = rg.runtime_models([load(path)])
    assert set(kinds) <= {layer.kind for layer in model.layers}
    # The model's outputs are typed as a run of the source model makes them...
    source = create_session(str(path))
    outputs = _ran(source, make_inputs(source))
    assert dict(model.outputs) == outputs
    # ...and every output of each layer of those kinds as a run of its brick makes it.
    for layer in model.layers:
        if layer.kind not in kinds:
            continue
        assert None not in layer.output_types
        brick, info = generate_brick(model, [layer.index])
        session = create_session(brick)
        got = _ran(session, make_inputs(brick, int_bounds=info.int_bounds))
        assert got == dict(zip(layer.outputs, layer.output_types)), layer.name


def test_types_the_source_declares_give_way_to_those_onnxruntime_produces(tmp_path):
    # An exporter traced at batch 1 declared the contrib op's output [1, 16]; onnxruntime
    # keeps that declaration in the graph it saves, but at batch 3 it produces [3, 16].
    nodes = [N("Gelu", ["x"], ["g"], domain="com.microsoft"), N("Relu", ["g"], ["y"])]
    proto = _model(nodes, [_vi("x", F, ["b", 16])], [_vi("y", F, ["b", 16])], value_info=[_vi("g", F, [1, 16])])
    path = tmp_path / "stale.onnx"
    onnx.save(proto, str(path))
    shapes = {"x": (3, 16)}
    (model,) = rg.runtime_models([load(path, shapes)], input_shapes=shapes)
    assert [(layer.kind, layer.output_types) for layer in model.layers] == [
        ("com.microsoft::Gelu", (TensorType(F, (3, 16)),)), ("Relu", (TensorType(F, (3, 16)),))]


def test_values_shape_inference_cannot_type_are_read_off_a_second_run(tmp_path, monkeypatch):
    # NonZero's output size depends on the values: ONNX inference leaves it and the
    # Cast after it without a static shape, so a second run exposes them. (The loader
    # needs static shapes, so this is the optimiser's step alone.)
    nodes = [N("Gelu", ["x"], ["g"], domain="com.microsoft"), N("NonZero", ["g"], ["nz"]),
             N("Cast", ["nz"], ["c"], to=F), N("ReduceSum", ["c"], ["y"], keepdims=0)]
    path = tmp_path / "nonzero.onnx"
    onnx.save(_model(nodes, [_vi("x", F, [2, 8])], [_vi("y", F, [])]), str(path))
    runs: list[list[str]] = []
    real = rg._run_exposing

    def counted(proto, names, *args):  # type: ignore[no-untyped-def]
        runs.append(list(names))
        return real(proto, names, *args)

    monkeypatch.setattr(rg, "_run_exposing", counted)
    proto = rg.optimized_model(str(path))
    assert runs == [["g"], ["nz", "c"]]
    types = {vi.name: (vi.type.tensor_type.elem_type, [d.dim_value for d in vi.type.tensor_type.shape.dim])
             for vi in list(proto.graph.value_info) + list(proto.graph.output)}
    # The runs feed zeros: Gelu(0) = 0, so NonZero finds none.
    assert types == {"g": (F, [2, 8]), "nz": (TensorProto.INT64, [2, 0]), "c": (F, [2, 0]), "y": (F, [])}


# -- runtime_models_or_sources: the runtime graph where there is one ---------------------------


@pytest.fixture(scope="module")
def no_cpu_kernel(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A model dlbricks loads (its custom op's output is declared) and onnxruntime cannot."""
    nodes = [N("Frobnicate", ["x"], ["f"], domain="com.example"), N("Relu", ["f"], ["y"])]
    graph = helper.make_graph(nodes, "frob", [_vi("x", F, [1, 4])], [_vi("y", F, [1, 4])], value_info=[_vi("f", F, [1, 4])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    path = tmp_path_factory.mktemp("rt") / "frob.onnx"
    onnx.save(proto, str(path))
    return str(path)


def test_a_model_whose_runtime_graph_fails_keeps_its_source_graph_with_a_warning_naming_it(conv_bn_relu, no_cpu_kernel):
    sources = [load(no_cpu_kernel), load(conv_bn_relu)]
    said: list[str] = []
    models, graphs = rg.runtime_models_or_sources(sources, config=RunnerConfig(graph_optimization="basic"),
                                                  on_warning=said.append)
    assert graphs == ["source", "runtime"]
    assert models[0] is sources[0]
    assert models[1].name == "conv_bn_relu" and models[1].path is None
    assert [layer.op_type for layer in models[1].layers] == ["Conv", "Relu"]
    (line,) = said
    assert line.startswith("frob: decomposed as its source graph") and "onnxruntime cannot optimise" in line
    assert "\n" not in line
    with pytest.warns(DlbricksWarning, match="^frob: decomposed as its source graph"):
        assert rg.runtime_models_or_sources(sources[:1])[1] == ["source"]


def test_a_model_whose_runtime_graph_cannot_be_decomposed_keeps_its_source_graph(conv_bn_relu, monkeypatch):
    def fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise ModelError("<model>: cannot infer the type of tensor 't'")

    monkeypatch.setattr("dlbricks.loading.load", fail)
    source = load(conv_bn_relu)
    said: list[str] = []
    models, graphs = rg.runtime_models_or_sources([source], on_warning=said.append)
    assert (models, graphs) == ([source], ["source"])
    assert said == ["conv_bn_relu: decomposed as its source graph: its runtime graph cannot be used "
                    "(<model>: cannot infer the type of tensor 't')"]


def test_an_in_memory_model_is_optimised_like_its_file(conv_bn_relu):
    # With or without its weights at hand: the graph is optimised with synthesised ones.
    from_file = rg.runtime_models([load(conv_bn_relu)], config=RunnerConfig(graph_optimization="basic"))[0]
    in_memory = load(onnx.load(conv_bn_relu), name="conv_bn_relu")
    without_weights = replace(in_memory, _materialize=None)
    for source in (in_memory, without_weights):
        assert source.path is None
        (model,), graphs = rg.runtime_models_or_sources([source], config=RunnerConfig(graph_optimization="basic"))
        assert graphs == ["runtime"] and model.name == "conv_bn_relu"
        assert [layer.op_type for layer in model.layers] == ["Conv", "Relu"]
        assert [layer.digest for layer in model.layers] == [layer.digest for layer in from_file.layers]


def test_the_runtime_graph_is_the_graph_timed_end_to_end_not_the_files_own():
    # onnxruntime's optimiser depends on how the file states its weights: Inception v2's
    # file computes them with ConstantOfShape nodes, folded only after the fusions ran,
    # and optimises to 129 kernels; the model timed end to end (whole_model: the same
    # layers with synthesised weights) runs 96. Bricks must come from the latter.
    from conftest import light

    from dlbricks.bricks import whole_model

    source = load(light("inception_v2"))
    (model,) = rg.runtime_models([source])
    timed = load(rg.optimized_model(whole_model(source)[0]))
    assert [layer.digest for layer in model.layers] == [layer.digest for layer in timed.layers]
    from_file = rg.optimized_model(str(light("inception_v2")))
    assert len(from_file.graph.node) > len(model.layers)


def test_each_model_is_optimised_at_its_own_input_shapes(tmp_path, conv_bn_relu):
    proto = onnx.load(conv_bn_relu)
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    path = tmp_path / "batched.onnx"
    onnx.save(proto, str(path))
    shapes = {"x": (4, 3, 16, 16)}
    sources = [load(path, shapes), load(conv_bn_relu)]
    models, graphs = rg.runtime_models_or_sources(
        sources, input_shapes_for=lambda m: shapes if m.name == "batched" else None)
    assert graphs == ["runtime", "runtime"]
    assert [m.inputs[0][1].shape for m in models] == [(4, 3, 16, 16), (1, 3, 16, 16)]
    assert models[0].outputs[0][1].shape == (4, 8, 16, 16)


def test_the_runtime_graph_holds_shapes_not_weights():
    # Bricks synthesise their weights: a corpus of runtime graphs must not hold a second
    # copy of every model's weights in memory; small operands keep their values.
    from conftest import light

    proto = rg.optimized_model(str(light("squeezenet")))
    big = [t for t in proto.graph.initializer if int(np.prod(t.dims)) * 4 > rg._INLINE_BYTES]
    small = [t for t in proto.graph.initializer if 0 < int(np.prod(t.dims)) * 4 <= 1024]
    assert big and all(not t.raw_data and not t.float_data and not t.external_data for t in big)
    assert proto.ByteSize() < 1 << 20
    assert all(onnx.numpy_helper.to_array(t).size == int(np.prod(t.dims)) for t in small)
