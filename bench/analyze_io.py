"""How close ``dlbricks analyze`` comes to the I/O floor on a corpus of big model files.

Usage: python bench/analyze_io.py [--copies 2] [--repeat 3] [--dir DIR] [--keep] [-o out.json]

The corpus: the nine light models shipped with onnx, with every ``ConstantOfShape``
weight replaced by a real initializer of random values, so that the files are as big
as the real models (VGG-19 becomes ~550 MB). ``--copies N`` writes each model N times
with different weights (N=2: ~2.7 GB in 18 files). The folder is removed afterwards
unless ``--keep``. Before anything is timed the bench checks that each materialised
model analyses to the same layers and digests as its light original.

What is timed, each in a fresh subprocess over all files, ``--repeat`` times (median):
  * ``analyze_s``: the Python API behind ``dlbricks analyze``: ``load_corpus`` on the
    folder plus ``analyze`` (dedup statistics at G=1,2,3);
  * ``onnx_load_s``: ``onnx.load`` of each file (parse the protobuf, weights included);
  * ``read_s``: reading each file's bytes into a reused 16 MiB buffer (the floor).
Imports are outside the timed region. The page cache is warm for all three: every
file is read once before the first timing, and the files fit in memory, so no method
pays for the disk and the order of the methods does not matter. Each figure comes as
wall-clock seconds (``*_s``) and as CPU seconds of the process (``*_cpu_s``), since the
wall clock of a shared machine also counts time spent waiting for a CPU.
``analyze_cli_s`` is the wall time of the ``dlbricks analyze --json`` command,
interpreter start and imports included (once).

Memory: ``peak_rss`` gives the peak RSS (VmHWM) of the analyze process over the whole
folder, over each model alone (``per_model``; the largest file and the worst model are
picked out), the folder's and the largest file's also minus the process's high-water
mark right before the work (``*_growth``), and over the same corpus without weights
(the light originals, copied as often), i.e. what the graphs analysis keeps take.
Bounded memory means the folder's peak stays near the worst single model's (a
transient while that model loads) plus the weightless corpus's share, far below the
corpus size.

Targets (issue): analyze within 1x of onnx.load and within 5x of reading the bytes.
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

import dlbricks

SCHEMA_VERSION = 1
LIGHT_DIR = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"

# Each child prints {"wall_s", "cpu_s", "rss_before", "rss_peak", ...} as its last line.
# The high-water mark is VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and
# exec, so a child would report the parent's peak (this script holds ~1 GB while it
# writes the files); VmHWM belongs to the child's own address space.
_CHILD_PRELUDE = r"""
import json, resource, sys, time
def peak():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
paths = sys.argv[1:]
"""
_CHILD_BODY = {
    "analyze": r"""
from dlbricks.analysis import analyze, load_corpus
before = peak(); t0 = time.perf_counter(); c0 = time.process_time()
loaded = load_corpus(paths)
result = analyze(loaded.models, (1, 2, 3))
extra = {"models": len(loaded.models), "errors": len(loaded.errors), "layers": result["corpus"]["layers"]}
""",
    "onnx_load": r"""
import onnx
before = peak(); t0 = time.perf_counter(); c0 = time.process_time()
n = 0
for p in paths:
    m = onnx.load(p)
    n += len(m.graph.node)
    del m
extra = {"nodes": n}
""",
    "read": r"""
import os
before = peak(); t0 = time.perf_counter(); c0 = time.process_time()
buf = bytearray(16 << 20)
view = memoryview(buf)
total = 0
for p in paths:
    with open(p, "rb", buffering=0) as f:
        while True:
            k = f.readinto(view)
            if not k:
                break
            total += k
