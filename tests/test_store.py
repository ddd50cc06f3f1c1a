"""Results store (dlbricks.store), system fingerprint (dlbricks.timing.sysinfo), `dlbricks results`."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import dlbricks
from dlbricks.cli import main
from dlbricks.store import APPLICATION_ID, SCHEMA_VERSION, Store, StoreError, default_store_path
from dlbricks.timing import Failure, Measurement, RunnerConfig, summarize
from dlbricks.timing.sysinfo import IDENTITY_FIELDS, fingerprint_id, system_fingerprint

SYSTEM = {"cpu": {"model": "Test CPU", "flags": ["avx2"], "logical_cores": 4}, "hostname": "box"}
CFG = RunnerConfig()
SRC = str(Path(dlbricks.__file__).resolve().parent.parent)


def _measurement(times=(100, 110, 105, 120, 101, 99, 104), seed=0, config=CFG) -> Measurement:
    t = np.asarray(times, dtype=np.int64)
    return Measurement(
        times_ns=t,
        stats=summarize(t),
        config=config,
        warmup_iters=5,
        stop_reason="converged",
        setup_time_s=0.01,
        wall_time_s=0.5,
        denormal_input_fraction=0.0,
        denormal_output_fraction=0.0,
        denormal_fraction=0.0,
        denormals_as_zero=True,
        denormals_flushed=True,
        ort_version="0.0",
        seed=seed,
    )


def _snapshot(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


# --------------------------------------------------------------------------- round trip


def test_result_round_trips_with_all_iterations(tmp_path):
    m = _measurement()
    with Store(tmp_path / "r.sqlite") as st:
        st.put_result("brick", bytes(range(16)), 1, SYSTEM, CFG, m)
        rec = st.get_result("brick", bytes(range(16)).hex(), 1, fingerprint_id(SYSTEM), CFG.key())
    assert rec is not None and rec.ok
    np.testing.assert_array_equal(rec.times_ns, m.times_ns)
    assert rec.median_ns == m.stats.median == 104
    assert rec.stats == m.stats.to_dict()
    assert rec.meta["warmup_iters"] == 5 and rec.meta["stop_reason"] == "converged"
    with Store(tmp_path / "r.sqlite") as st:
        [light] = st.results(with_times=False)
    assert light.times_ns is None and light.stats == rec.stats


def test_results_persist_across_reopen_and_record_system_and_config(tmp_path):
    path = tmp_path / "r.sqlite"
    with Store(path) as st:
        st.put_result("model", "ab" * 16, 2, SYSTEM, CFG, _measurement())
    with Store(path) as st:
        [rec] = list(st.results())
        assert (rec.kind, rec.digest, rec.digest_version) == ("model", "ab" * 16, 2)
        assert st.systems() == {fingerprint_id(SYSTEM): SYSTEM}
        assert RunnerConfig.from_dict(st.configs()[CFG.key()]) == CFG


def test_failure_is_stored_with_its_error(tmp_path):
    with Store(tmp_path / "r.sqlite") as st:
        st.put_result("brick", "01" * 16, 1, SYSTEM, CFG, Failure("b.onnx: worker crashed (SIGSEGV)", "crash", -11))
        rec = st.get_result("brick", "01" * 16, 1, fingerprint_id(SYSTEM), CFG.key())
    assert rec.status == "failed" and rec.stats is None and rec.times_ns is None
    assert "SIGSEGV" in rec.error and rec.meta["exitcode"] == -11


def test_put_result_replaces_an_existing_result(tmp_path):
    sid = fingerprint_id(SYSTEM)
    with Store(tmp_path / "r.sqlite") as st:
        st.put_result("brick", "02" * 16, 1, SYSTEM, CFG, Failure("first try timed out", "timeout"))
        st.put_result("brick", "02" * 16, 1, sid, CFG.key(), _measurement((7, 7, 7)))
        assert st.count() == 1
        rec = st.get_result("brick", "02" * 16, 1, sid, CFG.key())
    assert rec.ok and rec.median_ns == 7 and rec.error is None


def test_results_are_keyed_by_system_config_and_digest_version(tmp_path):
    other_cfg = RunnerConfig(intra_op_threads=2)
    other_sys = {**SYSTEM, "cpu": {**SYSTEM["cpu"], "model": "Other CPU"}}
    with Store(tmp_path / "r.sqlite") as st:
        for sysd, cfg, ver in [(SYSTEM, CFG, 1), (other_sys, CFG, 1), (SYSTEM, other_cfg, 1), (SYSTEM, CFG, 2)]:
            st.put_result("brick", "03" * 16, ver, sysd, cfg, _measurement(config=cfg))
        assert st.count() == 4
        assert len(list(st.results(config_key=other_cfg.key()))) == 1
        assert len(list(st.results(system_id=fingerprint_id(other_sys)))) == 1


def test_missing_lists_unmeasured_digests_in_order(tmp_path):
    sid, key = fingerprint_id(SYSTEM), CFG.key()
    digests = [f"{i:032x}" for i in range(1200)]  # more than one IN (...) chunk
    with Store(tmp_path / "r.sqlite") as st:
        stored = set(digests[::100]) | {digests[999]}
        for d in digests[::100]:
            st.put_result("brick", d, 1, SYSTEM, CFG, _measurement())
        st.put_result("brick", digests[999], 1, sid, key, Failure("boom"))
        missing = st.missing("brick", digests + digests[:3], 1, sid, key)
        assert missing == [d for d in digests if d not in stored]
        assert st.missing("brick", digests[998:1001], 1, sid, key, retry_failed=True) == digests[998:1000]
        assert st.missing("model", digests[:2], 1, sid, key) == digests[:2]
        assert st.missing("brick", [bytes.fromhex(digests[0])], 1, sid, key) == []


def test_unknown_system_or_config_reference_is_an_error(tmp_path):
    with Store(tmp_path / "r.sqlite") as st:
        with pytest.raises(StoreError, match="unknown system"):
            st.put_result("brick", "04" * 16, 1, "feedfacefeedface", CFG, _measurement())
        with pytest.raises(StoreError, match="kind"):
            st.put_result("layer", "04" * 16, 1, SYSTEM, CFG, _measurement())
        assert st.count() == 0


def test_brick_and_model_metadata_round_trip(tmp_path):
    with Store(tmp_path / "r.sqlite") as st:
        st.put_brick("05" * 16, 1, g=3, op_types=["Conv", "Relu"], shapes={"x": [1, 3, 8, 8]})
        st.put_model("06" * 16, 1, name="light_resnet50", meta={"layers": 120})
        assert st.bricks()[("05" * 16, 1)]["op_types"] == ["Conv", "Relu"]
        assert st.models()[("06" * 16, 1)] == {"name": "light_resnet50", "meta": {"layers": 120}}


def test_new_store_has_our_application_id_schema_version_and_wal(tmp_path):
    path = tmp_path / "r.sqlite"
    Store(path).close()
    con = sqlite3.connect(path)
    try:
        assert con.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
        assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        con.close()


def test_default_path_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_store_path() == tmp_path / "cache" / "dlbricks" / "results.sqlite"
    with Store() as st:
        assert st.path == default_store_path() and st.path.exists()


# --------------------------------------------------------------------------- refusing files


def test_a_text_file_is_rejected_and_left_untouched(tmp_path):
    path = tmp_path / "notes.sqlite"
    path.write_text("not a database\n" * 100)
    before = _snapshot(path)
    with pytest.raises(StoreError, match="notes.sqlite.*not a dlbricks results store"):
        Store(path)
    assert _snapshot(path) == before


def test_an_sqlite_file_of_another_application_is_rejected_and_left_untouched(tmp_path):
    path = tmp_path / "other.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE results (x)")
    con.commit()
    con.close()
    before = _snapshot(path)
    with pytest.raises(StoreError, match="other.db.*another application"):
        Store(path)
    assert _snapshot(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db"]


def test_a_store_from_a_newer_dlbricks_is_rejected_and_left_untouched(tmp_path):
    path = tmp_path / "r.sqlite"
    with Store(path) as st:
        st.put_result("brick", "07" * 16, 1, SYSTEM, CFG, _measurement())
    con = sqlite3.connect(path)
    con.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    con.execute("PRAGMA journal_mode = DELETE")  # fold the WAL so the file is all there is
    con.close()
    before = _snapshot(path)
    with pytest.raises(StoreError, match="r.sqlite.*newer dlbricks"):
        Store(path)
    with pytest.raises(StoreError, match="newer"):
        Store(path, readonly=True)
    assert _snapshot(path) == before


def test_readonly_open_of_a_missing_store_fails_without_creating_it(tmp_path):
    with pytest.raises(StoreError, match="no results store"):
        Store(tmp_path / "absent.sqlite", readonly=True)
    assert not (tmp_path / "absent.sqlite").exists()


def test_readonly_store_refuses_writes(tmp_path):
    path = tmp_path / "r.sqlite"
    Store(path).close()
    with Store(path, readonly=True) as st:
        with pytest.raises(StoreError, match="read-only"):
            st.put_result("brick", "08" * 16, 1, SYSTEM, CFG, _measurement())


# --------------------------------------------------------------------------- processes

_WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from dlbricks.store import Store
    from dlbricks.timing import Measurement, RunnerConfig, summarize

    path, tag, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    t = np.arange(100, 140, dtype=np.int64)
    m = Measurement(t, summarize(t), RunnerConfig(), 5, "converged", 0.0, 0.0, 0.0, 0.0, 0.0, True, True, "x")
    system = {"cpu": {"model": "Test CPU"}}
    with Store(path) as st:
        i = 0
        while count < 0 or i < count:
            st.put_result("brick", f"{tag}{i:030x}", 1, system, RunnerConfig(), m)
            print(i, flush=True)  # committed: put_result returns after COMMIT
            i += 1
    """
)


