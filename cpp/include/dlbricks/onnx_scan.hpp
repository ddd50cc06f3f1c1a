// The fast analysis path: reads a serialized ONNX ModelProto straight from its bytes.
//
// Reading a model through Python protobuf objects costs microseconds per node and
// field; for plain graphs (the vast majority of real models) everything analysis
// needs is a few fields per node. OnnxScan walks the protobuf wire format itself
// (no protobuf library: bytes in, flat tables out), skips weight payloads by their
// length prefix without touching them, writes the weight-free copy that onnx's shape
// inference runs on, and, given the inferred types back, folds constants, builds the
// activation edges and computes every layer digest in the canonical form of
// docs/digests.md.
//
// It handles a strict subset of ONNX and says so: any graph outside it (control flow,
// subgraph attributes, functions, other domains, sparse tensors, symbolic dims other
// than a leading batch, shapes inference cannot resolve, params that need evaluation,
// anything malformed...) sets `fallback` to the reason and the Python loader, which
// handles everything and produces the error messages, takes over. The two paths give
// identical digests and edges (tests compare them over every model onnx ships).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "dlbricks/digest.hpp"

namespace dlbricks {

/// A growable byte buffer for bytes written a few at a time (interned keys, compact
/// keys, canonical forms). Its appends are inline: a capacity check, then a copy that
/// the compiler turns into one store for a 4- or 8-byte integer. std::string::append
/// is an out-of-line call (and a memmove call) per append, which was a sixth of
/// finish()'s time.
class ByteBuffer {
public:
    void clear() { size_ = 0; }
    std::size_t size() const { return size_; }
    const char* data() const { return data_.get(); }
    __attribute__((always_inline)) void append(const char* p, std::size_t n) {
        if (n == 0) return;  // (memcpy's pointers must be valid even for 0 bytes)
        if (__builtin_expect(n > capacity_ - size_, 0)) grow(n);
        std::memcpy(data_.get() + size_, p, n);
        size_ += n;
    }
    void push_back(char c) {
        if (size_ == capacity_) grow(1);
        data_[size_++] = c;
    }
    ByteBuffer& operator+=(std::string_view s) {
        append(s.data(), s.size());
        return *this;
    }

private:
    __attribute__((noinline)) void grow(std::size_t n) {
        const std::size_t capacity = std::max<std::size_t>({256, 2 * capacity_, size_ + n});
        std::unique_ptr<char[]> data(new char[capacity]);
        if (size_) std::memcpy(data.get(), data_.get(), size_);
        data_.swap(data);
        capacity_ = capacity;
    }
    std::unique_ptr<char[]> data_;
    std::size_t size_ = 0, capacity_ = 0;
};

/// Interns byte strings: ids 0, 1, 2... by first appearance. Keys live back to back in
/// one arena and the table is open addressing over (hash, id): models have tens of
/// thousands of names, and a node-based map would cost an allocation and a pointer
/// chase for each. Cost: O(key length) per call, amortised.
class BytesIndex {
public:
    /// The id of the key, inserting it if new; `inserted` tells which.
    std::int32_t intern(const char* p, std::size_t n, bool& inserted);
    /// Sizes the table for about `n` keys (avoids rehashing while they arrive).
    void reserve(std::size_t n);
    /// The id of the key, or -1.
    std::int32_t find(const char* p, std::size_t n) const;
    /// Whether `id` is the id of this key (any id may be asked; no hashing).
    bool holds(std::int64_t id, const char* p, std::size_t n) const {
        if (id < 0 || static_cast<std::uint64_t>(id) >= size()) return false;
        const std::string_view k = key(static_cast<std::int32_t>(id));
        return k.size() == n && bytes_equal(k.data(), p, n);
    }
    std::string_view key(std::int32_t id) const {
        const auto i = static_cast<std::size_t>(id);
        return std::string_view(arena_.data() + at_[i], static_cast<std::size_t>(at_[i + 1] - at_[i]));
    }
    std::size_t size() const { return at_.size() - 1; }

private:
    // One slot per table entry: the hash's high half to skip most mismatches without
    // touching the arena, and the id plus one (0: empty, so that a new table is zeroed
    // memory, not a loop storing -1 per slot). Ids keep their full hash for rehashing.
    struct Slot {
        std::uint32_t check;
        std::int32_t id1;
    };
    void rehash(std::size_t capacity);
    ByteBuffer arena_;
    std::vector<std::uint64_t> at_{0};  // key i is arena_[at_[i], at_[i+1])
    std::vector<std::uint64_t> hash_of_;  // per id
    std::vector<Slot> slots_;
};

/// Canonical layer heads (digest.py's _head: operator, version and attributes) by
/// (op key, op version, attribute bytes as written), shared by the scans of a process:
/// models repeat heads, and canonicalising one takes onnx's schemas (Python). A cache:
/// it empties itself when it would pass `max_entries` heads or `max_bytes` bytes.
class HeadTable {
public:
    explicit HeadTable(std::size_t max_entries = 1 << 14, std::size_t max_bytes = 64 << 20)
        : max_entries_(max_entries), max_bytes_(max_bytes) {}
    /// The head stored under `key`, or null. Shared: a scan keeps its heads alive even
    /// when the table empties itself before the scan is finished.
    std::shared_ptr<const std::string> find(std::string_view key) const;
    void add(std::string_view key, std::shared_ptr<const std::string> head);
    std::size_t size() const { return heads_.size(); }
    void clear();

private:
    std::size_t max_entries_, max_bytes_, bytes_ = 0;
    BytesIndex keys_;
    std::vector<std::shared_ptr<const std::string>> heads_;  // by key id
};

/// Malformed protobuf bytes. The caller falls back to the full loader, which reports it.
struct WireError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct ScanSpan {
    std::uint64_t begin = 0, end = 0;
    std::uint64_t size() const { return end - begin; }
};

/// One dimension of a declared or inferred shape. kind: 0 unknown, 1 value, 2 param.
struct ScanDim {
    std::uint8_t kind = 0;
    std::int64_t value = 0;
    std::string param;
};

/// A parsed TypeProto. kind: 0 none, 1 tensor, 2 other (sequence, map, optional, sparse).
struct ScanType {
    std::uint8_t kind = 0;
    std::int32_t elem_type = 0;
    bool has_shape = false;
    std::vector<ScanDim> dims;
};

/// A graph input as declared (for the batch-dim rule, applied in Python).
struct ScanInput {
    std::string name;
    ScanType type;
};

/// A view of a shape's dims (a vector's, or a run of a pool).
struct Dims {
    const std::int64_t* p = nullptr;
    std::size_t n = 0;
    Dims() = default;
    Dims(const std::int64_t* data, std::size_t size) : p(data), n(size) {}
    Dims(const std::vector<std::int64_t>& v) : p(v.data()), n(v.size()) {}  // NOLINT: implicit by design
    const std::int64_t* begin() const { return p; }
    const std::int64_t* end() const { return p + n; }
    std::size_t size() const { return n; }
};

/// A concrete tensor type: element type and shape.
struct ScanTensorType {
    std::int32_t elem_type = 0;
    std::vector<std::int64_t> shape;
};

/// What `OnnxScan::finish` returns (moved to numpy by the bindings).
struct ScanResult {
    std::string fallback;                      // non-empty: use the full loader
    std::vector<std::int32_t> layer_op_keys;   // op key of each layer (OnnxScan::op_keys)
    std::vector<Digest128> digests;            // one per layer
    std::vector<std::int32_t> edge_src, edge_src_slot, edge_dst, edge_dst_slot;
    std::vector<ScanTensorType> output_types;  // one per graph output
    std::string layer_names;                   // node names of the layers, back to back
    std::vector<std::int64_t> layer_name_ends;  // layer i's is [ends[i-1], ends[i])
};

/// The attributes part of a layer head (digest.make_head's ``_write_attributes``) from a
/// node's attribute fields as written (NodeProto field 5 entries, tags included), when
/// every attribute is plain: an explicit type among FLOAT, INT, STRING, FLOATS, INTS
/// and STRINGS, and an ASCII name. `defaults` (may be null) has the canonical body of
/// each schema default by attribute name; an attribute equal to its default is left
/// out. Returns nullopt for anything else (tensors, graphs, references, a type left
/// unset, malformed bytes): Python canonicalises those. Cost: O(bytes + k log k) for
/// k attributes.
std::optional<std::string> canonical_attributes(const std::uint8_t* data, std::size_t size,
                                                const std::unordered_map<std::string, std::string>* defaults);

/// The canonical body of one serialized AttributeProto (digest._attr_body: type tag,
/// reference flag, value) when it is plain, as canonical_attributes defines it; nullopt
/// otherwise. For schema defaults, which onnx keeps serialized. Cost: O(bytes).
std::optional<std::string> canonical_attribute_body(const std::uint8_t* data, std::size_t size);

class OnnxScan {
public:
    /// Parses the model's structure from `size` bytes at `data` (not kept: every later
    /// call takes the same bytes again). Cost: O(bytes outside weight payloads).
    /// Throws WireError on malformed bytes.
    OnnxScan(const std::uint8_t* data, std::size_t size);
    OnnxScan(const OnnxScan&) = delete;  // nodes view pool_
    OnnxScan& operator=(const OnnxScan&) = delete;

