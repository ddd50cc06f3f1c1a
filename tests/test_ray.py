"""Distributed analysis and benchmarking on a real two-node Ray cluster (loopback only).

The module starts its own cluster: a head node (``ray start --head``) and a worker
node (``ray start --address ...``), both bound to 127.0.0.1 with free ports and a
private temp dir, each offering one timing slot and pinned to its own CPU. Every
process a node starts is tracked, and the teardown ends exactly those.
"""

from __future__ import annotations

import _thread
import json
import os
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

# Read when ray is imported, so set first. Ray replaces 127.0.0.1 by the machine's
# outward address unless this is 0:
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# The cluster and this driver share a token of their own (never ~/.ray/auth_token).
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'dlbricks[ray]')")

from conftest import light  # noqa: E402

from dlbricks.cli import main  # noqa: E402
from dlbricks.distributed import (  # noqa: E402
    CORES_ENV,
    TIMING_RESOURCE,
    bench_on_ray,
    connect,
    load_corpus_ray,
    node_cores,
)
from dlbricks.distributed.driver import BATCH  # noqa: E402
from dlbricks.errors import DlbricksError  # noqa: E402
from dlbricks.store import Store  # noqa: E402
from dlbricks.timing import RunnerConfig  # noqa: E402
from dlbricks.timing.sysinfo import fingerprint_id, system_fingerprint  # noqa: E402

pytestmark = [
    pytest.mark.ray,
    # Ray's own modules warn about their dependencies and deprecated APIs they use.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*"),
    pytest.mark.filterwarnings("ignore::FutureWarning:ray.*"),
]

# `ray start` with its address resolution kept on loopback: for a worker node Ray
# otherwise swaps 127.0.0.1 for the outward address (and refuses to start a worker
# node at all when RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0).
_RAY_START = (
    "import sys, ray._private.services as s; s.resolve_ip_for_localhost = lambda host: host; "
    "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; sys.exit(main())"
)
START_TIMEOUT_S = 120.0
FAST = ["--min-time", "0.01", "--max-time", "0.05", "--warmup-time", "0", "--warmup", "1", "--min-iters", "3"]


_HANDED_OUT: set[int] = set()


