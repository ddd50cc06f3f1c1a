"""The one way dlbricks creates, binds and pins an onnxruntime session, and the one
timed loop that runs it.

- :func:`session_options` / :func:`create_session`: a CPU session with a
  configuration's options (callers that need more, such as onnxruntime's profiler or
  the saved optimised graph, start from :func:`session_options` and pass ``options``);
- :func:`bind`: inputs and outputs bound once (:class:`BoundSession`);
- :func:`pinned`: the calling thread on the configuration's cores (:func:`pin_process`
  for a worker, for good);
- :func:`prepared_session` (:func:`prepare_session` for a caller that holds the
  pinning and the FP environment itself): the whole set-up a timed run needs, in one
  order, for the runner, the profiler and the measurement engine's worker;
- :func:`timed_runs`: the timed loop, over anything :class:`Runnable`.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Protocol

import numpy as np

from dlbricks.errors import DlbricksError, first_line
from dlbricks.timing.config import RunnerConfig
from dlbricks.timing.fpenv import FloatEnv, denormals_flushed

if TYPE_CHECKING:  # pragma: no cover
    import onnxruntime


def _affinity_string(cores: tuple[int, ...], threads: int) -> str:
    # One entry per pool thread (onnxruntime does not place the calling thread);
    # ids are 1-based. The calling thread keeps cores[0], so pool threads start at
    # cores[1] and wrap round when there are more threads than cores.
    return ";".join(str(cores[(i + 1) % len(cores)] + 1) for i in range(threads - 1))


@dataclass(frozen=True)
class SerializedModel:
    """A serialized model whose external data live in ``weights_dir`` (the weights of
    a :class:`dlbricks.weight_pool.WeightPool`): what the engine hands its workers.

    Attributes:
        data: the serialized ``ModelProto``.
        weights_dir: the folder its external-data locations are relative to.
        weight_bytes: the bytes of weights it names there.
        weight_files: the files of ``weights_dir`` it names (None: all of them). The
            pool grows while sessions open: a file another model is being written to
            may be there, still empty.
    """

    data: bytes
    weights_dir: str
    weight_bytes: int = 0
    weight_files: tuple[str, ...] | None = None


def model_label(model: Any) -> str:
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    graph = getattr(model, "graph", None)
    return f"<model {graph.name}>" if graph is not None and graph.name else "<model>"


def session_options(cfg: RunnerConfig) -> onnxruntime.SessionOptions:
    """onnxruntime ``SessionOptions`` for a runner configuration (threads, execution
    mode, optimisation level, denormals, pool-thread affinities). Every session that
    dlbricks times is created with these, so the profiler's sessions match the runner's."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = cfg.intra_op_threads
    so.inter_op_num_threads = cfg.inter_op_threads
    so.execution_mode = (
        ort.ExecutionMode.ORT_PARALLEL if cfg.execution_mode == "parallel" else ort.ExecutionMode.ORT_SEQUENTIAL
    )
    if cfg.graph_optimization != "default":
        so.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[cfg.graph_optimization]
    so.log_severity_level = 3  # errors only: warnings would drown the CLI's output
    if cfg.denormals_as_zero:
        so.add_session_config_entry("session.set_denormal_as_zero", "1")
    if cfg.cores is not None and cfg.intra_op_threads > 1:
        so.add_session_config_entry("session.intra_op_thread_affinities", _affinity_string(cfg.cores, cfg.intra_op_threads))
    if cfg.intra_op_threads != 1 and not cfg.thread_spinning:
        # Every session has its own pool; the engine holds many, and a pool thread that
        # spins after its run would take the core from the next session's run.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return so


