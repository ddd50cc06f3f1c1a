"""Across-stack profiling (XSP): ``dlbricks profile``, its trace, OpenTelemetry
spans across processes, the kernel-to-layer join and the reconciliation."""

from __future__ import annotations

import http.server
import json
import mmap
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import onnx
import pytest
from conftest import light
from onnx import TensorProto, helper, numpy_helper

from dlbricks.cli import main
from dlbricks.errors import DlbricksError, UsageError
from dlbricks.loading import load
from dlbricks.profiling import ProfileOptions, parse_levels, profile_model, render_profile
from dlbricks.profiling.join import join_layers
from dlbricks.profiling.options import LEVELS
from dlbricks.profiling.ort_profile import OrtNode, parse_ort_profile
from dlbricks.profiling.perfevents import EVENTS, CounterSet, PerfUnavailable, derived_metrics, probe
from dlbricks.profiling.tracing import OtelConfig, Recorder, validate_chrome_trace
from dlbricks.timing import RunnerConfig

# Quick sampling: these tests check structure and reconciliation, not speed.
QUICK = RunnerConfig(warmup_iters=1, warmup_time=0.0, min_iters=3, min_time=0.0, max_time=0.5, target_ci=0.05)
QUICK_BRICK = RunnerConfig(warmup_iters=1, warmup_time=0.0, min_iters=3, min_time=0.0, max_time=0.1, target_ci=0.2)


