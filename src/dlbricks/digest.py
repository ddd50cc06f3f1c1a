"""Layer identity: a 128-bit digest over a canonical, name-free byte form of a layer.

Two layers get the same digest exactly when they would run the same computation on
tensors of the same types: same operator (domain, type, schema version), same
attributes, same input/output types, same values for "param" constants. Weight values,
tensor names and node names never count. The byte layout is documented in
``docs/digests.md``; any change to it must bump :data:`LAYER_DIGEST_VERSION`
(digests key persisted results).
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
from typing import Iterable, Literal, Mapping, Sequence

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto

from dlbricks import _core
from dlbricks.loading.names import norm_domain
from dlbricks.model import ConstInput, TensorType
from dlbricks.versions import LAYER_DIGEST_VERSION

__all__ = [
    "LAYER_DIGEST_VERSION",
    "LAYER_MAGIC",
    "constant_role",
    "layer_canonical_bytes",
    "layer_digest",
    "qdq_group_digest",
]

LAYER_MAGIC = b"DLBRICKS-LAYER\x00"

# Both limits come from the extension, whose fast loader classifies constants by the
# same rule (cpp/include/dlbricks/limits.hpp).
# Scalars are "params" whatever their dtype (Clip bounds, a scalar Mul, Pad's constant
# value, Range's start/limit/delta...): cheap to compare, and they change what the op does.
PARAM_MAX_ELEMENTS: int = _core.PARAM_MAX_ELEMENTS
# int32/int64 constants up to this many elements are "params" too: ONNX uses these
# dtypes for shapes, axes, starts/ends, pads, repeats and indices, whose values change
# what the op computes (and a synthetic value could make the op fail).
INT_PARAM_MAX_ELEMENTS: int = _core.INT_PARAM_MAX_ELEMENTS
_INDEX_DTYPES = frozenset({TensorProto.INT32, TensorProto.INT64})
# Float inputs whose values shape the computation (resize factors), by (op, slot).
# Other small float vectors are weights: conv biases of 4 or 16 channels must not
# keep otherwise identical layers apart.
_FLOAT_PARAM_SLOTS = frozenset({("Resize", 1), ("Resize", 2), ("Upsample", 1)})

# Input tags.
_IN_OMITTED, _IN_ACTIVATION, _IN_WEIGHT, _IN_PARAM = 0, 1, 2, 3
# Output tags.
_OUT_OMITTED, _OUT_TYPED, _OUT_UNKNOWN = 0, 1, 2
# Reference kinds inside a subgraph.
_REF_OMITTED, _REF_INPUT, _REF_INIT, _REF_NODE, _REF_ENCLOSING, _REF_OUTER = 0, 1, 2, 3, 4, 5
# TypeProto kinds.
_TP_NONE, _TP_TENSOR, _TP_SEQUENCE, _TP_MAP, _TP_OPTIONAL, _TP_SPARSE = 0, 1, 2, 3, 4, 5

_CANONICAL_NAN32 = struct.pack("<I", 0x7FC00000)


def constant_role(t: TensorType, op_type: str = "", slot: int = -1) -> Literal["weight", "param"]:
    """Classify a constant layer input as a weight (identity by type) or a param (by value).

    Args:
        t: the constant's type.
        op_type: the default-domain op it feeds ("" when unknown).
        slot: the input slot it feeds (-1 when unknown).

    Returns:
        ``"param"`` for scalars, for int32/int64 tensors of at most 4096 elements, and
        for the scales/roi inputs of Resize and Upsample; ``"weight"`` otherwise.
    """
    n = t.numel
    if n <= PARAM_MAX_ELEMENTS:
        return "param"
    if t.elem_type in _INDEX_DTYPES and n <= INT_PARAM_MAX_ELEMENTS:
        return "param"
    if (op_type, slot) in _FLOAT_PARAM_SLOTS and n <= INT_PARAM_MAX_ELEMENTS:
        return "param"
    return "weight"


class _Writer:
    """Accumulates the canonical form; every integer is fixed-width little-endian."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def u8(self, v: int) -> None:
        self.parts.append(struct.pack("<B", v))

    def u32(self, v: int) -> None:
        self.parts.append(struct.pack("<I", v))

    def i64(self, v: int) -> None:
        self.parts.append(struct.pack("<q", v))

    def i64s(self, vs: Sequence[int]) -> None:
        self.parts.append(struct.pack(f"<{len(vs)}q", *vs))

    def f32(self, v: float) -> None:
        # All NaNs are one value; otherwise the IEEE bits (so -0.0 != 0.0).
        self.parts.append(_CANONICAL_NAN32 if math.isnan(v) else struct.pack("<f", v))

    def text(self, s: str | bytes) -> None:
        b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
        self.parts.append(struct.pack("<I", len(b)))
        self.parts.append(b)

    def raw(self, b: bytes) -> None:
        self.parts.append(b)

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


