"""The driver of a Ray benchmark: one queue of missing bricks per system kind, at most
one brick in flight per agent, results committed as they arrive, lost bricks retried."""

from __future__ import annotations

import collections
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Sequence, cast

import numpy as np

from dlbricks.distributed.agent import TimingAgent
from dlbricks.distributed.cluster import TIMING_RESOURCE, check_versions, ray_module
from dlbricks.distributed.sketches import ModelSketch
from dlbricks.errors import DlbricksError, UsageError
from dlbricks.pipeline import BenchSummary
from dlbricks.timing.hostload import busy_warning

#: The most items one agent measures per call.
BATCH = 16


@dataclass(slots=True)
class RayBenchSummary(BenchSummary):
    """What one distributed benchmarking pass did.

    The counters have the meaning of :class:`dlbricks.pipeline.BenchSummary`, summed
    over system kinds (each kind measures what it misses); ``systems`` splits them by
    kind, ``nodes`` lists the agents, ``retries`` counts bricks put back after their
    node was lost, ``lost`` bricks recorded ``not measured``.
    """

    systems: dict[str, dict[str, Any]] = field(default_factory=dict)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    nodes_lost: int = 0
    retries: int = 0
    lost: int = 0


@dataclass(slots=True)
class _Item:
    kind: str
    digest: str
    version: int
    payload: dict[str, Any]
    attempts: int = 0


@dataclass(slots=True)
class _AgentState:
    node_id: str
    actor: Any
    system_id: str | None = None
    info: dict[str, Any] | None = None
    items: list[_Item] = field(default_factory=list)
    measured: int = 0
    failed: int = 0
    lost: bool = False
    created: float = field(default_factory=time.monotonic)
    #: What else ran on its node while it timed (``TimingAgent.host``).
    host: dict[str, Any] | None = None


def busy_nodes(nodes: Sequence[Mapping[str, Any]]) -> list[str]:
    """A warning line for each node (``RayBenchSummary.nodes``) that was busy with other
    work while it timed."""
    lines = []
    for node in nodes:
        busy = busy_warning(node.get("host"))
        if busy is not None:
            lines.append(f"node {node.get('hostname') or node.get('node_id')}: {busy}")
    return lines


def _matches(node: Mapping[str, Any], resources: Mapping[str, float], labels: Mapping[str, str]) -> bool:
    have = node.get("Resources") or {}
    if have.get(TIMING_RESOURCE, 0) < 1:
        return False
    if any(have.get(k, 0) < v for k, v in resources.items()):
        return False
    node_labels = node.get("Labels") or {}
    return all(node_labels.get(k) == v for k, v in labels.items())


