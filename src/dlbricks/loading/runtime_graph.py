"""Runtime-aware decomposition: the graph onnxruntime actually executes.

onnxruntime fuses layers (Conv+BatchNorm+Relu, ...) and, at its highest level, moves
convolutions to a blocked layout (``com.microsoft.nchwc``). A brick cannot be fused
with its neighbours, so decomposing the source graph mispredicts; decomposing the
optimised graph makes every layer one kernel that really runs.

onnxruntime saves the optimised model but no intermediate types (at most the source's
declarations), and ONNX shape inference does not know its contrib ops, so their outputs'
types are read off one run of the saved model with optimisation disabled and those
outputs exposed, ONNX shape inference carries them through the rest, and the types
found replace any declared ones. The loader takes each op onnx
does not define (com.microsoft's, com.microsoft.nchwc's, and the ONNX-domain ops of
onnxruntime's own such as SimplifiedLayerNormalization) as an opaque layer of those
types: what onnxruntime produces, optional outputs included.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np
import onnx
import onnxruntime
from onnx import helper

from dlbricks.errors import DlbricksError, ModelError, first_line
from dlbricks.loading.messages import DlbricksWarning
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
    label: str | None = None,
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
        label: how messages name the model (default: the file, or the graph's name).

    Returns:
        the optimised ModelProto, weights loaded, value_info filled in.
    Raises:
        ModelError: onnxruntime cannot load or run the model (names the file), or
            ``level`` is unknown.
    """
    if label is None:
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
        so = _deriving_options(cfg)
        so.optimized_model_filepath = str(out)
        # Weights go to a file beside it: the graph is read, extended and loaded without
        # them (shapes and types are all the decomposition needs; bricks synthesise
        # their own), and the session that records the types reads them from disk.
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", _WEIGHTS_FILE)
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                    str(_INLINE_BYTES))
        try:
            create_session(source, cfg, options=so)
        except DlbricksError as exc:
            cause = exc.__cause__ or exc
            raise ModelError(f"{label}: onnxruntime cannot optimise the model: {first_line(cause)}") from None
        proto = onnx.load(str(out), load_external_data=False)
        _record_types(proto, label, input_shapes or {}, cfg, Path(workdir))
        _drop_external_data(proto)
        return proto
    finally:
        fenv.restore()
        if own_tmp is not None:
            own_tmp.cleanup()


def _deriving_options(cfg: RunnerConfig) -> onnxruntime.SessionOptions:
    """The timed sessions' options, without weight prepacking: these sessions are
    built only to save the optimised graph and to read types off one run. Prepacking
    comes after graph optimisation (the saved graph is byte for byte the same), but it
    copies every MatMul and Conv weight into its packed form: without it, deriving
    the 36 models of ``bench/modern_corpus.py`` took 13.7-32.8 s (median 14.3) against
    20.6-31.6 s (median 23.3), four interleaved pairs on a 2-vCPU VM."""
    so = session_options(cfg)
    so.add_session_config_entry("session.disable_prepacking", "1")
    return so


#: The optimised model's weights file, beside it in the work folder.
_WEIGHTS_FILE = "weights.bin"
#: Initializers up to this size stay in the graph: the loader reads the values of
#: shape and index operands and of per-channel quantisation parameters (a 2048-channel
#: scale is 8 KiB); a layer's weights are larger.
_INLINE_BYTES = 64 << 10


def _drop_external_data(proto: onnx.ModelProto) -> None:
    """Leave the weights that went to the work folder's file as shapes and types only
    (the folder is removed): empty, non-external tensors of their dims and type."""
    for t in proto.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT


