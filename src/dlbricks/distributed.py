"""Scale out on Ray: parallel corpus analysis and a fleet of timing agents.

Ray (``pip install 'dlbricks[ray]'``) is optional; nothing here imports it until a
function is called, and the single-machine path never does.

Analysis (:func:`load_corpus_ray`): model files are parsed and digested by Ray tasks,
a chunk of paths per task. A task returns a :class:`ModelSketch` per model (name,
path, layer names and kinds, layer digests and slot-annotated edges: flat arrays, no
protobuf), which is everything the dedup, the ``analyze`` report and the choice of
bricks read. The driver merges them in path order, so the result is the local one.

Benchmarking (:func:`bench_on_ray`): every Ray node that offers the custom resource
:data:`TIMING_RESOURCE` can host one timing *agent*, a Ray actor pinned to that node
that holds the resource for its lifetime. An agent reports its own system
fingerprint; agents with the same fingerprint id form one *system kind*. For each
kind the driver asks the store what is missing (no ok result for the brick digest,
digest version, that system id and the run's config key), and the agents of that
kind share those bricks. So one corpus can be benchmarked on several kinds of
machine at once, each brick once per kind, and a rerun measures only what is still
missing for each kind present.

Timing integrity: an agent runs one brick at a time: it generates the brick on its
node (loading the model from its path there, cached), then times it in an isolated
worker process (:func:`dlbricks.timing.workers.run_isolated`) pinned to the node's cores;
session set-up stays off the clock as in the local runner. The driver keeps at most
one brick in flight per agent, and since an agent holds the node's timing slot, no
other dlbricks run (or anything else asking for the slot) times on that node at the
same time. The agent also reserves as many Ray CPUs as it pins cores, so Ray does
not place its own tasks on their share. Start one timing slot per machine (or per
disjoint set of cores, with :data:`CORES_ENV` telling each node its cores).

Cores on a node: ``DLBRICKS_CORES`` (e.g. ``3`` or ``2-3``) in the environment of
``ray start`` names the node's CPUs to pin to; otherwise the run's cores are kept
when the node has them, else the node's last CPUs are used. The count of pinned
cores is the run's, so the config key is the same on every node.

Results stream back: the driver writes each one to the store as it arrives, so an
interrupted run loses only the bricks in flight and resumes like a local one.

Faults: when an agent's node dies (or the agent does), its brick in flight is put
back at the head of its system kind's queue and retried on another agent of that
kind, up to ``max_attempts`` tries in all; after that, or when no node of the kind
is left (and none joins within ``orphan_timeout_s``), it is stored as a failure
``not measured`` (reason ``lost``), which the next run retries. Nodes that join
during a run are used.

Every node needs dlbricks installed and the model files at the same paths (a shared
filesystem), as any Ray job reading files does.

Loopback-only clusters: Ray replaces ``127.0.0.1`` by the machine's outward address
unless the environment has ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (driver and head
node); ``tests/test_ray.py`` shows how to start a two-node cluster bound to
``127.0.0.1`` only.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from dlbricks.cpuset import parse_ranges, usable_cpus
from dlbricks.errors import DlbricksError, ModelError, UsageError
from dlbricks.model import layer_kinds, layer_names
from dlbricks.pipeline import BenchSummary

__all__ = [
    "CORES_ENV",
    "TIMING_RESOURCE",
    "LayerSketch",
    "ModelSketch",
    "RayBenchSummary",
    "bench_on_ray",
    "connect",
    "load_corpus_ray",
    "sketch",
]

#: Custom Ray resource a node offers to host one timing agent (one brick at a time).
TIMING_RESOURCE = "dlbricks_timing_slot"
#: Environment variable of a node (set for ``ray start``): the CPUs its agent pins to.
CORES_ENV = "DLBRICKS_CORES"

_MODEL_CACHE = 4  # loaded models an agent keeps (a corpus is usually walked model by model)


# ----------------------------------------------------------------------------- Ray


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray: pip install 'dlbricks[ray]'") from None
    return ray


def _check_reachable(address: str | None) -> None:
    """Fail fast on a ``host:port`` nobody listens on (Ray would retry for minutes)."""
    import socket

    if not address or address in ("auto", "local") or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise UsageError(f"--ray {address!r}: expected host:port, auto, local or ray://host:port")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5.0).close()
    except OSError as exc:
        raise DlbricksError(f"no Ray head node answers at {address}: {exc}") from None


@contextlib.contextmanager
def connect(address: str | None = "auto", *, namespace: str = "dlbricks") -> Iterator[Any]:
    """Connect this process to a Ray cluster for the duration of the block.

    Args:
        address: ``"auto"`` (the cluster this machine belongs to), ``"host:port"`` of
            a head node, ``"ray://..."``, or ``"local"`` (start a private one-node
            cluster offering one timing slot). If Ray is already initialised in this
            process it is used as is.
        namespace: the Ray namespace of the job.

    Yields:
        the ``ray`` module.

    Raises:
        UsageError: Ray is not installed, or a malformed address.
        DlbricksError: the cluster cannot be reached.
    """
    ray = _ray()
    if ray.is_initialized():
        yield ray
        return
    _check_reachable(address)
    extra: dict[str, Any] = {}
    if address == "local":
        extra = {"resources": {TIMING_RESOURCE: 1}, "include_dashboard": False}
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.WARNING, **extra)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise DlbricksError(f"cannot connect to Ray at {address!r}: {exc}") from None
    # Ray's driver prints cluster events ("node ... marked dead") on stdout, which
    # holds dlbricks' results: while connected, and while shutting down (when Ray
    # flushes the events it held back to dedup them), they go to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            yield ray
        finally:
            ray.shutdown()


def _versions() -> dict[str, Any]:
    """What must match between the driver and a node for digests to mean the same."""
    from dlbricks import __version__
    from dlbricks.versions import brick_digest_version, model_digest_version

    return {"dlbricks": __version__, "brick_digest": brick_digest_version(), "model_digest": model_digest_version()}


def _check_versions(theirs: Mapping[str, Any], where: str) -> None:
    ours = _versions()
    if dict(theirs) != ours:
        raise DlbricksError(f"{where} runs {dict(theirs)}, the driver {ours}: install the same dlbricks everywhere")


# ----------------------------------------------------------------------------- analysis


@dataclass(frozen=True, slots=True)
class LayerSketch:
    """A layer as the driver needs it: its name and ``op_type`` (domain-qualified)."""

    name: str
    kind: str


@dataclass(slots=True)
class ModelSketch:
    """A loaded model reduced to flat data (picklable, a few bytes per layer).

    It has the attributes :class:`~dlbricks.corpus.Corpus`, :func:`dlbricks.analysis.analyze`,
    :func:`dlbricks.pipeline.unique_bricks` and :func:`dlbricks.bricks.model_digest` read,
    so it stands in for a :class:`~dlbricks.model.Model` wherever no ONNX node is needed.
    ``input_shapes`` are the overrides it was loaded with: a node reloads the model
    from ``path`` with them to generate its bricks.
    """

    name: str
    path: str | None
    layers: tuple[LayerSketch, ...]
    digests: np.ndarray
    edge_src: np.ndarray
    edge_src_slot: np.ndarray
    edge_dst: np.ndarray
    edge_dst_slot: np.ndarray
    input_shapes: dict[str, tuple[int, ...]] | None = None

    @property
    def n_layers(self) -> int:
        return len(self.layers)


def sketch(model: Any, input_shapes: Mapping[str, Sequence[int]] | None = None) -> ModelSketch:
    """The :class:`ModelSketch` of a loaded :class:`~dlbricks.model.Model`."""
    return ModelSketch(
        name=model.name,
        path=model.path,
        # Names and kinds without building Layer objects (a fast-loaded model has them lazily).
        layers=tuple(LayerSketch(n, k) for n, k in zip(layer_names(model.layers), layer_kinds(model.layers))),
        digests=np.ascontiguousarray(model.digests),
        edge_src=np.ascontiguousarray(model.edge_src),
        edge_src_slot=np.ascontiguousarray(model.edge_src_slot),
        edge_dst=np.ascontiguousarray(model.edge_dst),
        edge_dst_slot=np.ascontiguousarray(model.edge_dst_slot),
        input_shapes={k: tuple(int(d) for d in v) for k, v in input_shapes.items()} if input_shapes else None,
    )


def _load_chunk(paths: Sequence[str], input_shapes: dict[str, tuple[int, ...]] | None) -> tuple[dict, list[tuple]]:
    """Ray task body: (versions, [(sketch or None, error or None, warnings) per path])."""
    from dlbricks.loading import load

    out = []
    for p in paths:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result: tuple = (sketch(load(p, input_shapes), input_shapes), None)
            except ModelError as exc:
                result = (None, str(exc))
        out.append((*result, [str(w.message) for w in caught]))
    return _versions(), out


def load_corpus_ray(
    paths: Sequence[str | Path],
    input_shapes: dict[str, tuple[int, ...]] | None = None,
    *,
    strict: bool = False,
    on_warning: Callable[[str], None] | None = None,
    chunk_size: int | None = None,
) -> Any:
    """:func:`dlbricks.analysis.load_corpus` with the models parsed by Ray tasks.

    Needs a connected Ray (see :func:`connect`). Paths are expanded here; each task
    loads a chunk of files on whichever node Ray picks, so every node must see the
    files at the same path.

    Args:
        paths: files or folders (searched recursively for ``*.onnx``).
        input_shapes: concrete shapes for symbolic graph inputs, by input name.
        strict: raise the first bad model's error (in path order) instead of skipping it.
        on_warning: called with each loader warning, in path order.
        chunk_size: files per task (default: about four tasks per Ray CPU, at most 16 files).

    Returns:
        a :class:`dlbricks.analysis.LoadedCorpus` whose ``models`` are
        :class:`ModelSketch` objects, in the order the local loader gives.

    Raises:
        UsageError: a missing path or a folder without models.
        ModelError: with ``strict``, a bad model; or no model could be loaded.
        DlbricksError: a node runs another dlbricks (digests would differ).
    """
    from dlbricks.analysis import LoadedCorpus, model_files

    ray = _ray()
    files = [str(f) for f in model_files(paths)]
    shapes = {k: tuple(int(d) for d in v) for k, v in input_shapes.items()} if input_shapes else None
    start = time.perf_counter()
    if chunk_size is None:
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        chunk_size = max(1, min(16, math.ceil(len(files) / (4 * cpus))))
    task = ray.remote(num_cpus=1, max_retries=3)(_load_chunk)
    refs = [task.remote(files[i : i + chunk_size], shapes) for i in range(0, len(files), chunk_size)]
    rows = []
    for versions, chunk in ray.get(refs):
        _check_versions(versions, "a Ray node")
        rows.extend(chunk)
    out = LoadedCorpus(models=[])
    for f, (model, error, caught) in zip(files, rows):
        if error is not None:
            if strict:
                raise ModelError(error)
            out.errors.append({"path": f, "error": error})
        else:
            out.models.append(model)
        out.add_warnings(caught, on_warning)
    return out.done(start)


# ----------------------------------------------------------------------------- the agent


def node_cores(cores: Sequence[int] | None, env: Mapping[str, str] | None = None) -> tuple[int, ...] | None:
    """The CPUs an agent on this node pins to, for a run pinned to ``cores``.

    ``DLBRICKS_CORES`` wins (its first ``len(cores)`` CPUs); else ``cores`` when this
    node may use them all; else this node's last ``len(cores)`` CPUs. None: no pinning.

    Raises:
        DlbricksError: ``DLBRICKS_CORES`` is malformed, names fewer CPUs than the run
            pins, or CPUs this process may not use.
    """
    if cores is None:
        return None
    env = os.environ if env is None else env
    n = len(cores)
    allowed = usable_cpus()
    spec = env.get(CORES_ENV)
    if spec:
        try:
            mine = parse_ranges(spec)
        except ValueError:
            raise DlbricksError(f"{CORES_ENV}={spec!r}: expected CPU ids like 2 or 2-3") from None
        if len(mine) < n or not set(mine[:n]) <= set(allowed):
            raise DlbricksError(f"{CORES_ENV}={spec!r}: need {n} usable CPU(s) of {allowed}")
        return tuple(mine[:n])
    if set(cores) <= set(allowed):
        return tuple(cores)
    if len(allowed) < n:
        raise DlbricksError(f"the run pins {n} CPU(s); this node has {len(allowed)}")
    return tuple(allowed[-n:])


class _Agent:
    """A Ray actor: generates and times bricks on its node, one at a time.

    Timing runs in an isolated worker process (kept across bricks, replaced after a
    crash or a timeout), fed through a queue by a thread that runs
    :func:`dlbricks.timing.workers.run_isolated`; the actor's own thread generates the next
    brick only after the previous result is back, so generation never overlaps a
    timing.
    """

    def __init__(self, config: dict[str, Any], seed: int) -> None:
        from dlbricks.timing import RunnerConfig

        cfg = RunnerConfig.from_dict(config)
        self.setup_error: str | None = None
        try:
            cores = node_cores(cfg.cores)
        except DlbricksError as exc:
            self.setup_error, cores = str(exc), cfg.cores
        self.config = replace(cfg, cores=cores)
        self.seed = seed
        self.workdir = Path(tempfile.mkdtemp(prefix="dlbricks-agent-"))
        self.models: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self.jobs: queue.Queue = queue.Queue()
        self.results: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._serve, name="dlbricks-timing", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        from dlbricks.timing import Failure
        from dlbricks.timing.workers import run_isolated

        done = False

        def jobs() -> Iterator[Any]:
            nonlocal done
            while True:
                job = self.jobs.get()
                if job is None:
                    done = True
                    return
                yield job

        while not done:
            try:
                run_isolated(jobs(), self.config, on_result=lambda job, result: self.results.put(result))
            except Exception as exc:  # the worker could not start: this job fails, the next retries
                self.results.put(Failure(f"timing worker failed: {exc}", "error"))

    def info(self) -> dict[str, Any]:
        """This node: its fingerprint, Ray node id, host, pinned cores."""
        import socket

        import ray

        from dlbricks.timing.sysinfo import system_fingerprint

        return {
            "fingerprint": system_fingerprint(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "cores": list(self.config.cores) if self.config.cores is not None else None,
            "versions": _versions(),
            "error": self.setup_error,
        }

    def _model(self, path: str, shapes: dict[str, tuple[int, ...]] | None) -> Any:
        from dlbricks.loading import load

        key = (path, tuple(sorted((shapes or {}).items())))
        if key in self.models:
            self.models.move_to_end(key)
            return self.models[key]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the driver already reported the loader's warnings
            model = load(path, shapes)
        self.models[key] = model
        while len(self.models) > _MODEL_CACHE:
            self.models.popitem(last=False)
        return model

    def measure(self, item: dict[str, Any]) -> tuple[str, dict[str, Any], float]:
        """Generate and time one brick or whole model.

        Returns:
            ("ok", measurement dict, generation seconds) or ("failed", failure dict, ...).
        """
        from dlbricks.bricks import model_digest, whole_model, write_brick
        from dlbricks.pipeline import write_whole_model
        from dlbricks.timing import Failure, Measurement
        from dlbricks.timing.workers import START_TIMEOUT_S, Job

        if self.setup_error is not None:
            return "failed", Failure(self.setup_error).to_dict(), 0.0
        kind, d = item["kind"], item["digest"]
        path = self.workdir / kind / f"{d}.onnx"
        t0 = time.perf_counter()
        try:
            model = self._model(item["path"], item["input_shapes"])
            if kind == "brick":
                members = list(item["members"])
                got = np.ascontiguousarray(model.digests[members]).tobytes().hex()
                if got != item["expect"]:
                    raise DlbricksError(f"{item['path']}: the model on this node differs from the driver's "
                                        "(layer digests)")
                _, info = write_brick(model, members, path, seed=self.seed, digest=d, G=item["G"])
            else:
                if model_digest(model) != d:
                    raise DlbricksError(f"{item['path']}: the model on this node differs from the driver's "
                                        "(model digest)")
                proto, info = whole_model(model, seed=self.seed)
                write_whole_model(proto, path)
        except DlbricksError as exc:
            return "failed", Failure(str(exc)).to_dict(), time.perf_counter() - t0
        gen_s = time.perf_counter() - t0
        try:
            self.jobs.put(Job(id=f"{kind}:{d}", path=str(path), int_bounds=info.int_bounds or None, seed=self.seed))
            try:
                # run_isolated enforces the job's timeout; this only guards a dead serving thread.
                result = self.results.get(timeout=self.config.timeout_s + START_TIMEOUT_S + 60.0)
            except queue.Empty:
                result = Failure(f"{path}: no result from the timing worker", "timeout")
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
                Path(str(path) + ".data").unlink(missing_ok=True)
        if isinstance(result, Measurement):
            return "ok", result.to_dict(), gen_s
        return "failed", result.to_dict(), gen_s

    def close(self) -> None:
        """Stop the timing worker and remove the agent's files."""
        self.jobs.put(None)
        self.thread.join(30.0)
        shutil.rmtree(self.workdir, ignore_errors=True)


