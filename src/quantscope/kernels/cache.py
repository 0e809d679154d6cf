"""Building a kernel library into the per-user cache: the compile flags, the compiler, the
cache key, and what the cache must be (complete, and the user's alone) before a library in
it is loaded. :func:`quantscope.kernels.load` loads what :func:`build` returns."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["FLAGS", "BuildError", "CacheError", "NoCompiler", "build", "cache_dir", "compiler"]

#: IEEE results as torch computes them: no contraction into FMA (-ffp-contract=off), no
#: fast-math (-fno-fast-math undoes a ``$CC`` of ``-Ofast`` / ``-ffast-math``: its words come
#: first); -fno-trapping-math only lets loops with selects vectorize (no kernel reads FP
#: exception flags, and no value changes).
FLAGS = ["-O3", "-march=native", "-fno-fast-math", "-ffp-contract=off", "-fno-trapping-math",
         "-pthread", "-shared", "-fPIC", "-std=gnu99"]


class CacheError(OSError):
    """The cache folder cannot be made or written (not a compiler or build problem)."""


class NoCompiler(FileNotFoundError):
    """No C compiler to build with: none on the PATH, or ``$CC`` names none."""


class BuildError(OSError):
    """The compiler ran, exited 0, and yet wrote no library."""


def cache_dir() -> Path:
    """Where built kernels are kept (per user)."""
    root = os.environ.get("QUANTSCOPE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "quantscope")
    return Path(root)


def compiler() -> list[str] | None:
    """The compiler command as an argument list: ``$CC`` split like a shell would split it
    (``"ccache gcc -m64"``), else ``cc`` or ``gcc`` on the PATH; None when ``$CC`` is unset
    and neither is there. :class:`NoCompiler` for a ``$CC`` that does not split (an
    unbalanced quote) or whose program is not there: the user chose that compiler, so
    another one is not quietly used instead (lib() warns and takes the torch path)."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        try:
            argv = shlex.split(cc)
        except ValueError as e:
            raise NoCompiler(f"$CC={cc!r} is no command line ({e})") from None
        exe = shutil.which(argv[0])
        if exe is None:
            where = "no executable file" if os.sep in argv[0] else "not found on the PATH"
            raise NoCompiler(f"$CC={cc!r}: {argv[0]!r} is {where}; $CC is used when set, "
                             "never cc or gcc in its place: fix or unset CC")
        return [exe, *argv[1:]]
    exe = shutil.which("cc") or shutil.which("gcc")
    return [exe] if exe else None


def _cpu_id() -> str:
    """The CPU model and feature flags (what ``-march=native`` compiles for)."""
    import platform

    ident = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    ident.append(line.strip())
                if len(ident) >= 3 and line.strip() == "":
                    break  # the first CPU is enough
    except OSError:
        pass
    return "\n".join(ident)


def _seal(target: Path) -> Path:
    """Where the build of ``target`` records its size and SHA-256."""
    return target.with_name(target.name + ".sha256")


def _digest(path: Path) -> str:
    data = path.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}"


def _intact(target: Path) -> bool:
    """Whether ``target`` is the complete file its build recorded (a missing record, as
    left by an older quantscope or a crash between the two renames, is not)."""
    try:
        return _seal(target).read_text() == _digest(target)
    except OSError:
        return False


def others_write(st: os.stat_result) -> bool:
    """Whether someone other than the owner can write: anyone, or a group other than the
    user's own private group (a umask of 002 makes every file group-writable): the user's
    gid, named as the user, with no members (accounts whose primary group it is are not
    listed as members: a shared primary group such as ``nogroup`` is told apart by name)."""
    if st.st_mode & 0o002:
        return True
    if not st.st_mode & 0o020:
        return False
    import grp
    import pwd

    try:
        group, me = grp.getgrgid(st.st_gid), pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return True
    return st.st_gid != os.getgid() or bool(group.gr_mem) or group.gr_name != me


def _check_private(path: Path, named: Path | None = None) -> None:
    """A :class:`CacheError` unless ``path`` (not a link) is the user's and no one else can
    write it: whoever can write the cache can make this process load their code. ``named``:
    the link that led to ``path``, named in the error too."""
    st = os.lstat(path)
    if st.st_uid != os.getuid() or others_write(st) or stat.S_ISLNK(st.st_mode):
        linked = named is not None and Path(os.path.abspath(named)) != path
        via = f" (where {str(named)!r} leads)" if linked else ""
        raise CacheError(f"will not load kernels from {str(path)!r}{via}: it is not yours alone "
                          f"(owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); set "
                          "QUANTSCOPE_CACHE to a folder only you can write")


