"""Brick generation: standalone, valid, runnable ONNX models that compute what the
source model computes, with reproducible synthetic weights and bounded memory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import light
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from dlbricks.bricks import generate_brick, generate_bricks, write_brick
from dlbricks.corpus import Corpus
from dlbricks.errors import UsageError
from dlbricks.graph import split
from dlbricks.loading import load
from dlbricks.model import Model

# Largest weight of the corpus: VGG-19's fc6 Gemm, 25088x4096 float32 plus its bias.
VGG_FC6_BYTES = (25088 * 4096 + 4096) * 4


# -- helpers ----------------------------------------------------------------------------


def _ort_session(model: str | bytes | onnx.ModelProto, *, optimize: bool = True):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if not optimize:
        # Same kernels, no fusions: a brick and its source then compute bit-for-bit alike.
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


_TYPE_RE = re.compile(r"^(\w+)\[([0-9x]*)\]$")


def _parse_type(text: str) -> tuple[np.dtype, tuple[int, ...]]:
    """'float32[1x3x8x8]' -> (float32, (1, 3, 8, 8)); 'bool[]' is a scalar."""
    m = _TYPE_RE.match(text)
    assert m, text
    dims = tuple(int(d) for d in m.group(2).split("x")) if m.group(2) else ()
    return np.dtype(m.group(1)), dims


def _synthetic_feeds(info: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds = {}
    for name, text in info["inputs"].items():
        dtype, shape = _parse_type(text)
        if dtype == np.bool_:
            feeds[name] = np.asarray(rng.random(shape) < 0.5)
        elif np.issubdtype(dtype, np.integer):
            bound = info["int_bounds"].get(name, 1)
            feeds[name] = rng.integers(0, bound, size=shape).astype(dtype)
        else:
            feeds[name] = rng.random(shape, dtype=np.float32).astype(dtype)
    return feeds


def _source_tensors(proto: onnx.ModelProto, model: Model, feeds: dict[str, np.ndarray], names) -> dict:
    """Run the source model once with the tensors ``names`` exposed as extra outputs."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(proto)
    present = {vi.name for vi in exposed.graph.output} | set(feeds)
    types = dict(model.inputs)
    for layer in model.layers:
        types.update((n, t) for n, t in zip(layer.outputs, layer.output_types) if n and t is not None)
    for name in sorted(set(names) - present):
        t = types[name]
        exposed.graph.output.append(h.make_tensor_value_info(name, t.elem_type, list(t.shape)))
    sess = _ort_session(exposed, optimize=False)
    out_names = [o.name for o in sess.get_outputs()]
    values = dict(zip(out_names, sess.run(None, feeds)))
    values.update(feeds)
    return values


def _assert_brick_matches_source(model: Model, members, reference: dict) -> int:
    """Generate the brick with the source's weights, feed it the source's tensors and
    compare its outputs with the source's tensors of the same names. Returns #outputs."""
    proto, info = generate_brick(model, list(members), weights="source")
    onnx.checker.check_model(proto, full_check=True)
    sess = _ort_session(proto, optimize=False)
    feeds = {i.name: reference[i.name] for i in sess.get_inputs()}
    got = sess.run(None, feeds)
    for out, value in zip(sess.get_outputs(), got):
        want = reference[out.name]
        assert value.shape == want.shape, (info.source_layers, out.name)
        scale = float(np.abs(want).max()) if want.size and want.dtype.kind == "f" else 1.0
        np.testing.assert_allclose(
            value, want, rtol=1e-5, atol=1e-6 * max(1.0, scale), err_msg=f"{info.source_layers} -> {out.name}"
        )
    return len(got)


# -- all nine light models, G=1 and G=3 --------------------------------------------------

# Runs in a fresh process so that its peak RSS measures generation alone: the process
# loads the corpus, notes its high-water mark, then generates the G=1 and G=3 bricks.
# The mark is VmHWM: ru_maxrss survives fork and exec, so it could be pytest's own peak.
_GENERATE_SCRIPT = r"""
import json, sys
from dlbricks.bricks import generate_bricks
from dlbricks.loading import load
out, paths = sys.argv[1], sys.argv[2:]
models = [load(p) for p in paths]
def peak():
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None  # not Linux
before = peak()
infos = generate_bricks(models, 1, out + "/g1", check=True)
after_g1 = peak()
generate_bricks(models, 3, out + "/g3", check=True)
print(json.dumps({"before": before, "after_g1": after_g1, "weights_g1": [i.weight_bytes for i in infos]}))
"""