def _writer(path: Path, tag: str, count: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), tag, str(count)], stdout=subprocess.PIPE, text=True, env=env
    )


def test_two_concurrent_writer_processes_lose_nothing(tmp_path):
    path = tmp_path / "r.sqlite"
    Store(path).close()
    procs = [_writer(path, tag, 40) for tag in ("aa", "bb")]
    for p in procs:
        p.communicate(timeout=120)
        assert p.returncode == 0
    with Store(path) as st:
        digests = {r.digest for r in st.results()}
    assert len(digests) == 80
    assert {d[:2] for d in digests} == {"aa", "bb"}


def test_a_killed_writer_leaves_a_usable_store_with_every_committed_result(tmp_path):
    path = tmp_path / "r.sqlite"
    proc = _writer(path, "cc", -1)  # writes until killed
    committed = []
    for line in proc.stdout:
        committed.append(int(line))
        if len(committed) >= 25:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    with Store(path) as st:
        stored = {r.digest for r in st.results()}
        assert {f"cc{i:030x}" for i in committed} <= stored
        assert st._con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        st.put_result("brick", "dd" * 16, 1, SYSTEM, CFG, _measurement())  # still writable
        assert st.count() == len(stored) + 1


# --------------------------------------------------------------------------- export


@pytest.fixture
def filled(tmp_path) -> Path:
    path = tmp_path / "r.sqlite"
    with Store(path) as st:
        st.put_result("brick", "0a" * 16, 1, SYSTEM, CFG, _measurement())
        st.put_result("brick", "0b" * 16, 1, SYSTEM, CFG, Failure("b.onnx: timed out after 60 s", "timeout"))
        st.put_result("model", "0c" * 16, 1, SYSTEM, CFG, _measurement((5, 6, 7)))
    return path


