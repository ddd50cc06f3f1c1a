// See onnx_scan.hpp. Field numbers are onnx.proto's (ONNX IR 10); the canonical byte
// form written by finish() is docs/digests.md's and must stay byte-identical to
// dlbricks/digest.py (tests compare the two loaders on every model onnx ships).
#include "dlbricks/onnx_scan.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

namespace dlbricks {

namespace {

// onnx.proto field numbers.
namespace model_f { constexpr unsigned ir_version = 1, graph = 7, opset_import = 8, functions = 25; }
namespace opset_f { constexpr unsigned domain = 1, version = 2; }
namespace graph_f {
constexpr unsigned node = 1, name = 2, initializer = 5, input = 11, output = 12, value_info = 13, sparse = 15;
}
namespace node_f { constexpr unsigned input = 1, output = 2, name = 3, op_type = 4, attribute = 5, domain = 7; }
namespace attr_f {
constexpr unsigned name = 1, f = 2, i = 3, s = 4, t = 5, g = 6, floats = 7, ints = 8, strings = 9, graphs = 11,
                   type = 20, ref_attr_name = 21, sparse_tensor = 22;
}
namespace tensor_f {
constexpr unsigned dims = 1, data_type = 2, segment = 3, float_data = 4, int32_data = 5, string_data = 6,
                   int64_data = 7, name = 8, raw_data = 9, double_data = 10, uint64_data = 11, external_data = 13,
                   data_location = 14;
}
namespace vi_f { constexpr unsigned name = 1, type = 2; }
namespace type_f { constexpr unsigned tensor = 1, sequence = 4, map = 5, sparse = 8, optional = 9; }
namespace tensor_type_f { constexpr unsigned elem_type = 1, shape = 2; }
namespace dim_f { constexpr unsigned value = 1, param = 2; }

// TensorProto.DataType values used below.
constexpr std::int32_t kFloat = 1, kUint8 = 2, kInt8 = 3, kUint16 = 4, kInt16 = 5, kInt32 = 6, kInt64 = 7,
                       kString = 8, kBool = 9, kFloat16 = 10, kDouble = 11, kUint32 = 12, kUint64 = 13,
                       kComplex64 = 14, kComplex128 = 15;
constexpr std::int32_t kAttrGraph = 5, kAttrGraphs = 10;
constexpr std::int64_t kInlineBytes = 64 * 1024;       // onnx_io._INLINE_BYTES
constexpr std::int64_t kMaxElements = std::int64_t{1} << 40;  // onnx_io.MAX_ELEMENTS
constexpr std::int64_t kIntParamMax = 4096;            // digest.INT_PARAM_MAX_ELEMENTS

constexpr std::uint32_t tag(unsigned number, unsigned wire) { return number << 3 | wire; }

struct Field {
    // tag = number << 3 | wire, as on the wire. Tests compare the tag in one go: testing
    // number and wire separately lets the compiler fuse two 32-bit fields into one
    // 64-bit load right after two 32-bit stores, a store-forwarding stall per field.
    std::uint32_t tag = 0;
    unsigned number = 0;
    unsigned wire = 0;
    std::uint64_t value = 0;  // varint / fixed value
    ScanSpan payload;         // length-delimited payload
    ScanSpan whole;           // tag through end
};

class Reader {
public:
    Reader(const std::uint8_t* d, std::uint64_t begin, std::uint64_t end) : d_(d), pos_(begin), end_(end) {}
    Reader(const std::uint8_t* d, ScanSpan s) : Reader(d, s.begin, s.end) {}

    __attribute__((always_inline)) bool next(Field& f) {
        if (pos_ >= end_) return false;
        f.whole.begin = pos_;
        const std::uint64_t key = varint();
        f.tag = static_cast<std::uint32_t>(key);
        f.number = static_cast<unsigned>(key >> 3);
        f.wire = static_cast<unsigned>(key & 7);
        if (f.number == 0) throw WireError("field number 0");
        switch (f.wire) {
            case 0: f.value = varint(); break;
            case 1: f.value = fixed(8); break;
            case 2: {
                const std::uint64_t n = varint();
                if (n > end_ - pos_) throw WireError("truncated length-delimited field");
                f.payload = {pos_, pos_ + n};
                pos_ += n;
                break;
            }
            case 5: f.value = fixed(4); break;
            default: throw WireError("unsupported wire type");
        }
        f.whole.end = pos_;
        return true;
    }

