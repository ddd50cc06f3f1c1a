"""What else ran on the machine while the engine timed (dlbricks.timing.hostload)."""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

from dlbricks.timing.hostload import BUSY_OTHER_CPUS, BUSY_STEAL, HostLoad, LoadReading, host_load, read_load


def _reading(wall: float, busy: float, own: float, steal: float = 0.0, total: float | None = None) -> LoadReading:
    return LoadReading(wall_s=wall, busy_s=busy, steal_s=steal, total_s=total if total is not None else 2 * wall,
                       own_s=own)


def test_other_processes_are_the_machines_busy_time_less_this_process_and_its_children():
    # 10 s: the machine busy for 14 CPU-seconds, 11 of them ours -> 0.3 CPUs of others.
    load = host_load(_reading(100.0, 50.0, 20.0), _reading(110.0, 64.0, 31.0))
    assert load is not None
    assert load.seconds == pytest.approx(10.0) and load.other_cpus == pytest.approx(0.3)
    # Our own time can exceed the machine's by the counters' rounding: never below zero.
    assert host_load(_reading(0.0, 0.0, 0.0), _reading(10.0, 5.0, 5.1)).other_cpus == 0.0


def test_steal_is_a_share_of_the_machines_cpu_time():
    load = host_load(_reading(0.0, 0.0, 0.0, steal=0.0, total=0.0), _reading(10.0, 1.0, 1.0, steal=1.0, total=20.0))
    assert load is not None and load.steal == pytest.approx(0.05) and load.busy


@pytest.mark.parametrize(("other", "steal", "busy"), [
    (0.0, 0.0, False),
    (BUSY_OTHER_CPUS * 0.9, BUSY_STEAL * 0.9, False),
    (BUSY_OTHER_CPUS, 0.0, True),
    (0.0, BUSY_STEAL, True),
])
def test_a_run_is_busy_when_others_or_the_hypervisor_took_enough(other, steal, busy):
    load = HostLoad(seconds=8.0, other_cpus=other, steal=steal)
    assert load.busy is busy
    assert HostLoad.from_dict(json.loads(json.dumps(load.to_dict()))) == load


def test_the_shared_cache_readings_are_summarized_and_kept_in_the_json():
    load = host_load(_reading(0.0, 0.0, 0.0), _reading(10.0, 1.0, 1.0), [2.5, 2.0, 3.4])
    assert load is not None and load.shared_cache == (2.5, 2.0, 3.4)
    d = json.loads(json.dumps(load.to_dict()))
    assert d["shared_cache"] == 2.5 and d["shared_cache_range"] == [2.0, 3.4]
    assert HostLoad.from_dict(d) == load
    assert "shared_cache" not in host_load(_reading(0.0, 0.0, 0.0), _reading(10.0, 1.0, 1.0)).to_dict()


def test_loads_of_several_runs_combine_weighted_by_their_seconds():
    from dlbricks.timing.hostload import combine_loads

    a = HostLoad(seconds=10.0, other_cpus=0.1, steal=0.0, shared_cache=(2.0, 1.5, 3.0))
    b = HostLoad(seconds=30.0, other_cpus=0.7, steal=0.08)
    c = HostLoad(seconds=20.0, other_cpus=0.0, steal=0.0, shared_cache=(2.4, 1.2, 2.6))
    both = combine_loads([a, b, c])
    assert both is not None and both.seconds == 60.0
    assert both.other_cpus == pytest.approx((1.0 + 21.0) / 60) and both.steal == pytest.approx(2.4 / 60)
    assert both.shared_cache == (pytest.approx(2.2), 1.2, 3.0) and both.busy
    assert combine_loads([]) is None and combine_loads([b]).shared_cache is None


def test_the_shared_cache_probe_reads_more_when_its_buffer_left_the_cache():
    from dlbricks.roofline.peaks import data_cache_bytes
    from dlbricks.timing.cacheprobe import SharedCacheProbe, probe_nbytes

    class Evicted(SharedCacheProbe):
        # What a neighbour streaming through memory does while the core waits. Twice the
        # whole last-level cache as reported, not the 64 MiB the cold state counts: a
        # Xeon whose L3 (480 MiB on a 2-vCPU VM) keeps data that was reused against a
        # single stream read 1.09x after 128 MiB of it, 1.54x after 512 MiB, 1.95x after 1 GiB.
        stream = np.ones(2 * min(data_cache_bytes() or 32 << 20, 512 << 20), dtype=np.uint8)

        def _wait(self) -> None:
            np.add.reduce(self.stream[::64])

    nbytes = probe_nbytes()
    assert nbytes >= 64
    cached = SharedCacheProbe(nbytes, idle_s=0.0)
    evicted = Evicted(nbytes)
    quiet = statistics.median(cached.read() for _ in range(9))
    streamed = statistics.median(evicted.read() for _ in range(9))
    assert 0.5 < quiet < streamed and streamed > 1.2 * quiet, (quiet, streamed)


