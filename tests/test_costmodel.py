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

from dlbricks.model import ConstInput, Layer, TensorType
from dlbricks.roofline.costmodel import (
    LayerCost,
    ModelCost,
    conv_output_spatial,
    conv_transpose_output_spatial,
    efficiency,
    int8_unbounded,
    layer_cost,
    layer_from_node,
    model_cost,
    roofline_bound,
    roofline_terms,
    supported_ops,
)
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


U8, I8, I32 = TensorProto.UINT8, TensorProto.INT8, TensorProto.INT32


def test_quantized_contractions_count_int_ops_and_requantisation():
    # QLinearMatMul: a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp.
    s, z = T(), T(elem=U8)
    q = cost("QLinearMatMul", [T(3, 4, elem=U8), s, z, T(4, 5, elem=U8), s, z, s, z],
             [T(3, 5, elem=U8)], [1, 2, 3, 4, 5, 6, 7])
    assert q.macs == 60
    assert q.int_ops == 2 * 60 and q.flops == 5 * 15  # requantise each of the 15 outputs
    ci = cost("ConvInteger", [T(1, 2, 5, 5, elem=U8), T(4, 2, 3, 3, elem=U8)],
              [T(1, 4, 3, 3, elem=I32)], [1])
    assert ci.macs == 4 * 9 * 2 * 9
    assert ci.int_ops == 2 * ci.macs and ci.flops == 0  # int32 out: nothing to rescale
    mi = cost("MatMulInteger", [T(2, 8, elem=U8), T(8, 3, elem=I8)], [T(2, 3, elem=I32)], [1])
    assert (mi.macs, mi.int_ops, mi.flops) == (48, 96, 0)
    # 8-bit tensors count one byte an element.
    assert q.input_bytes == 12 and q.weight_bytes == 20 + 3 * 4 + 3 * 1 and q.output_bytes == 15
    assert mi.bytes_min == 16 + 24 + 6 * 4


def test_a_qdq_group_conv_on_8_bit_tensors_counts_int_ops():
    # A QDQ group keeps the op's type with the quantized tensors in its slots.
    x, w, b, y = T(1, 2, 5, 5, elem=U8), T(4, 2, 3, 3, elem=I8), T(4, elem=I32), T(1, 4, 3, 3, elem=U8)
    c = cost("Conv", [x, w, b], [y], [1, 2])
    assert c.macs == 4 * 9 * 2 * 9 == 648
    assert c.int_ops == 2 * 648 + 36 and c.flops == 5 * 36
    f = cost("Conv", [T(1, 2, 5, 5), T(4, 2, 3, 3), T(4)], [T(1, 4, 3, 3)], [1, 2])
    assert f.int_ops == 0 and f.flops == 2 * 648 + 36


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


# --------------------------------------------------------------------------- onnxruntime's kernels
# The ops onnxruntime writes into the graph it executes (runtime-graph decomposition).

MS, NCHWC = "com.microsoft", "com.microsoft.nchwc"


