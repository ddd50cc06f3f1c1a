"""Analytic cost of a layer: FLOPs, MACs and the minimum bytes it must move.

Benanza-style lower bounds. Every formula works from the concrete input and output
types of a :class:`~dlbricks.model.Layer` and the attributes of its node; nothing
is run. Conventions, shared by every formula:

* **MACs** count the multiply-accumulates of an op's contraction (Conv,
  ConvTranspose, Gemm, MatMul, their fused, blocked-layout and integer/quantized
  forms, attention's two products, the gate products of LSTM/GRU/RNN). They are 0
  for ops without a contraction.
* **FLOPs** count floating-point work: one multiply-add as 2 FLOPs; every other
  arithmetic step (add, multiply, compare, select, divide, round) and every
  transcendental (exp, log, tanh, erf, sqrt, pow) counts 1 FLOP. A kernel that
  onnxruntime fused counts the op it replaces plus what it absorbed (FusedConv's
  activation, NCHWc Conv's ``Sum`` input, SkipLayerNormalization's skip add).
* **int ops** count the integer work of quantized kernels, on the same scale: the
  8-bit multiply-accumulates of a quantized contraction (ConvInteger, MatMulInteger,
  QLinearConv, QLinearMatMul, QGemm, MatMulIntegerToFloat, DynamicQuantizeMatMul,
  and a QDQ group's Conv/MatMul/Gemm on 8-bit tensors) as 2 each, their int32 bias
  add, the taps of a pool over 8-bit data. What such a kernel does in float (the
  requantisation of each output, quantizing a float input) is FLOPs. The roofline
  bounds int ops by the measured int8 peak
  (:attr:`~dlbricks.roofline.peaks.Peaks.int8_gops`), FLOPs by the float one.
* Only per-element work is counted. Scalar work done once per row, channel or
  group (adding epsilon, a square root of a variance, the log of a row sum,
  folding BatchNormalization's four vectors into one scale and shift) is O(groups)
  and left out.
* Zero padding is counted as real work (a padded Conv tap is one MAC), as is
  conventional for published GMAC figures.
* **bytes_min** is the traffic a layer cannot avoid: each distinct input (by
  tensor name), constant, and output counted once, from ``TensorType.nbytes`` (so
  8-bit tensors count one byte an element, and a blocked NCHWc tensor its padded
  channels).
  Exceptions: view ops (Reshape, Flatten, Squeeze, Unsqueeze, Identity, Dropout)
  move 0 bytes, because onnxruntime aliases their output to the input buffer (or
  removes the node, as it does for Dropout at inference) so a lower bound must not
  charge a copy; ops that read a subset of their data (Gather, Slice, the tables
  of EmbedLayerNormalization) are charged only the elements they can read; Shape
  and Size read no data; the NCHWc reorders are copies, charged what they read
  and write.

Ops without a formula get ``has_formula=False``: their bytes are still counted,
their FLOPs are 0, and callers should flag them. The formulas themselves are in
:mod:`dlbricks.roofline.formulas`; this module is what callers use.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from dlbricks.model import ConstInput, Layer, TensorType
from dlbricks.roofline.formulas import (
    conv_output_spatial,
    conv_transpose_output_spatial,
    op_bytes,
    op_counts,
    supported_ops,
)

if TYPE_CHECKING:  # pragma: no cover
    import onnx

    from dlbricks.roofline.peaks import Peaks

__all__ = [
    "LayerCost",
    "ModelCost",
    "conv_output_spatial",
    "conv_transpose_output_spatial",
    "efficiency",
    "int8_unbounded",
    "layer_cost",
    "layer_from_node",
    "model_cost",
    "roofline_bound",
    "roofline_terms",
    "supported_ops",
]


@dataclass(frozen=True, slots=True)
class LayerCost:
    """The analytic cost of one layer.

    ``input_bytes`` and ``output_bytes`` are activation traffic, ``weight_bytes``
    the constant inputs (weights and params alike). ``bytes_min`` is what the
    roofline uses; it equals their sum except for view ops (0) and ops that read
    only part of an input (see the module docstring). ``int_ops`` is the integer
    work of a quantized kernel, apart from its ``flops``.
    """

    kind: str
    flops: int
    macs: int
    input_bytes: int
    weight_bytes: int
    output_bytes: int
    bytes_min: int
    has_formula: bool
    int_ops: int = 0

    @property
    def ops(self) -> int:
        """FLOPs and int ops together: the arithmetic a roofline plot places."""
        return self.flops + self.int_ops

    @property
    def activation_bytes(self) -> int:
        """Activation bytes read and written (constants excluded)."""
        return self.input_bytes + self.output_bytes

    @property
    def arithmetic_intensity(self) -> float:
        """Operations (:attr:`ops`) per byte of ``bytes_min``; 0 when there are none,
        inf when no bytes."""
        if self.ops == 0:
            return 0.0
        if self.bytes_min == 0:
            return math.inf
        return self.ops / self.bytes_min

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (derived values included; ``from_dict`` ignores them)."""
        d = asdict(self)
        d["activation_bytes"] = self.activation_bytes
        ai = self.arithmetic_intensity
        d["arithmetic_intensity"] = ai if math.isfinite(ai) else None
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerCost:
        """Inverse of :meth:`to_dict`; unknown keys are ignored, ``int_ops`` may be
        missing (0: dicts written before it existed)."""
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(slots=True)
class ModelCost:
    """Totals over a list of layers (layer-by-layer execution: every intermediate
    activation is written by its producer and read again by each consumer)."""

    flops: int = 0
    macs: int = 0
    int_ops: int = 0
    bytes_min: int = 0
    weight_bytes: int = 0
    activation_bytes: int = 0
    n_layers: int = 0
    n_without_formula: int = 0
    kinds_without_formula: tuple[str, ...] = ()
    layers: list[LayerCost] = field(default_factory=list)

    def to_dict(self, *, per_layer: bool = False) -> dict[str, Any]:
        """A JSON-ready dict; per-layer costs only when ``per_layer``."""
        d: dict[str, Any] = {
            k: getattr(self, k)
            for k in (
                "flops", "macs", "int_ops", "bytes_min", "weight_bytes", "activation_bytes",
                "n_layers", "n_without_formula",
            )
        }
        d["kinds_without_formula"] = list(self.kinds_without_formula)
        if per_layer:
            d["layers"] = [c.to_dict() for c in self.layers]
        return d


