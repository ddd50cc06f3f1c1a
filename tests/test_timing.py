"""Runner, statistics, synthetic inputs and denormal handling (dlbricks.timing)."""

from __future__ import annotations

import json
import math
import os
from fractions import Fraction

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from dlbricks.errors import DlbricksError
from dlbricks.timing import (
    Measurement,
    Runner,
    RunnerConfig,
    bind,
    count_denormals,
    create_session,
    make_inputs,
    median_ci_ranks,
    summarize,
)

# Short runs: these tests check structure, never speed.
FAST = dict(warmup_iters=2, warmup_time=0.0, min_iters=10, min_time=0.01, max_time=0.05)


def _model(nodes, inputs, outputs, initializers=(), opset=13, name="g"):
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


@pytest.fixture
def matmul_add():
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 8], np.linspace(-1, 1, 64, dtype=np.float32))
    return _model(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "x"], ["y"])],
        [_vi("x", TensorProto.FLOAT, [4, 8])],
        [_vi("y", TensorProto.FLOAT, [4, 8])],
        [w],
    )


@pytest.fixture
def gather_model():
    return _model(
        [helper.make_node("Gather", ["data", "idx"], ["y"], axis=0)],
        [_vi("data", TensorProto.FLOAT, [5, 3]), _vi("idx", TensorProto.INT64, [2000])],
        [_vi("y", TensorProto.FLOAT, [2000, 3])],
    )


# --------------------------------------------------------------------------- summarize


def test_summarize_matches_hand_computed_values_on_1_to_10():
    s = summarize(np.arange(1, 11))
    assert s.n == 10
    assert (s.min, s.max, s.median, s.mean) == (1, 10, 5.5, 5.5)
    assert s.stddev == pytest.approx(math.sqrt(sum((x - 5.5) ** 2 for x in range(1, 11)) / 9))
    assert s.mad == 2.5  # |x - 5.5| = 4.5 3.5 2.5 1.5 .5 .5 1.5 2.5 3.5 4.5
    assert s.p25 == pytest.approx(3.25) and s.p75 == pytest.approx(7.75)
    assert s.iqr == pytest.approx(4.5)
    assert s.p90 == pytest.approx(9.1) and s.p99 == pytest.approx(9.91)
    # n=10: P(B<=1)=11/1024 -> 2*that < 5%, P(B<=2)=56/1024 -> not: CI = [x(2), x(9)]
    assert (s.ci_low, s.ci_high, s.ci_exact) == (2, 9, True)
    assert s.cv == pytest.approx(s.stddev / 5.5)
    assert s.unstable and "unstable" in s.warning


def test_summarize_flags_nothing_on_a_tight_sample():
    s = summarize([100] * 9 + [101])
    assert s.median == 100 and s.min == 100 and s.max == 101
    assert s.cv < 0.05 and not s.unstable and s.warning is None


def test_summarize_single_sample_has_zero_spread():
    s = summarize([42])
    assert (s.median, s.stddev, s.cv, s.ci_low, s.ci_high, s.ci_exact) == (42, 0, 0, 42, 42, False)


def test_drift_measures_a_change_of_speed_during_sampling_not_noise():
    rng = np.random.default_rng(0)
    steady = rng.normal(100.0, 5.0, 400)  # noisy, but one speed throughout
    shifted = steady + np.r_[np.zeros(200), np.full(200, 20.0)]  # the machine slowed down halfway
    assert summarize(steady).drift < 0.05 < 0.15 < summarize(shifted).drift
    flat = np.r_[np.full(200, 100.0), np.full(200, 120.0)]
    assert summarize(flat).drift == pytest.approx(20 / 110)  # blocks at 100 and 120, median 110
    assert summarize(np.full(39, 5.0)).drift == 0.0  # too few samples for 8 blocks of 5


def test_a_drifting_measurement_says_why_its_ci_is_too_narrow(matmul_add):
    d = Runner(RunnerConfig(**FAST)).time(matmul_add).to_dict()
    d.pop("stats")  # recomputed from the times below
    d["times_ns"] = [1000] * 100 + [1300] * 100
    m = Measurement.from_dict(d)
    assert m.stats.drift > 0.05
    assert any(w.startswith("drifting:") for w in m.warnings)


def test_summarize_rejects_empty_input():
    with pytest.raises(ValueError):
        summarize([])


