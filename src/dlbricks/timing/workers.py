"""Run timing jobs in a worker process, so that a bad brick cannot take the run down.

A brick may crash onnxruntime (a kernel that segfaults or aborts on an odd shape)
or hang. Each job therefore runs in a separate worker process; the parent only
waits on a pipe. A crash or a timeout is recorded as a :class:`Failure` for that
job, the worker is restarted, and the run goes on.

Timing integrity: jobs run strictly one at a time, in one worker, so two timings
never share the pinned cores. The worker is reused across jobs (the ~1 s start-up
of Python + onnxruntime is paid once, not per brick) and replaced only after a
crash or a timeout.

Workers are started with the ``spawn`` context: onnxruntime's thread pools do not
survive ``fork``, and the parent may already hold sessions.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from dlbricks.errors import DlbricksError
from dlbricks.timing.config import RunnerConfig
from dlbricks.timing.runner import Failure, Measurement, Runner

__all__ = ["Failure", "Job", "RunSummary", "run_isolated"]

#: How long a fresh worker may take to import onnxruntime and report ready.
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Job:
    """One model to time.

    Attributes:
        id: the caller's name for the job (e.g. the brick digest).
        path: the ONNX file.
        int_bounds: bounds for integer inputs (see :func:`dlbricks.timing.make_inputs`).
        seed: the input seed.
        hook: ``"module:function"`` called without arguments in the worker before
            the job runs; a diagnostic/test seam (``"os:abort"`` simulates a crash,
            ``"signal:pause"`` a hang).
    """

    id: str
    path: str
    int_bounds: Mapping[str, int] | None = field(default=None, hash=False)
    seed: int = 0
    hook: str | None = None


@dataclass
class RunSummary:
    """Counts for one :func:`run_isolated` call."""

    ok: int = 0
    failed: int = 0
    worker_starts: int = 0


def _call_hook(spec: str) -> None:
    module, _, name = spec.partition(":")
    fn = getattr(importlib.import_module(module), name)
    fn()


def _worker_main(conn: Any, config: dict[str, Any]) -> None:
    """Worker loop: receive a Job, send back ("ok", measurement dict) or ("failed", failure dict)."""
    # Ctrl-C reaches the whole process group; the parent decides what to do and
    # kills us, so a half-finished timing is never reported as a result.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runner = Runner(RunnerConfig.from_dict(config))
    import onnxruntime  # noqa: F401  (paid before "ready", so not on any job's clock)

    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            if job.hook:
                _call_hook(job.hook)
            m = runner.time(job.path, seed=job.seed, int_bounds=job.int_bounds)
            conn.send(("ok", m.to_dict()))
        except Exception as exc:  # every error becomes this job's failure
            msg = str(exc) if isinstance(exc, DlbricksError) else f"{job.path}: {type(exc).__name__}: {exc}"
            conn.send(("failed", Failure(msg, "error", None, time.perf_counter() - t0).to_dict()))


def start_worker(
    ctx: Any, target: Callable[..., None], args: tuple, *, name: str, what: str, start_timeout_s: float
) -> tuple[Any, Any, Any]:
    """Start a worker process and wait for its ``("ready", payload)`` handshake.

    ``target`` receives its end of a duplex pipe as the first argument, then ``args``.

    Returns:
        (process, the parent's connection, the ready payload).
    Raises:
        DlbricksError: the worker did not start in time, died, or broke the protocol
            (``what`` names it in the message); the process is gone then.
    """
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
    proc.start()
    # Drop our copy of the child's end, or a dead worker would never read as EOF.
    child.close()

    def abandon() -> None:
        if proc.is_alive():
            proc.kill()
        proc.join(5.0)
        parent.close()

    if not parent.poll(start_timeout_s):
        abandon()
        raise DlbricksError(f"{what} did not start within {start_timeout_s:.0f} s")
    try:
        tag, payload = parent.recv()
    except (EOFError, OSError):
        abandon()
        raise DlbricksError(f"{what} died while starting ({_describe_exit(proc.exitcode)})") from None
    if tag != "ready":  # pragma: no cover - protocol error
        abandon()
        raise DlbricksError(f"{what} sent {tag!r} instead of 'ready'")
    return proc, parent, payload


class _Worker:
    def __init__(self, ctx: Any, config: RunnerConfig, start_timeout_s: float):
        self.proc, self.conn, _ = start_worker(
            ctx, _worker_main, (config.to_dict(),), name="dlbricks-worker", what="timing worker",
            start_timeout_s=start_timeout_s,
        )

    def exitcode(self) -> int | None:
        self.proc.join(5.0)
        return self.proc.exitcode

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, EOFError):
            pass
        self.proc.join(5.0)
        self.kill()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_isolated(
    jobs: Iterable[Job],
    config: RunnerConfig,
    *,
    on_result: Callable[[Job, Measurement | Failure], None],
    timeout_s: float | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
) -> RunSummary:
    """Time jobs one at a time in a worker process; report each result as it arrives.

    Args:
        jobs: the jobs (consumed lazily, so a generator may depend on earlier results).
        config: the runner configuration (pinning applies inside the worker).
        on_result: called in this process with each job and its :class:`Measurement`
            or :class:`Failure`, right after the job ends (store it there).
        timeout_s: per-job limit, session creation included; default
            ``config.timeout_s``. A job past it is killed and recorded as failed.
        start_timeout_s: how long a worker may take to start.

    Returns:
        A :class:`RunSummary`.

    Raises:
        DlbricksError: a worker cannot be started at all.
        Exception: whatever ``on_result`` raises (the worker is shut down first).
    """
    limit = config.timeout_s if timeout_s is None else float(timeout_s)
    ctx = mp.get_context("spawn")
    summary = RunSummary()
    worker: _Worker | None = None
    try:
        for job in jobs:
            if worker is None:
                worker = _Worker(ctx, config, start_timeout_s)
                summary.worker_starts += 1
            t0 = time.perf_counter()
            result: Measurement | Failure
            try:
                worker.conn.send(job)
                ready = worker.conn.poll(limit)
            except (OSError, EOFError):
                ready = True  # the worker is gone: recv below reports the crash
            if not ready:
                worker.kill()
                worker = None
                result = Failure(f"{job.path}: timed out after {limit:g} s", "timeout", None, time.perf_counter() - t0)
            else:
                try:
                    tag, payload = worker.conn.recv()
                except (EOFError, OSError):
                    code = worker.exitcode()
                    worker.kill()
                    worker = None
                    result = Failure(
                        f"{job.path}: worker crashed ({_describe_exit(code)})", "crash", code, time.perf_counter() - t0
                    )
                else:
                    result = Measurement.from_dict(payload) if tag == "ok" else Failure.from_dict(payload)
            if isinstance(result, Measurement):
                summary.ok += 1
            else:
                summary.failed += 1
            on_result(job, result)
    finally:
        if worker is not None:
            worker.stop()
    return summary
