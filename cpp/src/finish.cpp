// OnnxScan::finish: the inferred types read back, constants folded, layers, edges and
// digests in the canonical form of docs/digests.md (see onnx_scan.hpp). It follows the
// full loader's rules (dlbricks/loading/full.py) step for step; the tests compare the
// two loaders on every model onnx ships.
#include "dlbricks/onnx_scan.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

#include "dlbricks/limits.hpp"

namespace dlbricks {

namespace {

bool too_big(const ScanTensorType& t) {
    const std::int64_t n = numel(t.shape);
    return n < 0 || n > kMaxElements;
}

// Concrete tensor types of one model, interned: each carries its canonical bytes
// (digest._tensor_type_bytes), element count and the absurd-size flag, computed once.
class TypeTable {
public:
    std::int32_t intern(std::int32_t elem, const std::int64_t* dims, std::size_t rank) {
        scratch_.clear();
        put_u32(scratch_, static_cast<std::uint32_t>(elem));
        put_u32(scratch_, static_cast<std::uint32_t>(rank));
        for (std::size_t k = 0; k < rank; ++k) put_u64(scratch_, static_cast<std::uint64_t>(dims[k]));
        bool inserted;
        const std::int32_t id = ids_.intern(scratch_.data(), scratch_.size(), inserted);
        if (inserted) {
            ScanTensorType t{elem, std::vector<std::int64_t>(dims, dims + rank)};
            numels.push_back(numel(t.shape));
            big.push_back(too_big(t) ? 1 : 0);
            types.push_back(std::move(t));
        }
        return id;
    }
    std::int32_t intern(const ScanTensorType& t) { return intern(t.elem_type, t.shape.data(), t.shape.size()); }
    std::string_view bytes(std::int32_t id) const { return ids_.key(id); }

