"""Calibrating one call's fixed cost, and counting it once per model."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from dlbricks.store import Store
from dlbricks.timing import RunnerConfig, calibration, summarize
from dlbricks.timing.runner import Failure, Measurement

SYSTEM = {"schema_version": 1, "cpu": {"model": "test"}, "hostname": "h"}
CFG = RunnerConfig()


def _m(ns: float, se_ns: float = 0.0) -> Measurement:
    t = np.full(7, int(ns), dtype=np.int64)
    return Measurement(times_ns=t, stats=summarize(t), config=CFG, warmup_iters=1, stop_reason="converged",
                       setup_time_s=0.0, wall_time_s=0.0, denormal_input_fraction=0.0, denormal_output_fraction=0.0,
                       denormal_fraction=0.0, denormals_as_zero=True, denormals_flushed=True, ort_version="0",
                       median_se_ns=se_ns)


def test_probes_are_valid_chains_that_onnxruntime_runs():
    for n in calibration.PROBE_LENGTHS:
        s = ort.InferenceSession(calibration.probe_model(n), providers=["CPUExecutionProvider"])
        assert len(s.get_inputs()) == 1
        assert s.run(None, {"x": np.array([-2.0], np.float32)})[0].tolist() == [2.0]


def test_the_fixed_cost_is_the_short_probe_less_one_node_and_is_stored_per_system_and_config(tmp_path):
    with Store(tmp_path / "s.sqlite") as st:
        sid = st.put_system(SYSTEM)
        key = st.put_config(CFG)
        assert calibration.call_overhead_ns(st, sid, key) is None
        calibration.record(st, sid, key, {"probe:1:0": _m(3000), "probe:9:0": _m(3000 + 8 * 250)})
        assert calibration.call_overhead_ns(st, sid, key) == pytest.approx(2750)
        other = st.put_config(RunnerConfig(intra_op_threads=2))
        assert calibration.call_overhead_ns(st, sid, other) is None


def test_a_failed_probe_records_no_calibration(tmp_path):
    with Store(tmp_path / "s.sqlite") as st:
        sid = st.put_system(SYSTEM)
        key = st.put_config(CFG)
        calibration.record(st, sid, key, {"probe:1:0": _m(3000), "probe:9:0": Failure("boom")})
        assert calibration.stored(st, sid, key) is None


def test_a_probe_session_in_a_slow_state_of_its_own_does_not_move_the_calibration(tmp_path):
    with Store(tmp_path / "s.sqlite") as st:
        sid = st.put_system(SYSTEM)
        key = st.put_config(CFG)
        short = {f"probe:1:{k}": _m(ns) for k, ns in enumerate((3000, 7400, 3020))}
        long = {f"probe:9:{k}": _m(ns) for k, ns in enumerate((5000, 5010, 4990))}
        calibration.record(st, sid, key, {**short, **long, "probe:9:1": Failure("boom")})
        assert calibration.stored(st, sid, key)["probe_ns"] == {"1": 3020.0, "9": 4995.0}
        assert calibration.call_overhead_ns(st, sid, key) == pytest.approx(3020 - (4995 - 3020) / 8)


def test_the_calibration_keeps_its_standard_error_from_the_sessions_spread_and_their_own_errors(tmp_path):
    with Store(tmp_path / "s.sqlite") as st:
        sid = st.put_system(SYSTEM)
        key = st.put_config(CFG)

        def calibrate(short, long):
            calibration.record(st, sid, key, {**{f"probe:1:{k}": m for k, m in enumerate(short)},
                                              **{f"probe:9:{k}": m for k, m in enumerate(long)}})
            return calibration.call_overhead(st, sid, key)

        # Sessions that agree: the error is their own (t1 counts 9/8, t9 1/8).
        agree = calibrate([_m(3000, 10)] * 3, [_m(5000, 10)] * 3)
        assert agree.se_ns == pytest.approx(1.25 * 10 / np.sqrt(3) * np.hypot(9 / 8, 1 / 8))
        # Sessions that disagree: their spread is the error, and it is larger.
        spread = calibrate([_m(2900, 10), _m(3000, 10), _m(3100, 10)], [_m(5000, 10)] * 3)
        assert spread.ns == pytest.approx(agree.ns)
        assert spread.se_ns == pytest.approx(1.25 * 1.4826 * 100 / np.sqrt(3) * 9 / 8, rel=0.01)
        # One session in a slow state of its own counts no more than the spread of the others.
        odd = calibrate([_m(2900, 10), _m(3000, 10), _m(7400, 10)], [_m(5000, 10)] * 3)
        assert odd.se_ns == pytest.approx(spread.se_ns)


def test_evaluate_counts_the_calibrated_cost_once_per_model(tmp_path):
    from onnx import TensorProto, helper

    from dlbricks.loading import load
    from dlbricks.pipeline import evaluate
    from dlbricks.versions import brick_digest_version

    nodes = [helper.make_node(op, [a], [b]) for op, a, b in (("Relu", "x", "a"), ("Sigmoid", "a", "b"), ("Tanh", "b", "y"))]
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])])
    model = load(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]))
    with Store(tmp_path / "s.sqlite") as st:
        with_c = evaluate([model], [1], store=st, config=CFG, n_boot=50)
        without = evaluate([model], [1], store=st, config=RunnerConfig(call_overhead=False), n_boot=50)
        c = with_c["call_overhead_ns"]
        assert c is not None and c > 0 and without["call_overhead_ns"] is None
        assert without["config_key"] == with_c["config_key"]  # a reconstruction switch keys no result
        medians = [st.get_result("brick", b["digest"], brick_digest_version(), with_c["system_id"],
                                 with_c["config_key"]).median_ns for b in with_c["bricks"]]
        plain = without["models"][0]["per_g"]["1"]["sequential"]["latency_s"]
        corrected = with_c["models"][0]["per_g"]["1"]["sequential"]["latency_s"]
        assert plain == pytest.approx(sum(medians) * 1e-9)
        # Each brick less the cost in its own rounds (the probes ran in every round of
        # the same engine run), the model's one call at the whole run's.
        cal = calibration.call_overhead(st, with_c["system_id"], with_c["config_key"])
        assert cal is not None and cal.engine_run and len(cal.by_round) >= 3
        metas = [st.get_result("brick", b["digest"], brick_digest_version(), with_c["system_id"],
                               with_c["config_key"]).meta for b in with_c["bricks"]]
        paid = [cal.in_rounds(m["engine_run"], m["round_nos"]) for m in metas]
        assert all(p > 0 for p in paid)
        assert corrected == pytest.approx((sum(max(m - p, 0) for m, p in zip(medians, paid)) + c) * 1e-9)


def _rounds_m(medians: list[float], run: str = "run", first: int = 1) -> Measurement:
    """A probe result of the measurement engine: these round medians, numbered from ``first``."""
    m = _m(float(np.median(medians)))
    m.rounds, m.round_medians_ns, m.engine_run = len(medians), list(medians), run
    m.round_nos = list(range(first, first + len(medians)))
    return m


def test_the_calibration_keeps_the_cost_of_each_round():
    # Three sessions per length; rounds 1-4 quiet, 5-8 a slow stretch (every call 1.5x).
    quiet, slow = [3000.0] * 4, [4500.0] * 4
    long_quiet, long_slow = [5000.0] * 4, [7500.0] * 4
    results = {f"probe:1:{k}": _rounds_m(quiet + slow) for k in range(3)}
    results |= {f"probe:9:{k}": _rounds_m(long_quiet + long_slow) for k in range(3)}
    results["probe:1:1"] = _rounds_m([9000.0] * 8)  # one session in a state of its own: the median ignores it
    series = calibration.per_round(results)
    assert series["engine_run"] == "run" and series["round_nos"] == list(range(1, 9))
    assert series["ns"] == pytest.approx([3000 - 2000 / 8] * 4 + [4500 - 3000 / 8] * 4)
    # Probes of two engine runs, or without round numbers, give no series.
    assert calibration.per_round({**results, "probe:9:0": _rounds_m(long_quiet, run="other")}) is None
    assert calibration.per_round({"probe:1:0": _m(3000), "probe:9:0": _m(5000)}) is None


def test_a_result_is_corrected_by_the_cost_in_its_own_rounds():
    cal = calibration.CallOverhead(3000.0, 20.0, "run", {1: 2500.0, 2: 2500.0, 3: 2500.0, 4: 4000.0, 5: 4000.0,
                                                         6: 4000.0})
    assert cal.in_rounds("run", [4, 5, 6]) == 4000.0
    assert cal.in_rounds("run", [1, 2, 3, 4]) == 2500.0  # the median of the shared rounds
    assert cal.in_rounds("run", [5, 6]) == 3000.0  # too few shared rounds: the whole estimate
    assert cal.in_rounds("another run", [1, 2, 3]) == 3000.0
    assert calibration.CallOverhead(3000.0, 20.0).in_rounds("run", [1, 2, 3]) == 3000.0


def test_bricks_measured_in_a_slow_stretch_lose_that_stretchs_call_cost(tmp_path):
    from test_outputs import MEDIANS, _config, fill
    from test_pipeline import chain_model

    from dlbricks.loading import load
    from dlbricks.reconstruct import predict
    from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint

    model = load(chain_model(4), name="chain")
    with Store(tmp_path / "s.sqlite") as st:
        fill(st, [model], 1, median_of=MEDIANS, se_rel=1e-6, round_medians=True, engine_run="run")
        kw = dict(store=st, system_id=fingerprint_id(system_fingerprint()), config_key=_config().key(),
                  modes=("sequential",), n_boot=200)
        whole = calibration.CallOverhead(1000.0, 0.0)
        slow = calibration.CallOverhead(1000.0, 0.0, "run", dict.fromkeys(range(1, 11), 1600.0))
        (a,), = predict([model], 1, call_overhead=whole, **kw)
        (b,), = predict([model], 1, call_overhead=slow, **kw)
        (c,), = predict([model], 1, call_overhead=calibration.CallOverhead(1000.0, 0.0, "other run",
                                                                         dict.fromkeys(range(1, 11), 1600.0)), **kw)
    assert a.latency_s == pytest.approx(c.latency_s)  # another engine run's rounds: the whole estimate
    # Every brick ran in the slow rounds: 600 ns more off each, the model's one call unchanged.
    assert (a.latency_s - b.latency_s) * 1e9 == pytest.approx(600.0 * model.n_layers, rel=1e-6)


def _chain(name, ops):
    """A loaded model: a chain of the one-input ``ops`` on a [1, 32] float tensor."""
    from onnx import TensorProto, helper

    from dlbricks.loading import load

    nodes = [helper.make_node(op, [f"t{i}"], [f"t{i + 1}"]) for i, op in enumerate(ops)]
    g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [1, 32])],
                          [helper.make_tensor_value_info(f"t{len(ops)}", TensorProto.FLOAT, [1, 32])])
    return load(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), name=name)


def test_evaluate_leaves_out_a_model_whose_end_to_end_run_fails_and_says_why(tmp_path, monkeypatch):
    import dlbricks.bricks as bricks
    from dlbricks.errors import DlbricksError
    from dlbricks.pipeline import evaluate

    good, bad = _chain("good", ["Relu", "Tanh"]), _chain("bad", ["Sigmoid", "Abs"])
    real = bricks.generate_brick

    def generate_brick(model, members, **kw):
        # The whole model is the brick of all its layers; its bricks are built as usual.
        if model.name == "bad" and len(members) == model.n_layers:
            raise DlbricksError("bad: cannot build the whole model (test)")
        return real(model, members, **kw)

    monkeypatch.setattr(bricks, "generate_brick", generate_brick)
    with Store(tmp_path / "s.sqlite") as st:
        result = evaluate([good, bad], [1], store=st, config=CFG, n_boot=20)
    assert [m["name"] for m in result["models"]] == ["good"]
    assert result["excluded"][0]["name"] == "bad" and "test" in result["excluded"][0]["error"]
    assert result["excluded"][0]["error"].startswith("its end-to-end run failed")


def test_evaluate_leaves_out_a_model_one_of_whose_bricks_fails_and_says_why(tmp_path, monkeypatch):
    import dlbricks.bricks as bricks
    from dlbricks.errors import DlbricksError
    from dlbricks.pipeline import evaluate

    good, bad = _chain("good", ["Relu", "Tanh"]), _chain("bad", ["Sigmoid", "Abs"])
    real = bricks.generate_brick

    def generate_brick(model, members, **kw):
        # Only bricks: the whole model is built through here too, and runs.
        if len(members) < model.n_layers and any(model.layers[int(i)].op_type == "Abs" for i in members):
            raise DlbricksError("Abs brick: cannot be built (test)")
        return real(model, members, **kw)

    monkeypatch.setattr(bricks, "generate_brick", generate_brick)
    with Store(tmp_path / "s.sqlite") as st:
        result = evaluate([good, bad], [1, 2], store=st, config=CFG, n_boot=20)
    assert [m["name"] for m in result["models"]] == ["good"]
    (left_out,) = result["excluded"]
    assert left_out["name"] == "bad" and "failed" in left_out["error"] and "test" in left_out["error"]
    # The table names it too (the demo prints nothing else about it).
    from dlbricks.commands.evaluate import render_evaluation

    table = render_evaluation(result.to_dict())
    assert any(line.startswith("! bad ") and "left out: brick" in line for line in table.splitlines())
