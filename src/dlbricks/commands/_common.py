"""Arguments and output helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dlbricks.cpuset import ReversedRange, parse_ranges, usable_cpus
from dlbricks.errors import DlbricksError, UsageError, warn
from dlbricks.files import write_atomically

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable, Mapping, Sequence

    from dlbricks.commands._shapes import ShapePlan
    from dlbricks.quality import Assessment
    from dlbricks.store import Store
    from dlbricks.timing.config import RunnerConfig

#: ``schema_version`` of every command's ``--json`` object that has no schema of its own.
SCHEMA_VERSION = 1


def add_model_args(p: argparse.ArgumentParser, *, nargs: str = "+") -> None:
    p.add_argument("paths", nargs=nargs, metavar="PATH", help="ONNX files or folders (searched recursively)")
    p.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="NAME=DIMS",
        help="the shape of the graph input NAME in every model that has one, e.g. data=1x3x224x224 (repeatable)",
    )
    p.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=N",
        help="a named free dimension in every model's inputs, e.g. batch=1 or sequence=128 (repeatable); "
             "bricks and end-to-end runs see the same shapes",
    )
    p.add_argument("--input-shapes", metavar="FILE",
                   help="per-model input shapes: a JSON or TOML mapping from a model path or glob to "
                        "{input: dims}, e.g. {\"zoo/bert/*.onnx\": {\"input_ids\": \"1x128\"}}")
    p.add_argument("--strict", action="store_true", help="a bad model is fatal instead of skipped")


def add_graph_arg(p: argparse.ArgumentParser, *, ray: bool = False) -> None:
    """``--graph runtime|source``: which graph is cut into bricks (``ray``: the command
    has ``--ray``, whose nodes cut the source graph)."""
    p.add_argument(
        "--graph",
        choices=("runtime", "source"),
        default=None,
        help="decompose the graph onnxruntime executes (the default: its fusions and layouts are inside the "
             "bricks, as in the model run) or the model file's own graph (portable between machines"
             + ("; the default with --ray)" if ray else ")"),
    )
    # The flag of earlier releases, now the default.
    p.add_argument("--runtime-graph", dest="graph", action="store_const", const="runtime", help=argparse.SUPPRESS)


def add_attribution_arg(p: argparse.ArgumentParser) -> None:
    """``--attribution``: what each correction explains of each model's error."""
    p.add_argument(
        "--attribution",
        action="store_true",
        help="also show, per model at the first G, the normalized latency after each correction in turn: "
             "source graph with warm caches and no call-overhead correction, + the call-overhead correction, "
             "+ the runtime graph, + --cache-state (the evaluation itself); measures the bricks the store lacks",
    )


def chosen_graph(args: argparse.Namespace) -> str:
    """The graph ``--graph`` asks to cut: as given, else "runtime" (commands without the
    option cut the source graph, and so do Ray runs: see bench's ``--ray``)."""
    if not hasattr(args, "graph"):
        return "source"
    return args.graph or ("source" if getattr(args, "ray", None) else "runtime")


def shape_plan(args: argparse.Namespace) -> ShapePlan | None:
    """Each model's input overrides from --dim, --input-shape and --input-shapes
    (:mod:`dlbricks.commands._shapes`), or None when none is given.

    Raises:
        UsageError: a malformed option or shapes file (naming it).
    """
    from dlbricks.analysis import print_err
    from dlbricks.commands._shapes import ShapePlan, parse_dims, read_shapes_file

    file = getattr(args, "input_shapes", None)
    plan = ShapePlan(parse_input_shapes(getattr(args, "input_shape", [])), parse_dims(getattr(args, "dim", [])),
                     read_shapes_file(file) if file else (), file=file, on_warning=print_err)
    return None if plan.empty else plan


def add_output_args(p: argparse.ArgumentParser) -> None:
    """``--json`` and ``-o/--output FILE``: in every command, ``-o`` names where the
    command's result goes instead of stdout (a file; a folder for ``generate`` and
    ``demo``, whose result is a folder of files)."""
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("-o", "--output", "--output-file", dest="output", metavar="FILE",
                   help="write the result (text, or JSON with --json) to FILE instead of stdout")


