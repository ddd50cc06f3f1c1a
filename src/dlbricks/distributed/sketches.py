"""Corpus analysis on Ray: model files parsed and digested by Ray tasks, returned as flat
:class:`ModelSketch` objects and merged on the driver in path order."""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from dlbricks.distributed.cluster import check_versions, dlbricks_versions, ray_module
from dlbricks.errors import ModelError
from dlbricks.model import layer_kinds, layer_names

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.loading import FastPathFallback


@dataclass(frozen=True, slots=True)
class LayerSketch:
    """A layer as the driver needs it: its name and ``op_type`` (domain-qualified)."""

    name: str
    kind: str


@dataclass(slots=True)
class ModelSketch:
    """A loaded model reduced to flat data (picklable, a few bytes per layer).

    It has the attributes :class:`~dlbricks.corpus.Corpus`, :func:`dlbricks.analysis.analyze`,
    :func:`dlbricks.pipeline.unique_bricks` and :func:`dlbricks.bricks.model_digest` read,
    so it stands in for a :class:`~dlbricks.model.Model` wherever no ONNX node is needed.
    ``input_shapes`` are the overrides it was loaded with: a node reloads the model
    from ``path`` with them to generate its bricks.
    """

    name: str
    path: str | None
    layers: tuple[LayerSketch, ...]
    digests: np.ndarray
    edge_src: np.ndarray
    edge_src_slot: np.ndarray
    edge_dst: np.ndarray
    edge_dst_slot: np.ndarray
    input_shapes: dict[str, tuple[int, ...]] | None = None

    @property
    def n_layers(self) -> int:
        return len(self.layers)


def sketch(model: Any, input_shapes: Mapping[str, Sequence[int]] | None = None) -> ModelSketch:
    """The :class:`ModelSketch` of a loaded :class:`~dlbricks.model.Model`."""
    return ModelSketch(
        name=model.name,
        path=model.path,
        # Names and kinds without building Layer objects (a fast-loaded model has them lazily).
        layers=tuple(LayerSketch(n, k) for n, k in zip(layer_names(model.layers), layer_kinds(model.layers))),
        digests=np.ascontiguousarray(model.digests),
        edge_src=np.ascontiguousarray(model.edge_src),
        edge_src_slot=np.ascontiguousarray(model.edge_src_slot),
        edge_dst=np.ascontiguousarray(model.edge_dst),
        edge_dst_slot=np.ascontiguousarray(model.edge_dst_slot),
        input_shapes={k: tuple(int(d) for d in v) for k, v in input_shapes.items()} if input_shapes else None,
    )


def _load_chunk(paths: Sequence[str], input_shapes: dict[str, tuple[int, ...]] | None) -> tuple[dict, list[tuple]]:
    """Ray task body: (versions, [(sketch or None, error or None, warnings, fallback) per
    path]); the fallback (:class:`~dlbricks.loading.FastPathFallback`, None when the fast
    path loaded the model) is recorded for a model that then fails to load too, as the
    local loader does."""
    from dlbricks.loading import load

    out = []
    for p in paths:
        left: list[FastPathFallback] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result: tuple = (sketch(load(p, input_shapes, on_fallback=left.append), input_shapes), None)
            except ModelError as exc:
                result = (None, str(exc))
        out.append((*result, [str(w.message) for w in caught], left[0] if left else None))
    return dlbricks_versions(), out


def load_corpus_ray(
    paths: Sequence[str | Path],
    input_shapes: dict[str, tuple[int, ...]] | None = None,
    *,
    strict: bool = False,
    on_warning: Callable[[str], None] | None = None,
    chunk_size: int | None = None,
) -> Any:
    """:func:`dlbricks.analysis.load_corpus` with the models parsed by Ray tasks.

    Needs a connected Ray (see :func:`connect`). Paths are expanded here; each task
    loads a chunk of files on whichever node Ray picks, so every node must see the
    files at the same path.

    Args:
        paths: files or folders (searched recursively for ``*.onnx``).
        input_shapes: concrete shapes for symbolic graph inputs, by input name.
        strict: raise the first bad model's error (in path order) instead of skipping it.
        on_warning: called with each loader warning, in path order.
        chunk_size: files per task (default: about four tasks per Ray CPU, at most 16 files).

    Returns:
        a :class:`dlbricks.analysis.LoadedCorpus` whose ``models`` are
        :class:`ModelSketch` objects, in the order the local loader gives, with the
        models the nodes' fast path left to the full loader (``fallbacks``), in the
        same order.

    Raises:
        UsageError: a missing path or a folder without models.
        ModelError: with ``strict``, a bad model; or no model could be loaded.
        DlbricksError: a node runs another dlbricks (digests would differ).
    """
    from dlbricks.analysis import LoadedCorpus, model_files

    ray = ray_module()
    files = [str(f) for f in model_files(paths)]
    shapes = {k: tuple(int(d) for d in v) for k, v in input_shapes.items()} if input_shapes else None
    start = time.perf_counter()
    if chunk_size is None:
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        chunk_size = max(1, min(16, math.ceil(len(files) / (4 * cpus))))
    task = ray.remote(num_cpus=1, max_retries=3)(_load_chunk)
    refs = [task.remote(files[i : i + chunk_size], shapes) for i in range(0, len(files), chunk_size)]
    rows = []
    for versions, chunk in ray.get(refs):
        check_versions(versions, "a Ray node")
        rows.extend(chunk)
    fallbacks: list[FastPathFallback] = []
    out = LoadedCorpus(models=[], fallbacks=fallbacks)
    for f, (model, error, caught, fallback) in zip(files, rows):
        if fallback is not None:
            fallbacks.append(fallback)
        if error is not None:
            if strict:
                raise ModelError(error)
            out.errors.append({"path": f, "error": error})
        else:
            out.models.append(model)
        out.add_warnings(caught, on_warning)
    return out.done(start)