@pytest.mark.parametrize("n", [6, 7, 10, 17, 50, 101])
def test_median_ci_ranks_is_the_largest_order_statistic_interval_with_95_percent_coverage(n):
    lo, hi, exact = median_ci_ranks(n)
    assert exact and hi == n - 1 - lo

    def coverage(rank):  # [x(rank), x(n+1-rank)], exact binomial in rationals
        tail = sum(Fraction(math.comb(n, k), 2**n) for k in range(rank))
        return 1 - 2 * tail

    rank = lo + 1
    assert coverage(rank) >= Fraction(95, 100)
    assert coverage(rank + 1) < Fraction(95, 100)


def test_median_ci_ranks_too_few_samples_falls_back_to_the_range():
    assert median_ci_ranks(5) == (0, 4, False)


def test_median_ci_contains_the_median_and_shrinks_with_more_samples():
    rng = np.random.default_rng(1)
    widths = []
    for n in (30, 300, 3000):
        s = summarize(rng.lognormal(10, 0.2, size=n))
        assert s.ci_low <= s.median <= s.ci_high
        widths.append(s.ci_high - s.ci_low)
    assert widths[0] > widths[1] > widths[2]


# --------------------------------------------------------------------------- config


def test_config_key_is_stable_and_depends_only_on_what_is_measured():
    base = RunnerConfig()
    assert base.key() == RunnerConfig().key()
    assert len(base.key()) == 16
    assert RunnerConfig(min_time=5, max_time=9, timeout_s=3).key() == base.key()
    assert RunnerConfig(intra_op_threads=2).key() != base.key()
    assert RunnerConfig(denormals_as_zero=False).key() != base.key()
    assert RunnerConfig(cores=[1, 0]).key() == RunnerConfig(cores=(0, 1)).key()


def test_config_round_trips_through_json_and_ignores_unknown_keys():
    cfg = RunnerConfig(cores=(0,), graph_optimization="all", execution_mode="parallel", target_ci=0.02)
    d = json.loads(json.dumps(cfg.to_dict()))
    d["from_the_future"] = 1
    assert RunnerConfig.from_dict(d) == cfg


@pytest.mark.parametrize(
    "kwargs",
    [
        {"execution_mode": "fast"},
        {"graph_optimization": "max"},
        {"min_time": 3.0, "max_time": 1.0},
        {"cores": (-1,)},
        {"cores": (0,), "intra_op_threads": 0},
        {"min_iters": -1},
        {"timeout_s": 0},
    ],
)
def test_config_rejects_invalid_values(kwargs):
    with pytest.raises(DlbricksError):
        RunnerConfig(**kwargs)


# --------------------------------------------------------------------------- runner


def test_runner_keeps_every_iteration_with_positive_times(matmul_add):
    cfg = RunnerConfig(**FAST)
    m = Runner(cfg).time(matmul_add)
    assert m.times_ns.dtype == np.int64
    assert m.stats.n == len(m.times_ns) >= cfg.min_iters
    assert (m.times_ns > 0).all()
    assert m.stats.min == m.times_ns.min() and m.stats.median == np.median(m.times_ns)
    assert m.config == cfg and m.stop_reason in ("converged", "max_time")
    assert m.warmup_iters >= cfg.warmup_iters
    assert m.wall_time_s >= m.setup_time_s > 0
    assert m.wall_time_s * 1e9 >= m.sampling_time_s * 1e9 >= m.times_ns.sum()
    assert m.ort_version


def test_runner_respects_min_iters_even_past_max_time(matmul_add):
    cfg = RunnerConfig(warmup_iters=0, warmup_time=0.0, min_iters=300, min_time=0.0, max_time=0.0)
    m = Runner(cfg).time(matmul_add)
    assert m.stats.n >= 300


def test_runner_stops_at_max_time_when_the_ci_target_is_unreachable(matmul_add):
    cfg = RunnerConfig(**{**FAST, "target_ci": 0.0})
    m = Runner(cfg).time(matmul_add)
    assert m.stop_reason == "max_time"
    assert m.times_ns.sum() <= m.wall_time_s * 1e9
    assert any("max_time" in w for w in m.warnings)


def test_measurement_round_trips_through_json(matmul_add):
    m = Runner(RunnerConfig(**FAST)).time(matmul_add, seed=3)
    d = json.loads(json.dumps(m.to_dict()))
    assert d["schema_version"] == 1 and d["config_key"] == m.config.key()
    back = Measurement.from_dict(d)
    assert np.array_equal(back.times_ns, m.times_ns)
    assert back.stats == m.stats and back.config == m.config and back.seed == 3


