"""Constant values: what a folded constant holds, computed only when asked.

Analysis reads no weight bytes; it needs the values of "param" constants only (see
:func:`dlbricks.digest.constant_role`), and :meth:`Model.constant_value` asks for any
constant's value afterwards. :class:`ConstantStore` evaluates just the constant
subgraph a value depends on, reading initializers from the proto, from the model file
(data :mod:`dlbricks.loading.wire` left there) or from external data files.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto

from dlbricks.errors import ModelError
from dlbricks.loading.messages import one_line
from dlbricks.loading.sizes import itemsize, numel
from dlbricks.model import TensorType

__all__ = ["ConstantStore", "constant_node_type", "type_folded_value"]

# Computed constant values up to this size are kept for later calls (params, shapes);
# weights are recomputed or re-read on each call rather than held for the model's life.
_CACHE_BYTES = 64 * 1024


def constant_node_type(node: onnx.NodeProto) -> tuple[int, tuple[int, ...]] | None:
    """The type of a ``Constant`` node's output, read from its attribute (no data copied)."""
    for a in node.attribute:
        if a.name == "value":
            return a.t.data_type, tuple(a.t.dims)
        if a.name == "sparse_value":
            return a.sparse_tensor.values.data_type, tuple(a.sparse_tensor.dims)
        if a.name == "value_float":
            return TensorProto.FLOAT, ()
        if a.name == "value_floats":
            return TensorProto.FLOAT, (len(a.floats),)
        if a.name == "value_int":
            return TensorProto.INT64, ()
        if a.name == "value_ints":
            return TensorProto.INT64, (len(a.ints),)
        if a.name == "value_string":
            return TensorProto.STRING, ()
        if a.name == "value_strings":
            return TensorProto.STRING, (len(a.strings),)
    return None


def type_folded_value(node: onnx.NodeProto, t: TensorType) -> np.ndarray:
    """The value of ``Shape``/``Size`` of a tensor of type ``t``."""
    if node.op_type == "Size":
        return np.array(t.numel, dtype=np.int64)
    start, end = 0, None
    for a in node.attribute:
        if a.name == "start":
            start = a.i
        elif a.name == "end":
            end = a.i
    # Python slicing clamps out-of-range and negative bounds exactly as Shape-15 does.
    return np.array(t.shape[start:end], dtype=np.int64)


def _failing_node(exc: BaseException) -> onnx.NodeProto | None:
    """The node whose reference kernel raised ``exc``: the innermost ``OpRun`` on its traceback."""
    import traceback

    from onnx.reference.op_run import OpRun

    found = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        obj = frame.f_locals.get("self")
        if isinstance(obj, OpRun):
            found = getattr(obj, "onnx_node", None)
    return found


@functools.lru_cache(maxsize=1)
def _fixed_reference_ops() -> list[type]:
    """Kernels that replace onnx.reference's where it computes wrong or fails on valid input.

    GatherElements: onnx's uses ``np.choose``, which takes at most 32 (older numpy) or 64
    choices, and its fallback for 2-D tensors is correct only for ``axis=0``. Position
    ids exported by transformers (a ``[1, 512]`` buffer gathered along axis 1) hit it.
    """
    from onnx.reference.op_run import OpRun

    class GatherElements(OpRun):
        op_domain = ""

        def _run(self, data, indices, axis=None):
            axis = 0 if axis is None else int(axis)
            if axis < 0:
                axis += data.ndim
            idx = indices.astype(np.int64, copy=False)
            idx = np.where(idx < 0, idx + data.shape[axis], idx)
            return (np.take_along_axis(data, idx, axis=axis),)

    return [GatherElements]


