"""What a user sees after a run: precision warnings, the tables of bench/construct/evaluate,
schema versions, and the typed evaluation result.

Stores are filled with synthetic results shaped like the measurement engine's (rounds,
standard error, stop reason), so that nothing here needs timing to be fast or stable.
"""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
from test_pipeline import chain_model, diamond_model

from dlbricks.cli import build_parser, main
from dlbricks.commands._common import runner_config
from dlbricks.corpus import Corpus
from dlbricks.loading import load
from dlbricks.store import Store
from dlbricks.timing import Measurement, summarize
from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint
from dlbricks.versions import brick_digest_version, model_digest_version

# Engine options kept short, and no calibration probes to measure; the stores these
# tests fill hold results of the models' source-graph bricks.
CLI = ["--no-pin", "--no-call-overhead", "--min-rounds", "3", "--max-rounds", "4", "--graph", "source"]


def _config(argv: list[str] = CLI):
    return runner_config(build_parser("bench").parse_args(["x", *argv]))


def engine_result(median_ns: float, se_ns: float, *, rounds: int = 10, stop: str = "converged",
                  round_medians: list[float] | None = None, engine_run: str = "",
                  common_se_factor: float = 1.0) -> Measurement:
    """A result as the engine stores it: round medians around ``median_ns`` whose spread
    gives ``se_ns``; the interval the engine's t rule gives. With ``round_medians``,
    those, numbered 1, 2, ... in the engine run ``engine_run``."""
    rng = np.random.default_rng(int(median_ns) % 997)
    times = np.rint(median_ns + rng.normal(0.0, se_ns, 50)).astype(np.int64)
    stats = summarize(times)
    from dataclasses import replace

    from scipy.stats import t

    half = float(t.ppf(0.975, rounds - 1)) * se_ns
    stats = replace(stats, median=median_ns, ci_low=median_ns - half, ci_high=median_ns + half, drift=0.01)
    return Measurement(
        times_ns=times, stats=stats, config=_config(), warmup_iters=1, stop_reason=stop, setup_time_s=0.01,
        wall_time_s=0.2, denormal_input_fraction=0.0, denormal_output_fraction=0.0, denormal_fraction=0.0,
        denormals_as_zero=True, denormals_flushed=True, ort_version="test", rounds=rounds,
        round_medians_ns=round_medians or [median_ns] * rounds, median_se_ns=se_ns, common_se_factor=common_se_factor,
        round_nos=list(range(1, len(round_medians) + 1)) if round_medians else [], engine_run=engine_run,
    )


def fill(store: Store, models: list, G: int, *, median_of: dict[str, float], se_rel: float = 0.001,
         wide: dict[str, float] | None = None, stopped: set[str] = frozenset(), e2e: dict[str, float] | None = None,
         e2e_se_rel: float = 0.001, common_se_factor: float = 1.0, round_medians: bool = False,
         engine_run: str = "") -> dict[str, str]:
    """Store a result for every unique brick at ``G`` (median: the sum of its layers' op
    medians) and, with ``e2e``, each model end to end; ``wide`` gives some op types a
    larger relative standard error, ``stopped`` makes their results stop at max rounds;
    ``common_se_factor`` is every brick result's; ``round_medians``: brick results have
    numbered rounds of the engine run ``engine_run``. Returns op types joined by "+" -> digest."""
    from dlbricks.bricks import model_digest

    config = _config()
    store.put_system(system_fingerprint())
    store.put_config(config)
    sid = fingerprint_id(system_fingerprint())
    sp = Corpus(models).split(G)
    out = {}
    for u in range(sp.n_unique):
        m, members = sp.first_occurrence(u)
        ops = [models[m].layers[int(i)].op_type for i in members]
        med = sum(median_of[o] for o in ops)
        rel = max((wide or {}).get(o, se_rel) for o in ops)
        stop = "max_rounds" if set(ops) & set(stopped) else "converged"
        d = bytes(sp.unique_digests[u]).hex()
        store.put_brick(d, brick_digest_version(), g=G, op_types=ops, meta={"source_model": models[m].name})
        store.put_result("brick", d, brick_digest_version(), sid, config, engine_result(
            med, rel * med, stop=stop, common_se_factor=common_se_factor,
            round_medians=[med] * 10 if round_medians else None, engine_run=engine_run))
        out["+".join(ops)] = d
    for model in models if e2e else ():
        d = model_digest(model)
        store.put_model(d, model_digest_version(), name=model.name, meta={"path": model.path})
        med = e2e[model.name]
        store.put_result("model", d, model_digest_version(), sid, config, engine_result(med, e2e_se_rel * med))
    return out