def layer_cost(layer: Layer) -> LayerCost:
    """The analytic cost of one layer.

    Args:
        layer: a layer with concrete input and output types.

    Returns:
        Its :class:`LayerCost`. Op kinds without a formula (see
        :func:`supported_ops`), and layers missing a type a formula needs, get
        ``has_formula=False`` (bytes only, FLOPs 0).

    Raises:
        TypeError: ``layer`` is not a :class:`~dlbricks.model.Layer`.
    """
    if not isinstance(layer, Layer):
        raise TypeError(f"layer_cost expects a dlbricks Layer, got {type(layer).__name__}")
    inputs, weights, outputs, bytes_min = op_bytes(layer)
    counted = op_counts(layer)
    flops, macs, int_ops = counted if counted is not None else (0, 0, 0)
    return LayerCost(
        kind=layer.kind, flops=int(flops), macs=int(macs), input_bytes=inputs,
        weight_bytes=weights, output_bytes=outputs, bytes_min=bytes_min,
        has_formula=counted is not None, int_ops=int(int_ops),
    )


def model_cost(layers: Iterable[Layer]) -> ModelCost:
    """Sum :func:`layer_cost` over layers.

    Args:
        layers: e.g. ``model.layers``.

    Returns:
        A :class:`ModelCost` with the totals, the per-layer costs and the sorted
        kinds that had no formula.
    """
    total = ModelCost()
    missing: set[str] = set()
    for layer in layers:
        c = layer_cost(layer)
        total.layers.append(c)
        total.flops += c.flops
        total.macs += c.macs
        total.int_ops += c.int_ops
        total.bytes_min += c.bytes_min
        total.weight_bytes += c.weight_bytes
        total.activation_bytes += c.activation_bytes
        total.n_layers += 1
        if not c.has_formula:
            total.n_without_formula += 1
            missing.add(c.kind)
    total.kinds_without_formula = tuple(sorted(missing))
    return total


