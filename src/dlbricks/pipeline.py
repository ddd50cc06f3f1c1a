"""Benchmarking a corpus through its bricks, and reconstructing model latency.

The flow: split every model at each G, dedup the sequences, look each unique brick up
in the store (keyed by brick digest, digest version, system fingerprint and runner
configuration), generate and time only what is missing (in isolated worker
processes, each result committed at once), then rebuild every model's latency from
its bricks and compare with end-to-end runs.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from dlbricks.corpus import Corpus
from dlbricks.graph import critical_path, sequence_graph
from dlbricks.errors import DlbricksError
from dlbricks.model import Model, layer_kinds
from dlbricks.versions import brick_digest_version, model_digest_version

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.store import Store
    from dlbricks.timing.config import RunnerConfig


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


class _Progress:
    """Progress on stderr: a rich bar (done, total, ETA) on a terminal, else a plain
    line every 10% or 30 s, so logs of long runs show that they advance."""

    def __init__(self, enabled: bool, description: str) -> None:
        self.enabled = enabled
        self.description = description
        self._progress = None
        self._task = None
        self._total = 0
        self._done = 0
        self._start = time.perf_counter()
        self._last_line = 0.0
        self._last_pct = -1

    def __enter__(self) -> "_Progress":
        if self.enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TimeElapsedColumn(),
                console=Console(file=sys.stderr),
                transient=False,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(self.description, total=0)
        return self

    def set_total(self, total: int) -> None:
        self._total = total
        if self._progress is not None:
            self._progress.update(self._task, total=total)

    def advance(self, n: int = 1) -> None:
        self._done += n
        if self._progress is not None:
            self._progress.advance(self._task, n)
        elif self.enabled and self._total:
            now = time.perf_counter()
            pct = 100 * self._done // self._total
            if pct // 10 > self._last_pct // 10 or now - self._last_line > 30 or self._done == self._total:
                elapsed = now - self._start
                eta = elapsed / self._done * (self._total - self._done)
                print(f"{self.description}: {self._done}/{self._total} ({pct}%), {elapsed:.0f} s elapsed, "
                      f"eta {eta:.0f} s", file=sys.stderr, flush=True)
                self._last_line, self._last_pct = now, pct

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(None, None, None)


def unique_bricks(models: Sequence[Model], Gs: Sequence[int]) -> dict[str, tuple[Model, np.ndarray, int]]:
    """Unique bricks over all G: digest hex -> (source model, members, G first seen at).

    A single-layer window has the same digest whichever G produced it, so bricks
    shared between granularities are measured once.
    """
    corpus = Corpus(models)
    out: dict[str, tuple[Model, np.ndarray, int]] = {}
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
    model: Any  # a Model, or anything with the same digests/layers (distributed.ModelSketch)
    members: np.ndarray | None
    G: int


def plan_work(
    models: Sequence[Any],
    Gs: Sequence[int],
    store: "Store",
    *,
    bricks: bool = True,
    e2e: bool = False,
    e2e_models: Sequence[Any] | None = None,
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
    store: "Store",
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
    store: "Store",
    config: "RunnerConfig",
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
    with tmp_ctx as wd, _Progress(progress, "benchmarking") as bar:
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
                            _write_whole(proto, path)
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

        def on_result(job: "Job", result: object) -> None:
            from dlbricks.timing import Measurement

            kind, d = jobs_meta.pop(job.id)
            store.put_result(kind, d, bver if kind == "brick" else mver, system_id, config_key, result)  # type: ignore[arg-type]
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


def _write_whole(proto: object, path: Path) -> None:
    """Write a whole-model brick (weights inline or, when large, as external data)."""
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    onnx.save_model(proto, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)
    import os

    os.replace(tmp, path)


def _run_jobs(todo, job_stream, config, on_result, jobs: int) -> None:  # type: ignore[no-untyped-def]
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

    def locked(job, result):  # type: ignore[no-untyped-def]
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


# ----------------------------------------------------------------------- reconstruction


@dataclass(slots=True)
class Prediction:
    """A model's latency rebuilt from its bricks (seconds), with a bootstrap interval."""

    model: str
    G: int
    mode: str
    latency_s: float
    ci_low_s: float
    ci_high_s: float
    bricks: int
    unique_bricks: int

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]


class MissingResults(DlbricksError):
    """Bricks needed for a reconstruction have no stored result."""

    def __init__(self, missing: list[str], G: int) -> None:
        shown = ", ".join(d[:12] for d in missing[:5]) + (" ..." if len(missing) > 5 else "")
        super().__init__(
            f"{len(missing)} brick(s) at G={G} have no stored result ({shown}); "
            "run `dlbricks bench` first or pass --measure-missing"
        )
        self.missing = missing