    /// Non-empty when the model needs the full loader; the reason, for tests and logs.
    std::string fallback;
    std::int64_t ir_version = 0;
    std::vector<std::pair<std::string, std::int64_t>> opsets;  // (domain as written, version)
    /// Distinct (normalised domain, op type) pairs; node_op_key indexes them.
    std::vector<std::pair<std::string, std::string>> op_keys;
    /// Distinct (op key, attribute bytes): the part of a layer digest that depends on
    /// the operator and attributes only. head_node is one node that has it.
    std::vector<std::int32_t> head_node;
    std::vector<std::int32_t> head_op_key;  // the op key of each head
    std::vector<ScanInput> inputs;  // activation graph inputs (initializers excluded)
    std::vector<std::string> output_names;
    /// Where node `i`'s field lies in the model bytes (tag included).
    ScanSpan node_span(std::size_t i) const;
    /// The attribute fields of node `i` as written (tags included). Cost: O(node bytes).
    std::string node_attributes(const std::uint8_t* data, std::size_t i) const;

    /// The weight-free model for shape inference: activation inputs with the given
    /// concrete shapes (same order as `inputs`), initializers and Constant values up to
    /// 64 KiB inline, larger ones as typed graph inputs. It comes as pieces to write one
    /// after the other (views into `data` or into `owned`, which must outlive them), so
    /// that a caller copies it once, into a buffer of the exact size; adjacent spans of
    /// the file come as one piece. Cost: O(graph bytes).
    std::vector<std::string_view> light_model_pieces(const std::uint8_t* data, std::size_t size,
                                                     const std::vector<std::vector<std::int64_t>>& input_shapes,
                                                     std::string& owned) const;

