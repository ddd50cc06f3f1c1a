"""Input shapes for real model zoos, resolved model by model at the command layer.

Three options, applied in this order (a later one wins for the same input):

* ``--dim NAME=N``: a named free dimension (``batch``, ``sequence``...) set in every
  model's inputs that declare it, as ``onnxruntime_perf_test -f`` does; a leading free
  dim left unnamed is the batch size and becomes 1, as the loader would make it;
* ``--input-shape NAME=DIMS``: the whole shape of the input called NAME, in every
  model that has one;
* ``--input-shapes FILE``: a JSON or TOML mapping from a model path or glob to
  ``{input: dims}`` (dims as a list or ``1x3x224x224``), for one model or a family.

The loader takes one ``{input: shape}`` mapping per model, and refuses a name that is
not an input of the model; so each model's graph inputs are read first (without the
weights' data) and it gets exactly the overrides that apply to it. An override that
matches no input of a model is said on stderr, naming the model, instead of dropping
the model from the corpus. The same shapes reach the bricks and the end-to-end runs,
since both come from the one loaded model.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dlbricks.errors import UsageError

__all__ = ["ShapePlan", "parse_dim", "parse_dims", "parse_shape", "read_shapes_file"]

Shape = tuple[int, ...]


def parse_shape(text: Any, flag: str) -> Shape:
    """``1x3x224x224`` (or ``1,3,224,224``, or a list of ints) as a shape of positive dims.

    Raises:
        UsageError: not integers, or a dim below 1 (the message names ``flag``).
    """
    if isinstance(text, (list, tuple)):
        parts = list(text)
    else:
        parts = [d for d in str(text).lower().replace(",", "x").replace(" ", "").split("x") if d != ""]
    try:
        shape = tuple(int(d) for d in parts)
        if any(isinstance(d, bool) or (isinstance(d, float) and not d.is_integer()) for d in parts):
            raise ValueError
    except (TypeError, ValueError):
        raise UsageError(f"{flag}: dimensions must be integers, e.g. 1x3x224x224, got {text!r}") from None
    if not shape:
        raise UsageError(f"{flag}: no dimensions given")
    if any(d < 1 for d in shape):
        raise UsageError(f"{flag}: every dimension must be at least 1, got {'x'.join(map(str, shape))}")
    return shape


def parse_dim(item: str) -> tuple[str, int]:
    """``sequence=128`` -> ("sequence", 128).

    Raises:
        UsageError: malformed, or not a positive integer (naming ``--dim``).
    """
    name, sep, value = item.partition("=")
    name = name.strip()
    if not sep or not name:
        raise UsageError(f"--dim {item!r}: expected NAME=N, e.g. sequence=128")
    try:
        n = int(value)
    except ValueError:
        raise UsageError(f"--dim {item!r}: the size must be an integer") from None
    if n < 1:
        raise UsageError(f"--dim {item!r}: the size must be at least 1")
    return name, n


def parse_dims(items: Sequence[str]) -> dict[str, int]:
    return dict(parse_dim(i) for i in items)


def read_shapes_file(path: str) -> list[tuple[str, dict[str, Shape]]]:
    """The entries of an ``--input-shapes`` file, in file order: (pattern, {input: shape}).

    Raises:
        UsageError: unreadable, not JSON/TOML, or not a mapping of mappings of shapes.
    """
    flag = f"--input-shapes {path}"
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"{flag}: {exc.strerror or exc}") from None
    doc: Any
    if path.lower().endswith(".toml"):
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # Python 3.10
            try:
                import tomli as tomllib
            except ImportError:
                raise UsageError(f"{flag}: TOML needs Python 3.11 or `pip install tomli`; or write it as JSON") from None
        try:
            doc = tomllib.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise UsageError(f"{flag}: not TOML ({exc})") from None
    else:
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise UsageError(f"{flag}: not JSON ({exc}); a .toml file is read as TOML") from None
    if not isinstance(doc, Mapping):
        raise UsageError(f"{flag}: expected a mapping from a model path or glob to {{input: dims}}")
    out = []
    for pattern, inputs in doc.items():
        if not isinstance(inputs, Mapping) or not inputs:
            raise UsageError(f"{flag}: {pattern!r} must map input names to dims, e.g. {{\"data\": \"1x3x224x224\"}}")
        out.append((str(pattern), {str(k): parse_shape(v, f"{flag}: {pattern!r} input {k!r}") for k, v in inputs.items()}))
    return out


def _graph_inputs(path: Path) -> dict[str, list[int | str | None]] | None:
    """A model file's activation inputs (not initializers) and their declared dims
    (int, a dim_param name, or None); None when the file cannot be read (the loader
    then reports why)."""
    from dlbricks.errors import DlbricksError
    from dlbricks.loading.wire import read_proto

    try:
        proto, _ = read_proto(path, os.fspath(path))
    except (DlbricksError, OSError, ValueError):
        return None
    consts = {t.name for t in proto.graph.initializer}
    out: dict[str, list[int | str | None]] = {}
    for vi in proto.graph.input:
        if vi.name in consts:
            continue
        dims: list[int | str | None] = []
        tt = vi.type.tensor_type
        for d in tt.shape.dim if tt.HasField("shape") else ():
            which = d.WhichOneof("value")
            dims.append(int(d.dim_value) if which == "dim_value" else (d.dim_param if which == "dim_param" else None))
        out[vi.name] = dims
    return out


def _matches(pattern: str, path: Path) -> bool:
    """A model path or glob against a model file: the path as given, resolved, relative
    to the working folder, or its file name."""
    resolved = path.resolve()
    if Path(pattern).expanduser().resolve() == resolved:
        return True
    candidates = {path.as_posix(), resolved.as_posix(), path.name}
    try:
        candidates.add(resolved.relative_to(Path.cwd().resolve()).as_posix())
    except ValueError:
        pass
    return any(fnmatch.fnmatchcase(c, pattern) for c in candidates)


class ShapePlan:
    """Each model's input overrides from ``--dim``, ``--input-shape`` and
    ``--input-shapes`` (see the module docstring)."""

    def __init__(
        self,
        shapes: Mapping[str, Shape] | None = None,
        dims: Mapping[str, int] | None = None,
        per_model: Sequence[tuple[str, Mapping[str, Shape]]] = (),
        *,
        file: str | None = None,
        on_warning: Callable[[str], None] | None = None,
    ) -> None:
        self.shapes = dict(shapes or {})
        self.dims = dict(dims or {})
        self.per_model = [(p, dict(m)) for p, m in per_model]
        self.file = file
        self.on_warning = on_warning
        self.dims_used: set[str] = set()
        self.patterns_used: set[str] = set()
        self._cache: dict[Path, dict[str, Shape] | None] = {}

    @property
    def empty(self) -> bool:
        return not (self.shapes or self.dims or self.per_model)

    def _warn(self, text: str) -> None:
        if self.on_warning is not None:
            self.on_warning(text)

    def __call__(self, path: str | os.PathLike) -> dict[str, Shape] | None:
        return self.for_file(path)

    def for_file(self, path: str | os.PathLike) -> dict[str, Shape] | None:
        """The overrides for one model file (None: none apply)."""
        p = Path(path)
        if p in self._cache:
            return self._cache[p]
        out = self._resolve(p)
        self._cache[p] = out
        return out

    def _resolve(self, path: Path) -> dict[str, Shape] | None:
        if self.empty:
            return None
        inputs = _graph_inputs(path)
        mine = [(pat, m) for pat, m in self.per_model if _matches(pat, path)]
        if inputs is None:  # unreadable: the loader says why; pass what was asked
            merged = dict(self.shapes)
            for _pat, m in mine:
                merged.update(m)
            return merged or None
        out: dict[str, Shape] = {}
        listed = ", ".join(inputs) or "none"
        for name, declared in inputs.items():
            named = [d for d in declared if isinstance(d, str)]
            if not self.dims or not any(d in self.dims for d in named):
                continue
            shape: list[int] = []
            for i, d in enumerate(declared):
                if isinstance(d, int) and d > 0:
                    shape.append(d)
                elif isinstance(d, str) and d in self.dims:
                    shape.append(self.dims[d])
                    self.dims_used.add(d)
                elif i == 0:
                    shape.append(1)  # the loader's rule for a free leading dim: the batch size
                else:
                    shape = []
                    self._warn(f"{path}: input '{name}' has a free dim {d or '?'} that --dim does not set "
                               f"(dims: {declared}); give it with --dim or --input-shape {name}=...")
                    break
            if shape:
                out[name] = tuple(shape)
        for name, given in self.shapes.items():
            if name in inputs:
                out[name] = given
            else:
                self._warn(f"{path}: has no input '{name}' (its inputs: {listed}); --input-shape {name}=... "
                           "does not apply to it")
        for pat, m in mine:
            self.patterns_used.add(pat)
            for name, entry in m.items():
                if name in inputs:
                    out[name] = entry
                else:
                    self._warn(f"{path}: has no input '{name}' (its inputs: {listed}); --input-shapes {self.file} "
                               f"entry {pat!r} does not apply to it")
        return out or None

    def report_unused(self) -> None:
        """Warn about the --dim names and --input-shapes entries that matched no model."""
        for d in self.dims:
            if d not in self.dims_used:
                self._warn(f"--dim {d}={self.dims[d]}: no model input has a dimension named '{d}'")
        for pat, _ in self.per_model:
            if pat not in self.patterns_used:
                self._warn(f"--input-shapes {self.file}: entry {pat!r} matches no model")