def roofline_terms(
    cost: LayerCost | ModelCost, peaks: Peaks, *, bandwidth_gbs: float | None = None
) -> tuple[float, float]:
    """The two roofline times in seconds: compute and memory.

    compute = flops / peak FLOP/s + int_ops / int8 peak: a quantized kernel's
    integer and float steps share the vector units, so their times add. Where the
    int8 peak was not measured (``peaks.int8_gops`` is None: peaks from before it
    existed) int ops are not bounded by compute, and such a layer's bound is its
    memory time and its float work alone (:func:`int8_unbounded` says which).
    memory = bytes_min / bandwidth.

    Args:
        cost: a layer's (or a model's) cost.
        peaks: measured peaks; ``gflops``, ``int8_gops`` and ``bandwidth_gbs`` are used.
        bandwidth_gbs: override the bandwidth (e.g. a cache bandwidth).

    Returns:
        ``(compute_seconds, memory_seconds)``.

    Raises:
        ValueError: a peak is not positive.
    """
    bw = peaks.bandwidth_gbs if bandwidth_gbs is None else bandwidth_gbs
    if not (peaks.gflops > 0 and bw > 0):
        raise ValueError(f"peaks must be positive, got {peaks.gflops} GFLOP/s and {bw} GB/s")
    compute = cost.flops / (peaks.gflops * 1e9)
    if cost.int_ops and peaks.int8_gops is not None:
        if not peaks.int8_gops > 0:
            raise ValueError(f"peaks must be positive, got an int8 peak of {peaks.int8_gops} GOP/s")
        compute += cost.int_ops / (peaks.int8_gops * 1e9)
    return compute, cost.bytes_min / (bw * 1e9)


def int8_unbounded(cost: LayerCost | ModelCost, peaks: Peaks) -> bool:
    """Whether ``cost`` has int ops that ``peaks`` cannot bound (no int8 peak measured):
    its bound then counts its memory traffic and float work only."""
    return bool(cost.int_ops) and peaks.int8_gops is None


def roofline_bound(
    cost: LayerCost | ModelCost, peaks: Peaks, *, bandwidth_gbs: float | None = None
) -> float:
    """Roofline lower bound on latency: the larger of :func:`roofline_terms`' compute
    and memory times (``max(flops / peak, bytes_min / bandwidth)`` for float work).

    The bandwidth is the best main-memory rate measured; a layer whose working set
    stays in cache can beat it, so for small layers the bound is conservative only
    with respect to DRAM.

    Args:
        cost, peaks, bandwidth_gbs: as for :func:`roofline_terms`.

    Returns:
        Seconds.

    Raises:
        ValueError: a peak is not positive.
    """
    return max(roofline_terms(cost, peaks, bandwidth_gbs=bandwidth_gbs))


def efficiency(bound: float, measured: float) -> float:
    """Fraction of the roofline achieved: ``bound / measured``.

    1.0 means the layer ran at the bound; above 1.0 means it beat the bound (the
    bound's assumptions did not hold, e.g. data stayed in cache).

    Args:
        bound: roofline bound in seconds.
        measured: measured time in seconds.

    Returns:
        ``bound / measured``.

    Raises:
        ValueError: ``measured`` is not positive or ``bound`` is negative.
    """
    if not measured > 0:
        raise ValueError(f"measured time must be positive, got {measured}")
    if bound < 0:
        raise ValueError(f"bound must not be negative, got {bound}")
    return bound / measured


def layer_from_node(
    node: onnx.NodeProto,
    input_types: Sequence[TensorType | None],
    output_types: Sequence[TensorType | None],
    constants: Mapping[int, ConstInput] | Iterable[int] | None = None,
    *,
    index: int = 0,
) -> Layer:
    """Build a :class:`Layer` from a node and its types, without a loader.

    For tests and for graphs that did not come through :mod:`dlbricks.loading`.
    The digest is 16 zero bytes (not computed), so such layers must not be
    deduplicated by digest.

    Args:
        node: the ONNX node.
        input_types: one per ``node.input`` (None where the input is omitted).
        output_types: one per ``node.output``.
        constants: slot -> :class:`ConstInput`, or just the slots that are constant;
            those become ``role="weight"`` constants of the slot's type.
        index: the layer index.

    Returns:
        The layer.

    Raises:
        ValueError: a types list does not match the node's inputs or outputs.
    """
    if len(input_types) != len(node.input) or len(output_types) != len(node.output):
        raise ValueError(
            f"node {node.name or node.op_type!r}: {len(node.input)} inputs and "
            f"{len(node.output)} outputs, got {len(input_types)} and {len(output_types)} types"
        )
    if constants is None:
        consts: dict[int, ConstInput] = {}
    elif isinstance(constants, Mapping):
        consts = dict(constants)
    else:
        consts = {}
        for slot in constants:
            t = input_types[slot]
            if t is None:
                raise ValueError(f"constant slot {slot} has no type")
            consts[slot] = ConstInput(name=node.input[slot], type=t, role="weight")
    return Layer(
        index=index, name=node.name or f"{node.op_type}_{index}", op_type=node.op_type,
        domain=node.domain, node=node, inputs=tuple(node.input), outputs=tuple(node.output),
        input_types=tuple(input_types), output_types=tuple(output_types),
        constants=consts, digest=bytes(16),
    )
