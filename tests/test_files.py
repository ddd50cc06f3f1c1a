"""write_atomically: every result file is written whole or not at all."""

from __future__ import annotations

import os

import pytest

from dlbricks.errors import UsageError
from dlbricks.files import write_atomically


def test_writes_text_as_utf8_and_bytes_as_given(tmp_path):
    write_atomically(tmp_path / "a.txt", "Größe ✓\n")
    write_atomically(str(tmp_path / "b.bin"), b"\x00\xff")
    assert (tmp_path / "a.txt").read_bytes() == "Größe ✓\n".encode()
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\xff"


def test_replaces_an_existing_file_and_creates_missing_folders(tmp_path):
    target = tmp_path / "x" / "y" / "r.json"
    write_atomically(target, "first")
    write_atomically(target, "second, longer")
    assert target.read_text() == "second, longer"
    assert os.listdir(target.parent) == ["r.json"]


def test_large_payloads_are_written_whole(tmp_path):
    data = bytes(range(256)) * 40_000  # 10 MB: more than one write() may take
    write_atomically(tmp_path / "big", data)
    assert (tmp_path / "big").read_bytes() == data


@pytest.mark.parametrize(("where", "cause"), [("f/x", "Not a directory"), ("d", "Is a directory")])
def test_failure_names_the_file_and_leaves_nothing_behind(tmp_path, where, cause):
    (tmp_path / "f").write_text("keep")
    (tmp_path / "d").mkdir()
    with pytest.raises(UsageError) as err:
        write_atomically(tmp_path / where, "data")
    assert str(err.value) == f"{tmp_path / where}: cannot write the file ({cause})"
    assert sorted(os.listdir(tmp_path)) == ["d", "f"]
    assert (tmp_path / "f").read_text() == "keep" and os.listdir(tmp_path / "d") == []