def add_bricks_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bricks-dir", "--output-dir", dest="workdir", metavar="DIR",
                   help="keep the generated bricks in DIR (default: a temporary folder, removed after)")


def add_remeasure_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--remeasure-unstable", action="store_true",
                   help="measure again the stored results the precision check flags: those that stopped at "
                        "--max-rounds, and those carrying most of the variance of a model whose interval is "
                        "wider than --precision")


def ray_shapes(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    """The one shape mapping a Ray load takes: --input-shape only.

    Raises:
        UsageError: --dim or --input-shapes, which Ray's loader does not resolve per model yet.
    """
    if getattr(args, "dim", None) or getattr(args, "input_shapes", None):
        raise UsageError("--dim and --input-shapes do not apply with --ray yet: use --input-shape")
    return parse_input_shapes(args.input_shape)


def parse_input_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    """Parse repeated ``NAME=1x3x224x224`` options.

    Raises:
        UsageError: a malformed item.
    """
    from dlbricks.commands._shapes import parse_shape

    shapes: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, sep, dims = item.rpartition("=")
        if not sep or not name:
            raise UsageError(f"--input-shape {item!r}: expected NAME=DIMS, e.g. data=1x3x224x224")
        shapes[name] = parse_shape(dims, f"--input-shape {item!r}")
    return shapes


def parse_g_list(text: str) -> list[int]:
    """Parse ``1,2,3`` or ``1-4`` into a sorted list of granularities >= 1.

    Raises:
        UsageError: not integers, or a G < 1.
    """
    try:
        out = parse_ranges(text)
    except ReversedRange as exc:
        raise UsageError(f"-G {text!r}: {exc}") from None
    except ValueError:
        raise UsageError(f"-G {text!r}: expected integers like 1,2,3 or 1-3") from None
    if not out:
        raise UsageError("-G: no granularity given")
    bad = [g for g in out if g < 1]
    if bad:
        raise UsageError(f"-G {text!r}: G must be at least 1, got {min(bad)}")
    return out


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


T = TypeVar("T", int, float)


def _within(value: T, ok: bool, need: str, shown: object) -> T:
    """``value`` if ``ok``, else the option's error: it must be ``need``."""
    if not ok:
        raise argparse.ArgumentTypeError(f"must be {need}, got {shown}")
    return value


def positive_int(text: str) -> int:
    v = _integer(text)
    return _within(v, v >= 1, "at least 1", v)


def _number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if v != v:
        raise argparse.ArgumentTypeError("expected a number, got nan")
    return v


def non_negative_float(text: str) -> float:
    """A number >= 0 (seconds, fractions)."""
    v = _number(text)
    return _within(v, v >= 0, ">= 0", text)


def positive_float(text: str) -> float:
    """A number > 0 (seconds)."""
    v = _number(text)
    return _within(v, v > 0, "> 0", text)


def non_negative_int(text: str) -> int:
    v = _integer(text)
    return _within(v, v >= 0, ">= 0", v)


def precision_fraction(text: str) -> float:
    """A relative half-width: a fraction strictly between 0 and 1 (0.02: +/-2%)."""
    v = _number(text)
    return _within(v, 0 < v < 1, "a fraction between 0 and 1 (0.02 for +/-2%)", text)


def emit(args: argparse.Namespace, text: str | None, obj: Any) -> None:
    """Write the command's result: JSON with --json, else text; to -o FILE or stdout."""
    # One line, compact: json's C encoder handles that (an indent forces its
    # pure-Python encoder, which costs more than analysing a small corpus); pipe to
    # `python -m json.tool` or `jq` to read it.
    if getattr(args, "json", False) or text is None:
        payload = json.dumps(obj, separators=(",", ":"), default=_json_default) + "\n"
    else:
        payload = text
    output = getattr(args, "output", None)
    if output and output != "-":
        write_atomically(output, payload)
        print(f"wrote {output}", file=sys.stderr)
    else:
        sys.stdout.write(payload)


#: Options that name a file a command writes (argparse dest -> option).
OUTPUT_FILE_OPTIONS = {"output": "-o", "save": "--save", "trace": "--trace", "plot": "--plot",
                       "otel_file": "--otel-file"}


def check_output_files(args: argparse.Namespace) -> None:
    """Fail before any work when a file the command is to write cannot be: the path is
    a folder, or the nearest existing folder above it is a file or not writable (a
    folder still missing is created when the file is written). Measuring for minutes
    and then failing to save is what this avoids.

    Raises:
        UsageError: naming the option, the path and why.
    """
    import os

    for dest, option in OUTPUT_FILE_OPTIONS.items():
        path = getattr(args, dest, None)
        if not isinstance(path, str) or not path or path == "-":
            continue
        target = Path(path)
        if target.is_dir():
            raise UsageError(f"{option} {path}: a folder, not a file")
        above = target.parent
        while not above.exists() and above != above.parent:
            above = above.parent
        if not above.is_dir():
            raise UsageError(f"{option} {path}: {above} is not a folder")
        if not os.access(above, os.W_OK | os.X_OK):
            raise UsageError(f"{option} {path}: cannot write in {above} (permission denied)")


def _json_default(o: Any) -> Any:
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def add_store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", metavar="PATH", help="results store (default: ~/.cache/dlbricks/results.sqlite)")


def add_runner_args(p: argparse.ArgumentParser) -> None:
    """The runner and measurement-engine options, their help showing the defaults
    these commands really use. The options of a single contiguous run (warm-up, minimum
    and maximum sampling, target CI) are accepted and recorded with the settings but
    hidden: every command here measures through the engine, which does not read them."""
    g = p.add_argument_group("runner")
    g.add_argument("--threads", type=positive_int, default=1, help="onnxruntime intra-op threads (default 1)")
    g.add_argument("--inter-threads", type=positive_int, default=1, help="onnxruntime inter-op threads (default 1)")
    g.add_argument("--execution-mode", choices=["sequential", "parallel"], default="sequential",
                   help="onnxruntime execution mode (default sequential)")
    g.add_argument(
        "--opt-level",
        choices=["default", "disable", "basic", "extended", "all"],
        default="default",
        help="onnxruntime graph optimisation level (default: onnxruntime's default)",
    )
    cpus = usable_cpus()
    g.add_argument("--cores", metavar="LIST",
                   help=f"pin to these CPUs, e.g. 1 or 0-3 (default: the last usable CPU, here {cpus[-1] if cpus else 0})")
    g.add_argument("--no-pin", action="store_true", help="do not pin to CPUs")
    g.add_argument("--open-cores", metavar="LIST",
                   help="CPUs where sessions are built while none is timed, e.g. 0, or 'none' (default: the "
                        "other usable CPUs when --cores is not given, else none)")
    hidden = argparse.SUPPRESS
    g.add_argument("--warmup", type=non_negative_int, default=5, metavar="N", help=hidden)
    g.add_argument("--warmup-time", type=non_negative_float, default=0.05, metavar="S", help=hidden)
    g.add_argument("--min-iters", type=non_negative_int, default=10, metavar="N", help=hidden)
    g.add_argument("--min-time", type=non_negative_float, default=0.2, metavar="S", help=hidden)
    g.add_argument("--max-time", type=non_negative_float, default=2.0, metavar="S", help=hidden)
    g.add_argument("--target-ci", type=non_negative_float, default=0.01, metavar="F", help=hidden)
    g.add_argument("--timeout", type=positive_float, default=120.0, metavar="S",
                   help="longest a worker may take to answer, session set-up included (default 120)")
    e = p.add_argument_group(
        "measurement engine",
        "bricks and whole models are measured in interleaved rounds until every model's latency is known "
        "to the stated precision, or the round limit is reached (a warning then names the models short of it)",
    )
    e.add_argument("--precision", type=precision_fraction, default=0.02, metavar="F",
                   help="95%% interval of each model's latency within +/-F (default 0.02)")
    e.add_argument("--min-rounds", type=positive_int, default=5, metavar="N",
                   help="rounds before any result is final (default 5)")
    e.add_argument("--max-rounds", type=positive_int, default=60, metavar="N",
                   help="stop after N rounds even if not precise enough (default 60)")
    e.add_argument("--min-span", type=non_negative_float, default=6.0, metavar="S",
                   help="seconds a result's rounds must span before it is final, so that they sample "
                        "several of a shared host's slow phases (default 6)")
    e.add_argument("--model-span", type=non_negative_float, default=15.0, metavar="S",
                   help="the same for a whole model's result, whose latency moves with what other tenants "
                        "evict from the shared cache over tens of seconds (default 15)")
    e.add_argument("--cache-state", choices=["warm", "cold", "auto"], default="auto",
                   help="warm: a burst starts with discarded runs (two under 0.5 ms, none from 0.5 s), so the timed runs find the brick cached; "
                        "cold: between two runs twice the largest cache's size (up to 64 MiB) of other data is read (other "
                        "sessions' runs, topped up from an eviction buffer), so its weights come from memory, and "
                        "its inputs are read just before it; auto (default): cold for memory-bound bricks whose "
                        "weights outgrow the L2 cache (fewer than 8 operations per weight byte), warm for the others")
    e.add_argument("--clock", choices=["auto", "wall", "thread"], default="auto",
                   help="what a run's duration is read from: thread = the calling thread's CPU time, which "
                        "leaves out time descheduled by other processes (one thread only); auto = thread when "
                        "valid, else wall (default auto)")
    e.add_argument("--no-call-overhead", action="store_true",
                   help="do not correct for each brick's fixed per-call cost (calibrated on this machine by two "
                        "probe models; by default it is counted once per model instead of once per brick)")
    e.add_argument("--speed-probe", action=argparse.BooleanOptionalAction, default=False,
                   help="bring each round's median to one reference speed of the core, read by a small probe "
                        "kernel timed around every burst (on a shared host the core's speed changes for seconds "
                        "at a time, so the sessions of one round meet different speeds); off by default: its "
                        "fitted slopes add more spread between runs than they take out")
    e.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=False,
                   help="back the measured sessions' memory with transparent huge pages, where glibc and the "
                        "kernel allow (with 4 KiB pages a session's latency depends a little on where its buffers "
                        "land in physical memory); off by default: faulting them in slows every session's set-up "
                        "where the kernel compacts memory to find them or a VM backs its memory lazily, and "
                        "normalized latency reproduced no better with them")
    e.add_argument("--memory-budget", type=positive_int, default=0, metavar="MB",
                   help="most memory the measured sessions may hold at once (default: 2048 or half the available, "
                   "whichever is less)")
    g.add_argument("--allow-denormals", action="store_true", help="do not flush denormals to zero")
    g.add_argument("--seed", type=int, default=0, help="seed of synthetic weights and inputs")


