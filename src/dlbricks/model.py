"""The in-memory model that every part of dlbricks works on.

A :class:`Model` is an ONNX graph after loading (see :mod:`dlbricks.loading`):
constants are folded away, every remaining node is a :class:`Layer` with concrete
input and output types, and the graph is also available as flat arrays (per-layer
digests and slot-annotated edges) in the form the C++ core consumes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol

import numpy as np

from dlbricks.errors import DlbricksError
from dlbricks.loading.names import is_default_domain

if TYPE_CHECKING:  # pragma: no cover
    import onnx


@dataclass(frozen=True, slots=True)
class TensorType:
    """Element type (an ``onnx.TensorProto.DataType`` value) and a concrete shape."""

    elem_type: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def dtype(self) -> np.dtype:
        import onnx.helper

        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.elem_type))

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:  # e.g. float32[1x3x224x224]
        return f"{self.dtype.name}[{'x'.join(map(str, self.shape))}]"


@dataclass(frozen=True, slots=True)
class ConstInput:
    """A constant that feeds one input of a layer.

    ``role == "weight"``: identity by dtype and shape only; ``value`` is None (the
    bytes are never needed to analyse, and are synthesised to benchmark).
    ``role == "param"``: an integer tensor or a tiny constant that changes what the
    op does (Reshape's shape, Slice's starts, Pad's pads...); identity by value and
    ``value`` is always present.
    """

    name: str
    type: TensorType
    role: Literal["weight", "param"]
    value: np.ndarray | None = None


@dataclass(slots=True)
class Layer:
    """One node of the folded graph."""

    index: int
    name: str
    op_type: str
    domain: str  # "" for the default ONNX domain
    node: onnx.NodeProto  # attributes (and subgraphs of control-flow ops) live here
    inputs: tuple[str, ...]  # as in the node; "" marks an omitted optional input
    outputs: tuple[str, ...]
    input_types: tuple[TensorType | None, ...]  # None for omitted optional inputs
    output_types: tuple[TensorType | None, ...]  # None for omitted optional outputs
    constants: dict[int, ConstInput]  # input slot -> constant; others are activations
    digest: bytes  # 16 bytes; see dlbricks.digest for the canonical form

    @property
    def kind(self) -> str:
        """``op_type`` qualified by domain when not the default domain."""
        return self.op_type if is_default_domain(self.domain) else f"{self.domain}::{self.op_type}"

    def activation_slots(self) -> list[int]:
        """Input slots fed by activations (not constants, not omitted)."""
        return [i for i, n in enumerate(self.inputs) if n and i not in self.constants]


def unique_layer_name(node_name: str, op_type: str, index: int, taken: set[str]) -> str:
    """Layer ``index``'s name: its node's, else ``<op_type>_<index>``, suffixed with
    ``_<index>`` until not in ``taken`` (which it then joins). Node names need not be
    unique in ONNX; layer names are."""
    name = node_name or f"{op_type}_{index}"
    while name in taken:
        name = f"{name}_{index}"
    taken.add(name)
    return name


class LazyLayers(Sequence[Layer]):
    """A model's layers, built on first use.

    The fast loader (:mod:`dlbricks.loading.fast`) computes digests, edges and layer kinds
    without building a :class:`Layer` per node: analysing a corpus needs no more. The
    layers themselves (nodes, types, constants) are built the first time anything
    reads them. Each layer's :attr:`Layer.kind` is available at once, as ``kinds`` or,
    cheaper for statistics, as codes into a table of distinct kinds
    (:func:`layer_kind_codes`). Pickling materialises the layers, so a pickled model
    never depends on the file.
    """

    __slots__ = ("_kind_table", "_kind_codes", "_kinds", "_build", "_layers", "_names", "_node_names")

    def __init__(
        self,
        kind_table: list[str],
        kind_codes: np.ndarray,
        build: Callable[[], list[Layer]],
        node_names: Callable[[], list[str]] | None = None,
    ):
        self._kind_table = kind_table
        self._kind_codes = kind_codes
        self._kinds: list[str] | None = None
        self._build = build
        self._layers: list[Layer] | None = None
        self._node_names = node_names
        self._names: list[str] | None = None

    @property
    def kinds(self) -> list[str]:
        """Each layer's :attr:`Layer.kind`, without building the layers."""
        if self._kinds is None:
            table = self._kind_table
            self._kinds = [table[k] for k in self._kind_codes.tolist()]
        return self._kinds

    @property
    def names(self) -> list[str]:
        """Each layer's :attr:`Layer.name`, without building the layers."""
        if self._names is None:
            if self._node_names is None:
                self._names = [layer.name for layer in self.materialized()]
            else:
                taken: set[str] = set()
                self._names = [
                    unique_layer_name(node_name, kind.rsplit("::", 1)[-1], idx, taken)
                    for idx, (node_name, kind) in enumerate(zip(self._node_names(), self.kinds))
                ]
        return self._names

    def materialized(self) -> list[Layer]:
        if self._layers is None:
            self._layers = self._build()
        return self._layers

    @property
    def is_materialized(self) -> bool:
        return self._layers is not None

    def __len__(self) -> int:
        return len(self._kind_codes)

    def __getitem__(self, i: Any) -> Any:
        return self.materialized()[i]

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.materialized())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, LazyLayers)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-list semantics

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (self.materialized(),))

    def __repr__(self) -> str:
        state = "built" if self._layers is not None else "not built yet"
        return f"<{len(self)} layers, {state}>"


