"""The profiler's sessions: :mod:`dlbricks.timing.session`'s factory, set-up and timed
loop, with what profiling adds to them.

Every session the profiler times is set up by :func:`dlbricks.timing.prepared_session`,
as :meth:`dlbricks.timing.Runner.time` sets up its own (pinned to the configuration's
cores, flush-to-zero as configured, synthetic inputs bound once, the calling thread off
the pool threads' cores), so a profiled run differs from a timed one only by what is
being profiled. Profiling adds two session options (onnxruntime's profiler, the saved
executed graph) and needs where each run lies in time, not only how long it took, to
place it in the trace.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from dlbricks.timing import RunnerConfig, create_session, pinned, prepared_session, session_options, timed_runs
from dlbricks.timing.fpenv import FloatEnv
from dlbricks.timing.session import BoundSession, Runnable

if TYPE_CHECKING:  # pragma: no cover
    import onnxruntime

__all__ = ["open_session", "prepared", "timed_intervals", "timing_env", "warm"]


def _profiling_options(
    cfg: RunnerConfig, profile_prefix: str | None, executed_graph_path: str | None
) -> onnxruntime.SessionOptions | None:
    """The runner's options (:func:`~dlbricks.timing.session_options`) plus onnxruntime's
    profiler and/or the saved executed graph (its weights go to a side file, never read
    back); None when neither is asked for."""
    if profile_prefix is None and executed_graph_path is None:
        return None
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
    return so


def open_session(
    model_bytes: bytes,
    cfg: RunnerConfig,
    *,
    profile_prefix: str | None = None,
    executed_graph_path: str | None = None,
) -> onnxruntime.InferenceSession:
    """A CPU session with the runner's options (:func:`~dlbricks.timing.session_options`),
    optionally profiling and/or saving the graph onnxruntime executes.

    Raises:
        DlbricksError: onnxruntime rejects the model.
    """
    return create_session(model_bytes, cfg, options=_profiling_options(cfg, profile_prefix, executed_graph_path))


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
    """A session bound to synthetic inputs, in the conditions the runner times under
    (:func:`~dlbricks.timing.prepared_session`).

    Yields:
        ``(session, bound)``; the pinning and the FP environment last until exit.

    Raises:
        DlbricksError: onnxruntime rejects the model, a run fails, or pinning fails.
    """
    options = _profiling_options(cfg, profile_prefix, executed_graph_path)
    with prepared_session(model_bytes, cfg, seed=seed, int_bounds=int_bounds, options=options) as prep:
        yield prep.session, prep.bound


def warm(bound: Runnable, count: int) -> None:
    """``count`` discarded runs."""
    timed_runs(bound, count)


def timed_intervals(bound: Runnable, count: int) -> list[tuple[int, int]]:
    """``count`` runs of :func:`~dlbricks.timing.timed_runs`, each as its ``(start, end)``
    in ``time.perf_counter_ns``: the start is the run's first clock read, the end that
    plus the duration the timed loop measured.

    Args:
        bound: a :class:`BoundSession`, or any :class:`~dlbricks.timing.session.Runnable`.
        count: how many runs.
    """
    starts: list[int] = []
    durations = timed_runs(bound, count, starts=starts)
    return [(t0, t0 + d) for t0, d in zip(starts, durations)]
