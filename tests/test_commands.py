"""The subcommands' shared behaviour: exit codes, model naming, options reaching every model."""

from __future__ import annotations

import pytest

from dlbricks.cli import main

FAST_CLI = ["--no-pin", "--warmup", "1", "--warmup-time", "0", "--min-iters", "5", "--min-time", "0.005", "--max-time", "0.05"]


def test_an_impossible_runner_setting_is_a_usage_error(tmp_path, capsys):
    code = main(["bench", str(tmp_path), "--no-pin", "--min-time", "2", "--max-time", "1", "--store", str(tmp_path / "s.sqlite")])
    err = capsys.readouterr().err
    assert code == 2 and "max_time" in err and len(err.splitlines()) == 1


def test_a_bug_building_the_runner_configuration_is_not_a_usage_error(tmp_path, monkeypatch):
    import dlbricks.timing

    def broken(**kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(dlbricks.timing, "RunnerConfig", broken)
    # Propagates: the console script exits 1 with the traceback, never 2.
    with pytest.raises(RuntimeError, match="a bug"):
        main(["bench", str(tmp_path), "--no-pin", "--store", str(tmp_path / "s.sqlite")])
