"""The measurement engine's worker process: holds many bound sessions, runs rounds.

Started by :mod:`dlbricks.timing.engine` as ``python -m dlbricks.timing.engine_worker
READ_FD WRITE_FD BEACON``, a fresh interpreter rather than a ``multiprocessing`` child,
so that a user's script needs no ``if __name__ == "__main__":`` guard (``spawn``
re-imports the parent's main module; this does not).

Protocol (pickled tuples over a pipe, one reply per request):

- ``("config", config_dict)`` -> ``("ready", pid)``: pin this process, keep the config.
- ``("open", id, source, int_bounds, seed, slot)`` -> ``("opened", id, info)`` or
  ``("failed", id, message)``: create and bind a session (``source`` is serialized
  model bytes or a path), warm it up until its run time settles.
- ``("round", [(id, k, warm), ...], read_cache)`` ->
  ``("round", {id: [ns, ...]}, wall_s, {id: probe_ns}, cache_reading)``: give every
  listed session ``k`` timed runs, in the order the cache state asks for; ``probe_ns``
  is the speed probe's reading around the session's burst (its cold runs):
  :class:`_SpeedReadings`; ``cache_reading`` the shared-cache probe's after the round
  (:mod:`dlbricks.timing.cacheprobe`) when ``read_cache``, else None.
- ``("pin", cpus)`` -> ``("pinned",)`` or ``("failed", None, message)``: move to those
  CPUs to build sessions while no round runs, or back to the configured cores (``cpus``
  None) to time them.
- ``("close", [id, ...])`` -> ``("closed", held_bytes)``: what the worker's live
  sessions hold now; the memory of the closed ones stays with the worker for the next
  (:mod:`dlbricks.timing.heap`). ``info`` of ``opened`` has the same as ``"held"``.
- ``None`` or end of file: exit.

Before touching a session the worker writes its slot number into the *beacon*, a
small shared file, so that the parent can tell which session was running when the
worker crashed or hung, without a message per run.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import statistics
import struct
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

import numpy as np

#: Warm-up ends when the latest run is within this fraction of the fastest before it,
#: faster or slower (first-run allocations and caches are behind it)...
_STEADY_TOLERANCE = 0.10
#: ...for this many consecutive runs (after the binding's two untimed runs, which take
#: the first-run allocations: one settled run more says the run time has settled, and
#: a session's warm-up runs are a fifth of what opening the light corpus costs),
_STEADY_RUNS = 1
#: or after this many runs or seconds, whichever comes first. Rounds are robust to a
#: session that is not quite steady yet: each round weighs the same in its estimate.
_WARMUP_MAX_RUNS = 20
_WARMUP_MAX_S = 0.25
#: A cold run finds its weights in DRAM: at least this many times the largest cache's
#: size of other data is read between two runs of a cold session (twice: caches do
#: not evict in strict LRU order)...
_EVICTION_CACHE_MULTIPLE = 2
#: ...the largest cache assumed when the machine does not say...
_DEFAULT_LLC_BYTES = 32 << 20
#: ...and the most of it counted. A cloud VM reports its host socket's whole last-level
#: cache (480 MiB on a 2-vCPU Xeon VM), which it shares with every other tenant and
#: whose share it holds is a few MiB per core; reading twice that size between cold
#: runs took 60 ms a pass, and allocating the buffer 7.6 s in each worker (the VM backs
#: fresh pages on first touch), half of a four-model evaluation.
_MAX_LLC_BYTES = 64 << 20
#: Timed runs of the speed probe per reading (the least of them is the reading: the
#: first finds the caches as the last session left them)...
_PROBE_RUNS = 3
#: ...and the least time between two readings: the core's speed changes over hundreds
#: of milliseconds, and short sessions in between share the readings around them.
_PROBE_EVERY_NS = 1_000_000


def eviction_bytes() -> int:
    """The data read between two runs of a cold session (see :class:`_Evictor`)."""
    from dlbricks.roofline.peaks import data_cache_bytes

    return _EVICTION_CACHE_MULTIPLE * min(data_cache_bytes() or _DEFAULT_LLC_BYTES, _MAX_LLC_BYTES)


class _Evictor:
    """Makes the cold state a setting rather than an accident of the schedule.

    Two runs of a cold session are separated by the runs of the other cold sessions of
    the round, which evict its weights only if they read enough: with many sessions
    open they do, with the last few of a batch they do not, and the same brick would
    then read its weights from the last-level cache in one run and from DRAM in the
    next (a 4 MB Gemm measured 43 us in one run and 113 us in another). So each pass
    over the cold sessions is preceded by a read of this buffer, of whatever the
    other sessions' weights fall short of :func:`eviction_bytes`.

    The read evicts onnxruntime's code as well, which in a model run stays cached
    (every layer runs through it), and which the other sessions' runs keep cached when
    they do the evicting; so after the read a tiny session is run once, untimed, to
    bring the code of a run back."""

    def __init__(self, nbytes: int, refresh: Callable[[], None]) -> None:
        self.nbytes = nbytes
        self._refresh = refresh
        self._buffer: np.ndarray | None = None

    def top_up(self, others_bytes: int) -> None:
        """Read what ``others_bytes`` (the data other sessions read between two runs
        of each cold session) falls short of."""
        short = self.nbytes - others_bytes
        if short <= 0:
            return
        if self._buffer is None:  # allocated on first use: a warm-only worker never pays it
            self._buffer = np.ones(self.nbytes, dtype=np.uint8)
        # One byte of every cache line; the sum is discarded.
        np.add.reduce(self._buffer[:short:64])
        self._refresh()


def _probe_model() -> bytes:
    """The speed probe: a small MatMul whose weights and inputs stay in the core's caches.

    Timed around every burst, it reads the speed of the core at that moment: on a
    shared host an SMT sibling or a neighbour's vector work slows every compute-bound
    kernel by the same factor for seconds at a time (on a 2-core VM, bursts of a 64x512
    MatMul and of this probe, 20 ms apart, moved together with a correlation of 0.85
    while both changed speed by 1.5x), and the engine takes that factor out of each
    session's rounds (:mod:`dlbricks.timing.engine`). A run of it also goes through
    onnxruntime's run path and little else, which is what the evictor needs after its
    read."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((128, 128)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "speed_probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 128])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 128])], initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


