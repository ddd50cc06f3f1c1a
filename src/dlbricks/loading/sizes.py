"""Element counts and item sizes of tensors, and the size limits both loaders apply."""

from __future__ import annotations

import functools
from typing import Iterable

import numpy as np
import onnx
from onnx import TensorProto

from dlbricks import _core

__all__ = ["INLINE_BYTES", "MAX_ELEMENTS", "elem_type_of", "itemsize", "numel"]

# Both from the extension, so that the C++ fast path and the Python loader apply the
# same numbers (cpp/include/dlbricks/limits.hpp).
#: Tensors with more elements than this (2**40) are rejected as absurd.
MAX_ELEMENTS: int = _core.MAX_ELEMENTS
#: Initializers (and Constant values) up to this size go to shape inference with their
#: data, so that data propagation can see shape-like values; larger ones only by type.
INLINE_BYTES: int = _core.INLINE_BYTES


@functools.cache
def itemsize(elem_type: int) -> int:
    """numpy's item size for an ONNX element type (8 where onnx has no numpy type)."""
    try:
        return int(onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize) or 1
    except Exception:
        return 8


def numel(dims: Iterable[int]) -> int:
    """The product of ``dims`` (1 for a scalar)."""
    n = 1
    for d in dims:
        n *= d
    return n


def elem_type_of(arr: np.ndarray) -> int:
    """The ONNX element type of a numpy array (STRING for object and text arrays)."""
    if arr.dtype.kind in ("O", "U", "S"):
        return TensorProto.STRING
    return int(onnx.helper.np_dtype_to_tensor_dtype(arr.dtype))
