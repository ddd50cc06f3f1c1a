"""Shared fixtures: the nine light models shipped with onnx, and small graph builders."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import pytest

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
