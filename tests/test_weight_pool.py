"""The weight pool: one run's synthetic weights, shared by the models it generates."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from dlbricks.bricks import generate_brick, weight_range
from dlbricks.loading import load
from dlbricks.model import TensorType
from dlbricks.timing.session import SerializedModel, create_session, source_nbytes
from dlbricks.weight_pool import MIN_POOLED_BYTES, WeightPool


def _external(t: TensorProto) -> dict[str, str]:
    assert t.data_location == TensorProto.EXTERNAL
    return {e.key: e.value for e in t.external_data}


def _values(pool: WeightPool, t: TensorProto) -> np.ndarray:
    ext = _external(t)
    dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
    raw = (pool.folder / ext["location"]).read_bytes()[int(ext["offset"]):int(ext["offset"]) + int(ext["length"])]
    return np.frombuffer(raw, dtype=dtype).reshape(tuple(t.dims))


def test_every_weight_starts_its_file_and_the_pool_holds_the_largest_of_each_kind(tmp_path):
    # Sessions copy their weights (see the test at the end), so what the windows share
    # changes nothing timed; the pool is only ever as large as its largest weights.
    pool = WeightPool(tmp_path / "w")
    f32 = TensorType(TensorProto.FLOAT, (256, 256))  # 256 KiB
    big = TensorType(TensorProto.FLOAT, (512, 256))
    a = pool.model()
    first = [a.tensor(f"w{i}", f32, -0.1, 0.1) for i in range(3)]
    assert {(_external(t)["offset"], _external(t)["location"]) for t in first} == {("0", _external(first[0])["location"])}
    assert a.nbytes == 3 * f32.nbytes and a.files == {_external(first[0])["location"]}
    assert f32.nbytes <= pool.nbytes < f32.nbytes + (1 << 20)
    b = pool.model()
    second = b.tensor("v", big, -0.1, 0.1)
    assert _external(second)["location"] == _external(first[0])["location"]
    assert big.nbytes <= pool.nbytes < big.nbytes + (1 << 20)  # grown to the larger weight only
    np.testing.assert_array_equal(_values(pool, second)[:256], _values(pool, first[0]))
    pool.close()
    assert not (tmp_path / "w").exists()


def test_weights_on_the_same_pool_bytes_are_copies_of_their_own_in_the_session(tmp_path):
    # What the windows share, the session does not: each weight is its own memory, as
    # in the source model (three of 64 MiB: over 150 MiB held, against about 90 MiB
    # for one shared copy and what a session holds besides).
    import subprocess
    import sys

    n = 4096
    pool = WeightPool(tmp_path / "w")
    window = pool.model()
    a, b, c = (window.tensor(name, TensorType(TensorProto.FLOAT, (n, n)), -0.01, 0.01) for name in "abc")
    assert _external(a) == _external(b) == _external(c)
    nodes = [helper.make_node("Add", ["x", "a"], ["y"]), helper.make_node("Add", ["y", "b"], ["u"]),
             helper.make_node("Add", ["u", "c"], ["z"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, n])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [n, n])], [a, b, c])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    source = SerializedModel(model.SerializeToString(), str(pool.folder), window.nbytes, tuple(window.files))
    x = np.zeros((n, n), np.float32)
    np.testing.assert_allclose(create_session(source).run(None, {"x": x})[0], 3 * _values(pool, a), rtol=1e-6)
    # Memory is counted in a fresh process: a long-lived one (this) reuses what it freed.
    (tmp_path / "model.onnx").write_bytes(source.data)
    script = (
        "import sys; from dlbricks.timing.heap import held_bytes; "
        "from dlbricks.timing.session import SerializedModel, create_session; "
        "data = open(sys.argv[1], 'rb').read(); before = held_bytes(); "
        "s = create_session(SerializedModel(data, sys.argv[2], 0, ('" + _external(a)["location"] + "',))); "
        "print(held_bytes() - before)"
    )
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "model.onnx"), str(pool.folder)],
                         capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) > 150 << 20
    pool.close()


@settings(max_examples=25, deadline=None)
@given(fan_in=st.integers(1, 1 << 16), positive=st.booleans(), ints=st.booleans())
def test_pooled_values_have_the_type_and_about_the_range_a_synthesised_weight_gets(tmp_path_factory, fan_in, positive,
                                                                                   ints):
    pool = WeightPool(tmp_path_factory.mktemp("pool"))
    rows = max(1, (MIN_POOLED_BYTES // 4 + fan_in - 1) // fan_in)
    ttype = TensorType(TensorProto.INT32 if ints else TensorProto.FLOAT, (rows, fan_in))
    low, high = weight_range(ttype, op_type="BatchNormalization" if positive else "MatMul", slot=1)
    values = _values(pool, pool.model().tensor("w", ttype, low, high))
    assert values.dtype == ttype.dtype and values.shape == ttype.shape
    if ints:
        assert values.min() >= 0 and values.max() < 4
    elif positive:
        assert values.min() >= 0.5 and values.max() <= 1.5
    else:
        # The fan-in is rounded to a power of two: within 2**(1/4) of the range it would get.
        bound = float(np.abs(values).max())
        assert bound <= high * 2 ** 0.25 * (1 + 1e-6)
        assert bound >= high / 2 ** 0.25 * 0.9  # 64K uniform draws come near the bound
    pool.close()


def _matmul_model(k: int = 256, n: int = 512) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((k, n), np.float32), "w")
    b = numpy_helper.from_array(np.ones((n,), np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Add", ["h", "b"], ["y"], name="add")]
    g = helper.make_graph(nodes, "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, n])], [w, b])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_brick_with_pooled_weights_runs_in_onnxruntime_and_computes_what_the_same_weights_inline_do(tmp_path):
    model = load(_matmul_model())
    pool = WeightPool(tmp_path / "w", seed=3)
    window = pool.model()
    proto, info = generate_brick(model, [0, 1], pool=window)
    inits = {t.name: t for t in proto.graph.initializer}
    # The 512 KiB matrix is in the pool; the 2 KiB bias stays in the model.
    assert inits["w"].data_location == TensorProto.EXTERNAL and inits["b"].data_location != TensorProto.EXTERNAL
    assert window.nbytes == 256 * 512 * 4 and info.weight_bytes == 256 * 512 * 4 + 512 * 4
    source = SerializedModel(proto.SerializeToString(), str(pool.folder), window.nbytes)
    assert source_nbytes(source) == len(source.data) + window.nbytes and len(source.data) < 16 << 10
    x = np.random.default_rng(0).uniform(-1, 1, (4, 256)).astype(np.float32)
    got = create_session(source).run(None, {"x": x})[0]
    inline = onnx.ModelProto()
    inline.CopyFrom(proto)
    for t in inline.graph.initializer:
        if t.name == "w":
            t.CopyFrom(numpy_helper.from_array(_values(pool, inits["w"]), "w"))
    want = create_session(inline.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    pool.close()


def test_a_pooled_model_whose_pool_is_gone_fails_with_the_model_s_error(tmp_path):
    from dlbricks.errors import DlbricksError

    model = load(_matmul_model())
    pool = WeightPool(tmp_path / "w")
    window = pool.model()
    proto, _ = generate_brick(model, [0], pool=window)
    source = SerializedModel(proto.SerializeToString(), str(pool.folder), window.nbytes)
    pool.close()
    with pytest.raises(DlbricksError, match="cannot read its weights"):
        create_session(source)


def test_a_pooled_model_opens_while_the_pool_starts_a_file_for_another_model(tmp_path):
    # The engine opens sessions while the run generates further models into the same
    # pool: a file just created for another dtype is still empty when a worker looks.
    from dlbricks.pipeline import pooled_model

    model = load(_matmul_model())
    pool = WeightPool(tmp_path / "w")
    source, _ = pooled_model(model, [0, 1], pool, seed=0, digest="0" * 64, G=2)
    assert source.weight_files == tuple(p.name for p in pool.folder.iterdir())
    (pool.folder / "w9-float16.bin").touch()
    x = np.zeros((4, 256), np.float32)
    assert create_session(source).run(None, {"x": x})[0].shape == (4, 512)
    pool.close()


def test_small_and_boolean_weights_stay_in_the_model():
    small = TensorType(TensorProto.FLOAT, (16, 16))
    flags = TensorType(TensorProto.BOOL, (1 << 20,))
    big = TensorType(TensorProto.FLOAT16, (256, 256))
    from dlbricks.weight_pool import PoolWindow

    assert not PoolWindow.accepts(small) and not PoolWindow.accepts(flags) and PoolWindow.accepts(big)
    assert math.isclose(weight_range(TensorType(TensorProto.FLOAT, (8, 3)))[1], 1.0)


def test_a_session_holds_its_own_copy_of_pooled_weights_not_the_pool_s_pages(tmp_path):
    # An Add's constant: onnxruntime packs nothing for it, and would use the pool's
    # pages in place if it were handed the folder. Rewriting the pool after the session
    # is built then shows which memory the session reads.
    n = 1 << 16
    c = numpy_helper.from_array(np.ones(n, np.float32), "c")
    g = helper.make_graph([helper.make_node("Add", ["x", "c"], ["y"], name="add")], "add",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])], [c])
    model = load(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    pool = WeightPool(tmp_path / "w")
    window = pool.model()
    proto, _ = generate_brick(model, [0], pool=window)
    (init,) = proto.graph.initializer
    before = _values(pool, init).copy()
    session = create_session(SerializedModel(proto.SerializeToString(), str(pool.folder), window.nbytes))
    path = pool.folder / _external(init)["location"]
    with open(path, "r+b") as f:
        f.write(np.full(n, 7.0, np.float32).tobytes())
    zeros = np.zeros(n, np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": zeros})[0], before)
    pool.close()
