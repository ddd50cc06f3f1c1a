"""``dlbricks profile``: across-stack profiling with levelled measurement (XSP).

Levels ``model`` (end-to-end latency, profiling off), ``layer`` (onnxruntime's
profiler, joined to layers and corrected for its own overhead) and ``hw``
(per-layer perf counters on each layer's brick, in a worker process). The text
summary (or ``--json``) goes to stdout (or ``-o FILE``), the Chrome/Perfetto trace to ``--trace``,
OpenTelemetry spans to ``--otel-file`` and/or ``--otlp-endpoint``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dlbricks.commands._common import emit, parse_input_shapes, positive_int
from dlbricks.errors import DlbricksError, UsageError
from dlbricks.files import write_atomically


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="across-stack profile (model, layer, hw levels) with overhead correction; Chrome trace and OpenTelemetry",
        description="Profile one model level by level: the end-to-end latency with profiling off, "
        "onnxruntime's per-kernel profile joined to dlbricks layers and corrected for the profiler's "
        "overhead, and per-layer perf counters measured on each layer's brick.",
    )
    p.add_argument("path", metavar="PATH", help="an ONNX model")
    p.add_argument(
        "--levels", default="model,layer,hw", metavar="LIST", help="levels to measure: model,layer,hw (default: all)"
    )
    p.add_argument("--trace", metavar="TRACE.json", help="write a Chrome/Perfetto trace here")
    p.add_argument("-o", "--output", metavar="FILE", help="write the summary (text, or JSON with --json) to FILE")
    p.add_argument("--otlp-endpoint", metavar="URL", help="export OpenTelemetry spans over OTLP/HTTP to URL")
    p.add_argument("--otel-file", metavar="FILE", help="append OpenTelemetry spans to FILE as JSON lines")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text summary")
    p.add_argument("--runs", type=positive_int, default=10, help="profiled runs at the layer level (default 10)")
    p.add_argument("--brick-runs", type=positive_int, default=10, help="counted runs per brick at the hw level (default 10)")
    p.add_argument("--no-bricks", action="store_true", help="hw level: count the whole model only, not every layer's brick")
    p.add_argument("--threads", type=positive_int, default=1, help="onnxruntime intra-op threads (default 1)")
    p.add_argument("--top", type=positive_int, default=15, help="layers in the summary table (default 15)")
    p.add_argument("--seed", type=int, default=0, help="seed of synthetic inputs and weights (default 0)")
    p.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="NAME=DIMS",
        help="concrete shape for a graph input, e.g. data=1x3x224x224 (repeatable)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Profile ``args.path``; returns 0.

    Raises:
        UsageError: bad option values, missing file.
        DlbricksError: the model cannot be loaded or run; OpenTelemetry output
            asked for without the SDK.
    """
    from dlbricks.loading import load
    from dlbricks.profiling import ProfileOptions, parse_levels, profile_model, render_profile
    from dlbricks.profiling.tracing import OtelConfig, Recorder, to_jsonable
    from dlbricks.timing import RunnerConfig

    levels = parse_levels(args.levels)
    if not os.path.isfile(args.path):
        raise UsageError(f"{args.path}: " + ("a folder; profile takes one model file" if os.path.isdir(args.path)
                                             else "no such file"))
    shapes = parse_input_shapes(args.input_shape)
    otel = OtelConfig(file=args.otel_file, endpoint=args.otlp_endpoint)
    otel.traces_url()  # validates the URL before any work
    recorder = Recorder(otel, process_name="dlbricks profile")
    try:
        model = load(args.path, shapes or None)
        options = ProfileOptions(
            levels=levels,
            runs=args.runs,
            brick_runs=args.brick_runs,
            hw_bricks=not args.no_bricks,
            config=RunnerConfig(intra_op_threads=args.threads),
            seed=args.seed,
        )
        result = profile_model(model, options, recorder=recorder)
    finally:
        recorder.shutdown()
    if args.trace:
        path = Path(args.trace)
        trace = recorder.chrome_trace(metadata={"model": result["model"], "context": result["context"]})
        write_atomically(path, json.dumps(trace, separators=(",", ":")))
        print(f"dlbricks profile: wrote trace {path} ({len(trace['traceEvents'])} events)", file=sys.stderr)
    if args.otel_file:
        print(f"dlbricks profile: appended OpenTelemetry spans to {args.otel_file}", file=sys.stderr)
    if args.json:
        emit(args, None, to_jsonable(result))
    else:
        emit(args, render_profile(result, top=args.top), None)
    if recorder.export_error:  # after every other output: the profile itself is not lost
        raise DlbricksError(recorder.export_error)
    return 0

