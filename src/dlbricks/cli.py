"""The ``dlbricks`` command line.

Each subcommand lives in ``dlbricks.commands.<name>`` and exports
``add_parser(subparsers)`` (which registers it and sets ``func``) and the function
it points at, ``run(args) -> int``. Results go to stdout, diagnostics to stderr.
Exit codes: 0 ok, 1 failure (bad model, failed run), 2 usage error.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import shutil
import signal
import sys
from typing import Any, NoReturn

from dlbricks import __version__
from dlbricks.errors import DlbricksError, UsageError, os_error_text

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


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter with the terminal width looked up once per process.

    argparse builds a formatter for every option it registers (to check the option's
    format) and each one asks the terminal for its size; on a pipe that is a failing
    ioctl and an environment lookup per option.
    """

    _columns: int | None = None  # not _width: HelpFormatter's own instance attribute

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24, width: int | None = None):
        if width is None:
            if _HelpFormatter._columns is None:
                _HelpFormatter._columns = shutil.get_terminal_size().columns - 2
            width = _HelpFormatter._columns
        super().__init__(prog, indent_increment, max_help_position, width)


class _ArgumentParser(argparse.ArgumentParser):
    """Subcommand parsers are made with the main parser's class, so they share this default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """One line, as every other error: a command's usage block is twenty lines of
        options above the one that says what was wrong (``--help`` shows it)."""
        from gettext import gettext

        self.exit(2, gettext("%(prog)s: error: %(message)s\n") % {"prog": self.prog, "message": message})


class _OneCommand:
    """Stands in for the subcommand action when one known command runs: its parser is
    built alone, exactly as ``add_subparsers().add_parser`` builds it (same class, prog,
    options and help), without the main parser around it, which cost about as much
    again (argparse looks its messages' translations up on disk for every parser)."""

    def __init__(self) -> None:
        self.parser: argparse.ArgumentParser | None = None

    def add_parser(self, name: str, *, help: str | None = None, **kwargs) -> argparse.ArgumentParser:  # noqa: A002, ANN003
        kwargs.setdefault("prog", f"dlbricks {name}")
        self.parser = _ArgumentParser(**kwargs)
        self.parser.set_defaults(command=name)  # what the subcommand action records
        return self.parser


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with ``only``, the parser of just that subcommand, which
    takes the arguments after the command name.

    Registering all ten subcommands costs several milliseconds (argparse builds
    formatters for every option), more than ``dlbricks analyze`` spends on a small
    corpus, so :func:`main` builds only the command it runs.
    """
    if only is not None:
        module = _command_module(only)
        if module is not None:
            one = _OneCommand()
            module.add_parser(one)
            if one.parser is not None:
                return one.parser
    parser = _ArgumentParser(
        prog="dlbricks",
        description="Benchmark DL models cheaply: decompose into bricks, dedup, time, reconstruct.",
    )
    parser.add_argument("--version", action="version", version=f"dlbricks {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        module = _command_module(name)
        if module is not None:
            module.add_parser(sub)
    return parser


def _command_module(name: str):  # noqa: ANN202
    """The module of command ``name``, or None if this build lacks it."""
    try:
        return importlib.import_module(f"dlbricks.commands.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"dlbricks.commands.{name}":
            return None
        raise


# Parsers main() has built, by command (None: the main parser). A process that runs
# several commands (a pipeline calling main(), the tests) builds each parser once:
# parsing leaves a parser unchanged, and building analyze's costs more than parsing
# its arguments.
_parsers: dict[str | None, argparse.ArgumentParser] = {}


def console_main() -> int:
    """Entry point of the ``dlbricks`` program (and ``python -m dlbricks``): :func:`main`
    on ``sys.argv``, in a process that exits right after it.

    Before the interpreter shuts down, the objects alive now are moved out of the
    cyclic garbage collector's reach (``gc.freeze``). Shutdown otherwise runs full
    collections over every object of numpy, onnx and protobuf, only for the OS to free
    the whole heap a moment later; for a quick command that is most of the time spent
    after it returns. Shutdown itself is unchanged: atexit handlers run, streams are flushed, modules are torn
    down; only garbage cycles that are still alive at the end are left to the OS.

    A SIGTERM (``kill``, ``timeout``, a batch scheduler) ends the program as an
    interrupt does, through every ``finally``: the worker processes are stopped and
    the bricks spooled to ``/dev/shm`` (memory, gigabytes for a large corpus) are removed,
    where the default action would leave both behind.
    """
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return main()
    finally:
        gc.freeze()


def _warnings_as_lines() -> None:
    """Show dlbricks' own warnings (what a command goes on despite) as ``dlbricks:
    warning:`` lines, as :func:`dlbricks.errors.warn` writes them, not as Python's
    two-line warning with a source line; other warnings as Python shows them."""
    import warnings

    from dlbricks.errors import warn
    from dlbricks.loading.messages import DlbricksWarning

    shown = warnings.showwarning
    if getattr(shown, "dlbricks", False):
        return

    def show(message: Warning | str, category: type[Warning], *rest: Any, **kw: Any) -> None:
        if issubclass(category, DlbricksWarning):
            warn(str(message))
        else:
            shown(message, category, *rest, **kw)

    show.dlbricks = True  # type: ignore[attr-defined]
    warnings.showwarning = show


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # The first argument names the command unless it is an option (--help, --version).
    only = argv[0] if argv and argv[0] in _COMMANDS else None
    parser = _parsers.get(only)
    if parser is None:
        parser = _parsers[only] = build_parser(only)
    # A command's own parser takes what follows the command name.
    alone = only is not None and parser.prog != "dlbricks"
    args = parser.parse_args(argv[1:] if alone else argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    from dlbricks.timing.heap import keep_freed_memory, numpy_huge_pages

    # This process generates and parses model after model: memory it frees is kept
    # for the next one instead of being returned to the system, on small pages (see
    # timing/heap.py).
    keep_freed_memory()
    numpy_huge_pages(False)
    _warnings_as_lines()
    try:
        from dlbricks.commands._common import check_output_files

        check_output_files(args)
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
    except BrokenPipeError:
        # The reader went away (`dlbricks results | head`): stop quietly, and keep the
        # interpreter from complaining again when it flushes stdout at exit.
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except OSError as exc:
        # A path the user gave that cannot be made or written (a file where a folder
        # must go, a read-only folder, a full disk): the file and the cause, not a traceback.
        print(f"dlbricks {args.command}: error: {os_error_text(exc)}", file=sys.stderr)
        return 1
