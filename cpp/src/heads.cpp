// A scan's layer heads: looked up in the process's HeadTable, made from plain
// attributes in C++, or given by Python (see onnx_scan.hpp).
#include "dlbricks/onnx_scan.hpp"

#include <optional>

namespace dlbricks {

namespace {

// Appends the attribute fields of the NodeProto field at `sp` (tags included).
void append_attributes(const std::uint8_t* d, ScanSpan sp, std::string& out) {
    Reader r(d, sp);
    Field f;
    if (!r.next(f) || f.wire != 2) return;
    Reader nr(d, f.payload);
    while (nr.next(f))
        if (f.tag == tag(node_f::attribute, 2))
            out.append(reinterpret_cast<const char*>(d + f.whole.begin), f.whole.size());
}

}  // namespace

std::string OnnxScan::node_attributes(const std::uint8_t* d, std::size_t i) const {
    std::string out;
    append_attributes(d, node_span(i), out);
    return out;
}

std::vector<std::int32_t> OnnxScan::resolve_heads(const std::uint8_t* d, std::size_t size, HeadTable& table,
                                                  const std::vector<std::int64_t>& op_versions) {
    if (op_versions.size() != op_keys.size()) throw std::invalid_argument("resolve_heads: one op version per op key");
    // A node whose inputs are all constants is folded, never a layer (finish folds a few
    // more, Shape and Size of typed tensors, which takes the inferred types).
    std::vector<char> is_const(n_names(), 0), needed(head_node.size(), 0);
    for (const auto& t : inits_) is_const[t.name] = 1;
    for (const Node& n : nodes_) {
        bool all_const = true;
        for (std::int32_t t : n.ins())
            if (t >= 0 && !is_const[t]) { all_const = false; break; }
        if (!all_const) {
            needed[n.head] = 1;
            continue;
        }
        for (std::int32_t o : n.outs())
            if (o >= 0) is_const[o] = 1;
    }
    heads_.assign(head_node.size(), nullptr);
    pending_keys_.assign(head_node.size(), std::string());
    std::vector<std::int32_t> missing;
    std::string key;
    for (std::size_t h = 0; h < head_node.size(); ++h) {
        if (!needed[h]) continue;
        const ScanSpan sp = node_span(static_cast<std::size_t>(head_node[h]));
        if (sp.end > size) throw std::invalid_argument("resolve_heads: not the bytes the scan was made from");
        const auto k = static_cast<std::size_t>(head_op_key[h]);
        const auto& [domain, op_type] = op_keys[k];
        key.clear();
        put_u32(key, static_cast<std::uint32_t>(domain.size()));
        key += domain;
        put_u32(key, static_cast<std::uint32_t>(op_type.size()));
        key += op_type;
        put_u64(key, static_cast<std::uint64_t>(op_versions[k]));
        append_attributes(d, sp, key);
        if (auto hit = table.find(key)) {
            heads_[h] = std::move(hit);
        } else {
            pending_keys_[h] = key;
            missing.push_back(static_cast<std::int32_t>(h));
        }
    }
    return missing;
}

void OnnxScan::set_head(std::int32_t head, std::string canonical, HeadTable& table) {
    if (head < 0 || static_cast<std::size_t>(head) >= heads_.size()) throw std::out_of_range("set_head: no such head");
    std::string& key = pending_keys_[static_cast<std::size_t>(head)];
    if (key.empty()) throw std::invalid_argument("set_head: resolve_heads did not ask for this head");
    if (canonical.empty()) throw std::invalid_argument("set_head: an empty head");
    auto shared = std::make_shared<const std::string>(std::move(canonical));
    table.add(key, shared);
    heads_[static_cast<std::size_t>(head)] = std::move(shared);
    std::string().swap(key);
}

std::vector<std::int32_t> OnnxScan::set_plain_heads(
    const std::uint8_t* d, std::size_t size, const std::vector<std::int32_t>& heads,
    const std::vector<std::string>& prefixes,
    const std::vector<const std::unordered_map<std::string, std::string>*>& defaults, HeadTable& table) {
    if (prefixes.size() != op_keys.size() || defaults.size() != op_keys.size())
        throw std::invalid_argument("set_plain_heads: one prefix and one defaults entry per op key");
    std::vector<std::int32_t> left;
    std::string attributes;
    for (std::int32_t h : heads) {
        if (h < 0 || static_cast<std::size_t>(h) >= head_node.size()) throw std::out_of_range("set_plain_heads: no such head");
        const auto k = static_cast<std::size_t>(head_op_key[static_cast<std::size_t>(h)]);
        if (prefixes[k].empty()) throw std::invalid_argument("set_plain_heads: no prefix for the head's op");
        const ScanSpan sp = node_span(static_cast<std::size_t>(head_node[static_cast<std::size_t>(h)]));
        if (sp.end > size) throw std::invalid_argument("set_plain_heads: not the bytes the scan was made from");
        attributes.clear();
        append_attributes(d, sp, attributes);
        std::optional<std::string> body = canonical_attributes(
            reinterpret_cast<const std::uint8_t*>(attributes.data()), attributes.size(), defaults[k]);
        if (!body) {
            left.push_back(h);
            continue;
        }
        set_head(h, prefixes[k] + *body, table);
    }
    return left;
}

}  // namespace dlbricks
