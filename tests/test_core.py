"""Properties of the C++ core, checked through the Python API on random DAGs.

The references here (topological order, split rule, canonical form v2, critical
path, Jaccard) are small independent Python versions written from the documented
rules; the core must agree with them exactly.
"""

from __future__ import annotations

import hashlib
import re
import struct
import subprocess
import sys
import textwrap
from collections import Counter
from itertools import permutations

import numpy as np
import pytest
import reference  # tests/reference.py: the pure-Python core
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import dlbricks
from dlbricks import Corpus, Graph, _core, critical_path, sequence_graph, split, topo_order

SETTINGS = settings(deadline=None, max_examples=40)
FORM_VERSION = reference.SEQUENCE_DIGEST_VERSION  # the canonical form that ref_sequence_digest lays out


# -- builders and references ------------------------------------------------------------
def kind_digest(kind: int) -> bytes:
    return hashlib.blake2b(b"kind%d" % kind, digest_size=16).digest()


def digest_rows(kinds: list[int]) -> np.ndarray:
    return np.frombuffer(b"".join(kind_digest(k) for k in kinds), dtype=np.uint8).reshape(len(kinds), 16)


def make_graph(
    kinds: list[int],
    edges: list[tuple[int, int]],
    src_slot: list[int] | None = None,
    dst_slot: list[int] | None = None,
) -> Graph:
    return Graph(
        digest_rows(kinds),
        np.array([a for a, _ in edges], dtype=np.int32),
        np.array([b for _, b in edges], dtype=np.int32),
        None if src_slot is None else np.array(src_slot, dtype=np.int32),
        None if dst_slot is None else np.array(dst_slot, dtype=np.int32),
    )


@st.composite
def dags(draw: st.DrawFn, max_nodes: int = 12, max_kinds: int = 3, shuffled: bool = True) -> Graph:
    """A random DAG: edges go forward in a hidden order, then nodes are relabelled.

    Each (destination, input slot) gets one producer, as in ONNX; a producer may
    feed several slots of one consumer (Add(x, x)) and read its output slot 0 or 1.
    """
    n = draw(st.integers(0, max_nodes))
    edges: list[tuple[int, int]] = []
    if n > 1:
        pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3 * n))
        edges = [(min(a, b), max(a, b)) for a, b in pairs if a != b]
    perm = draw(st.permutations(range(n))) if shuffled else list(range(n))
    kinds = draw(st.lists(st.integers(0, max_kinds - 1), min_size=n, max_size=n))
    src_slot = draw(st.lists(st.integers(0, 1), min_size=len(edges), max_size=len(edges)))
    used: Counter[int] = Counter()
    dst_slot = []
    for _, b in edges:
        dst_slot.append(used[b])
        used[b] += 1
    return make_graph(kinds, [(perm[a], perm[b]) for a, b in edges], src_slot, dst_slot)


def edge_list(g: Graph) -> list[tuple[int, int, int, int]]:
    """(src, src_slot, dst, dst_slot) of every edge."""
    k = len(g.edge_src)
    ss = g.edge_src_slot if g.edge_src_slot is not None else np.zeros(k, np.int32)
    ds = g.edge_dst_slot if g.edge_dst_slot is not None else np.zeros(k, np.int32)
    return list(zip(g.edge_src.tolist(), ss.tolist(), g.edge_dst.tolist(), ds.tolist()))


def successors(g: Graph) -> list[set[int]]:
    out: list[set[int]] = [set() for _ in range(g.n_layers)]
    for s, d in zip(g.edge_src.tolist(), g.edge_dst.tolist()):
        out[s].add(d)
    return out


def on_a_cycle(g: Graph, v: int) -> bool:
    """Whether v reaches itself through at least one edge."""
    succ = successors(g)
    seen: set[int] = set()
    stack = list(succ[v])
    while stack:
        u = stack.pop()
        if u == v:
            return True
        if u not in seen:
            seen.add(u)
            stack.extend(succ[u])
    return False


def ref_topo(n: int, src: list[int], dst: list[int]) -> list[int]:
    """Kahn's algorithm, smallest ready index first (tests/reference.py)."""
    return reference.topo_order(n, src, dst)


def weakly_connected(nodes: list[int], g: Graph) -> bool:
    inside = set(nodes)
    adj: dict[int, set[int]] = {v: set() for v in nodes}
    for s, d in zip(g.edge_src.tolist(), g.edge_dst.tolist()):
        if s in inside and d in inside:
            adj[s].add(d)
            adj[d].add(s)
    seen = {nodes[0]}
    stack = [nodes[0]]
    while stack:
        for u in adj[stack.pop()] - seen:
            seen.add(u)
            stack.append(u)
    return len(seen) == len(nodes)


def _ref_inputs(g: Graph) -> list[list[tuple[int, int, int]]]:
    src, src_slot, dst, dst_slot = (list(c) for c in zip(*edge_list(g))) if len(g.edge_src) else ([], [], [], [])
    return reference.in_edges(g.n_layers, src, src_slot, dst, dst_slot)


def ref_split(g: Graph, G: int) -> list[list[int]]:
    """The rule: take the next min(G, left) layers if connected, else the first alone."""
    src, src_slot, dst, dst_slot = (list(c) for c in zip(*edge_list(g))) if len(g.edge_src) else ([], [], [], [])
    offsets, members, _ = reference.split_sequences([bytes(d) for d in g.digests], src, dst, src_slot, dst_slot, G)
    return [members[a:b] for a, b in zip(offsets, offsets[1:])]


def ref_sequence_digest(g: Graph, members: list[int]) -> bytes:
    """Canonical form v2 (docs/core.md), laid out byte by byte by tests/reference.py."""
    return reference.sequence_digest(members, [bytes(d) for d in g.digests], _ref_inputs(g))


def relabel(g: Graph, new_of_old: list[int]) -> Graph:
    """The same graph with node v renamed new_of_old[v]."""
    n = g.n_layers
    old_of_new = [0] * n
    for old, new in enumerate(new_of_old):
        old_of_new[new] = old
    m = np.array(new_of_old, dtype=np.int32)
    return Graph(g.digests[old_of_new], m[g.edge_src], m[g.edge_dst], g.edge_src_slot, g.edge_dst_slot)