@pytest.fixture
def zoo(tmp_path):
    a, b = tmp_path / "chain.onnx", tmp_path / "diamond.onnx"
    onnx.save(chain_model(3), str(a))
    onnx.save(diamond_model(), str(b))
    return [a, b]


MEDIANS = {"Conv": 20_000.0, "Relu": 2_000.0, "Sigmoid": 3_000.0, "Tanh": 3_000.0, "Add": 1_000.0}


# ------------------------------------------------------------------------- warnings


def test_bench_warns_about_unconverged_and_imprecise_results_and_names_the_worst(zoo, tmp_path, capsys):
    store_path = tmp_path / "s.sqlite"
    models = [load(p) for p in zoo]
    with Store(store_path) as st:
        # Every brick of the chain is stored; its Conv is 10x less precise than the rest,
        # and the diamond's Sigmoid stopped at the round limit.
        fill(st, models, 1, median_of=MEDIANS, wide={"Conv": 0.03}, stopped={"Sigmoid"})
    code = main(["bench", *map(str, zoo), "-G", "1", "--store", str(store_path), "--json", *CLI])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = json.loads(captured.out)
    assert out["bricks_reused"] == out["bricks_total"] and out["bricks_measured"] == 0  # nothing new measured...
    err = captured.err
    # ...and still the reused results are judged, by what they do to each model's precision.
    assert "1 brick result(s) stopped at the round limit" in err
    assert "1 model(s) short of the +/-2.0% precision" in err
    line = next(x for x in err.splitlines() if "chain (G=1)" in x)
    assert "of its variance from brick Conv" in line and "(x3)" in line
    assert "--remeasure-unstable" in err
    check = out["precision_check"]
    assert check["models_flagged"] == 1 and check["results_unconverged"] == 1
    assert check["flagged"][0]["model"] == "chain" and check["flagged"][0]["rel_halfwidth"] > 0.02
    assert check["flagged"][0]["contributors"][0]["share"] > 0.9


def test_a_fixed_cv_flags_nothing_that_keeps_every_model_precise(zoo, tmp_path, capsys):
    store_path = tmp_path / "s.sqlite"
    models = [load(p) for p in zoo]
    with Store(store_path) as st:
        # Microsecond bricks varying by 30% from run to run, but converged and light in
        # the models they feed.
        fill(st, models, 1, median_of={**MEDIANS, "Relu": 50.0}, wide={"Relu": 0.3})
        assert all(r.stats["cv"] > 0.05 for r in st.results(with_times=False) if r.stats["median"] < 100)
    assert main(["bench", *map(str, zoo), "-G", "1", "--store", str(store_path), *CLI]) == 0
    assert "warning" not in capsys.readouterr().err


def test_remeasure_unstable_measures_exactly_the_flagged_results_again(zoo, tmp_path, capsys):
    store_path = tmp_path / "s.sqlite"
    models = [load(p) for p in zoo]
    with Store(store_path) as st:
        digests = fill(st, models, 1, median_of=MEDIANS, wide={"Conv": 0.03}, stopped={"Sigmoid"})
        before = {r.digest: r.created_at for r in st.results(with_times=False)}
    code = main(["bench", *map(str, zoo), "-G", "1", "--store", str(store_path), "--json", "--remeasure-unstable",
                 *CLI])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = json.loads(captured.out)
    assert "re-measuring 2 stored result(s)" in captured.err
    assert out["bricks_measured"] == 2 and out["bricks_reused"] == out["bricks_total"] - 2
    with Store(store_path, readonly=True) as st:
        after = {r.digest: r.created_at for r in st.results(with_times=False)}
    changed = {d for d in before if after[d] != before[d]}
    assert changed == {digests["Conv"], digests["Sigmoid"]}


# ------------------------------------------------------------------------- construct


