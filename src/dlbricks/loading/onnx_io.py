"""Load ONNX models into :class:`dlbricks.model.Model`.

Loading validates the graph, resolves every tensor type with onnx's shape inference,
folds constants symbolically (initializers, ``Constant`` nodes, every node whose inputs
are all constant, and ``Shape``/``Size`` of statically shaped tensors) and turns each
remaining node into a :class:`~dlbricks.model.Layer` with a digest.

Analysis never reads weight bytes: big files are parsed without their large
initializers' data (see ``_scan_model``), external data is not loaded, shape inference
runs on a light copy of the model whose large initializers are replaced by typed graph
inputs, and constant values are computed only for "param" constants (see
:func:`dlbricks.digest.constant_role`). :meth:`Model.constant_value` computes any
constant's real value on demand.
"""

from __future__ import annotations

import functools
import heapq
import mmap
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Literal, Mapping, Sequence, Union

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto

from dlbricks import _core
from dlbricks.digest import _head_prefix, _layer_digest_fields, constant_role, make_head, schema_defaults_of
from dlbricks.errors import DlbricksError, ModelError
from dlbricks.model import ConstInput, LazyLayers, LazyMapping, Layer, Model, TensorType, unique_layer_name

__all__ = ["DlbricksWarning", "MAX_ELEMENTS", "iter_model_paths", "load"]

PathLike = Union[str, "os.PathLike[str]"]

#: Tensors with more elements than this are rejected as absurd.
MAX_ELEMENTS = 2**40
# Ops that carry subgraphs; they are single opaque layers.
_CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})
# Ops whose output follows from the input's type alone.
_TYPE_FOLDED = frozenset({"Shape", "Size"})
# Initializers (and Constant values) up to this size go to shape inference with their
# data, so that data propagation can see shape-like values; larger ones only by type.
_INLINE_BYTES = 64 * 1024
# Computed constant values up to this size are kept for later calls (params, shapes);
# weights are recomputed or re-read on each call rather than held for the model's life.
_CACHE_BYTES = 64 * 1024
# Files at least this big are read by walking the wire format (see _scan_model).
_SCAN_MIN_BYTES = 8 << 20
# Rounds of "evaluate small folded constants, re-run inference" when shapes stay unknown,
# and the largest folded constant evaluated for that.
_MAX_INFERENCE_ROUNDS = 4
_INJECT_MAX_ELEMENTS = 4096

_GRAPH_ATTR_TYPES = (AttributeProto.GRAPH, AttributeProto.GRAPHS)

_Dims = tuple[Union[int, str, None], ...]
_RawType = tuple[int, Union[_Dims, None]]  # elem_type, dims (None: unknown rank)


class DlbricksWarning(UserWarning):
    """A model was analysed under an assumption (e.g. a symbolic batch dim set to 1)."""


def _oneline(s: str) -> str:
    return " ".join(s.split())


def _norm_domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def iter_model_paths(paths: PathLike | Iterable[PathLike]) -> list[Path]:
    """Expand files and folders into a list of model files.

    Args:
        paths: one path or several; a folder stands for every ``*.onnx`` file below it
            (recursively, sorted); a file is taken as given.

    Returns:
        The files in argument order, each folder's files sorted, without duplicates.

    Raises:
        DlbricksError: a path does not exist, or a folder holds no ``.onnx`` file.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    seen: set[str] = set()  # str(path): Path's own hash costs more than the lookup
    for p in paths:
        path = p if isinstance(p, Path) else Path(p)
        try:
            is_dir = stat.S_ISDIR(os.stat(path).st_mode)  # one stat per path
        except (OSError, ValueError):
            raise DlbricksError(f"{path}: no such file or directory") from None
        if is_dir:
            found = sorted(f for f in path.rglob("*.onnx") if f.is_file())
            if not found:
                raise DlbricksError(f"{path}: no .onnx files found")
        else:
            found = [path]
        for f in found:
            key = str(f)
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out


def load(
    source: PathLike | onnx.ModelProto,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    name: str | None = None,
) -> Model:
    """Load, validate and fold an ONNX model.

    Args:
        source: a path to an ``.onnx`` file, or an in-memory ``onnx.ModelProto``.
            External data is never loaded during analysis.
        input_shapes: shapes for graph inputs, overriding the declared ones (needed
            when an input has symbolic dims other than a leading batch dim).
        name: the model's name; defaults to the file stem (or the graph name).

    Returns:
        The folded :class:`~dlbricks.model.Model`.

    Raises:
        ModelError: the file is not a readable ONNX model, or the graph is invalid
            (cycle, undefined tensor, unknown op, unresolvable or absurd shape, no
            layers). The message is one line naming the file and the cause.
        TypeError: ``source`` is neither a path nor a ModelProto.

    Warns:
        DlbricksWarning: a symbolic leading (batch) dim of an input was set to 1.
    """
    if isinstance(source, onnx.ModelProto):
        label = name or source.graph.name or "<model>"
        if _FAST_PATH and not input_shapes:
            fast = _load_fast_proto(source, label, name or source.graph.name or "model")
            if fast is not None:
                return fast
        return _load_proto(source, label, None, name, input_shapes, {})
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"load() expects a path or an onnx.ModelProto, got {type(source).__name__}")
    path = source if isinstance(source, Path) else Path(source)
    label = os.fspath(source)
    if _FAST_PATH and not input_shapes:
        fast = _load_fast(path, label, name or path.stem)
        if fast is not None:
            return fast
    return _load_file(path, label, name, input_shapes)


def iter_load(
    paths: Sequence[PathLike],
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    batch_bytes: int = 32 << 20,
    batch_models: int = 64,
) -> Iterator[tuple[Path, Model | None, ModelError | None]]:
    """Load model files one after the other, each exactly as :func:`load` would.

    Yields ``(path, model, None)`` or ``(path, None, error)`` in the order of ``paths``;
    a model's warnings are given just before it is yielded. The fast path runs in
    phases over batches of files: every file of a batch is scanned, then every light
    model goes through onnx's shape inference, then every model is finished. Model by
    model, onnx's inference evicted the loader from the CPU's caches between two of its
    steps, and the loader evicted onnx; in phases both stay warm (the nine light models,
    alternating processes: dlbricks' own time 10.99 -> 8.95 ms, onnx's 28.4 -> 23.9
    ms). A batch takes files while it holds less than ``batch_bytes`` of them, and at
    most ``batch_models`` files, so memory stays bounded by the largest model, not by
    the corpus. Errors other than a bad model's (``MemoryError``...) propagate.
    """
    files = [p if isinstance(p, Path) else Path(p) for p in paths]
    fast = _FAST_PATH and not input_shapes and _c_shape_inference is not None
    i = 0
    while i < len(files):
        batch: list[Path] = []
        scanned: list[tuple[bytes | mmap.mmap, _core.OnnxScan] | None] = []
        held = 0  # bytes of the batch's files
        while i < len(files) and len(batch) < max(batch_models, 1) and (not batch or held < batch_bytes):
            path = files[i]
            i += 1
            batch.append(path)
            scanned.append(_scan_file(path) if fast else None)
            held += len(scanned[-1][0]) if scanned[-1] is not None else 0
        yield from _complete_batch(batch, scanned, input_shapes)


def _scan_file(path: Path) -> tuple[bytes | mmap.mmap, _core.OnnxScan] | None:
    """The file's bytes and their scan; None (nothing left open) when the full loader
    must run."""
    buf = _open_bytes(path)
    if buf is None:
        return None
    try:
        scan = _core.OnnxScan(buf)
        if not scan.fallback:
            return buf, scan
    except Exception:  # noqa: BLE001 - malformed: the full loader says why
        pass
    _release(buf)
    return None


def _complete_batch(
    files: list[Path],
    scanned: list[tuple[bytes | mmap.mmap, _core.OnnxScan] | None],
    input_shapes: Mapping[str, Sequence[int]] | None,
) -> Iterator[tuple[Path, Model | None, ModelError | None]]:
    """The rest of a batch's steps, each over the whole batch (see :func:`iter_load`),
    then the models in order; the full loader for every file the fast path leaves."""
    bufs = [s[0] for s in scanned if s is not None]
    try:
        prepared: list[_Prepared | None] = []
        for path, s in zip(files, scanned):
            p = None
            if s is not None:
                try:
                    p = _fast_prepare(s[1], s[0], path, os.fspath(path), path.stem)
                except Exception:  # noqa: BLE001 - the full loader says why
                    p = None
            prepared.append(p)
        del scanned
        inferred = [None if p is None else _infer_light(p) for p in prepared]
        finished: list[dict | None] = []
        for p, light_inferred in zip(prepared, inferred):
            res = None
            if p is not None and light_inferred is not None:
                try:
                    res = _finish(p, light_inferred)
                except Exception:  # noqa: BLE001 - the full loader says why
                    res = None
            finished.append(res)
        del inferred
        for buf in bufs:  # every step that reads the files is done
            _release(buf)
        for i, path in enumerate(files):
            p, res = prepared[i], finished[i]
            prepared[i] = finished[i] = None
            model: Model | None = None
            if p is not None and res is not None:
                model = _build_model(p, res, stacklevel=3)
            error: ModelError | None = None
            if model is None:
                try:
                    model = _load_file(path, os.fspath(path), None, input_shapes)
                except ModelError as exc:
                    error = exc
            yield path, model, error
    finally:  # also when a step is interrupted
        for buf in bufs:
            _release(buf)


def _load_file(
    path: Path, label: str, name: str | None, input_shapes: Mapping[str, Sequence[int]] | None
) -> Model:
    """The full loader on a file (everything ONNX allows; every error message)."""
    proto, spans = _read_proto(path, label)
    return _load_proto(proto, label, path, name, input_shapes, spans)


def _load_proto(
    proto: onnx.ModelProto,
    label: str,
    path: Path | None,
    name: str | None,
    input_shapes: Mapping[str, Sequence[int]] | None,
    spans: Mapping[str, tuple[int, int]],
) -> Model:
    if proto.ir_version <= 0 or not proto.HasField("graph"):
        raise ModelError(f"{label}: not an ONNX model (no IR version or no graph)")
    model_name = name or (path.stem if path is not None else proto.graph.name or "model")
    try:
        return _Loader(proto, label, path, model_name, input_shapes, spans).run()
    except (DlbricksError, MemoryError, RecursionError):
        raise
    except Exception as exc:  # noqa: BLE001
        # A damaged file can parse as protobuf yet hold fields no valid model has (names
        # that are not UTF-8, an op_type that is bytes...): still one line, not a traceback.
        raise ModelError(_oneline(f"{label}: not a valid ONNX model ({type(exc).__name__}: {exc})")) from None


# -- the fast path -----------------------------------------------------------------------
#
# Most models are plain graphs: default-domain ops, no subgraphs, static shapes (or a
# symbolic batch dim). For those the C++ scanner (_core.OnnxScan, cpp/src/onnx_scan.cpp)
# reads the file's bytes directly: no protobuf object per node, weight payloads skipped
# by their length. Python adds only what needs onnx itself: each distinct op's schema
# version and attribute defaults, each distinct (op, attributes) head whose attributes
# are not plain (OnnxScan.set_plain_heads makes the others in C++), and shape
# inference, which runs on bytes. Anything else, including every error, goes to the full
# loader above, which the scanner never second-guesses: when it says "fallback", the
# full loader runs from scratch. Layers, constant types and constant values of a fast
# model are built by the full loader on first use (see model.LazyLayers).

try:  # onnx's C++ shape inference on serialized bytes (what onnx.shape_inference wraps)
    from onnx.onnx_cpp2py_export import shape_inference as _c_shape_inference
except ImportError:  # pragma: no cover - every onnx release since 1.2 has it
    _c_shape_inference = None

# Tests turn the fast path off to compare it with the full loader.
_FAST_PATH = True
# Files at least this big are memory-mapped: weight pages are then never read.
_MMAP_MIN_BYTES = 1 << 20
# (op type, op version, serialized attributes) -> canonical head (digest.make_head), kept in
# C++ so that a scan finds its heads without a Python lookup per head.
_FAST_HEADS = _core.HeadTable()


@functools.lru_cache(maxsize=4096)
def _op_schema(op_type: str, opset: int) -> tuple[int, bytes, dict[str, bytes]] | None:
    """A default-domain op at a model's opset: its schema version, then what C++ needs
    to make its plain heads (digest.plain_head_parts: prefix, attribute defaults), from
    one schema lookup (asking for the version, then for the defaults at that version,
    looked the same schema up twice). None: onnx knows no such op."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    version = int(schema.since_version)
    return version, _head_prefix("", op_type, version), schema_defaults_of(schema)


