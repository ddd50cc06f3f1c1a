"""CPU lists as Linux writes them (``0-3,6``): the one parser for ``--cores``,
``DLBRICKS_CORES``, ``-G`` ranges and the lists under ``/sys/devices/system/cpu``."""

from __future__ import annotations

import os

__all__ = ["ReversedRange", "numa_node_of", "parse_ranges", "usable_cpus"]


class ReversedRange(ValueError):
    """A range ``a-b`` of :func:`parse_ranges` with ``b < a`` (most likely a typo)."""


def parse_ranges(text: str) -> list[int]:
    """``0-3,6`` -> ``[0, 1, 2, 3, 6]``: comma-separated integers and inclusive ranges
    ``a-b``, sorted, without duplicates. Empty items are skipped; a single item may be
    negative (``-3``), so that callers can say why it is out of range.

    Raises:
        ReversedRange: a range ``a-b`` with ``b < a``.
        ValueError: an item is neither an integer nor a range of two.
    """
    out: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        dash = part.find("-", 1)  # from 1: a leading "-" is a sign
        if dash > 0:
            first, last = int(part[:dash]), int(part[dash + 1 :])
            if last < first:
                raise ReversedRange(f"the range {part} runs backwards")
            out.update(range(first, last + 1))
        else:
            out.add(int(part))
    return sorted(out)


def usable_cpus() -> list[int]:
    """The CPUs this process may run on, sorted (every CPU where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


_NODE_ROOT = "/sys/devices/system/node"


def numa_node_of(cpu: int, root: str = _NODE_ROOT) -> int:
    """The NUMA node of ``cpu`` (0 where the system does not say)."""
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        if not (name.startswith("node") and name[4:].isdigit()):
            continue
        try:
            with open(os.path.join(root, name, "cpulist")) as f:
                if cpu in parse_ranges(f.read()):
                    return int(name[4:])
        except (OSError, ValueError):
            continue
    return 0