def test_construct_prints_the_engine_interval_the_end_to_end_latency_and_the_error(zoo, tmp_path, capsys):
    store_path = tmp_path / "s.sqlite"
    chain = load(zoo[0])
    se = 400.0
    with Store(store_path) as st:
        # G=3 covers the chain's six layers in two bricks (Conv, Relu, Conv), (Relu, Conv, Relu).
        fill(st, [chain], 3, median_of=MEDIANS, se_rel=se / 42_000.0, e2e={"chain": 60_000.0})
    code = main(["construct", str(zoo[0]), "-G", "3", "--store", str(store_path), "--bootstrap", "4000", "--json",
                 *CLI])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    (p,) = json.loads(captured.out)["predictions"]
    assert json.loads(captured.out)["schema_version"] == 1
    # Two bricks of 42 and 24 us, known to `se` and to `se` scaled; t quantile with 9 degrees of freedom.
    se1, se2 = se, se * 24_000.0 / 42_000.0
    from scipy.stats import t

    half = t.ppf(0.975, 9) * math.hypot(se1, se2)
    assert p["latency_s"] == pytest.approx(66e-6)
    assert (p["ci_high_s"] - p["ci_low_s"]) / 2 == pytest.approx(half * 1e-9, rel=0.15)
    assert p["e2e_s"] == pytest.approx(60e-6) and p["error"] == pytest.approx(66 / 60 - 1)
    assert p["G"] == 3 and p["mode"] == "sequential" and p["path"] == str(zoo[0]) and not p["flagged"]
    code = main(["construct", str(zoo[0]), "-G", "3", "--store", str(store_path), "--bootstrap", "4000", *CLI])
    text = capsys.readouterr().out
    row = next(x for x in text.splitlines() if "chain" in x)
    assert f"[{p['ci_low_s'] * 1e6:.3f}, {p['ci_high_s'] * 1e6:.3f}]" in row  # the same interval, in us
    assert "66.000" in row and "60.000" in row and "+10.0%" in row and "sequential" in row
    assert "end-to-end us" in text and "error" in text


def test_construct_compares_as_evaluate_does_with_the_model_in_its_bricks_rounds(zoo, tmp_path, capsys):
    # The bricks closed after 5 rounds; the model ran 20, and the machine slowed by 40%
    # after the fifth: its whole estimate (70 us) is not what the bricks met (50 us).
    store_path = tmp_path / "s.sqlite"
    chain = load(zoo[0])
    config = _config()
    sid = fingerprint_id(system_fingerprint())
    with Store(store_path) as st:
        st.put_system(system_fingerprint())
        st.put_config(config)
        sp = Corpus([chain]).split(3)
        for u in range(sp.n_unique):
            m, members = sp.first_occurrence(u)
            med = sum(MEDIANS[chain.layers[int(i)].op_type] for i in members)
            d = bytes(sp.unique_digests[u]).hex()
            st.put_brick(d, brick_digest_version(), g=3, op_types=[], meta={})
            st.put_result("brick", d, brick_digest_version(), sid, config,
                          engine_result(med, 0.001 * med, rounds=5, round_medians=[med] * 5, engine_run="run1"))
        from dlbricks.bricks import model_digest

        st.put_model(model_digest(chain), model_digest_version(), name=chain.name, meta={"path": chain.path})
        whole = engine_result(70_000.0, 700.0, rounds=20, round_medians=[50_000.0] * 5 + [70_000.0] * 15,
                              engine_run="run1")
        st.put_result("model", model_digest(chain), model_digest_version(), sid, config, whole)
    assert main(["construct", str(zoo[0]), "-G", "3", "--store", str(store_path), "--json", *CLI]) == 0
    (p,) = json.loads(capsys.readouterr().out)["predictions"]
    assert p["e2e_s"] == pytest.approx(70e-6) and p["e2e_same_rounds_s"] == pytest.approx(50e-6)
    assert p["normalized"] == pytest.approx(66 / 50) and p["error"] == pytest.approx(66 / 50 - 1)
    assert main(["evaluate", str(zoo[0]), "-G", "3", "--store", str(store_path), "--no-measure", "--json", *CLI]) == 0
    (model,) = json.loads(capsys.readouterr().out)["models"]
    assert model["per_g"]["3"]["sequential"]["normalized"] == pytest.approx(p["normalized"], rel=1e-12)
    assert main(["construct", str(zoo[0]), "-G", "3", "--store", str(store_path), *CLI]) == 0
    text = capsys.readouterr().out
    assert "+32.0%" in text and "in the rounds its bricks were measured in" in text


def test_construct_flags_a_model_whose_interval_is_wider_than_the_precision(zoo, tmp_path, capsys):
    store_path = tmp_path / "s.sqlite"
    chain = load(zoo[0])
    with Store(store_path) as st:
        fill(st, [chain], 1, median_of=MEDIANS, wide={"Conv": 0.05})
    assert main(["construct", str(zoo[0]), "-G", "1", "--store", str(store_path), "--json", *CLI]) == 0
    captured = capsys.readouterr()
    (p,) = json.loads(captured.out)["predictions"]
    assert p["flagged"] and p["flags"][0].startswith("G=1: +/-")
    assert "short of the +/-2.0% precision" in captured.err and "dlbricks bench --remeasure-unstable" in captured.err


