"""Progress of a long run on stderr."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import rich.progress

__all__ = ["Progress"]

#: A plain progress line at least this often (seconds), even when nothing finished.
LINE_EVERY_S = 30.0


class Progress:
    """Progress on stderr: a rich bar (done, total, status, ETA) on a terminal, else a
    plain line every 10% or 30 s, so logs of long runs show that they advance.

    The ETA is the caller's when it has one (:meth:`update`; the measurement engine
    knows how many rounds each session still needs), else the elapsed time per item
    finished times the items left (:meth:`advance`)."""

    def __init__(self, enabled: bool, description: str) -> None:
        self.enabled = enabled
        self.description = description
        self._progress: rich.progress.Progress | None = None
        self._task: Any = None
        self._total = 0
        self._done = 0
        self._start = time.perf_counter()
        self._last_line = self._start
        self._last_pct = -1

    def __enter__(self) -> Progress:
        if self.enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TextColumn("eta {task.fields[eta]}"),
                TimeElapsedColumn(),
                console=Console(file=sys.stderr),
                transient=False,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(self.description, total=0, status="", eta="-")
        return self

    def set_total(self, total: int) -> None:
        self._total = total
        if self._progress is not None:
            self._progress.update(self._task, total=total)

    def advance(self, n: int = 1) -> None:
        """``n`` more items finished; the ETA is extrapolated from the rate so far."""
        done = self._done + n
        elapsed = time.perf_counter() - self._start
        self.update(done, eta_s=elapsed / done * (self._total - done) if done else None)

    def update(self, done: int, *, eta_s: float | None = None, status: str = "") -> None:
        """``done`` items finished in all; ``eta_s`` seconds to go (None: unknown);
        ``status`` says what the run is doing (e.g. "round 7")."""
        self._done = done
        eta = _duration(eta_s)
        if self._progress is not None:
            self._progress.update(self._task, completed=done, status=status, eta=eta)
            return
        if not (self.enabled and self._total):
            return
        now = time.perf_counter()
        pct = 100 * done // self._total
        if pct // 10 > self._last_pct // 10 or now - self._last_line >= LINE_EVERY_S or done == self._total:
            doing = f", {status}" if status else ""
            print(f"{self.description}: {done}/{self._total} ({pct}%){doing}, {now - self._start:.0f} s elapsed, "
                  f"eta {eta}", file=sys.stderr, flush=True)
            self._last_line, self._last_pct = now, pct

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(None, None, None)


def _duration(seconds: float | None) -> str:
    """"1 h 05 min", "4 min 10 s", "35 s"; "-" when unknown."""
    if seconds is None or seconds != seconds:
        return "-"
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    if s >= 60:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s} s"
