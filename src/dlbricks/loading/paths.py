"""Finding model files: paths and folders to a list of ``.onnx`` files."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterable, Union

from dlbricks.errors import ArgumentTypeError, DlbricksError

__all__ = ["PathLike", "iter_model_paths"]

PathLike = Union[str, "os.PathLike[str]"]


def iter_model_paths(paths: PathLike | Iterable[PathLike]) -> list[Path]:
    """Expand files and folders into a list of model files.

    Args:
        paths: one path or several; a folder stands for every ``*.onnx`` file below it
            (recursively, sorted); a file is taken as given.

    Returns:
        The files in argument order, each folder's files sorted, without duplicates.

    Raises:
        DlbricksError: a path does not exist, or a folder holds no ``.onnx`` file.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    elif isinstance(paths, (bytes, bytearray)) or not hasattr(paths, "__iter__"):
        raise ArgumentTypeError(f"expected a path or a list of paths, got {type(paths).__name__}")
    out: list[Path] = []
    seen: set[str] = set()  # str(path): Path's own hash costs more than the lookup
    for p in paths:
        if not isinstance(p, (str, os.PathLike)):
            raise ArgumentTypeError(f"expected paths (str or os.PathLike), got {type(p).__name__!r} among them")
        path = p if isinstance(p, Path) else Path(p)
        try:
            is_dir = stat.S_ISDIR(os.stat(path).st_mode)  # one stat per path
        except (OSError, ValueError):
            raise DlbricksError(f"{path}: no such file or directory") from None
        if is_dir:
            found = sorted(f for f in path.rglob("*.onnx") if f.is_file())
            if not found:
                raise DlbricksError(f"{path}: no .onnx files found")
        else:
            found = [path]
        for f in found:
            key = str(f)
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out
