"""Calibrating one call's fixed cost, and counting it once per model."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from dlbricks.store import Store
from dlbricks.timing import RunnerConfig, summarize
from dlbricks.timing import calibration
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
        assert corrected == pytest.approx((sum(max(m - c, 0) for m in medians) + c) * 1e-9)


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