def _free_port() -> int:
    """A free loopback port never handed out before in this process: the OS may give a
    just-released port again, and Ray refuses two components on one port."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])
            out.setdefault(ppid, []).append(int(entry.name))
    return out


def _descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(tree.get(p, []))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class LocalCluster:
    """A Ray cluster of `ray start` nodes on this machine, on 127.0.0.1 only."""

    def __init__(self) -> None:
        # Short: Ray puts unix sockets below it (108-byte path limit).
        self.root = Path(tempfile.mkdtemp(prefix="dlbr-", dir="/tmp"))
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: dict[str, subprocess.Popen] = {}
        self.seen: set[int] = set()
        self.killed: set[str] = set()

    def start_node(self, name: str, *, head: bool, cores: str) -> None:
        args = [
            "start", "--block", "--node-ip-address", "127.0.0.1", "--temp-dir", str(self.root),
            "--num-cpus", "1", "--object-store-memory", str(100 * 2**20), "--disable-usage-stats",
            "--resources", json.dumps({TIMING_RESOURCE: 1}),
            "--node-manager-port", str(_free_port()), "--object-manager-port", str(_free_port()),
            "--dashboard-agent-listen-port", str(_free_port()), "--dashboard-agent-grpc-port", str(_free_port()),
            "--runtime-env-agent-port", str(_free_port()), "--metrics-export-port", str(_free_port()),
        ]  # fmt: skip
        if head:
            args += ["--head", "--port", str(self.port), "--include-dashboard=false"]
        else:
            args += ["--address", self.address]
        env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
        env[CORES_ENV] = cores
        # The agents' brick files: a killed node leaves its last ones behind.
        env["TMPDIR"] = str(self.root / "tmp")
        (self.root / "tmp").mkdir(exist_ok=True)
        log = open(self.root / f"{name}.log", "wb")
        self.nodes[name] = subprocess.Popen(
            [sys.executable, "-c", _RAY_START, *args], env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        log.close()

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")[-4000:]

    def wait_nodes(self) -> None:
        """Until every node started and not killed is alive in the cluster."""
        live = {name: proc for name, proc in self.nodes.items() if name not in self.killed}
        n = len(live)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (self.root / "ray_current_cluster").exists():
            for name, proc in live.items():
                assert proc.poll() is None, f"ray node {name} exited:\n{self.log(name)}"
            assert time.monotonic() < deadline, "the Ray head did not start"
            time.sleep(0.25)
        ray.init(address=self.address, log_to_driver=False, logging_level="WARNING")
        try:
            while len(alive := [x for x in ray.nodes() if x["Alive"]]) < n:
                for name, proc in live.items():
                    assert proc.poll() is None, f"ray node {name} exited:\n{self.log(name)}"
                assert time.monotonic() < deadline, f"only {len(alive)} of {n} Ray nodes came up"
                time.sleep(0.25)
            # Loopback only: every node and this driver.
            assert {x["NodeManagerAddress"] for x in alive} == {"127.0.0.1"}
            assert ray.util.get_node_ip_address() == "127.0.0.1"
        finally:
            ray.shutdown()
        self.track()

    def track(self) -> None:
        for proc in self.nodes.values():
            self.seen.update(_descendants(proc.pid))

    def processes(self, name: str) -> list[int]:
        return _descendants(self.nodes[name].pid)

    def kill(self, name: str) -> None:
        """The machine dies: every process of the node at once."""
        self.killed.add(name)
        for pid in self.processes(name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.nodes[name].wait(30)

    def stop(self) -> None:
        self.track()
        for proc in self.nodes.values():
            if proc.poll() is None:
                proc.terminate()  # `ray start --block` stops its node's processes
        for proc in self.nodes.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        for pid in self.seen:  # only what our nodes started
            if _cmdline(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in self.nodes.values():
            if proc.poll() is None:
                proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster()
    try:
        c.start_node("head", head=True, cores="0")
        c.start_node("worker", head=False, cores="1")
        c.wait_nodes()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    d = tmp_path_factory.mktemp("corpus")
    paths = []
    for name in ("squeezenet", "shufflenet"):
        p = d / f"{name}.onnx"
        p.write_bytes(light(name).read_bytes())
        paths.append(str(p))
    return paths


def _run_json(argv: list[str], capsys) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(argv)
    out = capsys.readouterr().out
    return rc, json.loads(out)


def test_node_cores_prefers_the_nodes_own_setting():
    assert node_cores(None, {CORES_ENV: "1"}) is None
    assert node_cores((5, 6), {CORES_ENV: "0-3"}) == (0, 1)
    allowed = sorted(os.sched_getaffinity(0))
    assert node_cores((allowed[0],), {}) == (allowed[0],)
    # Cores this node lacks: its own last ones, as many as the run pins.
    assert node_cores((10_000,), {}) == (allowed[-1],)


def test_a_node_busy_with_other_work_gets_a_warning_line_naming_it():
    from dlbricks.distributed.driver import busy_nodes
    from dlbricks.timing.hostload import HostLoad

    quiet = {"hostname": "a", "node_id": "1", "host": HostLoad(9.0, 0.01, 0.0).to_dict()}
    busy = {"hostname": None, "node_id": "2", "host": HostLoad(9.0, 0.9, 0.0, (2.0, 1.0, 3.0)).to_dict()}
    lost = {"hostname": "c", "node_id": "3", "host": None}
    lines = busy_nodes([quiet, busy, lost])
    assert len(lines) == 1 and lines[0].startswith("node 2: the machine was busy") and "0.90 CPUs" in lines[0]


def test_analyze_on_ray_equals_the_local_analysis(cluster, corpus, tmp_path, capsys):
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not an onnx model")
    paths = [*corpus, str(broken)]
    rc_local, local = _run_json(["analyze", *paths, "-G", "1,2,3", "--json"], capsys)
    rc_ray, distributed = _run_json(["analyze", *paths, "-G", "1,2,3", "--json", "--ray", cluster.address], capsys)
    assert rc_local == rc_ray == 0
    assert local.pop("timing").keys() == distributed.pop("timing").keys()
    assert len(local["errors"]) == 1
    assert distributed == local


def _if_model():
    """Control flow, which the fast path leaves to the full loader by design."""
    from onnx import TensorProto
    from onnx import helper as h

    def vi(name, shape, elem=TensorProto.FLOAT):
        return h.make_tensor_value_info(name, elem, shape)

    then_g = h.make_graph([h.make_node("Relu", ["r"], ["t"])], "then", [], [vi("t", [1, 8])])
    else_g = h.make_graph([h.make_node("Neg", ["r"], ["e"])], "else", [], [vi("e", [1, 8])])
    nodes = [h.make_node("Sigmoid", ["x"], ["r"]),
             h.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)]
    graph = h.make_graph(nodes, "branchy", [vi("x", [1, 8]), vi("c", [], TensorProto.BOOL)], [vi("y", [1, 8])])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])


def test_analyze_on_ray_counts_and_names_fast_path_fallbacks_as_a_local_run(cluster, corpus, tmp_path, capsys):
    import onnx

    # The nodes load the files themselves: the model must leave the fast path by its
    # own content (control flow), and a file that is no model (malformed bytes) too.
    branchy, broken = tmp_path / "branchy.onnx", tmp_path / "broken.onnx"
    onnx.save(_if_model(), branchy)
    broken.write_bytes(b"not an onnx model")
    paths = [*corpus, str(branchy), str(broken)]
    _, local = _run_json(["analyze", *paths, "--json"], capsys)
    _, distributed = _run_json(["analyze", *paths, "--json", "--ray", cluster.address], capsys)
    keys = ("fast_path_fallbacks", "fast_path_fallback_count", "fast_path_unexpected_count")
    assert {k: distributed["timing"][k] for k in keys} == {k: local["timing"][k] for k in keys}
    by_model = {f["model"]: f for f in distributed["timing"]["fast_path_fallbacks"]}
    assert by_model[str(branchy)] == {"model": str(branchy), "reason": "control flow or a subgraph attribute",
                                      "expected": True}
    assert str(broken) in by_model and not set(corpus) & set(by_model)  # the light models took the fast path
    assert distributed["timing"]["fast_path_fallback_count"] == len(by_model) == 2
    assert distributed["timing"]["fast_path_unexpected_count"] == 0
    # -v says the same on stderr as a local run.
    capsys.readouterr()
    assert main(["analyze", *paths, "-v", "--ray", cluster.address]) == 0
    ray_err = [line for line in capsys.readouterr().err.splitlines() if "fast path" in line]
    assert main(["analyze", *paths, "-v"]) == 0
    local_err = [line for line in capsys.readouterr().err.splitlines() if "fast path" in line]
    assert ray_err == local_err and ray_err[0] == "dlbricks: fast path: 2 of 4 models; 2 to the full loader (0 unexpected)"


def _kill_when_busy(
    cluster: LocalCluster, node: str, store: Path, results: int, before: dict[str, str]
) -> threading.Thread:
    """Kill ``node`` once ``store`` holds ``results`` brick results and the node is timing one."""

    def killer() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if store.exists():
                try:
                    with Store(store, readonly=True) as st:
                        rows = {r.digest: r.created_at for r in st.results(kind="brick", with_times=False)}
                except (DlbricksError, sqlite3.Error):
                    # The bench process is still creating the store (an empty file is
                    # "not a dlbricks store" to a reader): look again.
                    time.sleep(0.02)
                    continue
                busy = any(_cmdline(p).startswith("ray::TimingAgent.measure") for p in cluster.processes(node))
                if len(rows) >= results and busy:
                    before.update(rows)
                    cluster.kill(node)
                    return
            time.sleep(0.02)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    return thread


def _brick_results(path: Path) -> dict[tuple, str]:
    with Store(path, readonly=True) as st:
        return {(r.digest, r.digest_version, r.system_id, r.config_key): r.status for r in st.results(kind="brick")}


def test_bench_on_ray_matches_local_and_survives_a_node_loss(cluster, corpus, tmp_path, capsys):
    common = ["bench", *corpus, "-G", "1,2", *FAST, "--cores", "1", "--json"]
    local_store, ray_store = tmp_path / "local.sqlite", tmp_path / "ray.sqlite"
    # Ray nodes cut the source graph; so does the local run compared with them.
    rc, local = _run_json([*common, "--graph", "source", "--store", str(local_store)], capsys)
    assert rc == 0 and local["bricks_failed"] == 0

    # Kill the worker node once results stream in and it is timing a brick.
    before: dict[str, str] = {}
    thread = _kill_when_busy(cluster, "worker", ray_store, 5, before)
    rc, distributed = _run_json([*common, "--store", str(ray_store), "--ray", cluster.address], capsys)
    thread.join(60)
    assert before, "the run ended before the worker node was killed"
    assert rc == 0, distributed["failures"]

    system_id = fingerprint_id(system_fingerprint())
    # Both nodes are this machine: one system kind, the worker node lost with its brick in flight.
    assert list(distributed["systems"]) == [system_id] and distributed["systems"][system_id]["nodes"] == 2
    assert sorted(n["lost"] for n in distributed["nodes"]) == [False, True]
    assert distributed["nodes_lost"] == 1 and distributed["retries"] >= 1 and distributed["lost"] == 0
    assert distributed["bricks_total"] == local["bricks_total"] == distributed["bricks_measured"]
    assert distributed["bricks_failed"] == 0
    assert distributed["config_key"] == local["config_key"]
    # The surviving node says what else ran on it while it timed (the lost one cannot).
    hosts = {n["lost"]: n["host"] for n in distributed["nodes"]}
    assert hosts[True] is None and hosts[False]["seconds"] > 0 and hosts[False]["other_cpus"] >= 0
    assert hosts[False]["shared_cache"] > 0

    # The same bricks under the same keys as the local run, every one measured.
    local_results, ray_results = _brick_results(local_store), _brick_results(ray_store)
    assert ray_results == local_results
    assert set(ray_results.values()) == {"ok"}
    with Store(local_store, readonly=True) as a, Store(ray_store, readonly=True) as b:
        assert b.bricks() == a.bricks()
        assert set(b.systems()) == {system_id}
        after = {r.digest: r.created_at for r in b.results(kind="brick", with_times=False)}
    # Nothing measured before the kill was lost or measured again.
    assert before and all(after[d] == t for d, t in before.items())

    # Resume: a second run finds everything in the store (on the surviving node).
    rc, again = _run_json([*common, "--store", str(ray_store), "--ray", cluster.address], capsys)
    assert rc == 0
    assert again["bricks_measured"] == 0 and again["bricks_reused"] == local["bricks_total"]
    assert [n["lost"] for n in again["nodes"]] == [False]
    assert again["nodes"][0]["host"] is None  # nothing timed


def test_bench_on_ray_checks_precision_and_remeasures_exactly_what_it_flags(cluster, tmp_path, capsys):
    import onnx
    from test_outputs import CLI, MEDIANS, fill
    from test_pipeline import chain_model, diamond_model

    from dlbricks.loading import load

    zoo = [tmp_path / "chain.onnx", tmp_path / "diamond.onnx"]
    onnx.save(chain_model(3), str(zoo[0]))
    onnx.save(diamond_model(), str(zoo[1]))
    store_path = tmp_path / "s.sqlite"
    with Store(store_path) as st:
        # Stored results under the key the agents report (both nodes are this machine):
        # the chain's Conv 10x less precise than the rest, the diamond's Sigmoid stopped
        # at the round limit.
        digests = fill(st, [load(p) for p in zoo], 1, median_of=MEDIANS, wide={"Conv": 0.03}, stopped={"Sigmoid"})
        before = {r.digest: r.created_at for r in st.results(with_times=False)}
    argv = ["bench", *map(str, zoo), "-G", "1", "--store", str(store_path), "--json", "--ray", cluster.address, *CLI]

    capsys.readouterr()
    rc = main(argv)
    captured = capsys.readouterr()
    out, err = json.loads(captured.out), captured.err
    assert rc == 0 and out["bricks_measured"] == 0 and out["bricks_reused"] == out["bricks_total"]
    # The reused results are judged as after a local bench, and the worst case named.
    assert "1 brick result(s) stopped at the round limit" in err
    assert "1 model(s) short of the +/-2.0% precision" in err and "--remeasure-unstable" in err
    assert next(x for x in err.splitlines() if "chain (G=1)" in x).count("of its variance from brick Conv") == 1
    check = out["precision_check"]
    assert check["models_flagged"] == 1 and check["results_unconverged"] == 1
    assert out["systems"][out["system_id"]]["precision_check"] == check

    assert main([*argv, "--remeasure-unstable"]) == 0
    captured = capsys.readouterr()
    again = json.loads(captured.out)
    assert "re-measuring 2 stored result(s)" in captured.err
    assert again["bricks_measured"] == 2 and again["bricks_reused"] == again["bricks_total"] - 2
    with Store(store_path, readonly=True) as st:
        after = {r.digest: r.created_at for r in st.results(with_times=False)}
    assert {d for d in before if after[d] != before[d]} == {digests["Conv"], digests["Sigmoid"]}


def test_bench_on_ray_e2e_prints_each_models_latency_per_system_kind(cluster, tmp_path, capsys, monkeypatch):
    import onnx
    from test_outputs import CLI, MEDIANS, fill
    from test_pipeline import chain_model, diamond_model

    import dlbricks.distributed
    from dlbricks.commands._common import render_latencies
    from dlbricks.loading import load

    zoo = [tmp_path / "chain.onnx", tmp_path / "diamond.onnx"]
    onnx.save(chain_model(3), str(zoo[0]))
    onnx.save(diamond_model(), str(zoo[1]))
    store_path = tmp_path / "s.sqlite"
    with Store(store_path) as st:
        # Under the key the agents report (both nodes are this machine): nothing to measure.
        fill(st, [load(p) for p in zoo], 1, median_of=MEDIANS, e2e={"chain": 60_000.0, "diamond": 8_000.0},
             e2e_se_rel=0.02)
    # CLI cuts the source graph, as Ray does: the local run reads the same results.
    local_argv = ["bench", *map(str, zoo), "-G", "1", "--e2e", "--store", str(store_path), *CLI]
    argv = [*local_argv, "--ray", cluster.address]

    capsys.readouterr()
    assert main(argv) == 0
    text = capsys.readouterr().out
    head = next(x for x in text.splitlines() if "median" in x)
    assert "p90" in head and "p99" in head and "95% interval" in head
    rows = {x.split()[1]: x for x in text.splitlines() if x[2:].startswith(("chain", "diamond"))}
    assert "60.000" in rows["chain"] and "8.000" in rows["diamond"]
    assert rows["chain"].startswith("!") and "end to end: +/-" in rows["chain"]

    rc, out = _run_json([*argv, "--json"], capsys)
    assert rc == 0 and out["models_measured"] == 0 and out["models_reused"] == 2
    keys = {"name", "path", "median_s", "p90_s", "p99_s", "ci_low_s", "ci_high_s", "rounds", "stop_reason",
            "flagged", "flags"}
    assert all(keys <= set(m) for m in out["models"])
    by_name = {m["name"]: m for m in out["models"]}
    assert by_name["chain"]["median_s"] == pytest.approx(60e-6) and by_name["chain"]["path"] == str(zoo[0])
    assert by_name["chain"]["flagged"] and by_name["chain"]["flags"][0].startswith("end to end: +/-")
    assert out["systems"][out["system_id"]]["models"] == out["models"]
    # What a local bench --e2e reports from the same results, and its table.
    rc, local = _run_json([*local_argv, "--json"], capsys)
    assert rc == 0 and local["models"] == out["models"]
    assert render_latencies(out["models"]) in text

    # A second system kind (this machine's nodes are one kind; this one measured
    # nothing): each kind's table under its own line, its models in its JSON block.
    real = dlbricks.distributed.bench_on_ray
    other = "f" * 32

    def two_kinds(*args, **kwargs):
        summary = real(*args, **kwargs)
        summary.systems[other] = {"cpu": "another cpu", "nodes": 1}
        return summary

    monkeypatch.setattr(dlbricks.distributed, "bench_on_ray", two_kinds)
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    at = {x.split()[1]: i for i, x in enumerate(lines) if x.startswith("system ")}
    assert set(at) == {out["system_id"], other}
    mine, theirs = lines[at[out["system_id"]] + 1:at[other]], lines[at[other] + 1:]
    assert "median" in mine[0] and "60.000" in next(x for x in mine if x[2:].startswith("chain"))
    assert "median" in theirs[0] and [x.split() for x in theirs[1:3]] == [["chain", "missing"], ["diamond", "missing"]]
    assert sum("median" in x for x in lines) == 2  # no third table for the first kind
    rc, both = _run_json([*argv, "--json"], capsys)
    assert rc == 0 and both["models"] == out["models"]
    assert both["systems"][out["system_id"]]["models"] == out["models"]
    assert [m["status"] for m in both["systems"][other]["models"]] == ["missing", "missing"]


def test_a_brick_lost_with_its_node_is_stored_not_measured_and_measured_next_run(cluster, corpus, tmp_path):
    cluster.start_node("spare", head=False, cores="1")
    cluster.wait_nodes()
    store_path = tmp_path / "ray.sqlite"
    config = RunnerConfig(cores=(1,), warmup_iters=1, warmup_time=0.0, min_iters=3, min_time=0.01, max_time=0.05)
    before: dict[str, str] = {}
    with connect(cluster.address), Store(store_path) as store:
        models = load_corpus_ray(corpus[:1]).models
        thread = _kill_when_busy(cluster, "spare", store_path, 3, before)
        # One attempt: the batch in flight on the dead node is not retried in this run.
        first = bench_on_ray(models, [1], store=store, config=config, max_attempts=1)
        thread.join(60)
        assert before, "the run ended before the spare node was killed"
        lost = first.lost
        assert first.nodes_lost == 1 and 1 <= lost <= BATCH and first.retries == 0
        assert first.bricks_failed == lost and first.bricks_measured == first.bricks_total - lost
        failed = [r for r in store.results(kind="brick") if not r.ok]
        assert len(failed) == lost and all(r.error.startswith("not measured: node") for r in failed)
        assert {r.meta["reason"] for r in failed} == {"lost"}
        # The next run measures just those bricks (on the surviving head node).
        second = bench_on_ray(models, [1], store=store, config=config)
        assert second.bricks_measured == lost and second.bricks_failed == 0
        assert second.bricks_reused == first.bricks_total - lost
        assert all(r.ok for r in store.results(kind="brick"))


def test_an_interrupted_run_keeps_its_results_and_the_next_one_resumes(cluster, corpus, tmp_path):
    store_path = tmp_path / "ray.sqlite"
    config = RunnerConfig(cores=(1,), warmup_iters=1, warmup_time=0.0, min_iters=3, min_time=0.01, max_time=0.05)

    def interrupter() -> None:  # Ctrl-C once a few results are in
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if store_path.exists():
                with Store(store_path, readonly=True) as st:
                    if st.count(kind="brick") >= 5:
                        _thread.interrupt_main()
                        return
            time.sleep(0.02)

    with connect(cluster.address), Store(store_path) as store:
        # Both models: enough bricks left after the first results that the interrupt
        # always lands mid-run (one model alone could finish between two polls of the
        # interrupter on a fast host); one granularity keeps the resumed run short.
        models = load_corpus_ray(corpus).models
        thread = threading.Thread(target=interrupter, daemon=True)
        thread.start()
        with pytest.raises(KeyboardInterrupt):
            bench_on_ray(models, [1], store=store, config=config)
        thread.join(60)
        kept = store.count(kind="brick")
        assert kept >= 5 and all(r.ok for r in store.results(kind="brick"))
        # The interrupted run released its timing slots: the next one starts agents
        # and measures only what is missing.
        again = bench_on_ray(models, [1], store=store, config=config, start_timeout_s=60)
        assert again.bricks_reused == kept
        assert again.bricks_measured == again.bricks_total - kept and again.bricks_failed == 0


def test_an_address_nobody_answers_fails_fast(corpus, capsys):
    t0 = time.monotonic()
    assert main(["analyze", corpus[0], "--ray", f"127.0.0.1:{_free_port()}"]) == 1
    assert "no Ray head node answers" in capsys.readouterr().err
    assert time.monotonic() - t0 < 30
    assert main(["bench", corpus[0], "--ray", "no-port-here"]) == 2
