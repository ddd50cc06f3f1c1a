"""The timing agent: a Ray actor that holds its node's timing slot, generates bricks on
that node and measures them with the same engine as a local bench, pinned to the
node's cores."""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

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
    """A Ray actor: generates and measures batches of bricks on its node.

    Each batch runs through the measurement engine (:mod:`dlbricks.timing.engine`), as a
    local bench does: interleaved rounds over the batch's sessions in a worker process
    pinned to the node's cores, a crashing or hanging session recorded as failed while
    the rest go on. Bricks are generated on this node when their sessions open.
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
        from dlbricks.timing.engine_process import spool_dir, spool_prefix

        # In memory where there is tmpfs (the weight pool's files), named so that a
        # later run on this node removes it if this process is killed.
        self.workdir = Path(tempfile.mkdtemp(prefix=spool_prefix("agent"), dir=spool_dir()))
        self.models: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self.shapes: dict[str, Any] = {}  # item id -> the brick's shapes, read while generating it
        self.loads: list[Any] = []  # each batch's HostLoad: what else ran on this node meanwhile

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

    def _compute_bound(self, item: dict[str, Any]) -> bool:
        """:func:`dlbricks.pipeline.compute_bound` of a brick payload (False if its model
        cannot be loaded here: its source then reports why)."""
        from dlbricks.pipeline import compute_bound

        try:
            model = self._model(item["path"], item["input_shapes"])
        except DlbricksError:
            return False
        return compute_bound(model, list(item["members"]))

    def _source(self, item: dict[str, Any], pool: Any) -> Any:
        """The engine's source callable for one payload: generates it on this node,
        its large weights from the batch's weight pool (as a local bench does)."""
        from dlbricks.bricks import model_digest, whole_model_window
        from dlbricks.pipeline import brick_shapes, pooled_model

        def source() -> tuple[Any, dict[str, int] | None]:
            kind, d = item["kind"], item["digest"]
            model = self._model(item["path"], item["input_shapes"])
            if kind == "brick":
                members = list(item["members"])
                got = np.ascontiguousarray(model.digests[members]).tobytes().hex()
                if got != item["expect"]:
                    raise DlbricksError(f"{item['path']}: the model on this node differs from the driver's "
                                        "(layer digests)")
                if item.get("shapes"):  # the driver's catalogue lacks them; the layers are built now
                    self.shapes[f"{kind}:{d}"] = brick_shapes(model, members)
                return pooled_model(model, members, pool, seed=self.seed, digest=d, G=item["G"])
            if model_digest(model) != d:
                raise DlbricksError(f"{item['path']}: the model on this node differs from the driver's "
                                    "(model digest)")
            members, digest, G = whole_model_window(model)
            return pooled_model(model, members, pool, seed=self.seed, digest=digest, G=G)

        return source

    def measure(self, items: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], float, Any]]:
        """Generate and measure a batch of bricks or whole models, in the given order.

        Returns:
            per item ("ok", measurement dict, generation seconds, shapes) or ("failed",
            failure dict, ...); shapes (:func:`dlbricks.pipeline.brick_shapes`) for a
            brick whose payload asks for them, else None.
        """
        from dlbricks.timing import Failure, Measurement
        from dlbricks.timing.engine import EngineItem, measure

        if self.setup_error is not None:
            return [("failed", Failure(self.setup_error).to_dict(), 0.0, None) for _ in items]
        from dlbricks.weight_pool import WeightPool

        self.shapes.clear()
        results: dict[str, Any] = {}
        with WeightPool(self.workdir / "weights", seed=self.seed) as pool:
            engine_items = [
                EngineItem(f"{it['kind']}:{it['digest']}", self._source(it, pool), seed=self.seed,
                           warm=it["kind"] == "model", label=f"{it['kind']} {it['digest'][:12]}", kind=it["kind"],
                           compute_bound=it["kind"] == "brick" and self._compute_bound(it))
                for it in items
            ]
            try:
                summary = measure(engine_items, [], self.config, on_result=lambda it, r: results.__setitem__(it.id, r))
            except DlbricksError as exc:  # the worker could not start: this batch fails, the next retries
                return [("failed", Failure(f"timing worker failed: {exc}", "error").to_dict(), 0.0, None)
                        for _ in items]
        if summary.host is not None:
            self.loads.append(summary.host)
        out = []
        for it in engine_items:
            r = results.get(it.id) or Failure(f"{it.label}: no result from the engine", "error")
            out.append(("ok" if isinstance(r, Measurement) else "failed", r.to_dict(), it.prep_s,
                        self.shapes.pop(it.id, None)))
        return out

    def host(self) -> dict[str, Any] | None:
        """What else ran on this node while its batches were timed
        (:meth:`dlbricks.timing.hostload.HostLoad.to_dict`; None when nothing was)."""
        from dlbricks.timing.hostload import combine_loads

        load = combine_loads(self.loads)
        return load.to_dict() if load is not None else None

    def close(self) -> None:
        """Remove the agent's files."""
        shutil.rmtree(self.workdir, ignore_errors=True)