class ConstantStore:
    """Computes values of folded constants by evaluating just their constant subgraph.

    Used during analysis for params (small values) and afterwards by
    :meth:`Model.constant_value` for any constant. Holds the original proto; large
    values are not cached.
    """

    def __init__(
        self,
        proto: onnx.ModelProto,
        label: str,
        path: Path | None,
        spans: Mapping[str, tuple[int, int]],
        producer: Mapping[str, tuple[int, int]],
        order: Sequence[int],
    ) -> None:
        g = proto.graph
        self.proto = proto
        self.label = label
        self.path = path
        self.base_dir = path.parent if path is not None else None
        # Initializers whose data wire.read_proto left in the model file: name -> span.
        self.spans = spans
        self.nodes = list(g.node)
        self.producer = producer
        self.order = order
        self.init = {t.name: t for t in g.initializer}
        self.sparse = {sp.values.name: sp for sp in g.sparse_initializer}
        # Outputs of Shape/Size nodes folded from their input's type.
        self.type_folded: dict[str, np.ndarray] = {}
        self.cache: dict[str, np.ndarray] = {}

    def _keep(self, name: str, arr: np.ndarray) -> None:
        if arr.nbytes <= _CACHE_BYTES:
            self.cache[name] = arr

    def value(self, name: str) -> np.ndarray:
        return self.values([name])[name]

    def values(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """Values of several constants, evaluating their shared ancestors once."""
        targets = list(dict.fromkeys(names))
        known: dict[str, np.ndarray] = {}
        todo: set[int] = set()
        stack = list(targets)
        seen: set[str] = set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in self.cache:
                known[n] = self.cache[n]
            elif n in self.type_folded:
                known[n] = self.type_folded[n]
            elif n in self.init:
                known[n] = self._read_initializer(self.init[n])
                self._keep(n, known[n])
            elif n in self.sparse:
                known[n] = self._read_sparse(self.sparse[n])
                self._keep(n, known[n])
            elif n in self.producer:
                i = self.producer[n][0]
                if i not in todo:
                    todo.add(i)
                    stack.extend(t for t in self.nodes[i].input if t)
            else:
                raise ModelError(f"{self.label}: {n!r} is not a constant")
        if todo:
            known.update(self._evaluate([i for i in self.order if i in todo], targets, known))
        return {n: known[n] for n in targets}

    def _evaluate(
        self, node_ids: list[int], targets: list[str], feeds: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        from onnx.reference import ReferenceEvaluator  # lazy: a heavy import few analyses need

        nodes = [self.nodes[i] for i in node_ids]
        produced = {o for node in nodes for o in node.output if o}
        wanted = [t for t in targets if t in produced]
        used = {t for node in nodes for t in node.input if t}
        feeds = {k: v for k, v in feeds.items() if k in used}
        graph = onnx.helper.make_graph(
            nodes,
            "constants",
            [onnx.ValueInfoProto(name=k) for k in feeds],
            [onnx.ValueInfoProto(name=t) for t in wanted],
        )
        model = onnx.helper.make_model(
            graph, opset_imports=list(self.proto.opset_import), ir_version=self.proto.ir_version
        )
        try:
            # ONNX arithmetic is IEEE: log(0) is -inf, a NaN cast is whatever it is (relative
            # position buckets take the log of 0 and mask it away). numpy's warnings about
            # it are noise to the user.
            with np.errstate(all="ignore"):
                results = ReferenceEvaluator(model, new_ops=_fixed_reference_ops()).run(wanted, feeds)
        except Exception as exc:
            # All wanted values are computed in one run: name the node that failed, the
            # wanted value alone would point at an innocent consumer.
            culprit = _failing_node(exc)
            where = ""
            if culprit is not None:
                named = f"node {culprit.name!r} " if culprit.name else ""
                where = f" ({named}({culprit.op_type}) failed)"
            raise ModelError(
                one_line(f"{self.label}: cannot compute constant {wanted[0]!r}{where}: {type(exc).__name__}: {exc}")
            ) from None
        out = {}
        for t, v in zip(wanted, results):
            arr = np.asarray(v)
            out[t] = arr
            self._keep(t, arr)
        return out

    def _read_initializer(self, t: TensorProto) -> np.ndarray:
        span = self.spans.get(t.name)
        if span is not None:
            return self._read_span(t.name, span)
        if t.data_location != TensorProto.EXTERNAL:
            return onnx.numpy_helper.to_array(t)
        info = {e.key: e.value for e in t.external_data}
        location = info.get("location", "")
        if self.base_dir is None:
            raise ModelError(
                f"{self.label}: tensor {t.name!r} has external data ({location!r}), "
                "but the model was not loaded from a file"
            )
        base = self.base_dir.resolve()
        file = (base / location).resolve()
        # The location comes from the file: never read outside the model's folder.
        if not location or Path(location).is_absolute() or not file.is_relative_to(base):
            raise ModelError(f"{self.label}: tensor {t.name!r} has an invalid external data location {location!r}")
        offset = int(info.get("offset", 0) or 0)
        length = int(info["length"]) if info.get("length") else -1
        try:
            with open(file, "rb") as f:
                f.seek(offset)
                data = f.read(length)
        except FileNotFoundError:
            raise ModelError(
                f"{self.label}: external data file {location!r} for tensor {t.name!r} not found"
            ) from None
        except OSError as exc:
            raise ModelError(
                one_line(f"{self.label}: cannot read external data file {location!r}: {exc.strerror or exc}")
            ) from None
        expected = numel(t.dims) * itemsize(t.data_type)
        if (length >= 0 and len(data) < length) or (t.data_type != TensorProto.STRING and len(data) < expected):
            raise ModelError(
                f"{self.label}: external data file {location!r} is truncated "
                f"(tensor {t.name!r} needs {expected} bytes at offset {offset}, got {len(data)})"
            )
        local = TensorProto()
        local.data_type = t.data_type
        local.dims.extend(t.dims)
        local.raw_data = data
        return onnx.numpy_helper.to_array(local)

    def _read_span(self, name: str, span: tuple[int, int]) -> np.ndarray:
        assert self.path is not None  # spans come only from files
        start, end = span
        try:
            with open(self.path, "rb") as f:
                f.seek(start)
                data = f.read(end - start)
            full = onnx.TensorProto.FromString(data)
        except OSError as exc:
            raise ModelError(one_line(f"{self.label}: cannot read tensor {name!r}: {exc.strerror or exc}")) from None
        except Exception:  # noqa: BLE001 - a parse error: the file changed since loading
            full = None
        if full is None or full.name != name:
            raise ModelError(f"{self.label}: cannot read tensor {name!r}: the file changed since it was loaded")
        return onnx.numpy_helper.to_array(full)

    def _read_sparse(self, sp: onnx.SparseTensorProto) -> np.ndarray:
        values = self._read_initializer(sp.values)
        indices = self._read_initializer(sp.indices).astype(np.int64)
        dense = np.zeros(tuple(sp.dims), dtype=values.dtype)
        if indices.ndim == 1:  # linearised indices
            dense.reshape(-1)[indices] = values
        else:
            dense[tuple(indices.T)] = values
        return dense
