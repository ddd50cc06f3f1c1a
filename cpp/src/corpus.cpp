#include "dlbricks/corpus.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace dlbricks {
namespace {

// Doubles an open-addressing table (`first` slots to start) whose slots mark empty
// with id < 0, re-placing every used slot by linear probing from hash_of(slot).
template <class Slot, class HashOf>
void grow_table(std::vector<Slot>& slots, std::size_t& mask, HashOf hash_of, std::size_t first = 1024) {
    std::vector<Slot> old = std::move(slots);
    // Default-constructed in place: filling with copies of one empty slot made GCC
    // rebuild that slot on the stack for each copy (a store-forwarding stall per slot).
    slots = std::vector<Slot>(old.empty() ? first : 2 * old.size());
    mask = slots.size() - 1;
    for (const Slot& s : old)
        if (s.id >= 0) {
            std::size_t i = static_cast<std::size_t>(hash_of(s)) & mask;
            while (slots[i].id >= 0) i = (i + 1) & mask;
            slots[i] = s;
        }
}

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

private:
    static std::size_t hash(const Digest128& d) { return Digest128Hash{}(d); }
    void grow() {
        grow_table(slots_, mask_, [](const Slot& s) { return hash(s.key); });
    }
    std::vector<Slot> slots_;
    std::size_t mask_ = 0;
    std::size_t count_ = 0;
};

// Unique sequences keyed by their compact form (see split_sequences): equal forms mean
// an equal digest, so BLAKE2b runs once per unique sequence instead of once per
// sequence (on the architecture-search corpus of bench/core.py, four in five sequences
// repeat). The table is open addressing over 32-byte slots that hold a 32-bit check of
// the hash and the key itself when it is short (a sequence of up to three layers with
// ids below 128, the common case, takes ~15 bytes), so a lookup reads one slot and
// nothing else; longer keys live back to back in an arena.
class SequenceIndex {
public:
    static constexpr std::size_t kInline = 16;  // keys up to this size live in their slot
    struct Slot {
        std::uint32_t check = 0;  // the hash's high half
        std::int32_t id = -1;
        std::int32_t last_model = -1;  // as DigestIndex::Slot
        std::uint32_t size = 0;
        // The key, or for a longer one where it begins in the arena (its first 8 bytes).
        std::uint8_t key[kInline] = {};
    };

    /// Frees the table and the keys; the index is empty afterwards.
    void release() {
        slots_ = {};
        arena_ = {};
        hash_of_id_ = {};
        mask_ = count_ = 0;
    }

    /// Room for n more keys without growing (so prefetched slots stay where they are).
    void reserve(std::size_t n) {
        while (2 * (count_ + n) > slots_.size()) grow();
    }
    void prefetch(std::uint64_t hash) const { __builtin_prefetch(&slots_[hash & mask_]); }

    /// The slot of the key (whose bytes_hash is `hash`), inserting it with id `next` (=
    /// the number of keys so far) when absent. Precondition: reserve() made room, and
    /// n < 2^32. The reference is valid until the next call.
    Slot& find_or_insert(std::uint64_t hash, const std::uint8_t* key, std::size_t n, std::int32_t next,
                         bool& inserted) {
        const auto check = static_cast<std::uint32_t>(hash >> 32);
        std::size_t i = hash & mask_;
        while (true) {
            Slot& s = slots_[i];
            if (s.id < 0) {
                s.check = check;
                s.id = next;
                s.last_model = -1;
                s.size = static_cast<std::uint32_t>(n);
                if (n <= kInline) {
                    std::memcpy(s.key, key, n);
                } else {
                    const std::uint64_t at = arena_.size();
                    std::memcpy(s.key, &at, sizeof at);
                    arena_.insert(arena_.end(), key, key + n);
                }
                hash_of_id_.push_back(hash);  // ids are 0, 1, 2... in insertion order
                ++count_;
                inserted = true;
                return s;
            }
            if (s.check == check && s.size == n && bytes_equal(key_of(s), key, n)) {
                inserted = false;
                return s;
            }
            i = (i + 1) & mask_;
        }
    }

private:
    const std::uint8_t* key_of(const Slot& s) const {
        if (s.size <= kInline) return s.key;
        std::uint64_t at;
        std::memcpy(&at, s.key, sizeof at);
        return arena_.data() + at;
    }
    void grow() {
        // Slots keep only a check of the hash; the full hashes are kept by id.
        grow_table(slots_, mask_, [this](const Slot& s) { return hash_of_id_[static_cast<std::size_t>(s.id)]; });
    }
    std::vector<std::uint64_t> hash_of_id_;
    std::vector<Slot> slots_;
    std::size_t mask_ = 0;
    std::size_t count_ = 0;
    std::vector<std::uint8_t> arena_;
};

