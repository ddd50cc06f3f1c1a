"""Analytic cost model: every formula against a hand calculation, and model totals
against published GMAC figures."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, shape_inference

from dlbricks.roofline.costmodel import (
    LayerCost,
    ModelCost,
    conv_output_spatial,
    conv_transpose_output_spatial,
    efficiency,
    layer_cost,
    layer_from_node,
    model_cost,
    roofline_bound,
    roofline_terms,
    supported_ops,
)
from dlbricks.model import ConstInput, Layer, TensorType
from dlbricks.roofline.peaks import Peaks

F = TensorProto.FLOAT
I64 = TensorProto.INT64


def T(*shape: int, elem: int = F) -> TensorType:
    return TensorType(elem, tuple(shape))


def mk(
    op: str,
    ins: Sequence[TensorType | None],
    outs: Sequence[TensorType | None],
    consts: Sequence[int] = (),
    *,
    names: Sequence[str] | None = None,
    domain: str = "",
    **attrs: object,
) -> Layer:
    """A layer for ``op`` with inputs i0, i1... ("" where the type is None)."""
    if names is None:
        names = [f"i{k}" if t is not None else "" for k, t in enumerate(ins)]
    node = helper.make_node(op, list(names), [f"o{k}" for k in range(len(outs))], domain=domain,
                            **attrs)
    return layer_from_node(node, ins, outs, consts)


def cost(op: str, ins, outs, consts=(), **attrs) -> LayerCost:
    c = layer_cost(mk(op, ins, outs, consts, **attrs))
    assert c.has_formula
    return c


def nbytes(*types: TensorType) -> int:
    return sum(t.nbytes for t in types)


# --------------------------------------------------------------------------- Conv


def test_conv_macs_are_n_cout_out_spatial_cin_kernel_and_bias_adds_one_per_output():
    x, w, b, y = T(1, 3, 224, 224), T(64, 3, 7, 7), T(64), T(1, 64, 112, 112)
    c = cost("Conv", [x, w, b], [y], [1, 2], strides=[2, 2], pads=[3, 3, 3, 3])
    macs = 1 * 64 * 112 * 112 * 3 * 7 * 7
    assert c.macs == macs == 118_013_952
    assert c.flops == 2 * macs + 64 * 112 * 112
    assert c.weight_bytes == nbytes(w, b)
    assert c.input_bytes == x.nbytes and c.output_bytes == y.nbytes
    assert c.bytes_min == nbytes(x, w, b, y)


def test_conv_groups_divide_input_channels_and_no_bias_adds_nothing():
    # group=4, dilation 2, pad 2, 3x3: 10x10 -> 10x10; weight is [Cout, Cin/g, kh, kw].
    x, w, y = T(2, 8, 10, 10), T(16, 2, 3, 3), T(2, 16, 10, 10)
    c = cost("Conv", [x, w], [y], [1], group=4, dilations=[2, 2], pads=[2, 2, 2, 2])
    assert c.macs == 2 * 16 * 10 * 10 * 2 * 3 * 3 == 57_600
    assert c.flops == 2 * c.macs


def test_depthwise_conv_has_one_input_channel_per_output():
    x, w, y = T(1, 32, 8, 8), T(32, 1, 3, 3), T(1, 32, 4, 4)
    c = cost("Conv", [x, w], [y], [1], group=32, strides=[2, 2], pads=[1, 1, 1, 1])
    assert c.macs == 32 * 4 * 4 * 9


def test_conv_without_output_type_derives_the_output_size_from_attributes():
    x, w, b = T(1, 3, 17, 17), T(8, 3, 3, 3), T(8)
    attrs = dict(strides=[2, 2], auto_pad="SAME_UPPER")
    with_type = cost("Conv", [x, w, b], [T(1, 8, 9, 9)], [1, 2], **attrs)
    without = cost("Conv", [x, w, b], [None], [1, 2], **attrs)
    assert without.macs == with_type.macs == 8 * 81 * 3 * 9
    assert without.flops == with_type.flops


def test_conv1d_and_conv3d_use_every_spatial_dim():
    c1 = cost("Conv", [T(1, 4, 20), T(6, 4, 5)], [T(1, 6, 16)], [1])
    assert c1.macs == 6 * 16 * 4 * 5
    c3 = cost("Conv", [T(1, 2, 4, 4, 4), T(3, 2, 3, 3, 3)], [T(1, 3, 2, 2, 2)], [1])
    assert c3.macs == 3 * 8 * 2 * 27


def test_conv_transpose_macs_scatter_each_input_through_its_group_kernel():
    # stride 2, 3x3: 5 -> 2*4 + 3 = 11; weight [Cin, Cout/g, k, k].
    x, w, b, y = T(1, 4, 5, 5), T(4, 2, 3, 3), T(2), T(1, 2, 11, 11)
    c = cost("ConvTranspose", [x, w, b], [y], [1, 2], strides=[2, 2])
    assert c.macs == 1 * 4 * 25 * 2 * 9 == 1800
    assert c.flops == 2 * 1800 + 2 * 121
    g = cost("ConvTranspose", [x, T(4, 1, 3, 3), b], [y], [1, 2], strides=[2, 2], group=2)
    assert g.macs == 4 * 25 * 1 * 9
    assert g.flops == 2 * g.macs + 2 * 121  # Cout = 1 * group 2
    nob = cost("ConvTranspose", [x, w, b], [None], [1, 2], strides=[2, 2])
    assert nob.flops == c.flops


def _inferred_spatial(op: str, x: Sequence[int], w: Sequence[int], **attrs: object) -> tuple[int, ...]:
    inputs = [helper.make_tensor_value_info("x", F, list(x))]
    names = ["x"]
    if op != "MaxPool":
        inputs.append(helper.make_tensor_value_info("w", F, list(w)))
        names.append("w")
    g = helper.make_graph([helper.make_node(op, names, ["y"], **attrs)], "g", inputs,
                          [helper.make_tensor_value_info("y", F, None)])
    m = shape_inference.infer_shapes(
        helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), strict_mode=True)
    return tuple(d.dim_value for d in m.graph.output[0].type.tensor_type.shape.dim[2:])


_AUTO_PADS = st.sampled_from(["NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"])


@settings(deadline=None, max_examples=60)
@given(
    size=st.integers(7, 20), k=st.integers(1, 4), s=st.integers(1, 3), d=st.integers(1, 2),
    pb=st.integers(0, 2), pe=st.integers(0, 2), auto_pad=_AUTO_PADS,
)
def test_conv_output_spatial_matches_onnx_shape_inference(size, k, s, d, pb, pe, auto_pad):
    attrs: dict[str, object] = dict(strides=[s], dilations=[d])
    if auto_pad == "NOTSET":
        attrs["pads"] = [pb, pe]
    else:
        attrs["auto_pad"] = auto_pad
    expected = _inferred_spatial("Conv", [1, 2, size], [3, 2, k], **attrs)
    got = conv_output_spatial([size], [k], strides=[s], dilations=[d],
                              pads=attrs.get("pads"), auto_pad=auto_pad)  # type: ignore[arg-type]
    assert got == expected


@settings(deadline=None, max_examples=40)
@given(size=st.integers(5, 20), k=st.integers(1, 4), s=st.integers(1, 3),
       pb=st.integers(0, 1), pe=st.integers(0, 1), ceil=st.booleans())
def test_pool_output_spatial_with_ceil_mode_matches_onnx_shape_inference(size, k, s, pb, pe, ceil):
    expected = _inferred_spatial("MaxPool", [1, 2, size], [], kernel_shape=[k], strides=[s],
                                 pads=[pb, pe], ceil_mode=int(ceil))
    assert conv_output_spatial([size], [k], strides=[s], pads=[pb, pe], ceil_mode=ceil) == expected


@settings(deadline=None, max_examples=40)
@given(size=st.integers(2, 9), k=st.integers(1, 4), s=st.integers(1, 3), d=st.integers(1, 2),
       p=st.integers(0, 1), op_=st.integers(0, 1))
def test_conv_transpose_output_spatial_matches_onnx_shape_inference(size, k, s, d, p, op_):
    op_ = min(op_, s - 1)  # output_padding must be below the stride
    expected = _inferred_spatial("ConvTranspose", [1, 2, size], [2, 3, k], strides=[s],
                                 dilations=[d], pads=[p, p], output_padding=[op_])
    got = conv_transpose_output_spatial([size], [k], strides=[s], dilations=[d], pads=[p, p],
                                        output_padding=[op_])
    assert got == expected


def test_conv_output_spatial_rejects_unknown_auto_pad():
    with pytest.raises(ValueError, match="auto_pad"):
        conv_output_spatial([8], [3], auto_pad="SAME")


# --------------------------------------------------------------------------- Gemm, MatMul


def test_gemm_transposes_and_bias_terms():
    a, b, cc, y = T(3, 4), T(5, 4), T(5), T(3, 5)
    c = cost("Gemm", [a, b, cc], [y], [1, 2], transB=1)
    assert c.macs == 3 * 5 * 4
    assert c.flops == 2 * 60 + 15  # + C
    t = cost("Gemm", [T(4, 3), T(4, 5), cc], [y], [1, 2], transA=1, alpha=0.5, beta=2.0)
    assert t.macs == 60
    assert t.flops == 2 * 60 + 15 + 15 + 15  # alpha scaling, C add, beta scaling
    nob = cost("Gemm", [a, T(4, 5)], [y], [1])
    assert nob.flops == 120


def test_matmul_counts_broadcast_batches():
    c = cost("MatMul", [T(2, 1, 3, 4), T(5, 4, 6)], [T(2, 5, 3, 6)])
    assert c.macs == 2 * 5 * 3 * 6 * 4 == 720
    assert c.flops == 1440
    no_out = cost("MatMul", [T(2, 1, 3, 4), T(5, 4, 6)], [None])
    assert no_out.macs == 720


def test_matmul_with_vector_operands():
    assert cost("MatMul", [T(4), T(4, 6)], [T(6)]).macs == 24
    assert cost("MatMul", [T(7, 4), T(4)], [T(7)]).macs == 28
    assert cost("MatMul", [T(4), T(4)], [T()]).macs == 4
    assert cost("MatMul", [T(4), T(3, 4, 6)], [None]).macs == 3 * 6 * 4


def test_quantized_contractions_use_the_float_formulas():
    # QLinearMatMul: a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp.
    u8 = TensorProto.UINT8
    s, z = T(), T(elem=u8)
    q = cost("QLinearMatMul", [T(3, 4, elem=u8), s, z, T(4, 5, elem=u8), s, z, s, z],
             [T(3, 5, elem=u8)], [1, 2, 3, 4, 5, 6, 7])
    assert q.macs == 60
    ci = cost("ConvInteger", [T(1, 2, 5, 5, elem=u8), T(4, 2, 3, 3, elem=u8)],
              [T(1, 4, 3, 3, elem=TensorProto.INT32)], [1])
    assert ci.macs == 4 * 9 * 2 * 9


# --------------------------------------------------------------------------- pools, norms


def test_pools_count_kernel_ops_per_output():
    x, y = T(1, 2, 6, 6), T(1, 2, 4, 4)
    assert cost("MaxPool", [x], [y], kernel_shape=[3, 3]).flops == 32 * 9
    assert cost("AveragePool", [x], [y], kernel_shape=[3, 3]).flops == 32 * 9
    assert cost("LpPool", [x], [y], kernel_shape=[3, 3]).flops == 32 * 18
    assert cost("MaxPool", [x], [y], kernel_shape=[3, 3]).macs == 0  # no contraction


def test_global_pools_touch_every_input_element_once():
    x, y = T(2, 3, 7, 7), T(2, 3, 1, 1)
    assert cost("GlobalAveragePool", [x], [y]).flops == 2 * 3 * 49
    assert cost("GlobalMaxPool", [x], [y]).flops == 294
    assert cost("GlobalLpPool", [x], [y]).flops == 588


def test_pool_without_output_type_has_no_formula():
    c = layer_cost(mk("MaxPool", [T(1, 2, 6, 6)], [None], kernel_shape=[3, 3]))
    assert not c.has_formula and c.flops == 0 and c.bytes_min == T(1, 2, 6, 6).nbytes


def test_normalizations_per_element_counts():
    x = T(2, 3, 4, 4)
    p = T(3)
    assert cost("BatchNormalization", [x, p, p, p, p], [x], [1, 2, 3, 4]).flops == 2 * 96
    assert cost("InstanceNormalization", [x, p, p], [x], [1, 2]).flops == 6 * 96
    ln_x, ln_p = T(2, 3, 4), T(4)
    assert cost("LayerNormalization", [ln_x, ln_p, ln_p], [ln_x], [1, 2]).flops == 8 * 24
    assert cost("LayerNormalization", [ln_x, ln_p], [ln_x], [1]).flops == 7 * 24


def test_lrn_sums_size_squares_per_element():
    x = T(1, 8, 2, 2)
    assert cost("LRN", [x], [x], size=5).flops == 32 * (2 * 5 + 4)


# --------------------------------------------------------------------------- elementwise


@pytest.mark.parametrize(
    ("op", "per", "attrs"),
    [
        ("Relu", 1, {}), ("Tanh", 1, {}), ("Exp", 1, {}), ("Erf", 1, {}), ("Sqrt", 1, {}),
        ("LeakyRelu", 2, {}), ("Clip", 2, {}), ("Sigmoid", 4, {}), ("HardSigmoid", 4, {}),
        ("Softplus", 3, {}), ("Gelu", 5, {}), ("Gelu", 9, {"approximate": "tanh"}),
    ],
)
def test_unary_ops_cost_a_fixed_count_per_element(op, per, attrs):
    x = T(2, 3, 5)
    c = cost(op, [x], [x], **attrs)
    assert c.flops == 30 * per
    assert c.bytes_min == 2 * x.nbytes


@pytest.mark.parametrize(("op", "per"), [("Add", 1), ("Sub", 1), ("Mul", 1), ("Div", 1),
                                         ("Pow", 1), ("PRelu", 2)])
def test_binary_ops_count_per_broadcast_output_element(op, per):
    a, b, y = T(2, 3), T(3), T(2, 3)
    c = cost(op, [a, b], [y])
    assert c.flops == 6 * per
    assert c.bytes_min == nbytes(a, b, y)


def test_variadic_ops_take_n_minus_one_ops_per_element():
    x = T(4, 5)
    assert cost("Sum", [x, x, x], [x]).flops == 2 * 20
    assert cost("Max", [x, x], [x]).flops == 20
    assert cost("Min", [x, x, x, x], [x]).flops == 60
    assert cost("Mean", [x, x, x], [x]).flops == 60  # two adds and a divide
    assert cost("Sum", [x], [x]).flops == 0


def test_softmax_and_logsoftmax_cost_five_per_element():
    x = T(8, 10)
    assert cost("Softmax", [x], [x]).flops == 400
    assert cost("LogSoftmax", [x], [x], axis=1).flops == 400


def test_reductions_count_per_input_element():
    x, y = T(2, 3, 4), T(2, 1, 4)
    assert cost("ReduceMean", [x], [y], axes=[1]).flops == 24
    assert cost("ReduceMax", [x], [y], axes=[1]).flops == 24
    assert cost("ReduceSumSquare", [x], [y], axes=[1]).flops == 48


def test_resize_counts_interpolation_taps():
    x, y = T(1, 1, 2, 2), T(1, 1, 4, 4)
    scales = T(4)
    assert cost("Resize", [x, None, scales], [y], [2], mode="nearest").flops == 0
    assert cost("Resize", [x, None, scales], [y], [2], mode="linear").flops == 16 * 2 * 4
    assert cost("Resize", [x, None, scales], [y], [2], mode="cubic").flops == 16 * 2 * 16
    assert cost("Upsample", [x, scales], [y], [1], mode="linear").flops == 128
    same = cost("Resize", [x, None, scales], [x], [2], mode="linear")
    assert same.flops == 0


# --------------------------------------------------------------------------- recurrent


def test_lstm_gates_per_time_step():
    seq, batch, inp, hid = 5, 2, 3, 4
    x, w, r, b = T(seq, batch, inp), T(1, 4 * hid, inp), T(1, 4 * hid, hid), T(1, 8 * hid)
    c = cost("LSTM", [x, w, r, b], [T(seq, 1, batch, hid)], [1, 2, 3], hidden_size=hid)
    assert c.macs == seq * batch * 4 * hid * (inp + hid) == 1120
    # per step and unit: 4 gates * (product add + 2 bias adds) + 18 cell ops
    assert c.flops == 2 * 1120 + seq * batch * hid * (4 * 3 + 18)


def test_lstm_peepholes_add_three_multiply_adds_per_unit():
    seq, batch, inp, hid = 2, 1, 3, 4
    x, w, r = T(seq, batch, inp), T(1, 4 * hid, inp), T(1, 4 * hid, hid)
    base = cost("LSTM", [x, w, r], [T(seq, 1, batch, hid)], [1, 2], hidden_size=hid)
    peep = cost("LSTM", [x, w, r, None, None, None, None, T(1, 3 * hid)],
                [T(seq, 1, batch, hid)], [1, 2, 7], hidden_size=hid)
    assert peep.flops - base.flops == seq * batch * hid * 6


def test_bidirectional_gru_without_bias():
    seq, batch, inp, hid = 5, 2, 3, 4
    x, w, r = T(seq, batch, inp), T(2, 3 * hid, inp), T(2, 3 * hid, hid)
    c = cost("GRU", [x, w, r], [T(seq, 2, batch, hid)], [1, 2], hidden_size=hid,
             direction="bidirectional")
    steps = seq * 2 * batch
    assert c.macs == steps * 3 * hid * (inp + hid) == 1680
    assert c.flops == 2 * 1680 + steps * hid * (3 * 1 + 14)


def test_rnn_batch_major_layout():
    # layout=1: X is [batch, seq, input].
    x, w, r = T(2, 5, 3), T(1, 4, 3), T(1, 4, 4)
    c = cost("RNN", [x, w, r], [T(2, 5, 1, 4)], [1, 2], hidden_size=4, layout=1)
    assert c.macs == 10 * 4 * 7
    assert c.flops == 2 * 280 + 10 * 4 * (1 + 1)


# --------------------------------------------------------------------------- bytes


def test_data_movement_ops_cost_bytes_only():
    a, b, y = T(1, 2, 4), T(1, 3, 4), T(1, 5, 4)
    c = cost("Concat", [a, b], [y], axis=1)
    assert c.flops == 0 and c.bytes_min == nbytes(a, b, y)
    t = cost("Transpose", [a], [T(4, 2, 1)], perm=[2, 1, 0])
    assert t.bytes_min == 2 * a.nbytes
    s = cost("Split", [y], [a, b], axis=1)
    assert s.bytes_min == nbytes(y, a, b)
    p = cost("Pad", [a, T(6, elem=I64)], [T(1, 2, 6)], [1])
    assert p.weight_bytes == 48 and p.bytes_min == a.nbytes + 48 + T(1, 2, 6).nbytes


def test_views_move_no_bytes_but_report_their_tensors():
    x = T(2, 3, 4)
    shape = T(2, elem=I64)
    c = cost("Reshape", [x, shape], [T(6, 4)], [1])
    assert c.flops == 0 and c.bytes_min == 0
    assert c.input_bytes == x.nbytes and c.output_bytes == x.nbytes and c.weight_bytes == 16
    for op in ("Flatten", "Identity", "Dropout"):
        assert cost(op, [x], [x]).bytes_min == 0


def test_gather_reads_only_the_addressed_rows():
    table, idx, y = T(1000, 64), T(2, 3, elem=I64), T(2, 3, 64)
    c = cost("Gather", [table, idx], [y], [0])
    assert c.weight_bytes == 6 * 64 * 4
    assert c.bytes_min == 6 * 64 * 4 + idx.nbytes + y.nbytes


def test_shape_reads_no_data():
    x, y = T(8, 3, 224, 224), T(4, elem=I64)
    c = cost("Shape", [x], [y])
    assert c.bytes_min == 32 and c.input_bytes == 0


def test_bytes_count_each_distinct_tensor_once():
    x = T(10, 10)
    c = layer_cost(mk("Add", [x, x], [x], names=["a", "a"]))
    assert c.bytes_min == 2 * x.nbytes
    assert c.activation_bytes == 2 * x.nbytes
    assert c.arithmetic_intensity == pytest.approx(100 / 800)


def test_omitted_optional_inputs_cost_nothing():
    x, w, y = T(1, 2, 4, 4), T(3, 2, 1, 1), T(1, 3, 4, 4)
    c = layer_cost(mk("Conv", [x, w, None], [y], [1]))
    assert c.bytes_min == nbytes(x, w, y)
    assert c.flops == 2 * c.macs


def test_unknown_ops_are_flagged_and_still_charged_bytes():
    x = T(4, 4)
    for layer in (mk("TopK", [x, T(1, elem=I64)], [x, T(4, 4, elem=I64)], [1]),
                  mk("Relu", [x], [x], domain="com.example")):
        c = layer_cost(layer)
        assert not c.has_formula
        assert c.flops == 0 and c.bytes_min > 0
    total = model_cost([mk("TopK", [x, T(1, elem=I64)], [x, x], [1]), mk("Relu", [x], [x])])
    assert total.n_without_formula == 1 and total.kinds_without_formula == ("TopK",)


def test_arithmetic_intensity_edge_cases():
    zero = LayerCost("X", 0, 0, 0, 0, 0, 0, True)
    assert zero.arithmetic_intensity == 0.0
    no_bytes = LayerCost("X", 10, 0, 0, 0, 0, 0, True)
    assert no_bytes.arithmetic_intensity == math.inf
    assert no_bytes.to_dict()["arithmetic_intensity"] is None


def test_layer_cost_round_trips_through_dict():
    c = cost("Conv", [T(1, 3, 8, 8), T(4, 3, 3, 3)], [T(1, 4, 6, 6)], [1])
    assert LayerCost.from_dict(c.to_dict()) == c


def test_supported_ops_cover_the_brief():
    ops = set(supported_ops())
    assert {"Conv", "ConvTranspose", "Gemm", "MatMul", "LSTM", "GRU", "RNN", "Resize",
            "LRN", "Softmax", "Gather", "Pad", "ReduceMean"} <= ops


def test_layer_from_node_rejects_mismatched_types():
    node = helper.make_node("Relu", ["x"], ["y"])
    with pytest.raises(ValueError, match="1 inputs"):
        layer_from_node(node, [T(2), T(2)], [T(2)])


def test_layer_from_node_accepts_const_inputs():
    node = helper.make_node("Mul", ["x", "s"], ["y"])
    s = ConstInput("s", T(), "param", None)
    layer = layer_from_node(node, [T(2), T()], [T(2)], {1: s})
    assert layer.constants[1] is s and layer.activation_slots() == [0]


def test_layer_cost_rejects_non_layers():
    with pytest.raises(TypeError, match="Layer"):
        layer_cost(helper.make_node("Relu", ["x"], ["y"]))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- totals, roofline


def test_model_cost_sums_its_layers():
    layers = [
        mk("Conv", [T(1, 3, 8, 8), T(4, 3, 3, 3)], [T(1, 4, 6, 6)], [1]),
        mk("Relu", [T(1, 4, 6, 6)], [T(1, 4, 6, 6)]),
        mk("Reshape", [T(1, 4, 6, 6), T(2, elem=I64)], [T(1, 144)], [1]),
    ]
    total = model_cost(layers)
    parts = [layer_cost(layer) for layer in layers]
    assert total.flops == sum(c.flops for c in parts)
    assert total.macs == parts[0].macs
    assert total.bytes_min == sum(c.bytes_min for c in parts)
    assert total.weight_bytes == sum(c.weight_bytes for c in parts)
    assert total.n_layers == 3 and total.n_without_formula == 0
    assert total.to_dict(per_layer=True)["layers"][1] == parts[1].to_dict()


def _peaks(gflops: float, bw: float) -> Peaks:
    return Peaks(threads=1, gflops=gflops, copy_gbs=bw, triad_gbs=bw / 2, ort_scale_gbs=bw / 4,
                 ort_add_gbs=bw / 3)


def test_roofline_bound_is_the_max_of_compute_and_memory_time():
    c = LayerCost("Conv", flops=2_000_000_000, macs=10**9, input_bytes=0, weight_bytes=0,
                  output_bytes=0, bytes_min=1_000_000_000, has_formula=True)
    compute_bound = _peaks(gflops=1.0, bw=100.0)  # 2 s vs 0.01 s
    assert roofline_terms(c, compute_bound) == pytest.approx((2.0, 0.01))
    assert roofline_bound(c, compute_bound) == pytest.approx(2.0)
    memory_bound = _peaks(gflops=1000.0, bw=0.5)  # 0.002 s vs 2 s
    assert roofline_bound(c, memory_bound) == pytest.approx(2.0)
    assert roofline_bound(c, memory_bound, bandwidth_gbs=4.0) == pytest.approx(0.25)


def test_roofline_uses_the_best_measured_bandwidth_and_rejects_zero_peaks():
    c = LayerCost("Add", 0, 0, 0, 0, 0, 10**9, True)
    assert roofline_bound(c, _peaks(1.0, 10.0)) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="positive"):
        roofline_bound(c, _peaks(0.0, 10.0))


def test_efficiency_is_bound_over_measured():
    assert efficiency(0.5, 2.0) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        efficiency(0.5, 0.0)
    with pytest.raises(ValueError):
        efficiency(-1.0, 1.0)


def test_model_cost_works_with_roofline():
    total = model_cost([mk("Relu", [T(1000)], [T(1000)])])
    assert isinstance(total, ModelCost)
    assert roofline_bound(total, _peaks(1.0, 1.0)) == pytest.approx(8000 / 1e9)


# --------------------------------------------------------------------------- real models

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
# Published GMACs at 224x224 (conv + fully connected multiply-adds).
PUBLISHED_GMACS = {"light_resnet50.onnx": 4.1, "light_vgg19.onnx": 19.6}


def _layers_by_shape_inference(path: str) -> list[Layer]:
    """Layers of a light model without the dlbricks loader: onnx shape inference
    (with data propagation, which resolves the ConstantOfShape weights), with
    ConstantOfShape-of-initializer chains taken as constants."""
    m = shape_inference.infer_shapes(onnx.load(path), strict_mode=True, data_prop=True)
    g = m.graph

    def tt(v: onnx.ValueInfoProto) -> TensorType:
        t = v.type.tensor_type
        return TensorType(t.elem_type, tuple(d.dim_value for d in t.shape.dim))

    types = {v.name: tt(v) for v in [*g.input, *g.value_info, *g.output]}
    const = {i.name for i in g.initializer}
    layers: list[Layer] = []
    for n in g.node:
        if n.op_type == "ConstantOfShape" and n.input[0] in const:
            const.update(n.output)
            continue
        layers.append(layer_from_node(
            n, [types[i] if i else None for i in n.input],
            # Unused outputs (Dropout's mask) get no inferred type.
            [types.get(o) if o else None for o in n.output],
            [s for s, i in enumerate(n.input) if i in const], index=len(layers)))
    return layers


@pytest.mark.parametrize("name", sorted(PUBLISHED_GMACS))
def test_gmacs_match_published_figures_via_shape_inference(name):
    total = model_cost(_layers_by_shape_inference(os.path.join(LIGHT, name)))
    assert total.macs / 1e9 == pytest.approx(PUBLISHED_GMACS[name], rel=0.05)
    assert total.n_without_formula == 0


@pytest.mark.parametrize("name", sorted(PUBLISHED_GMACS))
def test_gmacs_match_published_figures_via_the_loader(name):
    from dlbricks import loading as onnx_io

    path = os.path.join(LIGHT, name)
    total = model_cost(onnx_io.load(path).layers)
    assert total.macs / 1e9 == pytest.approx(PUBLISHED_GMACS[name], rel=0.05)
    assert total.macs == model_cost(_layers_by_shape_inference(path)).macs


def test_every_light_model_is_fully_covered_and_the_loader_agrees():
    from dlbricks import loading as onnx_io

    names = sorted(f for f in os.listdir(LIGHT) if f.endswith(".onnx"))
    assert len(names) == 9
    for name in names:
        path = os.path.join(LIGHT, name)
        total = model_cost(_layers_by_shape_inference(path))
        assert total.kinds_without_formula == (), name
        assert total.macs > 0 and total.flops >= 2 * total.macs
        loaded = model_cost(onnx_io.load(path).layers)
        assert (loaded.macs, loaded.flops) == (total.macs, total.flops), name
        assert loaded.kinds_without_formula == (), name