def digest_list(sp: dlbricks.Split) -> list[bytes]:
    return [bytes(d) for d in sp.digests]


# -- topological order -----------------------------------------------------------------
@SETTINGS
@given(dags(max_nodes=30))
def test_topo_order_is_a_permutation_that_respects_every_edge(g: Graph) -> None:
    order = topo_order(g)
    assert sorted(order.tolist()) == list(range(g.n_layers))
    position = np.empty(g.n_layers, dtype=np.int64)
    position[order] = np.arange(g.n_layers)
    assert np.all(position[g.edge_src] < position[g.edge_dst])


@SETTINGS
@given(dags(max_nodes=30))
def test_topo_order_takes_the_smallest_ready_index_first(g: Graph) -> None:
    assert topo_order(g).tolist() == ref_topo(g.n_layers, g.edge_src.tolist(), g.edge_dst.tolist())


@SETTINGS
@given(dags(max_nodes=30, shuffled=False))
def test_topo_order_of_a_sorted_graph_is_the_identity(g: Graph) -> None:
    assert topo_order(g).tolist() == list(range(g.n_layers))


@SETTINGS
@given(dags(max_nodes=15), st.data())
def test_a_cycle_raises_value_error_naming_a_node_on_it(g: Graph, data: st.DataObject) -> None:
    assume(g.n_layers >= 1)
    # Close a cycle: an edge back from a node b to a node a that reaches b (or a == b).
    a = data.draw(st.integers(0, g.n_layers - 1))
    reach = [a] + [v for v in range(g.n_layers) if v != a and a in _ancestors(g, v)]
    b = data.draw(st.sampled_from(reach))
    cyclic = Graph(g.digests, np.append(g.edge_src, b), np.append(g.edge_dst, a))
    calls = (
        lambda: topo_order(cyclic),
        lambda: split(cyclic, 2),
        lambda: critical_path(cyclic, np.ones(cyclic.n_layers)),
    )
    for call in calls:
        with pytest.raises(ValueError, match=r"cycle through node \d+") as info:
            call()
        v = int(re.search(r"cycle through node (\d+)", str(info.value)).group(1))
        assert on_a_cycle(cyclic, v), (v, edge_list(cyclic))


def _ancestors(g: Graph, v: int) -> set[int]:
    pred: dict[int, set[int]] = {}
    for s, d in zip(g.edge_src.tolist(), g.edge_dst.tolist()):
        pred.setdefault(d, set()).add(s)
    seen: set[int] = set()
    stack = [v]
    while stack:
        for u in pred.get(stack.pop(), ()):
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


@pytest.mark.parametrize("edge", [(0, 3), (3, 0), (-1, 1), (1, -2), (0, 2**31 - 1)])
def test_an_edge_to_a_missing_node_raises_value_error(edge: tuple[int, int]) -> None:
    g = make_graph([0, 1, 2], [(0, 1), (1, 2), edge])
    calls = (
        lambda: topo_order(g),
        lambda: split(g, 2),
        lambda: critical_path(g, np.ones(3)),
        lambda: Corpus([g]).split(2),
    )
    for call in calls:
        with pytest.raises(ValueError, match=re.escape(f"edge 2 ({edge[0]} -> {edge[1]}) names a node outside [0, 3)")):
            call()


def test_a_negative_slot_raises_value_error() -> None:
    g = make_graph([0, 1], [(0, 1)], [0], [-1])
    with pytest.raises(ValueError, match="edge 0 has a negative slot"):
        split(g, 2)


# -- split ------------------------------------------------------------------------------
@SETTINGS
@given(dags(max_nodes=20), st.integers(1, 6))
def test_split_partitions_the_layers_into_connected_runs_of_the_topo_order(g: Graph, G: int) -> None:
    sp = split(g, G)
    members = sp.members.tolist()
    assert sorted(members) == list(range(g.n_layers))  # every layer exactly once
    assert sp.offsets[0] == 0 and sp.offsets[-1] == g.n_layers
    # Sequences concatenated in order are the topological order itself.
    assert members == topo_order(g).tolist()
    assert sp.digests.shape == (len(sp), 16)
    for seq in sp.sequences():
        assert 1 <= len(seq) <= G
        assert weakly_connected(seq.tolist(), g)


@SETTINGS
@given(dags(max_nodes=20), st.integers(1, 6))
def test_split_follows_the_window_rule(g: Graph, G: int) -> None:
    assert [s.tolist() for s in split(g, G).sequences()] == ref_split(g, G)


@SETTINGS
@given(dags(max_nodes=20), st.integers(1, 6))
def test_graph_of_sequences_is_acyclic(g: Graph, G: int) -> None:
    sp = split(g, G)
    src, dst = sequence_graph(g, sp)
    pairs = list(zip(src.tolist(), dst.tolist()))
    assert len(set(pairs)) == len(pairs) and all(s != d for s, d in pairs)
    # Every edge leads to a later sequence (consecutive runs of one topo order), and
    # the sequence graph holds exactly the layer edges that cross sequences.
    assert all(s < d for s, d in pairs)
    of = sp.sequence_of_layer()
    crossing = {(int(of[s]), int(of[d])) for s, d in zip(g.edge_src, g.edge_dst) if of[s] != of[d]}
    assert set(pairs) == crossing


@pytest.mark.parametrize("G", [0, -1, -(2**31)])
def test_split_rejects_G_below_one(G: int) -> None:
    g = make_graph([0, 1], [(0, 1)])
    with pytest.raises(ValueError, match=f"G must be at least 1, got {G}"):
        split(g, G)
    with pytest.raises(ValueError, match=f"G must be at least 1, got {G}"):
        Corpus([g]).split(G)


@pytest.mark.parametrize("G", [2.0, "2", None, True, np.float64(2)])
def test_split_rejects_a_G_that_is_not_an_int(G: object) -> None:
    g = make_graph([0, 1], [(0, 1)])
    with pytest.raises(TypeError, match="G must be an int"):
        split(g, G)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="G must be an int"):
        Corpus([g]).split(G)  # type: ignore[arg-type]