# Layers repeat a few types many times; keyed by (elem_type, shape) so that a lookup
# compares plain tuples (a TensorType's generated __eq__ runs Python code).
_TYPE_BYTES: dict[tuple[int, tuple[int, ...]], bytes] = {}
_CACHE_MAX = 1 << 16


def _tensor_type_bytes(t: TensorType) -> bytes:
    key = (t.elem_type, t.shape)
    b = _TYPE_BYTES.get(key)
    if b is None:
        n = len(t.shape)
        b = struct.pack(f"<II{n}q", t.elem_type, n, *t.shape)
        if len(_TYPE_BYTES) >= _CACHE_MAX:
            _TYPE_BYTES.clear()
        _TYPE_BYTES[key] = b
    return b


def _write_tensor_type(w: _Writer, t: TensorType) -> None:
    w.raw(_tensor_type_bytes(t))


def _write_values(w: _Writer, arr: np.ndarray) -> None:
    """Element values in C order; the element count follows from the shape written before."""
    if arr.dtype.kind in ("O", "U", "S"):
        for item in arr.reshape(-1).tolist():
            w.text(item)
        return
    a = np.ascontiguousarray(arr)
    if a.dtype.kind == "f" and a.size and np.isnan(a).any():
        a = a.copy()
        a[np.isnan(a)] = np.nan  # one NaN bit pattern
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    w.raw(a.tobytes())


def _write_tensor_proto(w: _Writer, t: TensorProto, *, values: bool) -> None:
    """dtype, dims, then a flag and (when ``values``) the element values."""
    w.u32(t.data_type)
    w.u32(len(t.dims))
    w.i64s(list(t.dims))
    if not values:
        w.u8(0)
        return
    if t.data_location == TensorProto.EXTERNAL:
        # The bytes live in another file that analysis never reads.
        w.u8(2)
        return
    w.u8(1)
    _write_values(w, onnx.numpy_helper.to_array(t))


def _write_sparse_proto(w: _Writer, sp: onnx.SparseTensorProto, *, values: bool) -> None:
    w.u32(len(sp.dims))
    w.i64s(list(sp.dims))
    _write_tensor_proto(w, sp.values, values=values)
    _write_tensor_proto(w, sp.indices, values=values)


def _write_type_proto(w: _Writer, tp: onnx.TypeProto) -> None:
    kind = tp.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        tt = getattr(tp, kind)
        w.u8(_TP_TENSOR if kind == "tensor_type" else _TP_SPARSE)
        w.u32(tt.elem_type)
        if not tt.HasField("shape"):
            w.u8(0)
            return
        w.u8(1)
        w.u32(len(tt.shape.dim))
        for d in tt.shape.dim:
            which = d.WhichOneof("value")
            if which == "dim_value":
                w.u8(1)
                w.i64(d.dim_value)
            elif which == "dim_param":
                w.u8(2)
                w.text(d.dim_param)
            else:
                w.u8(0)
    elif kind == "sequence_type":
        w.u8(_TP_SEQUENCE)
        _write_type_proto(w, tp.sequence_type.elem_type)
    elif kind == "optional_type":
        w.u8(_TP_OPTIONAL)
        _write_type_proto(w, tp.optional_type.elem_type)
    elif kind == "map_type":
        w.u8(_TP_MAP)
        w.u32(tp.map_type.key_type)
        _write_type_proto(w, tp.map_type.value_type)
    else:
        w.u8(_TP_NONE)