def tiny_net() -> onnx.ModelProto:
    """Conv-BN-Relu, a residual Conv-Add-Relu, then a classifier: what onnxruntime
    fuses (BN into Conv, Relu into Conv, Add+Relu into NCHWc Conv) in 10 layers."""
    rng = np.random.default_rng(0)

    def init(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name)

    inits = [
        init("w0", 16, 3, 3, 3), init("b0", 16),
        numpy_helper.from_array(np.ones(16, np.float32), "bn_s"), init("bn_b", 16),
        init("bn_m", 16), numpy_helper.from_array(np.ones(16, np.float32), "bn_v"),
        init("w1", 16, 16, 3, 3), init("b1", 16),
        init("wf", 10, 16), init("bf", 10),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c0", "bn_s", "bn_b", "bn_m", "bn_v"], ["bn0"], name="bn0"),
        helper.make_node("Relu", ["bn0"], ["r0"], name="relu0"),
        helper.make_node("Conv", ["r0", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c1", "r0"], ["a1"], name="add1"),
        helper.make_node("Relu", ["a1"], ["r1"], name="relu1"),
        helper.make_node("GlobalAveragePool", ["r1"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["logits"], name="fc", transB=1),
        helper.make_node("Softmax", ["logits"], ["y"], name="softmax"),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def ffn_net() -> onnx.ModelProto:
    """A transformer's feed-forward block as exporters write it: MatMul+Add, an erf
    GELU, MatMul+Add. onnxruntime makes each MatMul+Add a Gemm between two Reshapes
    it inserts (the Gemm named after the MatMul, the Reshape after it producing the
    Add's output) and the GELU one com.microsoft Gelu named after none of its nodes."""
    rng = np.random.default_rng(0)

    def init(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name)

    def scalar(name: str, v: float) -> onnx.TensorProto:
        return numpy_helper.from_array(np.array(v, np.float32), name)

    inits = [init("w1", 32, 64), init("b1", 64), init("w2", 64, 32), init("b2", 32),
             scalar("sqrt2", 1.4142135), scalar("one", 1.0), scalar("half", 0.5)]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="/ffn/lin1/MatMul"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="/ffn/lin1/Add"),
        helper.make_node("Div", ["h1", "sqrt2"], ["g0"], name="/ffn/act/Div"),
        helper.make_node("Erf", ["g0"], ["g1"], name="/ffn/act/Erf"),
        helper.make_node("Add", ["g1", "one"], ["g2"], name="/ffn/act/Add"),
        helper.make_node("Mul", ["h1", "g2"], ["g3"], name="/ffn/act/Mul"),
        helper.make_node("Mul", ["g3", "half"], ["g4"], name="/ffn/act/Mul_1"),
        helper.make_node("MatMul", ["g4", "w2"], ["h2"], name="/ffn/lin2/MatMul"),
        helper.make_node("Add", ["h2", "b2"], ["y"], name="/ffn/lin2/Add"),
    ]
    graph = helper.make_graph(
        nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 32])], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def int8_net() -> onnx.ModelProto:
    """A uint8 activation times a constant int8 weight (MatMulInteger), then Cast."""
    w = numpy_helper.from_array(np.random.default_rng(0).integers(-128, 128, (64, 48), dtype=np.int8), "w")
    nodes = [helper.make_node("MatMulInteger", ["a", "w"], ["acc"], name="qmm"),
             helper.make_node("Cast", ["acc"], ["y"], name="cast", to=TensorProto.FLOAT)]
    graph = helper.make_graph(
        nodes, "int8_mm", [helper.make_tensor_value_info("a", TensorProto.UINT8, [16, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 48])], [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("profile") / "tiny_net.onnx"
    onnx.save(tiny_net(), str(path))
    return str(path)


@pytest.fixture(scope="module")
def full_profile(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """All three levels on the tiny net, OpenTelemetry to a file: one run shared by
    the trace, span and per-layer tests (it spawns the hw worker)."""
    otel_file = tmp_path_factory.mktemp("otel") / "spans.jsonl"
    rec = Recorder(OtelConfig(file=str(otel_file)), process_name="test")
    messages: list[str] = []
    opts = ProfileOptions(runs=4, warmup=1, brick_runs=3, config=QUICK, brick_config=QUICK_BRICK)
    result = profile_model(load(tiny_net()), opts, recorder=rec, on_message=messages.append)
    rec.shutdown()
    spans = [json.loads(line) for line in otel_file.read_text().splitlines()]
    return {"result": result, "trace": rec.chrome_trace(), "spans": spans, "messages": messages}


# --------------------------------------------------------------------------- options


def test_parse_levels_canonical_order_and_errors():
    assert parse_levels("hw,model") == ("model", "hw")
    assert parse_levels(" layer ") == ("layer",)
    assert parse_levels(["model", "layer", "hw"]) == LEVELS
    with pytest.raises(UsageError, match="unknown level 'kernel'"):
        parse_levels("model,kernel")
    with pytest.raises(UsageError):
        parse_levels(",")


# --------------------------------------------------------------------------- perf events


def test_probe_gives_a_reason_for_every_unavailable_event():
    result = probe(["cycles", "task-clock"])
    assert set(result) == {"cycles", "task-clock"}
    for name, why in result.items():
        assert why is None or (isinstance(why, str) and why.split(":")[0].startswith("E")), (name, why)
    with pytest.raises(KeyError):
        probe(["no-such-event"])


def test_task_clock_and_page_faults_count_real_work():
    if probe(["task-clock", "page-faults"]) != {"task-clock": None, "page-faults": None}:
        pytest.skip("software perf events are not available here")
    with CounterSet(["task-clock", "page-faults"], threads="self") as cs:
        before = cs.snapshot()
        t0 = time.perf_counter_ns()
        # A fresh anonymous mapping: every first write to a page faults (a numpy buffer
        # could reuse memory the allocator already mapped, and fault nowhere).
        region = mmap.mmap(-1, 16 << 20)
        buf = np.frombuffer(region, dtype=np.uint8)
        buf[::4096] = 1  # touch every page of 16 MiB
        x = 0
        while time.perf_counter_ns() - t0 < 20_000_000:  # 20 ms of CPU work
            x += 1
        wall = time.perf_counter_ns() - t0
        after = cs.snapshot()
    del buf
    region.close()
    d = CounterSet.delta(before, after)
    assert 0 < d["task-clock"] <= wall * 1.2 + 1e6
    assert d["task-clock"] >= 2_000_000  # busy for 20 ms: even a loaded machine gives us some of it
    assert d["page-faults"] >= 1


def test_counterset_rejects_unknown_events_and_reports_all_unavailable(monkeypatch):
    with pytest.raises(KeyError):
        CounterSet(["task-clock", "bogus"])
    import dlbricks.profiling.perfevents as pe

    def refuse(name, tid, exclude_kernel):
        raise OSError(13, "Permission denied")

    monkeypatch.setattr(pe, "_open_event", refuse)
    with pytest.raises(PerfUnavailable) as info:
        CounterSet(["cycles", "task-clock"])
    assert set(info.value.reasons) == {"cycles", "task-clock"}
    assert "EACCES" in str(info.value)


def test_derived_metrics():
    d = derived_metrics({"cycles": 2000.0, "instructions": 3000.0, "branch-misses": 6.0, "task-clock": 1000.0})
    assert d["ipc"] == pytest.approx(1.5)
    assert d["branch_miss_per_kinstr"] == pytest.approx(2.0)
    assert d["cpu_ghz"] == pytest.approx(2.0)
    assert derived_metrics({"task-clock": 5.0}) == {}
    assert set(EVENTS) >= {"cycles", "instructions", "cache-misses", "branch-misses", "task-clock"}


# --------------------------------------------------------------------------- onnxruntime profile parsing


def test_parse_ort_profile_keeps_the_last_runs_and_their_kernels():
    def run(ts, dur):
        return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur, "ph": "X"}

    def node(name, ts, dur):
        return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "ph": "X",
                "args": {"op_name": "Conv", "provider": "CPUExecutionProvider"}}

    events = [
        run(0, 100), node("a", 10, 20), node("b", 40, 30),
        run(200, 100), node("a", 205, 25), node("b", 240, 35),
        {"cat": "Node", "name": "a_fence_before", "ts": 206, "dur": 0},
        run(400, 90), node("a", 405, 22), node("b", 430, 33),
    ]
    runs = parse_ort_profile(events, 2)
    assert [r["ts"] for r in runs] == [200, 400]
    assert [[(k["name"], k["dur"]) for k in r["kernels"]] for r in runs] == [[("a", 25), ("b", 35)], [("a", 22), ("b", 33)]]
    assert runs[0]["kernels"][0]["op"] == "Conv"
    with pytest.raises(DlbricksError, match="3 model runs"):
        parse_ort_profile(events, 4)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_timed_intervals_follow_each_other_and_pinning_is_undone():
    from dlbricks.profiling.sessions import prepared, timed_intervals
    from dlbricks.timing.fpenv import denormals_flushed

    before, flushed = os.sched_getaffinity(0), denormals_flushed()
    cfg = RunnerConfig(intra_op_threads=1, cores=(min(before),))
    with prepared(tiny_net().SerializeToString(), cfg) as (_, bound):
        assert os.sched_getaffinity(0) == {min(before)}
        intervals = timed_intervals(bound, 5)
    assert os.sched_getaffinity(0) == before and denormals_flushed() == flushed
    assert len(intervals) == 5 and all(a < b for a, b in intervals)
    assert all(end <= start for (_, end), (start, _) in zip(intervals, intervals[1:]))


# --------------------------------------------------------------------------- the join


def test_join_maps_fused_nchwc_kernels_back_to_source_layers():
    model = load(tiny_net())
    # What onnxruntime makes of tiny_net at the default level on x86: the NCHWc
    # Conv named after the Relu's output holds Conv+BN+Relu, the next one absorbs
    # the residual Add+Relu, and a reorder leaves the blocked layout.
    nodes = [
        OrtNode("ReorderInput", "ReorderInput", "com.microsoft.nchwc", ("x",), ("tok0",)),
        OrtNode("r0_nchwc", "Conv", "com.microsoft.nchwc", ("tok0", "w0", "b0"), ("tok1",)),
        OrtNode("c1_nchwc", "Conv", "com.microsoft.nchwc", ("tok1", "w1", "b1", "tok1"), ("tok2",)),
        OrtNode("ReorderOutput", "ReorderOutput", "com.microsoft.nchwc", ("tok2",), ("r1",)),
        OrtNode("gap", "GlobalAveragePool", "", ("r1",), ("g",)),
        OrtNode("flatten", "Flatten", "", ("g",), ("f",)),
        OrtNode("fc", "Gemm", "", ("f", "wf", "bf"), ("logits",)),
        OrtNode("softmax", "Softmax", "", ("logits",), ("y",)),
    ]
    join = join_layers(model, nodes)
    names = {k: [model.layers[i].name for i in v] for k, v in join.layers.items()}
    assert names["r0_nchwc"] == ["conv0", "bn0", "relu0"]
    assert names["c1_nchwc"] == ["conv1", "add1", "relu1"]
    assert names["ReorderOutput"] == [] and join.how["ReorderOutput"] == "runtime"
    assert names["fc"] == ["fc"] and join.how["fc"] == "name"
    assert join.unassigned == [] and join.violations == 0
    # Every source layer is covered exactly once.
    covered = sorted(i for v in join.layers.values() for i in v)
    assert covered == list(range(model.n_layers))


def test_join_leaves_unknown_kernels_unmatched_rather_than_guessing():
    model = load(tiny_net())
    nodes = [OrtNode("mystery", "Conv", "", ("x",), ("t",)), OrtNode("other", "Conv", "", ("t",), ("u",))]
    join = join_layers(model, nodes)
    # Two Conv layers and two unnamed Conv kernels: no unique match by op and shape.
    assert join.how["mystery"] == join.how["other"] == "unmatched"
    assert join.layers["mystery"] == [] and len(join.unassigned) == model.n_layers


def test_every_kernel_of_a_fused_transformer_block_is_attributed_and_traced_to_its_source_layers():
    model = load(ffn_net())
    opts = ProfileOptions(levels=("layer",), runs=2, warmup=1, config=QUICK, calibrate=False)
    res = profile_model(model, opts, on_message=None)
    join, kernels = res["join"], res["kernels"]
    # Every kernel onnxruntime ran is a layer of its runtime graph, with that layer's cost.
    assert join["graph"] == "runtime" and join["attributed"] == join["kernels"] == len(kernels) == 7
    assert join["unattributed"] == [] and "unmatched" not in join["by_match"]
    assert all(k["attributed"] and k["runtime_layer"]["name"] == k["kernel"] for k in kernels)
    assert not any("not attributed" in w or "not traced" in w for w in res["warnings"])
    # ... and each source layer is in exactly one kernel: the Gemm holds its
    # MatMul and the bias Add, the Gelu the five nodes of the erf formula.
    by_op = {}
    for k in kernels:
        by_op.setdefault(k["op"], []).append(k)
    gemms = sorted(by_op["Gemm"], key=lambda k: k["kernel"])
    assert [[m["name"] for m in k["layers"]] for k in gemms] == [
        ["/ffn/lin1/MatMul", "/ffn/lin1/Add"], ["/ffn/lin2/MatMul", "/ffn/lin2/Add"]]
    assert all(k["match"] == "name" and k["cost_of"] == "runtime layer" for k in gemms)
    # The Gemm's work is its runtime layer's: 2 x 16 x 32 x 64 multiply-adds and the bias.
    assert gemms[0]["flops"] >= 2 * 16 * 32 * 64 and gemms[0]["runtime_layer"]["op_type"] == "Gemm"
    (gelu,) = by_op["Gelu"]
    assert [m["op_type"] for m in gelu["layers"]] == ["Div", "Erf", "Add", "Mul", "Mul"]
    assert gelu["match"] == "output" and gelu["label"] == "Div+Erf+Add+Mul"
    # The Reshapes onnxruntime put around each Gemm come from no source layer, and say so.
    assert len(by_op["Reshape"]) == 4
    assert all(k["match"] == "inserted" and k["layers"] == [] and k["label"] == "Reshape (inserted)"
               for k in by_op["Reshape"])
    assert join["inserted_ops"] == {"Reshape": 4} and join["unassigned_layers"] == 0
    assert sorted(m["index"] for k in kernels for m in k["layers"]) == list(range(model.n_layers))
    text = render_profile(res)
    assert "join: all 7 kernels attributed to the runtime graph's layers" in text
    assert "traced to source layers: 2 by name, 1 by output tensor; 0 source layers without a kernel" in text
    assert "inserted by onnxruntime (no source layer): Reshape 4" in text


def test_int8_kernels_report_their_integer_ops_as_work():
    opts = ProfileOptions(levels=("layer",), runs=2, warmup=1, config=QUICK, calibrate=False)
    res = profile_model(load(int8_net()), opts, on_message=None)
    (mm,) = [k for k in res["kernels"] if k["op"] == "MatMulInteger"]
    assert mm["int_ops"] == 2 * 16 * 64 * 48 and mm["layers"][0]["int_ops"] == mm["int_ops"]
    assert mm["gops"] == pytest.approx((mm["flops"] + mm["int_ops"]) / (mm["corrected_us"] * 1e3))
    assert res["join"]["attributed"] == res["join"]["kernels"]


# --------------------------------------------------------------------------- the full profile


def test_profile_covers_every_layer_and_reconciles(full_profile):
    res = full_profile["result"]
    assert res["schema_version"] == 1
    assert {"onnxruntime", "intra_op_threads", "logical_cores", "system_id"} <= set(res["context"])
    kernels = res["kernels"]
    joined = sorted(m["index"] for k in kernels for m in k["layers"])
    assert joined == list(range(res["model"]["layers"]))  # each layer in exactly one kernel
    assert res["join"]["attributed"] == len(kernels) and all(k["runtime_layer"] for k in kernels)
    conv0 = next(k for k in kernels if any(m["name"] == "conv0" for m in k["layers"]))
    assert [m["op_type"] for m in conv0["layers"]] == ["Conv", "BatchNormalization", "Relu"]
    ll = res["layer_level"]
    # The identity that defines framework overhead, and the figures it rests on.
    assert ll["corrected_sum_us"] + ll["framework_overhead_us"] == pytest.approx(ll["reference_us"])
    assert ll["framework_overhead_us"] == pytest.approx(ll["scale"] * ll["framework_seen_in_profile_us"])
    assert ll["corrected_sum_us"] == pytest.approx(sum(k["corrected_us"] for k in kernels))
    assert ll["raw_sum_us"] == pytest.approx(sum(k["raw_us"] for k in kernels))
    assert ll["instrumentation"]["in_span_us"] >= 0 and ll["instrumentation"]["total_us"] >= 0
    for k in kernels:
        assert k["raw_us"] > 0 and len(k["raw_runs_us"]) == 4
        assert k["corrected_us"] == pytest.approx(
            ll["scale"] * max(k["raw_us"] - ll["instrumentation"]["in_span_us"], 0.0)
        )
    assert res["model_level"]["latency_us"] == ll["reference_us"]


def test_profile_hw_level_counts_or_says_why_in_one_line(full_profile):
    res = full_profile["result"]
    hw = res["hw_level"]
    notices = [m for m in full_profile["messages"] if m.startswith("hardware counters unavailable on this machine (")]
    if hw["hardware_counters"]:
        assert notices == [] and hw["message"] is None
    else:
        assert len(notices) == 1 and "\n" not in notices[0] and notices[0] == hw["message"]
        assert "skipping the hw level" in notices[0]
    assert hw["failed"] == 0 and hw["bricks"] >= 4
    assert hw["model"]["counted_us"] > 0 and hw["model"]["uncounted_us"] > 0
    for k in res["kernels"]:
        if k["layers"]:
            assert k["isolated_us"] > 0 and k["in_model_over_isolated"] >= 0
            if k["flops"] > 100_000:
                assert k["in_model_over_isolated"] > 0
            if hw["events"]:
                assert set(k["counters"]) == set(hw["events"])


@pytest.mark.parametrize("hardware", [True, False])
def test_hw_notice_is_one_line_only_when_the_pmu_is_missing(monkeypatch, hardware):
    import dlbricks.profiling.hw as hw_mod
    import dlbricks.profiling.perfevents as pe

    def fake_probe(events):
        return {e: None if hardware or e in pe.SOFTWARE_EVENTS else "EACCES: not permitted" for e in events}

    def fake_jobs(jobs, setup, rec, timeout_s, say):
        assert setup["events"] == (list(pe.HARDWARE_EVENTS + pe.SOFTWARE_EVENTS) if hardware else list(pe.SOFTWARE_EVENTS))
        assert [j["key"] for j in jobs] == ["model"]
        return {"model": {"key": "model", "error": None, "counted_us": 11.0, "uncounted_us": 10.0}}, [1]

    monkeypatch.setattr(pe, "probe", fake_probe)
    monkeypatch.setattr(hw_mod, "run_hw_jobs", fake_jobs)
    messages: list[str] = []
    opts = ProfileOptions(levels=("hw",), hw_bricks=False)
    rec = Recorder()
    root = rec.start("root")
    hw = hw_mod.hw_level(load(tiny_net()), b"", None, [], opts, rec, root, messages.append, [])
    assert hw["hardware_counters"] is hardware
    assert hw["model"]["overhead_us"] == pytest.approx(1.0) and hw["overhead_rel"] == pytest.approx(0.1)
    if hardware:
        assert messages == ["level 3 (hw): 0 bricks and the whole model in a worker process"]
    else:
        assert messages[0] == hw["message"]
        assert messages[0].startswith("hardware counters unavailable on this machine (EACCES: not permitted)")
        assert "skipping the hw level" in messages[0] and "task-clock" in messages[0]


# A user's script as they write it: no `if __name__ == "__main__":` guard.
_HW_SCRIPT = textwrap.dedent("""
    import json
    import sys

    from dlbricks.loading import load
    from dlbricks.profiling import ProfileOptions, profile_model
    from dlbricks.timing import RunnerConfig

    print("script body ran")
    quick = RunnerConfig(warmup_iters=1, warmup_time=0.0, min_iters=3, min_time=0.0, max_time=0.1, target_ci=0.2)
    opts = ProfileOptions(levels=("hw",), hw_bricks=False, brick_runs=2, warmup=1, config=quick, brick_config=quick)
    result = profile_model(load(sys.argv[1]), opts, on_message=None)
    print(json.dumps(result["hw_level"]))
""")


def test_hw_level_runs_from_a_script_without_a_main_guard(tiny_path, tmp_path):
    if probe(["task-clock"]) != {"task-clock": None}:
        pytest.skip("perf events are not available here")
    script = tmp_path / "profile_hw.py"
    script.write_text(_HW_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), tiny_path], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    # The worker did not run the user's script again (spawn re-imports the main module).
    assert lines.count("script body ran") == 1
    hw = json.loads(lines[-1])
    assert len(hw["worker_pids"]) == 1 and hw["failed"] == 0
    assert "task-clock" in hw["events"] and hw["model"]["counters"]["task-clock"] > 0
    assert hw["model"]["counted_us"] > 0 and hw["model"]["uncounted_us"] > 0


