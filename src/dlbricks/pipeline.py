"""Benchmarking a corpus through its bricks: planning and measuring.

The flow: split every model at each G, dedup the sequences, look each unique brick up
in the store (keyed by brick digest, digest version, system fingerprint and runner
configuration), then generate and time only what is missing (in isolated worker
processes, each result committed at once). Rebuilding a model's latency from its
bricks is :mod:`dlbricks.reconstruct`; comparing it with end-to-end runs is
:func:`evaluate` (:mod:`dlbricks.evaluation`, re-exported here).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Collection, Sequence, cast

import numpy as np

from dlbricks.corpus import Corpus
from dlbricks.errors import ArgumentError
from dlbricks.evaluation import evaluate
from dlbricks.model import Model, ModelLike, layer_kinds
from dlbricks.progress import Progress
from dlbricks.timing import calibration
from dlbricks.timing.engine import EngineItem, EngineProgress, Group, measure
from dlbricks.timing.engine_process import remove_stale_spools, spool_dir, spool_prefix
from dlbricks.timing.runner import Failure, Measurement
from dlbricks.timing.session import SerializedModel
from dlbricks.versions import brick_digest_version, model_digest_version
from dlbricks.weight_pool import WeightPool

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.store import Store
    from dlbricks.timing.config import RunnerConfig

__all__ = ["BenchSummary", "WorkItem", "bench", "evaluate", "missing_work", "plan_work", "unique_bricks",
           "precision_groups"]

@dataclass(slots=True)
class BenchSummary:
    """What one benchmarking pass did."""

    system_id: str
    config_key: str
    bricks_total: int = 0
    bricks_reused: int = 0
    bricks_measured: int = 0
    bricks_failed: int = 0
    models_total: int = 0
    models_reused: int = 0
    models_measured: int = 0
    models_failed: int = 0
    generate_s: float = 0.0
    wall_s: float = 0.0
    failures: list[dict[str, str]] = field(default_factory=list)
    #: What else ran on the machine while timing (:meth:`HostLoad.to_dict`; None when
    #: nothing was timed or the kernel does not say).
    host: dict[str, float | bool] | None = None

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def unique_bricks(models: Sequence[ModelLike], Gs: Sequence[int]) -> dict[str, tuple[ModelLike, np.ndarray, int]]:
    """Unique bricks over all G: digest hex -> (source model, members, G first seen at).

    A single-layer window has the same digest whichever G produced it, so bricks
    shared between granularities are measured once.
    """
    corpus = Corpus(models)
    out: dict[str, tuple[ModelLike, np.ndarray, int]] = {}
    for G in Gs:
        sp = corpus.split(G)
        for u in range(sp.n_unique):
            d = bytes(sp.unique_digests[u]).hex()
            if d not in out:
                m, members = sp.first_occurrence(u)
                out[d] = (models[m], members, G)
    return out


@dataclass(frozen=True)
class WorkItem:
    """One thing to time: a unique brick (``members`` of ``model``, first seen at ``G``)
    or a whole model (``members`` None, ``G`` 0), keyed by ``digest`` and ``version``."""

    kind: str  # "brick" | "model"
    digest: str
    version: int
    model: ModelLike  # a Model; on Ray a distributed.ModelSketch, which a node reloads
    members: np.ndarray | None
    G: int


def brick_shapes(model: ModelLike, members: Sequence[int] | np.ndarray) -> list[list[str | None]] | None:
    """A brick's shapes as the catalogue and ``dlbricks results`` give them: per member
    layer, its input types (``"float32[1x4x8x8]"``, None for an omitted optional input).

    Reads the layers, so it builds a lazily loaded model's :class:`~dlbricks.model.Layer`
    objects. None for a model without layer types (a Ray :class:`~dlbricks.distributed.ModelSketch`).
    """
    layers = model.layers
    out: list[list[str | None]] = []
    for i in members:
        types = getattr(layers[int(i)], "input_types", None)
        if types is None:
            return None
        out.append([None if t is None else str(t) for t in types])
    return out


def plan_work(
    models: Sequence[ModelLike],
    Gs: Sequence[int],
    store: Store,
    *,
    bricks: bool = True,
    e2e: bool = False,
    e2e_models: Sequence[ModelLike] | None = None,
) -> list[WorkItem]:
    """The unique bricks (and with ``e2e`` the whole models) of a corpus, registered in
    the store's catalogue; what is already measured is for the caller to ask the store,
    per system (:meth:`Store.missing`). Used by :func:`bench` and by the Ray driver.
    """
    from dlbricks.bricks import model_digest

    items: list[WorkItem] = []
    if bricks:
        bver = brick_digest_version()
        catalogue = unique_bricks(models, Gs)
        # Kinds without building Layer objects: a fast-loaded model builds them only if
        # one of its bricks has to be written. Shapes need the layers, so they are read
        # only for bricks the catalogue has none for: new bricks, which are about to be
        # generated (and the layers built) anyway. A rerun builds nothing.
        kinds = {id(m): layer_kinds(m.layers) for m in models}
        known = store.bricks_with_shapes(catalogue, bver)
        store.put_bricks(
            (d, bver, {"g": G, "op_types": [kinds[id(model)][i] for i in members],
                       "shapes": None if d in known else brick_shapes(model, members),
                       "meta": {"source_model": model.name, "layers": len(members)}})
            for d, (model, members, G) in catalogue.items()
        )
        items += [WorkItem("brick", d, bver, m, members, G) for d, (m, members, G) in catalogue.items()]
    if e2e:
        mver = model_digest_version()
        whole = {model_digest(m): m for m in (e2e_models if e2e_models is not None else models)}
        for d, m in whole.items():
            store.put_model(d, mver, name=m.name, meta={"path": m.path, "layers": m.n_layers})
        items += [WorkItem("model", d, mver, m, None, 0) for d, m in whole.items()]
    # Model by model: each whole model, then the bricks first seen in it. The engine opens
    # sessions in this order as far as its memory budget goes, so where a corpus does not
    # fit the budget at once each model is measured in the same rounds as its own bricks,
    # the rounds its normalized latency is taken over (evaluation.same_rounds_latency),
    # rather than all models at the end, apart from the bricks of the others.
    position = {id(m): i for i, m in enumerate(models)}
    position.update({id(m): i for i, m in enumerate(e2e_models or ())})
    items.sort(key=lambda w: (position.get(id(w.model), len(models)), w.kind != "model"))
    return items


def missing_work(
    items: Sequence[WorkItem],
    store: Store,
    system_id: str,
    config_key: str,
    *,
    force: bool = False,
    retry_failed: bool = True,
) -> tuple[list[WorkItem], dict[str, int]]:
    """The items the store holds no result for on ``system_id`` with ``config_key``
    (all of them with ``force``), and per kind how many it already holds (reused)."""
    missing: dict[str, set[str]] = {}
    reused: dict[str, int] = {}
    for kind in ("brick", "model"):
        of_kind = [w for w in items if w.kind == kind]
        if not of_kind:
            continue
        wanted = [w.digest for w in of_kind]
        version = of_kind[0].version  # one digest version per kind
        missing[kind] = set(wanted if force else store.missing(kind, wanted, version, system_id, config_key,
                                                               retry_failed=retry_failed))
        reused[kind] = len(wanted) - len(missing[kind])
    # In the order of ``items`` (see plan_work).
    return [w for w in items if w.digest in missing.get(w.kind, ())], reused


def paired_e2e_models(models: Sequence[ModelLike], e2e_models: Sequence[ModelLike] | None) -> list[ModelLike]:
    """The models timed end to end for ``models``: ``e2e_models`` (one per model), or
    the models themselves.

    Raises:
        ArgumentError: ``e2e_models`` is not one per model.
    """
    if e2e_models is None:
        return list(models)
    if len(e2e_models) != len(models):
        raise ArgumentError(f"{len(models)} models but {len(e2e_models)} end-to-end models: give one per model")
    return list(e2e_models)


def bench(
    models: Sequence[Model],
    Gs: Sequence[int],
    *,
    store: Store,
    config: RunnerConfig,
    workdir: str | Path | None = None,
    force: bool = False,
    e2e: bool = False,
    bricks: bool = True,
    jobs: int = 1,
    seed: int = 0,
    progress: bool = False,
    retry_failed: bool = True,
    on_event: Callable[[str], None] | None = None,
    e2e_models: Sequence[Model] | None = None,
    brick_dirs: Sequence[str | Path] = (),
    remeasure: Collection[str] = (),
) -> BenchSummary:
    """Measure every unique brick (and, with ``e2e``, every whole model) not yet stored.

    Args:
        models: loaded models.
        Gs: granularities.
        store: the results store; each result is committed as soon as it is measured.
        config: the runner configuration (part of the result key).
        workdir: where the run keeps its weight pool (default: a temporary folder, in
            memory where there is /dev/shm); the pool is removed after.
        force: re-measure even what the store has.
        e2e: also time each whole model (synthetic weights, like the bricks).
        bricks: time the bricks (False: only end-to-end runs).
        jobs: worker processes timing at once. More than one shares the machine
            between timings; each worker gets its own core from ``config.cores``.
        seed: seed of synthetic weights and inputs.
        progress: show a progress bar on stderr.
        retry_failed: measure again bricks whose stored result is a failure.
        e2e_models: the models to time end to end, when they differ from the models
            decomposed (runtime-graph decomposition times the source models end to end).
        brick_dirs: folders of bricks written by :func:`dlbricks.bricks.generate_bricks`
            (``<digest>.onnx``); a brick found there is timed from there, not rebuilt.
        remeasure: digests (bricks or whole models) to measure again although the
            store has them (``--remeasure-unstable``: :meth:`dlbricks.quality.Assessment.remeasure`).

    Returns:
        a :class:`BenchSummary`.
    """
    from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint

    paired_e2e_models(models, e2e_models)
    start = time.perf_counter()
    fingerprint = system_fingerprint()
    system_id = fingerprint_id(fingerprint)
    store.put_system(fingerprint)
    config_key = store.put_config(config)
    summary = BenchSummary(system_id=system_id, config_key=config_key)
    bver = brick_digest_version()
    mver = model_digest_version()

    items = plan_work(models, Gs, store, bricks=bricks, e2e=e2e, e2e_models=e2e_models)
    summary.bricks_total = sum(w.kind == "brick" for w in items)
    if e2e:
        summary.models_total = len(e2e_models if e2e_models is not None else models)
    todo, reused = missing_work(items, store, system_id, config_key, force=force, retry_failed=retry_failed)
    if remeasure:
        queued = {w.digest for w in todo}
        again = [w for w in items if w.digest in remeasure and w.digest not in queued]
        todo += again
        for w in again:
            reused[w.kind] -= 1
    for kind, n in reused.items():
        setattr(summary, f"{kind}s_reused", n)

    remove_stale_spools()
    tmp_ctx = (tempfile.TemporaryDirectory(prefix=spool_prefix("bricks"), dir=spool_dir()) if workdir is None
               else contextlib.nullcontext(str(workdir)))
    with tmp_ctx as wd, Progress(progress, "benchmarking") as bar, WeightPool(Path(wd) / "weights", seed=seed) as pool:
        bar.set_total(len(todo))
        engine_items = [_engine_item(w, brick_dirs, seed, pool) for w in todo]
        kinds = {f"{w.kind}:{w.digest}": (w.kind, w.digest) for w in todo}
        # Rounds an interrupted run checkpointed go on from where they were.
        partial = {
            f"{kind}:{d}": st
            for kind, ver in (("brick", bver), ("model", mver))
            for d, st in store.get_partials(kind, ver, system_id, config_key).items()
        }
        if not force:
            for it in engine_items:
                it.resume = partial.get(it.id)

        def on_checkpoint(states: dict[str, dict]) -> None:
            store.put_partials(
                (kinds[i][0], kinds[i][1], bver if kinds[i][0] == "brick" else mver, system_id, config_key, st)
                for i, st in states.items() if i in kinds
            )

        probes: dict[str, Measurement | Failure] = {}
        if bricks and config.call_overhead and (force or calibration.stored(store, system_id, config_key) is None):
            # First: a reference is measured for as long as anything else is, and the
            # engine opens items in order as memory allows.
            engine_items = calibration.probe_items(seed) + engine_items
        done = [0]

        def on_result(item: EngineItem, result: Measurement | Failure) -> None:
            if item.id not in kinds:  # a calibration probe: recorded below, not a brick
                probes[item.id] = result
                return
            kind, d = kinds[item.id]
            store.put_result(kind, d, bver if kind == "brick" else mver, system_id, config_key, result)
            ok = isinstance(result, Measurement)
            if kind == "brick":
                summary.bricks_measured += ok
                summary.bricks_failed += not ok
            else:
                summary.models_measured += ok
                summary.models_failed += not ok
            if not ok:
                error = getattr(result, "error", "failed")
                summary.failures.append({"kind": kind, "digest": d, "error": error})
                if on_event is not None:
                    on_event(f"{kind} {d[:12]} failed: {error}")
            done[0] += 1

        def on_progress(p: EngineProgress) -> None:
            status = f"opening sessions ({p.opened} of {p.total})" if p.phase == "opening" else f"round {p.rounds}"
            bar.update(done[0], eta_s=p.eta_s, status=status)

        engine = measure(engine_items, precision_groups(models, Gs, todo), config, on_result=on_result, jobs=jobs,
                         on_checkpoint=on_checkpoint, on_progress=on_progress)
        if engine.host is not None and engine_items:
            summary.host = engine.host.to_dict()
            if engine.host.busy and on_event is not None:
                on_event(engine.host.describe())
        if probes:
            calibration.record(store, system_id, config_key, probes)
        summary.generate_s = sum(it.prep_s for it in engine_items)
    summary.wall_s = time.perf_counter() - start
    return summary


def pooled_model(model: Model, members: Sequence[int] | np.ndarray, pool: WeightPool, *, seed: int,
                 digest: str, G: int) -> tuple[SerializedModel, dict[str, int] | None]:
    """Layers ``members`` of ``model`` (a brick, or the whole model) as the engine gets
    them: a serialized graph whose large weights are windows of ``pool``, and the
    bounds of its integer inputs."""
    from dlbricks.bricks import generate_brick

    window = pool.model()
    proto, info = generate_brick(model, members, seed=seed, digest=digest, G=G, pool=window)
    source = SerializedModel(proto.SerializeToString(), str(pool.folder), window.nbytes, tuple(sorted(window.files)))
    return source, dict(info.int_bounds) or None


#: Operations per byte of weights from which a brick counts as compute-bound. A fully
#: connected layer at batch 1 does 0.5 (2 per 4-byte weight; 2 at int8); a transformer's
#: projection over 128 tokens 64, a ResNet convolution 25-800; a core's ridge point
#: between its peak arithmetic and its share of memory bandwidth lies between (4-15).
COMPUTE_BOUND_OPS_PER_BYTE = 8.0


def compute_bound(model: ModelLike, members: Sequence[int] | np.ndarray) -> bool:
    """Whether layers ``members`` of ``model`` do at least
    :data:`COMPUTE_BOUND_OPS_PER_BYTE` operations per byte of their weights (analytic
    counts, :func:`dlbricks.roofline.costmodel.layer_cost`): in a model run their
    weights stream from memory under their arithmetic, so cache state ``"auto"`` times
    them warm. False when a layer has no formula, or for a model without layer types
    (the size rule then decides alone)."""
    from dlbricks.roofline.costmodel import model_cost

    layers = getattr(model, "layers", None)
    if layers is None:
        return False
    cost = model_cost(layers[int(i)] for i in members)
    ops = cost.flops + cost.int_ops
    return cost.n_without_formula == 0 and cost.weight_bytes > 0 and ops >= COMPUTE_BOUND_OPS_PER_BYTE * cost.weight_bytes


def _engine_item(w: WorkItem, brick_dirs: Sequence[str | Path], seed: int, pool: WeightPool) -> EngineItem:
    """A work item as the engine's item: generated when its session is opened, its
    large weights windows of the run's weight pool, handed over as a small serialized
    graph (no file written, no weights copied)."""
    from dlbricks.bricks import whole_model_window

    model = cast(Model, w.model)  # bench plans loaded Models; only Ray's driver plans sketches

    def source() -> tuple[str | SerializedModel, dict[str, int] | None]:
        members: Sequence[int] | np.ndarray
        if w.kind == "brick":
            for b in brick_dirs:
                if (Path(b) / f"{w.digest}.onnx").exists():
                    return str(Path(b) / f"{w.digest}.onnx"), None
            assert w.members is not None
            members, digest, G = w.members, w.digest, w.G
        else:
            members, digest, G = whole_model_window(model)
        return pooled_model(model, members, pool, seed=seed, digest=digest, G=G)

    label = f"{w.kind} {w.digest[:12]}" if w.kind == "brick" else f"model {getattr(w.model, 'name', w.digest[:12])}"
    # Whole models are not engine references (measured over every round of their
    # bricks): that did not make their estimates reproduce any better between runs,
    # and it keeps the largest sessions running for as long as the slowest bricks.
    return EngineItem(f"{w.kind}:{w.digest}", source, seed=seed, warm=w.kind == "model", label=label, kind=w.kind,
                      compute_bound=w.kind == "brick" and w.members is not None and compute_bound(model, w.members))


def precision_groups(models: Sequence[ModelLike], Gs: Sequence[int], todo: Sequence[WorkItem]) -> list[Group]:
    """What the engine's precision is stated for: each model's latency reconstructed at
    each G (its bricks weighted by occurrences), restricted to the bricks being
    measured (already-stored bricks are what they are). Whole models are their own
    groups (the engine makes a group of every item no group names)."""
    wanted = {w.digest for w in todo if w.kind == "brick"}
    if not wanted:
        return []
    corpus = Corpus(models)
    groups = []
    for G in Gs:
        sp = corpus.split(G)
        ids = [f"brick:{bytes(d).hex()}" for d in sp.unique_digests]
        keep = np.array([bytes(d).hex() in wanted for d in sp.unique_digests], dtype=bool)
        occ = sp.occurrences()
        for i, m in enumerate(models):
            cols = np.nonzero((occ[i] > 0) & keep)[0]
            if cols.size:
                groups.append(Group(f"{m.name} G={G}", {ids[u]: float(occ[i, u]) for u in cols}))
    return groups
