"""Loading: ONNX files into :class:`dlbricks.model.Model` objects.

The modules, in the order a model meets them:

- :mod:`.paths`      finding model files (``iter_model_paths``)
- :mod:`.loader`     ``load`` and ``iter_load``: which path a model takes, and why
- :mod:`.fast`       the C++ scanner's fast path, for plain graphs
- :mod:`.full`       the full Python loader: every model, every error message
- :mod:`.wire`       reading a file into a ModelProto, big files without their weights
- :mod:`.constants`  the values of folded constants, computed on demand
- :mod:`.names`      ONNX name rules: operator domains, names subgraphs read from outside
- :mod:`.sizes`      element counts and the size limits
- :mod:`.messages`   the warning category and one-line messages

Names load on first use: :mod:`dlbricks.model` imports :mod:`.names`, so importing this
package must not import the loaders (which import the model).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_ELEMENTS", "DlbricksWarning", "FastPathFallback", "iter_load", "iter_model_paths", "load"]

_LAZY = {
    "MAX_ELEMENTS": "dlbricks.loading.sizes",
    "DlbricksWarning": "dlbricks.loading.messages",
    "FastPathFallback": "dlbricks.loading.fast",
    "iter_load": "dlbricks.loading.loader",
    "iter_model_paths": "dlbricks.loading.paths",
    "load": "dlbricks.loading.loader",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dlbricks.loading' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
