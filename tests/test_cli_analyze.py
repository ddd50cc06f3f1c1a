"""``dlbricks analyze`` through the CLI entry point: JSON schema, dedup figures on the
light models, and one-line diagnostics with the right exit code for bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import light
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from dlbricks.bricks import model_digest
from dlbricks.cli import main
from dlbricks.loading import load


def analyze(capsys, *args: str) -> tuple[int, str, str]:
    """Run ``dlbricks analyze ARGS`` in-process: (exit code, stdout, stderr)."""
    code = main(["analyze", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def analyze_json(capsys, *args: str) -> tuple[dict, str]:
    code, out, err = analyze(capsys, "--json", *args)
    assert code == 0, err
    return json.loads(out), err


def _model(nodes, inputs, outputs, inits=(), name="m") -> onnx.ModelProto:
    graph = h.make_graph(nodes, name, inputs, outputs, initializer=list(inits))
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])


def _vi(name, shape, elem=T.FLOAT):
    return h.make_tensor_value_info(name, elem, shape)


def _conv_net(seed: int, in_shape=(1, 3, 16, 16)) -> onnx.ModelProto:
    """Conv-Relu twice, a Gemm head; random weights drawn from ``seed``."""
    rng = np.random.default_rng(seed)

    def w(name, *shape):
        return nh.from_array(rng.standard_normal(shape).astype(np.float32), name)

    hw = in_shape[2] * in_shape[3] if all(isinstance(d, int) for d in in_shape[2:]) else 256
    nodes = [
        h.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["c1"], ["r1"]),
        h.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["c2"], ["r2"]),
        h.make_node("Flatten", ["r2"], ["f"]),
        h.make_node("Gemm", ["f", "fc", "fcb"], ["y"], transB=1),
    ]
    inits = [w("w1", 8, 3, 3, 3), w("b1", 8), w("w2", 8, 8, 3, 3), w("b2", 8), w("fc", 10, 8 * hw), w("fcb", 10)]
    return _model(nodes, [_vi("x", list(in_shape))], [_vi("y", None)], inits, name="convnet")


# -- the light models ----------------------------------------------------------------------


def test_json_has_per_model_and_corpus_layer_counts_for_the_nine_light_models(capsys, light_dir):
    result, err = analyze_json(capsys, light_dir, "-G", "1,3")
    assert err == ""
    assert result["G"] == [1, 3] and result["errors"] == []
    models = {m["name"]: m for m in result["models"]}
    assert sorted(models) == sorted(p.stem for p in light_dir.glob("light_*.onnx"))
    assert len(models) == 9
    for m in models.values():
        assert 0 < m["unique_layers"] <= m["layers"]
        assert m["sequences"]["1"]["sequences"] == m["layers"]
        assert m["sequences"]["3"]["sequences"] < m["layers"]
    assert models["light_resnet50"]["layers"] == load(light("resnet50")).n_layers
    corpus = result["corpus"]
    assert corpus["models"] == 9
    assert corpus["layers"] == sum(m["layers"] for m in models.values())
    # Layers shared between models are counted once in the corpus.
    assert max(m["unique_layers"] for m in models.values()) <= corpus["unique_layers"]
    assert corpus["unique_layers"] < sum(m["unique_layers"] for m in models.values())
    jac = np.array(corpus["jaccard"]["matrix"])
    assert jac.shape == (9, 9) and np.allclose(np.diag(jac), 1.0) and np.allclose(jac, jac.T)


def test_resnet50_repeats_most_of_its_layers(capsys):
    result, _ = analyze_json(capsys, light("resnet50"))
    (m,) = result["models"]
    assert m["unique_layer_pct"] == pytest.approx(100 * m["unique_layers"] / m["layers"])
    assert m["unique_layer_pct"] < 40
    assert m["repeated_layer_types"]["Conv"] > 20


def test_text_output_names_every_model_and_can_go_to_a_file(capsys, tmp_path, light_dir):
    code, out, err = analyze(capsys, light("squeezenet"), light("vgg19"))
    assert code == 0, err
    assert "light_squeezenet" in out and "light_vgg19" in out and "Jaccard" in out
    target = tmp_path / "sub" / "a.json"
    code, out, err = analyze(capsys, "--json", "-o", target, light("squeezenet"))
    assert code == 0 and out == "" and str(target) in err
    assert json.loads(target.read_text())["models"][0]["name"] == "light_squeezenet"


def test_output_file_replaces_an_old_one_and_creates_folders(capsys, tmp_path):
    target = tmp_path / "new" / "deeper" / "a.json"
    code, _, err = analyze(capsys, "--json", "-o", str(target), light("squeezenet"))
    assert code == 0, err
    first = json.loads(target.read_text())
    target.write_text("old")
    code, _, err = analyze(capsys, "--json", "-o", str(target), light("squeezenet"))
    assert code == 0, err
    second = json.loads(target.read_text())
    assert first.pop("timing").keys() == second.pop("timing").keys()
    assert second == first
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.json"]  # no temporary file


@pytest.mark.parametrize(
    ("where", "cause"),
    [("a_file/x.json", "{tmp}/a_file is not a folder"), ("a_dir", "a folder, not a file")],
)
def test_unwritable_output_file_is_one_line_and_leaves_nothing(capsys, tmp_path, where, cause):
    (tmp_path / "a_file").write_text("keep")
    (tmp_path / "a_dir").mkdir()
    target = tmp_path / where
    code, out, err = analyze(capsys, "--json", "-o", str(target), light("squeezenet"))
    assert code == 2 and out == ""
    expected = f"dlbricks analyze: error: -o {target}: {cause.format(tmp=tmp_path)}"
    assert err.strip().splitlines() == [expected]
    assert (tmp_path / "a_file").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir", "a_file"]
    assert list((tmp_path / "a_dir").iterdir()) == []


def test_copies_with_different_weights_share_every_layer(capsys, tmp_path):
    for name, seed in (("a", 1), ("b", 2)):
        onnx.save(_conv_net(seed), tmp_path / f"{name}.onnx")
    onnx.save(_conv_net(3, in_shape=(1, 3, 8, 8)), tmp_path / "small.onnx")  # same ops, other shapes
    assert (tmp_path / "a.onnx").read_bytes() != (tmp_path / "b.onnx").read_bytes()
    result, _ = analyze_json(capsys, tmp_path)
    names = result["corpus"]["jaccard"]["names"]
    jac = dict(zip(names, result["corpus"]["jaccard"]["matrix"]))
    assert names == ["a", "b", "small"]
    assert jac["a"][1] == 1.0 and jac["b"][0] == 1.0
    assert jac["a"][2] < 1.0  # other shapes: the Conv and Gemm layers differ
    models = {m["name"]: m for m in result["models"]}
    for G in ("1", "2", "3"):
        assert models["a"]["sequences"][G] == models["b"]["sequences"][G]
    assert load(tmp_path / "a.onnx").digests.tobytes() == load(tmp_path / "b.onnx").digests.tobytes()
    assert model_digest(load(tmp_path / "a.onnx")) == model_digest(load(tmp_path / "b.onnx"))
    assert model_digest(load(tmp_path / "a.onnx")) != model_digest(load(tmp_path / "small.onnx"))


def test_a_corpus_too_large_for_the_matrix_lists_each_models_closest_others(capsys, tmp_path):
    # 14 models, in 7 pairs of equal layer sets (same shapes, other weights): a 14-column
    # matrix would not fit a terminal, so each model names its closest others instead.
    for k in range(7):
        for copy in range(2):
            onnx.save(_conv_net(10 * k + copy, in_shape=(1, 3, 8 + 2 * k, 8)), tmp_path / f"net{k:02d}{'ab'[copy]}.onnx")
    code, out, err = analyze(capsys, tmp_path, "-G", "1")
    assert code == 0, err
    assert "Most similar models" in out and "…" not in out
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in out.splitlines()
            if line.startswith("│ net") and len(line.split("│")) == 4}
    assert sorted(rows) == sorted(f"net{k:02d}{c}" for k in range(7) for c in "ab")
    for k in range(7):
        assert rows[f"net{k:02d}a"].startswith(f"net{k:02d}b 1.00")  # its twin first
    result, _ = analyze_json(capsys, tmp_path, "-G", "1")
    assert len(result["corpus"]["jaccard"]["matrix"]) == 14  # the whole matrix stays in the JSON


def test_input_shape_resolves_symbolic_dims(capsys, tmp_path):
    path = tmp_path / "sym.onnx"
    onnx.save(_conv_net(0, in_shape=("N", 3, "H", "W")), path)
    code, _, err = analyze(capsys, path)
    assert code == 1 and str(path) in err and "'H'" in err and len(err.splitlines()) == 1
    result, err = analyze_json(capsys, path, "--input-shape", "x=2x3x16x16")
    assert err == ""  # nothing assumed: no warning about the batch dim
    assert result["models"][0]["layers"] == 6
    code, _, err = analyze(capsys, path, "--input-shape", "x=2x3xHx16")
    assert code == 2 and "--input-shape" in err and len(err.splitlines()) == 1


def test_main_builds_a_parser_once_and_each_call_parses_afresh(capsys, tmp_path, monkeypatch):
    # main() keeps the parsers it builds; a later call must not see an earlier one's
    # options (here the shapes that resolve the model's symbolic dims, and -G).
    from dlbricks import cli

    built = []
    build = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda only=None: built.append(only) or build(only))
    monkeypatch.setattr(cli, "_parsers", {})
    path = tmp_path / "sym.onnx"
    onnx.save(_conv_net(0, in_shape=("N", 3, "H", "W")), path)
    result, _ = analyze_json(capsys, path, "--input-shape", "x=2x3x16x16", "-G", "2")
    assert result["models"][0]["layers"] == 6 and result["G"] == [2]
    code, _, err = analyze(capsys, path)
    assert code == 1 and "'H'" in err  # no shapes left over from the first call
    result, _ = analyze_json(capsys, path, "--input-shape", "x=1x3x16x16")
    assert result["G"] == [1, 2, 3]  # the default again
    assert built == ["analyze"]


def test_a_symbolic_batch_dim_is_set_to_one_with_a_warning(capsys, tmp_path):
    path = tmp_path / "batch.onnx"
    onnx.save(_conv_net(0, in_shape=("N", 3, 16, 16)), path)
    result, err = analyze_json(capsys, path)
    assert result["models"][0]["layers"] == 6
    assert err.startswith("dlbricks: warning: ") and "'N'" in err and len(err.splitlines()) == 1


# -- bad input -----------------------------------------------------------------------------------


def _if_model() -> onnx.ModelProto:
    """Control flow, which the fast path leaves to the full loader by design."""
    then_g = h.make_graph([h.make_node("Relu", ["r"], ["t"])], "then", [], [_vi("t", [1, 8])])
    else_g = h.make_graph([h.make_node("Neg", ["r"], ["e"])], "else", [], [_vi("e", [1, 8])])
    nodes = [
        h.make_node("Sigmoid", ["x"], ["r"]),
        h.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g),
    ]
    return _model(nodes, [_vi("x", [1, 8]), _vi("c", [], T.BOOL)], [_vi("y", [1, 8])], name="branchy")


def test_json_names_each_fast_path_fallback_and_why(capsys, tmp_path, monkeypatch):
    onnx.save(_conv_net(0), tmp_path / "plain.onnx")
    onnx.save(_if_model(), tmp_path / "branchy.onnx")
    result, err = analyze_json(capsys, tmp_path)
    assert err == "" and len(result["models"]) == 2
    timing = result["timing"]
    assert timing["fast_path_fallback_count"] == 1 and timing["fast_path_unexpected_count"] == 0
    [fallback] = timing["fast_path_fallbacks"]
    assert fallback == {"model": str(tmp_path / "branchy.onnx"),
                        "reason": "control flow or a subgraph attribute", "expected": True}

    # A fast-path bug (here: a step that raises) still loads the model, the slow way,
    # and is counted apart, with the exception's type and message.
    from dlbricks.loading import fast

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(fast, "_since_versions", broken)
    result, _ = analyze_json(capsys, tmp_path / "plain.onnx")
    assert len(result["models"]) == 1 and result["timing"]["fast_path_unexpected_count"] == 1
    [fallback] = result["timing"]["fast_path_fallbacks"]
    assert fallback["expected"] is False and fallback["reason"] == "prepare: RuntimeError: boom"


def test_verbose_says_on_stderr_which_models_left_the_fast_path(capsys, tmp_path):
    onnx.save(_conv_net(0), tmp_path / "plain.onnx")
    onnx.save(_if_model(), tmp_path / "branchy.onnx")
    code, out, err = analyze(capsys, tmp_path, "-v")
    assert code == 0 and "branchy" in out
    assert err.splitlines() == [
        "dlbricks: fast path: 1 of 2 models; 1 to the full loader (0 unexpected)",
        f"dlbricks: fast path left {tmp_path / 'branchy.onnx'}: control flow or a subgraph attribute",
    ]
    _, _, quiet = analyze(capsys, tmp_path)
    assert quiet == ""


def _bad_models() -> dict[str, tuple[onnx.ModelProto | bytes, str]]:
    """File stem -> (content, a word of the cause its message must give)."""
    x = [_vi("x", [2])]
    cyclic = [
        h.make_node("Relu", ["x"], ["a"], name="entry"),
        h.make_node("Add", ["a", "c"], ["b"], name="add"),
        h.make_node("Relu", ["b"], ["c"], name="back"),
        h.make_node("Relu", ["c"], ["y"], name="after"),
    ]
    resnet = light("resnet50").read_bytes()
    return {
        "notonnx": (b"this is not an onnx model\n" * 10, "not an ONNX model"),
        "truncated": (resnet[: len(resnet) // 2], "not an ONNX model"),
        "cyclic": (_model(cyclic, x, [_vi("y", None)]), "cycle"),
        "undefined": (_model([h.make_node("Add", ["x", "ghost"], ["y"])], x, [_vi("y", None)]), "'ghost'"),
        "unknownop": (_model([h.make_node("Frobnicate", ["x"], ["y"])], x, [_vi("y", None)]), "unknown op"),
        "symbolic": (_model([h.make_node("Relu", ["x"], ["y"])], [_vi("x", [1, "S"])], [_vi("y", None)]), "'S'"),
        "absurd": (_model([h.make_node("Relu", ["x"], ["y"])], [_vi("x", [2**21, 2**20])], [_vi("y", None)]), "2**40"),
    }


def _write(path: Path, content: onnx.ModelProto | bytes) -> Path:
    path.write_bytes(content if isinstance(content, bytes) else content.SerializeToString())
    return path


@pytest.mark.parametrize("stem", sorted(_bad_models()))
def test_a_bad_model_is_one_line_naming_the_file_and_the_cause_and_exit_1(capsys, tmp_path, stem):
    content, cause = _bad_models()[stem]
    path = _write(tmp_path / f"{stem}.onnx", content)
    code, out, err = analyze(capsys, "--json", path)
    assert code == 1 and out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("dlbricks analyze: error: ")
    assert str(path) in err and cause in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args, cause",
    [
        (["-G", "0"], "at least 1"),
        (["-G", "-3"], "at least 1"),
        (["-G", "two"], "integers"),
        (["-G", "1,x"], "integers"),
    ],
)
def test_a_bad_granularity_is_a_usage_error(capsys, args, cause):
    code, out, err = analyze(capsys, *args, light("squeezenet"))
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and "-G" in err and cause in err


def test_an_empty_folder_and_a_missing_path_are_usage_errors(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no models here")
    for path, cause in ((tmp_path / "empty", "no .onnx files"), (tmp_path / "absent.onnx", "no such file")):
        code, out, err = analyze(capsys, path)
        assert code == 2 and out == ""
        assert len(err.splitlines()) == 1
        assert err.startswith(f"dlbricks analyze: error: {path}: {cause}")


def test_a_bad_model_in_a_corpus_is_reported_and_skipped_unless_strict(capsys, tmp_path):
    shutil.copy(light("squeezenet"), tmp_path / "squeezenet.onnx")
    onnx.save(_conv_net(0), tmp_path / "convnet.onnx")
    bad = _write(tmp_path / "broken.onnx", _bad_models()["cyclic"][0])
    result, err = analyze_json(capsys, tmp_path)
    assert sorted(m["name"] for m in result["models"]) == ["convnet", "squeezenet"]
    assert [e["path"] for e in result["errors"]] == [str(bad)]
    assert "cycle" in result["errors"][0]["error"]
    (line,) = err.splitlines()
    assert line.startswith("dlbricks: warning: skipped ") and str(bad) in line and "cycle" in line
    code, out, err = analyze(capsys, "--json", "--strict", tmp_path)
    assert code == 1 and out == ""
    assert len(err.splitlines()) == 1 and str(bad) in err


def test_python_dash_m_dlbricks_analyze_prints_json_and_exits_0():
    proc = subprocess.run(
        [sys.executable, "-m", "dlbricks", "analyze", "--json", "-G", "2", str(light("squeezenet"))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["G"] == [2] and result["models"][0]["name"] == "light_squeezenet"
    assert result["corpus"]["sequences"]["2"]["unique_sequences"] <= result["corpus"]["sequences"]["2"]["sequences"]


_ENTRY_PROBE = """
import gc, sys
from dlbricks.cli import console_main
sys.argv = ["dlbricks", *sys.argv[1:]]
try:
    rc = console_main()