def parse_cores(text: str | None, option: str = "--cores") -> tuple[int, ...]:
    """``0-3,6`` -> (0, 1, 2, 3, 6).

    Raises:
        UsageError: malformed, or a CPU this process may not use.
    """
    if text is None:
        return ()
    try:
        cores = set(parse_ranges(text))
    except ReversedRange as exc:
        raise UsageError(f"{option} {text!r}: {exc}") from None
    except ValueError:
        raise UsageError(f"{option} {text!r}: expected CPU ids like 0-3,6") from None
    allowed = set(usable_cpus())
    bad = sorted(cores - allowed)
    if bad:
        raise UsageError(f"{option} {text!r}: CPU {bad[0]} is not available (allowed: {sorted(allowed)})")
    if not cores:
        raise UsageError(f"{option}: no CPU given")
    return tuple(sorted(cores))


def open_cores(args: argparse.Namespace) -> tuple[int, ...] | None:
    """``--open-cores``: None (the engine's default) unless given, or unless ``--cores``
    is (a user who names the timing cores may want the others left alone)."""
    text = getattr(args, "open_cores", None)
    if text is None:
        return () if getattr(args, "cores", None) else None
    if text.strip().lower() == "none":
        return ()
    return parse_cores(text, "--open-cores")


def runner_config(args: argparse.Namespace, jobs: int = 1) -> RunnerConfig:
    """A RunnerConfig from the runner options; by default pinned to the last CPU(s)."""
    from dlbricks.timing import RunnerConfig

    cores: tuple[int, ...] | None
    if args.no_pin:
        cores = None
    elif args.cores:
        cores = parse_cores(args.cores)
    else:
        # The last CPUs: CPU 0 usually takes more interrupts and housekeeping.
        allowed = usable_cpus()
        need = max(1, args.threads) * max(1, jobs)
        cores = tuple(allowed[-need:]) if len(allowed) >= need else tuple(allowed)
    if jobs == 1 and cores is not None and len(cores) > args.threads:
        cores = cores[: args.threads] if args.cores is None else cores
    try:
        return RunnerConfig(
            intra_op_threads=args.threads,
            inter_op_threads=args.inter_threads,
            execution_mode=args.execution_mode,
            graph_optimization=args.opt_level,
            cores=cores,
            warmup_iters=args.warmup,
            warmup_time=args.warmup_time,
            min_iters=args.min_iters,
            min_time=args.min_time,
            max_time=args.max_time,
            target_ci=args.target_ci,
            denormals_as_zero=not args.allow_denormals,
            timeout_s=args.timeout,
            precision=args.precision,
            min_rounds=args.min_rounds,
            max_rounds=max(args.max_rounds, args.min_rounds),
            min_span_s=args.min_span,
            model_span_s=args.model_span,
            cache_state=args.cache_state,
            memory_budget_mb=args.memory_budget,
            call_overhead=not args.no_call_overhead,
            speed_probe=args.speed_probe,
            clock=args.clock,
            huge_pages=args.huge_pages,
            open_cores=open_cores(args),
        )
    except UsageError:
        raise  # already in the options' words (--cores, --open-cores)
    except DlbricksError as exc:
        # RunnerConfig rejects impossible settings with a DlbricksError: the user's to
        # fix (exit 2), in the words of the options they gave. Anything else is a bug and
        # propagates as one (exit 1, traceback).
        text = str(exc).removeprefix("RunnerConfig: ")
        raise UsageError(_FIELD_NAMES.sub(lambda m: _OPTION_OF_FIELD[m.group(0)], text)) from None


