"""Joining the kernels onnxruntime executes to dlbricks' layers and brick digests.

A kernel in onnxruntime's profile is a node of the graph it executes, under the same
name, so :func:`kernel_records` attributes each to that runtime graph's layer (loaded
with the profile's session options), whose cost is the kernel's. onnxruntime fuses
nodes (Conv+BatchNormalization+Relu, MatMul+Add into a Gemm, LayerNormalization and
GELU patterns, NCHWc layouts), so those nodes are not the source layers:
:func:`join_layers` maps each back to the source layers it came from, anchoring on
node names (a fused node names a source node or the tensor it outputs), output tensor
names and op/shape matches inside fusion components (the source layers joined by
tensors the executed graph no longer has), then gives each remaining fused layer the
kernel next to it that keeps the executed graph's edges consistent. Kernels
onnxruntime inserts (NCHWc reorders, copies, the Reshapes around a Gemm it made) have
no source layer. Each record carries the kernel's runtime layer, its source layers
with their costs, and the brick digest of those layers.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from dlbricks import _core
from dlbricks.graph import split, topo_order
from dlbricks.model import Model
from dlbricks.profiling.ort_profile import OrtNode
from dlbricks.roofline.costmodel import layer_cost

__all__ = ["RUNTIME_OPS", "Join", "event_shapes", "join_layers", "kernel_records"]

#: Kernels onnxruntime inserts that correspond to no source layer.
RUNTIME_OPS = frozenset({"ReorderInput", "ReorderOutput", "MemcpyFromHost", "MemcpyToHost"})


@dataclass
class Join:
    """Which source layers each executed kernel covers.

    Attributes:
        layers: kernel (onnxruntime node name) -> source layer indices, ascending.
        how: kernel -> ``"name"`` (its name names a layer or a layer's output),
            ``"output"`` (it produces a layer's output tensor), ``"shape"`` (the
            only unjoined layer of its op type and output shape), ``"fused"``
            (it holds only layers fused into it), ``"runtime"`` (a layout reorder
            or copy onnxruntime inserts), ``"inserted"`` (no source layer, next to
            layers that all have their kernel: inserted by a fusion) or
            ``"unmatched"``.
        unassigned: source layers no kernel covers (removed by onnxruntime, or
            not joined).
        violations: source edges between two kernels that the executed graph
            does not connect in the same direction (0 for a consistent join).
    """

    layers: dict[str, list[int]]
    how: dict[str, str]
    unassigned: list[int]
    violations: int

    def kernel_of_layer(self) -> dict[int, str]:
        return {li: k for k, ls in self.layers.items() for li in ls}


def _name_forms(name: str) -> list[str]:
    """The names a kernel's name may stand for, longest first: itself, its last word
    and every prefix of them up to an ``_`` or a ``/``. ``"fused n16"`` -> n16;
    ``"r8_bn_nchwc"`` -> r8_bn, r8; ``"/l0/k/MatMul/MatMulAddFusion"`` -> /l0/k/MatMul;
    ``"x/Relu_output_0_nchwc"`` -> x/Relu_output_0 (a tensor: its producer)."""
    bases = [name]
    parts = name.split()
    if len(parts) > 1:
        bases.append(parts[-1])
    forms: list[str] = []
    for base in bases:
        cuts = [i for i, c in enumerate(base) if c in "_/" and i > 0]
        for form in [base, *(base[:i] for i in reversed(cuts))]:
            if form and form not in forms:
                forms.append(form)
    return forms


def _components(model: Model, kept: set[str]) -> list[int]:
    """Each source layer's fusion component: layers joined by a tensor the executed
    graph no longer has (fused away, or renamed by a layout change) are one
    component; a tensor it keeps is a boundary no fusion crossed. Returns a
    component id per layer."""
    parent = list(range(model.n_layers))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for s, slot, d in zip(model.edge_src.tolist(), model.edge_src_slot.tolist(), model.edge_dst.tolist()):
        if s != d and model.layers[s].outputs[slot] not in kept:
            a, b = find(s), find(d)
            if a != b:
                parent[max(a, b)] = min(a, b)
    return [find(i) for i in range(model.n_layers)]


def _nearest_of_op(
    model: Model, start: Sequence[int], op: str, nbrs: Sequence[Sequence[int]], assign: Mapping[int, int],
    component: Sequence[int], depth: int = 4,
) -> int | None:
    """Breadth-first from ``start`` along ``nbrs`` through unclaimed layers of the
    same fusion component: the first unclaimed layer of type ``op`` within ``depth``
    steps."""
    frontier = list(start)
    seen = set(start)
    comps = {component[li] for li in start}
    for _ in range(depth):
        nxt = []
        for li in frontier:
            for n in nbrs[li]:
                if n in seen or n in assign or component[n] not in comps:
                    continue
                seen.add(n)
                if model.layers[n].op_type == op:
                    return n
                nxt.append(n)
        frontier = nxt
    return None


def _canonical_op(op: str) -> str:
    return op[len("Fused") :] if op.startswith("Fused") and len(op) > len("Fused") else op


def join_layers(
    model: Model,
    nodes: Sequence[OrtNode],
    output_shapes: Mapping[str, Sequence[Sequence[int]]] | None = None,
) -> Join:
    """Join the nodes onnxruntime executes to the model's source layers.

    The source layers fall into fusion components (:func:`_components`): layers
    joined by a tensor the executed graph no longer has. A kernel's layers are all
    of one component, or of several it spans; a tensor both graphs have is a
    boundary nothing is joined across.

    1. Anchors: (a) a node whose name is a layer's name, else whose name's longest
       form (a prefix of it up to an ``_`` or a ``/``, or its last word:
       ``r1_nchwc``, ``fused n16``, ``.../MatMul/MatMulAddFusion``) is a layer's
       name or a layer's output tensor; (b) a node producing a layer's output
       tensor, in a component no node named or of which it holds a named layer (a
       node onnxruntime inserts after a fusion, such as the Reshape back from a
       Gemm, produces the fused layers' output but named none of them); (c) a node whose op type (``Fused``
       stripped) and output shape match exactly one layer of a component no node
       has claimed, placed consistently; (d) a kernel holding no layer of its own op
       type (it was named after a fused activation) takes the nearest unjoined
       layer of that type in its component, upstream first.
    2. Fused layers: only op types with more layers than kernels can have been
       fused away. Such a layer joins the kernel of a producer in its component
       (fusions absorb the ops after a Conv/Gemm), else of a consumer, choosing only
       kernels that keep every joined neighbour on the right side in the executed
       graph; repeated to a fixed point.

    Args:
        model: the source model (the same graph onnxruntime was given).
        nodes: the executed graph's nodes (:func:`load_executed_graph`).
        output_shapes: kernel -> output shapes seen in the profile (for step 1c).

    Returns:
        The :class:`Join`.
    """
    n_nodes = len(nodes)
    producer = model.producers()
    consumers = model.consumers()
    layer_by_name = {layer.name: layer.index for layer in model.layers}
    # Executed-graph edges and descendant sets (Python ints as bitsets).
    ort_prod: dict[str, int] = {}
    for k, node in enumerate(nodes):
        for t in node.outputs:
            if t:
                ort_prod[t] = k
    succs: list[set[int]] = [set() for _ in nodes]
    for k, node in enumerate(nodes):
        for t in set(node.inputs):
            j = ort_prod.get(t)
            if j is not None and j != k:
                succs[j].add(k)
    edges = np.asarray([(j, k) for j in range(n_nodes) for k in sorted(succs[j])], np.int32).reshape(-1, 2)
    # The core's order (any topological order gives the same descendant sets); the
    # executed graph is acyclic, since onnxruntime ran it.
    order = _core.topo_order(n_nodes, edges[:, 0].copy(), edges[:, 1].copy()).tolist()
    desc = [0] * n_nodes
    for k in reversed(order):
        bits = 0
        for s in succs[k]:
            bits |= desc[s] | (1 << s)
        desc[k] = bits

    def reaches(a: int, b: int) -> bool:
        return a == b or bool((desc[a] >> b) & 1)

    component = _components(model, {t for node in nodes for t in (*node.inputs, *node.outputs) if t})
    assign: dict[int, int] = {}
    how: dict[int, str] = {}
    runtime = {k for k, node in enumerate(nodes) if node.op_type in RUNTIME_OPS}
    for k in runtime:
        how[k] = "runtime"
    # 1a. names: a layer's own name first (an unfused layer keeps its node's
    # name), then the longest form of the others' names.
    for k, node in enumerate(nodes):
        li = layer_by_name.get(node.name)
        if k not in runtime and li is not None:
            assign[li] = k
            how[k] = "name"
    for k, node in enumerate(nodes):
        if k in runtime or k in how:
            continue
        for form in _name_forms(node.name)[1:]:
            li = layer_by_name.get(form)
            if li is None and form in producer:
                li = producer[form][0]
            if li is None:
                continue
            if li not in assign:
                assign[li] = k
                how[k] = "name"
            break
    named = {component[li] for li in assign}
    holds = {(k, component[li]) for li, k in assign.items()}
    # 1b. output tensors: in a component no name anchors, or by a kernel that
    # holds a named layer of that component already (two Reshapes made one).
    for k, node in enumerate(nodes):
        if k in runtime:
            continue
        for t in node.outputs:
            p = producer.get(t)
            if p is not None and p[0] not in assign and (component[p[0]] not in named or (k, component[p[0]]) in holds):
                assign[p[0]] = k
                how.setdefault(k, "output")

    preds_l: list[list[int]] = [[] for _ in model.layers]
    succs_l: list[list[int]] = [[] for _ in model.layers]
    for s, d in zip(model.edge_src.tolist(), model.edge_dst.tolist()):
        if s != d:
            if s not in preds_l[d]:
                preds_l[d].append(s)
            if d not in succs_l[s]:
                succs_l[s].append(d)

    def consistent(li: int, g: int) -> bool:
        """Whether joining layer ``li`` to kernel ``g`` keeps each joined producer
        upstream of ``g`` and each joined consumer downstream of it."""
        ups = (assign.get(p) for p in preds_l[li])
        downs = (assign.get(s) for s in succs_l[li])
        return all(h is None or h == g or reaches(h, g) for h in ups) and all(
            h is None or h == g or reaches(g, h) for h in downs
        )

    # 1c. op type and output shape, among the layers of components no kernel holds
    shapes = output_shapes or {}
    for k, node in enumerate(nodes):
        if k in how:
            continue
        claimed = {component[li] for li in assign}
        op = _canonical_op(node.op_type)
        want = shapes.get(node.name)
        cands = []
        for layer in model.layers:
            if (layer.index in assign or component[layer.index] in claimed or layer.op_type != op
                    or not consistent(layer.index, k)):
                continue
            if want and "nchwc" not in node.domain:
                got = [tuple(t.shape) for t in layer.output_types if t is not None]
                if got[:1] != [tuple(want[0])]:
                    continue
            cands.append(layer.index)
        if len(cands) == 1:
            assign[cands[0]] = k
            how[k] = "shape"

    # 1d. the kernel's own op: a kernel named after a fused activation (r63_nchwc
    # is Conv+Relu, named after the Relu's output) also holds the nearest layer of
    # its op type, upstream first, through layers no kernel has claimed.
    members_of: dict[int, list[int]] = {}
    for li, k in assign.items():
        members_of.setdefault(k, []).append(li)
    for k, lis in sorted(members_of.items()):
        op = _canonical_op(nodes[k].op_type)
        if any(model.layers[li].op_type == op for li in lis):
            continue
        for nbrs in (preds_l, succs_l):
            found = _nearest_of_op(model, lis, op, nbrs, assign, component)
            if found is not None and consistent(found, k):
                assign[found] = k
                break

    # 2. fused layers, to a fixed point. An op type with no more layers than
    # kernels cannot have lost a layer to a fusion, so only the others are joined.
    kernel_ops = Counter(_canonical_op(node.op_type) for k, node in enumerate(nodes) if k not in runtime)
    layer_ops = Counter(layer.op_type for layer in model.layers)
    absorbable = {op for op, n in layer_ops.items() if n > kernel_ops.get(op, 0)}
    topo = [int(i) for i in topo_order(model) if model.layers[int(i)].op_type in absorbable]
    position = {k: i for i, k in enumerate(order)}

    def absorb(layer_order: Sequence[int], nbrs: Sequence[Sequence[int]], pick: Any) -> bool:
        """Join each unjoined layer to a consistent kernel of its neighbours along
        ``nbrs`` in its component; ``pick`` chooses among several by execution order."""
        changed = False
        for li in layer_order:
            if li in assign:
                continue
            groups = list(dict.fromkeys(assign[n] for n in nbrs[li] if n in assign and component[n] == component[li]))
            ok = [g for g in groups if consistent(li, g)]
            if ok:
                assign[li] = pick(ok, key=position.__getitem__)
                changed = True
        return changed

    # Fusions absorb the ops after a Conv/Gemm: producers first, the most
    # downstream of several; then consumers, the most upstream. Both run every
    # round (``|``, not ``or``).
    while absorb(topo, preds_l, max) | absorb(topo[::-1], succs_l, min):
        pass

    violations = 0
    for s, d in zip(model.edge_src.tolist(), model.edge_dst.tolist()):
        gs, gd = assign.get(s), assign.get(d)
        if gs is not None and gd is not None and gs != gd and not reaches(gs, gd):
            violations += 1
    layers: dict[str, list[int]] = {node.name: [] for node in nodes}
    for li, k in assign.items():
        layers[nodes[k].name].append(li)
    for v in layers.values():
        v.sort()

    def without_layers(k: int, node: OrtNode) -> str:
        # A kernel next to source layers that all have a kernel of their own was
        # inserted by onnxruntime around a fusion (the Reshapes of a MatMul+Add made a
        # Gemm); one next to a layer no kernel holds may be the one it became.
        near = [producer[t][0] for t in node.outputs if t in producer]
        near += [c for t in node.inputs for c, _ in consumers.get(t, ())]
        comps = {component[li] for li in near}
        if any(component[li] in comps and li not in assign for li in range(model.n_layers)) or not near:
            return "unmatched" if len(assign) < model.n_layers else "inserted"
        return "inserted"

    how_named = {
        node.name: (how.get(k) or "fused") if layers[node.name] or k in runtime else without_layers(k, node)
        for k, node in enumerate(nodes)
    }
    unassigned = sorted(set(range(model.n_layers)) - set(assign))
    return Join(layers=layers, how=how_named, unassigned=unassigned, violations=violations)


def _brick_digests(model: Model) -> list[str]:
    """Each layer's G=1 brick digest (the sequence digest the store keys bricks by)."""
    sp = split(model, 1)
    of = sp.sequence_of_layer()
    hexes = sp.hex_digests()
    return [hexes[int(of[i])] for i in range(model.n_layers)]


def _group_key(model: Model, members: Sequence[int], g1: Sequence[str]) -> str:
    """The brick digest of a kernel: the G=1 digest for one layer; for fused layers
    a BLAKE2b-128 over their G=1 digests and internal edges (a local key that
    dedups identical fused bricks within the run)."""
    if len(members) == 1:
        return g1[members[0]]
    pos = {m: i for i, m in enumerate(members)}
    h = hashlib.blake2b(digest_size=16)
    h.update(b"DLBFUSED" + len(members).to_bytes(4, "little"))
    for m in members:
        h.update(bytes.fromhex(g1[m]))
    edges = sorted(
        (pos[s], ss, pos[d], ds)
        for s, ss, d, ds in zip(
            model.edge_src.tolist(), model.edge_src_slot.tolist(), model.edge_dst.tolist(), model.edge_dst_slot.tolist()
        )
        if s in pos and d in pos
    )
    for e in edges:
        h.update(b"".join(int(x).to_bytes(4, "little") for x in e))
    return h.hexdigest()


def _layer_record(model: Model, li: int, g1: Sequence[str]) -> dict[str, Any]:
    layer = model.layers[li]
    try:
        cost = layer_cost(layer)
        flops, int_ops, bytes_min, has_formula = cost.flops, cost.int_ops, cost.bytes_min, cost.has_formula
    except (TypeError, ValueError):
        flops, int_ops, bytes_min, has_formula = 0, 0, 0, False
    return {
        "index": li,
        "name": layer.name,
        "op_type": layer.kind,
        "inputs": [str(t) for t in layer.input_types if t is not None],
        "outputs": [str(t) for t in layer.output_types if t is not None],
        "brick_digest": g1[li],
        "flops": int(flops),
        "int_ops": int(int_ops),
        "bytes_min": int(bytes_min),
        "has_formula": bool(has_formula),
    }


def event_shapes(event: Mapping[str, Any], key: str) -> list[list[int]]:
    """Shapes from a kernel event's ``input_type_shape``/``output_type_shape``
    argument (a list of ``{"float": [1, 64, 56, 56]}``)."""
    items = (event.get("args") or {}).get(key) or []
    return [list(next(iter(x.values()))) for x in items if isinstance(x, dict) and x]


def _label(members: Sequence[Mapping[str, Any]], op: str) -> str:
    if not members:
        return op or "?"
    return "+".join(dict.fromkeys(m["op_type"] for m in members))


def _ops_list(ops: Mapping[str, int]) -> str:
    return ", ".join(f"{op} {n}" for op, n in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])))


