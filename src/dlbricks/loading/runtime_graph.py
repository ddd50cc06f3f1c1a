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
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from dlbricks.errors import DlbricksError, ModelError, first_line
from dlbricks.model import Model
from dlbricks.timing.config import RunnerConfig
from dlbricks.timing.fpenv import FloatEnv
from dlbricks.timing.inputs import ORT_TYPES
from dlbricks.timing.session import create_session, session_options


def _config(config: RunnerConfig | None, level: str | None, label: str) -> RunnerConfig:
    cfg = config or RunnerConfig()
    if level is None or level == cfg.graph_optimization:
        return cfg
    try:
        return replace(cfg, graph_optimization=level)
    except DlbricksError:
        raise ModelError(f"{label}: unknown optimisation level {level!r}") from None


def optimized_model(
    source: str | os.PathLike[str] | onnx.ModelProto,
    *,
    config: RunnerConfig | None = None,
    level: str | None = None,
    workdir: str | os.PathLike[str] | None = None,
    input_shapes: dict[str, tuple[int, ...]] | None = None,
) -> onnx.ModelProto:
    """The model as onnxruntime executes it on the CPU, with every value's type recorded.

    The graph is optimised with the session options the runner times with
    (:func:`dlbricks.timing.session_options`), so the graph decomposed is the graph
    the timed sessions run.

    Args:
        source: an ONNX file or ModelProto.
        config: the runner configuration the bricks will be timed with (default
            ``RunnerConfig()``).
        level: overrides ``config.graph_optimization``: "default" (onnxruntime's
            default, i.e. all), "disable", "basic", "extended", "all".
        workdir: where to write the optimised model (default: a temporary folder).
        input_shapes: concrete shapes for symbolic graph inputs.

    Returns:
        the optimised ModelProto, weights loaded, value_info filled in.
    Raises:
        ModelError: onnxruntime cannot load or run the model (names the file), or
            ``level`` is unknown.
    """
    label = str(source) if not isinstance(source, onnx.ModelProto) else (source.graph.name or "<model>")
    cfg = _config(config, level, label)
    own_tmp = None
    if workdir is None:
        own_tmp = tempfile.TemporaryDirectory(prefix="dlbricks-rt-")
        workdir = own_tmp.name
    # onnxruntime's first session sets flush-to-zero on the calling thread and never
    # undoes it; a loader must leave the caller's floating-point state alone.
    fenv = FloatEnv()
    try:
        out = Path(workdir) / "optimized.onnx"
        so = session_options(cfg)
        so.optimized_model_filepath = str(out)
        try:
            create_session(source, cfg, options=so)
        except DlbricksError as exc:
            cause = exc.__cause__ or exc
            raise ModelError(f"{label}: onnxruntime cannot optimise the model: {first_line(cause)}") from None
        proto = onnx.load(str(out))
        _record_types(proto, label, input_shapes or {}, cfg)
        return proto
    finally:
        fenv.restore()
        if own_tmp is not None:
            own_tmp.cleanup()


def _record_types(
    proto: onnx.ModelProto, label: str, input_shapes: dict[str, tuple[int, ...]], cfg: RunnerConfig
) -> None:
    """Run the optimised model once with every intermediate exposed and store the types."""
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
    try:
        # Optimising again would rewrite the graph whose types are being read.
        session = create_session(probe, replace(cfg, graph_optimization="disable"))
    except DlbricksError as exc:
        cause = exc.__cause__ or exc
        raise ModelError(f"{label}: onnxruntime cannot load its own optimised model: {first_line(cause)}") from None
    feeds: dict[str, np.ndarray] = {}
    for inp in session.get_inputs():
        if inp.name in initializer_names:
            continue
        shape = input_shapes.get(inp.name)
        if shape is None:
            shape = tuple(d if isinstance(d, int) else 1 for d in inp.shape)
        dtype = ORT_TYPES.get(inp.type)
        if dtype is None:
            raise ModelError(f"{label}: input {inp.name!r}: cannot make values of type {inp.type}")
        # Zeros rather than make_inputs: the values only have to run, zero is a valid
        # index for every Gather or Slice the optimised graph holds, and the session
        # alone cannot bound random integers.
        feeds[inp.name] = np.zeros(shape, dtype=dtype)
    try:
        values = session.run(None, feeds)
    except Exception as exc:
        raise ModelError(f"{label}: onnxruntime failed to run its optimised model: {first_line(exc)}") from None
    existing = {vi.name for vi in graph.value_info} | {vi.name for vi in graph.output}
    for meta, value in zip(session.get_outputs(), values):
        if meta.name in existing or not isinstance(value, np.ndarray):
            continue
        elem = helper.np_dtype_to_tensor_dtype(value.dtype)
        graph.value_info.append(helper.make_tensor_value_info(meta.name, elem, list(value.shape)))


def runtime_models(
    models: list[Model],
    *,
    config: RunnerConfig | None = None,
    level: str | None = None,
    input_shapes: dict | None = None,
) -> list[Model]:
    """Reload each model as the graph onnxruntime executes, under the same name.

    The reloaded models have no ``path``: the file holds the source graph, not this one.

    Args:
        models: loaded models, each with its file.
        config, level: as for :func:`optimized_model`: pass the configuration the
            bricks will be timed with.
        input_shapes: concrete shapes for symbolic graph inputs.

    Raises:
        ModelError: a model has no path (in-memory models are optimised from their proto
            only when passed to :func:`optimized_model` directly) or fails to optimise.
    """
    from dlbricks.loading import load

    out = []
    for m in models:
        if m.path is None:
            raise ModelError(f"{m.name}: --runtime-graph needs the model's file")
        proto = optimized_model(m.path, config=config, level=level, input_shapes=input_shapes)
        out.append(load(proto, input_shapes, name=m.name))
    return out
