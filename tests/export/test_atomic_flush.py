"""What quantscope writes is on the disk before a swap names it, and the swap after it
(exporters/atomic_swap.py, docs/SECURITY.md): every file of a new output folder and every
folder's entries ``fsync``-ed before the rename, the parent folder's entries after it. A file
system may write a rename before the data it names: without this a power loss after the swap
could find the previous output gone and the new one's files empty."""

from __future__ import annotations

import errno
import os

import pytest

from quantscope.exporters import atomic, atomic_swap

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"),
                                reason="names an fd by /proc")


def _record(monkeypatch, root):
    """The events of a write, paths relative to ``root``: ``("fsync", path)`` and
    ``("swap", new, target)`` (renameat2, or os.replace for a file)."""
    events, real_fsync, real_replace = [], os.fsync, os.replace
    real_rename2 = atomic._renameat2

    def rel(p):
        return os.path.relpath(p, root)

    def fsync(fd):
        events.append(("fsync", rel(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def renameat2(src, dst, flags):
        events.append(("swap", rel(src), rel(dst)))
        return real_rename2(src, dst, flags)

    def replace(src, dst):
        events.append(("swap", rel(src), rel(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(atomic, "_renameat2", renameat2)
    return events


def test_a_folder_is_on_the_disk_before_the_swap_and_its_name_after(tmp_path, monkeypatch):
    events = _record(monkeypatch, tmp_path)
    with atomic.atomic_dir(tmp_path / "out") as tmp:
        os.makedirs(os.path.join(tmp, "sub"))
        for name in ("a.json", "sub/b.safetensors"):
            with open(os.path.join(tmp, name), "w") as f:
                f.write("x")
        os.symlink("a.json", os.path.join(tmp, "link"))
        new = os.path.basename(tmp)
    (swap,) = [e for e in events if e[0] == "swap" and e[2] == "out"]  # (the marker's: inside)
    before, after = events[:events.index(swap)], events[events.index(swap) + 1:]
    assert swap[1:] == (new, "out")
    flushed = {e[1] for e in before if e[0] == "fsync"}
    marker_temp = {p for p in flushed if os.path.basename(p).startswith(f".{atomic.MARKER}.")}
    assert len(marker_temp) == 1  # the marker, before its rename (as in any folder: below)
    # every file (the marker too) and every folder's entries; a link is an entry, not data
    assert flushed - marker_temp == {f"{new}/a.json", f"{new}/sub/b.safetensors", f"{new}/sub", new,
                       f"{new}/{atomic.MARKER}"}
    assert after == [("fsync", ".")]  # the parent's entries: the rename itself


def test_a_file_is_on_the_disk_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    (tmp_path / "report.md").write_text("old")
    events = _record(monkeypatch, tmp_path)
    with atomic.atomic_file(tmp_path / "report.md") as tmp, open(tmp, "w") as f:
        f.write("new")
    name = os.path.basename(tmp)
    assert events[:3] == [("fsync", name), ("swap", name, "report.md"), ("fsync", ".")]
    assert (tmp_path / "report.md").read_text() == "new"


def test_a_report_added_to_an_output_folder_is_listed_on_the_disk(tmp_path, monkeypatch):
    """A plot redrawn into a compare run is listed in the run's marker: the new marker on
    the disk before its rename names it, the rename after (an empty or old marker after a
    power loss would leave the run refused for ``overwrite``, or the plot unlisted)."""
    with atomic.atomic_dir(tmp_path / "run") as tmp, open(os.path.join(tmp, "a.md"), "w") as f:
        f.write("x")
    events = _record(monkeypatch, tmp_path)
    with atomic.atomic_file(tmp_path / "run" / "hist.png") as tmp, open(tmp, "w") as f:
        f.write("png")
    marker = [e for e in events if e[0] == "swap" and e[2] == f"run/{atomic.MARKER}"]
    assert len(marker) == 1
    at = events.index(marker[0])
    assert events[at - 1] == ("fsync", marker[0][1]) and events[at + 1:] == [("fsync", "run")]
    assert atomic._listed(str(tmp_path / "run")) == {"a.md", "hist.png"}


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_the_folders_a_write_makes_are_named_on_the_disk_too(tmp_path, monkeypatch, kind):
    """An output whose parent folders the write made: after the swap, the entries of its
    parent and of every folder above a made one, innermost first (a power loss must not
    lose the new chain of folders and with it the output)."""
    events = _record(monkeypatch, tmp_path)
    write = atomic.atomic_dir if kind == "folder" else atomic.atomic_file
    with write(tmp_path / "a" / "b" / "out") as tmp:
        if kind == "file":
            with open(tmp, "w") as f:
                f.write("x")
    (swap,) = [e for e in events if e[0] == "swap" and e[2] == os.path.join("a", "b", "out")]
    after = events[events.index(swap) + 1:]
    assert after[:3] == [("fsync", "a/b"), ("fsync", "a"), ("fsync", ".")]


def test_a_write_that_cannot_reach_the_disk_fails_and_keeps_the_old_output(tmp_path,
                                                                           monkeypatch):
    with atomic.atomic_dir(tmp_path / "out") as tmp, open(os.path.join(tmp, "v"), "w") as f:
        f.write("old")

    def eio(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(OSError, match="Input/output"), \
            atomic.atomic_dir(tmp_path / "out", overwrite=True) as tmp, \
            open(os.path.join(tmp, "v"), "w") as f:
        f.write("new")
    assert (tmp_path / "out" / "v").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary left


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOTSUP])
def test_a_file_system_without_folder_fsync_still_writes(tmp_path, monkeypatch, code):
    """A folder's fsync refused as unsupported leaves its renames to the system; a file's
    refused the same way is an error (its data would not be on the disk)."""
    def refuse_folders(fd):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", refuse_folders)
    atomic_swap.flush_entries(str(tmp_path))
    (tmp_path / "f").write_text("x")
    atomic_swap.flush(str(tmp_path))

    def refuse(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", refuse)
    with pytest.raises(OSError):
        atomic_swap.flush(str(tmp_path / "f"))
