"""Worker processes as fresh interpreters: ``python -m dlbricks.profiling.worker FD``.

:func:`dlbricks.timing.workers.start_worker` (and so :class:`~dlbricks.timing.workers.Worker`
and :func:`~dlbricks.timing.workers.run_with_restart`) starts its process from a
``multiprocessing`` context. The ``spawn`` context re-imports the parent's main module
in the child, so a user's script without an ``if __name__ == "__main__":`` guard runs
again there and the worker dies while starting. :class:`ModuleContext` is a context
whose processes are started as the measurement engine starts its workers
(:mod:`dlbricks.timing.engine_worker`): a new interpreter running a module, which
imports only dlbricks. The worker loop itself is unchanged.

The child gets its end of the pipe as an inherited descriptor (``FD``), then reads the
target, ``"module"`` and ``"qualified.name"``, and its arguments, pickled, from its
standard input; it calls ``target(connection, *args)``.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import pickle
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable

__all__ = ["ModuleContext", "main"]


class ModuleContext:
    """The part of a ``multiprocessing`` context that :func:`dlbricks.timing.workers.start_worker`
    uses (``Pipe`` and ``Process``), with processes that are fresh interpreters."""

    @staticmethod
    def Pipe(duplex: bool = True) -> tuple[Connection, Connection]:  # noqa: N802 (multiprocessing's name)
        # A socket pair: its descriptors can be handed to another program.
        return multiprocessing.Pipe(duplex)

    @staticmethod
    def Process(target: Callable[..., None], args: tuple = (), name: str | None = None,  # noqa: N802
                daemon: bool = True) -> ModuleProcess:
        return ModuleProcess(target, args, name)


class ModuleProcess:
    """A worker process running ``python -m dlbricks.profiling.worker``, with the methods
    of ``multiprocessing.Process`` the worker loop calls.

    ``args[0]`` is the child's end of the pipe (a :class:`Connection`); the rest are
    pickled to the child. ``target`` must be importable by its module and qualified name.
    """

    def __init__(self, target: Callable[..., None], args: tuple, name: str | None = None) -> None:
        if not args or not isinstance(args[0], Connection):
            raise TypeError("the first argument of a worker is its end of the pipe (a Connection)")
        self.name = name
        self._conn: Connection = args[0]
        self._spec = pickle.dumps((target.__module__, target.__qualname__, tuple(args[1:])))
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        fd = self._conn.fileno()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "dlbricks.profiling.worker", str(fd)],
            pass_fds=(fd,),
            stdin=subprocess.PIPE,
        )
        assert self._proc.stdin is not None
        # A child that died before reading is reported by the pipe's end of file.
        with contextlib.suppress(BrokenPipeError, OSError):
            self._proc.stdin.write(self._spec)
        with contextlib.suppress(BrokenPipeError, OSError):
            self._proc.stdin.close()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def exitcode(self) -> int | None:
        """None while running; negative: the signal that ended it (as ``multiprocessing``)."""
        return None if self._proc is None else self._proc.poll()

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        if self.is_alive():
            assert self._proc is not None
            self._proc.kill()

    def join(self, timeout: float | None = None) -> None:
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout)


def main(argv: list[str]) -> int:
    """The child: its pipe end from ``argv[0]``, its target and arguments from stdin."""
    conn = Connection(int(argv[0]))
    module, qualname, args = pickle.load(sys.stdin.buffer)
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    target(conn, *args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