def test_trace_is_valid_nested_and_carries_layer_args(full_profile):
    trace = full_profile["trace"]
    json.loads(json.dumps(trace))  # plain JSON
    assert validate_chrome_trace(trace) == []
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    runs = [e for e in events if e["name"].startswith("model run")]
    kernels = [e for e in events if e["cat"] == "kernel"]
    assert len(runs) == 4
    assert len(kernels) == 4 * len(full_profile["result"]["kernels"])
    by_id = {e["args"]["span_id"]: e for e in events}
    for k in kernels:
        a = k["args"]
        assert {"op", "input_shapes", "output_shapes", "brick_digest", "flops", "bytes_min", "layers"} <= set(a) or a[
            "match"
        ] == "runtime"
        # kernel > onnxruntime model_run > model run > level 2
        parent = by_id[a["parent_id"]]
        assert parent["name"] == "onnxruntime model_run"
        assert by_id[parent["args"]["parent_id"]]["name"].startswith("model run")
        if full_profile["result"]["hw_level"]["events"] and a["match"] != "runtime":
            assert set(a["counters"]) == set(full_profile["result"]["hw_level"]["events"])
    conv = next(k for k in kernels if "conv0" in k["args"].get("layers", []))
    assert conv["args"]["flops"] > 0 and conv["args"]["input_shapes"][0] == [1, 3, 32, 32]
    # The worker's spans are in the trace, in another process, under the hw level.
    pids = {e["pid"] for e in events}
    assert len(pids) == 2
    worker = [e for e in events if e["pid"] != os.getpid()]
    hw_span = next(e for e in events if e["name"].startswith("level 3"))
    assert any(e["args"]["parent_id"] == hw_span["args"]["span_id"] for e in worker)