class LazyMapping(Mapping[str, Any]):
    """A dict built on first use (see :class:`LazyLayers`); pickles as a plain dict."""

    __slots__ = ("_build", "_data")

    def __init__(self, build: Callable[[], dict[str, Any]]):
        self._build = build
        self._data: dict[str, Any] | None = None

    def materialized(self) -> dict[str, Any]:
        if self._data is None:
            self._data = self._build()
        return self._data

    def __getitem__(self, key: str) -> Any:
        return self.materialized()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.materialized())

    def __len__(self) -> int:
        return len(self.materialized())

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (self.materialized(),))

    def __repr__(self) -> str:
        return repr(self.materialized()) if self._data is not None else "<constants, not built yet>"


def layer_names(layers: Sequence[Layer]) -> list[str]:
    """Each layer's :attr:`Layer.name`, without building lazily loaded layers."""
    return list(layers.names) if isinstance(layers, LazyLayers) else [layer.name for layer in layers]


def layer_kinds(layers: Sequence[HasKind]) -> list[str]:
    """Each layer's :attr:`Layer.kind`, without building lazily loaded layers."""
    return list(layers.kinds) if isinstance(layers, LazyLayers) else [layer.kind for layer in layers]


def layer_kind_codes(layers: Sequence[Layer]) -> tuple[list[str], np.ndarray]:
    """Distinct layer kinds and each layer's index into them (int32), without building
    lazily loaded layers; ``table[codes[i]]`` is layer ``i``'s :attr:`Layer.kind`."""
    if isinstance(layers, LazyLayers):
        return layers._kind_table, layers._kind_codes
    index: dict[str, int] = {}
    codes = [index.setdefault(layer.kind, len(index)) for layer in layers]
    return list(index), np.asarray(codes, dtype=np.int32)


@dataclass(slots=True)
class Model:
    """A loaded, folded, shape-inferred model.

    ``edge_*`` arrays describe activation edges between layers: the value produced at
    output slot ``edge_src_slot[k]`` of layer ``edge_src[k]`` is read at input slot
    ``edge_dst_slot[k]`` of layer ``edge_dst[k]``. They are int32 and sorted by
    (dst, dst_slot). ``digests`` is a (n_layers, 16) uint8 array of layer digests.
    """

    name: str
    path: str | None
    ir_version: int
    opset_imports: dict[str, int]
    layers: list[Layer]  # or a LazyLayers, which behaves as a read-only list
    inputs: list[tuple[str, TensorType]]  # activation graph inputs (initializers excluded)
    outputs: list[tuple[str, TensorType]]
    edge_src: np.ndarray
    edge_src_slot: np.ndarray
    edge_dst: np.ndarray
    edge_dst_slot: np.ndarray
    digests: np.ndarray
    # Name of a folded constant -> its type (weights and params alike).
    constant_types: Mapping[str, TensorType] = field(default_factory=dict)
    # Materialises a folded constant's real value on demand (reads external data or
    # evaluates its ConstantOfShape chain). Analysis never calls it.
    _materialize: Callable[[str], np.ndarray] | None = field(default=None, repr=False)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def constant_value(self, name: str) -> np.ndarray:
        """The real value of a folded constant (weights included), computed on demand.

        Raises:
            KeyError: ``name`` is not a constant of this model.
        """
        if name not in self.constant_types:
            raise KeyError(f"{self.name}: {name!r} is not a constant")
        if self._materialize is None:
            raise DlbricksError(f"{self.name}: constant values are not available for this model")
        return self._materialize(name)

    def producers(self) -> dict[str, tuple[int, int]]:
        """Tensor name -> (layer index, output slot) for every layer output."""
        out: dict[str, tuple[int, int]] = {}
        for layer in self.layers:
            for slot, name in enumerate(layer.outputs):
                if name:
                    out[name] = (layer.index, slot)
        return out

    def consumers(self) -> dict[str, list[tuple[int, int]]]:
        """Tensor name -> [(layer index, input slot)] for every activation input."""
        out: dict[str, list[tuple[int, int]]] = {}
        for layer in self.layers:
            for slot in layer.activation_slots():
                out.setdefault(layer.inputs[slot], []).append((layer.index, slot))
        return out


