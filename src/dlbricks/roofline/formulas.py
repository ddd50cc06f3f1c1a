"""The per-op formulas behind :mod:`dlbricks.roofline.costmodel`: FLOPs and MACs
of each op with a contraction or per-element work, and the bytes a layer cannot
avoid moving. The conventions they share are in that module's docstring.

A formula is registered for its op types with ``@_formula``; it reads only the
layer's types and attributes and raises ``_NoFormula`` when a type it needs is
omitted, so that the layer is still charged its bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Callable

import numpy as np

from dlbricks.loading.names import is_default_domain
from dlbricks.model import Layer, TensorType

__all__ = [
    "VIEW_OPS",
    "conv_output_spatial",
    "conv_transpose_output_spatial",
    "op_bytes",
    "op_flops",
    "supported_ops",
]


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
# formulas: each returns (flops, macs)

_Formula = Callable[[Layer], tuple[int, int]]
_FORMULAS: dict[str, _Formula] = {}


def _formula(*ops: str) -> Callable[[_Formula], _Formula]:
    def register(fn: _Formula) -> _Formula:
        for op in ops:
            _FORMULAS[op] = fn
        return fn

    return register


# Slots of (activation, weight, bias) for the conv-like ops.
_CONV_SLOTS = {"Conv": (0, 1, 2), "ConvInteger": (0, 1, None), "QLinearConv": (0, 3, 8)}


@_formula("Conv", "ConvInteger", "QLinearConv")
def _conv(layer: Layer) -> tuple[int, int]:
    """MACs = N * Cout * prod(out_spatial) * (Cin/groups) * prod(kernel);
    FLOPs = 2*MACs + N * Cout * prod(out_spatial) when there is a bias.

    ``Cin/groups`` and the kernel come from the weight ``[Cout, Cin/groups, k...]``;
    strides, pads, dilations and auto_pad enter through the output size (the output
    type, or :func:`conv_output_spatial` when it is missing).
    """
    xs, ws, bs = _CONV_SLOTS[layer.op_type]
    x, w = _need_in(layer, xs), _need_in(layer, ws)
    kernel = w.shape[2:]
    y = layer.output_types[0] if layer.output_types else None
    if y is not None:
        out_spatial = y.shape[2:]
    else:
        out_spatial = conv_output_spatial(
            x.shape[2:], _attr(layer, "kernel_shape") or kernel,
            strides=_attr(layer, "strides"), pads=_attr(layer, "pads"),
            dilations=_attr(layer, "dilations"), auto_pad=_attr(layer, "auto_pad", "NOTSET"),
        )
    n, cout = x.shape[0], w.shape[0]
    outputs = n * cout * _prod(out_spatial)
    macs = outputs * w.shape[1] * _prod(kernel)
    bias = outputs if bs is not None and _in(layer, bs) is not None else 0
    return 2 * macs + bias, macs


@_formula("ConvTranspose")
def _conv_transpose(layer: Layer) -> tuple[int, int]:
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
    return 2 * macs + bias, macs


@_formula("Gemm")
def _gemm(layer: Layer) -> tuple[int, int]:
    """Y = alpha * A' B' + beta * C with A' (M, K), B' (K, N) after transA/transB.

    MACs = M * N * K. FLOPs = 2*MACs, + M*N when alpha != 1 (the scaling),
    + M*N when C is present (the add), + M*N more when beta != 1.
    """
    a, b = _need_in(layer, 0), _need_in(layer, 1)
    m, k = (a.shape[1], a.shape[0]) if _attr(layer, "transA", 0) else (a.shape[0], a.shape[1])
    n = b.shape[0] if _attr(layer, "transB", 0) else b.shape[1]
    macs = m * n * k
    flops = 2 * macs
    if float(_attr(layer, "alpha", 1.0)) != 1.0:
        flops += m * n
    if _in(layer, 2) is not None:
        flops += m * n
        if float(_attr(layer, "beta", 1.0)) != 1.0:
            flops += m * n
    return flops, macs


_MATMUL_SLOTS = {"MatMul": (0, 1), "MatMulInteger": (0, 1), "QLinearMatMul": (0, 3)}


@_formula("MatMul", "MatMulInteger", "QLinearMatMul")
def _matmul(layer: Layer) -> tuple[int, int]:
    """numpy.matmul semantics: A [..., M, K] @ B [..., K, N] with broadcast batch dims.

    MACs = prod(broadcast batch dims) * M * N * K, which equals numel(Y) * K (a 1-D
    operand contributes M = 1 or N = 1). FLOPs = 2*MACs.
    """
    sa, sb = _MATMUL_SLOTS[layer.op_type]
    a, b = _need_in(layer, sa), _need_in(layer, sb)
    k = a.shape[-1]
    y = layer.output_types[0] if layer.output_types else None
    if y is not None:
        out = y.numel
    else:
        m = a.shape[-2] if len(a.shape) >= 2 else 1
        n = b.shape[-1] if len(b.shape) >= 2 else 1
        batch = np.broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2]))
        out = _prod(batch) * m * n
    macs = out * k
    return 2 * macs, macs


def _pool_kernel_ops(layer: Layer) -> int:
    return _prod(_attr(layer, "kernel_shape") or ())


@_formula("MaxPool", "AveragePool")
def _pool(layer: Layer) -> tuple[int, int]:
    """FLOPs = numel(Y) * prod(kernel_shape): one compare (Max) or add (Average,
    the final divide replacing the first add) per kernel tap of each output."""
    return _need_out(layer).numel * _pool_kernel_ops(layer), 0


@_formula("LpPool")
def _lp_pool(layer: Layer) -> tuple[int, int]:
    """FLOPs = numel(Y) * 2 * prod(kernel_shape): a pow and an add per tap."""
    return _need_out(layer).numel * 2 * _pool_kernel_ops(layer), 0


@_formula("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(layer: Layer) -> tuple[int, int]:
    """FLOPs = numel(X): one add or compare per input element."""
    return _need_in(layer, 0).numel, 0


@_formula("GlobalLpPool")
def _global_lp_pool(layer: Layer) -> tuple[int, int]:
    """FLOPs = 2 * numel(X): a pow and an add per input element."""
    return 2 * _need_in(layer, 0).numel, 0


@_formula("BatchNormalization")
def _batchnorm(layer: Layer) -> tuple[int, int]:
    """Inference form: FLOPs = 2 * numel(X), y = x * a + b with the per-channel a, b
    folded from scale, bias, mean, var and epsilon (per-channel work not counted)."""
    return 2 * _need_in(layer, 0).numel, 0


@_formula("InstanceNormalization", "GroupNormalization", "MeanVarianceNormalization")
def _instancenorm(layer: Layer) -> tuple[int, int]:
    """FLOPs = 6 * numel(X): mean (1 add), variance (subtract, square, add = 3),
    apply y = x * a + b with a, b per normalised group (2)."""
    return 6 * _need_in(layer, 0).numel, 0


@_formula("LayerNormalization")
def _layernorm(layer: Layer) -> tuple[int, int]:
    """FLOPs = 7 * numel(X), 8 with a bias B: mean (1), variance (3),
    (x - mean) * inv_std (2), * scale (1), + B (1). Scale is per element of the
    normalised shape, so it cannot be folded into a per-group factor."""
    per = 8 if _in(layer, 2) is not None else 7
    return per * _need_in(layer, 0).numel, 0


@_formula("LRN")
def _lrn(layer: Layer) -> tuple[int, int]:
    """FLOPs = numel(X) * (2*size + 4): the cross-channel sum of squares over
    ``size`` channels (a multiply-add per channel), then scale by alpha/size, add
    bias, pow beta and divide."""
    size = int(_attr(layer, "size"))
    return _need_in(layer, 0).numel * (2 * size + 4), 0


# Per-element op counts of unary and binary elementwise ops (see module docstring).
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
}
# Gelu(approximate="tanh"): 0.5x(1 + tanh(sqrt(2/pi) * (x + 0.044715x^3))) = x^3 (2),
# multiply-add (2), multiply, tanh, add, 2 multiplies.
_GELU_TANH = 9


@_formula(*_ELEMENTWISE)
def _elementwise(layer: Layer) -> tuple[int, int]:
    """FLOPs = numel(Y) * ops per element (the table ``_ELEMENTWISE``)."""
    per = _ELEMENTWISE[layer.op_type]
    if layer.op_type == "Gelu" and _attr(layer, "approximate", "none") == "tanh":
        per = _GELU_TANH
    return _need_out(layer).numel * per, 0


@_formula("Sum", "Max", "Min", "Mean")
def _variadic(layer: Layer) -> tuple[int, int]:
    """FLOPs = numel(Y) * (n - 1) for n inputs (adds or compares); Mean adds one
    divide per element, numel(Y) * n."""
    n = sum(1 for name in layer.inputs if name)
    per = n if layer.op_type == "Mean" else max(n - 1, 0)
    return _need_out(layer).numel * per, 0


@_formula("Softmax", "LogSoftmax")
def _softmax(layer: Layer) -> tuple[int, int]:
    """FLOPs = 5 * numel(X): row max, subtract, exp, row sum, then divide
    (Softmax) or subtract the row's log-sum (LogSoftmax)."""
    return 5 * _need_in(layer, 0).numel, 0