    /// Looks up, in `table`, the canonical head of every head a layer may have (nodes
    /// whose inputs are all constants, Constant nodes included, are never layers and
    /// need none). `op_versions` has the op version (schema since_version) of each op
    /// key. Returns the heads not found: the caller canonicalises each (from
    /// node_attributes of its head_node) and gives it with set_head before finish.
    std::vector<std::int32_t> resolve_heads(const std::uint8_t* data, std::size_t size, HeadTable& table,
                                            const std::vector<std::int64_t>& op_versions);
    /// Gives head `head` (one resolve_heads returned) its canonical bytes, and stores
    /// them in `table` for later scans.
    void set_head(std::int32_t head, std::string canonical, HeadTable& table);
    /// set_head for each of `heads` (ones resolve_heads returned) whose attributes are
    /// all plain: prefixes[k] (magic, version, operator) followed by
    /// canonical_attributes with defaults[k] (the schema's; null: none), k its op key.
    /// Returns the heads left (an attribute not plain): the caller makes those.
    /// Cost: O(the heads' attribute bytes).
    std::vector<std::int32_t> set_plain_heads(const std::uint8_t* data, std::size_t size,
                                              const std::vector<std::int32_t>& heads,
                                              const std::vector<std::string>& prefixes,
                                              const std::vector<const std::unordered_map<std::string, std::string>*>& defaults,
                                              HeadTable& table);