# ------------------------------------------------------------------------- bench --e2e


def test_bench_e2e_prints_each_models_latency_and_its_json_has_a_schema_version(zoo, tmp_path, capsys):
    store_path = tmp_path / "s.sqlite"
    models = [load(p) for p in zoo]
    with Store(store_path) as st:
        fill(st, models, 1, median_of=MEDIANS, e2e={"chain": 60_000.0, "diamond": 8_000.0}, e2e_se_rel=0.02)
    assert main(["bench", *map(str, zoo), "-G", "1", "--e2e", "--store", str(store_path), *CLI]) == 0
    text = capsys.readouterr().out
    head = next(x for x in text.splitlines() if "median" in x)
    assert "p90" in head and "p99" in head and "95% interval" in head
    rows = {x.split()[1]: x for x in text.splitlines() if x[2:].startswith(("chain", "diamond"))}
    assert "60.000" in rows["chain"] and "8.000" in rows["diamond"]
    # +/-2% standard error: the interval is about +/-4.5%, wider than the precision.
    assert rows["chain"].startswith("!") and "end to end: +/-" in rows["chain"]
    assert main(["bench", *map(str, zoo), "-G", "1", "--e2e", "--store", str(store_path), "--json", *CLI]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema_version"] == 1
    by_name = {m["name"]: m for m in out["models"]}
    assert by_name["chain"]["median_s"] == pytest.approx(60e-6) and by_name["chain"]["path"] == str(zoo[0])
    assert {"p90_s", "p99_s", "ci_low_s", "ci_high_s", "rounds", "stop_reason", "flagged"} <= set(by_name["diamond"])


# ------------------------------------------------------------------------- evaluate


def test_evaluate_returns_a_typed_result_that_still_reads_as_the_json(zoo, tmp_path):
    from dlbricks.evaluation import Evaluation, GAccuracy, evaluate

    store_path = tmp_path / "s.sqlite"
    models = [load(p) for p in zoo]
    with Store(store_path) as st:
        fill(st, models, 1, median_of=MEDIANS, e2e={"chain": 60_000.0, "diamond": 8_000.0})
        result = evaluate(models, [1], store=st, config=_config(), measure_missing=False, n_boot=50)
    assert isinstance(result, Evaluation)
    (g1,) = result.per_g
    assert isinstance(g1, GAccuracy) and g1.G == 1 and result.accuracy(1) == g1
    assert g1.within_10pct == result["per_g"][0]["within_10pct"]
    chain = result.models[0]
    assert chain.name == "chain" and chain.path == str(zoo[0]) and chain.e2e_s == pytest.approx(60e-6)
    assert chain.normalized(1) == pytest.approx(66_000 / 60_000) and math.isnan(chain.normalized(2))
    doc = result.to_dict()
    json.dumps(doc)
    assert doc["per_g"][0]["G"] == 1 and {"within_5pct", "within_10pct", "rmspe", "spearman", "wallclock_speedup",
                                          "speedup", "bricks_wall_s", "e2e_wall_s"} <= set(doc["per_g"][0])
    assert "call_overhead_ns" in doc and doc["reuse"]["models_reused"] == 2
    assert doc["models"][0]["flagged"] is False and doc["precision_check"]["models_flagged"] == 0
    doc["models"].clear()  # a copy: the result is unchanged
    assert len(result["models"]) == 2
    with pytest.raises(KeyError, match="G=3"):
        result.accuracy(3)


def test_evaluate_to_dataframe_has_a_row_per_model_g_and_mode(zoo, tmp_path):
    pd = pytest.importorskip("pandas")
    from dlbricks.evaluation import evaluate

    models = [load(p) for p in zoo]
    with Store(tmp_path / "s.sqlite") as st:
        fill(st, models, 1, median_of=MEDIANS, e2e={"chain": 60_000.0, "diamond": 8_000.0})
        df = evaluate(models, [1], store=st, config=_config(), measure_missing=False, n_boot=50).to_dataframe()
    assert isinstance(df, pd.DataFrame) and len(df) == 4
    assert set(df["mode"]) == {"sequential", "parallel"} and set(df["model"]) == {"chain", "diamond"}


def test_results_from_before_the_engine_are_judged_with_their_drift(zoo, tmp_path):
    from dataclasses import replace

    from test_pipeline import fake_measurement

    from dlbricks.quality import assess, result_se_ns

    chain = load(zoo[0])
    sp = Corpus([chain]).split(1)
    sid = fingerprint_id(system_fingerprint())
    config = _config()

    def store(drift: float) -> Store:
        st = Store(tmp_path / f"legacy-{drift}.sqlite")
        st.put_system(system_fingerprint())
        st.put_config(config)
        for u in range(sp.n_unique):
            # One contiguous run each (rounds 0): a +/-0.5% interval of its iterations...
            m = fake_measurement(np.full(101, 10_000, dtype=np.int64))
            m.stats = replace(m.stats, ci_low=9_950.0, ci_high=10_050.0, drift=drift)
            st.put_result("brick", bytes(sp.unique_digests[u]).hex(), brick_digest_version(), sid, config, m)
        return st

    with store(0.0) as st:
        rec = next(st.results(with_times=False))
        assert result_se_ns(rec) == (pytest.approx(50 / 1.96, rel=1e-3), math.inf)
        assert not assess([chain], [1], store=st, system_id=sid, config_key=config.key(), precision=0.02).flagged
    # ...that the blocks of the run drifted 40% apart: not a 95% interval of anything.
    with store(0.4) as st:
        check = assess([chain], [1], store=st, system_id=sid, config_key=config.key(), precision=0.02)
        (flagged,) = check.flagged
        assert flagged.model == "chain" and flagged.rel_halfwidth > 0.02 and not check.unconverged


def test_open_cores_default_to_the_engines_choice_unless_timing_cores_are_named():
    from dlbricks.commands._common import UsageError
    from dlbricks.cpuset import usable_cpus

    cpu = usable_cpus()[0]
    assert _config([]).open_cores is None
    assert _config(["--cores", str(cpu)]).open_cores == ()
    assert _config(["--open-cores", "none"]).open_cores == ()
    assert _config(["--cores", str(cpu), "--open-cores", str(cpu)]).open_cores == (cpu,)
    with pytest.raises(UsageError, match="--open-cores"):
        _config(["--open-cores", "x"])
    with pytest.raises(UsageError, match="--open-cores '4096'"):
        _config(["--open-cores", "4096"])


def test_a_brick_results_common_se_factor_widens_its_models_interval_and_not_its_own(tmp_path):
    from dlbricks.quality import assess
    from dlbricks.reconstruct import predict

    model = load(chain_model(4), name="chain")
    widths, halves, own = [], [], []
    for factor in (1.0, 3.0):
        with Store(tmp_path / f"s{factor}.sqlite") as st:
            fill(st, [model], 1, median_of=MEDIANS, se_rel=0.01, common_se_factor=factor)
            kw = dict(store=st, system_id=fingerprint_id(system_fingerprint()), config_key=_config().key())
            (p,), = predict([model], 1, modes=("sequential",), n_boot=4000, **kw)
            widths.append(p.ci_high_s - p.ci_low_s)
            halves.append(assess([model], [1], precision=0.02, **kw).models[0].rel_halfwidth)
            rows = [row for _, row in st.rows(kind="brick")]
            own.append([row["ci_high_ns"] - row["median_ns"] for row in rows])
            assert all(row["common_se_factor"] == factor for row in rows)
    assert widths[1] / widths[0] == pytest.approx(3.0, rel=0.15)
    assert halves[1] / halves[0] == pytest.approx(3.0, rel=0.05)
    assert own[0] == own[1]  # each brick's interval is its own


def test_the_call_overheads_error_widens_a_models_interval_once_per_brick_less_one(tmp_path):
    from dlbricks.reconstruct import predict
    from dlbricks.timing.calibration import CallOverhead

    short, long = load(chain_model(1), name="short"), load(chain_model(8), name="long")
    with Store(tmp_path / "s.sqlite") as st:
        fill(st, [short, long], 1, median_of=MEDIANS, se_rel=1e-6)
        kw = dict(store=st, system_id=fingerprint_id(system_fingerprint()), config_key=_config().key(),
                  modes=("sequential",), n_boot=4000)
        exact = [p[0] for p in predict([short, long], 1, call_overhead=CallOverhead(1000.0, 0.0), **kw)]
        se = 100.0
        vague = [p[0] for p in predict([short, long], 1, call_overhead=CallOverhead(1000.0, se), **kw)]
    for a, b in zip(exact, vague):
        assert a.latency_s == b.latency_s  # the point estimate keeps the calibrated cost
    for p, n_bricks in zip(vague, (2, 16)):
        # The model's latency moves by -(bricks - 1) x the cost's error: a 95% interval
        # about 2 x 1.96 x that wide (bricks' own errors are negligible here).
        width_ns = (p.ci_high_s - p.ci_low_s) * 1e9
        assert width_ns == pytest.approx(2 * 1.96 * (n_bricks - 1) * se, rel=0.1)
