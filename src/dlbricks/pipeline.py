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
import os
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from dlbricks.corpus import Corpus
from dlbricks.errors import DlbricksError
from dlbricks.evaluation import evaluate
from dlbricks.model import Model, ModelLike, layer_kinds
from dlbricks.progress import Progress
from dlbricks.versions import brick_digest_version, model_digest_version

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.store import Store
    from dlbricks.timing import Failure, Measurement
    from dlbricks.timing.config import RunnerConfig
    from dlbricks.timing.workers import Job

__all__ = ["BenchSummary", "WorkItem", "bench", "evaluate", "missing_work", "plan_work", "unique_bricks",
           "write_whole_model"]

#: What the job loop reports for each job: the job and its measurement or failure.
OnResult = Callable[["Job", "Measurement | Failure"], None]
#: Turns work items into jobs, lazily (a brick is generated just before it is timed).
JobStream = Callable[[Sequence["WorkItem"]], Iterator["Job"]]


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
        # one of its bricks has to be written.
        kinds = {id(m): layer_kinds(m.layers) for m in models}
        store.put_bricks(
            (d, bver, {"g": G, "op_types": [kinds[id(model)][i] for i in members],
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
    todo: list[WorkItem] = []
    reused: dict[str, int] = {}
    for kind in ("brick", "model"):
        of_kind = [w for w in items if w.kind == kind]
        if not of_kind:
            continue
        wanted = [w.digest for w in of_kind]
        version = of_kind[0].version  # one digest version per kind
        missing = set(wanted if force else store.missing(kind, wanted, version, system_id, config_key, retry_failed=retry_failed))
        reused[kind] = len(wanted) - len(missing)
        todo += [w for w in of_kind if w.digest in missing]
    return todo, reused


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
) -> BenchSummary:
    """Measure every unique brick (and, with ``e2e``, every whole model) not yet stored.

    Args:
        models: loaded models.
        Gs: granularities.
        store: the results store; each result is committed as soon as it is measured.
        config: the runner configuration (part of the result key).
        workdir: where bricks are written (default: a temporary folder, removed after).
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

    Returns:
        a :class:`BenchSummary`.
    """
    from dlbricks.bricks import whole_model, write_brick
    from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint
    from dlbricks.timing.workers import Job

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
    for kind, n in reused.items():
        setattr(summary, f"{kind}s_reused", n)

    tmp_ctx = tempfile.TemporaryDirectory(prefix="dlbricks-bricks-") if workdir is None else contextlib.nullcontext(str(workdir))
    with tmp_ctx as wd, Progress(progress, "benchmarking") as bar:
        out = Path(wd)
        bar.set_total(len(todo))
        gen_time = [0.0]
        jobs_meta: dict[str, tuple[str, str]] = {}

        def job_stream(work: Sequence[WorkItem]) -> Iterator[Job]:
            # Generated lazily, between timings: the parent stays idle while a brick runs.
            for w in work:
                kind, d, model, members, G = w.kind, w.digest, w.model, w.members, w.G
                t0 = time.perf_counter()
                path = out / kind / f"{d}.onnx"
                if kind == "brick":
                    path = next((Path(b) / f"{d}.onnx" for b in brick_dirs if (Path(b) / f"{d}.onnx").exists()), path)
                try:
                    if not path.exists():
                        if kind == "brick":
                            assert members is not None
                            _, info = write_brick(model, members, path, seed=seed, digest=d, G=G)
                        else:
                            proto, info = whole_model(model, seed=seed)
                            write_whole_model(proto, path)
                        bounds = info.int_bounds
                    else:
                        bounds = None
                except DlbricksError as exc:
                    _record_failure(kind, d, str(exc))
                    continue
                finally:
                    gen_time[0] += time.perf_counter() - t0
                jobs_meta[f"{kind}:{d}"] = (kind, d)
                yield Job(id=f"{kind}:{d}", path=str(path), int_bounds=bounds or None, seed=seed)

        def _record_failure(kind: str, d: str, error: str) -> None:
            from dlbricks.timing import Failure

            store.put_result(kind, d, bver if kind == "brick" else mver, system_id, config_key, Failure(error))
            _count(kind, ok=False, error=error, digest=d)

        def _count(kind: str, *, ok: bool, error: str = "", digest: str = "") -> None:
            if kind == "brick":
                if ok:
                    summary.bricks_measured += 1
                else:
                    summary.bricks_failed += 1
            else:
                if ok:
                    summary.models_measured += 1
                else:
                    summary.models_failed += 1
            if not ok:
                summary.failures.append({"kind": kind, "digest": digest, "error": error})
                if on_event is not None:
                    on_event(f"{kind} {digest[:12]} failed: {error}")
            bar.advance()

        def on_result(job: Job, result: Measurement | Failure) -> None:
            from dlbricks.timing import Measurement

            kind, d = jobs_meta.pop(job.id)
            store.put_result(kind, d, bver if kind == "brick" else mver, system_id, config_key, result)
            ok = isinstance(result, Measurement)
            _count(kind, ok=ok, error="" if ok else getattr(result, "error", "failed"), digest=d)
            # Bricks this run generated are no longer needed once measured.
            if Path(job.path).parent.parent != out:
                return
            with contextlib.suppress(OSError):
                Path(job.path).unlink()
                Path(job.path + ".data").unlink(missing_ok=True)

        _run_jobs(todo, job_stream, config, on_result, jobs)
        summary.generate_s = gen_time[0]
    summary.wall_s = time.perf_counter() - start
    return summary


def write_whole_model(proto: object, path: Path) -> None:
    """Write a whole-model brick (weights inline or, when large, as external data)
    through a temporary file, so a reader never sees part of one."""
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    onnx.save_model(proto, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)
    os.replace(tmp, path)


def _run_jobs(todo: Sequence[WorkItem], job_stream: JobStream, config: RunnerConfig, on_result: OnResult,
              jobs: int) -> None:
    """Run the job stream on ``jobs`` isolated workers, each pinned to its own core(s)."""
    from dataclasses import replace

    from dlbricks.timing.workers import run_isolated

    if jobs <= 1 or len(todo) <= 1:
        run_isolated(job_stream(todo), config, on_result=on_result)
        return
    import threading

    cores = list(config.cores) if config.cores else list(range(jobs * max(1, config.intra_op_threads)))
    per = max(1, config.intra_op_threads)
    if len(cores) < jobs * per:
        raise DlbricksError(f"--jobs {jobs} needs {jobs * per} cores to pin to, got {len(cores)}")
    shards = [todo[i::jobs] for i in range(jobs)]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def locked(job: Job, result: Measurement | Failure) -> None:
        with lock:
            on_result(job, result)

    def worker(i: int) -> None:
        cfg = replace(config, cores=tuple(cores[i * per : (i + 1) * per]))
        try:
            run_isolated(job_stream(shards[i]), cfg, on_result=locked)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
