"""A failed first write leaves no empty folders behind (fault probe s35: the output's missing
parents were made before the write and kept after it failed)."""

import pytest

from quantscope.exporters import atomic


def _fail(cm):
    with pytest.raises(RuntimeError, match="mid-write"), cm as tmp:
        assert tmp
        raise RuntimeError("mid-write")


def test_a_failed_folder_write_removes_the_parents_it_made(tmp_path):
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "mine.txt").write_text("user")
    _fail(atomic.atomic_dir(tmp_path / "keep" / "a" / "b" / "out"))
    _fail(atomic.atomic_dir(tmp_path / "c" / "d" / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]
    assert sorted(p.name for p in (tmp_path / "keep").iterdir()) == ["mine.txt"]


def test_a_failed_file_write_removes_the_parents_it_made(tmp_path):
    _fail(atomic.atomic_file(tmp_path / "x" / "y" / "report.md"))
    assert list(tmp_path.iterdir()) == []


def test_a_write_that_succeeds_keeps_its_parents(tmp_path):
    with atomic.atomic_dir(tmp_path / "a" / "out") as tmp, open(f"{tmp}/f.txt", "w") as f:
        f.write("x")
    with atomic.atomic_file(tmp_path / "b" / "r.md") as tmp, open(tmp, "w") as f:
        f.write("y")
    assert (tmp_path / "a" / "out" / "f.txt").read_text() == "x"
    assert (tmp_path / "b" / "r.md").read_text() == "y"