def bootstrap_medians(times_ns: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """``n_boot`` bootstrap replicates of the median of ``times_ns`` (nanoseconds).

    Small samples (n <= 400) are resampled exactly. For larger ones the replicate's
    median is drawn by rank: the rank of a resample's median among the sorted samples
    is asymptotically normal around n/2 with standard deviation sqrt(n)/2 (the binomial
    count of draws below a point), which avoids materialising n_boot x n resamples.
    """
    t = np.sort(np.asarray(times_ns, dtype=np.float64))
    n = t.shape[0]
    if n == 0:
        raise DlbricksError("cannot bootstrap an empty sample")
    if n <= 400:
        idx = rng.integers(0, n, size=(n_boot, n))
        return np.median(t[idx], axis=1)
    ranks = np.rint((n - 1) / 2 + 0.5 * np.sqrt(n) * rng.standard_normal(n_boot)).astype(np.int64)
    return t[np.clip(ranks, 0, n - 1)]


def reconstruct(
    models: Sequence[Model],
    G: int,
    *,
    store: "Store",
    system_id: str,
    config_key: str,
    modes: Sequence[str] = ("sequential", "parallel"),
    n_boot: int = 400,
    seed: int = 0,
    corpus: Corpus | None = None,
) -> list[Prediction]:
    """Predict each model's latency from its bricks' stored medians.

    sequential = the sum of its sequences' latencies; parallel = the longest path
    through its graph of sequences. The interval is the 2.5-97.5 percentile range over
    bootstrap replicates: each brick's median is resampled from its own kept iteration
    times (independently per brick; every occurrence of a brick shares its replicate).

    Raises:
        MissingResults: some bricks have no ok result (lists them).
    """
    corpus = corpus or Corpus(models)
    sp = corpus.split(G)
    bver = brick_digest_version()
    digests = [bytes(d).hex() for d in sp.unique_digests]
    records = {}
    missing = []
    for d in digests:
        rec = store.get_result("brick", d, bver, system_id, config_key)
        if rec is None or not rec.ok:
            missing.append(d)
        else:
            records[d] = rec
    if missing:
        raise MissingResults(missing, G)
    rng = np.random.default_rng(seed)
    medians = np.array([records[d].median_ns for d in digests], dtype=np.float64)
    boots = np.stack([bootstrap_medians(records[d].times_ns, n_boot, rng) for d in digests]) if digests else np.zeros((0, n_boot))
    out: list[Prediction] = []
    for i, model in enumerate(models):
        seq_ids = sp.model_seq_ids(i)
        model_split = sp.model_split(i)
        for mode in modes:
            if mode == "sequential":
                point = float(medians[seq_ids].sum())
                reps = boots[seq_ids].sum(axis=0)
            elif mode == "parallel":
                src, dst = sequence_graph(model, model_split)
                from dlbricks.graph import Graph

                sg = Graph(np.zeros((len(seq_ids), 16), np.uint8), src, dst)
                point = float(critical_path(sg, medians[seq_ids])[0])
                reps = np.array([critical_path(sg, boots[seq_ids, b])[0] for b in range(n_boot)])
            else:
                raise DlbricksError(f"unknown reconstruction mode {mode!r} (sequential or parallel)")
            lo, hi = np.percentile(reps, [2.5, 97.5])
            out.append(
                Prediction(model.name, G, mode, point * 1e-9, float(lo) * 1e-9, float(hi) * 1e-9,
                           int(seq_ids.shape[0]), int(np.unique(seq_ids).shape[0]))
            )
    return out


def geomean(values: Sequence[float]) -> float:
    v = np.asarray([x for x in values if x > 0], dtype=np.float64)
    return float(np.exp(np.log(v).mean())) if v.size else float("nan")


def evaluate(
    models: Sequence[Model],
    Gs: Sequence[int],
    *,
    store: "Store",
    config: "RunnerConfig",
    measure_missing: bool = True,
    workdir: str | Path | None = None,
    seed: int = 0,
    progress: bool = False,
    n_boot: int = 400,
    e2e_models: Sequence[Model] | None = None,
    brick_dirs: Sequence[str | Path] = (),
) -> dict:
    """The paper's experiments: constructed vs end-to-end latency and speedups per G.

    Measures what is missing first (bricks and whole models), then reports per model
    and G the end-to-end latency, the sequential and parallel constructed latencies,
    normalized latency (constructed / end-to-end) with its interval; per G the
    geometric mean of normalized latency, the paper's speedup (sum of end-to-end
    latencies / sum of unique brick latencies) and the wall-clock speedup (time to
    benchmark every model end to end / time to benchmark the unique bricks, same
    statistical rules, set-up included).
    """
    from dlbricks.bricks import model_digest
    from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint

    whole = {m.name: m for m in (e2e_models if e2e_models is not None else models)}
    if measure_missing:
        bench(models, Gs, store=store, config=config, workdir=workdir, e2e=True, seed=seed, progress=progress,
              e2e_models=list(whole.values()), brick_dirs=brick_dirs)
    system_id = fingerprint_id(system_fingerprint())
    config_key = config.key()
    mver = model_digest_version()
    bver = brick_digest_version()
    corpus = Corpus(models)

    e2e: dict[str, object] = {}
    missing_models = []
    for m in models:
        if m.name not in whole:
            raise DlbricksError(f"{m.name}: no end-to-end model given for it")
        rec = store.get_result("model", model_digest(whole[m.name]), mver, system_id, config_key)
        if rec is None or not rec.ok:
            missing_models.append(m.name)
        e2e[m.name] = rec
    if missing_models:
        raise DlbricksError(
            f"no end-to-end result for {len(missing_models)} model(s) ({', '.join(missing_models[:5])}); "
            "run `dlbricks bench --e2e` first or drop --no-measure"
        )

    rows: dict[str, dict] = {m.name: {"name": m.name, "path": m.path, "layers": m.n_layers, "per_g": {}} for m in models}
    per_g = []
    bricks_out: list[dict] = []
    e2e_total = sum(e2e[m.name].median_ns for m in models) * 1e-9  # type: ignore[union-attr]
    e2e_wall = sum(_wall_s(e2e[m.name]) for m in models)
    for G in Gs:
        preds = reconstruct(models, G, store=store, system_id=system_id, config_key=config_key,
                            n_boot=n_boot, seed=seed, corpus=corpus)
        norm_seq, norm_par = [], []
        for p in preds:
            e = e2e[p.model].median_ns * 1e-9  # type: ignore[union-attr]
            entry = rows[p.model]["per_g"].setdefault(str(G), {"e2e_s": e})
            entry[p.mode] = {
                "latency_s": p.latency_s,
                "ci_low_s": p.ci_low_s,
                "ci_high_s": p.ci_high_s,
                "normalized": p.latency_s / e,
                "normalized_ci": [p.ci_low_s / e, p.ci_high_s / e],
            }
            entry["bricks"] = p.bricks
            entry["unique_bricks"] = p.unique_bricks
            (norm_seq if p.mode == "sequential" else norm_par).append(p.latency_s / e)
        sp = corpus.split(G)
        unique = [bytes(d).hex() for d in sp.unique_digests]
        recs = [store.get_result("brick", d, bver, system_id, config_key) for d in unique]
        occurrences = sp.occurrences().sum(axis=0)
        for u, (d, rec) in enumerate(zip(unique, recs)):
            m, members = sp.first_occurrence(u)
            median_s = rec.median_ns * 1e-9  # type: ignore[union-attr]
            bricks_out.append({
                "G": G,
                "digest": d,
                "occurrences": int(occurrences[u]),
                "median_s": median_s,
                "ci_low_s": rec.stats["ci_low"] * 1e-9,  # type: ignore[union-attr,index]
                "ci_high_s": rec.stats["ci_high"] * 1e-9,  # type: ignore[union-attr,index]
                "op_types": [models[m].layers[i].kind for i in members],
                "contribution_s": median_s * int(occurrences[u]),
            })
        brick_total = sum(r.median_ns for r in recs) * 1e-9  # type: ignore[union-attr]
        brick_wall = sum(_wall_s(r) for r in recs)
        per_g.append(
            {
                "G": G,
                "unique_bricks": len(unique),
                "bricks": sp.n_sequences,
                "geomean_normalized": geomean(norm_seq),
                "min_normalized": float(min(norm_seq)),
                "max_normalized": float(max(norm_seq)),
                "geomean_normalized_parallel": geomean(norm_par),
                "speedup": e2e_total / brick_total if brick_total > 0 else float("nan"),
                "wallclock_speedup": e2e_wall / brick_wall if brick_wall > 0 else float("nan"),
                "e2e_total_s": e2e_total,
                "bricks_total_s": brick_total,
                "e2e_wall_s": e2e_wall,
                "bricks_wall_s": brick_wall,
            }
        )
    for m in models:
        r = rows[m.name]
        r["e2e_s"] = e2e[m.name].median_ns * 1e-9  # type: ignore[union-attr]
        r["e2e_ci_s"] = [e2e[m.name].stats["ci_low"] * 1e-9, e2e[m.name].stats["ci_high"] * 1e-9]  # type: ignore[union-attr]
        g1 = r["per_g"].get("1")
        if g1:  # the paper's Section 2: layer latencies summed, and along the critical path
            r["layer_sum_s"] = g1["sequential"]["latency_s"]
            r["layer_critical_path_s"] = g1["parallel"]["latency_s"]
    return {
        "schema_version": 1,
        "system_id": system_id,
        "config_key": config_key,
        "config": config.to_dict(),
        "G": list(Gs),
        "per_g": per_g,
        "models": list(rows.values()),
        "bricks": bricks_out,
    }


def _wall_s(rec: object) -> float:
    """Seconds spent measuring one result, set-up and warm-up included (the runner's
    ``wall_time_s``); for results stored without it, samples times their mean."""
    meta = getattr(rec, "meta", None) or {}
    if "wall_time_s" in meta:
        return float(meta["wall_time_s"])
    stats = getattr(rec, "stats", None) or {}
    return float(stats.get("n", 0) * stats.get("mean", 0.0) * 1e-9)
