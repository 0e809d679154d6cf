"""Small C kernels, compiled on first use and loaded through ctypes.

A few inner loops (per-row min / max, histogram binning, quantization-error sums)
are much faster as a plain C loop over the data than as a chain of torch ops,
because the chain reads and writes the data once per op. Each kernel module keeps
its C source beside the torch reference it must equal (tests compare them
bitwise) and calls :func:`load`, which builds the source with the system C
compiler (``$CC``, else ``cc`` / ``gcc``) into a cache directory
(``$QUANTSCOPE_CACHE``, else ``~/.cache/quantscope``), keyed by a hash of the
source, the flags and the machine. Without a compiler, on Windows, when the
build fails, or with ``QUANTSCOPE_NO_KERNEL=1``, :func:`load` returns None and
callers use their torch path.

The flags forbid floating-point contraction (``-ffp-contract=off``) so that
every ``a * b + c`` rounds twice, as the torch ops it mirrors do.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

__all__ = ["FLAGS", "cache_dir", "disabled", "load"]

FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-pthread", "-shared", "-fPIC",
         "-std=gnu99"]

_libs: dict[str, ctypes.CDLL | None] = {}
_lock = threading.Lock()


def cache_dir() -> Path:
    """Where built kernels are kept."""
    root = os.environ.get("QUANTSCOPE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "quantscope")
    return Path(root)


def disabled() -> bool:
    """Whether ``QUANTSCOPE_NO_KERNEL`` turns every kernel off."""
    return os.environ.get("QUANTSCOPE_NO_KERNEL", "") not in ("", "0")


def _build(name: str, source: str) -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None or sys.platform == "win32":
        return None
    key = hashlib.sha256("\n".join([source, *FLAGS, cc, platform.machine(),
                                    platform.node()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / f"{name}.c"
            src.write_text(source)
            out = Path(tmp) / target.name
            subprocess.run([cc, *FLAGS, str(src), "-o", str(out), "-lm"], check=True,
                           capture_output=True, timeout=120)
            os.replace(out, target)  # atomic: concurrent builders agree
    return ctypes.CDLL(str(target))


def load(name: str, source: str, argtypes: dict[str, list]) -> ctypes.CDLL | None:
    """The library built from ``source`` (once per process), its functions typed by
    ``argtypes`` (``{function: [ctypes types]}``, all returning ``int64``); None when no
    kernel can be used (see the module doc)."""
    if name in _libs:
        return _libs[name]
    with _lock:
        if name not in _libs:
            lib = None
            if not disabled():
                try:
                    lib = _build(name, source)
                except (OSError, subprocess.SubprocessError):
                    lib = None
            if lib is not None:
                for fn, types in argtypes.items():
                    f = getattr(lib, fn)
                    f.restype = ctypes.c_int64
                    f.argtypes = types
            _libs[name] = lib
    return _libs[name]