    std::vector<ScanTensorType> types;
    std::vector<std::int64_t> numels;
    std::vector<char> big;

private:
    BytesIndex ids_;  // keyed by the canonical bytes themselves
    ByteBuffer scratch_;
};

constexpr std::int64_t kUnknownDim = std::numeric_limits<std::int64_t>::min();

}  // namespace

ScanResult OnnxScan::finish(const std::uint8_t* d, std::size_t size, const std::uint8_t* inferred,
                            std::size_t inferred_size, const std::vector<std::vector<std::int64_t>>& input_shapes,
                            const std::unordered_map<std::string, std::int64_t>& dim_subst) const {
    ScanResult res;
    if (heads_.size() != head_node.size()) throw std::invalid_argument("finish: resolve_heads first");
    if (input_shapes.size() != input_ids_.size()) throw std::invalid_argument("finish: one shape per input");
    const std::size_t names = n_names();
    TypeTable tt;
    // Concrete type id per name (-1: none known), in loading.full._Loader._concrete's order
    // of precedence: initializers, Constant nodes, folded Shape/Size, then inference.
    std::vector<std::int32_t> cid(names, -1);

    // Inferred types, merged as loading.full._Loader._merge_type does: a later entry replaces an
    // earlier one only when strictly more complete (loading.full._completeness).
    {
        std::vector<std::int16_t> score(names, -1);
        Reader mr(inferred, 0, inferred_size);
        Field f;
        ScanSpan graph;
        while (mr.next(f))
            if (f.tag == tag(model_f::graph, 2)) graph = f.payload;
        std::vector<ScanSpan> by_kind[3];  // input, value_info, output: Python's order
        Reader gr(inferred, graph);
        while (gr.next(f)) {
            if (f.wire != 2) continue;
            if (f.number == graph_f::input) by_kind[0].push_back(f.payload);
            else if (f.number == graph_f::value_info) by_kind[1].push_back(f.payload);
            else if (f.number == graph_f::output) by_kind[2].push_back(f.payload);
        }
        std::vector<std::int64_t> dims;
        // Models repeat a few types many times: remember what each TypeProto's exact
        // bytes parsed to, as (completeness score, concrete type id or -1, tensor?).
        BytesIndex seen_types;
        std::vector<std::int32_t> seen_score, seen_cid;
        // onnx's inference appends a value_info per node output, in node order: each
        // name is first compared with the next few outputs after the last one matched
        // (a name table lookup is a cache miss or two after onnx's work), and looked up
        // only when none matches. Declared value_info comes first, in any order.
        std::size_t next_node = 0, next_slot = 0;
        auto predicted = [&](const char* p, std::size_t n) -> std::int32_t {
            const std::size_t node_was = next_node, slot_was = next_slot;  // kept on a miss
            for (int tries = 0; tries < 4 && next_node < nodes_.size(); ++tries) {
                const Ids outs = nodes_[next_node].outs();
                if (next_slot >= outs.size()) {
                    ++next_node;
                    next_slot = 0;
                    continue;
                }
                const std::int32_t id = outs[next_slot++];
                if (id < 0) continue;
                const std::string_view have = name(id);
                if (have.size() == n && bytes_equal(have.data(), p, n)) return id;
            }
            next_node = node_was;
            next_slot = slot_was;
            return -1;
        };
        const char* last_type_p = nullptr;
        std::size_t last_type_n = 0;
        std::int32_t last_seen = -1;
        for (int kind = 0; kind < 3; ++kind) {
            for (const ScanSpan& s : by_kind[kind]) {
                Reader vr(inferred, s);
                Field g;
                std::int32_t id = -1;
                ScanSpan type_span;
                while (vr.next(g)) {
                    if (g.tag == tag(vi_f::name, 2)) {
                        const auto* p = reinterpret_cast<const char*>(inferred + g.payload.begin);
                        const std::size_t n = g.payload.size();
                        id = kind == 1 ? predicted(p, n) : -1;
                        if (id < 0) id = find(std::string_view(p, n));
                    } else if (g.tag == tag(vi_f::type, 2)) {
                        type_span = g.payload;
                    }
                }
                if (id < 0 || type_span.size() == 0) continue;
                // A node's output often has the type of the one before it (Conv, then
                // BatchNormalization, then Relu...): compared before a lookup.
                const auto* type_p = reinterpret_cast<const char*>(inferred + type_span.begin);
                const std::size_t type_n = type_span.size();
                bool new_type = false;
                std::int32_t seen = last_seen;
                if (!(type_n == last_type_n && bytes_equal(last_type_p, type_p, type_n)))
                    seen = seen_types.intern(type_p, type_n, new_type);
                last_seen = seen;
                last_type_p = type_p;
                last_type_n = type_n;
                if (!new_type) {
                    const std::int32_t sc = seen_score[seen];
                    if (sc < 0 || (score[id] >= 0 && sc <= score[id])) continue;  // non-tensor, or no better
                    score[id] = static_cast<std::int16_t>(sc);
                    cid[id] = seen_cid[seen];
                    continue;
                }
                seen_score.push_back(-1);
                seen_cid.push_back(-1);
                // Each distinct TypeProto is parsed once (the cache above), as parse_type
                // would, straight into the resolved dims (no ScanDim strings to allocate).
                std::uint8_t kind = 0;
                std::int32_t elem = 0;
                bool has_shape = false, dims_known = true;
                int n_known = 0;
                walk_type(
                    inferred, type_span,
                    [&](std::uint8_t k) {
                        kind = k;
                        elem = 0;
                        has_shape = false;
                        dims_known = true;
                        n_known = 0;
                        dims.clear();
                    },
                    [&](std::int32_t e) { elem = e; },
                    [&] { has_shape = true; },
                    [&](std::uint8_t dim_kind, std::int64_t value, ScanSpan param) {
                        std::int64_t v = kUnknownDim;  // loading.full._Loader._parse_type's rule
                        if (dim_kind == 1 && value >= 0) {
                            v = value;
                        } else if (dim_kind == 2 && param.size() != 0) {
                            auto it = dim_subst.find(text(inferred, param));
                            if (it != dim_subst.end()) v = it->second;
                        }
                        if (v == kUnknownDim) dims_known = false; else ++n_known;
                        dims.push_back(v);
                    });
                if (kind != 1) continue;  // non-tensor types never make a name concrete
                int sc = elem ? 1 : 0;
                const bool all_known = has_shape && dims_known;
                if (has_shape) sc += 1 + 2 * std::min(n_known, 16000);
                sc = std::min(sc, 32000);
                seen_score[seen] = sc;
                seen_cid[seen] = (all_known && elem) ? tt.intern(elem, dims.data(), dims.size()) : -1;
                if (score[id] >= 0 && sc <= score[id]) continue;
                score[id] = static_cast<std::int16_t>(sc);
                cid[id] = seen_cid[seen];
            }
        }
    }
    // Initializers and Constant outputs take their declared types (over inferred ones),
    // interned when first read (concrete() below): most are read only by folded nodes
    // (the shapes of ConstantOfShape chains), so interning all of them up front would
    // be work for types nobody reads.
    constexpr std::int32_t kDeclaredType = -2;
    std::vector<std::int32_t> init_of(names, -1), const_node_of(names, -1);
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
        const Node& n = nodes_[i];
        if (n.is_constant && extras_[n.extra].const_typed && !n.outs().empty() && n.outs()[0] >= 0) {
            const_node_of[n.outs()[0]] = static_cast<std::int32_t>(i);
            cid[n.outs()[0]] = kDeclaredType;
        }
    }
    for (std::size_t k = 0; k < inits_.size(); ++k) {
        init_of[inits_[k].name] = static_cast<std::int32_t>(k);
        cid[inits_[k].name] = kDeclaredType;
    }
    // Name t's concrete type id, -1 if none is known.
    auto concrete = [&](std::int32_t t) -> std::int32_t {
        if (cid[t] != kDeclaredType) return cid[t];
        if (init_of[t] >= 0) {
            const Initializer& init = inits_[init_of[t]];
            return cid[t] = init.elem_type ? tt.intern(init.elem_type, dims(init).p, init.rank) : -1;
        }
        const ScanTensorType& declared = extras_[nodes_[const_node_of[t]].extra].const_type;
        return cid[t] = declared.elem_type ? tt.intern(declared) : -1;
    };
    for (std::size_t k = 0; k < input_ids_.size(); ++k)  // activation inputs: as resolved
        if (input_shapes[k].size() != inputs[k].type.dims.size())
            throw std::invalid_argument("finish: input shape rank differs from the declaration");
    std::vector<std::int32_t> act(names, -1);
    for (std::size_t k = 0; k < input_ids_.size(); ++k)
        act[input_ids_[k]] = tt.intern(inputs[k].type.elem_type, input_shapes[k].data(), input_shapes[k].size());