def create_session(
    model: Any, config: RunnerConfig | None = None, *, options: onnxruntime.SessionOptions | None = None
) -> onnxruntime.InferenceSession:
    """Create a CPU ``InferenceSession`` with the options of ``config``.

    Pinning of the calling thread is the caller's business (see
    :func:`prepared_session`); this only adds the pool-thread affinities.

    Args:
        model: a path, serialized bytes, a :class:`SerializedModel` or an ``onnx.ModelProto``.
        config: the runner configuration (defaults to ``RunnerConfig()``).
        options: the session options to use instead of ``session_options(config)``:
            made by :func:`session_options` and then extended (profiling, the saved
            optimised graph), so that the timed settings stay those of ``config``.

    Returns:
        The session.

    Raises:
        DlbricksError: onnxruntime rejects the model or the options (the first line
            of its message; the exception is the cause).
    """
    import onnxruntime as ort

    so = options if options is not None else session_options(config or RunnerConfig())
    if isinstance(model, SerializedModel):
        # onnxruntime would map the pool's files and use the pages in place, so every
        # session would share its weights' memory with every other (and on 4 KiB pages,
        # whatever config.huge_pages says). Handed the files as memory, it copies each
        # weight into its own allocation, as it does a weight inside the model (the
        # mappings go when the options do).
        names, arrays = [], []
        try:
            files = model.weight_files if model.weight_files is not None else sorted(os.listdir(model.weights_dir))
            for name in files:
                with open(os.path.join(model.weights_dir, name), "rb") as f:
                    arrays.append(np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8))
                names.append(name)
        except (OSError, ValueError) as exc:  # ValueError: mmap of an empty file
            raise DlbricksError(f"{model_label(model)}: cannot read its weights in {model.weights_dir}: {exc}") from exc
        so.add_external_initializers_from_files_in_memory(names, arrays, [a.nbytes for a in arrays])
        src: Any = model.data
    elif isinstance(model, (str, os.PathLike)):
        src = os.fspath(model)
    elif isinstance(model, (bytes, bytearray)):
        src = bytes(model)
    else:
        src = model.SerializeToString()
    try:
        return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own pybind exception types
        raise DlbricksError(f"{model_label(model)}: onnxruntime cannot load the model: {first_line(exc)}") from exc


#: The alignment of onnxruntime's CPU allocations (``kAllocAlignment``): every tensor a
#: model's layers pass each other lives at such an address, and so do a session's inputs.
TENSOR_ALIGNMENT = 64