#: The runner option that sets each RunnerConfig field (for its errors' wording).
_OPTION_OF_FIELD = {
    "intra_op_threads": "--threads", "inter_op_threads": "--inter-threads", "execution_mode": "--execution-mode",
    "graph_optimization": "--opt-level", "cores": "--cores", "open_cores": "--open-cores", "warmup_iters": "--warmup",
    "warmup_time": "--warmup-time", "min_iters": "--min-iters", "min_time": "--min-time", "max_time": "--max-time",
    "target_ci": "--target-ci", "timeout_s": "--timeout", "precision": "--precision", "min_rounds": "--min-rounds",
    "max_rounds": "--max-rounds", "min_span_s": "--min-span", "model_span_s": "--model-span",
    "cache_state": "--cache-state", "memory_budget_mb": "--memory-budget", "clock": "--clock",
}
_FIELD_NAMES = re.compile(r"(?<![-\w])(" + "|".join(_OPTION_OF_FIELD) + r")\b")


def open_store(args: argparse.Namespace, *, readonly: bool = False, must_exist: bool = False) -> Store:
    """The ``--store`` (default: the user cache store).

    Args:
        readonly: open for reading only; implies ``must_exist``.
        must_exist: a store that is not there is the user's error, never created
            empty (a read-only command given a typo would otherwise make one and then
            report that nothing was measured).

    Raises:
        UsageError: ``must_exist`` and there is no store at that path (exit 2).
        StoreError: the file is not a store, or a newer dlbricks wrote it.
    """
    from dlbricks.store import Store

    path = getattr(args, "store", None)
    if readonly or must_exist:
        require_store(path)
    return Store(path, readonly=readonly)