# ----------------------------------------------------------------------------- the driver


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
    item: _Item | None = None
    measured: int = 0
    failed: int = 0
    lost: bool = False
    created: float = field(default_factory=time.monotonic)


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

    Returns:
        a :class:`RayBenchSummary`.

    Raises:
        DlbricksError: no node can time (none offers the timing resource or matches
            the targets, or no agent started within ``start_timeout_s``).
    """
    from dlbricks.pipeline import missing_work, plan_work
    from dlbricks.progress import Progress
    from dlbricks.timing.sysinfo import fingerprint_id
    from dlbricks.timing import Failure, Measurement

    ray = _ray()
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
    payloads: dict[tuple[str, str], dict[str, Any]] = {}
    for w in work:
        m = w.model
        if not m.path:
            raise DlbricksError("a model without a file path cannot be benchmarked on Ray (nodes load it by path)")
        payload: dict[str, Any] = {"kind": w.kind, "digest": w.digest, "path": m.path,
                                   "input_shapes": m.input_shapes, "G": int(w.G)}
        if w.members is not None:
            payload["members"] = [int(i) for i in w.members]
            payload["expect"] = np.ascontiguousarray(m.digests[w.members]).tobytes().hex()
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
    agent_cls = ray.remote(_Agent)
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
        items, reused = missing_work(work, store, sid, config_key, force=force, retry_failed=retry_failed)
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
        item, agent.item = agent.item, None
        msg = f"node {agent.node_id[:12]} lost ({why})"
        if item is not None and agent.system_id is not None:
            item.attempts += 1
            if item.attempts >= max_attempts:
                summary.lost += 1
                record(agent.system_id, item, Failure(f"not measured: {msg}; {item.attempts} attempt(s)", "lost"), None)
            else:
                summary.retries += 1
                queues[agent.system_id].appendleft(item)
                msg += f"; {item.kind} {item.digest[:12]} put back"
        event(msg)

    def dispatch() -> None:
        for agent in agents.values():
            if agent.lost or agent.system_id is None or agent.item is not None:
                continue
            q = queues[agent.system_id]
            if q:
                agent.item = q.popleft()
                pending[agent.actor.measure.remote(agent.item.payload)] = ("measure", agent)

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
                busy = any(a.item is not None for a in agents.values())
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
                        elif agent.item is not None and agent.system_id is not None:
                            # The agent raised (its node is fine): this item fails, the agent goes on.
                            item, agent.item = agent.item, None
                            record(agent.system_id, item, Failure(f"agent error: {str(exc).splitlines()[0]}"), agent)
                        continue
                    except ray.exceptions.RayError as exc:
                        lose(agent, type(exc).__name__)
                        continue
                    if what == "info":
                        try:
                            _check_versions(value["versions"], f"node {agent.node_id[:12]}")
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
                        status, payload, gen_s = value
                        item, agent.item = agent.item, None
                        summary.generate_s += gen_s
                        result = Measurement.from_dict(payload) if status == "ok" else Failure.from_dict(payload)
                        record(agent.system_id, item, result, agent)  # type: ignore[arg-type]
                now = time.monotonic()
                if now - last_refresh >= refresh_s:
                    last_refresh = now
                    discover()
                    orphans(now)
        finally:
            closing = [a.actor.close.remote() for a in agents.values() if not a.lost and a.system_id is not None]
            with contextlib.suppress(Exception):
                ray.wait(closing, num_returns=len(closing), timeout=30)
            for a in agents.values():
                with contextlib.suppress(Exception):
                    ray.kill(a.actor)
    summary.nodes = [
        {"node_id": a.node_id, "system_id": a.system_id, "hostname": (a.info or {}).get("hostname"),
         "cores": (a.info or {}).get("cores"), "measured": a.measured, "failed": a.failed, "lost": a.lost}
        for a in agents.values() if a.info is not None
    ]
    if summary.systems:
        summary.system_id = next(iter(summary.systems))
    summary.wall_s = time.perf_counter() - start
    return summary