@_formula("Hardmax")
def _hardmax(layer: Layer) -> tuple[int, int]:
    """FLOPs = numel(X): one compare per element."""
    return _need_in(layer, 0).numel, 0


# Per-input-element op counts of reductions; per-output scalar work (the divide of
# ReduceMean, the sqrt of ReduceL2, the log of ReduceLogSum) is not counted.
_REDUCE: dict[str, int] = {
    **dict.fromkeys(
        ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd",
         "ReduceLogSum", "ArgMax", "ArgMin"], 1),
    **dict.fromkeys(["ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSumExp"], 2),
}


@_formula(*_REDUCE)
def _reduce(layer: Layer) -> tuple[int, int]:
    """FLOPs = numel(X) * ops per element: 1 (sum, max, ...) or 2 (square or abs or
    exp, then add)."""
    return _need_in(layer, 0).numel * _REDUCE[layer.op_type], 0


@_formula("Resize", "Upsample")
def _resize(layer: Layer) -> tuple[int, int]:
    """Nearest: 0 FLOPs (a gather). Linear: numel(Y) * 2 * 2^r, cubic:
    numel(Y) * 2 * 4^r, for r resized dims: each output is a weighted sum of
    2^r (4^r) input taps, one multiply-add per tap. Coordinate arithmetic is not
    counted."""
    x, y = _need_in(layer, 0), _need_out(layer)
    mode = str(_attr(layer, "mode", "nearest"))
    r = sum(1 for i, o in zip(x.shape, y.shape) if i != o)
    if mode == "nearest" or r == 0:
        return 0, 0
    taps = {"linear": 2, "bilinear": 2, "cubic": 4}.get(mode)
    if taps is None:
        raise _NoFormula
    return y.numel * 2 * taps**r, 0


