"""The subcommands' shared behaviour: exit codes, model naming, options reaching every model."""

from __future__ import annotations

import pytest

from dlbricks.cli import main

FAST_CLI = ["--no-pin", "--warmup", "1", "--warmup-time", "0", "--min-iters", "5", "--min-time", "0.005", "--max-time", "0.05"]


def test_an_impossible_runner_setting_is_a_usage_error(tmp_path, capsys):
    code = main(["bench", str(tmp_path), "--no-pin", "--min-time", "2", "--max-time", "1", "--store", str(tmp_path / "s.sqlite")])
    err = capsys.readouterr().err
    assert code == 2 and "--max-time" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("command", ["bench", "evaluate", "construct", "demo"])
def test_the_runner_options_default_to_what_runner_config_defaults_to(command):
    # The options state their defaults in --help, apart from RunnerConfig's fields: a
    # default changed on one side only would make the CLI and Python measure
    # differently. Pinning is the CLI's own default (the last CPU; Python: none).
    import dataclasses

    from dlbricks.cli import build_parser
    from dlbricks.commands._common import runner_config
    from dlbricks.timing import RunnerConfig

    positional = [] if command == "demo" else ["model.onnx"]
    config = runner_config(build_parser(command).parse_args(positional))
    assert config == dataclasses.replace(RunnerConfig(), cores=config.cores, open_cores=config.open_cores)


def test_a_bug_building_the_runner_configuration_is_not_a_usage_error(tmp_path, monkeypatch):
    import dlbricks.timing

    def broken(**kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(dlbricks.timing, "RunnerConfig", broken)
    # Propagates: the console script exits 1 with the traceback, never 2.
    with pytest.raises(RuntimeError, match="a bug"):
        main(["bench", str(tmp_path), "--no-pin", "--store", str(tmp_path / "s.sqlite")])


def _batched_model(path):
    """x[N, 4] -> MatMul -> Relu: a symbolic batch dim for --input-shape to set."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["y"], name="relu")],
        "batched", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], [w],
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), str(path))


@pytest.mark.parametrize("command", [["evaluate", "--bootstrap", "20"], ["bench", "--e2e"]])
def test_input_shapes_reach_the_end_to_end_models_of_a_runtime_graph_run(tmp_path, command):
    from dlbricks.bricks import model_digest
    from dlbricks.loading import load
    from dlbricks.store import Store

    path = tmp_path / "batched.onnx"
    _batched_model(path)
    store_path = tmp_path / "s.sqlite"
    code = main([command[0], str(path), "-G", "1", "--runtime-graph", "--input-shape", "x=8x4", "--store", str(store_path),
                 "--json", *command[1:], *FAST_CLI])
    assert code == 0
    with Store(store_path, readonly=True) as store:
        timed = {d for d, _ in store.models()}
    assert timed == {model_digest(load(path, {"x": (8, 4)}))}  # batch 8, as the bricks; never batch 1


def _conv_bn_relu_model(path, name="cbr"):
    """Conv -> BatchNormalization -> Relu: three source layers onnxruntime fuses into one."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.uniform(-0.3, 0.3, (8, 4, 3, 3)).astype(np.float32), "w")]
    inits += [numpy_helper.from_array(v.astype(np.float32), n) for n, v in
              [("s", np.ones(8)), ("b", np.zeros(8)), ("m", np.zeros(8)), ("v", np.ones(8))]]
    g = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"], name="bn"),
         helper.make_node("Relu", ["n"], ["y"], name="relu")],
        name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], inits,
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), str(path))


def _brick_op_types(store_path):
    import json
    import sqlite3

    con = sqlite3.connect(store_path)
    try:
        return [json.loads(r[0]) for r in con.execute("SELECT op_types FROM bricks")]
    finally:
        con.close()


