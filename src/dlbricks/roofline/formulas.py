"""The per-op formulas behind :mod:`dlbricks.roofline.costmodel`: FLOPs, MACs and
integer ops of each op with a contraction or per-element work, and the bytes a
layer cannot avoid moving. The conventions they share are in that module's docstring.

A formula is registered with ``@_formula`` for the op *kinds* it covers
(:attr:`~dlbricks.model.Layer.kind`: the op type in the default ONNX domain,
``domain::op_type`` elsewhere), so the standard ops of a source graph and the ops
onnxruntime writes into the graph it executes (``com.microsoft`` fusions and
quantized kernels, ``com.microsoft.nchwc`` blocked-layout kernels) share one table
and one set of helpers: a fused or blocked kernel is counted by the formula of the
op it replaces plus what was fused into it. A formula reads only the layer's types
and attributes and raises ``_NoFormula`` when a type or attribute it needs is
missing, so that the layer is still charged its bytes.

The module holds every formula because they are one table: splitting it by domain
would split ops that share a formula (Conv, NCHWc Conv, FusedConv and QLinearConv).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Callable, NamedTuple

import numpy as np
from onnx import TensorProto

from dlbricks.model import Layer, TensorType

__all__ = [
    "VIEW_OPS",
    "Counts",
    "conv_output_spatial",
    "conv_transpose_output_spatial",
    "op_bytes",
    "op_counts",
    "supported_ops",
]

# Domain prefixes of Layer.kind for onnxruntime's own ops.
_MS = "com.microsoft::"
_NCHWC = "com.microsoft.nchwc::"


class Counts(NamedTuple):
    """What a formula counts for one layer (see :mod:`dlbricks.roofline.costmodel`)."""

    flops: int  # floating-point operations
    macs: int = 0  # multiply-accumulates of the contraction, float or integer
    int_ops: int = 0  # integer operations of a quantized kernel


class _NoFormula(Exception):
    """A formula lacks what it needs (an omitted type); fall back to bytes only."""


# ---------------------------------------------------------------------------
# helpers


def _prod(xs: Iterable[int]) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def _attr(layer: Layer, name: str, default: Any = None) -> Any:
    import onnx.helper

    for a in layer.node.attribute:
        if a.name == name:
            v = onnx.helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default


def _in(layer: Layer, slot: int) -> TensorType | None:
    """Type of input ``slot``; None when omitted."""
    if slot >= len(layer.inputs) or not layer.inputs[slot]:
        return None
    t = layer.input_types[slot] if slot < len(layer.input_types) else None
    if t is None and slot in layer.constants:
        t = layer.constants[slot].type
    return t


def _need_in(layer: Layer, slot: int) -> TensorType:
    t = _in(layer, slot)
    if t is None:
        raise _NoFormula
    return t


def _need_out(layer: Layer, slot: int = 0) -> TensorType:
    t = layer.output_types[slot] if slot < len(layer.output_types) else None
    if t is None:
        raise _NoFormula
    return t


def conv_output_spatial(
    in_spatial: Sequence[int],
    kernel: Sequence[int],
    *,
    strides: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    dilations: Sequence[int] | None = None,
    auto_pad: str = "NOTSET",
    ceil_mode: bool = False,
) -> tuple[int, ...]:
    """Output spatial size of Conv and the pooling ops, as ONNX defines it.

    ``NOTSET``: ``out = floor_or_ceil((in + pad_begin + pad_end - ((k-1)*d + 1)) / s) + 1``;
    ``SAME_UPPER``/``SAME_LOWER``: ``ceil(in / s)``; ``VALID``: the NOTSET formula with
    zero pads.

    Args:
        in_spatial: input sizes of the spatial dims.
        kernel: kernel sizes, one per spatial dim.
        strides, dilations: default 1 per dim.
        pads: ``[begin..., end...]``; default zeros.
        auto_pad: ``NOTSET``, ``SAME_UPPER``, ``SAME_LOWER`` or ``VALID``.
        ceil_mode: pooling's ``ceil_mode`` (round the NOTSET/VALID division up).

    Returns:
        The output spatial sizes.

    Raises:
        ValueError: an unknown ``auto_pad`` or mismatched lengths.
    """
    r = len(in_spatial)
    if len(kernel) != r:
        raise ValueError(f"kernel has {len(kernel)} dims, input has {r} spatial dims")
    strides = list(strides) if strides else [1] * r
    dilations = list(dilations) if dilations else [1] * r
    pads = list(pads) if pads else [0] * (2 * r)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return tuple(-(-i // s) for i, s in zip(in_spatial, strides))
    if auto_pad == "VALID":
        pads = [0] * (2 * r)
    elif auto_pad != "NOTSET":
        raise ValueError(f"unknown auto_pad {auto_pad!r}")
    out = []
    for i in range(r):
        span = in_spatial[i] + pads[i] + pads[i + r] - ((kernel[i] - 1) * dilations[i] + 1)
        q = -(-span // strides[i]) if ceil_mode else span // strides[i]
        out.append(q + 1)
    return tuple(out)


def conv_transpose_output_spatial(
    in_spatial: Sequence[int],
    kernel: Sequence[int],
    *,
    strides: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    dilations: Sequence[int] | None = None,
    output_padding: Sequence[int] | None = None,
    output_shape: Sequence[int] | None = None,
    auto_pad: str = "NOTSET",
) -> tuple[int, ...]:
    """Output spatial size of ConvTranspose, as ONNX defines it.

    ``out = s*(in-1) + output_padding + ((k-1)*d + 1) - pad_begin - pad_end``;
    ``SAME_*``: ``in * s``; an explicit ``output_shape`` wins.

    Args:
        in_spatial, kernel, strides, pads, dilations, auto_pad: as for
            :func:`conv_output_spatial`.
        output_padding: default zeros.
        output_shape: the attribute, spatial dims only.

    Returns:
        The output spatial sizes.
    """
    r = len(in_spatial)
    if output_shape:
        return tuple(int(x) for x in output_shape[-r:])
    strides = list(strides) if strides else [1] * r
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return tuple(i * s for i, s in zip(in_spatial, strides))
    dilations = list(dilations) if dilations else [1] * r
    output_padding = list(output_padding) if output_padding else [0] * r
    pads = list(pads) if pads and auto_pad != "VALID" else [0] * (2 * r)
    return tuple(
        strides[i] * (in_spatial[i] - 1) + output_padding[i] + (kernel[i] - 1) * dilations[i] + 1
        - pads[i] - pads[i + r]
        for i in range(r)
    )


# ---------------------------------------------------------------------------
# formulas: each returns Counts

_Formula = Callable[[Layer], Counts]
_FORMULAS: dict[str, _Formula] = {}


def _formula(*kinds: str) -> Callable[[_Formula], _Formula]:
    def register(fn: _Formula) -> _Formula:
        for kind in kinds:
            _FORMULAS[kind] = fn
        return fn

    return register


# 8-bit integer tensors: the operands of the kernels bounded by the int8 peak.
_INT8_TYPES = frozenset({TensorProto.INT8, TensorProto.UINT8})
_FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE})

# Per element: (x - zero_point) * scale.
_DEQUANTIZE = 2
# Per element: x / scale, round, + zero_point, saturate (a min and a max).
_QUANTIZE = 5


def _is_int8(t: TensorType | None) -> bool:
    return t is not None and t.elem_type in _INT8_TYPES


def _output_scaling(y: TensorType, outputs: int) -> int:
    """FLOPs that turn a quantized contraction's int32 accumulators into its output:
    a requantisation (:data:`_QUANTIZE`) per element of an 8-bit output, one multiply
    by the product of the scales per element of a float output, nothing for an
    int32 output (MatMulInteger, ConvInteger). Zero points are folded into the
    integer accumulation (row and column sums, O(M*K + K*N), not counted)."""
    if y.elem_type in _INT8_TYPES:
        return _QUANTIZE * outputs
    return outputs if y.elem_type in _FLOAT_TYPES else 0


# Activations fused into Conv/Gemm kernels (the ``activation`` attribute of FusedConv,
# FusedGemm and NCHWc Conv) that are not ops of their own: alpha * tanh(beta * x),
# and alpha * log(1 + exp(beta * x)).
_FUSED_ONLY_ACTIVATIONS = {"ScaledTanh": 3, "ParametricSoftplus": 5}


def _activation(layer: Layer) -> int:
    """Per-element FLOPs of the activation fused into a kernel (0 when none)."""
    act = _attr(layer, "activation")
    if act is None:
        return 0
    per = _ELEMENTWISE.get(str(act), _FUSED_ONLY_ACTIVATIONS.get(str(act)))
    if per is None:
        raise _NoFormula
    return per


# Slots of (activation, weight, bias, summand) for the conv-like ops. NCHWc Conv's
# ``Sum`` and FusedConv's ``Z`` are added to the result before the activation.
_CONV_SLOTS: dict[str, tuple[int, int, int | None, int | None]] = {
    "Conv": (0, 1, 2, None),
    "ConvInteger": (0, 1, None, None),
    "QLinearConv": (0, 3, 8, None),
    f"{_MS}QLinearConv": (0, 3, 8, None),
    f"{_MS}FusedConv": (0, 1, 2, 3),
    f"{_MS}NhwcConv": (0, 1, 2, None),
    f"{_NCHWC}Conv": (0, 1, 2, 3),
}


def _channels_last(layer: Layer) -> bool:
    return layer.kind == f"{_MS}NhwcConv" or bool(_attr(layer, "channels_last", 0))


@_formula(*_CONV_SLOTS)
def _conv(layer: Layer) -> Counts:
    """MACs = N * Cout * prod(out_spatial) * (Cin/groups) * prod(kernel).

    ``Cin/groups`` and the kernel come from the weight ``[Cout, Cin/groups, k...]``;
    strides, pads, dilations and auto_pad enter through the output size (the output
    type, or :func:`conv_output_spatial` when it is missing). Channels-last layouts
    (NhwcConv, QLinearConv with ``channels_last``) take the spatial dims of X and Y
    from between N and C. NCHWc Conv runs on the blocked layout, whose channels are
    padded to the block size: its types and reordered weight carry the padded
    channels, and the MACs count them, as the kernel computes them.

    Float: FLOPs = 2*MACs, + 1 per output for a bias, + 1 for a summand (NCHWc
    Conv's ``Sum``, FusedConv's ``Z``), + the fused ``activation``'s per-element
    count. 8-bit operands (ConvInteger, QLinearConv, a QDQ group's Conv): int ops =
    2*MACs + 1 per output for the int32 bias; FLOPs are the output's scaling
    (:func:`_output_scaling`).
    """
    xs, ws, bs, ss = _CONV_SLOTS[layer.kind]
    x, w = _need_in(layer, xs), _need_in(layer, ws)
    last = _channels_last(layer)
    kernel = w.shape[2:]
    y = layer.output_types[0] if layer.output_types else None
    if y is not None:
        out_spatial: Sequence[int] = y.shape[1:-1] if last else y.shape[2:]
    else:
        out_spatial = conv_output_spatial(
            x.shape[1:-1] if last else x.shape[2:], _attr(layer, "kernel_shape") or kernel,
            strides=_attr(layer, "strides"), pads=_attr(layer, "pads"),
            dilations=_attr(layer, "dilations"), auto_pad=_attr(layer, "auto_pad", "NOTSET"),
        )
    n, cout = x.shape[0], w.shape[0]
    outputs = n * cout * _prod(out_spatial)
    macs = outputs * w.shape[1] * _prod(kernel)
    bias = outputs if bs is not None and _in(layer, bs) is not None else 0
    if _is_int8(x) and _is_int8(w):
        return Counts(_output_scaling(_need_out(layer), outputs), macs, 2 * macs + bias)
    summand = outputs if ss is not None and _in(layer, ss) is not None else 0
    return Counts(2 * macs + bias + summand + outputs * _activation(layer), macs)


@_formula("ConvTranspose")
def _conv_transpose(layer: Layer) -> Counts:
    """MACs = N * Cin * prod(in_spatial) * (Cout/groups) * prod(kernel): every input
    element is scattered through its group's kernel (what a GEMM + col2im
    implementation computes; taps cropped by pads are counted too).
    FLOPs = 2*MACs + N * Cout * prod(out_spatial) when there is a bias.

    The weight is ``[Cin, Cout/groups, k...]``.
    """
    x, w = _need_in(layer, 0), _need_in(layer, 1)
    kernel = w.shape[2:]
    macs = x.shape[0] * x.shape[1] * _prod(x.shape[2:]) * w.shape[1] * _prod(kernel)
    bias = 0
    if _in(layer, 2) is not None:
        y = layer.output_types[0] if layer.output_types else None
        if y is not None:
            out_spatial: Sequence[int] = y.shape[2:]
        else:
            out_spatial = conv_transpose_output_spatial(
                x.shape[2:], _attr(layer, "kernel_shape") or kernel,
                strides=_attr(layer, "strides"), pads=_attr(layer, "pads"),
                dilations=_attr(layer, "dilations"),
                output_padding=_attr(layer, "output_padding"),
                output_shape=_attr(layer, "output_shape"),
                auto_pad=_attr(layer, "auto_pad", "NOTSET"),
            )
        group = int(_attr(layer, "group", 1))
        bias = x.shape[0] * w.shape[1] * group * _prod(out_spatial)
    return Counts(2 * macs + bias, macs)


# Slots of (A, B, C) for the Gemm-like ops.
_GEMM_SLOTS = {
    "Gemm": (0, 1, 2),
    f"{_MS}FusedGemm": (0, 1, 2),
    f"{_MS}GemmFastGelu": (0, 1, 2),
    f"{_MS}QGemm": (0, 3, 6),
}


@_formula(*_GEMM_SLOTS)
def _gemm(layer: Layer) -> Counts:
    """Y = alpha * A' B' + beta * C with A' (M, K), B' (K, N) after transA/transB.

    MACs = M * N * K. Float: FLOPs = 2*MACs, + M*N when alpha != 1 (the scaling),
    + M*N when C is present (the add), + M*N more when beta != 1, + M*N times the
    per-element count of FusedGemm's ``activation`` or of GemmFastGelu's tanh Gelu.
    QGemm (8-bit A and B): int ops = 2*MACs, + M*N for the int32 C; alpha is folded
    into the output scale; FLOPs are the output's scaling (:func:`_output_scaling`).
    """
    sa, sb, sc = _GEMM_SLOTS[layer.kind]
    a, b = _need_in(layer, sa), _need_in(layer, sb)
    m, k = (a.shape[1], a.shape[0]) if _attr(layer, "transA", 0) else (a.shape[0], a.shape[1])
    n = b.shape[0] if _attr(layer, "transB", 0) else b.shape[1]
    macs = m * n * k
    has_c = _in(layer, sc) is not None
    if _is_int8(a) and _is_int8(b):
        return Counts(_output_scaling(_need_out(layer), m * n), macs, 2 * macs + (m * n if has_c else 0))
    flops = 2 * macs
    if float(_attr(layer, "alpha", 1.0)) != 1.0:
        flops += m * n
    if has_c:
        flops += m * n
        if float(_attr(layer, "beta", 1.0)) != 1.0:
            flops += m * n
    if layer.kind == f"{_MS}GemmFastGelu":
        flops += m * n * _GELU_TANH
    else:
        flops += m * n * _activation(layer)
    return Counts(flops, macs)


# Slots of (A, B, bias) for the MatMul-like ops.
_MATMUL_SLOTS: dict[str, tuple[int, int, int | None]] = {
    "MatMul": (0, 1, None),
    "MatMulInteger": (0, 1, None),
    "QLinearMatMul": (0, 3, None),
    f"{_MS}FusedMatMul": (0, 1, None),
    f"{_MS}MatMulIntegerToFloat": (0, 1, 6),
    f"{_MS}DynamicQuantizeMatMul": (0, 1, 4),
}
# Quantizes its float A itself: a DynamicQuantizeLinear of A inside the kernel.
_DYNAMIC_MATMUL = f"{_MS}DynamicQuantizeMatMul"


def _contraction_dim(layer: Layer, a: TensorType) -> int:
    """K of a MatMul-like op: A's last dim; FusedMatMul's ``transA`` makes it the
    second last, or the first with ``transBatchA`` too (A is then ``[K, batch..., M]``:
    transBatchA moves A's first dim behind its batch dims before transA swaps the
    last two)."""
    if layer.kind == f"{_MS}FusedMatMul" and _attr(layer, "transA", 0):
        return a.shape[0] if _attr(layer, "transBatchA", 0) else a.shape[-2]
    return a.shape[-1]


@_formula(*_MATMUL_SLOTS)
def _matmul(layer: Layer) -> Counts:
    """numpy.matmul semantics: A [..., M, K] @ B [..., K, N] with broadcast batch dims.

    MACs = prod(broadcast batch dims) * M * N * K, which equals numel(Y) * K (a 1-D
    operand contributes M = 1 or N = 1). Float: FLOPs = 2*MACs, + numel(Y) for
    FusedMatMul's alpha when it is not 1. 8-bit A and B (MatMulInteger,
    QLinearMatMul, MatMulIntegerToFloat), or DynamicQuantizeMatMul (float A,
    quantized inside the kernel: 2 + :data:`_QUANTIZE` FLOPs per element of A, as
    DynamicQuantizeLinear): int ops = 2*MACs; FLOPs are the output's scaling
    (:func:`_output_scaling`), + numel(Y) for a bias.
    """
    sa, sb, sbias = _MATMUL_SLOTS[layer.kind]
    a, b = _need_in(layer, sa), _need_in(layer, sb)
    k = _contraction_dim(layer, a)
    y = layer.output_types[0] if layer.output_types else None
    if y is not None:
        out = y.numel
    elif layer.kind == f"{_MS}FusedMatMul" and any(
            _attr(layer, t, 0) for t in ("transA", "transB", "transBatchA", "transBatchB")):
        raise _NoFormula  # transposed operands: the output size needs the output type
    else:
        m = a.shape[-2] if len(a.shape) >= 2 else 1
        n = b.shape[-1] if len(b.shape) >= 2 else 1
        batch = np.broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2]))
        out = _prod(batch) * m * n
    macs = out * k
    dynamic = layer.kind == _DYNAMIC_MATMUL
    if _is_int8(b) and (_is_int8(a) or dynamic):
        flops = _output_scaling(_need_out(layer), out)
        if sbias is not None and _in(layer, sbias) is not None:
            flops += out
        if dynamic:
            flops += (2 + _QUANTIZE) * a.numel
        return Counts(flops, macs, 2 * macs)
    flops = 2 * macs
    if float(_attr(layer, "alpha", 1.0)) != 1.0:
        flops += out
    return Counts(flops, macs)


def _pool_kernel_ops(layer: Layer) -> int:
    return _prod(_attr(layer, "kernel_shape") or ())


@_formula("MaxPool", "AveragePool", f"{_NCHWC}MaxPool", f"{_NCHWC}AveragePool", f"{_MS}NhwcMaxPool")
def _pool(layer: Layer) -> Counts:
    """numel(Y) * prod(kernel_shape): one compare (Max) or add (Average, the final
    divide replacing the first add) per kernel tap of each output; int ops when the
    data is 8-bit (a max pool of a quantized tensor). NCHWc pools count the padded
    channels of the blocked layout, NhwcMaxPool the same taps channels-last."""
    n = _need_out(layer).numel * _pool_kernel_ops(layer)
    return Counts(0, 0, n) if _is_int8(_in(layer, 0)) else Counts(n)


@_formula(f"{_MS}QLinearAveragePool")
def _qlinear_pool(layer: Layer) -> Counts:
    """int ops = numel(Y) * prod(kernel_shape) (8-bit taps summed);
    FLOPs = :data:`_QUANTIZE` per output (the sum requantised)."""
    y = _need_out(layer)
    return Counts(_QUANTIZE * y.numel, 0, y.numel * _pool_kernel_ops(layer))


@_formula("LpPool")
def _lp_pool(layer: Layer) -> Counts:
    """FLOPs = numel(Y) * 2 * prod(kernel_shape): a pow and an add per tap."""
    return Counts(_need_out(layer).numel * 2 * _pool_kernel_ops(layer))


@_formula("GlobalAveragePool", "GlobalMaxPool", f"{_NCHWC}GlobalAveragePool", f"{_NCHWC}GlobalMaxPool")
def _global_pool(layer: Layer) -> Counts:
    """FLOPs = numel(X): one add or compare per input element (NCHWc: the padded
    channels of the blocked layout)."""
    return Counts(_need_in(layer, 0).numel)


@_formula(f"{_MS}QLinearGlobalAveragePool")
def _qlinear_global_pool(layer: Layer) -> Counts:
    """int ops = numel(X) (the 8-bit values summed in int32); FLOPs =
    :data:`_QUANTIZE` per output (the sum requantised)."""
    return Counts(_QUANTIZE * _need_out(layer).numel, 0, _need_in(layer, 0).numel)


@_formula("GlobalLpPool")
def _global_lp_pool(layer: Layer) -> Counts:
    """FLOPs = 2 * numel(X): a pow and an add per input element."""
    return Counts(2 * _need_in(layer, 0).numel)


@_formula("BatchNormalization")
def _batchnorm(layer: Layer) -> Counts:
    """Inference form: FLOPs = 2 * numel(X), y = x * a + b with the per-channel a, b
    folded from scale, bias, mean, var and epsilon (per-channel work not counted)."""
    return Counts(2 * _need_in(layer, 0).numel)


@_formula("InstanceNormalization", "GroupNormalization", "MeanVarianceNormalization")
def _instancenorm(layer: Layer) -> Counts:
    """FLOPs = 6 * numel(X): mean (1 add), variance (subtract, square, add = 3),
    apply y = x * a + b with a, b per normalised group (2)."""
    return Counts(6 * _need_in(layer, 0).numel)


# LayerNormalization per element: mean (1), variance (3), (x - mean) * inv_std (2),
# * scale (1).
_LAYERNORM = 7
# RMS normalisation per element: square and add (2), * inv_rms (1), * scale (1).
_RMSNORM = 4
# kind -> (FLOPs per element, slots of the optional inputs that add 1 more each: a
# bias before the normalisation, a beta after it). The Skip forms add their skip
# input first (1).
_NORMS: dict[str, tuple[int, tuple[int, ...]]] = {
    "LayerNormalization": (_LAYERNORM, (2,)),
    "SimplifiedLayerNormalization": (_RMSNORM, ()),
    "RMSNormalization": (_RMSNORM, ()),
    f"{_MS}SkipLayerNormalization": (1 + _LAYERNORM, (3, 4)),
    f"{_MS}SkipSimplifiedLayerNormalization": (1 + _RMSNORM, (3,)),
}


@_formula(*_NORMS)
def _layernorm(layer: Layer) -> Counts:
    """Per element of X: LayerNormalization 7 FLOPs, 8 with a bias B: mean (1),
    variance (3), (x - mean) * inv_std (2), * scale (1), + B (1). Scale is per element
    of the normalised shape, so it cannot be folded into a per-group factor.
    RMS normalisation (SimplifiedLayerNormalization, onnxruntime's RMSNorm;
    RMSNormalization): 4, no mean and no B. SkipLayerNormalization and
    SkipSimplifiedLayerNormalization first add the skip input (1) and their
    optional bias (1), then normalise (with SkipLayerNormalization's optional beta)."""
    per, optional = _NORMS[layer.kind]
    per += sum(_in(layer, slot) is not None for slot in optional)
    return Counts(per * _need_in(layer, 0).numel)


# EmbedLayerNormalization: the embedding tables, read only at the rows looked up.
_EMBED_TABLES = (2, 3, 4)


@_formula(f"{_MS}EmbedLayerNormalization")
def _embed_layernorm(layer: Layer) -> Counts:
    """Per output element: the word and position embeddings (and the segment one when
    given) summed (1 or 2 adds), then a LayerNormalization with gamma and beta (8)."""
    y = _need_out(layer)
    return Counts(y.numel * (1 + (_in(layer, 4) is not None) + _LAYERNORM + 1))


def _attention_counts(batch: int, heads: int, seq: int, total: int, head_qk: int, head_v: int,
                      masked: bool) -> tuple[int, int]:
    """(MACs, FLOPs) of scaled dot-product attention per batch: Q K^T (head_qk MACs
    per score) and P V (head_v per score); per score the scaling (1), the softmax
    (5, as :func:`_softmax`) and the mask or bias add (1) when there is one."""
    scores = batch * heads * seq * total
    macs = scores * (head_qk + head_v)
    return macs, 2 * macs + scores * (1 + 5 + masked)


@_formula(f"{_MS}Attention")
def _attention(layer: Layer) -> Counts:
    """onnxruntime's Attention: X [B, S, D_in] times the packed weight
    [D_in, D_q + D_k + D_v] (``qkv_hidden_sizes``, else three equal parts), then
    attention over ``num_heads`` heads against S keys plus the ``past`` ones.

    MACs = B*S*D_in*(D_q + D_k + D_v) (the projection) + the attention's
    (:func:`_attention_counts`); FLOPs = 2*MACs + the attention's per-score work,
    + B*S*(D_q + D_k + D_v) for the bias.
    """
    x, w = _need_in(layer, 0), _need_in(layer, 1)
    heads = int(_attr(layer, "num_heads") or 0)
    if len(x.shape) != 3 or heads < 1:
        raise _NoFormula
    b, s, d_in = x.shape
    sizes = _attr(layer, "qkv_hidden_sizes") or [w.shape[-1] // 3] * 3
    dq, dk, dv = (int(v) for v in sizes)
    past = _in(layer, 4)  # [2, B, heads, past_len, head]
    total = s + (past.shape[3] if past is not None and len(past.shape) == 5 else 0)
    proj = b * s * d_in * (dq + dk + dv)
    masked = _in(layer, 3) is not None or _in(layer, 5) is not None
    macs, flops = _attention_counts(b, heads, s, total, dq // heads, dv // heads, masked)
    bias = b * s * (dq + dk + dv) if _in(layer, 2) is not None else 0
    return Counts(2 * proj + flops + bias, proj + macs)


@_formula(f"{_MS}MultiHeadAttention")
def _multi_head_attention(layer: Layer) -> Counts:
    """onnxruntime's MultiHeadAttention (projections done before it): query
    [B, S, D] (or packed QKV [B, S, heads, 3, head]), keys and values of length L
    ([B, L, D], [B, heads, L, head], or packed KV [B, L, heads, 2, head]) after the
    ``past_key`` ones; the output [B, S, D_v]. MACs and FLOPs are the attention's
    (:func:`_attention_counts`), + B*S*numel(bias) for the ``bias`` of q, k and v
    (its adds, exact when keys and queries are as long).
    """
    q, y = _need_in(layer, 0), _need_out(layer)
    heads = int(_attr(layer, "num_heads") or 0)
    if heads < 1 or len(y.shape) != 3 or len(q.shape) not in (3, 5):
        raise _NoFormula
    b, s, dv = y.shape
    head_qk = q.shape[-1] if len(q.shape) == 5 else q.shape[2] // heads
    key = _in(layer, 1)
    present = layer.output_types[1] if len(layer.output_types) > 1 else None
    if present is not None and len(present.shape) == 4:
        total = present.shape[2]
    else:
        total = s if key is None else (key.shape[2] if len(key.shape) == 4 else key.shape[1])
        past = _in(layer, 6)
        if past is not None and len(past.shape) == 4:
            total += past.shape[2]
    masked = _in(layer, 4) is not None or _in(layer, 5) is not None
    macs, flops = _attention_counts(b, heads, s, total, head_qk, dv // heads, masked)
    bias = _in(layer, 3)
    if bias is not None:
        flops += b * s * bias.numel
    return Counts(flops, macs)


@_formula("LRN")
def _lrn(layer: Layer) -> Counts:
    """FLOPs = numel(X) * (2*size + 4): the cross-channel sum of squares over
    ``size`` channels (a multiply-add per channel), then scale by alpha/size, add
    bias, pow beta and divide."""
    size = int(_attr(layer, "size"))
    return Counts(_need_in(layer, 0).numel * (2 * size + 4))


# Per-element op counts of unary and binary elementwise ops (see module docstring),
# by kind. Activation names (FusedConv's ``activation="Relu"``) are looked up here too.
_ELEMENTWISE: dict[str, int] = {
    # binary (numpy broadcasting; counted per output element)
    **dict.fromkeys(
        ["Add", "Sub", "Mul", "Div", "Pow", "Mod", "And", "Or", "Xor", "Equal",
         "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "BitShift",
         "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Where"], 1),
    "PRelu": 2,  # compare, multiply
    # unary
    **dict.fromkeys(
        ["Relu", "Tanh", "Exp", "Log", "Erf", "Sqrt", "Reciprocal", "Neg", "Abs",
         "Ceil", "Floor", "Round", "Sign", "Sin", "Cos", "Tan", "Asin", "Acos",
         "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Not", "BitwiseNot",
         "IsNaN", "IsInf", "ThresholdedRelu"], 1),
    "LeakyRelu": 2,  # compare, multiply
    "Clip": 2,  # max, min
    "Shrink": 2,  # compare, add
    "Elu": 4,  # compare, exp, subtract 1, multiply by alpha
    "Celu": 4,
    "Selu": 5,  # Elu plus the gamma scaling
    "Sigmoid": 4,  # 1 / (1 + exp(-x)): negate, exp, add, divide
    "HardSigmoid": 4,  # max(0, min(1, alpha*x + beta)): multiply-add (2), min, max
    "HardSwish": 5,  # x * HardSigmoid(x)
    "Softplus": 3,  # log(exp(x) + 1)
    "Softsign": 3,  # x / (1 + |x|)
    "Mish": 5,  # x * tanh(log(1 + exp(x)))
    "Gelu": 5,  # 0.5 * x * (1 + erf(x / sqrt 2)): divide, erf, add, 2 multiplies
    "CumSum": 1,  # one add per element along the axis
    # onnxruntime's fusions
    f"{_MS}Gelu": 5,  # as Gelu
    f"{_MS}BiasGelu": 6,  # + bias, then Gelu
    f"{_MS}QuickGelu": 6,  # x * Sigmoid(alpha * x): multiply, Sigmoid (4), multiply
    f"{_MS}BiasAdd": 2,  # x + bias + skip
    # quantized binary ops: dequantize both inputs (2 + 2), the op, quantize (5)
    **dict.fromkeys([f"{_MS}QLinearAdd", f"{_MS}QLinearMul"], 2 * _DEQUANTIZE + 1 + _QUANTIZE),
}
# Gelu(approximate="tanh"), FastGelu: 0.5x(1 + tanh(sqrt(2/pi) * (x + 0.044715x^3)))
# = x^3 (2), multiply-add (2), multiply, tanh, add, 2 multiplies.
_GELU_TANH = 9


@_formula(*_ELEMENTWISE)
def _elementwise(layer: Layer) -> Counts:
    """FLOPs = numel(Y) * ops per element (the table ``_ELEMENTWISE``)."""
    per = _ELEMENTWISE[layer.kind]
    if layer.kind == "Gelu" and _attr(layer, "approximate", "none") == "tanh":
        per = _GELU_TANH
    return Counts(_need_out(layer).numel * per)


@_formula(f"{_MS}FastGelu")
def _fast_gelu(layer: Layer) -> Counts:
    """FLOPs = numel(Y) * 9 (tanh Gelu), + numel(Y) for the optional bias add."""
    per = _GELU_TANH + (_in(layer, 1) is not None)
    return Counts(_need_out(layer).numel * per)


@_formula("QuantizeLinear", f"{_MS}QuantizeLinear")
def _quantize(layer: Layer) -> Counts:
    """FLOPs = :data:`_QUANTIZE` per element: divide by the scale, round, add the zero
    point, saturate (min and max)."""
    return Counts(_QUANTIZE * _need_in(layer, 0).numel)


@_formula("DequantizeLinear", f"{_MS}DequantizeLinear")
def _dequantize(layer: Layer) -> Counts:
    """FLOPs = :data:`_DEQUANTIZE` per element: subtract the zero point, multiply by
    the scale."""
    return Counts(_DEQUANTIZE * _need_in(layer, 0).numel)


@_formula("DynamicQuantizeLinear")
def _dynamic_quantize(layer: Layer) -> Counts:
    """FLOPs = (2 + :data:`_QUANTIZE`) per element: the running min and max that set
    the scale and zero point, then the quantisation."""
    return Counts((2 + _QUANTIZE) * _need_in(layer, 0).numel)


@_formula("Sum", "Max", "Min", "Mean")
def _variadic(layer: Layer) -> Counts:
    """FLOPs = numel(Y) * (n - 1) for n inputs (adds or compares); Mean adds one
    divide per element, numel(Y) * n."""
    n = sum(1 for name in layer.inputs if name)
    per = n if layer.op_type == "Mean" else max(n - 1, 0)
    return Counts(_need_out(layer).numel * per)


@_formula("Softmax", "LogSoftmax")
def _softmax(layer: Layer) -> Counts:
    """FLOPs = 5 * numel(X): row max, subtract, exp, row sum, then divide
    (Softmax) or subtract the row's log-sum (LogSoftmax)."""
    return Counts(5 * _need_in(layer, 0).numel)


@_formula(f"{_MS}BiasSoftmax")
def _bias_softmax(layer: Layer) -> Counts:
    """FLOPs = 6 * numel(X): the bias add, then Softmax (5)."""
    return Counts(6 * _need_in(layer, 0).numel)


@_formula("Hardmax")
def _hardmax(layer: Layer) -> Counts:
    """FLOPs = numel(X): one compare per element."""
    return Counts(_need_in(layer, 0).numel)


# Per-input-element op counts of reductions; per-output scalar work (the divide of
# ReduceMean, the sqrt of ReduceL2, the log of ReduceLogSum) is not counted.
_REDUCE: dict[str, int] = {
    **dict.fromkeys(
        ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd",
         "ReduceLogSum", "ArgMax", "ArgMin"], 1),
    **dict.fromkeys(["ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSumExp"], 2),
}


@_formula(*_REDUCE)
def _reduce(layer: Layer) -> Counts:
    """FLOPs = numel(X) * ops per element: 1 (sum, max, ...) or 2 (square or abs or
    exp, then add)."""
    return Counts(_need_in(layer, 0).numel * _REDUCE[layer.op_type])


@_formula("Resize", "Upsample", f"{_NCHWC}Upsample")
def _resize(layer: Layer) -> Counts:
    """Nearest: 0 FLOPs (a gather). Linear: numel(Y) * 2 * 2^r, cubic:
    numel(Y) * 2 * 4^r, for r resized dims: each output is a weighted sum of
    2^r (4^r) input taps, one multiply-add per tap. Coordinate arithmetic is not
    counted. NCHWc Upsample: the same on the blocked layout."""
    x, y = _need_in(layer, 0), _need_out(layer)
    mode = str(_attr(layer, "mode", "nearest"))
    r = sum(1 for i, o in zip(x.shape, y.shape) if i != o)
    if mode == "nearest" or r == 0:
        return Counts(0)
    taps = {"linear": 2, "bilinear": 2, "cubic": 4}.get(mode)
    if taps is None:
        raise _NoFormula
    return Counts(y.numel * 2 * taps**r)


# Gate count G and per-hidden-unit cell ops (after the gate pre-activations).
_RNN_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
# RNN: tanh (1). GRU: two sigmoids (2*4), r * (R_h h) (1), tanh (1),
# (1 - z) * h~ + z * h (4). LSTM: three sigmoids (3*4), tanh (1), f*c + i*g (3),
# tanh(c) (1), o * tanh(c) (1).
_RNN_CELL_OPS = {"RNN": 1, "GRU": 14, "LSTM": 18}


@_formula("RNN", "GRU", "LSTM")
def _rnn(layer: Layer) -> Counts:
    """Per time step, per direction, per batch row, G gates of hidden size H:

    MACs = seq * dirs * batch * G * H * (I + H) (the W x_t and R h_{t-1} products).
    FLOPs = 2*MACs + seq * dirs * batch * H * (G * (1 + 2*has_B) + cell_ops), where
    each gate adds its two products (1) and the two biases Wb, Rb (2 if B is given),
    and cell_ops is 1 (RNN, tanh), 14 (GRU) or 18 (LSTM), +6 for LSTM peepholes.
    G = 1, 3, 4. Default activations are assumed; ``sequence_lens`` is ignored (the
    full padded length is counted).
    """
    x, w, r = _need_in(layer, 0), _need_in(layer, 1), _need_in(layer, 2)
    seq, batch = (x.shape[1], x.shape[0]) if _attr(layer, "layout", 0) else (x.shape[0], x.shape[1])
    dirs, hidden, inp = w.shape[0], r.shape[-1], w.shape[-1]
    g = _RNN_GATES[layer.op_type]
    steps = seq * dirs * batch
    macs = steps * g * hidden * (inp + hidden)
    cell = _RNN_CELL_OPS[layer.op_type]
    if layer.op_type == "LSTM" and _in(layer, 7) is not None:
        cell += 6  # three peephole multiply-adds
    has_b = _in(layer, 3) is not None
    return Counts(2 * macs + steps * hidden * (g * (1 + 2 * has_b) + cell), macs)


# Pure data movement: 0 FLOPs, all bytes counted. NCHWc reorders convert between the
# plain and the blocked layout (a strided copy); QLinearConcat requantises each input
# through a 256-entry table, when its scale differs from the output's (a lookup).
_DATA_MOVEMENT = [
    "Concat", "Split", "Transpose", "Pad", "Tile", "Expand", "Cast", "CastLike",
    "DepthToSpace", "SpaceToDepth", "ScatterND", "ScatterElements", "Scatter",
    "ConstantOfShape", "Constant", "ReverseSequence", "Trilu", "OneHot",
    f"{_NCHWC}ReorderInput", f"{_NCHWC}ReorderOutput", f"{_MS}QLinearConcat",
]
# Quantized activations that onnxruntime runs as a 256-entry table lookup per
# element (the table is computed once from the scales): no arithmetic per element.
_LOOKUPS = [f"{_MS}QLinearSigmoid", f"{_MS}QLinearLeakyRelu"]
# Views: aliased by onnxruntime (or removed, Dropout at inference): 0 bytes.
VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"})
_GATHERS = ["Gather", "GatherElements", "GatherND", "Slice"]
# Read only the addressed elements of these input slots: at most numel(Y) of them.
_SUBSET_READS: dict[str, tuple[int, ...]] = {
    **dict.fromkeys(_GATHERS, (0,)), f"{_MS}EmbedLayerNormalization": _EMBED_TABLES,
}
# Read only metadata of their input.
_METADATA = {"Shape", "Size"}


@_formula(*_DATA_MOVEMENT, *_LOOKUPS, *VIEW_OPS, *_GATHERS, *_METADATA)
def _zero_flops(layer: Layer) -> Counts:
    """0 FLOPs: copies, views, gathers and table lookups (their bytes are what they cost)."""
    return Counts(0)


def supported_ops() -> list[str]:
    """The op kinds that have a formula, sorted: op types of the default ONNX domain,
    ``domain::op_type`` for onnxruntime's (``com.microsoft::FusedConv``,
    ``com.microsoft.nchwc::Conv``...)."""
    return sorted(_FORMULAS)


# ---------------------------------------------------------------------------
# bytes


def op_bytes(layer: Layer) -> tuple[int, int, int, int]:
    """(input_bytes, weight_bytes, output_bytes, bytes_min) of a layer; see
    :mod:`dlbricks.roofline.costmodel` for what is charged."""
    kind = layer.kind
    subset = _SUBSET_READS.get(kind, ())
    y0 = layer.output_types[0] if layer.output_types else None
    seen: set[str] = set()
    inputs = weights = 0
    for slot, name in enumerate(layer.inputs):
        t = _in(layer, slot)
        if t is None or name in seen:
            continue
        seen.add(name)
        nbytes = t.nbytes
        if slot in subset and y0 is not None:
            nbytes = min(nbytes, y0.numel * t.dtype.itemsize)
        if kind in _METADATA:
            nbytes = 0
        if slot in layer.constants:
            weights += nbytes
        else:
            inputs += nbytes
    outputs = 0
    for name, t in zip(layer.outputs, layer.output_types):
        if not name or t is None or name in seen:
            continue
        seen.add(name)
        outputs += t.nbytes
    if kind in VIEW_OPS:
        # A Dropout mask is the one real write here; onnxruntime drops the node
        # when the mask is unused, the normal case at inference, so it is not charged.
        return inputs, weights, outputs, 0
    return inputs, weights, outputs, inputs + weights + outputs


def op_counts(layer: Layer) -> Counts | None:
    """The layer's :class:`Counts` by its op's formula; None when there is none: an
    op kind without a formula, an activation or mode a formula does not know, or a
    layer missing a type the formula needs."""
    fn = _FORMULAS.get(layer.kind)
    if fn is None:
        return None
    try:
        return fn(layer)
    except _NoFormula:
        return None