@pytest.fixture(scope="module")
def corpus_bricks(tmp_path_factory, light_paths) -> dict:
    out = tmp_path_factory.mktemp("light_bricks")
    proc = subprocess.run(
        [sys.executable, "-c", _GENERATE_SCRIPT, str(out), *map(str, light_paths)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["dirs"] = {1: out / "g1", 3: out / "g3"}
    return result


@pytest.fixture(scope="module")
def light_models(light_paths) -> dict[str, Model]:
    return {p.stem: load(p) for p in light_paths}


def _manifest(corpus_bricks: dict, G: int) -> dict:
    return json.loads((corpus_bricks["dirs"][G] / "manifest.json").read_text())


def _source_layers(models: dict[str, Model], info: dict):
    model = models[info["source_model"]]
    by_name = {layer.name: layer for layer in model.layers}
    return model, [by_name[n] for n in info["source_layers"]]


@pytest.mark.parametrize("G", [1, 3])
def test_every_light_brick_passes_the_full_check_and_runs_with_the_manifest_shapes(corpus_bricks, light_models, G):
    manifest = _manifest(corpus_bricks, G)
    folder = corpus_bricks["dirs"][G]
    rng = np.random.default_rng(G)
    assert manifest["G"] == G and len(manifest["bricks"]) > 0
    for info in manifest["bricks"]:
        path = folder / info["file"]
        # Independent of write_brick's own check: the saved file, weights beside it.
        onnx.checker.check_model(str(path), full_check=True)
        brick = onnx.load(str(path), load_external_data=False)
        source = light_models[info["source_model"]]
        assert {o.domain or "": o.version for o in brick.opset_import} == source.opset_imports
        assert len(brick.graph.node) == info["layers"] <= G
        sess = _ort_session(str(path))
        assert {i.name for i in sess.get_inputs()} == set(info["inputs"])
        outputs = sess.run(None, _synthetic_feeds(info, rng))
        names = [o.name for o in sess.get_outputs()]
        assert set(names) == set(info["outputs"])
        for name, value in zip(names, outputs):
            dtype, shape = _parse_type(info["outputs"][name])
            assert value.shape == shape and value.dtype == dtype, (info["file"], name)
            if value.dtype.kind == "f":
                assert np.isfinite(value).all(), (info["source_layers"], name)


@pytest.mark.parametrize("G", [1, 3])
def test_brick_inputs_are_the_activations_entering_the_window_with_concrete_shapes(corpus_bricks, light_models, G):
    for info in _manifest(corpus_bricks, G)["bricks"]:
        model, layers = _source_layers(light_models, info)
        produced = {o for layer in layers for o in layer.outputs if o}
        consumed = set()
        entering: dict[str, str] = {}
        for layer in layers:
            for slot in layer.activation_slots():
                name = layer.inputs[slot]
                consumed.add(name)
                if name not in produced:
                    entering[name] = str(layer.input_types[slot])
        assert info["inputs"] == entering
        window = {layer.index for layer in layers}
        read_outside = {
            other.inputs[s] for other in model.layers if other.index not in window for s in other.activation_slots()
        }
        model_outputs = {n for n, _ in model.outputs}
        leaving = {
            o: str(t)
            for layer in layers
            for o, t in zip(layer.outputs, layer.output_types)
            # an unused, untyped output (Dropout's mask) is dropped
            if o and t is not None and (o not in consumed or o in read_outside or o in model_outputs)
        }
        assert info["outputs"] == leaving


def test_values_consumed_inside_and_outside_the_window_are_brick_outputs(light_models):
    model = light_models["light_resnet50"]
    consumers = model.consumers()
    model_outputs = {n for n, _ in model.outputs}
    for members in split(model, 3).sequences():
        window = set(members.tolist())
        proto, _ = generate_brick(model, members.tolist(), weights_file=os.devnull)
        outputs = {vi.name for vi in proto.graph.output}
        for i in window:
            for name in model.layers[i].outputs:
                leaves = name in model_outputs or any(c not in window for c, _ in consumers.get(name, []))
                if name and leaves:
                    assert name in outputs, (model.layers[i].name, name)


@pytest.mark.parametrize("G", [1, 3])
def test_brick_constants_keep_source_dtype_and_shape_and_params_keep_their_values(corpus_bricks, light_models, G):
    folder = corpus_bricks["dirs"][G]
    n_params = n_weights = 0
    for info in _manifest(corpus_bricks, G)["bricks"]:
        _, layers = _source_layers(light_models, info)
        consts = {c.name: c for layer in layers for c in layer.constants.values()}
        brick = onnx.load(str(folder / info["file"]), load_external_data=False)
        inits = {t.name: t for t in brick.graph.initializer}
        assert set(inits) == set(consts), info["file"]  # no constant became a graph input
        assert not set(inits) & {vi.name for vi in brick.graph.input}
        for name, t in inits.items():
            c = consts[name]
            assert (t.data_type, tuple(t.dims)) == (c.type.elem_type, c.type.shape), (info["file"], name)
            if c.role == "param":
                n_params += 1
                np.testing.assert_array_equal(nh.to_array(t), c.value)
            else:
                n_weights += 1
                if c.type.nbytes >= 1024:  # big weights live beside the model, not in it
                    assert t.data_location == T.EXTERNAL
    assert n_params > 0 and n_weights > 0


def test_reshape_shape_is_copied_by_value_and_batchnorm_variance_is_positive(corpus_bricks, light_models):
    folder = corpus_bricks["dirs"][1]
    seen = set()
    for info in _manifest(corpus_bricks, 1)["bricks"]:
        op = info["op_types"][0]
        if op not in ("Reshape", "BatchNormalization"):
            continue
        (layer,) = _source_layers(light_models, info)[1]
        brick = onnx.load(str(folder / info["file"]))  # with its external weights
        value = {t.name: nh.to_array(t) for t in brick.graph.initializer}
        if op == "Reshape":
            shape = value[layer.inputs[1]]
            assert shape.dtype == np.int64
            np.testing.assert_array_equal(shape, layer.constants[1].value)
        else:
            scale, bias, mean, var = (value[layer.inputs[s]] for s in (1, 2, 3, 4))
            assert var.dtype == np.float32 and var.shape == layer.input_types[4].shape
            assert (var > 0).all() and (scale > 0).all()
            assert len(np.unique(var)) > 1 and len(np.unique(bias)) > 1  # random, not constant
        seen.add(op)
    assert seen == {"Reshape", "BatchNormalization"}


@pytest.mark.parametrize("G", [1, 3])
def test_manifest_occurrences_sum_to_each_models_sequence_count(corpus_bricks, light_models, G):
    manifest = _manifest(corpus_bricks, G)
    models = [light_models[name] for name in manifest["models"]]
    sp = Corpus(models).split(G)
    assert len(manifest["bricks"]) == sp.n_unique
    assert [b["digest"] for b in manifest["bricks"]] == [bytes(d).hex() for d in sp.unique_digests]
    for model in models:
        total = sum(b["occurrences"].get(model.name, 0) for b in manifest["bricks"])
        assert total == len(split(model, G))
    assert sum(sum(b["occurrences"].values()) for b in manifest["bricks"]) == sp.n_sequences
    # Bricks shared across models: the corpus holds fewer bricks than the models' sums.
    assert sp.n_unique < sum(len(np.unique(sp.model_seq_ids(i))) for i in range(len(models)))


def test_generation_holds_one_bricks_weights_at_a_time(corpus_bricks):
    weights = sorted(corpus_bricks["weights_g1"], reverse=True)
    assert weights[0] == VGG_FC6_BYTES
    if corpus_bricks["before"] is None:
        pytest.skip("peak RSS (VmHWM) needs Linux /proc")
    growth = corpus_bricks["after_g1"] - corpus_bricks["before"]
    # Holding any two bricks' weights at once needs at least the two largest together;
    # generating them one at a time needs one (and the interpreter's small change).
    assert weights[0] <= growth + (64 << 20)
    assert growth < weights[0] + weights[1], (growth, weights[:2], sum(weights))


# -- determinism ---------------------------------------------------------------------------


def test_generating_again_keeps_bricks_of_the_same_seed_and_rewrites_those_of_another(tmp_path):
    model = load(light("squeezenet"))
    out = tmp_path / "bricks"
    generate_bricks([model], 3, out, seed=0)
    data = sorted(out.glob("*.data"))
    seed0 = {p.name: p.read_bytes() for p in data}
    stamps = {p.name: p.stat().st_mtime_ns for p in data}
    generate_bricks([model], 3, out, seed=0)
    assert {p.name: p.stat().st_mtime_ns for p in data} == stamps  # kept, not written again
    generate_bricks([model], 3, out, seed=1)
    assert json.loads((out / "manifest.json").read_text())["seed"] == 1
    assert all(p.read_bytes() != seed0[p.name] for p in data)  # the seed the manifest names


def test_generating_into_a_file_is_a_usage_error(tmp_path):
    target = tmp_path / "afile"
    target.write_text("x")
    with pytest.raises(UsageError, match="afile: exists and is not a folder"):
        generate_bricks([load(light("squeezenet"))], 1, target)
    assert target.read_text() == "x"


def test_same_digest_and_seed_give_identical_bricks_and_another_seed_other_weights(tmp_path):
    model = load(light("squeezenet"))
    a = generate_bricks([model], 3, tmp_path / "a", seed=7)
    b = generate_bricks([model], 3, tmp_path / "b", seed=7)
    generate_bricks([model], 3, tmp_path / "c", seed=8)
    assert [i.to_dict() for i in a] == [i.to_dict() for i in b]
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    assert any(f.endswith(".data") for f in files)
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    data = [f for f in files if f.endswith(".data")]
    assert all((tmp_path / "a" / f).read_bytes() != (tmp_path / "c" / f).read_bytes() for f in data)
    # In memory too, and the seed comes from the digest, not the call order.
    members = split(model, 3).sequence(4).tolist()
    first, _ = generate_brick(model, members, digest="ab" * 16, seed=7)
    generate_brick(model, split(model, 3).sequence(5).tolist(), digest="cd" * 16, seed=7)
    again, _ = generate_brick(model, members, digest="ab" * 16, seed=7)
    other, _ = generate_brick(model, members, digest="ef" * 16, seed=7)
    assert first.SerializeToString() == again.SerializeToString()
    assert first.SerializeToString() != other.SerializeToString()


def test_members_in_any_order_build_the_brick_of_their_topological_order():
    model = load(light("squeezenet"))
    members = split(model, 3).sequence(4).tolist()
    assert len(members) == 3
    ordered, info = generate_brick(model, members, digest="ab" * 16)
    shuffled, shuffled_info = generate_brick(model, members[::-1], digest="ab" * 16)
    onnx.checker.check_model(shuffled, full_check=True)
    assert shuffled.SerializeToString() == ordered.SerializeToString()
    assert shuffled_info.source_layers == info.source_layers


# -- bricks compute what the source computes ----------------------------------------------------


@pytest.mark.parametrize("name", ["squeezenet", "resnet50"])
def test_light_bricks_with_source_weights_reproduce_the_source_intermediates(name):
    path = light(name)
    proto = onnx.load(str(path))
    model = load(path)
    sequences = split(model, 3).sequences()
    mid = len(sequences) // 2
    # The first, the middle, the last, and every one with several external inputs.
    chosen = {0, mid, len(sequences) - 1}
    for s, members in enumerate(sequences):
        ins = {model.layers[i].inputs[k] for i in members for k in model.layers[i].activation_slots()}
        outs = {o for i in members for o in model.layers[i].outputs}
        if len(ins - outs) > 1:
            chosen.add(s)
    assert len(chosen) > 3
    names = set()
    for s in chosen:
        for i in sequences[s]:
            layer = model.layers[i]
            names.update(layer.inputs[k] for k in layer.activation_slots())
            names.update(o for o in layer.outputs if o)
    (in_name, in_type), = model.inputs
    feeds = {in_name: np.random.default_rng(0).random(in_type.shape, dtype=np.float32)}
    reference = _source_tensors(proto, model, feeds, names)
    compared = sum(_assert_brick_matches_source(model, sequences[s].tolist(), reference) for s in sorted(chosen))
    assert compared >= len(chosen)


def _random_resnet_block() -> onnx.ModelProto:
    """Conv+BN+Relu, Conv+BN, Add skip, Relu, pooling, Reshape, Gemm, Concat, Softmax
    with random (seeded) real initializers."""
    rng = np.random.default_rng(42)

    def init(name, *shape, positive=False):
        v = rng.uniform(0.5, 1.5, shape) if positive else rng.standard_normal(shape) * 0.3
        return nh.from_array(v.astype(np.float32), name)

    inits = [
        init("w1", 8, 3, 3, 3), init("b1", 8),
        init("s1", 8, positive=True), init("o1", 8), init("m1", 8), init("v1", 8, positive=True),
        init("w2", 8, 8, 3, 3),
        init("s2", 8, positive=True), init("o2", 8), init("m2", 8), init("v2", 8, positive=True),
        init("fc", 5, 8), init("fcb", 5), init("alt", 8, 3),
        nh.from_array(np.array([1, -1], np.int64), "flat"),
        nh.from_array(np.array(0.5, np.float32), "half"),
    ]
    nodes = [
        h.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        h.make_node("BatchNormalization", ["c1", "s1", "o1", "m1", "v1"], ["n1"], name="bn1"),
        h.make_node("Relu", ["n1"], ["r1"], name="relu1"),
        h.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        h.make_node("BatchNormalization", ["c2", "s2", "o2", "m2", "v2"], ["n2"], name="bn2"),
        h.make_node("Add", ["n2", "r1"], ["sum"], name="skip"),
        h.make_node("Relu", ["sum"], ["r2"], name="relu2"),
        h.make_node("GlobalAveragePool", ["r2"], ["gap"], name="gap"),
        h.make_node("Reshape", ["gap", "flat"], ["vec"], name="flatten"),
        h.make_node("Gemm", ["vec", "fc", "fcb"], ["logits"], name="fc", transB=1),
        h.make_node("Mul", ["vec", "half"], ["halfvec"], name="scale"),
        h.make_node("MatMul", ["halfvec", "alt"], ["side"], name="side"),
        h.make_node("Concat", ["logits", "side"], ["both"], name="concat", axis=1),
        h.make_node("Softmax", ["both"], ["y"], name="softmax", axis=1),
    ]
    graph = h.make_graph(
        nodes, "block", [h.make_tensor_value_info("x", T.FLOAT, [1, 3, 12, 12])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 8])], inits,
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 15)])


