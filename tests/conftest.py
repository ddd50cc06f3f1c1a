"""Shared fixtures: the nine light models shipped with onnx, and small graph builders."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import onnx
import pytest

# Runtime graphs are cached (dlbricks.files.cache_dir): in a folder of this run's own,
# so that the tests neither read a cache an older dlbricks wrote nor leave one behind.
_CACHE_DIR = tempfile.mkdtemp(prefix="dlbricks-test-cache-")
os.environ["DLBRICKS_CACHE_DIR"] = _CACHE_DIR

LIGHT_DIR = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"
LIGHT_MODELS = sorted(LIGHT_DIR.glob("light_*.onnx"))


def light(name: str) -> Path:
    """Path of one light model, e.g. light("resnet50")."""
    path = LIGHT_DIR / f"light_{name}.onnx"
    if not path.exists():
        raise FileNotFoundError(path)
    return path


@pytest.fixture(scope="session")
def light_dir() -> Path:
    return LIGHT_DIR


@pytest.fixture(scope="session")
def light_paths() -> list[Path]:
    assert len(LIGHT_MODELS) == 9, LIGHT_MODELS
    return LIGHT_MODELS


# Ray's native threads can crash the interpreter while it tears down after a process
# has run ray.init()/ray.shutdown() several times (ray-project/ray#31145): CI saw a
# segfault after "467 passed". When Ray was used, end the process right after pytest
# has reported, with pytest's own exit status, instead of running that teardown.
_EXIT_STATUS = {"status": 0}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS["status"] = int(exitstatus)
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    import sys

    if "ray" in sys.modules and not os.environ.get("DLBRICKS_TEST_NORMAL_EXIT"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS["status"])
