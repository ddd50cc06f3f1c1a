"""The fixed cost of one onnxruntime ``Run()`` on this machine, measured with the bricks.

Every brick's time includes one call's fixed cost (entering the session, the executor's
set-up, binding), which a whole model pays once, not once per brick: summed over a
model's bricks it over-predicts models of many tiny layers. Two probe models measured
in the same interleaved run as the bricks tell the fixed cost apart from the per-node
cost: a chain of one ``Abs`` and a chain of nine on a one-element tensor. Per node:
(t9 - t1) / 8; per call: t1 - per node; kept for each round too, so that a brick is
corrected by the cost of the rounds it was measured in. Each probe runs in several sessions, whose
median counts: a session can land in a slow state of its own for its whole life (seen:
one probe session read 7.4 us where every other read 3.4), and one call's cost,
subtracted from every brick, moves a model of two hundred small layers by 20%. The
result is stored per system and runner configuration (like the machine's peaks) with
its standard error, which reconstruction carries into each model's interval (an error
in the per-call cost counts once per brick less one); nothing is fitted to the models
evaluated.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

from dlbricks.timing.stats import MIN_SHARED_ROUNDS, numbered_rounds

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.store import Store
    from dlbricks.timing.engine import EngineItem
    from dlbricks.timing.runner import Failure, Measurement

__all__ = ["NAME", "PROBE_LENGTHS", "CallOverhead", "call_overhead", "call_overhead_ns", "probe_items", "probe_model", "record", "stored"]

#: The chain lengths of the two probes.
PROBE_LENGTHS = (1, 9)
#: Sessions of each probe (their median counts).
PROBE_SESSIONS = 3
#: The calibration's name in the store.
NAME = "call_overhead"


def probe_model(length: int) -> bytes:
    """A chain of ``length`` ``Abs`` nodes on a float[1] tensor, serialized."""
    from onnx import TensorProto, helper

    names = ["x"] + [f"t{i}" for i in range(1, length)] + ["y"]
    nodes = [helper.make_node("Abs", [names[i]], [names[i + 1]]) for i in range(length)]
    graph = helper.make_graph(
        nodes,
        f"call_overhead_probe_{length}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def probe_items(seed: int = 0) -> list[EngineItem]:
    """The probes as measurement-engine items (ids ``probe:<length>:<session>``)."""
    from dlbricks.timing.engine import EngineItem

    # References: a probe measured only in its first few rounds would calibrate the
    # machine of those rounds, not of the bricks' rounds.
    return [EngineItem(f"probe:{n}:{k}", probe_model(n), seed=seed, label=f"call-overhead probe ({n} nodes)",
                       reference=True, kind="probe")
            for n in PROBE_LENGTHS for k in range(PROBE_SESSIONS)]


class CallOverhead(NamedTuple):
    """The calibrated per-call cost and its standard error (nanoseconds), and the cost
    in each round (round number -> ns) of the engine run it was measured in
    (:func:`per_round`; empty for calibrations stored without it)."""

    ns: float
    se_ns: float
    engine_run: str = ""
    by_round: Mapping[int, float] = {}

    def in_rounds(self, engine_run: str, round_nos: Sequence[int]) -> float:
        """The cost in the rounds a result was measured in: the median over those of
        this calibration's rounds (at least ``MIN_SHARED_ROUNDS`` of them, of the same
        engine run), else the whole estimate."""
        if not self.by_round or not engine_run or engine_run != self.engine_run:
            return self.ns
        shared = [self.by_round[r] for r in round_nos if r in self.by_round]
        return float(statistics.median(shared)) if len(shared) >= MIN_SHARED_ROUNDS else self.ns


def call_overhead_from(t1_ns: float, t9_ns: float) -> float:
    """The per-call cost from the two probes' latencies."""
    per_node = max(0.0, (t9_ns - t1_ns) / (PROBE_LENGTHS[1] - PROBE_LENGTHS[0]))
    return max(0.0, t1_ns - per_node)


def _median_and_se(values: list[float], ses: list[float]) -> tuple[float, float]:
    """The median of a probe's session medians and its standard error.

    A session's reading errs by its own sampling error (its ``median_se_ns``) and by the
    state the session landed in; the spread between sessions shows both. The spread is
    taken robustly (MAD), as the median it qualifies ignores one odd session, and never
    below the sessions' own errors; x1.25 for a median rather than a mean.
    """
    k = len(values)
    med = statistics.median(values)
    within = sum(se * se for se in ses) / k
    between = (1.4826 * statistics.median(abs(v - med) for v in values)) ** 2 if k >= 2 else 0.0
    return med, 1.25 * math.sqrt(max(within, between) / k)