def test_validator_rejects_broken_traces(full_profile):
    trace = json.loads(json.dumps(full_profile["trace"]))
    kernel = next(e for e in trace["traceEvents"] if e.get("cat") == "kernel")
    kernel["ts"] -= 1e6  # move a layer out of its model run
    problems = validate_chrome_trace(trace)
    assert any("not within its parent" in p for p in problems)
    assert validate_chrome_trace({"traceEvents": [{"name": "x", "ph": "X", "ts": 0, "pid": 1, "tid": 1}]})
    assert validate_chrome_trace({"traceEvents": [{"name": "x", "ph": "Q", "ts": 0}]})
    assert validate_chrome_trace({"events": []}) == ["traceEvents is missing or not a list"]


def test_otel_spans_of_the_worker_join_the_parents_trace(full_profile):
    spans = full_profile["spans"]
    parent_pid = os.getpid()
    roots = [s for s in spans if s["parent_span_id"] is None]
    assert len(roots) == 1 and roots[0]["name"].startswith("dlbricks profile")
    trace_id = roots[0]["trace_id"]
    assert {s["trace_id"] for s in spans} == {trace_id}
    worker_spans = [s for s in spans if s["resource"]["process.pid"] != parent_pid]
    assert worker_spans, "the worker exported no spans"
    hw = next(s for s in spans if s["name"].startswith("level 3"))
    assert hw["resource"]["process.pid"] == parent_pid
    bricks = [s for s in worker_spans if s["name"].startswith("brick ")]
    assert bricks and all(s["parent_span_id"] == hw["span_id"] for s in bricks)
    # Layer spans nest under model runs, as in the Chrome trace.
    by_id = {s["span_id"]: s for s in spans}
    layer = next(s for s in spans if s["attributes"].get("kernel") and s["attributes"].get("layers"))
    assert by_id[layer["parent_span_id"]]["name"] == "onnxruntime model_run"
    assert layer["start_time_unix_nano"] >= by_id[layer["parent_span_id"]]["start_time_unix_nano"]


