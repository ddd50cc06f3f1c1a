"""How ONNX names resolve: operator domains, and the tensors a subgraph reads from outside.

Imports nothing heavy (not even onnx): :mod:`dlbricks.model` uses it, and ``import
dlbricks`` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import onnx

__all__ = ["free_names", "has_subgraphs", "is_default_domain", "norm_domain", "outer_names", "subgraphs"]

# onnx.AttributeProto.AttributeType values (fixed by onnx.proto).
_UNDEFINED, _GRAPH, _GRAPHS = 0, 5, 10


def norm_domain(domain: str) -> str:
    """One spelling of an operator domain: ``""`` and ``"ai.onnx"`` both name the default one."""
    return "" if domain == "ai.onnx" else domain


def is_default_domain(domain: str) -> bool:
    """Whether ``domain`` names the default ONNX domain (``""`` or ``"ai.onnx"``)."""
    return domain == "" or domain == "ai.onnx"


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