def bench_on_ray(
    models: Sequence[ModelSketch],
    Gs: Sequence[int],
    *,
    store: Any,
    config: Any,
    force: bool = False,
    e2e: bool = False,
    bricks: bool = True,
    seed: int = 0,
    retry_failed: bool = True,
    resources: Mapping[str, float] | None = None,
    labels: Mapping[str, str] | None = None,
    max_attempts: int = 3,
    start_timeout_s: float = 120.0,
    orphan_timeout_s: float = 60.0,
    refresh_s: float = 2.0,
    progress: bool = False,
    on_event: Callable[[str], None] | None = None,
    remeasure: Callable[[str], Collection[str]] | None = None,
) -> RayBenchSummary:
    """Measure every unique brick (and with ``e2e`` every whole model) on a Ray fleet.

    Needs a connected Ray (see :func:`connect`); the store is written here, on the
    driver, as each result arrives. See the module docstring for the scheduling,
    per-system and fault rules.

    Args:
        models: the corpus, as :class:`ModelSketch` (e.g. from :func:`load_corpus_ray`).
        Gs: granularities.
        store: the results store.
        config: the runner configuration (its key is part of every result's key).
        force: re-measure, on every system kind, even what the store has.
        e2e: also time each whole model.
        bricks: time the bricks (False: only end-to-end runs).
        seed: seed of synthetic weights and inputs.
        retry_failed: measure again what is stored as failed (or not measured).
        resources: only nodes offering at least these Ray resources time; the agent
            also requests them.
        labels: only nodes with these Ray node labels time.
        max_attempts: tries of one brick across lost nodes before it is recorded as
            not measured.
        start_timeout_s: how long an agent may take to start (e.g. while another run
            holds its node's timing slot) before its node is left out.
        orphan_timeout_s: how long bricks of a system kind whose nodes are all lost
            wait for a node of that kind to join.
        refresh_s: how often the driver looks for new nodes.
        progress: show a progress bar on stderr.
        on_event: called with one line per notable event (node lost, brick failed).
        remeasure: given a system kind's id when its first agent reports, the digests
            (bricks or whole models) to measure again there although the store has them
            (``--remeasure-unstable``: the precision check of that kind's results,
            :meth:`dlbricks.quality.Assessment.remeasure`), as ``remeasure`` of
            :func:`dlbricks.pipeline.bench` does locally.

    Returns:
        a :class:`RayBenchSummary`.

    Raises:
        DlbricksError: no node can time (none offers the timing resource or matches
            the targets, or no agent started within ``start_timeout_s``).
    """
    from dlbricks.pipeline import missing_work, plan_work
    from dlbricks.progress import Progress
    from dlbricks.timing import Failure, Measurement
    from dlbricks.timing.sysinfo import fingerprint_id

    ray = ray_module()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    start = time.perf_counter()
    resources = dict(resources or {})
    labels = dict(labels or {})
    if max_attempts < 1:
        raise UsageError(f"max_attempts must be at least 1, got {max_attempts}")
    config_key = store.put_config(config)
    summary = RayBenchSummary(system_id="", config_key=config_key)

    # The work, independent of systems, and what each agent is sent for an item.
    work = plan_work(models, Gs, store, bricks=bricks, e2e=e2e)
    # Sketches have no layer types: the catalogue gets a new brick's shapes from the
    # agent that generates it.
    bver = next((w.version for w in work if w.kind == "brick"), 0)
    shaped = store.bricks_with_shapes([w.digest for w in work if w.kind == "brick"], bver)
    payloads: dict[tuple[str, str], dict[str, Any]] = {}
    for w in work:
        m = cast(ModelSketch, w.model)  # plan_work hands back the sketches it was given
        if not m.path:
            raise DlbricksError("a model without a file path cannot be benchmarked on Ray (nodes load it by path)")
        payload: dict[str, Any] = {"kind": w.kind, "digest": w.digest, "path": m.path,
                                   "input_shapes": m.input_shapes, "G": int(w.G)}
        if w.members is not None:
            payload["members"] = [int(i) for i in w.members]
            payload["expect"] = np.ascontiguousarray(m.digests[w.members]).tobytes().hex()
            payload["shapes"] = w.digest not in shaped
        payloads[(w.kind, w.digest)] = payload
    summary.bricks_total = sum(w.kind == "brick" for w in work)
    if e2e:
        summary.models_total = len(models)

    queues: dict[str, collections.deque[_Item]] = {}
    orphaned_since: dict[str, float] = {}
    agents: dict[str, _AgentState] = {}  # by node id
    excluded: set[str] = set()
    pending: dict[Any, tuple[str, _AgentState]] = {}  # ObjectRef -> ("info" | "measure", agent)
    total = [0]  # items to do, over every system kind found so far
    agent_cls = ray.remote(TimingAgent)
    cfg_dict = config.to_dict()
    n_cores = len(config.cores) if config.cores is not None else 0

    def event(line: str) -> None:
        if on_event is not None:
            on_event(line)

    def count(sid: str, kind: str, key: str, n: int = 1) -> None:
        setattr(summary, f"{kind}s_{key}", getattr(summary, f"{kind}s_{key}") + n)
        per = summary.systems[sid]
        per[f"{kind}s_{key}"] = per.get(f"{kind}s_{key}", 0) + n

    def add_system(sid: str, fingerprint: Mapping[str, Any]) -> int:
        store.put_system(fingerprint)
        summary.systems[sid] = {"cpu": (fingerprint.get("cpu") or {}).get("model"), "nodes": 0}
        again = set(remeasure(sid)) if remeasure is not None and not force else set()
        items, reused = missing_work([w for w in work if w.digest not in again], store, sid, config_key, force=force,
                                     retry_failed=retry_failed)
        if again:  # measured again whatever the store holds: as with force, for just these
            items += missing_work([w for w in work if w.digest in again], store, sid, config_key, force=True)[0]
        for kind, n in reused.items():
            count(sid, kind, "reused", n)
        queues[sid] = collections.deque(_Item(w.kind, w.digest, w.version, payloads[(w.kind, w.digest)]) for w in items)
        return len(items)

    def discover() -> None:
        for node in ray.nodes():
            nid = node.get("NodeID")
            if not node.get("Alive") or nid in agents or nid in excluded or not _matches(node, resources, labels):
                continue
            cpus = min(float(n_cores), float((node.get("Resources") or {}).get("CPU", 0)))
            actor = agent_cls.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False),
                resources={TIMING_RESOURCE: 1, **resources},
                num_cpus=cpus,
                max_restarts=0,
                max_task_retries=0,
            ).remote(cfg_dict, seed)
            agent = _AgentState(nid, actor)
            agents[nid] = agent
            pending[actor.info.remote()] = ("info", agent)

    def record(sid: str, item: _Item, result: Any, agent: _AgentState | None) -> None:
        store.put_result(item.kind, item.digest, item.version, sid, config_key, result)
        ok = isinstance(result, Measurement)
        count(sid, item.kind, "measured" if ok else "failed")
        if agent is not None:
            if ok:
                agent.measured += 1
            else:
                agent.failed += 1
        if not ok:
            summary.failures.append({"kind": item.kind, "digest": item.digest, "system_id": sid, "error": result.error})
            event(f"{item.kind} {item.digest[:12]} on {sid} failed: {result.error}")
        bar.advance()

    def lose(agent: _AgentState, why: str) -> None:
        agent.lost = True
        excluded.add(agent.node_id)
        with contextlib.suppress(Exception):
            ray.kill(agent.actor)
        if agent.system_id is None:  # never started: nothing was running there
            event(f"node {agent.node_id[:12]} cannot time: {why}")
            return
        summary.nodes_lost += 1
        items, agent.items = agent.items, []
        msg = f"node {agent.node_id[:12]} lost ({why})"
        put_back = 0
        for item in reversed(items):
            item.attempts += 1
            if item.attempts >= max_attempts:
                summary.lost += 1
                record(agent.system_id, item, Failure(f"not measured: {msg}; {item.attempts} attempt(s)", "lost"), None)
            else:
                summary.retries += 1
                queues[agent.system_id].appendleft(item)
                put_back += 1
        if put_back:
            msg += f"; {put_back} item(s) put back"
        event(msg)

    def dispatch() -> None:
        for agent in agents.values():
            if agent.lost or agent.system_id is None or agent.items:
                continue
            q = queues[agent.system_id]
            if q:
                # Batches interleave within themselves on the node's engine; bounded so
                # that results stream back and a lost node loses little.
                live = sum(1 for a in agents.values() if a.system_id == agent.system_id and not a.lost)
                size = max(1, min(BATCH, -(-len(q) // max(1, live))))
                agent.items = [q.popleft() for _ in range(min(size, len(q)))]
                pending[agent.actor.measure.remote([i.payload for i in agent.items])] = ("measure", agent)

    def orphans(now: float) -> None:
        probing = any(a.system_id is None and not a.lost for a in agents.values())
        for sid, q in queues.items():
            alive = any(a.system_id == sid and not a.lost for a in agents.values())
            if not q or alive or probing:
                orphaned_since.pop(sid, None)
                continue
            since = orphaned_since.setdefault(sid, now)
            if now - since >= orphan_timeout_s:
                event(f"no live node of system {sid}: {len(q)} item(s) not measured")
                while q:
                    item = q.popleft()
                    summary.lost += 1
                    record(sid, item, Failure(f"not measured: no live node of system {sid}", "lost"), None)

    with Progress(progress, "benchmarking on ray") as bar:
        discover()
        if not agents:
            raise DlbricksError(
                f"no Ray node can time bricks: none offers the resource {TIMING_RESOURCE!r}"
                + (f" and matches {resources or ''} {labels or ''}".rstrip() if resources or labels else "")
                + f" (start nodes with --resources '{{\"{TIMING_RESOURCE}\": 1}}')"
            )
        try:
            last_refresh = time.monotonic()
            while True:
                dispatch()
                now = time.monotonic()
                for a in agents.values():
                    if a.system_id is None and not a.lost and now - a.created > start_timeout_s:
                        lose(a, f"its agent did not start within {start_timeout_s:.0f} s "
                                "(timing slot held by another run?)")
                probing = any(a.system_id is None and not a.lost for a in agents.values())
                busy = any(a.items for a in agents.values())
                if not probing and not busy:
                    if not summary.systems:
                        raise DlbricksError("no timing agent could start on any Ray node (see the warnings above)")
                    if not any(queues.values()):
                        break
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=refresh_s) if pending else ([], [])
                if not pending:
                    time.sleep(min(refresh_s, 0.2))
                for ref in ready:
                    what, agent = pending.pop(ref)
                    if agent.lost:
                        continue
                    try:
                        value = ray.get(ref)
                    except ray.exceptions.RayTaskError as exc:
                        if what == "info":
                            lose(agent, str(exc).splitlines()[0])
                        elif agent.items and agent.system_id is not None:
                            # The agent raised (its node is fine): its batch fails, the agent goes on.
                            items, agent.items = agent.items, []
                            for item in items:
                                record(agent.system_id, item, Failure(f"agent error: {str(exc).splitlines()[0]}"), agent)
                        continue
                    except ray.exceptions.RayError as exc:
                        lose(agent, type(exc).__name__)
                        continue
                    if what == "info":
                        try:
                            check_versions(value["versions"], f"node {agent.node_id[:12]}")
                        except DlbricksError as exc:
                            value["error"] = str(exc)
                        if value.get("error"):
                            lose(agent, value["error"])
                            continue
                        sid = fingerprint_id(value["fingerprint"])
                        agent.system_id, agent.info = sid, value
                        if sid not in summary.systems:
                            total[0] += add_system(sid, value["fingerprint"])
                            bar.set_total(total[0])
                        summary.systems[sid]["nodes"] += 1
                    else:
                        items, agent.items = agent.items, []
                        read = [(item, v[3]) for item, v in zip(items, value) if v[3]]
                        if read:
                            store.put_brick_shapes((item.digest, item.version, shapes) for item, shapes in read)
                            for item, _ in read:  # another system kind's agent need not read them again
                                item.payload["shapes"] = False
                        for item, (status, payload, gen_s, _) in zip(items, value):
                            summary.generate_s += gen_s
                            result = Measurement.from_dict(payload) if status == "ok" else Failure.from_dict(payload)
                            record(agent.system_id, item, result, agent)  # type: ignore[arg-type]
                now = time.monotonic()
                if now - last_refresh >= refresh_s:
                    last_refresh = now
                    discover()
                    orphans(now)
        finally:
            live = [a for a in agents.values() if not a.lost and a.system_id is not None]
            # An actor answers in order: its load, then its files removed; one wait for both.
            asked = [a.actor.host.remote() for a in live]
            closing = [a.actor.close.remote() for a in live]
            with contextlib.suppress(Exception):
                ray.wait(asked + closing, num_returns=len(asked) + len(closing), timeout=30)
            for a, ref in zip(live, asked):
                with contextlib.suppress(Exception):
                    a.host = ray.get(ref, timeout=0)
            for a in agents.values():
                with contextlib.suppress(Exception):
                    ray.kill(a.actor)
    summary.nodes = [
        {"node_id": a.node_id, "system_id": a.system_id, "hostname": (a.info or {}).get("hostname"),
         "cores": (a.info or {}).get("cores"), "measured": a.measured, "failed": a.failed, "lost": a.lost,
         "host": a.host}
        for a in agents.values() if a.info is not None
    ]
    for line in busy_nodes(summary.nodes):
        event(line)
    if summary.systems:
        summary.system_id = next(iter(summary.systems))
    summary.wall_s = time.perf_counter() - start
    return summary
