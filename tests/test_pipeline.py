"""Benchmarking through the store, reconstruction and evaluation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from conftest import light
from onnx import TensorProto, helper, numpy_helper

from dlbricks.cli import main
from dlbricks.corpus import Corpus
from dlbricks.loading import load
from dlbricks.pipeline import bench, evaluate
from dlbricks.reconstruct import MissingResults, bootstrap_medians, reconstruct
from dlbricks.store import Store, StoreError
from dlbricks.timing import Measurement, RunnerConfig, summarize
from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint
from dlbricks.versions import brick_digest_version

FAST = RunnerConfig(cores=None, warmup_iters=1, warmup_time=0.0, min_iters=5, min_time=0.005, max_time=0.05)
FAST_CLI = ["--no-pin", "--warmup", "1", "--warmup-time", "0", "--min-iters", "5", "--min-time", "0.005", "--max-time", "0.05"]


def _conv(name: str, x: str, y: str, c: int, rng: np.random.Generator) -> tuple[list, list]:
    w = numpy_helper.from_array(rng.standard_normal((c, c, 3, 3)).astype(np.float32), f"{name}_w")
    node = helper.make_node("Conv", [x, w.name], [y], name=name, pads=[1, 1, 1, 1])
    return [node], [w]


def chain_model(n_blocks: int = 2, c: int = 4) -> onnx.ModelProto:
    """x -> (Conv -> Relu) * n_blocks: repeated identical blocks."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    cur = "x"
    for i in range(n_blocks):
        ns, ws = _conv(f"conv{i}", cur, f"c{i}", c, rng)
        nodes += ns
        inits += ws
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}"))
        cur = f"r{i}"
    g = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 8, 8])],
        [helper.make_tensor_value_info(cur, TensorProto.FLOAT, [1, c, 8, 8])], inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def diamond_model(c: int = 4) -> onnx.ModelProto:
    """x -> Relu -> {Sigmoid, Tanh} -> Add: two independent branches."""
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="head"),
        helper.make_node("Sigmoid", ["a"], ["b"], name="left"),
        helper.make_node("Tanh", ["a"], ["c"], name="right"),
        helper.make_node("Add", ["b", "c"], ["y"], name="join"),
    ]
    g = helper.make_graph(
        nodes, "diamond", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 8, 8])],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def fake_measurement(times_ns: np.ndarray) -> Measurement:
    times = np.asarray(times_ns, dtype=np.int64)
    return Measurement(
        times_ns=times, stats=summarize(times), config=FAST, warmup_iters=1, stop_reason="converged",
        setup_time_s=0.0, wall_time_s=float(times.sum()) * 1e-9, denormal_input_fraction=0.0,
        denormal_output_fraction=0.0, denormal_fraction=0.0, denormals_as_zero=True, denormals_flushed=True,
        ort_version="test",
    )