def test_split_accepts_numpy_integer_G() -> None:
    g = make_graph([0, 1, 2], [(0, 1), (1, 2)])
    assert split(g, np.int64(2)).offsets.tolist() == split(g, 2).offsets.tolist()


def test_a_G_beyond_int32_acts_like_a_G_covering_the_whole_graph() -> None:
    # Every window is min(G, layers left), so any G >= n gives the same split; an int
    # G must not fail as a TypeError from the binding's int conversion.
    g = make_graph([0, 1, 2], [(0, 1), (1, 2)])
    assert digest_list(split(g, 2**40)) == digest_list(split(g, 3))
    assert Corpus([g]).split(2**40).n_sequences == 1


# -- sequence digests ----------------------------------------------------------------------
@SETTINGS
@given(dags(max_nodes=15), st.integers(1, 5))
def test_sequence_digests_follow_the_canonical_form(g: Graph, G: int) -> None:
    sp = split(g, G)
    assert digest_list(sp) == [ref_sequence_digest(g, s.tolist()) for s in sp.sequences()]


@SETTINGS
@given(dags(max_nodes=15), st.integers(1, 5))
def test_sequence_digests_survive_renumbering_in_topo_order(g: Graph, G: int) -> None:
    # Renaming every layer by its topological position keeps the order (the renamed
    # graph is sorted, so its order is the identity) and hence the split.
    order = topo_order(g).tolist()
    new_of_old = [0] * g.n_layers
    for p, v in enumerate(order):
        new_of_old[v] = p
    renamed = relabel(g, new_of_old)
    a, b = split(g, G), split(renamed, G)
    assert digest_list(a) == digest_list(b)
    assert [new_of_old[v] for v in a.members.tolist()] == b.members.tolist()


@SETTINGS
@given(dags(max_nodes=15), st.integers(1, 5), st.randoms(use_true_random=False))
def test_sequence_digests_ignore_edge_order(g: Graph, G: int, rnd) -> None:  # noqa: ANN001
    perm = list(range(len(g.edge_src)))
    rnd.shuffle(perm)
    shuffled = Graph(g.digests, g.edge_src[perm], g.edge_dst[perm], g.edge_src_slot[perm], g.edge_dst_slot[perm])
    a, b = split(g, G), split(shuffled, G)
    assert a.members.tolist() == b.members.tolist()
    assert digest_list(a) == digest_list(b)


@SETTINGS
@given(dags(max_nodes=12), st.data())
def test_single_layer_digests_survive_any_renumbering(g: Graph, data: st.DataObject) -> None:
    # At G = 1 every layer is its own sequence, so the multiset of digests cannot
    # depend on names or order at all.
    new_of_old = data.draw(st.permutations(range(g.n_layers)))
    assert Counter(digest_list(split(g, 1))) == Counter(digest_list(split(relabel(g, list(new_of_old)), 1)))


@SETTINGS
@given(dags(max_nodes=15), st.integers(1, 5), st.data())
def test_changing_a_member_digest_changes_only_its_sequence(g: Graph, G: int, data: st.DataObject) -> None:
    assume(g.n_layers >= 1)
    v = data.draw(st.integers(0, g.n_layers - 1))
    digests = g.digests.copy()
    digests[v, data.draw(st.integers(0, 15))] ^= data.draw(st.integers(1, 255))
    a = split(g, G)
    b = split(Graph(digests, g.edge_src, g.edge_dst, g.edge_src_slot, g.edge_dst_slot), G)
    assert a.members.tolist() == b.members.tolist()
    owner = int(a.sequence_of_layer()[v])
    for s, (x, y) in enumerate(zip(digest_list(a), digest_list(b))):
        assert (x != y) == (s == owner)


@SETTINGS
@given(dags(max_nodes=15), st.integers(2, 5), st.data())
def test_changing_an_internal_slot_changes_the_sequence_digest(g: Graph, G: int, data: st.DataObject) -> None:
    sp = split(g, G)
    of = sp.sequence_of_layer()
    internal = [k for k in range(len(g.edge_src)) if of[g.edge_src[k]] == of[g.edge_dst[k]]]
    assume(internal)
    k = data.draw(st.sampled_from(internal))
    which = data.draw(st.sampled_from(["edge_src_slot", "edge_dst_slot"]))
    slots = getattr(g, which).copy()
    slots[k] = slots.max() + 1  # a slot no edge uses yet
    arrays = {"edge_src_slot": g.edge_src_slot, "edge_dst_slot": g.edge_dst_slot, which: slots}
    changed = split(Graph(g.digests, g.edge_src, g.edge_dst, **arrays), G)
    s = int(of[g.edge_dst[k]])
    assert digest_list(changed)[s] != digest_list(sp)[s]


def test_internal_wiring_distinguishes_slots() -> None:
    base = split(make_graph([0, 1], [(0, 1)], [0], [0]), 2)
    other_input = split(make_graph([0, 1], [(0, 1)], [0], [1]), 2)
    other_output = split(make_graph([0, 1], [(0, 1)], [1], [0]), 2)
    assert len(base) == len(other_input) == len(other_output) == 1
    assert len({bytes(base.digests[0]), bytes(other_input.digests[0]), bytes(other_output.digests[0])}) == 3


def test_sharing_of_an_external_input_changes_the_digest() -> None:
    # Layers 2 -> 3 form the last sequence at G = 2. Its two external inputs read one
    # tensor (output 0 of layer 0) or two: outputs of layers 0 and 1, or outputs 0
    # and 1 of layer 0. Only the sharing is hashed, not where tensors come from, so
    # the last two are the same brick.
    shared = make_graph([0, 0, 1, 2], [(0, 2), (0, 3), (2, 3)], [0, 0, 0], [0, 1, 0])
    distinct = make_graph([0, 0, 1, 2], [(0, 2), (1, 3), (2, 3)], [0, 0, 0], [0, 1, 0])
    two_outputs = make_graph([0, 0, 1, 2], [(0, 2), (0, 3), (2, 3)], [0, 1, 0], [0, 1, 0])
    splits = [split(g, 2) for g in (shared, distinct, two_outputs)]
    assert all(sp.sequence(len(sp) - 1).tolist() == [2, 3] for sp in splits)
    shared_d, distinct_d, two_outputs_d = (bytes(sp.digests[-1]) for sp in splits)
    assert shared_d != distinct_d
    assert distinct_d == two_outputs_d


