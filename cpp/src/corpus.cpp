#include "dlbricks/corpus.hpp"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace dlbricks {
namespace {

// Open addressing with linear probing over a power-of-two table of (digest, id) slots:
// one cache line per lookup (std::unordered_map costs a bucket load plus a chain of
// node loads, and a division by a prime). Digests are uniform, so their first 8
// bytes are the hash. Ids are handed out by the caller in first-appearance order.
class DigestIndex {
public:
    struct Slot {
        Digest128 key;
        std::int32_t id = -1;
        // The last model the digest occurred in: per-model distinct counts cost no extra
        // memory access, the slot is already in cache after the lookup.
        std::int32_t last_model = -1;
    };

    /// The slot of d, inserting it with id `next` when absent; `inserted` tells which.
    /// The reference is valid until the next call.
    Slot& find_or_insert(const Digest128& d, std::int32_t next, bool& inserted) {
        if (2 * (count_ + 1) > slots_.size()) grow();
        std::size_t i = hash(d) & mask_;
        while (true) {
            Slot& s = slots_[i];
            if (s.id < 0) {
                s.key = d;
                s.id = next;
                ++count_;
                inserted = true;
                return s;
            }
            if (s.key == d) {
                inserted = false;
                return s;
            }
            i = (i + 1) & mask_;
        }
    }

    /// Starts loading d's home slot; a model's sequences are looked up right after.
    void prefetch(const Digest128& d) const {
        if (!slots_.empty()) __builtin_prefetch(&slots_[hash(d) & mask_]);
    }

private:
    static std::size_t hash(const Digest128& d) { return Digest128Hash{}(d); }
    void grow() {
        std::vector<Slot> old = std::move(slots_);
        slots_.assign(old.empty() ? 1024 : 2 * old.size(), Slot{});
        mask_ = slots_.size() - 1;
        for (const Slot& s : old)
            if (s.id >= 0) {
                std::size_t i = hash(s.key) & mask_;
                while (slots_[i].id >= 0) i = (i + 1) & mask_;
                slots_[i] = s;
            }
    }
    std::vector<Slot> slots_;
    std::size_t mask_ = 0;
    std::size_t count_ = 0;
};

}  // namespace

