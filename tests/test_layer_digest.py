"""Layer digests: name-free, weight-value-free, sensitive to everything else."""

from __future__ import annotations

import collections
import hashlib
import os
import random
import struct
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from dlbricks.digest import (
    LAYER_DIGEST_VERSION,
    LAYER_MAGIC,
    constant_role,
    layer_canonical_bytes,
    layer_digest,
)
from dlbricks.loading import loader
from dlbricks.model import ConstInput, TensorType

LIGHT = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"

F = T.FLOAT
X4 = TensorType(F, (1, 3, 8, 8))


def vi(name: str, elem: int = F, shape: list | None = None) -> onnx.ValueInfoProto:
    return h.make_tensor_value_info(name, elem, shape)


def make_model(nodes, inputs, outputs, initializers=(), *, opset=13) -> onnx.ModelProto:
    graph = h.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])


def digests(proto: onnx.ModelProto, **kw) -> list[bytes]:
    return [layer.digest for layer in loader.load(proto, **kw).layers]


# -- golden values: a change here means persisted results no longer match ---------------


def _golden_layers():
    relu = h.make_node("Relu", ["x"], ["y"])
    conv = h.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=1)
    w = ConstInput("w", TensorType(F, (4, 3, 3, 3)), "weight")
    b = ConstInput("b", TensorType(F, (4,)), "weight")
    reshape = h.make_node("Reshape", ["x", "s"], ["y"])
    s = ConstInput("s", TensorType(T.INT64, (2,)), "param", np.array([1, -1], np.int64))
    return {
        "relu": (relu, [X4], [X4], {}, 14),
        "conv": (conv, [X4, w.type, b.type], [TensorType(F, (1, 4, 8, 8))], {1: w, 2: b}, 11),
        "reshape": (reshape, [X4, s.type], [TensorType(F, (1, 192))], {1: s}, 14),
    }


GOLDEN = {
    "relu": "879508142b0bdaa38ace2d47fcce82e3",
    "conv": "87fa1a3691f106bf10b39b3bb15fa540",
    "reshape": "c7addea6bd8da741655b393c3a99a475",
}


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_golden_layer_digests_are_pinned(key):
    node, ins, outs, consts, version = _golden_layers()[key]
    assert layer_digest(node, ins, outs, consts, op_version=version).hex() == GOLDEN[key]


def test_digest_is_blake2b_128_of_the_canonical_bytes_with_a_versioned_magic():
    node, ins, outs, consts, version = _golden_layers()["conv"]
    data = layer_canonical_bytes(node, ins, outs, consts, op_version=version)
    assert LAYER_DIGEST_VERSION == 1
    assert data.startswith(LAYER_MAGIC + struct.pack("<I", LAYER_DIGEST_VERSION))
    assert layer_digest(node, ins, outs, consts, op_version=version) == hashlib.blake2b(data, digest_size=16).digest()


def test_relu_canonical_bytes_follow_the_documented_layout():
    node = h.make_node("Relu", ["x"], ["y"], name="whatever")
    t = TensorType(F, (2, 3))
    ttype = struct.pack("<II2q", F, 2, 2, 3)
    expected = (
        LAYER_MAGIC
        + struct.pack("<I", 1)
        + struct.pack("<I", 0)  # domain ""
        + struct.pack("<I", 4) + b"Relu"
        + struct.pack("<q", 14)
        + struct.pack("<I", 0)  # no attributes
        + struct.pack("<I", 1) + b"\x01" + ttype  # one activation input
        + struct.pack("<I", 1) + b"\x01" + ttype  # one typed output
        + struct.pack("<I", 0)  # no outer references
    )
    assert layer_canonical_bytes(node, [t], [t], op_version=14) == expected


# -- what does not count ----------------------------------------------------------------


def test_names_never_count():
    t = TensorType(F, (2, 3))
    a = h.make_node("Relu", ["x"], ["y"], name="first")
    b = h.make_node("Relu", ["other_in"], ["other_out"], name="second", doc_string="hello")
    assert layer_digest(a, [t], [t]) == layer_digest(b, [t], [t])