def _record_types(
    proto: onnx.ModelProto, label: str, input_shapes: dict[str, tuple[int, ...]], cfg: RunnerConfig,
    folder: Path,
) -> None:
    """Store every value's type (weights read from the file beside the model in ``folder``).

    The outputs of the ops ONNX does not define are read off one run of the optimised
    model with them exposed; ONNX shape inference carries their types through the rest;
    whatever is still without a static type is read off a second run. Exposing every
    intermediate at once instead keeps onnxruntime from reusing any buffer: AST's 374
    values took 3.5 GB and 11-14 s to run, against 2.1-2.7 s for the run that exposes
    its 28 non-ONNX outputs."""
    graph = proto.graph
    produced = [name for node in graph.node for name in node.output if name]
    foreign = [name for node in graph.node if not onnx.defs.has(node.op_type, node.domain or "")
               for name in node.output if name]
    ran, shapes = _run_exposing(proto, foreign, label, input_shapes, cfg, folder)
    inferred = _inferred_types(proto, ran, shapes)
    missing = [name for name in produced if name not in ran and name not in inferred]
    if missing:
        more, _ = _run_exposing(proto, missing, label, input_shapes, cfg, folder)
        ran.update(more)
    types = {**inferred, **ran}
    # The run's types replace any declared ones: onnxruntime keeps the source's
    # declarations, whose dims may be symbolic or predate its rewrites.
    kept = [vi for vi in graph.value_info if vi.name not in types]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    outputs = {vi.name for vi in graph.output}
    for vi in graph.output:
        if vi.name in types:
            vi.type.CopyFrom(types[vi.name])
    for name in produced:
        if name in types and name not in outputs:
            graph.value_info.add(name=name).type.CopyFrom(types[name])


def _run_exposing(
    proto: onnx.ModelProto, names: Sequence[str], label: str, input_shapes: dict[str, tuple[int, ...]],
    cfg: RunnerConfig, folder: Path,
) -> tuple[dict[str, onnx.TypeProto], dict[str, tuple[int, ...]]]:
    """Run the optimised model once with ``names`` exposed as outputs; returns the types
    of its tensor outputs (the graph's own included) and the input shapes it was fed."""
    graph = proto.graph
    initializer_names = {t.name for t in graph.initializer}
    known = {vi.name for vi in graph.input} | {vi.name for vi in graph.output} | initializer_names
    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    for name in names:
        if name not in known:
            probe.graph.output.append(helper.make_empty_tensor_value_info(name))
            known.add(name)
    probe_path = folder / "probe.onnx"
    probe_path.write_bytes(probe.SerializeToString())
    try:
        # Optimising again would rewrite the graph whose types are being read.
        unoptimised = replace(cfg, graph_optimization="disable")
        session = create_session(str(probe_path), unoptimised, options=_deriving_options(unoptimised))
    except DlbricksError as exc:
        cause = exc.__cause__ or exc
        raise ModelError(f"{label}: onnxruntime cannot load its own optimised model: {first_line(cause)}") from None
    feeds: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
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
        feeds[inp.name] = onnxruntime.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=dtype))
        shapes[inp.name] = tuple(shape)
    try:
        # OrtValues: only types are read, so nothing is copied out.
        values = session.run_with_ort_values(None, feeds)
    except Exception as exc:
        raise ModelError(f"{label}: onnxruntime failed to run its optimised model: {first_line(exc)}") from None
    types = {
        meta.name: helper.make_tensor_type_proto(value.element_type(), list(value.shape()))
        for meta, value in zip(session.get_outputs(), values) if value.is_tensor()
    }
    return types, shapes