    /// Folds constants with the inferred types of `inferred` (the light model after
    /// shape inference) and computes layers, edges and digests. `input_shapes` are the
    /// ones given to light_model, the heads are resolved (resolve_heads, set_head),
    /// `dim_subst` maps symbolic dims to the values chosen for them. Cost: O(graph
    /// bytes + inferred bytes).
    ScanResult finish(const std::uint8_t* data, std::size_t size, const std::uint8_t* inferred,
                      std::size_t inferred_size, const std::vector<std::vector<std::int64_t>>& input_shapes,
                      const std::unordered_map<std::string, std::int64_t>& dim_subst) const;

    /// A node's input or output name ids (-1 for ""), viewing the scan's id pool.
    struct Ids {
        const std::int32_t* p = nullptr;
        std::size_t n = 0;
        const std::int32_t* begin() const { return p; }
        const std::int32_t* end() const { return p + n; }
        std::size_t size() const { return n; }
        bool empty() const { return n == 0; }
        std::int32_t operator[](std::size_t k) const { return p[k]; }
    };
    struct Node {
        // User-provided, so that emplace_back() runs the member initializers alone: value
        // initialization of an aggregate first zeroes the whole node (a `rep stos`, ~9%
        // of the scan).
        Node() {}  // NOLINT(modernize-use-equals-default)
        Ids ins() const { return Ids{ins_p, n_ins}; }
        Ids outs() const { return Ids{outs_p, n_outs}; }
        // Views into the scan's id pool, set once it is complete (a node is 72 bytes:
        // the scan writes and finish reads one per node, ~4,000 for the light models).
        const std::int32_t* ins_p = nullptr;
        const std::int32_t* outs_p = nullptr;
        std::uint32_t n_ins = 0, n_outs = 0;
        std::int32_t op_key = 0, head = 0;
        ScanSpan span;
        ScanSpan name;  // the node's name (may be empty)
        bool is_constant = false, is_shape = false, is_size = false;
        std::int32_t extra = -1;  // Constant and Shape/Size nodes: index into extras_
    };
    /// What a Constant node holds or which slice a Shape node takes (few nodes have one).
    struct Extra {
        // Constant nodes: the output type and where the value comes from.
        bool const_typed = false;
        ScanTensorType const_type;
        std::uint8_t const_kind = 0;  // 1 tensor 'value', 2 value_int(s), 3 value_float(s), 0 unsupported
        ScanSpan const_tensor;        // kind 1
        std::vector<std::int64_t> const_ints;
        std::vector<float> const_floats;
        // Shape nodes: the slice of the input shape.
        std::int64_t shape_start = 0, shape_end = 0;
        bool shape_has_end = false;
    };
    // Dims live in one pool (init_dims_): models have thousands of small initializers,
    // and a vector each was a sixth of the scan's work.
    struct Initializer {
        std::int32_t name = -1;
        std::int32_t elem_type = 0;
        std::uint32_t dims_at = 0, rank = 0;  // init_dims_[dims_at, dims_at + rank)
        bool external = false;
        ScanSpan span;  // the whole TensorProto
    };

private:
    std::int32_t intern(const char* p, std::size_t n);
    std::int32_t find(std::string_view s) const;
    std::string_view name(std::int32_t id) const { return names_.key(id); }
    std::size_t n_names() const { return names_.size(); }

    BytesIndex names_;               // tensor names
    std::vector<std::int32_t> pool_;  // every node's input ids, then output ids
    std::vector<Node> nodes_;
    std::vector<Extra> extras_;
    std::vector<Initializer> inits_;
    std::vector<std::int64_t> init_dims_;
    Dims dims(const Initializer& t) const { return Dims(init_dims_.data() + t.dims_at, t.rank); }
    std::vector<std::int32_t> input_ids_;   // activation inputs, as `inputs`
    std::vector<std::int32_t> output_ids_;  // graph outputs
    std::vector<ScanSpan> opset_spans_;
    ScanSpan graph_name_;
    // Canonical head per head id (null: not resolved), and the table keys of the heads
    // resolve_heads did not find, until set_head.
    std::vector<std::shared_ptr<const std::string>> heads_;
    std::vector<std::string> pending_keys_;
};

}  // namespace dlbricks
