"""Arguments and output helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from dlbricks.model import UsageError


def add_model_args(p: argparse.ArgumentParser, *, nargs: str = "+") -> None:
    p.add_argument("paths", nargs=nargs, metavar="PATH", help="ONNX files or folders (searched recursively)")
    p.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="NAME=DIMS",
        help="concrete shape for a graph input, e.g. data=1x3x224x224 (repeatable)",
    )
    p.add_argument("--strict", action="store_true", help="a bad model is fatal instead of skipped")


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--output-file", "-o", dest="output", metavar="FILE", help="write the result to FILE")


def parse_input_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    """Parse repeated ``NAME=1x3x224x224`` options.

    Raises:
        UsageError: a malformed item.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, sep, dims = item.rpartition("=")
        if not sep or not name:
            raise UsageError(f"--input-shape {item!r}: expected NAME=DIMS, e.g. data=1x3x224x224")
        try:
            shape = tuple(int(d) for d in dims.lower().replace(",", "x").split("x") if d != "")
        except ValueError:
            raise UsageError(f"--input-shape {item!r}: dimensions must be integers separated by 'x'") from None
        if any(d < 0 for d in shape):
            raise UsageError(f"--input-shape {item!r}: dimensions must be >= 0")
        shapes[name] = shape
    return shapes


def parse_g_list(text: str) -> list[int]:
    """Parse ``1,2,3`` or ``1-4`` into a sorted list of granularities >= 1.

    Raises:
        UsageError: not integers, or a G < 1.
    """
    out: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part[1:]:
                a, b = part.split("-", 1)
                out.update(range(int(a), int(b) + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise UsageError(f"-G {text!r}: expected integers like 1,2,3 or 1-3") from None
    if not out:
        raise UsageError("-G: no granularity given")
    bad = [g for g in out if g < 1]
    if bad:
        raise UsageError(f"-G {text!r}: G must be at least 1, got {min(bad)}")
    return sorted(out)


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def emit(args: argparse.Namespace, text: str | None, obj: Any) -> None:
    """Write the command's result: JSON with --json, else text; to -o FILE or stdout."""
    payload = json.dumps(obj, indent=1, default=_json_default) + "\n" if getattr(args, "json", False) or text is None else text
    output = getattr(args, "output", None)
    if output:
        path = Path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(payload)
        os.replace(tmp, path)
        print(f"wrote {path}", file=sys.stderr)
    else:
        sys.stdout.write(payload)


def _json_default(o: Any) -> Any:
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def warn(message: str) -> None:
    print(f"dlbricks: warning: {message}", file=sys.stderr)
