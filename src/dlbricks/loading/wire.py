"""Reading a model file into a ``ModelProto``; big files without their weights' data.

Parsing a protobuf copies every bytes field, so onnx.load on a model with 500 MB of
weights costs a second or more. For big files the wire format is walked instead (the
file is memory-mapped; weight pages are never touched) and a copy of the model is
parsed in which every large initializer keeps its name, dims and type but not its
data. Its span in the file is remembered so that Model.constant_value can parse it on
demand (:class:`dlbricks.loading.constants.ConstantStore`).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Iterable

import onnx

from dlbricks.errors import ModelError
from dlbricks.loading.messages import one_line
from dlbricks.loading.sizes import INLINE_BYTES, itemsize, numel

__all__ = ["read_proto"]

# Files at least this big are read by walking the wire format (see _scan_model).
_SCAN_MIN_BYTES = 8 << 20

_GRAPH_FIELD = 7  # ModelProto.graph
_INITIALIZER_FIELD = 5  # GraphProto.initializer
# TensorProto fields holding element data (float_data, int32_data, string_data,
# int64_data, raw_data, double_data, uint64_data); every other field stays in the stub.
_TENSOR_DATA_FIELDS = frozenset({4, 5, 6, 7, 9, 10, 11})
_TENSOR_DIMS, _TENSOR_DATA_TYPE = 1, 2


def read_proto(path: Path, label: str) -> tuple[onnx.ModelProto, dict[str, tuple[int, int]]]:
    """The model in ``path``, and where the data of initializers left out of it lie in
    the file (name -> (start, end) of the TensorProto).

    Raises:
        ModelError: the file is missing, unreadable or not a protobuf ModelProto (one
            line naming ``label`` and the cause).
    """
    try:
        if path.stat().st_size >= _SCAN_MIN_BYTES:
            return _scan_model(path)
    except Exception:  # noqa: BLE001 - onnx.load below reports what is wrong with the file
        pass
    try:
        # format="protobuf": never guess a text format from the file extension.
        return onnx.load(os.fspath(path), format="protobuf", load_external_data=False), {}
    except FileNotFoundError:
        raise ModelError(f"{label}: no such file") from None
    except IsADirectoryError:
        raise ModelError(f"{label}: is a directory, not an ONNX file") from None
    except OSError as exc:
        raise ModelError(one_line(f"{label}: cannot read the file ({exc.strerror or exc})")) from None
    except Exception as exc:  # DecodeError and friends: every parse failure means the same
        raise ModelError(one_line(f"{label}: not an ONNX model ({type(exc).__name__}: {exc})")) from None


def _read_varint(buf: mmap.mmap | bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("bad varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _varint_bytes(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _wire_fields(buf: mmap.mmap | bytes, start: int, end: int) -> Iterable[tuple[int, int, int, int, int]]:
    """(field number, wire type, field start, value start, field end) of each field."""
    pos = start
    while pos < end:
        field_start = pos
        key, pos = _read_varint(buf, pos, end)
        wire = key & 7
        if wire == 0:
            value_start = pos
            _, pos = _read_varint(buf, pos, end)
        elif wire == 1:
            value_start, pos = pos, pos + 8
        elif wire == 2:
            n, value_start = _read_varint(buf, pos, end)
            pos = value_start + n
        elif wire == 5:
            value_start, pos = pos, pos + 4
        else:  # groups are not used by onnx.proto
            raise ValueError(f"unsupported wire type {wire}")
        if pos > end:
            raise ValueError("truncated field")
        yield key >> 3, wire, field_start, value_start, pos


def _tensor_stub(buf: mmap.mmap, start: int, end: int) -> bytes | None:
    """A TensorProto's fields without its data, or None when the tensor is small."""
    kept: list[bytes] = []
    dims: list[int] = []
    data_type = 0
    for field, wire, fs, vs, fe in _wire_fields(buf, start, end):
        if field in _TENSOR_DATA_FIELDS:
            continue
        if field == _TENSOR_DIMS:
            if wire == 0:
                dims.append(_read_varint(buf, vs, fe)[0])
            else:  # packed
                p = vs
                while p < fe:
                    d, p = _read_varint(buf, p, fe)
                    dims.append(d)
        elif field == _TENSOR_DATA_TYPE:
            data_type = _read_varint(buf, vs, fe)[0]
        kept.append(buf[fs:fe])
    if numel(dims) * itemsize(data_type) <= INLINE_BYTES:
        return None
    return b"".join(kept)


def _scan_model(path: Path) -> tuple[onnx.ModelProto, dict[str, tuple[int, int]]]:
    """Parse ``path`` leaving large initializer data in the file (see above)."""
    spans: dict[str, tuple[int, int]] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        size = len(buf)
        model_parts: list[bytes] = []
        for field, wire, fs, vs, fe in _wire_fields(buf, 0, size):
            if field != _GRAPH_FIELD or wire != 2:
                model_parts.append(buf[fs:fe])
                continue
            graph_parts: list[bytes] = []
            for gfield, gwire, gfs, gvs, gfe in _wire_fields(buf, vs, fe):
                stub = None
                if gfield == _INITIALIZER_FIELD and gwire == 2 and gfe - gvs > INLINE_BYTES:
                    stub = _tensor_stub(buf, gvs, gfe)
                if stub is None:
                    graph_parts.append(buf[gfs:gfe])
                    continue
                name = onnx.TensorProto.FromString(stub).name
                spans[name] = (gvs, gfe)
                graph_parts.append(_varint_bytes(_INITIALIZER_FIELD << 3 | 2) + _varint_bytes(len(stub)) + stub)
            graph = b"".join(graph_parts)
            model_parts.append(_varint_bytes(_GRAPH_FIELD << 3 | 2) + _varint_bytes(len(graph)) + graph)
    return onnx.ModelProto.FromString(b"".join(model_parts)), spans
