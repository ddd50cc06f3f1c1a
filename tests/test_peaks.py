"""Measured machine peaks: structure and plausibility (never speed), cache parsing,
and the JSON cache."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

import dlbricks.roofline.peaks as peaks_mod
from dlbricks.roofline.peaks import CacheLevel, Peaks, cache_levels, load_or_measure_peaks, measure_peaks


@pytest.fixture(scope="module")
def quick_peaks() -> Peaks:
    return measure_peaks(threads=1, quick=True)


def test_quick_measurement_returns_positive_plausible_rates(quick_peaks):
    p = quick_peaks
    assert p.threads == 1 and p.quick
    rates = [p.gflops, p.copy_gbs, p.triad_gbs, p.ort_scale_gbs, p.ort_add_gbs]
    assert all(math.isfinite(r) and r > 0 for r in rates)
    # Plausible for any CPU: 0.1 GFLOP/s .. 100 TFLOP/s, 0.1 GB/s .. 10 TB/s.
    assert 0.1 < p.gflops < 1e5
    assert all(0.1 < r < 1e4 for r in rates[1:])
    assert p.gflops == max(p.gflops_by_size.values())
    assert len(p.gflops_by_size) >= 2
    assert p.bandwidth_gbs == max(rates[1:])
    assert p.ridge_point == pytest.approx(p.gflops / p.bandwidth_gbs)
    assert p.elapsed_s > 0


def test_quick_measurement_has_an_int8_matmul_peak(quick_peaks):
    p = quick_peaks
    assert p.int8_gops is not None and math.isfinite(p.int8_gops) and 0.1 < p.int8_gops < 1e6
    assert p.int8_gops == max(p.int8_gops_by_size.values())
    assert set(p.int8_gops_by_size) == set(p.gflops_by_size)
    assert p.int8_ridge_point == pytest.approx(p.int8_gops / p.bandwidth_gbs)


def test_stream_arrays_are_twice_the_last_level_cache_within_bounds(quick_peaks):
    from dlbricks.roofline.peaks import STREAM_MAX_BYTES, stream_array_bytes

    assert quick_peaks.stream_bytes == stream_array_bytes(quick_peaks.last_level_cache_bytes)
    assert stream_array_bytes(0) == 64 << 20  # cache sizes unknown
    assert stream_array_bytes(40 << 20) == 80 << 20
    assert stream_array_bytes(480 << 20) == STREAM_MAX_BYTES == 256 << 20  # a VM shown its host's L3


def test_peaks_round_trip_through_json(quick_peaks):
    d = json.loads(json.dumps(quick_peaks.to_dict()))
    assert d["schema_version"] == 1 and d["bandwidth_gbs"] == quick_peaks.bandwidth_gbs
    assert {"onnxruntime", "numpy", "cpu_count"} <= set(d["context"])
    assert Peaks.from_dict(d) == quick_peaks


def test_from_dict_ignores_unknown_keys_and_rejects_other_schemas(quick_peaks):
    d = quick_peaks.to_dict()
    d["added_later"] = 1
    assert Peaks.from_dict(d) == quick_peaks
    d["schema_version"] = 99
    with pytest.raises(ValueError, match="schema_version"):
        Peaks.from_dict(d)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_pinned_measurement_records_cores_and_restores_affinity():
    before = os.sched_getaffinity(0)
    core = min(before)
    p = measure_peaks(threads=1, cores=[core], quick=True)
    assert p.cores == [core] and p.gflops > 0
    assert os.sched_getaffinity(0) == before


def test_measuring_leaves_the_threads_fp_state_alone():
    from dlbricks.timing.fpenv import denormals_flushed

    flushed = denormals_flushed()
    measure_peaks(threads=1, quick=True)
    assert denormals_flushed() == flushed


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="threads"):
        measure_peaks(threads=0, quick=True)
    with pytest.raises(ValueError, match="cores"):
        measure_peaks(cores=[], quick=True)


# --------------------------------------------------------------------------- caches


def _fake_sysfs(root: Path, entries: list[dict[str, str]]) -> Path:
    for k, e in enumerate(entries):
        d = root / f"index{k}"
        d.mkdir(parents=True)
        for name, value in e.items():
            (d / name).write_text(value + "\n")
    return root


def test_cache_levels_parse_sysfs(tmp_path):
    root = _fake_sysfs(tmp_path / "cache", [
        {"level": "1", "type": "Data", "size": "32K", "shared_cpu_list": "0",
         "coherency_line_size": "64"},
        {"level": "1", "type": "Instruction", "size": "32K", "shared_cpu_list": "0"},
        {"level": "3", "type": "Unified", "size": "32768K", "shared_cpu_list": "0-3,8",
         "coherency_line_size": "64"},
        {"level": "2", "type": "Unified", "size": "1M", "shared_cpu_list": "0-1"},
    ])
    caches = cache_levels(root)
    assert [(c.level, c.type) for c in caches] == [
        (1, "Data"), (1, "Instruction"), (2, "Unified"), (3, "Unified")]
    assert caches[0] == CacheLevel(1, "Data", 32768, 1, 64)
    assert caches[2].size_bytes == 1 << 20 and caches[2].shared_cpus == 2
    assert caches[3].size_bytes == 32 << 20 and caches[3].shared_cpus == 5
    p = Peaks(threads=1, gflops=1, copy_gbs=1, triad_gbs=1, ort_scale_gbs=1, ort_add_gbs=1,
              caches=caches)
    assert p.last_level_cache_bytes == 32 << 20


def test_cache_levels_fall_back_to_lscpu(tmp_path, monkeypatch):
    out = {"caches": [
        {"name": "L1d", "one-size": "49152", "all-size": "98304", "type": "Data", "level": 1,
         "coherency-size": 64},
        {"name": "L3", "one-size": "33554432", "all-size": "33554432", "type": "Unified",
         "level": 3, "coherency-size": 64},
    ]}

    def fake_run(cmd, **kwargs):
        assert cmd[0] == "lscpu"
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(out), stderr="")

    monkeypatch.setattr(peaks_mod.subprocess, "run", fake_run)
    monkeypatch.setattr(peaks_mod.os, "cpu_count", lambda: 2)
    caches = cache_levels(tmp_path / "missing")
    assert [(c.level, c.size_bytes, c.shared_cpus) for c in caches] == [
        (1, 49152, 1), (3, 33554432, 2)]


def test_cache_levels_are_empty_when_no_source_answers(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(peaks_mod.subprocess, "run", failing_run)
    assert cache_levels(tmp_path) == []


# --------------------------------------------------------------------------- JSON cache


@pytest.fixture()
def counting_measure(monkeypatch):
    """Replaces the measurement with a cheap fake that counts its calls."""
    calls: list[tuple[int, object, bool]] = []

    def fake(threads: int = 1, cores=None, quick: bool = False) -> Peaks:
        calls.append((threads, cores, quick))
        return Peaks(threads=threads, gflops=10.0 + len(calls), copy_gbs=5.0, triad_gbs=6.0,
                     ort_scale_gbs=4.0, ort_add_gbs=3.0, int8_gops=40.0, quick=quick,
                     cores=list(cores) if cores is not None else None)

    monkeypatch.setattr(peaks_mod, "measure_peaks", fake)
    return calls


def test_cache_hit_returns_the_stored_peaks_without_measuring(tmp_path, counting_measure):
    first = load_or_measure_peaks(tmp_path, "machine-a", quick=True)
    second = load_or_measure_peaks(tmp_path, "machine-a", quick=True)
    assert len(counting_measure) == 1
    assert second == first and second.fingerprint == "machine-a"
    assert len(list(tmp_path.glob("peaks-*.json"))) == 1


def test_cache_is_keyed_by_fingerprint_threads_and_cores(tmp_path, counting_measure):
    load_or_measure_peaks(tmp_path, "machine-a")
    load_or_measure_peaks(tmp_path, "machine-b")
    load_or_measure_peaks(tmp_path, "machine-a", threads=2)
    load_or_measure_peaks(tmp_path, "machine-a", cores=[0])
    assert len(counting_measure) == 4
    load_or_measure_peaks(tmp_path, "machine-b")
    assert len(counting_measure) == 4


def test_cached_quick_peaks_do_not_satisfy_a_full_request(tmp_path, counting_measure):
    load_or_measure_peaks(tmp_path, "m", quick=True)
    full = load_or_measure_peaks(tmp_path, "m", quick=False)
    assert not full.quick and len(counting_measure) == 2
    again = load_or_measure_peaks(tmp_path, "m", quick=True)  # a full result serves quick
    assert again == full and len(counting_measure) == 2


def test_cached_peaks_without_the_int8_peak_are_remeasured(tmp_path, counting_measure):
    load_or_measure_peaks(tmp_path, "m")
    (path,) = tmp_path.glob("peaks-*.json")
    old = json.loads(path.read_text())
    del old["int8_gops"], old["int8_gops_by_size"]  # written before the int8 peak existed
    path.write_text(json.dumps(old))
    assert Peaks.from_dict(old).int8_gops is None and Peaks.from_dict(old).int8_ridge_point is None
    p = load_or_measure_peaks(tmp_path, "m")
    assert len(counting_measure) == 2 and p.int8_gops == 40.0
    assert json.loads(path.read_text())["int8_gops"] == 40.0


def test_corrupt_cache_is_remeasured_and_replaced(tmp_path, counting_measure, capsys):
    load_or_measure_peaks(tmp_path, "m")
    (path,) = tmp_path.glob("peaks-*.json")
    path.write_text("{not json")
    p = load_or_measure_peaks(tmp_path, "m")
    assert len(counting_measure) == 2
    assert "unreadable peaks cache" in capsys.readouterr().err
    assert Peaks.from_dict(json.loads(path.read_text())) == p


def test_no_store_dir_measures_every_time(counting_measure):
    a = load_or_measure_peaks(None, "m")
    b = load_or_measure_peaks(None, "m")
    assert len(counting_measure) == 2 and a.fingerprint == b.fingerprint == "m"
