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

__all__ = ["FAKE_QUANT_C", "FLAGS", "QPARAMS_C", "THREADS_C", "cache_dir", "disabled", "load",
           "qparams_consts"]

#: IEEE results as torch computes them: no contraction into FMA (-ffp-contract=off), no
#: fast-math; -fno-trapping-math only lets loops with selects vectorize (no kernel reads
#: FP exception flags, and no value changes).
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-pthread",
         "-shared", "-fPIC", "-std=gnu99"]


#: C prelude of every kernel: ``qs_run_jobs`` runs a function over an array of per-thread
#: jobs on plain pthreads, joined before it returns (an OpenMP pool would keep spinning
#: after the call and slow down torch's own thread pool).
THREADS_C = r"""
#include <stddef.h>
#include <stdint.h>
#include <pthread.h>

#define QS_MAXT 64

/* fn on each of the `threads` jobs at `jobs` (`size` bytes apart): job 0 on the calling
   thread, the others on their own threads; a thread that cannot start has its job run
   here. Returns 1 if any fn returned non-NULL (the kernels' error signal), else 0. */
static int qs_run_jobs(void *(*fn)(void *), void *jobs, size_t size, int threads) {
    pthread_t tid[QS_MAXT];
    int started[QS_MAXT] = {0}, bad = 0;
    char *j = (char *)jobs;
    if (threads > QS_MAXT) threads = QS_MAXT;
    for (int t = 1; t < threads; ++t)
        started[t] = pthread_create(&tid[t], NULL, fn, j + t * size) == 0;
    bad |= fn(j) != NULL;
    for (int t = 1; t < threads; ++t) {
        void *r = NULL;
        if (started[t]) pthread_join(tid[t], &r);
        else r = fn(j + t * size);
        bad |= r != NULL;
    }
    return bad;
}
"""

#: C prelude of the kernels that price integer fake quantization (the MSE search, the
#: histogram error): the float32 steps of :func:`quantscope.quantize.fake_quantize_units`,
#: ``d = (clamp(nearbyint(x / s + z), qmin, qmax) - z) * s - x``, scalar (``dq1``) and as
#: one SIMD vector (``dqv``, ``VW`` lanes: AVX-512 or AVX2, with float64 helpers), written
#: once here so both kernels round alike (each tests itself against torch bitwise).
FAKE_QUANT_C = r"""
#include <stdint.h>
#include <math.h>
#include <pthread.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* d = (clamp(nearbyint(x / s + z), qmin, qmax) - z) * s - x, each float32 op rounded as
   the torch ops of fake_quantize_units round it (no contraction: -ffp-contract=off).
   With z == 0 the two zero-point ops are skipped: they change nothing but the sign of a
   zero, which the square drops. */
static inline float dq1(float v, float s, float z, float qmin, float qmax) {
    float t = v / s;
    t = t + z;
    t = nearbyintf(t);
    t = t > qmin ? t : qmin;
    t = t < qmax ? t : qmax;
    float d = (t - z) * s;
    return d - v;
}

#if defined(__AVX512F__)
#define VW 16
typedef __m512 vf;
static inline __attribute__((always_inline)) vf dqv(vf v, vf s, vf z, vf lo, vf hi, int zero) {
    vf t = _mm512_div_ps(v, s);
    if (!zero) t = _mm512_add_ps(t, z);
    t = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    t = _mm512_min_ps(_mm512_max_ps(t, lo), hi);
    if (!zero) t = _mm512_sub_ps(t, z);
    return _mm512_sub_ps(_mm512_mul_ps(t, s), v);
}
#define VSET1 _mm512_set1_ps
#define VADD _mm512_add_ps
#define VMUL _mm512_mul_ps
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
typedef __m512d vd;
#define DZERO _mm512_setzero_pd
#define DADD _mm512_add_pd
#define DMUL _mm512_mul_pd
#define DLOAD _mm512_loadu_pd
#define DLO(f) _mm512_cvtps_pd(_mm512_castps512_ps256(f))
#define DHI(f) _mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1))
#define DSUM _mm512_reduce_add_pd
#elif defined(__AVX2__)
#define VW 8
typedef __m256 vf;
static inline __attribute__((always_inline)) vf dqv(vf v, vf s, vf z, vf lo, vf hi, int zero) {
    vf t = _mm256_div_ps(v, s);
    if (!zero) t = _mm256_add_ps(t, z);
    t = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    t = _mm256_min_ps(_mm256_max_ps(t, lo), hi);
    if (!zero) t = _mm256_sub_ps(t, z);
    return _mm256_sub_ps(_mm256_mul_ps(t, s), v);
}
#define VSET1 _mm256_set1_ps
#define VADD _mm256_add_ps
#define VMUL _mm256_mul_ps
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
typedef __m256d vd;
#define DZERO _mm256_setzero_pd
#define DADD _mm256_add_pd
#define DMUL _mm256_mul_pd
#define DLOAD _mm256_loadu_pd
#define DLO(f) _mm256_cvtps_pd(_mm256_castps256_ps128(f))
#define DHI(f) _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1))
static inline double DSUM(vd a) {
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}
#endif

"""

#: C prelude of the kernels that search ranges (the histogram error's line search): the
#: integer branch of :func:`quantscope.qparams.qparams_from_range` with fp32 scales, the same
#: float32 steps in its order, so a kernel can price candidate ranges it generates itself
#: (tests compare it with qparams_from_range bitwise). ``q`` holds :func:`qparams_consts`.
QPARAMS_C = r"""
#include <math.h>
#include <float.h>

/* q: qmin, qmax, min_scale, symmetric (0 / 1), the symmetric zero point */
static inline void qs_qparams(float lo, float hi, const double *q, float *s, float *z) {
    const float qmin = (float)q[0], qmax = (float)q[1];
    lo = 0.0f < lo ? 0.0f : lo;                      /* lo.clamp(max=0) */
    hi = hi < 0.0f ? 0.0f : hi;                      /* hi.clamp(min=0) */
    float scale;
    if (q[3] != 0.0) {
        float amax = -lo < hi ? hi : -lo;            /* torch.maximum(-lo, hi) */
        scale = amax / ((qmax - qmin) / 2.0f);
    } else {
        scale = (hi - lo) / (qmax - qmin);
        if (!isfinite(scale)) scale = hi / (qmax - qmin) - lo / (qmax - qmin);
    }
    if (scale < (float)q[2]) scale = (float)q[2];    /* clamp(min=min_scale) */
    if (scale < 0x1p-149f) scale = 0x1p-149f;        /* encode_scale fp32: subnormal min */
    if (scale > FLT_MAX) scale = FLT_MAX;
    *s = scale;
    if (q[3] != 0.0) { *z = (float)q[4]; return; }
    float t = nearbyintf(qmin - lo / scale);
    *z = t < qmin ? qmin : (t > qmax ? qmax : t);
}
"""


def qparams_consts(spec) -> list[float] | None:
    """:data:`QPARAMS_C`'s constants for ``spec``, or None where it does not apply (float
    formats, scale encodings other than fp32): those price with qparams_from_range."""
    from .formats import IntFormat

    fmt = spec.format
    if not isinstance(fmt, IntFormat) or spec.scale.kind != "fp32":
        return None
    qmin, qmax = float(spec.qmin), float(spec.qmax)
    zsym = 0.0 if fmt.signed else float(int(qmin + qmax + 1) // 2)
    return [qmin, qmax, float(spec.min_scale), float(spec.symmetric), zsym]


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
