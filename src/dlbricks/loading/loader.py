"""The entry points: :func:`load` and :func:`iter_load` take the fast path
(:mod:`dlbricks.loading.fast`) where it applies, the full loader
(:mod:`dlbricks.loading.full`) for the rest, and say which models fell back.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
import onnx

from dlbricks.errors import ArgumentError, ArgumentTypeError, ModelError
from dlbricks.loading import fast
from dlbricks.loading.fast import FastPathFallback
from dlbricks.loading.full import load_file, load_proto
from dlbricks.loading.paths import PathLike
from dlbricks.model import Model

__all__ = ["FastPathFallback", "iter_load", "load"]

# Tests turn the fast path off to compare it with the full loader.
_FAST_PATH = True

OnFallback = Callable[[FastPathFallback], None]


def _checked_shapes(input_shapes: Mapping[str, Sequence[int]] | None) -> None:
    """Refuse shapes the CLI's ``--input-shape`` refuses: every dim an int >= 1 (a float
    dim would be truncated, a 0 gives empty tensors to time)."""
    if input_shapes is None:
        return
    if not isinstance(input_shapes, Mapping):
        raise ArgumentTypeError(f"input_shapes must map input names to shapes, got {type(input_shapes).__name__}")
    for name, dims in input_shapes.items():
        if isinstance(dims, (str, bytes)) or not all(
                isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 1 for d in dims):
            raise ArgumentError(f"input_shapes[{name!r}] = {dims!r}: every dimension must be an int >= 1")


def _not_tried(label: str, input_shapes: Mapping[str, Sequence[int]] | None) -> FastPathFallback | None:
    """Why the fast path is not even tried, or None when it is."""
    if input_shapes:
        return FastPathFallback(label, "input shapes given (the fast path takes the declared ones only)")
    if not _FAST_PATH:
        return FastPathFallback(label, "the fast path is turned off")
    if not fast.available():
        return FastPathFallback(label, "this onnx has no shape inference on bytes")
    return None


def load(
    source: PathLike | onnx.ModelProto,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    name: str | None = None,
    on_fallback: OnFallback | None = None,
) -> Model:
    """Load, validate and fold an ONNX model.

    Args:
        source: a path to an ``.onnx`` file, or an in-memory ``onnx.ModelProto``.
            External data is never loaded during analysis.
        input_shapes: shapes for graph inputs, overriding the declared ones (needed
            when an input has symbolic dims other than a leading batch dim).
        name: the model's name; defaults to the file stem (or the graph name).
        on_fallback: called with a :class:`FastPathFallback` when the model goes to
            the full loader rather than the fast path, saying why.

    Returns:
        The folded :class:`~dlbricks.model.Model`.

    Raises:
        ModelError: the file is not a readable ONNX model, or the graph is invalid
            (cycle, undefined tensor, unknown op, unresolvable or absurd shape, no
            layers). The message is one line naming the file and the cause.
        ArgumentTypeError: ``source`` is neither a path nor a ModelProto (a TypeError too).
        ArgumentError: a dimension of ``input_shapes`` is not an int >= 1.

    Warns:
        DlbricksWarning: a symbolic leading (batch) dim of an input was set to 1.
    """
    _checked_shapes(input_shapes)
    # partial, not a lambda: no frame of its own between load and the path it takes,
    # so that the fast path's warnings still point at the caller of load.
    if isinstance(source, onnx.ModelProto):
        label = name or source.graph.name or "<model>"
        fast_path = functools.partial(fast.load_fast_proto, source, label, name or source.graph.name or "model")
        full_path = functools.partial(load_proto, source, label, None, name, input_shapes, {})
    elif isinstance(source, (str, os.PathLike)):
        path = source if isinstance(source, Path) else Path(source)
        label = os.fspath(source)
        fast_path = functools.partial(fast.load_fast, path, label, name or path.stem)
        full_path = functools.partial(load_file, path, label, name, input_shapes)
    else:
        raise ArgumentTypeError(f"load() expects a path or an onnx.ModelProto, got {type(source).__name__}")
    fallback = _not_tried(label, input_shapes)
    if fallback is None:
        result = fast_path()
        if not isinstance(result, FastPathFallback):
            return result
        fallback = result
    if on_fallback is not None:
        on_fallback(fallback)
    return full_path()


def iter_load(
    paths: Sequence[PathLike],
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    batch_bytes: int = 32 << 20,
    batch_models: int = 64,
    on_fallback: OnFallback | None = None,
) -> Iterator[tuple[Path, Model | None, ModelError | None]]:
    """Load model files one after the other, each exactly as :func:`load` would.

    Yields ``(path, model, None)`` or ``(path, None, error)`` in the order of ``paths``;
    a model's warnings are given, and ``on_fallback`` called for a model that left the
    fast path, just before it is yielded. The fast path runs in phases over batches of
    files (:func:`dlbricks.loading.fast.finish_batch`). A batch takes files while it
    holds less than ``batch_bytes`` of them, and at most ``batch_models`` files, so
    memory stays bounded by the largest model, not by the corpus. Errors other than a
    bad model's (``MemoryError``...) propagate.
    """
    _checked_shapes(input_shapes)
    files = [p if isinstance(p, Path) else Path(p) for p in paths]
    i = 0
    while i < len(files):
        batch: list[Path] = []
        scanned: list[fast.Scanned | FastPathFallback] = []
        held = 0  # bytes of the batch's files
        while i < len(files) and len(batch) < max(batch_models, 1) and (not batch or held < batch_bytes):
            path = files[i]
            i += 1
            batch.append(path)
            label = os.fspath(path)
            s = _not_tried(label, input_shapes) or fast.scan_file(path, label)
            scanned.append(s)
            held += 0 if isinstance(s, FastPathFallback) else len(s[0])
        # Warnings: 1 fast's model builder, 2 finish_batch, 3 here, 4 our consumer.
        for path, result in fast.finish_batch(batch, scanned, stacklevel=4):
            if not isinstance(result, FastPathFallback):
                yield path, result, None
                continue
            if on_fallback is not None:
                on_fallback(result)
            try:
                model = load_file(path, os.fspath(path), None, input_shapes)
            except ModelError as exc:
                yield path, None, exc
                continue
            yield path, model, None
