"""The one CPU-list parser (``0-3,6``) behind --cores, DLBRICKS_CORES, -G and /sys lists."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlbricks.cpuset import parse_ranges, usable_cpus


def test_ranges_and_singles_expand_sorted_without_duplicates():
    assert parse_ranges("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_ranges(" 6, 2-3 ,2,, ") == [2, 3, 6]
    assert parse_ranges("") == []


def test_a_leading_minus_is_a_sign():
    assert parse_ranges("-3") == [-3]


@pytest.mark.parametrize("bad", ["a", "1-", "1-2-3", "x-2", "1.5"])
def test_malformed_items_raise_value_error(bad):
    with pytest.raises(ValueError):
        parse_ranges(bad)


@settings(deadline=None, max_examples=50)
@given(st.sets(st.integers(0, 64), max_size=20))
def test_the_linux_form_of_a_set_parses_back_to_it(cpus):
    items, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
        else:
            if run:
                items.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = [c]
    if run:
        items.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    assert parse_ranges(",".join(items)) == sorted(cpus)


def test_usable_cpus_are_sorted_and_not_empty():
    cpus = usable_cpus()
    assert cpus and cpus == sorted(set(cpus))


def test_the_numa_node_of_a_cpu_comes_from_sysfs(tmp_path):
    from dlbricks.cpuset import numa_node_of

    for node, cpus in ((0, "0-3"), (1, "4-7,12")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-1\n")
    assert [numa_node_of(c, str(tmp_path)) for c in (0, 3, 4, 12)] == [0, 0, 1, 1]
    assert numa_node_of(99, str(tmp_path)) == 0  # not listed: node 0
    assert numa_node_of(1, str(tmp_path / "absent")) == 0
