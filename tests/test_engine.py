"""The measurement engine: allocation, precision, interleaving, isolation.

Most tests drive the real scheduler with an in-process worker that answers the
engine's requests from synthetic timing streams (known true latencies, known noise,
a machine that can slow down); the last ones run real worker processes on real
ONNX models.
"""

from __future__ import annotations

import collections
import math
import statistics
import time

import numpy as np
import pytest
from onnx import TensorProto, helper

from dlbricks.timing import RunnerConfig
from dlbricks.timing.engine import EngineItem, EngineProgress, Group, WorkerDied, measure, runs_per_burst, t_quantile
from dlbricks.timing.runner import Failure, Measurement


class SyntheticWorker:
    """Answers the worker protocol from item specs ``{"ns": true latency, "cv": noise}``.

    ``speed(round_no)`` scales every run of that round (a machine slowing down);
    ``crash_on`` names an item whose first round kills the worker. With ``phase``
    (``rng -> factor``), every burst meets a speed of its own, drawn afresh, which its
    runs follow as ``factor ** spec["slope"]`` (a sum of parts ``[(ns, slope), ...]``
    for ``spec["parts"]``) and the speed probe, read before it, exactly; a run of
    ``spec["span"]`` phases follows their mean, the probe reading one of them;
    ``spec["probe_offset"]`` scales the probe's reading beside the session in every
    round (a session that leaves the core slow for the probe after it).
    """

    def __init__(self, config, start_timeout_s, *, rng, speed=lambda r: 1.0, crash_on=(), counts=None, phase=None):
        self.rng, self.speed, self.crash_on, self.phase = rng, speed, set(crash_on), phase
        self.specs, self.slots, self.next_slot, self.held, self.round_no = {}, {}, 0, 0, 0
        self.spool_bytes, self._held = 0, 0  # (the engine writes .held from the replies)
        self.live: set[str] = set()  # sessions open now, and the most open at once
        self.most_live = 0
        self.counts = counts if counts is not None else {}
        self.bursts: dict[str, list[int]] = {}  # runs per round, per item
        self._replies = collections.deque()

    def send(self, msg):
        if msg is None:
            return
        op = msg[0]
        if op == "open":
            _, item_id, spec, _, _, slot = msg
            if spec.get("crash_on_open"):
                self._replies.append(WorkerDied(slot, "crash", "crashed (killed by SIGABRT)"))
                return
            if spec.get("bad"):
                self._replies.append(("failed", item_id, "cannot load the model: bad"))
                return
            self.specs[item_id] = (spec, slot)
            self.live.add(item_id)
            self.most_live = max(self.most_live, len(self.live))
            self._held += spec.get("held", 0)  # the memory the session holds
            self._replies.append(("opened", item_id, {"slot": slot, "setup_s": 0.001, "run_s": spec["ns"] * 1e-9,
                                                      "held": self._held}))
        elif op == "round":
            out, probes = {}, {}
            read_cache = len(msg) > 2 and msg[2]
            f = self.speed(self.round_no)
            for item_id, k, _ in msg[1]:
                spec, slot = self.specs[item_id]
                if item_id in self.crash_on:
                    self._replies.append(WorkerDied(slot, "crash", "crashed (killed by SIGSEGV)"))
                    return
                # "burst_cv": a factor shared by the runs of one burst (the machine's
                # state in it), drawn afresh for every burst.
                noise = self.rng.lognormal(0.0, spec["cv"], size=k)
                if spec.get("burst_cv"):
                    noise *= self.rng.lognormal(0.0, spec["burst_cv"])
                if self.phase is None:
                    out[item_id] = [int(spec["ns"] * f * x) for x in noise]
                else:
                    p = self.phase(self.rng)
                    probes[item_id] = int(1e4 * p * spec.get("probe_offset", 1.0))
                    parts = spec.get("parts", [(spec["ns"], spec.get("slope", 1.0))])
                    # "span": a run long enough to meet that many phases, the probe's one of them.
                    ps = [p] + [self.phase(self.rng) for _ in range(spec.get("span", 1) - 1)]
                    out[item_id] = [int(sum(ns * sum(q ** b for q in ps) / len(ps) for ns, b in parts) * f * x)
                                    for x in noise]
                self.counts[item_id] = self.counts.get(item_id, 0) + k
                self.bursts.setdefault(item_id, []).append(k)
            self.round_no += 1
            wall = sum(sum(v) for v in out.values()) * 1e-9
            if read_cache:  # the shared-cache probe's reading: 2.00, 2.01, ... by round
                self._replies.append(("round", out, wall, probes, 2.0 + 0.01 * (self.round_no - 1)))
            else:
                self._replies.append(("round", out, wall, probes) if probes else ("round", out, wall))
        elif op == "close":
            self.live.difference_update(msg[1])
            self._held -= sum(self.specs[i][0].get("held", 0) for i in msg[1])
            self._replies.append(("closed", self._held))

    def answered(self, slot):
        pass

    def reply(self, timeout_s, doing):
        r = self._replies.popleft()
        if isinstance(r, Exception):
            raise r
        return r

    def stop(self):
        pass

    def kill(self):
        pass


def run_synthetic(specs, groups, *, seed=0, speed=lambda r: 1.0, crash_on=(), references=(), phase=None, **cfg):
    rng = np.random.default_rng(seed)
    counts: dict[str, int] = {}
    results: dict[str, Measurement | Failure] = {}
    # Synthetic rounds take microseconds: spanning seconds would mean thousands of them.
    cfg.setdefault("min_span_s", 0.0)
    config = RunnerConfig(**cfg)
    summary = measure(
        [EngineItem(i, spec, reference=i in references) for i, spec in specs.items()],
        [Group(name, terms) for name, terms in groups.items()],
        config,
        on_result=lambda it, r: results.__setitem__(it.id, r),
        worker_factory=lambda c, t: SyntheticWorker(c, t, rng=rng, speed=speed, crash_on=crash_on, counts=counts,
                                                    phase=phase),
    )
    return results, counts, summary


def measure_with_progress(specs, groups, config, *, seed, kinds=None):
    """Measure synthetic items, recording each progress report with the number of
    rounds run by then, and each round's wall time (s): what an ETA is checked against.
    ``kinds``: item id -> ``EngineItem.kind``."""
    rng = np.random.default_rng(seed)
    walls: list[float] = []
    reports: list[tuple[EngineProgress, int]] = []

    class Timed(SyntheticWorker):
        def reply(self, timeout_s, doing):
            r = super().reply(timeout_s, doing)
            if isinstance(r, tuple) and r[0] == "round":
                walls.append(r[2])
            return r

    measure([EngineItem(i, s, kind=(kinds or {}).get(i, "")) for i, s in specs.items()], groups, config,
            on_result=lambda it, r: None,
            on_progress=lambda p: reports.append((p, len(walls))), worker_factory=lambda c, t: Timed(c, t, rng=rng))
    return reports, walls


def group_estimate(results, terms):
    point = sum(c * results[i].stats.median for i, c in terms.items())
    se = math.sqrt(sum((c * results[i].sum_se_ns) ** 2 for i, c in terms.items()))
    return point, se


def test_t_quantile_matches_the_normal_limit_and_small_samples():
    assert t_quantile(math.inf) == pytest.approx(1.959964, abs=1e-5)
    assert t_quantile(4) == pytest.approx(2.776445, abs=1e-5)


def test_a_brick_with_more_occurrences_gets_more_runs():
    specs = {"a": {"ns": 1e5, "cv": 0.05}, "b": {"ns": 1e5, "cv": 0.05}}
    _, counts, _ = run_synthetic(specs, {"m": {"a": 20.0, "b": 1.0}}, precision=0.01)
    assert counts["a"] > 3 * counts["b"]


def test_a_brick_with_more_variance_gets_more_runs():
    specs = {"a": {"ns": 1e5, "cv": 0.20}, "b": {"ns": 1e5, "cv": 0.01}}
    _, counts, _ = run_synthetic(specs, {"m": {"a": 1.0, "b": 1.0}}, precision=0.01)
    assert counts["a"] > 3 * counts["b"]


def test_a_negligible_brick_gets_few_runs():
    specs = {"big": {"ns": 1e7, "cv": 0.05}, "tiny": {"ns": 1e4, "cv": 0.05}}
    _, counts, _ = run_synthetic(specs, {"m": {"big": 1.0, "tiny": 1.0}}, precision=0.005)
    # One run a round, to stay interleaved with the rest: well under 1% of the time.
    assert counts["tiny"] * 1e4 < 0.01 * counts["big"] * 1e7


def test_runs_per_burst_is_cochrans_optimum_and_unbounded_without_variance_between_bursts():
    assert runs_per_burst(0.0, 0.01, 1e-5, 1e-5) == math.inf
    assert runs_per_burst(0.01, 0.01, 1e-5, 1e-5) == pytest.approx(1.0)
    assert runs_per_burst(0.01, 0.04, 1e-5, 1e-5) == pytest.approx(2.0)
    assert runs_per_burst(0.01, 0.01, 1e-6, 1e-4) == pytest.approx(10.0)
    # The optimum: variance times cost is least there.
    def cost(k, between=0.02, within=0.05, run_s=2e-6, fixed_s=3e-5):
        return (between + within / k) * (fixed_s + k * run_s)
    best = runs_per_burst(0.02, 0.05, 2e-6, 3e-5)
    assert cost(best) <= min(cost(best * 0.7), cost(best * 1.4))


