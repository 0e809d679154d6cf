"""The fallback swap (no ``renameat2``: the old output moved aside into ``.NAME.XXXX.old/x``,
the new one renamed in, under a lock on the parent): a swap interrupted or failed between its
renames keeps the old output (docs/SECURITY.md: "an interrupted or failed write leaves the
previous content intact"), and no old copy is ever left hidden beside the output."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from quantscope.exporters import atomic


def _write(out: Path, text: str, overwrite: bool = False) -> None:
    with atomic.atomic_dir(out, overwrite=overwrite) as t:
        Path(t, "a.txt").write_text(text)


def _renames(monkeypatch, fail_at=(), after=None, refuse_existing=False):
    """``os.rename`` counted: the calls numbered in ``fail_at`` raise what ``fail_at`` maps
    them to; ``after(n)`` runs after the n-th done; ``refuse_existing``: Windows' rename."""
    real, calls = os.rename, []

    def rename(src, dst):
        calls.append((src, dst))
        if len(calls) in fail_at:
            raise fail_at[len(calls)]
        if refuse_existing and os.path.lexists(dst):
            raise FileExistsError(17, "File exists", dst)
        real(src, dst)
        if after is not None:
            after(len(calls))

    monkeypatch.setattr(os, "rename", rename)
    return calls


@pytest.fixture
def fallback(monkeypatch):
    """No atomic exchange: the swap the systems without ``renameat2`` take."""
    monkeypatch.setattr(atomic, "_renameat2", lambda *a: False)


@pytest.mark.parametrize("error", [KeyboardInterrupt("Ctrl-C"), OSError(5, "I/O error")])
def test_an_interrupted_swap_puts_the_old_output_back(tmp_path, monkeypatch, fallback, error):
    out = tmp_path / "out"
    _write(out, "OLD")
    calls = _renames(monkeypatch, fail_at={2: error})  # 1: path -> .old/x, 2: tmp -> path
    with pytest.raises(type(error)):
        _write(out, "NEW", overwrite=True)
    monkeypatch.undo()
    assert calls[0][0] == str(out) and calls[1][1] == str(out)  # interrupted where meant
    assert (out / "a.txt").read_text() == "OLD"
    assert os.listdir(tmp_path) == ["out"]  # no .old folder, no temporary
    assert atomic.written_by_quantscope(out)  # still replaceable: the marker came back too


@pytest.mark.parametrize("error", [KeyboardInterrupt("Ctrl-C"), OSError(5, "I/O error")])
def test_a_swap_failing_after_the_new_output_is_in_deletes_the_old(tmp_path, monkeypatch,
                                                                   fallback, error):
    """Once the new output is renamed in the write has taken effect: a failure to move the
    old one aside is no failed write (it raised, saying the save failed; session 35), and a
    Ctrl-C stops the program with the new output in place."""
    out = tmp_path / "out"
    _write(out, "OLD")
    _renames(monkeypatch, fail_at={3: error})  # 3: .old/x -> tmp
    if isinstance(error, OSError):
        _write(out, "NEW", overwrite=True)
    else:
        with pytest.raises(KeyboardInterrupt):
            _write(out, "NEW", overwrite=True)
    monkeypatch.undo()
    assert (out / "a.txt").read_text() == "NEW"  # the new one is whole in place
    assert os.listdir(tmp_path) == ["out"]  # the superseded old one deleted, not hidden


def test_an_old_output_that_cannot_go_back_is_named(tmp_path, monkeypatch, fallback):
    out = tmp_path / "out"
    _write(out, "OLD")
    _renames(monkeypatch, fail_at={2: OSError(5, "I/O error"), 3: OSError(5, "I/O error")})
    with pytest.warns(RuntimeWarning, match="rename it back yourself") as seen, \
            pytest.raises(OSError):
        _write(out, "NEW", overwrite=True)
    monkeypatch.undo()
    old = [n for n in os.listdir(tmp_path) if n.endswith(".old")]
    assert len(old) == 1 and old[0].startswith(".out.")
    aside = tmp_path / old[0] / "x"
    assert (aside / "a.txt").read_text() == "OLD"
    assert str(aside) in str(seen[0].message)  # where the previous output is, told


def test_another_writer_between_the_renames_leaves_no_hidden_old_copy(tmp_path, monkeypatch,
                                                                      fallback):
    """No ``fcntl`` (Windows: no lock) and a rename refusing an existing target: another
    writer's output lands between ``path -> .old/x`` and ``tmp -> path``; the swap retries."""
    monkeypatch.setitem(sys.modules, "fcntl", None)  # `import fcntl` raises ImportError
    out = tmp_path / "out"
    _write(out, "OLD")

    def other_writer(n):
        if n == 1:  # a complete output of another quantscope writer, marker and all
            out.mkdir()
            (out / "a.txt").write_text("OTHER")
            atomic._write_marker(str(out), ["a.txt"])

    calls = _renames(monkeypatch, after=other_writer, refuse_existing=True)
    _write(out, "NEW", overwrite=True)
    monkeypatch.undo()
    assert (out / "a.txt").read_text() == "NEW"  # the last complete write wins
    assert os.listdir(tmp_path) == ["out"]  # neither OLD nor OTHER left hidden
    assert len(calls) == 5  # aside, refused, then a whole swap of OTHER: aside, in, out


def test_the_swap_names_stay_importable_from_atomic():
    from quantscope.exporters import atomic_swap

    assert atomic._renameat2 is atomic_swap._renameat2
    assert atomic._parent_lock is atomic_swap._parent_lock
    assert atomic._RENAME_EXCHANGE == 2  # renameat2's RENAME_EXCHANGE (linux/fs.h)