def test_bricks_are_cut_from_the_runtime_graph_by_default_and_from_the_source_graph_on_request(tmp_path, capsys):
    import json

    path = tmp_path / "cbr.onnx"
    _conv_bn_relu_model(path)
    runs = {}
    for graph in ("runtime", "source"):
        store_path = tmp_path / f"{graph}.sqlite"
        extra = [] if graph == "runtime" else ["--graph", "source"]
        code = main(["evaluate", str(path), "-G", "1", "--store", str(store_path), "--json", "--bootstrap", "20",
                     *extra, *FAST_CLI])
        assert code == 0
        runs[graph] = (json.loads(capsys.readouterr().out), _brick_op_types(store_path))
    out, bricks = runs["runtime"]
    assert out["graph"] == "runtime" and out["models"][0]["graph"] == "runtime"
    # No brick boundary inside what onnxruntime fuses: the Conv brick has the
    # BatchNormalization folded in and the Relu fused (a layout change may follow it).
    assert not {"BatchNormalization", "Relu"} & {op for b in bricks for op in b}
    assert len(bricks) < 3 and any(op.endswith("Conv") for b in bricks for op in b)
    out, bricks = runs["source"]
    assert out["graph"] == "source" and out["models"][0]["graph"] == "source"
    assert sorted(b[0] for b in bricks) == ["BatchNormalization", "Conv", "Relu"]


def test_a_model_whose_runtime_graph_cannot_be_used_is_cut_from_its_source_graph(tmp_path, capsys, monkeypatch):
    import json

    import dlbricks.loading.runtime_graph as rg
    from dlbricks.errors import ModelError

    real = rg._runtime_model

    def failing_for_bad(model, *args, **kwargs):
        if model.name == "bad":
            raise ModelError("bad: an op the loader cannot type")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(rg, "_runtime_model", failing_for_bad)
    good, bad = tmp_path / "good.onnx", tmp_path / "bad.onnx"
    _conv_bn_relu_model(good, "good")
    _conv_bn_relu_model(bad, "bad")
    code = main(["evaluate", str(good), str(bad), "-G", "1", "--store", str(tmp_path / "s.sqlite"), "--json",
                 "--bootstrap", "20", *FAST_CLI])
    captured = capsys.readouterr()
    assert code == 0
    out = json.loads(captured.out)
    assert out["graph"] == "mixed"
    assert {m["name"]: m["graph"] for m in out["models"]} == {"good": "runtime", "bad": "source"}
    warned = [line for line in captured.err.splitlines() if "bad" in line and "source graph" in line]
    assert len(warned) == 1 and "cannot type" in warned[0]


def test_ray_runs_cut_the_source_graph(tmp_path, capsys):
    code = main(["bench", str(tmp_path), "--ray", "local", "--graph", "runtime", "--store", str(tmp_path / "s.sqlite")])
    err = capsys.readouterr().err
    assert code == 2 and "--graph runtime" in err and len(err.splitlines()) == 1