    __attribute__((always_inline)) std::uint64_t varint() {
        // One-byte varints (tags, small lengths) are the common case.
        if (pos_ < end_ && d_[pos_] < 0x80) return d_[pos_++];
        std::uint64_t r = 0;
        for (unsigned shift = 0;; shift += 7) {
            if (pos_ >= end_ || shift > 63) throw WireError("bad varint");
            const std::uint8_t b = d_[pos_++];
            r |= static_cast<std::uint64_t>(b & 0x7f) << shift;
            if (b < 0x80) return r;
        }
    }
    bool done() const { return pos_ >= end_; }

private:
    std::uint64_t fixed(unsigned n) {
        if (end_ - pos_ < n) throw WireError("truncated fixed field");
        std::uint64_t v = 0;
        for (unsigned k = 0; k < n; ++k) v |= static_cast<std::uint64_t>(d_[pos_ + k]) << (8 * k);
        pos_ += n;
        return v;
    }

    const std::uint8_t* d_;
    std::uint64_t pos_, end_;
};

std::string text(const std::uint8_t* d, ScanSpan s) {
    return std::string(reinterpret_cast<const char*>(d + s.begin), static_cast<std::size_t>(s.size()));
}

// Repeated scalar fields come packed (wire 2) or one per field (their own wire type).
template <typename Fn>
void for_each_varint(const std::uint8_t* d, const Field& f, Fn&& fn) {
    if (f.wire == 2) {
        Reader r(d, f.payload);
        while (!r.done()) fn(r.varint());
    } else if (f.wire == 0) {
        fn(f.value);
    } else {
        throw WireError("bad wire type for an integer field");
    }
}

template <typename Fn>
void for_each_fixed(const std::uint8_t* d, const Field& f, unsigned width, Fn&& fn) {
    if (f.wire == 2) {
        if (f.payload.size() % width) throw WireError("bad packed fixed-width field");
        for (std::uint64_t p = f.payload.begin; p < f.payload.end; p += width) {
            std::uint64_t v = 0;
            for (unsigned k = 0; k < width; ++k) v |= static_cast<std::uint64_t>(d[p + k]) << (8 * k);
            fn(v);
        }
    } else if ((width == 4 && f.wire == 5) || (width == 8 && f.wire == 1)) {
        fn(f.value);
    } else {
        throw WireError("bad wire type for a fixed-width field");
    }
}

// Walks a TypeProto: begin(kind) for each tensor (1) or other (2) type field (a oneof:
// the last one counts), elem(v) for a tensor's element type, shape() when it has a
// shape, dim(kind, value, param span) per dim (a oneof too: the last field written
// wins). Throws WireError on malformed bytes.
template <class Begin, class Elem, class Shape, class Dim>
void walk_type(const std::uint8_t* d, ScanSpan s, Begin&& begin, Elem&& elem, Shape&& shape, Dim&& dim) {
    Reader r(d, s);
    Field f;
    while (r.next(f)) {
        if (f.wire != 2) continue;
        if (f.number == type_f::tensor) {
            begin(1);
            Reader tr(d, f.payload);
            Field g;
            while (tr.next(g)) {
                if (g.tag == tag(tensor_type_f::elem_type, 0)) {
                    elem(static_cast<std::int32_t>(g.value));
                } else if (g.tag == tag(tensor_type_f::shape, 2)) {
                    shape();
                    Reader sr(d, g.payload);
                    Field h;
                    while (sr.next(h)) {
                        if (h.tag != tag(1, 2)) continue;
                        std::uint8_t kind = 0;
                        std::int64_t value = 0;
                        ScanSpan param;
                        Reader dr(d, h.payload);
                        Field k;
                        while (dr.next(k)) {
                            if (k.tag == tag(dim_f::value, 0)) {
                                kind = 1;
                                value = static_cast<std::int64_t>(k.value);
                            } else if (k.tag == tag(dim_f::param, 2)) {
                                kind = 2;
                                value = 0;
                                param = k.payload;
                            }
                        }
                        dim(kind, value, param);
                    }
                }
            }
        } else if (f.number == type_f::sequence || f.number == type_f::map || f.number == type_f::sparse ||
                   f.number == type_f::optional) {
            begin(2);
        }
    }
}

ScanType parse_type(const std::uint8_t* d, ScanSpan s) {
    ScanType t;
    walk_type(
        d, s,
        [&](std::uint8_t kind) {
            t = ScanType{};
            t.kind = kind;
        },
        [&](std::int32_t e) { t.elem_type = e; },
        [&] { t.has_shape = true; },
        [&](std::uint8_t kind, std::int64_t value, ScanSpan param) {
            ScanDim dim;
            dim.kind = kind;
            dim.value = value;
            if (kind == 2) dim.param = text(d, param);
            t.dims.push_back(std::move(dim));
        });
    return t;
}

// Checks a TypeProto's wire format without keeping anything (WireError if malformed).
void check_type(const std::uint8_t* d, ScanSpan s) {
    walk_type(
        d, s, [](std::uint8_t) {}, [](std::int32_t) {}, [] {}, [](std::uint8_t, std::int64_t, ScanSpan) {});
}

// numpy's itemsize for an ONNX element type, as onnx_io._itemsize computes it
// (8 where onnx has no numpy type).
std::int64_t itemsize(std::int32_t elem) {
    switch (elem) {
        case kFloat: case kInt32: case kUint32: return 4;
        case kUint8: case kInt8: case kBool: return 1;
        case kUint16: case kInt16: case kFloat16: case 16: return 2;  // 16: bfloat16
        case kInt64: case kUint64: case kDouble: case kString: case kComplex64: return 8;
        case kComplex128: return 16;
        case 17: case 18: case 19: case 20: case 21: case 22: case 23: case 24: case 25: case 26: return 1;
        default: return 8;
    }
}

// Product of dims, saturating at INT64_MAX; -1 if a dim is negative.
std::int64_t numel(Dims dims) {
    std::int64_t n = 1;
    for (std::int64_t v : dims) {
        if (v < 0) return -1;
        if (v != 0 && n > std::numeric_limits<std::int64_t>::max() / v) return std::numeric_limits<std::int64_t>::max();
        n *= v;
    }
    return n;
}

bool too_big(const ScanTensorType& t) {
    const std::int64_t n = numel(t.shape);
    return n < 0 || n > kMaxElements;
}

std::int64_t nbytes(std::int32_t elem, Dims dims) {
    const std::int64_t n = numel(dims), s = itemsize(elem);
    if (n < 0) return -1;
    if (n > std::numeric_limits<std::int64_t>::max() / s) return std::numeric_limits<std::int64_t>::max();
    return n * s;
}

void put_varint(std::string& out, std::uint64_t v) {
    while (v >= 0x80) {
        out.push_back(static_cast<char>((v & 0x7f) | 0x80));
        v >>= 7;
    }
    out.push_back(static_cast<char>(v));
}

void put_len_field(std::string& out, unsigned number, const std::string& payload) {
    put_varint(out, (static_cast<std::uint64_t>(number) << 3) | 2);
    put_varint(out, payload.size());
    out += payload;
}

void put_varint_field(std::string& out, unsigned number, std::uint64_t v) {
    put_varint(out, static_cast<std::uint64_t>(number) << 3);
    put_varint(out, v);
}

// A ValueInfoProto with a tensor type (what onnx.helper.make_tensor_value_info writes);
// no type when `shape` is null.
std::string value_info(const std::string& name, std::int32_t elem, const Dims* shape) {
    std::string vi, type, tensor;
    put_len_field(vi, vi_f::name, name);
    if (shape != nullptr) {
        put_varint_field(tensor, tensor_type_f::elem_type, static_cast<std::uint64_t>(elem));
        std::string shp;
        for (std::int64_t v : *shape) {
            std::string dim;
            put_varint_field(dim, dim_f::value, static_cast<std::uint64_t>(v));
            put_len_field(shp, 1, dim);
        }
        put_len_field(tensor, tensor_type_f::shape, shp);
        put_len_field(type, type_f::tensor, tensor);
        put_len_field(vi, vi_f::type, type);
    }
    return vi;
}

// Little-endian, appended in one go: byte-by-byte push_back checks capacity per byte
// and was a third of finish()'s own time. `Out`: std::string or ByteBuffer.
template <class Out>
__attribute__((always_inline)) inline void put_u32(Out& out, std::uint32_t v) {
    char b[4];
    for (int k = 0; k < 4; ++k) b[k] = static_cast<char>((v >> (8 * k)) & 0xff);
    out.append(b, 4);
}
template <class Out>
__attribute__((always_inline)) inline void put_u64(Out& out, std::uint64_t v) {
    char b[8];
    for (int k = 0; k < 8; ++k) b[k] = static_cast<char>((v >> (8 * k)) & 0xff);
    out.append(b, 8);
}

// Element values in the canonical form of digest._write_values (little-endian, one NaN).
template <class Out>
void put_value(Out& out, std::int32_t elem, std::uint64_t bits) {
    switch (elem) {
        case kFloat: {
            std::uint32_t v = static_cast<std::uint32_t>(bits);
            if ((v & 0x7f800000u) == 0x7f800000u && (v & 0x007fffffu)) v = 0x7fc00000u;
            put_u32(out, v);
            return;
        }
        case kDouble: {
            if ((bits & 0x7ff0000000000000ull) == 0x7ff0000000000000ull && (bits & 0x000fffffffffffffull))
                bits = 0x7ff8000000000000ull;
            put_u64(out, bits);
            return;
        }
        case kFloat16: {
            std::uint16_t v = static_cast<std::uint16_t>(bits);
            if ((v & 0x7c00u) == 0x7c00u && (v & 0x03ffu)) v = 0x7e00u;
            out.push_back(static_cast<char>(v & 0xff));
            out.push_back(static_cast<char>(v >> 8));
            return;
        }
        case kBool: out.push_back(static_cast<char>(bits ? 1 : 0)); return;
        default: {
            const auto n = itemsize(elem);
            char b[16] = {};
            for (int k = 0; k < n && k < 8; ++k) b[k] = static_cast<char>((bits >> (8 * k)) & 0xff);
            out.append(b, static_cast<std::size_t>(n));
        }
    }
}

bool value_dtype_supported(std::int32_t e) {
    switch (e) {
        case kFloat: case kUint8: case kInt8: case kUint16: case kInt16: case kInt32: case kInt64: case kBool:
        case kFloat16: case kDouble: case kUint32: case kUint64: return true;
        default: return false;
    }
}

// The canonical value bytes of a TensorProto's elements; false if they cannot be
// read here (external, strings, segments, an unusual dtype, a count mismatch).
template <class Out>
bool tensor_values(const std::uint8_t* d, ScanSpan payload, const ScanTensorType& type, Out& out) {
    const std::int32_t elem = type.elem_type;
    const std::int64_t n = numel(type.shape);
    if (!value_dtype_supported(elem) || n < 0 || n > kIntParamMax * 16) return false;
    const std::int64_t isz = itemsize(elem);
    std::optional<ScanSpan> raw;
    std::vector<std::uint64_t> vals;
    Reader r(d, payload);
    Field f;
    while (r.next(f)) {
        switch (f.number) {
            case tensor_f::raw_data:
                if (f.wire != 2) return false;
                raw = f.payload;
                break;
            case tensor_f::float_data:
                if (elem != kFloat) return false;
                for_each_fixed(d, f, 4, [&](std::uint64_t v) { vals.push_back(v); });
                break;
            case tensor_f::double_data:
                if (elem != kDouble) return false;
                for_each_fixed(d, f, 8, [&](std::uint64_t v) { vals.push_back(v); });
                break;
            case tensor_f::int32_data:
                if (elem == kFloat || elem == kDouble || elem == kInt64 || elem == kUint32 || elem == kUint64)
                    return false;
                for_each_varint(d, f, [&](std::uint64_t v) { vals.push_back(v); });
                break;
            case tensor_f::int64_data:
                if (elem != kInt64) return false;
                for_each_varint(d, f, [&](std::uint64_t v) { vals.push_back(v); });
                break;
            case tensor_f::uint64_data:
                if (elem != kUint32 && elem != kUint64) return false;
                for_each_varint(d, f, [&](std::uint64_t v) { vals.push_back(v); });
                break;
            case tensor_f::string_data: case tensor_f::segment: case tensor_f::external_data:
                return false;
            case tensor_f::data_location:
                if (f.value != 0) return false;
                break;
            default: break;
        }
    }
    if (raw) {
        if (static_cast<std::int64_t>(raw->size()) != n * isz) return false;
        for (std::uint64_t p = raw->begin; p < raw->end; p += static_cast<std::uint64_t>(isz)) {
            std::uint64_t v = 0;
            for (std::int64_t k = 0; k < isz; ++k) v |= static_cast<std::uint64_t>(d[p + k]) << (8 * k);
            if (elem == kBool) {  // numpy keeps a bool's raw byte as it is
                out.push_back(static_cast<char>(v));
                continue;
            }
            put_value(out, elem, v);
        }
        return true;
    }
    if (static_cast<std::int64_t>(vals.size()) != n) return false;
    for (std::uint64_t v : vals) put_value(out, elem, v);
    return true;
}


}  // namespace

// ------------------------------------------------------------------------------ scan


void BytesIndex::rehash(std::size_t capacity) {
    std::vector<Slot> slots(capacity);
    const std::size_t mask = capacity - 1;
    for (std::size_t id = 0; id < hash_of_.size(); ++id) {
        std::size_t j = hash_of_[id] & mask;
        while (slots[j].id1 != 0) j = (j + 1) & mask;
        slots[j] = Slot{static_cast<std::uint32_t>(hash_of_[id] >> 32), static_cast<std::int32_t>(id) + 1};
    }
    slots_.swap(slots);
}

void BytesIndex::reserve(std::size_t n) {
    std::size_t capacity = 256;
    while (capacity < 2 * n) capacity *= 2;
    if (capacity > slots_.size()) rehash(capacity);
    at_.reserve(n + 1);
    hash_of_.reserve(n);
}

std::int32_t BytesIndex::intern(const char* p, std::size_t n, bool& inserted) {
    if (2 * (size() + 1) > slots_.size()) rehash(slots_.empty() ? 256 : 2 * slots_.size());  // at most half full
    const std::uint64_t h = bytes_hash(p, n);
    const auto check = static_cast<std::uint32_t>(h >> 32);
    const std::size_t mask = slots_.size() - 1;
    std::size_t j = h & mask;
    for (; slots_[j].id1 != 0; j = (j + 1) & mask) {
        if (slots_[j].check != check) continue;
        const std::int32_t id = slots_[j].id1 - 1;
        const std::string_view have = key(id);
        if (have.size() == n && bytes_equal(have.data(), p, n)) {
            inserted = false;
            return id;
        }
    }
    const auto id = static_cast<std::int32_t>(size());
    arena_.append(p, n);
    at_.push_back(arena_.size());
    hash_of_.push_back(h);
    slots_[j] = Slot{check, id + 1};
    inserted = true;
    return id;
}

std::int32_t BytesIndex::find(const char* p, std::size_t n) const {
    if (slots_.empty()) return -1;
    const std::uint64_t h = bytes_hash(p, n);
    const auto check = static_cast<std::uint32_t>(h >> 32);
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t j = h & mask; slots_[j].id1 != 0; j = (j + 1) & mask) {
        if (slots_[j].check != check) continue;
        const std::int32_t id = slots_[j].id1 - 1;
        const std::string_view have = key(id);
        if (have.size() == n && bytes_equal(have.data(), p, n)) return id;
    }
    return -1;
}

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

