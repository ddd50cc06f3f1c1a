"""How ONNX names resolve: operator domains (and the ops onnxruntime adds to the default
one), and the tensors a subgraph reads from outside.

Imports nothing heavy (not even onnx; onnxruntime only when asked about its ops):
:mod:`dlbricks.model` uses it, and ``import dlbricks`` stays fast.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import onnx

__all__ = [
    "free_names", "has_subgraphs", "is_default_domain", "norm_domain", "onnxruntime_onnx_op", "outer_names", "subgraphs",
]

# onnx.AttributeProto.AttributeType values (fixed by onnx.proto).
_UNDEFINED, _GRAPH, _GRAPHS = 0, 5, 10


def norm_domain(domain: str) -> str:
    """One spelling of an operator domain: ``""`` and ``"ai.onnx"`` both name the default one."""
    return "" if domain == "ai.onnx" else domain


def is_default_domain(domain: str) -> bool:
    """Whether ``domain`` names the default ONNX domain (``""`` or ``"ai.onnx"``)."""
    return domain == "" or domain == "ai.onnx"


@functools.cache
def _onnxruntime_onnx_kernels() -> dict[str, tuple[tuple[int, int], ...]]:
    """The version ranges of onnxruntime's CPU kernels in the ONNX domain, by op."""
    try:  # lazily: onnxruntime is heavy, and only graphs it optimised need it here
        from onnxruntime.capi.onnxruntime_pybind11_state import get_all_opkernel_def
    except ImportError:  # pragma: no cover - onnxruntime is a dependency
        return {}
    out: dict[str, set[tuple[int, int]]] = {}
    for k in get_all_opkernel_def():
        if k.provider == "CPUExecutionProvider" and is_default_domain(k.domain):
            out.setdefault(k.op_name, set()).add((int(k.version_range[0]), int(k.version_range[1])))
    return {op: tuple(sorted(ranges)) for op, ranges in out.items()}


@functools.lru_cache(maxsize=1024)
def onnxruntime_onnx_op(op_type: str, opset: int) -> int | None:
    """The version of a default-domain op that onnxruntime runs on the CPU at ``opset``
    (the first version of its kernel), or None when it has none.

    onnxruntime registers ops of its own in the ONNX domain, and its optimiser writes
    them into the graphs it saves: ``SimplifiedLayerNormalization`` (RMSNorm, which onnx
    defines only from opset 23 and under another name), ``LayerNormalization`` below
    opset 17 (where onnx has none). The loaders ask only about ops onnx does not know.
    """
    for start, end in _onnxruntime_onnx_kernels().get(op_type, ()):
        if start <= opset <= end:
            return start
    return None


def has_subgraphs(a: onnx.AttributeProto) -> bool:
    """Whether the attribute holds graphs: typed GRAPH or GRAPHS, or (very old models
    leave ``type`` unset) untyped with a graph field set."""
    typ = a.type
    return typ == _GRAPH or typ == _GRAPHS or (typ == _UNDEFINED and (a.HasField("g") or len(a.graphs) > 0))


def subgraphs(a: onnx.AttributeProto) -> list[onnx.GraphProto]:
    """The graphs a graph attribute holds (see :func:`has_subgraphs`)."""
    if a.type == _GRAPH or a.HasField("g"):
        return [a.g]
    return list(a.graphs)


def free_names(g: onnx.GraphProto) -> list[str]:
    """Names a subgraph reads from enclosing scopes, in order of first use."""
    bound = {vi.name for vi in g.input}
    bound.update(t.name for t in g.initializer)
    bound.update(sp.values.name for sp in g.sparse_initializer)
    for node in g.node:
        bound.update(o for o in node.output if o)
    free: dict[str, None] = {}
    for node in g.node:
        for t in node.input:
            if t and t not in bound:
                free[t] = None
        for t in outer_names(node):
            if t not in bound:
                free[t] = None
    for vi in g.output:
        if vi.name not in bound:
            free[vi.name] = None
    return list(free)


def outer_names(node: onnx.NodeProto) -> list[str]:
    """Names a node's subgraph attributes (If/Loop/Scan bodies) read from the graph
    around the node, in order of first use; empty for a node without subgraphs."""
    free: dict[str, None] = {}
    for a in node.attribute:
        if has_subgraphs(a):
            for sub in subgraphs(a):
                for t in free_names(sub):
                    free[t] = None
    return list(free)
