"""Corpus-wide dedup of layers and sequences (the C++ core does the heavy lifting)."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Sequence

import numpy as np

from dlbricks import _core
from dlbricks.errors import ArgumentError
from dlbricks.graph import GraphLike, Split, check_g, check_graph
from dlbricks.model import layer_kind_codes


def _sizes(offsets: np.ndarray) -> list[int]:
    """Sizes of the runs that ``offsets`` delimit, as a list (one numpy call)."""
    o = offsets.tolist()
    return [b - a for a, b in zip(o, o[1:])]


@dataclass(frozen=True, slots=True)
class CorpusSplit:
    """All models split at one ``G`` and their sequences united by digest.

    Attributes:
        G: the granularity.
        seq_model_offsets: model ``i`` owns sequences ``[a, b)`` of the flat lists.
        seq_offsets, seq_members: flat sequence membership (model-local layer indices).
        seq_ids: unique-sequence id of every sequence.
        unique_first: flat index of each unique sequence's first occurrence.
        model_unique: distinct sequence ids within each model.
        compact_keys, compact_key_offsets: the compact form of each unique sequence
            (docs/core.md: members as unique-layer ids), back to back.
        layer_digests: (L, 16) digests of the corpus' unique layers, by id.
        unique_keys, unique_key_offsets: the canonical bytes of each unique sequence
            (the digest's input, docs/core.md), back to back (expanded from the compact
            forms on first use).
        unique_digests: (U, 16) digests of the unique sequences, first-appearance order
            (hashed from the keys on first use: counting unique sequences needs none).
    """

    G: int
    seq_model_offsets: np.ndarray
    seq_offsets: np.ndarray
    seq_members: np.ndarray
    seq_ids: np.ndarray
    unique_first: np.ndarray
    model_unique: np.ndarray
    compact_keys: np.ndarray
    compact_key_offsets: np.ndarray
    layer_digests: np.ndarray = field(repr=False)
    _keys: list = field(default_factory=list, repr=False, compare=False)  # [(keys, offsets)] once expanded
    _digests: list = field(default_factory=list, repr=False, compare=False)  # [digests] once hashed

    def _canonical(self) -> tuple[np.ndarray, np.ndarray]:
        if not self._keys:
            # Two threads may both expand; either result is the same array's worth.
            self._keys.append(_core.expand_sequence_keys(self.compact_keys, self.compact_key_offsets, self.layer_digests))
        return self._keys[0]

    @property
    def unique_keys(self) -> np.ndarray:
        return self._canonical()[0]

    @property
    def unique_key_offsets(self) -> np.ndarray:
        return self._canonical()[1]

    @property
    def unique_digests(self) -> np.ndarray:
        if not self._digests:
            # Each form is expanded and hashed in a scratch buffer: no array of keys.
            self._digests.append(
                _core.compact_sequence_digests(self.compact_keys, self.compact_key_offsets, self.layer_digests)
            )
        return self._digests[0]

    @property
    def n_unique(self) -> int:
        return int(self.compact_key_offsets.shape[0]) - 1

    @property
    def n_sequences(self) -> int:
        return int(self.seq_ids.shape[0])

    def model_split(self, i: int) -> Split:
        """Model ``i``'s own :class:`Split` (offsets rebased to its members)."""
        a, b = int(self.seq_model_offsets[i]), int(self.seq_model_offsets[i + 1])
        offs = self.seq_offsets[a : b + 1]
        members = self.seq_members[offs[0] : offs[-1]]
        digests = self.unique_digests[self.seq_ids[a:b]]
        return Split(self.G, (offs - offs[0]).astype(np.int64), members, digests)

    def model_seq_ids(self, i: int) -> np.ndarray:
        """Unique-sequence ids of model ``i``'s sequences, in its split order."""
        return self.seq_ids[self.seq_model_offsets[i] : self.seq_model_offsets[i + 1]]

    def occurrences(self) -> np.ndarray:
        """(n_models, n_unique) int64 matrix: how often each unique sequence occurs per model."""
        m = len(self.seq_model_offsets) - 1
        model_of_seq = np.repeat(np.arange(m), np.diff(self.seq_model_offsets))
        out = np.zeros((m, self.n_unique), dtype=np.int64)
        np.add.at(out, (model_of_seq, self.seq_ids), 1)
        return out

    def first_occurrence(self, u: int) -> tuple[int, np.ndarray]:
        """(model index, model-local layer indices) of unique sequence ``u``'s first occurrence."""
        flat = int(self.unique_first[u])
        model = int(np.searchsorted(self.seq_model_offsets, flat, side="right") - 1)
        return model, self.seq_members[self.seq_offsets[flat] : self.seq_offsets[flat + 1]]


