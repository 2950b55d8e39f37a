"""miniverl/atomic.py: what it publishes is whole or absent, whatever happens in the block."""

from __future__ import annotations

import os

import pytest

from miniverl.atomic import PARTIAL_SUFFIX, atomic_dir, atomic_write_text


def test_a_directory_appears_only_when_its_block_succeeds(tmp_path):
    out = tmp_path / "sub" / "out"
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("half")
        raise RuntimeError("killed mid-write")
    assert not out.exists() and list(out.parent.iterdir()) == []  # no partial sibling left either
    with atomic_dir(out, fsync=True) as tmp:
        assert tmp.name.endswith(PARTIAL_SUFFIX) and tmp.parent == out.parent
        (tmp / "a.txt").write_text("whole")
    assert (out / "a.txt").read_text() == "whole" and [p.name for p in out.parent.iterdir()] == ["out"]


def test_an_existing_directory_is_never_overwritten(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "theirs.txt").write_text("first")
    with pytest.raises(FileExistsError), atomic_dir(out) as tmp:
        (tmp / "ours.txt").write_text("second")
    with atomic_dir(out, keep_existing=True) as tmp:  # a second writer of the same thing: the first copy stays
        (tmp / "ours.txt").write_text("second")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in out.iterdir()] == ["theirs.txt"]


def test_a_file_is_replaced_in_one_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("old\n")
    atomic_write_text(path, "new\n")
    assert path.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # an ordinary file, not mkstemp's private 0600
