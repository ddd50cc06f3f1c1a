"""Writing output files whole or not at all; the cache folder."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import IO, Iterator

from dlbricks.errors import UsageError


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/dlbricks`` (``~/.cache`` when unset): the default store's folder."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dlbricks"


def cache_dir() -> Path:
    """Where dlbricks keeps what it can derive again (runtime graphs):
    ``$DLBRICKS_CACHE_DIR``, else :func:`user_cache_dir`."""
    named = os.environ.get("DLBRICKS_CACHE_DIR")
    return Path(named) if named else user_cache_dir()

_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)


def write_atomically(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (str as UTF-8) to ``path``: into a temporary file beside it, then
    renamed over it, so readers see the old file or the new one, never a part. Missing
    folders are created.

    os-level calls: a Python file object costs four more system calls (fstat, isatty,
    seeks) than the write itself, and the folder is created only when it is missing.

    Raises:
        UsageError: the file cannot be written (the message names it and says why); the
            temporary file is removed.
    """
    target = os.fspath(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    tmp = f"{target}.{os.getpid()}.tmp"  # one per process: concurrent writers never share it
    created = False
    try:
        try:
            fd = os.open(tmp, _WRITE_FLAGS, 0o666)
        except FileNotFoundError:
            parent = os.path.dirname(tmp)
            if not parent:
                raise
            os.makedirs(parent, exist_ok=True)
            fd = os.open(tmp, _WRITE_FLAGS, 0o666)
        created = True
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except OSError as exc:
        if created:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise UsageError(f"{target}: cannot write the file ({exc.strerror or exc})") from None


@contextlib.contextmanager
def atomic_text(path: str | os.PathLike) -> Iterator[IO[str]]:
    """A text file to write ``path`` through piece by piece (an export too large to
    build in memory): a temporary file beside it, renamed over it when the block ends
    without an error and removed when it raises. Missing folders are created.

    Raises:
        UsageError: the file cannot be written (the message names it and says why).
    """
    target = os.fspath(path)
    tmp = f"{target}.{os.getpid()}.tmp"
    try:
        parent = os.path.dirname(tmp)
        if parent:
            os.makedirs(parent, exist_ok=True)
        fh = open(tmp, "w", encoding="utf-8", newline="")
    except OSError as exc:
        raise UsageError(f"{target}: cannot write the file ({exc.strerror or exc})") from None
    try:
        with fh:
            yield fh
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise UsageError(f"{target}: cannot write the file ({exc.strerror or exc})") from None
        raise
