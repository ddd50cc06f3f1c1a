"""``dlbricks results``: export the results store as CSV, JSON or Parquet."""

from __future__ import annotations

import argparse
import sys

from dlbricks.store import EXPORT_FORMATS, KINDS, Store, StoreError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "results",
        help="export stored brick/model timings",
        description="Export the results store. CSV has one row per result; JSON adds systems, "
        "configs and every raw iteration time; Parquet needs pyarrow.",
    )
    p.add_argument("--store", metavar="PATH", help="results store (default: the user cache store)")
    p.add_argument("--format", choices=EXPORT_FORMATS, default="csv", help="output format (default: csv)")
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    p.add_argument("--kind", choices=KINDS, help="only brick or only model results")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Export; returns 0.

    Raises:
        StoreError: the store is missing or unreadable, or the format needs a
            missing package.
    """
    with Store(args.store, readonly=True) as store:
        if args.output:
            n = store.export(args.format, args.output, kind=args.kind)
        elif args.format == "parquet":
            if sys.stdout.isatty():
                raise StoreError("refusing to write Parquet to a terminal; use -o FILE")
            n = store.export(args.format, sys.stdout.buffer, kind=args.kind)
        else:
            n = store.export(args.format, sys.stdout, kind=args.kind)
    print(f"dlbricks results: {n} result(s) from {store.path}", file=sys.stderr)
    return 0
