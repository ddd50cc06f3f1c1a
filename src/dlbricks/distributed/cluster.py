"""Connecting to Ray, and the version check that keeps every node's digests equal to the driver's."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Iterator, Mapping

from dlbricks.errors import DlbricksError, UsageError

#: Custom Ray resource a node offers to host one timing agent (one brick at a time).
TIMING_RESOURCE = "dlbricks_timing_slot"


def ray_module() -> Any:
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray: pip install 'dlbricks[ray]'") from None
    return ray


def _check_reachable(address: str | None) -> None:
    """Fail fast on a ``host:port`` nobody listens on (Ray would retry for minutes)."""
    import socket

    if not address or address in ("auto", "local") or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise UsageError(f"--ray {address!r}: expected host:port, auto, local or ray://host:port")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5.0).close()
    except OSError as exc:
        raise DlbricksError(f"no Ray head node answers at {address}: {exc}") from None


@contextlib.contextmanager
def connect(address: str | None = "auto", *, namespace: str = "dlbricks") -> Iterator[Any]:
    """Connect this process to a Ray cluster for the duration of the block.

    Args:
        address: ``"auto"`` (the cluster this machine belongs to), ``"host:port"`` of
            a head node, ``"ray://..."``, or ``"local"`` (start a private one-node
            cluster offering one timing slot). If Ray is already initialised in this
            process it is used as is.
        namespace: the Ray namespace of the job.

    Yields:
        the ``ray`` module.

    Raises:
        UsageError: Ray is not installed, or a malformed address.
        DlbricksError: the cluster cannot be reached.
    """
    ray = ray_module()
    if ray.is_initialized():
        yield ray
        return
    _check_reachable(address)
    extra: dict[str, Any] = {}
    if address == "local":
        extra = {"resources": {TIMING_RESOURCE: 1}, "include_dashboard": False}
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.WARNING, **extra)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise DlbricksError(f"cannot connect to Ray at {address!r}: {exc}") from None
    # Ray's driver prints cluster events ("node ... marked dead") on stdout, which
    # holds dlbricks' results: while connected, and while shutting down (when Ray
    # flushes the events it held back to dedup them), they go to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            yield ray
        finally:
            ray.shutdown()


def dlbricks_versions() -> dict[str, Any]:
    """What must match between the driver and a node for digests to mean the same."""
    from dlbricks import __version__
    from dlbricks.versions import brick_digest_version, model_digest_version

    return {"dlbricks": __version__, "brick_digest": brick_digest_version(), "model_digest": model_digest_version()}


def check_versions(theirs: Mapping[str, Any], where: str) -> None:
    ours = dlbricks_versions()
    if dict(theirs) != ours:
        raise DlbricksError(f"{where} runs {dict(theirs)}, the driver {ours}: install the same dlbricks everywhere")
