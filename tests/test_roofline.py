"""Roofline analysis: exact bounds with hand-made peaks, efficiency flagging, headroom
order, scenario arithmetic on a hand-built model with fake store results, re-batching,
the peaks cache, the plot, and one end-to-end CLI run on SqueezeNet."""

from __future__ import annotations

import base64
import json

import numpy as np
import onnx
import pytest
from conftest import light
from onnx import TensorProto, helper, numpy_helper

import dlbricks.roofline.peaks as peaks_mod
from dlbricks.bricks import model_digest
from dlbricks.cli import main
from dlbricks.corpus import Corpus
from dlbricks.errors import ModelError
from dlbricks.loading import load
from dlbricks.roofline import analysis as rl
from dlbricks.roofline.costmodel import LayerCost
from dlbricks.roofline.peaks import CacheLevel, Peaks
from dlbricks.store import Store
from dlbricks.timing import Measurement, RunnerConfig, summarize
from dlbricks.versions import brick_digest_version, model_digest_version

SYSTEM = {"test_system": 1}  # put_result stores a fingerprint dict and keys by its id
CONFIG = RunnerConfig()
US = 1e-6

# Layer order of the hand-built model:
# x -> conv0 (3x3) -> relu1 -> {convA (1x1), convB (3x3, dilation 2)} -> add4.
CONV0, RELU1, CONVA, CONVB, ADD4 = range(5)


def hand_peaks(gflops: float = 100.0, gbs: float = 10.0, llc: int = 1 << 20, int8: float | None = 400.0) -> Peaks:
    return Peaks(threads=1, gflops=gflops, copy_gbs=gbs, triad_gbs=gbs, ort_scale_gbs=gbs, ort_add_gbs=gbs,
                 int8_gops=int8,
                 caches=[CacheLevel(level=3, type="Unified", size_bytes=llc, shared_cpus=2, line_bytes=64)])