def test_an_unshared_external_input_does_not_change_the_digest() -> None:
    # The brick Conv -> Relu is the same whether its input is a graph input or the
    # output of an earlier layer.
    fed = make_graph([0, 1, 2, 3], [(0, 1), (1, 2), (2, 3)])
    alone = make_graph([2, 3], [(0, 1)])
    assert split(fed, 2).sequence(1).tolist() == [2, 3]
    assert bytes(split(fed, 2).digests[1]) == bytes(split(alone, 2).digests[0])


# Pinned: a change of the canonical form must bump SEQUENCE_DIGEST_VERSION and these.
GOLDEN_RESIDUAL = "f29ea22064dc7485ce7925586ba7c6fa"
GOLDEN_SHARED_INPUT = "38ef650f11baf0f4542f195c6e904a50"
GOLDEN_FED_CHAIN = "cd12d46cfd13c812387267cd3c53692f"


def test_sequence_digest_golden_values() -> None:
    assert dlbricks.SEQUENCE_DIGEST_VERSION == FORM_VERSION
    residual = make_graph([0, 1, 2], [(0, 1), (1, 2), (0, 2)], [0, 0, 0], [0, 0, 1])
    sp = split(residual, 3)
    assert len(sp) == 1
    assert sp.hex_digests()[0] == GOLDEN_RESIDUAL
    shared = make_graph([0, 0, 1, 2], [(0, 2), (0, 3), (2, 3)], [0, 0, 0], [0, 1, 0])
    assert split(shared, 2).hex_digests()[-1] == GOLDEN_SHARED_INPUT
    chain = make_graph([0, 1, 2, 3], [(0, 1), (1, 2), (2, 3)])
    assert split(chain, 2).hex_digests()[1] == GOLDEN_FED_CHAIN


def test_sequence_digest_bytes_of_small_cases() -> None:
    # Spelled out: sequence [2, 3] of the shared-input graph above...
    shared_bytes = (
        b"DLBSEQ\0\0"
        + struct.pack("<II", FORM_VERSION, 2)
        + kind_digest(1)
        + kind_digest(2)
        + struct.pack("<I4I", 1, 0, 0, 1, 0)  # one internal edge: 2.out0 -> 3.in0
        + struct.pack("<I3I3I", 2, 0, 0, 0, 1, 1, 0)  # 2.in0 and 3.in1 read shared tensor 0
    )
    shared = make_graph([0, 0, 1, 2], [(0, 2), (0, 3), (2, 3)], [0, 0, 0], [0, 1, 0])
    assert bytes(split(shared, 2).digests[-1]) == hashlib.blake2b(shared_bytes, digest_size=16).digest()
    # ...and of the chain 0 -> 1 -> 2 -> 3, whose input from layer 1 is not hashed.
    chain_bytes = (
        b"DLBSEQ\0\0"
        + struct.pack("<II", FORM_VERSION, 2)
        + kind_digest(2)
        + kind_digest(3)
        + struct.pack("<I4I", 1, 0, 0, 1, 0)
        + struct.pack("<I", 0)
    )
    chain = make_graph([0, 1, 2, 3], [(0, 1), (1, 2), (2, 3)])
    assert bytes(split(chain, 2).digests[1]) == hashlib.blake2b(chain_bytes, digest_size=16).digest()


@pytest.mark.parametrize("length", [0, 1, 3, 4, 63, 64, 127, 128, 129, 255, 256, 257, 1000, 4096, 4097])
def test_digest128_equals_blake2b_at_block_boundaries(length: int) -> None:
    data = bytes((i * 131 + 7) % 256 for i in range(length))
    assert _core.digest128(data) == hashlib.blake2b(data, digest_size=16).digest()


@SETTINGS
@given(st.binary(max_size=700))
def test_digest128_equals_blake2b(data: bytes) -> None:
    assert _core.digest128(data) == hashlib.blake2b(data, digest_size=16).digest()


# -- corpus ------------------------------------------------------------------------------
corpora = st.lists(dags(max_nodes=10), min_size=1, max_size=5)


@SETTINGS
@given(corpora, st.integers(1, 4))
def test_corpus_split_agrees_with_per_graph_split(graphs: list[Graph], G: int) -> None:
    cs = Corpus(graphs).split(G)
    for i, g in enumerate(graphs):
        mine, alone = cs.model_split(i), split(g, G)
        assert mine.offsets.tolist() == alone.offsets.tolist()
        assert mine.members.tolist() == alone.members.tolist()
        assert digest_list(mine) == digest_list(alone)


@SETTINGS
@given(corpora, st.integers(1, 4))
def test_dedup_is_idempotent(graphs: list[Graph], G: int) -> None:
    once, twice = Corpus(graphs), Corpus(graphs + graphs)
    a, b = once.split(G), twice.split(G)
    assert a.n_unique == b.n_unique and b.n_sequences == 2 * a.n_sequences
    assert np.array_equal(a.unique_digests, b.unique_digests)
    assert once.n_unique_layers == twice.n_unique_layers


@SETTINGS
@given(corpora, st.integers(1, 4), st.randoms(use_true_random=False))
def test_dedup_does_not_depend_on_model_order(graphs: list[Graph], G: int, rnd) -> None:  # noqa: ANN001
    shuffled = graphs[:]
    rnd.shuffle(shuffled)
    a, b = Corpus(graphs), Corpus(shuffled)
    assert {bytes(d) for d in a.split(G).unique_digests} == {bytes(d) for d in b.split(G).unique_digests}
    assert {bytes(d) for d in a.unique_layer_digests} == {bytes(d) for d in b.unique_layer_digests}


