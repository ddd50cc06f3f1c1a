// See wire.hpp.
#include "dlbricks/wire.hpp"

#include <utility>

namespace dlbricks {

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

void check_type(const std::uint8_t* d, ScanSpan s) {
    walk_type(
        d, s, [](std::uint8_t) {}, [](std::int32_t) {}, [] {}, [](std::uint8_t, std::int64_t, ScanSpan) {});
}

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

}  // namespace dlbricks
