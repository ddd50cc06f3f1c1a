"""What ``dlbricks profile`` measures and how: the levels and :class:`ProfileOptions`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from dlbricks.errors import UsageError
from dlbricks.timing import RunnerConfig

__all__ = ["LEVELS", "ProfileOptions", "parse_levels"]

#: The levels, bottom of the stack last.
LEVELS = ("model", "layer", "hw")


def parse_levels(text: str | Iterable[str]) -> tuple[str, ...]:
    """Parse ``model,layer,hw`` (any subset, any order) into canonical order.

    Raises:
        UsageError: an unknown level or none.
    """
    items = text.split(",") if isinstance(text, str) else list(text)
    chosen = {s.strip().lower() for s in items if s.strip()}
    bad = sorted(chosen - set(LEVELS))
    if bad:
        raise UsageError(f"--levels: unknown level {bad[0]!r} (choose from {', '.join(LEVELS)})")
    if not chosen:
        raise UsageError("--levels: no level given")
    return tuple(level for level in LEVELS if level in chosen)


def _default_brick_config() -> RunnerConfig:
    # Bricks are many: sample each briefly (a 5% CI is plenty to compare a layer's
    # isolated time with its in-model time).
    return RunnerConfig(warmup_iters=2, warmup_time=0.01, min_iters=5, min_time=0.02, max_time=0.25, target_ci=0.05)


@dataclass(frozen=True)
class ProfileOptions:
    """What to measure and how.

    Attributes:
        levels: a subset of :data:`LEVELS`.
        runs: profiled runs at the layer level (as many unprofiled runs follow).
        warmup: discarded runs before each timed block.
        brick_runs: counted runs per brick at the hw level (as many uncounted
            runs are interleaved).
        hw_bricks: run every kernel's brick at the hw level; False counts the
            whole model only.
        config: runner configuration of the model and layer levels.
        brick_config: runner configuration of the isolated brick timings.
        seed: input (and weight) seed.
        hw_events: perf events to count at the hw level.
        calibrate: measure the profiler's in-span cost (else it is taken as 0).
        worker_timeout_s: limit per hw-level job (session creation included).
    """

    levels: tuple[str, ...] = LEVELS
    runs: int = 10
    warmup: int = 3
    brick_runs: int = 10
    hw_bricks: bool = True
    config: RunnerConfig = field(default_factory=RunnerConfig)
    brick_config: RunnerConfig = field(default_factory=_default_brick_config)
    seed: int = 0
    hw_events: tuple[str, ...] = ()
    calibrate: bool = True
    worker_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", parse_levels(self.levels))
        for name in ("runs", "brick_runs"):
            if int(getattr(self, name)) < 1:
                raise UsageError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        if int(self.warmup) < 0:
            raise UsageError(f"warmup must be >= 0, got {self.warmup!r}")
        if not self.hw_events:
            from dlbricks.profiling.perfevents import HARDWARE_EVENTS, SOFTWARE_EVENTS

            object.__setattr__(self, "hw_events", HARDWARE_EVENTS + SOFTWARE_EVENTS)