def store_fake_results(store: Store, models: list, G: int, median_of: dict[str, float], n: int = 101) -> tuple[str, str]:
    """Put a result with a known median for every unique brick at G (by its first layer's name)."""
    system_id = fingerprint_id(system_fingerprint())
    store.put_system(system_fingerprint())
    store.put_config(FAST)
    sp = Corpus(models).split(G)
    rng = np.random.default_rng(1)
    for u in range(sp.n_unique):
        m, members = sp.first_occurrence(u)
        total = sum(median_of[models[m].layers[i].op_type] for i in members)
        # Symmetric spread around the median, shuffled: the median is exactly `total`.
        times = total + rng.permutation(np.arange(-(n // 2), n // 2 + 1))
        store.put_result("brick", bytes(sp.unique_digests[u]).hex(), brick_digest_version(), system_id, FAST,
                         fake_measurement(times))
    return system_id, FAST.key()


def test_sequential_reconstruction_is_the_sum_of_brick_medians(tmp_path):
    model = load(chain_model(3))
    medians = {"Conv": 1000.0, "Relu": 100.0}
    with Store(tmp_path / "s.sqlite") as store:
        sid, key = store_fake_results(store, [model], 1, medians)
        (pred,) = reconstruct([model], 1, store=store, system_id=sid, config_key=key, modes=["sequential"])
    assert pred.latency_s == pytest.approx(3 * 1100e-9)
    assert pred.bricks == 6 and pred.unique_bricks == 2


def test_parallel_reconstruction_is_the_critical_path(tmp_path):
    model = load(diamond_model())
    medians = {"Relu": 100.0, "Sigmoid": 700.0, "Tanh": 300.0, "Add": 50.0}
    with Store(tmp_path / "s.sqlite") as store:
        sid, key = store_fake_results(store, [model], 1, medians)
        preds = {p.mode: p for p in reconstruct([model], 1, store=store, system_id=sid, config_key=key)}
    assert preds["sequential"].latency_s == pytest.approx(1150e-9)
    assert preds["parallel"].latency_s == pytest.approx((100 + 700 + 50) * 1e-9)


def test_prediction_interval_contains_the_point_estimate(tmp_path):
    model = load(chain_model(2))
    with Store(tmp_path / "s.sqlite") as store:
        sid, key = store_fake_results(store, [model], 2, {"Conv": 5000.0, "Relu": 300.0})
        for p in reconstruct([model], 2, store=store, system_id=sid, config_key=key):
            assert p.ci_low_s <= p.latency_s <= p.ci_high_s


def test_bootstrap_interval_shrinks_with_more_iterations():
    rng = np.random.default_rng(0)

    def width(n: int) -> float:
        times = rng.lognormal(mean=np.log(1e5), sigma=0.1, size=n)
        reps = bootstrap_medians(times, 2000, np.random.default_rng(1))
        lo, hi = np.percentile(reps, [2.5, 97.5])
        assert lo <= np.median(times) <= hi
        return hi - lo

    small, medium, large = width(50), width(1000), width(20000)
    assert large < medium < small


def test_missing_bricks_are_a_clear_error(tmp_path):
    model = load(chain_model(2))
    with Store(tmp_path / "s.sqlite") as store, pytest.raises(MissingResults, match=r"2 brick\(s\) at G=1 have no stored result"):
        reconstruct([model], 1, store=store, system_id="x", config_key=FAST.key())


def test_construct_cli_without_results_exits_1(tmp_path, capsys):
    path = tmp_path / "chain.onnx"
    onnx.save(chain_model(2), str(path))
    Store(tmp_path / "s.sqlite").close()  # a store, but nothing measured in it
    code = main(["construct", str(path), "-G", "1", "--store", str(tmp_path / "s.sqlite"), *FAST_CLI])
    err = capsys.readouterr().err
    assert code == 1
    assert "have no stored result" in err and "--measure-missing" in err and "Traceback" not in err


@pytest.mark.parametrize("command", [
    ["construct", "MODEL", "-G", "1"],
    ["evaluate", "MODEL", "-G", "1", "--no-measure"],
    ["report"],
    ["results"],
    ["roofline", "MODEL", "--no-measure"],
])
def test_read_only_commands_refuse_a_store_that_is_not_there_and_never_create_one(tmp_path, capsys, command):
    path = tmp_path / "chain.onnx"
    onnx.save(chain_model(2), str(path))
    missing = tmp_path / "typo" / "none.sqlite"
    argv = [str(path) if a == "MODEL" else a for a in command] + ["--store", str(missing)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--store {missing}" in err and "no results store" in err and len(err.strip().splitlines()) == 1
    assert not missing.exists() and not missing.parent.exists()


def test_bench_reuses_the_store_and_measures_only_new_bricks(tmp_path):
    a, b = load(chain_model(2)), load(diamond_model())
    with Store(tmp_path / "s.sqlite") as store:
        first = bench([a], [1, 2], store=store, config=FAST)
        assert first.bricks_measured == first.bricks_total > 0 and first.bricks_failed == 0
        second = bench([a, b], [1, 2], store=store, config=FAST)
        assert second.bricks_reused == first.bricks_total
        assert second.bricks_measured == second.bricks_total - first.bricks_total > 0
        third = bench([a, b], [1, 2], store=store, config=FAST, force=True)
        assert third.bricks_measured == third.bricks_total


def test_work_is_planned_model_by_model_each_whole_model_before_the_bricks_first_seen_in_it(tmp_path):
    from dlbricks.pipeline import missing_work, plan_work

    a, b = tmp_path / "chain.onnx", tmp_path / "diamond.onnx"
    onnx.save(chain_model(3), str(a))
    onnx.save(diamond_model(), str(b))
    models = [load(a), load(b)]
    with Store(tmp_path / "s.sqlite") as st:
        items = plan_work(models, [1, 2], st, e2e=True)
        # The engine fills its memory budget in this order: a corpus measured in several
        # batches then has each model in the same rounds as its bricks.
        owner = [0 if w.model is models[0] else 1 for w in items]
        assert owner == sorted(owner) and owner[0] == 0 and 1 in owner
        for m in (0, 1):
            first = owner.index(m)
            assert items[first].kind == "model"
            assert all(w.kind == "brick" for w, o in zip(items, owner) if o == m and w is not items[first])
        # What the store lacks keeps that order.
        sys_id = fingerprint_id(system_fingerprint())
        st.put_system(system_fingerprint())
        key = st.put_config(RunnerConfig())
        done = items[1]
        st.put_result(done.kind, done.digest, done.version, sys_id, key, fake_measurement(np.full(11, 1e5)))
        todo, reused = missing_work(items, st, sys_id, key)
        assert todo == [w for w in items if w is not done] and reused == {"brick": 1, "model": 0}


def test_large_weights_come_from_the_run_s_weight_pool_which_is_removed_after(tmp_path, monkeypatch):
    import dlbricks.weight_pool as weight_pool

    # Convolutions with 64 channels: 147 KiB of weights each, above the pool's minimum.
    m = load(chain_model(2, c=64))
    made: list = []
    original = weight_pool.WeightPool.model

    def spy(self):
        made.append(window := original(self))
        return window

    monkeypatch.setattr(weight_pool.WeightPool, "model", spy)
    work = tmp_path / "work"
    with Store(tmp_path / "s.sqlite") as store:
        s = bench([m], [1], store=store, config=FAST, e2e=True, workdir=work)
    assert s.bricks_measured == s.bricks_total > 0 and s.models_measured == 1 and s.bricks_failed == 0
    # The convolution brick and the whole model named pooled weights (two 147 KiB
    # convolutions in the model, one in the brick), and no file is left once measured.
    pooled = sorted(w.nbytes for w in made)
    assert pooled[-1] == 2 * 64 * 64 * 9 * 4 and 64 * 64 * 9 * 4 in pooled
    assert not [p for p in work.rglob("*") if p.is_file()]


def test_a_brick_onnxruntime_cannot_run_is_recorded_failed_and_the_run_goes_on(tmp_path):
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("Mystery", ["a"], ["b"], name="custom", domain="example.custom"),
        helper.make_node("Sigmoid", ["b"], ["y"], name="sig"),
    ]
    g = helper.make_graph(
        nodes, "custom", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        value_info=[helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, 8])],
    )
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("example.custom", 1)])
    model = load(proto)
    with Store(tmp_path / "s.sqlite") as store:
        s = bench([model], [1], store=store, config=FAST)
        assert s.bricks_total == 3 and s.bricks_failed == 1 and s.bricks_measured == 2
        assert "Mystery" in s.failures[0]["error"] or "example.custom" in s.failures[0]["error"]
        # A failed brick is tried again by default, and stays failed.
        again = bench([model], [1], store=store, config=FAST)
        assert again.bricks_reused == 2 and again.bricks_failed == 1


