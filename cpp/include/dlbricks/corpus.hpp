// Corpus-wide dedup: split every model and unite layers and sequences by digest.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "dlbricks/digest.hpp"
#include "dlbricks/graph.hpp"

namespace dlbricks {

/// A corpus of m models as concatenated flat arrays. Model i owns nodes
/// [node_offsets[i], node_offsets[i+1]) and edges [edge_offsets[i], edge_offsets[i+1]);
/// edge endpoints are model-local node indices.
struct CorpusView {
    std::int64_t n_models = 0;
    const std::int64_t* node_offsets = nullptr;  // m + 1, starts at 0, non-decreasing
    const std::int64_t* edge_offsets = nullptr;  // m + 1, starts at 0, non-decreasing
    const Digest128* digests = nullptr;          // node_offsets[m] layer digests
    const std::int32_t* src = nullptr;
    const std::int32_t* src_slot = nullptr;  // may be null
    const std::int32_t* dst = nullptr;
    const std::int32_t* dst_slot = nullptr;  // may be null
};

/// Everything the dedup produces. Unique ids are numbered in order of first appearance
/// (model by model, node by node / sequence by sequence), so results do not depend on
/// hash-map iteration order.
struct CorpusResult {
    std::vector<std::int32_t> layer_ids;           // per node (global index): unique layer id
    std::vector<std::int64_t> unique_layer_first;  // per unique layer: global node index
    std::vector<std::int64_t> seq_model_offsets;   // m + 1: model i owns sequences [a, b)
    std::vector<std::int64_t> seq_offsets;         // S + 1: into seq_members
    std::vector<std::int32_t> seq_members;         // model-local node indices
    std::vector<std::int32_t> seq_ids;             // per sequence: unique sequence id
    std::vector<Digest128> unique_seq_digests;     // per unique sequence (when asked for)
    // Otherwise each unique sequence's compact form (see split_sequences), back to back:
    // sequence u is unique_seq_compact[offsets[u], offsets[u+1]). expand_sequence_keys()
    // turns them into canonical bytes (the digests' input), for sequence_digests().
    std::vector<std::uint8_t> unique_seq_compact;
    std::vector<std::int64_t> unique_seq_compact_offsets;  // U + 1, starts at 0
    std::vector<std::int64_t> unique_seq_first;    // per unique sequence: global sequence index
    std::vector<std::int64_t> model_unique_layers;  // m: distinct layer ids within each model
    std::vector<std::int64_t> model_unique_seqs;    // m: distinct sequence ids within each model
    std::vector<std::uint8_t> layer_repeats;        // per node: 1 if its layer occurred earlier in its model
};

/// Splits every model at granularity G and dedups layers and sequences across the
/// corpus. Sequences are deduplicated by their compact forms (equal exactly when their
/// canonical bytes are); with `digests` each unique one is then hashed
/// (unique_seq_digests), without it its compact form is returned instead
/// (unique_seq_compact), for expand_sequence_keys() and sequence_digests() when the
/// digests are wanted: counting unique sequences needs neither. Throws
/// std::invalid_argument naming the model and the problem.
/// Cost: O(total nodes log + total edges), memory O(total nodes + edges).
CorpusResult dedup_corpus(const CorpusView& corpus, int G, bool digests = true);

/// The same for several granularities in one pass: each model's layers are deduplicated
/// once and its adjacency and order built once. results[k] is the result at Gs[k]; the
/// layer fields (layer_ids, unique_layer_first, model_unique_layers, layer_repeats) are
/// filled in results[0] only. Throws std::invalid_argument as above (or no G given).
std::vector<CorpusResult> dedup_corpus(const CorpusView& corpus, const std::vector<int>& Gs, bool digests = true);

/// The digests of n compact sequence forms: each form is expanded into a scratch buffer
/// and hashed there (no array of canonical keys is made). Same checks and errors as
/// expand_sequence_keys. Cost: O(canonical bytes).
std::vector<Digest128> compact_sequence_digests(const std::uint8_t* compact, const std::int64_t* offsets, std::int64_t n,
                                                const Digest128* layer_digests, std::int64_t n_layers);

/// The sequence digest of each of n canonical byte strings keys[offsets[u], offsets[u+1])
/// (as dedup_corpus returns them without digests). Throws std::invalid_argument if the
/// The canonical bytes of n compact sequence forms (dedup_corpus without digests), back
/// to back with their offsets (n + 1, from 0). layer_digests has one digest per
/// unique-layer id of the corpus that made them (n_layers). Throws
/// std::invalid_argument on a form that is malformed or names an id out of range.
/// Cost: O(output bytes).
std::pair<std::vector<std::uint8_t>, std::vector<std::int64_t>> expand_sequence_keys(
    const std::uint8_t* compact, const std::int64_t* offsets, std::int64_t n, const Digest128* layer_digests,
    std::int64_t n_layers);

/// offsets do not start at 0 or decrease. Cost: O(key bytes).
std::vector<Digest128> sequence_digests(const std::uint8_t* keys, const std::int64_t* offsets, std::int64_t n);

/// Jaccard similarity of the layer sets of every pair of models: |A n B| / |A u B| over
/// unique layer ids (two empty sets have similarity 1). layer_ids as in CorpusResult.
/// Returns an m x m row-major matrix. Cost: O(m^2 * L) for L unique layers per model.
std::vector<double> jaccard_matrix(std::int64_t n_models, const std::int64_t* node_offsets,
                                   const std::int32_t* layer_ids);

/// Per model, the kinds of its repeated layers (repeated[l] != 0; a negative kind code
/// means none) with their counts, most common first and ties in order of first repeat.
/// Model i's entries are [offsets[i], offsets[i+1]) of kinds and counts. Kind codes are
/// the caller's (e.g. indices into each model's table of op types). Throws
/// std::invalid_argument if the node offsets decrease. Cost: O(layers + kinds log kinds).
struct RepeatedKinds {
    std::vector<std::int64_t> offsets;
    std::vector<std::int32_t> kinds;
    std::vector<std::int64_t> counts;
};
RepeatedKinds repeated_kinds(std::int64_t n_models, const std::int64_t* node_offsets, const std::uint8_t* repeated,
                             const std::int32_t* kind_codes);

}  // namespace dlbricks