def test_bricks_of_a_model_with_random_weights_reproduce_its_intermediates():
    proto = _random_resnet_block()
    model = load(proto)
    assert model.n_layers == 14
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 3, 12, 12)).astype(np.float32)}
    all_names = {n for layer in model.layers for n in (*layer.inputs, *layer.outputs) if n}
    reference = _source_tensors(proto, model, feeds, all_names - set(model.constant_types))
    compared = 0
    for G in (1, 2, 3, 5):
        for members in split(model, G).sequences():
            compared += _assert_brick_matches_source(model, members.tolist(), reference)
    assert compared > 14
    # Synthetic weights compute something else: the comparison above can tell.
    members = split(model, 3).sequence(0).tolist()
    proto_syn, _ = generate_brick(model, members)
    sess = _ort_session(proto_syn, optimize=False)
    got = sess.run(None, {"x": feeds["x"]})
    assert not np.allclose(got[0], reference[sess.get_outputs()[0].name])


# -- control flow: subgraphs reading outer-scope tensors ------------------------------------------


def _control_flow_model() -> onnx.ModelProto:
    """If and Loop whose bodies read tensors of the main graph that are not node inputs:
    ``r`` (an activation made by an earlier layer) and ``k`` (an initializer)."""
    vi = h.make_tensor_value_info
    then_g = h.make_graph([h.make_node("Add", ["r", "k"], ["t"])], "then", [], [vi("t", T.FLOAT, [1, 8])])
    else_g = h.make_graph([h.make_node("Mul", ["r", "q"], ["e"])], "else", [], [vi("e", T.FLOAT, [1, 8])])
    body = h.make_graph(
        [h.make_node("Identity", ["cond_in"], ["cond_out"]), h.make_node("Add", ["acc", "r"], ["acc_out"])],
        "body",
        [vi("i", T.INT64, []), vi("cond_in", T.BOOL, []), vi("acc", T.FLOAT, [1, 8])],
        [vi("cond_out", T.BOOL, []), vi("acc_out", T.FLOAT, [1, 8])],
    )
    nodes = [
        h.make_node("Sigmoid", ["x"], ["r"], name="sig"),
        h.make_node("Relu", ["x"], ["q"], name="relu"),
        h.make_node("If", ["c"], ["y"], name="branch", then_branch=then_g, else_branch=else_g),
        h.make_node("Loop", ["trips", "go", "y"], ["looped"], name="loop", body=body),
        h.make_node("Tanh", ["looped"], ["z"], name="out"),
    ]
    inits = [
        nh.from_array(np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 8), "k"),
        nh.from_array(np.array(3, np.int64), "trips"),
        nh.from_array(np.array(True), "go"),
    ]
    graph = h.make_graph(
        nodes, "cf", [vi("x", T.FLOAT, [1, 8]), vi("c", T.BOOL, [])], [vi("z", T.FLOAT, [1, 8])], inits
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])