def require_store(path: str | Path | None) -> Path:
    """The store file at ``path`` (None: the default store), which must exist.

    Raises:
        UsageError: nothing there (one message and exit code for every read-only command).
    """
    from dlbricks.store import default_store_path

    target = Path(path) if path is not None else default_store_path()
    if not target.is_file():
        where = f"--store {path}" if path is not None else f"the default store {target}"
        raise UsageError(f"{where}: no results store there (measure with `dlbricks bench` first, "
                         "or give the path of an existing store)")
    return target


def load_models(args: argparse.Namespace, config: RunnerConfig | None = None) -> list:
    """Load the PATHs (skipping bad models unless --strict), optionally as runtime graphs."""
    return load_models_and_sources(args, config)[0]


def load_models_and_sources(args: argparse.Namespace, config: RunnerConfig | None = None) -> tuple[list, list]:
    """The models to decompose and, pairwise, the models to time end to end.

    Both come from one load with the same shape overrides. With ``--graph runtime``
    (the default) the first are the graphs onnxruntime executes, optimised at those
    shapes with the session options of ``config``, the run's configuration; a model
    whose runtime graph cannot be decomposed is cut from its source graph instead, with
    a warning naming it. With ``--graph source`` both lists are the same. Which graph
    each model was cut from is on ``args.graphs`` (source path -> "runtime"|"source").
    """
    from dlbricks.analysis import load_corpus, print_err

    plan = shape_plan(args)
    loaded = load_corpus(args.paths, strict=args.strict, on_warning=print_err, shapes_for=plan)
    if plan is not None:
        plan.report_unused()
    for e in loaded.errors:
        print_err(f"skipped {e['error']}")
    sources = loaded.models
    models = sources
    if chosen_graph(args) == "runtime":
        from dlbricks.loading.runtime_graph import runtime_models_or_sources

        models, used = runtime_models_or_sources(
            sources, config=config, level=getattr(args, "opt_level", "default"),
            input_shapes_for=(lambda m: plan.for_file(m.path) if plan and m.path else None), on_warning=print_err)
    else:
        used = ["source"] * len(sources)
    args.graphs = {s.path: g for s, g in zip(sources, used)}
    return models, sources


