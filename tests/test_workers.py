"""Isolated timing jobs (dlbricks.timing.workers): failures are recorded, the run goes on."""

from __future__ import annotations

import multiprocessing as mp

import onnx
import pytest
from onnx import TensorProto, helper

from dlbricks.errors import DlbricksError
from dlbricks.timing import Failure, Measurement, RunnerConfig
from dlbricks.timing.workers import Job, run_isolated

CFG = RunnerConfig(warmup_iters=1, warmup_time=0.0, min_iters=5, min_time=0.005, max_time=0.02, timeout_s=60)


def _save(path, nodes, opsets=(("", 13),)):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 8
    onnx.save(model, path)
    return str(path)


@pytest.fixture
def good(tmp_path):
    return _save(tmp_path / "add.onnx", [helper.make_node("Add", ["x", "x"], ["y"])])


@pytest.fixture
def unloadable(tmp_path):
    # An op from a domain onnxruntime has never heard of: session creation fails.
    return _save(
        tmp_path / "custom.onnx",
        [helper.make_node("Frobnicate", ["x"], ["y"], domain="org.unknown")],
        opsets=(("", 13), ("org.unknown", 1)),
    )


def _run(jobs, **kwargs):
    got: list[tuple[Job, Measurement | Failure]] = []
    summary = run_isolated(jobs, kwargs.pop("config", CFG), on_result=lambda j, r: got.append((j, r)), **kwargs)
    return summary, got


def test_jobs_share_one_worker_and_deliver_measurements_in_order(good):
    summary, got = _run([Job(str(i), good, seed=i) for i in range(3)])
    assert [j.id for j, _ in got] == ["0", "1", "2"]
    assert all(isinstance(r, Measurement) and r.stats.n >= 5 for _, r in got)
    assert [r.seed for _, r in got] == [0, 1, 2]
    assert (summary.ok, summary.failed, summary.worker_starts) == (3, 0, 1)


def test_a_model_onnxruntime_cannot_load_is_recorded_as_failed(good, unloadable):
    summary, got = _run([Job("bad", unloadable), Job("ok", good)])
    (_, bad), (_, ok) = got
    assert isinstance(bad, Failure) and bad.reason == "error"
    assert "custom.onnx" in bad.error and "Frobnicate" in bad.error
    assert isinstance(ok, Measurement)
    assert summary.worker_starts == 1  # an exception does not cost the worker


def test_a_crashing_job_is_recorded_and_the_next_job_still_succeeds(good):
    summary, got = _run([Job("crash", good, hook="os:abort"), Job("next", good)])
    (_, crash), (_, nxt) = got
    assert isinstance(crash, Failure) and crash.reason == "crash"
    assert "SIGABRT" in crash.error and crash.exitcode < 0
    assert isinstance(nxt, Measurement)
    assert (summary.ok, summary.failed, summary.worker_starts) == (1, 1, 2)


def test_a_hanging_job_times_out_and_the_next_job_still_succeeds(good):
    # The limit covers the next job's session set-up in a fresh worker too: 60 ms on
    # a quiet host, and past 1 s in one clean-clone CI run on a busy one.
    summary, got = _run([Job("hang", good, hook="signal:pause"), Job("next", good)], timeout_s=5.0)
    (_, hang), (_, nxt) = got
    assert isinstance(hang, Failure) and hang.reason == "timeout"
    assert "timed out after 5 s" in hang.error and hang.wall_time_s >= 5.0
    assert isinstance(nxt, Measurement)
    assert summary.worker_starts == 2


def test_each_result_is_delivered_before_the_next_job_is_taken(good):
    delivered: list[str] = []

    def jobs():
        for i in range(3):
            assert len(delivered) == i  # the caller has stored result i-1 already
            yield Job(str(i), good)

    run_isolated(jobs(), CFG, on_result=lambda j, r: delivered.append(j.id))
    assert delivered == ["0", "1", "2"]


def test_an_error_in_the_callback_propagates_and_leaves_no_worker_behind(good):
    def boom(job, result):
        raise RuntimeError("store is full")

    with pytest.raises(RuntimeError, match="store is full"):
        run_isolated([Job("a", good), Job("b", good)], CFG, on_result=boom)
    assert not [p for p in mp.active_children() if p.name == "dlbricks-worker"]


def test_a_worker_that_cannot_start_is_an_error_not_a_job_failure(good):
    with pytest.raises(DlbricksError, match="did not start"):
        run_isolated([Job("a", good)], CFG, on_result=lambda j, r: None, start_timeout_s=0.001)
