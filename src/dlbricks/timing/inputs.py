"""Seeded, dtype-correct synthetic inputs for a model or a session."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from dlbricks.errors import DlbricksError
from dlbricks.timing.session import SerializedModel, model_label

if TYPE_CHECKING:  # pragma: no cover
    import onnx

# ORT type strings of session inputs -> numpy dtypes.
ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int8)": np.int8,
    "tensor(int16)": np.int16,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
    "tensor(uint8)": np.uint8,
    "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
    "tensor(string)": np.str_,
}
# Floats are drawn from [-1, 1] with magnitudes below this pushed up to it: tiny values
# would be subnormal in float16 (whose smallest normal is ~6.1e-5).
_FLOAT_FLOOR = 1e-3


@dataclass(frozen=True)
class _InputSpec:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]


def _load_proto(source: Any) -> onnx.ModelProto:
    import onnx

    if isinstance(source, onnx.ModelProto):
        return source
    if isinstance(source, (bytes, bytearray)):
        return onnx.load_from_string(bytes(source))
    if isinstance(source, SerializedModel):  # the graph; its weights are elsewhere
        return onnx.load_from_string(source.data)
    try:
        # Weights are not needed to read the graph; skip external data.
        return onnx.load(os.fspath(source), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, OSError, ... for bad files
        raise DlbricksError(f"{source}: cannot read ONNX model: {exc}") from exc


def _is_session(obj: Any) -> bool:
    return hasattr(obj, "get_inputs") and hasattr(obj, "run")


def _static_shape(dims: Any) -> tuple[int, ...]:
    # Symbolic or unknown dimensions become 1: bricks are static, and 1 is the only
    # size valid for every dimension a model may constrain (batch, sequence...).
    return tuple(d if isinstance(d, int) and d >= 0 else 1 for d in dims)


def _specs_from_session(session: Any) -> list[_InputSpec]:
    specs = []
    for inp in session.get_inputs():
        dtype = ORT_TYPES.get(inp.type)
        if dtype is None:
            raise DlbricksError(f"input {inp.name!r}: cannot synthesise values of type {inp.type}")
        specs.append(_InputSpec(inp.name, np.dtype(dtype), _static_shape(inp.shape)))
    return specs


def _proto_dims(type_proto: Any) -> tuple[int | None, ...] | None:
    if not type_proto.HasField("tensor_type") or not type_proto.tensor_type.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else None for d in type_proto.tensor_type.shape.dim)


def _specs_from_proto(model: onnx.ModelProto) -> list[_InputSpec]:
    import onnx.helper

    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        if not vi.type.HasField("tensor_type"):
            raise DlbricksError(f"input {vi.name!r}: only tensor inputs can be synthesised")
        elem = vi.type.tensor_type.elem_type
        try:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
        except Exception as exc:
            raise DlbricksError(f"input {vi.name!r}: unsupported element type {elem}") from exc
        if elem == onnx.TensorProto.STRING:
            dtype = np.dtype(np.str_)
        dims = _proto_dims(vi.type) or ()
        specs.append(_InputSpec(vi.name, dtype, _static_shape(dims)))
    return specs


def _known_shapes(model: onnx.ModelProto, infer: bool) -> dict[str, tuple[int | None, ...]]:
    g = model.graph
    shapes: dict[str, tuple[int | None, ...]] = {}
    for t in g.initializer:
        shapes[t.name] = tuple(t.dims)
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        dims = _proto_dims(vi.type)
        if dims is not None:
            shapes.setdefault(vi.name, dims)
    for node in g.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    shapes[node.output[0]] = tuple(a.t.dims)
    if infer:
        import onnx.shape_inference

        try:
            inferred = onnx.shape_inference.infer_shapes(model)
        except Exception:  # shape inference is a best effort: fall back to what we know
            return shapes
        for vi in inferred.graph.value_info:
            dims = _proto_dims(vi.type)
            if dims is not None:
                shapes.setdefault(vi.name, dims)
    return shapes


def _attr_int(node: Any, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


def _dim(shapes: Mapping[str, tuple[int | None, ...]], tensor: str, axis: int) -> int | None:
    dims = shapes.get(tensor)
    if not dims:
        return None
    if axis < 0:
        axis += len(dims)
    if not 0 <= axis < len(dims):
        return None
    d = dims[axis]
    return d if isinstance(d, int) and d > 0 else None


def _index_bounds(model: onnx.ModelProto, names: set[str]) -> dict[str, tuple[int, int]]:
    """Value ranges [low, high) for integer inputs that index into another tensor.

    Looks at each input's direct consumers: Gather/GatherElements/Scatter* indices
    must lie within the indexed axis of the data operand, GatherND/ScatterND
    indices within the dims they address, TopK's k within [1, axis size]. The
    tightest bound over all consumers wins.
    """
    consumers: dict[str, list[tuple[Any, int]]] = {n: [] for n in names}
    for node in model.graph.node:
        for slot, inp in enumerate(node.input):
            if inp in consumers:
                consumers[inp].append((node, slot))
    need_infer = any(consumers.values())
    shapes = _known_shapes(model, infer=need_infer)
    out: dict[str, tuple[int, int]] = {}
    for name, uses in consumers.items():
        low, high = 0, None
        for node, slot in uses:
            op, data = node.op_type, node.input[0] if node.input else ""
            bound = None
            if op in ("Gather", "GatherElements", "ScatterElements", "Scatter") and slot == 1:
                bound = _dim(shapes, data, _attr_int(node, "axis", 0))
            elif op in ("GatherND", "ScatterND") and slot == 1:
                b = _attr_int(node, "batch_dims", 0)
                idx = shapes.get(name) or ()
                m = idx[-1] if idx and isinstance(idx[-1], int) else None
                ddims = shapes.get(data)
                if m and ddims and len(ddims) >= b + m:
                    sub = [d for d in ddims[b : b + m] if isinstance(d, int) and d > 0]
                    bound = min(sub) if len(sub) == m else None
            elif op == "TopK" and slot == 1:
                size = _dim(shapes, data, _attr_int(node, "axis", -1))
                if size is not None:
                    low, bound = 1, size + 1
            elif op == "OneHot" and slot == 1:
                low = 1  # depth must be positive
            if bound is not None:
                high = bound if high is None else min(high, bound)
        if high is not None:
            out[name] = (low, max(high, low + 1))
        elif low:
            out[name] = (low, low + 1)
    return out


def make_inputs(
    source: Any,
    seed: int = 0,
    *,
    int_bounds: Mapping[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """Synthesise seeded, dtype-correct inputs for a model.

    Floats are uniform in [-1, 1] with magnitudes below 1e-3 raised to 1e-3, so no
    value is subnormal even in float16; they repeat a seeded block of 64K values, as
    synthetic weights do (:func:`dlbricks.bricks.repeating_uniform`). Booleans are
    fair coin flips. Integers must often index something, so they are non-negative
    and bounded: by ``int_bounds``
    when given (values in ``[0, bound)``), else by what the graph shows (Gather's
    indexed axis, TopK's axis for k...; needs a model, not a session), else by the
    smallest static dimension of any input or initializer (valid for every axis).
    Each input draws from its own stream seeded by ``(seed, position)``.
    Symbolic dimensions are taken as 1.

    Args:
        source: an ``onnxruntime.InferenceSession``, an ``onnx.ModelProto``,
            serialized bytes or a path.
        seed: the random seed.
        int_bounds: exclusive upper bounds for named integer inputs.

    Returns:
        Input name -> array, in the model's input order.

    Raises:
        DlbricksError: the model cannot be read or an input type is unsupported.
    """
    from dlbricks.bricks import repeating_uniform

    int_bounds = dict(int_bounds or {})
    proto = None
    if _is_session(source):
        specs = _specs_from_session(source)
    else:
        proto = _load_proto(source)
        specs = _specs_from_proto(proto)

    def is_int(s: _InputSpec) -> bool:
        return s.dtype.kind in "iu"

    unbounded = {s.name for s in specs if is_int(s) and s.name not in int_bounds}
    graph_bounds = _index_bounds(proto, unbounded) if (proto is not None and unbounded) else {}
    default_high = _default_int_high(proto, specs)

    out: dict[str, np.ndarray] = {}
    for pos, spec in enumerate(specs):
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, pos])
        kind = spec.dtype.kind
        if kind == "f":
            n = int(np.prod(spec.shape, dtype=np.int64))
            x = repeating_uniform(rng, n, -1.0, 1.0, floor=_FLOAT_FLOOR).reshape(spec.shape)
            out[spec.name] = x.astype(spec.dtype, copy=False)
        elif kind == "b":
            out[spec.name] = rng.random(size=spec.shape) < 0.5
        elif kind in "iu":
            if spec.name in int_bounds:
                low, high = 0, int(int_bounds[spec.name])
                if high < 1:
                    raise DlbricksError(f"input {spec.name!r}: int bound must be >= 1, got {high}")
            else:
                low, high = graph_bounds.get(spec.name, (0, default_high))
            high = min(high, int(np.iinfo(spec.dtype).max) + 1)
            out[spec.name] = rng.integers(low, high, size=spec.shape, dtype=np.int64).astype(spec.dtype)
        elif kind == "U":
            out[spec.name] = np.full(spec.shape, "a", dtype=object)
        else:
            raise DlbricksError(f"input {spec.name!r}: cannot synthesise values of dtype {spec.dtype}")
    return out


def _default_int_high(proto: Any, specs: list[_InputSpec]) -> int:
    dims = [d for s in specs for d in s.shape if d > 0]
    if proto is not None:
        dims += [int(d) for t in proto.graph.initializer for d in t.dims if d > 0]
    return max(1, min(dims)) if dims else 1


def session_feeds(
    session: Any,
    model: Any,
    inputs: Mapping[str, np.ndarray] | None,
    seed: int,
    int_bounds: Mapping[str, int] | None,
) -> dict[str, np.ndarray]:
    """Inputs for ``session``: the ``inputs`` given, the rest synthesised with
    :func:`make_inputs` (from the graph of ``model`` when integer inputs need bounds).

    Raises:
        DlbricksError: ``inputs`` names an input the session does not have.
    """
    given = dict(inputs or {})
    names = [i.name for i in session.get_inputs()]
    unknown = set(given) - set(names)
    if unknown:
        raise DlbricksError(f"{model_label(model)}: no input named {sorted(unknown)} (inputs: {names})")
    if all(n in given for n in names):
        return {n: np.asarray(given[n]) for n in names}
    need_graph = any(
        np.dtype(ORT_TYPES.get(i.type, np.float32)).kind in "iu"
        and i.name not in given
        and i.name not in (int_bounds or {})
        for i in session.get_inputs()
    )
    # The graph tells which integer inputs index what; only read it when needed.
    source = model if need_graph else session
    made = make_inputs(source, seed, int_bounds=int_bounds)
    return {n: np.asarray(given[n]) if n in given else made[n] for n in names}