def _branchy(batch: int = 1, *, pinned_reshape: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def w(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv0"),
        helper.make_node("Relu", ["c"], ["r"], name="relu1"),
        helper.make_node("Conv", ["r", "wa", "ba"], ["a"], kernel_shape=[1, 1], name="convA"),
        # Dilated, so that its brick differs from conv0's (same FLOPs and bytes).
        helper.make_node("Conv", ["r", "wb", "bb"], ["b"], kernel_shape=[3, 3], pads=[2, 2, 2, 2], dilations=[2, 2],
                         name="convB"),
        helper.make_node("Add", ["a", "b"], ["y"], name="add4"),
    ]
    inits = [w("w0", 8, 8, 3, 3), w("b0", 8), w("wa", 8, 8, 1, 1), w("ba", 8), w("wb", 8, 8, 3, 3), w("bb", 8)]
    out_name, out_shape = "y", [batch, 8, 16, 16]
    if pinned_reshape:  # the AlexNet pattern: a shape constant that bakes in batch 1
        nodes.append(helper.make_node("Reshape", ["y", "shape"], ["z"], name="flat"))
        inits.append(numpy_helper.from_array(np.array([1, 2048], np.int64), "shape"))
        out_name, out_shape = "z", [1, 2048]
    graph = helper.make_graph(
        nodes, "branchy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8, 16, 16])],
        [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, out_shape)], initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def branchy_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "branchy.onnx"
    onnx.save(_branchy(), path)
    return path


@pytest.fixture(scope="module")
def branchy(branchy_path):
    return load(branchy_path)


def _measurement(seconds: float, n: int = 21, jitter: float = 0.0) -> Measurement:
    t = np.full(n, seconds * 1e9)
    if jitter:
        t = t * np.linspace(1 - jitter, 1 + jitter, n)
    t = np.rint(t).astype(np.int64)
    return Measurement(times_ns=t, stats=summarize(t), config=CONFIG, warmup_iters=0, stop_reason="converged",
                       setup_time_s=0.0, wall_time_s=0.0, denormal_input_fraction=0.0,
                       denormal_output_fraction=0.0, denormal_fraction=0.0, denormals_as_zero=True,
                       denormals_flushed=True, ort_version="test")


# Measured medians by layer.
TIMES = {CONV0: 10 * US, RELU1: 4 * US, CONVA: 3 * US, CONVB: 8 * US, ADD4: 2 * US}


def _fill(store: Store, model, times: dict[int, float], jitter: dict[int, float] | None = None) -> str:
    digests = rl.layer_brick_digests(Corpus([model]), 0)
    for i, t in times.items():
        store.put_result("brick", digests[i], brick_digest_version(), SYSTEM, CONFIG,
                         _measurement(t, jitter=(jitter or {}).get(i, 0.0)))
    from dlbricks.timing.sysinfo import fingerprint_id

    return fingerprint_id(SYSTEM)


@pytest.fixture()
def store(tmp_path):
    with Store(tmp_path / "results.sqlite") as s:
        yield s


def _analyze(model, store, times=TIMES, noise=0.05, peaks=None, jitter=None):
    sid = _fill(store, model, times, jitter)
    return rl.analyze([model], peaks or hand_peaks(), store=store, system_id=sid, config_key=CONFIG.key(),
                      noise=noise), sid


# --------------------------------------------------------------------------- bounds


def test_layer_bounds_are_exact_with_hand_made_peaks(branchy):
    a = rl.analyze([branchy], hand_peaks())  # 100 GFLOP/s, 10 GB/s
    rows = a.models[0].layers
    assert [r.kind for r in rows] == ["Conv", "Relu", "Conv", "Conv", "Add"]
    conv0, relu = rows[CONV0], rows[RELU1]
    # Conv 3x3 8->8 on 16x16 with bias: 2*(8*256*8*9) + 8*256 FLOPs; bytes: x, w, b, y.
    assert conv0.cost.flops == 296960
    assert conv0.cost.bytes_min == 8192 + 2304 + 32 + 8192
    assert conv0.compute_s == pytest.approx(296960 / 100e9, rel=1e-12)
    assert conv0.memory_s == pytest.approx(18720 / 10e9, rel=1e-12)
    assert conv0.bound_s == conv0.compute_s and conv0.limit == "compute"
    assert conv0.intensity == pytest.approx(296960 / 18720)
    # Relu on 2048 elements: 2048 FLOPs, 2 * 8192 bytes: memory-bound.
    assert relu.bound_s == pytest.approx(16384 / 10e9, rel=1e-12) and relu.limit == "memory"
    assert rows[CONVA].bound_s == pytest.approx(16672 / 10e9, rel=1e-12)
    assert rows[ADD4].bound_s == pytest.approx(24576 / 10e9, rel=1e-12)
    m = a.models[0]
    assert m.ideal_sequential_s == pytest.approx(11.7024 * US, rel=1e-9)
    # conv0 + relu + the slower branch (convB) + add
    assert m.ideal_critical_path_s == pytest.approx(10.0352 * US, rel=1e-9)
    # Without a store nothing is measured.
    assert m.layers_missing == 5 and m.measured_s is None and all(r.efficiency is None for r in rows)


def test_fusion_groups_fuse_activations_and_adds_into_single_consumer_producers(branchy):
    group, fused_into, saved = rl.fusion_groups(branchy)
    # relu1 fuses into conv0; add4 into convA (its first input, consumed by add4 only);
    # convB's output also feeds only add4, but add4 has joined convA's kernel already.
    assert fused_into == [None, CONV0, None, None, CONVA]
    assert saved == [0, 8192, 0, 0, 8192]
    assert group.tolist() == [0, 0, 2, 3, 2]


def test_relu_of_a_tensor_with_two_consumers_is_not_fused():
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Add", ["c", "r"], ["y"]),  # c is read twice: it must be written
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        initializer=[numpy_helper.from_array(np.ones((4, 4, 1, 1), np.float32), "w")],
    )
    m = load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    _, fused_into, _ = rl.fusion_groups(m)
    assert fused_into[1] is None  # Relu: c has two consumers
    assert fused_into[2] == 1  # Add: r is consumed by Add only


# --------------------------------------------------------------------------- measured


def test_measured_times_efficiency_and_model_latency_come_from_the_store(branchy, store):
    a, _ = _analyze(branchy, store)
    m = a.models[0]
    rows = m.layers
    assert [r.measured_s for r in rows] == pytest.approx([TIMES[i] for i in range(5)])
    assert rows[CONV0].efficiency == pytest.approx(2.9696 / 10)
    assert rows[RELU1].efficiency == pytest.approx(1.6384 / 4)
    assert m.layers_missing == 0
    assert m.layer_sum_s == pytest.approx(27 * US)
    assert m.measured_source == "layer_sum" and m.measured_s == m.layer_sum_s
    assert m.efficiency == pytest.approx(11.7024 / 27)