def _attr_type(a: AttributeProto) -> int:
    """The attribute's type; very old models leave ``type`` unset, so guess from the fields."""
    if a.type:
        return a.type
    for field, typ in (
        ("f", AttributeProto.FLOAT),
        ("i", AttributeProto.INT),
        ("s", AttributeProto.STRING),
        ("t", AttributeProto.TENSOR),
        ("g", AttributeProto.GRAPH),
        ("sparse_tensor", AttributeProto.SPARSE_TENSOR),
        ("tp", AttributeProto.TYPE_PROTO),
    ):
        if a.HasField(field):
            return typ
    for field, typ in (
        ("floats", AttributeProto.FLOATS),
        ("ints", AttributeProto.INTS),
        ("strings", AttributeProto.STRINGS),
        ("tensors", AttributeProto.TENSORS),
        ("graphs", AttributeProto.GRAPHS),
        ("sparse_tensors", AttributeProto.SPARSE_TENSORS),
        ("type_protos", AttributeProto.TYPE_PROTOS),
    ):
        if len(getattr(a, field)):
            return typ
    return AttributeProto.UNDEFINED


class _Scopes:
    """Name resolution for subgraphs: a stack of name->ref maps plus the outer table.

    Names defined outside the layer (the model tensors a control-flow body reads) get
    indices in order of first reference; the layer's canonical form ends with their types.
    """

    def __init__(self) -> None:
        self.stack: list[dict[str, tuple[int, ...]]] = []
        self.outer: dict[str, int] = {}

    def write_ref(self, w: _Writer, name: str) -> None:
        if not name:
            w.u8(_REF_OMITTED)
            return
        for depth, scope in enumerate(reversed(self.stack)):
            ref = scope.get(name)
            if ref is None:
                continue
            if depth:
                w.u8(_REF_ENCLOSING)
                w.u32(depth)
            w.u8(ref[0])
            for x in ref[1:]:
                w.u32(x)
            return
        idx = self.outer.setdefault(name, len(self.outer))
        w.u8(_REF_OUTER)
        w.u32(idx)


def _write_graph(w: _Writer, g: onnx.GraphProto, scopes: _Scopes) -> None:
    """A subgraph by structure only: wiring is by position, never by name."""
    scope: dict[str, tuple[int, ...]] = {}
    for i, vi in enumerate(g.input):
        scope[vi.name] = (_REF_INPUT, i)
    for j, init in enumerate(g.initializer):
        scope[init.name] = (_REF_INIT, j)
    n_dense = len(g.initializer)
    for j, sp in enumerate(g.sparse_initializer):
        scope[sp.values.name] = (_REF_INIT, n_dense + j)
    for k, node in enumerate(g.node):
        for s, out in enumerate(node.output):
            if out:
                scope[out] = (_REF_NODE, k, s)
    scopes.stack.append(scope)
    try:
        w.u32(len(g.input))
        for vi in g.input:
            _write_type_proto(w, vi.type)
        w.u32(n_dense + len(g.sparse_initializer))
        for init in g.initializer:
            t = TensorType(init.data_type, tuple(init.dims))
            _write_tensor_proto(w, init, values=constant_role(t) == "param")
        for sp in g.sparse_initializer:
            _write_sparse_proto(w, sp, values=False)
        w.u32(len(g.node))
        for node in g.node:
            w.text(norm_domain(node.domain))
            w.text(node.op_type)
            _write_attributes(w, node.attribute, scopes, defaults=None)
            ins = _strip_trailing(node.input)
            w.u32(len(ins))
            for name in ins:
                scopes.write_ref(w, name)
            outs = _strip_trailing(node.output)
            w.u32(len(outs))
            for name in outs:
                w.u8(1 if name else 0)
        w.u32(len(g.output))
        for vi in g.output:
            scopes.write_ref(w, vi.name)
            _write_type_proto(w, vi.type)
    finally:
        scopes.stack.pop()


