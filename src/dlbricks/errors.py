"""The exceptions dlbricks raises for what a user can fix (the CLI turns them into one
line and an exit code), and the one way it warns on stderr."""

from __future__ import annotations

import sys

__all__ = ["ArgumentError", "ArgumentTypeError", "DlbricksError", "ModelError", "UsageError", "first_line", "os_error_text",
           "warn"]


class DlbricksError(Exception):
    """A user-facing error: one line that names the file (or object) and the cause."""


class UsageError(DlbricksError):
    """The command was asked something impossible (bad option value, missing path): exit 2."""


class ArgumentError(DlbricksError, ValueError):
    """A value the Python API cannot take (G < 1, a malformed layer graph, an edge to a
    missing layer, a cycle); a ValueError too, as these were before."""


class ArgumentTypeError(DlbricksError, TypeError):
    """An argument of the wrong type given to the Python API; a TypeError too."""


class ModelError(DlbricksError):
    """A model cannot be analysed (bad file, bad graph, unresolved shapes...)."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none:
    onnxruntime's messages run on for pages, and a user-facing error is one line."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def os_error_text(exc: OSError) -> str:
    """An OS error as one line that names the file: ``out: Not a directory``."""
    cause = exc.strerror or first_line(exc)
    if exc.filename is None:
        return cause
    return f"{exc.filename}: {cause}" if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}: {cause}"


def warn(message: str) -> None:
    """One ``dlbricks: warning:`` line on stderr (what a command goes on despite)."""
    print(f"dlbricks: warning: {message}", file=sys.stderr)