def test_end_to_end_result_is_preferred_for_the_model_latency(branchy, store):
    sid = _fill(store, branchy, TIMES)
    store.put_result("model", model_digest(branchy), model_digest_version(), SYSTEM, CONFIG, _measurement(25 * US))
    a = rl.analyze([branchy], hand_peaks(), store=store, system_id=sid, config_key=CONFIG.key())
    m = a.models[0]
    assert m.measured_source == "end_to_end" and m.measured_s == pytest.approx(25 * US)
    assert m.layer_sum_s == pytest.approx(27 * US)


def test_a_layer_faster_than_its_bound_is_flagged_with_reasons(branchy, store):
    # add4's bound is 2.4576 us and it ran in 2 us: efficiency 1.23.
    a, _ = _analyze(branchy, store)
    flagged = a.beats_bound()
    assert [(r.index, r.kind) for r in flagged] == [(ADD4, "Add")]
    r = flagged[0]
    assert r.efficiency == pytest.approx(1.2288)
    assert r.cause == "cache_resident"  # 24576 bytes fit in the 1 MiB LLC
    assert "cache" in r.reasons[0]
    assert all(not x.beats_bound and x.efficiency <= 1.05 for x in a.models[0].layers if x is not r)


def test_flagging_tolerates_noise_and_the_medians_own_uncertainty(branchy, store):
    a, _ = _analyze(branchy, store, noise=0.25)
    assert a.beats_bound() == []
    # A median whose CI spans +/-30% cannot show an efficiency of 1.23 is real.
    with Store(store.path.with_name("other.sqlite")) as s2:
        a2, _ = _analyze(branchy, s2, jitter={ADD4: 0.6})
        add = a2.models[0].layers[ADD4]
        assert add.ci_rel > 0.23 and add.efficiency > 1.05
        assert not add.beats_bound


def test_an_uncached_memory_bound_layer_blames_the_bandwidth_and_compute_bound_the_flop_side(branchy, store):
    # LLC of 1 KiB: add4's 24576 bytes cannot be cache-resident.
    a, _ = _analyze(branchy, store, peaks=hand_peaks(llc=1024))
    assert [r.cause for r in a.beats_bound()] == ["bandwidth_peak"]
    # A slow compute peak (1 GFLOP/s) puts conv0 at 297 us of bound against 10 us measured.
    with Store(store.path.with_name("other.sqlite")) as s2:
        a2, _ = _analyze(branchy, s2, peaks=hand_peaks(gflops=1.0))
        conv0 = a2.models[0].layers[CONV0]
        assert conv0.limit == "compute" and conv0.beats_bound
        assert conv0.cause == "flop_formula_or_peak"