def test_default_domain_spellings_agree():
    t = TensorType(F, (2,))
    a = h.make_node("Relu", ["x"], ["y"])
    b = h.make_node("Relu", ["x"], ["y"], domain="ai.onnx")
    assert layer_digest(a, [t], [t], op_version=14) == layer_digest(b, [t], [t], op_version=14)


def test_attributes_at_their_schema_default_equal_omitted_ones():
    a, b = TensorType(F, (2, 3)), TensorType(F, (3, 4))
    out = [TensorType(F, (2, 4))]
    plain = h.make_node("Gemm", ["a", "b"], ["y"])
    spelled = h.make_node("Gemm", ["a", "b"], ["y"], alpha=1.0, transA=0)
    changed = h.make_node("Gemm", ["a", "b"], ["y"], alpha=2.0)
    d = [layer_digest(n, [a, b], out, op_version=13) for n in (plain, spelled, changed)]
    assert d[0] == d[1] != d[2]


def test_attribute_order_does_not_count():
    conv1 = h.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], strides=[1, 1])
    conv2 = h.make_node("Conv", ["x", "w"], ["y"], strides=[1, 1], pads=[1, 1, 1, 1])
    ins = [X4, TensorType(F, (4, 3, 3, 3))]
    outs = [TensorType(F, (1, 4, 8, 8))]
    assert layer_digest(conv1, ins, outs) == layer_digest(conv2, ins, outs)


def test_trailing_omitted_inputs_do_not_count():
    t = TensorType(F, (4,))
    short = h.make_node("Clip", ["x"], ["y"])
    padded = h.make_node("Clip", ["x", "", ""], ["y"])
    assert layer_digest(short, [t], [t]) == layer_digest(padded, [t, None, None], [t])


def test_weight_values_do_not_count_in_a_model():
    base = _conv_model(np.full((4, 3, 3, 3), 0.5, np.float32))
    other = _conv_model(np.random.default_rng(1).normal(size=(4, 3, 3, 3)).astype(np.float32))
    assert digests(base) == digests(other)


def test_constant_node_weight_values_do_not_count():
    def model(fill: float) -> onnx.ModelProto:
        value = nh.from_array(np.full((1, 3, 8, 8), fill, np.float32))
        nodes = [h.make_node("Constant", [], ["k"], value=value), h.make_node("Mul", ["x", "k"], ["y"])]
        return make_model(nodes, [vi("x", F, [1, 3, 8, 8])], [vi("y")])

    assert digests(model(1.0)) == digests(model(3.0))


def test_renaming_every_tensor_and_node_keeps_every_digest():
    proto = onnx.load(LIGHT / "light_inception_v1.onnx")
    assert digests(_renamed(proto, seed=3)) == digests(proto)


# -- what counts ------------------------------------------------------------------------


def _conv_model(w: np.ndarray, *, shape=(1, -1), elem=F, x_shape=(1, 3, 8, 8)) -> onnx.ModelProto:
    np_dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
    nodes = [
        h.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        h.make_node("LeakyRelu", ["c"], ["r"], alpha=0.1),
        h.make_node("Reshape", ["r", "s"], ["y"]),
    ]
    inits = [nh.from_array(w.astype(np_dtype), "w"), nh.from_array(np.array(shape, np.int64), "s")]
    return make_model(nodes, [vi("x", elem, list(x_shape))], [vi("y")], inits)


W = np.ones((4, 3, 3, 3), np.float32)


def test_a_param_value_changes_the_digest_but_nothing_else():
    a = digests(_conv_model(W, shape=(1, -1)))
    b = digests(_conv_model(W, shape=(1, 256)))  # same output shape, other param
    assert a[:2] == b[:2] and a[2] != b[2]


def test_a_dtype_changes_the_digest():
    a = digests(_conv_model(W))
    b = digests(_conv_model(W, elem=T.DOUBLE))
    assert all(x != y for x, y in zip(a, b))


