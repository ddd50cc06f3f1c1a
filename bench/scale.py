"""Scale-out on Ray: distributed analysis throughput and per-brick dispatch overhead.

Analysis: a synthetic corpus of ``--files`` ONNX models (conv/relu/pool chains with
random widths, so layers repeat across models but not all) is loaded and digested
locally (:func:`dlbricks.analysis.load_corpus`, one process) and with
:func:`dlbricks.distributed.load_corpus_ray` on a private local Ray cluster of 1 and
of 2 worker processes (``num_cpus``). Each figure is the median of ``--rounds``
timed passes after a warm-up pass (which starts Ray's worker processes); the
distributed corpus is checked to analyse exactly like the local one.

Dispatch overhead: one model of ``--bricks`` distinct single-layer bricks, timed
with one iteration each (the stopping rule out of the way), by the local path
(:func:`dlbricks.pipeline.bench`: an isolated worker fed by the driver) and by the
Ray path (:func:`dlbricks.distributed.bench_on_ray`: one agent on a 1-CPU cluster).
Both store each result as it arrives; the steady-state interval between consecutive
stored results (median and mean) is the cost of one brick, start-up excluded. The
Ray path's per-brick overhead is its interval minus the local one.

Everything binds to 127.0.0.1. Prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

# Read when ray is imported: keep the cluster on loopback, with a token of its own.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

SCHEMA_VERSION = 1


def chain_model(rng: np.random.Generator, name: str, layers: int) -> onnx.ModelProto:
    """A conv/relu chain with random widths (1x8x16x16 input), ending in a pool."""
    nodes, inits = [], []
    c, x = 8, "x"
    for i in range(layers):
        out_c = int(rng.choice([8, 16, 24]))
        k = int(rng.choice([1, 3]))
        w = f"w{i}"
        inits.append(numpy_helper.from_array(np.zeros((out_c, c, k, k), np.float32), w))
        nodes.append(helper.make_node("Conv", [x, w], [f"c{i}"], pads=[k // 2] * 4))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
        c, x = out_c, f"r{i}"
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["y"]))
    graph = helper.make_graph(
        nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 1, 1])], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def relu_bank(n: int) -> onnx.ModelProto:
    """``n`` independent Relu layers on distinct shapes: ``n`` unique G=1 bricks."""
    nodes = [helper.make_node("Relu", [f"x{i}"], [f"y{i}"]) for i in range(n)]
    graph = helper.make_graph(
        nodes, "relu_bank",
        [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [1, i + 1]) for i in range(n)],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, i + 1]) for i in range(n)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def init_ray(cpus: int) -> None:
    import logging

    import ray

    from dlbricks.distributed import TIMING_RESOURCE

    ray.init(num_cpus=cpus, resources={TIMING_RESOURCE: 1}, include_dashboard=False,
             object_store_memory=100 * 2**20, log_to_driver=False, logging_level=logging.WARNING)


def analysis_figures(corpus: Path, rounds: int, workers: list[int]) -> dict:
    import ray

    from dlbricks.analysis import analyze, load_corpus
    from dlbricks.distributed import load_corpus_ray

    files = sorted(corpus.glob("*.onnx"))
    local_s = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        local = load_corpus([corpus])
        local_s.append(time.perf_counter() - t0)
    reference = analyze(local.models, [1, 2, 3])
    reference.pop("timing")
    out = {"files": len(files), "layers": sum(m.n_layers for m in local.models),
           "local_s": statistics.median(local_s), "local_files_per_s": len(files) / statistics.median(local_s)}
    for k in workers:
        init_ray(k)
        try:
            load_corpus_ray(files[: 2 * k])  # starts the worker processes
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                got = load_corpus_ray([corpus])
                times.append(time.perf_counter() - t0)
            result = analyze(got.models, [1, 2, 3])
            result.pop("timing")
        finally:
            ray.shutdown()
        med = statistics.median(times)
        out[f"ray_{k}_s"] = med
        out[f"ray_{k}_files_per_s"] = len(files) / med
        out[f"ray_{k}_all_s"] = times
        out[f"ray_{k}_identical"] = result == reference
        print(f"analysis: {k} worker(s) {len(files) / med:.0f} files/s (local {out['local_files_per_s']:.0f})",
              file=sys.stderr, flush=True)
    if len(workers) > 1:
        out["speedup_2_vs_1"] = out[f"ray_{workers[0]}_s"] / out[f"ray_{workers[-1]}_s"]
    return out


def _intervals(store) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    recs = list(store.results(kind="brick"))
    ts = sorted(datetime.fromisoformat(r.created_at).timestamp() for r in recs)
    gaps = np.diff(ts)
    walls = [r.meta.get("wall_time_s", 0.0) for r in recs if r.ok]
    return float(np.median(gaps)), float((ts[-1] - ts[0]) / (len(ts) - 1)), float(np.mean(walls))


def dispatch_figures(workdir: Path, n: int, core: int) -> dict:
    import ray

    from dlbricks.distributed import bench_on_ray, connect, load_corpus_ray
    from dlbricks.pipeline import bench
    from dlbricks.store import Store
    from dlbricks.timing import RunnerConfig

    path = workdir / "relu_bank.onnx"
    onnx.save(relu_bank(n), path)
    cfg = RunnerConfig(cores=(core,), warmup_iters=0, warmup_time=0.0, min_iters=1, min_time=0.0, max_time=0.0,
                       target_ci=0.0)
    from dlbricks.analysis import load_corpus

    models = load_corpus([path]).models
    out: dict = {"bricks": n, "core": core}
    with Store(workdir / "local.sqlite") as st:
        t0 = time.perf_counter()
        s = bench(models, [1], store=st, config=cfg)
        out["local_wall_s"] = time.perf_counter() - t0
        assert s.bricks_measured == n, s.failures[:3]
        out["local_interval_median_s"], out["local_interval_mean_s"], out["local_timing_wall_s"] = _intervals(st)
    init_ray(1)
    try:
        with connect(), Store(workdir / "ray.sqlite") as st:
            sketches = load_corpus_ray([path]).models
            t0 = time.perf_counter()
            s = bench_on_ray(sketches, [1], store=st, config=cfg)
            out["ray_wall_s"] = time.perf_counter() - t0
            assert s.bricks_measured == n, s.failures[:3]
            out["ray_interval_median_s"], out["ray_interval_mean_s"], out["ray_timing_wall_s"] = _intervals(st)
    finally:
        ray.shutdown()
    out["overhead_per_brick_median_s"] = out["ray_interval_median_s"] - out["local_interval_median_s"]
    out["overhead_per_brick_mean_s"] = out["ray_interval_mean_s"] - out["local_interval_mean_s"]
    print(f"dispatch: local {out['local_interval_median_s'] * 1e3:.1f} ms/brick, ray "
          f"{out['ray_interval_median_s'] * 1e3:.1f} ms/brick", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=400, help="models in the synthetic corpus")
    ap.add_argument("--layers", type=int, default=24, help="conv+relu pairs per model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bricks", type=int, default=150, help="single-layer bricks for the dispatch figure")
    ap.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import ray

    import dlbricks

    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="dlbricks-scale-") as tmp:
        workdir = Path(tmp)
        corpus = workdir / "corpus"
        corpus.mkdir()
        rng = np.random.default_rng(args.seed)
        for i in range(args.files):
            onnx.save(chain_model(rng, f"m{i:04d}", args.layers), corpus / f"m{i:04d}.onnx")
        analysis = analysis_figures(corpus, args.rounds, [1, 2])
        dispatch = dispatch_figures(workdir, args.bricks, args.core)
    result = {
        "schema_version": SCHEMA_VERSION,
        "bench": "scale",
        "context": {
            "dlbricks": dlbricks.__version__,
            "ray": ray.__version__,
            "onnxruntime": __import__("onnxruntime").__version__,
            "python": sys.version.split()[0],
            "cpu_count": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)),
            "loadavg_1min": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        },
        "analysis": analysis,
        "dispatch": dispatch,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