// Digests of sequence keys, appended to `out` in the order they are added, a batch at a
// time: the canonical keys (docs/core.md) of a batch lie in one buffer and are hashed
// four at a time (blake2b128_jobs). A batch holds at most kBatch keys, so the scratch
// stays small and in cache whatever the corpus.
class DigestBatch {
public:
    explicit DigestBatch(std::vector<Digest128>& out) : out_(out) {}

    /// A compact form, expanded here (the expander's errors are thrown as they are).
    void add_compact(const std::uint8_t* key, std::size_t size, const Digest128* digest_of_id, std::size_t n_ids) {
        Blake2bJob job = start_;
        job.offset = bytes_.size();
        bytes_.resize(job.offset + expanded_key_bound(size));
        auto* at = reinterpret_cast<std::uint8_t*>(bytes_.data()) + job.offset;
        job.size = static_cast<std::size_t>(expand_sequence_key(key, size, digest_of_id, n_ids, at) - at);
        bytes_.resize(job.offset + job.size);
        push(job);
    }
    /// A canonical key as it is.
    void add_key(const std::uint8_t* key, std::size_t size) {
        Blake2bJob job = start_;
        job.offset = bytes_.size();
        job.size = size;
        bytes_.append(reinterpret_cast<const char*>(key), size);
        push(job);
    }
    /// Hashes what is left.
    void flush() {
        const std::size_t at = out_.size();
        out_.resize(at + jobs_.size());
        blake2b128_jobs(reinterpret_cast<const std::uint8_t*>(bytes_.data()), jobs_.data(), jobs_.size(), out_.data() + at);
        jobs_.clear();
        bytes_.clear();
    }

private:
    static constexpr std::size_t kBatch = 1024;
    void push(const Blake2bJob& job) {
        jobs_.push_back(job);
        if (jobs_.size() == kBatch) flush();
    }
    static Blake2bJob initial_job() {
        std::string none;
        return Blake2b128().job(none);  // a fresh hash has nothing buffered
    }

    std::vector<Digest128>& out_;
    const Blake2bJob start_ = initial_job();
    std::string bytes_;
    std::vector<Blake2bJob> jobs_;
};

// Collects one model's sequences from split_sequences, then dedups them corpus-wide in
// one pass. Two passes so that the table slots, prefetched while the split runs, are
// in cache by the time they are read: at 10^6 layers the table is megabytes and a
// lookup right after hashing waited for memory every time.
//
// Sequences arrive in their compact form (members as unique-layer ids, see
// split_sequences): the index compares and keeps those, less than half the canonical
// bytes, so a repeated sequence (most are) costs one cache line of key instead of two.
// A new sequence's canonical bytes are written out from its compact form, for its
// digest; without digests the compact forms of the unique sequences are the result.
class CorpusSequences final : public SequenceSink {
public:
    CorpusSequences(CorpusResult& r, bool digests, const std::vector<Digest128>& digest_of_id)
        : r_(r), digests_(digests), digest_of_id_(digest_of_id), batch_(r.unique_seq_digests) {
        if (!digests_) r_.unique_seq_compact_offsets.push_back(0);
    }

    /// Starts model `model`, which has at most `sequences` sequences: the table makes
    /// room for them first, so that the slots prefetched while they arrive stay put.
    void begin(std::int32_t model, std::int64_t sequences) {
        model_ = model;
        pending_.clear();
        bytes_.clear();
        index_.reserve(static_cast<std::size_t>(sequences));
    }

    void sequence(const std::uint8_t* bytes, std::size_t size) override {
        const std::uint64_t h = bytes_hash(bytes, size);
        index_.prefetch(h);
        pending_.push_back(Pending{h, bytes_.size(), size});
        bytes_.insert(bytes_.end(), bytes, bytes + size);
    }

    /// Dedups the model's sequences, appending their ids to seq_ids.
    void end() {
        for (const Pending& p : pending_) {
            const std::uint8_t* key = bytes_.data() + p.at;
            bool inserted;
            auto& slot = index_.find_or_insert(p.hash, key, p.size, n_seqs_, inserted);
            const std::int32_t id = slot.id;
            if (inserted) {
                ++n_seqs_;
                if (digests_) {
                    batch_.add_compact(key, p.size, digest_of_id_.data(), digest_of_id_.size());
                } else {
                    r_.unique_seq_compact.insert(r_.unique_seq_compact.end(), key, key + p.size);
                    r_.unique_seq_compact_offsets.push_back(static_cast<std::int64_t>(r_.unique_seq_compact.size()));
                }
                r_.unique_seq_first.push_back(static_cast<std::int64_t>(r_.seq_ids.size()));
            }
            if (slot.last_model != model_) {
                slot.last_model = model_;
                ++r_.model_unique_seqs[static_cast<std::size_t>(model_)];
            }
            r_.seq_ids.push_back(id);
        }
        batch_.flush();  // the model's new sequences
    }