def test_an_input_shape_changes_the_digest():
    a = digests(_conv_model(W))
    b = digests(_conv_model(W), input_shapes={"x": (1, 3, 8, 9)})
    assert all(x != y for x, y in zip(a, b))


def test_a_weight_shape_changes_the_digest():
    t_in, t_out = X4, TensorType(F, (1, 4, 8, 8))
    node = h.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])

    def d(wshape):
        w = ConstInput("w", TensorType(F, wshape), "weight")
        return layer_digest(node, [t_in, w.type], [t_out], {1: w})

    assert d((4, 3, 3, 3)) != d((4, 3, 3, 4))


def test_weight_activation_and_param_roles_differ():
    node = h.make_node("Add", ["x", "k"], ["y"])
    t = TensorType(F, (4,))
    as_weight = {1: ConstInput("k", t, "weight")}
    as_param = {1: ConstInput("k", t, "param", np.zeros(4, np.float32))}
    d = {layer_digest(node, [t, t], [t], c) for c in ({}, as_weight, as_param)}
    assert len(d) == 3


def test_an_output_type_and_an_omitted_output_count():
    node = h.make_node("Dropout", ["x"], ["y", "mask"])
    t = TensorType(F, (4,))
    m = TensorType(T.BOOL, (4,))
    with_mask = layer_digest(node, [t], [t, m])
    unknown_mask = layer_digest(node, [t], [t, None])
    without = layer_digest(h.make_node("Dropout", ["x"], ["y"]), [t], [t])
    assert len({with_mask, unknown_mask, without}) == 3


def test_the_operator_version_counts():
    t = TensorType(F, (2, 5))
    node = h.make_node("Softmax", ["x"], ["y"], axis=1)
    assert layer_digest(node, [t], [t], op_version=11) != layer_digest(node, [t], [t], op_version=13)


_ATTRS = {
    "i": (3, 4),
    "f": (0.5, 0.25),
    "s": (b"constant", b"reflect"),
    "ints": ([1, 2], [2, 1]),
    "floats": ([1.0, 2.0], [1.0, 2.5]),
    "strs": ([b"a", b"b"], [b"a", b"c"]),
    "t": (nh.from_array(np.array([1, 2], np.int32)), nh.from_array(np.array([1, 3], np.int32))),
}


@pytest.mark.parametrize("changed", sorted(_ATTRS))
def test_changing_any_one_attribute_changes_the_digest(changed):
    t = TensorType(F, (4,))

    def node(which: int) -> onnx.NodeProto:
        attrs = {k: v[which if k == changed else 0] for k, v in _ATTRS.items()}
        return h.make_node("Custom", ["x"], ["y"], domain="com.example", **attrs)

    assert layer_digest(node(0), [t], [t], op_version=1) != layer_digest(node(1), [t], [t], op_version=1)


def test_changing_an_attribute_in_a_model_changes_only_that_layer():
    proto = _conv_model(W)
    base = digests(proto)
    for a in proto.graph.node[1].attribute:
        if a.name == "alpha":
            a.f = 0.3
    changed = digests(proto)
    assert base[0] == changed[0] and base[1] != changed[1] and base[2] == changed[2]


def test_nan_payloads_and_float_spellings_canonicalise():
    t = TensorType(F, (2,))
    a = h.make_node("Custom", ["x"], ["y"], domain="d", v=float("nan"))
    b = h.make_node("Custom", ["x"], ["y"], domain="d", v=-float("nan"))
    c = h.make_node("Custom", ["x"], ["y"], domain="d", v=0.0)
    d = h.make_node("Custom", ["x"], ["y"], domain="d", v=-0.0)
    assert layer_digest(a, [t], [t]) == layer_digest(b, [t], [t])
    assert layer_digest(c, [t], [t]) != layer_digest(d, [t], [t])


def test_mismatched_type_lists_are_rejected():
    node = h.make_node("Relu", ["x"], ["y"])
    with pytest.raises(ValueError):
        layer_digest(node, [], [X4])
    with pytest.raises(ValueError):
        layer_digest(node, [None], [X4])


