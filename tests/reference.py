"""Pure-Python reference of the C++ core: topological order, DLBricks split,
sequence digests (canonical form v2, byte for byte as cpp/src/graph.cpp) and
corpus dedup.

The one reference implementation: ``tests/test_core.py`` checks the core against it,
and ``bench/core.py`` times it next to the core and checks that both give identical
sequence digests. It is written the obvious way (lists, dicts, heapq, hashlib) and
takes plain Python lists, not numpy arrays.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections import Counter
from typing import Sequence

SEQUENCE_DIGEST_VERSION = 2
_MAGIC = b"DLBSEQ\0\0"


def in_edges(
    n: int, src: Sequence[int], src_slot: Sequence[int], dst: Sequence[int], dst_slot: Sequence[int]
) -> list[list[tuple[int, int, int]]]:
    """Per node, its inputs as (dst_slot, src, src_slot), sorted like the core sorts them."""
    inputs: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    for k in range(len(src)):
        s, d = src[k], dst[k]
        if not (0 <= s < n and 0 <= d < n):
            raise ValueError(f"edge {k} ({s} -> {d}) names a node outside [0, {n})")
        if src_slot[k] < 0 or dst_slot[k] < 0:
            raise ValueError(f"edge {k} has a negative slot")
        inputs[d].append((dst_slot[k], s, src_slot[k]))
    for ins in inputs:
        if len(ins) > 1:
            ins.sort()
    return inputs


def topo_order(n: int, src: Sequence[int], dst: Sequence[int]) -> list[int]:
    """Kahn's algorithm taking the smallest ready index first (same result as the core).

    Like the core, it returns the identity at once when every edge already goes
    from a smaller to a larger index (ONNX node lists are topologically sorted).
    """
    if all(s < d for s, d in zip(src, dst)):
        return list(range(n))
    indegree = [0] * n
    succ: list[list[int]] = [[] for _ in range(n)]
    for s, d in zip(src, dst):
        indegree[d] += 1
        succ[s].append(d)
    ready = [v for v in range(n) if indegree[v] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        v = heapq.heappop(ready)
        order.append(v)
        for w in succ[v]:
            indegree[w] -= 1
            if indegree[w] == 0:
                heapq.heappush(ready, w)
    if len(order) != n:
        raise ValueError("the graph has a cycle")
    return order


def _connected(window: list[int], inputs: list[list[tuple[int, int, int]]], where: dict[int, int]) -> bool:
    """Whether the window's nodes are weakly connected through edges inside it."""
    if len(window) == 1:
        return True
    parent = list(range(len(window)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    components = len(window)
    for local, v in enumerate(window):
        for _, s, _ in inputs[v]:
            p = where.get(s)
            if p is not None:
                a, b = find(p), find(local)
                if a != b:
                    parent[b] = a
                    components -= 1
    return components == 1


def sequence_digest(members: list[int], digests: Sequence[bytes], inputs: list[list[tuple[int, int, int]]]) -> bytes:
    """Canonical form v2 of one sequence (members in topological order), hashed.

    Bytes: magic "DLBSEQ\\0\\0", u32 version, u32 member count, the member layer
    digests, u32 internal-edge count, per internal edge u32 (src_local, src_slot,
    dst_local, dst_slot), u32 count of shared external inputs, per shared external
    input u32 (dst_local, dst_slot, shared id). An external input is shared when
    another external input of the sequence reads the same (src, src_slot); shared ids
    number those tensors in order of first appearance. All integers little-endian.
    Edges are listed member by member, each member's inputs sorted by
    (dst_slot, src, src_slot).
    """
    local_of = {v: i for i, v in enumerate(members)}
    internal: list[int] = []
    external: list[tuple[int, int, tuple[int, int]]] = []
    for local, v in enumerate(members):
        for dslot, s, sslot in inputs[v]:
            p = local_of.get(s)
            if p is not None:
                internal += (p, sslot, local, dslot)
            else:
                external.append((local, dslot, (s, sslot)))
    readers = Counter(tensor for _, _, tensor in external)
    shared_ids: dict[tuple[int, int], int] = {}
    shared: list[int] = []
    for local, dslot, tensor in external:
        if readers[tensor] > 1:
            shared += (local, dslot, shared_ids.setdefault(tensor, len(shared_ids)))
    parts = [_MAGIC, struct.pack("<II", SEQUENCE_DIGEST_VERSION, len(members))]
    parts += [digests[v] for v in members]
    parts.append(struct.pack(f"<I{len(internal)}I", len(internal) // 4, *internal))
    parts.append(struct.pack(f"<I{len(shared)}I", len(shared) // 3, *shared))
    return hashlib.blake2b(b"".join(parts), digest_size=16).digest()


def split_sequences(
    digests: Sequence[bytes],
    src: Sequence[int],
    dst: Sequence[int],
    src_slot: Sequence[int] | None,
    dst_slot: Sequence[int] | None,
    G: int,
) -> tuple[list[int], list[int], list[bytes]]:
    """The DLBricks split of one graph: (offsets, members, sequence digests).

    Walk the topological order from position i: if the next min(G, left) layers are
    weakly connected through edges among them they form one sequence, otherwise the
    layer at i alone does.
    """
    if G < 1:
        raise ValueError(f"G must be at least 1, got {G}")
    n = len(digests)
    zeros = [0] * len(src)
    inputs = in_edges(
        n, src, src_slot if src_slot is not None else zeros, dst, dst_slot if dst_slot is not None else zeros
    )
    order = topo_order(n, src, dst)
    offsets = [0]
    members: list[int] = []
    seq_digests: list[bytes] = []
    i = 0
    while i < n:
        window = order[i : i + G]
        if not _connected(window, inputs, {v: p for p, v in enumerate(window)}):
            window = window[:1]
        seq_digests.append(sequence_digest(window, digests, inputs))
        members += window
        offsets.append(len(members))
        i += len(window)
    return offsets, members, seq_digests


def dedup_corpus(
    node_offsets: Sequence[int],
    edge_offsets: Sequence[int],
    digests: Sequence[bytes],
    src: Sequence[int],
    dst: Sequence[int],
    src_slot: Sequence[int] | None,
    dst_slot: Sequence[int] | None,
    G: int,
) -> dict[str, list]:
    """Split every model and unite layers and sequences by digest.

    Same inputs and output keys as ``dlbricks._core.dedup_corpus`` (as lists; unique
    sequence digests as 16-byte ``bytes``). Ids follow first appearance.
    """
    layer_index: dict[bytes, int] = {}
    seq_index: dict[bytes, int] = {}
    out: dict[str, list] = {
        "layer_ids": [],
        "unique_layer_first": [],
        "seq_model_offsets": [0],
        "seq_offsets": [0],
        "seq_members": [],
        "seq_ids": [],
        "unique_seq_digests": [],
        "unique_seq_first": [],
    }
    for i in range(len(node_offsets) - 1):
        a, b = node_offsets[i], node_offsets[i + 1]
        ea, eb = edge_offsets[i], edge_offsets[i + 1]
        model_digests = digests[a:b]
        for v, d in enumerate(model_digests):
            lid = layer_index.get(d)
            if lid is None:
                lid = layer_index[d] = len(layer_index)
                out["unique_layer_first"].append(a + v)
            out["layer_ids"].append(lid)
        try:
            offsets, members, seq_digests = split_sequences(
                model_digests,
                src[ea:eb],
                dst[ea:eb],
                src_slot[ea:eb] if src_slot is not None else None,
                dst_slot[ea:eb] if dst_slot is not None else None,
                G,
            )
        except ValueError as exc:
            raise ValueError(f"model {i}: {exc}") from None
        base = len(out["seq_members"])
        out["seq_members"] += members
        out["seq_offsets"] += [base + o for o in offsets[1:]]
        for d in seq_digests:
            sid = seq_index.get(d)
            if sid is None:
                sid = seq_index[d] = len(seq_index)
                out["unique_seq_digests"].append(d)
                out["unique_seq_first"].append(len(out["seq_ids"]))
            out["seq_ids"].append(sid)
        out["seq_model_offsets"].append(len(out["seq_ids"]))
    return out