def _write_attr_value(w: _Writer, a: AttributeProto, typ: int, scopes: _Scopes) -> None:
    A = AttributeProto
    if typ == A.FLOAT:
        w.f32(a.f)
    elif typ == A.INT:
        w.i64(a.i)
    elif typ == A.STRING:
        w.text(a.s)
    elif typ == A.TENSOR:
        _write_tensor_proto(w, a.t, values=True)
    elif typ == A.GRAPH:
        _write_graph(w, a.g, scopes)
    elif typ == A.SPARSE_TENSOR:
        _write_sparse_proto(w, a.sparse_tensor, values=True)
    elif typ == A.TYPE_PROTO:
        _write_type_proto(w, a.tp)
    elif typ == A.FLOATS:
        w.u32(len(a.floats))
        for f in a.floats:
            w.f32(f)
    elif typ == A.INTS:
        w.u32(len(a.ints))
        w.i64s(list(a.ints))
    elif typ == A.STRINGS:
        w.u32(len(a.strings))
        for s in a.strings:
            w.text(s)
    elif typ == A.TENSORS:
        w.u32(len(a.tensors))
        for t in a.tensors:
            _write_tensor_proto(w, t, values=True)
    elif typ == A.GRAPHS:
        w.u32(len(a.graphs))
        for g in a.graphs:
            _write_graph(w, g, scopes)
    elif typ == A.SPARSE_TENSORS:
        w.u32(len(a.sparse_tensors))
        for sp in a.sparse_tensors:
            _write_sparse_proto(w, sp, values=True)
    elif typ == A.TYPE_PROTOS:
        w.u32(len(a.type_protos))
        for tp in a.type_protos:
            _write_type_proto(w, tp)
    # UNDEFINED: the type tag alone.


def _attr_body(a: AttributeProto, scopes: _Scopes) -> bytes:
    """Type tag, reference flag and value of one attribute (its name excluded)."""
    w = _Writer()
    typ = _attr_type(a)
    w.u8(typ)
    if a.ref_attr_name:
        # Inside a function body: the value comes from the caller's attribute.
        w.u8(1)
        w.text(a.ref_attr_name)
    else:
        w.u8(0)
        _write_attr_value(w, a, typ, scopes)
    return w.getvalue()


@functools.lru_cache(maxsize=4096)
def _schema_defaults(op_type: str, op_version: int) -> dict[str, bytes]:
    """Canonical bodies of the default-domain schema's attribute defaults."""
    try:
        schema = onnx.defs.get_schema(op_type, op_version, "")
    except onnx.defs.SchemaError:
        return {}
    return schema_defaults_of(schema)


def schema_defaults_of(schema: onnx.defs.OpSchema) -> dict[str, bytes]:
    """Canonical bodies of an operator schema's attribute defaults, by attribute name."""
    out: dict[str, bytes] = {}
    for name, attr in schema.attributes.items():
        # onnx keeps each default serialized (``default_value`` parses it into a
        # protobuf object in Python): plain ones are canonicalised from those bytes in
        # C++, without that object. Empty bytes: no default.
        raw = getattr(attr, "_default_value", None)
        if raw is not None:
            if not raw:
                continue
            body = _core.canonical_attribute_body(raw)
            if body is not None:
                out[name] = body
                continue
        default = attr.default_value
        if default.type != AttributeProto.UNDEFINED:
            out[name] = _attr_body(default, _Scopes())
    return out


def _write_attributes(
    w: _Writer,
    attrs: Iterable[AttributeProto],
    scopes: _Scopes,
    defaults: Mapping[str, bytes] | None,
) -> None:
    entries: list[tuple[bytes, bytes]] = []
    # Encode in name order: subgraph bodies number outer names by first reference.
    for a in sorted(attrs, key=lambda a: a.name.encode("utf-8")):
        body = _attr_body(a, scopes)
        # An attribute spelled out at its schema default means the same as leaving it
        # out; exporters differ on this, so drop it.
        if defaults is not None and defaults.get(a.name) == body:
            continue
        entries.append((a.name.encode("utf-8"), body))
    w.u32(len(entries))
    for name, body in entries:
        w.text(name)
        w.raw(body)