def test_evaluate_two_light_models_end_to_end(tmp_path):
    models = [load(light("squeezenet")), load(light("bvlc_alexnet"))]
    with Store(tmp_path / "s.sqlite") as store:
        result = evaluate(models, [1, 2], store=store, config=FAST, n_boot=50)
    assert [g["G"] for g in result["per_g"]] == [1, 2]
    for g in result["per_g"]:
        assert g["geomean_normalized"] > 0 and g["speedup"] > 0 and g["wallclock_speedup"] > 0
        assert g["min_normalized"] <= g["geomean_normalized"] <= g["max_normalized"]
    for m in result["models"]:
        assert m["e2e_s"] > 0 and m["layer_sum_s"] > 0
        assert m["layer_critical_path_s"] <= m["layer_sum_s"] * (1 + 1e-9)
        for G in ("1", "2"):
            seq = m["per_g"][G]["sequential"]
            assert seq["ci_low_s"] <= seq["latency_s"] <= seq["ci_high_s"]
            # Compared with the model's latency in the rounds its bricks were measured in.
            ref = m["per_g"][G]["e2e_same_rounds_s"]
            assert seq["normalized"] == pytest.approx(seq["latency_s"] / ref)
            assert 0.5 * m["e2e_s"] < ref < 2.0 * m["e2e_s"]
    json.dumps(result.to_dict())  # JSON-ready


