"""Scale out on Ray: parallel corpus analysis and a fleet of timing agents.

Ray (``pip install 'dlbricks[ray]'``) is optional; nothing here imports it until a
function is called, and the single-machine path never does.

Analysis (:func:`load_corpus_ray`): model files are parsed and digested by Ray tasks,
a chunk of paths per task. A task returns a :class:`ModelSketch` per model (name,
path, layer names and kinds, layer digests and slot-annotated edges: flat arrays, no
protobuf), which is everything the dedup, the ``analyze`` report and the choice of
bricks read, with the model's loader warnings and, when the fast path left it to the
full loader, why (a :class:`~dlbricks.loading.FastPathFallback`). The driver merges
them in path order, so the result is the local one, fallbacks included.

Benchmarking (:func:`bench_on_ray`): every Ray node that offers the custom resource
:data:`TIMING_RESOURCE` can host one timing *agent*, a Ray actor pinned to that node
that holds the resource for its lifetime. An agent reports its own system
fingerprint; agents with the same fingerprint id form one *system kind*. For each
kind the driver asks the store what is missing (no ok result for the brick digest,
digest version, that system id and the run's config key), and the agents of that
kind share those bricks. So one corpus can be benchmarked on several kinds of
machine at once, each brick once per kind, and a rerun measures only what is still
missing for each kind present.

Timing integrity: an agent measures one batch at a time (at most
:data:`~dlbricks.distributed.driver.BATCH` items): it generates each brick on its node
(loading the model from its path there, cached) and times the batch with the
measurement engine (:mod:`dlbricks.timing.engine`), as a local bench does, in a worker
process pinned to the node's cores; session set-up stays off the clock. The driver
keeps at most one batch in flight per agent, and since an agent holds the node's
timing slot, no other dlbricks run (or anything else asking for the slot) times on
that node at the same time. The agent also reserves as many Ray CPUs as it pins cores, so Ray does
not place its own tasks on their share. Start one timing slot per machine (or per
disjoint set of cores, with :data:`CORES_ENV` telling each node its cores).

Cores on a node: ``DLBRICKS_CORES`` (e.g. ``3`` or ``2-3``) in the environment of
``ray start`` names the node's CPUs to pin to; otherwise the run's cores are kept
when the node has them, else the node's last CPUs are used. The count of pinned
cores is the run's, so the config key is the same on every node.

Results stream back: the driver writes each one to the store as it arrives, so an
interrupted run loses only the bricks in flight and resumes like a local one.

Faults: when an agent's node dies (or the agent does), its brick in flight is put
back at the head of its system kind's queue and retried on another agent of that
kind, up to ``max_attempts`` tries in all; after that, or when no node of the kind
is left (and none joins within ``orphan_timeout_s``), it is stored as a failure
``not measured`` (reason ``lost``), which the next run retries. Nodes that join
during a run are used.

Every node needs dlbricks installed and the model files at the same paths (a shared
filesystem), as any Ray job reading files does.

Loopback-only clusters: Ray replaces ``127.0.0.1`` by the machine's outward address
unless the environment has ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (driver and head
node); ``tests/test_ray.py`` shows how to start a two-node cluster bound to
``127.0.0.1`` only.
"""

from __future__ import annotations

from dlbricks.distributed.agent import CORES_ENV, node_cores
from dlbricks.distributed.cluster import TIMING_RESOURCE, connect
from dlbricks.distributed.driver import RayBenchSummary, bench_on_ray
from dlbricks.distributed.sketches import (
    LayerSketch,
    ModelSketch,
    load_corpus_ray,
    sketch,
)

__all__ = [
    "CORES_ENV",
    "TIMING_RESOURCE",
    "LayerSketch",
    "ModelSketch",
    "RayBenchSummary",
    "bench_on_ray",
    "connect",
    "load_corpus_ray",
    "node_cores",
    "sketch",
]