def _chain() -> onnx.ModelProto:
    """x -> the same 3x3 Conv as branchy's conv0 -> four Relus."""
    w = numpy_helper.from_array(np.zeros((8, 8, 3, 3), np.float32), "w")
    b = numpy_helper.from_array(np.zeros(8, np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["t0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    nodes += [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"]) for i in range(4)]
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
        [helper.make_tensor_value_info("t4", TensorProto.FLOAT, [1, 8, 16, 16])], initializer=[w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def test_headroom_ranks_unique_layers_by_wasted_time_times_occurrences(branchy, store):
    chain = load(_chain())
    sid = _fill(store, branchy, TIMES)
    a = rl.analyze([branchy, chain], hand_peaks(), store=store, system_id=sid, config_key=CONFIG.key())
    assert a.models[1].layers_missing == 0  # every chain layer is a brick of branchy
    h = rl.layer_headroom(a)
    # conv3x3 on the graph input (both models): (10 - 2.9696) x 2; Relu (1 + 4 occurrences):
    # (4 - 1.6384) x 5; convB (8 - 2.9696); convA (3 - 1.6672); add (2 - 2.4576): it beat
    # its bound. The Relu outranks convB, which wastes more per occurrence.
    assert [(e["example"], e["occurrences"]) for e in h] == [
        ("branchy:conv0", 2), ("branchy:relu1", 5), ("branchy:convB", 1), ("branchy:convA", 1), ("branchy:add4", 1)]
    assert [e["total_headroom_s"] for e in h] == pytest.approx(
        [14.0608 * US, 11.808 * US, 5.0304 * US, 1.3328 * US, -0.4576 * US])
    assert h[0]["models"] == ["branchy", "chain"]
    assert rl.layer_headroom(a, top=2) == h[:2]


def test_brick_headroom_bounds_a_brick_by_the_sum_of_its_layers(branchy, store):
    sid = _fill(store, branchy, TIMES)
    a = rl.analyze([branchy], hand_peaks(), store=store, system_id=sid, config_key=CONFIG.key())
    sp = Corpus([branchy]).split(2)
    for u in range(sp.n_unique):
        store.put_result("brick", bytes(sp.unique_digests[u]).hex(), brick_digest_version(), SYSTEM, CONFIG,
                         _measurement(20 * US))
    bricks = rl.brick_headroom([branchy], a, 2, store=store, system_id=sid, config_key=CONFIG.key())
    assert len(bricks) == sp.n_unique
    rows = a.models[0].layers
    for b in bricks:
        _, members = sp.first_occurrence([bytes(d).hex() for d in sp.unique_digests].index(b["digest"]))
        assert b["bound_s"] == pytest.approx(sum(rows[j].bound_s for j in members))
        assert b["total_headroom_s"] == pytest.approx((20 * US - b["bound_s"]) * b["occurrences"])
    assert [b["total_headroom_s"] for b in bricks] == sorted((b["total_headroom_s"] for b in bricks), reverse=True)


# --------------------------------------------------------------------------- scenarios


def test_scenario_arithmetic(branchy, store):
    a, _ = _analyze(branchy, store)
    s = a.models[0].scenarios
    assert s["at_bound"]["latency_s"] == pytest.approx(11.7024 * US)
    assert s["at_bound"]["speedup"] == pytest.approx(27 / 11.7024)
    # Branches overlap: conv0 + relu + max(convA 3, convB 8) + add = 24 us.
    assert s["parallel_branches"]["latency_s"] == pytest.approx(24 * US)
    assert s["parallel_branches"]["speedup"] == pytest.approx(27 / 24)
    f = s["fusion"]
    assert f["fused_layers"] == 2 and f["groups"] == 3
    assert f["latency_s"] == pytest.approx(21 * US)  # relu (4) and add (2) dropped
    assert f["speedup"] == pytest.approx(27 / 21)
    # {conv0, relu}: compute 299008 FLOPs; {convA, add}: (16672 + 24576 - 2*8192) bytes; convB alone.
    assert f["bound_latency_s"] == pytest.approx((2.99008 + 2.4864 + 2.9696) * US)
    assert f["bound_speedup"] == pytest.approx(11.7024 / 8.44608)


def test_scenarios_that_need_every_layer_measured_are_null_when_one_is_missing(branchy, store):
    a, _ = _analyze(branchy, store, times={k: v for k, v in TIMES.items() if k != RELU1})
    m = a.models[0]
    assert m.layers_missing == 1 and m.layer_sum_s is None and m.measured_s is None
    s = m.scenarios
    assert s["at_bound"]["speedup"] is None and s["parallel_branches"]["latency_s"] is None
    assert s["fusion"]["latency_s"] is None and s["fusion"]["bound_latency_s"] > 0
    json.dumps(rl.to_dict(a))  # no NaN or inf slip into the JSON


def test_batch_scenario_compares_time_per_sample(branchy, store, tmp_path):
    pinned = tmp_path / "pinned.onnx"
    onnx.save(_branchy(pinned_reshape=True), pinned)
    models = [branchy, load(pinned)]
    sid = _fill(store, branchy, TIMES)
    _fill(store, models[1], {**TIMES, 5: 1 * US})
    a = rl.analyze(models, hand_peaks(), store=store, system_id=sid, config_key=CONFIG.key())
    b2 = rl.rebatch(branchy, 2)
    _fill(store, b2, {**{i: 2 * t for i, t in TIMES.items()}, CONV0: 15 * US})  # batching pays off on conv0
    out = rl.batch_what_if(models, 2, a, store=store, system_id=sid, config_key=CONFIG.key(), measure=False)
    ok = out["branchy"]
    assert ok["rebatchable"] and ok["layers_missing"] == 0
    assert ok["latency_s"] == pytest.approx((15 + 8 + 6 + 16 + 4) * US)
    assert ok["per_sample_latency_s"] == pytest.approx(24.5 * US)
    assert ok["per_sample_speedup"] == pytest.approx(27 / 24.5)
    assert ok["ideal_latency_s"] > a.models[0].ideal_sequential_s
    bad = out["pinned"]
    assert not bad["rebatchable"] and "pinned" in bad["error"] and "flat" in bad["error"]
    assert a.models[0].scenarios["batch"] is ok and a.models[1].scenarios["batch"] is bad


def test_rebatch_light_models_sets_the_batch_or_names_the_pinning_layer():
    squeeze = load(light("squeezenet"))
    b = rl.rebatch(squeeze, 3)
    assert b.inputs[0][1].shape == (3, 3, 224, 224) and b.outputs[0][1].shape[0] == 3
    with pytest.raises(ModelError, match="Reshape"):
        rl.rebatch(load(light("bvlc_alexnet")), 2)
    with pytest.raises(ValueError):
        rl.rebatch(squeeze, 0)


# --------------------------------------------------------------------------- peaks, plot, JSON


def test_peaks_are_cached_next_to_the_store_per_thread_count(tmp_path, monkeypatch):
    calls = []

    def fake_measure(threads=1, cores=None, quick=False):
        calls.append(threads)
        return hand_peaks(gflops=10.0 * threads)

    monkeypatch.setattr(peaks_mod, "measure_peaks", fake_measure)
    store_path = tmp_path / "s" / "results.sqlite"
    p1 = rl.peaks_for_store(store_path, RunnerConfig(), system_id="sys1")
    p2 = rl.peaks_for_store(store_path, RunnerConfig(), system_id="sys1")
    assert calls == [1] and p1 == p2 and p1.fingerprint == "sys1"
    assert len(list((tmp_path / "s" / "peaks").glob("peaks-*.json"))) == 1
    p3 = rl.peaks_for_store(store_path, RunnerConfig(intra_op_threads=2, cores=None), system_id="sys1")
    assert calls == [1, 2] and p3.gflops == 20.0
    rl.peaks_for_store(store_path, RunnerConfig(), system_id="sys2")
    assert calls == [1, 2, 1]
    assert rl.peaks_dir(store_path) == tmp_path / "s" / "peaks"


def test_plot_is_a_png_and_json_carries_it(branchy, store, tmp_path):
    a, _ = _analyze(branchy, store)
    png = rl.plot_roofline(a, tmp_path / "plot" / "r.png")
    assert png.startswith(b"\x89PNG") and (tmp_path / "plot" / "r.png").read_bytes() == png
    d = json.loads(json.dumps(rl.to_dict(a, headroom=rl.layer_headroom(a), png=png)))
    assert base64.b64decode(d["plot_png_base64"]) == png
    assert d["schema_version"] == 1 and d["peaks"]["gflops"] == 100.0
    assert [x["name"] for x in d["beats_bound"]] == ["add4"]
    text = rl.format_text(a, rl.layer_headroom(a))
    assert "branchy" in text and "1 layer(s) beat their bound" in text


def _legend_labels(fig) -> list[str]:
    (ax,) = fig.axes
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_plot_title_no_longer_counts_unplaced_layers_and_every_mark_has_a_legend(branchy, store):
    a, _ = _analyze(branchy, store)
    fig = rl.roofline_figure(a)
    (ax,) = fig.axes
    assert ax.get_title() == "roofline, 1 thread(s)"
    labels = _legend_labels(fig)
    assert labels[0] == "branchy"
    assert any(x.startswith("float32 roofline") for x in labels)
    assert any(x.startswith("float32 ridge point") for x in labels)
    assert "faster than its bound" in labels  # add4's red edge
    # No int8 layer here: no int8 ceiling, triangle or axis wording.
    assert not any("int8" in x for x in labels) and "int8" not in ax.get_xlabel()
    # Every layer of branchy is drawn: no note under the plot.
    assert not [t for t in ax.texts if t.get_text()]


def _fill_every_layer(store: Store, model, seconds: float = 20 * US) -> str:
    for d in set(rl.layer_brick_digests(Corpus([model]), 0)):
        store.put_result("brick", d, brick_digest_version(), SYSTEM, CONFIG, _measurement(seconds))
    from dlbricks.timing.sysinfo import fingerprint_id

    return fingerprint_id(SYSTEM)


@pytest.fixture(scope="module")
def squeezenet_runtime():
    from dlbricks.loading.runtime_graph import runtime_models

    (m,) = runtime_models([load(light("squeezenet"))])
    return m


def test_runtime_graph_of_squeezenet_places_every_layer_that_computes(squeezenet_runtime, store):
    m = squeezenet_runtime
    assert "com.microsoft.nchwc::Conv" in {layer.kind for layer in m.layers}
    sid = _fill_every_layer(store, m)
    a = rl.analyze([m], hand_peaks(), store=store, system_id=sid, config_key=CONFIG.key())
    rows = a.models[0].layers
    assert all(r.cost.has_formula for r in rows) and a.models[0].layers_missing == 0
    # The only layers without a point move data (Concat, the reorder back to NCHW), named with the reason.
    (only,) = a.not_placed()
    assert only["reason"] == "no_arithmetic"
    assert only["kinds"] == {"Concat": 8, "com.microsoft.nchwc::ReorderOutput": 1}
    assert only["layers"] == 9 == sum(r.not_placed() is not None for r in rows)
    # Every NCHWc Conv has a compute bound: its fused bias and Relu on top of the MACs.
    convs = [r for r in rows if r.kind == "com.microsoft.nchwc::Conv"]
    assert len(convs) == 26 and all(r.cost.flops > 2 * r.cost.macs > 0 and r.not_placed() is None for r in convs)
    text = rl.format_text(a)
    assert "9 layer(s) do no arithmetic" in text and "Concat 8, com.microsoft.nchwc::ReorderOutput 1" in text
    note = "".join(t.get_text() for t in rl.roofline_figure(a).axes[0].texts)
    assert note.startswith("Layers not drawn:") and "Concat 8" in note and "bounded by memory alone" in note
    d = json.loads(json.dumps(rl.to_dict(a)))
    assert d["not_placed"] == [only]


def test_layers_without_a_formula_or_a_measurement_are_named_with_their_reason(squeezenet_runtime, store):
    a = rl.analyze([squeezenet_runtime], hand_peaks())  # no store: nothing measured
    by = {e["reason"]: e for e in a.not_placed()}
    assert set(by) == {"no_arithmetic", "not_measured"}
    assert by["not_measured"]["kinds"]["com.microsoft.nchwc::Conv"] == 26
    fig_note = "".join(t.get_text() for t in rl.roofline_figure(a).axes[0].texts)
    assert "have no measurement in the store" in fig_note
    # A layer without a formula: its op type is named, and why.
    bogus = a.models[0].layers[0]
    bogus.kind = "com.example::Mystery"
    bogus.cost = LayerCost(bogus.kind, 0, 0, 8, 0, 8, 16, False)
    lines = rl.not_placed_lines(a)
    assert lines[0] == ("1 layer(s) have no formula for their op (their bound counts their bytes alone): "
                        "com.example::Mystery 1")


def test_text_tables_have_human_column_names(branchy, store):
    a, _ = _analyze(branchy, store)
    text = rl.format_text(a, rl.layer_headroom(a))
    headers = [line for line in text.splitlines() if line.startswith(("model ", "op type "))]
    assert len(headers) == 3  # models, what-if, headroom
    assert all("_" not in h for h in headers)
    assert "bound, critical path (ms)" in text and "ideal cp" not in text and " eff " not in text
    assert "sum of layers" in text and "layer_sum" not in text
    assert "by likely cause: data in cache 1" in text  # add4, not the code cache_resident


def _qdq_conv(path) -> None:
    """x -> Q -> DQ -> Conv(DQ(int8 w), DQ(int32 b)) -> Q -> DQ: onnxruntime runs a QLinearConv."""
    rng = np.random.default_rng(0)

    def c(name: str, value) -> onnx.TensorProto:
        return numpy_helper.from_array(np.asarray(value), name)

    inits = [c("xs", np.float32(0.05)), c("xz", np.uint8(128)),
             c("w", rng.integers(-100, 100, (8, 8, 3, 3)).astype(np.int8)), c("ws", np.float32(0.01)),
             c("wz", np.int8(0)), c("b", rng.integers(-100, 100, 8).astype(np.int32)), c("bs", np.float32(5e-4)),
             c("bz", np.int32(0)), c("ys", np.float32(0.1)), c("yz", np.uint8(128))]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"]),
        helper.make_node("DequantizeLinear", ["b", "bs", "bz"], ["bd"]),
        helper.make_node("Conv", ["xd", "wd", "bd"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("QuantizeLinear", ["c", "ys", "yz"], ["cq"]),
        helper.make_node("DequantizeLinear", ["cq", "ys", "yz"], ["y"]),
    ]
    x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 8, 16, 16]) for n in ("x", "y"))
    graph = helper.make_graph(nodes, "qdq_conv", [x], [y], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)


