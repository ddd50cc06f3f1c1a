"""Speed and memory of the C++ core on a synthetic architecture-search corpus.

Usage: python bench/core.py [--sizes 10000,100000,1000000] [--repeat 5] [--analyze-repeat 15]
       [--oneshot-repeat 9] [-o out.json]

The corpus: models of 80-120 layers drawn from 30 layer kinds (4 widths each), mostly
chains, with about 12% of layers an Add fed by a skip connection from 2-6 layers back
(so some layers have two consumers) and about 2% of edges reading a second output.
Node lists are topologically sorted, as ONNX requires.

The process is pinned to one CPU. Each figure is a discarded warmup plus ``--repeat``
values (median, MAD, min, raw values), as CPU time of the calling thread (``*_cpu_s``:
robust to other processes sharing the machine) and wall time (``*_wall_s``):
  * ``generate_wall_s``: building the flat numpy arrays (not part of dlbricks).
  * ``corpus_build_*``: ``Corpus(graphs)`` from per-model ``Graph`` views (Python:
    concatenates the arrays). Not included in ``layers_per_s``.
  * ``core_split_*``: ``Corpus.split(3)`` on a fresh Corpus: per model topological
    order, split at G=3, sequence digests, then corpus-wide dedup of layers and
    sequences. ``layers_per_s`` = layers / median CPU time of this.
  * ``python_*``: tests/reference.py doing the same on Python lists, one run (the
    numpy->list conversion, ``python_convert_cpu_s``, is excluded). At a size where the
    per-layer time of the previous size predicts more than 120 s it is extrapolated.
Both implementations must give identical unique-sequence digests, ids and members.

Memory: each size runs in two fresh subprocesses that read the arrays from .npy files
and build the Corpus. ``bytes_per_layer`` is (ru_maxrss of the one that then splits)
minus (ru_maxrss of the one that does not), per layer. As a cross-check the splitting
process resets its high-water mark (/proc/self/clear_refs) right before the split and
reports VmHWM - VmRSS (``hwm_bytes_per_layer``).

``analyze_split``: ``dlbricks analyze`` over the nine light models of onnx's test data,
with onnx parsing, shape inference and onnx's reference evaluator timed apart from the
total (the split), and, in runs of their own alternating with those, the fast loader's
C++ passes and the core calls too (``breakdown_median``: a timer around each of
dlbricks' calls would add its own cost to dlbricks' share of the split). These runs repeat
the command in one process (warm, as a pipeline calling dlbricks would); onnx's work is
its parsing, shape inference, operator schema lookups and reference evaluator.

``analyze_oneshot``: the same command once per fresh process (``--oneshot-repeat``), as
one command-line run makes it: first-use work (canonical heads, schema lookups, argparse)
included, module imports timed apart (``import_s``).

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import hashlib
import io
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import dlbricks

# The pure-Python reference lives with the tests, which check the core against it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import reference as pycore  # noqa: E402

SCHEMA_VERSION = 1
G = 3
N_KINDS = 30
N_WIDTHS = 4
ADD_KIND = 0
SKIP_RATE = 0.12
SECOND_OUTPUT_RATE = 0.02
ARRAY_KEYS = ("node_offsets", "edge_offsets", "digests", "src", "dst", "src_slot", "dst_slot")
PYTHON_LIMIT_S = 120.0  # measure pure Python at a size only if its estimate is below this


# -- the synthetic corpus -----------------------------------------------------------
def make_corpus_arrays(n_layers: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Flat arrays of a corpus of about ``n_layers`` layers (models of 80-120 layers)."""
    rng = np.random.default_rng(seed)
    n_models = max(1, n_layers // 100)
    sizes = rng.integers(80, 121, size=n_models)
    node_offsets = np.zeros(n_models + 1, dtype=np.int64)
    np.cumsum(sizes, out=node_offsets[1:])
    n = int(node_offsets[-1])
    model_of = np.repeat(np.arange(n_models), sizes)
    base = node_offsets[:-1][model_of]
    local = np.arange(n, dtype=np.int64) - base
    size_of = sizes[model_of]

    # Layer identity: a kind (Zipf-like frequencies) and a width growing by stage.
    p = 1.0 / np.arange(1, N_KINDS + 1) ** 1.1
    kind = rng.choice(N_KINDS, size=n, p=p / p.sum())
    width = np.minimum(N_WIDTHS - 1, local * N_WIDTHS // size_of)

    # Chain edges v-1 -> v, plus skip edges into Add layers from 2..6 layers back.
    chain_dst = np.flatnonzero(local >= 1)
    skip_dst = np.flatnonzero((local >= 2) & (rng.random(n) < SKIP_RATE))
    skip_src = np.maximum(skip_dst - rng.integers(2, 7, size=skip_dst.size), base[skip_dst])
    kind[skip_dst] = ADD_KIND
    vocab = np.frombuffer(
        b"".join(hashlib.blake2b(f"kind{k}/width{w}".encode(), digest_size=16).digest()
                 for k in range(N_KINDS) for w in range(N_WIDTHS)),
        dtype=np.uint8,
    ).reshape(-1, 16)
    digests = vocab[kind * N_WIDTHS + width]

    src = np.concatenate([chain_dst - 1, skip_src])
    dst = np.concatenate([chain_dst, skip_dst])
    dst_slot = np.concatenate([np.zeros(chain_dst.size, np.int32), np.ones(skip_dst.size, np.int32)])
    src_slot = (rng.random(src.size) < SECOND_OUTPUT_RATE).astype(np.int32)
    order = np.lexsort((dst_slot, dst))  # grouped by model, sorted by (dst, dst_slot)
    src, dst, src_slot, dst_slot = src[order], dst[order], src_slot[order], dst_slot[order]
    edge_offsets = np.zeros(n_models + 1, dtype=np.int64)
    np.cumsum(np.bincount(model_of[dst], minlength=n_models), out=edge_offsets[1:])
    edge_base = node_offsets[:-1][model_of[dst]]
    return {
        "node_offsets": node_offsets,
        "edge_offsets": edge_offsets,
        "digests": np.ascontiguousarray(digests),
        "src": (src - edge_base).astype(np.int32),
        "dst": (dst - edge_base).astype(np.int32),
        "src_slot": src_slot,
        "dst_slot": dst_slot,
    }


def make_graphs(a: dict[str, np.ndarray]) -> list[dlbricks.Graph]:
    """One ``Graph`` per model; its arrays are views into the flat arrays."""
    no, eo = a["node_offsets"].tolist(), a["edge_offsets"].tolist()
    return [
        dlbricks.Graph(
            a["digests"][no[i] : no[i + 1]],
            a["src"][eo[i] : eo[i + 1]],
            a["dst"][eo[i] : eo[i + 1]],
            a["src_slot"][eo[i] : eo[i + 1]],
            a["dst_slot"][eo[i] : eo[i + 1]],
            name=f"m{i}",
        )
        for i in range(len(no) - 1)
    ]


# -- measurement helpers ---------------------------------------------------------------
def pin_to_one_cpu() -> int:
    cpu = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return cpu


def summary(values: list[float]) -> dict:
    """pyperf-style figures of one series: median, MAD, min and the raw values."""
    med = statistics.median(values)
    out = {
        "median": med,
        "mad": statistics.median(abs(v - med) for v in values),
        "min": min(values),
        "values": values,
    }
    if len(values) > 1 and statistics.stdev(values) > 0.1 * statistics.mean(values):
        print(f"warning: unstable timings (stdev > 10% of mean): {values}", file=sys.stderr)
    return out


def clocked(fn):  # noqa: ANN001, ANN201
    """Runs fn once; returns (result, wall seconds, CPU seconds of this thread)."""
    w0, c0 = time.perf_counter(), time.thread_time()
    result = fn()
    return result, time.perf_counter() - w0, time.thread_time() - c0


def timed(fn, repeat: int, setup=lambda: None) -> tuple[dict, dict, object]:  # noqa: ANN001
    """One discarded warmup, then ``repeat`` values of fn(setup()); setup is untimed."""
    walls, cpus, result = [], [], None
    for i in range(repeat + 1):
        result, wall, cpu = clocked(functools.partial(fn, setup()))
        if i:
            walls.append(wall)
            cpus.append(cpu)
    return summary(cpus), summary(walls), result


def as_lists(a: dict[str, np.ndarray]) -> dict:
    raw = a["digests"].tobytes()
    return {
        "node_offsets": a["node_offsets"].tolist(),
        "edge_offsets": a["edge_offsets"].tolist(),
        "digests": [raw[16 * i : 16 * i + 16] for i in range(a["digests"].shape[0])],
        "src": a["src"].tolist(),
        "dst": a["dst"].tolist(),
        "src_slot": a["src_slot"].tolist(),
        "dst_slot": a["dst_slot"].tolist(),
    }


def run_python(lists: dict) -> dict:
    return pycore.dedup_corpus(
        lists["node_offsets"], lists["edge_offsets"], lists["digests"], lists["src"], lists["dst"],
        lists["src_slot"], lists["dst_slot"], G,
    )


def same_result(core: dlbricks.CorpusSplit, py: dict) -> bool:
    return (
        [bytes(d) for d in core.unique_digests] == py["unique_seq_digests"]
        and core.seq_ids.tolist() == py["seq_ids"]
        and core.seq_members.tolist() == py["seq_members"]
        and core.seq_offsets.tolist() == py["seq_offsets"]
        and core.seq_model_offsets.tolist() == py["seq_model_offsets"]
        and core.unique_first.tolist() == py["unique_seq_first"]
    )


# -- memory, in fresh subprocesses -----------------------------------------------------
def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _release_free_heap() -> None:
    """Hands free heap pages back to the OS (glibc), so the split cannot reuse memory
    that is resident but free and so hide its own allocations from RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def memory_child(folder: str, mode: str) -> None:
    """Entry point of a memory subprocess; prints one JSON line.

    Mode ``write:N`` generates a corpus of about N layers into .npy files. Modes
    ``inputs`` and ``split`` read them (one allocation per array, no temporaries), so
    the process peaks at the end of building its inputs and whatever the split adds
    shows in ru_maxrss.
    """
    pin_to_one_cpu()
    if mode.startswith("write:"):
        arrays = make_corpus_arrays(int(mode.split(":")[1]))
        for k in ARRAY_KEYS:
            np.save(Path(folder) / f"{k}.npy", arrays[k])
        print(json.dumps({"layers": int(arrays["node_offsets"][-1])}))
        return
    arrays = {k: np.load(Path(folder) / f"{k}.npy") for k in ARRAY_KEYS}
    corpus = dlbricks.Corpus(make_graphs(arrays))
    _release_free_heap()
    out = {"layers": corpus.n_layers, "rss_after_inputs_kb": _status_kb("VmRSS")}
    if mode == "split":
        rss_before = _status_kb("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)
            hwm_reset = True
        except OSError:
            hwm_reset = False
        sp = corpus.split(G)
        out["sequences"] = sp.n_sequences
        if hwm_reset:
            out["split_peak_delta_kb"] = _status_kb("VmHWM") - rss_before
    out["ru_maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(out))


def measure_memory(n_layers: int) -> dict:
    """Peak memory of the split at one size, from fresh subprocesses.

    Call this while the parent is still small: Linux carries the parent's resident
    size at fork/exec into the child's ru_maxrss.
    """
    with tempfile.TemporaryDirectory() as folder:

        def child(mode: str) -> dict:
            cmd = [sys.executable, __file__, "--memory-child", folder, mode]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            return json.loads(done.stdout.splitlines()[-1])

        child(f"write:{n_layers}")
        base, split = child("inputs"), child("split")
    n = split["layers"]
    out = {
        "layers": n,
        "baseline_maxrss_bytes": base["ru_maxrss_kb"] * 1024,
        "split_maxrss_bytes": split["ru_maxrss_kb"] * 1024,
        "bytes_per_layer": (split["ru_maxrss_kb"] - base["ru_maxrss_kb"]) * 1024 / n,
    }
    if "split_peak_delta_kb" in split:
        out["hwm_bytes_per_layer"] = split["split_peak_delta_kb"] * 1024 / n
    return out


# -- `dlbricks analyze` split into ONNX work and dlbricks' own work ------------------
class _Timers:
    """Wraps callables so their time adds up under a label, restoring them afterwards."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, attr: str, label: str) -> None:
        original = getattr(owner, attr)
        totals = self.totals
        totals.setdefault(label, 0.0)

        def timed_call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - t0

        self._undo.append((owner, attr, original))
        setattr(owner, attr, timed_call)

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()


# onnx's work inside `dlbricks analyze`: everything else is dlbricks' own.
_ONNX_LABELS = ("onnx_parse_s", "shape_inference_s", "onnx_schema_s", "onnx_constant_eval_s")


def _light_paths(onnx_module) -> list[str]:  # noqa: ANN001
    """The nine light models shipped with onnx (their weights come from ConstantOfShape)."""
    light = Path(onnx_module.__file__).parent / "backend" / "test" / "data" / "light"
    return sorted(str(p) for p in light.glob("light_*.onnx"))


def _onnx_timers(onnx_module, onnx_io) -> _Timers:  # noqa: ANN001
    """Timers around every onnx call dlbricks analyze makes: parsing, shape inference
    (the fast loader calls onnx's C++ entry directly), operator schema lookups (the
    first one builds onnx's registry) and the reference evaluator (constant folding)."""
    import onnx.defs
    import onnx.reference
    import onnx.shape_inference

    timers = _Timers()
    timers.wrap(onnx_module, "load", "onnx_parse_s")
    timers.wrap(onnx.shape_inference, "infer_shapes", "shape_inference_s")
    if onnx_io._c_shape_inference is not None:
        timers.wrap(onnx_io._c_shape_inference, "infer_shapes", "shape_inference_s")
    timers.wrap(onnx.defs, "get_schema", "onnx_schema_s")
    timers.wrap(onnx.reference.ReferenceEvaluator, "run", "onnx_constant_eval_s")
    return timers


def _timed_analyze(cli, paths: list[str], report: str) -> tuple[int, float, str]:  # noqa: ANN001
    """``dlbricks analyze PATHS --json -o REPORT`` in this process, its output captured:
    (exit code, wall seconds, captured output)."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        t0 = time.perf_counter()
        rc = cli.main(["analyze", *paths, "--json", "-o", report])
        wall = time.perf_counter() - t0
    return rc, wall, sink.getvalue()


def _own_shares(runs: list[dict]) -> dict:
    """Median and quartiles of each run's own share: this machine's speed can change by
    2x between runs, and a median of totals and a median of onnx times may come from runs
    of different speeds. Within one run both parts ran at the same speed."""
    shares = [r["own_s"] / r["total_s"] for r in runs]
    return {
        "dlbricks_own_share_of_total": statistics.median(shares),
        "dlbricks_own_share_quartiles": statistics.quantiles(shares, n=4) if len(shares) > 1 else shares * 3,
    }


def analyze_split(repeat: int) -> dict:
    """``dlbricks analyze`` over the nine light models of onnx's test data, timed in
    process: total wall time, and within it onnx.load (parsing), onnx shape inference and
    onnx's reference evaluator (constant folding). Everything but onnx's is dlbricks' own
    work (the C++ passes, the Python around them, statistics, report). Alternate runs
    also time the fast loader's C++ passes (scan, light model, finish) and the C++ core
    calls (``breakdown_median``)."""
    try:
        import onnx
        import onnx.reference
        import onnx.shape_inference

        from dlbricks import _core, cli  # noqa: F401
        from dlbricks.loading import fast as onnx_io  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means "not available yet"
        return {"skipped": f"dlbricks analyze is not importable: {type(exc).__name__}: {exc}"}
    paths = _light_paths(onnx)
    if len(paths) != 9:
        return {"skipped": f"expected the nine light models beside onnx, found {len(paths)}"}

    def timers_for(breakdown: bool) -> _Timers:
        timers = _onnx_timers(onnx, onnx_io)
        if breakdown:
            # The fast loader's C++ passes, reported apart (they are dlbricks' own work).
            timers.wrap(_core.OnnxScan, "light_model", "fast_loader_light_model_s")
            timers.wrap(_core.OnnxScan, "finish", "fast_loader_finish_s")
            timers.wrap(_core, "OnnxScan", "fast_loader_scan_s")  # after its methods: this replaces the class
            timers.wrap(_core, "dedup_corpus", "core_s")
            timers.wrap(_core, "dedup_corpus_many", "core_s")
            timers.wrap(_core, "sequence_digests", "core_s")
            timers.wrap(_core, "jaccard_matrix", "core_s")
        return timers

    # Two kinds of run, alternating: the split times onnx's calls only (a timer around
    # each of dlbricks' own calls would add its cost to dlbricks' share), the breakdown
    # times dlbricks' C++ passes too.
    runs, breakdowns = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(2 * (repeat + 1)):  # the first two runs are warmups (imports, caches)
            timers = timers_for(breakdown=i % 2 == 1)
            try:
                # A new report file per run, as a first analysis writes: replacing an
                # existing file makes ext4 flush the new one first (auto_da_alloc),
                # about 0.7 ms here that depends on the file's history, not on us.
                rc, wall, output = _timed_analyze(cli, paths, os.path.join(tmp, f"a{i}.json"))
            except Exception as exc:  # noqa: BLE001
                return {"skipped": f"dlbricks analyze failed: {type(exc).__name__}: {exc}"}
            finally:
                timers.restore()
            if rc != 0:
                return {"skipped": f"dlbricks analyze exited with {rc}: {output[-300:]}"}
            if i >= 2:
                (breakdowns if i % 2 else runs).append({"total_s": wall, **timers.totals})
        result = json.loads(Path(tmp, f"a{2 * repeat + 1}.json").read_text())
    for r in runs:
        r["own_s"] = r["total_s"] - sum(r[k] for k in _ONNX_LABELS)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    breakdown = {k: statistics.median(r[k] for r in breakdowns) for k in breakdowns[0]}
    onnx_s = med["onnx_parse_s"] + med["shape_inference_s"] + med["onnx_schema_s"]
    return {
        "models": len(paths),
        "layers": sum(m["layers"] for m in result["models"]),
        "repeat": repeat,
        "median": med,
        "onnx_parse_and_shape_inference_s": onnx_s,
        "dlbricks_own_s": med["own_s"],
        **_own_shares(runs),
        "target_own_share": 0.25,
        "breakdown_median": breakdown,
        "dlbricks_core_share_of_total": breakdown["core_s"] / breakdown["total_s"],
        "runs": runs,
        "breakdown_runs": breakdowns,
    }


def oneshot_child(out_dir: str) -> None:
    """One ``dlbricks analyze`` of the nine light models in this fresh process, as a
    command-line run makes it; prints one JSON line. dlbricks' and onnx's modules are
    imported first and timed apart (``import_s``): a clean install has their bytecode
    compiled, this checkout may not, so import cost depends on the machine's setup."""
    pin_to_one_cpu()
    t0 = time.perf_counter()
    import onnx
    import onnx.defs
    import onnx.reference
    import onnx.shape_inference

    from dlbricks import analysis, cli, corpus, digest, graph  # noqa: F401
    from dlbricks.commands import _common, analyze  # noqa: F401
    from dlbricks.loading import fast as onnx_io  # noqa: F401

    import_s = time.perf_counter() - t0
    timers = _onnx_timers(onnx, onnx_io)
    rc, wall, _ = _timed_analyze(cli, _light_paths(onnx), os.path.join(out_dir, "a.json"))
    timers.restore()
    print(json.dumps({"rc": rc, "import_s": import_s, "total_s": wall, **timers.totals}))


def analyze_oneshot(repeat: int) -> dict:
    """``dlbricks analyze`` once per fresh process (``repeat`` processes): what one
    command-line run costs, first-use work included (canonical heads, schema lookups,
    argparse), after the modules are imported. The split is the same as in
    :func:`analyze_split`; onnx's schema lookups count as onnx's (the first one builds
    onnx's operator registry)."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeat):
            done = subprocess.run([sys.executable, __file__, "--oneshot-child", tmp], capture_output=True, text=True)
            if done.returncode != 0 or not done.stdout.strip():
                return {"skipped": f"one-shot child failed ({done.returncode}): {done.stderr.strip()[-300:]}"}
            run = json.loads(done.stdout.splitlines()[-1])
            if run["rc"] != 0:
                return {"skipped": f"dlbricks analyze exited with {run['rc']}"}
            run["onnx_s"] = sum(run[k] for k in _ONNX_LABELS)
            run["own_s"] = run["total_s"] - run["onnx_s"]
            runs.append(run)
    return {
        "processes": repeat,
        "median": {k: statistics.median(r[k] for r in runs) for k in ("import_s", "total_s", "onnx_s", "own_s")},
        **_own_shares(runs),
        "runs": runs,
    }


# -- main --------------------------------------------------------------------------------
def bench_size(n_target: int, repeat: int, python_estimate_s: float | None, memory: dict) -> dict:
    arrays, generate_wall, _ = clocked(lambda: make_corpus_arrays(n_target))
    graphs = make_graphs(arrays)
    n = int(arrays["node_offsets"][-1])

    build_cpu, build_wall, corpus = timed(lambda _: dlbricks.Corpus(graphs), repeat)
    # Corpus.split caches per G, so each value splits a fresh Corpus (built untimed).
    # The sequence digests are hashed on first use: the timed work asks for them.
    def split_with_digests(c: dlbricks.Corpus) -> dlbricks.CorpusSplit:
        sp = c.split(G)
        sp.unique_digests  # noqa: B018
        return sp

    split_cpu, split_wall, core_split = timed(split_with_digests, repeat, setup=lambda: dlbricks.Corpus(graphs))

    row = {
        "layers": n,
        "models": len(graphs),
        "edges": int(arrays["edge_offsets"][-1]),
        "sequences": core_split.n_sequences,
        "unique_sequences": core_split.n_unique,
        "unique_layers": corpus.n_unique_layers,
        "generate_wall_s": generate_wall,
        "corpus_build_cpu_s": build_cpu,
        "corpus_build_wall_s": build_wall,
        "core_split_cpu_s": split_cpu,
        "core_split_wall_s": split_wall,
        "layers_per_s": n / split_cpu["median"],
        "layers_per_s_wall": n / split_wall["median"],
        "layers_per_s_with_build": n / (split_cpu["median"] + build_cpu["median"]),
        "core_ns_per_layer": split_cpu["median"] / n * 1e9,
    }

    if python_estimate_s is None or python_estimate_s <= PYTHON_LIMIT_S:
        lists, _, row["python_convert_cpu_s"] = clocked(lambda: as_lists(arrays))
        py, row["python_wall_s"], row["python_cpu_s"] = clocked(lambda: run_python(lists))
        row["python_measured"] = True
        row["identical_digests"] = same_result(core_split, py)
        del py, lists
    else:
        row["python_cpu_s"] = python_estimate_s
        row["python_measured"] = False
        row["identical_digests"] = None
    row["speedup_vs_python"] = row["python_cpu_s"] / split_cpu["median"]
    row["memory"] = memory
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--repeat", type=int, default=5)
    # A run takes ~40 ms and this machine's speed drifts from run to run: 15 split runs
    # (and 15 breakdown runs between them) cost about a second and give quartiles.
    parser.add_argument("--analyze-repeat", type=int, default=15, help="timed runs of dlbricks analyze")
    parser.add_argument("-o", "--output", help="also write the JSON object here")
    parser.add_argument("--oneshot-repeat", type=int, default=9, help="fresh processes running dlbricks analyze once")
    parser.add_argument("--memory-child", nargs=2, metavar=("FOLDER", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--oneshot-child", metavar="FOLDER", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.oneshot_child:
        oneshot_child(args.oneshot_child)
        return 0
    if args.memory_child:
        memory_child(args.memory_child[0], args.memory_child[1])
        return 0

    cpu = pin_to_one_cpu()
    load_at_start = os.getloadavg()[0]
    sizes = sorted(int(float(s)) for s in args.sizes.split(","))
    memory = [measure_memory(n) for n in sizes]  # first, while this process is small
    rows = []
    python_us_per_layer = None
    for n, mem in zip(sizes, memory):
        estimate = None if python_us_per_layer is None else python_us_per_layer * n * 1e-6
        row = bench_size(n, args.repeat, estimate, mem)
        if row["python_measured"]:
            python_us_per_layer = row["python_cpu_s"] / row["layers"] * 1e6
        else:
            row["python_note"] = (
                f"extrapolated from {python_us_per_layer:.2f} us/layer measured at the previous size: "
                f"the estimate exceeds {PYTHON_LIMIT_S:.0f} s"
            )
        rows.append(row)
        print(
            f"{row['layers']:>9} layers: core split {row['core_split_cpu_s']['median'] * 1e3:8.2f} ms CPU "
            f"({row['layers_per_s'] / 1e6:.2f} M layers/s; wall {row['core_split_wall_s']['median'] * 1e3:.2f} ms), "
            f"build {row['corpus_build_cpu_s']['median'] * 1e3:.1f} ms, "
            f"python {row['python_cpu_s']:.2f} s{'' if row['python_measured'] else ' (est.)'}, "
            f"speedup {row['speedup_vs_python']:.0f}x, identical={row['identical_digests']}, "
            f"{row['memory']['bytes_per_layer']:.1f} B/layer",
            file=sys.stderr,
        )
    largest = rows[-1]
    analyze = analyze_split(args.analyze_repeat)
    if "skipped" not in analyze:
        q = analyze["dlbricks_own_share_quartiles"]
        print(
            f"analyze: dlbricks' own share {analyze['dlbricks_own_share_of_total']:.3f} (median of runs, "
            f"quartiles {q[0]:.3f}-{q[2]:.3f}; target < {analyze['target_own_share']}), own "
            f"{analyze['dlbricks_own_s'] * 1e3:.2f} ms, onnx {analyze['onnx_parse_and_shape_inference_s'] * 1e3:.2f} ms",
            file=sys.stderr,
        )
    oneshot = analyze_oneshot(args.oneshot_repeat) if args.oneshot_repeat > 0 else {"skipped": "--oneshot-repeat 0"}
    if "skipped" not in oneshot:
        q, m = oneshot["dlbricks_own_share_quartiles"], oneshot["median"]
        print(
            f"analyze once per process: dlbricks' own share {oneshot['dlbricks_own_share_of_total']:.3f} "
            f"(quartiles {q[0]:.3f}-{q[2]:.3f}), own {m['own_s'] * 1e3:.2f} ms, onnx {m['onnx_s'] * 1e3:.2f} ms, "
            f"imports {m['import_s'] * 1e3:.0f} ms",
            file=sys.stderr,
        )
    result = {
        "schema_version": SCHEMA_VERSION,
        "context": {
            "dlbricks": dlbricks.__version__,
            "python": platform.python_version(),
            "numpy": np.__version__,
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "pinned_cpu": cpu,
            "threads": 1,
            "G": G,
            "repeat": args.repeat,
            "timed": (
                "core_split_* = Corpus(graphs).split(3) only; Corpus construction is corpus_build_*; "
                "layers_per_s and speedups use CPU time of the calling thread (time.thread_time), "
                "*_wall_s the wall clock"
            ),
            "load_avg_1min": {"start": load_at_start, "end": os.getloadavg()[0]},
        },
        "layers_per_s": largest["layers_per_s"],
        "speedup_vs_python": largest["speedup_vs_python"],
        "speedup_measured": largest["python_measured"],
        "bytes_per_layer": largest["memory"]["bytes_per_layer"],
        "identical_digests": all(r["identical_digests"] is not False for r in rows),
        "core_ns_per_layer_by_size": {str(r["layers"]): r["core_ns_per_layer"] for r in rows},
        "targets": {"layers_per_s": 5e6, "speedup_vs_python": 30, "bytes_per_layer": 256},
        "sizes": rows,
        "analyze_split": None if "skipped" in analyze else analyze,
        "analyze_oneshot": None if "skipped" in oneshot else oneshot,
    }
    if "skipped" in oneshot:
        result["analyze_oneshot_reason"] = oneshot["skipped"]
    if "skipped" in analyze:
        result["analyze_split_reason"] = analyze["skipped"]
    line = json.dumps(result)
    if args.output:
        Path(args.output).write_text(line + "\n")
    print(line)
    return 0 if result["identical_digests"] else 1


if __name__ == "__main__":
    sys.exit(main())
