"""Timing: how one session is created, bound, pinned and timed on the CPU.

- :mod:`.config`  the runner configuration (what keys a result, when sampling stops)
- :mod:`.session` the one session factory, IOBinding, core pinning, set-up and timed loop
- :mod:`.inputs`  synthetic inputs
- :mod:`.stats`   statistics of iteration times
- :mod:`.fpenv`   denormals and the flush-to-zero mode
- :mod:`.runner`  :class:`Runner`, :class:`Measurement`, :class:`Failure`
- :mod:`.workers` crash- and hang-isolated worker processes (the generic worker loop)
- :mod:`.engine`, :mod:`.engine_worker` the measurement engine: many sessions at once,
  interleaved rounds, sampling allocated to a stated precision
- :mod:`.calibration` the fixed cost of one run, measured to be subtracted
- :mod:`.sysinfo` the system fingerprint that keys results per machine
"""

from __future__ import annotations

from dlbricks.timing.config import RunnerConfig
from dlbricks.timing.fpenv import count_denormals
from dlbricks.timing.inputs import make_inputs
from dlbricks.timing.runner import Failure, Measurement, Runner
from dlbricks.timing.session import (
    BoundSession,
    PreparedSession,
    bind,
    create_session,
    model_label,
    pinned,
    prepared_session,
    session_options,
    timed_runs,
)
from dlbricks.timing.stats import Stats, median_ci_ranks, summarize

__all__ = [
    "BoundSession",
    "Failure",
    "Measurement",
    "PreparedSession",
    "Runner",
    "RunnerConfig",
    "Stats",
    "bind",
    "count_denormals",
    "create_session",
    "make_inputs",
    "median_ci_ranks",
    "model_label",
    "pinned",
    "prepared_session",
    "session_options",
    "summarize",
    "timed_runs",
]
