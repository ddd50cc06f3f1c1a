"""What the loaders tell the user: the warning category and one-line messages."""

from __future__ import annotations

__all__ = ["DlbricksWarning", "batch_dim_note", "one_line"]


class DlbricksWarning(UserWarning):
    """A model was analysed under an assumption (e.g. a symbolic batch dim set to 1)."""


def one_line(s: str) -> str:
    """``s`` with every run of whitespace (newlines included) as one space: error
    messages quote onnx and protobuf, whose texts span lines."""
    return " ".join(s.split())


def batch_dim_note(label: str, input_name: str, what: str) -> str:
    """The warning for a symbolic leading dim set to 1; ``what`` is the dim as written
    (``'N'``, or ``unknown``). Both loaders give it, in the same words."""
    return (
        f"{label}: input '{input_name}' has a symbolic batch dim ({what}); using 1 "
        f"(set it with --input-shape {input_name}=..., or input_shapes in Python)"
    )
