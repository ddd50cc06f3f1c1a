"""Loading: ONNX files into :class:`dlbricks.model.Model` objects (fast C++ path, full Python path)."""

from __future__ import annotations

from dlbricks.loading.onnx_io import iter_load, iter_model_paths, load

__all__ = ["iter_load", "iter_model_paths", "load"]
