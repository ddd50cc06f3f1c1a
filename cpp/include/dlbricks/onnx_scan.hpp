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
//
// The pieces: wire.hpp (the wire format), byte_index.hpp (interning, the head table),
// canonical.hpp (canonical attributes and values), limits.hpp (sizes); the scan is in
// src/scan.cpp, its heads in src/heads.cpp, the light model in src/light_model.cpp and
// the fold and hash in src/finish.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dlbricks/byte_index.hpp"
#include "dlbricks/canonical.hpp"
#include "dlbricks/digest.hpp"
#include "dlbricks/wire.hpp"

namespace dlbricks {

/// A graph input as declared (for the batch-dim rule, applied in Python).
struct ScanInput {
    std::string name;
    ScanType type;
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
        // initialization of an aggregate would first zero the whole node, once per node.
        Node() {}  // NOLINT(modernize-use-equals-default)
        Ids ins() const { return Ids{ins_p, n_ins}; }
        Ids outs() const { return Ids{outs_p, n_outs}; }
        // Views into the scan's id pool, set once it is complete: pointers rather than
        // vectors keep a node small (72 bytes), and the scan writes and finish reads one
        // per node.
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
    // and a vector each would cost an allocation each.
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