def test_csv_export_has_one_flat_row_per_result(filled, tmp_path):
    out = tmp_path / "r.csv"
    with Store(filled) as st:
        assert st.export("csv", out) == 3
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [r["status"] for r in rows] == ["ok", "failed", "ok"]
    assert float(rows[0]["median_ns"]) == 104 and rows[1]["error"].endswith("60 s")


def test_json_export_carries_systems_and_schema_version_and_raw_times_only_when_asked(filled):
    buf = io.StringIO()
    with Store(filled) as st:
        st.export("json", buf, kind="brick")
    doc = json.loads(buf.getvalue())
    assert doc["schema_version"] == SCHEMA_VERSION
    assert len(doc["results"]) == 2 and "times_ns" not in doc["results"][0]
    assert fingerprint_id(SYSTEM) in doc["systems"] and CFG.key() in doc["configs"]
    buf = io.StringIO()
    with Store(filled) as st:
        st.export("json", buf, kind="brick", with_times=True)
    assert json.loads(buf.getvalue())["results"][0]["times_ns"][:2] == [100, 110]


def test_export_rows_name_what_each_result_is_and_how_it_was_measured(tmp_path):
    engine = _measurement()
    engine.rounds, engine.median_se_ns, engine.stop_reason = 7, 1.5, "max_rounds"
    with Store(tmp_path / "r.sqlite") as st:
        st.put_brick("0a" * 16, 1, g=2, op_types=["Conv", "Relu"], meta={"source_model": "net", "layers": 2})
        st.put_model("0c" * 16, 1, name="net", meta={"path": "/zoo/net/model.onnx", "layers": 9})
        st.put_result("brick", "0a" * 16, 1, SYSTEM, CFG, engine)
        st.put_result("model", "0c" * 16, 1, SYSTEM, CFG, _measurement((5, 6, 7)))
        out = tmp_path / "r.csv"
        st.export("csv", out)
    brick, model = list(csv.DictReader(io.StringIO(out.read_text())))
    assert brick["model"] == "net" and brick["model_path"] == "/zoo/net/model.onnx"
    assert brick["op_types"] == "Conv+Relu" and brick["G"] == "2" and brick["layers"] == "2"
    assert brick["rounds"] == "7" and brick["stop_reason"] == "max_rounds" and brick["converged"] == "False"
    assert brick["config.intra_op_threads"] == str(CFG.intra_op_threads)
    assert brick["config.precision"] == str(CFG.precision) and "drift" in brick and "p99_ns" in brick
    # A single contiguous run has no stopping rule of the engine's to judge it by.
    assert model["model"] == "net" and model["converged"] == "" and model["layers"] == "9"


