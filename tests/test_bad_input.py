"""A user's mistake in a path or an option: one line naming it and the cause, a non-zero
exit, nothing written that breaks a later run, and never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import light

from dlbricks.cli import main
from dlbricks.errors import DlbricksError
from dlbricks.store import Store, StoreError
from dlbricks.timing.runner import Runner

FAST = ["--no-pin", "--min-span", "0", "--min-rounds", "2", "--max-rounds", "3", "--precision", "0.5"]


def _one_line_error(capsys, needle: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and "error:" in lines[-1] and needle in lines[-1], err
    assert "Traceback" not in err, err
    return lines[-1]


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "afile"
    path.write_text("not a folder")
    return path


@pytest.mark.parametrize("argv, option", [
    (["evaluate", "MODEL", "--save", "{f}/out.json"], "--save"),
    (["bench", "MODEL", "-o", "{f}/out.json"], "-o"),
    (["profile", "MODEL", "--trace", "{f}/t.json"], "--trace"),
    (["roofline", "MODEL", "--plot", "{f}/r.png"], "--plot"),
])
def test_an_output_file_under_a_file_is_refused_before_any_work(tmp_path, capsys, a_file, argv, option):
    store = tmp_path / "s.sqlite"
    argv = [a.replace("{f}", str(a_file)).replace("MODEL", str(light("squeezenet"))) for a in argv]
    assert main([*argv, "--store", str(store)] if argv[0] != "profile" else argv) == 2
    line = _one_line_error(capsys, f"{option} {a_file}/")
    assert "is not a folder" in line
    assert not store.exists()  # nothing was measured, nothing created


def test_an_output_file_that_is_a_folder_is_refused(tmp_path, capsys):
    assert main(["analyze", str(light("squeezenet")), "-o", str(tmp_path)]) == 2
    _one_line_error(capsys, "a folder, not a file")


def test_a_store_under_a_file_names_the_store(tmp_path, capsys, a_file):
    assert main(["bench", str(light("squeezenet")), "--store", str(a_file / "s.sqlite"), *FAST]) == 1
    _one_line_error(capsys, f"{a_file}/s.sqlite: cannot create the store's folder")


def test_a_read_only_store_is_refused_when_opened_to_write(tmp_path, monkeypatch):
    path = tmp_path / "s.sqlite"
    Store(path).close()
    import dlbricks.store

    # Root writes whatever the mode bits say; the check is what a user's account meets.
    monkeypatch.setattr(dlbricks.store.os, "access", lambda p, mode: False)
    with pytest.raises(StoreError, match="read-only file"):
        Store(path)
    monkeypatch.undo()
    with Store(path, readonly=True) as store:  # reading it is fine
        assert store.path == path


def test_a_store_that_sqlite_cannot_write_is_a_store_error_naming_it(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        store._con.execute("PRAGMA query_only = ON")  # as a read-only file or folder answers
        with pytest.raises(StoreError, match=r"s\.sqlite: cannot write to the store \(attempt to write a readonly"):
            store.put_system({"cpu": "x"})
        store._con.execute("PRAGMA query_only = OFF")
        assert store.put_system({"cpu": "x"})  # nothing half-written stood in the way


def test_an_os_error_of_a_users_path_is_one_line(tmp_path, capsys, a_file):
    # --bricks-dir under a file fails where the bricks' weights are written.
    code = main(["bench", str(light("squeezenet")), "--store", str(tmp_path / "s.sqlite"), "--bricks-dir",
                 str(a_file), *FAST])
    assert code == 1
    _one_line_error(capsys, f"{a_file}/weights: Not a directory")


@pytest.mark.parametrize("argv, needle", [
    (["results", "--store", "STORE", "-G", "abc"], "-G 'abc': expected integers"),
    (["report", "--store", "STORE", "-G", "abc", "-o", "OUT/r.html"], "-G 'abc': expected integers"),
    (["analyze", "MODEL", "-G", "5-1"], "-G '5-1': the range 5-1 runs backwards"),
    (["bench", "MODEL", "--cores", "1-0", "--store", "STORE"], "--cores '1-0': the range 1-0 runs backwards"),
    (["bench", "MODEL", "--ray-label", "a=b", "--store", "STORE"], "--ray-label applies only with --ray"),
    (["bench", "MODEL", "--clock", "thread", "--threads", "2", "--store", "STORE"],
     "--clock 'thread' needs --threads 1 and --execution-mode sequential"),
    (["profile", "DIR"], "a folder; profile takes one model file"),
])
def test_a_malformed_option_is_a_usage_error_even_where_it_is_not_used(tmp_path, capsys, argv, needle):
    store = tmp_path / "s.sqlite"
    Store(store).close()
    subs = {"STORE": str(store), "OUT": str(tmp_path), "MODEL": str(light("squeezenet")), "DIR": str(tmp_path)}
    assert main([subs.get(a, a.replace("OUT", str(tmp_path))) for a in argv]) == 2
    _one_line_error(capsys, needle)


@pytest.mark.parametrize("option, value", [("--min-span", "-1"), ("--model-span", "-1"), ("--timeout", "0"),
                                           ("--warmup-time", "nan")])
def test_a_runner_option_out_of_range_names_the_option(tmp_path, capsys, option, value):
    with pytest.raises(SystemExit) as exited:
        main(["bench", str(tmp_path), option, value])
    assert exited.value.code == 2 and f"argument {option}" in capsys.readouterr().err


@pytest.mark.parametrize("option, doc, needle", [
    ("--evaluation", {"per_g": 5, "models": 3}, "needs per_g (a list of objects), models (a list of objects)"),
    ("--analysis", {"models": [1], "corpus": {}}, "needs models (a list of objects)"),
    ("--roofline", {}, "needs peaks (a JSON object)"),
])
def test_report_inputs_of_the_wrong_shape_are_named(tmp_path, capsys, option, doc, needle):
    path = tmp_path / "in.json"
    path.write_text(json.dumps(doc))
    assert main(["report", option, str(path), "-o", str(tmp_path / "r.html")]) == 2
    _one_line_error(capsys, needle)
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("doc, needle", [([1, 2], "not a peaks file (a JSON object"), ({}, "not a peaks file (no ")])
def test_roofline_peaks_that_are_not_peaks_are_named(tmp_path, capsys, doc, needle):
    path = tmp_path / "peaks.json"
    path.write_text(json.dumps(doc))
    code = main(["roofline", str(light("squeezenet")), "--store", str(tmp_path / "s.sqlite"), "--no-measure", "--peaks",
                 str(path)])
    assert code == 1
    _one_line_error(capsys, needle)


def test_dlbricks_warnings_are_one_line_each(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    path = tmp_path / "batch.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    # In a process of its own: pytest records warnings in its place, where a user's
    # terminal shows them.
    done = subprocess.run([sys.executable, "-m", "dlbricks", "profile", str(path), "--levels", "model", "--runs", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert "dlbricks: warning: " in err and "symbolic batch dim" in err
    assert "DlbricksWarning" not in err



@pytest.mark.parametrize("argv", [["analyze", "MODEL", "--json"], ["results", "--store", "STORE"],
                                  ["report", "--store", "STORE"]])
def test_dash_as_the_output_file_is_stdout(tmp_path, capsys, monkeypatch, argv):
    store = tmp_path / "s.sqlite"
    Store(store).close()
    monkeypatch.chdir(tmp_path)
    subs = {"STORE": str(store), "MODEL": str(light("squeezenet"))}
    assert main([subs.get(a, a) for a in argv] + ["-o", "-"]) == 0
    assert capsys.readouterr().out.strip()
    assert not (tmp_path / "-").exists()


# -- the Python API ----------------------------------------------------------------------


def _chain(n: int, name: str = "chain"):
    import numpy as np

    from dlbricks.graph import Graph

    digests = np.zeros((n, 16), np.uint8)
    digests[:, 0] = np.arange(n)
    return Graph(digests, np.arange(n - 1), np.arange(1, n), name=name)


@pytest.mark.parametrize("call, kind", [
    (lambda dl, g: dl.split(g, 0), ValueError),
    (lambda dl, g: dl.split(g, 2.0), TypeError),
    (lambda dl, g: dl.split("not a graph", 1), TypeError),
    (lambda dl, g: dl.Corpus([g]).split(-1), ValueError),
    (lambda dl, g: dl.load(None), TypeError),
    (lambda dl, g: dl.load_corpus(None), None),
    (lambda dl, g: dl.load_corpus([3]), None),
    (lambda dl, g: dl.load(light("squeezenet"), {"data_0": (1, 3, 224.5, 224)}), ValueError),
    (lambda dl, g: dl.load(light("squeezenet"), {"data_0": (1, 3, 0, 224)}), ValueError),
    (lambda dl, g: dl.load_corpus([light("squeezenet")], {"data_0": "1x3"}), None),
    (lambda dl, g: dl.generate_brick(str(light("squeezenet")), [0]), TypeError),
    (lambda dl, g: dl.generate_brick(dl.load(light("squeezenet")), [0, 0]), ValueError),
    (lambda dl, g: dl.generate_brick(dl.load(light("squeezenet")), "01"), TypeError),
    (lambda dl, g: dl.generate_brick(dl.load(light("squeezenet")), [0], weights="bogus"), ValueError),
    (lambda dl, g: Store(5), None),
    (lambda dl, g: Runner().time(None), TypeError),
    (lambda dl, g: Runner("cfg"), TypeError),
])
def test_a_callers_mistake_is_a_dlbricks_error_and_the_builtin_it_was(call, kind):
    import dlbricks

    with pytest.raises(dlbricks.DlbricksError) as raised:
        call(dlbricks, _chain(4))
    assert kind is None or isinstance(raised.value, kind)
    assert len(str(raised.value).splitlines()) == 1


def test_a_cycle_from_the_core_is_an_argument_error_naming_a_layer():
    import numpy as np

    import dlbricks

    cyclic = dlbricks.Graph(np.zeros((3, 16), np.uint8), [0, 1, 2], [1, 2, 0])
    for call in (lambda: dlbricks.topo_order(cyclic), lambda: dlbricks.split(cyclic, 2),
                 lambda: dlbricks.Corpus([cyclic]).split(2)):
        with pytest.raises(dlbricks.ArgumentError, match="cycle"):
            call()


@pytest.mark.parametrize("edges", [[0.0, 1.7], [0, 2**32 + 2], [[0, 1]]])
def test_edges_that_are_not_int32_layer_indices_are_refused_not_wrapped(edges):
    import numpy as np

    import dlbricks

    with pytest.raises(dlbricks.ArgumentError, match="edge_dst"):
        dlbricks.Graph(np.zeros((3, 16), np.uint8), [0, 1], edges)


def test_slot_arrays_whose_lengths_only_add_up_are_refused():
    import numpy as np

    import dlbricks

    a, b = _chain(3, "a"), _chain(3, "b")
    a.edge_src_slot = np.zeros(1, np.int32)  # two edges
    b.edge_src_slot = np.zeros(3, np.int32)  # two edges: four slots in all, as the corpus has
    with pytest.raises(dlbricks.ArgumentError, match="a: edge_src_slot has 1 entries, expected 2"):
        dlbricks.Corpus([a, b])


def test_reconstruct_refuses_a_corpus_of_other_models(tmp_path):
    import dlbricks
    from dlbricks.reconstruct import predict

    one, two = dlbricks.load(light("squeezenet")), dlbricks.load(light("shufflenet"))
    with Store(tmp_path / "s.sqlite") as store:
        with pytest.raises(dlbricks.ArgumentError, match="corpus= must be the Corpus of exactly these models"):
            predict([two], 1, store=store, system_id="s", config_key="c", corpus=dlbricks.Corpus([one]))
        with pytest.raises(dlbricks.ArgumentError, match="n_boot"):
            predict([one], 1, store=store, system_id="s", config_key="c", n_boot=0)


def test_evaluate_and_bench_refuse_what_does_not_pair(tmp_path):
    import dlbricks
    from dlbricks.evaluation import evaluate
    from dlbricks.pipeline import bench
    from dlbricks.timing import RunnerConfig

    model = dlbricks.load(light("squeezenet"))
    with Store(tmp_path / "s.sqlite") as store:
        with pytest.raises(dlbricks.ArgumentError, match="no models"):
            evaluate([], [1], store=store, config=RunnerConfig())
        with pytest.raises(dlbricks.ArgumentError, match="1 models but 0 end-to-end models"):
            bench([model], [1], store=store, config=RunnerConfig(), e2e=True, e2e_models=[])
        assert store.count() == 0


def test_generated_bricks_count_models_of_the_same_name_apart(tmp_path):
    import shutil

    import dlbricks

    for zoo in ("a", "b"):
        (tmp_path / zoo).mkdir()
        shutil.copy(light("squeezenet"), tmp_path / zoo / "model.onnx")
    models = [dlbricks.load(tmp_path / zoo / "model.onnx") for zoo in ("a", "b")]
    assert models[0].name == models[1].name == "model"
    infos = dlbricks.generate_bricks(models, 1, tmp_path / "bricks")
    assert all(set(i.occurrences) == {"a/model", "b/model"} for i in infos)


@pytest.mark.parametrize("setting", [{"max_rounds": 30.7}, {"precision": "0.02"}, {"cores": 1}, {"cores": "01"},
                                     {"call_overhead": "no"}, {"intra_op_threads": True}, {"timeout_s": None}])
def test_a_runner_setting_of_the_wrong_kind_is_named(setting):
    from dlbricks.timing import RunnerConfig

    name = next(iter(setting))
    with pytest.raises(DlbricksError, match=f"RunnerConfig: {name} must be"):
        RunnerConfig(**setting)


def test_runner_settings_take_numpy_scalars_and_any_iterable_of_cpus():
    import numpy as np

    from dlbricks.timing import RunnerConfig

    config = RunnerConfig(cores=range(1), min_rounds=np.int64(3), precision=np.float64(0.05))
    assert config.cores == (0,) and config.key() == RunnerConfig(cores=(0,), min_rounds=3, precision=0.05).key()


def test_a_closed_store_says_so(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    store.close()
    store.close()  # twice is harmless
    with pytest.raises(StoreError, match=r"s\.sqlite: the store is closed"):
        store.count()