def _cache_folder(folder: Path) -> Path:
    """The real path of the cache ``folder`` (made 0700 if missing); a :class:`CacheError`
    naming it if it cannot be made or others can write it. A link to a folder (anywhere in
    the path) is followed and the folder it leads to checked; the build writes and loads
    through that real path, so a link changed after the check is not followed."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise CacheError(f"cannot write its kernel cache folder {str(folder)!r} ({e}); "
                          "set QUANTSCOPE_CACHE to a writable folder") from e
    real = Path(os.path.realpath(folder))
    _check_private(real, folder)
    return real


#: A build's scratch folder; one a killed build left is removed once older than any build
#: can run (the compiler's timeout twice), never one a build still uses.
_SCRATCH, _BUILD_TIMEOUT = "quantscope-build-", 300


def _sweep(folder: Path) -> None:
    """Remove the scratch folders killed builds left in the cache ``folder``."""
    stale = time.time() - 2 * _BUILD_TIMEOUT
    for old in folder.glob(_SCRATCH + "*"):
        try:
            if not old.is_symlink() and old.is_dir() and old.stat().st_mtime < stale:
                shutil.rmtree(old)
        except OSError:  # another process swept it first, or it is not ours to remove
            pass


def _scratch(folder: Path) -> tempfile.TemporaryDirectory:
    """A temporary folder inside the cache ``folder`` (the same file system, so that
    ``os.replace`` from it is atomic); a :class:`CacheError` if it cannot be written."""
    _sweep(folder)
    try:
        return tempfile.TemporaryDirectory(dir=folder, prefix=_SCRATCH)
    except OSError as e:
        raise CacheError(f"cannot write its kernel cache folder {str(folder)!r} ({e}); "
                          "set QUANTSCOPE_CACHE to a writable folder") from e


#: a quoted include of a ``.c`` file, ``#  include "x.c"`` and indented ones too
_INCLUDED_SOURCE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+\.c)"', re.MULTILINE)


def _texts(source: Path, include: Path) -> list[bytes]:
    """What the build reads: ``source``, every header of ``include`` and the sources it
    includes by name, theirs too (tests build a kernel's own ``.c`` under other flags: a key
    without it served the library built from the old text). An include in a comment or an
    ``#if 0`` counts too: a key that changes more often than needed costs one build."""
    text = source.read_bytes()
    return ([text] + [h.read_bytes() for h in sorted(include.glob("*.h"))]
            + _included(source, text, include, {source.resolve()}))


def _included(path: Path, text: bytes, include: Path, seen: set) -> list[bytes]:
    """The texts of the ``.c`` files ``text`` (of ``path``) includes, each followed by those
    it includes; each file once (``seen``)."""
    out = []
    for name in sorted(set(_INCLUDED_SOURCE.findall(text))):
        # where the compiler looks for a quoted name: beside the including file first, then
        # -I (a name found in neither: the compiler says so)
        found = next((p for p in (path.parent / name.decode(), include / name.decode())
                      if p.is_file()), None)
        if found is None or found.resolve() in seen:
            continue
        seen.add(found.resolve())
        inner = found.read_bytes()
        out += [inner, *_included(found, inner, include, seen)]
    return out


def build(name: str, source: Path, cc: list[str], include: Path) -> Path:
    """The cached library built from ``source`` (built now unless cached and intact)."""
    key = hashlib.sha256(b"\0".join([*_texts(source, include),
                                      "\0".join([*FLAGS, *cc, _cpu_id()]).encode()]))
    target = _cache_folder(cache_dir()) / f"{name}-{key.hexdigest()[:16]}.so"
    if _intact(target):
        _check_private(target)
        return target
    with _scratch(target.parent) as tmp:
        out, seal = Path(tmp) / target.name, Path(tmp) / _seal(target).name
        subprocess.run([*cc, *FLAGS, f"-I{include}", str(source), "-o", str(out), "-lm"],
                       check=True, capture_output=True, text=True, timeout=_BUILD_TIMEOUT)
        if not out.is_file():  # exit 0 and no output: `CC="gcc -fsyntax-only"`, `CC=true`
            raise BuildError(f"the compiler wrote no library: {shlex.join(cc)} exited 0 "
                             f"without writing {out.name}")
        out.chmod(0o700)  # the user's alone, whatever the umask
        seal.write_text(_digest(out))
        os.replace(out, target)  # atomic: concurrent builders agree
        # the record last: a reader never trusts a library its record does not match (two
        # builders racing leave at worst a mismatch, which the next process rebuilds)
        os.replace(seal, _seal(target))
    return target
