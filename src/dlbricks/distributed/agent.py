"""The timing agent: a Ray actor that holds its node's timing slot, generates each brick
on that node and times it in an isolated worker pinned to the node's cores."""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import shutil
import tempfile
import threading
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from dlbricks.cpuset import parse_ranges, usable_cpus
from dlbricks.distributed.cluster import dlbricks_versions
from dlbricks.errors import DlbricksError

#: Environment variable of a node (set for ``ray start``): the CPUs its agent pins to.
CORES_ENV = "DLBRICKS_CORES"


_MODEL_CACHE = 4  # loaded models an agent keeps (a corpus is usually walked model by model)


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


class TimingAgent:
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
            "versions": dlbricks_versions(),
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