class HasKind(Protocol):
    """A layer as the pipeline reads it: a :class:`Layer`, or a sketch of one."""

    @property
    def kind(self) -> str: ...


class ModelLike(Protocol):
    """What the dedup, the planner and reconstruction read from a model.

    A :class:`Model` offers it; so does :class:`dlbricks.distributed.ModelSketch`, which
    stands in for one where no ONNX node is needed. Generating a brick needs the full
    :class:`Model` (its layers' nodes and types).
    """

    @property
    def name(self) -> str: ...
    @property
    def path(self) -> str | None: ...
    @property
    def layers(self) -> Sequence[HasKind]: ...  # a LazyLayers exposes ``kinds`` without building
    @property
    def n_layers(self) -> int: ...
    @property
    def digests(self) -> np.ndarray: ...
    @property
    def edge_src(self) -> np.ndarray: ...
    @property
    def edge_src_slot(self) -> np.ndarray: ...
    @property
    def edge_dst(self) -> np.ndarray: ...
    @property
    def edge_dst_slot(self) -> np.ndarray: ...


def distinct_names(names: Sequence[str], paths: Sequence[str | None]) -> list[str]:
    """Display names that tell models apart, readable in a table.

    A name shared by several models (``model.onnx`` in every folder of a model zoo) is
    replaced, for each of them, by the shortest suffix of its path (folders joined by
    ``/``, the file without ``.onnx``) that no other model of that name ends with:
    ``zoo/a/model.onnx`` and ``zoo/b/model.onnx`` become ``a/model`` and ``b/model``.
    Models without a path, or whose paths cannot tell them apart, get ``#2``, ``#3``...
    after their name. Names already distinct come back unchanged.

    Args:
        names: each model's name (:attr:`Model.name`).
        paths: each model's file, or None.

    Returns:
        one distinct name per model, in order.
    """
    import os

    if len(names) != len(paths):
        raise ValueError(f"{len(names)} names but {len(paths)} paths")
    groups: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        groups.setdefault(n, []).append(i)
    out = list(names)
    for members in groups.values():
        if len(members) < 2:
            continue
        parts: dict[int, list[str]] = {}
        for i in members:
            p = paths[i]
            if p is not None:
                split = os.path.abspath(os.fspath(p)).replace(os.sep, "/").strip("/").split("/")
                split[-1] = split[-1][: -len(".onnx")] if split[-1].endswith(".onnx") else split[-1]
                parts[i] = split
        for i, own in parts.items():
            for k in range(1, len(own) + 1):
                mine = own[-k:]
                if all(other[-k:] != mine for j, other in parts.items() if j != i):
                    out[i] = "/".join(mine)
                    break
    # What paths could not separate (no path, the same file twice, or a suffix that is
    # another model's name): numbered in order.
    seen: dict[str, int] = {}
    for i, n in enumerate(out):
        seen[n] = seen.get(n, 0) + 1
        if seen[n] > 1:
            candidate = f"{n}#{seen[n]}"
            while candidate in seen:
                seen[n] += 1
                candidate = f"{n}#{seen[n]}"
            seen[candidate] = 1
            out[i] = candidate
    return out


def name_distinctly(models: Sequence[Any]) -> None:
    """Give every model of a corpus a distinct :attr:`~Model.name` (:func:`distinct_names`), in place."""
    names = distinct_names([m.name for m in models], [m.path for m in models])
    for m, n in zip(models, names):
        if m.name != n:
            m.name = n