def test_measurement_from_a_newer_schema_is_rejected(matmul_add):
    d = Runner(RunnerConfig(**FAST)).time(matmul_add).to_dict()
    d["schema_version"] = 99
    with pytest.raises(DlbricksError, match="newer"):
        Measurement.from_dict(d)


def test_iobinding_outputs_equal_session_run_outputs(matmul_add):
    session = create_session(matmul_add)
    feeds = make_inputs(matmul_add, seed=7)
    expected = session.run(None, feeds)[0]
    bound = bind(session, feeds)
    for _ in range(3):
        bound.run()
    np.testing.assert_array_equal(bound.outputs()["y"], expected)


def _counting(session):
    """``session`` with its public run_with_iobinding counted (binding runs through it)."""
    calls = []
    run = session.run_with_iobinding

    def counted(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    session.run_with_iobinding = counted
    return calls


@pytest.mark.parametrize(("op", "declared", "runs"), [
    ("MatMul", [4, 8], 1),  # every output's shape known: bound up front, one run
    ("MatMul", [5, 8], 2),  # a declared shape the model does not produce: bound from the first run
    ("NonZero", [2, None], 2),  # a shape only a run tells: the same
])
def test_binding_runs_once_when_the_outputs_declare_their_shapes(op, declared, runs):
    if op == "MatMul":
        w = helper.make_tensor("w", TensorProto.FLOAT, [8, 8], np.linspace(-1, 1, 64, dtype=np.float32))
        model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [_vi("x", TensorProto.FLOAT, [4, 8])],
                       [_vi("y", TensorProto.FLOAT, declared)], [w])
    else:
        model = _model([helper.make_node("NonZero", ["x"], ["y"])], [_vi("x", TensorProto.FLOAT, [4, 8])],
                       [_vi("y", TensorProto.INT64, declared)])
    session = create_session(model)
    feeds = make_inputs(model, seed=1)
    expected = session.run(None, feeds)[0]
    calls = _counting(session)
    bound = bind(session, feeds)
    assert bound.bind_runs == len(calls) == runs
    for _ in range(2):
        bound.run()
    np.testing.assert_array_equal(bound.outputs()["y"], expected)


def test_runner_uses_given_inputs_and_rejects_unknown_names(matmul_add):
    with pytest.raises(DlbricksError, match="no input named"):
        Runner(RunnerConfig(**FAST)).time(matmul_add, inputs={"nope": np.zeros(1)})


def test_runner_reports_a_model_onnxruntime_cannot_load_with_its_path(tmp_path):
    bad = _model([helper.make_node("Frobnicate", ["x"], ["y"], domain="org.unknown")],
                 [_vi("x", TensorProto.FLOAT, [2])], [_vi("y", TensorProto.FLOAT, [2])])
    bad.opset_import.append(helper.make_opsetid("org.unknown", 1))
    path = tmp_path / "bad.onnx"
    onnx.save(bad, path)
    with pytest.raises(DlbricksError, match="bad.onnx"):
        Runner(RunnerConfig(**FAST)).time(path)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity API")
def test_runner_pins_to_the_configured_core_and_restores_affinity(matmul_add):
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[-1]
    m = Runner(RunnerConfig(cores=(core,), **FAST)).time(matmul_add)
    assert m.config.cores == (core,)
    assert sorted(os.sched_getaffinity(0)) == allowed


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores"
)
def test_runner_with_two_pinned_threads_runs(matmul_add):
    cores = tuple(sorted(os.sched_getaffinity(0))[:2])
    m = Runner(RunnerConfig(cores=cores, intra_op_threads=2, **FAST)).time(matmul_add)
    assert m.stats.n >= 10


def test_pinning_to_a_core_that_does_not_exist_is_an_error(matmul_add):
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("Linux affinity API")
    with pytest.raises(DlbricksError, match="cannot pin"):
        Runner(RunnerConfig(cores=(4095,), **FAST)).time(matmul_add)


# --------------------------------------------------------------------------- inputs


def test_make_inputs_is_seeded_and_dtype_correct():
    model = _model(
        [helper.make_node("Identity", [n], [n + "_o"]) for n in ("f", "h", "d", "b")],
        [_vi("f", TensorProto.FLOAT, [3, 5]), _vi("h", TensorProto.FLOAT16, [64]),
         _vi("d", TensorProto.DOUBLE, ["N", 2]), _vi("b", TensorProto.BOOL, [100])],
        [_vi(n + "_o", t, s) for n, t, s in (("f", 1, [3, 5]), ("h", 10, [64]), ("d", 11, ["N", 2]), ("b", 9, [100]))],
    )
    a, b, c = make_inputs(model, 0), make_inputs(model, 0), make_inputs(model, 1)
    assert [a[k].dtype for k in "fhdb"] == [np.float32, np.float16, np.float64, np.bool_]
    assert a["d"].shape == (1, 2)  # symbolic dimension -> 1
    for k in "fhdb":
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["f"], c["f"])
    for k in "fhd":
        assert np.abs(a[k]).max() <= 1 and count_denormals(a[k]) == 0
    assert 0 < a["b"].sum() < 100