def test_results_command_filters_by_model_file_with_occurrences_and_shapes(tmp_path, capsys):
    import onnx
    from test_pipeline import chain_model, diamond_model

    from dlbricks.loading import load
    from dlbricks.pipeline import bench

    a, b = tmp_path / "chain.onnx", tmp_path / "diamond.onnx"
    onnx.save(chain_model(3), str(a))
    onnx.save(diamond_model(), str(b))
    store = tmp_path / "s.sqlite"
    fast = RunnerConfig(cores=None, max_rounds=5)
    with Store(store) as st:
        bench([load(a), load(b)], [1], store=st, config=fast, e2e=True)
    assert main(["results", "--store", str(store), "--model", str(a), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {(r["kind"], r["op_types"]): r for r in doc["results"]}
    assert set(rows) == {("brick", "Conv"), ("brick", "Relu"), ("model", None)}
    conv = rows[("brick", "Conv")]
    assert conv["occurrences"] == 3 and conv["model"] == "chain" and conv["model_path"] == str(a)
    assert json.loads(conv["shapes"])[0][0] == "float32[1x4x8x8]"
    assert rows[("model", None)]["model"] == "chain"
    # By the name the store knows it under, too.
    assert main(["results", "--store", str(store), "--model", "diamond", "--format", "json"]) == 0
    assert {r["model"] for r in json.loads(capsys.readouterr().out)["results"]} == {"diamond"}
    assert main(["results", "--store", str(store), "--model", "nothing"]) == 2
    assert "--model nothing" in capsys.readouterr().err


def test_results_name_every_bricks_shapes_from_the_catalogue_without_model(tmp_path, capsys):
    import onnx
    from test_pipeline import chain_model, diamond_model

    from dlbricks.loading import load
    from dlbricks.pipeline import plan_work

    a, b = tmp_path / "chain.onnx", tmp_path / "diamond.onnx"
    onnx.save(chain_model(3), str(a))
    onnx.save(diamond_model(), str(b))
    store = tmp_path / "s.sqlite"
    with Store(store) as st:
        items = plan_work([load(a), load(b)], [1, 2], st)
        for w in items:
            st.put_result("brick", w.digest, w.version, SYSTEM, CFG, _measurement())
        # Planned again from freshly loaded models: the catalogue keeps the shapes it
        # has, and no fast-loaded model builds its layers for them.
        again = [load(a), load(b)]
        plan_work(again, [1, 2], st)
        assert not any(m.layers.is_materialized for m in again)
    assert main(["results", "--store", str(store), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert len(rows) == len(items) and all(r["shapes"] for r in rows)
    by_ops = {r["op_types"]: json.loads(r["shapes"]) for r in rows}
    assert by_ops["Relu+Sigmoid"] == [["float32[1x4x8x8]"], ["float32[1x4x8x8]"]]
    assert by_ops["Conv"] == [["float32[1x4x8x8]", "float32[4x4x3x3]"]]  # activation, then weight
    # The same shapes, in the same form, as the rows --model describes from the file.
    assert main(["results", "--store", str(store), "--model", str(a), "--model", str(b), "-G", "1,2",
                 "--format", "json"]) == 0
    described = json.loads(capsys.readouterr().out)["results"]
    assert {r["digest"]: r["shapes"] for r in described} == {r["digest"]: r["shapes"] for r in rows}
    assert main(["results", "--store", str(store), "--format", "csv"]) == 0
    assert all(r["shapes"] for r in csv.DictReader(io.StringIO(capsys.readouterr().out)))


def test_export_rejects_unknown_formats(filled):
    with Store(filled) as st, pytest.raises(StoreError, match="format"):
        st.export("xlsx", io.StringIO())


def test_parquet_without_pyarrow_and_dataframe_without_pandas_say_what_to_install(filled, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import now raises ImportError
    monkeypatch.setitem(sys.modules, "pandas", None)
    with Store(filled) as st:
        with pytest.raises(StoreError, match="pip install pyarrow"):
            st.export("parquet", tmp_path / "r.parquet")
        with pytest.raises(StoreError, match="pip install pandas"):
            st.to_dataframe()


def test_parquet_export_round_trips_when_pyarrow_is_installed(filled, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    with Store(filled) as st:
        st.export("parquet", tmp_path / "r.parquet")
    table = pq.read_table(tmp_path / "r.parquet").to_pydict()
    assert table["status"] == ["ok", "failed", "ok"] and "times_ns" not in table
    with Store(filled) as st:
        st.export("parquet", tmp_path / "t.parquet", with_times=True)
    table = pq.read_table(tmp_path / "t.parquet").to_pydict()
    assert table["times_ns"][1] is None and table["times_ns"][2] == [5, 6, 7]


def test_dataframe_has_a_row_per_result_when_pandas_is_installed(filled):
    pytest.importorskip("pandas")
    with Store(filled) as st:
        df = st.to_dataframe(kind="brick")
    assert list(df["status"]) == ["ok", "failed"] and df["median_ns"].iloc[0] == 104


def test_results_command_prints_json_filtered_by_kind(filled, capsys):
    assert main(["results", "--store", str(filled), "--format", "json", "--kind", "model"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["digest"] for r in doc["results"]] == ["0c" * 16]


def test_results_command_writes_csv_to_a_file(filled, tmp_path, capsys):
    out = tmp_path / "out.csv"
    assert main(["results", "--store", str(filled), "-o", str(out)]) == 0
    assert len(list(csv.DictReader(io.StringIO(out.read_text())))) == 3
    assert "3 result(s)" in capsys.readouterr().err


def test_results_command_fails_cleanly_on_a_missing_or_foreign_store(tmp_path, capsys):
    assert main(["results", "--store", str(tmp_path / "none.sqlite")]) == 2
    assert not (tmp_path / "none.sqlite").exists()
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"\x00" * 64)
    assert main(["results", "--store", str(junk)]) == 1
    err = capsys.readouterr().err
    assert "none.sqlite" in err and "junk.sqlite" in err


# --------------------------------------------------------------------------- sysinfo


def test_fingerprint_describes_this_machine():
    fp = system_fingerprint()
    json.dumps(fp)
    assert fp["cpu"]["logical_cores"] == os.cpu_count()
    assert fp["versions"]["onnxruntime"] and fp["versions"]["numpy"] == np.__version__
    assert fp["os"]["system"] and fp["python"]["version"]
    assert fingerprint_id(fp) == fingerprint_id(system_fingerprint())


def test_fingerprint_id_counts_identity_fields_only():
    fp = system_fingerprint()
    other_host = {**fp, "hostname": "elsewhere", "python": {"version": "0.0"}}
    assert fingerprint_id(other_host) == fingerprint_id(fp)
    other_cpu = {**fp, "cpu": {**fp["cpu"], "model": "Imaginary 9000"}}
    assert fingerprint_id(other_cpu) != fingerprint_id(fp)
    other_ort = {**fp, "versions": {**fp["versions"], "onnxruntime": "0.0.1"}}
    assert fingerprint_id(other_ort) != fingerprint_id(fp)
    assert "cpu.model" in IDENTITY_FIELDS and "hostname" not in IDENTITY_FIELDS


def test_partial_rounds_are_kept_until_the_final_result_replaces_them(tmp_path):
    with Store(tmp_path / "r.sqlite") as st:
        st.put_system(SYSTEM)
        st.put_config(CFG)
        sid, key = fingerprint_id(SYSTEM), CFG.key()
        st.put_partials([("brick", "aa" * 16, 1, sid, key, {"round_medians": [1.0, 2.0]})])
        assert st.get_partials("brick", 1, sid, key) == {"aa" * 16: {"round_medians": [1.0, 2.0]}}
        assert st.get_partials("model", 1, sid, key) == {}
        st.put_result("brick", "aa" * 16, 1, sid, key, _measurement())
        assert st.get_partials("brick", 1, sid, key) == {}


def test_a_write_interrupted_inside_its_transaction_leaves_the_store_writable(tmp_path):
    # Ctrl-C can land right after BEGIN, before the handler that would roll back: the
    # next write must still work (it used to fail with "cannot start a transaction
    # within a transaction"), and nothing of the interrupted write is committed.
    with Store(tmp_path / "r.sqlite") as store:
        store._con.execute("BEGIN IMMEDIATE")
        store._con.execute(
            "INSERT INTO configs (key, config, created_at) VALUES ('half', '{}', 'now')"
        )
        key = store.put_config(CFG)
        rows = [r[0] for r in store._con.execute("SELECT key FROM configs")]
    assert rows == [key]


def test_an_interrupt_during_a_write_propagates_unmasked(tmp_path):
    class Interrupting:  # parameters whose binding raises, as a signal mid-statement would
        def __len__(self):
            raise KeyboardInterrupt

        def __getitem__(self, i):
            raise KeyboardInterrupt

    with Store(tmp_path / "r.sqlite") as store:
        with pytest.raises(KeyboardInterrupt):
            store._write([("INSERT INTO configs (key, config, created_at) VALUES (?, ?, ?)", Interrupting())])
        assert not store._con.in_transaction
        store.put_config(CFG)
