"""Element counts and item sizes of tensors, and the size limits both loaders apply."""

from __future__ import annotations

import functools
from typing import Iterable

import numpy as np
import onnx
from onnx import TensorProto

__all__ = ["INLINE_BYTES", "MAX_ELEMENTS", "elem_type_of", "itemsize", "numel"]

#: Tensors with more elements than this are rejected as absurd.
MAX_ELEMENTS = 2**40
#: Initializers (and Constant values) up to this size go to shape inference with their
#: data, so that data propagation can see shape-like values; larger ones only by type.
INLINE_BYTES = 64 * 1024


@functools.lru_cache(maxsize=None)
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