def record(store: Store, system_id: str, config_key: str, results: Mapping[str, Measurement | Failure]) -> None:
    """Store the calibration from the probes' results: per length the median over its
    sessions measured, and the standard error of the per-call cost (nothing when every
    session of a length failed)."""
    from dlbricks.timing.runner import Measurement

    meds, ses = [], []
    for n in PROBE_LENGTHS:
        ok = [m for k in range(PROBE_SESSIONS) if isinstance(m := results.get(f"probe:{n}:{k}"), Measurement)]
        if not ok:
            return
        med, se = _median_and_se([float(m.stats.median) for m in ok], [float(m.median_se_ns) for m in ok])
        meds.append(med)
        ses.append(se)
    # overhead = t1 - (t9 - t1) / 8 = (9 t1 - t9) / 8: independent errors in quadrature.
    span = PROBE_LENGTHS[1] - PROBE_LENGTHS[0]
    se_ns = math.hypot(PROBE_LENGTHS[1] / span * ses[0], PROBE_LENGTHS[0] / span * ses[1])
    value: dict[str, Any] = {
        "ns": call_overhead_from(*meds),
        "se_ns": se_ns,
        "probe_ns": dict(zip((str(n) for n in PROBE_LENGTHS), meds)),
    }
    rounds = per_round(results)
    if rounds is not None:
        value["rounds"] = rounds
    store.put_calibration(system_id, config_key, NAME, value)


def per_round(results: Mapping[str, Measurement | Failure]) -> dict[str, Any] | None:
    """The per-call cost in each round of the engine run the probes were measured in:
    ``{"engine_run", "round_nos", "ns"}``, from the median over each length's sessions
    of their medians in that round (rounds where a length has none are left out); None
    without round numbers.

    The probes are measured in every round, the bricks in a few of them, and on a shared
    VM the cost moves in stretches: in one run of four model-zoo models on 2 vCPUs it was
    2.7 us in some quarters of the rounds and 4.0 us in others, and the whole run's cost
    (3.5 us) subtracted from ShuffleNet's bricks, measured in quiet rounds, made its
    normalized latency 0.896 where its own rounds' cost made it 0.925 (eleven other
    runs: 0.894-0.926). So a brick is corrected by the cost of its own rounds
    (:func:`dlbricks.reconstruct.predict`)."""
    from dlbricks.timing.runner import Measurement

    runs: set[str] = set()
    per_length: list[dict[int, float]] = []
    for n in PROBE_LENGTHS:
        by_round: dict[int, list[float]] = {}
        for k in range(PROBE_SESSIONS):
            m = results.get(f"probe:{n}:{k}")
            if not isinstance(m, Measurement) or not m.round_nos:
                continue
            runs.add(m.engine_run)
            for r, v in numbered_rounds(m.round_medians_ns, m.round_nos).items():
                by_round.setdefault(r, []).append(v)
        per_length.append({r: statistics.median(v) for r, v in by_round.items()})
    if len(runs) != 1 or not all(per_length):
        return None
    shared = sorted(set.intersection(*(set(d) for d in per_length)))
    return {"engine_run": runs.pop(), "round_nos": shared,
            "ns": [call_overhead_from(per_length[0][r], per_length[1][r]) for r in shared]}


def stored(store: Store, system_id: str, config_key: str) -> dict[str, Any] | None:
    """The stored calibration, or None."""
    return store.get_calibration(system_id, config_key, NAME)


def call_overhead(store: Store, system_id: str, config_key: str) -> CallOverhead | None:
    """The calibrated per-call cost for this system and configuration, or None
    (calibrations stored before errors were kept have a standard error of 0)."""
    value = stored(store, system_id, config_key)
    if value is None:
        return None
    rounds = value.get("rounds") or {}
    return CallOverhead(float(value["ns"]), float(value.get("se_ns", 0.0)), str(rounds.get("engine_run", "")),
                        dict(zip(rounds.get("round_nos", ()), rounds.get("ns", ()))))


def call_overhead_ns(store: Store, system_id: str, config_key: str) -> float | None:
    """The calibrated per-call cost (ns) for this system and configuration, or None."""
    value = call_overhead(store, system_id, config_key)
    return None if value is None else value.ns
