"""dlbricks: cheap, trustworthy deep-learning inference benchmarking.

Decompose ONNX models into layers and bricks (sequences of at most G layers),
dedup them across a corpus, benchmark only the unique bricks, and reconstruct
every model's latency from them.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

try:
    from dlbricks import _core  # noqa: F401
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(f"{exc}. The C++ extension is not built; run `pip install -e .`") from exc

from dlbricks.corpus import Corpus, CorpusSplit
from dlbricks.errors import ArgumentError, ArgumentTypeError, DlbricksError, ModelError
from dlbricks.graph import Graph, Split, critical_path, sequence_graph, split, topo_order
from dlbricks.model import ConstInput, Layer, Model, TensorType
from dlbricks.versions import SEQUENCE_DIGEST_VERSION

# Heavier parts load on first use, so `import dlbricks` stays fast.
_LAZY = {
    "load": ("dlbricks.loading", "load"),
    "load_corpus": ("dlbricks.analysis", "load_corpus"),
    "LAYER_DIGEST_VERSION": ("dlbricks.versions", "LAYER_DIGEST_VERSION"),
    "Runner": ("dlbricks.timing", "Runner"),
    "RunnerConfig": ("dlbricks.timing", "RunnerConfig"),
    "Measurement": ("dlbricks.timing", "Measurement"),
    "Store": ("dlbricks.store", "Store"),
    "system_fingerprint": ("dlbricks.timing.sysinfo", "system_fingerprint"),
    "generate_brick": ("dlbricks.bricks", "generate_brick"),
    "generate_bricks": ("dlbricks.bricks", "generate_bricks"),
}

__all__ = [
    "SEQUENCE_DIGEST_VERSION",
    "ConstInput",
    "Corpus",
    "CorpusSplit",
    "ArgumentError",
    "ArgumentTypeError",
    "DlbricksError",
    "Graph",
    "Layer",
    "Model",
    "ModelError",
    "Split",
    "TensorType",
    "critical_path",
    "sequence_graph",
    "split",
    "topo_order",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dlbricks' has no attribute {name!r}")
