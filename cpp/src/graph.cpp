#include "dlbricks/graph.hpp"

#include <algorithm>
#include <cstring>
#include <cmath>
#include <functional>
#include <numeric>
#include <queue>
#include <stdexcept>
#include <string>

namespace dlbricks {
namespace {

inline std::int32_t slot_of(const std::int32_t* slots, std::int64_t k) { return slots ? slots[k] : 0; }

// Writes x little-endian at p (room checked by the caller); returns the end.
inline std::uint8_t* put_le32(std::uint8_t* p, std::uint32_t x) {
    p[0] = static_cast<std::uint8_t>(x);
    p[1] = static_cast<std::uint8_t>(x >> 8);
    p[2] = static_cast<std::uint8_t>(x >> 16);
    p[3] = static_cast<std::uint8_t>(x >> 24);
    return p + 4;
}

// Writes the magic and version that begin every canonical sequence key at p; returns
// the end (12 bytes on).
inline std::uint8_t* put_key_header(std::uint8_t* p) {
    std::memcpy(p, "DLBSEQ\0\0", 8);
    return put_le32(p + 8, kSequenceDigestVersion);
}

// Writes x as a LEB128 varint (1 to 5 bytes) at p; returns the end.
inline std::uint8_t* put_varint32(std::uint8_t* p, std::uint32_t x) {
    while (x >= 0x80) {
        *p++ = static_cast<std::uint8_t>(x | 0x80);
        x >>= 7;
    }
    *p++ = static_cast<std::uint8_t>(x);
    return p;
}

[[noreturn]] void throw_cycle(const GraphView& g, const Adjacency& adj, const std::vector<std::int32_t>& indegree) {
    // Every node left with a positive in-degree has a predecessor that is also left,
    // so walking predecessors from any of them must revisit a node: that node is on a cycle.
    std::int32_t start = -1;
    for (std::int64_t v = 0; v < g.n_nodes; ++v)
        if (indegree[v] > 0) {
            start = static_cast<std::int32_t>(v);
            break;
        }
    std::vector<char> seen(static_cast<std::size_t>(g.n_nodes), 0);
    std::int32_t v = start;
    while (!seen[v]) {
        seen[v] = 1;
        std::int32_t next = -1;
        for (std::int64_t k = adj.in_offsets[v]; k < adj.in_offsets[v + 1]; ++k) {
            std::int32_t u = g.src[adj.in_edges[k]];
            if (indegree[u] > 0) {
                next = u;
                break;
            }
        }
        v = next;
    }
    throw std::invalid_argument("the graph has a cycle through node " + std::to_string(v));
}

// Union-find over window positions; windows are at most G nodes, so this stays small.
struct WindowSets {
    std::vector<std::int32_t> parent;
    void reset(std::size_t k) {
        parent.resize(k);
        std::iota(parent.begin(), parent.end(), 0);
    }
    std::int32_t find(std::int32_t x) {
        while (parent[x] != x) x = parent[x] = parent[parent[x]];
        return x;
    }
    bool unite(std::int32_t a, std::int32_t b) {
        a = find(a);
        b = find(b);
        if (a == b) return false;
        parent[b] = a;
        return true;
    }
};

}  // namespace

Adjacency build_adjacency(const GraphView& g) {
    if (g.n_nodes < 0 || g.n_nodes > INT32_MAX) throw std::invalid_argument("node count out of range");
    if (g.n_edges < 0 || g.n_edges > INT32_MAX) throw std::invalid_argument("edge count out of range");
    const std::int64_t n = g.n_nodes;
    Adjacency adj;
    adj.in_offsets.assign(static_cast<std::size_t>(n + 1), 0);
    adj.out_offsets.assign(static_cast<std::size_t>(n + 1), 0);
    for (std::int64_t k = 0; k < g.n_edges; ++k) {
        const std::int32_t s = g.src[k], d = g.dst[k];
        if (s < 0 || s >= n || d < 0 || d >= n)
            throw std::invalid_argument("edge " + std::to_string(k) + " (" + std::to_string(s) + " -> " +
                                        std::to_string(d) + ") names a node outside [0, " + std::to_string(n) + ")");
        if (slot_of(g.src_slot, k) < 0 || slot_of(g.dst_slot, k) < 0)
            throw std::invalid_argument("edge " + std::to_string(k) + " has a negative slot");
        ++adj.in_offsets[d + 1];
        ++adj.out_offsets[s + 1];
    }
    for (std::int64_t v = 0; v < n; ++v) {
        adj.in_offsets[v + 1] += adj.in_offsets[v];
        adj.out_offsets[v + 1] += adj.out_offsets[v];
    }
    adj.in_edges.resize(static_cast<std::size_t>(g.n_edges));
    adj.out_nodes.resize(static_cast<std::size_t>(g.n_edges));
    std::vector<std::int64_t> in_fill(adj.in_offsets.begin(), adj.in_offsets.end() - 1);
    std::vector<std::int64_t> out_fill(adj.out_offsets.begin(), adj.out_offsets.end() - 1);
    for (std::int64_t k = 0; k < g.n_edges; ++k) {
        adj.in_edges[in_fill[g.dst[k]]++] = static_cast<std::int32_t>(k);
        adj.out_nodes[out_fill[g.src[k]]++] = g.dst[k];
    }
    // Canonical order of each node's inputs, so digests do not depend on edge order.
    auto by_slot = [&g](std::int32_t a, std::int32_t b) {
        const auto ka = std::make_tuple(slot_of(g.dst_slot, a), g.src[a], slot_of(g.src_slot, a));
        const auto kb = std::make_tuple(slot_of(g.dst_slot, b), g.src[b], slot_of(g.src_slot, b));
        return ka < kb;
    };
    for (std::int64_t v = 0; v < n; ++v) {
        auto first = adj.in_edges.begin() + adj.in_offsets[v];
        auto last = adj.in_edges.begin() + adj.in_offsets[v + 1];
        if (last - first > 1 && !std::is_sorted(first, last, by_slot)) std::sort(first, last, by_slot);
    }
    return adj;
}

std::vector<std::int32_t> topo_order(const GraphView& g, const Adjacency& adj) {
    const std::int64_t n = g.n_nodes;
    std::vector<std::int32_t> order;
    order.reserve(static_cast<std::size_t>(n));
    // Fast path: ONNX requires topologically sorted nodes, so most inputs already are;
    // the smallest-index rule then returns the identity.
    bool sorted = true;
    for (std::int64_t k = 0; k < g.n_edges && sorted; ++k) sorted = g.src[k] < g.dst[k];
    if (sorted) {
        for (std::int64_t v = 0; v < n; ++v) order.push_back(static_cast<std::int32_t>(v));
        return order;
    }
    std::vector<std::int32_t> indegree(static_cast<std::size_t>(n));
    for (std::int64_t v = 0; v < n; ++v)
        indegree[v] = static_cast<std::int32_t>(adj.in_offsets[v + 1] - adj.in_offsets[v]);
    std::priority_queue<std::int32_t, std::vector<std::int32_t>, std::greater<std::int32_t>> ready;
    for (std::int64_t v = 0; v < n; ++v)
        if (indegree[v] == 0) ready.push(static_cast<std::int32_t>(v));
    while (!ready.empty()) {
        const std::int32_t v = ready.top();
        ready.pop();
        order.push_back(v);
        for (std::int64_t k = adj.out_offsets[v]; k < adj.out_offsets[v + 1]; ++k)
            if (--indegree[adj.out_nodes[k]] == 0) ready.push(adj.out_nodes[k]);
    }
    if (static_cast<std::int64_t>(order.size()) != n) throw_cycle(g, adj, indegree);
    return order;
}

Split split_sequences(const GraphView& g, int G) {
    const Adjacency adj = build_adjacency(g);
    return split_sequences(g, adj, topo_order(g, adj), G);
}

std::uint8_t* expand_sequence_key(const std::uint8_t* key, std::size_t size, const Digest128* digest_of_id,
                                  std::size_t n_ids, std::uint8_t* out) {
    // Checked: every read stays inside the form, every id names a digest, and the form
    // ends where its size says (the public array API hands arbitrary bytes here).
    const std::uint8_t* q = key;
    const std::uint8_t* const end = key + size;
    auto word = [&]() {
        std::uint32_t x = 0;
        for (unsigned shift = 0;; shift += 7) {
            if (q >= end || shift > 28) throw std::invalid_argument("malformed sequence key");
            const std::uint8_t b = *q++;
            x |= static_cast<std::uint32_t>(b & 0x7f) << shift;
            if (b < 0x80) return x;
        }
    };
    const std::uint32_t n_members = word();
    std::uint8_t* p = put_le32(put_key_header(out), n_members);
    for (std::uint32_t k = 0; k < n_members; ++k, p += 16) {
        const std::uint32_t id = word();
        if (id >= n_ids)
            throw std::invalid_argument("sequence key names layer id " + std::to_string(id) + " of " +
                                        std::to_string(n_ids));
        std::memcpy(p, digest_of_id[id].bytes.data(), 16);
    }
    for (int part = 0; part < 2; ++part) {  // internal edges (4 words each), shared inputs (3)
        const std::uint32_t count = word();
        p = put_le32(p, count);
        for (std::uint64_t k = 0; k < std::uint64_t{count} * (part == 0 ? 4 : 3); ++k) p = put_le32(p, word());
    }
    if (q != end) throw std::invalid_argument("malformed sequence key");
    return p;
}

Split split_sequences(const GraphView& g, const Adjacency& adj, const std::vector<std::int32_t>& order, int G,
                      SequenceSink* sink, const std::int32_t* member_ids) {
    if (G < 1) throw std::invalid_argument("G must be at least 1, got " + std::to_string(G));
    if (g.n_nodes > 0 && g.digests == nullptr) throw std::invalid_argument("layer digests are required to split");
    const std::int64_t n = g.n_nodes;
    std::vector<std::int64_t> position(static_cast<std::size_t>(n));
    for (std::int64_t p = 0; p < n; ++p) position[order[p]] = p;

    Split out;
    out.offsets.reserve(static_cast<std::size_t>(n / G + 2));
    out.members.reserve(static_cast<std::size_t>(n));
    out.offsets.push_back(0);
    WindowSets sets;

    // Sequence digest canonical form (docs/core.md; kSequenceDigestVersion): magic, version, member count,
    // member digests in window order, internal edges, then the external inputs that
    // share a source with another external input.
    struct ExternalInput {
        std::uint32_t dst_local, dst_slot;
        std::int32_t src, src_slot;
    };
    std::vector<std::uint32_t> internal;  // 4 words per edge
    std::vector<ExternalInput> external;
    std::vector<std::pair<std::int64_t, std::uint32_t>> groups;  // (src node << 32 | slot) -> group id
    std::vector<std::uint32_t> group_of, group_size, shared_id;
    std::vector<std::uint8_t> bytes;  // canonical form of the current sequence

    // The canonical bytes of one sequence are laid out in `bytes` and hashed in one call
    // (feeding the hasher 4 bytes at a time cost more than the compression itself).
    // begin_key sizes the buffer, writes magic, version and member count and returns
    // where the members go; open_count leaves room for the shared-input count, which
    // end_key fills in before it hands the bytes [start, end) on.
    const bool compact = sink != nullptr && member_ids != nullptr;
    // A word of the form: fixed-width, or a varint in the compact form.
    auto put_word = [compact](std::uint8_t* p, std::uint32_t x) { return compact ? put_varint32(p, x) : put_le32(p, x); };
    auto begin_key = [&](std::size_t need, std::uint32_t n_members) {
        need += need / 4 + 16;  // room for varints (5 bytes per 4-byte word at most)
        if (bytes.size() < need) bytes.resize(need);
        std::uint8_t* p = compact ? bytes.data() : put_key_header(bytes.data());
        return put_word(p, n_members);
    };
    // A member: its digest, or its id in the compact form.
    auto put_member = [&](std::uint8_t* p, std::int32_t v) {
        out.members.push_back(v);
        if (compact) return put_varint32(p, static_cast<std::uint32_t>(member_ids[v]));
        std::memcpy(p, g.digests[v].bytes.data(), 16);
        return p + 16;
    };
    // The count's room: 4 bytes, or 1 in the compact form (a varint; end_key shifts the
    // entries in the rare case of 128 shared inputs or more; begin_key's slack covers it).
    auto open_count = [compact](std::uint8_t* p) { return p + (compact ? 1 : 4); };
    auto end_key = [&](std::uint8_t* count_at, std::uint32_t n_shared_inputs, std::uint8_t* end) {
        if (!compact) {
            put_le32(count_at, n_shared_inputs);
        } else if (n_shared_inputs < 0x80) {
            *count_at = static_cast<std::uint8_t>(n_shared_inputs);
        } else {
            std::uint8_t count[5];
            const auto len = static_cast<std::size_t>(put_varint32(count, n_shared_inputs) - count);
            std::memmove(count_at + len, count_at + 1, static_cast<std::size_t>(end - (count_at + 1)));
            std::memcpy(count_at, count, len);
            end += len - 1;
        }
        const auto n_bytes = static_cast<std::size_t>(end - bytes.data());
        if (sink != nullptr) sink->sequence(bytes.data(), n_bytes);
        else out.digests.push_back(digest128(bytes.data(), n_bytes));
        out.offsets.push_back(static_cast<std::int64_t>(out.members.size()));
    };

    // One layer with few inputs (every window at G=1, and each fallback to a single
    // layer): no internal edges, and the inputs that share a source are found by
    // comparing the few in-edges pairwise; the bytes are those the general form below
    // writes.
    constexpr std::int64_t kSmallFanIn = 8;
    auto emit_single = [&](std::int32_t v) {
        const std::int64_t first = adj.in_offsets[v], fan_in = adj.in_offsets[v + 1] - first;
        std::uint8_t* p = begin_key(16 + 16 + 4 + 4 + 12 * static_cast<std::size_t>(fan_in), 1);
        p = put_word(put_member(p, v), 0);  // no internal edges
        std::uint8_t* count_at = p;
        p = open_count(p);
        std::uint32_t n_shared_inputs = 0, next_shared = 0;
        std::uint32_t shared[kSmallFanIn];  // shared id of edge k's source, by first edge
        for (std::int64_t k = 0; k < fan_in; ++k) {
            const std::int32_t e = adj.in_edges[first + k];
            std::int64_t same = -1;  // an earlier edge from the same source and slot
            bool later = false;      // or a later one
            for (std::int64_t j = 0; j < fan_in; ++j) {
                if (j == k) continue;
                const std::int32_t o = adj.in_edges[first + j];
                if (g.src[o] != g.src[e] || slot_of(g.src_slot, o) != slot_of(g.src_slot, e)) continue;
                if (j < k) { same = j; break; }
                later = true;
            }
            if (same < 0 && !later) continue;  // a source of its own: not written
            const std::uint32_t id = same < 0 ? next_shared++ : shared[same];
            shared[k] = id;
            ++n_shared_inputs;
            p = put_word(put_word(put_word(p, 0), static_cast<std::uint32_t>(slot_of(g.dst_slot, e))), id);
        }
        end_key(count_at, n_shared_inputs, p);
    };

    auto emit = [&](std::int64_t begin, std::int64_t size) {
        if (size == 1) {
            const std::int32_t v = order[begin];
            if (adj.in_offsets[v + 1] - adj.in_offsets[v] <= kSmallFanIn) return emit_single(v);
        }
        internal.clear();
        external.clear();
        for (std::int64_t local = 0; local < size; ++local) {
            const std::int32_t v = order[begin + local];
            for (std::int64_t k = adj.in_offsets[v]; k < adj.in_offsets[v + 1]; ++k) {
                const std::int32_t e = adj.in_edges[k];
                const std::int64_t p = position[g.src[e]];
                if (p >= begin && p < begin + size) {
                    internal.push_back(static_cast<std::uint32_t>(p - begin));
                    internal.push_back(static_cast<std::uint32_t>(slot_of(g.src_slot, e)));
                    internal.push_back(static_cast<std::uint32_t>(local));
                    internal.push_back(static_cast<std::uint32_t>(slot_of(g.dst_slot, e)));
                } else {
                    external.push_back({static_cast<std::uint32_t>(local),
                                        static_cast<std::uint32_t>(slot_of(g.dst_slot, e)), g.src[e],
                                        slot_of(g.src_slot, e)});
                }
            }
        }
        groups.clear();
        group_of.clear();
        for (const ExternalInput& x : external) {
            const std::int64_t key = (static_cast<std::int64_t>(x.src) << 32) | static_cast<std::uint32_t>(x.src_slot);
            std::uint32_t group = static_cast<std::uint32_t>(groups.size());
            for (const auto& kv : groups)
                if (kv.first == key) {
                    group = kv.second;
                    break;
                }
            if (group == groups.size()) groups.emplace_back(key, group);
            group_of.push_back(group);
        }
        group_size.assign(groups.size(), 0);
        for (std::uint32_t grp : group_of) ++group_size[grp];
        const std::size_t need =
            16 + 16 * static_cast<std::size_t>(size) + 4 + 4 * internal.size() + 4 + 12 * external.size();
        std::uint8_t* p = begin_key(need, static_cast<std::uint32_t>(size));
        auto put_u32 = [&](std::uint32_t x) { p = put_word(p, x); };
        for (std::int64_t local = 0; local < size; ++local) p = put_member(p, order[begin + local]);
        put_u32(static_cast<std::uint32_t>(internal.size() / 4));
        for (std::uint32_t w : internal) put_u32(w);
        std::uint8_t* count_at = p;
        p = open_count(p);
        shared_id.assign(groups.size(), UINT32_MAX);
        std::uint32_t n_shared_inputs = 0, next_shared = 0;
        for (std::size_t k = 0; k < external.size(); ++k) {
            const std::uint32_t grp = group_of[k];
            if (group_size[grp] < 2) continue;
            if (shared_id[grp] == UINT32_MAX) shared_id[grp] = next_shared++;
            ++n_shared_inputs;
            put_u32(external[k].dst_local);
            put_u32(external[k].dst_slot);
            put_u32(shared_id[grp]);
        }
        end_key(count_at, n_shared_inputs, p);
    };

    auto window_connected = [&](std::int64_t begin, std::int64_t size) {
        if (size == 1) return true;
        sets.reset(static_cast<std::size_t>(size));
        std::int64_t components = size;
        for (std::int64_t local = 0; local < size; ++local) {
            const std::int32_t v = order[begin + local];
            for (std::int64_t k = adj.in_offsets[v]; k < adj.in_offsets[v + 1]; ++k) {
                const std::int64_t p = position[g.src[adj.in_edges[k]]];
                if (p >= begin && p < begin + size &&
                    sets.unite(static_cast<std::int32_t>(p - begin), static_cast<std::int32_t>(local)))
                    if (--components == 1) return true;
            }
        }
        return components == 1;
    };

    std::int64_t i = 0;
    while (i < n) {
        const std::int64_t size = std::min<std::int64_t>(G, n - i);
        if (window_connected(i, size)) {
            emit(i, size);
            i += size;
        } else {
            emit(i, 1);
            i += 1;
        }
    }
    return out;
}

CriticalPath critical_path(const GraphView& g, const double* weights) {
    const Adjacency adj = build_adjacency(g);
    const std::vector<std::int32_t> order = topo_order(g, adj);
    const std::int64_t n = g.n_nodes;
    for (std::int64_t v = 0; v < n; ++v)
        if (!(weights[v] >= 0.0) || !std::isfinite(weights[v]))
            throw std::invalid_argument("weight of node " + std::to_string(v) + " must be finite and >= 0, got " +
                                        std::to_string(weights[v]));
    std::vector<double> finish(static_cast<std::size_t>(n), 0.0);
    std::vector<std::int32_t> best_pred(static_cast<std::size_t>(n), -1);
    CriticalPath result;
    std::int32_t end = -1;
    for (std::int32_t v : order) {
        double start = 0.0;
        for (std::int64_t k = adj.in_offsets[v]; k < adj.in_offsets[v + 1]; ++k) {
            const std::int32_t u = g.src[adj.in_edges[k]];
            if (best_pred[v] < 0 || finish[u] > start || (finish[u] == start && u < best_pred[v])) {
                start = finish[u];
                best_pred[v] = u;
            }
        }
        finish[v] = start + weights[v];
        if (end < 0 || finish[v] > finish[end] || (finish[v] == finish[end] && v < end)) end = v;
    }
    if (end >= 0) {
        result.length = finish[end];
        for (std::int32_t v = end; v >= 0; v = best_pred[v]) result.path.push_back(v);
        std::reverse(result.path.begin(), result.path.end());
    }
    return result;
}

}  // namespace dlbricks
