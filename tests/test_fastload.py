"""The fast loader (C++ scan of the serialized model) against the full Python loader.

Both must give the same model: digests, edges, inputs, outputs, layer kinds. The
fast path's layers are built lazily by the full loader, which also re-checks the
digests, so every test elsewhere that reads ``model.layers`` checks agreement too.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import dlbricks
from dlbricks import _core, digest
from dlbricks.errors import DlbricksError, ModelError
from dlbricks.loading import fast as fastpath
from dlbricks.loading import loader
from dlbricks.model import LazyLayers

DATA = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data"
F = T.FLOAT


def full_load(source, **kw):
    saved = loader._FAST_PATH
    loader._FAST_PATH = False
    try:
        return loader.load(source, **kw)
    finally:
        loader._FAST_PATH = saved


def is_fast(model) -> bool:
    return isinstance(model.layers, LazyLayers)


def assert_same(fast, full) -> None:
    assert fast.name == full.name and fast.path == full.path
    assert fast.ir_version == full.ir_version and fast.opset_imports == full.opset_imports
    assert np.array_equal(fast.digests, full.digests)
    for k in ("edge_src", "edge_src_slot", "edge_dst", "edge_dst_slot"):
        assert np.array_equal(getattr(fast, k), getattr(full, k)), k
        assert getattr(fast, k).dtype == np.int32
    assert fast.inputs == full.inputs and fast.outputs == full.outputs
    assert dlbricks.model.layer_kinds(fast.layers) == [layer.kind for layer in full.layers]
    assert dlbricks.model.layer_names(fast.layers) == [layer.name for layer in full.layers]


def shipped_models() -> list[Path]:
    out = sorted((DATA / "light").glob("*.onnx"))
    for sub in ("pytorch-converted", "pytorch-operator", "simple"):
        out += sorted((DATA / sub).glob("*/model.onnx"))
    return out


def test_fast_and_full_loaders_agree_on_every_model_onnx_ships():
    fast_count = 0
    for path in shipped_models():
        fallbacks = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                full = full_load(path)
            except ModelError:
                with pytest.raises(ModelError):  # the fast path never accepts what the full one rejects
                    loader.load(path, on_fallback=fallbacks.append)
                assert len(fallbacks) == 1 and fallbacks[0].expected, fallbacks
                continue
            fast = loader.load(path, on_fallback=fallbacks.append)
        assert_same(fast, full)
        fast_count += is_fast(fast)
        # Each model the fast path leaves is named once, with a reason that is not a
        # fast-path exception.
        assert len(fallbacks) == (not is_fast(fast)) and all(f.expected and f.reason for f in fallbacks), fallbacks
        assert all(f.model == os.fspath(path) for f in fallbacks)
    assert fast_count >= 100


@pytest.mark.parametrize("length", [1, 7, 8, 9, 16, 23, 24, 25, 40])
def test_names_that_differ_in_one_byte_anywhere_stay_apart(length):
    # The scanner compares names word by word, and compares some with a predicted
    # name instead of looking them up (initializers: the last one's id plus the last
    # step, which misses when they are listed out of order). Weights whose names differ
    # in a single byte, at any position, listed shuffled, keep their own shapes.
    import random

    def one_off(at: int, base: str = "n", mark: str = "m") -> str:
        name = [base] * length
        name[at] = mark
        return "".join(name)

    weights = [one_off(at) for at in range(length)]
    shapes = [[4], [1, 4], [1, 1], [1]]
    acts = ["x", *(one_off(at, "q", "p") for at in range(length))]
    nodes = [h.make_node("Add", [a, w], [b]) for a, w, b in zip(acts, weights, acts[1:])]
    inits = [nh.from_array(np.ones(shapes[i % 4], np.float32), w) for i, w in enumerate(weights)]
    random.Random(length).shuffle(inits)
    proto = h.make_model(
        h.make_graph(nodes, "g", [h.make_tensor_value_info("x", F, [1, 4])],
                     [h.make_tensor_value_info(acts[-1], F, [1, 4])], initializer=inits),
        opset_imports=[h.make_opsetid("", 17)],
    )
    assert _core.OnnxScan(proto.SerializeToString()).fallback == ""
    fast, full = loader.load(proto), full_load(proto)
    assert is_fast(fast) and fast.n_layers == len(nodes)
    assert_same(fast, full)
    if length >= 4:
        assert len(set(map(bytes, fast.digests))) == 4  # one layer per weight shape


@pytest.mark.parametrize("path", sorted((DATA / "light").glob("*.onnx")), ids=lambda p: p.stem)
def test_the_light_models_take_the_fast_path_and_stay_lazy(path):
    model = loader.load(path)
    assert is_fast(model) and not model.layers.is_materialized
    dlbricks.Corpus([model]).stats([1, 2, 3])  # analysis needs no Layer objects
    assert not model.layers.is_materialized
    layers = list(model.layers)
    assert model.layers.is_materialized and len(layers) == model.n_layers == model.digests.shape[0]
    assert [layer.digest for layer in layers] == [bytes(d) for d in model.digests]


def test_a_fast_model_pickles_with_its_layers_and_reads_constant_values(tmp_path):
    path = DATA / "light" / "light_resnet50.onnx"
    model = loader.load(path)
    clone = pickle.loads(pickle.dumps(model))
    assert isinstance(clone.layers, list) and len(clone.layers) == model.n_layers
    full = full_load(path)
    name = next(c.name for c in full.layers[0].constants.values())
    assert np.array_equal(model.constant_value(name), full.constant_value(name))
    assert dict(model.constant_types) == dict(full.constant_types)


def test_layers_are_built_from_the_same_file_after_a_change_of_directory(tmp_path, monkeypatch):
    (tmp_path / "m.onnx").write_bytes((DATA / "light" / "light_squeezenet.onnx").read_bytes())
    monkeypatch.chdir(tmp_path)
    model = loader.load("m.onnx")
    assert model.path == "m.onnx"
    monkeypatch.chdir(DATA)
    assert len(list(model.layers)) == model.n_layers


def test_a_file_rewritten_after_fast_loading_is_detected(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes((DATA / "light" / "light_squeezenet.onnx").read_bytes())
    model = loader.load(path)
    path.write_bytes((DATA / "light" / "light_zfnet512.onnx").read_bytes())
    with pytest.raises(DlbricksError, match="no longer match"):
        list(model.layers)


def _vi(name, shape, elem=F):
    return h.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, inits=(), opset=13, ir=8):
    m = h.make_model(h.make_graph(nodes, "g", inputs, outputs, initializer=list(inits)),
                     opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = ir
    return m


def test_value_info_in_any_order_and_for_some_outputs_only_gives_the_same_model():
    # The scanner expects onnx's inferred value_info in node order and looks a name up
    # when the guess fails: declared value_info comes first, in the file's order, and
    # outputs without a type are left out.
    nodes = [h.make_node("Relu", ["x"], ["a"]), h.make_node("Neg", ["a"], ["b"]),
             h.make_node("Split", ["b"], ["c", "d"], axis=1), h.make_node("Add", ["c", "d"], ["e"]),
             h.make_node("Sigmoid", ["e"], ["y"])]
    declared = [_vi("e", [1, 2]), _vi("c", [1, 2]), _vi("a", [1, 4])]
    m = _model(nodes, [_vi("x", [1, 4])], [_vi("y", [1, 2])])
    m.graph.value_info.extend(declared)
    fast = loader.load(m)
    assert is_fast(fast) and fast.n_layers == 5
    assert_same(fast, full_load(m))


def test_control_flow_and_foreign_domains_use_the_full_loader():
    then = h.make_graph([h.make_node("Relu", ["x"], ["t"])], "then", [], [_vi("t", [1, 4])])
    other = h.make_graph([h.make_node("Neg", ["x"], ["e"])], "else", [], [_vi("e", [1, 4])])
    cond = nh.from_array(np.array(True), "c")
    m_if = _model([h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                  [_vi("x", [1, 4])], [_vi("y", [1, 4])], [cond])
    m_ms = h.make_model(
        h.make_graph([h.make_node("Gelu", ["x"], ["y"], domain="com.microsoft")], "g", [_vi("x", [1, 4])],
                     [_vi("y", [1, 4])]),
        opset_imports=[h.make_opsetid("", 13), h.make_opsetid("com.microsoft", 1)],
    )
    for proto in (m_if, m_ms):
        scan = _core.OnnxScan(proto.SerializeToString())
        assert scan.fallback
        model = loader.load(proto)
        assert not is_fast(model)
        assert_same(model, full_load(proto))


def test_a_symbolic_batch_warns_once_with_the_full_loaders_text(tmp_path):
    proto = _model([h.make_node("Relu", ["x"], ["y"])], [_vi("x", ["N", 3])], [_vi("y", ["N", 3])])
    with warnings.catch_warnings(record=True) as fast_w:
        warnings.simplefilter("always")
        fast = loader.load(proto, name="m")
    with warnings.catch_warnings(record=True) as full_w:
        warnings.simplefilter("always")
        full = full_load(proto, name="m")
    assert is_fast(fast)
    assert [str(w.message) for w in fast_w] == [str(w.message) for w in full_w] and len(fast_w) == 1
    assert fast_w[0].filename == __file__  # points at the caller of load()
    assert_same(fast, full)
    # Given shapes go to the full loader (they may override any dim).
    assert not is_fast(loader.load(proto, {"x": [2, 3]}))


# -- the head table -------------------------------------------------------------------------


def _scan_with_heads(buf: bytes, table):
    scan = _core.OnnxScan(buf)
    versions = [fastpath._since_version(op, dict(scan.opsets)[""]) for _, op in scan.op_keys]
    return scan, versions, scan.resolve_heads(buf, table, versions)


def test_heads_are_made_once_per_process_and_reused_by_later_scans(monkeypatch):
    path = DATA / "light" / "light_resnet50.onnx"
    buf = path.read_bytes()
    table = _core.HeadTable()
    scan, versions, missing = _scan_with_heads(buf, table)
    op_names = [op for _, op in scan.op_keys]
    asked = {op_names[k] for _, k, _ in missing}
    # ConstantOfShape reads an initializer only: folded, never a layer, so never asked for.
    assert "ConstantOfShape" not in asked and {"Conv", "BatchNormalization", "Relu"} <= asked
    for h_id, k, attr_bytes in missing:
        attrs = onnx.NodeProto.FromString(attr_bytes).attribute if attr_bytes else ()
        head, outer = digest.make_head("", op_names[k], attrs, versions[k])
        assert not outer
        assert digest._head("", op_names[k], attrs, versions[k]) == (head, outer)  # cached == uncached
        assert digest.make_head_from_fields(op_names[k], versions[k], attr_bytes) == head  # C++ == Python
        scan.set_head(h_id, head, table)
    assert len(table) == len(missing)
    again, _, missing_again = _scan_with_heads(buf, table)
    assert missing_again == []  # every head from the table

    # The loader with a fresh table, then with the table it filled: the same model.
    monkeypatch.setattr(fastpath, "_FAST_HEADS", _core.HeadTable())
    first = loader.load(path)
    second = loader.load(path)
    assert is_fast(first) and is_fast(second)
    assert np.array_equal(first.digests, second.digests)
    assert_same(second, full_load(path))


# -- heads made in C++ ------------------------------------------------------------------
_PLAIN = {
    onnx.AttributeProto.FLOAT, onnx.AttributeProto.INT, onnx.AttributeProto.STRING,
    onnx.AttributeProto.FLOATS, onnx.AttributeProto.INTS, onnx.AttributeProto.STRINGS,
}


def _python_head(op_type: str, version: int, fields: bytes) -> bytes:
    attrs = onnx.NodeProto.FromString(fields).attribute
    head, outer = digest.make_head("", op_type, attrs, version)
    assert not outer
    return head


def test_heads_from_fields_equal_pythons_for_every_node_onnx_ships():
    seen_plain = seen_other = 0
    for path in shipped_models():
        model = onnx.load(path)
        opset = {d or "": v for d, v in ((o.domain, o.version) for o in model.opset_import)}
        for node in model.graph.node:
            version = fastpath._since_version(node.op_type, opset.get("", 1))
            if node.domain not in ("", "ai.onnx") or version is None:
                continue
            fields = onnx.NodeProto(attribute=node.attribute).SerializeToString()
            head = digest.make_head_from_fields(node.op_type, version, fields)
            plain = all(a.type in _PLAIN and a.name.isascii() and not a.ref_attr_name for a in node.attribute)
            if plain:
                seen_plain += 1
                assert head == _python_head(node.op_type, version, fields), (path, node.op_type)
            else:
                seen_other += 1
                assert head is None, (path, node.op_type)
    assert seen_plain > 1000 and seen_other > 0  # the C++ path and the Python one both ran


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _wire_field(number: int, wire: int, payload: bytes) -> bytes:
    """A protobuf field: tag, then the payload (length-prefixed for wire type 2)."""
    if wire == 2:
        payload = _varint(len(payload)) + payload
    return _varint(number << 3 | wire) + payload


_F32 = st.one_of(
    st.floats(width=32, allow_nan=False),
    st.sampled_from([0.0, -0.0, float("inf"), float("-inf"), 1e-45, float("nan")]),
    st.integers(0x7F800001, 0x7FFFFFFF).map(lambda b: np.frombuffer(b.to_bytes(4, "little"), "<f4")[0].item()),
)
_I64 = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63)]))


@st.composite
def _plain_attribute(draw, names):
    """One plain AttributeProto written by hand: fields in any order, repeated numbers
    packed or one per field, a doc string sometimes."""
    name = draw(names)
    kind = draw(st.sampled_from(["f", "i", "s", "floats", "ints", "strings"]))
    typ = {"f": 1, "i": 2, "s": 3, "floats": 6, "ints": 7, "strings": 8}[kind]
    parts = [_wire_field(1, 2, name.encode()), _wire_field(20, 0, _varint(typ))]
    if kind == "f":
        parts.append(_wire_field(2, 5, np.float32(draw(_F32)).tobytes()))
    elif kind == "i":
        parts.append(_wire_field(3, 0, _varint(draw(_I64))))
    elif kind == "s":
        parts.append(_wire_field(4, 2, draw(st.binary(max_size=12))))
    elif kind == "floats":
        values = b"".join(np.float32(v).tobytes() for v in draw(st.lists(_F32, max_size=5)))
        if draw(st.booleans()):
            parts.append(_wire_field(7, 2, values))
        else:
            parts += [_wire_field(7, 5, values[k : k + 4]) for k in range(0, len(values), 4)]
    elif kind == "ints":
        values = draw(st.lists(_I64, max_size=5))
        if draw(st.booleans()):
            parts.append(_wire_field(8, 2, b"".join(_varint(v) for v in values)))
        else:
            parts += [_wire_field(8, 0, _varint(v)) for v in values]
    else:
        parts += [_wire_field(9, 2, v) for v in draw(st.lists(st.binary(max_size=6), max_size=4))]
    if draw(st.booleans()):
        parts.append(_wire_field(13, 2, b"a doc string"))
    order = draw(st.permutations(range(len(parts))))
    return _wire_field(5, 2, b"".join(parts[k] for k in order))


# Ops whose schemas have defaults of each plain kind: an attribute written at its
# default must drop out in both implementations.
_OPS_WITH_DEFAULTS = [("LeakyRelu", 16, ["alpha"]), ("Gemm", 13, ["alpha", "beta", "transA", "transB"]),
                      ("Conv", 11, ["auto_pad", "group", "dilations"]), ("LRN", 13, ["alpha", "beta", "bias", "size"]),
                      ("Relu", 14, ["x"])]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_heads_from_fields_equal_pythons_on_random_plain_attributes(data):
    op, version, known = data.draw(st.sampled_from(_OPS_WITH_DEFAULTS))
    names = st.sampled_from(known + ["b", "a", "zz"])
    fields = b"".join(data.draw(st.lists(_plain_attribute(names), max_size=5)))
    # Some attributes exactly at their schema default (e.g. LeakyRelu alpha=0.01).
    for name in list(digest._schema_defaults(op, version))[:2]:
        if data.draw(st.booleans()):
            attr = onnx.AttributeProto()
            attr.CopyFrom(onnx.defs.get_schema(op, version, "").attributes[name].default_value)
            attr.name = name
            fields += onnx.NodeProto(attribute=[attr]).SerializeToString()
    head = digest.make_head_from_fields(op, version, fields)
    assert head is not None
    assert head == _python_head(op, version, fields)


def test_schema_defaults_from_cpp_equal_pythons_for_every_schema_onnx_has():
    # _schema_defaults canonicalises plain defaults from onnx's serialized bytes in C++;
    # every default-domain schema version must give what the Python writer gives.
    checked = 0
    for schema in onnx.defs.get_all_schemas_with_history():
        if schema.domain != "":
            continue
        expected = {}
        for name, attr in schema.attributes.items():
            default = attr.default_value
            if default.type != onnx.AttributeProto.UNDEFINED:
                expected[name] = digest._attr_body(default, digest._Scopes())
        got = digest._schema_defaults.__wrapped__(schema.name, schema.since_version)
        assert got == expected, (schema.name, schema.since_version)
        checked += len(expected)
    assert checked > 500


@pytest.mark.parametrize(
    "attribute, plain",
    [
        (h.make_attribute("alpha", 0.5), True),
        (h.make_attribute("axes", [1, -2]), True),
        (h.make_attribute("mode", "nearest"), True),
        (h.make_attribute("value", nh.from_array(np.ones(2, np.float32))), False),
        (onnx.AttributeProto(name="alpha", f=0.5), False),  # no type
        (onnx.AttributeProto(type=onnx.AttributeProto.INT, i=1), False),  # no name
    ],
)
def test_one_attribute_body_is_made_in_cpp_when_plain(attribute, plain):
    body = _core.canonical_attribute_body(attribute.SerializeToString())
    if plain:
        assert body == digest._attr_body(attribute, digest._Scopes())
    else:
        assert body is None
    assert _core.canonical_attribute_body(attribute.SerializeToString()[:-1] + b"\xff") is None  # malformed


def test_an_attribute_at_its_schema_default_drops_out_of_the_head():
    bare = digest.make_head_from_fields("LeakyRelu", 16, b"")
    at_default = onnx.NodeProto(attribute=[h.make_attribute("alpha", 0.01)]).SerializeToString()
    other = onnx.NodeProto(attribute=[h.make_attribute("alpha", 0.2)]).SerializeToString()
    assert digest.make_head_from_fields("LeakyRelu", 16, at_default) == bare == _python_head("LeakyRelu", 16, b"")
    assert digest.make_head_from_fields("LeakyRelu", 16, other) not in (None, bare)


@pytest.mark.parametrize(
    "attribute",
    [
        h.make_attribute("value", nh.from_array(np.ones(2, np.float32))),  # a tensor
        h.make_attribute("body", h.make_graph([], "g", [], [])),  # a graph
        onnx.AttributeProto(name="alpha", ref_attr_name="outer_alpha", type=onnx.AttributeProto.FLOAT),
        onnx.AttributeProto(name="alpha", f=0.5),  # type unset: Python guesses it from the fields
        onnx.AttributeProto(name="é", type=onnx.AttributeProto.INT, i=1),  # not ASCII
    ],
    ids=["tensor", "graph", "reference", "untyped", "non-ascii"],
)
def test_heads_that_are_not_plain_are_left_to_python(attribute):
    fields = onnx.NodeProto(attribute=[attribute]).SerializeToString()
    assert digest.make_head_from_fields("LeakyRelu", 16, fields) is None


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_heads_from_arbitrary_bytes_never_crash_and_agree_when_made(data):
    # Random bytes, or valid attribute fields with bytes flipped or cut: C++ either
    # declines (None) or gives exactly what Python makes of the same bytes.
    good = data.draw(st.lists(_plain_attribute(st.sampled_from(["alpha", "axis"])), max_size=3))
    raw = bytearray(b"".join(good)) if good and data.draw(st.booleans()) else bytearray(data.draw(st.binary(max_size=64)))
    for _ in range(data.draw(st.integers(0, 3))):
        if raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    raw = bytes(raw[: data.draw(st.integers(0, len(raw)))])
    head = digest.make_head_from_fields("LeakyRelu", 16, raw)
    if head is not None:
        assert head == _python_head("LeakyRelu", 16, raw)


def test_malformed_attribute_fields_are_left_to_pythons_parser():
    good = onnx.NodeProto(attribute=[h.make_attribute("axis", 1)]).SerializeToString()
    for bad in (good[:-1], good + b"\xff", _wire_field(3, 2, b"x"), _wire_field(5, 2, _wire_field(3, 2, b"x"))):
        assert digest.make_head_from_fields("Concat", 13, bad) is None
    assert digest.make_head_from_fields("Concat", 13, b"") == _python_head("Concat", 13, b"")


def _prefixes_and_defaults(scan, versions, missing):
    op_names = [op for _, op in scan.op_keys]
    prefixes, defaults = [b""] * len(op_names), [None] * len(op_names)
    for _, k, _ in missing:
        prefixes[k], defaults[k] = digest.plain_head_parts(op_names[k], versions[k])
    return prefixes, defaults


def test_plain_heads_are_made_in_one_call_and_the_others_are_left_to_python(monkeypatch):
    # An attribute without its type field is not plain (Python guesses the type from the
    # fields); Relu (no attributes) and LeakyRelu with a typed alpha are plain.
    untyped = h.make_attribute("alpha", 0.2)
    untyped.ClearField("type")
    guessed = h.make_node("LeakyRelu", ["r"], ["z"])
    guessed.attribute.append(untyped)
    graph = h.make_graph(
        [h.make_node("Relu", ["x"], ["r"]), guessed, h.make_node("LeakyRelu", ["z"], ["y"], alpha=0.01)],
        "g",
        [h.make_tensor_value_info("x", T.FLOAT, [1, 4])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 4])],
    )
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    buf = proto.SerializeToString()
    table = _core.HeadTable()
    scan, versions, missing = _scan_with_heads(buf, table)
    prefixes, defaults = _prefixes_and_defaults(scan, versions, missing)
    left = scan.set_plain_heads(buf, [m[0] for m in missing], prefixes, defaults, table)
    assert len(missing) == 3 and left == [hid for hid, k, _ in missing if scan.op_keys[k][1] == "LeakyRelu" and hid in left]
    assert len(left) == 1 and len(table) == 2
    for hid, _, _ in missing:  # the plain ones are given; the one left is still asked for
        if hid not in left:
            with pytest.raises(ValueError, match="did not ask for this head"):
                scan.set_head(hid, b"h", table)
    _, _, missing_again = _scan_with_heads(buf, table)
    assert [m[0] for m in missing_again] == left
    # The loader makes the plain heads in C++ and the other in Python: the same model.
    monkeypatch.setattr(fastpath, "_FAST_HEADS", _core.HeadTable())
    fast = loader.load(proto)
    assert is_fast(fast) and len(fastpath._FAST_HEADS) == 3
    assert_same(fast, full_load(proto))

    with pytest.raises(ValueError, match="one prefix and one defaults entry per op key"):
        scan.set_plain_heads(buf, [missing[0][0]], prefixes[:-1], defaults, table)
    no_prefix = [b""] * len(prefixes)
    with pytest.raises(ValueError, match="no prefix for the head's op"):
        scan.set_plain_heads(buf, [missing[0][0]], no_prefix, defaults, table)
    with pytest.raises(IndexError, match="no such head"):
        scan.set_plain_heads(buf, [10**6], prefixes, defaults, table)
    with pytest.raises(ValueError, match="not the bytes the scan was made from"):
        scan.set_plain_heads(buf[:10], [missing[0][0]], prefixes, defaults, table)


def test_a_full_head_table_empties_itself_and_the_models_stay_right(monkeypatch):
    monkeypatch.setattr(fastpath, "_FAST_HEADS", _core.HeadTable(max_entries=3))
    for name in ("light_squeezenet", "light_resnet50", "light_squeezenet"):
        model = loader.load(DATA / "light" / f"{name}.onnx")
        assert is_fast(model) and len(fastpath._FAST_HEADS) <= 3
        assert_same(model, full_load(DATA / "light" / f"{name}.onnx"))
    # Nothing is kept that is bigger than the table's byte budget.
    tiny = _core.HeadTable(max_bytes=8)
    buf = (DATA / "light" / "light_squeezenet.onnx").read_bytes()
    scan, _, missing = _scan_with_heads(buf, tiny)
    scan.set_head(missing[0][0], b"x" * 100, tiny)
    assert len(tiny) == 0


def test_head_misuse_is_a_clear_error():
    buf = (DATA / "light" / "light_squeezenet.onnx").read_bytes()
    table = _core.HeadTable()
    scan = _core.OnnxScan(buf)
    shapes = [[d[1] for d in dims] for _, _, dims in scan.inputs]
    with pytest.raises(ValueError, match="resolve_heads first"):
        scan.finish(buf, b"", shapes, {})
    scan, versions, missing = _scan_with_heads(buf, table)
    with pytest.raises(ValueError, match="one op version per op key"):
        scan.resolve_heads(buf, table, versions[:-1])
    with pytest.raises(IndexError, match="no such head"):
        scan.set_head(10**6, b"h", table)
    with pytest.raises(ValueError, match="an empty head"):
        scan.set_head(missing[0][0], b"", table)
    scan.set_head(missing[0][0], b"h", table)
    with pytest.raises(ValueError, match="did not ask for this head"):
        scan.set_head(missing[0][0], b"h", table)  # given already
    inferred = onnx.shape_inference.infer_shapes(onnx.load_from_string(scan.light_model(buf, shapes))).SerializeToString()
    with pytest.raises(ValueError, match="never set"):
        scan.finish(buf, inferred, shapes, {})  # the other heads are missing


# -- random graphs with constants in every role -------------------------------------------


@st.composite
def models_with_constants(draw) -> onnx.ModelProto:
    """Chains and merges on [B, 4, 6, 6] float tensors whose constants come from
    initializers, Constant nodes (each attribute kind), ConstantOfShape chains and
    Shape folds, feeding weight, param and omitted slots."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    batch = draw(st.sampled_from([1, "N", 2]))
    shape = [batch, 4, 6, 6]
    real = [1 if batch == "N" else batch, 4, 6, 6]
    nodes, inits = [], []
    tensors = ["x"]
    c = iter(range(10_000))

    def const(kind: str, value: np.ndarray) -> str:
        name = f"c{next(c)}"
        if kind == "init":
            inits.append(nh.from_array(value, name))
        elif kind == "tensor":
            nodes.append(h.make_node("Constant", [], [name], value=nh.from_array(value)))
        elif kind == "ints":
            nodes.append(h.make_node("Constant", [], [name], value_ints=[int(v) for v in value.reshape(-1)]))
        elif kind == "float":
            nodes.append(h.make_node("Constant", [], [name], value_float=float(value)))
        elif kind == "cos":  # a ConstantOfShape chain, as in the light models
            shp = f"s{next(c)}"
            inits.append(nh.from_array(np.array(value.shape, np.int64), shp))
            nodes.append(h.make_node("ConstantOfShape", [shp], [name],
                                     value=nh.from_array(np.array([0.5], np.float32))))
        return name

    for k in range(draw(st.integers(1, 9))):
        a = draw(st.sampled_from(tensors))
        out = f"t{k}"
        op = draw(st.sampled_from(["conv", "reshape", "clip", "add", "split", "concat", "relu", "resize", "shape"]))
        if op == "conv":
            w = const(draw(st.sampled_from(["init", "tensor", "cos"])), rng.normal(size=(4, 4, 3, 3)).astype(np.float32))
            b = const(draw(st.sampled_from(["init", "cos"])), rng.normal(size=(4,)).astype(np.float32))
            g = draw(st.sampled_from([1, 2, 4]))
            if g != 1:  # grouped conv weights have fewer input channels
                w = f"wg{k}"
                inits.append(nh.from_array(rng.normal(size=(4, 4 // g, 3, 3)).astype(np.float32), w))
            nodes.append(h.make_node("Conv", [a, w, b], [out], pads=[1, 1, 1, 1], group=g))
        elif op == "reshape":
            spec = draw(st.sampled_from([[1, 4, 6, 6], [-1, 4, 6, 6], [0, 4, 36, 1]]))
            if batch == 2 and spec[0] == 1:
                spec = [2, 4, 6, 6]
            s = const(draw(st.sampled_from(["init", "tensor", "ints"])), np.array(spec, np.int64))
            r = f"r{k}"
            nodes.append(h.make_node("Reshape", [a, s], [r]))
            back = const("init", np.array([-1, 4, 6, 6], np.int64))
            nodes.append(h.make_node("Reshape", [r, back], [out]))
        elif op == "clip":
            lo = draw(st.sampled_from(["", "init", "float"]))
            lo_name = "" if lo == "" else const(lo, np.array(0.0, np.float32))
            hi = const(draw(st.sampled_from(["init", "float", "tensor"])), np.array(6.0, np.float32))
            nodes.append(h.make_node("Clip", [a, lo_name, hi], [out]))
        elif op == "add":
            b = draw(st.sampled_from(tensors + ["const"]))
            if b == "const":
                b = const(draw(st.sampled_from(["init", "cos", "tensor"])), rng.normal(size=(1, 4, 1, 1)).astype(np.float32))
            nodes.append(h.make_node("Add", [a, b], [out]))
        elif op == "split":
            sp = const("init", np.array([2, 2], np.int64))
            nodes.append(h.make_node("Split", [a, sp], [f"p{k}", f"q{k}"], axis=1))
            other = draw(st.sampled_from(["concat", "drop"]))
            if other == "concat":
                nodes.append(h.make_node("Concat", [f"q{k}", f"p{k}"], [out], axis=1))
            else:  # q is never used: an untyped-unused output is allowed
                nodes.append(h.make_node("Concat", [f"p{k}", f"p{k}"], [out], axis=1))
        elif op == "concat":
            b = draw(st.sampled_from(tensors))
            cat = f"k{k}"
            nodes.append(h.make_node("Concat", [a, b], [cat], axis=1))
            sl = [const("init", np.array(v, np.int64)) for v in ([0], [4], [1])]
            nodes.append(h.make_node("Slice", [cat, sl[0], sl[1], sl[2]], [out]))
        elif op == "resize":
            scales = const(draw(st.sampled_from(["init", "tensor"])), np.array([1, 1, 1, 1], np.float32))
            nodes.append(h.make_node("Resize", [a, "", scales], [out], mode="nearest"))
        elif op == "shape":  # Reshape(a, Shape(b)): a shape folded from a type
            b = draw(st.sampled_from(tensors))
            sh = f"sh{k}"
            nodes.append(h.make_node("Shape", [b], [sh]))
            nodes.append(h.make_node("Reshape", [a, sh], [out]))
        else:
            nodes.append(h.make_node(draw(st.sampled_from(["Relu", "Sigmoid", "Neg"])), [a], [out]))
        tensors.append(out)
    ir = draw(st.sampled_from([3, 8]))
    inputs = [_vi("x", shape)]
    if ir == 3:  # old style: every initializer is also a graph input
        inputs += [h.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    del real
    return _model(nodes, inputs, [_vi(tensors[-1], None)], inits, ir=ir)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models_with_constants())
def test_fast_and_full_loaders_agree_on_random_models(proto):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            full = full_load(proto)
        except ModelError:
            with pytest.raises(ModelError):
                loader.load(proto)
            return
        fast = loader.load(proto)
    assert_same(fast, full)
    # Every construct above is on the fast path, except a Reshape to a Shape fold:
    # inference leaves its output unknown, and the full loader's evaluate-and-retry
    # rounds resolve it.
    if not any(n.op_type == "Shape" for n in proto.graph.node):
        assert is_fast(fast)
    assert [layer.digest for layer in fast.layers] == [layer.digest for layer in full.layers]


# -- malformed bytes ------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_truncated_or_corrupted_bytes_never_crash_the_scanner(data):
    good = (DATA / "light" / "light_squeezenet.onnx").read_bytes()
    buf = bytearray(good)
    how = data.draw(st.sampled_from(["truncate", "flip", "splice"]))
    if how == "truncate":
        buf = buf[: data.draw(st.integers(0, len(buf) - 1))]
    elif how == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(buf) - 1))
            buf[i] = data.draw(st.integers(0, 255))
    else:
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i:i] = data.draw(st.binary(min_size=1, max_size=16))
    # A ValueError (WireError, or a name that is not UTF-8) sends the loader to the full
    # path; anything else, or a crash, is a bug.
    try:
        scan = _core.OnnxScan(bytes(buf))
        if scan.fallback:
            return
        _ = (scan.opsets, scan.op_keys, scan.output_names, scan.head_node)
        shapes = [[d[1] if d[0] == 1 else 1 for d in dims] for _, _, dims in scan.inputs]
        scan.light_model(bytes(buf), shapes)
    except ValueError:
        return


def test_a_corrupted_file_is_a_one_line_model_error(tmp_path):
    good = (DATA / "light" / "light_squeezenet.onnx").read_bytes()
    path = tmp_path / "bad.onnx"
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(ModelError) as err:
        loader.load(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_name_that_is_not_utf8_is_a_one_line_model_error(tmp_path):
    proto = _model([h.make_node("Relu", ["x"], ["y"])], [_vi("x", [1, 3])], [_vi("y", [1, 3])])
    data = proto.SerializeToString()
    assert data.count(b"Relu") == 1
    path = tmp_path / "bad.onnx"
    path.write_bytes(data.replace(b"Relu", b"\xff\xfeRe"))
    with pytest.raises(ModelError) as err:
        loader.load(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_sketch_for_scale_out_needs_no_layer_objects():
    from dlbricks.distributed import sketch

    path = DATA / "light" / "light_inception_v1.onnx"
    model = loader.load(path)
    s = sketch(model)
    assert not model.layers.is_materialized
    full = full_load(path)
    assert [(x.name, x.kind) for x in s.layers] == [(layer.name, layer.kind) for layer in full.layers]


def test_external_weights_are_never_read_by_the_fast_path(tmp_path):
    rng = np.random.default_rng(0)
    w = nh.from_array(rng.normal(size=(64, 64, 3, 3)).astype(np.float32), "w")
    shape = nh.from_array(np.array([1, -1], np.int64), "s")
    proto = _model(
        [h.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), h.make_node("Reshape", ["c", "s"], ["y"])],
        [_vi("x", [1, 64, 8, 8])], [_vi("y", None)], [w, shape],
    )
    path = tmp_path / "ext.onnx"
    onnx.save(proto, path, save_as_external_data=True, all_tensors_to_one_file=True, location="w.bin",
              size_threshold=1024)
    (tmp_path / "w.bin").unlink()  # analysis must not need it
    model = loader.load(path)
    assert is_fast(model)
    assert_same(model, full_load(path))
    with pytest.raises(ModelError, match="not found"):
        model.constant_value("w")  # the weight's value is what needs the file


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from /proc")
def test_scanning_does_not_scale_memory_with_weight_bytes(tmp_path):
    # A 256 MB initializer: the scanner skips its payload, and its tables must be sized
    # from the nodes, not from the graph's byte size (that once zeroed a 64 MB table).
    import subprocess
    import sys
    import textwrap

    x = h.make_tensor_value_info("x", T.FLOAT, [1, 64 << 20])
    y = h.make_tensor_value_info("y", T.FLOAT, [1, 64 << 20])
    w = nh.from_array(np.zeros((1, 64 << 20), dtype=np.float32), "w")
    graph = h.make_graph([h.make_node("Add", ["x", "w"], ["y"])], "g", [x], [y], [w])
    path = tmp_path / "big.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), path)
    del w, graph
    code = textwrap.dedent(
        f"""
        import mmap
        from dlbricks import _core
        def rss_kb():  # resident now (the peak may predate the scan)
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * mmap.PAGESIZE // 1024
        with open({str(path)!r}, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        before = rss_kb()
        scan = _core.OnnxScan(mm)
        assert not scan.fallback, scan.fallback
        print(rss_kb() - before)
        """
    )
    grown_kb = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
    assert grown_kb < 16 * 1024, f"scanning a 256 MB model grew the resident memory by {grown_kb} kB"


# -- loading many files in phases -------------------------------------------------------------


def _mixed_corpus(tmp_path: Path) -> list[Path]:
    """Light models, a bad file, a model the fast path leaves to the full loader, a
    symbolic batch (a warning) and a file big enough to be memory-mapped."""
    then = h.make_graph([h.make_node("Relu", ["x"], ["t"])], "then", [], [_vi("t", [1, 4])])
    other = h.make_graph([h.make_node("Neg", ["x"], ["e"])], "else", [], [_vi("e", [1, 4])])
    m_if = _model([h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                  [_vi("x", [1, 4])], [_vi("y", [1, 4])], [nh.from_array(np.array(True), "c")])
    m_sym = _model([h.make_node("Relu", ["x"], ["y"])], [_vi("x", ["N", 3])], [_vi("y", ["N", 3])])
    w = nh.from_array(np.zeros((1, 1 << 19), np.float32), "w")  # 2 MB: mapped, not read
    m_big = _model([h.make_node("Add", ["x", "w"], ["y"])], [_vi("x", [1, 1 << 19])], [_vi("y", [1, 1 << 19])], [w])
    files = sorted((DATA / "light").glob("light_*.onnx"))[:4]
    for name, proto in (("if", m_if), ("sym", m_sym), ("big", m_big)):
        onnx.save(proto, tmp_path / f"{name}.onnx")
        files.append(tmp_path / f"{name}.onnx")
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    files.insert(2, tmp_path / "bad.onnx")
    return files


@pytest.mark.parametrize("batch_models, batch_bytes", [(64, 32 << 20), (1, 32 << 20), (3, 32 << 20), (64, 100_000)])
def test_iter_load_gives_what_load_gives_file_by_file(tmp_path, batch_models, batch_bytes):
    files = _mixed_corpus(tmp_path)
    got = []
    fell_back = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for path, model, error in loader.iter_load(files, batch_models=batch_models, batch_bytes=batch_bytes,
                                                   on_fallback=fell_back.append):
            # A model's warnings and fallback come while it is yielded, not with the batch.
            got.append((path, model, error, [str(w.message) for w in caught], fell_back[:]))
            caught.clear()
            fell_back.clear()
    assert [g[0] for g in got] == files
    for path, model, error, said, fallbacks in got:
        alone_fallbacks = []
        with warnings.catch_warnings(record=True) as alone:
            warnings.simplefilter("always")
            try:
                want, want_error = loader.load(path, on_fallback=alone_fallbacks.append), None
            except ModelError as exc:
                want, want_error = None, exc
        assert said == [str(w.message) for w in alone]
        assert fallbacks == alone_fallbacks
        if want_error is not None:
            assert model is None and str(error) == str(want_error)
            continue
        assert error is None and is_fast(model) == is_fast(want)
        assert_same(model, want)
    assert "symbolic batch" in got[files.index(tmp_path / "sym.onnx")][3][0]
    assert [f.reason for f in got[files.index(tmp_path / "if.onnx")][4]] == ["control flow or a subgraph attribute"]
    assert got[files.index(tmp_path / "bad.onnx")][4][0].reason.startswith("malformed protobuf bytes")
    assert is_fast(got[-1][1])  # the mapped file took the fast path


def test_iter_load_unmaps_its_files_also_when_interrupted(tmp_path, monkeypatch):
    files = _mixed_corpus(tmp_path)
    big = str(tmp_path / "big.onnx")
    files.insert(0, tmp_path / "big.onnx")  # mapped, in the first batch

    def mapped() -> bool:
        with open("/proc/self/maps") as f:
            return big in f.read()

    # Mapped files are released once the batch's steps that read them are done...
    loading = loader.iter_load(files)
    path, model, _ = next(loading)
    assert path == files[0] and is_fast(model) and not mapped()
    loading.close()
    # ...and when a step is interrupted.
    seen = []
    real_infer = fastpath.infer_light

    def interrupted(prepared):
        seen.append(mapped())
        if len(seen) == 2:
            raise KeyboardInterrupt
        return real_infer(prepared)

    monkeypatch.setattr(fastpath, "infer_light", interrupted)
    with pytest.raises(KeyboardInterrupt):
        next(loader.iter_load(files))
    assert seen == [True, True] and not mapped()


def test_iter_load_with_input_shapes_uses_the_full_loader(tmp_path):
    _mixed_corpus(tmp_path)  # writes sym.onnx, among others
    sym = tmp_path / "sym.onnx"
    [(path, model, error)] = list(loader.iter_load([sym], {"x": [2, 3]}))
    assert path == sym and error is None and not is_fast(model)
    assert model.inputs[0][1].shape == (2, 3)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _wire_field(number, 2, payload)


def test_a_node_with_its_fields_in_any_order_is_the_same_layer(tmp_path):
    # The scanner keys a node's head by the span of its op type and attribute fields
    # when they lie back to back (as serializers write them), else by a key it writes.
    # A node written in another field order, or with a field between those, must give
    # the same layer.
    alpha = h.make_attribute("alpha", 0.2).SerializeToString()
    usual = h.make_node("LeakyRelu", ["x"], ["a"], alpha=0.2).SerializeToString()
    reordered = _field(5, alpha) + _field(4, b"LeakyRelu") + _field(1, b"a") + _field(2, b"b")
    split_up = _field(1, b"b") + _field(2, b"y") + _field(4, b"LeakyRelu") + _field(6, b"doc") + _field(5, alpha)
    empty = _model([], [_vi("x", [1, 4])], [_vi("y", [1, 4])])
    graph = _field(1, usual) + _field(1, reordered) + _field(1, split_up) + empty.graph.SerializeToString()
    empty.ClearField("graph")
    path = tmp_path / "orders.onnx"
    path.write_bytes(empty.SerializeToString() + _field(7, graph))

    # Two head ids: the span of the usual node, and the written key the other two share.
    assert len(_core.OnnxScan(path.read_bytes()).head_node) == 2
    fast = loader.load(path)
    assert is_fast(fast) and fast.n_layers == 3
    assert_same(fast, full_load(path))
    assert len({bytes(d) for d in fast.digests}) == 1


def test_initializers_listed_as_inputs_have_their_types_checked_even_after_an_equal_one(tmp_path):
    # Older models list every initializer among the graph inputs; those types are never
    # read, only checked, and a type whose bytes equal the previous one's is not checked
    # again. One of the same length that differs (here an invalid wire type in its first
    # tag) is still checked: the file is refused, as onnx refuses it.
    w = [nh.from_array(np.zeros([2], np.float32), f"w{i}") for i in range(3)]
    nodes = [h.make_node("Add", ["x", "w0"], ["a"]), h.make_node("Add", ["a", "w1"], ["b"]),
             h.make_node("Add", ["b", "w2"], ["y"])]
    m = _model(nodes, [_vi("x", [2]), _vi("w0", [2]), _vi("w1", [2])], [_vi("y", [2])], inits=w, ir=3)
    good = _vi("w2", [2]).type.SerializeToString()
    graph = m.graph.SerializeToString()
    m.ClearField("graph")
    for name, type_bytes, ok in (("good", good, True), ("bad", bytes([good[0] | 7]) + good[1:], False)):
        path = tmp_path / f"{name}.onnx"
        listed = _field(11, _field(1, b"w2") + _field(2, type_bytes))
        path.write_bytes(m.SerializeToString() + _field(7, graph + listed))
        if ok:
            model = loader.load(path)
            assert is_fast(model) and model.n_layers == 3
        else:
            with pytest.raises(ValueError, match="unsupported wire type"):
                _core.OnnxScan(path.read_bytes())
            with pytest.raises(ModelError, match="bad.onnx"):
                loader.load(path)


def test_each_op_schema_is_looked_up_once_for_its_version_and_its_heads(monkeypatch):
    # What the fast path takes from one schema lookup equals what make_head_from_fields
    # takes from two (version at the model's opset, defaults at that version).
    for schema in onnx.defs.get_all_schemas_with_history():
        if schema.domain not in ("", "ai.onnx") or schema.deprecated:
            continue
        v = schema.since_version
        for opset in (v, v + 1):
            info = fastpath._op_schema(schema.name, opset)
            if info is None or info[0] != v:
                continue  # a newer version took over at opset v + 1
            assert info == (v, *digest.plain_head_parts(schema.name, v)), (schema.name, opset)
    assert fastpath._op_schema("NoSuchOp", 13) is None and fastpath._since_version("NoSuchOp", 13) is None

    # A fresh process's first analysis: one lookup per distinct op.
    fastpath._op_schema.cache_clear()
    fastpath._since_versions.cache_clear()
    digest._schema_defaults.cache_clear()
    monkeypatch.setattr(fastpath, "_FAST_HEADS", _core.HeadTable())
    calls = []
    real = onnx.defs.get_schema
    monkeypatch.setattr(onnx.defs, "get_schema", lambda *a, **k: calls.append(a[:2]) or real(*a, **k))
    model = loader.load(DATA / "light" / "light_resnet50.onnx")
    assert is_fast(model) and len(calls) == len(set(calls)) == len({op for op, _ in calls})