def kernel_records(
    model: Model,
    nodes: Sequence[OrtNode],
    runs: Sequence[Mapping[str, Any]],
    warnings: list[str],
    runtime: Model | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """One record per executed kernel: the runtime layer it is, the source layers it
    came from (with their costs), its work, label and brick digest.

    A kernel is a node of the graph onnxruntime executes, so with ``runtime`` (that
    graph, loaded: :func:`dlbricks.loading.runtime_graph.runtime_models` on the
    profile's session options) each kernel is attributed to the runtime layer of
    its name, whose cost (FLOPs, the int ops of int8 kernels, bytes) is the
    kernel's. Its source layers come from :func:`join_layers`; a kernel onnxruntime
    inserted (layout reorders, the Reshapes around a Gemm it made of MatMul+Add) has
    none. Without ``runtime`` a kernel is attributed only through its source layers,
    and costs what they cost together.

    Args:
        model: the source model.
        nodes: the executed graph's nodes.
        runs: the profiled runs (:func:`~dlbricks.profiling.ort_profile.parse_ort_profile`);
            may be empty (the hw level alone), then the kernels are the executed
            graph's nodes and carry no shapes.
        warnings: what the join could not explain is appended here.
        runtime: the runtime graph as a model, if it could be loaded.

    Returns:
        ``(kernels, summary, unassigned)``: the records in execution order, the
        join's counts (kernels attributed and not, with the op types of those not;
        kernels per kind of source match; op types of the kernels onnxruntime
        inserted; unassigned source layers, violations) and the names of the source
        layers no kernel covers.
    """
    g1 = _brick_digests(model)
    shapes = {k["name"]: event_shapes(k, "output_type_shape") for r in runs[:1] for k in r["kernels"]}
    join = join_layers(model, nodes, shapes)
    node_by_name = {n.name: n for n in nodes}
    runtime_by_name = {layer.name: layer for layer in runtime.layers} if runtime is not None else {}
    runtime_g1 = _brick_digests(runtime) if runtime is not None else []
    if runs:
        names = list(dict.fromkeys(k["name"] for r in runs for k in r["kernels"]))
    else:
        names = [n.name for n in nodes]
    first_event = {k["name"]: k for r in reversed(runs) for k in r["kernels"]}
    kernels: list[dict[str, Any]] = []
    for name in names:
        members = [_layer_record(model, li, g1) for li in join.layers.get(name, [])]
        node = node_by_name.get(name)
        ev = first_event.get(name, {})
        op = ev.get("op") or (node.op_type if node else "")
        how = join.how.get(name, "unmatched")
        rt_layer = runtime_by_name.get(name)
        rt = _layer_record(runtime, rt_layer.index, runtime_g1) if runtime is not None and rt_layer else None
        # The kernel's work: its runtime layer's, when its formula is known (a
        # fused kernel's own: a Gemm's bias, a FusedConv's activation), else that
        # of the source layers it came from.
        costed = [rt] if rt is not None and (rt["has_formula"] or not members) else members
        if how == "runtime":
            label = f"{op} (runtime)"
        elif how == "inserted":
            label = f"{op} (inserted)"
        else:
            label = _label(members, op)
        kernels.append(
            {
                "kernel": name,
                "op": op,
                "domain": node.domain if node else "",
                "provider": ev.get("provider", ""),
                "match": how,
                "attributed": rt is not None or bool(members),
                "label": label,
                "layers": members,
                "runtime_layer": rt,
                "brick_digest": _group_key(model, [m["index"] for m in members], g1) if members else None,
                "input_shapes": event_shapes(ev, "input_type_shape"),
                "output_shapes": event_shapes(ev, "output_type_shape"),
                "flops": sum(m["flops"] for m in costed),
                "int_ops": sum(m["int_ops"] for m in costed),
                "bytes_min": sum(m["bytes_min"] for m in costed),
                "cost_of": "runtime layer" if costed and costed[0] is rt else "source layers",
            }
        )
    unattributed = [k for k in kernels if not k["attributed"]]
    unattributed_ops = dict(Counter(k["op"] for k in unattributed))
    summary: dict[str, Any] = {
        "kernels": len(kernels),
        "graph": "runtime" if runtime is not None else "source",
        "attributed": len(kernels) - len(unattributed),
        "unattributed": [{"kernel": k["kernel"], "op": k["op"]} for k in unattributed],
        "unattributed_ops": unattributed_ops,
        "by_match": {h: sum(1 for k in kernels if k["match"] == h) for h in sorted({k["match"] for k in kernels})},
        "inserted_ops": dict(Counter(k["op"] for k in kernels if k["match"] in ("inserted", "runtime"))),
        "unassigned_layers": len(join.unassigned),
        "violations": join.violations,
    }
    if join.violations:
        warnings.append(f"{join.violations} source edge(s) disagree with the executed graph after the join")
    if unattributed:
        where = "the runtime graph's layers" if runtime is not None else "a source layer"
        warnings.append(f"{len(unattributed)} kernel(s) not attributed to {where} ({_ops_list(unattributed_ops)}): "
                        + ", ".join(k["kernel"] for k in unattributed[:5]))
    unmatched = [k for k in kernels if k["attributed"] and k["match"] == "unmatched"]
    if unmatched:
        warnings.append(f"{len(unmatched)} kernel(s) of the runtime graph not traced to a source layer "
                        f"({_ops_list(Counter(k['op'] for k in unmatched))}): "
                        + ", ".join(k["kernel"] for k in unmatched[:5]))
    return kernels, summary, [model.layers[i].name for i in join.unassigned]