except SystemExit as exc:  # argparse's --version exits from inside main
    rc = exc.code
sys.stdout.flush()
print("frozen", gc.get_freeze_count(), "rc", rc)
"""


def test_program_entry_runs_main_then_leaves_live_objects_to_the_os():
    # The installed `dlbricks` program is console_main: the command's output and exit
    # code are main's, and the objects alive at the end are frozen (shutdown skips
    # collecting them), also when argparse exits from inside main.
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "dlbricks"]
    assert script.value == "dlbricks.cli:console_main"
    model = str(light("bvlc_alexnet"))
    for args, rc in ((["analyze", "--json", model], 0), (["--version"], 0), (["analyze", "-G", "0", model], 2)):
        proc = subprocess.run([sys.executable, "-c", _ENTRY_PROBE, *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        frozen, n, _, code = lines[-1].split()
        assert frozen == "frozen" and int(n) > 1000 and code == str(rc), proc.stdout[-300:]
        if args[0] == "analyze" and rc == 0:
            assert json.loads(lines[0])["models"][0]["layers"] == 24


_FASTBIN_PROBE = """
import ctypes, sys
from dlbricks.commands._common import tune_allocator_for_loading
if sys.argv[1] == "tuned":
    tune_allocator_for_loading()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = Mallinfo2