def _since_version(op_type: str, opset: int) -> int | None:
    info = _op_schema(op_type, opset)
    return None if info is None else info[0]


@functools.lru_cache(maxsize=1024)
def _since_versions(op_types: tuple[str, ...], opset: int) -> tuple[int, ...] | None:
    """Each op's schema version, or None if one is unknown: one lookup per model for
    models that share their op list (in first-use order), as copies of a model do."""
    versions = tuple(_since_version(op, opset) for op in op_types)
    return None if None in versions else versions  # type: ignore[return-value]


class _FullModel:
    """The full loader's Model of a model the fast path analysed, built once on demand.

    ``source`` is the file's path or the in-memory ModelProto. The full model's digests
    must equal the fast path's: a mismatch means the file changed in between (or a bug),
    and is an error rather than two inconsistent views of one model.
    """

    def __init__(self, source: Path | onnx.ModelProto, label: str, name: str, digests: np.ndarray) -> None:
        self.source, self.label, self.name, self.digests = source, label, name, digests
        self._model: Model | None = None

    def get(self) -> Model:
        if self._model is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DlbricksWarning)  # given once, by the fast path
                if isinstance(self.source, onnx.ModelProto):
                    model = _load_proto(self.source, self.label, None, self.name, None, {})
                else:
                    model = _load_file(self.source, self.label, self.name, None)
            if not np.array_equal(model.digests, self.digests):
                what = "ModelProto" if isinstance(self.source, onnx.ModelProto) else "file"
                raise ModelError(
                    f"{self.label}: the model's layers no longer match its analysis "
                    f"(was the {what} changed since it was loaded?)"
                )
            self._model = model
        return self._model

    def layers(self) -> list[Layer]:
        return list(self.get().layers)

    def constant_types(self) -> dict[str, TensorType]:
        return dict(self.get().constant_types)

    def constant_value(self, name: str) -> np.ndarray:
        return self.get().constant_value(name)

    def __getstate__(self) -> dict:
        return {"source": self.source, "label": self.label, "name": self.name, "digests": self.digests, "_model": None}


def _split_names(blob: bytes, ends: np.ndarray) -> list[str]:
    out, start = [], 0
    for end in ends.tolist():
        out.append(blob[start:end].decode("utf-8", errors="replace"))
        start = end
    return out


def _load_fast_proto(proto: onnx.ModelProto, label: str, name: str) -> Model | None:
    """The fast path on an in-memory model: serializing it (in C) is cheaper than
    reading its fields from Python."""
    if _c_shape_inference is None:
        return None
    try:
        data = proto.SerializeToString()
    except Exception:  # noqa: BLE001 - e.g. over protobuf's 2 GB limit
        return None
    try:
        return _fast_model(data, proto, label, name)
    except Exception:  # noqa: BLE001 - malformed: the full loader says why
        return None


def _load_fast(path: Path, label: str, name: str) -> Model | None:
    """The fast path's Model, or None when the full loader must run."""
    if _c_shape_inference is None:
        return None
    buf = _open_bytes(path)
    if buf is None:
        return None
    try:
        return _fast_model(buf, path, label, name)
    except Exception:  # noqa: BLE001 - unreadable or malformed: the full loader says why
        return None
    finally:
        _release(buf)


def _release(buf: bytes | mmap.mmap) -> None:
    """Unmaps what :func:`_open_bytes` mapped (bytes need nothing; unmapping twice is fine)."""
    if isinstance(buf, mmap.mmap):
        buf.close()