def test_text_summary_has_every_section(full_profile):
    text = render_profile(full_profile["result"], top=5)
    for needle in ("levels (each measured", "model  latency", "layer  profiled run", "reconciliation",
                   "framework overhead", "top 5 layers", "per op type", "in-model vs isolated"):
        assert needle in text, needle


# --------------------------------------------------------------------------- ResNet-50


def test_resnet50_corrected_layer_times_reconcile_with_model_latency():
    opts = ProfileOptions(levels=("model", "layer"), runs=3, warmup=1, config=QUICK)
    res = profile_model(load(light("resnet50")), opts, on_message=None)
    ll = res["layer_level"]
    assert ll["reference"] == "model level"
    assert abs(ll["corrected_sum_us"] - res["model_level"]["latency_us"]) <= 0.10 * res["model_level"]["latency_us"]
    assert res["join"]["unassigned_layers"] == 0 and res["join"]["violations"] == 0
    assert res["join"]["by_match"].get("unmatched", 0) == 0
    # 53 convolutions, each BatchNormalization folded into one of them.
    convs = [k for k in res["kernels"] if k["layers"] and k["layers"][0]["op_type"] == "Conv"]
    assert len(convs) == 53
    assert all(k["layers"][1]["op_type"] == "BatchNormalization" for k in convs)