def test_control_flow_bricks_take_outer_scope_tensors_as_inputs(tmp_path):
    proto = _control_flow_model()
    model = load(proto)
    assert [layer.kind for layer in model.layers] == ["Sigmoid", "Relu", "If", "Loop", "Tanh"]
    # Every G=1 brick, If and Loop included, is written, checked and runs.
    infos = {i.op_types[0]: i for i in generate_bricks([model], 1, tmp_path, check=True)}
    assert infos["If"].inputs == {"c": "bool[]", "r": "float32[1x8]", "q": "float32[1x8]"}
    assert infos["Loop"].inputs == {"y": "float32[1x8]", "r": "float32[1x8]"}
    rng = np.random.default_rng(0)
    for info in infos.values():
        sess = _ort_session(str(tmp_path / info.file))
        (out,) = sess.run(None, _synthetic_feeds(info.to_dict(), rng))
        assert out.shape == (1, 8)
    brick = onnx.load(str(tmp_path / infos["If"].file))
    assert [t.name for t in brick.graph.initializer] == ["k"]  # the outer initializer came along
    # With the source's weights, each brick computes the source's tensor, on both branches.
    x = rng.standard_normal((1, 8)).astype(np.float32)
    names = {"r", "q", "y", "looped", "z"}
    for cond in (True, False):
        reference = _source_tensors(proto, model, {"x": x, "c": np.array(cond)}, names)
        for i in range(model.n_layers):
            _assert_brick_matches_source(model, [i], reference)
        _assert_brick_matches_source(model, [2, 3, 4], reference)