    /// After the last model: frees the index (the canonical keys are already out).
    void done() { index_.release(); }

private:
    struct Pending {
        std::uint64_t hash;
        std::size_t at, size;  // in bytes_
    };
    CorpusResult& r_;
    const bool digests_;
    const std::vector<Digest128>& digest_of_id_;  // grows as the corpus' layers are found
    DigestBatch batch_;                             // the model's new sequences, for their digests
    SequenceIndex index_;
    std::vector<Pending> pending_;
    std::vector<std::uint8_t> bytes_;
    std::int32_t model_ = 0;
    std::int32_t n_seqs_ = 0;
};

}  // namespace

std::vector<CorpusResult> dedup_corpus(const CorpusView& c, const std::vector<int>& Gs, bool digests) {
    if (Gs.empty()) throw std::invalid_argument("no granularity given");
    for (int G : Gs)
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
    std::vector<CorpusResult> results(Gs.size());
    // Layers are the same at every G: deduplicated once, into the first result.
    CorpusResult& layers = results[0];
    layers.layer_ids.resize(static_cast<std::size_t>(total_nodes));
    layers.model_unique_layers.assign(static_cast<std::size_t>(c.n_models), 0);
    layers.layer_repeats.assign(static_cast<std::size_t>(total_nodes), 0);
    std::vector<Digest128> unique_layer_digest;  // by unique-layer id
    std::vector<std::unique_ptr<CorpusSequences>> sequences;
    for (CorpusResult& r : results) {
        r.seq_model_offsets.reserve(static_cast<std::size_t>(c.n_models + 1));
        r.seq_model_offsets.push_back(0);
        r.seq_offsets.push_back(0);
        r.seq_members.reserve(static_cast<std::size_t>(total_nodes));
        r.model_unique_seqs.assign(static_cast<std::size_t>(c.n_models), 0);
        sequences.push_back(std::make_unique<CorpusSequences>(r, digests, unique_layer_digest));
    }

    // Ids are handed out in first-appearance order; the maps are only lookups, so their
    // iteration order never shows in the result. Per-model distinct counts and repeats
    // come from each slot's last model.
    DigestIndex layer_index;
    std::int32_t n_layers = 0;
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
            layers.layer_ids[node_base + v] = slot.id;
            if (inserted) {
                ++n_layers;
                layers.unique_layer_first.push_back(node_base + v);
                unique_layer_digest.push_back(g.digests[v]);
            }
            if (slot.last_model == i) {
                layers.layer_repeats[node_base + v] = 1;
            } else {
                slot.last_model = static_cast<std::int32_t>(i);
                ++layers.model_unique_layers[i];
            }
        }

        // The adjacency and the order serve every G.
        Adjacency adj;
        std::vector<std::int32_t> order;
        try {
            adj = build_adjacency(g);
            order = topo_order(g, adj);
        } catch (const std::invalid_argument& e) {
            throw std::invalid_argument("model " + std::to_string(i) + ": " + e.what());
        }
        for (std::size_t k = 0; k < Gs.size(); ++k) {
            CorpusResult& r = results[k];
            sequences[k]->begin(static_cast<std::int32_t>(i), g.n_nodes);  // at most one per layer
            const Split split =
                split_sequences(g, adj, order, Gs[k], sequences[k].get(), layers.layer_ids.data() + node_base);
            sequences[k]->end();
            const std::int64_t member_base = static_cast<std::int64_t>(r.seq_members.size());
            r.seq_members.insert(r.seq_members.end(), split.members.begin(), split.members.end());
            for (std::size_t s = 0; s + 1 < split.offsets.size(); ++s)
                r.seq_offsets.push_back(member_base + split.offsets[s + 1]);
            r.seq_model_offsets.push_back(static_cast<std::int64_t>(r.seq_ids.size()));
        }
    }
    for (auto& s : sequences) s->done();
    return results;
}

CorpusResult dedup_corpus(const CorpusView& c, int G, bool digests) {
    return std::move(dedup_corpus(c, std::vector<int>{G}, digests)[0]);
}