def _inferred_types(
    proto: onnx.ModelProto, known: Mapping[str, onnx.TypeProto], input_shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, onnx.TypeProto]:
    """The static tensor types ONNX shape inference gives the graph's values, from the
    inputs' fed shapes and the ``known`` types (an empty dict where it fails)."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    graph = model.graph
    del graph.value_info[:]
    for vi in graph.input:
        if vi.name in input_shapes and vi.type.HasField("tensor_type"):
            elem = vi.type.tensor_type.elem_type
            vi.type.CopyFrom(helper.make_tensor_type_proto(elem, list(input_shapes[vi.name])))
    outputs = {vi.name for vi in graph.output}
    for vi in graph.output:
        vi.type.Clear()
        if vi.name in known:
            vi.type.CopyFrom(known[vi.name])
    for name, tp in known.items():
        if name not in outputs:
            graph.value_info.add(name=name).type.CopyFrom(tp)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:  # inference is a shortcut: a second run reads what it cannot
        return {}
    return {
        vi.name: vi.type
        for vi in list(inferred.graph.value_info) + list(inferred.graph.output)
        if _static_tensor(vi.type)
    }


def _static_tensor(tp: onnx.TypeProto) -> bool:
    if not tp.HasField("tensor_type") or not tp.tensor_type.elem_type or not tp.tensor_type.HasField("shape"):
        return False
    return all(d.HasField("dim_value") for d in tp.tensor_type.shape.dim)


def runtime_models(
    models: list[Model],
    *,
    config: RunnerConfig | None = None,
    level: str | None = None,
    input_shapes: dict | None = None,
) -> list[Model]:
    """Reload each model as the graph onnxruntime executes, under the same name.

    The reloaded models have no ``path``: the file holds the source graph, not this one.
    Each is optimised as it is timed end to end (:func:`dlbricks.bricks.whole_model`:
    its graph with synthesised weights), file or not.

    Args:
        models: loaded models.
        config, level: as for :func:`optimized_model`: pass the configuration the
            bricks will be timed with.
        input_shapes: concrete shapes for symbolic graph inputs.

    Raises:
        ModelError: a model's graph cannot be rebuilt or optimised, or its runtime graph
            cannot be loaded (:func:`runtime_models_or_sources` keeps the source graph of
            such a model instead).
    """
    return [_runtime_model(m, config, level, input_shapes) for m in models]


def _runtime_model(
    model: Model,
    config: RunnerConfig | None,
    level: str | None,
    input_shapes: Mapping[str, Sequence[int]] | None,
) -> Model:
    from dlbricks.bricks import whole_model_window, write_brick
    from dlbricks.loading import load
    from dlbricks.timing.engine_process import spool_dir

    shapes = {k: tuple(v) for k, v in input_shapes.items()} if input_shapes else None
    cached = _cache_path(model, _config(config, level, model.name), shapes)
    proto = _read_cached(cached)
    if proto is not None:
        return load(proto, shapes, name=model.name)
    with tempfile.TemporaryDirectory(prefix="dlbricks-rt-", dir=spool_dir()) as tmp:
        # Optimised as it is timed end to end: with synthesised weights (those of
        # dlbricks.bricks.whole_model). onnxruntime's optimiser looks at weight values (it
        # merges branches whose weights are equal, folds BatchNormalization only where it
        # can), so the file's own weights can give another graph: the light models'
        # weights are all zeros, and Inception v2's file optimises to 129 kernels where
        # the model that runs has 96. Written as a file with its weights raw beside it,
        # which onnxruntime maps, rather than copied through protobuf.
        source = Path(tmp) / "model.onnx"
        members, digest, G = whole_model_window(model)
        try:
            write_brick(model, members, source, seed=0, digest=digest, G=G, check=False)
        except (DlbricksError, KeyError, ValueError) as exc:
            raise ModelError(f"{model.name}: cannot rebuild its graph to optimise: {first_line(exc)}") from None
        proto = optimized_model(source, config=config, level=level, input_shapes=shapes, workdir=tmp,
                                label=model.name)
    runtime = load(proto, shapes, name=model.name)
    _write_cached(cached, proto)
    return runtime


#: Version of how a runtime graph is derived (:func:`_runtime_model`): part of its cache key.
RUNTIME_GRAPH_FORM = 1


def _cache_path(model: Model, cfg: RunnerConfig, shapes: Mapping[str, tuple[int, ...]] | None) -> Path:
    """Where the runtime graph of ``model`` is cached: keyed by what it is derived from,
    the model's computation (:func:`dlbricks.bricks.model_digest`) and names, the
    synthesised weights' generator, the session options that shape the optimised graph,
    and the machine and onnxruntime (:func:`dlbricks.timing.sysinfo.fingerprint_id`:
    its CPU flags choose kernels and layouts). Deriving one runs onnxruntime's optimiser
    and a whole model (~1 s for a BERT-base): every command on a corpus paid that again."""
    import hashlib
    import json

    from dlbricks.bricks import model_digest
    from dlbricks.files import cache_dir
    from dlbricks.versions import brick_digest_version

    names = hashlib.blake2b(digest_size=16)
    for layer in model.layers:
        names.update(layer.name.encode() + b"\0")
    key = {
        "form": RUNTIME_GRAPH_FORM,
        "model": model_digest(model),
        "names": names.hexdigest(),
        "bricks": brick_digest_version(),
        "system": _system_id(),
        "options": [cfg.graph_optimization, cfg.execution_mode, cfg.intra_op_threads, cfg.inter_op_threads,
                    cfg.denormals_as_zero],
        "shapes": sorted((k, list(v)) for k, v in (shapes or {}).items()),
    }
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest()
    return cache_dir() / "runtime-graphs" / f"{digest}.onnx"


@functools.cache
def _system_id() -> str:
    """This machine's fingerprint id, once per process (it reads /proc and /sys)."""
    from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint

    return fingerprint_id(system_fingerprint())


