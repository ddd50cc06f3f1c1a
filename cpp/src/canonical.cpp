// See canonical.hpp.
#include "dlbricks/canonical.hpp"

#include <algorithm>
#include <string_view>

namespace dlbricks {

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

}  // namespace dlbricks
