"""Progress of a long run on stderr."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import rich.progress

__all__ = ["Progress"]


class Progress:
    """Progress on stderr: a rich bar (done, total, ETA) on a terminal, else a plain
    line every 10% or 30 s, so logs of long runs show that they advance."""

    def __init__(self, enabled: bool, description: str) -> None:
        self.enabled = enabled
        self.description = description
        self._progress: rich.progress.Progress | None = None
        self._task: Any = None
        self._total = 0
        self._done = 0
        self._start = time.perf_counter()
        self._last_line = 0.0
        self._last_pct = -1

    def __enter__(self) -> Progress:
        if self.enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TimeElapsedColumn(),
                console=Console(file=sys.stderr),
                transient=False,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(self.description, total=0)
        return self

    def set_total(self, total: int) -> None:
        self._total = total
        if self._progress is not None:
            self._progress.update(self._task, total=total)

    def advance(self, n: int = 1) -> None:
        self._done += n
        if self._progress is not None:
            self._progress.advance(self._task, n)
        elif self.enabled and self._total:
            now = time.perf_counter()
            pct = 100 * self._done // self._total
            if pct // 10 > self._last_pct // 10 or now - self._last_line > 30 or self._done == self._total:
                elapsed = now - self._start
                eta = elapsed / self._done * (self._total - self._done)
                print(f"{self.description}: {self._done}/{self._total} ({pct}%), {elapsed:.0f} s elapsed, "
                      f"eta {eta:.0f} s", file=sys.stderr, flush=True)
                self._last_line, self._last_pct = now, pct

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(None, None, None)
