"""The fast path: a model read by the C++ scanner, with onnx only where it is needed.

Most models are plain graphs: default-domain ops, no subgraphs, static shapes (or a
symbolic batch dim). For those the C++ scanner (``_core.OnnxScan``, cpp/src/scan.cpp)
reads the file's bytes directly: no protobuf object per node, weight payloads skipped
by their length. Python adds only what needs onnx itself: each distinct op's schema
version and attribute defaults, each distinct (op, attributes) head whose attributes
are not plain (``OnnxScan.set_plain_heads`` makes the others in C++), and shape
inference, which runs on bytes. Anything else, including every error, goes to the full
loader (:mod:`dlbricks.loading.full`), which the scanner never second-guesses: when it
says "fallback", the full loader runs from scratch. Each step says why it leaves a
model (a :class:`FastPathFallback`), so that a fast path that stops taking models it
used to take shows. Layers, constant types and constant values of a fast model are
built by the full loader on first use (see ``model.LazyLayers``).
"""

from __future__ import annotations

import functools
import mmap
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx

from dlbricks import _core
from dlbricks.digest import head_prefix, make_head, schema_defaults_of
from dlbricks.errors import ModelError
from dlbricks.loading.full import load_file, load_proto
from dlbricks.loading.messages import DlbricksWarning, batch_dim_note, one_line
from dlbricks.loading.names import norm_domain
from dlbricks.loading.sizes import MAX_ELEMENTS, numel
from dlbricks.model import Layer, LazyLayers, LazyMapping, Model, TensorType

__all__ = [
    "FastPathFallback", "available", "finish_batch", "infer_light", "load_fast", "load_fast_proto", "release", "scan_file",
]

try:  # onnx's C++ shape inference on serialized bytes (what onnx.shape_inference wraps)
    from onnx.onnx_cpp2py_export import shape_inference as _c_shape_inference
except ImportError:  # pragma: no cover - every onnx release since 1.2 has it
    _c_shape_inference = None  # type: ignore[assignment]  # the optional-import idiom: available() checks

# Files at least this big are memory-mapped: weight pages are then never read.
_MMAP_MIN_BYTES = 1 << 20
# (op type, op version, serialized attributes) -> canonical head (digest.make_head), kept in
# C++ so that a scan finds its heads without a Python lookup per head.
_FAST_HEADS = _core.HeadTable()

Buffer = bytes | mmap.mmap
Scanned = tuple[Buffer, _core.OnnxScan]


@dataclass(frozen=True, slots=True)
class FastPathFallback:
    """Why the fast path left a model to the full loader.

    Attributes:
        model: the model's file (or, in memory, its label).
        reason: the scanner's or a step's reason; for an exception, its type and message.
        expected: True when the model lies outside what the fast path handles (control
            flow, other domains, functions, malformed bytes...: the full loader takes
            anything unusual); False when a step raised an exception it should not
            have, a fast-path bug that costs only time, which is why it must be seen.
    """

    model: str
    reason: str
    expected: bool = True

    def as_dict(self) -> dict[str, str | bool]:
        """The JSON form: ``{"model", "reason", "expected"}``."""
        return {"model": self.model, "reason": self.reason, "expected": self.expected}


def _raised(label: str, step: str, exc: BaseException) -> FastPathFallback:
    """The fallback for an exception from ``step``: malformed bytes are the model's
    (expected), anything else is the fast path's own failure."""
    text = one_line(str(exc)) or "(no message)"
    if isinstance(exc, _core.WireError):
        return FastPathFallback(label, f"malformed protobuf bytes ({text})")
    return FastPathFallback(label, f"{step}: {type(exc).__name__}: {text}", expected=False)


def available() -> bool:
    """Whether this onnx offers shape inference on bytes, which the fast path needs."""
    return _c_shape_inference is not None


@functools.lru_cache(maxsize=4096)
def _op_schema(op_type: str, opset: int) -> tuple[int, bytes, dict[str, bytes]] | None:
    """A default-domain op at a model's opset: its schema version, then what C++ needs
    to make its plain heads (digest.plain_head_parts: prefix, attribute defaults), from
    one schema lookup (a schema lookup is the costliest onnx call of a first analysis).
    None: onnx knows no such op."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    version = int(schema.since_version)
    return version, head_prefix("", op_type, version), schema_defaults_of(schema)


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
                    model = load_proto(self.source, self.label, None, self.name, None, {})
                else:
                    model = load_file(self.source, self.label, self.name, None)
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


def load_fast_proto(proto: onnx.ModelProto, label: str, name: str) -> Model | FastPathFallback:
    """The fast path on an in-memory model (serializing it, in C, costs less than
    reading its fields from Python), or why the full loader must run. Needs
    :func:`available`; its warnings point at the caller of this function's caller."""
    try:
        data = proto.SerializeToString()
    except Exception as exc:  # noqa: BLE001 - e.g. over protobuf's 2 GB limit
        return FastPathFallback(label, f"cannot serialize the ModelProto ({type(exc).__name__}: {one_line(str(exc))})")
    scan = _scan(data, label)
    return scan if isinstance(scan, FastPathFallback) else _fast_model(scan, data, proto, label, name)


