"""Graph-level API over the C++ core: topological order, split, critical path.

Everything here works on flat arrays, so programmatically built graphs (an
architecture-search space of a million small models, say) can be analysed without
writing ONNX files. A :class:`~dlbricks.model.Model` is accepted wherever a
:class:`Graph` is, since it carries the same arrays.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Protocol, runtime_checkable

import numpy as np

from dlbricks import _core
from dlbricks.errors import ArgumentError, ArgumentTypeError

#: The largest G the core takes (an int32); any larger G splits as this one does.
MAX_G = 2**31 - 1


@runtime_checkable
class GraphLike(Protocol):
    """Anything with per-layer digests and slot-annotated activation edges (read only)."""

    @property
    def digests(self) -> np.ndarray: ...
    @property
    def edge_src(self) -> np.ndarray: ...
    @property
    def edge_dst(self) -> np.ndarray: ...
    @property
    def edge_src_slot(self) -> np.ndarray | None: ...
    @property
    def edge_dst_slot(self) -> np.ndarray | None: ...


@dataclass(slots=True)
class Graph:
    """A layer graph as flat arrays.

    Args:
        digests: (n, 16) uint8, one 16-byte layer digest per layer.
        edge_src, edge_dst: int32 arrays, one entry per activation edge (layer indices).
        edge_src_slot, edge_dst_slot: output/input slot of each edge; None means 0.
        name: a label used in messages and reports.
    """

    digests: np.ndarray
    edge_src: np.ndarray
    edge_dst: np.ndarray
    edge_src_slot: np.ndarray | None = None
    edge_dst_slot: np.ndarray | None = None
    name: str = "graph"

    def __post_init__(self) -> None:
        self.digests = _as_digests(self.digests)
        self.edge_src = _as_index_array(self.edge_src, "edge_src")
        self.edge_dst = _as_index_array(self.edge_dst, "edge_dst")
        if self.edge_src_slot is not None:
            self.edge_src_slot = _as_index_array(self.edge_src_slot, "edge_src_slot")
        if self.edge_dst_slot is not None:
            self.edge_dst_slot = _as_index_array(self.edge_dst_slot, "edge_dst_slot")

    @property
    def n_layers(self) -> int:
        return int(self.digests.shape[0])


@dataclass(frozen=True, slots=True)
class Split:
    """A partition of a graph's layers into sequences (bricks) at granularity ``G``.

    Sequence ``s`` holds layers ``members[offsets[s]:offsets[s+1]]`` in topological
    order; ``digests[s]`` is its 16-byte sequence digest.
    """

    G: int
    offsets: np.ndarray
    members: np.ndarray
    digests: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sequence(self, s: int) -> np.ndarray:
        """Layer indices of sequence ``s``."""
        return self.members[self.offsets[s] : self.offsets[s + 1]]

    def sequences(self) -> list[np.ndarray]:
        return [self.sequence(s) for s in range(len(self))]

    def sequence_of_layer(self) -> np.ndarray:
        """int32 array: the sequence index of every layer."""
        out = np.empty(len(self.members), dtype=np.int32)
        out[self.members] = np.repeat(np.arange(len(self), dtype=np.int32), np.diff(self.offsets))
        return out

    def hex_digests(self) -> list[str]:
        return [bytes(d).hex() for d in self.digests]


def _as_digests(digests: np.ndarray) -> np.ndarray:
    arr = np.asarray(digests)
    if arr.dtype != np.uint8 or arr.ndim != 2 or arr.shape[1] != 16:
        raise ArgumentError(f"digests must be a (n, 16) uint8 array, got {arr.dtype} {arr.shape}")
    return np.ascontiguousarray(arr)


_INT32 = np.iinfo(np.int32)


def _as_index_array(values: object, name: str) -> np.ndarray:
    """``values`` as a contiguous int32 vector: integers only (a float index would be
    truncated, one past int32 wrapped around to another layer)."""
    if values is None:
        raise ArgumentTypeError(f"{name} must be an array of layer indices, got None")
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ArgumentError(f"{name} must be a 1-d array of integers, got {arr.dtype} {arr.shape}")
    if arr.size and (int(arr.min()) < _INT32.min or int(arr.max()) > _INT32.max):
        raise ArgumentError(f"{name} holds a value outside int32 (min {arr.min()}, max {arr.max()})")
    return np.ascontiguousarray(arr, dtype=np.int32)


def check_g(G: object) -> int:
    """``G`` as the core takes it: an int >= 1, capped at :data:`MAX_G` (any G of at
    least a model's layer count splits it alike).

    Raises:
        ArgumentTypeError: not an int. ArgumentError: below 1.
    """
    if isinstance(G, bool) or not isinstance(G, (int, np.integer)):
        raise ArgumentTypeError(f"G must be an int, got {type(G).__name__}")
    if G < 1:
        raise ArgumentError(f"G must be at least 1, got {G}")
    return min(int(G), MAX_G)


_GRAPH_ATTRS = ("digests", "edge_src", "edge_dst", "edge_src_slot", "edge_dst_slot")


def check_graph(graph: object) -> None:
    """Raise ``TypeError`` unless ``graph`` has a :class:`GraphLike`'s arrays: what
    ``isinstance(graph, GraphLike)`` checks, without typing's protocol machinery,
    which costs more than analysing a small model."""
    if not all(hasattr(graph, a) for a in _GRAPH_ATTRS):
        raise ArgumentTypeError(f"expected a dlbricks Graph or Model, got {type(graph).__name__}")


def topo_order(graph: GraphLike) -> np.ndarray:
    """Deterministic topological order of a graph's layers.

    Among ready layers the one with the smallest index goes first, so a node list
    that is already topological comes back unchanged.

    Returns:
        int32 array, a permutation of ``range(n_layers)``.
    Raises:
        ValueError: an edge names a missing layer, or the graph has a cycle (the
            message names a layer on it).
    """
    check_graph(graph)
    with _core_errors():
        return _core.topo_order(graph.digests.shape[0], graph.edge_src, graph.edge_dst)


def split(graph: GraphLike, G: int) -> Split:
    """The DLBricks split of a graph into sequences of at most ``G`` layers.

    Rule: walk the topological order; if the next ``min(G, left)`` layers form a weakly
    connected window (through edges inside it) they become one sequence, otherwise the
    first layer alone does and the window moves on by one layer.

    Raises:
        TypeError: ``graph`` is not a Graph/Model; ``G`` is not an int.
        ValueError: ``G < 1``, a bad edge, or a cycle.
    """
    check_graph(graph)
    G = check_g(G)
    with _core_errors():
        offsets, members, digests = _core.split_sequences(
            graph.digests,
            graph.edge_src,
            graph.edge_dst,
            graph.edge_src_slot,
            graph.edge_dst_slot,
            G,
        )
    return Split(G, offsets, members, digests)


def critical_path(graph: GraphLike, weights: np.ndarray) -> tuple[float, np.ndarray]:
    """Longest path through the graph where layer ``i`` weighs ``weights[i]``.

    Returns:
        (length, path): the path's layer indices, source first.
    Raises:
        ValueError: negative or non-finite weight, wrong length, cycle.
    """
    check_graph(graph)
    w = np.ascontiguousarray(weights, dtype=np.float64)
    if w.shape != (graph.digests.shape[0],):
        raise ArgumentError(f"weights must have shape ({graph.digests.shape[0]},), got {w.shape}")
    with _core_errors():
        return _core.critical_path(w, graph.edge_src, graph.edge_dst)


@contextlib.contextmanager
def _core_errors() -> Iterator[None]:
    """The core's ValueError (a bad edge, a cycle) as an :class:`ArgumentError`; its
    message already names the layer."""
    try:
        yield
    except ValueError as exc:
        if isinstance(exc, ArgumentError):
            raise
        raise ArgumentError(str(exc)) from None


def sequence_graph(graph: GraphLike, split_: Split) -> tuple[np.ndarray, np.ndarray]:
    """Edges of the graph of sequences (each pair once, no self-loops).

    Returns:
        (src, dst) int32 arrays of sequence indices.
    """
    of = split_.sequence_of_layer()
    s = of[graph.edge_src]
    d = of[graph.edge_dst]
    keep = s != d
    pairs = np.unique(np.stack([s[keep], d[keep]], axis=1), axis=0) if keep.any() else np.empty((0, 2), np.int32)
    return pairs[:, 0].astype(np.int32), pairs[:, 1].astype(np.int32)
