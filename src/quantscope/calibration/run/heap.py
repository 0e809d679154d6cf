"""Keep the C heap near what is live during calibration (glibc; elsewhere a no-op).

glibc serves allocations below its mmap threshold from its heap, and the threshold rises
(up to 32 MB) each time a larger mmapped block is freed; the many small allocations hooks
and observers make between a forward's large activations then pin the heap's top, so it
grows past what is live (docs/memory.md, "The C heap"): freed weights and activations stay
counted in the resident set and in the process's data size (which ``RLIMIT_DATA`` limits).

- :func:`prepare` (called when calibration starts) fixes ``M_MMAP_THRESHOLD`` at 1 MiB:
  every tensor of a MiB or more is mmapped and unmapped when freed. This is a setting of
  the whole process and stays after calibration (glibc cannot go back to the dynamic
  threshold); it is what ``MALLOC_MMAP_THRESHOLD_=1048576`` in the environment does.
- :func:`trim` (after each calibration batch of a model on the CPU, :func:`runs_on_host`,
  and each sequential block) runs ``malloc_trim(0)``: free pages inside the heap go back to
  the system. It changes no setting; it walks the whole heap (about 10 ms on a fragmented
  GB), so a model on a GPU, whose activations never reach the host heap, skips it.

``QUANTSCOPE_HEAP=0`` in the environment turns both off.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from ..._checks import env_flag

__all__ = ["MMAP_THRESHOLD", "prepare", "runs_on_host", "trim"]

#: allocations of at least this many bytes are mmapped once :func:`prepare` ran
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD = -3, -1  # glibc's mallopt parameter numbers
_libc = None
_looked = False
_prepared = False


def _glibc():
    global _libc, _looked
    if not _looked:
        _looked = True
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            lib.malloc_trim.argtypes, lib.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
            lib.mallopt.argtypes, lib.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _libc = lib
        except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
            _libc = None
    return _libc


def _on() -> bool:
    return env_flag("QUANTSCOPE_HEAP", True)


def prepare() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` (once per process); False where
    off or not glibc."""
    global _prepared
    lib = _glibc() if _on() else None
    if lib is None:
        return False
    if not _prepared:
        _prepared = bool(lib.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return _prepared


def runs_on_host(model) -> bool:
    """Whether ``model``'s forward may put its activations on the host heap: a parameter or
    buffer on the CPU, or none at all (a module of no state computes where its inputs are)."""
    tensors = [*model.parameters(), *model.buffers()]
    return not tensors or any(t.device.type == "cpu" for t in tensors)


def trim() -> bool:
    """Return the heap's free pages to the system; False where off or not glibc."""
    lib = _glibc() if _on() else None
    if lib is None:
        return False
    lib.malloc_trim(0)
    return True