@SETTINGS
@given(corpora, st.integers(1, 4))
def test_unique_ids_name_distinct_digests_in_first_appearance_order(graphs: list[Graph], G: int) -> None:
    corpus = Corpus(graphs)
    cs = corpus.split(G)
    all_digests = [d for i in range(len(graphs)) for d in digest_list(split(graphs[i], G))]
    firsts = list(dict.fromkeys(all_digests))
    assert [bytes(d) for d in cs.unique_digests] == firsts
    assert cs.seq_ids.tolist() == [firsts.index(d) for d in all_digests]
    assert cs.unique_first.tolist() == [all_digests.index(d) for d in firsts]
    layers = [bytes(r) for r in corpus.digests]
    first_layers = list(dict.fromkeys(layers))
    assert corpus.layer_ids.tolist() == [first_layers.index(d) for d in layers]


def test_expanding_compact_keys_checks_its_input() -> None:
    digests = np.zeros((2, 16), np.uint8)
    one = np.array([1, 0, 0, 0], np.uint8)  # one member (id 0), no edges, no shared inputs
    keys, offsets = _core.expand_sequence_keys(one, np.array([0, 4]), digests)
    assert offsets.tolist() == [0, len(keys)] and bytes(keys[:8]) == b"DLBSEQ\0\0"
    for bad, what in (
        (np.array([1, 5, 0, 0], np.uint8), "key 0: sequence key names layer id 5 of 2"),
        (np.array([1, 0, 0], np.uint8), "key 0: malformed sequence key"),  # cut short
        (np.array([1, 0, 0, 0, 7], np.uint8), "key 0: malformed sequence key"),  # trailing byte
        (np.array([1, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF], np.uint8), "key 0: malformed sequence key"),  # varint too long
    ):
        for checked in (_core.expand_sequence_keys, _core.compact_sequence_digests):
            with pytest.raises(ValueError, match=what):
                checked(bad, np.array([0, len(bad)]), digests)
    with pytest.raises(ValueError, match="offsets must end at len"):
        _core.expand_sequence_keys(one, np.array([0, 3]), digests)
    with pytest.raises(ValueError, match="decrease"):
        _core.expand_sequence_keys(one, np.array([0, 4, 2, 4]), digests)
    with pytest.raises(ValueError, match="shape"):
        _core.expand_sequence_keys(one, np.array([0, 4]), np.zeros((2, 8), np.uint8))


@settings(deadline=None, max_examples=200)
@given(st.binary(max_size=40), st.lists(st.integers(0, 40), max_size=4))
def test_expanding_arbitrary_bytes_never_crashes(data: bytes, cuts: list[int]) -> None:
    offsets = sorted({0, len(data), *(min(c, len(data)) for c in cuts)})
    compact, layers = np.frombuffer(data, np.uint8), np.arange(48, dtype=np.uint8).reshape(3, 16)
    try:
        keys, out = _core.expand_sequence_keys(compact, np.array(offsets), layers)
    except ValueError:
        with pytest.raises(ValueError):
            _core.compact_sequence_digests(compact, np.array(offsets), layers)
        return
    assert len(out) == len(offsets) and out[-1] == len(keys)
    # Hashing in a scratch buffer gives what hashing the expanded keys gives.
    assert np.array_equal(_core.compact_sequence_digests(compact, np.array(offsets), layers), _core.sequence_digests(keys, out))


@SETTINGS
@given(corpora, st.lists(st.integers(1, 5), min_size=1, max_size=3))
def test_sequence_keys_hash_to_the_digests_the_core_computes(graphs: list[Graph], Gs: list[int]) -> None:
    # Corpus asks the core for each unique sequence's canonical bytes, not its digest;
    # hashing them must give exactly what the core hashes when asked for digests.
    Gs = list(dict.fromkeys(Gs))
    corpus = Corpus(graphs)
    args = (corpus.node_offsets, corpus.edge_offsets, corpus.digests, corpus._src, corpus._dst,
            corpus._src_slot, corpus._dst_slot)
    with_digests = _core.dedup_corpus_many(*args, Gs=Gs)
    for G, sp, direct in zip(Gs, corpus.splits(Gs), with_digests):
        assert "unique_seq_compact" not in direct
        offsets = sp.unique_key_offsets.tolist()
        keys = [bytes(sp.unique_keys[a:b]) for a, b in zip(offsets, offsets[1:])]
        assert len(set(keys)) == len(keys) == sp.n_unique
        assert not sp._digests  # nothing hashed yet
        assert [_core.digest128(k) for k in keys] == [bytes(d) for d in direct["unique_seq_digests"]]
        assert np.array_equal(sp.unique_digests, direct["unique_seq_digests"])
        assert sp.unique_digests is sp.unique_digests  # hashed once
        assert np.array_equal(_core.dedup_corpus(*args, G=G)["unique_seq_digests"], sp.unique_digests)


def test_statistics_hash_no_sequence() -> None:
    graphs = [make_graph([0, 1, 0, 1], [(0, 1), (1, 2), (2, 3)]), make_graph([1, 0], [(0, 1)])]
    corpus = Corpus(graphs)
    corpus.stats([1, 2, 3])
    corpus.models_stats([1, 2, 3])
    assert all(not corpus.split(G)._digests for G in (1, 2, 3))


@pytest.mark.parametrize(
    ("keys", "offsets", "message"),
    [
        (b"abc", [1, 3], "key offsets must start at 0"),
        (b"abc", [0, 2, 1, 3], "key offsets decrease at 1"),
        (b"abc", [0, 2], "key_offsets must end at len(keys)"),
        (b"", [], "key_offsets needs at least one entry"),
    ],
)
def test_sequence_digests_reject_bad_offsets(keys: bytes, offsets: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _core.sequence_digests(np.frombuffer(keys, np.uint8), np.array(offsets, np.int64))


def _blake2b_128(b: bytes) -> bytes:
    return hashlib.blake2b(b, digest_size=16).digest()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=600), st.integers(0, 5).map(lambda k: b"x" * (128 * k))),
                max_size=13))
def test_sequence_digests_are_blake2b_of_each_key_whatever_the_batch(messages: list[bytes]) -> None:
    # Keys are hashed four at a time (one per vector lane) when the CPU allows, lanes
    # of different lengths side by side; each digest must be BLAKE2b-128 of its key,
    # including empty keys and keys of exactly k blocks.
    offsets = np.array([0, *np.cumsum([len(m) for m in messages])], np.int64)
    keys = np.frombuffer(b"".join(messages), np.uint8)
    got = _core.sequence_digests(keys, offsets)
    assert [bytes(d) for d in got] == [_blake2b_128(m) for m in messages]


