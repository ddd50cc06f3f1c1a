"""The progress display's plain-line mode (what logs and CI show)."""

from __future__ import annotations

import pytest

from dlbricks import progress
from dlbricks.progress import Progress


def test_a_line_comes_every_so_often_while_nothing_finishes(capsys, monkeypatch):
    # Opening thousands of sessions finishes nothing for minutes: the log must still
    # say what the run is doing and how long it has to go.
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    with Progress(True, "benchmarking") as bar:
        bar.set_total(200)
        bar.update(0, eta_s=125.0, status="opening sessions (80 of 200)")
    err = capsys.readouterr().err
    assert "benchmarking: 0/200 (0%), opening sessions (80 of 200)" in err
    assert "eta 2 min 05 s" in err


def test_lines_come_at_the_first_item_and_each_tenth_not_at_every_item(capsys):
    with Progress(True, "benchmarking") as bar:
        bar.set_total(100)
        for done in range(1, 101):
            bar.update(done, eta_s=None, status="round 3")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 11, lines
    assert lines[0].startswith("benchmarking: 1/100 (1%)")
    assert lines[-1].startswith("benchmarking: 100/100 (100%), round 3") and lines[-1].endswith("eta -")


def test_advance_extrapolates_the_rate_when_the_caller_has_no_estimate(capsys):
    with Progress(True, "generating") as bar:
        bar.set_total(2)
        bar.advance()
        bar.advance()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("generating: 1/2 (50%)") and lines[-1].startswith("generating: 2/2 (100%)")
    assert lines[-1].endswith("eta 0 s")


def test_disabled_progress_prints_nothing(capsys):
    with Progress(False, "benchmarking") as bar:
        bar.set_total(3)
        bar.update(3, eta_s=1.0)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("seconds, text", [(None, "-"), (float("nan"), "-"), (0.4, "0 s"), (59.6, "1 min 00 s"),
                                           (250, "4 min 10 s"), (3900, "1 h 05 min")])
def test_durations_read_as_a_person_would_say_them(seconds, text):
    assert progress._duration(seconds) == text