CorpusResult dedup_corpus(const CorpusView& c, int G) {
    if (G < 1) throw std::invalid_argument("G must be at least 1, got " + std::to_string(G));
    if (c.n_models < 0) throw std::invalid_argument("model count must be >= 0");
    if (c.n_models > std::numeric_limits<std::int32_t>::max())
        throw std::invalid_argument("at most 2^31 - 1 models per corpus");
    if (c.node_offsets[0] != 0 || c.edge_offsets[0] != 0)
        throw std::invalid_argument("node and edge offsets must start at 0");
    for (std::int64_t i = 0; i < c.n_models; ++i)
        if (c.node_offsets[i + 1] < c.node_offsets[i] || c.edge_offsets[i + 1] < c.edge_offsets[i])
            throw std::invalid_argument("offsets of model " + std::to_string(i) + " decrease");

    const std::int64_t total_nodes = c.node_offsets[c.n_models];
    CorpusResult r;
    r.layer_ids.resize(static_cast<std::size_t>(total_nodes));
    r.seq_model_offsets.reserve(static_cast<std::size_t>(c.n_models + 1));
    r.seq_model_offsets.push_back(0);
    r.seq_offsets.push_back(0);
    r.seq_members.reserve(static_cast<std::size_t>(total_nodes));

    // Ids are handed out in first-appearance order; the maps are only lookups, so their
    // iteration order never shows in the result.
    DigestIndex layer_index, seq_index;
    std::int32_t n_layers = 0, n_seqs = 0;
    // Per-model distinct counts and repeats come from each slot's last model.
    r.model_unique_layers.assign(static_cast<std::size_t>(c.n_models), 0);
    r.model_unique_seqs.assign(static_cast<std::size_t>(c.n_models), 0);
    r.layer_repeats.assign(static_cast<std::size_t>(total_nodes), 0);

    for (std::int64_t i = 0; i < c.n_models; ++i) {
        const std::int64_t node_base = c.node_offsets[i];
        const std::int64_t edge_base = c.edge_offsets[i];
        GraphView g;
        g.n_nodes = c.node_offsets[i + 1] - node_base;
        g.n_edges = c.edge_offsets[i + 1] - edge_base;
        g.src = c.src + edge_base;
        g.dst = c.dst + edge_base;
        g.src_slot = c.src_slot ? c.src_slot + edge_base : nullptr;
        g.dst_slot = c.dst_slot ? c.dst_slot + edge_base : nullptr;
        g.digests = c.digests + node_base;

        for (std::int64_t v = 0; v < g.n_nodes; ++v) {
            bool inserted;
            auto& slot = layer_index.find_or_insert(g.digests[v], n_layers, inserted);
            r.layer_ids[node_base + v] = slot.id;
            if (inserted) {
                ++n_layers;
                r.unique_layer_first.push_back(node_base + v);
            }
            if (slot.last_model == i) {
                r.layer_repeats[node_base + v] = 1;
            } else {
                slot.last_model = static_cast<std::int32_t>(i);
                ++r.model_unique_layers[i];
            }
        }

        Split split;
        try {
            const Adjacency adj = build_adjacency(g);
            split = split_sequences(g, adj, topo_order(g, adj), G);
        } catch (const std::invalid_argument& e) {
            throw std::invalid_argument("model " + std::to_string(i) + ": " + e.what());
        }
        const std::int64_t member_base = static_cast<std::int64_t>(r.seq_members.size());
        r.seq_members.insert(r.seq_members.end(), split.members.begin(), split.members.end());
        for (const Digest128& d : split.digests) seq_index.prefetch(d);
        for (std::size_t s = 0; s < split.digests.size(); ++s) {
            r.seq_offsets.push_back(member_base + split.offsets[s + 1]);
            bool inserted;
            auto& slot = seq_index.find_or_insert(split.digests[s], n_seqs, inserted);
            const std::int32_t id = slot.id;
            if (inserted) {
                ++n_seqs;
                r.unique_seq_digests.push_back(split.digests[s]);
                r.unique_seq_first.push_back(static_cast<std::int64_t>(r.seq_ids.size()));
            }
            if (slot.last_model != i) {
                slot.last_model = static_cast<std::int32_t>(i);
                ++r.model_unique_seqs[i];
            }
            r.seq_ids.push_back(id);
        }
        r.seq_model_offsets.push_back(static_cast<std::int64_t>(r.seq_ids.size()));
    }
    return r;
}

std::vector<double> jaccard_matrix(std::int64_t m, const std::int64_t* node_offsets, const std::int32_t* layer_ids) {
    // Check every offset before reading any layer id: with the first and last offsets
    // checked by the caller, non-decreasing offsets keep every read in range.
    for (std::int64_t i = 0; i < m; ++i)
        if (node_offsets[i + 1] < node_offsets[i])
            throw std::invalid_argument("offsets of model " + std::to_string(i) + " decrease");
    std::vector<std::vector<std::int32_t>> sets(static_cast<std::size_t>(m));
    for (std::int64_t i = 0; i < m; ++i) {
        auto& s = sets[i];
        s.assign(layer_ids + node_offsets[i], layer_ids + node_offsets[i + 1]);
        std::sort(s.begin(), s.end());
        s.erase(std::unique(s.begin(), s.end()), s.end());
    }
    std::vector<double> out(static_cast<std::size_t>(m * m), 1.0);
    for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = i + 1; j < m; ++j) {
            const auto& a = sets[i];
            const auto& b = sets[j];
            std::size_t common = 0;
            for (std::size_t x = 0, y = 0; x < a.size() && y < b.size();) {
                if (a[x] < b[y]) ++x;
                else if (b[y] < a[x]) ++y;
                else { ++common; ++x; ++y; }
            }
            const std::size_t uni = a.size() + b.size() - common;
            const double sim = uni == 0 ? 1.0 : static_cast<double>(common) / static_cast<double>(uni);
            out[i * m + j] = out[j * m + i] = sim;
        }
    return out;
}

}  // namespace dlbricks