def test_nchwc_conv_counts_bias_sum_and_fused_activation_per_output():
    x, w, b, y = T(1, 16, 5, 5), T(16, 16, 3, 3), T(16), T(1, 16, 5, 5)
    attrs = dict(domain=NCHWC, kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    macs = 16 * 25 * 16 * 9
    c = cost("Conv", [x, w, b, y], [y], [1, 2], activation="Relu", **attrs)  # Sum: the residual
    assert c.kind == "com.microsoft.nchwc::Conv"
    assert c.macs == macs == 57_600
    assert c.flops == 2 * macs + 400 + 400 + 400  # bias, Sum, Relu per output
    assert c.input_bytes == 2 * x.nbytes and c.weight_bytes == nbytes(w, b) and c.output_bytes == y.nbytes
    plain = cost("Conv", [x, w, b], [y], [1, 2], **attrs)
    assert plain.flops == 2 * macs + 400
    hard = cost("Conv", [x, w, b], [y], [1, 2], activation="HardSigmoid", activation_params=[0.2, 0.5], **attrs)
    assert hard.flops == 2 * macs + 400 + 4 * 400
    unknown = layer_cost(mk("Conv", [x, w, b], [y], [1, 2], activation="Swish", **attrs))
    assert not unknown.has_formula and unknown.bytes_min == nbytes(x, w, b, y)


def test_nchwc_conv_counts_the_channels_padded_to_the_block():
    # 10 output channels padded to a block of 16: the reordered weight and Y carry 16.
    c = cost("Conv", [T(1, 3, 8, 8), T(16, 3, 3, 3), T(16)], [T(1, 16, 6, 6)], [1, 2], domain=NCHWC,
             kernel_shape=[3, 3])
    assert c.macs == 16 * 36 * 3 * 9
    # The reorders are copies: no arithmetic, the blocked and the plain tensor moved.
    out = cost("ReorderOutput", [T(1, 16, 6, 6)], [T(1, 10, 6, 6)], domain=NCHWC, channels=10)
    assert out.flops == out.macs == 0 and out.bytes_min == 16 * 36 * 4 + 10 * 36 * 4
    inp = cost("ReorderInput", [T(1, 10, 6, 6)], [T(1, 16, 6, 6)], domain=NCHWC)
    assert inp.flops == 0 and inp.bytes_min == out.bytes_min


def test_nchwc_pools_and_upsample_use_the_standard_formulas():
    assert cost("MaxPool", [T(1, 16, 6, 6)], [T(1, 16, 4, 4)], domain=NCHWC, kernel_shape=[3, 3]).flops == 256 * 9
    assert cost("AveragePool", [T(1, 16, 6, 6)], [T(1, 16, 4, 4)], domain=NCHWC, kernel_shape=[3, 3]).flops == 2304
    assert cost("GlobalAveragePool", [T(1, 16, 7, 7)], [T(1, 16, 1, 1)], domain=NCHWC).flops == 784
    up = cost("Upsample", [T(1, 16, 2, 2)], [T(1, 16, 4, 4)], domain=NCHWC, scales=[1, 1, 2, 2], mode="linear")
    assert up.flops == 256 * 2 * 4


def test_fused_conv_adds_z_and_its_activation():
    x, w, b, z = T(1, 4, 6, 6), T(8, 4, 1, 1), T(8), T(1, 8, 6, 6)
    c = cost("FusedConv", [x, w, b, z], [z], [1, 2], domain=MS, activation="LeakyRelu", activation_params=[0.1])
    assert c.macs == 288 * 4
    assert c.flops == 2 * 1152 + 288 + 288 + 2 * 288


def test_fused_gemm_and_gemm_fast_gelu_add_their_activation_per_output():
    a, b, c_, y = T(3, 4), T(5, 4), T(5), T(3, 5)
    g = cost("FusedGemm", [a, b, c_], [y], [1, 2], domain=MS, transB=1, activation="Relu")
    assert g.macs == 60 and g.flops == 120 + 15 + 15
    f = cost("GemmFastGelu", [a, T(4, 5), c_], [y], [1, 2], domain=MS)
    assert f.macs == 60 and f.flops == 120 + 15 + 15 * 9


def test_fused_matmul_transposes_and_scales():
    b, y = T(2, 3, 5, 6), T(2, 3, 4, 6)
    # K = 5 in each layout: A [.., K, M] (transA), [K, .., M] (transBatchA too), [M, .., K].
    for a, attrs in ((T(2, 3, 5, 4), dict(transA=1)), (T(5, 2, 3, 4), dict(transA=1, transBatchA=1)),
                     (T(4, 2, 3, 5), dict(transBatchA=1)), (T(2, 3, 4, 5), {})):
        c = cost("FusedMatMul", [a, b], [y], domain=MS, **attrs)
        assert c.macs == 144 * 5, attrs
        assert c.flops == 2 * 720
    scaled = cost("FusedMatMul", [T(2, 3, 4, 5), b], [y], domain=MS, alpha=0.125)
    assert scaled.flops == 2 * 720 + 144


@pytest.mark.parametrize(("op", "ins", "per"), [
    ("Gelu", 1, 5), ("BiasGelu", 2, 6), ("QuickGelu", 1, 6), ("FastGelu", 1, 9), ("FastGelu", 2, 10),
    ("BiasAdd", 3, 2),
])
def test_onnxruntime_activations_cost_a_fixed_count_per_element(op, ins, per):
    x = T(2, 3, 5)
    c = cost(op, [x, T(5), x][:ins], [x], [1] if ins > 1 else [], domain=MS)
    assert c.flops == 30 * per


def test_cumsum_adds_once_per_element():
    assert cost("CumSum", [T(2, 3, 5), T(elem=I64)], [T(2, 3, 5)], [1]).flops == 30


def test_skip_and_simplified_layer_norms_per_element_counts():
    x, p = T(2, 3, 4), T(4)
    assert cost("SkipLayerNormalization", [x, x, p, p, p], [x], [2, 3, 4], domain=MS).flops == 10 * 24
    assert cost("SkipLayerNormalization", [x, x, p], [x], [2], domain=MS).flops == 8 * 24
    assert cost("SimplifiedLayerNormalization", [x, p], [x], [1]).flops == 4 * 24
    assert cost("SkipSimplifiedLayerNormalization", [x, x, p, p], [x], [2, 3], domain=MS).flops == 6 * 24
    sk = cost("SkipLayerNormalization", [x, x, p, p, p], [x], [2, 3, 4], domain=MS)
    assert sk.input_bytes == 2 * x.nbytes and sk.weight_bytes == 3 * p.nbytes


def test_attention_counts_projection_scores_and_softmax():
    x, w, b, y = T(1, 4, 8), T(8, 24), T(24), T(1, 4, 8)
    c = cost("Attention", [x, w, b], [y], [1, 2], domain=MS, num_heads=2)
    # projection 4*8*24; 2 heads of 4 over 4 keys: 32 scores, (4 + 4) MACs each.
    assert c.macs == 768 + 32 * 8 == 1024
    assert c.flops == 2 * 1024 + 32 * 6 + 4 * 24  # scale and softmax per score; the bias
    masked = cost("Attention", [x, w, b, T(1, elem=I32)], [y], [1, 2], domain=MS, num_heads=2)
    assert masked.flops == c.flops + 32
    past = cost("Attention", [x, w, b, None, T(2, 1, 2, 3, 4)], [y, T(2, 1, 2, 7, 4)], [1, 2], domain=MS,
                num_heads=2)
    assert past.macs == 768 + 56 * 8 and past.flops == 2 * past.macs + 56 * 6 + 96


def test_multi_head_attention_counts_scores_over_the_keys():
    q, kv, y = T(1, 4, 8), T(1, 6, 8), T(1, 4, 8)
    c = cost("MultiHeadAttention", [q, kv, kv], [y], domain=MS, num_heads=2)
    assert c.macs == 2 * 4 * 6 * (4 + 4) == 384
    assert c.flops == 768 + 48 * 6
    biased = cost("MultiHeadAttention", [q, kv, kv, T(24)], [y], [3], domain=MS, num_heads=2)
    assert biased.flops == c.flops + 4 * 24


def test_channels_last_qlinear_conv_counts_int_ops_and_int8_bytes():
    s, zu, x = T(), T(elem=U8), T(1, 5, 5, 2, elem=U8)
    w, ws, wz, b, y = T(4, 2, 3, 3, elem=I8), T(4), T(4, elem=I8), T(4, elem=I32), T(1, 3, 3, 4, elem=U8)
    c = cost("QLinearConv", [x, s, zu, w, ws, wz, s, zu, b], [y], range(1, 9), domain=MS, channels_last=1,
             kernel_shape=[3, 3])
    assert c.macs == 36 * 2 * 9 == 648
    assert c.int_ops == 2 * 648 + 36  # + the int32 bias
    assert c.flops == 5 * 36  # requantised outputs
    assert c.input_bytes == 50 and c.output_bytes == 36
    assert c.weight_bytes == 72 + 16 + 4 + 16 + 2 * 4 + 2 * 1  # w, its scales and zero points, bias; x's, y's


def test_quantized_gemm_and_matmuls_to_float():
    s, zu, zi = T(), T(elem=U8), T(elem=I8)
    a, b = T(2, 8, elem=U8), T(8, 3, elem=I8)
    q = cost("QGemm", [a, s, zu, b, s, zi, T(3, elem=I32), s, zu], [T(2, 3, elem=U8)], range(1, 9), domain=MS)
    assert (q.macs, q.int_ops, q.flops) == (48, 96 + 6, 5 * 6)
    qf = cost("QGemm", [a, s, zu, b, s, zi], [T(2, 3)], range(1, 6), domain=MS)
    assert (qf.int_ops, qf.flops) == (96, 6)  # float out: one multiply by the scales
    m = cost("MatMulIntegerToFloat", [a, b, s, s, zu, zi, T(3)], [T(2, 3)], range(1, 7), domain=MS)
    assert (m.macs, m.int_ops, m.flops) == (48, 96, 6 + 6)
    d = cost("DynamicQuantizeMatMul", [T(2, 8), b, s, zi, T(3)], [T(2, 3)], range(1, 5), domain=MS)
    assert (d.macs, d.int_ops) == (48, 96)
    assert d.flops == 6 + 6 + 7 * 16  # scale, bias; A quantized in the kernel (min, max, quantize)
    assert d.input_bytes == 16 * 4 and d.weight_bytes == 24 + 4 + 1 + 12


def test_quantize_dequantize_and_quantized_elementwise_ops():
    s, zu = T(), T(elem=U8)
    xf, xq = T(2, 8), T(2, 8, elem=U8)
    assert cost("QuantizeLinear", [xf, s, zu], [xq], [1, 2]).flops == 5 * 16
    assert cost("DequantizeLinear", [xq, s, zu], [xf], [1, 2]).flops == 2 * 16
    dq = cost("DynamicQuantizeLinear", [xf], [xq, s, zu])
    assert dq.flops == 7 * 16 and dq.bytes_min == 64 + 16 + 4 + 1
    add = cost("QLinearAdd", [xq, s, zu, xq, s, zu, s, zu], [xq], [1, 2, 4, 5, 6, 7], names=[
        "a", "as", "az", "b", "bs", "bz", "cs", "cz"], domain=MS)
    assert add.flops == 10 * 16 and add.int_ops == 0 and add.activation_bytes == 3 * 16
    gap = cost("QLinearGlobalAveragePool", [T(1, 7, 7, 4, elem=U8), s, zu, s, zu], [T(1, 1, 1, 4, elem=U8)],
               [1, 2, 3, 4], domain=MS, channels_last=1)
    assert (gap.int_ops, gap.flops) == (196, 20)
    assert cost("QLinearSigmoid", [xq, s, zu, s, zu], [xq], [1, 2, 3, 4], domain=MS).flops == 0  # a lookup


def test_pools_over_8_bit_data_count_int_ops():
    x, y = T(1, 6, 6, 2, elem=U8), T(1, 4, 4, 2, elem=U8)
    q = cost("NhwcMaxPool", [x], [y], domain=MS, kernel_shape=[3, 3])
    assert (q.int_ops, q.flops) == (32 * 9, 0)
    f = cost("NhwcMaxPool", [T(1, 6, 6, 2)], [T(1, 4, 4, 2)], domain=MS, kernel_shape=[3, 3])
    assert (f.int_ops, f.flops) == (0, 288)


def test_embed_layer_norm_reads_only_the_rows_it_looks_up():
    ids, word, pos, seg, p = T(1, 4, elem=I32), T(100, 8), T(16, 8), T(2, 8), T(8)
    y, mask = T(1, 4, 8), T(1, elem=I32)
    c = cost("EmbedLayerNormalization", [ids, ids, word, pos, seg, p, p], [y, mask], [2, 3, 4, 5, 6],
             names=["ids", "seg_ids", "w", "pos", "seg", "g", "b"], domain=MS)
    assert c.flops == 32 * (2 + 8)  # three embeddings summed, then LayerNormalization
    assert c.weight_bytes == 128 + 128 + 64 + 32 + 32  # 4 rows of each table: at most numel(Y)
    assert c.input_bytes == 32 and c.output_bytes == 128 + 4


def test_supported_ops_cover_onnxruntimes_runtime_graphs():
    ops = set(supported_ops())
    assert {f"{NCHWC}::{op}" for op in ("Conv", "MaxPool", "AveragePool", "GlobalAveragePool", "ReorderInput",
                                         "ReorderOutput", "Upsample")} <= ops
    assert {f"{MS}::{op}" for op in ("FusedConv", "FusedGemm", "FusedMatMul", "Gelu", "FastGelu", "BiasGelu",
                                      "QuickGelu", "SkipLayerNormalization", "Attention", "MultiHeadAttention",
                                      "QLinearConv", "QLinearAdd", "MatMulIntegerToFloat", "DynamicQuantizeMatMul",
                                      "QGemm", "NhwcMaxPool", "QLinearGlobalAveragePool")} <= ops
    assert {"SimplifiedLayerNormalization", "LayerNormalization", "QLinearMatMul", "MatMulInteger",
            "DynamicQuantizeLinear", "QuantizeLinear", "DequantizeLinear", "CumSum"} <= ops
    # A kind names its domain: a com.microsoft Relu is not ONNX's Relu.
    assert "com.microsoft::Relu" not in ops


def test_runtime_graph_of_light_resnet50_counts_the_source_graphs_macs():
    from dlbricks import loading as onnx_io
    from dlbricks.loading.runtime_graph import runtime_models

    source = onnx_io.load(os.path.join(LIGHT, "light_resnet50.onnx"))
    (runtime,) = runtime_models([source])
    kinds = {layer.kind for layer in runtime.layers}
    assert "com.microsoft.nchwc::Conv" in kinds
    total = model_cost(runtime.layers)
    assert total.kinds_without_formula == ()
    # Every channel count is a multiple of the block, so NCHWc pads nothing: the same MACs.
    assert total.macs == model_cost(source.layers).macs


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


def test_int_ops_are_bounded_by_the_int8_peak_and_add_to_the_float_time():
    c = LayerCost("com.microsoft::QLinearConv", flops=10**9, macs=4 * 10**9, input_bytes=0, weight_bytes=0,
                  output_bytes=0, bytes_min=10**8, has_formula=True, int_ops=8 * 10**9)
    assert c.ops == 9 * 10**9 and c.arithmetic_intensity == pytest.approx(90.0)
    p = _peaks(gflops=100.0, bw=10.0)
    p.int8_gops = 400.0  # 0.01 s of float work and 0.02 s of int8 work share the vector units
    assert roofline_terms(c, p) == pytest.approx((0.03, 0.01))
    assert roofline_bound(c, p) == pytest.approx(0.03) and not int8_unbounded(c, p)
    p.int8_gops = None  # peaks measured before the int8 peak existed: int ops are not bounded
    assert roofline_terms(c, p) == pytest.approx((0.01, 0.01)) and int8_unbounded(c, p)
    assert not int8_unbounded(LayerCost("Conv", 1, 0, 0, 0, 0, 1, True), p)
    p.int8_gops = 0.0
    with pytest.raises(ValueError, match="int8"):
        roofline_terms(c, p)


def test_layer_costs_from_before_int_ops_read_as_zero_int_ops():
    d = cost("Relu", [T(4)], [T(4)]).to_dict()
    del d["int_ops"]
    assert LayerCost.from_dict(d).int_ops == 0


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