def test_bursts_are_short_when_the_machine_changes_between_them_and_intervals_stay_honest():
    # The same brick, its runs varying by 5% within a burst, with and without a 20%
    # change from burst to burst: more runs per burst only pay for the former.
    def bursts(spec, seed):
        workers = []
        results: dict = {}

        def factory(c, t):
            workers.append(SyntheticWorker(c, t, rng=np.random.default_rng(seed)))
            return workers[-1]

        measure([EngineItem("b", spec)], [Group("m", {"b": 1.0})], RunnerConfig(precision=0.002, max_rounds=30, min_span_s=0.0),
                on_result=lambda it, r: results.__setitem__(it.id, r), worker_factory=factory)
        return results["b"], workers[0].bursts["b"]

    _, calm = bursts({"ns": 1e4, "cv": 0.05}, 0)
    assert len(calm) < 30 and max(calm[3:]) >= 100  # converged; bursts as long as the allocation asks
    covered = 0
    for seed in range(8):
        result, noisy = bursts({"ns": 1e4, "cv": 0.05, "burst_cv": 0.2}, seed)
        assert len(noisy) == 30 and np.median(noisy[6:]) <= 5
        covered += abs(result.stats.median - 1e4) <= 1.96 * result.median_se_ns
    assert covered >= 6


def test_model_intervals_meet_the_requested_precision_and_cover_the_truth():
    rng = np.random.default_rng(1)
    specs = {f"b{i}": {"ns": float(rng.uniform(1e4, 1e6)), "cv": float(rng.uniform(0.01, 0.2))} for i in range(40)}
    groups = {f"m{j}": {f"b{i}": float(rng.integers(1, 6)) for i in rng.choice(40, size=12, replace=False)} for j in range(6)}
    covered = total = 0
    for seed in range(10):
        results, _, summary = run_synthetic(specs, groups, seed=seed, precision=0.02)
        assert summary.converged_groups == summary.groups
        for terms in groups.values():
            point, se = group_estimate(results, terms)
            assert 1.96 * se <= 0.02 * point
            # The streams are lognormal: the true median of each is its "ns".
            truth = sum(c * specs[i]["ns"] for i, c in terms.items())
            covered += abs(point - truth) <= 1.96 * se
            total += 1
    assert covered / total >= 0.9


def test_bricks_that_slow_down_together_widen_their_models_interval():
    # Every round's speed is drawn afresh and shared by every session of the round (a
    # shared host's phases), on top of each brick's own small noise. Summed as
    # independent, the bricks' errors would give an interval far narrower than the
    # spread of the reconstruction; the common movement has to be in it.
    specs = {f"b{i}": {"ns": 1e5 * (1 + i % 5), "cv": 0.01} for i in range(20)}
    terms = {i: 1.0 for i in specs}
    covered = total = 0
    for seed in range(12):
        speeds = np.exp(np.random.default_rng(100 + seed).normal(0.0, 0.08, size=200))
        results, _, _ = run_synthetic(specs, {"m": terms}, seed=seed, precision=0.02,
                                      speed=lambda r, s=speeds: float(s[r]))
        point, se = group_estimate(results, terms)
        truth = sum(specs[i]["ns"] for i in terms)  # the speeds' median is 1
        covered += abs(point - truth) <= 1.96 * se
        total += 1
    assert covered / total >= 0.75


def test_common_movement_widens_a_bricks_term_in_the_sum_and_not_its_own_interval():
    # As above: what the bricks of a round share widens each one's term in the model's
    # sum; each brick's own interval is its own rounds' spread, which already holds the
    # shared speed, and still covers that brick's truth.
    specs = {f"b{i}": {"ns": 1e5 * (1 + i % 5), "cv": 0.01} for i in range(20)}
    terms = {i: 1.0 for i in specs}
    covered = total = widened = 0
    for seed in range(6):
        speeds = np.exp(np.random.default_rng(200 + seed).normal(0.0, 0.08, size=200))
        results, _, _ = run_synthetic(specs, {"m": terms}, seed=seed, precision=0.02,
                                      speed=lambda r, s=speeds: float(s[r]))
        for i, r in results.items():
            t = t_quantile(r.rounds - 1)
            assert r.stats.ci_high == pytest.approx(r.stats.median + t * r.median_se_ns)
            assert r.sum_se_ns == pytest.approx(r.median_se_ns * r.common_se_factor)
            assert r.common_se_factor >= 1.0
            widened += r.common_se_factor > 1.5
            covered += abs(r.stats.median - specs[i]["ns"]) <= t * r.median_se_ns
            total += 1
        back = Measurement.from_dict(results["b0"].to_dict())
        assert back.common_se_factor == results["b0"].common_se_factor
    assert widened >= total // 2
    assert covered / total >= 0.85


def test_a_speed_change_mid_run_leaves_normalized_latency_unchanged():
    specs = {"b1": {"ns": 2e5, "cv": 0.03}, "b2": {"ns": 5e5, "cv": 0.03}, "model": {"ns": 7e5, "cv": 0.03}}
    groups = {"recon": {"b1": 1.0, "b2": 1.0}, "e2e": {"model": 1.0}}

    def ratio(speed):
        results, _, _ = run_synthetic(specs, groups, speed=speed, seed=3, min_rounds=8)
        return (results["b1"].stats.median + results["b2"].stats.median) / results["model"].stats.median

    steady = ratio(lambda r: 1.0)
    slowed = ratio(lambda r: 2.0 if 2 <= r < 5 else 1.0)
    assert steady == pytest.approx(1.0, abs=0.03)
    assert slowed == pytest.approx(steady, abs=0.03)


def _two_speeds(rng):
    # A shared core: most bursts at one speed, two in five 1.5x slower (an SMT
    # sibling's vector work), each burst's drawn afresh.
    return 1.5 if rng.random() < 0.4 else 1.0


def test_the_speed_probe_takes_the_cores_speed_out_of_every_session():
    # A compute-bound brick follows the core's speed, a memory-bound one a third as
    # much, and the whole model is their sum. Read as they come, the few round medians
    # of a session land in one speed or the other, and the median with them: the
    # model's latency and its bricks' sum disagree by a quarter, with intervals that
    # say 1%. Brought to the probe's reference speed, they agree.
    specs = {"compute": {"ns": 3e5, "cv": 0.01, "slope": 1.0}, "memory": {"ns": 2e5, "cv": 0.01, "slope": 0.3},
             "model": {"ns": 5e5, "cv": 0.01, "parts": [(3e5, 1.0), (2e5, 0.3)]}}
    groups = {"recon": {"compute": 1.0, "memory": 1.0}, "e2e": {"model": 1.0}}
    ratios: dict[bool, list[float]] = {True: [], False: []}
    for probe in (True, False):
        for seed in range(6):
            results, _, _ = run_synthetic(specs, groups, seed=seed, phase=_two_speeds, speed_probe=probe,
                                          precision=0.01, max_rounds=40)
            recon = results["compute"].stats.median + results["memory"].stats.median
            ratios[probe].append(recon / results["model"].stats.median)
    assert max(abs(r - 1.0) for r in ratios[False]) > 0.1  # the premise
    # The engine plans bursts on the wall-clock cost of its rounds, so which runs a
    # seed draws is not fixed: over many runs of this test one seed in a few dozen
    # lands 2-3% off (its rounds met one speed more often than the reference's mix).
    assert statistics.median(abs(r - 1.0) for r in ratios[True]) < 0.01
    assert max(abs(r - 1.0) for r in ratios[True]) < 0.04
    # Over enough rounds every session meets both speeds, and its own slope is found.
    results, _, _ = run_synthetic(specs, groups, seed=0, phase=_two_speeds, min_rounds=20, speed_probe=True)
    assert results["compute"].speed_slope == pytest.approx(1.0, abs=0.1)
    assert results["memory"].speed_slope == pytest.approx(0.3, abs=0.1)
    # The rounds as read are recoverable from what the result keeps.
    m = results["compute"]
    raw = [a * (p / m.speed_ref_ns) ** m.speed_slope for a, p in zip(m.round_medians_ns, m.round_probes_ns)]
    assert max(raw) / min(raw) > 1.3 and max(m.round_medians_ns) / min(m.round_medians_ns) < 1.1


def test_a_whole_model_whose_run_spans_many_speed_phases_agrees_with_its_bricks():
    # The bricks are short, each burst in one phase of the core's speed, which the probe
    # reads; the whole model's run meets twenty phases and has their mean in it, and
    # the probe beside it reads one of them, so its slope on the probe is small. Brought
    # to the median reading (one of the two speeds), the bricks would be 16% off it;
    # brought to the run's mix of speeds (read over its first rounds: enough sessions
    # and rounds to know it), they match it.
    specs = {f"b{i}": {"ns": 2e4 * (1 + i % 4), "cv": 0.01, "slope": 1.0} for i in range(20)}
    specs["model"] = {"ns": sum(v["ns"] for v in specs.values()), "cv": 0.01, "span": 20}
    groups = {"recon": {i: 1.0 for i in specs if i != "model"}, "e2e": {"model": 1.0}}
    ratios: dict[bool, list[float]] = {True: [], False: []}
    for probe in (True, False):
        for seed in range(4):
            results, _, _ = run_synthetic(specs, groups, seed=seed, phase=_two_speeds, speed_probe=probe,
                                          precision=0.01, min_rounds=20, max_rounds=40)
            recon = sum(results[i].stats.median for i in groups["recon"])
            ratios[probe].append(recon / results["model"].stats.median)
    assert max(abs(r - 1.0) for r in ratios[False]) > 0.1  # the premise: the bricks' medians sit in one phase
    assert max(abs(r - 1.0) for r in ratios[True]) < 0.03