def record_graphs(result: dict, graphs: Mapping[str | None, str]) -> None:
    """Say in an evaluation's result which graph each model was cut from (``graph``:
    "runtime" or "source", per model and, when all agree, for the run)."""
    for m in result.get("models", []):
        m["graph"] = graphs.get(m.get("path"), "source")
    result["graph"] = run_graph([m["graph"] for m in result.get("models", [])] or list(graphs.values()))


def run_graph(per_model: Sequence[str]) -> str:
    """The graph of a run: the one every model was cut from, else "mixed"."""
    used = set(per_model)
    return used.pop() if len(used) == 1 else ("mixed" if used else "source")


def graph_models(sources: Sequence, graphs: Sequence[str], config: RunnerConfig | None,
                 shapes_for: Callable[[Any], Mapping | None] | None = None) -> list:
    """The models an evaluation decomposed, again: each source model's runtime graph
    where ``graphs`` says "runtime", else the model itself."""
    from dlbricks.loading.runtime_graph import runtime_models

    out = []
    for s, g in zip(sources, graphs):
        if g == "runtime":
            shapes = shapes_for(s) if shapes_for else None
            out += runtime_models([s], config=config, input_shapes=dict(shapes) if shapes else None)
        else:
            out.append(s)
    return out


_allocator_tuned = False


def tune_allocator_for_loading() -> None:
    """Turn glibc's fastbins off for this process; a no-op elsewhere and after the first call.

    onnx's shape inference frees thousands of small blocks per model. glibc parks them
    in fastbins and merges them all (malloc_consolidate) at the next large free or
    allocation, which the loader makes right after inference, so loading pays for the
    merge on every model. Small blocks still come from glibc's per-thread cache. Only
    commands that do not time models call this, so timings are always taken in a
    process with the default allocator. The extension calls mallopt, which costs less
    than loading ctypes to do it.
    """
    global _allocator_tuned
    if _allocator_tuned:
        return
    _allocator_tuned = True
    from dlbricks import _core

    _core.disable_fastbins()


def check_precision(
    models: Sequence,
    Gs: Sequence[int],
    store: Store,
    system_id: str,
    config: RunnerConfig,
    e2e_models: Sequence | None = None,
    *,
    bricks: bool = True,
    rerun: str | None = None,
) -> Assessment:
    """The precision check of the stored results (:mod:`dlbricks.quality`), its
    warnings printed on stderr: a count, then the worst models, then ``rerun``."""
    from dlbricks.quality import assess

    check = assess(models, Gs, store=store, system_id=system_id, config_key=config.key(),
                   precision=config.precision, e2e_models=e2e_models, bricks=bricks)
    print_check(check, rerun)
    return check