def _strip_trailing(names: Sequence[str]) -> list[str]:
    """Trailing omitted optional inputs/outputs mean the same as leaving them off."""
    out = list(names)
    while out and not out[-1]:
        out.pop()
    return out


def layer_canonical_bytes(
    node: onnx.NodeProto,
    input_types: Sequence[TensorType | None],
    output_types: Sequence[TensorType | None],
    constants: Mapping[int, ConstInput] | None = None,
    *,
    op_version: int = 0,
    outer_types: Mapping[str, TensorType] | None = None,
) -> bytes:
    """The canonical byte form of one layer (see ``docs/digests.md``).

    Args:
        node: the layer's node; its domain, op type, attributes and which inputs and
            outputs are present (non-empty names) are used, never its names.
        input_types: one entry per ``node.input``: the type, or None for an omitted
            optional input.
        output_types: one entry per ``node.output``: the type, or None when the
            output is omitted or its type is unknown (an unused output).
        constants: input slot -> constant feeding it; weights count by type, params
            by type and value.
        op_version: the operator's schema version (``since_version`` for the default
            domain, the domain's opset otherwise); 0 when unknown.
        outer_types: types of model tensors that subgraph attributes (If/Loop/Scan
            bodies) read from the enclosing graph.

    Returns:
        The canonical bytes, starting with :data:`LAYER_MAGIC` and the version.

    Raises:
        ValueError: the type lists do not match the node, a present input has no
            type, or a param constant has no value.
    """
    constants = constants or {}
    if len(input_types) != len(node.input) or len(output_types) != len(node.output):
        raise ValueError(
            f"node {node.name!r} ({node.op_type}): {len(node.input)} inputs and "
            f"{len(node.output)} outputs, got {len(input_types)} input types and "
            f"{len(output_types)} output types"
        )
    return _canonical_bytes(
        node.domain,
        node.op_type,
        node.attribute,
        node.name,
        tuple(node.input),
        tuple(node.output),
        input_types,
        output_types,
        constants,
        op_version,
        outer_types,
    )


_U32 = struct.Struct("<I").pack
_IN_OMITTED_B, _IN_ACTIVATION_B, _IN_WEIGHT_B, _IN_PARAM_B = (bytes([t]) for t in range(4))
_OUT_OMITTED_B, _OUT_TYPED_B, _OUT_UNKNOWN_B = (bytes([t]) for t in range(3))
_U32_SMALL = [_U32(n) for n in range(64)]
# (domain, op_type, op_version, serialized attributes) -> (head bytes, outer names).
_HEADS: dict[tuple[str, str, int, tuple[bytes, ...]], tuple[bytes, tuple[str, ...]]] = {}
# Attributes bigger than this (subgraph bodies, tensors) are not kept as cache keys.
_HEAD_KEY_MAX_BYTES = 4096


def _head(
    raw_domain: str, op_type: str, attrs: Sequence[AttributeProto], op_version: int
) -> tuple[bytes, tuple[str, ...]]:
    """:func:`make_head`, cached: both results follow from the operator and the
    attributes' serialized bytes alone (subgraph bodies included), so layers that repeat
    them share one computation."""
    attr_bytes = tuple([a.SerializeToString() for a in attrs]) if len(attrs) else ()
    key = (raw_domain, op_type, op_version, attr_bytes)
    hit = _HEADS.get(key)
    if hit is not None:
        return hit
    hit = make_head(raw_domain, op_type, attrs, op_version)
    if sum(map(len, attr_bytes)) <= _HEAD_KEY_MAX_BYTES:
        if len(_HEADS) >= _CACHE_MAX:
            _HEADS.clear()
        _HEADS[key] = hit
    return hit


