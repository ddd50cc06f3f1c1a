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

The loop itself is generic, and the profiler's hw worker uses it too: in the child,
:func:`serve` answers each job with one reply until told to stop; in the parent,
:func:`run_with_restart` sends the jobs one at a time to a :class:`Worker`, waits for
each reply within a limit, and replaces the worker after a crash or a timeout.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, TypeVar

from dlbricks.errors import DlbricksError
from dlbricks.timing.config import RunnerConfig
from dlbricks.timing.runner import Failure, Measurement, Runner

__all__ = ["Failure", "Job", "Reply", "RunSummary", "Worker", "run_isolated", "run_with_restart", "serve", "start_worker"]

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


def serve(conn: Any, handle: Callable[[Any], tuple[Any, ...]]) -> None:
    """The child's side of every worker loop (the runner's, the profiler's hw worker,
    the measurement engine's): say ``("ready", pid)``, then answer every request
    received with ``handle(request)``, a reply tuple led by its tag, until ``None`` or
    the end of the pipe.

    ``handle`` turns a job's own errors into its reply; whatever it raises ends the
    worker, which the parent then sees as a crash.
    """
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        conn.send(handle(job))


def _worker_main(conn: Any, config: dict[str, Any]) -> None:
    """Worker: receive a Job, send back ("ok", measurement dict) or ("failed", failure dict)."""
    # Ctrl-C reaches the whole process group; the parent decides what to do and
    # kills us, so a half-finished timing is never reported as a result.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runner = Runner(RunnerConfig.from_dict(config))
    import onnxruntime  # noqa: F401  (paid before "ready", so not on any job's clock)

    def handle(job: Job) -> tuple[str, Any]:
        t0 = time.perf_counter()
        try:
            if job.hook:
                _call_hook(job.hook)
            m = runner.time(job.path, seed=job.seed, int_bounds=job.int_bounds)
            return "ok", m.to_dict()
        except Exception as exc:  # every error becomes this job's failure
            msg = str(exc) if isinstance(exc, DlbricksError) else f"{job.path}: {type(exc).__name__}: {exc}"
            return "failed", Failure(msg, "error", None, time.perf_counter() - t0).to_dict()

    serve(conn, handle)


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
        raise DlbricksError(f"{what} died while starting ({describe_exit(proc.exitcode)})") from None
    if tag != "ready":  # pragma: no cover - protocol error
        abandon()
        raise DlbricksError(f"{what} sent {tag!r} instead of 'ready'")
    return proc, parent, payload


@dataclass(frozen=True)
class Reply:
    """What one job came to in the parent.

    Attributes:
        tag, payload: the worker's reply; both None when there was none.
        lost: None for a reply; ``"timeout"`` (the worker was killed at the limit) or
            ``"crash"`` (the worker died) otherwise, and the worker is then gone.
        exitcode: the worker's exit code when it was lost (negative: a signal).
        wall_s: from sending the job to the reply or the loss.
    """

    tag: str | None
    payload: Any
    lost: str | None = None
    exitcode: int | None = None
    wall_s: float = 0.0


class Worker:
    """A worker process started with :func:`start_worker`, and the parent's end of its pipe.

    Attributes:
        proc, conn: the process and the connection.
        ready: the payload of the worker's ``("ready", payload)`` handshake.
    """

    def __init__(
        self, ctx: Any, target: Callable[..., None], args: tuple, *, name: str, what: str, start_timeout_s: float
    ):
        self.proc, self.conn, self.ready = start_worker(
            ctx, target, args, name=name, what=what, start_timeout_s=start_timeout_s
        )

    def call(self, job: Any, timeout_s: float) -> Reply:
        """Send ``job`` and wait up to ``timeout_s`` for its reply; a worker that does
        not answer in time is killed, one that died is cleaned up (both then gone)."""
        t0 = time.perf_counter()
        try:
            self.conn.send(job)
            ready = self.conn.poll(timeout_s)
        except (OSError, EOFError):
            ready = True  # the worker is gone: recv below reports the crash
        if not ready:
            self.kill()
            return Reply(None, None, "timeout", self.proc.exitcode, time.perf_counter() - t0)
        try:
            tag, payload = self.conn.recv()
        except (EOFError, OSError):
            code = self.exitcode()
            self.kill()
            return Reply(None, None, "crash", code, time.perf_counter() - t0)
        return Reply(tag, payload, None, None, time.perf_counter() - t0)

    def exitcode(self) -> int | None:
        self.proc.join(5.0)
        return self.proc.exitcode

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)
        self.conn.close()

    def stop(self, *, last_message_s: float = 0.0, join_s: float = 5.0) -> tuple[str, Any] | None:
        """Tell the worker to stop (``None``), then make sure it is gone.

        Args:
            last_message_s: how long to wait for a message the worker sends as it stops
                (0: none is expected).
            join_s: how long it may take to exit before it is killed.

        Returns:
            That last ``(tag, payload)``, or None.
        """
        last = None
        try:
            self.conn.send(None)
            if last_message_s > 0 and self.conn.poll(last_message_s):
                last = self.conn.recv()
        except (OSError, EOFError):
            pass
        self.proc.join(join_s)
        self.kill()
        return last


J = TypeVar("J")


def run_with_restart(
    jobs: Iterable[J],
    start: Callable[[], Worker],
    on_reply: Callable[[J, Reply], None],
    *,
    timeout_s: float,
    stop: Callable[[Worker], object] = Worker.stop,
) -> int:
    """The parent's side of the worker loop: each job to a worker in turn, a fresh
    worker after one is lost.

    Args:
        jobs: the jobs (consumed lazily, so a generator may depend on earlier replies).
        start: starts a worker (called for the first job and after each loss).
        on_reply: called with each job and its :class:`Reply` as soon as it ends.
        timeout_s: the limit for one job's reply.
        stop: how the last worker is stopped (also when ``on_reply`` raises).

    Returns:
        How many workers were started.

    Raises:
        Exception: whatever ``start`` or ``on_reply`` raises.
    """
    starts = 0
    worker: Worker | None = None
    try:
        for job in jobs:
            if worker is None:
                worker = start()
                starts += 1
            reply = worker.call(job, timeout_s)
            if reply.lost is not None:
                worker = None
            on_reply(job, reply)
    finally:
        if worker is not None:
            stop(worker)
    return starts


def describe_exit(code: int | None) -> str:
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

    def start() -> Worker:
        return Worker(
            ctx, _worker_main, (config.to_dict(),), name="dlbricks-worker", what="timing worker",
            start_timeout_s=start_timeout_s,
        )

    def on_reply(job: Job, reply: Reply) -> None:
        result: Measurement | Failure
        if reply.lost == "timeout":
            result = Failure(f"{job.path}: timed out after {limit:g} s", "timeout", None, reply.wall_s)
        elif reply.lost == "crash":
            code = reply.exitcode
            result = Failure(f"{job.path}: worker crashed ({describe_exit(code)})", "crash", code, reply.wall_s)
        else:
            result = Measurement.from_dict(reply.payload) if reply.tag == "ok" else Failure.from_dict(reply.payload)
        if isinstance(result, Measurement):
            summary.ok += 1
        else:
            summary.failed += 1
        on_result(job, result)

    summary.worker_starts = run_with_restart(jobs, start, on_reply, timeout_s=limit)
    return summary
