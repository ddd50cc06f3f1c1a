"""The exceptions dlbricks raises for what a user can fix (the CLI turns them into one line and an exit code)."""

from __future__ import annotations

__all__ = ["DlbricksError", "ModelError", "UsageError"]


class DlbricksError(Exception):
    """A user-facing error: one line that names the file (or object) and the cause."""


class UsageError(DlbricksError):
    """The command was asked something impossible (bad option value, missing path): exit 2."""


class ModelError(DlbricksError):
    """A model cannot be analysed (bad file, bad graph, unresolved shapes...)."""