def test_make_inputs_from_a_session_matches_the_model(matmul_add):
    from_session = make_inputs(create_session(matmul_add), 5)
    from_model = make_inputs(matmul_add, 5)
    np.testing.assert_array_equal(from_session["x"], from_model["x"])


def test_gather_indices_stay_within_the_indexed_axis(gather_model):
    idx = make_inputs(gather_model, 0)["idx"]
    assert idx.dtype == np.int64 and idx.min() >= 0 and idx.max() < 5
    assert len(np.unique(idx)) == 5  # the whole axis is exercised, not just 0


def test_gather_on_an_initializer_axis_uses_its_size():
    table = helper.make_tensor("emb", TensorProto.FLOAT, [7, 4], np.ones(28, np.float32))
    model = _model(
        [helper.make_node("Gather", ["emb", "ids"], ["y"], axis=0)],
        [_vi("ids", TensorProto.INT32, [1, 500])],
        [_vi("y", TensorProto.FLOAT, [1, 500, 4])],
        [table],
    )
    ids = make_inputs(model, 0)["ids"]
    assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() == 6


def test_int_bounds_hint_overrides_the_graph(gather_model):
    idx = make_inputs(gather_model, 0, int_bounds={"idx": 2})["idx"]
    assert set(np.unique(idx)) == {0, 1}


def test_gather_elements_and_topk_bounds_follow_their_axis():
    model = _model(
        [helper.make_node("GatherElements", ["data", "idx"], ["y"], axis=1),
         helper.make_node("TopK", ["data", "k"], ["v", "i"], axis=1)],
        [_vi("data", TensorProto.FLOAT, [40, 6]), _vi("idx", TensorProto.INT64, [40, 6]),
         _vi("k", TensorProto.INT64, [1])],
        [_vi("y", TensorProto.FLOAT, [40, 6]), _vi("v", TensorProto.FLOAT, [40, None]),
         _vi("i", TensorProto.INT64, [40, None])],
    )
    for seed in range(20):
        inputs = make_inputs(model, seed)
        assert 0 <= inputs["idx"].min() and inputs["idx"].max() < 6
        assert 1 <= int(inputs["k"][0]) <= 6


def test_runner_times_a_gather_model_without_index_errors(gather_model):
    m = Runner(RunnerConfig(**FAST)).time(gather_model)
    assert m.stats.n >= 10


def test_unbounded_integer_inputs_default_to_the_smallest_dimension():
    model = _model(
        [helper.make_node("Cast", ["i"], ["y"], to=TensorProto.FLOAT)],
        [_vi("i", TensorProto.INT64, [3, 9])],
        [_vi("y", TensorProto.FLOAT, [3, 9])],
    )
    i = make_inputs(model, 0)["i"]
    assert i.min() >= 0 and i.max() < 3


# --------------------------------------------------------------------------- denormals


def test_count_denormals_finds_subnormals_by_bit_pattern():
    f32 = np.array([0.0, 1e-40, -1e-40, 1.0, np.finfo(np.float32).tiny, np.inf, np.nan], dtype=np.float32)
    assert count_denormals(f32) == 2
    assert count_denormals(np.array([1e-6, 1e-3, -0.0], dtype=np.float16)) == 1
    assert count_denormals(np.array([5e-324, 1e-300])) == 1
    assert count_denormals(np.array([1e-40 + 1e-40j, 1 + 0j], dtype=np.complex64)) == 2  # re and im
    assert count_denormals(np.arange(10)) == 0


@pytest.fixture
def tiny_mul():
    c = helper.make_tensor("c", TensorProto.FLOAT, [1], [1e-30])
    return _model([helper.make_node("Mul", ["x", "c"], ["y"])],
                  [_vi("x", TensorProto.FLOAT, [64])], [_vi("y", TensorProto.FLOAT, [64])], [c])


def _denormal_feed():
    x = np.full(64, 1e-10, dtype=np.float32)  # 1e-10 * 1e-30 underflows to a subnormal
    x[:16] = 1e-40  # subnormal inputs
    return {"x": x}