    // Fold: Shape/Size of typed tensors, and every node whose inputs are all constant.
    // Values of folded Shape/Size outputs (few names have one): index per name, -1 none.
    std::vector<std::int32_t> folded_at(names, -1);
    std::vector<std::vector<std::int64_t>> folded;
    std::vector<char> is_const(names, 0), used(names, 0);
    for (const auto& t : inits_) is_const[t.name] = 1;
    for (std::int32_t o : output_ids_) used[o] = 1;
    for (const auto& n : nodes_)
        for (std::int32_t t : n.ins())
            if (t >= 0) used[t] = 1;
    std::vector<char> is_layer(nodes_.size(), 0);
    std::size_t n_layers = 0;
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
        const Node& n = nodes_[i];
        if ((n.is_shape || n.is_size) && !n.ins().empty() && n.ins()[0] >= 0 && !n.outs().empty() && n.outs()[0] >= 0 &&
            concrete(n.ins()[0]) >= 0) {
            const ScanTensorType& t = tt.types[cid[n.ins()[0]]];
            const std::int32_t o = n.outs()[0];
            std::vector<std::int64_t> v;
            if (n.is_size) {
                v.push_back(numel(t.shape));
                cid[o] = tt.intern(kInt64, nullptr, 0);
            } else {
                // Python slicing, as Shape-15 defines start and end.
                const auto rank = static_cast<std::int64_t>(t.shape.size());
                auto clamp = [&](std::int64_t x) {
                    if (x < 0) x += rank;
                    return std::min(std::max<std::int64_t>(x, 0), rank);
                };
                const Extra& x = extras_[n.extra];
                const std::int64_t s = clamp(x.shape_start), e = x.shape_has_end ? clamp(x.shape_end) : rank;
                for (std::int64_t k = s; k < e; ++k) v.push_back(t.shape[static_cast<std::size_t>(k)]);
                const std::int64_t len = static_cast<std::int64_t>(v.size());
                cid[o] = tt.intern(kInt64, &len, 1);
            }
            folded_at[o] = static_cast<std::int32_t>(folded.size());
            folded.push_back(std::move(v));
            is_const[o] = 1;
            continue;
        }
        bool all_const = true;
        for (std::int32_t t : n.ins())
            if (t >= 0 && !is_const[t]) { all_const = false; break; }
        if (all_const) {
            for (std::int32_t o : n.outs())
                if (o >= 0) is_const[o] = 1;
        } else {
            is_layer[i] = 1;
            ++n_layers;
        }
    }
    if (n_layers == 0) { res.fallback = "no layers"; return res; }
    res.layer_op_keys.reserve(n_layers);
    res.digests.reserve(n_layers);
    res.layer_name_ends.reserve(n_layers);
    for (auto* edges : {&res.edge_src, &res.edge_src_slot, &res.edge_dst, &res.edge_dst_slot})
        edges->reserve(n_layers + n_layers / 2);  // most layers read one or two activations

    // Resize's scales/sizes and Upsample's scales count by value (digest.constant_role).
    std::vector<std::uint8_t> size_op(op_keys.size(), 0);  // 1 Resize, 2 Upsample
    for (std::size_t k = 0; k < op_keys.size(); ++k) {
        if (op_keys[k].first.empty() && op_keys[k].second == "Resize") size_op[k] = 1;
        if (op_keys[k].first.empty() && op_keys[k].second == "Upsample") size_op[k] = 2;
    }
    // The canonical value bytes of param constant t (of type ct); false if they need evaluation.
    auto write_param_values = [&](std::int32_t t, const ScanTensorType& ct, ByteBuffer& out) {
        if (init_of[t] >= 0) {
            const auto& init = inits_[init_of[t]];
            if (init.external || init.span.end > size) return false;
            Reader ir(d, init.span);
            Field f;
            ir.next(f);
            return tensor_values(d, f.payload, ct, out);
        }
        if (const_node_of[t] >= 0) {
            const Extra& cn = extras_[nodes_[const_node_of[t]].extra];
            if (cn.const_kind == 1) return cn.const_tensor.end <= size && tensor_values(d, cn.const_tensor, ct, out);
            if (cn.const_kind == 2) {
                for (std::int64_t v : cn.const_ints) put_u64(out, static_cast<std::uint64_t>(v));
                return true;
            }
            if (cn.const_kind == 3) {
                for (float v : cn.const_floats) {
                    std::uint32_t u;
                    std::memcpy(&u, &v, 4);
                    put_value(out, kFloat, u);
                }
                return true;
            }
            return false;
        }
        if (folded_at[t] >= 0) {
            for (std::int64_t v : folded[static_cast<std::size_t>(folded_at[t])]) put_u64(out, static_cast<std::uint64_t>(v));
            return true;
        }
        return false;
    };
    // Node n's input and output slots after the head: in the canonical form (type bytes,
    // then the empty outer-reference list) or, for looking forms up, as a compact key
    // with type ids in place of type bytes. Equal keys mean equal canonical bytes: type
    // ids are interned from those bytes and param values are written in full. Returns
    // nullptr, or why the full loader must take over.
    auto write_slots = [&](const Node& n, bool canonical, ByteBuffer& out) -> const char* {
        auto put_type = [&](std::int32_t type) {
            if (canonical) out += tt.bytes(type);
            else put_u32(out, static_cast<std::uint32_t>(type));
        };
        // Slots up to the last present one (trailing omitted optionals are not written).
        auto present = [](Ids ids) {
            std::size_t k = ids.size();
            while (k && ids[k - 1] < 0) --k;
            return k;
        };
        const std::size_t n_in = present(n.ins());
        put_u32(out, static_cast<std::uint32_t>(n_in));
        for (std::size_t slot = 0; slot < n_in; ++slot) {
            const std::int32_t t = n.ins()[slot];
            if (t < 0) { out.push_back(0); continue; }
            if (is_const[t]) {
                const std::int32_t c = concrete(t);
                if (c < 0) return "a constant whose type needs evaluation";
                if (tt.big[c]) return "an absurd shape";
                const ScanTensorType& ct = tt.types[c];
                const std::int64_t ne = tt.numels[c];
                const std::uint8_t so = size_op[static_cast<std::size_t>(n.op_key)];
                const bool param = ne <= kParamMaxElements || ((ct.elem_type == kInt32 || ct.elem_type == kInt64) && ne <= kIntParamMax) ||
                                   (((so == 1 && (slot == 1 || slot == 2)) || (so == 2 && slot == 1)) && ne <= kIntParamMax);
                out.push_back(param ? 3 : 2);
                put_type(c);
                if (param && !write_param_values(t, ct, out)) return "a param constant that needs evaluation";
                continue;
            }
            const std::int32_t a = act[t] >= 0 ? act[t] : concrete(t);
            if (a < 0) return "an activation without a concrete type";
            if (tt.big[a]) return "an absurd shape";
            out.push_back(1);
            put_type(a);
        }
        const std::size_t n_out = present(n.outs());
        put_u32(out, static_cast<std::uint32_t>(n_out));
        for (std::size_t slot = 0; slot < n_out; ++slot) {
            const std::int32_t t = n.outs()[slot];
            if (t < 0) { out.push_back(0); continue; }
            const std::int32_t o = concrete(t);
            if (o < 0) {
                if (used[t]) return "a used output without a concrete type";
                out.push_back(2);
            } else {
                if (tt.big[o]) return "an absurd shape";
                out.push_back(1);
                put_type(o);
            }
        }
        if (canonical) put_u32(out, 0);  // no outer references: no subgraphs on this path
        return nullptr;
    };

    std::vector<std::pair<std::int32_t, std::int32_t>> produced_by(names, {-1, -1});
    // Identical layers have identical canonical bytes: each distinct form is hashed once,
    // found by its compact key. BLAKE2b resumes from the state after the form's head
    // (absorbed once per head), so a new form costs only its slots; the forms are hashed
    // together after the loop (blake2b128_jobs: four at a time).
    BytesIndex forms;
    std::vector<Blake2bJob> form_jobs;
    ByteBuffer form_bytes;  // each new form's bytes after its head state
    std::vector<std::int32_t> layer_form;
    layer_form.reserve(n_layers);
    // The state after each used head (most heads belong to folded nodes: made on demand).
    std::vector<std::int32_t> head_state_at(heads_.size(), -1);
    std::vector<Blake2b128> head_states;
    head_states.reserve(std::min(heads_.size(), n_layers));
    ByteBuffer key;
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
        if (!is_layer[i]) continue;
        const Node& n = nodes_[i];
        const auto idx = static_cast<std::int32_t>(res.layer_op_keys.size());
        key.clear();
        put_u32(key, static_cast<std::uint32_t>(n.head));
        if (const char* why = write_slots(n, false, key)) { res.fallback = why; return res; }
        for (std::size_t slot = 0; slot < n.ins().size(); ++slot) {
            const std::int32_t t = n.ins()[slot];
            if (t < 0 || is_const[t]) continue;
            const auto& p = produced_by[t];
            if (p.first < 0) continue;  // a graph input
            res.edge_src.push_back(p.first);
            res.edge_src_slot.push_back(p.second);
            res.edge_dst.push_back(idx);
            res.edge_dst_slot.push_back(static_cast<std::int32_t>(slot));
        }
        for (std::size_t slot = 0; slot < n.outs().size(); ++slot)
            if (n.outs()[slot] >= 0) produced_by[n.outs()[slot]] = {idx, static_cast<std::int32_t>(slot)};
        res.layer_names.append(reinterpret_cast<const char*>(d + n.name.begin), n.name.end <= size ? n.name.size() : 0);
        res.layer_name_ends.push_back(static_cast<std::int64_t>(res.layer_names.size()));
        bool new_form;
        const std::int32_t form = forms.intern(key.data(), key.size(), new_form);
        if (new_form) {
            const auto h = static_cast<std::size_t>(n.head);
            if (head_state_at[h] < 0) {
                if (!heads_[h]) throw std::invalid_argument("finish: a layer's head was never set (set_head)");
                head_state_at[h] = static_cast<std::int32_t>(head_states.size());
                head_states.emplace_back().update(heads_[h]->data(), heads_[h]->size());
            }
            Blake2bJob job = head_states[static_cast<std::size_t>(head_state_at[h])].job(form_bytes);
            write_slots(n, true, form_bytes);
            job.size = form_bytes.size() - job.offset;
            form_jobs.push_back(job);
        }
        layer_form.push_back(form);
        res.layer_op_keys.push_back(n.op_key);
    }
    std::vector<Digest128> form_digest(form_jobs.size());
    blake2b128_jobs(reinterpret_cast<const std::uint8_t*>(form_bytes.data()), form_jobs.data(), form_jobs.size(),
                    form_digest.data());
    for (std::int32_t form : layer_form) res.digests.push_back(form_digest[static_cast<std::size_t>(form)]);
    for (std::int32_t o : output_ids_) {
        const std::int32_t t = act[o] >= 0 ? act[o] : concrete(o);
        if (t < 0) { res.fallback = "a graph output without a concrete type"; return res; }
        res.output_types.push_back(tt.types[t]);
    }
    return res;
}

}  // namespace dlbricks