def _open_bytes(path: Path) -> bytes | mmap.mmap | None:
    """A model file's bytes (memory-mapped when big: weight pages are then never read),
    or None when the full loader must run (it says why)."""
    try:
        # os-level calls: for a small file, Python's buffered open() costs more than the read.
        fd = os.open(path, os.O_RDONLY)
    except (OSError, ValueError):
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return None
        if st.st_size < _MMAP_MIN_BYTES:
            data = os.read(fd, st.st_size)
            return data if len(data) == st.st_size else None
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)  # keeps its own descriptor
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _fast_model(
    buf: bytes | mmap.mmap, source: Path | onnx.ModelProto, label: str, name: str, stacklevel: int = 5
) -> Model | None:
    """The fast path's steps on one model (see :func:`iter_load` for many)."""
    prepared = _fast_prepare(_core.OnnxScan(buf), buf, source, label, name)
    if prepared is None:
        return None
    inferred = _infer_light(prepared)
    if inferred is None:
        return None
    res = _finish(prepared, inferred)
    return None if res is None else _build_model(prepared, res, stacklevel)


@dataclass(slots=True)
class _Prepared:
    """A model between the fast path's phases: scanned, heads resolved, light model
    written (``light``, dropped once inferred)."""

    buf: bytes | mmap.mmap
    source: Path | onnx.ModelProto
    label: str
    name: str
    scan: _core.OnnxScan
    opsets: dict[str, int]
    op_names: list[str]
    act_inputs: list[tuple[str, int, tuple[int, ...]]]
    shapes: list[list[int]]
    dim_subst: dict[str, int]
    notes: list[str]
    light: bytes | None


def _fast_prepare(
    scan: _core.OnnxScan, buf: bytes | mmap.mmap, source: Path | onnx.ModelProto, label: str, name: str
) -> _Prepared | None:
    """After the scan of ``buf``: resolve op versions, input shapes and heads, write the
    light model. None: the full loader must run."""
    if scan.fallback:
        return None
    opsets: dict[str, int] = {}
    for domain, version in scan.opsets:
        opsets[_norm_domain(domain)] = int(version)
    default_opset = opsets.get("")
    if default_opset is None:
        return None
    op_names = [op for _, op in scan.op_keys]  # every op is in the default domain on this path
    versions = _since_versions(tuple(op_names), default_opset)
    if versions is None:
        return None

    # Activation inputs: the scanner accepted static shapes and a symbolic leading dim.
    act_inputs: list[tuple[str, int, tuple[int, ...]]] = []
    dim_subst: dict[str, int] = {}
    notes: list[str] = []
    for in_name, elem, dims in scan.inputs:
        shape = []
        for kind, value, param in dims:
            if kind == 1 and value >= 0:
                shape.append(int(value))
                continue
            what = f"'{param}'" if kind == 2 else "unknown"
            notes.append(
                f"{label}: input '{in_name}' has a symbolic batch dim ({what}); using 1 "
                f"(pass --input-shape {in_name}=... to choose)"
            )
            if param:
                dim_subst.setdefault(param, 1)
            shape.append(1)
        if _numel(shape) > MAX_ELEMENTS:
            return None
        act_inputs.append((in_name, int(elem), tuple(shape)))
    shapes = [list(s) for _, _, s in act_inputs]

    # Canonical heads come from the process's table; only new ones are made here: those
    # with plain attributes in C++, in one call (a first analysis makes every head: one
    # call per head through make_head_from_fields cost ~8 us each), the rest in Python.
    pending = scan.resolve_heads(buf, _FAST_HEADS, versions)
    if pending:
        prefixes = [b""] * len(op_names)
        defaults: list[dict[str, bytes] | None] = [None] * len(op_names)
        for _, k, _ in pending:
            if not prefixes[k]:
                _, prefixes[k], defaults[k] = _op_schema(op_names[k], default_opset)  # type: ignore[misc]
        left = scan.set_plain_heads(buf, [h for h, _, _ in pending], prefixes, defaults, _FAST_HEADS)
        if left:
            attributes_of = {h: (k, attr_bytes) for h, k, attr_bytes in pending}
            for h in left:
                k, attr_bytes = attributes_of[h]
                # The attribute fields alone parse as a NodeProto with just those attributes.
                attrs = onnx.NodeProto.FromString(attr_bytes).attribute if attr_bytes else ()
                head, outer = make_head("", op_names[k], attrs, versions[k])
                if outer:
                    return None
                scan.set_head(h, head, _FAST_HEADS)
    return _Prepared(buf, source, label, name, scan, opsets, op_names, act_inputs, shapes, dim_subst, notes,
                     scan.light_model(buf, shapes))


def _infer_light(prepared: _Prepared) -> bytes | None:
    """onnx's shape inference on the light model (None: the full loader reports
    inference errors)."""
    light, prepared.light = prepared.light, None
    try:
        return _c_shape_inference.infer_shapes(light, False, False, True)
    except Exception:  # noqa: BLE001
        return None


def _finish(p: _Prepared, inferred: bytes) -> dict | None:
    """Fold and hash (the scan's finish); None: the full loader must run."""
    res = p.scan.finish(p.buf, inferred, p.shapes, p.dim_subst)
    return None if res["fallback"] else res


def _build_model(p: _Prepared, res: dict, stacklevel: int) -> Model:
    """The Model of a finished scan. ``stacklevel`` points warnings at the caller of the
    public function."""
    scan = p.scan
    source = p.source
    digests = res["digests"]
    # Absolute: the layers may be built after the caller has changed directory.
    full = _FullModel(source if isinstance(source, onnx.ModelProto) else source.absolute(), p.label, p.name, digests)
    tts: dict[tuple[int, tuple[int, ...]], TensorType] = {}
    for n_, e, s in p.act_inputs:
        tts.setdefault((e, s), TensorType(e, s))
    outputs = []
    for out_name, (e, s) in zip(scan.output_names, res["output_types"]):
        outputs.append((out_name, tts.setdefault((e, s), TensorType(e, s))))
    for note in p.notes:
        warnings.warn(note, DlbricksWarning, stacklevel=stacklevel)
    names = functools.partial(_split_names, res["layer_names"], res["layer_name_ends"])
    return Model(
        name=p.name,
        path=None if isinstance(source, onnx.ModelProto) else os.fspath(source),
        ir_version=int(scan.ir_version),
        opset_imports=p.opsets,
        layers=LazyLayers(p.op_names, res["layer_op_keys"], full.layers, names),  # type: ignore[arg-type]
        inputs=[(n_, tts[(e, s)]) for n_, e, s in p.act_inputs],
        outputs=outputs,
        edge_src=res["edge_src"],
        edge_src_slot=res["edge_src_slot"],
        edge_dst=res["edge_dst"],
        edge_dst_slot=res["edge_dst_slot"],
        digests=digests,
        constant_types=LazyMapping(full.constant_types),
        _materialize=full.constant_value,
    )


def _read_proto(path: Path, label: str) -> tuple[onnx.ModelProto, dict[str, tuple[int, int]]]:
    """The model, and where the data of initializers left out of it lie in the file."""
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
        raise ModelError(_oneline(f"{label}: cannot read the file ({exc.strerror or exc})")) from None
    except Exception as exc:  # DecodeError and friends: every parse failure means the same
        raise ModelError(_oneline(f"{label}: not an ONNX model ({type(exc).__name__}: {exc})")) from None


# -- reading big files without their weights -------------------------------------------
#
# Parsing a protobuf copies every bytes field, so onnx.load on a model with 500 MB of
# weights costs a second or more. For big files we walk the wire format instead (the
# file is memory-mapped; weight pages are never touched) and parse a copy of the model
# in which every large initializer keeps its name, dims and type but not its data. Its
# span in the file is remembered so that Model.constant_value can parse it on demand.

_GRAPH_FIELD = 7  # ModelProto.graph
_INITIALIZER_FIELD = 5  # GraphProto.initializer
# TensorProto fields holding element data (float_data, int32_data, string_data,
# int64_data, raw_data, double_data, uint64_data); every other field stays in the stub.
_TENSOR_DATA_FIELDS = frozenset({4, 5, 6, 7, 9, 10, 11})
_TENSOR_DIMS, _TENSOR_DATA_TYPE = 1, 2


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
    if _numel(dims) * _itemsize(data_type) <= _INLINE_BYTES:
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
                if gfield == _INITIALIZER_FIELD and gwire == 2 and gfe - gvs > _INLINE_BYTES:
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