def aligned_copy(a: np.ndarray, alignment: int = TENSOR_ALIGNMENT) -> np.ndarray:
    """``a`` copied into a C-contiguous buffer whose address is a multiple of ``alignment``.

    numpy's buffers are only 16-byte aligned, so where a brick's input lands relative to
    the output onnxruntime allocates (64-byte aligned) was luck of the session; and a
    copy whose destination lies 8 to 24 bytes past its source modulo 4 KiB runs 8 to 13
    times slower on AMD Zen cores (a Reshape brick, a plain copy: 150 us against 20 us,
    whole sessions in one state or the other). Inside a model both ends of such a copy
    are onnxruntime's, aligned, so its bricks' inputs must be too."""
    a = np.asarray(a)
    if a.dtype.hasobject or a.nbytes == 0:
        return np.ascontiguousarray(a)
    raw = np.empty(a.nbytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


class BoundSession:
    """A session with its inputs and outputs bound once, ready to run repeatedly.

    Inputs live in pre-allocated ``OrtValue`` objects, at aligned addresses
    (:func:`aligned_copy`), as a model's intermediate tensors are. Outputs are bound to
    buffers too, so every run writes into the same ones and an iteration allocates
    nothing on the Python side: allocated up front when the session declares every
    output's type and shape, so that binding costs one run (for a whole model of
    seconds, one run fewer before its timing starts); otherwise those the first run
    produced, bound back and checked by a second. onnxruntime cannot bind string
    tensors; a model with string inputs or outputs falls back to ``session.run``
    (``uses_iobinding`` is then False). ``bind_runs``: the runs binding took.
    """

    def __init__(self, session: onnxruntime.InferenceSession, feeds: Mapping[str, np.ndarray]):
        import onnxruntime as ort

        self.session = session
        self._out_names = [o.name for o in session.get_outputs()]
        arrays = {n: aligned_copy(a) for n, a in feeds.items()}
        #: The bound inputs (the aligned copies onnxruntime reads).
        self.feeds = arrays
        has_strings = any(a.dtype.kind in "OU" for a in arrays.values()) or any(
            o.type == "tensor(string)" for o in session.get_outputs()
        )
        self.uses_iobinding = not has_strings
        if has_strings:
            self._last: list[Any] = session.run(None, arrays)
            self.bind_runs = 1
            self.run_fn: Any = session.run
            self.run_args: tuple[Any, Any] = (None, arrays)
            return
        self._values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in arrays.items()}
        self._binding = session.io_binding()
        for name, value in self._values.items():
            self._binding.bind_ortvalue_input(name, value)
        self.bind_runs = 0
        if not self._bind_declared_outputs(session):
            self._bind_produced_outputs(session)
        # The public run_with_iobinding wraps the C++ call in WebGPU graph-capture
        # bookkeeping (several Python calls); on CPU the raw call does the same work,
        # so use it when available to keep Python off the clock.
        raw_sess = getattr(session, "_sess", None)
        raw_binding = getattr(self._binding, "_iobinding", None)
        if raw_sess is not None and raw_binding is not None and hasattr(raw_sess, "run_with_iobinding"):
            self.run_fn = raw_sess.run_with_iobinding
            self.run_args = (raw_binding, None)
        else:
            self.run_fn = session.run_with_iobinding
            self.run_args = (self._binding, None)

    def _bind_declared_outputs(self, session: onnxruntime.InferenceSession) -> bool:
        """Bind a new buffer to every output and run once, when the session declares
        every output's tensor type and static shape; False (nothing bound) otherwise,
        or when that run fails (a declared shape the model does not produce)."""
        import onnxruntime as ort

        from dlbricks.timing.inputs import ORT_TYPES

        declared = []
        for meta in session.get_outputs():
            dtype = ORT_TYPES.get(meta.type)
            shape = meta.shape
            if dtype is None or dtype is np.str_ or not all(isinstance(d, int) and d >= 0 for d in shape):
                return False
            declared.append((meta.name, [int(d) for d in shape], dtype))
        try:
            for name, shape, dtype in declared:
                self._binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype))
            self._bind_run(session)
        except Exception:  # noqa: BLE001 - the other way binds what a run produces
            self._binding.clear_binding_outputs()
            return False
        return True

    def _bind_produced_outputs(self, session: onnxruntime.InferenceSession) -> None:
        """Bind the outputs a first run produced, checked by a second; where they cannot
        be bound back (e.g. sequence outputs), let onnxruntime allocate them per run."""
        self._bind_outputs_to_cpu()
        self._bind_run(session)
        produced = self._binding.get_outputs()
        try:
            self._binding.clear_binding_outputs()
            for name, value in zip(self._out_names, produced):
                self._binding.bind_ortvalue_output(name, value)
            self._bind_run(session)
        except Exception:
            self._binding.clear_binding_outputs()
            self._bind_outputs_to_cpu()
            self._bind_run(session)

    def _bind_outputs_to_cpu(self) -> None:
        for name in self._out_names:
            self._binding.bind_output(name, "cpu")

    def _bind_run(self, session: onnxruntime.InferenceSession) -> None:
        # Through the public API, which validates that the binding belongs to this
        # session; ``bind_runs`` counts the runs that completed.
        session.run_with_iobinding(self._binding)
        self.bind_runs += 1

    def run(self) -> None:
        """Run once (the timed loop inlines this call)."""
        a, b = self.run_args
        if self.uses_iobinding:
            self.run_fn(a, b)
        else:
            self._last = self.run_fn(a, b)

    def outputs(self) -> dict[str, np.ndarray]:
        """The outputs of the latest run (of :meth:`run` or the binding runs), as numpy."""
        if not self.uses_iobinding:
            return {n: np.asarray(v) for n, v in zip(self._out_names, self._last)}
        return {n: v.numpy() for n, v in zip(self._out_names, self._binding.get_outputs())}


def bind(session: onnxruntime.InferenceSession, feeds: Mapping[str, np.ndarray]) -> BoundSession:
    """Bind ``feeds`` and the outputs of ``session`` (runs the session once, or twice
    where its outputs do not declare their shapes; see :class:`BoundSession`).

    Raises:
        DlbricksError: a run fails (bad input, kernel error).
    """
    try:
        return BoundSession(session, feeds)
    except Exception as exc:
        raise DlbricksError(f"cannot run the session with IOBinding: {exc}") from exc


