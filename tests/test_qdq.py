"""Quantized (QDQ) models: a DQ -> op -> Q group is one layer, kept quantized, and its
brick fuses in onnxruntime as the model does (issue 22)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from dlbricks.bricks import check_brick, generate_brick
from dlbricks.loading import loader
from dlbricks.loading.qdq import QdqLayer
from dlbricks.model import TensorType


def _float_conv_model(path: Path) -> None:
    rng = np.random.default_rng(0)
    inits = [
        nh.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w"),
        nh.from_array(rng.standard_normal(8).astype(np.float32), "b"),
        nh.from_array(rng.standard_normal((8, 8, 3, 3)).astype(np.float32), "w2"),
    ]
    nodes = [
        h.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["c"], ["r"], name="relu"),
        h.make_node("Conv", ["r", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        h.make_node("MaxPool", ["c2"], ["y"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
    ]
    graph = h.make_graph(
        nodes,
        "convs",
        [h.make_tensor_value_info("x", T.FLOAT, [1, 3, 16, 16])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 8, 8, 8])],
        inits,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


@pytest.fixture(scope="module")
def qdq_path(tmp_path_factory) -> Path:
    """A two-conv model quantized by onnxruntime's own quantize_static (QDQ format)."""
    quantization = pytest.importorskip("onnxruntime.quantization")
    folder = tmp_path_factory.mktemp("qdq")
    _float_conv_model(folder / "float.onnx")
    rng = np.random.default_rng(1)

    class Reader(quantization.CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter([{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(4)])

        def get_next(self):
            return next(self.feeds, None)

    quantization.quantize_static(
        str(folder / "float.onnx"),
        str(folder / "qdq.onnx"),
        Reader(),
        quant_format=quantization.QuantFormat.QDQ,
        activation_type=quantization.QuantType.QUInt8,
        weight_type=quantization.QuantType.QInt8,
    )
    return folder / "qdq.onnx"


def _optimized_ops(proto: onnx.ModelProto, tmp_path: Path) -> list[str]:
    """The op types of onnxruntime's optimized model, after running it once."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    feeds = {}
    for vi in proto.graph.input:
        tt = vi.type.tensor_type
        shape = [d.dim_value for d in tt.shape.dim]
        feeds[vi.name] = np.ones(shape, onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
    assert all(out is not None for out in sess.run(None, feeds))
    return [node.op_type for node in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]


def test_qdq_convs_are_groups_that_keep_their_int8_weights(qdq_path):
    fallbacks = []
    model = loader.load(qdq_path, on_fallback=fallbacks.append)
    assert fallbacks and "QDQ" in fallbacks[0].reason  # the fast path leaves groups to the full loader
    convs = [layer for layer in model.layers if layer.op_type == "Conv"]
    assert len(convs) == 2 and all(isinstance(layer, QdqLayer) for layer in convs)
    first = convs[0]
    # Slots keep the op's: the quantized input, the INT8 weight, the INT32 bias; then scales and zero points.
    assert first.input_types[0] == TensorType(T.UINT8, (1, 3, 16, 16))
    assert first.input_types[1] == TensorType(T.INT8, (8, 3, 3, 3))
    assert first.input_types[2] == TensorType(T.INT32, (8,))
    assert first.output_types[0].elem_type == T.UINT8
    assert first.constants[1].role == "weight" and first.constants[1].value is None
    assert [m.op_type for m in first.members] == ["DequantizeLinear"] * 3 + ["Conv", "QuantizeLinear"]
    # No weight was folded to float: every constant a layer reads is integer, or a scale.
    for layer in model.layers:
        for c in layer.constants.values():
            assert c.type.elem_type != T.FLOAT or c.type.numel <= 1, (layer.name, c.name)
    # The groups absorb their DQs and Qs: only the model's first Q and last DQ remain.
    assert [layer.op_type for layer in model.layers] == [
        "QuantizeLinear",
        "Conv",
        "Conv",
        "MaxPool",
        "DequantizeLinear",
    ]


def test_a_qdq_conv_brick_runs_and_fuses_to_qlinearconv(qdq_path, tmp_path):
    model = loader.load(qdq_path)
    conv = next(layer for layer in model.layers if layer.op_type == "Conv")
    proto, info = generate_brick(model, [conv.index], digest=conv.digest)
    check_brick(proto)
    assert info.inputs == {"x_QuantizeLinear_Output": "uint8[1x3x16x16]"}
    assert "QLinearConv" in _optimized_ops(proto, tmp_path)


def test_the_whole_qdq_model_fuses_as_its_bricks_do(qdq_path, tmp_path):
    model = loader.load(qdq_path)
    whole = _optimized_ops(onnx.load(str(qdq_path)), tmp_path)
    bricks = []
    for layer in model.layers:
        proto, _ = generate_brick(model, [layer.index], digest=layer.digest)
        bricks += _optimized_ops(proto, tmp_path)
    kernels = {"QLinearConv", "QuantizeLinear", "DequantizeLinear"}
    assert sorted(op for op in bricks if op in kernels) == sorted(op for op in whole if op in kernels)


def _qdq(prefix: str, x: str, w_shape: tuple[int, ...], seed: int, inits: list) -> list[onnx.NodeProto]:
    """DQ(x) -> Conv(DQ(int8 w)) -> Q, by hand; scales and weights seeded."""
    rng = np.random.default_rng(seed)
    inits += [
        nh.from_array(rng.integers(-100, 100, size=w_shape).astype(np.int8), f"{prefix}_w"),
        nh.from_array(np.array(rng.uniform(0.01, 0.1), np.float32), f"{prefix}_ws"),
        nh.from_array(np.array(0, np.int8), f"{prefix}_wz"),
        nh.from_array(np.array(rng.uniform(0.01, 0.1), np.float32), f"{prefix}_ys"),
        nh.from_array(np.array(rng.integers(0, 255), np.uint8), f"{prefix}_yz"),
    ]
    return [
        h.make_node("DequantizeLinear", [x, "xs", "xz"], [f"{prefix}_xf"]),
        h.make_node("DequantizeLinear", [f"{prefix}_w", f"{prefix}_ws", f"{prefix}_wz"], [f"{prefix}_wf"]),
        h.make_node("Conv", [f"{prefix}_xf", f"{prefix}_wf"], [f"{prefix}_c"], pads=[1, 1, 1, 1]),
        h.make_node("QuantizeLinear", [f"{prefix}_c", f"{prefix}_ys", f"{prefix}_yz"], [f"{prefix}_q"]),
    ]


def test_group_digests_cover_shapes_and_dtypes_but_not_weight_or_scale_values():
    inits = [nh.from_array(np.array(0.05, np.float32), "xs"), nh.from_array(np.array(128, np.uint8), "xz")]
    nodes = _qdq("a", "x", (4, 4, 3, 3), 1, inits)
    nodes += _qdq("b", "a_q", (4, 4, 3, 3), 2, inits)  # other weights and scales
    nodes += _qdq("c", "b_q", (4, 4, 1, 1), 3, inits)  # another kernel
    x = h.make_tensor_value_info("x", T.UINT8, [1, 4, 8, 8])
    y = h.make_tensor_value_info("c_q", T.UINT8, [1, 4, 8, 8])
    proto = h.make_model(h.make_graph(nodes, "hand", [x], [y], inits), opset_imports=[h.make_opsetid("", 17)])
    model = loader.load(proto)
    a, b, c = model.layers
    assert a.digest == b.digest != c.digest
    # The whole model is one brick of three groups: a valid model with every member once.
    brick, _ = generate_brick(model, [0, 1, 2])
    check_brick(brick)
    assert [n.op_type for n in brick.graph.node].count("DequantizeLinear") == 6


def test_a_dq_shared_by_two_groups_is_in_each_and_once_in_a_brick():
    inits = [nh.from_array(np.array(0.05, np.float32), "xs"), nh.from_array(np.array(128, np.uint8), "xz")]
    nodes = [h.make_node("DequantizeLinear", ["x", "xs", "xz"], ["xf"])]
    for p in ("a", "b"):
        nodes += [
            h.make_node("Relu", ["xf"], [f"{p}_r"]),
            h.make_node("QuantizeLinear", [f"{p}_r", "xs", "xz"], [f"{p}_q"]),
        ]
    x = h.make_tensor_value_info("x", T.UINT8, [1, 4])
    outs = [h.make_tensor_value_info(f"{p}_q", T.UINT8, [1, 4]) for p in ("a", "b")]
    model = loader.load(h.make_model(h.make_graph(nodes, "shared", [x], outs, inits)))
    assert [layer.op_type for layer in model.layers] == ["Relu", "Relu"]
    assert all(layer.inputs[0] == "x" for layer in model.layers)
    brick, _ = generate_brick(model, [0, 1])
    check_brick(brick)
    assert [n.op_type for n in brick.graph.node] == [
        "DequantizeLinear",
        "Relu",
        "QuantizeLinear",
        "Relu",
        "QuantizeLinear",
    ]
