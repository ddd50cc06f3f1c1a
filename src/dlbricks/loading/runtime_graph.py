"""Runtime-aware decomposition: the graph onnxruntime actually executes.

onnxruntime fuses layers (Conv+BatchNorm+Relu, ...) and, at its highest level, moves
convolutions to a blocked layout (``com.microsoft.nchwc``). A brick cannot be fused
with its neighbours, so decomposing the source graph mispredicts; decomposing the
optimised graph makes every layer one kernel that really runs.

onnxruntime saves the optimised model but no intermediate types, and ONNX shape
inference does not know its contrib ops, so the types are read off one run of the
saved model with optimisation disabled and every intermediate value exposed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from dlbricks.errors import ModelError
from dlbricks.model import Model

_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}


def optimized_model(
    source: str | os.PathLike[str] | onnx.ModelProto,
    *,
    level: str = "default",
    workdir: str | os.PathLike[str] | None = None,
    input_shapes: dict[str, tuple[int, ...]] | None = None,
) -> onnx.ModelProto:
    """The model as onnxruntime executes it on the CPU, with every value's type recorded.

    Args:
        source: an ONNX file or ModelProto.
        level: "default" (onnxruntime's default, i.e. all), "basic", "extended", "all".
        workdir: where to write the optimised model (default: a temporary folder).
        input_shapes: concrete shapes for symbolic graph inputs.

    Returns:
        the optimised ModelProto, weights loaded, value_info filled in.
    Raises:
        ModelError: onnxruntime cannot load or run the model (names the file).
    """
    import onnxruntime as ort

    label = str(source) if not isinstance(source, onnx.ModelProto) else (source.graph.name or "<model>")
    own_tmp = None
    if workdir is None:
        own_tmp = tempfile.TemporaryDirectory(prefix="dlbricks-rt-")
        workdir = own_tmp.name
    try:
        out = Path(workdir) / "optimized.onnx"
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if level != "default":
            if level not in _LEVELS:
                raise ModelError(f"{label}: unknown optimisation level {level!r}")
            so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _LEVELS[level])
        so.optimized_model_filepath = str(out)
        model_arg = source.SerializeToString() if isinstance(source, onnx.ModelProto) else str(source)
        try:
            ort.InferenceSession(model_arg, so, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises several unrelated types
            raise ModelError(f"{label}: onnxruntime cannot optimise the model: {_first_line(exc)}") from None
        proto = onnx.load(str(out))
        _record_types(proto, label, input_shapes or {})
        return proto
    finally:
        if own_tmp is not None:
            own_tmp.cleanup()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _record_types(proto: onnx.ModelProto, label: str, input_shapes: dict[str, tuple[int, ...]]) -> None:
    """Run the optimised model once with every intermediate exposed and store the types."""
    import onnxruntime as ort

    graph = proto.graph
    initializer_names = {t.name for t in graph.initializer}
    known = {vi.name for vi in graph.input} | {vi.name for vi in graph.output} | initializer_names
    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    for node in graph.node:
        for name in node.output:
            if name and name not in known:
                probe.graph.output.append(helper.make_empty_tensor_value_info(name))
                known.add(name)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = ort.InferenceSession(probe.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ModelError(f"{label}: onnxruntime cannot load its own optimised model: {_first_line(exc)}") from None
    feeds = {}
    for inp in session.get_inputs():
        if inp.name in initializer_names:
            continue
        shape = input_shapes.get(inp.name)
        if shape is None:
            shape = tuple(d if isinstance(d, int) else 1 for d in inp.shape)
        dtype = _ort_type_to_numpy(inp.type)
        feeds[inp.name] = np.zeros(shape, dtype=dtype)
    try:
        values = session.run(None, feeds)
    except Exception as exc:
        raise ModelError(f"{label}: onnxruntime failed to run its optimised model: {_first_line(exc)}") from None
    existing = {vi.name for vi in graph.value_info} | {vi.name for vi in graph.output}
    for meta, value in zip(session.get_outputs(), values):
        if meta.name in existing or not isinstance(value, np.ndarray):
            continue
        elem = helper.np_dtype_to_tensor_dtype(value.dtype)
        graph.value_info.append(helper.make_tensor_value_info(meta.name, elem, list(value.shape)))


def _ort_type_to_numpy(type_str: str) -> np.dtype:
    inner = type_str[len("tensor(") : -1] if type_str.startswith("tensor(") else "float"
    mapping = {"float": np.float32, "double": np.float64, "float16": np.float16, "bool": np.bool_, "string": np.object_}
    return np.dtype(mapping.get(inner, inner))


def runtime_models(models: "list[Model]", *, level: str = "default", input_shapes: dict | None = None) -> "list[Model]":
    """Reload each model as the graph onnxruntime executes (same names, ``path`` kept).

    Raises:
        ModelError: a model has no path (in-memory models are optimised from their proto
            only when passed to :func:`optimized_model` directly) or fails to optimise.
    """
    from dlbricks.loading.onnx_io import load

    out = []
    for m in models:
        if m.path is None:
            raise ModelError(f"{m.name}: --runtime-graph needs the model's file")
        proto = optimized_model(m.path, level=level, input_shapes=input_shapes)
        out.append(load(proto, input_shapes, name=m.name))
    return out
