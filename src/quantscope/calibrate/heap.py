"""Give the C heap's free memory back to the system between calibration steps.

glibc keeps freed memory in its heap; the many small allocations hooks and observers make
between a forward's large activations fragment it, so the resident set grows past what is
live (docs/memory.md, "The C heap"). ``malloc_trim(0)`` returns every free page (also
those inside the heap, by ``madvise``) and changes no setting of the process, unlike
``mallopt(M_MMAP_THRESHOLD)``. It is called after each calibration batch and at block
boundaries; ``QUANTSCOPE_MALLOC_TRIM=0`` in the environment turns it off. Elsewhere than
glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["trim"]

_trim = None
_looked = False


def _find():
    global _trim, _looked
    _looked = True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _trim = libc.malloc_trim
        _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        _trim = None


def trim() -> bool:
    """Return the heap's free pages to the system; False where off or not glibc."""
    if os.environ.get("QUANTSCOPE_MALLOC_TRIM", "1") == "0":
        return False
    if not _looked:
        _find()
    if _trim is None:
        return False
    _trim(0)
    return True
