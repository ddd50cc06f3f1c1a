"""The core called from several threads at once gives the same results as alone.

The bindings release the GIL around the C++ work (boost-histogram's threaded fill
test is the model), so these calls really overlap; they share no state, so results
must not depend on it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dlbricks import Corpus, Graph, split

N_THREADS = 4


def random_corpus(n_models: int, seed: int) -> list[Graph]:
    """Models of 40-80 layers from 12 kinds: chains with skip edges, nodes shuffled."""
    rng = np.random.default_rng(seed)
    vocab = rng.integers(0, 256, size=(12, 16), dtype=np.uint8)
    graphs = []
    for _ in range(n_models):
        n = int(rng.integers(40, 81))
        dst = np.arange(1, n)
        src = dst - 1
        skip_dst = np.flatnonzero(rng.random(n) < 0.15)
        skip_dst = skip_dst[skip_dst >= 2]
        skip_src = skip_dst - rng.integers(2, 6, size=skip_dst.size).clip(max=skip_dst)
        perm = rng.permutation(n).astype(np.int32)  # unsorted node lists take the heap path
        graphs.append(
            Graph(
                vocab[rng.integers(0, 12, size=n)],
                perm[np.concatenate([src, skip_src])],
                perm[np.concatenate([dst, skip_dst])],
                rng.integers(0, 2, size=src.size + skip_src.size).astype(np.int32),
                np.concatenate([np.zeros(src.size, np.int32), np.ones(skip_dst.size, np.int32)]),
            )
        )
    return graphs


def corpus_result(graphs: list[Graph]) -> dict[str, list]:
    corpus = Corpus(graphs)
    out: dict[str, list] = {"layer_ids": corpus.layer_ids.tolist(), "jaccard": corpus.jaccard().tolist()}
    for G in (1, 2, 3, 5):
        cs = corpus.split(G)
        out[f"G{G}"] = [
            cs.seq_model_offsets.tolist(),
            cs.seq_offsets.tolist(),
            cs.seq_members.tolist(),
            cs.seq_ids.tolist(),
            cs.unique_digests.tobytes(),
            cs.unique_first.tolist(),
        ]
    out["splits"] = [split(g, 3).digests.tobytes() for g in graphs[:50]]
    return out


def test_concurrent_corpus_dedup_gives_identical_results() -> None:
    graphs = random_corpus(300, seed=7)
    expected = corpus_result(graphs)
    start = threading.Barrier(N_THREADS)

    def work(_: int) -> list[dict[str, list]]:
        start.wait()
        return [corpus_result(graphs) for _ in range(3)]

    with ThreadPoolExecutor(N_THREADS) as pool:
        results = [r for rs in pool.map(work, range(N_THREADS)) for r in rs]
    assert len(results) == 3 * N_THREADS
    for r in results:
        assert r == expected


def test_different_corpora_in_parallel_match_their_sequential_results() -> None:
    corpora = [random_corpus(120, seed=s) for s in range(N_THREADS)]
    expected = [corpus_result(c) for c in corpora]
    with ThreadPoolExecutor(N_THREADS) as pool:
        got = list(pool.map(corpus_result, corpora))
    assert got == expected
    assert expected[0] != expected[1]  # the corpora differ, so a mix-up would show


def test_dedup_releases_the_gil() -> None:
    # While one thread is inside the core, a pure-Python thread must keep running.
    # If the GIL were held, the ticker could not record any time inside the call
    # (checked by hand: list.sort() of 2e6 floats, which holds it, gives no tick).
    corpus = Corpus(random_corpus(3000, seed=11))
    ticks: list[float] = []
    done = threading.Event()

    def ticker() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        time.sleep(0.01)
        t0 = time.perf_counter()
        corpus.split(3)
        t1 = time.perf_counter()
    finally:
        done.set()
        thread.join()
    # Only the middle half counts: around the call the ticker may legitimately run
    # for a switch interval (5 ms) while the caller is still in Python.
    quarter = (t1 - t0) / 4
    inside = [t for t in ticks if t0 + quarter < t < t1 - quarter]
    assert inside, f"no Python progress during the middle of a {1e3 * (t1 - t0):.1f} ms core call"