def test_constant_role_rule():
    assert constant_role(TensorType(F, ())) == "param"
    assert constant_role(TensorType(F, (1,))) == "param"
    assert constant_role(TensorType(F, (4,))) == "weight"  # e.g. a conv bias
    assert constant_role(TensorType(F, (4,)), "Resize", 2) == "param"  # scales
    assert constant_role(TensorType(F, (4,)), "Upsample", 1) == "param"
    assert constant_role(TensorType(T.INT64, (4096,))) == "param"
    assert constant_role(TensorType(T.INT64, (4097,))) == "weight"
    assert constant_role(TensorType(T.INT32, (64, 64))) == "param"
    assert constant_role(TensorType(T.INT8, (100,))) == "weight"
    assert constant_role(TensorType(T.UINT8, ())) == "param"  # e.g. a zero point


def test_small_biases_do_not_keep_identical_layers_apart():
    # Two 16-channel convs that differ only in their bias values are one brick.
    rng = np.random.default_rng(0)
    inits = []
    for k in range(2):
        inits.append(nh.from_array(rng.normal(size=(16, 16, 3, 3)).astype(np.float32), f"w{k}"))
        inits.append(nh.from_array(rng.normal(size=16).astype(np.float32), f"b{k}"))
    nodes = [
        h.make_node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1, 1, 1, 1]),
        h.make_node("Conv", ["c0", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
    ]
    model = loader.load(make_model(nodes, [vi("x", F, [1, 16, 5, 5])], [vi("c1")], inits))
    assert all(layer.constants[2].role == "weight" for layer in model.layers)
    assert model.layers[0].digest == model.layers[1].digest


# -- subgraphs --------------------------------------------------------------------------


def _if_node(then_op: str = "Relu", *, inner_name: str = "t", outer: str = "r") -> onnx.NodeProto:
    then_g = h.make_graph([h.make_node(then_op, [outer], [inner_name])], "then", [], [vi(inner_name, F, [4])])
    else_g = h.make_graph([h.make_node("Neg", [outer], ["e"])], "else", [], [vi("e", F, [4])])
    return h.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)


def test_subgraph_bodies_are_name_free_but_structural():
    c, t = TensorType(T.BOOL, ()), TensorType(F, (4,))

    def d(node, outer_type=t):
        return layer_digest(node, [c], [t], op_version=16, outer_types={n: outer_type for n in ("r", "q")})

    base = d(_if_node())
    assert d(_if_node(inner_name="renamed", outer="q")) == base
    assert d(_if_node("Sigmoid")) != base
    assert d(_if_node(), outer_type=TensorType(F, (5,))) != base


def test_if_layers_in_a_model_ignore_names_inside_branches():
    def model(inner: str) -> onnx.ModelProto:
        then_g = h.make_graph([h.make_node("Relu", ["r"], [inner])], "then", [], [vi(inner, F, [4])])
        else_g = h.make_graph([h.make_node("Neg", ["r"], ["e"])], "else", [], [vi("e", F, [4])])
        nodes = [
            h.make_node("Sigmoid", ["x"], ["r"]),
            h.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g),
        ]
        return make_model(nodes, [vi("x", F, [4]), vi("c", T.BOOL, [])], [vi("y")])

    assert digests(model("a")) == digests(model("b"))


# -- property tests ---------------------------------------------------------------------


