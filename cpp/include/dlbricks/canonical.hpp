// The canonical byte form of layer heads and param values (docs/digests.md), written
// from wire bytes. It must stay byte-identical to dlbricks/digest.py: the tests compare
// both on every node onnx ships and on random attributes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "dlbricks/limits.hpp"
#include "dlbricks/wire.hpp"

namespace dlbricks {

/// `v` little-endian, appended in one go (one capacity check per integer, not one per
/// byte: canonical forms are mostly such integers). `Out`: std::string or ByteBuffer.
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

/// One element value in the canonical form of digest._write_values (little-endian,
/// every NaN as one pattern); `bits` holds the value's bytes as read from the wire.
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

/// Whether tensor_values reads elements of this type.
inline bool value_dtype_supported(std::int32_t e) {
    switch (e) {
        case kFloat: case kUint8: case kInt8: case kUint16: case kInt16: case kInt32: case kInt64: case kBool:
        case kFloat16: case kDouble: case kUint32: case kUint64: return true;
        default: return false;
    }
}

/// Appends the canonical value bytes of a TensorProto's elements (`payload`, of type
/// `type`); false if they cannot be read here (external, strings, segments, an unusual
/// dtype, a count mismatch, more elements than a param can have). Cost: O(bytes).
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

}  // namespace dlbricks
