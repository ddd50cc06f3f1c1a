"""The README's Python example, saved as a file and run as a user would: `python script.py`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import onnx
from test_pipeline import chain_model, diamond_model

README = Path(__file__).resolve().parent.parent / "README.md"


def _api_snippet() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_runs_as_a_script_without_a_main_guard(tmp_path):
    code = _api_snippet()
    assert "__main__" not in code  # the point: a plain script
    (tmp_path / "models").mkdir()
    onnx.save(chain_model(3), str(tmp_path / "models" / "chain.onnx"))
    onnx.save(diamond_model(), str(tmp_path / "models" / "diamond.onnx"))
    script = tmp_path / "script.py"
    script.write_text(code, encoding="utf-8")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "timing worker died" not in run.stderr and "bootstrapping" not in run.stderr
    assert "GAccuracy(G=1" in run.stdout
    assert re.search(r"^chain [0-9.e-]+ [0-9.]+ ", run.stdout, re.M), run.stdout
    assert (tmp_path / "results.sqlite").is_file()
