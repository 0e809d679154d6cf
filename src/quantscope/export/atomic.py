"""Atomic writes: build under a temporary name beside the target, rename into place.

Every folder or file quantscope writes (calibration folders, exports) goes through here, so
an interrupted or failed write leaves either the old target or nothing, never a folder that
looks complete. The temporary name lives in the target's own directory (a rename within one
file system is atomic) and starts with ``.`` so listings and globs pass it over.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

__all__ = ["atomic_dir", "atomic_file", "check_writable_target"]


def check_writable_target(path, *, overwrite: bool = False, kind: str = "folder") -> str:
    """Refuse early what would fail late: ``path`` exists (non-empty) without ``overwrite``,
    or its parent cannot be created or written. Returns the absolute path."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path):
        if kind == "folder" and not os.path.isdir(path):
            raise ValueError(f"output {path!r} exists and is not a folder")
        if kind == "file" and os.path.isdir(path):
            raise ValueError(f"output {path!r} is a folder; expected a file path")
        nonempty = os.path.isfile(path) or (os.path.isdir(path) and os.listdir(path))
        if nonempty and not overwrite:
            raise ValueError(f"output {path!r} exists and is not empty; pass overwrite=True "
                             f"(--overwrite) to replace it")
    parent = os.path.dirname(path)
    probe = parent
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"output {path!r}: {probe!r} is a file, not a folder")
    try:  # create a file there: os.access says yes to root even on read-only file systems
        fd, name = tempfile.mkstemp(prefix=".quantscope-probe.", dir=probe)
        os.close(fd)
        os.remove(name)
    except OSError as e:
        raise PermissionError(f"output {path!r}: {probe!r} is not writable ({e.strerror})"
                              ) from None
    return path


@contextlib.contextmanager
def atomic_dir(path, *, overwrite: bool = False):
    """Yield a fresh temporary folder; on success it replaces ``path``, on error it is removed.

    ``with atomic_dir(out) as tmp: write files into tmp``.
    """
    path = check_writable_target(path, overwrite=overwrite)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)
    try:
        yield tmp
        old = None
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".old",
                                   dir=parent)
            os.rmdir(old)
            os.rename(path, old)
        os.rename(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(path, *, overwrite: bool = True):
    """Yield a temporary file path beside ``path``; on success it replaces ``path``."""
    path = check_writable_target(path, overwrite=overwrite, kind="file")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