def make_head(
    raw_domain: str, op_type: str, attrs: Sequence[AttributeProto], op_version: int
) -> tuple[bytes, tuple[str, ...]]:
    """Magic, version, operator and attributes (the start of a layer's canonical form),
    and the outer names the attributes read. Uncached: callers that key heads
    themselves (the fast loader's head table) skip :func:`_head`'s re-serialisation."""
    domain = norm_domain(raw_domain)
    w = _Writer()
    w.raw(head_prefix(domain, op_type, op_version))
    scopes = _Scopes()
    defaults = _schema_defaults(op_type, op_version) if domain == "" and op_version > 0 else None
    _write_attributes(w, attrs, scopes, defaults)
    return w.getvalue(), tuple(scopes.outer)  # dicts keep first-reference order


def make_head_from_fields(op_type: str, op_version: int, attribute_fields: bytes) -> bytes | None:
    """:func:`make_head` of a default-domain op whose attributes come as serialized
    NodeProto attribute fields, made in C++ when every attribute is plain (numbers,
    strings and lists of them: nearly every layer), without building protobuf objects.
    None: an attribute is not plain (tensor, graph, reference, type left unset...); use
    :func:`make_head` on the parsed attributes. Such heads never read outer names.

    One head at a time, the same C++ canonicalisation the fast loader runs for all of
    a model's new heads in one call (``OnnxScan.set_plain_heads``); the tests hold it
    equal to :func:`make_head` over every node onnx ships."""
    prefix, defaults = plain_head_parts(op_type, op_version)
    body = _core.canonical_attributes(attribute_fields, defaults)
    return None if body is None else prefix + body


def plain_head_parts(op_type: str, op_version: int) -> tuple[bytes, dict[str, bytes] | None]:
    """What C++ needs to make the plain heads of a default-domain op (see
    :func:`make_head_from_fields`, ``OnnxScan.set_plain_heads``): the prefix every head
    of the op starts with (magic, version, operator), and the canonical bodies of the
    schema's attribute defaults (None without a schema version)."""
    defaults = _schema_defaults(op_type, op_version) if op_version > 0 else None
    return head_prefix("", op_type, op_version), defaults


@functools.lru_cache(maxsize=4096)
def head_prefix(domain: str, op_type: str, op_version: int) -> bytes:
    """Magic, version, operator: the start of every head of this operator."""
    w = _Writer()
    w.raw(LAYER_MAGIC)
    w.u32(LAYER_DIGEST_VERSION)
    w.text(domain)
    w.text(op_type)
    w.i64(op_version)
    return w.getvalue()


def _canonical_bytes(
    raw_domain: str,
    op_type: str,
    attrs: Sequence[AttributeProto],
    node_name: str,
    ins: tuple[str, ...],
    outs: tuple[str, ...],
    input_types: Sequence[TensorType | None],
    output_types: Sequence[TensorType | None],
    constants: Mapping[int, ConstInput] | None,
    op_version: int,
    outer_types: Mapping[str, TensorType] | None,
) -> bytes:
    """:func:`layer_canonical_bytes` from a node's fields, read once by the caller."""
    head, outer = _head(raw_domain, op_type, attrs, op_version)
    parts = [head]
    append = parts.append
    type_bytes = _TYPE_BYTES

    n_in = len(ins)
    while n_in and not ins[n_in - 1]:
        n_in -= 1
    append(_U32_SMALL[n_in] if n_in < 64 else _U32(n_in))
    for slot in range(n_in):
        if not ins[slot]:
            append(_IN_OMITTED_B)
            continue
        t = input_types[slot]
        if t is None:
            raise ValueError(f"node {node_name!r} ({op_type}): input {slot} has no type")
        c = constants.get(slot) if constants else None
        if c is None:
            append(_IN_ACTIVATION_B)
        elif c.role == "weight":
            append(_IN_WEIGHT_B)
        else:
            if c.value is None:
                raise ValueError(f"node {node_name!r} ({op_type}): param input {slot} has no value")
            append(_IN_PARAM_B)
            append(_tensor_type_bytes(t))
            w = _Writer()
            _write_values(w, np.asarray(c.value))
            append(w.getvalue())
            continue
        b = type_bytes.get((t.elem_type, t.shape))
        append(b if b is not None else _tensor_type_bytes(t))

    n_out = len(outs)
    while n_out and not outs[n_out - 1]:
        n_out -= 1
    append(_U32_SMALL[n_out] if n_out < 64 else _U32(n_out))
    for slot in range(n_out):
        t = output_types[slot]
        if not outs[slot]:
            append(_OUT_OMITTED_B)
        elif t is None:
            append(_OUT_UNKNOWN_B)
        else:
            append(_OUT_TYPED_B)
            b = type_bytes.get((t.elem_type, t.shape))
            append(b if b is not None else _tensor_type_bytes(t))

    append(_U32_SMALL[len(outer)] if len(outer) < 64 else _U32(len(outer)))
    for name in outer:
        t = outer_types.get(name) if outer_types is not None else None
        if t is None:
            append(b"\x00")
        else:
            append(b"\x01")
            append(_tensor_type_bytes(t))
    return b"".join(parts)


