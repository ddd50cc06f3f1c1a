// The weight-free copy of a scanned model that onnx's shape inference runs on (see
// onnx_scan.hpp).
#include "dlbricks/onnx_scan.hpp"

#include <algorithm>

#include "dlbricks/limits.hpp"

namespace dlbricks {

std::vector<std::string_view> OnnxScan::light_model_pieces(const std::uint8_t* d, std::size_t size,
                                                         const std::vector<std::vector<std::int64_t>>& input_shapes,
                                                         std::string& owned) const {
    if (input_shapes.size() != input_ids_.size()) throw std::invalid_argument("light_model: one shape per input");
    const auto need = [&](ScanSpan s) {
        if (s.end > size) throw std::invalid_argument("light_model: not the bytes the scan was made from");
    };
    // Spans of the file kept as they are, in graph order; adjacent ones (consecutive
    // nodes) merge, so the copy is a few large memcpy calls.
    std::vector<ScanSpan> kept;
    std::size_t kept_bytes = 0;
    const auto keep = [&](ScanSpan s) {
        need(s);
        kept_bytes += s.size();
        if (!kept.empty() && kept.back().end == s.begin) kept.back().end = s.end;
        else kept.push_back(s);
    };
    std::string ins, tail;  // typed graph inputs, then graph outputs
    for (std::size_t k = 0; k < input_ids_.size(); ++k) {
        const Dims shape(input_shapes[k]);
        put_len_field(ins, graph_f::input, value_info(std::string(name(input_ids_[k])), inputs[k].type.elem_type, &shape));
    }
    std::vector<ScanSpan> inline_inits;  // written after the nodes
    for (const auto& t : inits_) {
        const Dims shape = dims(t);
        const std::int64_t b = nbytes(t.elem_type, shape);
        if (!t.external && b >= 0 && b <= kInlineBytes) inline_inits.push_back(t.span);
        else put_len_field(ins, graph_f::input, value_info(std::string(name(t.name)), t.elem_type, &shape));
    }
    for (const auto& n : nodes_) {
        if (n.is_constant && extras_[n.extra].const_typed && !n.outs().empty() && n.outs()[0] >= 0) {
            const ScanTensorType& ct = extras_[n.extra].const_type;
            const Dims shape(ct.shape);
            const std::int64_t b = nbytes(ct.elem_type, shape);
            if (b < 0 || b > kInlineBytes) {
                put_len_field(ins, graph_f::input, value_info(std::string(name(n.outs()[0])), ct.elem_type, &shape));
                continue;
            }
        }
        keep(n.span);
    }
    if (graph_name_.size()) keep(graph_name_);
    for (const ScanSpan& s : inline_inits) keep(s);
    for (std::int32_t o : output_ids_) put_len_field(tail, graph_f::output, value_info(std::string(name(o)), 0, nullptr));

    std::string head;  // the model's fields before the graph's payload
    put_varint_field(head, model_f::ir_version, static_cast<std::uint64_t>(std::max<std::int64_t>(ir_version, 4)));
    for (const ScanSpan& s : opset_spans_) {
        need(s);
        head.append(reinterpret_cast<const char*>(d + s.begin), s.size());
    }
    put_varint(head, tag(model_f::graph, 2));
    put_varint(head, kept_bytes + ins.size() + tail.size());
    // `owned` holds the generated parts; views into it are taken once it is complete.
    owned.clear();
    owned.reserve(head.size() + ins.size() + tail.size());
    owned += head;
    owned += ins;
    owned += tail;
    const char* o = owned.data();
    std::vector<std::string_view> pieces;
    pieces.reserve(kept.size() + 3);
    pieces.emplace_back(o, head.size());
    for (const ScanSpan& s : kept) pieces.emplace_back(reinterpret_cast<const char*>(d + s.begin), s.size());
    pieces.emplace_back(o + head.size(), ins.size());
    pieces.emplace_back(o + head.size() + ins.size(), tail.size());
    return pieces;
}

}  // namespace dlbricks
