// Tensor sizes, and the size limits the fast path shares with the Python loader.
//
// Python reads the limits from the extension (_core.MAX_ELEMENTS, _core.INLINE_BYTES,
// _core.INT_PARAM_MAX_ELEMENTS, _core.PARAM_MAX_ELEMENTS), so both loaders apply the
// same numbers by construction.
#pragma once

#include <cstdint>
#include <limits>

#include "dlbricks/wire.hpp"

namespace dlbricks {

/// Tensors with more elements are absurd: the model is refused (loading.MAX_ELEMENTS).
constexpr std::int64_t kMaxElements = std::int64_t{1} << 40;
/// Initializers and Constant values up to this many bytes go to shape inference with
/// their data (data propagation can read shape-like values); larger ones by type only.
constexpr std::int64_t kInlineBytes = 64 * 1024;
/// Constants with at most this many elements are params (identity by value) whatever
/// their type (digest.constant_role).
constexpr std::int64_t kParamMaxElements = 1;
/// int32/int64 constants (shapes, axes, pads, indices) and the scales/sizes of
/// Resize/Upsample up to this many elements are params too (digest.constant_role).
constexpr std::int64_t kIntParamMax = 4096;

/// numpy's itemsize for an ONNX element type, as loading.sizes.itemsize computes it
/// (8 where onnx has no numpy type). O(1).
inline std::int64_t itemsize(std::int32_t elem) {
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

/// Product of dims, saturating at INT64_MAX; -1 if a dim is negative. O(rank).
inline std::int64_t numel(Dims dims) {
    std::int64_t n = 1;
    for (std::int64_t v : dims) {
        if (v < 0) return -1;
        if (v != 0 && n > std::numeric_limits<std::int64_t>::max() / v) return std::numeric_limits<std::int64_t>::max();
        n *= v;
    }
    return n;
}

/// numel * itemsize, saturating as numel does; -1 if a dim is negative. O(rank).
inline std::int64_t nbytes(std::int32_t elem, Dims dims) {
    const std::int64_t n = numel(dims), s = itemsize(elem);
    if (n < 0) return -1;
    if (n > std::numeric_limits<std::int64_t>::max() / s) return std::numeric_limits<std::int64_t>::max();
    return n * s;
}

}  // namespace dlbricks