extra = {"bytes": total}
""",
}
_CHILD_EPILOGUE = r"""
wall = time.perf_counter() - t0; cpu = time.process_time() - c0
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "rss_before": before, "rss_peak": peak(), **extra}))
"""


def run_child(method: str, paths: list[str]) -> dict:
    code = _CHILD_PRELUDE + _CHILD_BODY[method] + _CHILD_EPILOGUE
    proc = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} child failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def materialise(src: Path, dst: Path, seed: int) -> int:
    """Write ``src`` with its ConstantOfShape weights as random initializers; returns bytes."""
    proto = onnx.load(str(src))
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    rng = np.random.default_rng(seed)
    keep_nodes = []
    new_inits = []
    for node in g.node:
        if node.op_type == "ConstantOfShape" and node.input and node.input[0] in inits:
            shape = tuple(int(d) for d in numpy_helper.to_array(inits[node.input[0]]))
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            dtype = numpy_helper.to_array(value).dtype if value is not None else np.dtype(np.float32)
            if dtype.kind == "f":
                data = (rng.random(shape, dtype=np.float32) * 0.1 - 0.05).astype(dtype, copy=False)
            else:
                data = np.zeros(shape, dtype)
            new_inits.append(numpy_helper.from_array(data, node.output[0]))
        else:
            keep_nodes.append(node)
    del g.node[:]
    g.node.extend(keep_nodes)
    g.initializer.extend(new_inits)
    # The shape tensors fed only the removed nodes.
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    unused = [t.name for t in g.initializer if t.name not in used]
    for name in unused:
        idx = next(k for k, t in enumerate(g.initializer) if t.name == name)
        del g.initializer[idx]
    kept_inputs = [vi for vi in g.input if vi.name not in unused]
    del g.input[:]
    g.input.extend(kept_inputs)
    if proto.ir_version < 4:  # IR 3 lists every initializer as a graph input too
        for t in new_inits:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    onnx.save_model(proto, str(dst))
    return dst.stat().st_size


def summary(values: list[float]) -> dict:
    med = statistics.median(values)
    return {"median": med, "min": min(values), "mad": statistics.median(abs(v - med) for v in values), "values": values}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=2, help="copies of each model, each with its own weights")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each method (median reported)")
    ap.add_argument("--dir", help="folder for the materialised models (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the materialised models")
    ap.add_argument("-o", "--output", help="also write the JSON result here")
    args = ap.parse_args(argv)

    from dlbricks.bricks import model_digest
    from dlbricks.loading import load

    sources = sorted(LIGHT_DIR.glob("light_*.onnx"))
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="dlbricks_analyze_io_"))
    folder.mkdir(parents=True, exist_ok=True)
    cleanup = [] if args.keep else [folder]
    load_avg_start = os.getloadavg()[0]
    try:
        t0 = time.perf_counter()
        files: list[Path] = []
        for copy in range(args.copies):
            for k, src in enumerate(sources):
                dst = folder / f"{src.stem}_w{copy}.onnx"
                materialise(src, dst, seed=1000 * copy + k)
                files.append(dst)
        sizes = {f.name: f.stat().st_size for f in files}
        print(f"materialised {len(files)} files, {sum(sizes.values()) / 1e9:.2f} GB "
              f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

        # Same layers and digests as the light originals: weights are identified by type.
        same = True
        for src in sources:
            ref = model_digest(load(src))
            for copy in range(args.copies):
                same &= model_digest(load(folder / f"{src.stem}_w{copy}.onnx")) == ref
        if not same:
            raise SystemExit("a materialised model does not analyse like its light original")

        paths = [str(f) for f in files]
        run_child("read", paths)  # warm the page cache: every method then reads from memory
        raw: dict[str, list[dict]] = {m: [] for m in ("analyze", "onnx_load", "read")}
        for r in range(args.repeat):
            for method in raw:  # interleaved, so slow phases of a shared machine hit all alike
                raw[method].append(run_child(method, paths))
            print(f"run {r + 1}/{args.repeat}: " + ", ".join(f"{m} {v[-1]['wall_s']:.2f} s" for m, v in raw.items()),
                  file=sys.stderr)

        largest = max(files, key=lambda f: f.stat().st_size)
        # Each model alone (one copy of each): the peak of the folder should be the
        # biggest of these plus the little every analysed model keeps.
        alone = {f.name: run_child("analyze", [str(f)]) for f in files[: len(sources)]}
        # The same corpus without weight bytes: what analysing the graphs alone costs.
        light_copies = Path(tempfile.mkdtemp(prefix="dlbricks_analyze_io_light_"))
        cleanup.append(light_copies)
        for f in files:
            shutil.copy(LIGHT_DIR / (f.stem.rsplit("_w", 1)[0] + ".onnx"), light_copies / f.name)
        no_weights = [run_child("analyze", sorted(map(str, light_copies.iterdir()))) for _ in range(2)]
        whole = raw["analyze"]
        t1 = time.perf_counter()
        cli = subprocess.run([sys.executable, "-m", "dlbricks", "analyze", "--json", str(folder)],
                             capture_output=True, text=True)
        cli_s = time.perf_counter() - t1
        if cli.returncode != 0:
            raise SystemExit(f"dlbricks analyze failed: {cli.stderr}")
        cli_result = json.loads(cli.stdout)
    finally:
        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)

    wall = {m: summary([v["wall_s"] for v in vals]) for m, vals in raw.items()}
    cpu = {m: summary([v["cpu_s"] for v in vals]) for m, vals in raw.items()}
    folder_peak = max(v["rss_peak"] for v in whole)
    folder_growth = max(v["rss_peak"] - v["rss_before"] for v in whole)
    alone_peak = alone[largest.name]["rss_peak"]
    alone_growth = alone[largest.name]["rss_peak"] - alone[largest.name]["rss_before"]
    worst_name = max(alone, key=lambda n: alone[n]["rss_peak"])
    worst_peak = alone[worst_name]["rss_peak"]
    onnx_peak = max(v["rss_peak"] for v in raw["onnx_load"])
    a, o, rd = wall["analyze"]["median"], wall["onnx_load"]["median"], wall["read"]["median"]
    ac, oc, rc = cpu["analyze"]["median"], cpu["onnx_load"]["median"], cpu["read"]["median"]
    result = {
        "schema_version": SCHEMA_VERSION,
        "context": {
            "dlbricks": dlbricks.__version__,
            "onnx": onnx.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "threads": 1,
            "cache": "warm (every file read once before timing; the corpus fits in memory)",
            "repeat": args.repeat,
            "load_avg_1min": {"start": load_avg_start, "end": os.getloadavg()[0]},
        },
        "files": len(files),
        "total_bytes": sum(sizes.values()),
        "largest_file": {"name": largest.name, "bytes": sizes[largest.name]},
        "models_analysed": whole[0]["models"],
        "layers": whole[0]["layers"],
        "analyze_s": a,
        "onnx_load_s": o,
        "read_s": rd,
        "analyze_cpu_s": ac,
        "onnx_load_cpu_s": oc,
        "read_cpu_s": rc,
        "analyze_vs_onnx_load": a / o,
        "analyze_vs_read": a / rd,
        "analyze_vs_onnx_load_cpu": ac / oc,
        "analyze_vs_read_cpu": ac / rc,
        "read_gb_per_s": sum(sizes.values()) / rd / 1e9,
        "targets_met": {"within_1x_onnx_load": a <= o, "within_5x_read": a <= 5 * rd},
        "analyze_cli_s": cli_s,
        "cli_models": len(cli_result["models"]),
        "peak_rss": {
            "analyze_folder": folder_peak,
            "analyze_largest_model": alone_peak,
            "analyze_folder_growth": folder_growth,
            "analyze_largest_model_growth": alone_growth,
            "analyze_max_single_model": worst_peak,
            "analyze_max_single_model_name": worst_name,
            "folder_vs_largest": folder_peak / alone_peak,
            "folder_vs_max_single": folder_peak / worst_peak,
            "per_model": {n: v["rss_peak"] for n, v in alone.items()},
            "onnx_load_folder": onnx_peak,
            "analyze_same_corpus_without_weights": max(v["rss_peak"] for v in no_weights),
        },
        "raw": {"wall_s": wall, "cpu_s": cpu},
    }
    line = json.dumps(result)
    if args.output:
        Path(args.output).write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