# Gate count G and per-hidden-unit cell ops (after the gate pre-activations).
_RNN_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
# RNN: tanh (1). GRU: two sigmoids (2*4), r * (R_h h) (1), tanh (1),
# (1 - z) * h~ + z * h (4). LSTM: three sigmoids (3*4), tanh (1), f*c + i*g (3),
# tanh(c) (1), o * tanh(c) (1).
_RNN_CELL_OPS = {"RNN": 1, "GRU": 14, "LSTM": 18}


@_formula("RNN", "GRU", "LSTM")
def _rnn(layer: Layer) -> tuple[int, int]:
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
    return 2 * macs + steps * hidden * (g * (1 + 2 * has_b) + cell), macs


# Pure data movement: 0 FLOPs, all bytes counted.
_DATA_MOVEMENT = [
    "Concat", "Split", "Transpose", "Pad", "Tile", "Expand", "Cast", "CastLike",
    "DepthToSpace", "SpaceToDepth", "ScatterND", "ScatterElements", "Scatter",
    "ConstantOfShape", "Constant", "ReverseSequence", "Trilu", "OneHot",
]
# Views: aliased by onnxruntime (or removed, Dropout at inference): 0 bytes.
VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"})
# Read only the addressed elements of slot 0: at most numel(Y) of them.
_SUBSET_READS = {"Gather", "GatherElements", "GatherND", "Slice"}
# Read only metadata of their input.
_METADATA = {"Shape", "Size"}


@_formula(*_DATA_MOVEMENT, *VIEW_OPS, *_SUBSET_READS, *_METADATA)
def _zero_flops(layer: Layer) -> tuple[int, int]:
    """0 FLOPs: copies, views and gathers (their bytes are what they cost)."""
    return 0, 0


def supported_ops() -> list[str]:
    """The op types (default ONNX domain) that have a formula, sorted."""
    return sorted(_FORMULAS)


# ---------------------------------------------------------------------------
# bytes


def op_bytes(layer: Layer) -> tuple[int, int, int, int]:
    """(input_bytes, weight_bytes, output_bytes, bytes_min) of a layer; see
    :mod:`dlbricks.roofline.costmodel` for what is charged."""
    seen: set[str] = set()
    inputs = weights = 0
    for slot, name in enumerate(layer.inputs):
        t = _in(layer, slot)
        if t is None or name in seen:
            continue
        seen.add(name)
        nbytes = t.nbytes
        if slot == 0 and layer.op_type in _SUBSET_READS:
            y = layer.output_types[0] if layer.output_types else None
            if y is not None:
                nbytes = min(nbytes, y.numel * t.dtype.itemsize)
        if layer.op_type in _METADATA:
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
    if layer.op_type in VIEW_OPS and is_default_domain(layer.domain):
        # A Dropout mask is the one real write here; onnxruntime drops the node
        # when the mask is unused, the normal case at inference, so it is not charged.
        return inputs, weights, outputs, 0
    return inputs, weights, outputs, inputs + weights + outputs


def op_flops(layer: Layer) -> tuple[int, int] | None:
    """(flops, macs) of a layer by its op's formula; None when there is none: an
    op outside the default domain or without a formula, or a layer missing a type
    the formula needs."""
    fn = _FORMULAS.get(layer.op_type) if is_default_domain(layer.domain) else None
    if fn is None:
        return None
    try:
        return fn(layer)
    except _NoFormula:
        return None
