"""Per-unit min and max: the one pass over the data every observer makes.

torch reduces a whole tensor (``torch.aminmax(x)``) in one vectorized read, but
per-row reductions are slower: ``torch.aminmax(u, dim=1)`` is not vectorized
(6-9x the whole-tensor time on CPU) and ``amin`` + ``amax`` read the data twice.
On CPU, for large contiguous float32 units, :func:`unit_minmax` therefore runs
a small C kernel (one read, both extremes, NaN propagated, threads over units),
compiled on first use with the system C compiler into a cache directory and
loaded through ctypes. Without a compiler, on other devices, for small inputs,
or with ``QUANTSCOPE_NO_KERNEL=1`` it uses torch; both give identical results
(tests compare them bitwise).
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

import torch

__all__ = ["kernel_available", "torch_unit_minmax", "unit_minmax"]

#: below this many elements torch's per-row reduction is as fast as a kernel call
KERNEL_MIN_NUMEL = 1 << 16

_SOURCE = r"""
#include <stdint.h>
#include <math.h>
#include <pthread.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* Min / max of rows [u0, u1) of a contiguous [U, E] float32 matrix; NaN propagates
   (tracked in a separate mask: the min / max instructions drop NaN). */
static void rows(const float *x, int64_t E, int64_t u0, int64_t u1, float *lo, float *hi) {
    for (int64_t u = u0; u < u1; ++u) {
        const float *r = x + u * E;
        float lo_ = INFINITY, hi_ = -INFINITY;
        int bad = 0;
        int64_t j = 0;
#ifdef __AVX2__
        if (E >= 8) {
            __m256 l = _mm256_set1_ps(INFINITY), h = _mm256_set1_ps(-INFINITY);
            __m256 n = _mm256_setzero_ps();
            __m256 l2 = l, h2 = h, n2 = n;
            for (; j + 16 <= E; j += 16) {
                __m256 a = _mm256_loadu_ps(r + j), b = _mm256_loadu_ps(r + j + 8);
                l = _mm256_min_ps(l, a); h = _mm256_max_ps(h, a);
                l2 = _mm256_min_ps(l2, b); h2 = _mm256_max_ps(h2, b);
                n = _mm256_or_ps(n, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
                n2 = _mm256_or_ps(n2, _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
            }
            for (; j + 8 <= E; j += 8) {
                __m256 a = _mm256_loadu_ps(r + j);
                l = _mm256_min_ps(l, a); h = _mm256_max_ps(h, a);
                n = _mm256_or_ps(n, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
            }
            l = _mm256_min_ps(l, l2); h = _mm256_max_ps(h, h2); n = _mm256_or_ps(n, n2);
            __m128 a = _mm_min_ps(_mm256_castps256_ps128(l), _mm256_extractf128_ps(l, 1));
            a = _mm_min_ps(a, _mm_movehl_ps(a, a));
            a = _mm_min_ss(a, _mm_shuffle_ps(a, a, 1));
            __m128 b = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            b = _mm_max_ps(b, _mm_movehl_ps(b, b));
            b = _mm_max_ss(b, _mm_shuffle_ps(b, b, 1));
            lo_ = _mm_cvtss_f32(a);
            hi_ = _mm_cvtss_f32(b);
            bad = _mm256_movemask_ps(n) != 0;
        }
#endif
        for (; j < E; ++j) {
            float v = r[j];
            lo_ = v < lo_ ? v : lo_;
            hi_ = v > hi_ ? v : hi_;
            bad |= v != v;
        }
        lo[u] = bad ? NAN : lo_;
        hi[u] = bad ? NAN : hi_;
    }
}

typedef struct { const float *x; int64_t E, u0, u1; float *lo, *hi; } job_t;

static void *run(void *p) {
    job_t *j = (job_t *)p;
    rows(j->x, j->E, j->u0, j->u1, j->lo, j->hi);
    return NULL;
}

/* Plain threads, joined before returning: an OpenMP pool would keep spinning after the
   call and slow down torch's own (separate) thread pool. */
void qs_unit_minmax(const float *x, int64_t U, int64_t E, float *lo, float *hi, int threads) {
    if (threads > 64) threads = 64;
    if (threads < 1) threads = 1;
    pthread_t tid[64];
    job_t jobs[64];
    int started[64] = {0};
    for (int t = 0; t < threads; ++t) {
        jobs[t] = (job_t){x, E, U * t / threads, U * (t + 1) / threads, lo, hi};
        if (t > 0) started[t] = pthread_create(&tid[t], NULL, run, &jobs[t]) == 0;
    }
    run(&jobs[0]);
    for (int t = 1; t < threads; ++t) {
        if (started[t]) pthread_join(tid[t], NULL);
        else run(&jobs[t]);  /* could not start a thread: do its share here */
    }
}
"""
_FLAGS = ["-O3", "-march=native", "-pthread", "-shared", "-fPIC", "-std=gnu99"]

_lib = None
_lib_tried = False
_lock = threading.Lock()


def _cache_dir() -> Path:
    root = os.environ.get("QUANTSCOPE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "quantscope")
    return Path(root)


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None or sys.platform == "win32":
        return None
    key = hashlib.sha256("\n".join([_SOURCE, *_FLAGS, cc, platform.machine(),
                                    platform.node()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"unit_minmax-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / "unit_minmax.c"
            src.write_text(_SOURCE)
            out = Path(tmp) / target.name
            subprocess.run([cc, *_FLAGS, str(src), "-o", str(out)], check=True,
                           capture_output=True, timeout=120)
            os.replace(out, target)  # atomic: concurrent builders agree
    lib = ctypes.CDLL(str(target))
    fn = lib.qs_unit_minmax
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int]
    return lib


def _kernel():
    global _lib, _lib_tried
    if _lib_tried:
        return _lib
    with _lock:
        if not _lib_tried:
            if os.environ.get("QUANTSCOPE_NO_KERNEL", "") not in ("", "0"):
                _lib = None
            else:
                try:
                    _lib = _build()
                except (OSError, subprocess.SubprocessError):
                    _lib = None
            _lib_tried = True
    return _lib


def kernel_available() -> bool:
    """Whether the compiled CPU kernel is in use (a C compiler was found and it built)."""
    return _kernel() is not None


def torch_unit_minmax(units: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of :func:`unit_minmax` (any device, any float dtype)."""
    if units.shape[0] == 1:  # a full reduction is much faster than one along a dim
        lo, hi = torch.aminmax(units)
        return lo.reshape(1), hi.reshape(1)
    return torch.aminmax(units, dim=1)


def unit_minmax(units: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of every row of ``units [U, E]`` as two ``[U]`` tensors (NaN propagates)."""
    U, E = units.shape
    if (units.device.type != "cpu" or units.dtype != torch.float32 or U < 2
            or units.numel() < KERNEL_MIN_NUMEL or not units.is_contiguous()
            or units.requires_grad):
        return torch_unit_minmax(units)
    lib = _kernel()
    if lib is None:
        return torch_unit_minmax(units)
    lo = torch.empty(U, dtype=torch.float32)
    hi = torch.empty(U, dtype=torch.float32)
    threads = max(1, min(torch.get_num_threads(), U))
    lib.qs_unit_minmax(units.data_ptr(), U, E, lo.data_ptr(), hi.data_ptr(), threads)
    return lo, hi