def test_int8_kernels_of_a_runtime_graph_are_bounded_by_the_int8_peak(tmp_path, store):
    from dlbricks.loading.runtime_graph import runtime_models

    path = tmp_path / "qdq_conv.onnx"
    _qdq_conv(path)
    source = load(path)
    (m,) = runtime_models([source])
    sid = _fill_every_layer(store, m, 1 * US)
    a = rl.analyze([m], hand_peaks(gflops=100.0, int8=400.0), store=store, system_id=sid, config_key=CONFIG.key())
    rows = a.models[0].layers
    (q,) = [r for r in rows if r.kind == "com.microsoft::QLinearConv"]
    macs = 8 * 256 * 8 * 9
    assert q.cost.macs == macs and q.cost.int_ops == 2 * macs + 8 * 256 and q.cost.flops == 5 * 8 * 256
    assert q.is_int8 and q.not_placed() is None
    assert q.compute_s == pytest.approx(q.cost.flops / 100e9 + q.cost.int_ops / 400e9, rel=1e-12)
    assert q.cost.input_bytes == 8 * 256 and q.cost.output_bytes == 8 * 256  # uint8: a byte an element
    # The source graph's QDQ group counts the same work.
    (group,) = [r for r in rl.analyze([source], hand_peaks()).models[0].layers if r.kind == "Conv"]
    assert (group.cost.macs, group.cost.int_ops, group.cost.flops) == (q.cost.macs, q.cost.int_ops, q.cost.flops)
    assert all(r.cost.has_formula for r in rows)
    fig = rl.roofline_figure(a)
    labels = _legend_labels(fig)
    assert "int8 roofline (400.0 GOP/s)" in labels and "int8 ridge point (40.0 op/byte)" in labels
    assert "int8 kernel (triangle; circle: float)" in labels
    assert "int8" in fig.axes[0].get_ylabel()
    assert "int8 400.0 GOP/s" in rl.format_text(a)
    # Peaks without the int8 peak: int ops get no compute bound, and the output says so.
    old = rl.analyze([m], hand_peaks(gflops=100.0, int8=None), store=store, system_id=sid, config_key=CONFIG.key())
    (q_old,) = [r for r in old.models[0].layers if r.kind == "com.microsoft::QLinearConv"]
    assert q_old.compute_s == pytest.approx(q.cost.flops / 100e9, rel=1e-12)
    text = rl.format_text(old)
    assert "int8 not measured" in text and "the 1 int8 layers are bounded by memory and their float work alone" in text
    assert not any("int8 roofline" in x for x in _legend_labels(rl.roofline_figure(old)))