#: A warm session shorter than this gets two discarded runs per burst, not one...
SHORT_RUN_S = 500e-6
#: ...and one this long or longer none.
LONG_RUN_S = 0.5


def discarded_runs(run_s: float, nbytes: int, burst_s: float, eviction_nbytes: int) -> int:
    """How many untimed runs a warm session gets before its timed ones in a round.

    They restore the session's own working set, as a warm loop has it (the previous
    round's other sessions and cold passes evicted it): a short run's, and a long
    one's whose weights fit the last-level cache. A long run that outgrows the caches
    evicts its own first layers with its last ones anyway, so it gets none.

    One run is not enough for a short session. Right after other sessions' runs, the
    runs of a brick in a row took (steady = the fifth), on a 2-core Xeon VM over 40
    bricks of ResNet-50 and SqueezeNet: the first +13-420% (+10-40 us), the second
    +1-54% (+1-10 us) for bricks under 0.3 ms and within 2% above, the third steady.
    In a model the layer runs on what the layer before just wrote, as in the steady
    runs; timed as the second run, ShuffleNet's 1x136x28x28 Relu read 13 us, as the
    first (the speed probe's runs in between) 30 us, and its bricks summed to 1.2-1.35x
    the model. So a short session gets two, which cost it at most ``SHORT_RUN_S``
    more per round.

    And a run of ``LONG_RUN_S`` or more gets none: what it re-reads from memory after
    other sessions' runs is small beside its own time. Right after an eviction read,
    paired with the run after it (same Xeon VM, 8-15 pairs each): ResNet-50 (56 ms)
    +0.8%, BERT-base (183 ms) +1.6%, Whisper-base's encoder (793 ms) -0.3%, AST (2.1 s,
    346 MB of weights) -0.01%; its discarded run doubled what a round cost AST, whose
    slow drift needed 58 rounds for +/-2% (233 s of a 496 s evaluation of 36 models).
    ``eviction_nbytes`` (:func:`eviction_bytes`) is a multiple of the last-level cache."""
    if run_s >= LONG_RUN_S or not (run_s < burst_s or nbytes <= eviction_nbytes // _EVICTION_CACHE_MULTIPLE):
        return 0
    return 2 if run_s < SHORT_RUN_S else 1


class _SpeedReadings:
    """Readings of the speed probe (:func:`_probe_model`) taken between sessions' bursts.

    Each burst is given the readings just before and just after it (the phases of the
    core's speed outlast a burst, but a long burst can straddle a change); readings
    are at least ``_PROBE_EVERY_NS`` apart, so a run of short sessions shares the
    readings around it instead of paying one each."""

    def __init__(self, read: Callable[[], int]) -> None:
        self._read = read
        self._last = 0
        self._last_ns = 0
        self._waiting: list[list[int]] = []

    def before(self, readings: list[int]) -> None:
        """Before a burst: its first reading goes to ``readings`` now, its second
        when the next reading is taken."""
        if not self._last or time.perf_counter_ns() - self._last_ns > _PROBE_EVERY_NS:
            self.take()
        readings.append(self._last)
        self._waiting.append(readings)

    def take(self) -> None:
        """A reading now: the second one of every burst since the last."""
        self._last = self._read()
        self._last_ns = time.perf_counter_ns()
        for readings in self._waiting:
            readings.append(self._last)
        self._waiting = []


class _Beacon:
    """The slot of the session being run, in a shared 8-byte file (-1: none)."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, 8)
        finally:
            os.close(fd)

    def set(self, slot: int) -> None:
        struct.pack_into("<q", self._map, 0, slot)


class _Session:
    __slots__ = ("bound", "inputs", "nbytes", "run_s", "slot")

    def __init__(self, bound: Any, inputs: list[np.ndarray], slot: int, run_s: float, nbytes: int) -> None:
        self.bound = bound
        self.inputs = inputs
        self.slot = slot
        self.run_s = run_s
        #: Its model's size (its weights): what one of its runs reads at least.
        self.nbytes = nbytes


def _touch(arrays: list[np.ndarray]) -> None:
    # Reading every cache line brings the inputs into the caches, as a layer finds
    # the output its predecessor just wrote; summing bytes is the cheapest full read.
    for a in arrays:
        if a.dtype.kind in "fiub" and a.size:
            np.add.reduce(a.reshape(-1).view(np.uint8)[::64])


def _fraction(arrays: Any, count: Any) -> tuple[int, int]:
    # A strided sample of at most ~64k values per tensor: denormals come from weights and
    # inputs spread over whole tensors, and a full count of a large one costs milliseconds.
    den = total = 0
    for a in arrays:
        flat = np.asarray(a).reshape(-1)
        step = max(1, flat.size // 65536)
        den += count(flat[::step])
        total += len(flat[::step])
    return den, total


def _warm_up(bound: Any, timed_runs: Any, clock: Any) -> tuple[int, float]:
    """Run until the run time settles; returns (runs, the settled run time in s)."""
    times: list[int] = []
    deadline = time.perf_counter_ns() + int(_WARMUP_MAX_S * 1e9)
    steady = 0
    best = None
    while len(times) < _WARMUP_MAX_RUNS:
        timed_runs(bound, 1, out=times, clock=clock)
        t = times[-1]
        # Within the tolerance of the fastest earlier run either way: a run much faster
        # than every one before it says the session is still warming up.
        if best is not None and abs(t - best) <= best * _STEADY_TOLERANCE:
            steady += 1
        else:
            steady = 0
        best = t if best is None else min(best, t)
        if steady >= _STEADY_RUNS or time.perf_counter_ns() > deadline:
            break
    tail = sorted(times[-_STEADY_RUNS:])
    return len(times), tail[len(tail) // 2] * 1e-9


def serve(conn: Connection, beacon: _Beacon) -> None:
    from dataclasses import replace

    from dlbricks.errors import DlbricksError
    from dlbricks.timing.cacheprobe import SharedCacheProbe
    from dlbricks.timing.config import RunnerConfig
    from dlbricks.timing.fpenv import FloatEnv, count_denormals
    from dlbricks.timing.heap import held_bytes
    from dlbricks.timing.session import pin_process, pinned, prepare_session, source_nbytes, timed_runs
    from dlbricks.timing.workers import serve as serve_requests

    tag, cfg_dict = conn.recv()
    assert tag == "config"
    config = RunnerConfig.from_dict(cfg_dict)
    pin_process(config)
    import onnxruntime  # noqa: F401  (paid before "ready", so on no session's clock)

    fenv = FloatEnv()
    clock = time.thread_time_ns if config.measure_clock() == "thread" else time.perf_counter_ns
    sessions: dict[str, _Session] = {}
    probe_bound: list[Any] = []

    def probe() -> Any:
        if not probe_bound:
            bound = prepare_session(_probe_model(), config, fenv).bound
            _warm_up(bound, timed_runs, clock)
            probe_bound.append(bound)
        return probe_bound[0]

    speed = _SpeedReadings(lambda: min(timed_runs(probe(), _PROBE_RUNS, clock=clock)))
    evictor = _Evictor(eviction_bytes(), lambda: probe().run())
    cache_probe = SharedCacheProbe()

    def handle(msg: tuple[Any, ...]) -> tuple[Any, ...]:
        op = msg[0]
        if op == "open":
            _, item_id, source, int_bounds, seed, slot = msg
            beacon.set(slot)
            t0 = time.perf_counter()
            try:
                if isinstance(source, tuple) and source[:1] == ("spool",):
                    # A large model the parent wrote at the start of one of its spool
                    # files, which it reuses once this request is answered.
                    with open(source[1], "rb") as f:
                        source = f.read(source[2])
                nbytes = source_nbytes(source)
                # With pool threads, the session is created on all the cores and this
                # thread goes back to cores[0], where the process pinning keeps it; the
                # flush mode set for the session stays for its rounds.
                with pinned(config.cores if config.intra_op_threads > 1 else None):
                    prep = prepare_session(source, config, fenv, seed=seed, int_bounds=int_bounds)
                bound, feeds, flushed = prep.bound, prep.feeds, prep.denormals_flushed
                warm_runs, run_s = _warm_up(bound, timed_runs, clock)
                info = {
                    "slot": slot,
                    "setup_s": time.perf_counter() - t0,
                    "warmup_runs": warm_runs + bound.bind_runs,
                    "run_s": run_s,
                    "held": held_bytes(),
                    "io_binding": bound.uses_iobinding,
                    "denormals_flushed": flushed,
                    "denormals_in": _fraction(feeds.values(), count_denormals),
                    "denormals_out": _fraction(bound.outputs().values(), count_denormals),
                }
                sessions[item_id] = _Session(bound, [np.asarray(a) for a in feeds.values()], slot, run_s, nbytes)
                return ("opened", item_id, info)
            except Exception as exc:  # a bad brick is that brick's failure, not the worker's
                text = str(exc) if isinstance(exc, DlbricksError) else f"{type(exc).__name__}: {exc}"
                return ("failed", item_id, text.splitlines()[0] if text else type(exc).__name__)
            finally:
                beacon.set(-1)
        elif op == "round":
            plan: list[tuple[str, int, bool]] = msg[1]
            read_cache = bool(msg[2]) if len(msg) > 2 else False
            out: dict[str, list[int]] = {item_id: [] for item_id, _, _ in plan}
            probes: dict[str, list[int]] = {item_id: [] for item_id, _, _ in plan}
            t0 = time.perf_counter()
            cold = []
            for item_id, k, warm in plan:
                s = sessions[item_id]
                if warm or config.cache_state == "warm":
                    beacon.set(s.slot)
                    discard = discarded_runs(s.run_s, s.nbytes, config.burst_s, evictor.nbytes)
                    # The probe's runs evict a short session's state from the core: its
                    # reading comes before the discarded runs. A long session's comes
                    # after them, next to the timed runs: a whole model's run outlasts
                    # many of the core's speed phases.
                    short = s.run_s < SHORT_RUN_S
                    if short:
                        speed.before(probes[item_id])
                    for _ in range(discard):
                        s.bound.run()
                    if not short:
                        speed.before(probes[item_id])
                    timed_runs(s.bound, k, out=out[item_id], clock=clock)
                else:
                    cold.append((s, k, out[item_id], probes[item_id]))
            # Pass j runs every cold session that wants more than j runs once, so two
            # runs of one session always have the others' runs between them.
            j = 0
            while cold:
                # Between two runs of a session: every other session's run, and the top-up.
                evictor.top_up(sum(s.nbytes for s, *_ in cold) - max(s.nbytes for s, *_ in cold))
                for s, _, times, readings in cold:
                    speed.before(readings)
                    beacon.set(s.slot)
                    _touch(s.inputs)
                    timed_runs(s.bound, 1, out=times, clock=clock)
                j += 1
                cold = [entry for entry in cold if entry[1] > j]
            beacon.set(-1)
            wall_s = time.perf_counter() - t0
            speed.take()  # the second reading of the round's last bursts, off its clock
            cache_reading = cache_probe.read() if read_cache else None
            return ("round", out, wall_s, {i: statistics.median(v) for i, v in probes.items() if v}, cache_reading)
        elif op == "pin":
            # To CPUs where sessions are built while no round runs, or home (None).
            try:
                pin_process(config if msg[1] is None else replace(config, cores=tuple(msg[1])))
            except DlbricksError as exc:  # e.g. a CPU taken offline since
                return ("failed", None, str(exc))
            return ("pinned",)
        elif op == "close":
            for item_id in msg[1]:
                sessions.pop(item_id, None)
            return ("closed", held_bytes())
        else:  # pragma: no cover - protocol error
            return ("error", f"unknown request {op!r}")

    serve_requests(conn, handle)


def main(argv: list[str]) -> int:
    # Ctrl-C reaches the whole process group; the parent decides what to do and
    # kills us, so a half-finished round is never reported as a result.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    read_fd, write_fd, beacon_path = int(argv[0]), int(argv[1]), argv[2]
    conn_in = Connection(read_fd, writable=False)
    conn_out = Connection(write_fd, readable=False)
    # A broken pipe, or the end of the parent's (before it sent this worker its
    # configuration, too): the parent is gone (killed, or ended while this worker
    # started), nobody is left to answer, and its user must not see a traceback of ours.
    with contextlib.suppress(BrokenPipeError, EOFError):
        serve(_Duplex(conn_in, conn_out), _Beacon(beacon_path))  # type: ignore[arg-type]
    # Told to stop, or the parent is gone (killed: it cannot remove the file itself).
    # The parent reads the beacon only after a worker died without getting here.
    with contextlib.suppress(OSError):
        os.unlink(beacon_path)
    return 0


class _Duplex:
    """Two one-way pipe connections as one (a pipe pair inherited by fd number)."""

    def __init__(self, rx: Connection, tx: Connection) -> None:
        self._rx, self._tx = rx, tx

    def recv(self) -> Any:
        return self._rx.recv()

    def send(self, obj: Any) -> None:
        self._tx.send(obj)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