def layer_digest(
    node: onnx.NodeProto,
    input_types: Sequence[TensorType | None],
    output_types: Sequence[TensorType | None],
    constants: Mapping[int, ConstInput] | None = None,
    *,
    op_version: int = 0,
    outer_types: Mapping[str, TensorType] | None = None,
) -> bytes:
    """The 16-byte layer digest: BLAKE2b-128 of :func:`layer_canonical_bytes`.

    Args:
        node: see :func:`layer_canonical_bytes`.
        input_types: see :func:`layer_canonical_bytes`.
        output_types: see :func:`layer_canonical_bytes`.
        constants: see :func:`layer_canonical_bytes`.
        op_version: see :func:`layer_canonical_bytes`.
        outer_types: see :func:`layer_canonical_bytes`.

    Returns:
        16 bytes.

    Raises:
        ValueError: as :func:`layer_canonical_bytes`.
    """
    data = layer_canonical_bytes(
        node, input_types, output_types, constants, op_version=op_version, outer_types=outer_types
    )
    return hashlib.blake2b(data, digest_size=16).digest()



def layer_digest_fields(
    raw_domain: str,
    op_type: str,
    attrs: Sequence[AttributeProto],
    node_name: str,
    ins: tuple[str, ...],
    outs: tuple[str, ...],
    input_types: Sequence[TensorType | None],
    output_types: Sequence[TensorType | None],
    constants: Mapping[int, ConstInput] | None,
    op_version: int,
    outer_types: Mapping[str, TensorType] | None,
) -> bytes:
    """:func:`layer_digest` for the loader, which has read the node's fields once and
    built one type per input and output."""
    data = _canonical_bytes(
        raw_domain, op_type, attrs, node_name, ins, outs, input_types, output_types, constants, op_version, outer_types
    )
    return hashlib.blake2b(data, digest_size=16).digest()


QDQ_GROUP_MAGIC = b"DLBRICKS-QDQGRP\x00"


def qdq_group_digest(
    core: bytes, input_dqs: Sequence[bytes | None], output_qs: Sequence[bytes | None]
) -> bytes:
    """The digest of a QDQ group layer (:mod:`dlbricks.loading.qdq`) from its members' digests.

    Canonical form: :data:`QDQ_GROUP_MAGIC`, the op's 16-byte digest, then u32 count and,
    per input slot of the op, ``0x00`` or ``0x01`` + the digest of the DequantizeLinear
    feeding it, then the same for output slots and their QuantizeLinear. Member digests
    are layer digests whose DQ/Q constants (quantized weights, scales, zero points) are
    weights: identity by dtype and shape, never by value. A new magic, so no digest of a
    plain layer can equal a group's.

    Args:
        core: the op's layer digest (its inputs typed as the DQs' float outputs).
        input_dqs: per input slot of the op, its DQ's layer digest or None.
        output_qs: per output slot of the op, its Q's layer digest or None.

    Returns:
        16 bytes.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(QDQ_GROUP_MAGIC)
    h.update(bytes(core))
    for members in (input_dqs, output_qs):
        h.update(struct.pack("<I", len(members)))
        for d in members:
            h.update(b"\x00" if d is None else b"\x01" + bytes(d))
    return h.digest()