def load_fast(path: Path, label: str, name: str) -> Model | FastPathFallback:
    """The fast path's Model of a file, or why the full loader must run (as
    :func:`load_fast_proto`)."""
    scanned = scan_file(path, label)
    if isinstance(scanned, FastPathFallback):
        return scanned
    buf, scan = scanned
    try:
        return _fast_model(scan, buf, path, label, name)
    finally:
        release(buf)


def scan_file(path: Path, label: str) -> Scanned | FastPathFallback:
    """The file's bytes and their scan, or why the full loader must run (then nothing
    is left open). Needs :func:`available`."""
    buf = _open_bytes(path, label)
    if isinstance(buf, FastPathFallback):
        return buf
    scan = _scan(buf, label)
    if isinstance(scan, FastPathFallback):
        release(buf)
        return scan
    return buf, scan


def _scan(buf: Buffer, label: str) -> _core.OnnxScan | FastPathFallback:
    """The scan of a model's bytes, or why the full loader must take them."""
    try:
        scan = _core.OnnxScan(buf)
    except Exception as exc:  # noqa: BLE001 - malformed: the full loader says why
        return _raised(label, "scan", exc)
    return FastPathFallback(label, scan.fallback) if scan.fallback else scan


def release(buf: Buffer) -> None:
    """Unmaps what :func:`_open_bytes` mapped (bytes need nothing; unmapping twice is fine)."""
    if isinstance(buf, mmap.mmap):
        buf.close()


def _open_bytes(path: Path, label: str) -> Buffer | FastPathFallback:
    """A model file's bytes (memory-mapped when big: weight pages are then never read),
    or why the full loader must run (it says what is wrong with the file)."""
    try:
        # os-level calls: for a small file, Python's buffered open() costs more than the read.
        fd = os.open(path, os.O_RDONLY)
    except (OSError, ValueError) as exc:
        return FastPathFallback(label, f"cannot open the file ({type(exc).__name__})")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return FastPathFallback(label, "not a regular, non-empty file")
        if st.st_size < _MMAP_MIN_BYTES:
            data = os.read(fd, st.st_size)
            return data if len(data) == st.st_size else FastPathFallback(label, "the file changed while read")
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)  # keeps its own descriptor
    except (OSError, ValueError) as exc:
        return FastPathFallback(label, f"cannot read the file ({type(exc).__name__})")
    finally:
        os.close(fd)


def _fast_model(
    scan: _core.OnnxScan, buf: Buffer, source: Path | onnx.ModelProto, label: str, name: str
) -> Model | FastPathFallback:
    """The fast path's steps after the scan of one model (see :func:`finish_batch` for many)."""
    prepared = _prepare(scan, buf, source, label, name)
    if isinstance(prepared, FastPathFallback):
        return prepared
    inferred = infer_light(prepared)
    if isinstance(inferred, FastPathFallback):
        return inferred
    res = _finish(prepared, inferred)
    # Warnings point at the caller of load(): 1 _build_model, 2 here, 3 load_fast(_proto), 4 load.
    return res if isinstance(res, FastPathFallback) else _build_model(prepared, res, stacklevel=5)


@dataclass(slots=True)
class _Prepared:
    """A model between the fast path's phases: scanned, heads resolved, light model
    written (``light``, dropped once inferred)."""

    buf: Buffer
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


def _prepare(
    scan: _core.OnnxScan, buf: Buffer, source: Path | onnx.ModelProto, label: str, name: str
) -> _Prepared | FastPathFallback:
    """After the scan of ``buf`` (one without a fallback): resolve op versions, input
    shapes and heads, write the light model; or why the full loader must run."""
    try:
        return _prepare_steps(scan, buf, source, label, name)
    except Exception as exc:  # noqa: BLE001 - the full loader says why
        return _raised(label, "prepare", exc)