@contextlib.contextmanager
def pinned(cores: tuple[int, ...] | None) -> Iterator[None]:
    """The calling thread on ``cores`` (None: left alone) until exit, then back where it was.

    Raises:
        DlbricksError: the platform cannot pin, or the cores are not allowed.
    """
    if cores is None:
        yield
        return
    old = _set_affinity(cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def _set_affinity(cores: Iterable[int]) -> set[int]:
    """Pin this thread to ``cores``; returns where it was allowed before.

    Raises:
        DlbricksError: the platform cannot pin, or the cores are not allowed.
    """
    if not hasattr(os, "sched_setaffinity"):
        raise DlbricksError("pinning cores needs os.sched_setaffinity (Linux)")
    old = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, set(cores))
    except OSError as exc:
        raise DlbricksError(f"cannot pin to cores {sorted(cores)} (allowed: {sorted(old)}): {exc}") from exc
    return old


def pin_process(config: RunnerConfig) -> None:
    """Pin this process for good (a worker that times sessions for its whole life):
    to ``config.cores``, or to ``cores[0]`` alone when onnxruntime's pool threads own
    the others (see :func:`prepare_session`). Nothing when no cores are configured.

    Raises:
        DlbricksError: the platform cannot pin, or the cores are not allowed.
    """
    if config.cores is not None:
        _set_affinity(config.cores[:1] if config.intra_op_threads > 1 else config.cores)


def source_nbytes(source: Any) -> int:
    """The size of a serialized model or model file, with the raw weights file that
    :func:`dlbricks.bricks.write_brick` puts beside it (``path + '.data'``): its
    weights, to within the few kilobytes of its graph. 0 for anything else."""
    if isinstance(source, SerializedModel):
        return len(source.data) + source.weight_bytes
    if isinstance(source, (bytes, bytearray, memoryview)):
        return len(source)
    try:
        path = os.fspath(source)
    except TypeError:
        return 0
    total = 0
    for p in (path, f"{path}.data"):
        with contextlib.suppress(OSError):
            total += os.path.getsize(p)
    return total


@dataclass(frozen=True)
class PreparedSession:
    """A session ready to be timed (see :func:`prepare_session`).

    Attributes:
        session: the ``InferenceSession``.
        bound: the session bound to ``feeds``.
        feeds: the inputs, given or synthesised, as bound (aligned copies).
        denormals_flushed: whether flush-to-zero was in effect on the calling thread
            right after creation (with one intra-op thread the kernels run there).
    """

    session: Any
    bound: BoundSession
    feeds: dict[str, np.ndarray]
    denormals_flushed: bool


def prepare_session(
    model: Any,
    config: RunnerConfig,
    fenv: FloatEnv,
    *,
    inputs: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    int_bounds: Mapping[str, int] | None = None,
    options: onnxruntime.SessionOptions | None = None,
) -> PreparedSession:
    """Create, set flush-to-zero, synthesise the feeds, bind; then move the calling
    thread to ``config.cores[0]`` when onnxruntime's pool threads own the other cores.

    For a caller that holds the pinning (the thread on ``config.cores``) and the FP
    environment ``fenv`` itself, such as the engine's worker, whose sessions outlive
    their set-up; everyone else uses :func:`prepared_session`.

    Args:
        model: a path, serialized bytes or an ``onnx.ModelProto``.
        config: the runner configuration.
        fenv: the calling thread's FP environment, whose flush mode is set here.
        inputs, seed, int_bounds: as for :func:`dlbricks.timing.inputs.session_feeds`.
        options: as for :func:`create_session`.

    Raises:
        DlbricksError: the model cannot be loaded or bound, or ``inputs`` names an
            unknown input.
    """
    from dlbricks.timing.inputs import session_feeds

    session = create_session(model, config, options=options)
    # After creation: the first session of the process sets the mode from its own
    # options, and this configuration's is wanted.
    fenv.set_flush(config.denormals_as_zero)
    flushed = denormals_flushed()
    feeds = session_feeds(session, model, inputs, seed, int_bounds)
    bound = bind(session, feeds)
    if config.cores is not None and config.intra_op_threads > 1:
        # Pool threads own cores[1:] (see _affinity_string); keep the calling thread,
        # which also computes, off them.
        os.sched_setaffinity(0, {config.cores[0]})
    return PreparedSession(session, bound, bound.feeds, flushed)