# --------------------------------------------------------------------------- CLI


def test_cli_end_to_end_on_squeezenet(tmp_path, capsys, squeezenet_runtime):
    peaks_file = tmp_path / "peaks.json"
    peaks_file.write_text(json.dumps(hand_peaks(gflops=50.0, gbs=10.0, llc=32 << 20).to_dict()))
    store = tmp_path / "results.sqlite"
    common = [str(light("squeezenet")), "--store", str(store), "--peaks", str(peaks_file), "--no-pin"]
    short = ["--min-time", "0.01", "--max-time", "0.05", "--warmup-time", "0", "--min-iters", "5"]
    plot = tmp_path / "roofline.png"
    assert main(["roofline", *common, *short, "--json", "--plot", str(plot), "--top", "5"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["schema_version"] == 1 and {"context", "peaks", "models", "headroom", "beats_bound"} <= set(d)
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert base64.b64decode(d["plot_png_base64"]).startswith(b"\x89PNG")
    (m,) = d["models"]
    # The layers of the graph onnxruntime runs, as bench cuts it by default.
    assert d["graph"] == "runtime" == m["graph"]
    assert m["name"] == "light_squeezenet" and m["n_layers"] == len(squeezenet_runtime.layers) == len(m["layers"])
    assert m["layers_missing"] == 0 and m["measured_source"] == "layer_sum"
    assert m["layer_sum_s"] == pytest.approx(sum(r["measured_s"] for r in m["layers"]))
    assert 0 < m["ideal_critical_path_s"] <= m["ideal_sequential_s"]
    assert set(m["scenarios"]) == {"at_bound", "parallel_branches", "fusion"}
    assert m["speedup_parallel"] == m["scenarios"]["parallel_branches"]["speedup"]
    assert "speedup_batch_per_sample" not in m
    assert m["scenarios"]["parallel_branches"]["latency_s"] <= m["layer_sum_s"] * (1 + 1e-12)
    for r in m["layers"]:
        assert r["measured_s"] > 0 and r["bound_s"] >= 0
        tol = 1 + max(d["noise"], r["ci_rel"])
        # Efficiency never exceeds 1 + noise unless the layer is flagged, with reasons.
        assert r["beats_bound"] == (r["efficiency"] > tol)
        assert bool(r["reasons"]) == r["beats_bound"]
    assert len(d["headroom"]) == 5
    totals = [h["total_headroom_s"] for h in d["headroom"]]
    assert totals == sorted(totals, reverse=True)
    # The second run measures nothing and reads the same medians back.
    assert main(["roofline", *common, "--no-measure", "--json", "--no-plot"]) == 0
    d2 = json.loads(capsys.readouterr().out)
    assert "plot_png_base64" not in d2
    assert [r["measured_s"] for r in d2["models"][0]["layers"]] == [r["measured_s"] for r in m["layers"]]
    assert main(["roofline", *common, "--no-measure"]) == 0
    assert "light_squeezenet" in capsys.readouterr().out


def test_cli_reads_what_bench_measured_on_the_graph_bench_cut(branchy_path, tmp_path, capsys):
    peaks_file = tmp_path / "peaks.json"
    peaks_file.write_text(json.dumps(hand_peaks().to_dict()))
    store = tmp_path / "results.sqlite"
    fast = ["--no-pin", "--warmup", "1", "--warmup-time", "0", "--min-iters", "5", "--min-time", "0.005",
            "--max-time", "0.05", "--min-rounds", "2", "--max-rounds", "3"]
    assert main(["bench", str(branchy_path), "--store", str(store), "--json", *fast]) == 0
    capsys.readouterr()
    common = [str(branchy_path), "--store", str(store), "--peaks", str(peaks_file), "--no-measure", "--no-pin"]
    assert main(["roofline", *common, "--json", "--no-plot"]) == 0
    d = json.loads(capsys.readouterr().out)
    (m,) = d["models"]
    assert d["graph"] == "runtime" and m["graph"] == "runtime" and m["path"] == str(branchy_path)
    # The runtime graph: NCHWc Convs with the Relu and the Add fused in, and layout
    # changes (and a ReorderInput of the 8-channel input where the NCHWc block is 8
    # channels, as with AVX2; not with AVX-512's 16); every layer has the time bench measured.
    kinds = {r["kind"] for r in m["layers"]}
    assert {"com.microsoft.nchwc::Conv", "com.microsoft.nchwc::ReorderOutput"} <= kinds
    assert kinds <= {"com.microsoft.nchwc::Conv", "com.microsoft.nchwc::ReorderOutput", "com.microsoft.nchwc::ReorderInput"}
    assert m["layers_missing"] == 0 and m["measured_source"] == "layer_sum"
    assert all(r["measured_s"] > 0 for r in m["layers"])
    assert not [n for n in d["not_placed"] if n["reason"] == "not_measured"]
    assert main(["roofline", *common]) == 0
    assert capsys.readouterr().out.startswith("layers of the graphs onnxruntime executes (--graph runtime)\n")
    # The batch what-if re-batches the model file and cuts its runtime graph at that batch.
    assert main(["roofline", *common, "--batch", "2", "--json", "--no-plot"]) == 0
    batch = json.loads(capsys.readouterr().out)["models"][0]["scenarios"]["batch"]
    assert batch["rebatchable"] and batch["layers_missing"] == 5 and batch["ideal_latency_s"] > 0
    # The source graph's bricks were not measured: asking for them says so.
    assert main(["roofline", *common, "--graph", "source", "--json", "--no-plot"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["graph"] == "source" and d["models"][0]["layers_missing"] == 5
    assert {r["kind"] for r in d["models"][0]["layers"]} == {"Conv", "Relu", "Add"}


def test_cli_usage_errors(tmp_path, capsys):
    assert main(["roofline", str(light("squeezenet")), "--store", str(tmp_path / "s.sqlite"),
                 "--peaks", str(tmp_path / "missing.json"), "--no-measure"]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert main(["roofline", str(light("squeezenet")), "--noise", "-1"]) == 2
    assert "--noise" in capsys.readouterr().err