def test_sequence_digests_of_more_keys_than_one_batch() -> None:
    rng = np.random.default_rng(5)
    messages = [rng.bytes(int(n)) for n in rng.integers(0, 400, 2600)]  # batches of 1024
    offsets = np.array([0, *np.cumsum([len(m) for m in messages])], np.int64)
    got = _core.sequence_digests(np.frombuffer(b"".join(messages), np.uint8), offsets)
    assert [bytes(d) for d in got] == [_blake2b_128(m) for m in messages]


@SETTINGS
@given(corpora, st.integers(1, 4))
def test_occurrences_sum_to_the_number_of_sequences(graphs: list[Graph], G: int) -> None:
    cs = Corpus(graphs).split(G)
    occ = cs.occurrences()
    assert occ.shape == (len(graphs), cs.n_unique)
    assert int(occ.sum()) == cs.n_sequences
    assert occ.sum(axis=1).tolist() == [len(split(g, G)) for g in graphs]
    assert np.all(occ.sum(axis=0) >= 1)


@SETTINGS
@given(corpora, st.lists(st.integers(1, 5), min_size=1, max_size=4))
def test_several_granularities_in_one_pass_equal_one_pass_each(graphs: list[Graph], Gs: list[int]) -> None:
    # Corpus.splits() asks the core for every missing G at once (layers deduplicated and
    # orders built once); each result must be exactly that of its own pass.
    together = Corpus(graphs).splits(Gs)
    for G, got in zip(Gs, together):
        alone_corpus = Corpus(graphs)
        want = alone_corpus.split(G)
        assert got.G == want.G == G
        for field in ("seq_model_offsets", "seq_offsets", "seq_members", "seq_ids", "unique_digests",
                      "unique_first", "model_unique"):
            assert np.array_equal(getattr(got, field), getattr(want, field)), field
    one = Corpus(graphs)
    one.splits(Gs)
    alone_corpus = Corpus(graphs)
    alone_corpus.split(Gs[0])
    assert np.array_equal(one.layer_ids, alone_corpus.layer_ids)
    assert np.array_equal(one._distinct_per_model(None), alone_corpus._distinct_per_model(None))


@SETTINGS
@given(corpora, st.integers(1, 4), st.data())
def test_per_model_counts_and_repeats_match_python_sets(graphs: list[Graph], G: int, data: st.DataObject) -> None:
    # The core counts distinct layers and sequences per model and flags repeats while it
    # dedups; model_stats builds on them. Kinds are drawn from a small vocabulary so
    # that ties in the repeat counts occur.
    kinds = [data.draw(st.lists(st.sampled_from("ABC"), min_size=g.n_layers, max_size=g.n_layers)) for g in graphs]

    class WithLayers:  # a Graph with layers that have a kind, as a Model has
        def __init__(self, g: Graph, ks: list[str]) -> None:
            self.digests, self.edge_src, self.edge_dst = g.digests, g.edge_src, g.edge_dst
            self.edge_src_slot, self.edge_dst_slot = g.edge_src_slot, g.edge_dst_slot
            self.layers = [type("L", (), {"kind": k})() for k in ks]

    # Some models are plain graphs (no layers, so no kinds): they have no repeated types.
    plain = [data.draw(st.booleans()) for _ in graphs]
    members = [g if p else WithLayers(g, ks) for g, ks, p in zip(graphs, kinds, plain)]
    corpus = Corpus(members, names=[f"m{i}" for i in range(len(graphs))])
    rows = corpus.models_stats([G])
    for i, (g, ks) in enumerate(zip(graphs, kinds)):
        layer_digests = [bytes(r) for r in g.digests]
        seqs = digest_list(split(g, G))
        seen: set[bytes] = set()
        repeated: list[str] = []
        for d, k in zip(layer_digests, ks):
            if d in seen:
                repeated.append(k)
            seen.add(d)
        want = {
            "name": f"m{i}",
            "layers": len(layer_digests),
            "unique_layers": len(set(layer_digests)),
            "unique_layer_pct": 100.0 * len(set(layer_digests)) / len(layer_digests) if layer_digests else 0.0,
            "sequences": {str(G): {"sequences": len(seqs), "unique_sequences": len(set(seqs))}},
            "repeated_layer_types": {} if plain[i] else dict(Counter(repeated).most_common()),
        }
        assert rows[i] == want
        assert list(rows[i]["repeated_layer_types"]) == list(want["repeated_layer_types"])  # same order
        assert corpus.model_stats(i, [G]) == want


@SETTINGS
@given(st.lists(st.lists(st.tuples(st.booleans(), st.integers(-1, 5)), max_size=30), max_size=6))
def test_repeated_kinds_count_like_counter_most_common(models: list[list[tuple[bool, int]]]) -> None:
    # Per model: (repeated?, kind code) per layer; a negative code has no kind.
    flat = [layer for model in models for layer in model]
    offsets = np.array([0, *np.cumsum([len(m) for m in models], dtype=np.int64)], dtype=np.int64)
    at, kinds, counts = _core.repeated_kinds(
        offsets, np.array([r for r, _ in flat], dtype=np.uint8), np.array([k for _, k in flat], dtype=np.int32)
    )
    assert at.dtype == np.int64 and kinds.dtype == np.int32 and counts.dtype == np.int64
    assert len(at) == len(models) + 1 and at[0] == 0 and at[-1] == len(kinds) == len(counts)
    for i, model in enumerate(models):
        want = Counter(k for r, k in model if r and k >= 0).most_common()
        assert list(zip(kinds[at[i] : at[i + 1]].tolist(), counts[at[i] : at[i + 1]].tolist())) == want


def test_repeated_kinds_rejects_inconsistent_arrays() -> None:
    flags, codes = np.zeros(3, np.uint8), np.zeros(3, np.int32)
    with pytest.raises(ValueError, match="run from 0 to len"):
        _core.repeated_kinds(np.array([0, 2], np.int64), flags, codes)
    with pytest.raises(ValueError, match="differ in length"):
        _core.repeated_kinds(np.array([0, 3], np.int64), flags, codes[:2])
    with pytest.raises(ValueError, match="decrease"):
        _core.repeated_kinds(np.array([0, 2, 1, 3], np.int64), flags, codes)