def test_the_warning_names_the_load_and_the_steal_only_when_there_is_some():
    text = HostLoad(seconds=7.2, other_cpus=0.88, steal=0.0).describe()
    assert "0.88 CPUs" in text and "7 s" in text and "hypervisor" not in text and "normalized latency" in text
    assert "3%" in HostLoad(seconds=7.2, other_cpus=0.0, steal=0.03).describe()


def test_no_reading_no_load(tmp_path: Path):
    assert host_load(None, _reading(1.0, 1.0, 1.0)) is None
    assert host_load(_reading(1.0, 1.0, 1.0), _reading(1.0, 1.0, 1.0)) is None  # no time passed
    assert read_load(str(tmp_path / "missing")) is None
    (tmp_path / "stat").write_text("intr 1 2 3\n")
    assert read_load(str(tmp_path / "stat")) is None
    (tmp_path / "stat").write_text("cpu  100 0 50 1000 5 1 2 7 0 0\ncpu0 100 0 50 1000 5 1 2 7 0 0\n")
    r = read_load(str(tmp_path / "stat"))
    tick = os.sysconf("SC_CLK_TCK")
    assert r is not None and r.busy_s == pytest.approx(153 / tick) and r.steal_s == pytest.approx(7 / tick)
    assert r.total_s == pytest.approx(1165 / tick)


def _spin(cpu: int, stop) -> None:
    os.sched_setaffinity(0, {cpu})
    while not stop.is_set():
        pass


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs /proc/stat and a second CPU")
def test_a_real_run_counts_a_busy_neighbour_and_not_its_own_workers():
    from test_engine import _matmul_model

    from dlbricks.timing import RunnerConfig
    from dlbricks.timing.engine import EngineItem, measure

    def run() -> HostLoad:
        items = [EngineItem(f"mm{n}", _matmul_model(n, f"mm{n}"), label=f"mm{n}") for n in (64, 128)]
        summary = measure(items, [], RunnerConfig(min_span_s=1.5), on_result=lambda it, r: None)
        assert summary.measured == 2 and summary.host is not None
        assert summary.host.shared_cache is not None  # one reading a round
        med, lo, hi = summary.host.shared_cache
        assert 0.0 < lo <= med <= hi
        return summary.host

    # Alone, the workers' time (a CPU's worth while rounds run) is the run's own.
    assert run().other_cpus < 0.5
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    # On a CPU the engine does not time on (it times on the last usable one).
    spinner = ctx.Process(target=_spin, args=(min(os.sched_getaffinity(0)), stop), daemon=True)
    spinner.start()
    try:
        busy = run()
    finally:
        stop.set()
        spinner.join(5)
    assert busy.other_cpus >= 0.4 and busy.busy, busy


def test_a_busy_machine_is_in_evaluates_json_its_warnings_and_the_report(tmp_path: Path, capsys, monkeypatch):
    import onnx
    from test_pipeline import FAST_CLI, chain_model

    import dlbricks.timing.engine as engine
    from dlbricks.cli import main
    from dlbricks.report.html import build_report

    path = tmp_path / "chain.onnx"
    onnx.save(chain_model(2), str(path))
    store = str(tmp_path / "s.sqlite")
    # A quiet machine: the load is reported, nothing is said.
    monkeypatch.setattr(engine, "host_load", lambda *readings: HostLoad(3.0, 0.01, 0.0))
    assert main(["evaluate", str(path), "-G", "1", "--store", store, "--json", "--bootstrap", "20", *FAST_CLI]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["host"] == {"seconds": 3.0, "other_cpus": 0.01, "steal": 0.0, "busy": False}
    assert "busy" not in captured.err
    # A busy one: a warning, the JSON says so, and so does the report.
    monkeypatch.setattr(engine, "host_load", lambda *readings: HostLoad(3.0, 0.9, 0.0))
    assert main(["evaluate", str(path), "-G", "1", "--store", str(tmp_path / "t.sqlite"), "--json",
                 "--bootstrap", "20", *FAST_CLI]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["host"]["busy"] and result["host"]["other_cpus"] == 0.9
    assert "dlbricks: warning: the machine was busy while timing: other processes kept 0.90 CPUs" in captured.err
    assert "Busy machine" in build_report(None, result) and "Busy machine" not in build_report(
        None, {**result, "host": None})
    # Nothing measured (all from the store): no load to speak of.
    assert main(["evaluate", str(path), "-G", "1", "--store", store, "--json", "--bootstrap", "20", *FAST_CLI]) == 0
    assert json.loads(capsys.readouterr().out)["host"] is None


def test_bench_says_when_the_machine_was_busy(tmp_path: Path, capsys, monkeypatch):
    import onnx
    from test_pipeline import FAST_CLI, chain_model

    import dlbricks.timing.engine as engine
    from dlbricks.cli import main

    path = tmp_path / "chain.onnx"
    onnx.save(chain_model(2), str(path))
    monkeypatch.setattr(engine, "host_load", lambda *readings: HostLoad(2.0, 0.0, 0.08))
    assert main(["bench", str(path), "-G", "1", "--store", str(tmp_path / "s.sqlite"), "--json", *FAST_CLI]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["host"]["steal"] == 0.08
    assert "the hypervisor took 8% of its CPU time" in captured.err