@pytest.mark.parametrize("fit_offsets", [True, False])
def test_long_sessions_that_slow_the_probe_beside_them_are_not_taken_as_run_in_slow_phases(monkeypatch, fit_offsets):
    # Every session follows the core's speed (slope 1), one phase per burst; the probe
    # beside a long one reads 1.35x slow in every round, as after a run of VGG-19 on a
    # 2-core Xeon. Taken as speed, that would bring the long bricks 26% too fast; the
    # offset fitted on run time over the early readings takes it out. The whole model
    # spans many phases and reads as slow beside it.
    from dlbricks.timing import engine

    if not fit_offsets:
        monkeypatch.setattr(engine, "_OFFSET_READINGS", 10**9)  # the premise: no offset curve
    specs = {f"s{i}": {"ns": 2e4 * (1 + i % 3), "cv": 0.01, "slope": 1.0} for i in range(60)}
    specs |= {f"l{i}": {"ns": 2e6 * (1 + i % 3), "cv": 0.01, "slope": 1.0, "probe_offset": 1.35}
              for i in range(30)}
    specs["model"] = {"ns": sum(v["ns"] for v in specs.values()), "cv": 0.01, "span": 20, "probe_offset": 1.35}
    groups = {"recon": {i: 1.0 for i in specs if i != "model"}, "e2e": {"model": 1.0}}
    ratios = []
    for seed in range(3):
        results, _, _ = run_synthetic(specs, groups, seed=seed, phase=_two_speeds, precision=0.02,
                                      min_rounds=10, max_rounds=20, speed_probe=True)
        recon = sum(results[i].stats.median for i in groups["recon"])
        ratios.append(recon / results["model"].stats.median)
    if fit_offsets:
        assert max(abs(r - 1.0) for r in ratios) < 0.04, ratios
    else:
        assert max(abs(r - 1.0) for r in ratios) > 0.1, ratios


def test_a_few_rounds_that_slow_everything_do_not_make_a_long_sessions_slope():
    # Most rounds: the core's phase moves the probe (bimodal) and a short session with
    # it, not a long one. Six rounds: a neighbour's heavy job slows everything by 1.5x.
    from dlbricks.timing.engine import _slope_sums

    rng = np.random.default_rng(1)
    x = np.where(rng.random(40) < 0.4, np.log(1.5), 0.0)
    episode = np.zeros(40)
    episode[[7, 15, 16, 30, 31, 32]] = np.log(1.5)
    probes = np.exp(9.0 + x + episode)
    long_run = np.exp(18.0 + episode + rng.normal(0, 0.01, 40))
    short_run = np.exp(10.0 + x + episode + rng.normal(0, 0.01, 40))
    sxx, sxy, _, n = _slope_sums(list(long_run), list(probes))
    assert n > 30 and abs(sxy / sxx) < 0.1
    xs, ys = np.log(probes), np.log(long_run)
    assert np.polyfit(xs, ys, 1)[0] > 0.3  # the premise: least squares through all rounds
    sxx, sxy, _, _ = _slope_sums(list(short_run), list(probes))
    assert abs(sxy / sxx - 1.0) < 0.05


def test_few_rounds_take_the_pooled_slope_of_their_run_time_class():
    # Six rounds, one slow beside a slow reading: any line fits them. A long session
    # then gets the slope that long sessions of the run share, not the short ones'.
    from dlbricks.timing.engine import _SLOPE_SD, _slope_sums, _Speed

    class Fake:
        def __init__(self, meds, probes, run_s):
            self.sums, self.run = _slope_sums(meds, probes), run_s

        def slope_sums(self):
            return self.sums

        def run_s(self):
            return self.run

    rng = np.random.default_rng(2)
    sp = _Speed()
    sp.add_readings([1e4] * 10, [1e-3] * 10, [True] * 10)
    tracks = []
    for _ in range(6):  # short sessions that follow the probe, long ones that do not
        p = np.exp(9.0 + np.where(rng.random(20) < 0.4, 0.4, 0.0))
        tracks.append(Fake(list(np.exp(10.0 + np.log(p) + rng.normal(0, 0.01, 20))), list(p), 2e-5))
        tracks.append(Fake(list(np.exp(18.0 + rng.normal(0, 0.01, 20))), list(p), 0.2))
    sp.pool(tracks)
    assert sp.slope_for(2e-5) == pytest.approx(1.0, abs=0.05)
    assert sp.slope_for(0.2) == pytest.approx(0.0, abs=0.05)
    meds, probes = [275e6, 284e6, 268e6, 276e6, 373e6, 273e6], [8e3, 9e3, 8e3, 8e3, 11e3, 8e3]
    assert np.polyfit(np.log(probes), np.log(meds), 1)[0] > 0.5  # the premise: a steep line
    assert sp.slope_of(_slope_sums(meds, probes), 0.27)[0] == pytest.approx(sp.slope_for(0.27))
    # ...with the variance of a slope not known: its rounds contradict the pooled one.
    assert sp.slope_of(_slope_sums(meds, probes), 0.27)[1] == pytest.approx(_SLOPE_SD**2)
    # Rounds that stay flat while the readings beside them move 30% bound the slope
    # near the pooled one of long sessions, though they are too few to move it.
    flat = [180e6, 181e6, 179.5e6, 180.5e6, 180.2e6]
    slope, var = sp.slope_of(_slope_sums(flat, [10e3, 7.7e3, 9.8e3, 10.2e3, 7.8e3]), 0.18)
    assert slope == pytest.approx(sp.slope_for(0.18)) and var < 0.01 * _SLOPE_SD**2


def test_the_offset_curve_follows_run_time_and_is_flat_where_the_readings_show_none():
    from dlbricks.timing.engine import _offset_curve

    rng = np.random.default_rng(0)
    runs = np.log(np.repeat(np.geomspace(1e-5, 1e-1, 200), 5))
    bimodal = np.where(rng.random(runs.size) < 0.4, np.log(1.5), 0.0)
    xs, ys = _offset_curve(bimodal + 0.25 * (runs > np.log(1e-3)), runs)
    assert np.all(np.diff(xs) > 0)
    short, long = np.interp(np.log(1e-5), xs, ys), np.interp(np.log(1e-1), xs, ys)
    assert abs((long - short) - 0.25) < 0.05
    xs, ys = _offset_curve(bimodal, runs)  # no dependence: the noise is shrunk away
    assert float(np.ptp(ys)) < 0.02
    assert _offset_curve(bimodal[:100], runs[:100]) is None  # too few readings for a curve


def test_speed_readings_bracket_every_burst_and_short_bursts_share_them(monkeypatch):
    from dlbricks.timing import engine_worker

    values = iter(range(10, 100, 10))
    readings = engine_worker._SpeedReadings(lambda: next(values))
    a: list[int] = []
    b: list[int] = []
    readings.before(a)  # a reading is taken for the first burst...
    readings.before(b)  # ...and shared by one starting within the interval
    readings.take()
    assert a == b == [10, 20]
    monkeypatch.setattr(engine_worker, "_PROBE_EVERY_NS", -1)  # a reading before every burst
    c: list[int] = []
    d: list[int] = []
    readings.before(c)
    readings.before(d)
    readings.take()
    assert c == [30, 40] and d == [40, 50]


def test_drift_between_rounds_widens_the_interval():
    specs = {"b": {"ns": 1e5, "cv": 0.01}}
    calm, _, _ = run_synthetic(specs, {}, seed=0, min_rounds=8, max_rounds=8)
    drifting, _, _ = run_synthetic(specs, {}, seed=0, min_rounds=8, max_rounds=8, speed=lambda r: 1.0 + 0.1 * (r % 2))
    assert drifting["b"].median_se_ns > 3 * calm["b"].median_se_ns
    assert drifting["b"].stats.drift > 0.05


def test_a_reference_spans_the_rounds_of_what_it_is_compared_with():
    # The model converges in a few rounds, its noisy bricks need many; the machine
    # slows by 2x after round 6. Measured only until its own precision, the model
    # would see the fast machine and its bricks mostly the slow one.
    specs = {"b1": {"ns": 2e5, "cv": 0.3}, "b2": {"ns": 5e5, "cv": 0.3}, "model": {"ns": 7e5, "cv": 0.002}}
    groups = {"recon": {"b1": 1.0, "b2": 1.0}, "e2e": {"model": 1.0}}

    def run(references):
        results, counts, _ = run_synthetic(specs, groups, speed=lambda r: 2.0 if r >= 6 else 1.0, seed=5,
                                           precision=0.01, references=references)
        ratio = (results["b1"].stats.median + results["b2"].stats.median) / results["model"].stats.median
        return ratio, results

    alone, solo = run(())
    paired, pair = run(("model",))
    assert solo["model"].rounds < solo["b1"].rounds  # the premise: it would stop early
    assert alone > 1.5
    assert paired == pytest.approx(1.0, abs=0.1)
    assert pair["model"].rounds >= max(pair["b1"].rounds, pair["b2"].rounds)
    # Its cost is what its own precision needed, not the rounds it kept up with the bricks.
    assert pair["model"].sampling_time_s == pytest.approx(solo["model"].sampling_time_s, rel=0.01)