@SETTINGS
@given(corpora)
def test_jaccard_matches_python_sets(graphs: list[Graph]) -> None:
    jac = Corpus(graphs).jaccard()
    sets = [{bytes(r) for r in g.digests} for g in graphs]
    m = len(graphs)
    assert jac.shape == (m, m)
    assert np.array_equal(jac, jac.T)
    assert np.all(np.diag(jac) == 1.0)
    assert np.all((jac >= 0.0) & (jac <= 1.0))
    for i in range(m):
        for j in range(m):
            union = sets[i] | sets[j]
            expected = len(sets[i] & sets[j]) / len(union) if union else 1.0
            assert jac[i, j] == expected


# -- critical path -------------------------------------------------------------------------
def brute_force_longest(g: Graph, w: list[float]) -> float:
    """Max over every path (enumerated by DFS) of the sum of its weights."""
    succ = successors(g)
    best = 0.0

    def walk(v: int, total: float) -> None:
        nonlocal best
        best = max(best, total)
        for u in succ[v]:
            walk(u, total + w[u])

    for v in range(g.n_layers):
        walk(v, w[v])
    return best


@SETTINGS
@given(dags(max_nodes=10), st.data())
def test_critical_path_equals_brute_force(g: Graph, data: st.DataObject) -> None:
    n = g.n_layers
    w = data.draw(st.lists(st.integers(0, 20).map(float), min_size=n, max_size=n))
    length, path = critical_path(g, np.array(w))
    assert length == brute_force_longest(g, w)
    if n:
        # The path is a real path whose weights add up to the length.
        edges = set(zip(g.edge_src.tolist(), g.edge_dst.tolist()))
        p = path.tolist()
        assert all((a, b) in edges for a, b in zip(p, p[1:]))
        assert sum(w[v] for v in p) == length
        assert max(w) <= length <= sum(w)
    else:
        assert length == 0.0 and len(path) == 0


@SETTINGS
@given(st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=30))
def test_critical_path_of_a_chain_is_the_sum(w: list[float]) -> None:
    n = len(w)
    g = make_graph([0] * n, [(v, v + 1) for v in range(n - 1)])
    length, path = critical_path(g, np.array(w))
    assert length == pytest.approx(sum(w), rel=1e-12)
    assert path.tolist() == list(range(n))


def test_critical_path_ties_go_to_the_smaller_index() -> None:
    # All-zero weights: every path ties at 0, so the path is the single layer 0.
    chain = make_graph([0] * 3, [(0, 1), (1, 2)])
    length, path = critical_path(chain, np.zeros(3))
    assert length == 0.0 and path.tolist() == [0]
    # Two equal branches 0 -> {1, 2} -> 3: the smaller predecessor, 1, is taken.
    diamond = make_graph([0] * 4, [(0, 2), (0, 1), (2, 3), (1, 3)])
    length, path = critical_path(diamond, np.ones(4))
    assert length == 3.0 and path.tolist() == [0, 1, 3]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_critical_path_rejects_bad_weights(bad: float) -> None:
    g = make_graph([0, 1], [(0, 1)])
    with pytest.raises(ValueError, match=r"weight of node 1 must be finite and >= 0"):
        critical_path(g, np.array([1.0, bad]))


# -- errors: clear ValueErrors, never a crash -------------------------------------------------
@pytest.mark.parametrize("field", ["edge_dst", "edge_src_slot", "edge_dst_slot"])
def test_mismatched_edge_arrays_raise_value_error(field: str) -> None:
    arrays = {
        "edge_dst": np.array([1, 2], np.int32),
        "edge_src_slot": np.zeros(2, np.int32),
        "edge_dst_slot": np.zeros(2, np.int32),
    }
    arrays[field] = arrays[field][:1]
    g = Graph(digest_rows([0, 1, 2]), np.array([0, 1], np.int32), **arrays)
    with pytest.raises(ValueError, match=f"{field} has 1 entries, expected 2"):
        split(g, 2)
    with pytest.raises(ValueError, match=f"{field} has 1 entries, expected 2"):
        Corpus([g]).split(2)
    if field == "edge_dst":
        with pytest.raises(ValueError, match="edge_dst has 1 entries, expected 2"):
            topo_order(g)
        with pytest.raises(ValueError, match="edge_dst has 1 entries, expected 2"):
            critical_path(g, np.ones(3))


@pytest.mark.parametrize("shape", [(3, 15), (3, 17), (48,), (3, 4, 4)])
def test_digests_of_the_wrong_shape_raise_value_error(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"digests must be a \(n, 16\) uint8 array"):
        Graph(np.zeros(shape, np.uint8), [0], [1])
    with pytest.raises(ValueError, match=r"digests must have shape \(n, 16\)"):
        _core.split_sequences(
            np.zeros(shape, np.uint8), np.array([0], np.int32), np.array([1], np.int32), None, None, 2
        )


def test_critical_path_weights_of_the_wrong_length_raise_value_error() -> None:
    g = make_graph([0, 1, 2], [(0, 1)])
    with pytest.raises(ValueError, match=r"weights must have shape \(3,\), got \(2,\)"):
        critical_path(g, np.ones(2))


def _dedup_args(node_offsets: list[int], edge_offsets: list[int]) -> tuple:
    # Three layers, two edges; the offsets under test describe how they split into models.
    return (
        np.array(node_offsets, np.int64),
        np.array(edge_offsets, np.int64),
        digest_rows([0, 1, 2]),
        np.array([0, 1], np.int32),
        np.array([1, 2], np.int32),
        None,
        None,
        2,
    )