class Corpus:
    """A set of models, deduplicated by layer and by sequence.

    Args:
        graphs: Models (from :func:`dlbricks.load`) or :class:`~dlbricks.graph.Graph`s.
        names: labels (default: each graph's ``name``).

    Raises:
        TypeError: an element is not a Graph/Model.
        ValueError: a graph is malformed (the message names the model).
    """

    def __init__(self, graphs: Sequence[GraphLike], names: Sequence[str] | None = None) -> None:
        graphs = list(graphs)
        for g in graphs:
            check_graph(g)
        self.graphs = graphs
        self.names = list(names) if names is not None else [str(getattr(g, "name", f"model{i}")) for i, g in enumerate(graphs)]
        if len(self.names) != len(graphs):
            raise ArgumentError(f"{len(self.names)} names for {len(graphs)} models")
        # Offsets summed in Python: one numpy call each (a numpy call costs more than
        # adding up a corpus's counts).
        self.node_offsets = np.array([0, *accumulate(g.digests.shape[0] for g in graphs)], dtype=np.int64)
        self.edge_offsets = np.array([0, *accumulate(g.edge_src.shape[0] for g in graphs)], dtype=np.int64)

        def cat(attr: str, dtype: type, default_zero: bool = False) -> np.ndarray:
            parts = []
            for i, g in enumerate(graphs):
                a = getattr(g, attr)
                if a is None and default_zero:
                    a = np.zeros(g.edge_src.shape[0], dtype=dtype)
                elif len(a) != g.edge_src.shape[0]:
                    # Concatenated, lengths that only add up would shift edges between models.
                    raise ArgumentError(f"{self.names[i]}: {attr} has {len(a)} entries, expected {g.edge_src.shape[0]}")
                parts.append(a)
            # concatenate converts each part (any integer dtype, or a list) to `dtype`.
            return np.concatenate(parts, dtype=dtype) if parts else np.empty(0, dtype)

        self.digests = np.ascontiguousarray(
            np.concatenate([g.digests for g in graphs]) if graphs else np.empty((0, 16), np.uint8)
        )
        self._src = cat("edge_src", np.int32)
        self._dst = cat("edge_dst", np.int32)
        self._src_slot = cat("edge_src_slot", np.int32, default_zero=True)
        self._dst_slot = cat("edge_dst_slot", np.int32, default_zero=True)
        self._splits: dict[int, CorpusSplit] = {}
        self._distinct: dict[int | None, np.ndarray] = {}
        self._layer_ids: np.ndarray | None = None
        self._unique_layer_first: np.ndarray | None = None
        self._repeats: list[dict[str, int]] | None = None
        self._model_unique_layers: np.ndarray | None = None
        self._layer_repeats: np.ndarray | None = None

    # -- layers -----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.graphs)

    @property
    def n_layers(self) -> int:
        return int(self.node_offsets[-1])

    @property
    def layer_ids(self) -> np.ndarray:
        """Unique-layer id of every layer of the corpus (models concatenated)."""
        if self._layer_ids is None:
            self.split(1)
        assert self._layer_ids is not None
        return self._layer_ids

    @property
    def n_unique_layers(self) -> int:
        self.layer_ids  # noqa: B018  (computes on first use)
        assert self._unique_layer_first is not None
        return int(self._unique_layer_first.shape[0])

    @property
    def unique_layer_digests(self) -> np.ndarray:
        self.layer_ids  # noqa: B018
        return self.digests[self._unique_layer_first]

    def model_layer_ids(self, i: int) -> np.ndarray:
        return self.layer_ids[self.node_offsets[i] : self.node_offsets[i + 1]]

    def unique_layer_first(self, u: int) -> tuple[int, int]:
        """(model index, local layer index) of unique layer ``u``'s first occurrence."""
        self.layer_ids  # noqa: B018
        assert self._unique_layer_first is not None
        flat = int(self._unique_layer_first[u])
        model = int(np.searchsorted(self.node_offsets, flat, side="right") - 1)
        return model, flat - int(self.node_offsets[model])

    # -- sequences ---------------------------------------------------------------
    def split(self, G: int) -> CorpusSplit:
        """Split every model at ``G`` and dedup the sequences (cached per ``G``).

        Raises:
            ValueError: ``G < 1`` or a malformed model (the message names it).
        """
        return self.splits([G])[0]

    def splits(self, Gs: Sequence[int]) -> list[CorpusSplit]:
        """:meth:`split` at each G of ``Gs``, the ones not cached yet in one core pass
        (layers deduplicated and each model's order built once for all of them).

        Raises:
            ValueError: a ``G < 1`` or a malformed model (the message names it).
        """
        keys = [check_g(G) for G in Gs]
        missing = list(dict.fromkeys(G for G in keys if G not in self._splits))
        if missing:
            try:
                results = _core.dedup_corpus_many(
                    self.node_offsets,
                    self.edge_offsets,
                    self.digests,
                    self._src,
                    self._dst,
                    self._src_slot,
                    self._dst_slot,
                    Gs=missing,
                    sequence_digests=False,
                )
            except ValueError as exc:
                raise ArgumentError(self._name_model(str(exc))) from None
            layers = results[0]  # every result holds the same layer arrays
            self._layer_ids = layers["layer_ids"]
            self._unique_layer_first = layers["unique_layer_first"]
            layer_digests = self.digests[self._unique_layer_first]
            self._model_unique_layers = layers["model_unique_layers"]
            self._layer_repeats = layers["layer_repeats"]
            for G, r in zip(missing, results):
                self._splits[G] = CorpusSplit(
                    G,
                    r["seq_model_offsets"],
                    r["seq_offsets"],
                    r["seq_members"],
                    r["seq_ids"],
                    r["unique_seq_first"],
                    r["model_unique_seqs"],
                    r["unique_seq_compact"],
                    r["unique_seq_compact_offsets"],
                    layer_digests,
                )
        return [self._splits[G] for G in keys]

    def _name_model(self, message: str) -> str:
        # The core names models by index; users know them by name.
        if message.startswith("model "):
            head, _, rest = message.partition(": ")
            try:
                i = int(head.split()[1])
                return f"{self.names[i]}: {rest}"
            except (ValueError, IndexError):
                pass
        return message

    # -- similarity and statistics -------------------------------------------------
    def jaccard(self) -> np.ndarray:
        """(m, m) Jaccard similarity of the models' layer sets."""
        return _core.jaccard_matrix(self.node_offsets, self.layer_ids)

    def _distinct_per_model(self, key: int | None) -> np.ndarray:
        """Distinct layer ids (key None) or unique-sequence ids at G=key, per model
        (the core counts them while it dedups)."""
        if key is None:
            self.layer_ids  # noqa: B018  (computes on first use)
            assert self._model_unique_layers is not None
            return self._model_unique_layers
        return self.split(key).model_unique

    def model_stats(self, i: int, Gs: Sequence[int] = (1,)) -> dict:
        """Statistics of model ``i``: layers, unique layers, sequences per G, repeated types."""
        return self.models_stats(Gs, only=i)[0]

    def models_stats(self, Gs: Sequence[int] = (1,), only: int | None = None) -> list[dict]:
        """:meth:`model_stats` of every model (or just model ``only``), from whole-corpus
        arrays: per-model Python is only the building of each dict."""
        rows = range(len(self.graphs)) if only is None else [range(len(self.graphs))[only]]
        splits = self.splits(Gs)  # first: one core pass also dedups the layers
        layers = _sizes(self.node_offsets)
        unique = self._distinct_per_model(None).tolist()
        per_G = []
        for G, sp in zip(Gs, splits):
            per_G.append((str(G), _sizes(sp.seq_model_offsets), sp.model_unique.tolist()))
        repeats = self._repeated_kinds()
        out = []
        for i in rows:
            n, u = layers[i], unique[i]
            out.append(
                {
                    "name": self.names[i],
                    "layers": n,
                    "unique_layers": u,
                    "unique_layer_pct": 100.0 * u / n if n else 0.0,
                    "sequences": {g: {"sequences": seqs[i], "unique_sequences": uniq[i]} for g, seqs, uniq in per_G},
                    "repeated_layer_types": dict(repeats[i]),
                }
            )
        return out

    def _repeated_kinds(self) -> list[dict[str, int]]:
        """Per model, the kinds of its repeated layers (every occurrence of a layer after
        its first within the model) with their counts, most common first and ties in
        order of first repeat, as Counter.most_common orders them. Models without
        ``layers`` (plain graphs) have none. The core flags the repeats while it dedups
        and counts them per kind in one pass over the corpus; per model there is only
        the building of its dict (cached)."""
        if self._repeats is None:
            self.layer_ids  # noqa: B018  (computes on first use)
            assert self._layer_repeats is not None
            tables: list[list[str] | None] = []
            codes: list[np.ndarray] = []
            for g, n in zip(self.graphs, _sizes(self.node_offsets)):
                layers = getattr(g, "layers", None)
                if layers is None or n == 0:
                    tables.append(None)
                    codes.append(np.full(n, -1, np.int32))  # no kinds: nothing counts
                    continue
                table, model_codes = layer_kind_codes(layers)
                tables.append(table)
                codes.append(model_codes)
            all_codes = np.concatenate(codes, dtype=np.int32) if codes else np.empty(0, np.int32)
            at, kinds, counts = (
                a.tolist() for a in _core.repeated_kinds(self.node_offsets, self._layer_repeats, all_codes)
            )
            self._repeats = [
                {table[kinds[j]]: counts[j] for j in range(at[i], at[i + 1])} if table is not None else {}
                for i, table in enumerate(tables)
            ]
        return self._repeats

    def stats(self, Gs: Sequence[int] = (1,)) -> dict:
        """Corpus statistics: totals, unique layers and unique sequences per G."""
        splits = self.splits(Gs)  # first: one core pass also dedups the layers
        n = self.n_layers
        u = self.n_unique_layers if n else 0
        out: dict = {
            "models": len(self),
            "layers": n,
            "unique_layers": u,
            "unique_layer_pct": 100.0 * u / n if n else 0.0,
            "sequences": {},
        }
        for G, sp in zip(Gs, splits):
            out["sequences"][str(G)] = {"sequences": sp.n_sequences, "unique_sequences": sp.n_unique}
        return out