std::shared_ptr<const std::string> HeadTable::find(std::string_view key) const {
    const std::int32_t id = keys_.find(key.data(), key.size());
    return id < 0 ? nullptr : heads_[static_cast<std::size_t>(id)];
}

void HeadTable::add(std::string_view key, std::shared_ptr<const std::string> head) {
    const std::size_t more = key.size() + head->size();
    if (more > max_bytes_) return;  // not worth keeping
    if (heads_.size() >= max_entries_ || bytes_ + more > max_bytes_) clear();
    bool inserted;
    const std::int32_t id = keys_.intern(key.data(), key.size(), inserted);
    if (!inserted) {  // the same key always canonicalises to the same head
        heads_[static_cast<std::size_t>(id)] = std::move(head);
        return;
    }
    heads_.push_back(std::move(head));
    bytes_ += more;
}

void HeadTable::clear() {
    keys_ = BytesIndex();
    heads_.clear();
    bytes_ = 0;
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

namespace {

// AttributeProto.AttributeType values canonical_attributes handles.
constexpr std::uint64_t kAttrFloat = 1, kAttrInt = 2, kAttrString = 3, kAttrFloats = 6, kAttrInts = 7,
                        kAttrStrings = 8;

// digest._Writer.f32: the IEEE bits, every NaN as one pattern.
void put_f32_bits(std::string& out, std::uint32_t bits) {
    const bool nan = (bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0;
    put_u32(out, nan ? 0x7fc00000u : bits);
}

void put_text(std::string& out, const std::uint8_t* d, ScanSpan s) {
    put_u32(out, static_cast<std::uint32_t>(s.size()));
    out.append(reinterpret_cast<const char*>(d + s.begin), static_cast<std::size_t>(s.size()));
}

// One attribute's name span and canonical body (digest._attr_body), or false when it
// is not a plain attribute (see canonical_attributes).
bool attribute_body(const std::uint8_t* d, ScanSpan attr, ScanSpan& name, std::string& body) {
    std::uint64_t type = 0, i = 0;
    std::uint32_t f = 0;
    ScanSpan str;
    std::vector<std::uint32_t> floats;
    std::vector<std::uint64_t> ints;
    std::vector<ScanSpan> strings;
    bool named = false;
    Reader r(d, attr);
    Field g;
    while (r.next(g)) {
        // Singular fields: the last occurrence wins, as protobuf parses them.
        switch (g.number) {
            case attr_f::name:
                if (g.wire != 2) return false;
                name = g.payload;
                named = true;
                break;
            case attr_f::f:
                if (g.wire != 5) return false;
                f = static_cast<std::uint32_t>(g.value);
                break;
            case attr_f::i:
                if (g.wire != 0) return false;
                i = g.value;
                break;
            case attr_f::s:
                if (g.wire != 2) return false;
                str = g.payload;
                break;
            case attr_f::floats:
                if (g.wire != 2 && g.wire != 5) return false;
                for_each_fixed(d, g, 4, [&](std::uint64_t v) { floats.push_back(static_cast<std::uint32_t>(v)); });
                break;
            case attr_f::ints:
                for_each_varint(d, g, [&](std::uint64_t v) { ints.push_back(v); });
                break;
            case attr_f::strings:
                if (g.wire != 2) return false;
                strings.push_back(g.payload);
                break;
            case attr_f::type:
                if (g.wire != 0) return false;
                type = g.value;
                break;
            case 13:  // doc_string: never part of the identity
                break;
            default:  // tensors, graphs, type protos, ref_attr_name, fields onnx lacks
                return false;
        }
    }
    // Protobuf hands Python a str for the name: only ASCII is surely the same bytes.
    if (!named) return false;
    for (std::uint64_t k = name.begin; k < name.end; ++k)
        if (d[k] >= 0x80) return false;
    body.clear();
    body.push_back(static_cast<char>(type));
    body.push_back(0);  // not a reference to a function's attribute
    switch (type) {
        case kAttrFloat: put_f32_bits(body, f); break;
        case kAttrInt: put_u64(body, i); break;
        case kAttrString: put_text(body, d, str); break;
        case kAttrFloats:
            put_u32(body, static_cast<std::uint32_t>(floats.size()));
            for (std::uint32_t v : floats) put_f32_bits(body, v);
            break;
        case kAttrInts:
            put_u32(body, static_cast<std::uint32_t>(ints.size()));
            for (std::uint64_t v : ints) put_u64(body, v);
            break;
        case kAttrStrings:
            put_u32(body, static_cast<std::uint32_t>(strings.size()));
            for (const ScanSpan& v : strings) put_text(body, d, v);
            break;
        default: return false;  // unset (guessed from the fields in Python), or not plain
    }
    return true;
}

}  // namespace

std::optional<std::string> canonical_attributes(const std::uint8_t* d, std::size_t size,
                                                const std::unordered_map<std::string, std::string>* defaults) {
    struct Entry {
        ScanSpan name;
        std::string body;
    };
    std::vector<Entry> entries;
    try {
        Reader r(d, 0, size);
        Field f;
        while (r.next(f)) {
            if (f.tag != tag(node_f::attribute, 2)) return std::nullopt;
            Entry e;
            if (!attribute_body(d, f.payload, e.name, e.body)) return std::nullopt;
            entries.push_back(std::move(e));
        }
    } catch (const WireError&) {
        return std::nullopt;  // Python's parser reports it
    }
    auto name_of = [d](const Entry& e) {
        return std::string_view(reinterpret_cast<const char*>(d + e.name.begin), static_cast<std::size_t>(e.name.size()));
    };
    // Name order, byte-wise; stable, as Python's sorted() (ONNX forbids duplicates, but
    // a file may hold them).
    std::stable_sort(entries.begin(), entries.end(),
                     [&](const Entry& a, const Entry& b) { return name_of(a) < name_of(b); });
    std::string out;
    std::uint32_t kept = 0;
    put_u32(out, 0);  // the count, written at the end
    for (const Entry& e : entries) {
        // An attribute spelled out at its schema default means the same as leaving it out.
        if (defaults != nullptr) {
            const auto it = defaults->find(std::string(name_of(e)));
            if (it != defaults->end() && it->second == e.body) continue;
        }
        put_text(out, d, e.name);
        out += e.body;
        ++kept;
    }
    for (int k = 0; k < 4; ++k) out[static_cast<std::size_t>(k)] = static_cast<char>((kept >> (8 * k)) & 0xff);
    return out;
}

std::optional<std::string> canonical_attribute_body(const std::uint8_t* d, std::size_t size) {
    ScanSpan name;
    std::string body;
    try {
        if (!attribute_body(d, ScanSpan{0, size}, name, body)) return std::nullopt;
    } catch (const WireError&) {
        return std::nullopt;  // Python's parser reports it
    }
    return body;
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

// ------------------------------------------------------------------------ light model

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

// ----------------------------------------------------------------------------- finish

namespace {

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
    // Concrete type id per name (-1: none known), in onnx_io._Loader._concrete's order
    // of precedence: initializers, Constant nodes, folded Shape/Size, then inference.
    std::vector<std::int32_t> cid(names, -1);

    // Inferred types, merged as onnx_io._merge_type does: a later entry replaces an
    // earlier one only when strictly more complete (onnx_io._completeness).
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
                        std::int64_t v = kUnknownDim;  // onnx_io._parse_type's rule
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
    // (the shapes of ConstantOfShape chains), and interning every one was a tenth of
    // finish()'s work.
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
                const bool param = ne <= 1 || ((ct.elem_type == kInt32 || ct.elem_type == kInt64) && ne <= kIntParamMax) ||
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