# --------------------------------------------------------------------------- CLI


def test_cli_json_and_text(tiny_path, capsys, tmp_path):
    trace_path = tmp_path / "trace.json"
    assert main(["profile", tiny_path, "--levels", "model,layer", "--runs", "2", "--json", "--trace", str(trace_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema_version"] == 1 and out["levels"] == ["model", "layer"] and out["hw_level"] is None
    assert validate_chrome_trace(json.loads(trace_path.read_text())) == []
    assert main(["profile", tiny_path, "--levels", "layer", "--runs", "2"]) == 0
    text = capsys.readouterr().out
    assert "reconciliation against same session, profiling off" in text


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--levels", "model,gpu"], "unknown level 'gpu'"),
        (["--otlp-endpoint", "ftp://collector"], "expected an http(s) URL"),
    ],
)
def test_cli_usage_errors_exit_2(tiny_path, capsys, argv, needle):
    assert main(["profile", tiny_path, *argv]) == 2
    assert needle in capsys.readouterr().err


def test_cli_rejects_zero_runs(tiny_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["profile", tiny_path, "--runs", "0"])
    assert info.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err


def test_cli_missing_file_is_a_usage_error(capsys, tmp_path):
    assert main(["profile", str(tmp_path / "nope.onnx")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_missing_opentelemetry_gives_one_clear_line(monkeypatch, tiny_path, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(DlbricksError, match=r"pip install dlbricks\[trace\]"):
        Recorder(OtelConfig(file=str(tmp_path / "s.jsonl")))
    Recorder(OtelConfig())  # no OpenTelemetry asked for: no import
    assert main(["profile", tiny_path, "--levels", "model", "--otel-file", str(tmp_path / "s.jsonl")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "OpenTelemetry" in err[0]


# --------------------------------------------------------------------------- OTLP


class _Collector(http.server.BaseHTTPRequestHandler):
    bodies: list[bytes] = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_otlp_export_reaches_the_collector_from_both_processes(tiny_path, capsys):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    _Collector.bodies = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["profile", tiny_path, "--levels", "model,hw", "--no-bricks", "--brick-runs", "2",
                     "--otlp-endpoint", url]) == 0
    finally:
        server.shutdown()
        server.server_close()
    capsys.readouterr()
    spans = []
    for body in _Collector.bodies:
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        for rs in req.resource_spans:
            pid = next(a.value.int_value for a in rs.resource.attributes if a.key == "process.pid")
            for ss in rs.scope_spans:
                spans.extend((pid, s) for s in ss.spans)
    assert spans, "the collector received nothing"
    assert len({s.trace_id for _, s in spans}) == 1
    assert len({pid for pid, _ in spans}) == 2  # this process and the worker
    names = {s.name for _, s in spans}
    assert "level 1: model (profiling off)" in names and any(n.startswith("brick whole model") for n in names)


class _RefusingCollector(_Collector):
    def do_POST(self):  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(400)  # not retried by the exporter: the test does not wait out back-offs
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_a_collector_that_refuses_the_spans_is_an_error_after_the_profile_is_written(tiny_path, tmp_path, capsys):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RefusingCollector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    out = tmp_path / "profile.txt"
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        code = main(["profile", tiny_path, "--levels", "model", "--runs", "2", "--otlp-endpoint", url, "-o", str(out)])
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().splitlines()[-1].startswith(f"dlbricks profile: error: --otlp-endpoint {url}/v1/traces: ")
    assert "span(s) were not exported" in err and "Traceback" not in err and "Failed to export" not in err
    assert "model" in out.read_text()  # the profile itself was written first