def test_write_brick_leaves_the_brick_file_and_no_temporaries(tmp_path):
    model = load(_control_flow_model())
    proto, info = write_brick(model, [2], tmp_path / "if.onnx", check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["if.onnx"]  # k is under 1 KiB: inline
    assert info.file == "if.onnx" and info.layers == 1
    onnx.checker.check_model(str(tmp_path / "if.onnx"), full_check=True)


def test_bricks_of_onnxruntimes_own_onnx_domain_ops_pass_the_checker_and_run(tmp_path):
    # onnxruntime writes T5's RMSNorm into its runtime graphs as SimplifiedLayerNormalization,
    # an op of the ONNX domain that onnx does not define: the checker must not reject it,
    # with its weight inline or (>= 1 KiB) in the brick's external data file.
    vi = h.make_tensor_value_info
    width = 512
    g = nh.from_array(np.linspace(0.5, 1.5, width, dtype=np.float32), "g")
    nodes = [
        h.make_node("SimplifiedLayerNormalization", ["x", "g"], ["s"], name="rms", axis=-1, epsilon=1e-6),
        h.make_node("Relu", ["s"], ["y"], name="relu"),
    ]
    graph = h.make_graph(nodes, "rms", [vi("x", T.FLOAT, [2, width])], [vi("y", T.FLOAT, [2, width])], [g],
                         value_info=[vi("s", T.FLOAT, [2, width])])
    model = load(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]))
    assert [layer.kind for layer in model.layers] == ["SimplifiedLayerNormalization", "Relu"]
    for members in ([0], [0, 1]):
        path = tmp_path / f"rms{len(members)}.onnx"
        proto, info = write_brick(model, members, path, check=True)
        assert onnx.load(str(path)).graph.node[0].domain == ""  # checked as written, saved as generated
        (out,) = _ort_session(str(path)).run(None, {"x": np.ones((2, width), np.float32)})
        assert out.shape == (2, width) and info.op_types[0] == "SimplifiedLayerNormalization"
        assert (tmp_path / f"rms{len(members)}.onnx.data").exists()
    assert not [p.name for p in tmp_path.iterdir() if "check" in p.name or p.suffix == ".tmp"]