def test_evaluate_attribution_prints_each_step_and_needs_its_data_with_no_measure(tmp_path, capsys):
    import json

    paths = [tmp_path / "a.onnx", tmp_path / "b.onnx"]
    _conv_bn_relu_model(paths[0], "a")
    _batched_model(paths[1])
    store = tmp_path / "s.sqlite"
    common = [*map(str, paths), "-G", "1", "--dim", "N=2", "--store", str(store), "--bootstrap", "20",
              *FAST_CLI]
    assert main(["evaluate", *common, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "attribution" not in plain
    # The store has the evaluation's results but none of the warm-cache variants'.
    code = main(["evaluate", *common, "--no-measure", "--attribution"])
    err = capsys.readouterr().err
    assert code == 2 and "--attribution" in err and "--no-measure" in err and len(err.splitlines()) == 1
    assert main(["evaluate", *common, "--attribution", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    att = out["attribution"]
    assert att["G"] == 1 and att["steps"] == ["baseline", "call_overhead", "runtime_graph", "cache_state"]
    assert [m["name"] for m in att["models"]] == [m["name"] for m in plain["models"]] == ["a", "b"]
    for m, row in zip(att["models"], out["models"]):
        assert set(m["explained"]) == set(att["steps"][1:])
        assert m["normalized"][-1] == row["per_g"]["1"]["sequential"]["normalized"]
        assert m["e2e_s"] == row["e2e_s"] and m["path"] == row["path"]
    assert out["reuse"]["models_measured"] == 0  # the whole models came from the first run
    # Now everything is stored: --no-measure reads it, and the table shows every step per model.
    assert main(["evaluate", *common, "--no-measure", "--attribution"]) == 0
    text = capsys.readouterr().out
    table = text[text.index("where each model's error comes from at G=1"):]
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[6:8]}
    assert list(rows) == ["a", "b"]
    for m in att["models"]:
        assert [float(x) for x in rows[m["name"]]] == pytest.approx(m["normalized"], abs=6e-4)


def test_evaluate_attribution_with_ray_is_a_usage_error(tmp_path, capsys):
    import argparse

    from dlbricks.commands import evaluate
    from dlbricks.errors import UsageError

    # evaluate measures on this machine only: argparse refuses --ray (exit 2)...
    with pytest.raises(SystemExit) as exited:
        main(["evaluate", str(tmp_path), "--attribution", "--ray", "local", "--store", str(tmp_path / "s.sqlite")])
    assert exited.value.code == 2 and "--ray" in capsys.readouterr().err
    # ...and so does the command itself, should it be handed one.
    with pytest.raises(UsageError, match="--attribution does not apply with --ray"):
        evaluate.run(argparse.Namespace(attribution=True, ray="local"))


def test_sigterm_ends_a_run_as_an_interrupt_does_and_leaves_no_spooled_bricks(tmp_path):
    import glob
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import light

    from dlbricks.timing.engine_process import spool_dir

    spool = spool_dir()
    if spool is None:
        pytest.skip("no tmpfs to spool bricks to")
    before = set(glob.glob(os.path.join(spool, "dlbricks-bricks-*")))
    proc = subprocess.Popen([sys.executable, "-m", "dlbricks", "evaluate", str(light("squeezenet")), "-G", "1",
                             "--store", str(tmp_path / "r.sqlite")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not set(glob.glob(os.path.join(spool, "dlbricks-bricks-*"))) - before:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before spooling bricks"
            time.sleep(0.05)
        spooled = set(glob.glob(os.path.join(spool, "dlbricks-bricks-*"))) - before
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    assert not {p for p in spooled if os.path.exists(p)}


def test_the_cli_runner_defaults_are_the_runner_configs_own():
    # The options repeat RunnerConfig's defaults as literals (importing the config at
    # parser build would slow every command's start): a default changed in one place
    # and not the other is caught here. Pinning is the CLI's own choice.
    import argparse
    import dataclasses

    from dlbricks.commands._common import add_runner_args, runner_config
    from dlbricks.timing.config import RunnerConfig

    parser = argparse.ArgumentParser()
    add_runner_args(parser)
    from_cli, default = runner_config(parser.parse_args([])), RunnerConfig()
    differ = [f.name for f in dataclasses.fields(RunnerConfig) if getattr(from_cli, f.name) != getattr(default, f.name)]
    assert differ == ["cores"]


@pytest.mark.parametrize("value, needle", [("-1", "between 0 and 1"), ("2", "between 0 and 1"),
                                           ("abc", "expected a number")])
@pytest.mark.parametrize("command", ["bench", "evaluate"])
def test_a_precision_outside_0_1_is_a_usage_error_naming_the_option(tmp_path, capsys, command, value, needle):
    from dlbricks.cli import main

    with pytest.raises(SystemExit) as exited:
        main([command, str(tmp_path), "--precision", value])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "argument --precision" in err and needle in err