@st.composite
def random_models(draw) -> onnx.ModelProto:
    """Random DAGs of shape-preserving ops on [1, 4, 6, 6] tensors."""
    n = draw(st.integers(1, 10))
    tensors = ["x"]
    nodes, inits = [], []
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    for k in range(n):
        kind = draw(st.sampled_from(["unary", "binary", "conv", "softmax", "leaky", "transpose"]))
        a = draw(st.sampled_from(tensors))
        out = f"t{k}"
        if kind == "unary":
            nodes.append(h.make_node(draw(st.sampled_from(["Relu", "Sigmoid", "Tanh", "Neg"])), [a], [out]))
        elif kind == "binary":
            b = draw(st.sampled_from(tensors))
            nodes.append(h.make_node(draw(st.sampled_from(["Add", "Mul", "Sub"])), [a, b], [out]))
        elif kind == "conv":
            inits.append(nh.from_array(rng.normal(size=(4, 4, 3, 3)).astype(np.float32), f"w{k}"))
            nodes.append(h.make_node("Conv", [a, f"w{k}"], [out], pads=[1, 1, 1, 1]))
        elif kind == "softmax":
            nodes.append(h.make_node("Softmax", [a], [out], axis=draw(st.integers(-4, 3))))
        elif kind == "leaky":
            alpha = draw(st.sampled_from([0.01, 0.1, 0.2]))
            nodes.append(h.make_node("LeakyRelu", [a], [out], alpha=alpha))
        else:
            nodes.append(h.make_node("Transpose", [a], [out], perm=[0, 1, 3, 2]))
        tensors.append(out)
    return make_model(nodes, [vi("x", F, [1, 4, 6, 6])], [vi(tensors[-1])], inits)


def _renamed(proto: onnx.ModelProto, seed: int) -> onnx.ModelProto:
    """A copy with every tensor and node renamed."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    g = out.graph
    names = {vi.name for vi in g.input} | {t.name for t in g.initializer}
    for node in g.node:
        names.update(node.input)
        names.update(node.output)
    names.discard("")
    shuffled = sorted(names)
    random.Random(seed).shuffle(shuffled)
    new = {n: f"v{i}" for i, n in enumerate(shuffled)}
    for seq in (g.input, g.output, g.value_info):
        for v in seq:
            v.name = new.get(v.name, v.name)
    for t in g.initializer:
        t.name = new[t.name]
    for k, node in enumerate(g.node):
        node.name = f"node{k}x"
        node.input[:] = [new.get(n, n) for n in node.input]
        node.output[:] = [new.get(n, n) for n in node.output]
    return out


@settings(max_examples=40, deadline=None)
@given(random_models(), st.randoms(use_true_random=False))
def test_shuffling_the_node_list_keeps_the_multiset_of_digests(proto, rnd):
    base = collections.Counter(digests(proto))
    shuffled = onnx.ModelProto()
    shuffled.CopyFrom(proto)
    nodes = list(shuffled.graph.node)
    rnd.shuffle(nodes)
    del shuffled.graph.node[:]
    shuffled.graph.node.extend(nodes)
    assert collections.Counter(digests(shuffled)) == base


@settings(max_examples=40, deadline=None)
@given(random_models(), st.integers(0, 1000))
def test_renaming_keeps_every_digest(proto, seed):
    assert digests(_renamed(proto, seed)) == digests(proto)


@settings(max_examples=10, deadline=None)
@given(st.randoms(use_true_random=False))
def test_shuffling_a_real_model_keeps_the_multiset_of_digests(rnd):
    proto = onnx.load(LIGHT / "light_squeezenet.onnx")
    base = collections.Counter(digests(proto))
    nodes = list(proto.graph.node)
    rnd.shuffle(nodes)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    assert collections.Counter(digests(proto)) == base


def test_cached_operator_and_attribute_bytes_match_a_fresh_computation():
    # Layers that repeat an operator and its attributes share cached head bytes; a
    # warm cache must give exactly what a cold one gives, for every light-model layer.
    from dlbricks import digest

    models = [loader.load(p) for p in sorted(LIGHT.glob("light_*.onnx"))]
    layers = [layer for m in models for layer in m.layers]

    def canonical(layer):
        return layer_canonical_bytes(
            layer.node, layer.input_types, layer.output_types, layer.constants, op_version=1
        )

    warm = [canonical(layer) for layer in layers]
    cold = []
    for layer in layers:
        digest._HEADS.clear()
        digest._TYPE_BYTES.clear()
        cold.append(canonical(layer))
    assert warm == cold
    assert [canonical(layer) for layer in layers] == warm