def test_no_result_is_final_before_its_rounds_span_min_span_s():
    import onnxruntime  # noqa: F401  (a result names its version: imported first, not timed as rounds)

    specs = {"b": {"ns": 1e4, "cv": 0.01}}
    quick, _, quick_summary = run_synthetic(specs, {}, seed=0, max_rounds=100_000)
    spread, _, summary = run_synthetic(specs, {}, seed=0, max_rounds=100_000, min_span_s=0.2)
    assert quick["b"].rounds == 5 and quick_summary.wall_s < 0.2
    assert spread["b"].rounds > 5 and summary.wall_s >= 0.2
    assert spread["b"].stop_reason == "converged"
    # The round limit still ends a run whose rounds are too short to span it; a result
    # that met its precision is then converged, not cut short.
    capped, _, _ = run_synthetic(specs, {}, seed=0, max_rounds=8, min_span_s=60.0)
    assert capped["b"].rounds == 8 and capped["b"].stop_reason == "converged"


def test_a_whole_model_spans_model_span_s_while_its_bricks_close_after_min_span_s():
    specs = {"b": {"ns": 1e4, "cv": 0.01}, "m": {"ns": 1e4, "cv": 0.01}}
    rng = np.random.default_rng(0)
    results: dict[str, Measurement | Failure] = {}
    started = time.perf_counter()
    closed_at: dict[str, float] = {}

    def on_result(item, result):
        results[item.id] = result
        closed_at[item.id] = time.perf_counter() - started

    config = RunnerConfig(min_span_s=0.05, model_span_s=0.4, max_rounds=1_000_000)
    measure([EngineItem("b", specs["b"], kind="brick"), EngineItem("m", specs["m"], kind="model")], [], config,
            on_result=on_result, worker_factory=lambda c, t: SyntheticWorker(c, t, rng=rng))
    assert results["b"].stop_reason == results["m"].stop_reason == "converged"
    assert 0.05 <= closed_at["b"] < 0.4 <= closed_at["m"]
    assert results["m"].rounds > results["b"].rounds


