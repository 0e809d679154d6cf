"""The swap of :mod:`quantscope.exporters.atomic`: a complete temporary folder put at the
output path, the old output left at the temporary's name for the caller to remove.

On Linux one ``renameat2`` call exchanges the two names (the output never absent). Where
it is missing (another system, a file system without it) the old output is moved aside
into ``.NAME.XXXXXXXX.old/x``, the new one renamed in, the old one moved to the
temporary's name, under an exclusive lock on the parent folder (none without ``fcntl``:
Windows, whose rename refuses an existing target). A swap that fails or is interrupted
between those renames puts the old output back (or, superseded, deletes it): never lost,
never left hidden. Only a kill at that instant (nothing can run) leaves it in the ``.old``
folder (docs/SECURITY.md names the recovery).

Before a swap names the new output it is on the disk (:func:`flush`), and the rename is
after it (:func:`flush_entries`): file systems may write a rename before the data it names,
so a power loss after the swap could otherwise find the old output gone and the new one's
files empty.

A reader of such a folder reads it with :func:`read_unchanged`, so a swap while it reads
cannot give it files of two versions.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import os
import shutil
import tempfile
import warnings

__all__ = ["flush", "flush_entries", "read_unchanged", "swap_in"]

_RETRIES = 100  # swaps lost to other writers before giving up (each loss is another's win)
_READ_RETRIES = 5  # versions replaced under a reader (read_unchanged) before it gives up
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2  # renameat2's flags


def _renameat2(src: str, dst: str, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False where the system or file system lacks it."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), dst)


@contextlib.contextmanager
def _parent_lock(parent: str):
    """An exclusive lock on the parent folder, for the swap where no atomic exchange exists."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock (its rename refuses an existing target anyway)
        yield
        return
    fd = os.open(parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def flush(top: str) -> None:
    """``fsync`` the file ``top``, or every file under the folder ``top`` and every folder's
    entries (links are names, not data: their folder's entries hold them)."""
    if not os.path.isdir(top) or os.path.islink(top):
        _fsync(top)
        return
    for root, _, files in os.walk(top):
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                _fsync(p)
        flush_entries(root)


def flush_entries(folder: str) -> None:
    """``fsync`` the folder's entries (a rename in it). Where a folder cannot be opened or
    synced (Windows; a file system that takes no folder fsync) its renames are the system's
    to keep."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)  # (not for writing: a file copied in may be read-only)
    try:
        os.fsync(fd)
    except OSError as e:  # Windows flushes only handles open for writing: left to its cache
        if e.errno != errno.EBADF:
            raise
    finally:
        os.close(fd)


def swap_in(tmp: str, path: str, check, prefix: str, renameat2=_renameat2) -> None:
    """Put ``tmp`` at ``path``; the old ``path`` ends at ``tmp`` (removed by the caller).
    ``check()`` refuses an existing ``path`` that may not be replaced (another writer's may
    have come meanwhile); ``prefix``: the ``.old`` folder's; ``renameat2``: as
    :func:`_renameat2` (the caller passes its own name for it, which tests replace)."""
    for _ in range(_RETRIES):
        try:
            if not os.path.lexists(path):
                if renameat2(tmp, path, _RENAME_NOREPLACE):
                    return
                return _swap_locked(tmp, path, check, prefix)
            check()
            if renameat2(tmp, path, _RENAME_EXCHANGE):
                return
            return _swap_locked(tmp, path, check, prefix)
        except FileExistsError:
            continue  # another writer created it meanwhile: it is there now, exchange
        except FileNotFoundError:
            continue  # another writer (without the exchange) moved it aside: create it
    raise RuntimeError(f"output {path!r}: other processes replaced it {_RETRIES} times while "
                       f"this one tried to; write one output from one process at a time")


def _swap_locked(tmp: str, path: str, check, prefix: str) -> None:
    parent = os.path.dirname(path)
    with _parent_lock(parent):
        if not os.path.lexists(path):
            os.rename(tmp, path)
            return
        check()
        old = tempfile.mkdtemp(prefix=prefix, suffix=".old", dir=parent)
        try:
            os.rename(path, os.path.join(old, "x"))
            os.rename(tmp, path)
        except BaseException:  # Ctrl-C, an OSError, another writer's output (no lock)
            _undo(old, path)
            raise
        try:  # done: the old output goes to tmp, which the caller removes outside the lock
            os.rename(os.path.join(old, "x"), tmp)
            os.rmdir(old)
        except BaseException as e:  # (a failure here is no failed write: removed here)
            _remove(old)
            if not isinstance(e, OSError):
                raise  # Ctrl-C: stop, the new output in place


def _undo(old: str, path: str) -> None:
    """After a failed or interrupted swap: the old output moved aside into ``old`` goes back
    to ``path`` where that is free (the new one never arrived); else it is superseded (the
    new output, or another writer's, is there) and deleted, as a whole swap would have."""
    aside = os.path.join(old, "x")
    if os.path.lexists(aside) and not os.path.lexists(path):
        try:
            os.rename(aside, path)
        except OSError as e:
            warnings.warn(f"quantscope could not put the previous output back at {path!r} "
                          f"({e.strerror}): it is at {aside!r}; rename it back yourself",
                          RuntimeWarning, stacklevel=4)
            return
    _remove(old)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):  # never a hidden copy left without a word
            warnings.warn(f"quantscope could not remove its temporary folder {path!r} (the "
                          f"replaced or unfinished output): remove it yourself",
                          RuntimeWarning, stacklevel=3)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def read_unchanged(folder: str, who: str, read):
    """``read()`` (which reads files of ``folder`` by path), from one version of the folder.

    A writer's :func:`swap_in` puts a new folder (another inode) at the path: a ``read``
    during which the path's folder stayed the same read one version, not some files of each.
    One during which it changed runs again (an error it raised too, which files of two
    versions may cause), up to :data:`_READ_RETRIES` times."""
    for attempt in itertools.count(1):
        before = _identity(folder)
        try:
            result = read()
        except Exception:
            if _identity(folder) == before:
                raise
        else:
            if _identity(folder) == before:
                return result
        if attempt == _READ_RETRIES:
            raise RuntimeError(f"{who}: {folder} was replaced {attempt} times while this "
                               f"process read it; read it when no process writes it")


def _identity(folder: str):
    try:
        st = os.stat(folder)
    except FileNotFoundError:  # between the renames of a swap without renameat2
        return None
    return st.st_dev, st.st_ino