def test_runner_records_denormal_fractions_and_flushes_by_default(tiny_mul):
    m = Runner(RunnerConfig(**FAST)).time(tiny_mul, inputs=_denormal_feed())
    assert m.denormals_as_zero and m.denormals_flushed
    assert m.denormal_input_fraction == pytest.approx(16 / 64)
    assert m.denormal_output_fraction == 0.0  # flushed to zero
    assert any("denormal" in w for w in m.warnings)


def test_runner_without_flush_sees_denormal_outputs_and_restores_the_thread(tiny_mul):
    Runner(RunnerConfig(**FAST)).time(tiny_mul, inputs=_denormal_feed())  # FTZ on, then restored
    m = Runner(RunnerConfig(denormals_as_zero=False, **FAST)).time(tiny_mul, inputs=_denormal_feed())
    assert not m.denormals_flushed
    assert m.denormal_output_fraction == pytest.approx(48 / 64)
    assert m.denormal_fraction == pytest.approx((16 + 48) / 128)
    # The runner leaves this thread's floating-point mode as it found it.
    assert np.float32(1e-40) * np.float32(1) != 0


def test_string_tensors_fall_back_to_session_run():
    model = _model([helper.make_node("Identity", ["s"], ["t"])],
                   [_vi("s", TensorProto.STRING, [3])], [_vi("t", TensorProto.STRING, [3])])
    m = Runner(RunnerConfig(**FAST)).time(model)
    assert not m.io_binding and m.stats.n >= 10
    bound = bind(create_session(model), {"s": np.array(["x", "y", "z"], dtype=object)})
    assert bound.bind_runs == 1  # the engine's worker reports it as warm-up
    bound.run()
    assert list(bound.outputs()["t"]) == ["x", "y", "z"]


def test_config_key_counts_pinned_cores_not_their_ids():
    from dlbricks.timing import RunnerConfig

    on_cpu0 = RunnerConfig(cores=(0,))
    on_cpu1 = RunnerConfig(cores=(1,))
    assert on_cpu0.key() == on_cpu1.key()
    assert on_cpu0.key() != RunnerConfig(cores=None).key()
    assert RunnerConfig(cores=(0, 1), intra_op_threads=2).key() != RunnerConfig(cores=(0,), intra_op_threads=2).key()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int8, np.bool_])
@pytest.mark.parametrize("shape", [(1,), (3, 5), (1, 136, 28, 28), (0, 4)])
def test_aligned_copy_is_equal_and_at_an_onnxruntime_aligned_address(dtype, shape):
    from dlbricks.timing.session import TENSOR_ALIGNMENT, aligned_copy

    rng = np.random.default_rng(0)
    a = (rng.random(shape) * 100).astype(dtype)
    for view in (a, a[..., ::-1] if a.ndim > 1 else a):
        b = aligned_copy(view)
        assert b.dtype == view.dtype and b.shape == view.shape and b.flags.c_contiguous
        assert np.array_equal(b, view)
        if b.nbytes:
            assert b.ctypes.data % TENSOR_ALIGNMENT == 0


def test_a_bound_sessions_inputs_are_aligned_as_onnxruntimes_own_tensors():
    # A copy layer (Reshape) whose output lands 8-24 bytes past its input modulo 4 KiB
    # runs many times slower on some CPUs; inside a model both are onnxruntime's, 64-byte
    # aligned, so the bound input must be too, whatever numpy gave.
    from dlbricks.timing.session import TENSOR_ALIGNMENT, bind, create_session

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 136, 28, 28])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 68, 28, 28])
    shape = onnx.numpy_helper.from_array(np.array([1, 2, 68, 28, 28], np.int64), "s")
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["y"])], "g", [x], [y], [shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    n = 136 * 28 * 28 * 4
    raw = np.zeros(n + 128, np.uint8)
    offset = (16 - raw.ctypes.data) % 64  # at 16 past a 64-byte boundary, as numpy's may be
    feed = raw[offset:offset + n].view(np.float32).reshape(1, 136, 28, 28)
    feed[...] = np.arange(feed.size, dtype=np.float32).reshape(feed.shape)
    assert feed.ctypes.data % TENSOR_ALIGNMENT != 0
    bound = bind(create_session(model.SerializeToString(), RunnerConfig()), {"x": feed})
    assert bound.feeds["x"].ctypes.data % TENSOR_ALIGNMENT == 0
    assert bound._values["x"].data_ptr() == bound.feeds["x"].ctypes.data
    bound.run()
    assert np.array_equal(bound.outputs()["y"].reshape(feed.shape), feed)