def _read_cached(path: Path) -> onnx.ModelProto | None:
    """The cached runtime graph, or None when there is none or it cannot be read (it is
    then derived and written again)."""
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - missing, truncated by a crash, or foreign: derive again
        return None


def _write_cached(path: Path, proto: onnx.ModelProto) -> None:
    """Keep a derived runtime graph; a cache that cannot be written is no error."""
    from dlbricks.errors import UsageError
    from dlbricks.files import write_atomically

    with contextlib.suppress(OSError, UsageError, ValueError):
        write_atomically(path, proto.SerializeToString())


# Which graph a model is decomposed as: the one onnxruntime executes, or its file's.
Graph = Literal["runtime", "source"]


def runtime_models_or_sources(
    sources: Sequence[Model],
    *,
    config: RunnerConfig | None = None,
    level: str | None = None,
    input_shapes_for: Callable[[Model], Mapping[str, Sequence[int]] | None] | None = None,
    on_warning: Callable[[str], None] | None = None,
) -> tuple[list[Model], list[Graph]]:
    """Each model's runtime graph (:func:`runtime_models`), or the model itself where
    that graph cannot be built or decomposed.

    Args:
        sources: loaded models.
        config, level: as for :func:`optimized_model`: pass the configuration the
            bricks will be timed with.
        input_shapes_for: each model's concrete input shapes (None: as declared); the
            source model was loaded with the same ones.
        on_warning: called with one line naming a model that keeps its source graph and
            why (default: a :class:`~dlbricks.loading.DlbricksWarning`).

    Returns:
        (models, graphs): pairwise with ``sources``, the model to decompose and which
        graph it is, ``"runtime"`` or ``"source"``. A runtime model has the source's
        name and no path. Only a :class:`~dlbricks.errors.DlbricksError` sends a model
        back to its source graph; other errors (``MemoryError``...) propagate.
    """
    def derive(m: Model) -> Model | DlbricksError:
        shapes = input_shapes_for(m) if input_shapes_for is not None else None
        try:
            return _runtime_model(m, config, level, shapes)
        except DlbricksError as exc:
            return exc

    # onnxruntime optimises and runs a model outside the GIL, so models not cached yet
    # are derived on every usable core at once (nothing is being timed yet).
    from dlbricks.cpuset import usable_cpus

    threads = min(len(sources), len(usable_cpus()))
    if threads > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(threads, thread_name_prefix="dlbricks-runtime-graph") as pool:
            derived = list(pool.map(derive, sources))
    else:
        derived = [derive(m) for m in sources]
    models: list[Model] = []
    graphs: list[Graph] = []
    for m, runtime in zip(sources, derived):
        if isinstance(runtime, Model):
            models.append(runtime)
            graphs.append("runtime")
        else:
            cause = _unlabelled(first_line(runtime), m.name)
            message = f"{m.name}: decomposed as its source graph: its runtime graph cannot be used ({cause})"
            if on_warning is not None:
                on_warning(message)
            else:
                warnings.warn(message, DlbricksWarning, stacklevel=2)
            models.append(m)
            graphs.append("source")
    return models, graphs


def _unlabelled(message: str, name: str) -> str:
    """``message`` without a leading ``name: `` (errors name their model; so does the
    line that quotes them)."""
    prefix = f"{name}: "
    return message[len(prefix):] if message.startswith(prefix) else message
