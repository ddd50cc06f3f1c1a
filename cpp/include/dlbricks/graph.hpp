// Graph algorithms on one model given as flat arrays: topological order, the
// DLBricks split into layer sequences, sequence digests and the critical path.
//
// A graph has n nodes (layers) and slot-annotated edges: edge k carries output slot
// src_slot[k] of node src[k] into input slot dst_slot[k] of node dst[k]. Nodes are
// identified by their index; names never reach the core.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dlbricks/digest.hpp"

namespace dlbricks {

/// Version of the sequence digest's canonical form (see docs/core.md). Bump it
/// whenever the bytes fed to the hash change: digests key persisted results.
constexpr std::uint32_t kSequenceDigestVersion = 2;

/// A non-owning view of one graph. Arrays must stay alive and unchanged while used.
struct GraphView {
    std::int64_t n_nodes = 0;
    std::int64_t n_edges = 0;
    const std::int32_t* src = nullptr;
    const std::int32_t* src_slot = nullptr;  // may be null: all slots 0
    const std::int32_t* dst = nullptr;
    const std::int32_t* dst_slot = nullptr;  // may be null: all slots 0
    const Digest128* digests = nullptr;      // n_nodes digests; needed by split only
};

/// Incoming edges grouped by destination (CSR), each group sorted by (dst_slot, src,
/// src_slot), and outgoing successor lists. Built once per graph. Cost: O(n + e log d).
struct Adjacency {
    std::vector<std::int64_t> in_offsets;   // n + 1
    std::vector<std::int32_t> in_edges;     // edge indices
    std::vector<std::int64_t> out_offsets;  // n + 1
    std::vector<std::int32_t> out_nodes;    // successor node per outgoing edge
};

/// Checks every index and slot, then builds the adjacency. Throws std::invalid_argument
/// naming the first bad edge. Cost: O(n + e log d).
Adjacency build_adjacency(const GraphView& g);

/// Deterministic topological order: Kahn's algorithm that always takes the ready node
/// with the smallest index, so an already topological node list is returned as is.
/// Throws std::invalid_argument naming a node on a cycle. Cost: O(n log n + e).
std::vector<std::int32_t> topo_order(const GraphView& g, const Adjacency& adj);

/// The result of splitting one graph: sequence s holds members[offsets[s]..offsets[s+1])
/// in topological order; digests[s] is its sequence digest.
struct Split {
    std::vector<std::int64_t> offsets;
    std::vector<std::int32_t> members;
    std::vector<Digest128> digests;
};

/// The DLBricks split (FindModelSubgraphs / SplitModel) at granularity G >= 1.
/// Walk the topological order from position i: if the window of the next min(G, left)
/// layers is weakly connected through edges inside it, it becomes one sequence and i
/// advances past it; otherwise the layer at i alone becomes a sequence and i advances
/// by one. Windows are consecutive runs of one topological order, so every layer is
/// in exactly one sequence and the graph of sequences is acyclic.
/// Precondition: digests set. Throws std::invalid_argument (G < 1, cycle, bad edge).
/// Cost: O(n log n + e log d) plus hashing O(n + e).
Split split_sequences(const GraphView& g, int G);

/// Receives each sequence's canonical bytes (the input of its digest), in split order,
/// or its compact form (see split_sequences' member_ids).
class SequenceSink {
public:
    virtual void sequence(const std::uint8_t* bytes, std::size_t size) = 0;

protected:
    ~SequenceSink() = default;
};

/// Same, reusing an adjacency and an order already computed for g. With a sink, the
/// sequences' canonical bytes go to it and `digests` stays empty: a corpus dedups by
/// those bytes and hashes only the sequences it has not seen (most repeat).
///
/// With a sink and `member_ids` (one per node; equal ids exactly for equal digests, as
/// a corpus' unique-layer ids), the sink gets each sequence's compact form instead: the
/// canonical words without magic and version, each member digest replaced by its id,
/// every word a LEB128 varint.
/// Equal compact forms mean equal canonical bytes, and expand_sequence_key turns one
/// into the other. A corpus compares and stores ~20 bytes per sequence instead of ~90.
Split split_sequences(const GraphView& g, const Adjacency& adj, const std::vector<std::int32_t>& order,
                      int G, SequenceSink* sink = nullptr, const std::int32_t* member_ids = nullptr);

/// The most bytes expand_sequence_key writes for a compact form of `size` bytes: the
/// 12-byte header, and 16 bytes (a digest) at most per byte of the form.
constexpr std::size_t expanded_key_bound(std::size_t size) { return 16 + 16 * size; }

/// Writes at `out` the canonical bytes of the sequence whose compact form (see
/// split_sequences) is [key, key + size); digest_of_id[id] (id < n_ids) is the digest of
/// member id. Returns the end of what it wrote: at most expanded_key_bound(size)
/// bytes, which `out` must have room for. Throws std::invalid_argument on a malformed
/// form or an id out of range. Cost: O(size).
std::uint8_t* expand_sequence_key(const std::uint8_t* key, std::size_t size, const Digest128* digest_of_id,
                                  std::size_t n_ids, std::uint8_t* out);

/// Longest path through the DAG where node i weighs weights[i] (>= 0 and finite).
/// Returns the length and the nodes on one longest path, source first; ties go to the
/// smaller predecessor index. Throws std::invalid_argument on a cycle or bad weight.
/// Cost: O(n log n + e).
struct CriticalPath {
    double length = 0.0;
    std::vector<std::int32_t> path;
};
CriticalPath critical_path(const GraphView& g, const double* weights);

}  // namespace dlbricks