def print_check(check: Assessment, rerun: str | None = None) -> None:
    """The precision check's warnings on stderr (nothing when all is well)."""
    for line in check.lines(rerun=rerun) if rerun else check.lines():
        warn(line)


def flagged_for_remeasure(
    args: argparse.Namespace,
    models: Sequence,
    Gs: Sequence[int],
    store: Store,
    system_id: str,
    config: RunnerConfig,
    e2e_models: Sequence | None = None,
) -> set[str]:
    """With ``--remeasure-unstable``, the digests the precision check flags (said on stderr)."""
    if not getattr(args, "remeasure_unstable", False):
        return set()
    from dlbricks.quality import assess

    digests = assess(models, Gs, store=store, system_id=system_id, config_key=config.key(),
                     precision=config.precision, e2e_models=e2e_models).remeasure()
    print(f"dlbricks: re-measuring {len(digests)} stored result(s) the precision check flags", file=sys.stderr)
    return digests


def model_latencies(store: Store, models: Sequence, system_id: str, config_key: str,
                    check: Assessment | None = None) -> list[dict[str, Any]]:
    """Each model's stored end-to-end result: median, p90, p99 and the 95% interval
    (seconds), rounds, stop reason and the precision check's flags."""
    from dlbricks.bricks import model_digest
    from dlbricks.quality import model_flags
    from dlbricks.versions import model_digest_version

    digests = [model_digest(m) for m in models]
    recs = store.get_results("model", digests, model_digest_version(), system_id, config_key)
    out = []
    for m, d in zip(models, digests):
        rec = recs.get(d)
        row: dict[str, Any] = {"name": m.name, "path": m.path, "digest": d}
        if rec is None or not rec.ok or rec.stats is None:
            row.update(status="failed" if rec is not None else "missing", error=getattr(rec, "error", None))
        else:
            st, meta = rec.stats, rec.meta or {}
            row.update(status="ok", median_s=st["median"] * 1e-9, p90_s=st.get("p90", math.nan) * 1e-9,
                       p99_s=st.get("p99", math.nan) * 1e-9, ci_low_s=st["ci_low"] * 1e-9,
                       ci_high_s=st["ci_high"] * 1e-9, rounds=meta.get("rounds", 0),
                       stop_reason=meta.get("stop_reason"))
        flags = model_flags(check, m.name) if check is not None else []
        flags = [f for f in flags if f.startswith("end to end")]
        row.update(flagged=bool(flags), flags=flags)
        out.append(row)
    return out


def time_unit(seconds: Sequence[float]) -> tuple[float, str]:
    """(scale, unit) that shows the smallest of ``seconds`` with at least 3 significant digits."""
    finite = [abs(x) for x in seconds if isinstance(x, (int, float)) and math.isfinite(x) and x > 0]
    low = min(finite) if finite else 1e-3
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if low >= scale:
            return scale, unit
    return 1e-9, "ns"


def render_latencies(rows: Sequence[dict[str, Any]]) -> str:
    """The end-to-end table of :func:`model_latencies` ("!" marks a flagged model)."""
    width = max([5, *(len(r["name"]) for r in rows)])
    scale, unit = time_unit([r["median_s"] for r in rows if r["status"] == "ok"])
    lines = [f"  {'model':<{width}} {'median ' + unit:>10} {'p90 ' + unit:>9} {'p99 ' + unit:>9}  95% interval ({unit})"]
    for r in rows:
        mark = "!" if r["flagged"] else " "
        if r["status"] != "ok":
            lines.append(f"{mark} {r['name']:<{width}} {r['status']}")
            continue
        lines.append(
            f"{mark} {r['name']:<{width}} {r['median_s'] / scale:>10.3f} {r['p90_s'] / scale:>9.3f} "
            f"{r['p99_s'] / scale:>9.3f}  [{r['ci_low_s'] / scale:.3f}, {r['ci_high_s'] / scale:.3f}]"
            + (f"  {'; '.join(r['flags'])}" if r["flags"] else "")
        )
    return "\n".join(lines) + "\n"