def _prepare_steps(
    scan: _core.OnnxScan, buf: Buffer, source: Path | onnx.ModelProto, label: str, name: str
) -> _Prepared | FastPathFallback:
    opsets: dict[str, int] = {}
    for domain, version in scan.opsets:
        opsets[norm_domain(domain)] = int(version)
    default_opset = opsets.get("")
    if default_opset is None:
        return FastPathFallback(label, "no default-domain opset import")
    op_names = [op for _, op in scan.op_keys]  # every op is in the default domain on this path
    if "DequantizeLinear" in op_names:
        # The scanner would fold DQ(int8 weight) to a float weight and time Q, DQ and op apart.
        return FastPathFallback(label, "a quantized (QDQ) model: the full loader makes its QDQ groups")
    versions = _since_versions(tuple(op_names), default_opset)
    if versions is None:
        return FastPathFallback(label, f"an op onnx does not know at opset {default_opset}")

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
            notes.append(batch_dim_note(label, in_name, f"'{param}'" if kind == 2 else "unknown"))
            if param:
                dim_subst.setdefault(param, 1)
            shape.append(1)
        if numel(shape) > MAX_ELEMENTS:
            return FastPathFallback(label, f"input '{in_name}' has more than MAX_ELEMENTS elements")
        act_inputs.append((in_name, int(elem), tuple(shape)))
    shapes = [list(s) for _, _, s in act_inputs]

    # Canonical heads come from the process's table; only new ones are made here: those
    # with plain attributes in C++, all in one call (a first analysis makes every head,
    # and a Python call per head would cost more than the C++ work), the rest in Python.
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
                    return FastPathFallback(label, f"attributes of a {op_names[k]} read outer names")
                scan.set_head(h, head, _FAST_HEADS)
    return _Prepared(buf, source, label, name, scan, opsets, op_names, act_inputs, shapes, dim_subst, notes,
                     scan.light_model(buf, shapes))


def infer_light(prepared: _Prepared) -> bytes | FastPathFallback:
    """onnx's shape inference on the light model, or why not (the full loader reports
    inference errors)."""
    light, prepared.light = prepared.light, None
    try:
        assert light is not None  # a prepared model is inferred once
        return _c_shape_inference.infer_shapes(light, False, False, True)
    except _c_shape_inference.InferenceError as exc:
        text = str(exc).strip()
        return FastPathFallback(prepared.label, f"shape inference failed ({text.splitlines()[0] if text else ''})")
    except Exception as exc:  # noqa: BLE001 - e.g. light model bytes onnx cannot parse
        return _raised(prepared.label, "shape inference", exc)


def _finish(p: _Prepared, inferred: bytes) -> _core._ScanResult | FastPathFallback:
    """Fold and hash (the scan's finish), or why the full loader must run."""
    try:
        res = p.scan.finish(p.buf, inferred, p.shapes, p.dim_subst)
    except Exception as exc:  # noqa: BLE001 - the full loader says why
        return _raised(p.label, "finish", exc)
    return FastPathFallback(p.label, res["fallback"]) if res["fallback"] else res


def _build_model(p: _Prepared, res: _core._ScanResult, stacklevel: int) -> Model:
    """The Model of a finished scan. ``stacklevel`` points warnings at the caller of the
    public function."""
    scan = p.scan
    source = p.source
    digests = res["digests"]
    # Absolute: the layers may be built after the caller has changed directory.
    full = _FullModel(source if isinstance(source, onnx.ModelProto) else source.absolute(), p.label, p.name, digests)
    tts: dict[tuple[int, tuple[int, ...]], TensorType] = {}
    for _name, e, s in p.act_inputs:
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


# -- many files in phases -------------------------------------------------------------


def finish_batch(
    files: list[Path], scanned: list[Scanned | FastPathFallback], stacklevel: int
) -> Iterator[tuple[Path, Model | FastPathFallback]]:
    """The fast path's remaining steps over a batch of scanned files, each step over the
    whole batch, then each file's Model or fallback in order.

    Step by step rather than model by model: onnx's inference evicts the loader's code
    and data from the CPU's caches between two steps of a model, and the loader evicts
    onnx's; in phases both stay warm. ``stacklevel`` is the models' warnings' (2 points
    at this generator, 3 at its consumer).
    """
    bufs = [s[0] for s in scanned if not isinstance(s, FastPathFallback)]
    try:
        prepared: list[_Prepared | FastPathFallback] = []
        for path, s in zip(files, scanned):
            prepared.append(s if isinstance(s, FastPathFallback) else _prepare(s[1], s[0], path, os.fspath(path), path.stem))
        del scanned
        inferred = [p if isinstance(p, FastPathFallback) else infer_light(p) for p in prepared]
        finished: list[_core._ScanResult | FastPathFallback | None] = []
        for p, light_inferred in zip(prepared, inferred):
            if isinstance(p, FastPathFallback):
                finished.append(None)
            elif isinstance(light_inferred, FastPathFallback):
                finished.append(light_inferred)
            else:
                finished.append(_finish(p, light_inferred))
        del inferred
        for buf in bufs:  # every step that reads the files is done
            release(buf)
        for i, path in enumerate(files):
            p, res = prepared[i], finished[i]
            prepared[i] = finished[i] = None  # type: ignore[call-overload]
            if isinstance(p, FastPathFallback):
                yield path, p
            elif isinstance(res, FastPathFallback):
                yield path, res
            else:
                yield path, _build_model(p, res, stacklevel)  # type: ignore[arg-type]
    finally:  # also when a step is interrupted
        for buf in bufs:
            release(buf)
