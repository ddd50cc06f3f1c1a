"""The full loader: every model ONNX allows, and every error message.

Loading validates the graph, resolves every tensor type with onnx's shape inference,
folds constants symbolically (initializers, ``Constant`` nodes, every node whose inputs
are all constant, and ``Shape``/``Size`` of statically shaped tensors) and turns each
remaining node into a :class:`~dlbricks.model.Layer` with a digest.

Analysis never reads weight bytes: big files are parsed without their large
initializers' data (:mod:`dlbricks.loading.wire`), external data is not loaded, shape
inference runs on a light copy of the model whose large initializers are replaced by
typed graph inputs, and constant values are computed only for "param" constants
(:mod:`dlbricks.loading.constants`).

One piece over 800 lines: :class:`_Loader` is one model's analysis, steps (structure,
order, input shapes, inference rounds, folding, layers) that share the model's tables;
split into modules, each step would reach into another's state.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from pathlib import Path
from typing import Literal, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto

from dlbricks import _core
from dlbricks.digest import constant_role, layer_digest_fields, qdq_group_digest
from dlbricks.errors import DlbricksError, ModelError
from dlbricks.loading.constants import ConstantStore, constant_node_type, type_folded_value
from dlbricks.loading.messages import DlbricksWarning, batch_dim_note, one_line
from dlbricks.loading.names import has_subgraphs, norm_domain, onnxruntime_onnx_op, outer_names
from dlbricks.loading.qdq import QUANTIZED_ELEM_TYPES, Group, QdqLayer, is_qdq_op, plan_groups
from dlbricks.loading.sizes import INLINE_BYTES, MAX_ELEMENTS, elem_type_of, itemsize, numel
from dlbricks.loading.wire import read_proto
from dlbricks.model import ConstInput, Layer, Model, TensorType, unique_layer_name

__all__ = ["load_file", "load_proto"]

# Ops that carry subgraphs; they are single opaque layers.
_CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})
# Ops whose output follows from the input's type alone.
_TYPE_FOLDED = frozenset({"Shape", "Size"})
# Rounds of "evaluate small folded constants, re-run inference" when shapes stay unknown,
# and the largest folded constant evaluated for that.
_MAX_INFERENCE_ROUNDS = 4
_INJECT_MAX_ELEMENTS = 4096

_Dims = tuple[int | str | None, ...]
_RawType = tuple[int, _Dims | None]  # elem_type, dims (None: unknown rank)


def load_file(
    path: Path, label: str, name: str | None, input_shapes: Mapping[str, Sequence[int]] | None
) -> Model:
    """The full loader on a file (``label`` names it in messages; ``name`` defaults to
    the file's stem).

    Raises:
        ModelError: the file is unreadable or not a valid model (one line).
    """
    proto, spans = read_proto(path, label)
    return load_proto(proto, label, path, name, input_shapes, spans)


def load_proto(
    proto: onnx.ModelProto,
    label: str,
    path: Path | None,
    name: str | None,
    input_shapes: Mapping[str, Sequence[int]] | None,
    spans: Mapping[str, tuple[int, int]],
) -> Model:
    """The full loader on a parsed model; ``path`` is the file it came from (for its
    external data and the ``spans`` of data left in it), None for an in-memory model.

    Raises:
        ModelError: the model is invalid (one line naming ``label`` and the cause).
    """
    if proto.ir_version <= 0 or not proto.HasField("graph"):
        raise ModelError(f"{label}: not an ONNX model (no IR version or no graph)")
    model_name = name or (path.stem if path is not None else proto.graph.name or "model")
    try:
        return _Loader(proto, label, path, model_name, input_shapes, spans).run()
    except (DlbricksError, MemoryError, RecursionError):
        raise
    except Exception as exc:  # noqa: BLE001
        # A damaged file can parse as protobuf yet hold fields no valid model has (names
        # that are not UTF-8, an op_type that is bytes...): still one line, not a traceback.
        raise ModelError(one_line(f"{label}: not a valid ONNX model ({type(exc).__name__}: {exc})")) from None


class _Loader:
    """One model's analysis; :meth:`run` returns the Model."""

    def __init__(
        self,
        proto: onnx.ModelProto,
        label: str,
        path: Path | None,
        name: str,
        input_shapes: Mapping[str, Sequence[int]] | None,
        spans: Mapping[str, tuple[int, int]],
    ) -> None:
        g = proto.graph
        self.spans = spans
        self.proto = proto
        self.g = g
        self.label = label
        self.path = path
        self.name = name
        self.input_shapes = dict(input_shapes or {})
        self.opsets: dict[str, int] = {}
        for o in proto.opset_import:
            self.opsets[norm_domain(o.domain)] = int(o.version)
        self.functions = {(norm_domain(f.domain), f.name) for f in proto.functions}
        self.nodes = list(g.node)
        # Protobuf field access is slow; read each node's fields once (slicing a
        # repeated field copies it in C, about twice as fast as iterating it).
        self.ins = [tuple(n.input[:]) for n in self.nodes]
        self.outs = [tuple(n.output[:]) for n in self.nodes]
        self.ops = [n.op_type for n in self.nodes]
        self.doms = [norm_domain(n.domain) for n in self.nodes]
        self.init = {t.name: t for t in g.initializer}
        self.sparse = {sp.values.name: sp for sp in g.sparse_initializer}
        self.input_names = [vi.name for vi in g.input]
        self.const_inputs = set(self.init) | set(self.sparse)
        self.constant_node_types: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.dim_subst: dict[str, int] = {}
        self._memo: dict[str, TensorType | None] = {}
        self._init_types: dict[str, TensorType] | None = None
        # One TensorType per distinct type: a lookup costs less than building one.
        self._tts: dict[tuple[int, tuple[int, ...]], TensorType] = {}
        # Serialized TypeProto -> (non-tensor kind, tensor type): models repeat few types.
        self._parsed_types: dict[bytes, tuple[str | None, _RawType | None, TensorType | None]] = {}

    # -- helpers --------------------------------------------------------------------

    def _err(self, msg: str) -> ModelError:
        return ModelError(one_line(f"{self.label}: {msg}"))

    def _desc(self, i: int) -> str:
        node = self.nodes[i]
        return f"'{node.name}' ({node.op_type})" if node.name else f"#{i} ({node.op_type})"

    def _deps(self, i: int) -> tuple[str, ...]:
        """Every tensor node ``i`` reads: explicit inputs and subgraph outer references."""
        return self.ins[i] + self.implicit[i] if self.implicit[i] else self.ins[i]

    # -- structure ------------------------------------------------------------------

    def _check_structure(self) -> None:
        """Ops, single definitions, no undefined reads; fills producer/implicit/opaque."""
        defined = set(self.const_inputs) | set(self.input_names)
        self.producer: dict[str, tuple[int, int]] = {}
        for i, outs in enumerate(self.outs):
            for s, o in enumerate(outs):
                if not o:
                    continue
                if o in self.producer or o in defined:
                    raise self._err(f"tensor '{o}' is defined twice (again by node {self._desc(i)})")
                self.producer[o] = (i, s)
        n = len(self.nodes)
        self.implicit: list[tuple[str, ...]] = [()] * n
        self.opaque = [False] * n
        self.op_version = [0] * n
        self.opaque_outputs: set[str] = set()
        self.loops: list[int] = []
        schemas: dict[tuple[str, int], int | None] = {}
        # (domain, op) -> (opaque, op_version) as _check_op found them for a node
        # without subgraphs: the outcome depends on nothing else.
        checked_ops: dict[tuple[str, str], tuple[bool, int]] = {}
        producer, ops, doms, all_outs = self.producer, self.ops, self.doms, self.outs
        for i, node in enumerate(self.nodes):
            has_graph = False
            for a in node.attribute:
                if has_subgraphs(a):
                    has_graph = True
                    break
            free = outer_names(node) if has_graph else ()
            op_type, domain, outs = ops[i], doms[i], all_outs[i]
            key = (domain, op_type)
            known = None if has_graph or op_type == "Loop" else checked_ops.get(key)
            if known is None:
                self._check_op(i, has_graph, schemas)
                if not has_graph and op_type != "Loop":
                    checked_ops[key] = (self.opaque[i], self.op_version[i])
            else:
                self.op_version[i] = known[1]
                if known[0]:
                    self.opaque[i] = True
                    self.opaque_outputs.update(o for o in outs if o)
            if free:
                self.implicit[i] = tuple(free)
                deps = self.ins[i] + self.implicit[i]
            else:
                deps = self.ins[i]
            for t in deps:
                if t and t not in producer and t not in defined:
                    raise self._err(f"node {self._desc(i)} reads undefined tensor '{t}'")
            if op_type == "Constant" and domain == "" and outs and outs[0]:
                ct = constant_node_type(node)
                if ct is not None:
                    self.constant_node_types[outs[0]] = ct
        for vi in self.g.output:
            if vi.name not in self.producer and vi.name not in defined:
                raise self._err(f"graph output '{vi.name}' is not produced by any node")

    def _check_op(self, i: int, has_graph: bool, schemas: dict[tuple[str, int], int | None]) -> None:
        op_type = self.ops[i]
        domain = self.doms[i]
        if (domain, op_type) in self.functions:
            self.opaque[i] = True
            self.op_version[i] = self.opsets.get(domain, 0)
            self.opaque_outputs.update(o for o in self.outs[i] if o)
            return
        if domain != "":
            if domain not in self.opsets:
                raise self._err(f"node {self._desc(i)} uses domain '{domain}', which the model does not import")
            self._contrib(i, self.opsets[domain])
            return
        version = self.opsets.get("")
        if version is None:
            raise self._err(f"node {self._desc(i)} is in the default ONNX domain, which the model does not import")
        key = (op_type, version)
        if key not in schemas:  # get_schema costs ~25 us; models repeat few ops
            try:
                schemas[key] = int(onnx.defs.get_schema(op_type, version, "").since_version)
            except onnx.defs.SchemaError:
                schemas[key] = None
        since = schemas[key]
        if since is None:
            ort_since = onnxruntime_onnx_op(op_type, version)
            if ort_since is not None:
                # One of onnxruntime's own ops in the ONNX domain, which its optimiser
                # writes (SimplifiedLayerNormalization...): a contrib op by another name.
                self._contrib(i, ort_since)
                return
            raise self._err(
                f"node {self._desc(i)} has unknown op '{op_type}' (not in the ONNX schema at opset {version})"
            )
        self.op_version[i] = since
        self.opaque[i] = has_graph or op_type in _CONTROL_FLOW
        if op_type == "Loop":
            self.loops.append(i)
        if self.opaque[i]:
            self.opaque_outputs.update(o for o in self.outs[i] if o)

    def _contrib(self, i: int, version: int) -> None:
        """Node ``i`` is an op onnx does not define (com.microsoft, ai.onnx.ml...): an
        opaque layer. Shape inference knows nothing of it, so its outputs take the types
        the model declares (:mod:`dlbricks.loading.runtime_graph` declares every value's,
        read off a run of the graph)."""
        self.opaque[i] = True
        self.op_version[i] = version
        self.opaque_outputs.update(o for o in self.outs[i] if o)

    def _topo_order(self) -> list[int]:
        """A topological order; the original order when it already is one."""
        n = len(self.nodes)
        producer = self.producer
        # Files are nearly always in order already: check that first, without building lists.
        in_order = True
        for i in range(n):
            for t in self._deps(i):
                p = producer.get(t)
                if p is not None and p[0] >= i:
                    in_order = False
                    break
            if not in_order:
                break
        if in_order:
            return list(range(n))
        src: list[int] = []
        dst: list[int] = []
        for i in range(n):
            for t in self._deps(i):
                p = producer.get(t)
                if p is not None:
                    src.append(p[0])
                    dst.append(i)
        # The core's order: lowest original index first, deterministic and as close to
        # the file as possible.
        try:
            order = _core.topo_order(n, np.asarray(src, np.int32), np.asarray(dst, np.int32))
        except ValueError as exc:
            # The core names a node on the cycle by index ("... through node 7").
            m = re.search(r"through node (\d+)", str(exc))
            where = f" through node {self._desc(int(m.group(1)))}" if m else ""
            raise self._err(f"the graph has a cycle{where}") from None
        return order.tolist()

    # -- input shapes ---------------------------------------------------------------

    def _resolve_inputs(self) -> None:
        """Concrete shapes for activation graph inputs (overrides, batch default)."""
        self.act_inputs: list[tuple[str, int, tuple[int, ...]]] = []
        act = [vi for vi in self.g.input if vi.name not in self.const_inputs]
        act_names = {vi.name for vi in act}
        for key in self.input_shapes:
            if key not in act_names:
                listed = ", ".join(sorted(act_names)) or "none"
                raise self._err(f"input_shapes names '{key}', which is not an input of the model (inputs: {listed})")
        for vi in act:
            kind = vi.type.WhichOneof("value")
            if kind != "tensor_type":
                raise self._err(f"input '{vi.name}' has a non-tensor type ({kind}); dlbricks handles tensors only")
            tt = vi.type.tensor_type
            if tt.elem_type == TensorProto.UNDEFINED:
                raise self._err(f"input '{vi.name}' has no element type")
            declared = list(tt.shape.dim) if tt.HasField("shape") else None
            if vi.name in self.input_shapes:
                shape = self._override_shape(vi.name, declared)
            else:
                shape = self._declared_shape(vi.name, declared)
            self._check_numel(vi.name, shape)
            self.act_inputs.append((vi.name, tt.elem_type, shape))

    def _override_shape(self, name: str, declared: list | None) -> tuple[int, ...]:
        raw = self.input_shapes[name]
        try:
            shape = tuple(int(d) for d in raw)
        except (TypeError, ValueError):
            raise self._err(f"input_shapes[{name!r}] = {raw!r} is not a sequence of integers") from None
        if any(d < 0 for d in shape):
            raise self._err(f"input_shapes[{name!r}] = {shape} has a negative dim")
        if declared is not None and len(declared) != len(shape):
            raise self._err(
                f"input_shapes gives {len(shape)} dims for input '{name}', which has rank {len(declared)}"
            )
        if declared is not None:
            for d, v in zip(declared, shape):
                if d.WhichOneof("value") == "dim_param":
                    self.dim_subst.setdefault(d.dim_param, v)
        return shape

    def _declared_shape(self, name: str, declared: list | None) -> tuple[int, ...]:
        if declared is None:
            raise self._err(
                f"cannot resolve the shape of tensor '{name}' (no shape declared); "
                f"set it with --input-shape {name}=... (input_shapes in Python)"
            )
        shape: list[int | None] = []
        for i, d in enumerate(declared):
            which = d.WhichOneof("value")
            if which == "dim_value" and d.dim_value >= 0:
                shape.append(int(d.dim_value))
                continue
            if i > 0:
                what = f"'{d.dim_param}'" if which == "dim_param" else "unknown"
                raise self._err(
                    f"cannot resolve the shape of tensor '{name}' (dim {i} is {what}); "
                    f"set it with --input-shape {name}=... (input_shapes in Python)"
                )
            shape.append(None)
        if shape and shape[0] is None:
            # A symbolic leading dim is almost always the batch size.
            d = declared[0]
            what = f"'{d.dim_param}'" if d.WhichOneof("value") == "dim_param" else "unknown"
            warnings.warn(batch_dim_note(self.label, name, what), DlbricksWarning, stacklevel=5)
            if d.dim_param:
                self.dim_subst.setdefault(d.dim_param, 1)
            shape[0] = 1
        return tuple(shape)  # type: ignore[arg-type]

    def _check_numel(self, name: str, shape: tuple[int, ...]) -> None:
        n = numel(shape)
        if n > MAX_ELEMENTS:
            raise self._err(f"tensor '{name}' has {n} elements (shape {list(shape)}), over the 2**40 limit")

    # -- shape inference ------------------------------------------------------------

    def _light_model(self, order: list[int], injected: Mapping[str, np.ndarray]) -> onnx.ModelProto:
        """A copy for shape inference that carries no large tensor data."""
        mk = onnx.helper.make_tensor_value_info
        light = onnx.ModelProto()
        # IR 4 lets initializers be constants without also being graph inputs, which
        # spares a value_info per initializer (IR 3 models list every weight as input).
        light.ir_version = max(int(self.proto.ir_version), 4)
        light.opset_import.extend(self.proto.opset_import)
        if len(self.proto.functions):
            light.functions.extend(self.proto.functions)
        lg = light.graph
        lg.name = self.g.name
        for name, elem, shape in self.act_inputs:
            lg.input.append(mk(name, elem, shape))
        for t in self.g.initializer:
            dims = tuple(t.dims[:])
            small = (
                t.data_location != TensorProto.EXTERNAL
                and t.name not in self.spans
                and numel(dims) * itemsize(t.data_type) <= INLINE_BYTES
            )
            if small:
                lg.initializer.append(t)
            else:
                lg.input.append(mk(t.name, t.data_type, dims))
        for sp in self.g.sparse_initializer:
            lg.input.append(mk(sp.values.name, sp.values.data_type, list(sp.dims)))
        skip: set[int] = set()
        for name in injected:
            i = self.producer[name][0]
            if all(o in injected for o in self.outs[i] if o):
                skip.add(i)
        for name, arr in injected.items():
            if self.producer[name][0] in skip:
                lg.initializer.append(onnx.numpy_helper.from_array(arr, name))
        opaque_out = self.opaque_outputs
        kept: list[onnx.NodeProto] = []
        nodes, ops, all_outs, const_types = self.nodes, self.ops, self.outs, self.constant_node_types
        for i in order:
            if i in skip:
                continue
            outs = all_outs[i]
            ct = const_types.get(outs[0]) if ops[i] == "Constant" and outs else None
            if ct is not None and numel(ct[1]) * itemsize(ct[0]) > INLINE_BYTES:
                lg.input.append(mk(outs[0], ct[0], list(ct[1])))
                continue
            kept.append(nodes[i])
        if len(kept) == len(nodes) and order == list(range(len(nodes))):
            lg.node.extend(self.g.node)  # the common case; copies in C, ~2x faster than a list
        else:
            lg.node.extend(kept)
        # Declared shapes of outputs computed by standard ops are dropped: they may
        # contradict overridden input shapes and inference recomputes them anyway.
        # Opaque ops keep theirs, as inference may know nothing else about them.
        for vi in self.g.output:
            if vi.name in opaque_out:
                lg.output.append(vi)
            else:
                lg.output.add().name = vi.name
        annotated = set()
        for vi in self.g.value_info:
            if vi.name in opaque_out:
                lg.value_info.append(vi)
                annotated.add(vi.name)
        # Seed Loop outputs with their body's declared types so that inference carries
        # shapes past the loop (see _loop_output_types).
        for name, typ in self._loop_output_types():
            if name not in annotated:
                v = lg.value_info.add()
                v.name = name
                v.type.CopyFrom(typ)
        return light

    def _loop_output_types(self) -> list[tuple[str, onnx.TypeProto]]:
        """Loop-carried outputs with the types the loop body declares for them.

        onnx infers no shape for them (they could change from one iteration to the
        next); the body's declared outputs give one.
        """
        out = []
        for i in self.loops:
            body = next((a.g for a in self.nodes[i].attribute if a.name == "body"), None)
            if body is not None:
                for name, vi in zip(self.outs[i], list(body.output)[1:]):
                    if name:
                        out.append((name, vi.type))
        return out

    def _infer(self, order: list[int], injected: Mapping[str, np.ndarray]) -> None:
        light = self._light_model(order, injected)
        try:
            inferred = onnx.shape_inference.infer_shapes(light, check_type=False, strict_mode=False, data_prop=True)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise self._err(f"shape inference failed: {first}") from None
        self._memo.clear()
        # Initializer types never change; seeding them spares a protobuf read per round.
        if self._init_types is None:
            self._init_types = {}
            for name in self.init:
                rt = self._raw_type(name)
                if rt is not None and rt[0] != TensorProto.UNDEFINED:
                    self._init_types[name] = self._tensor_type(int(rt[0]), rt[1])  # type: ignore[arg-type]
        self._memo.update(self._init_types)
        self.types: dict[str, _RawType] = {}
        # The concrete ones among self.types, as TensorTypes.
        self._types_tt: dict[str, TensorType] = {}
        self.nontensor: dict[str, str] = {}
        ig = inferred.graph
        # Declarations for opaque outputs count too: inference may have dropped them.
        declared: list[tuple[str, onnx.TypeProto]] = []
        if self.opaque_outputs:
            for vi in list(self.g.value_info) + list(self.g.output):
                if vi.name in self.opaque_outputs:
                    declared.append((vi.name, vi.type))
            declared.extend(self._loop_output_types())
        parsed_types, types, types_tt = self._parsed_types, self.types, self._types_tt
        for seq in (ig.input, ig.value_info, ig.output):
            for vi in seq:
                # _merge_type inlined for the common case: a name seen once, a known type.
                name = vi.name
                parsed = parsed_types.get(vi.type.SerializeToString())
                if parsed is None or parsed[1] is None or name in types:
                    self._merge_type(name, vi.type)
                else:
                    types[name] = parsed[1]
                    if parsed[2] is not None:
                        types_tt[name] = parsed[2]
        for name, typ in declared:
            self._merge_type(name, typ)

    def _merge_type(self, name: str, typ: onnx.TypeProto) -> None:
        """Record ``typ`` for ``name`` unless a more complete type is known already."""
        key = typ.SerializeToString()
        parsed = self._parsed_types.get(key)
        if parsed is None:
            # dim_subst is fixed before the first inference, so parsing depends on the bytes only.
            parsed = self._parsed_types[key] = self._parse_type(typ)
        kind, new, concrete = parsed
        if new is None:
            if kind:
                self.nontensor[name] = kind
            return
        old = self.types.get(name)
        if old is None or _completeness(new) > _completeness(old):
            self.types[name] = new
            if concrete is not None:
                self._types_tt[name] = concrete
            else:
                self._types_tt.pop(name, None)

    def _parse_type(self, typ: onnx.TypeProto) -> tuple[str | None, _RawType | None, TensorType | None]:
        """(non-tensor kind, None, None) or (None, tensor type, its TensorType when concrete)."""
        if not typ.HasField("tensor_type"):
            kind = typ.WhichOneof("value")
            return (kind.replace("_type", "") if kind else None), None, None
        tt = typ.tensor_type
        dims: _Dims | None = None
        if tt.HasField("shape"):
            subst = self.dim_subst
            ds: list[int | str | None] = []
            for d in tt.shape.dim:
                v = d.dim_value
                if v > 0:
                    ds.append(v)
                elif d.dim_param:
                    ds.append(subst.get(d.dim_param, d.dim_param))
                elif v == 0 and d.HasField("dim_value"):
                    ds.append(0)
                else:  # unset, or negative (some exporters' "unknown")
                    ds.append(None)
            dims = tuple(ds)
        raw = (tt.elem_type, dims)
        return None, raw, self._as_tensor_type(raw)

    # -- constants ------------------------------------------------------------------

    def _raw_type(self, name: str) -> _RawType | None:
        """Best known type of a tensor (constants from their definitions first)."""
        t = self.init.get(name)
        if t is not None:
            return t.data_type, tuple(t.dims[:])  # dims are ints already
        sp = self.sparse.get(name)
        if sp is not None:
            return sp.values.data_type, tuple(int(d) for d in sp.dims)
        ct = self.constant_node_types.get(name)
        if ct is not None:
            return ct
        v = self.store.cache.get(name)
        if v is None:
            v = self.store.type_folded.get(name)
        if v is not None:
            return elem_type_of(v), tuple(v.shape)
        return self.types.get(name)

    def _tensor_type(self, elem_type: int, shape: tuple[int, ...]) -> TensorType:
        key = (elem_type, shape)
        t = self._tts.get(key)
        if t is None:
            t = self._tts[key] = TensorType(elem_type, shape)
        return t

    def _concrete(self, name: str) -> TensorType | None:
        t = self._memo.get(name)
        if t is not None:
            return t
        store = self.store
        if (
            name in self.init
            or name in self.sparse
            or name in self.constant_node_types
            or name in store.cache
            or name in store.type_folded
        ):
            t = self._as_tensor_type(self._raw_type(name))
        else:  # what _raw_type would return: the inferred type, converted once in _infer
            t = self._types_tt.get(name)
        # Only known types are kept: evaluating a constant can turn unknown into known.
        if t is not None:
            self._memo[name] = t
        return t

    def _as_tensor_type(self, rt: _RawType | None) -> TensorType | None:
        if rt is None or rt[0] == TensorProto.UNDEFINED or rt[1] is None:
            return None
        if not all(isinstance(d, int) for d in rt[1]):
            return None
        return self._tensor_type(int(rt[0]), tuple(rt[1]))  # type: ignore[arg-type]

    def _classify(self, order: list[int]) -> None:
        """Which nodes fold to constants; sets ``self.kind`` and ``self.const``."""
        self.const = set(self.const_inputs)
        self.kind = ["layer"] * len(self.nodes)
        self.store.type_folded.clear()
        const, kind = self.const, self.kind
        opaque, all_ins, all_outs, ops, doms = self.opaque, self.ins, self.outs, self.ops, self.doms
        for i in order:
            if opaque[i]:
                continue
            ins, outs = all_ins[i], all_outs[i]
            if ops[i] in _TYPE_FOLDED and doms[i] == "" and ins and ins[0] and outs and outs[0]:
                t = self._concrete(ins[0])
                if t is not None:
                    self.store.type_folded[outs[0]] = type_folded_value(self.nodes[i], t)
                    kind[i] = "shape"
                    const.add(outs[0])
                    continue
            for t in ins:
                if t and t not in const:
                    break
            else:
                if ops[i] == "DequantizeLinear" and doms[i] == "" and self._quantized_constant(ins[0]):
                    continue  # quantized weights stay quantized (see loading.qdq)
                kind[i] = "const"
                const.update(o for o in outs if o)

    def _quantized_constant(self, name: str) -> bool:
        rt = self._raw_type(name) if name else None
        return rt is not None and rt[0] in QUANTIZED_ELEM_TYPES

    def _unresolved_layer_tensor(self) -> bool:
        const, used, concrete, all_ins, all_outs = self.const, self.used, self._concrete, self.ins, self.outs
        for i, kind in enumerate(self.kind):
            if kind != "layer":
                continue
            for t in all_ins[i]:
                if t and t not in const and concrete(t) is None:
                    return True
            for t in all_outs[i]:
                # An unused output may stay untyped (Dropout's mask in old opsets).
                if t and t in used and concrete(t) is None:
                    return True
        return False

    def _injection_candidates(self, injected: Mapping[str, np.ndarray]) -> list[str]:
        """Outputs of folded nodes small enough (or of unknown size) to evaluate."""
        out = []
        for i, kind in enumerate(self.kind):
            if kind not in ("const", "shape") or self.ops[i] == "Constant":
                continue
            names = [o for o in self.outs[i] if o]
            if not names or all(o in injected for o in names):
                continue
            small = True
            for o in names:
                t = self._concrete(o)
                if t is not None and t.numel > _INJECT_MAX_ELEMENTS:
                    small = False
            if small:
                out.extend(names)
        return out

    # -- main -----------------------------------------------------------------------

    def run(self) -> Model:
        if not self.nodes:
            raise self._err("model has no layers (the graph has no nodes)")
        self._check_structure()
        order = self._topo_order()
        self._resolve_inputs()
        self.store = ConstantStore(self.proto, self.label, self.path, self.spans, self.producer, order)
        self.used: set[str] = {vi.name for vi in self.g.output}
        for ins in self.ins:
            self.used.update(ins)
        for extra in self.implicit:
            self.used.update(extra)

        injected: dict[str, np.ndarray] = {}
        for _ in range(_MAX_INFERENCE_ROUNDS):
            self._infer(order, injected)
            self._classify(order)
            if not self._unresolved_layer_tensor():
                break
            # Shapes computed from constants that data propagation cannot follow:
            # evaluate those constants and let inference see their values.
            cand = self._injection_candidates(injected)
            if not cand:
                break
            try:
                values = self.store.values(cand)
            except ModelError:
                break
            injected.update({k: v for k, v in values.items() if v.dtype.kind not in ("O", "U", "S")})

        return self._build(order)

    def _build(self, order: list[int]) -> Model:
        layer_ids = [i for i in order if self.kind[i] == "layer"]
        if not layer_ids:
            raise self._err("model has no layers (every node folds to a constant)")
        used = self.used
        ops, doms, all_ins, all_outs = self.ops, self.doms, self.ins, self.outs
        roles: dict[tuple[str, int, int, tuple[int, ...]], Literal["weight", "param"]] = {}

        # QDQ groups (loading.qdq): a group's inputs and outputs are its boundary's. The
        # constants a DQ or Q reads are weights whatever their size (an INT32 bias of 64
        # channels, a scalar scale: identity by type), and scales and zero points keep
        # their values for bricks, as onnxruntime's fusions read them.
        groups: dict[int, Group] = {}
        layer_ins: dict[int, tuple[str, ...]] = {}
        layer_outs: dict[int, tuple[str, ...]] = {}
        as_weight: dict[int, set[int]] = {}
        keep_value: dict[int, set[int]] = {}
        if "DequantizeLinear" in ops or "QuantizeLinear" in ops:
            groups, absorbed = self._qdq_groups(layer_ids)
            layer_ids = [i for i in layer_ids if i not in absorbed]
            for i, g in groups.items():
                layer_ins[i], layer_outs[i], as_weight[i], keep_value[i] = g.boundary(all_ins, all_outs)
            for i in layer_ids:
                if is_qdq_op(ops[i], doms[i]):
                    as_weight[i] = set(range(len(all_ins[i])))
                    keep_value[i] = set(range(1, len(all_ins[i])))

        def ins_of(i: int) -> tuple[str, ...]:
            return layer_ins.get(i) or all_ins[i]

        # Constants feeding layers: types, and values for params (one evaluation).
        def role_of(i: int, slot: int, ct: TensorType) -> Literal["weight", "param"]:
            if i in as_weight and slot in as_weight[i]:
                return "weight"
            op = ops[i] if doms[i] == "" else ""
            key = (op, slot, ct.elem_type, ct.shape)
            role = roles.get(key)
            if role is None:
                role = roles[key] = constant_role(ct, op, slot)
            return role

        const = self.const
        uses = [(i, slot, t) for i in layer_ids for slot, t in enumerate(ins_of(i)) if t in const]
        need_value = sorted(
            {
                t
                for i, slot, t in uses
                if (ct := self._concrete(t)) is None
                or role_of(i, slot, ct) == "param"
                or (i in keep_value and slot in keep_value[i])
            }
        )
        values = self.store.values(need_value) if need_value else {}
        for t in values:  # their types may have been unknown before evaluation
            self._memo.pop(t, None)
        const_types: dict[str, TensorType] = {}
        concrete = self._concrete
        checked: set[tuple[int, ...]] = set()  # shapes already within MAX_ELEMENTS
        for _, _, t in uses:
            if t in const_types:
                continue
            v = values.get(t)
            ct = concrete(t) if v is None else self._tensor_type(elem_type_of(v), tuple(v.shape))
            assert ct is not None  # either typed or evaluated above
            if ct.shape not in checked:
                self._check_numel(t, ct.shape)
                checked.add(ct.shape)
            const_types[t] = ct

        layers: list[Layer] = []
        produced_by: dict[str, tuple[int, int]] = {}
        seen_names: set[str] = set()
        e_src: list[int] = []
        e_src_slot: list[int] = []
        e_dst: list[int] = []
        e_dst_slot: list[int] = []
        act_types = {n: TensorType(e, s) for n, e, s in self.act_inputs}
        for i in layer_ids:
            node = self.nodes[i]
            idx = len(layers)
            node_name = node.name
            op_type = ops[i]
            name = unique_layer_name(node_name, op_type, idx, seen_names)
            ins, outs = ins_of(i), layer_outs.get(i) or all_outs[i]
            kept = keep_value.get(i, ())
            in_types: list[TensorType | None] = []
            consts: dict[int, ConstInput] = {}
            for slot, t in enumerate(ins):
                if not t:
                    in_types.append(None)
                elif t in const_types:
                    ct = const_types[t]
                    role = role_of(i, slot, ct)
                    consts[slot] = ConstInput(t, ct, role, values[t] if role == "param" or slot in kept else None)
                    in_types.append(ct)
                else:
                    tt = act_types.get(t)
                    if tt is None:
                        tt = concrete(t)
                        if tt is None or tt.shape not in checked:
                            tt = self._require(t)
                            checked.add(tt.shape)
                    in_types.append(tt)
                    if t in produced_by:
                        src, src_slot = produced_by[t]
                        e_src.append(src)
                        e_src_slot.append(src_slot)
                        e_dst.append(idx)
                        e_dst_slot.append(slot)
            out_types: list[TensorType | None] = []
            for slot, t in enumerate(outs):
                if not t:
                    out_types.append(None)
                    continue
                tt = concrete(t)
                if tt is None and t in used:
                    tt = self._require(t)
                if tt is not None and tt.shape not in checked:
                    self._check_numel(t, tt.shape)
                    checked.add(tt.shape)
                out_types.append(tt)
                produced_by[t] = (idx, slot)
            outer = None
            if self.implicit[i]:
                outer = {}
                for t in self.implicit[i]:
                    tt = const_types.get(t) or self._concrete(t)
                    if tt is not None:
                        outer[t] = tt
            domain = node.domain
            group = groups.get(i)
            common = dict(index=idx, name=name, op_type=op_type, domain=domain, node=node, inputs=ins, outputs=outs,
                          input_types=tuple(in_types), output_types=tuple(out_types), constants=consts)
            if group is None:
                digest = layer_digest_fields(
                    domain,
                    op_type,
                    node.attribute,
                    node_name,
                    ins,
                    outs,
                    in_types,
                    out_types,
                    consts,
                    self.op_version[i],
                    outer,
                )
                layers.append(Layer(**common, digest=digest))
                continue
            # The group's digest covers each member as a layer of its own would be.
            core_consts = {s: c for s, c in consts.items() if s < len(all_ins[i]) and s not in group.in_dq}
            member = functools.partial(self._member_digest, const_types=const_types, act_types=act_types)
            digest = qdq_group_digest(
                member(i, core_consts),
                [None if (d := group.in_dq.get(s)) is None else member(d) for s in range(len(all_ins[i]))],
                [None if (q := group.out_q.get(o)) is None else member(q) for o in range(len(all_outs[i]))],
            )
            layers.append(QdqLayer(**common, digest=digest, members=tuple(self.nodes[j] for j in group.member_ids())))

        outputs = []
        for vi in self.g.output:
            tt = act_types.get(vi.name) or const_types.get(vi.name)
            outputs.append((vi.name, tt or self._require(vi.name)))

        constant_types: dict[str, TensorType] = {}
        for t in self.const:
            ct = const_types.get(t) or self._concrete(t)
            if ct is not None:
                constant_types[t] = ct

        def i32(xs: list[int]) -> np.ndarray:
            return np.asarray(xs, dtype=np.int32)

        digests = np.frombuffer(b"".join(layer.digest for layer in layers), dtype=np.uint8).reshape(len(layers), 16)
        return Model(
            name=self.name,
            path=os.fspath(self.path) if self.path is not None else None,
            ir_version=int(self.proto.ir_version),
            opset_imports=dict(self.opsets),
            layers=layers,
            inputs=[(n, act_types[n]) for n, _, _ in self.act_inputs],
            outputs=outputs,
            edge_src=i32(e_src),
            edge_src_slot=i32(e_src_slot),
            edge_dst=i32(e_dst),
            edge_dst_slot=i32(e_dst_slot),
            digests=digests.copy(),
            constant_types=constant_types,
            _materialize=self.store.value,
        )

    def _qdq_groups(self, layer_ids: list[int]) -> tuple[dict[int, Group], set[int]]:
        readers: dict[str, list[tuple[int, int]]] = {}
        for i in layer_ids:
            for s, t in enumerate(self.ins[i]):
                if t:
                    readers.setdefault(t, []).append((i, s))
            for t in self.implicit[i]:
                readers.setdefault(t, []).append((i, -1))
        graph_outputs = {vi.name for vi in self.g.output}
        return plan_groups(
            layer_ids, self.ops, self.doms, self.ins, self.outs, readers, self.producer, graph_outputs, self.opaque
        )

    def _member_digest(
        self,
        j: int,
        consts: dict[int, ConstInput] | None = None,
        *,
        const_types: Mapping[str, TensorType],
        act_types: Mapping[str, TensorType],
    ) -> bytes:
        """Node ``j``'s layer digest as a member of a QDQ group: its own inputs and
        outputs; a DQ's or Q's constants (``consts`` None) are weights."""
        ins, outs = self.ins[j], self.outs[j]
        if consts is None:
            consts = {s: ConstInput(t, const_types[t], "weight") for s, t in enumerate(ins) if t in const_types}
        in_types: list[TensorType | None] = []
        for t in ins:
            in_types.append(None if not t else const_types.get(t) or act_types.get(t) or self._require(t))
        out_types = [None if not t else self._concrete(t) or self._require(t) for t in outs]
        node = self.nodes[j]
        fields = (node.domain, self.ops[j], node.attribute, node.name, ins, outs, in_types, out_types, consts)
        return layer_digest_fields(*fields, self.op_version[j], None)

    def _require(self, name: str) -> TensorType:
        """The concrete type of ``name``, or a ModelError saying why there is none."""
        tt = self._concrete(name)
        if tt is not None:
            self._check_numel(name, tt.shape)
            return tt
        p = self.producer.get(name)
        where = f" (output of node {self._desc(p[0])})" if p is not None else ""
        if name in self.nontensor:
            raise self._err(
                f"tensor '{name}'{where} has a non-tensor type ({self.nontensor[name]}); dlbricks handles tensors only"
            )
        rt = self._raw_type(name)
        if rt is None or rt[0] == TensorProto.UNDEFINED:
            raise self._err(f"cannot infer the type of tensor '{name}'{where}")
        if rt[1] is None:
            raise self._err(f"cannot infer the shape of tensor '{name}'{where}")
        for k, d in enumerate(rt[1]):
            if not isinstance(d, int):
                what = f"'{d}'" if isinstance(d, str) else "unknown"
                raise self._err(f"cannot resolve the shape of tensor '{name}' (dim {k} is {what}){where}")
        raise AssertionError("unreachable")  # pragma: no cover


def _completeness(t: _RawType) -> int:
    elem, dims = t
    score = 1 if elem else 0
    if dims is not None:
        score += 1 + sum(2 for d in dims if isinstance(d, int))
    return score
