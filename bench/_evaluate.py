"""Run ``dlbricks evaluate`` as a user would (a fresh process, a fresh store) for the
benchmarks under bench/, and return its JSON and the command's wall-clock time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence


def light_models(names: Sequence[str] | None = None) -> list[str]:
    """Paths of the light model-zoo networks shipped with onnx (all nine by default)."""
    import onnx

    folder = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
    if not names:
        return [str(folder)]
    return [str(folder / f"light_{n}.onnx") for n in names]


def describe_host(host: dict[str, Any] | None) -> str:
    """``evaluate``'s ``host`` for a run's line: other processes' CPUs and the
    shared-cache probe's median reading ("" without one)."""
    if not host:
        return ""
    text = f"other processes {host['other_cpus']:.2f} CPUs"
    if host.get("shared_cache") is not None:
        text += f", shared cache {host['shared_cache']:.2f}"
    return text


def evaluate_cli(paths: Sequence[str], Gs: str, extra: Sequence[str] = (), store: str | None = None) -> tuple[dict[str, Any], float]:
    """``python -m dlbricks evaluate PATHS -G Gs --json`` in a fresh store (unless one is given)
    and a fresh cache.

    Raises:
        RuntimeError: the command failed (its stderr's last lines are in the message).
    """
    with tempfile.TemporaryDirectory(prefix="dlbricks-bench-") as tmp:
        store_path = store or str(Path(tmp) / "results.sqlite")
        cmd = [sys.executable, "-m", "dlbricks", "evaluate", *paths, "-G", Gs, "--store", store_path, "--json", *extra]
        # A fresh cache too: the figures are a first run's, runtime graphs derived.
        env = dict(os.environ, DLBRICKS_CACHE_DIR=str(Path(tmp) / "cache"))
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n" + "\n".join(proc.stderr.splitlines()[-15:]))
    return json.loads(proc.stdout), wall
