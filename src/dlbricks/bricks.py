"""Brick generation: each unique layer sequence becomes a standalone, runnable ONNX model.

A brick holds the sequence's nodes with their attributes. Weights are synthesised
(seeded from the brick's digest, so a brick's bytes are reproducible) or, for checks
against the source model, taken from it. Parameter-like constants (Reshape's shape,
Slice's starts, tiny constants) are copied by value. Every activation entering from
outside the window becomes a graph input with a concrete shape; every value a member
produces and no member consumes becomes a graph output.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Literal, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dlbricks import _core
from dlbricks.digest import constant_role
from dlbricks.errors import ArgumentError, ArgumentTypeError, DlbricksError, UsageError
from dlbricks.loading.names import is_default_domain, onnxruntime_onnx_op, outer_names
from dlbricks.model import Layer, Model, ModelLike, TensorType

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.progress import Progress
    from dlbricks.weight_pool import PoolWindow

WeightsMode = Literal["synthetic", "source"]

# Ops whose integer input indexes a dimension of another input: (index slot, data slot,
# axis attribute or None for "axis 0 of the data", default axis). The runner keeps such
# synthetic inputs inside the indexed dimension.
_INDEXING_OPS: dict[str, tuple[int, int, str | None, int]] = {
    "Gather": (1, 0, "axis", 0),
    "GatherElements": (1, 0, "axis", 0),
    "ScatterElements": (1, 0, "axis", 0),
    "Scatter": (1, 0, "axis", 0),
    "GatherND": (1, 0, None, 0),
    "ScatterND": (1, 0, None, 0),
    "Embedding": (1, 0, None, 0),
}

# Inputs that must be positive for the op to be valid (op type -> slots).
_POSITIVE_SLOTS: dict[str, tuple[int, ...]] = {
    "BatchNormalization": (1, 4),  # scale (kept near 1) and variance > 0
    "InstanceNormalization": (1,),
    "LayerNormalization": (1,),
    "GroupNormalization": (1,),
}


@dataclass(slots=True)
class BrickInfo:
    """What the manifest records for one generated brick."""

    digest: str
    G: int
    layers: int
    op_types: list[str]
    inputs: dict[str, str]  # graph input name -> type, e.g. "float32[1x64x56x56]"
    outputs: dict[str, str]
    int_bounds: dict[str, int] = field(default_factory=dict)  # integer input -> exclusive bound
    occurrences: dict[str, int] = field(default_factory=dict)  # model name -> count
    weight_bytes: int = 0
    file: str = ""
    source_model: str = ""
    source_layers: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _seed_from(digest: bytes | str, seed: int) -> int:
    raw = bytes.fromhex(digest) if isinstance(digest, str) else bytes(digest)
    return (int.from_bytes(raw[:8], "little") ^ (seed * 0x9E3779B97F4A7C15)) & (2**63 - 1)


_BLOCK = 1 << 16  # synthetic tensors repeat a seeded block of this many values


def repeating_uniform(rng: np.random.Generator, n: int, low: float, high: float, *, floor: float = 0.0) -> np.ndarray:
    """``n`` float32 values uniform in [low, high), magnitudes below ``floor`` raised
    to it, repeating a seeded block of 64K values.

    Dense kernels do not care that values repeat, and a tensor then costs one
    allocation of its own size: drawing every value in float64 and fixing it up
    allocated five times that in temporaries, and on a VM whose fresh pages are
    slow to fault in, zeroing those pages was half of a worker's session set-up.
    """
    block = rng.uniform(low, high, size=min(n, _BLOCK)).astype(np.float32)
    if floor > 0:
        small = np.abs(block) < floor
        block[small] = np.copysign(np.float32(floor), block[small])
    return np.resize(block, n) if n > _BLOCK else block


def weight_range(ttype: TensorType, *, op_type: str = "", slot: int = -1) -> tuple[float, float]:
    """The interval a synthetic weight of this type is drawn from (see :func:`synthesize`):
    integers [0, 4); inputs that must be positive (BatchNormalization's variance and
    scale) [0.5, 1.5]; multi-dimensional floats uniform with variance ``1/fan_in``, so
    activations keep their magnitude through a brick; other floats [-0.1, 0.1]."""
    if np.issubdtype(ttype.dtype, np.integer):
        return 0.0, 4.0
    if slot in _POSITIVE_SLOTS.get(op_type, ()):
        return 0.5, 1.5
    shape = ttype.shape
    if len(shape) >= 2:
        fan_in = max(1, int(np.prod(shape[1:], dtype=np.int64)))
        high = float(np.sqrt(3.0 / fan_in))
        return -high, high
    return -0.1, 0.1


def synthesize(ttype: TensorType, rng: np.random.Generator, *, op_type: str = "", slot: int = -1) -> np.ndarray:
    """A synthetic weight: dtype-correct, seeded, and in a numerically benign range.

    Floats never come near the denormal range; the range is :func:`weight_range`'s.
    Values repeat a seeded block of 64K: dense kernels do not care, and it keeps
    generating VGG-19's 400 MB of weights fast.
    """
    dtype = ttype.dtype
    shape = ttype.shape
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    low, high = weight_range(ttype, op_type=op_type, slot=slot)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(int(low), int(high), size=shape).astype(dtype)
    return repeating_uniform(rng, ttype.numel, low, high).reshape(shape).astype(dtype, copy=False)


def _value_info(name: str, ttype: TensorType) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, ttype.elem_type, list(ttype.shape))


def _int_bound(layer: Layer, slot: int) -> int | None:
    spec = _INDEXING_OPS.get(layer.op_type)
    if spec is None or spec[0] != slot:
        return None
    _, data_slot, axis_attr, default_axis = spec
    data_type = layer.input_types[data_slot] if data_slot < len(layer.input_types) else None
    if data_type is None or not data_type.shape:
        return None
    axis = default_axis
    if axis_attr is not None:
        for a in layer.node.attribute:
            if a.name == axis_attr:
                axis = a.i
    axis = axis % len(data_type.shape)
    return int(data_type.shape[axis])


def generate_brick(
    model: Model,
    members: Sequence[int] | np.ndarray,
    *,
    weights: WeightsMode = "synthetic",
    seed: int = 0,
    digest: bytes | str = b"\0" * 16,
    G: int = 0,
    weights_file: str | os.PathLike[str] | None = None,
    pool: PoolWindow | None = None,
) -> tuple[onnx.ModelProto, BrickInfo]:
    """Build one brick: the layers ``members`` of ``model`` as a standalone ONNX model.

    Args:
        model: the loaded source model.
        members: layer indices (built in topological order whatever order they come in).
        weights: "synthetic" (seeded from ``digest`` and ``seed``) or "source" (the real
            values, via ``model.constant_value``).
        seed: user seed mixed into the synthetic weights.
        digest: the sequence digest (names the brick, seeds its weights).
        G: the granularity the brick was split at (recorded only).
        weights_file: if given, weights are written there (raw, page-aligned) and the
            model refers to them as ONNX external data by the file's base name, so the
            model must be saved in the same folder. Keeps big weights out of protobuf,
            which would copy them several times.

    Returns:
        (ModelProto, BrickInfo).
    Raises:
        DlbricksError: ``members`` is empty, names a missing layer or one twice;
            ``weights`` is neither mode; ``model`` is not a loaded Model.
    """
    if not hasattr(model, "layers"):
        raise ArgumentTypeError(f"generate_brick() takes a loaded Model (dlbricks.load), got {type(model).__name__}")
    if weights not in ("synthetic", "source"):
        raise ArgumentError(f"weights must be 'synthetic' or 'source', got {weights!r}")
    if isinstance(members, (str, bytes)) or not all(isinstance(i, (int, np.integer)) for i in members):
        raise ArgumentTypeError(f"{model.name}: members must be layer indices (ints), got {members!r}")
    if len(members) == 0:
        raise DlbricksError(f"{model.name}: a brick needs at least one layer")
    if len(set(int(i) for i in members)) != len(members):
        raise ArgumentError(f"{model.name}: members name a layer twice: {list(members)}")
    layers: list[Layer] = []
    for i in members:
        if not 0 <= int(i) < len(model.layers):
            raise DlbricksError(f"{model.name}: layer index {i} out of range")
        layers.append(model.layers[int(i)])
    layers = _in_topological_order(layers, model.name)
    rng = np.random.default_rng(_seed_from(digest, seed))

    produced_inside = {name for layer in layers for name in layer.outputs if name}
    consumed_inside = {layer.inputs[s] for layer in layers for s in layer.activation_slots()}

    graph_inputs: list[onnx.ValueInfoProto] = []
    seen_inputs: set[str] = set()
    initializers: list[TensorProto] = []
    seen_constants: set[str] = set()
    int_bounds: dict[str, int] = {}
    weight_bytes = 0
    sink = _WeightSink(Path(weights_file)) if weights_file is not None else None
    activation_types: dict[str, TensorType] | None = None  # built only if a layer has hidden inputs

    for layer in layers:
        for slot, name in enumerate(layer.inputs):
            if not name:
                continue
            const = layer.constants.get(slot)
            if const is not None:
                if name in seen_constants:
                    continue
                seen_constants.add(name)
                if const.role == "param" or const.value is not None:
                    # A weight with its value: a QDQ scale or zero point (onnxruntime's
                    # fusions compare them, so they are the source's).
                    assert const.value is not None
                    value = np.asarray(const.value)
                elif weights == "source":
                    value = np.asarray(model.constant_value(name))
                elif pool is not None and const.role == "weight" and pool.accepts(const.type):
                    low, high = weight_range(const.type, op_type=layer.op_type, slot=slot)
                    initializers.append(pool.tensor(name, const.type, low, high))
                    weight_bytes += const.type.nbytes
                    continue
                else:
                    value = synthesize(const.type, rng, op_type=layer.op_type, slot=slot)
                    weight_bytes += value.nbytes
                if sink is not None and const.role == "weight" and value.nbytes >= 1024:
                    initializers.append(sink.add(name, value))
                else:
                    initializers.append(numpy_helper.from_array(value, name))
                continue
            if name in produced_inside or name in seen_inputs:
                continue
            ttype = layer.input_types[slot]
            if ttype is None:
                raise DlbricksError(f"{model.name}: input {name!r} of layer {layer.name!r} has no known type")
            seen_inputs.add(name)
            graph_inputs.append(_value_info(name, ttype))
            bound = _int_bound(layer, slot)
            if bound is not None and np.issubdtype(ttype.dtype, np.integer):
                int_bounds[name] = bound
        # If/Loop/Scan bodies may read tensors of the enclosing graph that are not node
        # inputs ("hidden inputs"). Without them the brick is not a valid model, so they
        # enter it like node inputs do: constants by value (params) or synthesised
        # (weights), activations as typed graph inputs.
        for name in outer_names(layer.node):
            if name in produced_inside or name in seen_inputs or name in seen_constants:
                continue
            ctype = model.constant_types.get(name)
            if ctype is not None:
                seen_constants.add(name)
                if constant_role(ctype) == "param" or weights == "source":
                    value = np.asarray(model.constant_value(name))
                elif pool is not None and pool.accepts(ctype):
                    initializers.append(pool.tensor(name, ctype, *weight_range(ctype)))
                    weight_bytes += ctype.nbytes
                    continue
                else:
                    value = synthesize(ctype, rng)
                    weight_bytes += value.nbytes
                if sink is not None and constant_role(ctype) == "weight" and value.nbytes >= 1024:
                    initializers.append(sink.add(name, value))
                else:
                    initializers.append(numpy_helper.from_array(value, name))
                continue
            if activation_types is None:
                activation_types = _activation_types(model)
            ttype = activation_types.get(name)
            if ttype is None:
                raise DlbricksError(
                    f"{model.name}: tensor {name!r} read inside a subgraph of layer {layer.name!r} has no known type"
                )
            seen_inputs.add(name)
            graph_inputs.append(_value_info(name, ttype))

    # A value leaves the window when a layer outside reads it or it is a model output;
    # a value nobody reads stays an output too (the source computes it as well). The
    # sequence digest does not record which values leave, so two windows with one
    # digest may differ here; exposing a value the brick computes anyway costs no kernel.
    window = {layer.index for layer in layers}
    model_outputs = {name for name, _ in model.outputs}
    read_outside = {
        name
        for other in model.layers
        if other.index not in window
        for slot in other.activation_slots()
        if (name := other.inputs[slot]) in produced_inside
    }
    graph_outputs: list[onnx.ValueInfoProto] = []
    for layer in layers:
        for slot, name in enumerate(layer.outputs):
            if name and (name not in consumed_inside or name in read_outside or name in model_outputs):
                ttype = layer.output_types[slot]
                if ttype is None:
                    continue
                graph_outputs.append(_value_info(name, ttype))
    if not graph_outputs:  # every output is consumed inside: expose the last layer's
        last = layers[-1]
        for slot, name in enumerate(last.outputs):
            last_type = last.output_types[slot]
            if name and last_type is not None:
                graph_outputs.append(_value_info(name, last_type))

    if sink is not None:
        sink.close()
    hex_digest = digest if isinstance(digest, str) else bytes(digest).hex()
    nodes = _brick_nodes(layers)
    graph = helper.make_graph(nodes, f"brick_{hex_digest[:12]}", graph_inputs, graph_outputs, initializers)
    opsets = [helper.make_opsetid(domain, version) for domain, version in sorted(model.opset_imports.items())]
    proto = helper.make_model(graph, opset_imports=opsets, producer_name="dlbricks")
    # IR < 4 would require every initializer to be listed as a graph input as well,
    # which would turn the weights into feedable inputs; IR 4 keeps the source opset.
    proto.ir_version = max(int(model.ir_version), 4)

    info = BrickInfo(
        digest=hex_digest,
        G=G,
        layers=len(layers),
        op_types=[layer.kind for layer in layers],
        inputs={vi.name: str(_type_of(vi)) for vi in graph_inputs},
        outputs={vi.name: str(_type_of(vi)) for vi in graph_outputs},
        int_bounds=int_bounds,
        weight_bytes=weight_bytes,
        source_model=model.name,
        source_layers=[layer.name for layer in layers],
    )
    return proto, info


def _in_topological_order(layers: list[Layer], model_name: str) -> list[Layer]:
    """``layers`` with every producer before its readers (ONNX requires it of a
    graph's nodes), keeping the given order wherever it already allows that: the
    bricks of a split come in order, so this is a check on their path; members a
    caller listed in another order are sorted rather than built into a brick that
    fails the checker."""
    producer = {name: k for k, layer in enumerate(layers) for name in layer.outputs if name}
    needs: list[set[int]] = []
    for k, layer in enumerate(layers):
        names = [layer.inputs[s] for s in layer.activation_slots()]
        names += outer_names(layer.node)
        needs.append({producer[n] for n in names if n in producer and producer[n] != k})
    if all(j < k for k, deps in enumerate(needs) for j in deps):
        return layers
    src = np.array([j for deps in needs for j in deps], dtype=np.int32)
    dst = np.array([k for k, deps in enumerate(needs) for _ in deps], dtype=np.int32)
    try:
        # The core's order: the earliest ready layer in the given order first.
        order = _core.topo_order(len(layers), src, dst)
    except ValueError as exc:
        # The core names a layer on the cycle by index ("... through node 7").
        m = re.search(r"through node (\d+)", str(exc))
        where = f" (through {layers[int(m.group(1))].name})" if m else ""
        raise DlbricksError(f"{model_name}: layers read each other's outputs in a cycle{where}") from None
    return [layers[int(k)] for k in order]


def _activation_types(model: Model) -> dict[str, TensorType]:
    """Type of every activation of ``model``: graph inputs and layer outputs."""
    out = dict(model.inputs)
    for layer in model.layers:
        for name, ttype in zip(layer.outputs, layer.output_types):
            if name and ttype is not None:
                out[name] = ttype
    return out


class _WeightSink:
    """Appends raw little-endian tensors to one file and returns external-data TensorProtos."""

    _ALIGN = 4096  # page-aligned offsets let onnxruntime map the weights instead of copying

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fh = open(path, "wb")
        self.offset = 0

    def add(self, name: str, value: np.ndarray) -> TensorProto:
        pad = (-self.offset) % self._ALIGN
        if pad:
            self.fh.write(b"\0" * pad)
            self.offset += pad
        data = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
        self.fh.write(data.data.cast("B"))
        t = TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(value.dtype)
        t.dims.extend(value.shape)
        t.data_location = TensorProto.EXTERNAL
        for key, val in (("location", self.path.name), ("offset", str(self.offset)), ("length", str(data.nbytes))):
            entry = t.external_data.add()
            entry.key = key
            entry.value = val
        self.offset += data.nbytes
        return t

    def close(self) -> None:
        self.fh.close()


def _copy_node(layer: Layer) -> onnx.NodeProto:
    node = onnx.NodeProto()
    node.CopyFrom(layer.node)
    if not node.name:
        node.name = layer.name
    return node


def _brick_nodes(layers: Sequence[Layer]) -> list[onnx.NodeProto]:
    """The layers' nodes in order: a QDQ group's members (loading.qdq), each other
    layer's node. A DQ shared by groups (or also a layer of its own) appears once."""
    nodes: list[onnx.NodeProto] = []
    emitted: set[tuple[str, ...]] = set()
    for layer in layers:
        members = getattr(layer, "members", ())
        if not members:
            key = tuple(layer.node.output)
            if key not in emitted:
                emitted.add(key)
                nodes.append(_copy_node(layer))
            continue
        for k, member in enumerate(members):
            key = tuple(member.output)
            if key in emitted:
                continue
            emitted.add(key)
            node = onnx.NodeProto()
            node.CopyFrom(member)
            if not node.name:
                node.name = f"{layer.name}/{member.op_type}_{k}"
            nodes.append(node)
    return nodes


def _type_of(vi: onnx.ValueInfoProto) -> TensorType:
    t = vi.type.tensor_type
    return TensorType(t.elem_type, tuple(d.dim_value for d in t.shape.dim))


# The domain check_brick moves onnxruntime's own ONNX-domain ops to (see below).
_ORT_CHECK_DOMAIN = "dlbricks.onnxruntime"


def _onnxruntime_ops_out_of_onnx_domain(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of ``proto`` whose default-domain nodes that onnx does not define but
    onnxruntime does (SimplifiedLayerNormalization; see
    :func:`dlbricks.loading.names.onnxruntime_onnx_op`) are in a domain of their own, or
    None when it has none. The checker rejects an op of the ONNX domain it has no
    schema for, and skips one of another domain, as it does com.microsoft's ops."""
    opset = next((int(o.version) for o in proto.opset_import if is_default_domain(o.domain)), None)
    if opset is None:
        return None
    moved = []
    for k, node in enumerate(proto.graph.node):
        if is_default_domain(node.domain) and not onnx.defs.has(node.op_type, opset):
            if onnxruntime_onnx_op(node.op_type, opset) is not None:
                moved.append(k)
    if not moved:
        return None
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    for k in moved:
        copy.graph.node[k].domain = _ORT_CHECK_DOMAIN
    copy.opset_import.append(helper.make_opsetid(_ORT_CHECK_DOMAIN, 1))
    return copy


def check_brick(proto: onnx.ModelProto | str, *, label: str | None = None) -> None:
    """Full ONNX check (structure plus strict shape inference) of a model or a saved file.

    Ops onnx does not define are not checked, whatever their domain: onnxruntime's
    contrib ops (com.microsoft...) and those it defines in the ONNX domain alike.

    Raises:
        DlbricksError: the brick is not a valid model.
    """
    if label is None:
        label = proto if isinstance(proto, str) else proto.graph.name
    try:
        parsed = onnx.load(proto, load_external_data=False) if isinstance(proto, str) else proto
    except Exception:  # noqa: BLE001 - an unreadable file: the checker says why
        parsed = None
    relabelled = None if parsed is None else _onnxruntime_ops_out_of_onnx_domain(parsed)
    copy_path = None
    if relabelled is not None and isinstance(proto, str):
        # The checker finds external weights relative to the file it checks, and an
        # in-memory model has none: the copy is checked as a file beside the original.
        try:
            fd, copy_path = tempfile.mkstemp(suffix=".check.onnx", dir=os.path.dirname(os.path.abspath(proto)))
            os.close(fd)
            onnx.save_model(relabelled, copy_path)
            proto = copy_path
        except OSError:  # a folder we cannot write to: checked in memory (weights inline only)
            proto = relabelled
    elif relabelled is not None:
        proto = relabelled
    try:
        onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DlbricksError(f"{label}: generated brick fails the ONNX checker: {first}") from None
    finally:
        if copy_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(copy_path)


def write_brick(
    model: Model,
    members: Sequence[int] | np.ndarray,
    path: str | os.PathLike[str],
    *,
    weights: WeightsMode = "synthetic",
    seed: int = 0,
    digest: bytes | str = b"\0" * 16,
    G: int = 0,
    check: bool = True,
) -> tuple[onnx.ModelProto, BrickInfo]:
    """Generate a brick and write it to ``path`` (weights in ``path + '.data'``).

    Both files appear atomically (written under temporary names, then renamed), so an
    interrupted run never leaves a half-written brick behind.

    Raises:
        DlbricksError: the brick fails the ONNX checker.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data_path = path.with_name(path.name + ".data")
    tmp_data = path.with_name(path.name + ".data.tmp")
    proto, info = generate_brick(model, members, weights=weights, seed=seed, digest=digest, G=G, weights_file=tmp_data)
    for t in proto.graph.initializer:  # refer to the final name of the weights file
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = data_path.name
    tmp = path.with_name(path.name + ".tmp")
    onnx.save_model(proto, str(tmp))
    if tmp_data.stat().st_size:
        os.replace(tmp_data, data_path)
    else:
        tmp_data.unlink()
    if check:
        try:
            # Checking the saved file lets the checker resolve the external weights
            # next to it without loading them.
            check_brick(str(tmp), label=path.name)
        except DlbricksError:
            tmp.unlink()
            raise
    os.replace(tmp, path)
    info.file = path.name
    return proto, info


def iter_unique_bricks(models: Sequence[Model], G: int) -> Iterator[tuple[str, Model, np.ndarray, dict[str, int]]]:
    """Yield (digest hex, source model, member layer indices, occurrences per model)
    for every unique sequence of the corpus at granularity ``G``, first-appearance order."""
    from dlbricks.corpus import Corpus
    from dlbricks.model import distinct_names

    corpus = Corpus(models)
    sp = corpus.split(G)
    occ = sp.occurrences()
    # Keyed by name: two models loaded as `*/model.onnx` must not count as one.
    names = distinct_names(corpus.names, [getattr(m, "path", None) for m in models])
    for u in range(sp.n_unique):
        model_index, members = sp.first_occurrence(u)
        counts = {names[m]: int(occ[m, u]) for m in range(len(models)) if occ[m, u]}
        yield bytes(sp.unique_digests[u]).hex(), models[model_index], members, counts


def generate_bricks(
    models: Sequence[Model],
    G: int,
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    check: bool = True,
    progress: Progress | None = None,
) -> list[BrickInfo]:
    """Write ``out_dir/<digest>.onnx`` for every unique sequence at ``G`` plus ``manifest.json``.

    Bricks are built and written one at a time, so memory holds one brick's weights.
    An existing brick file is kept when the folder's manifest says it was written with
    the same seed (bricks are deterministic per digest and seed); otherwise it is
    written again.

    Returns:
        the manifest entries.
    Raises:
        UsageError: ``out_dir`` exists and is not a folder.
        DlbricksError: a brick fails the checker (names the brick and the cause).
    """
    from dlbricks.files import write_atomically

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    keep_existing = _manifest_seed(out / "manifest.json") == seed
    infos: list[BrickInfo] = []
    for hex_digest, model, members, counts in iter_unique_bricks(models, G):
        path = out / f"{hex_digest}.onnx"
        if keep_existing and path.exists():
            _, info = generate_brick(model, members, seed=seed, digest=hex_digest, G=G, weights_file=os.devnull)
        else:
            proto, info = write_brick(model, members, path, seed=seed, digest=hex_digest, G=G, check=check)
            del proto
        info.occurrences = counts
        info.file = path.name
        infos.append(info)
        if progress is not None:
            progress.advance()
    manifest = {
        "schema_version": 1,
        "G": G,
        "seed": seed,
        "models": [m.name for m in models],
        "bricks": [i.to_dict() for i in infos],
    }
    write_atomically(out / "manifest.json", json.dumps(manifest, indent=1))
    return infos


def _manifest_seed(path: Path) -> int | None:
    """The seed a brick folder's manifest records (None: no readable manifest)."""
    try:
        seed = json.loads(path.read_text()).get("seed")
    except (OSError, ValueError, AttributeError):
        return None
    return seed if isinstance(seed, int) else None


def model_digest(model: ModelLike) -> str:
    """A 128-bit digest of a whole model's computation (hex): the layer digests in
    topological order plus the slot-annotated edges, names excluded. Keys end-to-end
    results in the store."""
    import hashlib

    from dlbricks.graph import topo_order

    order = topo_order(model)
    position = np.empty_like(order)
    position[order] = np.arange(len(order), dtype=order.dtype)
    h = hashlib.blake2b(digest_size=16)
    h.update(b"DLBMODEL" + (1).to_bytes(4, "little") + len(order).to_bytes(4, "little"))
    h.update(np.ascontiguousarray(model.digests[order]).tobytes())
    edges = np.stack(
        [position[model.edge_src], model.edge_src_slot, position[model.edge_dst], model.edge_dst_slot], axis=1
    ).astype("<u4")
    edges = edges[np.lexsort(edges.T[::-1])] if len(edges) else edges
    h.update(len(edges).to_bytes(4, "little"))
    h.update(edges.tobytes())
    return h.hexdigest()


def whole_model_window(model: Model) -> tuple[list[int], str, int]:
    """The whole model as a brick's window: (members, digest, G), for
    :func:`generate_brick` or :func:`write_brick` (the digest seeds its weights)."""
    return list(range(model.n_layers)), model_digest(model), model.n_layers


def whole_model(model: Model, *, weights: WeightsMode = "synthetic", seed: int = 0) -> tuple[onnx.ModelProto, BrickInfo]:
    """The whole model as one brick, with weights synthesised exactly as bricks get them.

    End-to-end runs use this, so end-to-end and brick timings see the same kind of
    weights (the light models' own weights are all zeros).
    """
    members, digest, G = whole_model_window(model)
    return generate_brick(model, members, weights=weights, seed=seed, digest=digest, G=G)