@pytest.mark.parametrize(
    ("node_offsets", "edge_offsets", "message"),
    [
        ([0, 2], [0, 2], "node_offsets ends at 2 but there are 3 digests"),
        ([0, 3], [0, 1], "edge_offsets ends at 1 but there are 2 edges"),
        ([0, 4], [0, 2], "node_offsets ends at 4 but there are 3 digests"),
        ([1, 3], [0, 2], "node and edge offsets must start at 0"),
        ([0, 3], [1, 2], "node and edge offsets must start at 0"),
        ([0, 4, 3], [0, 2, 2], "offsets of model 1 decrease"),
        ([0, 3, 3], [0, 3, 2], "offsets of model 1 decrease"),
        ([0, 3], [0, 2, 2], "edge_offsets has 3 entries, expected 2"),
        ([], [], "node_offsets needs at least one entry"),
    ],
)
def test_corpus_offsets_that_do_not_fit_raise_value_error(
    node_offsets: list[int], edge_offsets: list[int], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _core.dedup_corpus(*_dedup_args(node_offsets, edge_offsets))


def test_corpus_errors_name_the_model() -> None:
    good = make_graph([0, 1], [(0, 1)])
    bad = make_graph([0, 1], [(0, 1), (1, 0)])
    bad.name = "looping"
    with pytest.raises(ValueError, match=r"^looping: the graph has a cycle through node [01]$"):
        Corpus([good, bad]).split(2)
    with pytest.raises(ValueError, match=r"^model 1: the graph has a cycle"):
        _core.dedup_corpus(
            np.array([0, 2, 4]), np.array([0, 1, 3]), np.concatenate([good.digests, bad.digests]),
            np.array([0, 0, 1], np.int32), np.array([1, 1, 0], np.int32), None, None, 2,
        )


@pytest.mark.parametrize(
    ("node_offsets", "message"),
    [
        ([0, 2], "node_offsets must run from 0 to len(layer_ids)"),
        ([1, 3], "node_offsets must run from 0 to len(layer_ids)"),
        ([0, 3, 4], "node_offsets must run from 0 to len(layer_ids)"),
        ([0, -1, 3], "offsets of model 0 decrease"),
    ],
)
def test_jaccard_offsets_that_do_not_fit_raise_value_error(node_offsets: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _core.jaccard_matrix(np.array(node_offsets, np.int64), np.zeros(3, np.int32))


@pytest.mark.parametrize("node_offsets", [[0, 5, 3], [0, 2**30, 3], [0, 2**40, 3]])
def test_jaccard_offsets_past_the_end_raise_value_error_not_a_crash(node_offsets: list[int]) -> None:
    # Offsets that overshoot and come back must be rejected before any read. Run in a
    # child process, so a crash fails this test instead of the whole run.
    code = textwrap.dedent(
        f"""
        import numpy as np
        from dlbricks import _core
        try:
            _core.jaccard_matrix(np.array({node_offsets}, np.int64), np.zeros(3, np.int32))
        except ValueError as exc:
            print("ValueError:", exc)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"child exited with {proc.returncode}: {proc.stderr[-500:]}"
    assert proc.stdout.startswith("ValueError:") and "offsets" in proc.stdout, proc.stdout


def test_empty_inputs_are_fine() -> None:
    empty = Graph(np.zeros((0, 16), np.uint8), [], [])
    assert topo_order(empty).tolist() == []
    sp = split(empty, 3)
    assert len(sp) == 0 and sp.offsets.tolist() == [0]
    assert critical_path(empty, np.zeros(0))[0] == 0.0
    cs = Corpus([empty, empty]).split(2)
    assert cs.n_sequences == 0 and cs.n_unique == 0
    assert Corpus([empty, empty]).jaccard().tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert Corpus([]).split(1).n_sequences == 0


def test_permutations_of_three_layers_give_one_order_each() -> None:
    # A small exhaustive check next to the random ones: all labelings of a 3-chain.
    for perm in permutations(range(3)):
        g = make_graph([0, 1, 2], [(perm[0], perm[1]), (perm[1], perm[2])])
        assert topo_order(g).tolist() == list(perm)
        assert split(g, 3).members.tolist() == list(perm)


def test_the_type_stubs_name_exactly_what_the_extension_exports():
    import ast
    from pathlib import Path

    stub = ast.parse((Path(dlbricks.__file__).parent / "_core.pyi").read_text())
    declared = set()
    for node in stub.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            declared.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            declared.add(node.target.id)
    public = {n for n in declared if not n.startswith("_")}
    assert public == {n for n in dir(_core) if not n.startswith("_")}
    methods = {n.name for c in stub.body if isinstance(c, ast.ClassDef) and c.name == "OnnxScan" for n in c.body
               if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    assert methods == {n for n in dir(_core.OnnxScan) if not n.startswith("_")}


# -- limits shared with Python, and the thread's flush-to-zero mode ---------------------------


def test_the_size_limits_python_applies_are_the_extensions():
    from dlbricks import digest
    from dlbricks.loading import sizes

    assert dlbricks.loading.MAX_ELEMENTS == sizes.MAX_ELEMENTS == _core.MAX_ELEMENTS == 2**40
    assert sizes.INLINE_BYTES == _core.INLINE_BYTES == 64 * 1024
    assert digest.PARAM_MAX_ELEMENTS == _core.PARAM_MAX_ELEMENTS == 1
    assert digest.INT_PARAM_MAX_ELEMENTS == _core.INT_PARAM_MAX_ELEMENTS == 4096


def _subnormal_survives() -> bool:
    return bool(np.float32(1e-40) * np.float32(1) != 0)


def test_flush_denormals_sets_reads_back_and_returns_the_previous_mode():
    before = _core.flush_denormals()
    if before is None:
        pytest.skip("no flush-to-zero control on this CPU")
    try:
        assert _core.set_flush_denormals(True) is before
        assert _core.flush_denormals() is True and not _subnormal_survives()
        assert _core.set_flush_denormals(False) is True
        assert _core.flush_denormals() is False and _subnormal_survives()
    finally:
        _core.set_flush_denormals(before)
    assert _core.flush_denormals() is before


def test_flush_denormals_is_per_thread():
    import threading

    if _core.flush_denormals() is None:
        pytest.skip("no flush-to-zero control on this CPU")
    seen = {}

    def other() -> None:
        _core.set_flush_denormals(True)
        seen["other"] = (_core.flush_denormals(), _subnormal_survives())

    main_before = _core.flush_denormals()
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["other"] == (True, False)
    assert _core.flush_denormals() is main_before