# More small blocks than glibc's per-thread cache holds (7 per size): the rest go to fastbins.
blocks = [libc.malloc(48) for _ in range(200)]
for b in blocks:
    libc.free(b)
print(libc.mallinfo2().fsmblks)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator setting")
def test_analyze_turns_glibc_fastbins_off_for_its_process():
    def fastbin_bytes(mode: str) -> int:
        proc = subprocess.run([sys.executable, "-c", _FASTBIN_PROBE, mode], capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            pytest.skip(f"not glibc with mallinfo2: {proc.stderr.strip()[-200:]}")
        return int(proc.stdout)

    assert fastbin_bytes("default") > 0
    assert fastbin_bytes("tuned") == 0


@pytest.mark.parametrize("name", __import__("dlbricks.cli", fromlist=["_COMMANDS"])._COMMANDS)
def test_a_command_parser_built_alone_matches_the_one_under_the_main_parser(name, capsys):
    # main() builds only the parser of the command it runs; help, usage errors and
    # parsed arguments must be those of the full parser.
    from dlbricks import cli

    full, alone = cli.build_parser(), cli.build_parser(name)
    outputs = []
    for parser, argv in ((full, [name, "--help"]), (alone, ["--help"]), (full, [name, "--no-such-option"]),
                         (alone, ["--no-such-option"])):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(argv)
        out, err = capsys.readouterr()
        outputs.append((exc.value.code, out, err))
    assert outputs[0] == outputs[1] and outputs[0][0] == 0
    # A usage error exits 2 either way; alone, it is always the command's parser that
    # reports it (under the main parser, options left over by a command whose
    # positionals are all optional are reported by the main parser, with its usage).
    (code_full, _, err_full), (code_alone, _, err_alone) = outputs[2], outputs[3]
    assert code_full == code_alone == 2
    assert err_alone.startswith(f"dlbricks {name}: error: ") and len(err_alone.splitlines()) == 1
    assert err_full.splitlines()[-1].split(": error: ")[1] == err_alone.splitlines()[-1].split(": error: ")[1]
    if name == "analyze":
        argv = ["m.onnx", "d/", "--json", "-G", "1-2", "--strict", "-o", "x.json"]
        assert vars(full.parse_args([name, *argv])) == vars(alone.parse_args(argv))


def _write_mo(path: Path, messages: dict[str, str]) -> None:
    """A GNU gettext catalogue (.mo) holding ``messages`` (and a UTF-8 header)."""
    import struct

    entries = sorted({"": "Content-Type: text/plain; charset=UTF-8\n", **messages}.items())
    keys = [k.encode() for k, _ in entries]
    values = [v.encode() for _, v in entries]
    n = len(entries)
    start = 7 * 4 + 16 * n  # header, then both tables of (length, offset) pairs
    blob, key_at, value_at = b"", [], []
    for k in keys:
        key_at.append((len(k), start + len(blob)))
        blob += k + b"\0"
    for v in values:
        value_at.append((len(v), start + len(blob)))
        blob += v + b"\0"
    out = struct.pack("<7I", 0x950412DE, 0, n, 7 * 4, 7 * 4 + 8 * n, 0, 0)
    out += b"".join(struct.pack("<2I", *p) for p in key_at + value_at) + blob
    path.parent.mkdir(parents=True)
    path.write_bytes(out)


def test_argparse_messages_are_translated_by_gettext(tmp_path, monkeypatch, capsys):
    # The CLI leaves argparse's own translation alone: its messages are gettext's.
    import argparse
    import gettext

    from dlbricks import cli

    with pytest.raises(SystemExit):
        cli.main(["analyze", "--help"])
    capsys.readouterr()
    assert argparse._ is gettext.gettext
    _write_mo(tmp_path / "de" / "LC_MESSAGES" / "dlbtest.mo", {"usage: ": "Aufruf: ", "options": "Optionen"})
    monkeypatch.setenv("LANGUAGE", "de")
    domain = gettext.textdomain()
    gettext.bindtextdomain("dlbtest", str(tmp_path))
    gettext.textdomain("dlbtest")
    try:
        with pytest.raises(SystemExit):
            cli.build_parser("analyze").parse_args(["--help"])
        out = capsys.readouterr().out
        assert out.startswith("Aufruf: dlbricks analyze") and "\nOptionen:\n" in out
    finally:
        gettext.textdomain(domain)