def test_slow_phases_that_persist_over_rounds_widen_the_interval():
    # The same share of slow rounds, alternating or in phases of six: only phases make
    # a second run land elsewhere, so only they may widen the interval.
    specs = {"b": {"ns": 1e5, "cv": 0.01}}
    kw = {"min_rounds": 24, "max_rounds": 24}
    alternating, _, _ = run_synthetic(specs, {}, seed=0, speed=lambda r: 1.1 if r % 2 else 1.0, **kw)
    phases, _, _ = run_synthetic(specs, {}, seed=0, speed=lambda r: 1.1 if (r // 6) % 2 else 1.0, **kw)
    assert phases["b"].median_se_ns > 1.5 * alternating["b"].median_se_ns


def test_auto_cache_state_times_cold_only_memory_bound_sessions_whose_weights_outgrow_l2(monkeypatch):
    import dlbricks.timing.engine as engine

    monkeypatch.setattr(engine, "_l2_bytes", lambda: 1 << 20)
    monkeypatch.setattr(engine, "source_nbytes", lambda spec: spec["bytes"])
    plans: list[tuple[str, int, bool]] = []

    class Recording(SyntheticWorker):
        def send(self, msg):
            if msg is not None and msg[0] == "round":
                plans.extend(msg[1])
            super().send(msg)

    specs = {"big": {"ns": 1e5, "cv": 0.01, "bytes": 4 << 20}, "small": {"ns": 1e5, "cv": 0.01, "bytes": 64 << 10},
             "big_gemm": {"ns": 1e5, "cv": 0.01, "bytes": 4 << 20},
             "model": {"ns": 1e5, "cv": 0.01, "bytes": 400 << 20}}
    rng = np.random.default_rng(0)
    items = [EngineItem(i, spec, warm=i == "model", compute_bound=i == "big_gemm") for i, spec in specs.items()]
    results: dict = {}
    for state, cold in (("auto", {"big"}), ("warm", set()), ("cold", {"big", "small", "big_gemm"})):
        plans.clear()
        results.clear()
        measure(items, [], RunnerConfig(cache_state=state, min_rounds=3, max_rounds=3),
                on_result=lambda it, r: results.__setitem__(it.id, r),
                worker_factory=lambda c, t: Recording(c, t, rng=rng))
        timed_cold = {i for i, _, warm in plans if not warm}
        if state == "warm":
            assert timed_cold <= {"big", "small", "big_gemm"}  # the worker times everything warm anyway
        else:
            assert timed_cold == cold, state
        # Each result says how it was timed, and keeps saying it through the store's dict.
        expect = cold if state != "warm" else set()
        assert {i for i, r in results.items() if r.timed_cold} == expect, state
        assert all(Measurement.from_dict(r.to_dict()).timed_cold == r.timed_cold for r in results.values())


def test_a_crashing_session_fails_alone_and_the_rest_are_measured():
    specs = {"ok1": {"ns": 1e5, "cv": 0.02}, "boom": {"ns": 1e5, "cv": 0.02}, "ok2": {"ns": 1e5, "cv": 0.02}}
    results, _, summary = run_synthetic(specs, {}, crash_on=("boom",))
    assert isinstance(results["boom"], Failure) and results["boom"].reason == "crash"
    assert isinstance(results["ok1"], Measurement) and isinstance(results["ok2"], Measurement)
    assert summary.failed == 1 and summary.measured == 2 and summary.worker_starts >= 2


def test_a_session_that_kills_its_worker_while_opening_fails_alone():
    specs = {f"ok{i}": {"ns": 1e5, "cv": 0.02} for i in range(5)}
    specs["boom"] = {"crash_on_open": True}
    specs.update({f"late{i}": {"ns": 1e5, "cv": 0.02} for i in range(5)})
    results, _, summary = run_synthetic(specs, {})
    assert isinstance(results["boom"], Failure) and results["boom"].reason == "crash"
    assert all(isinstance(r, Measurement) for k, r in results.items() if k != "boom")
    assert len(results) == 11 and summary.worker_starts >= 2


def test_a_session_that_cannot_open_is_a_failure_with_the_reason():
    results, _, _ = run_synthetic({"bad": {"bad": True}, "ok": {"ns": 1e5, "cv": 0.02}}, {})
    assert isinstance(results["bad"], Failure) and "bad" in results["bad"].error
    assert isinstance(results["ok"], Measurement)


def test_results_keep_a_bounded_sample_and_every_round_median():
    results, _, _ = run_synthetic({"b": {"ns": 1e3, "cv": 0.05}}, {}, precision=0.001, min_rounds=5)
    m = results["b"]
    assert m.stats.n > len(m.times_ns)
    assert len(m.times_ns) <= 1024 and m.rounds == len(m.round_medians_ns) >= 5
    assert m.stats.ci_low < m.stats.median < m.stats.ci_high


# --------------------------------------------------------------------------- real workers


def _matmul_model(n: int, name: str) -> bytes:
    w = helper.make_tensor("w", TensorProto.FLOAT, [n, n], np.full(n * n, 0.01, np.float32))
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        initializer=[w],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m.SerializeToString()


def test_the_evictor_reads_only_what_the_other_sessions_fall_short_of():
    from dlbricks.timing.engine_worker import _Evictor

    refreshed = []
    evictor = _Evictor(8 << 20, lambda: refreshed.append(1))
    evictor.top_up(8 << 20)  # the other cold sessions read enough: nothing to add
    assert evictor._buffer is None and not refreshed
    evictor.top_up(1 << 20)  # they fall short: the buffer is read, then the run path refreshed
    assert evictor._buffer is not None and evictor._buffer.nbytes == 8 << 20 and refreshed == [1]


def test_the_eviction_read_is_twice_the_last_level_cache_but_not_a_cloud_hosts_whole_socket(monkeypatch):
    import dlbricks.roofline.peaks as peaks
    from dlbricks.timing.engine_worker import _EVICTION_CACHE_MULTIPLE, _MAX_LLC_BYTES, eviction_bytes

    monkeypatch.setattr(peaks, "data_cache_bytes", lambda level=None: 8 << 20)
    assert eviction_bytes() == _EVICTION_CACHE_MULTIPLE * (8 << 20)
    monkeypatch.setattr(peaks, "data_cache_bytes", lambda level=None: 480 << 20)  # a VM sees its host's L3
    assert eviction_bytes() == _EVICTION_CACHE_MULTIPLE * _MAX_LLC_BYTES < 480 << 20


def test_a_cold_session_alone_in_its_rounds_reads_its_weights_from_memory():
    # Alone in its rounds, a cold brick has no other sessions to evict its weights
    # between two of its runs: the eviction must not depend on them. 1024x1024 floats
    # (4 MiB) fit the last-level cache, so warm reads them from it and cold from DRAM.
    from dlbricks.roofline.peaks import data_cache_bytes
    from dlbricks.timing.engine_worker import _MAX_LLC_BYTES

    llc = data_cache_bytes() or 0
    if llc < 8 << 20:
        pytest.skip("needs a last-level cache that holds 4 MiB of weights twice over")
    # A cache larger than the eviction read counts (a cloud VM's view of its host's
    # socket) is only partly evicted: the weights come from DRAM only in part.
    factor = 1.5 if llc <= _MAX_LLC_BYTES else 1.15
    medians = {}
    for state in ("warm", "cold"):
        out: dict[str, Measurement] = {}
        measure([EngineItem("mm", _matmul_model(1024, "mm"))], [], RunnerConfig(cache_state=state, max_rounds=8),
                on_result=lambda it, r, out=out: out.__setitem__(it.id, r))
        medians[state] = out["mm"].stats.median
    assert medians["cold"] > factor * medians["warm"], medians


def test_a_warm_session_gets_discarded_runs_when_it_is_short_or_its_weights_fit_the_last_level_cache():
    from dlbricks.timing.engine_worker import _EVICTION_CACHE_MULTIPLE, LONG_RUN_S, SHORT_RUN_S, discarded_runs

    llc = 32 << 20
    evict = _EVICTION_CACHE_MULTIPLE * llc
    assert discarded_runs(1e-5, 1 << 30, 1e-3, evict) == 2  # short: two, whatever its size
    assert discarded_runs(2 * SHORT_RUN_S, 1 << 20, 1.0, evict) == 1  # shorter than a burst, not short
    assert discarded_runs(0.1, llc, 1e-3, evict) == 1  # longer than a burst, but its weights fit the LLC
    assert discarded_runs(0.1, llc + 1, 1e-3, evict) == 0  # longer and larger: it evicts itself anyway
    assert discarded_runs(LONG_RUN_S, 1 << 20, 1e-3, evict) == 0  # long: a first run is as fast as any


def _scripted_runs(times_ns):
    """A stand-in for timed_runs that 'runs' by handing out the next scripted time."""
    script = iter(times_ns)

    def timed_runs(bound, k, out, clock):
        out.extend(next(script) for _ in range(k))

    return timed_runs


def test_warm_up_ends_at_the_first_run_within_tolerance_of_the_fastest_before_it():
    from dlbricks.timing.engine_worker import _WARMUP_MAX_RUNS, _warm_up

    # Settled from the start: two runs (the binding's two came before).
    assert _warm_up(None, _scripted_runs([1000, 1050, 999]), None) == (2, pytest.approx(1050e-9))
    # Still getting faster: each run more than 10% below the fastest so far.
    runs, run_s = _warm_up(None, _scripted_runs([9000, 5000, 2000, 1000, 1020, 1]), None)
    assert (runs, run_s) == (5, pytest.approx(1020e-9))
    # A slow run (an interrupt) after a fast one is not steady.
    assert _warm_up(None, _scripted_runs([1000, 3000, 1080]), None) == (3, pytest.approx(1080e-9))
    # Never settles (15% faster every run): stops at the run limit.
    never = [int(1e9 * 0.85**i) for i in range(_WARMUP_MAX_RUNS + 5)]
    assert _warm_up(None, _scripted_runs(never), None)[0] == _WARMUP_MAX_RUNS


def test_a_warm_session_longer_than_a_burst_is_warm_if_its_weights_fit_the_last_level_cache():
    # A whole model is a warm loop, as a user times it. Its runs come after the previous
    # round's cold passes, which evict everything; a session whose weights fit the
    # last-level cache must get its discarded run back even when one run outlasts a
    # burst (here every run does: burst_s is tiny), or it is timed cold.
    from dlbricks.roofline.peaks import data_cache_bytes

    if (data_cache_bytes() or 0) < 8 << 20:
        pytest.skip("needs a last-level cache that holds 4 MiB of weights twice over")
    out = {}
    items = [EngineItem("model", _matmul_model(1024, "model"), warm=True),
             EngineItem("brick", _matmul_model(1024, "brick"))]
    measure(items, [], RunnerConfig(cache_state="cold", burst_s=1e-6, min_rounds=10, max_rounds=10),
            on_result=lambda it, r: out.__setitem__(it.id, r))
    # Fastest runs, not medians: other tenants of a shared last-level cache only ever
    # slow a run (in one CI run the warm model's last rounds ran as slowly as the cold
    # brick's), and the fastest warm run shows whether its weights were there to read.
    # The margin is small on some hosts: on a 2-core EPYC slice (32 MiB L3 shared with
    # other tenants) the run after the discarded one ran 0.74-0.81x the cold brick's,
    # and a warm loop 0.4x; without the discarded run both are cold (about 1x).
    model, brick = (float(np.min(out[k].times_ns)) for k in ("model", "brick"))
    assert model < 0.9 * brick, (out["model"].times_ns, out["brick"].times_ns)

@pytest.mark.parametrize("cache_state", ["warm", "cold", "auto"])
def test_real_workers_measure_sessions_from_bytes(cache_state):
    # 512x512 floats (1 MiB) go to the worker through a spool file, the others through the pipe.
    items = [EngineItem(f"mm{n}", _matmul_model(n, f"mm{n}"), label=f"mm{n}") for n in (64, 256, 512)]
    items.append(EngineItem("broken", b"not an onnx model", label="broken"))
    results: dict[str, object] = {}
    summary = measure(items, [Group("m", {"mm64": 1.0, "mm256": 1.0})],
                      RunnerConfig(cache_state=cache_state, speed_probe=True),
                      on_result=lambda it, r: results.__setitem__(it.id, r))
    assert isinstance(results["broken"], Failure) and "broken" in results["broken"].error
    for n in (64, 256, 512):
        m = results[f"mm{n}"]
        assert isinstance(m, Measurement), m
        assert m.rounds >= 5 and m.stats.median > 0 and m.wall_time_s > 0
        # Every round has its speed reading, and the rounds are brought to the run's mix
        # of readings (its reference depends on the session's slope, not on the session).
        assert len(m.round_probes_ns) == m.rounds and min(m.round_probes_ns) > 0
        # And its lane's shared-cache reading (one lane: the same in every result).
        assert len(m.round_shared_cache) == m.rounds and min(m.round_shared_cache) > 0
        assert 0.0 <= m.speed_slope <= 1.5
        readings = [p for n2 in (64, 256, 512) for p in results[f"mm{n2}"].round_probes_ns]
        assert min(readings) <= m.speed_ref_ns <= max(readings)
    if cache_state == "warm":
        med = {n: results[f"mm{n}"].stats.median for n in (64, 256, 512)}
        assert med[512] > med[256] > med[64], med
    # Cold runs are not ordered by size on every host: on a 2-core EPYC slice (32 MiB
    # L3 shared with other tenants) 64x64 and 256x256 weights both ran 18-25 us cold,
    # and 512x512 ran 52-56 us in most runs but 21-25 us in some (its weights, it seems,
    # outlived the eviction read there), failing this check in 5 of 11 runs.
    assert summary.measured == 3 and summary.failed == 1
    import glob

    assert not glob.glob("/dev/shm/dlbricks-model-*")  # spool files are removed


def test_a_worker_killed_between_rounds_is_replaced_and_its_sessions_reopened():
    import os
    import signal

    good = EngineItem("good", _matmul_model(32, "good"))
    victim = EngineItem("victim", _matmul_model(48, "victim"))
    results: dict[str, object] = {}
    killed = []

    def on_progress(p):
        if p.rounds == 1 and not killed:
            # Kill the worker between rounds: the next round finds it dead.
            for pid in _worker_pids():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    summary = measure([good, victim], [], RunnerConfig(), on_result=lambda it, r: results.__setitem__(it.id, r),
                      on_progress=on_progress)
    assert killed
    assert isinstance(results["good"], Measurement) and isinstance(results["victim"], Measurement)
    assert summary.worker_starts >= 2


def _worker_pids():
    import os

    me = os.getpid()
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if int(fields[3]) == me and b"dlbricks.timing.engine_worker" in cmd:
            pids.append(int(d))
    return pids


class _Sleeper:
    """A stand-in bound session whose run is descheduled time, not work."""

    def __init__(self, seconds: float) -> None:
        import time

        self.run_fn, self.run_args = (lambda a, b: time.sleep(seconds)), (None, None)


def test_the_thread_clock_leaves_out_time_the_thread_was_descheduled():
    import time

    from dlbricks.timing.session import timed_runs

    wall = timed_runs(_Sleeper(0.01), 3)
    cpu = timed_runs(_Sleeper(0.01), 3, clock=time.thread_time_ns)
    assert min(wall) >= 9_000_000 and max(cpu) < 2_000_000


def test_the_clock_is_part_of_the_key_and_auto_resolves_by_thread_count():
    assert RunnerConfig().measure_clock() == "thread"
    assert RunnerConfig(intra_op_threads=2).measure_clock() == "wall"
    assert RunnerConfig(clock="wall").key() != RunnerConfig().key()
    assert RunnerConfig(clock="thread").key() == RunnerConfig().key()
    with pytest.raises(Exception, match="clock 'thread'"):
        RunnerConfig(intra_op_threads=2, clock="thread")


def test_an_interrupted_run_resumes_from_its_last_checkpoint():
    specs = {"a": {"ns": 1e5, "cv": 0.02}, "b": {"ns": 2e5, "cv": 0.02}}
    rng = np.random.default_rng(0)
    states: dict[str, dict] = {}

    class Killed(Exception):
        pass

    def kill_at_round_3(p):
        if p.rounds == 3:
            raise Killed

    config = RunnerConfig(min_rounds=6, max_rounds=6)
    factory = lambda c, t: SyntheticWorker(c, t, rng=rng)  # noqa: E731
    with pytest.raises(Killed):
        measure([EngineItem(i, s) for i, s in specs.items()], [], config, on_result=lambda it, r: None,
                on_progress=kill_at_round_3, worker_factory=factory, on_checkpoint=states.update, checkpoint_s=0)
    assert set(states) == {"a", "b"} and all(len(s["round_medians"]) == 3 for s in states.values())
    results: dict[str, Measurement] = {}
    summary = measure([EngineItem(i, s, resume=states[i]) for i, s in specs.items()], [], config,
                      on_result=lambda it, r: results.__setitem__(it.id, r), worker_factory=factory)
    assert summary.rounds == 3  # only the rounds the first run had not done
    assert all(r.rounds == 6 for r in results.values())
    # Each round keeps its shared-cache reading across the interruption.
    assert all(len(s["round_cache"]) == 3 and min(s["round_cache"]) >= 2.0 for s in states.values())
    assert all(r.round_shared_cache[:3] == states[i]["round_cache"] and len(r.round_shared_cache) == 6
               for i, r in results.items())


def test_huge_pages_ask_glibc_for_them_in_the_worker_and_key_results():
    from dlbricks.timing.engine_process import worker_env

    os_env = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0"}
    import os

    old = dict(os.environ)
    os.environ.update(os_env)
    try:
        on = worker_env(RunnerConfig(huge_pages=True))
        off = worker_env(RunnerConfig())
    finally:
        os.environ.clear()
        os.environ.update(old)
    keep = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"
    # The user's other tunables kept; freed memory kept for the next sessions either way.
    assert on["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{keep}:glibc.malloc.hugetlb=1"
    assert off["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0:{keep}"
    assert RunnerConfig(huge_pages=True).key() != RunnerConfig().key()
    assert not RunnerConfig().huge_pages


def _anon_huge_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


@pytest.mark.parametrize("huge_pages", [True, False])
def test_a_worker_with_huge_pages_holds_its_sessions_in_them(huge_pages):
    from dlbricks.timing.sysinfo import huge_pages_available

    if not huge_pages_available():
        pytest.skip("glibc < 2.35 or transparent huge pages off: the setting has no effect here")
    seen: list[int] = []

    def on_progress(p):
        if p.phase == "measuring" and p.rounds == 1:
            seen.extend(_anon_huge_kib(pid) for pid in _worker_pids())

    # 16 MiB of weights: onnxruntime's copies of them fill several 2 MiB pages. Timed
    # warm: a cold run's eviction buffer is a numpy array, which numpy itself places in
    # huge pages, and it would be counted here.
    config = RunnerConfig(huge_pages=huge_pages, max_rounds=5, cache_state="warm")
    measure([EngineItem("big", _matmul_model(2048, "big"))], [], config,
            on_result=lambda it, r: None, on_progress=on_progress)
    assert seen
    assert (max(seen) >= 4096) == huge_pages


def _record(m: Measurement):
    from dlbricks.store import ResultRecord

    d = m.to_dict()
    meta = {k: v for k, v in d.items() if k not in ("times_ns", "stats")}
    return ResultRecord("brick", "x", 1, "sys", "cfg", "ok", d["stats"], m.times_ns, meta, None, "")


def test_bricks_closed_early_are_compared_with_the_model_in_their_own_rounds():
    # The bricks reach their precision in a few rounds; the noisy model needs many more,
    # and the machine slows by 1.5x after round 6. Against the model's estimate over all
    # its rounds the bricks would carry the fast rounds' speed into the ratio; against
    # the model in the rounds both were measured, the ratio holds.
    from dlbricks.evaluation import same_rounds_latency

    specs = {"b1": {"ns": 2e5, "cv": 0.01}, "b2": {"ns": 5e5, "cv": 0.01}, "model": {"ns": 7e5, "cv": 0.15}}
    groups = {"recon": {"b1": 1.0, "b2": 1.0}, "e2e": {"model": 1.0}}
    results, _, _ = run_synthetic(specs, groups, speed=lambda r: 1.5 if r >= 6 else 1.0, seed=7, precision=0.02)
    b1, b2, model = results["b1"], results["b2"], results["model"]
    assert max(b1.rounds, b2.rounds) <= 6 < model.rounds  # the premise
    assert b1.engine_run and b1.engine_run == model.engine_run
    assert model.round_nos == list(range(1, model.rounds + 1))
    recon = b1.stats.median + b2.stats.median
    assert recon / model.stats.median < 0.85  # what comparing the whole estimates gives
    ref, rounds = same_rounds_latency(_record(model), [_record(b1), _record(b2)], [b1.stats.median, b2.stats.median])
    assert recon / ref == pytest.approx(1.0, abs=0.06)
    assert rounds == pytest.approx(max(b1.rounds, b2.rounds), abs=1)


def test_the_same_rounds_reference_falls_back_to_the_whole_estimate():
    from dlbricks.evaluation import same_rounds_latency

    specs = {"b": {"ns": 2e5, "cv": 0.01}, "model": {"ns": 2e5, "cv": 0.01}}
    results, _, _ = run_synthetic(specs, {"recon": {"b": 1.0}, "e2e": {"model": 1.0}}, seed=1, min_rounds=6)
    b, model = _record(results["b"]), _record(results["model"])
    whole = results["model"].stats.median
    # Measured in every round of the model: the model's own estimate.
    assert same_rounds_latency(model, [b], [1.0])[0] == pytest.approx(whole)
    # A brick from another run of the engine (reused from the store), or one without
    # round numbers (an older store): nothing to pair it with.
    other = _record(results["b"])
    other.meta["engine_run"] = "another"
    assert same_rounds_latency(model, [other], [1.0]) == (whole, results["model"].rounds)
    old = _record(results["b"])
    del old.meta["round_nos"]
    assert same_rounds_latency(model, [old], [1.0])[0] == whole


def test_sessions_open_while_what_the_workers_hold_and_their_spool_files_fit_the_memory_budget():
    MiB = 1 << 20

    def most_live(spool_bytes):
        rng = np.random.default_rng(0)
        made = []

        def factory(c, t):
            wk = SyntheticWorker(c, t, rng=rng)
            wk.spool_bytes = spool_bytes
            made.append(wk)
            return wk

        specs = {f"b{i}": {"ns": 1e6, "cv": 0.01, "held": 20 * MiB} for i in range(20)}
        summary = measure([EngineItem(i, s) for i, s in specs.items()], [],
                          RunnerConfig(memory_budget_mb=100, min_span_s=0.0, open_cores=()),
                          on_result=lambda it, r: None, worker_factory=factory)
        assert summary.measured == 20 and summary.batches > 1
        return max(wk.most_live for wk in made)

    # 20 MiB a session against 100 MiB: sending stops once a reply says the worker
    # holds 100 MiB, and the requests already in flight (at most 3) still open; the
    # spool files' memory counts too.
    alone, spooled = most_live(0), most_live(40 * MiB)
    assert 5 <= alone <= 5 + 3 and 3 <= spooled <= 3 + 3 and spooled < alone


def test_a_session_that_closes_makes_room_for_the_next_while_the_others_run_on():
    # 40 MiB sessions against 100 MiB: "slow" (its burst medians vary by 30%) needs
    # many rounds, the quiet ones five. Those after the first fill open as the quiet
    # ones close, between rounds, and are measured in rounds of "slow" rather than
    # after it in a batch of their own.
    MiB = 1 << 20
    specs = {"slow": {"ns": 1e6, "cv": 0.01, "burst_cv": 0.3, "held": 40 * MiB}}
    specs |= {f"q{i}": {"ns": 1e6, "cv": 0.001, "held": 40 * MiB} for i in range(8)}
    results, _, summary = run_synthetic(specs, {}, memory_budget_mb=100, max_rounds=40, open_cores=())
    assert summary.measured == 9 and summary.batches >= 2
    slow = set(results["slow"].round_nos)
    later = [i for i in specs if i != "slow" and min(results[i].round_nos) > min(slow) + 4]
    assert later and all(set(results[i].round_nos) <= slow for i in later), (slow, later)


def test_progress_reports_opening_then_rounds_with_an_eta_that_tracks_the_rounds_still_needed():
    # Four items whose spread needs many rounds to reach +/-2% together: the ETA (the rounds each group still needs, r (h / precision)^2 - r, times
    # each item's cost per round) predicts the time the rest of the run takes, and it
    # is 0 when the run ends.
    specs = {f"b{i}": {"ns": 2e6 * (1 + i), "cv": 0.3} for i in range(4)}
    reports, walls = measure_with_progress(specs, [Group("m", {i: 1.0 for i in specs})],
                                           RunnerConfig(min_rounds=5, max_rounds=300, min_span_s=0.0), seed=1)
    phases = [p.phase for p, _ in reports]
    assert phases[0] == "opening" and phases[-1] == "measuring"
    assert all(p.eta_s is None for p, _ in reports if p.phase == "opening")  # no rounds seen: no guess
    assert phases.index("measuring") > phases.index("opening")
    assert max(p.opened for p, _ in reports) == 4 and reports[-1][0].final == 4
    measuring = [(p, n) for p, n in reports if p.phase == "measuring"]
    assert len(measuring) >= 15, len(measuring)  # a run long enough to predict
    assert measuring[-1][0].eta_s == 0
    # Early rounds' spread understates the later ones' (bursts shorten as items near
    # their runs), so the estimate is a rough one: within 2x once a quarter has run.
    for p, n in measuring[len(measuring) // 4:3 * len(measuring) // 4]:
        remaining = sum(walls[n:])
        assert 0.5 * remaining <= p.eta_s <= 2.0 * remaining, (p.rounds, p.eta_s, remaining)


def test_the_eta_of_sessions_not_yet_open_is_not_an_early_slow_item_s_round_limit_spread_over_all():
    # One slow, noisy item (100 ms runs whose bursts vary by 30%: many rounds) opens
    # first with a few quiet ones; two hundred quiet ones wait for memory. Early on,
    # the slow item's expected rounds up to the limit must not be charged to each of
    # them (that read 17 times the time left): a rough estimate, but within a few times.
    MiB = 1 << 20
    specs = {"slow": {"ns": 1e8, "cv": 0.01, "burst_cv": 0.3, "held": 10 * MiB}}
    specs |= {f"q{i}": {"ns": 1e5, "cv": 0.01, "held": 10 * MiB} for i in range(200)}
    reports, walls = measure_with_progress(
        specs, [], RunnerConfig(memory_budget_mb=100, min_span_s=0.0, max_rounds=60, open_cores=()), seed=0)
    early = [(p, n) for p, n in reports if p.phase == "measuring" and 2 <= p.rounds <= 4]
    assert early
    for p, n in early:
        remaining = sum(walls[n:])
        assert p.eta_s is not None and 0.25 * remaining <= p.eta_s <= 6.0 * remaining, (p.rounds, p.eta_s, remaining)


def test_sessions_not_yet_open_are_priced_at_what_opened_ones_of_their_kind_cost():
    # Model by model: three whole models (20 ms runs) open first with a few bricks
    # (0.1 ms), and 300 bricks wait for memory. Priced at the average opened session,
    # the waiting bricks would look like a fraction of a model each; priced as bricks,
    # the early estimate stays within a few times the time left.
    MiB = 1 << 20
    specs = {f"m{i}": {"ns": 2e7, "cv": 0.02, "held": 30 * MiB} for i in range(3)}
    specs |= {f"b{i}": {"ns": 1e5, "cv": 0.02, "held": 1 * MiB} for i in range(300)}
    kinds = {i: "model" if i.startswith("m") else "brick" for i in specs}
    config = RunnerConfig(memory_budget_mb=100, min_span_s=0.0, model_span_s=0.0, open_cores=())

    def early_ratios(kinds):
        reports, walls = measure_with_progress(specs, [], config, seed=0, kinds=kinds)
        early = [(p, n) for p, n in reports if p.phase == "measuring" and 2 <= p.rounds <= 4]
        assert early
        return [p.eta_s / sum(walls[n:]) for p, n in early]

    by_kind = early_ratios(kinds)
    assert all(1 / 3 <= r <= 3.0 for r in by_kind), by_kind
    assert max(early_ratios(None)) > 2 * max(by_kind)  # one price for all: far off


def test_rounds_to_precision_extrapolates_the_normal_half_width_and_lets_the_quantile_fall():
    from dlbricks.timing.engine import _rounds_to_precision

    # Many rounds: t is normal, so the interval narrows as one over the square root.
    assert _rounds_to_precision(200, 0.04, 0.02, 1000.0) == pytest.approx(800.0, rel=0.01)
    # Two rounds at twice the precision (normal quantile): a few more rounds, not the
    # t = 12.7 of one degree of freedom squared into the hundreds.
    n = _rounds_to_precision(2, 0.04, 0.02, 1000.0)
    assert 8.0 < n < 20.0
    assert _rounds_to_precision(2, 0.4, 0.02, 60.0) == 60.0  # the round limit bounds it
    assert _rounds_to_precision(10, 0.01, 0.02, 60.0) < 10.0  # already there


def test_a_sessions_probe_offset_goes_no_further_than_its_own_readings():
    # The probe reads 1.3x slower beside long sessions than beside short ones, and the
    # offset curve sees it; a long session whose own readings sit at the run's typical
    # reading is not moved by it (a whole model among cold bricks), one whose readings
    # show it is.
    from dlbricks.timing.engine import _Speed

    rng = np.random.default_rng(0)
    sp = _Speed()
    readings = list(1e4 * np.exp(rng.normal(0, 0.01, 400))) + list(1.3e4 * np.exp(rng.normal(0, 0.01, 400)))
    sp.add_readings(readings, [1e-5] * 400 + [5e-3] * 400, [True] * 800)
    offset = sp.offset(5e-3, True)
    assert offset > 0.05
    ref = sp.reference_for(0.5)
    typical = float(np.exp(np.median(np.log(readings))))
    assert sp.reference_of(0.5, 5e-3, True, [typical] * 10) == pytest.approx(ref, rel=0.01)
    assert sp.reference_of(0.5, 5e-3, True, [1.3e4] * 10) == pytest.approx(ref * math.exp(offset), rel=1e-6)
    assert sp.reference_of(0.5, 5e-3, True) == pytest.approx(ref * math.exp(offset), rel=1e-6)  # no readings yet


class _Logged(SyntheticWorker):
    """A synthetic worker that logs every request and reply in a log shared by all,
    and answers ``pin`` requests (recording where it is)."""

    def __init__(self, *args, log, name, **kw):
        super().__init__(*args, **kw)
        self.log, self.name, self.cpus = log, name, None

    def send(self, msg):
        if msg is not None:
            self.log.append(("send", self.name, msg[0], self.cpus, msg[0] == "round" and bool(msg[2])))
        if msg is not None and msg[0] == "pin":
            self.cpus = msg[1]
            self._replies.append(("pinned",))
            return
        super().send(msg)

    def reply(self, timeout_s, doing):
        r = super().reply(timeout_s, doing)
        self.log.append(("reply", self.name, r[0]))
        return r


def _run_with_openers(monkeypatch, n_items=40, jobs=1, cores=(1,), spare=(0,)):
    from dlbricks.timing import engine as engine_mod

    monkeypatch.setattr(engine_mod, "_opening_cpus", lambda config, lanes: list(spare))
    rng = np.random.default_rng(3)
    log: list[tuple] = []
    names = iter(range(100))
    specs = {f"b{i}": {"ns": 1e5 * (1 + i % 7), "cv": 0.02} for i in range(n_items)}
    results: dict[str, object] = {}
    summary = measure([EngineItem(i, s) for i, s in specs.items()], [Group("m", {i: 1.0 for i in specs})],
                      RunnerConfig(cores=cores), on_result=lambda it, r: results.__setitem__(it.id, r), jobs=jobs,
                      worker_factory=lambda c, t: _Logged(c, t, rng=rng, log=log, name=next(names)))
    return results, summary, log


def test_sessions_are_built_on_a_spare_cpu_too_and_timed_one_process_at_a_time(monkeypatch):
    results, summary, log = _run_with_openers(monkeypatch)
    assert all(isinstance(r, Measurement) for r in results.values()) and len(results) == 40
    assert summary.worker_starts == 2
    opened_by = collections.Counter(name for ev, name, op, *_ in log if ev == "send" and op == "open")
    assert len(opened_by) == 2, opened_by  # both processes build sessions
    # The extra process builds its sessions on the spare CPU and is home for every round.
    opens = [e for e in log if e[0] == "send" and e[2] == "open"]
    rounds = [e for e in log if e[0] == "send" and e[2] == "round"]
    assert {e[1]: e[3] for e in opens} == {0: None, 1: [0]}
    assert rounds and all(e[3] is None for e in rounds)
    # A lane's processes take turns: never two rounds out at once.
    out = 0
    for ev, _name, op, *_ in log:
        if op == "round":
            out += 1 if ev == "send" else -1
            assert out <= 1
    # One shared-cache reading per round, by the lane's first process with sessions in it,
    # kept with every session of the lane measured in that round.
    assert sum(e[4] for e in rounds) == summary.rounds
    for r in results.values():
        assert len(r.round_shared_cache) == r.rounds and min(r.round_shared_cache) >= 2.0, r.round_shared_cache
    if summary.host is not None:  # Linux
        assert summary.host.shared_cache is not None and 2.0 <= summary.host.shared_cache[1] <= 2.01


def test_each_lane_gets_its_own_opening_process_and_lanes_run_at_once(monkeypatch):
    results, summary, log = _run_with_openers(monkeypatch, jobs=2, cores=(2, 3), spare=(0, 1))
    assert all(isinstance(r, Measurement) for r in results.values())
    assert summary.worker_starts == 4
    out, most = 0, 0
    for ev, _name, op, *_ in log:
        if op == "round":
            out += 1 if ev == "send" else -1
            most = max(most, out)
    assert most == 2  # one round out per lane
    assert sum(e[4] for e in log if e[0] == "send" and e[2] == "round") == 2 * summary.rounds


def test_opening_costs_sum_to_the_wall_time_it_took():
    # Workers that say each session took a second to build, in a run that takes far
    # less: the sessions' costs are their share of the real wall time.
    class Slow(SyntheticWorker):
        def reply(self, timeout_s, doing):
            r = super().reply(timeout_s, doing)
            if r[0] == "opened":
                r[2]["setup_s"] = 1.0
            return r

    rng = np.random.default_rng(0)
    results: dict[str, object] = {}
    specs = {f"b{i}": {"ns": 1e5, "cv": 0.01} for i in range(20)}
    t0 = time.perf_counter()
    measure([EngineItem(i, s) for i, s in specs.items()], [], RunnerConfig(),
            on_result=lambda it, r: results.__setitem__(it.id, r), worker_factory=lambda c, t: Slow(c, t, rng=rng))
    wall = time.perf_counter() - t0
    assert sum(r.setup_time_s for r in results.values()) <= wall
    assert all(r.setup_time_s > 0 for r in results.values())


def test_real_workers_build_on_a_spare_cpu_and_time_on_the_pinned_one():
    import os

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two usable CPUs")
    items = [EngineItem(f"mm{n}", _matmul_model(n, f"mm{n}")) for n in (32, 48, 64, 96, 128, 160)]
    results: dict[str, object] = {}
    summary = measure(items, [], RunnerConfig(cores=(cpus[-1],), open_cores=(cpus[0],), max_rounds=6),
                      on_result=lambda it, r: results.__setitem__(it.id, r))
    assert summary.worker_starts == 2 and summary.measured == 6
    assert all(isinstance(r, Measurement) and r.stats.median > 0 for r in results.values())


def test_batches_after_the_first_fill_the_memory_budget_again_in_what_the_first_freed():
    # 24 sessions of 16 MiB of weights (about 40 MiB each in the worker) against 200 MiB:
    # five batches here. Counting the memory closed sessions left with the worker (its
    # resident size) made every batch after the first hold only the requests already in
    # flight: eight.
    items = [EngineItem(f"m{i}", _matmul_model(2048, f"m{i}")) for i in range(24)]
    config = RunnerConfig(memory_budget_mb=200, min_rounds=1, max_rounds=1, min_span_s=0.0, cache_state="warm",
                          open_cores=())
    summary = measure(items, [], config, on_result=lambda it, r: None)
    assert summary.measured == 24 and summary.batches <= 6, summary


def test_a_worker_keeps_the_memory_of_closed_sessions_for_the_next_and_reuses_its_spool_files():
    import glob
    import os

    from dlbricks.timing.engine_process import WorkerProcess, spool_dir

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("no /proc to read a process's resident size from")
    wk = WorkerProcess(RunnerConfig(cache_state="warm"), 60.0)
    mine = os.path.join(spool_dir() or "/tmp", f"dlbricks-model-{os.getpid()}-*")
    before = set(glob.glob(mine))

    def resident():
        with open(f"/proc/{wk.proc.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    try:
        started = resident()
        wk.send(("open", "big", _matmul_model(4096, "big"), None, 0, 0))  # 64 MiB of weights, spooled
        opened = wk.reply(60.0, "opening")
        assert opened[0] == "opened", opened
        with_big = resident()
        wk.answered(0)
        wk.send(("close", ["big"]))
        closed = wk.reply(60.0, "closing")
        # The pages stay with the worker ...
        after_close = resident()
        assert after_close > with_big - (16 << 20), (with_big, after_close)
        # ... but what it reports for the memory budget is what its live sessions hold:
        # the session's weights are no longer counted (else every batch after the first
        # would hold only the sessions already in flight).
        assert opened[2]["held"] - closed[1] > 48 << 20, (opened[2]["held"], closed[1])
        # The next session of that size is built mostly in those pages, not in memory
        # taken from the system again (here the first grew the worker by 279 MiB: the
        # weights' bytes, parsed and packed copies; the second by 4-64 MiB, as the
        # heap's free blocks happened to fit, in three runs).
        wk.send(("open", "again", _matmul_model(4096, "again"), None, 0, 1))
        again = wk.reply(60.0, "opening")
        first, second = with_big - started, resident() - after_close
        assert again[0] == "opened" and first > 128 << 20 and second < first / 2, (first, second)
        assert again[2]["held"] > closed[1] + (48 << 20)
        # Both large models went through the same spool file: reused, not made anew.
        assert len(set(glob.glob(mine)) - before) == 1
        wk.answered(1)
        # Two requests in flight need two files: the second must not overwrite the first.
        wk.send(("open", "a", _matmul_model(2048, "a"), None, 0, 2))
        wk.send(("open", "b", _matmul_model(2048, "b"), None, 0, 3))
        assert len(set(glob.glob(mine)) - before) == 2
        assert [wk.reply(60.0, "opening")[:2] for _ in range(2)] == [("opened", "a"), ("opened", "b")]
    finally:
        wk.stop()
    assert not set(glob.glob(mine)) - before  # removed with the worker


def test_spooled_files_of_processes_that_no_longer_run_are_removed(tmp_path, monkeypatch):
    import os
    import subprocess

    from dlbricks.timing import engine_process

    monkeypatch.setattr(engine_process, "spool_dir", lambda: str(tmp_path))
    monkeypatch.setattr(engine_process.tempfile, "gettempdir", lambda: str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"dlbricks-bricks-{dead.pid}-abc").mkdir()
    (tmp_path / f"dlbricks-bricks-{dead.pid}-abc" / "x.onnx").write_bytes(b"x" * 100)
    (tmp_path / f"dlbricks-model-{dead.pid}-def.onnx").write_bytes(b"x")
    (tmp_path / f"dlbricks-beacon-{dead.pid}-jkl").write_bytes(b"x" * 8)  # a killed run's worker's
    mine = tmp_path / f"dlbricks-bricks-{os.getpid()}-ghi"
    mine.mkdir()
    other = tmp_path / "dlbricks-bricks-notapid"
    other.mkdir()
    assert engine_process.remove_stale_spools() == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name])


def test_a_session_that_kills_an_opening_process_fails_alone(monkeypatch):
    from dlbricks.timing import engine as engine_mod

    monkeypatch.setattr(engine_mod, "_opening_cpus", lambda config, lanes: [0])
    rng = np.random.default_rng(5)
    log: list[tuple] = []
    names = iter(range(100))
    specs = {f"b{i}": {"ns": 2e5, "cv": 0.02} for i in range(12)}
    specs["b7"] = {"ns": 2e5, "cv": 0.02, "crash_on_open": True}
    results: dict[str, object] = {}
    summary = measure([EngineItem(i, s) for i, s in specs.items()], [], RunnerConfig(cores=(1,)),
                      on_result=lambda it, r: results.__setitem__(it.id, r),
                      worker_factory=lambda c, t: _Logged(c, t, rng=rng, log=log, name=next(names)))
    assert isinstance(results["b7"], Failure) and results["b7"].reason == "crash"
    assert all(isinstance(results[i], Measurement) for i in specs if i != "b7")
    assert summary.failed == 1 and summary.measured == 11 and summary.worker_starts == 3


def test_a_killed_opening_process_is_replaced_and_its_sessions_reopened_on_the_timing_cpu():
    import os
    import signal

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two usable CPUs")
    items = [EngineItem(f"mm{n}", _matmul_model(n, f"mm{n}")) for n in (32, 40, 48, 56)]
    results: dict[str, object] = {}
    killed: list[int] = []

    def on_progress(p):
        if p.rounds == 1 and not killed:
            pids = sorted(_worker_pids())
            assert len(pids) == 2
            os.kill(pids[-1], signal.SIGKILL)  # the later-started: the opening process
            killed.append(pids[-1])

    summary = measure(items, [], RunnerConfig(cores=(cpus[-1],), open_cores=(cpus[0],), max_rounds=8),
                      on_result=lambda it, r: results.__setitem__(it.id, r), on_progress=on_progress)
    assert killed and summary.worker_starts == 3
    assert all(isinstance(r, Measurement) for r in results.values()) and len(results) == 4


def test_a_process_that_cannot_move_to_its_opening_cpu_builds_its_sessions_at_home(monkeypatch):
    from dlbricks.timing import engine as engine_mod

    class Stuck(_Logged):
        def send(self, msg):
            if msg is not None and msg[0] == "pin" and msg[1] is not None:
                self.log.append(("send", self.name, "pin", self.cpus))
                self._replies.append(("failed", None, "Invalid argument"))
                return
            super().send(msg)

    monkeypatch.setattr(engine_mod, "_opening_cpus", lambda config, lanes: [0])
    rng = np.random.default_rng(9)
    log: list[tuple] = []
    names = iter(range(100))
    specs = {f"b{i}": {"ns": 2e5, "cv": 0.02} for i in range(10)}
    results: dict[str, object] = {}
    summary = measure([EngineItem(i, s) for i, s in specs.items()], [], RunnerConfig(cores=(1,)),
                      on_result=lambda it, r: results.__setitem__(it.id, r),
                      worker_factory=lambda c, t: Stuck(c, t, rng=rng, log=log, name=next(names)))
    assert summary.measured == 10 and summary.worker_starts == 2
    assert sum(1 for e in log if e[0] == "send" and e[2] == "pin") == 1  # tried once, then left home


def test_a_worker_whose_parent_is_gone_before_its_configuration_ends_quietly(tmp_path, capsys):
    # The parent ended (SIGTERM, a crash) while this worker was starting: its pipe ends
    # before the configuration arrives. The worker exits 0 without a traceback.
    import os
    import signal

    from dlbricks.timing.engine_worker import main

    beacon = tmp_path / "beacon"
    beacon.write_bytes(b"\xff" * 8)
    to_worker_r, to_worker_w = os.pipe()
    from_worker_r, from_worker_w = os.pipe()
    os.close(to_worker_w)  # the parent is gone: nothing will ever be sent
    sigint = signal.getsignal(signal.SIGINT)  # main ignores Ctrl-C, as a worker does; not pytest's
    try:
        assert main([str(to_worker_r), str(from_worker_w), str(beacon)]) == 0
    finally:
        signal.signal(signal.SIGINT, sigint)
        os.close(from_worker_r)
    assert "Traceback" not in capsys.readouterr().err


def test_a_worker_whose_parent_is_gone_removes_its_beacon_and_exits():
    import os

    from dlbricks.timing.engine_process import _CLOSE, WorkerProcess

    wk = WorkerProcess(RunnerConfig(cache_state="warm"), 60.0)
    path = wk._beacon_path
    try:
        assert os.path.exists(path)
        # What a parent killed with -9 leaves: the end of its pipe, no "stop".
        wk._outbox.put(_CLOSE)
        wk._sender.join(5.0)
        wk.tx.close()
        assert wk.proc.wait(60.0) == 0
        assert not os.path.exists(path)
    finally:
        wk.kill()
