"""The ``dlbricks`` command line.

Each subcommand lives in ``dlbricks.commands.<name>`` and exports
``add_parser(subparsers)`` (which registers it and sets ``func``) and the function
it points at, ``run(args) -> int``. Results go to stdout, diagnostics to stderr.
Exit codes: 0 ok, 1 failure (bad model, failed run), 2 usage error.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dlbricks import __version__
from dlbricks.model import DlbricksError, UsageError

# Order here is the order in `dlbricks --help`.
_COMMANDS = [
    "demo",
    "analyze",
    "generate",
    "bench",
    "construct",
    "evaluate",
    "report",
    "results",
    "profile",
    "roofline",
]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with ``only``, just that subcommand is registered.

    Registering all ten subcommands costs several milliseconds (argparse builds
    formatters for every option), more than ``dlbricks analyze`` spends on a small
    corpus, so :func:`main` registers only the command it runs.
    """
    parser = argparse.ArgumentParser(
        prog="dlbricks",
        description="Benchmark DL models cheaply: decompose into bricks, dedup, time, reconstruct.",
    )
    parser.add_argument("--version", action="version", version=f"dlbricks {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        if only is not None and name != only:
            continue
        try:
            module = importlib.import_module(f"dlbricks.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"dlbricks.commands.{name}":
                continue  # command not available in this build
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # The first argument names the command unless it is an option (--help, --version).
    only = argv[0] if argv and argv[0] in _COMMANDS else None
    parser = build_parser(only)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"dlbricks {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except DlbricksError as exc:
        print(f"dlbricks {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"dlbricks {args.command}: interrupted", file=sys.stderr)
        return 130