namespace {

// n keys' offsets (n + 1 of them): from 0, never decreasing.
void check_key_offsets(const std::int64_t* offsets, std::int64_t n) {
    if (n < 0) throw std::invalid_argument("key count must be >= 0");
    if (offsets[0] != 0) throw std::invalid_argument("key offsets must start at 0");
    for (std::int64_t u = 0; u < n; ++u)
        if (offsets[u + 1] < offsets[u]) throw std::invalid_argument("key offsets decrease at " + std::to_string(u));
}

void check_compact_offsets(const std::int64_t* offsets, std::int64_t n, std::int64_t n_layers) {
    if (n_layers < 0) throw std::invalid_argument("layer count must be >= 0");
    check_key_offsets(offsets, n);
}

// Runs `step` on key u; an error it throws names the key.
template <class Step>
auto for_key(std::int64_t u, Step&& step) {
    try {
        return step();
    } catch (const std::invalid_argument& e) {
        throw std::invalid_argument("key " + std::to_string(u) + ": " + e.what());
    }
}

}  // namespace

std::vector<Digest128> compact_sequence_digests(const std::uint8_t* compact, const std::int64_t* offsets, std::int64_t n,
                                                const Digest128* layer_digests, std::int64_t n_layers) {
    check_compact_offsets(offsets, n, n_layers);
    std::vector<Digest128> out;
    out.reserve(static_cast<std::size_t>(n));
    DigestBatch batch(out);
    for (std::int64_t u = 0; u < n; ++u) {
        const auto size = static_cast<std::size_t>(offsets[u + 1] - offsets[u]);
        for_key(u, [&] {
            batch.add_compact(compact + offsets[u], size, layer_digests, static_cast<std::size_t>(n_layers));
            return 0;
        });
    }
    batch.flush();
    return out;
}

std::pair<std::vector<std::uint8_t>, std::vector<std::int64_t>> expand_sequence_keys(
    const std::uint8_t* compact, const std::int64_t* offsets, std::int64_t n, const Digest128* layer_digests,
    std::int64_t n_layers) {
    check_compact_offsets(offsets, n, n_layers);
    std::pair<std::vector<std::uint8_t>, std::vector<std::int64_t>> out;
    auto& [keys, key_offsets] = out;
    key_offsets.reserve(static_cast<std::size_t>(n) + 1);
    key_offsets.push_back(0);
    std::size_t used = 0;
    for (std::int64_t u = 0; u < n; ++u) {
        const auto size = static_cast<std::size_t>(offsets[u + 1] - offsets[u]);
        const std::size_t need = used + expanded_key_bound(size);
        if (keys.size() < need) keys.resize(std::max(2 * keys.size(), need));
        used = static_cast<std::size_t>(for_key(u, [&] {
                   return expand_sequence_key(compact + offsets[u], size, layer_digests,
                                              static_cast<std::size_t>(n_layers), keys.data() + used);
               }) - keys.data());
        key_offsets.push_back(static_cast<std::int64_t>(used));
    }
    keys.resize(used);
    return out;
}

std::vector<Digest128> sequence_digests(const std::uint8_t* keys, const std::int64_t* offsets, std::int64_t n) {
    check_key_offsets(offsets, n);
    std::vector<Digest128> out;
    out.reserve(static_cast<std::size_t>(n));
    DigestBatch batch(out);
    for (std::int64_t u = 0; u < n; ++u)
        batch.add_key(keys + offsets[u], static_cast<std::size_t>(offsets[u + 1] - offsets[u]));
    batch.flush();
    return out;
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

RepeatedKinds repeated_kinds(std::int64_t m, const std::int64_t* node_offsets, const std::uint8_t* repeated,
                             const std::int32_t* kind_codes) {
    for (std::int64_t i = 0; i < m; ++i)
        if (node_offsets[i + 1] < node_offsets[i])
            throw std::invalid_argument("offsets of model " + std::to_string(i) + " decrease");
    RepeatedKinds out;
    out.offsets.reserve(static_cast<std::size_t>(m) + 1);
    out.offsets.push_back(0);
    std::vector<std::int64_t> count;  // by kind code, zero between models
    std::vector<std::int32_t> order;  // the model's kinds in order of first repeat
    for (std::int64_t i = 0; i < m; ++i) {
        order.clear();
        for (std::int64_t l = node_offsets[i]; l < node_offsets[i + 1]; ++l) {
            const std::int32_t k = kind_codes[l];
            if (!repeated[l] || k < 0) continue;
            if (static_cast<std::size_t>(k) >= count.size()) count.resize(static_cast<std::size_t>(k) + 1, 0);
            if (count[k]++ == 0) order.push_back(k);
        }
        std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return count[a] > count[b]; });
        for (std::int32_t k : order) {
            out.kinds.push_back(k);
            out.counts.push_back(count[k]);
            count[k] = 0;
        }
        out.offsets.push_back(static_cast<std::int64_t>(out.kinds.size()));
    }
    return out;
}

}  // namespace dlbricks
