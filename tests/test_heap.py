"""timing/heap.py: memory a process frees stays with it for what it allocates next."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dlbricks.timing.heap import TUNABLES, with_tunables

_PROBE = """
import json, sys, time, numpy as np
from dlbricks.timing.heap import held_bytes, keep_freed_memory, resident_bytes
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
a = np.ones(256 << 17)  # 256 MiB, every page touched
held, live = resident_bytes(), held_bytes()
del a
print(json.dumps({"kept": kept, "held": held, "freed": resident_bytes(), "live": live, "live_freed": held_bytes()}))
"""


def test_tunables_replace_those_of_the_same_name_and_keep_the_others():
    env = {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=5:glibc.malloc.arena_max=2", "X": "1"}
    out = with_tunables(env, TUNABLES)
    assert out["X"] == "1" and env["GLIBC_TUNABLES"] == "glibc.malloc.mmap_max=5:glibc.malloc.arena_max=2"
    assert out["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:" + ":".join(TUNABLES)
    assert with_tunables({}, ["a=1"])["GLIBC_TUNABLES"] == "a=1"


def _probe(mode: str, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True, env=env)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="no /proc to read resident sizes from")
def test_freed_memory_stays_resident_where_it_is_kept_and_goes_back_where_not():
    kept = _probe("keep")
    if not kept["kept"]:
        pytest.skip("not glibc: malloc's own policy applies")
    assert kept["freed"] > kept["held"] - (16 << 20), kept
    # What the live data hold drops all the same (the engine's memory budget counts that).
    assert kept["live"] > 256 << 20 and kept["live_freed"] < kept["live"] - (240 << 20), kept
    # The tunables do for a new process what keep_freed_memory does for a running one.
    tuned = _probe("no", with_tunables(dict(os.environ), TUNABLES))
    assert tuned["freed"] > tuned["held"] - (16 << 20), tuned
    # Without either, glibc gives a block that large back as soon as it is freed.
    default = _probe("no", {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"})
    assert default["freed"] < default["held"] - (200 << 20), default


def test_workers_numpy_asks_for_huge_pages_only_when_the_configuration_does():
    from dlbricks.timing.config import RunnerConfig
    from dlbricks.timing.engine_process import worker_env

    def numpy_advice(env: dict[str, str]) -> str:
        # What numpy in a process started with ``env`` does with the advice: it reads
        # the variable at import, and its setter returns the state it replaces.
        code = "from numpy._core.multiarray import _set_madvise_hugepage as s; print(s(False))"
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              check=True).stdout.strip()

    pytest.importorskip("numpy._core.multiarray")
    assert numpy_advice(worker_env(RunnerConfig(huge_pages=False))) == "False"
    assert numpy_advice(worker_env(RunnerConfig(huge_pages=True))) in ("True", "False")  # the kernel may not offer it
    assert worker_env(RunnerConfig(huge_pages=True))["NUMPY_MADVISE_HUGEPAGE"] == "1"