@contextlib.contextmanager
def prepared_session(
    model: Any,
    config: RunnerConfig,
    *,
    inputs: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    int_bounds: Mapping[str, int] | None = None,
    options: onnxruntime.SessionOptions | None = None,
) -> Iterator[PreparedSession]:
    """A session set up as every timed run is: the calling thread pinned to
    ``config.cores``, the session created, flush-to-zero as configured, the feeds
    synthesised and bound, the calling thread on ``cores[0]`` when there are pool
    threads (:func:`prepare_session`).

    The pinning and the flush mode last until exit; then the thread's affinity and FP
    environment are put back (onnxruntime's first session sets flush-to-zero on the
    calling thread and never undoes it).

    Yields:
        The :class:`PreparedSession`.

    Raises:
        DlbricksError: pinning fails, or as for :func:`prepare_session`.
    """
    fenv = FloatEnv()
    try:
        with pinned(config.cores):
            yield prepare_session(
                model, config, fenv, inputs=inputs, seed=seed, int_bounds=int_bounds, options=options
            )
    finally:
        fenv.restore()


class Runnable(Protocol):
    """What :func:`timed_runs` runs: ``run_fn(*run_args)``, always two arguments. A
    :class:`BoundSession` is one; peaks' numpy kernels and the hw level's counted
    runs are others."""

    @property
    def run_fn(self) -> Callable[[Any, Any], object]: ...
    @property
    def run_args(self) -> tuple[Any, Any]: ...


def timed_runs(
    bound: Runnable,
    count: int = 0,
    *,
    until_ns: int = 0,
    out: list[int] | None = None,
    clock: Callable[[], int] = time.perf_counter_ns,
    starts: list[int] | None = None,
) -> list[int]:
    """The one timed loop: run ``bound`` at least ``count`` times and until
    ``time.perf_counter_ns()`` passes ``until_ns``, timing each run on its own.

    An iteration is two clock reads around one call into onnxruntime, one append and
    one comparison: every ``run_fn`` takes exactly two arguments, so the call on the
    clock is a plain two-argument call. The garbage collector is off inside the loop,
    since a collection there would be a spurious outlier.

    Args:
        bound: the bound session, or any :class:`Runnable`.
        count: the fewest runs.
        until_ns: keep running until the clock passes this (0: ``count`` runs only).
        out: append the durations (ns) here instead of to a new list.
        clock: what a duration is read from (``time.perf_counter_ns``, or
            ``time.thread_time_ns`` for the calling thread's CPU time); ``until_ns``
            is always a ``perf_counter_ns`` time.
        starts: append each run's start (``perf_counter_ns``) here, after the run's
            clock has stopped; a run then lies in (start, start + duration) when
            ``clock`` is the wall clock.

    Returns:
        The list the durations were appended to.
    """
    run, (a, b) = bound.run_fn, bound.run_args
    wall = time.perf_counter_ns
    times: list[int] = [] if out is None else out
    append = times.append
    gc_on = gc.isenabled()
    gc.disable()
    try:
        if starts is not None:
            # A loop of its own, so the plain loop below stays as lean as it is.
            mark = starts.append
            same = clock is wall
            n = 0
            while n < count or (until_ns and wall() < until_ns):
                if same:
                    t0 = clock()
                    run(a, b)
                    append(clock() - t0)
                    mark(t0)
                else:
                    s = wall()
                    t0 = clock()
                    run(a, b)
                    append(clock() - t0)
                    mark(s)
                n += 1
            return times
        for _ in range(count):
            t0 = clock()
            run(a, b)
            append(clock() - t0)
        if until_ns and clock is wall:
            t1 = clock()
            while t1 < until_ns:
                t0 = clock()
                run(a, b)
                t1 = clock()
                append(t1 - t0)
        elif until_ns:
            while wall() < until_ns:
                t0 = clock()
                run(a, b)
                append(clock() - t0)
    finally:
        if gc_on:
            gc.enable()
    return times
