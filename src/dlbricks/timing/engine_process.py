"""The parent's handle on one measurement-engine worker process.

The engine (:mod:`dlbricks.timing.engine`) decides what to measure; this module only
starts a worker (a fresh interpreter running :mod:`dlbricks.timing.engine_worker`),
sends it requests, and turns a dead or hung worker into :class:`WorkerDied`, naming
the session it was running from the shared beacon file.
"""

from __future__ import annotations

import os
import queue
import struct
import subprocess
import sys
import tempfile
import threading
from multiprocessing.connection import Connection
from typing import Any

from dlbricks.errors import DlbricksError
from dlbricks.timing.config import RunnerConfig
from dlbricks.timing.heap import TUNABLES, with_tunables
from dlbricks.timing.workers import describe_exit

__all__ = ["WorkerDied", "WorkerProcess", "spool_dir", "worker_env"]

_CLOSE = object()  # tells a worker's sender thread to end
#: Serialized models larger than this go to the worker through a file (see WorkerProcess.send).
_SPOOL_BYTES = 256 << 10


def spool_dir() -> str | None:
    """Where files handed to a worker go: tmpfs when there is one (a copy in memory,
    never on disk), else None (the system's temporary folder)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def spool_prefix(kind: str) -> str:
    """The name prefix of this process's spooled files and folders of ``kind``: it
    carries the process id, so that :func:`remove_stale_spools` can tell whose they are."""
    return f"dlbricks-{kind}-{os.getpid()}-"


def remove_stale_spools() -> int:
    """Remove the spooled files and folders of dlbricks processes that no longer run (a
    run killed with ``kill -9`` cannot clean up, and on tmpfs what it left holds
    memory: gigabytes of generated models for a large corpus), and their workers'
    beacon files. Returns how many."""
    import re
    import shutil

    pattern = re.compile(r"dlbricks-(?:bricks|model|agent|beacon)-(\d+)-")
    removed = 0
    for folder in {spool_dir() or tempfile.gettempdir(), tempfile.gettempdir()}:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            m = pattern.match(name)
            if m is None or _alive(int(m.group(1))):
                continue
            path = os.path.join(folder, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    continue
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive, and not ours to clean
        return True
    return True


def worker_env(config: RunnerConfig) -> dict[str, str]:
    """The environment a worker process starts with: this one's, with one OpenMP
    thread (onnxruntime's own pools do the threading), glibc's malloc keeping the
    memory sessions free for the next ones (:mod:`dlbricks.timing.heap`), numpy not
    asking for huge pages and, with ``config.huge_pages``, the heap backed with
    transparent huge pages (tunables read at process start, hence set here, before
    the worker exists)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["NUMPY_MADVISE_HUGEPAGE"] = "1" if config.huge_pages else "0"
    return with_tunables(env, [*TUNABLES, *(["glibc.malloc.hugetlb=1"] if config.huge_pages else [])])


class WorkerDied(Exception):
    """A worker died or hung; ``slot`` is the session it was running (-1: none)."""

    def __init__(self, slot: int, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.slot, self.reason, self.detail = slot, reason, detail


class WorkerProcess:
    """A worker process (``python -m dlbricks.timing.engine_worker``) and its pipes."""

    def __init__(self, config: RunnerConfig, start_timeout_s: float) -> None:
        # Named by this process's id: a run killed with its workers leaves it to the next
        # run's remove_stale_spools.
        fd, self._beacon_path = tempfile.mkstemp(prefix=spool_prefix("beacon"))
        os.write(fd, struct.pack("<q", -1))
        os.close(fd)
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        env = worker_env(config)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dlbricks.timing.engine_worker", str(to_child_r), str(to_parent_w), self._beacon_path],
            pass_fds=(to_child_r, to_parent_w),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        os.close(to_child_r)
        os.close(to_parent_w)
        self.tx = Connection(to_child_w, readable=False)
        self.rx = Connection(to_parent_r, writable=False)
        # Requests go out through a thread: a large model blocks the pipe until the
        # worker reads it, and the parent meanwhile generates the next brick.
        self._outbox: queue.Queue[Any] = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name="dlbricks-engine-send", daemon=True)
        self._sender.start()
        self.slots: dict[int, str] = {}  # beacon slot -> item id
        self.next_slot = 0
        self.held = 0  # bytes its live sessions hold (not what it keeps for the next)
        # Spool files for large models, reused: a file's pages stay allocated, and a
        # new file would take fresh ones from the system for every model (see
        # timing/heap.py for what that costs). Free ones as (path, size); busy ones
        # by the slot of the request that carries them.
        self._spool_free: list[tuple[str, int]] = []
        self._spool_busy: dict[int, tuple[str, int]] = {}
        try:
            self.tx.send(("config", config.to_dict()))
            self.reply(start_timeout_s, "starting")
        except WorkerDied as exc:
            self.kill()
            raise DlbricksError(f"measurement worker {exc.detail}") from None

    def beacon(self) -> int:
        try:
            with open(self._beacon_path, "rb") as f:
                return int(struct.unpack("<q", f.read(8))[0])
        except (OSError, struct.error):
            return -1

    def reply(self, timeout_s: float, doing: str) -> Any:
        """The worker's next message, or :class:`WorkerDied` naming the culprit slot."""
        try:
            ready = self.rx.poll(timeout_s)
        except (OSError, EOFError):
            ready = True
        if not ready:
            slot = self.beacon()
            self.kill()
            raise WorkerDied(slot, "timeout", f"timed out after {timeout_s:.0f} s while {doing}")
        try:
            return self.rx.recv()
        except (EOFError, OSError):
            slot = self.beacon()
            code = self.proc.wait(5.0)
            self.kill()
            raise WorkerDied(slot, "crash", f"crashed while {doing} ({describe_exit(code)})") from None

    def send(self, msg: Any) -> None:
        if msg and msg[0] == "open" and isinstance(msg[2], bytes) and len(msg[2]) > _SPOOL_BYTES:
            # A large model goes through a file: one write here, one read there, instead
            # of a pipe the parent's generating thread must keep feeding 64 KiB at a time.
            data: bytes = msg[2]
            path, size = self._spool_file(len(data))
            with open(path, "r+b") as f:
                f.write(data)
            self._spool_busy[msg[5]] = (path, max(size, len(data)))
            msg = msg[:2] + (("spool", path, len(data)),) + msg[3:]
        self._outbox.put(msg)

    def _spool_file(self, nbytes: int) -> tuple[str, int]:
        """A free spool file: the smallest that holds ``nbytes``, else the largest (it
        grows), else a new one."""
        fits = [f for f in self._spool_free if f[1] >= nbytes]
        if fits or self._spool_free:
            chosen = min(fits, key=lambda f: f[1]) if fits else max(self._spool_free, key=lambda f: f[1])
            self._spool_free.remove(chosen)
            return chosen
        fd, path = tempfile.mkstemp(prefix=spool_prefix("model"), suffix=".onnx", dir=spool_dir())
        os.close(fd)
        return path, 0

    @property
    def spool_bytes(self) -> int:
        """What its spool files hold (memory, in tmpfs)."""
        return sum(size for _, size in [*self._spool_free, *self._spool_busy.values()])

    def answered(self, slot: int) -> None:
        """The worker answered the open request of ``slot``: its spool file, if it had
        one, is free for the next."""
        f = self._spool_busy.pop(slot, None)
        if f is not None:
            self._spool_free.append(f)

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is _CLOSE:
                return
            try:
                self.tx.send(msg)
            except (OSError, EOFError, ValueError):
                pass  # the worker is gone (or the pipe closed): the reply reports it

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self._outbox.put(_CLOSE)
        self._sender.join(5.0)
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        for c in (self.tx, self.rx):
            c.close()
        for path, _ in [*self._spool_free, *self._spool_busy.values()]:
            try:
                os.unlink(path)
            except OSError:
                pass
        self._spool_free, self._spool_busy = [], {}
        try:
            os.unlink(self._beacon_path)
        except OSError:
            pass

    def stop(self) -> None:
        self.send(None)
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
