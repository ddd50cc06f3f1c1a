// The protobuf wire format of onnx.proto, read and written without a protobuf library.
//
// Bytes in, spans out: a Reader walks a message's fields in place (a length-delimited
// field is a span of the caller's buffer, never a copy), so a weight payload is skipped
// by its length prefix without being touched. Field numbers are onnx.proto's (ONNX IR
// 10). Everything malformed throws WireError; callers turn it into "use the full loader".
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace dlbricks {

/// Malformed protobuf bytes. The caller falls back to the full loader, which reports it.
struct WireError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

/// A [begin, end) range of a caller's buffer.
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

// TensorProto.DataType values the scanner reads.
constexpr std::int32_t kFloat = 1, kUint8 = 2, kInt8 = 3, kUint16 = 4, kInt16 = 5, kInt32 = 6, kInt64 = 7,
                       kString = 8, kBool = 9, kFloat16 = 10, kDouble = 11, kUint32 = 12, kUint64 = 13,
                       kComplex64 = 14, kComplex128 = 15;
// AttributeProto.AttributeType values of graph attributes.
constexpr std::int32_t kAttrGraph = 5, kAttrGraphs = 10;

/// A field's key as written: number << 3 | wire type.
constexpr std::uint32_t tag(unsigned number, unsigned wire) { return number << 3 | wire; }

/// One field, as Reader::next found it.
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

/// Walks the fields of one message in place. Every read is bounds-checked and throws
/// WireError past the end; O(1) per field, payloads skipped by their length.
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

/// The bytes of `s` as a string (a copy).
inline std::string text(const std::uint8_t* d, ScanSpan s) {
    return std::string(reinterpret_cast<const char*>(d + s.begin), static_cast<std::size_t>(s.size()));
}

/// Each value of a repeated varint field: repeated scalar fields come packed (wire 2)
/// or one per field (their own wire type).
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

/// Each value of a repeated fixed-width (4 or 8 bytes) field, packed or not.
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

/// Walks a TypeProto: begin(kind) for each tensor (1) or other (2) type field (a oneof:
/// the last one counts), elem(v) for a tensor's element type, shape() when it has a
/// shape, dim(kind, value, param span) per dim (a oneof too: the last field written
/// wins). Throws WireError on malformed bytes. Cost: O(bytes).
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

/// Parses a TypeProto (the last of repeated oneof fields wins, as protobuf parses them).
/// Throws WireError on malformed bytes. Cost: O(bytes).
ScanType parse_type(const std::uint8_t* d, ScanSpan s);

/// Checks a TypeProto's wire format without keeping anything (WireError if malformed).
void check_type(const std::uint8_t* d, ScanSpan s);

/// Appends `v` as a varint.
inline void put_varint(std::string& out, std::uint64_t v) {
    while (v >= 0x80) {
        out.push_back(static_cast<char>((v & 0x7f) | 0x80));
        v >>= 7;
    }
    out.push_back(static_cast<char>(v));
}

/// Appends a length-delimited field.
inline void put_len_field(std::string& out, unsigned number, const std::string& payload) {
    put_varint(out, (static_cast<std::uint64_t>(number) << 3) | 2);
    put_varint(out, payload.size());
    out += payload;
}

/// Appends a varint field.
inline void put_varint_field(std::string& out, unsigned number, std::uint64_t v) {
    put_varint(out, static_cast<std::uint64_t>(number) << 3);
    put_varint(out, v);
}

/// A ValueInfoProto with a tensor type (what onnx.helper.make_tensor_value_info
/// writes): element type and concrete dims; no type when `shape` is null. Cost: O(rank).
std::string value_info(const std::string& name, std::int32_t elem, const Dims* shape);

}  // namespace dlbricks