def test_evaluate_cli_json_has_the_documented_keys(tmp_path, capsys):
    path = tmp_path / "chain.onnx"
    onnx.save(chain_model(3), str(path))
    code = main(["evaluate", str(path), "-G", "1,2", "--store", str(tmp_path / "s.sqlite"), "--json", "--bootstrap", "20", *FAST_CLI])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert {"G", "geomean_normalized", "speedup", "wallclock_speedup"} <= set(out["per_g"][0])
    assert out["models"][0]["name"] == "chain"


def test_a_killed_bench_run_resumes_without_losing_results(tmp_path):
    store_path = tmp_path / "s.sqlite"
    cmd = [sys.executable, "-m", "dlbricks", "bench", str(light("squeezenet")), "-G", "1", "--graph", "source",
           "--store", str(store_path),
           "--no-pin", "--warmup", "1", "--warmup-time", "0", "--min-iters", "20", "--min-time", "0.05", "--max-time", "0.1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    done_before = 0
    try:
        while time.monotonic() < deadline:
            time.sleep(0.3)
            exited = proc.poll() is not None
            try:
                with Store(store_path, readonly=True) as s:
                    done_before = s.count(kind="brick")
            except StoreError:
                # Not there yet, or created but still empty: sqlite makes the file
                # before the bench's first transaction fills it.
                if exited:
                    break
                continue
            if done_before >= 5 or exited:
                break
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the driver and its timing worker, mid-run
        proc.wait()
    assert done_before >= 5
    with Store(store_path) as store:
        kept = store.count(kind="brick")
        assert kept >= done_before
        s = bench([load(light("squeezenet"))], [1], store=store, config=RunnerConfig(
            cores=None, warmup_iters=1, warmup_time=0.0, min_iters=20, min_time=0.05, max_time=0.1))
        assert s.bricks_reused == kept
        assert s.bricks_measured == s.bricks_total - kept
        assert store.count(kind="brick") == s.bricks_total


def _zoo(tmp_path):
    """A model-zoo layout: two different networks, both called model.onnx."""
    for sub, proto in (("a", chain_model(3)), ("b", diamond_model())):
        (tmp_path / "zoo" / sub).mkdir(parents=True)
        onnx.save(proto, str(tmp_path / "zoo" / sub / "model.onnx"))
    return tmp_path / "zoo"


def test_models_with_the_same_file_name_stay_apart_in_evaluate(tmp_path, capsys):
    from dlbricks.bricks import model_digest
    from dlbricks.versions import model_digest_version

    zoo = _zoo(tmp_path)
    store_path = tmp_path / "s.sqlite"
    code = main(["evaluate", str(zoo), "-G", "1", "--store", str(store_path), "--json", "--bootstrap", "20", *FAST_CLI])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    rows = {m["name"]: m for m in out["models"]}
    assert sorted(rows) == ["a/model", "b/model"]
    sid = fingerprint_id(system_fingerprint())
    with Store(store_path, readonly=True) as store:
        assert sorted(m["name"] for m in store.models().values()) == ["a/model", "b/model"]
        for sub in ("a", "b"):
            row = rows[f"{sub}/model"]
            assert row["path"] == str(zoo / sub / "model.onnx")
            # Each model is paired with its own end-to-end run, not the other's.
            rec = store.get_result("model", model_digest(load(row["path"])), model_digest_version(), sid, out["config_key"])
            assert row["e2e_s"] == pytest.approx(rec.median_ns * 1e-9)
    assert rows["a/model"]["layers"] == 6 and rows["b/model"]["layers"] == 4


def test_models_with_the_same_file_name_get_distinct_names_in_analyze(tmp_path, capsys):
    zoo = _zoo(tmp_path)
    assert main(["analyze", str(zoo), "-G", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in out["models"]] == ["a/model", "b/model"]
    assert out["corpus"]["jaccard"]["names"] == ["a/model", "b/model"]


def test_evaluate_pairs_models_by_position_even_under_one_name(tmp_path):
    a, b = load(chain_model(3), name="net"), load(diamond_model(), name="net")
    with Store(tmp_path / "s.sqlite") as store:
        result = evaluate([a, b], [1], store=store, config=FAST, n_boot=20)
    assert [m["name"] for m in result["models"]] == ["net", "net#2"]
    assert [m["layers"] for m in result["models"]] == [6, 4]
    e2e = [m["e2e_s"] for m in result["models"]]
    assert e2e[0] != e2e[1]


def test_evaluating_fast_loaded_models_never_builds_their_layers(tmp_path):
    from dlbricks.analysis import load_corpus
    from dlbricks.report.html import brick_contributions

    zoo = _zoo(tmp_path)
    with Store(tmp_path / "s.sqlite") as store:
        bench(load_corpus([zoo]).models, [1, 2], store=store, config=FAST, e2e=True)  # generates: builds layers
        models = load_corpus([zoo]).models
        assert all(not m.layers.is_materialized for m in models)
        result = evaluate(models, [1, 2], store=store, config=FAST, n_boot=20)
        assert all(b["op_types"] for b in result["bricks"])
        assert all(not m.layers.is_materialized for m in models)
    # The report's fallback when the store has no brick metadata: kinds from the loader too.
    with Store(tmp_path / "bare.sqlite") as bare:
        sid, key = store_fake_results(bare, [load(chain_model(3))], 1, {"Conv": 1000.0, "Relu": 100.0})
        fresh = load_corpus([zoo / "a"]).models
        rows = brick_contributions(fresh, 1, store=bare, system_id=sid, config_key=key)
    assert sorted(r["op_types"][0] for r in rows) == ["Conv", "Relu"]
    assert not fresh[0].layers.is_materialized


# ------------------------------------------------------------------ attribution (issue: per-model accuracy)


@pytest.fixture(scope="module")
def attributed(tmp_path_factory):
    """Two tiny models evaluated on their runtime graphs with --attribution, then
    without it, then with it again, all in one store."""
    from dlbricks.loading.runtime_graph import runtime_models

    root = tmp_path_factory.mktemp("attribution")
    sources = [load(chain_model(3), name="chain"), load(diamond_model(), name="diamond")]
    models = runtime_models(sources, config=FAST)
    kw = {"config": FAST, "n_boot": 20, "e2e_models": sources}
    with Store(root / "s.sqlite") as store:
        first = evaluate(models, [1], store=store, attribution=True, **kw)
        counts = (store.count(kind="brick"), store.count(kind="model"))
        plain = evaluate(models, [1], store=store, **kw)
        again = evaluate(models, [1], store=store, attribution=True, **kw)
        counts_after = (store.count(kind="brick"), store.count(kind="model"))
    return {"store": root / "s.sqlite", "sources": sources, "models": models, "first": first, "plain": plain,
            "again": again, "counts": counts, "counts_after": counts_after}


def test_attribution_ends_at_the_normal_evaluation(attributed):
    att = attributed["first"]["attribution"]
    assert att["G"] == 1 and att["steps"] == ["baseline", "call_overhead", "runtime_graph", "cache_state"]
    assert "attribution" not in attributed["plain"]
    plain = {m["name"]: m["per_g"]["1"]["sequential"]["normalized"] for m in attributed["plain"]["models"]}
    assert [m["name"] for m in att["models"]] == ["chain", "diamond"]
    for m in att["models"]:
        assert len(m["normalized"]) == 4
        assert m["normalized"][-1] == pytest.approx(plain[m["name"]], rel=1e-12)
        # Each step's change, and together the whole way from the baseline.
        assert sum(m["explained"].values()) == pytest.approx(m["normalized"][-1] - m["normalized"][0])
    # The runtime graph fuses chain's Conv+Relu: its bricks differ from the source's.
    chain = att["models"][0]
    assert chain["latency_s"][2] != chain["latency_s"][1]


def test_attribution_call_overhead_step_is_the_calibrated_correction(attributed):
    from dataclasses import replace

    from dlbricks.timing.calibration import call_overhead

    warm_key = replace(FAST, cache_state="warm").key()
    att = attributed["first"]["attribution"]
    assert att["config_key"] == warm_key != FAST.key()
    sid = fingerprint_id(system_fingerprint())
    with Store(attributed["store"], readonly=True) as store:
        calibrated = call_overhead(store, sid, warm_key)
        assert calibrated is not None and att["call_overhead_ns"] == calibrated.ns
        assert calibrated.by_round  # each brick corrected in its own rounds, as the evaluation does
        kw = {"store": store, "system_id": sid, "config_key": warm_key, "modes": ("sequential",), "n_boot": 10}
        without = reconstruct(attributed["sources"], 1, **kw)
        with_ = reconstruct(attributed["sources"], 1, call_overhead=calibrated, **kw)
    for m, a, b in zip(att["models"], without, with_):
        expected = (b.latency_s - a.latency_s) / m["e2e_same_rounds_s"]
        assert m["normalized"][1] - m["normalized"][0] == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert m["explained"]["call_overhead"] == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert m["normalized"][0] == pytest.approx(a.latency_s / m["e2e_same_rounds_s"], rel=1e-12)


def test_attribution_rerun_with_the_same_store_measures_nothing_new(attributed):
    first, again = attributed["first"], attributed["again"]
    assert first["attribution"]["reuse"]["bricks_measured"] > 0  # the warm bricks, the first time
    reuse = again["attribution"]["reuse"]
    assert reuse["bricks_measured"] == 0 and reuse["bricks_reused"] == reuse["bricks_total"] > 0
    assert again["reuse"]["bricks_measured"] == 0 and again["reuse"]["models_measured"] == 0
    assert attributed["counts_after"] == attributed["counts"]
    for a, b in zip(first["attribution"]["models"], again["attribution"]["models"]):
        assert a["latency_s"][:3] == b["latency_s"][:3]


def test_attribution_steps_share_one_end_to_end_latency(attributed):
    from dlbricks.bricks import model_digest
    from dlbricks.versions import model_digest_version

    ev = attributed["first"]
    att = ev["attribution"]
    G = str(att["G"])
    for row, m in zip(ev["models"], att["models"]):
        assert m["e2e_s"] == row["e2e_s"]
        # The evaluation's own reference: the model in the rounds its bricks were measured.
        assert m["e2e_same_rounds_s"] == row["per_g"][G]["e2e_same_rounds_s"]
        assert m["normalized"] == pytest.approx([x / m["e2e_same_rounds_s"] for x in m["latency_s"]], rel=1e-12)
        assert m["normalized"][-1] == pytest.approx(row["per_g"][G]["sequential"]["normalized"], rel=1e-12)
    # Whole models were timed once, under the evaluation's own configuration, never per variant.
    sid = fingerprint_id(system_fingerprint())
    with Store(attributed["store"], readonly=True) as store:
        assert store.count(kind="model") == 2
        for s in attributed["sources"]:
            assert store.get_result("model", model_digest(s), model_digest_version(), sid, att["config_key"]) is None


def test_compute_bound_bricks_are_those_doing_much_arithmetic_per_weight_byte():
    from dlbricks.pipeline import compute_bound

    def model(rows: int) -> onnx.ModelProto:
        # A projection of `rows` tokens, then a Relu: 2 * rows operations per 4-byte weight.
        w = numpy_helper.from_array(np.zeros((64, 64), np.float32), "w")
        g = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])], "proj",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows, 64])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, rows, 64])], [w])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])

    tokens, one_row = load(model(128)), load(model(1))
    assert compute_bound(tokens, [0]) and compute_bound(tokens, [0, 1])  # 64 operations per byte
    assert not compute_bound(one_row, [0]) and not compute_bound(one_row, [0, 1])  # 0.5: a batch-1 layer
    assert not compute_bound(tokens, [1])  # no weights: the size rule decides
    assert not compute_bound(object(), [0])  # no layer types (a Ray sketch)
