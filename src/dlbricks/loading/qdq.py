"""QDQ groups: a quantized op as onnxruntime runs it, as one layer.

A QDQ model (onnxruntime's ``quantize_static`` in QDQ format, most exporters' INT8
models) writes each quantized op in float between DequantizeLinear and
QuantizeLinear nodes: ``DQ(x_q) -> Conv(DQ(w_int8), DQ(b_int32)) -> Q``. onnxruntime
fuses that unit into one kernel (QLinearConv, QLinearMatMul, QLinearAdd...) or drops
its Q/DQ (MaxPool, Reshape...). Folding ``DQ(w_int8)`` into a float weight, or timing
the DQ, the op and the Q apart, would time something onnxruntime never runs.

So the loader keeps a DequantizeLinear of a constant integer tensor (it is not
folded), and a group becomes one layer (:class:`QdqLayer`): the DequantizeLinear
nodes feeding an op, the op, and the QuantizeLinear consuming each of its outputs
when it is that output's only reader. Its slots keep the op's: input slot ``s`` is
the op's input ``s``, or the quantized tensor its DQ reads (same shape); the DQs'
and Qs' scales and zero points follow as extra slots. Output slot ``o`` is the op's
output ``o``, or the Q's output. The group's digest
(:func:`dlbricks.digest.qdq_group_digest`) covers every member; a brick holds the
members (:attr:`QdqLayer.members`), so onnxruntime fuses the brick as it fuses the
model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto

from dlbricks.model import Layer

__all__ = ["QUANTIZED_ELEM_TYPES", "Group", "QdqLayer", "is_qdq_op", "plan_groups"]

# Element types of quantized data: a DequantizeLinear of a constant of these types
# stays in the graph (INT32: biases).
QUANTIZED_ELEM_TYPES = frozenset(
    {
        TensorProto.INT8,
        TensorProto.UINT8,
        TensorProto.INT16,
        TensorProto.UINT16,
        TensorProto.INT32,
        TensorProto.INT4,
        TensorProto.UINT4,
    }
)

_DQ, _Q = "DequantizeLinear", "QuantizeLinear"


def is_qdq_op(op_type: str, domain: str) -> bool:
    """A default-domain QuantizeLinear or DequantizeLinear."""
    return domain == "" and op_type in (_DQ, _Q)


@dataclass(slots=True)
class QdqLayer(Layer):
    """A QDQ group as one layer; ``node`` is the group's op (its attributes), and
    ``members`` every node of the group in order: input DQs, the op, output Qs."""

    members: tuple[onnx.NodeProto, ...] = field(default=())


@dataclass(slots=True)
class Group:
    """One planned group: node ids of the loader's node list."""

    core: int
    in_dq: dict[int, int]  # the op's input slot -> the DQ node feeding it
    out_q: dict[int, int]  # the op's output slot -> the Q node that alone reads it

    def member_ids(self) -> list[int]:
        dqs = list(dict.fromkeys(self.in_dq[s] for s in sorted(self.in_dq)))
        return dqs + [self.core] + [self.out_q[s] for s in sorted(self.out_q)]

    def boundary(
        self, ins: Sequence[tuple[str, ...]], outs: Sequence[tuple[str, ...]]
    ) -> tuple[tuple[str, ...], tuple[str, ...], set[int], set[int]]:
        """(inputs, outputs, slots read by a DQ or Q, of those the scale/zero-point slots)."""
        core_ins = ins[self.core]
        b_ins: list[str] = []
        quant: set[int] = set()
        for s, t in enumerate(core_ins):
            d = self.in_dq.get(s)
            if d is None:
                b_ins.append(t)
            else:
                quant.add(s)
                b_ins.append(ins[d][0])
        qparams: set[int] = set()
        extra = [ins[self.in_dq[s]][1:] for s in sorted(self.in_dq)]
        extra += [ins[self.out_q[s]][1:] for s in sorted(self.out_q)]
        for names in extra:
            for t in names:
                if t:
                    qparams.add(len(b_ins))
                b_ins.append(t)
        b_outs = tuple(outs[self.out_q[o]][0] if o in self.out_q else t for o, t in enumerate(outs[self.core]))
        return tuple(b_ins), b_outs, quant | qparams, qparams


def plan_groups(
    layer_ids: Sequence[int],
    ops: Sequence[str],
    doms: Sequence[str],
    ins: Sequence[tuple[str, ...]],
    outs: Sequence[tuple[str, ...]],
    readers: Mapping[str, list[tuple[int, int]]],
    producer: Mapping[str, tuple[int, int]],
    graph_outputs: set[str],
    opaque: Sequence[bool],
) -> tuple[dict[int, Group], set[int]]:
    """The QDQ groups among the nodes ``layer_ids`` (those not folded) and the nodes
    they absorb (which are then no layers of their own).

    ``readers`` maps a tensor to every (node, input slot) reading it (slot -1 for a
    subgraph's outer reference). A DQ shared by several groups is a member of each, as
    onnxruntime gives each node unit its own DQ; it stays a layer of its own too when
    anything else reads its output.
    """
    is_layer = set(layer_ids)
    groups: dict[int, Group] = {}
    for i in layer_ids:
        if opaque[i] or doms[i] != "" or ops[i] in (_DQ, _Q):
            continue
        in_dq: dict[int, int] = {}
        for s, t in enumerate(ins[i]):
            p = producer.get(t) if t else None
            if p is not None and p[0] in is_layer and is_qdq_op(ops[p[0]], doms[p[0]]) and ops[p[0]] == _DQ:
                in_dq[s] = p[0]
        if not in_dq:
            continue
        out_q: dict[int, int] = {}
        for o, t in enumerate(outs[i]):
            rs = readers.get(t, []) if t else []
            if len(rs) == 1 and t not in graph_outputs:
                q, slot = rs[0]
                if slot == 0 and ops[q] == _Q and doms[q] == "" and q in is_layer:
                    out_q[o] = q
        groups[i] = Group(i, in_dq, out_q)
    absorbed: set[int] = set()
    for g in groups.values():
        absorbed.update(g.out_q.values())
        for d in g.in_dq.values():
            t = outs[d][0]
            if t not in graph_outputs and all(r in groups and s >= 0 for r, s in readers.get(t, [])):
                absorbed.add(d)
    return groups, absorbed