def _subgraphs(a: AttributeProto) -> list[onnx.GraphProto]:
    if a.type == AttributeProto.GRAPH or a.HasField("g"):
        return [a.g]
    return list(a.graphs)


def _free_names(g: onnx.GraphProto) -> list[str]:
    """Names a subgraph reads from enclosing scopes, in order of first use."""
    bound = {vi.name for vi in g.input}
    bound.update(t.name for t in g.initializer)
    bound.update(sp.values.name for sp in g.sparse_initializer)
    for node in g.node:
        bound.update(o for o in node.output if o)
    free: dict[str, None] = {}
    for node in g.node:
        for t in node.input:
            if t and t not in bound:
                free[t] = None
        for a in node.attribute:
            for sub in _subgraphs(a):
                for t in _free_names(sub):
                    if t not in bound:
                        free[t] = None
    for vi in g.output:
        if vi.name not in bound:
            free[vi.name] = None
    return list(free)


@functools.lru_cache(maxsize=None)
def _itemsize(elem_type: int) -> int:
    try:
        return int(onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize) or 1
    except Exception:
        return 8


def _numel(dims: Iterable[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _constant_node_type(node: onnx.NodeProto) -> tuple[int, tuple[int, ...]] | None:
    """The type of a ``Constant`` node's output, read from its attribute (no data copied)."""
    for a in node.attribute:
        if a.name == "value":
            return a.t.data_type, tuple(a.t.dims)
        if a.name == "sparse_value":
            return a.sparse_tensor.values.data_type, tuple(a.sparse_tensor.dims)
        if a.name == "value_float":
            return TensorProto.FLOAT, ()
        if a.name == "value_floats":
            return TensorProto.FLOAT, (len(a.floats),)
        if a.name == "value_int":
            return TensorProto.INT64, ()
        if a.name == "value_ints":
            return TensorProto.INT64, (len(a.ints),)
        if a.name == "value_string":
            return TensorProto.STRING, ()
        if a.name == "value_strings":
            return TensorProto.STRING, (len(a.strings),)
    return None


def _np_to_elem_type(arr: np.ndarray) -> int:
    if arr.dtype.kind in ("O", "U", "S"):
        return TensorProto.STRING
    return int(onnx.helper.np_dtype_to_tensor_dtype(arr.dtype))


class _Constants:
    """Computes values of folded constants by evaluating just their constant subgraph.

    Used during analysis for params (small values) and afterwards by
    :meth:`Model.constant_value` for any constant. Holds the original proto; large
    values are not cached.
    """

    def __init__(
        self,
        proto: onnx.ModelProto,
        label: str,
        path: Path | None,
        spans: Mapping[str, tuple[int, int]],
        producer: Mapping[str, tuple[int, int]],
        order: Sequence[int],
    ) -> None:
        g = proto.graph
        self.proto = proto
        self.label = label
        self.path = path
        self.base_dir = path.parent if path is not None else None
        # Initializers whose data _scan_model left in the model file: name -> span.
        self.spans = spans
        self.nodes = list(g.node)
        self.producer = producer
        self.order = order
        self.init = {t.name: t for t in g.initializer}
        self.sparse = {sp.values.name: sp for sp in g.sparse_initializer}
        # Outputs of Shape/Size nodes folded from their input's type.
        self.type_folded: dict[str, np.ndarray] = {}
        self.cache: dict[str, np.ndarray] = {}

    def _keep(self, name: str, arr: np.ndarray) -> None:
        if arr.nbytes <= _CACHE_BYTES:
            self.cache[name] = arr

    def value(self, name: str) -> np.ndarray:
        return self.values([name])[name]

    def values(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """Values of several constants, evaluating their shared ancestors once."""
        targets = list(dict.fromkeys(names))
        known: dict[str, np.ndarray] = {}
        todo: set[int] = set()
        stack = list(targets)
        seen: set[str] = set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in self.cache:
                known[n] = self.cache[n]
            elif n in self.type_folded:
                known[n] = self.type_folded[n]
            elif n in self.init:
                known[n] = self._read_initializer(self.init[n])
                self._keep(n, known[n])
            elif n in self.sparse:
                known[n] = self._read_sparse(self.sparse[n])
                self._keep(n, known[n])
            elif n in self.producer:
                i = self.producer[n][0]
                if i not in todo:
                    todo.add(i)
                    stack.extend(t for t in self.nodes[i].input if t)
            else:
                raise ModelError(f"{self.label}: {n!r} is not a constant")
        if todo:
            known.update(self._evaluate([i for i in self.order if i in todo], targets, known))
        return {n: known[n] for n in targets}

    def _evaluate(
        self, node_ids: list[int], targets: list[str], feeds: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        from onnx.reference import ReferenceEvaluator  # lazy: costs ~50 ms to import

        nodes = [self.nodes[i] for i in node_ids]
        produced = {o for node in nodes for o in node.output if o}
        wanted = [t for t in targets if t in produced]
        used = {t for node in nodes for t in node.input if t}
        feeds = {k: v for k, v in feeds.items() if k in used}
        graph = onnx.helper.make_graph(
            nodes,
            "constants",
            [onnx.ValueInfoProto(name=k) for k in feeds],
            [onnx.ValueInfoProto(name=t) for t in wanted],
        )
        model = onnx.helper.make_model(
            graph, opset_imports=list(self.proto.opset_import), ir_version=self.proto.ir_version
        )
        try:
            results = ReferenceEvaluator(model).run(wanted, feeds)
        except Exception as exc:
            raise ModelError(
                _oneline(f"{self.label}: cannot compute constant {wanted[0]!r}: {type(exc).__name__}: {exc}")
            ) from None
        out = {}
        for t, v in zip(wanted, results):
            arr = np.asarray(v)
            out[t] = arr
            self._keep(t, arr)
        return out

    def _read_initializer(self, t: TensorProto) -> np.ndarray:
        span = self.spans.get(t.name)
        if span is not None:
            return self._read_span(t.name, span)
        if t.data_location != TensorProto.EXTERNAL:
            return onnx.numpy_helper.to_array(t)
        info = {e.key: e.value for e in t.external_data}
        location = info.get("location", "")
        if self.base_dir is None:
            raise ModelError(
                f"{self.label}: tensor {t.name!r} has external data ({location!r}), "
                "but the model was not loaded from a file"
            )
        base = self.base_dir.resolve()
        file = (base / location).resolve()
        # The location comes from the file: never read outside the model's folder.
        if not location or Path(location).is_absolute() or not file.is_relative_to(base):
            raise ModelError(f"{self.label}: tensor {t.name!r} has an invalid external data location {location!r}")
        offset = int(info.get("offset", 0) or 0)
        length = int(info["length"]) if info.get("length") else -1
        try:
            with open(file, "rb") as f:
                f.seek(offset)
                data = f.read(length)
        except FileNotFoundError:
            raise ModelError(
                f"{self.label}: external data file {location!r} for tensor {t.name!r} not found"
            ) from None
        except OSError as exc:
            raise ModelError(
                _oneline(f"{self.label}: cannot read external data file {location!r}: {exc.strerror or exc}")
            ) from None
        expected = _numel(t.dims) * _itemsize(t.data_type)
        if (length >= 0 and len(data) < length) or (t.data_type != TensorProto.STRING and len(data) < expected):
            raise ModelError(
                f"{self.label}: external data file {location!r} is truncated "
                f"(tensor {t.name!r} needs {expected} bytes at offset {offset}, got {len(data)})"
            )
        local = TensorProto()
        local.data_type = t.data_type
        local.dims.extend(t.dims)
        local.raw_data = data
        return onnx.numpy_helper.to_array(local)

    def _read_span(self, name: str, span: tuple[int, int]) -> np.ndarray:
        assert self.path is not None  # spans come only from files
        start, end = span
        try:
            with open(self.path, "rb") as f:
                f.seek(start)
                data = f.read(end - start)
            full = onnx.TensorProto.FromString(data)
        except OSError as exc:
            raise ModelError(_oneline(f"{self.label}: cannot read tensor {name!r}: {exc.strerror or exc}")) from None
        except Exception:  # noqa: BLE001 - a parse error: the file changed since loading
            full = None
        if full is None or full.name != name:
            raise ModelError(f"{self.label}: cannot read tensor {name!r}: the file changed since it was loaded")
        return onnx.numpy_helper.to_array(full)

    def _read_sparse(self, sp: onnx.SparseTensorProto) -> np.ndarray:
        values = self._read_initializer(sp.values)
        indices = self._read_initializer(sp.indices).astype(np.int64)
        dense = np.zeros(tuple(sp.dims), dtype=values.dtype)
        if indices.ndim == 1:  # linearised indices
            dense.reshape(-1)[indices] = values
        else:
            dense[tuple(indices.T)] = values
        return dense


class _Loader:
    """One model's analysis; :meth:`run` returns the Model."""

    def __init__(
        self,
        proto: onnx.ModelProto,
        label: str,
        path: Path | None,
        name: str,
        input_shapes: Mapping[str, Sequence[int]] | None,
        spans: Mapping[str, tuple[int, int]],
    ) -> None:
        g = proto.graph
        self.spans = spans
        self.proto = proto
        self.g = g
        self.label = label
        self.path = path
        self.name = name
        self.input_shapes = dict(input_shapes or {})
        self.opsets: dict[str, int] = {}
        for o in proto.opset_import:
            self.opsets[_norm_domain(o.domain)] = int(o.version)
        self.functions = {(_norm_domain(f.domain), f.name) for f in proto.functions}
        self.nodes = list(g.node)
        # Protobuf field access is slow; read each node's fields once (slicing a
        # repeated field copies it in C, about twice as fast as iterating it).
        self.ins = [tuple(n.input[:]) for n in self.nodes]
        self.outs = [tuple(n.output[:]) for n in self.nodes]
        self.ops = [n.op_type for n in self.nodes]
        self.doms = ["" if d == "ai.onnx" else d for d in [n.domain for n in self.nodes]]  # _norm_domain, inlined
        self.init = {t.name: t for t in g.initializer}
        self.sparse = {sp.values.name: sp for sp in g.sparse_initializer}
        self.input_names = [vi.name for vi in g.input]
        self.const_inputs = set(self.init) | set(self.sparse)
        self.constant_node_types: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.dim_subst: dict[str, int] = {}
        self._memo: dict[str, TensorType | None] = {}
        self._init_types: dict[str, TensorType] | None = None
        # One TensorType per distinct type: a lookup costs less than building one.
        self._tts: dict[tuple[int, tuple[int, ...]], TensorType] = {}
        # Serialized TypeProto -> (non-tensor kind, tensor type): models repeat few types.
        self._parsed_types: dict[bytes, tuple[str | None, _RawType | None, TensorType | None]] = {}

    # -- helpers --------------------------------------------------------------------

    def _err(self, msg: str) -> ModelError:
        return ModelError(_oneline(f"{self.label}: {msg}"))

    def _desc(self, i: int) -> str:
        node = self.nodes[i]
        return f"'{node.name}' ({node.op_type})" if node.name else f"#{i} ({node.op_type})"

    def _deps(self, i: int) -> tuple[str, ...]:
        """Every tensor node ``i`` reads: explicit inputs and subgraph outer references."""
        return self.ins[i] + self.implicit[i] if self.implicit[i] else self.ins[i]

    # -- structure ------------------------------------------------------------------

    def _check_structure(self) -> None:
        """Ops, single definitions, no undefined reads; fills producer/implicit/opaque."""
        defined = set(self.const_inputs) | set(self.input_names)
        self.producer: dict[str, tuple[int, int]] = {}
        for i, outs in enumerate(self.outs):
            for s, o in enumerate(outs):
                if not o:
                    continue
                if o in self.producer or o in defined:
                    raise self._err(f"tensor '{o}' is defined twice (again by node {self._desc(i)})")
                self.producer[o] = (i, s)
        n = len(self.nodes)
        self.implicit: list[tuple[str, ...]] = [()] * n
        self.opaque = [False] * n
        self.op_version = [0] * n
        self.opaque_outputs: set[str] = set()
        self.loops: list[int] = []
        schemas: dict[tuple[str, int], int | None] = {}
        # (domain, op) -> (opaque, op_version) as _check_op found them for a node
        # without subgraphs: the outcome depends on nothing else.
        checked_ops: dict[tuple[str, str], tuple[bool, int]] = {}
        producer, ops, doms, all_outs = self.producer, self.ops, self.doms, self.outs
        graph_types = _GRAPH_ATTR_TYPES
        for i, node in enumerate(self.nodes):
            has_graph = False
            free: dict[str, None] = {}
            for a in node.attribute:
                typ = a.type
                if typ in graph_types or (typ == AttributeProto.UNDEFINED and (a.HasField("g") or a.graphs)):
                    has_graph = True
                    for sub in _subgraphs(a):
                        for t in _free_names(sub):
                            free[t] = None
            op_type, domain, outs = ops[i], doms[i], all_outs[i]
            key = (domain, op_type)
            known = None if has_graph or op_type == "Loop" else checked_ops.get(key)
            if known is None:
                self._check_op(i, has_graph, schemas)
                if not has_graph and op_type != "Loop":
                    checked_ops[key] = (self.opaque[i], self.op_version[i])
            else:
                self.op_version[i] = known[1]
                if known[0]:
                    self.opaque[i] = True
                    self.opaque_outputs.update(o for o in outs if o)
            if free:
                self.implicit[i] = tuple(free)
                deps = self.ins[i] + self.implicit[i]
            else:
                deps = self.ins[i]
            for t in deps:
                if t and t not in producer and t not in defined:
                    raise self._err(f"node {self._desc(i)} reads undefined tensor '{t}'")
            if op_type == "Constant" and domain == "" and outs and outs[0]:
                ct = _constant_node_type(node)
                if ct is not None:
                    self.constant_node_types[outs[0]] = ct
        for vi in self.g.output:
            if vi.name not in self.producer and vi.name not in defined:
                raise self._err(f"graph output '{vi.name}' is not produced by any node")

    def _check_op(self, i: int, has_graph: bool, schemas: dict[tuple[str, int], int | None]) -> None:
        op_type = self.ops[i]
        domain = self.doms[i]
        if (domain, op_type) in self.functions:
            self.opaque[i] = True
            self.op_version[i] = self.opsets.get(domain, 0)
            self.opaque_outputs.update(o for o in self.outs[i] if o)
            return
        if domain != "":
            if domain not in self.opsets:
                raise self._err(f"node {self._desc(i)} uses domain '{domain}', which the model does not import")
            # Ops of other domains (com.microsoft, ai.onnx.ml...) are opaque layers.
            self.opaque[i] = True
            self.op_version[i] = self.opsets[domain]
            self.opaque_outputs.update(o for o in self.outs[i] if o)
            return
        version = self.opsets.get("")
        if version is None:
            raise self._err(f"node {self._desc(i)} is in the default ONNX domain, which the model does not import")
        key = (op_type, version)
        if key not in schemas:  # get_schema costs ~25 us; models repeat few ops
            try:
                schemas[key] = int(onnx.defs.get_schema(op_type, version, "").since_version)
            except onnx.defs.SchemaError:
                schemas[key] = None
        since = schemas[key]
        if since is None:
            raise self._err(
                f"node {self._desc(i)} has unknown op '{op_type}' (not in the ONNX schema at opset {version})"
            )
        self.op_version[i] = since
        self.opaque[i] = has_graph or op_type in _CONTROL_FLOW
        if op_type == "Loop":
            self.loops.append(i)
        if self.opaque[i]:
            self.opaque_outputs.update(o for o in self.outs[i] if o)

    def _topo_order(self) -> list[int]:
        """A topological order; the original order when it already is one."""
        n = len(self.nodes)
        producer = self.producer
        # Files are nearly always in order already: check that first, without building lists.
        in_order = True
        for i in range(n):
            for t in self._deps(i):
                p = producer.get(t)
                if p is not None and p[0] >= i:
                    in_order = False
                    break
            if not in_order:
                break
        if in_order:
            return list(range(n))
        deps = [[producer[t][0] for t in self._deps(i) if t in producer] for i in range(n)]
        indeg = [0] * n
        users: list[list[int]] = [[] for _ in range(n)]
        for i, ds in enumerate(deps):
            for d in ds:
                indeg[i] += 1
                users[d].append(i)
        # Lowest original index first: deterministic and as close to the file as possible.
        ready = [i for i in range(n) if indeg[i] == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for u in users[i]:
                indeg[u] -= 1
                if indeg[u] == 0:
                    heapq.heappush(ready, u)
        if len(order) < n:
            # Walk back through unsorted producers until a node repeats: it is on a cycle
            # (the first unsorted node may merely sit downstream of one).
            i = min(i for i in range(n) if indeg[i] > 0)
            seen: set[int] = set()
            while i not in seen:
                seen.add(i)
                i = next(d for d in deps[i] if indeg[d] > 0)
            raise self._err(f"the graph has a cycle through node {self._desc(i)}")
        return order

    # -- input shapes ---------------------------------------------------------------

    def _resolve_inputs(self) -> None:
        """Concrete shapes for activation graph inputs (overrides, batch default)."""
        self.act_inputs: list[tuple[str, int, tuple[int, ...]]] = []
        act = [vi for vi in self.g.input if vi.name not in self.const_inputs]
        act_names = {vi.name for vi in act}
        for key in self.input_shapes:
            if key not in act_names:
                listed = ", ".join(sorted(act_names)) or "none"
                raise self._err(f"input_shapes names '{key}', which is not an input of the model (inputs: {listed})")
        for vi in act:
            kind = vi.type.WhichOneof("value")
            if kind != "tensor_type":
                raise self._err(f"input '{vi.name}' has a non-tensor type ({kind}); dlbricks handles tensors only")
            tt = vi.type.tensor_type
            if tt.elem_type == TensorProto.UNDEFINED:
                raise self._err(f"input '{vi.name}' has no element type")
            declared = list(tt.shape.dim) if tt.HasField("shape") else None
            if vi.name in self.input_shapes:
                shape = self._override_shape(vi.name, declared)
            else:
                shape = self._declared_shape(vi.name, declared)
            self._check_numel(vi.name, shape)
            self.act_inputs.append((vi.name, tt.elem_type, shape))

    def _override_shape(self, name: str, declared: list | None) -> tuple[int, ...]:
        raw = self.input_shapes[name]
        try:
            shape = tuple(int(d) for d in raw)
        except (TypeError, ValueError):
            raise self._err(f"input_shapes[{name!r}] = {raw!r} is not a sequence of integers") from None
        if any(d < 0 for d in shape):
            raise self._err(f"input_shapes[{name!r}] = {shape} has a negative dim")
        if declared is not None and len(declared) != len(shape):
            raise self._err(
                f"input_shapes gives {len(shape)} dims for input '{name}', which has rank {len(declared)}"
            )
        if declared is not None:
            for d, v in zip(declared, shape):
                if d.WhichOneof("value") == "dim_param":
                    self.dim_subst.setdefault(d.dim_param, v)
        return shape

    def _declared_shape(self, name: str, declared: list | None) -> tuple[int, ...]:
        if declared is None:
            raise self._err(
                f"cannot resolve the shape of tensor '{name}' (no shape declared); pass --input-shape {name}=..."
            )
        shape: list[int | None] = []
        for i, d in enumerate(declared):
            which = d.WhichOneof("value")
            if which == "dim_value" and d.dim_value >= 0:
                shape.append(int(d.dim_value))
                continue
            if i > 0:
                what = f"'{d.dim_param}'" if which == "dim_param" else "unknown"
                raise self._err(
                    f"cannot resolve the shape of tensor '{name}' (dim {i} is {what}); pass --input-shape {name}=..."
                )
            shape.append(None)
        if shape and shape[0] is None:
            # A symbolic leading dim is almost always the batch size.
            d = declared[0]
            what = f"'{d.dim_param}'" if d.WhichOneof("value") == "dim_param" else "unknown"
            warnings.warn(
                f"{self.label}: input '{name}' has a symbolic batch dim ({what}); using 1 "
                f"(pass --input-shape {name}=... to choose)",
                DlbricksWarning,
                stacklevel=5,
            )
            if d.dim_param:
                self.dim_subst.setdefault(d.dim_param, 1)
            shape[0] = 1
        return tuple(shape)  # type: ignore[arg-type]

    def _check_numel(self, name: str, shape: tuple[int, ...]) -> None:
        n = _numel(shape)
        if n > MAX_ELEMENTS:
            raise self._err(f"tensor '{name}' has {n} elements (shape {list(shape)}), over the 2**40 limit")

    # -- shape inference ------------------------------------------------------------

    def _light_model(self, order: list[int], injected: Mapping[str, np.ndarray]) -> onnx.ModelProto:
        """A copy for shape inference that carries no large tensor data."""
        mk = onnx.helper.make_tensor_value_info
        light = onnx.ModelProto()
        # IR 4 lets initializers be constants without also being graph inputs, which
        # spares a value_info per initializer (IR 3 models list every weight as input).
        light.ir_version = max(int(self.proto.ir_version), 4)
        light.opset_import.extend(self.proto.opset_import)
        if len(self.proto.functions):
            light.functions.extend(self.proto.functions)
        lg = light.graph
        lg.name = self.g.name
        for name, elem, shape in self.act_inputs:
            lg.input.append(mk(name, elem, shape))
        for t in self.g.initializer:
            dims = tuple(t.dims[:])
            small = (
                t.data_location != TensorProto.EXTERNAL
                and t.name not in self.spans
                and _numel(dims) * _itemsize(t.data_type) <= _INLINE_BYTES
            )
            if small:
                lg.initializer.append(t)
            else:
                lg.input.append(mk(t.name, t.data_type, dims))
        for sp in self.g.sparse_initializer:
            lg.input.append(mk(sp.values.name, sp.values.data_type, list(sp.dims)))
        skip: set[int] = set()
        for name in injected:
            i = self.producer[name][0]
            if all(o in injected for o in self.outs[i] if o):
                skip.add(i)
        for name, arr in injected.items():
            if self.producer[name][0] in skip:
                lg.initializer.append(onnx.numpy_helper.from_array(arr, name))
        opaque_out = self.opaque_outputs
        kept: list[onnx.NodeProto] = []
        nodes, ops, all_outs, const_types = self.nodes, self.ops, self.outs, self.constant_node_types
        for i in order:
            if i in skip:
                continue
            outs = all_outs[i]
            ct = const_types.get(outs[0]) if ops[i] == "Constant" and outs else None
            if ct is not None and _numel(ct[1]) * _itemsize(ct[0]) > _INLINE_BYTES:
                lg.input.append(mk(outs[0], ct[0], list(ct[1])))
                continue
            kept.append(nodes[i])
        if len(kept) == len(nodes) and order == list(range(len(nodes))):
            lg.node.extend(self.g.node)  # the common case; copies in C, ~2x faster than a list
        else:
            lg.node.extend(kept)
        # Declared shapes of outputs computed by standard ops are dropped: they may
        # contradict overridden input shapes and inference recomputes them anyway.
        # Opaque ops keep theirs, as inference may know nothing else about them.
        for vi in self.g.output:
            if vi.name in opaque_out:
                lg.output.append(vi)
            else:
                lg.output.add().name = vi.name
        annotated = set()
        for vi in self.g.value_info:
            if vi.name in opaque_out:
                lg.value_info.append(vi)
                annotated.add(vi.name)
        # Seed Loop outputs with their body's declared types so that inference carries
        # shapes past the loop (see _loop_output_types).
        for name, typ in self._loop_output_types():
            if name not in annotated:
                v = lg.value_info.add()
                v.name = name
                v.type.CopyFrom(typ)
        return light

    def _loop_output_types(self) -> list[tuple[str, onnx.TypeProto]]:
        """Loop-carried outputs with the types the loop body declares for them.

        onnx infers no shape for them (they could change from one iteration to the
        next); the body's declared outputs give one.
        """
        out = []
        for i in self.loops:
            body = next((a.g for a in self.nodes[i].attribute if a.name == "body"), None)
            if body is not None:
                for name, vi in zip(self.outs[i], list(body.output)[1:]):
                    if name:
                        out.append((name, vi.type))
        return out

    def _infer(self, order: list[int], injected: Mapping[str, np.ndarray]) -> None:
        light = self._light_model(order, injected)
        try:
            inferred = onnx.shape_inference.infer_shapes(light, check_type=False, strict_mode=False, data_prop=True)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise self._err(f"shape inference failed: {first}") from None
        self._memo.clear()
        # Initializer types never change; seeding them spares a protobuf read per round.
        if self._init_types is None:
            self._init_types = {}
            for name in self.init:
                rt = self._raw_type(name)
                if rt is not None and rt[0] != TensorProto.UNDEFINED:
                    self._init_types[name] = self._tensor_type(int(rt[0]), rt[1])  # type: ignore[arg-type]
        self._memo.update(self._init_types)
        self.types: dict[str, _RawType] = {}
        # The concrete ones among self.types, as TensorTypes.
        self._types_tt: dict[str, TensorType] = {}
        self.nontensor: dict[str, str] = {}
        ig = inferred.graph
        # Declarations for opaque outputs count too: inference may have dropped them.
        declared: list[tuple[str, onnx.TypeProto]] = []
        if self.opaque_outputs:
            for vi in list(self.g.value_info) + list(self.g.output):
                if vi.name in self.opaque_outputs:
                    declared.append((vi.name, vi.type))
            declared.extend(self._loop_output_types())
        parsed_types, types, types_tt = self._parsed_types, self.types, self._types_tt
        for seq in (ig.input, ig.value_info, ig.output):
            for vi in seq:
                # _merge_type inlined for the common case: a name seen once, a known type.
                name = vi.name
                parsed = parsed_types.get(vi.type.SerializeToString())
                if parsed is None or parsed[1] is None or name in types:
                    self._merge_type(name, vi.type)
                else:
                    types[name] = parsed[1]
                    if parsed[2] is not None:
                        types_tt[name] = parsed[2]
        for name, typ in declared:
            self._merge_type(name, typ)

    def _merge_type(self, name: str, typ: onnx.TypeProto) -> None:
        """Record ``typ`` for ``name`` unless a more complete type is known already."""
        key = typ.SerializeToString()
        parsed = self._parsed_types.get(key)
        if parsed is None:
            # dim_subst is fixed before the first inference, so parsing depends on the bytes only.
            parsed = self._parsed_types[key] = self._parse_type(typ)
        kind, new, concrete = parsed
        if new is None:
            if kind:
                self.nontensor[name] = kind
            return
        old = self.types.get(name)
        if old is None or _completeness(new) > _completeness(old):
            self.types[name] = new
            if concrete is not None:
                self._types_tt[name] = concrete
            else:
                self._types_tt.pop(name, None)

    def _parse_type(self, typ: onnx.TypeProto) -> tuple[str | None, _RawType | None, TensorType | None]:
        """(non-tensor kind, None, None) or (None, tensor type, its TensorType when concrete)."""
        if not typ.HasField("tensor_type"):
            kind = typ.WhichOneof("value")
            return (kind.replace("_type", "") if kind else None), None, None
        tt = typ.tensor_type
        dims: _Dims | None = None
        if tt.HasField("shape"):
            subst = self.dim_subst
            ds: list[int | str | None] = []
            for d in tt.shape.dim:
                v = d.dim_value
                if v > 0:
                    ds.append(v)
                elif d.dim_param:
                    ds.append(subst.get(d.dim_param, d.dim_param))
                elif v == 0 and d.HasField("dim_value"):
                    ds.append(0)
                else:  # unset, or negative (some exporters' "unknown")
                    ds.append(None)
            dims = tuple(ds)
        raw = (tt.elem_type, dims)
        return None, raw, self._as_tensor_type(raw)

    # -- constants ------------------------------------------------------------------

    def _raw_type(self, name: str) -> _RawType | None:
        """Best known type of a tensor (constants from their definitions first)."""
        t = self.init.get(name)
        if t is not None:
            return t.data_type, tuple(t.dims[:])  # dims are ints already
        sp = self.sparse.get(name)
        if sp is not None:
            return sp.values.data_type, tuple(int(d) for d in sp.dims)
        ct = self.constant_node_types.get(name)
        if ct is not None:
            return ct
        v = self.store.cache.get(name)
        if v is None:
            v = self.store.type_folded.get(name)
        if v is not None:
            return _np_to_elem_type(v), tuple(v.shape)
        return self.types.get(name)

    def _tensor_type(self, elem_type: int, shape: tuple[int, ...]) -> TensorType:
        key = (elem_type, shape)
        t = self._tts.get(key)
        if t is None:
            t = self._tts[key] = TensorType(elem_type, shape)
        return t

    def _concrete(self, name: str) -> TensorType | None:
        t = self._memo.get(name)
        if t is not None:
            return t
        store = self.store
        if (
            name in self.init
            or name in self.sparse
            or name in self.constant_node_types
            or name in store.cache
            or name in store.type_folded
        ):
            t = self._as_tensor_type(self._raw_type(name))
        else:  # what _raw_type would return: the inferred type, converted once in _infer
            t = self._types_tt.get(name)
        # Only known types are kept: evaluating a constant can turn unknown into known.
        if t is not None:
            self._memo[name] = t
        return t

    def _as_tensor_type(self, rt: _RawType | None) -> TensorType | None:
        if rt is None or rt[0] == TensorProto.UNDEFINED or rt[1] is None:
            return None
        if not all(isinstance(d, int) for d in rt[1]):
            return None
        return self._tensor_type(int(rt[0]), tuple(rt[1]))  # type: ignore[arg-type]

    def _classify(self, order: list[int]) -> None:
        """Which nodes fold to constants; sets ``self.kind`` and ``self.const``."""
        self.const = set(self.const_inputs)
        self.kind = ["layer"] * len(self.nodes)
        self.store.type_folded.clear()
        const, kind = self.const, self.kind
        opaque, all_ins, all_outs, ops, doms = self.opaque, self.ins, self.outs, self.ops, self.doms
        for i in order:
            if opaque[i]:
                continue
            ins, outs = all_ins[i], all_outs[i]
            if ops[i] in _TYPE_FOLDED and doms[i] == "" and ins and ins[0] and outs and outs[0]:
                t = self._concrete(ins[0])
                if t is not None:
                    self.store.type_folded[outs[0]] = _type_folded_value(self.nodes[i], t)
                    kind[i] = "shape"
                    const.add(outs[0])
                    continue
            for t in ins:
                if t and t not in const:
                    break
            else:
                kind[i] = "const"
                const.update(o for o in outs if o)

    def _unresolved_layer_tensor(self) -> bool:
        const, used, concrete, all_ins, all_outs = self.const, self.used, self._concrete, self.ins, self.outs
        for i, kind in enumerate(self.kind):
            if kind != "layer":
                continue
            for t in all_ins[i]:
                if t and t not in const and concrete(t) is None:
                    return True
            for t in all_outs[i]:
                # An unused output may stay untyped (Dropout's mask in old opsets).
                if t and t in used and concrete(t) is None:
                    return True
        return False

    def _injection_candidates(self, injected: Mapping[str, np.ndarray]) -> list[str]:
        """Outputs of folded nodes small enough (or of unknown size) to evaluate."""
        out = []
        for i, kind in enumerate(self.kind):
            if kind not in ("const", "shape") or self.ops[i] == "Constant":
                continue
            names = [o for o in self.outs[i] if o]
            if not names or all(o in injected for o in names):
                continue
            small = True
            for o in names:
                t = self._concrete(o)
                if t is not None and t.numel > _INJECT_MAX_ELEMENTS:
                    small = False
            if small:
                out.extend(names)
        return out

    # -- main -----------------------------------------------------------------------

    def run(self) -> Model:
        if not self.nodes:
            raise self._err("model has no layers (the graph has no nodes)")
        self._check_structure()
        order = self._topo_order()
        self._resolve_inputs()
        self.store = _Constants(self.proto, self.label, self.path, self.spans, self.producer, order)
        self.used: set[str] = {vi.name for vi in self.g.output}
        for ins in self.ins:
            self.used.update(ins)
        for extra in self.implicit:
            self.used.update(extra)

        injected: dict[str, np.ndarray] = {}
        for _ in range(_MAX_INFERENCE_ROUNDS):
            self._infer(order, injected)
            self._classify(order)
            if not self._unresolved_layer_tensor():
                break
            # Shapes computed from constants that data propagation cannot follow:
            # evaluate those constants and let inference see their values.
            cand = self._injection_candidates(injected)
            if not cand:
                break
            try:
                values = self.store.values(cand)
            except ModelError:
                break
            injected.update({k: v for k, v in values.items() if v.dtype.kind not in ("O", "U", "S")})

        return self._build(order)

    def _build(self, order: list[int]) -> Model:
        layer_ids = [i for i in order if self.kind[i] == "layer"]
        if not layer_ids:
            raise self._err("model has no layers (every node folds to a constant)")
        used = self.used
        ops, doms, all_ins, all_outs = self.ops, self.doms, self.ins, self.outs
        roles: dict[tuple[str, int, int, tuple[int, ...]], Literal["weight", "param"]] = {}

        # Constants feeding layers: types, and values for params (one evaluation).
        def role_of(i: int, slot: int, ct: TensorType) -> Literal["weight", "param"]:
            op = ops[i] if doms[i] == "" else ""
            key = (op, slot, ct.elem_type, ct.shape)
            role = roles.get(key)
            if role is None:
                role = roles[key] = constant_role(ct, op, slot)
            return role

        const = self.const
        uses = [(i, slot, t) for i in layer_ids for slot, t in enumerate(all_ins[i]) if t in const]
        need_value = sorted(
            {t for i, slot, t in uses if (ct := self._concrete(t)) is None or role_of(i, slot, ct) == "param"}
        )
        values = self.store.values(need_value) if need_value else {}
        for t in values:  # their types may have been unknown before evaluation
            self._memo.pop(t, None)
        const_types: dict[str, TensorType] = {}
        concrete = self._concrete
        checked: set[tuple[int, ...]] = set()  # shapes already within MAX_ELEMENTS
        for _, _, t in uses:
            if t in const_types:
                continue
            v = values.get(t)
            ct = concrete(t) if v is None else self._tensor_type(_np_to_elem_type(v), tuple(v.shape))
            assert ct is not None  # either typed or evaluated above
            if ct.shape not in checked:
                self._check_numel(t, ct.shape)
                checked.add(ct.shape)
            const_types[t] = ct

        layers: list[Layer] = []
        produced_by: dict[str, tuple[int, int]] = {}
        seen_names: set[str] = set()
        e_src: list[int] = []
        e_src_slot: list[int] = []
        e_dst: list[int] = []
        e_dst_slot: list[int] = []
        act_types = {n: TensorType(e, s) for n, e, s in self.act_inputs}
        for i in layer_ids:
            node = self.nodes[i]
            idx = len(layers)
            node_name = node.name
            op_type = ops[i]
            name = unique_layer_name(node_name, op_type, idx, seen_names)
            ins, outs = all_ins[i], all_outs[i]
            in_types: list[TensorType | None] = []
            consts: dict[int, ConstInput] = {}
            for slot, t in enumerate(ins):
                if not t:
                    in_types.append(None)
                elif t in const_types:
                    ct = const_types[t]
                    role = role_of(i, slot, ct)
                    consts[slot] = ConstInput(t, ct, role, values[t] if role == "param" else None)
                    in_types.append(ct)
                else:
                    tt = act_types.get(t)
                    if tt is None:
                        tt = concrete(t)
                        if tt is None or tt.shape not in checked:
                            tt = self._require(t)
                            checked.add(tt.shape)
                    in_types.append(tt)
                    if t in produced_by:
                        src, src_slot = produced_by[t]
                        e_src.append(src)
                        e_src_slot.append(src_slot)
                        e_dst.append(idx)
                        e_dst_slot.append(slot)
            out_types: list[TensorType | None] = []
            for slot, t in enumerate(outs):
                if not t:
                    out_types.append(None)
                    continue
                tt = concrete(t)
                if tt is None and t in used:
                    tt = self._require(t)
                if tt is not None and tt.shape not in checked:
                    self._check_numel(t, tt.shape)
                    checked.add(tt.shape)
                out_types.append(tt)
                produced_by[t] = (idx, slot)
            outer = None
            if self.implicit[i]:
                outer = {}
                for t in self.implicit[i]:
                    tt = const_types.get(t) or self._concrete(t)
                    if tt is not None:
                        outer[t] = tt
            domain = node.domain
            digest = _layer_digest_fields(
                domain,
                op_type,
                node.attribute,
                node_name,
                ins,
                outs,
                in_types,
                out_types,
                consts,
                self.op_version[i],
                outer,
            )
            layers.append(
                Layer(
                    index=idx,
                    name=name,
                    op_type=op_type,
                    domain=domain,
                    node=node,
                    inputs=ins,
                    outputs=outs,
                    input_types=tuple(in_types),
                    output_types=tuple(out_types),
                    constants=consts,
                    digest=digest,
                )
            )

        outputs = []
        for vi in self.g.output:
            tt = act_types.get(vi.name) or const_types.get(vi.name)
            outputs.append((vi.name, tt or self._require(vi.name)))

        constant_types: dict[str, TensorType] = {}
        for t in self.const:
            ct = const_types.get(t) or self._concrete(t)
            if ct is not None:
                constant_types[t] = ct

        def i32(xs: list[int]) -> np.ndarray:
            return np.asarray(xs, dtype=np.int32)

        digests = np.frombuffer(b"".join(layer.digest for layer in layers), dtype=np.uint8).reshape(len(layers), 16)
        return Model(
            name=self.name,
            path=os.fspath(self.path) if self.path is not None else None,
            ir_version=int(self.proto.ir_version),
            opset_imports=dict(self.opsets),
            layers=layers,
            inputs=[(n, act_types[n]) for n, _, _ in self.act_inputs],
            outputs=outputs,
            edge_src=i32(e_src),
            edge_src_slot=i32(e_src_slot),
            edge_dst=i32(e_dst),
            edge_dst_slot=i32(e_dst_slot),
            digests=digests.copy(),
            constant_types=constant_types,
            _materialize=self.store.value,
        )

    def _require(self, name: str) -> TensorType:
        """The concrete type of ``name``, or a ModelError saying why there is none."""
        tt = self._concrete(name)
        if tt is not None:
            self._check_numel(name, tt.shape)
            return tt
        p = self.producer.get(name)
        where = f" (output of node {self._desc(p[0])})" if p is not None else ""
        if name in self.nontensor:
            raise self._err(
                f"tensor '{name}'{where} has a non-tensor type ({self.nontensor[name]}); dlbricks handles tensors only"
            )
        rt = self._raw_type(name)
        if rt is None or rt[0] == TensorProto.UNDEFINED:
            raise self._err(f"cannot infer the type of tensor '{name}'{where}")
        if rt[1] is None:
            raise self._err(f"cannot infer the shape of tensor '{name}'{where}")
        for k, d in enumerate(rt[1]):
            if not isinstance(d, int):
                what = f"'{d}'" if isinstance(d, str) else "unknown"
                raise self._err(f"cannot resolve the shape of tensor '{name}' (dim {k} is {what}){where}")
        raise AssertionError("unreachable")  # pragma: no cover


def _completeness(t: _RawType) -> int:
    elem, dims = t
    score = 1 if elem else 0
    if dims is not None:
        score += 1 + sum(2 for d in dims if isinstance(d, int))
    return score


def _type_folded_value(node: onnx.NodeProto, t: TensorType) -> np.ndarray:
    """The value of ``Shape``/``Size`` of a tensor of type ``t``."""
    if node.op_type == "Size":
        return np.array(t.numel, dtype=np.int64)
    start, end = 0, None
    for a in node.attribute:
        if a.name == "start":
            start = a.i
        elif a.name == "end":
            end = a.i
    # Python slicing clamps out-of-range and negative bounds exactly as Shape-15 does.
    return np.array(t.shape[start:end], dtype=np.int64)
