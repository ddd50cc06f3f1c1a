"""The profiler's sessions: :mod:`dlbricks.timing.session`'s options, binding,
pinning and timed loop, with what profiling adds to them.

Every session the profiler times is set up as :meth:`dlbricks.timing.Runner.time`
sets up its own (pinned to the configuration's cores, flush-to-zero as configured,
synthetic inputs bound once, the calling thread off the pool threads' cores), so a
profiled run differs from a timed one only by what is being profiled. Profiling adds
two session options (onnxruntime's profiler, the saved executed graph) and needs
where each run lies in time, not only how long it took, to place it in the trace.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from dlbricks.errors import DlbricksError
from dlbricks.timing import RunnerConfig, bind, create_session, make_inputs, session_options
from dlbricks.timing.fpenv import FloatEnv
from dlbricks.timing.session import BoundSession, pinned, timed_runs

if TYPE_CHECKING:  # pragma: no cover
    import onnxruntime

__all__ = ["first_line", "open_session", "prepared", "timed_intervals", "timing_env", "warm"]


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (onnxruntime's run on for pages)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def open_session(
    model_bytes: bytes,
    cfg: RunnerConfig,
    *,
    profile_prefix: str | None = None,
    executed_graph_path: str | None = None,
) -> onnxruntime.InferenceSession:
    """A CPU session with the runner's options (:func:`~dlbricks.timing.session_options`),
    optionally profiling and/or saving the graph onnxruntime executes (its weights go
    to a side file, never read back).

    Raises:
        DlbricksError: onnxruntime rejects the model.
    """
    if profile_prefix is None and executed_graph_path is None:
        return create_session(model_bytes, cfg)
    import onnxruntime as ort

    so = session_options(cfg)
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    if executed_graph_path is not None:
        so.optimized_model_filepath = executed_graph_path
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", os.path.basename(executed_graph_path) + ".data"
        )
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    try:
        return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own pybind types
        raise DlbricksError(f"onnxruntime cannot load the model: {first_line(exc)}") from exc


@contextlib.contextmanager
def timing_env(cfg: RunnerConfig) -> Iterator[FloatEnv]:
    """Pinned to ``cfg.cores``; this thread's floating-point environment is put back
    on exit, since onnxruntime's first session sets flush-to-zero on the calling
    thread and never undoes it."""
    fenv = FloatEnv()
    try:
        with pinned(cfg.cores):
            yield fenv
    finally:
        fenv.restore()


@contextlib.contextmanager
def prepared(
    model_bytes: bytes,
    cfg: RunnerConfig,
    *,
    seed: int = 0,
    int_bounds: Mapping[str, int] | None = None,
    profile_prefix: str | None = None,
    executed_graph_path: str | None = None,
) -> Iterator[tuple[Any, BoundSession]]:
    """A session bound to synthetic inputs, in the conditions the runner times under.

    Yields:
        ``(session, bound)``; the pinning and the FP environment last until exit.

    Raises:
        DlbricksError: onnxruntime rejects the model, a run fails, or pinning fails.
    """
    with timing_env(cfg) as fenv:
        session = open_session(model_bytes, cfg, profile_prefix=profile_prefix, executed_graph_path=executed_graph_path)
        # After creation: the first session of the process sets the mode from its
        # own options, and this configuration's is wanted.
        fenv.set_flush(cfg.denormals_as_zero)
        bound = bind(session, make_inputs(model_bytes, seed, int_bounds=int_bounds))
        if cfg.cores is not None and cfg.intra_op_threads > 1:
            # The pool threads own cores[1:] (session_options places them); the
            # calling thread computes too, so it keeps cores[0] to itself.
            os.sched_setaffinity(0, {cfg.cores[0]})
        yield session, bound


def warm(bound: BoundSession, count: int) -> None:
    """``count`` discarded runs."""
    timed_runs(bound, count)


def timed_intervals(bound: Any, count: int) -> list[tuple[int, int]]:
    """``count`` runs of :func:`~dlbricks.timing.session.timed_runs`, each as its
    ``(start, end)`` in ``time.perf_counter_ns``.

    The trace places every run, so each run is timed by a call of its own with a
    clock read just before it: the interval is (that read, that read + the run's
    duration), the duration exactly what the one timed loop measured and the start
    early by the loop's own set-up (well under a microsecond).

    Args:
        bound: a :class:`BoundSession`, or anything with the same ``run_fn`` and
            two ``run_args``.
        count: how many runs.
    """
    clock = time.perf_counter_ns
    out: list[tuple[int, int]] = []
    for _ in range(count):
        t0 = clock()
        (d,) = timed_runs(bound, 1)
        out.append((t0, t0 + d))
    return out
