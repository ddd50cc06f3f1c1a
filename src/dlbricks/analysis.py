"""Corpus loading with per-model error handling, and the ``analyze`` report."""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from dlbricks.corpus import Corpus
from dlbricks.errors import DlbricksError, ModelError, UsageError, warn
from dlbricks.model import Model, name_distinctly

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.loading import FastPathFallback

SCHEMA_VERSION = 1


@dataclass(slots=True)
class LoadedCorpus:
    """Models that loaded, one error line per model that did not, and the models the
    fast path left to the full loader (``fallbacks``; None where the loader used does
    not report them)."""

    models: list[Model]
    errors: list[dict[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    load_s: float = 0.0
    fallbacks: list[FastPathFallback] | None = None

    def fast_path_report(self) -> dict:
        """The ``timing`` keys on the fast path: every fallback (model, reason, whether
        expected) and their counts; None values when fallbacks were not recorded."""
        if self.fallbacks is None:
            return {"fast_path_fallbacks": None, "fast_path_fallback_count": None, "fast_path_unexpected_count": None}
        return {
            "fast_path_fallbacks": [f.as_dict() for f in self.fallbacks],
            "fast_path_fallback_count": len(self.fallbacks),
            "fast_path_unexpected_count": sum(not f.expected for f in self.fallbacks),
        }

    def fast_path_lines(self) -> list[str]:
        """One line for the fast path's share, then one per model it left (``-v``)."""
        if self.fallbacks is None:
            return ["fast path: fallbacks not recorded by this loader"]
        total = len(self.models) + len(self.errors)
        unexpected = sum(not f.expected for f in self.fallbacks)
        lines = [
            f"fast path: {total - len(self.fallbacks)} of {total} models; {len(self.fallbacks)} "
            f"to the full loader ({unexpected} unexpected)"
        ]
        for f in self.fallbacks:
            lines.append(f"fast path {'failed on' if not f.expected else 'left'} {f.model}: {f.reason}")
        return lines

    def add_warnings(self, lines: Sequence[str], on_warning: Callable[[str], None] | None) -> None:
        """Record one model's loader warnings, passing each to ``on_warning`` as well."""
        for line in lines:
            self.warnings.append(line)
            if on_warning is not None:
                on_warning(line)

    def done(self, start: float) -> LoadedCorpus:
        """Stamp the load time since ``start``; an error when no model loaded at all.

        Raises:
            ModelError: every model failed (the message quotes the first error).
        """
        self.load_s = time.perf_counter() - start
        name_distinctly(self.models)  # zoo/a/model.onnx and zoo/b/model.onnx: a/model, b/model
        if not self.models and self.errors:
            raise ModelError(f"no model could be loaded ({len(self.errors)} failed; first: {self.errors[0]['error']})")
        return self


def model_files(paths: Sequence[str | Path]) -> list[Path]:
    """The ONNX files under ``paths`` (folders searched recursively).

    Raises:
        UsageError: a missing path or a folder without models (the user's call).
    """
    from dlbricks.loading import iter_model_paths

    try:
        return iter_model_paths(paths)
    except ModelError:
        raise
    except DlbricksError as exc:
        raise UsageError(str(exc)) from None


def load_corpus(
    paths: Sequence[str | Path],
    input_shapes: dict[str, tuple[int, ...]] | None = None,
    *,
    strict: bool = False,
    on_warning: Callable[[str], None] | None = None,
    shapes_for: Callable[[Path], dict[str, tuple[int, ...]] | None] | None = None,
) -> LoadedCorpus:
    """Load every ONNX model under ``paths``; a bad model is recorded and skipped.

    Args:
        paths: files or folders (searched recursively for ``*.onnx``).
        input_shapes: concrete shapes for symbolic graph inputs, by input name, the
            same for every model (a name that is not an input of a model is an error
            for that model).
        strict: re-raise the first bad model's error instead of skipping it.
        on_warning: called with each loader warning as one line (default: collected).
        shapes_for: each model file's own input shapes instead
            (:class:`dlbricks.commands._shapes.ShapePlan`: ``--dim``, ``--input-shapes``);
            ``input_shapes`` is then ignored.

    Returns:
        the models, the errors and the warnings.
    Raises:
        DlbricksError: a missing path or a folder without models; with ``strict``, a bad model.
    """
    from dlbricks.loading import iter_load

    files = model_files(paths)
    fallbacks: list[FastPathFallback] = []
    out = LoadedCorpus(models=[], fallbacks=fallbacks)
    start = time.perf_counter()
    # One recording context for the whole corpus (entering one per model cost more than
    # loading a small model's statistics), drained after each model.
    if shapes_for is not None:
        # One file at a time, each with its own overrides (given shapes keep a model
        # off the fast path anyway, so nothing is lost by not batching).
        stream = (r for f in files for r in iter_load([f], shapes_for(f), on_fallback=fallbacks.append))
    else:
        stream = iter_load(files, input_shapes, on_fallback=fallbacks.append)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for f, model, error in stream:
            if error is not None:
                if strict:
                    raise error
                out.errors.append({"path": str(f), "error": str(error)})
            else:
                out.models.append(model)
            lines = [str(w.message) for w in caught]
            caught.clear()
            out.add_warnings(lines, on_warning)
    return out.done(start)


def analyze(models: Sequence[Model], Gs: Sequence[int] = (1, 2, 3)) -> dict:
    """The analysis of a corpus as one JSON-ready dict (schema in README)."""
    from dlbricks.versions import LAYER_DIGEST_VERSION, SEQUENCE_DIGEST_VERSION

    if not models:
        raise DlbricksError("nothing to analyse: no models")
    corpus = Corpus(models)
    start = time.perf_counter()
    corpus_stats = corpus.stats(Gs)
    per_model = corpus.models_stats(Gs)
    for s, m in zip(per_model, models):
        s["path"] = m.path
    jac = corpus.jaccard()
    core_s = time.perf_counter() - start
    corpus_stats["jaccard"] = {"names": corpus.names, "matrix": np.round(jac, 6).tolist()}
    return {
        "schema_version": SCHEMA_VERSION,
        "digest_versions": {"layer": LAYER_DIGEST_VERSION, "sequence": SEQUENCE_DIGEST_VERSION},
        "G": list(Gs),
        "models": per_model,
        "corpus": corpus_stats,
        "timing": {"core_s": core_s},
    }


#: The most models whose Jaccard matrix the text output prints whole: beyond that its
#: columns no longer fit a terminal, and each model's closest others are shown instead
#: (the whole matrix stays in ``--json``).
MAX_MATRIX_MODELS = 12
#: How many of its closest other models each row of that table names.
_NEAREST = 3


def _nearest_models_table(names: Sequence[str], matrix: Sequence[Sequence[float]]) -> Any:
    from rich.table import Table

    t = Table(title=f"Most similar models (Jaccard similarity of layer sets; all {len(names)} x {len(names)} "
                    "in --json)", title_justify="left")
    t.add_column("model")
    t.add_column("closest models", overflow="fold")
    jac = np.asarray(matrix, dtype=np.float64)
    for i, name in enumerate(names):
        others = [j for j in np.argsort(-jac[i], kind="stable") if j != i and jac[i, j] > 0][:_NEAREST]
        t.add_row(name, ", ".join(f"{names[j]} {jac[i, j]:.2f}" for j in others) or "(no layer in common with any)")
    return t


def render_analysis(result: dict, errors: Sequence[dict[str, str]] = ()) -> str:
    """Readable tables for ``dlbricks analyze``."""
    import io

    from rich.console import Console
    from rich.table import Table

    console = Console(record=True, width=160, file=io.StringIO())
    Gs = result["G"]
    t = Table(title="Models", title_justify="left")
    t.add_column("model")
    t.add_column("layers", justify="right")
    t.add_column("unique", justify="right")
    t.add_column("unique %", justify="right")
    for G in Gs:
        t.add_column(f"seq G={G} (uniq)", justify="right")
    t.add_column("most repeated types")
    for m in result["models"]:
        seqs = [f"{m['sequences'][str(G)]['sequences']} ({m['sequences'][str(G)]['unique_sequences']})" for G in Gs]
        rep = ", ".join(f"{k} {v}" for k, v in list(m["repeated_layer_types"].items())[:4]) or "-"
        t.add_row(m["name"], str(m["layers"]), str(m["unique_layers"]), f"{m['unique_layer_pct']:.1f}", *seqs, rep)
    console.print(t)
    c = result["corpus"]
    ct = Table(title="Corpus", title_justify="left")
    ct.add_column("models", justify="right")
    ct.add_column("layers", justify="right")
    ct.add_column("unique layers", justify="right")
    for G in Gs:
        ct.add_column(f"unique seq G={G}", justify="right")
    ct.add_row(
        str(c["models"]),
        str(c["layers"]),
        f"{c['unique_layers']} ({c['unique_layer_pct']:.1f}%)",
        *[f"{c['sequences'][str(G)]['unique_sequences']} of {c['sequences'][str(G)]['sequences']}" for G in Gs],
    )
    console.print(ct)
    names = c["jaccard"]["names"]
    if len(names) > MAX_MATRIX_MODELS:
        console.print(_nearest_models_table(names, c["jaccard"]["matrix"]))
    elif len(names) > 1:
        jt = Table(title="Jaccard similarity of layer sets", title_justify="left")
        # Columns are numbered, rows carry the whole name: names of a model zoo differ in
        # their ends (a/model, b/model), which a cut would lose.
        jt.add_column("#", justify="right")
        jt.add_column("model")
        for i in range(len(names)):
            jt.add_column(str(i + 1), justify="right")
        for i, (n, row) in enumerate(zip(names, c["jaccard"]["matrix"])):
            jt.add_row(str(i + 1), n, *[f"{v:.2f}" for v in row])
        console.print(jt)
    for e in errors:
        console.print(f"skipped {e['path']}: {e['error']}", markup=False)
    return console.export_text()


#: A warning line on stderr (the name this module's callers use).
print_err = warn


def print_info(line: str) -> None:
    """A ``-v`` diagnostic line on stderr."""
    print(f"dlbricks: {line}", file=sys.stderr)
