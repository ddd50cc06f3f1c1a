// OnnxScan's constructor: the one pass over a model's bytes (see onnx_scan.hpp).
#include "dlbricks/onnx_scan.hpp"

#include <optional>

namespace dlbricks {

std::int32_t OnnxScan::intern(const char* p, std::size_t n) {
    if (n == 0) return -1;
    bool inserted;
    return names_.intern(p, n, inserted);
}

std::int32_t OnnxScan::find(std::string_view s) const {
    return s.empty() ? -1 : names_.find(s.data(), s.size());
}

ScanSpan OnnxScan::node_span(std::size_t i) const {
    if (i >= nodes_.size()) throw std::out_of_range("node index out of range");
    return nodes_[i].span;
}

OnnxScan::OnnxScan(const std::uint8_t* d, std::size_t size) {
    Reader r(d, 0, size);
    Field f;
    ScanSpan graph;
    int n_graphs = 0, n_functions = 0;
    while (r.next(f)) {
        if (f.tag == tag(model_f::ir_version, 0)) {
            ir_version = static_cast<std::int64_t>(f.value);
        } else if (f.tag == tag(model_f::opset_import, 2)) {
            std::string domain;
            std::int64_t version = 0;
            Reader o(d, f.payload);
            Field g;
            while (o.next(g)) {
                if (g.tag == tag(opset_f::domain, 2)) domain = text(d, g.payload);
                if (g.tag == tag(opset_f::version, 0)) version = static_cast<std::int64_t>(g.value);
            }
            opsets.emplace_back(std::move(domain), version);
            opset_spans_.push_back(f.whole);
        } else if (f.tag == tag(model_f::graph, 2)) {
            graph = f.payload;
            ++n_graphs;
        } else if (f.number == model_f::functions) {
            ++n_functions;
        }
    }
    if (ir_version <= 0 || n_graphs == 0) { fallback = "not an ONNX model"; return; }
    if (n_graphs > 1) { fallback = "graph field repeated"; return; }
    if (n_functions) { fallback = "model-local functions"; return; }

    std::vector<ScanSpan> input_spans, output_spans;
    BytesIndex op_key_ids, head_ids;
    // Everything that follows from a node's op type, domain and attribute bytes alone
    // (its op key, whether the fast path handles it, whether it is a Constant, Shape or
    // Size) is worked out once per distinct head, not once per node.
    enum : std::uint8_t { kPlain = 0, kConstantNode = 1, kShapeNode = 2, kSizeNode = 3 };
    struct HeadInfo {
        std::int32_t op_key;
        std::uint8_t kind;
    };
    std::vector<HeadInfo> head_info;
    // Reused per node so that the common case (a known head) allocates nothing but the
    // node's own name lists.
    std::string key;
    std::vector<ScanSpan> attr_whole, attrs;  // each attribute field, and its payload
    std::vector<std::int32_t> node_outs;
    {
        // Size the tables from a first pass over the graph's fields (payloads are skipped
        // by their length: microseconds). Not from the graph's size: weights can make it
        // gigabytes, and the names live in the nodes (about one per 32 node bytes).
        std::size_t n_nodes = 0, node_bytes = 0, n_other = 0, n_inits = 0;
        Reader pr(d, graph);
        while (pr.next(f)) {
            if (f.tag == tag(graph_f::node, 2)) {
                ++n_nodes;
                node_bytes += f.payload.size();
            } else {
                ++n_other;  // initializers, inputs, outputs, value_info: a name each
                if (f.tag == tag(graph_f::initializer, 2)) ++n_inits;
            }
        }
        nodes_.reserve(n_nodes);
        inits_.reserve(n_inits);
        names_.reserve(node_bytes / 32 + n_other);
    }
    std::int32_t last_init_id = -1, init_id_step = 1;  // initializer name prediction (below)
    std::int32_t last_head = -1;
    Reader gr(d, graph);
    while (gr.next(f)) {
        if (f.wire != 2) continue;
        switch (f.number) {
            case graph_f::node: {
                Node& node = nodes_.emplace_back();  // filled in place
                node.span = f.whole;
                const std::size_t ins_at = pool_.size();
                ScanSpan op_span, op_whole, domain_span;
                attr_whole.clear();
                attrs.clear();
                node_outs.clear();
                Reader nr(d, f.payload);
                Field g;
                while (nr.next(g)) {
                    if (g.wire != 2) continue;
                    switch (g.number) {
                        case node_f::input:  // straight into the pool; outputs follow them there
                            pool_.push_back(intern(reinterpret_cast<const char*>(d + g.payload.begin), g.payload.size()));
                            break;
                        case node_f::output:
                            node_outs.push_back(intern(reinterpret_cast<const char*>(d + g.payload.begin), g.payload.size()));
                            break;
                        case node_f::op_type:
                            op_span = g.payload;
                            op_whole = g.whole;
                            break;
                        case node_f::domain: domain_span = g.payload; break;
                        case node_f::name: node.name = g.payload; break;
                        case node_f::attribute:
                            attr_whole.push_back(g.whole);
                            attrs.push_back(g.payload);
                            break;
                        default: break;
                    }
                }
                // The head key. Serializers write a node's fields in field-number order,
                // so the op type field and the attribute fields usually lie back to back:
                // that span of the file is the key as it is (it starts with the op type's
                // tag, 0x22). Otherwise, or with a domain, a key is written: a 0 byte,
                // then op type and domain (length-prefixed), then the attribute fields.
                // The two forms never collide; equal heads written both ways only get
                // two ids with the same canonical head.
                bool contiguous = domain_span.size() == 0 && op_whole.size() > 0;
                std::uint64_t key_end = op_whole.end;
                for (const ScanSpan& w : attr_whole) {
                    contiguous = contiguous && w.begin == key_end;
                    key_end = w.end;
                }
                const char* key_data = reinterpret_cast<const char*>(d + op_whole.begin);
                std::size_t key_size = key_end - op_whole.begin;
                if (!contiguous) {
                    key.clear();
                    key.push_back('\0');
                    put_u32(key, static_cast<std::uint32_t>(op_span.size()));
                    key.append(reinterpret_cast<const char*>(d + op_span.begin), op_span.size());
                    put_u32(key, static_cast<std::uint32_t>(domain_span.size()));
                    key.append(reinterpret_cast<const char*>(d + domain_span.begin), domain_span.size());
                    for (const ScanSpan& w : attr_whole) key.append(reinterpret_cast<const char*>(d + w.begin), w.size());
                    key_data = key.data();
                    key_size = key.size();
                }
                // Runs of nodes share a head (the ConstantOfShape chains that make the
                // weights, Conv after Conv...): the last node's is compared first.
                bool inserted = false;
                if (head_ids.holds(last_head, key_data, key_size)) node.head = last_head;
                else node.head = head_ids.intern(key_data, key_size, inserted);
                last_head = node.head;
                if (inserted) {
                    head_node.push_back(static_cast<std::int32_t>(nodes_.size() - 1));
                    std::string op_type = text(d, op_span), domain = text(d, domain_span);
                    if (domain == "ai.onnx") domain.clear();
                    bool graph_attr = false;
                    for (const ScanSpan& as : attrs) {
                        Reader ar(d, as);
                        Field a;
                        while (ar.next(a)) {
                            if (a.number == attr_f::g || a.number == attr_f::graphs) graph_attr = true;
                            if (a.tag == tag(attr_f::type, 0) && (a.value == kAttrGraph || a.value == kAttrGraphs))
                                graph_attr = true;
                            if (a.number == attr_f::ref_attr_name) graph_attr = true;  // function bodies only
                        }
                    }
                    if (!domain.empty() && fallback.empty()) fallback = "an op of domain '" + domain + "'";
                    if ((graph_attr || op_type == "If" || op_type == "Loop" || op_type == "Scan") && fallback.empty())
                        fallback = "control flow or a subgraph attribute";
                    std::string op_key = domain;
                    op_key.push_back('\0');
                    op_key += op_type;
                    bool new_op;
                    HeadInfo info{op_key_ids.intern(op_key.data(), op_key.size(), new_op), kPlain};
                    if (new_op) op_keys.emplace_back(domain, op_type);
                    if (domain.empty()) {
                        if (op_type == "Constant") info.kind = kConstantNode;
                        if (op_type == "Shape") info.kind = kShapeNode;
                        if (op_type == "Size") info.kind = kSizeNode;
                    }
                    head_info.push_back(info);
                    head_op_key.push_back(info.op_key);
                }
                const HeadInfo info = head_info[static_cast<std::size_t>(node.head)];
                node.op_key = info.op_key;
                if (info.kind != kPlain) {
                    node.is_constant = info.kind == kConstantNode;
                    node.is_shape = info.kind == kShapeNode;
                    node.is_size = info.kind == kSizeNode;
                    node.extra = static_cast<std::int32_t>(extras_.size());
                    Extra& x = extras_.emplace_back();
                    bool decided = false;  // Constant: the first value attribute wins
                    for (const ScanSpan& as : attrs) {
                        std::string name;
                        Field a;
                        std::optional<Field> t_field, i_field, f_field;
                        std::vector<Field> ints_fields, floats_fields;
                        Reader ar(d, as);
                        while (ar.next(a)) {
                            switch (a.number) {
                                case attr_f::name: name = text(d, a.payload); break;
                                case attr_f::t: t_field = a; break;
                                case attr_f::i: i_field = a; break;
                                case attr_f::f: f_field = a; break;
                                case attr_f::ints: ints_fields.push_back(a); break;
                                case attr_f::floats: floats_fields.push_back(a); break;
                                default: break;
                            }
                        }
                        if (node.is_shape) {
                            if (name == "start" && i_field) x.shape_start = static_cast<std::int64_t>(i_field->value);
                            if (name == "end" && i_field) {
                                x.shape_end = static_cast<std::int64_t>(i_field->value);
                                x.shape_has_end = true;
                            }
                            continue;
                        }
                        if (!node.is_constant || decided) continue;
                        if (name == "value") {
                            decided = true;
                            x.const_typed = true;  // elem 0 (unknown) without a tensor
                            if (!t_field || t_field->wire != 2) continue;
                            Reader tr(d, t_field->payload);
                            Field tf;
                            bool segment = false;
                            while (tr.next(tf)) {
                                if (tf.number == tensor_f::dims)
                                    for_each_varint(d, tf, [&](std::uint64_t v) {
                                        x.const_type.shape.push_back(static_cast<std::int64_t>(v));
                                    });
                                else if (tf.tag == tag(tensor_f::data_type, 0))
                                    x.const_type.elem_type = static_cast<std::int32_t>(tf.value);
                                else if (tf.number == tensor_f::segment)
                                    segment = true;
                            }
                            x.const_kind = segment ? 0 : 1;
                            x.const_tensor = t_field->payload;
                        } else if (name == "value_int" || name == "value_ints") {
                            decided = true;
                            x.const_typed = true;
                            x.const_kind = 2;
                            x.const_type.elem_type = kInt64;
                            if (name == "value_int") {
                                x.const_ints.push_back(i_field ? static_cast<std::int64_t>(i_field->value) : 0);
                            } else {
                                for (const Field& y : ints_fields)
                                    for_each_varint(d, y, [&](std::uint64_t v) {
                                        x.const_ints.push_back(static_cast<std::int64_t>(v));
                                    });
                                x.const_type.shape.push_back(static_cast<std::int64_t>(x.const_ints.size()));
                            }
                        } else if (name == "value_float" || name == "value_floats") {
                            decided = true;
                            x.const_typed = true;
                            x.const_kind = 3;
                            x.const_type.elem_type = kFloat;
                            auto add = [&](std::uint64_t v) {
                                float fv;
                                const auto u = static_cast<std::uint32_t>(v);
                                std::memcpy(&fv, &u, 4);
                                x.const_floats.push_back(fv);
                            };
                            if (name == "value_float") {
                                if (f_field) add(f_field->value); else x.const_floats.push_back(0.0f);
                            } else {
                                for (const Field& y : floats_fields) for_each_fixed(d, y, 4, add);
                                x.const_type.shape.push_back(static_cast<std::int64_t>(x.const_floats.size()));
                            }
                        } else if (name == "sparse_value" || name == "value_string" || name == "value_strings") {
                            decided = true;
                            if (fallback.empty()) fallback = "a Constant with a sparse or string value";
                        }
                    }
                }
                node.n_ins = static_cast<std::uint32_t>(pool_.size() - ins_at);
                node.n_outs = static_cast<std::uint32_t>(node_outs.size());
                pool_.insert(pool_.end(), node_outs.begin(), node_outs.end());
                break;
            }
            case graph_f::name: graph_name_ = f.whole; break;
            case graph_f::initializer: {
                Initializer init;
                init.span = f.whole;
                init.dims_at = static_cast<std::uint32_t>(init_dims_.size());
                Reader tr(d, f.payload);
                Field g;
                bool segment = false;
                while (tr.next(g)) {
                    switch (g.number) {
                        case tensor_f::dims:
                            for_each_varint(d, g, [&](std::uint64_t v) { init_dims_.push_back(static_cast<std::int64_t>(v)); });
                            break;
                        case tensor_f::data_type:
                            if (g.wire == 0) init.elem_type = static_cast<std::int32_t>(g.value);
                            break;
                        case tensor_f::name:
                            if (g.wire == 2) {
                                // Exporters list initializers in the order the nodes first read
                                // them, so the name usually has the id the last initializer's
                                // had plus the same step: one comparison instead of a lookup.
                                const auto* p = reinterpret_cast<const char*>(d + g.payload.begin);
                                const std::size_t n = g.payload.size();
                                const std::int64_t guess = std::int64_t{last_init_id} + init_id_step;
                                init.name = names_.holds(guess, p, n) ? static_cast<std::int32_t>(guess) : intern(p, n);
                                if (init.name >= 0 && last_init_id >= 0) init_id_step = init.name - last_init_id;
                                if (init.name >= 0) last_init_id = init.name;
                            }
                            break;
                        case tensor_f::data_location:
                            if (g.wire == 0) init.external = g.value == 1;
                            break;
                        case tensor_f::segment: segment = true; break;
                        default: break;
                    }
                }
                if (segment && fallback.empty()) fallback = "a segmented initializer";
                init.rank = static_cast<std::uint32_t>(init_dims_.size() - init.dims_at);
                if (numel(dims(init)) < 0 && fallback.empty()) fallback = "an initializer with a negative dim";
                if (init.name < 0 && fallback.empty()) fallback = "an unnamed initializer";
                inits_.push_back(init);
                break;
            }
            case graph_f::sparse:
                if (fallback.empty()) fallback = "sparse initializers";
                break;
            case graph_f::input: input_spans.push_back(f.payload); break;
            case graph_f::output: output_spans.push_back(f.payload); break;
            default: break;
        }
    }
    // The pool is complete: point every node's id lists into it (each node's inputs
    // then outputs, node after node).
    std::size_t at = 0;
    for (Node& n : nodes_) {
        n.ins_p = pool_.data() + at;
        at += n.n_ins;
        n.outs_p = pool_.data() + at;
        at += n.n_outs;
    }
    if (!fallback.empty()) return;
    if (nodes_.empty()) { fallback = "no nodes"; return; }

    // Structure checks; anything unusual goes to the full loader, which names it.
    std::vector<char> is_init(n_names(), 0), defined(n_names(), 0);
    for (const auto& t : inits_) is_init[t.name] = defined[t.name] = 1;
    std::vector<std::int32_t> graph_inputs;
    std::vector<ScanType> graph_input_types;
    std::int32_t last_input_id = -1, input_id_step = 1;
    ScanSpan last_checked_type;
    for (const ScanSpan& s : input_spans) {
        Reader vr(d, s);
        Field g;
        ScanSpan name_span, type_span;
        while (vr.next(g)) {
            if (g.tag == tag(vi_f::name, 2)) name_span = g.payload;
            if (g.tag == tag(vi_f::type, 2)) type_span = g.payload;
        }
        // Older models list the initializers among the inputs too, in the nodes' order of
        // use, as the initializers themselves (see there): the same prediction.
        const auto* name_p = reinterpret_cast<const char*>(d + name_span.begin);
        const std::int64_t guess = std::int64_t{last_input_id} + input_id_step;
        const std::int32_t id = names_.holds(guess, name_p, name_span.size()) ? static_cast<std::int32_t>(guess)
                                                                              : intern(name_p, name_span.size());
        if (id >= 0 && last_input_id >= 0) input_id_step = id - last_input_id;
        if (id >= 0) last_input_id = id;
        if (id < 0) { fallback = "an unnamed graph input"; return; }
        if (static_cast<std::size_t>(id) >= defined.size()) {
            defined.resize(n_names(), 0);
            is_init.resize(n_names(), 0);
        }
        defined[id] = 1;
        // Older models list every initializer among the inputs too: those types are
        // never read, so they are only checked (once per distinct run of bytes: most
        // repeat the one before, as the shapes of ConstantOfShape chains do).
        if (is_init[id]) {
            const ScanSpan& last = last_checked_type;
            if (!(type_span.size() == last.size() && last.size() != 0 &&
                  bytes_equal(d + last.begin, d + type_span.begin, last.size())))
                check_type(d, type_span);
            last_checked_type = type_span;
            continue;
        }
        ScanType type = type_span.size() ? parse_type(d, type_span) : ScanType{};
        std::string name = text(d, name_span);
        if (type.kind != 1 || type.elem_type == 0 || !type.has_shape) {
            fallback = "a graph input without a tensor type and shape";
            return;
        }
        for (std::size_t k = 1; k < type.dims.size(); ++k)
            if (type.dims[k].kind != 1 || type.dims[k].value < 0) {
                fallback = "a symbolic dim other than the batch";
                return;
            }
        input_ids_.push_back(id);
        inputs.push_back(ScanInput{name, std::move(type)});
    }
    std::vector<std::int32_t> producer(n_names(), -1);
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
        for (std::int32_t o : nodes_[i].outs()) {
            if (o < 0) continue;
            if (producer[o] >= 0 || defined[o]) { fallback = "a tensor defined twice"; return; }
            producer[o] = static_cast<std::int32_t>(i);
        }
    }
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
        for (std::int32_t t : nodes_[i].ins()) {
            if (t < 0) continue;
            if (producer[t] < 0 && !defined[t]) { fallback = "a read of an undefined tensor"; return; }
            if (producer[t] >= static_cast<std::int32_t>(i)) { fallback = "nodes not in topological order"; return; }
        }
    }
    for (const ScanSpan& s : output_spans) {
        Reader vr(d, s);
        Field g;
        std::string name;
        while (vr.next(g))
            if (g.tag == tag(vi_f::name, 2)) name = text(d, g.payload);
        const std::int32_t id = find(name);
        if (id < 0 || (producer[id] < 0 && !defined[id])) { fallback = "a graph output nobody produces"; return; }
        output_ids_.push_back(id);
        output_names.push_back(name);
    }
}

}  // namespace dlbricks
