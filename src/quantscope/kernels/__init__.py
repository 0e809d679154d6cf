"""The C kernels: real source files (``csrc/*.c``, shared ``csrc/*.h``), built and loaded here.

A few inner loops (per-row min / max, histogram binning, quantization-error sums, the MSE
search, the L2 and entropy searches) are much faster as a plain C loop over the data than
as a chain of torch ops, which reads and writes the data once per op. Their sources ship as
package data; :func:`lib` builds one with the system C compiler on first use (``$CC``,
parsed like a shell word list, so ``CC="ccache gcc"`` works, and never replaced by another
when its program is missing; else ``cc`` / ``gcc``) into a per-user cache
(``$QUANTSCOPE_CACHE``, else ``$XDG_CACHE_HOME/quantscope``; a link is followed to the
folder it leads to, which must be the user's alone), keyed by a hash of the sources, the
flags, the compiler command and the CPU (model and feature flags: ``-march=native`` code is
only reused on the same kind of CPU; :mod:`.cache` builds), and loads it with ctypes.

Who decides what: ``stats/`` and ``estimators/`` choose whether a kernel applies (device,
dtype, size) and keep the torch reference it must equal bit for bit (the tests compare
them); this package only builds, loads and types the libraries (:data:`SIGNATURES`, the one
declaration of every exported function).

No kernel (the callers use their torch path): ``QUANTSCOPE_NO_KERNEL=1``, Windows, no
compiler (or a ``$CC`` naming none), a cache folder that is unwritable or that others can
write, or a failed build (a compiler error, or no library written). These are said once per
process (a :class:`KernelWarning`). Nor, silently, on a tensor with no memory of its
values, or while a trace would miss the C call (:func:`real`: FakeTensors, vmap / grad,
meta, ``torch.compile``, ``torch.jit.trace``, make_fx), where the torch path works.

A cached library that does not load (truncated, corrupt, another
architecture) is rebuilt, once: each build records its size and SHA-256 next to it
(``<library>.so.sha256``), and a library that does not match that record is rebuilt before
it is loaded, since ctypes maps a truncated file without complaint and the process dies
(SIGBUS) when it runs code past the file's end.

Why build at run time rather than at install (a setuptools extension, or
``torch.utils.cpp_extension``): see docs/benchmarks.md, "How the kernels are built".
The flags forbid floating-point contraction (``-ffp-contract=off``) so that every
``a * b + c`` rounds twice, as the torch ops it mirrors do.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from torch._C import _are_functorch_transforms_active as _transforming
from torch._C import _get_dispatch_mode, _len_torch_dispatch_stack, _TorchDispatchModeKey
from torch._C import _is_tracing as _jit_tracing
from torch._C._functorch import is_functorch_wrapped_tensor as _wrapped
from torch.autograd.graph import increment_version

from .._checks import env_flag, write_refused
from .._locks import ForkSafeLock
from ..formats import IntFormat
from .cache import FLAGS, BuildError, CacheError, NoCompiler, build, cache_dir, compiler

__all__ = ["BACKENDS", "CSRC", "FLAGS", "SIGNATURES", "KernelWarning", "add", "available",
           "buffer", "build_all", "cache_dir", "choose", "compiler", "contiguous", "disabled",
           "flat_f32", "lib", "load", "out_buffers", "plain", "plain_tensor", "qparams_consts",
           "read", "real", "real_tensor", "threads", "writable",
           "write", "wrote"]

#: the C sources and headers (package data)
CSRC = Path(__file__).resolve().with_name("csrc")

_P, _I, _INT, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double

#: every library (``csrc/<name>.c``) and the ctypes argument types of its exported
#: functions, all of which return ``int64``
SIGNATURES: dict[str, dict[str, list]] = {
    "unit_minmax": {
        "qs_unit_minmax": [_P, _I, _I, _P, _P, _P, _INT, _INT, _D, _P, _P, _INT],
        "qs_col_minmax": [_P, _I, _I, _I, _P, _P, _P, _INT, _INT, _I, _INT],
        "qs_actorder_minmax": [_P, _I, _I, _I, _I, _P, _I, _P, _P, _INT, _INT],
        "qs_padded_minmax": [_P, _I, _I, _I, _P, _P, _INT, _INT],
        "qs_nonzero_rows": [_P, _I, _I, _INT],
    },
    "hist_kernel": {
        "qs_hist_bin": [_P, _I, _I, _I, _P, _P, _P, _INT, _INT],
        "qs_hist_regrid": [_I, _I, _INT] + [_P] * 12,
        "qs_hist_fused": [_P, _I, _I, _INT] + [_P] * 13 + [_INT],
    },
    "mse_search": {
        "qs_mse_dq": [_P, _I, _D, _D, _D, _D, _P],
        "qs_mse_step": [_P, _I, _P, _I, _P, _P, _I, _I, _INT, _D, _D, _I, _INT, _INT, _INT]
        + [_P] * 8 + [_I, _P, _INT, _INT],
        "qs_mse_gstop": [_P, _I, _I, _P],
        "qs_mse_dq_fp": [_P, _I, _D, _D, _I, _I, _P],
        "qs_mse_price_w": [_P, _P, _I, _P, _I, _P, _P, _I, _D, _D, _P, _INT, _INT],
        "qs_mse_price_fp_w": [_P, _P, _I, _P, _I, _P, _P, _I, _D, _I, _I, _P, _INT, _INT],
        "qs_mse_step_fp": [_P, _I, _P, _I, _P, _P, _I, _I, _INT, _D, _D, _I, _INT, _INT, _INT]
        + [_P] * 8 + [_I, _P, _INT, _I, _I, _INT],
    },
    "mse_pnorm": {
        "qs_pnorm_lanes": [],
        "qs_pnorm_pow": [_P, _I, _D, _INT, _P],
        "qs_pnorm_price": [_P, _I, _I, _P, _P, _I, _D, _D, _D, _P, _INT],
    },
    "hist_error": {
        "qs_points": [_P] * 6 + [_I] * 3,
        "qs_hist_error": [_P] * 9 + [_I] * 4,
        "qs_line_search": [_P] * 15 + [_I] * 8 + [_P] + [_I] * 3,
    },
    "l2_walk": {
        "qs_l2_init": [_P, _P, _I, _I],
        "qs_l2_walk": [_P] * 7 + [_I] * 3,
        "qs_l2_result": [_P] * 5 + [_I] * 2,
        "qs_l2_terms": [_P] * 6 + [_I] * 4,
        "qs_l2_accept": [_P] * 6 + [_I] * 2,
    },
    "entropy": {
        "qs_entropy": [_P] * 4 + [_I] * 9,
    },
    "ao_hist": {
        "qs_ao_histc": [_P, _I, ctypes.c_float, ctypes.c_float, _I, _P, _P, _I],
        "qs_ao_upscale": [_P, _I, _I, _P, ctypes.c_float, ctypes.c_float, _P, _P],
        "qs_ao_widen": [_P, _I, _I, _P, ctypes.c_float, ctypes.c_float, _P, _P, _I,
                        ctypes.c_float, ctypes.c_float, _P, _I],
        "qs_ao_fused": [_P, _I, ctypes.c_float, ctypes.c_float, _I, _P, _P, _P, _I],
        "qs_ao_minmax": [_P, _I, _P, _I],
        "qs_ao_histc64": [_P, _I, ctypes.c_float, ctypes.c_float, _I, _P, _I, _I],
    },
    "block_qparams": {
        "qs_e8m0_qparams": [_P, _P, _I, _I, _I, _I, _D, _P],
        "qs_block_amax_max": [_P, _P, _I, _P],
        "qs_nvfp4_qparams": [_P, _P, _I, _D, _D, _D, _P],
    },
    "int_qparams": {
        "qs_int_qparams": [_P, _P, _I, _P, _P, _P],
    },
}


class KernelWarning(RuntimeWarning):
    """A kernel could not be built: quantscope runs its (slower) torch path instead."""


_libs: dict[str, ctypes.CDLL | None] = {}
# a child forked while another thread built a kernel builds or loads it itself (the cache's
# writes are atomic)
_lock = ForkSafeLock()
_warned = False


def disabled() -> bool:
    """Whether ``QUANTSCOPE_NO_KERNEL`` turns every kernel off."""
    return env_flag("QUANTSCOPE_NO_KERNEL", False)


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(message + "; quantscope uses its torch path (same results, slower). "
                      "QUANTSCOPE_NO_KERNEL=1 silences this.", KernelWarning, stacklevel=4)


def _open(name: str, source: Path, argtypes: dict[str, list], include: Path) -> ctypes.CDLL:
    """Build (or find) and load, typed; a cached library that does not load or lacks a
    function is removed and built again, once."""
    cc = compiler()
    if cc is None:
        raise NoCompiler("$CC is unset, and neither cc nor gcc is on the PATH")
    for attempt in (0, 1):
        target = build(name, source, cc, include)
        try:
            so = ctypes.CDLL(str(target))
            for fn, types in argtypes.items():
                f = getattr(so, fn)
                f.restype = ctypes.c_int64
                f.argtypes = types
            return so
        except (OSError, AttributeError):
            if attempt:
                raise
            target.unlink(missing_ok=True)  # corrupt or stale: build it again
    raise AssertionError("unreachable")


def load(name: str, argtypes: dict[str, list], source: Path | None = None,
         include: Path = CSRC) -> ctypes.CDLL | None:
    """The library ``name`` (``source``, default ``csrc/<name>.c``, with headers from
    ``include``), built once per process and typed by ``argtypes``; None when no kernel can
    be used (see the module doc)."""
    if name in _libs:
        return _libs[name]
    with _lock:
        if name not in _libs:
            so = None
            if not disabled() and sys.platform != "win32":
                try:
                    so = _open(name, source or CSRC / f"{name}.c", argtypes, include)
                except subprocess.CalledProcessError as e:
                    tail = (e.stderr or "").strip().splitlines()[-3:]
                    _warn_once(f"quantscope could not build its C kernel {name!r} "
                               f"({' '.join(map(str, e.cmd[:1]))} exited {e.returncode}: "
                               + " | ".join(tail) + ")")
                except CacheError as e:
                    _warn_once(f"quantscope {e}")
                except BuildError as e:
                    _warn_once(f"quantscope could not build its C kernel {name!r} ({e})")
                except NoCompiler as e:  # not any FileNotFoundError: a missing file is not
                    _warn_once(f"quantscope found no C compiler for its kernels ({e})")
                except (OSError, AttributeError, subprocess.SubprocessError) as e:
                    _warn_once(f"quantscope could not build or load its C kernel {name!r} "
                               f"({type(e).__name__}: {e})")
            _libs[name] = so
    return _libs[name]


def lib(name: str) -> ctypes.CDLL | None:
    """The shipped library ``name`` (a key of :data:`SIGNATURES`), or None (torch path): also
    where the context is not :func:`real` (``torch.compile``: Dynamo frees a tensor passed
    only as ``data_ptr()`` before the ctypes call after its graph break runs; the torch path
    is bitwise the same), for the callers that check only their inputs' device."""
    if not real():
        return None
    return load(name, SIGNATURES[name])


#: what every ``backend=`` argument takes: None (the C kernel where it applies, else torch),
#: ``"torch"`` (torch's ops: the reference each kernel is tested against bit for bit),
#: ``"kernel"`` (the kernel, or a ``ValueError`` saying why it cannot run)
BACKENDS = (None, "torch", "kernel")


def available(name: str) -> bool:
    """Whether the library ``name`` (a key of :data:`SIGNATURES`) is built and loads (False:
    its callers run their torch path)."""
    return lib(name) is not None


def choose(backend: str | None, name: str, where: str, applies: bool = True,
           reads: tuple[torch.Tensor, ...] = ()) -> ctypes.CDLL | None:
    """The library ``name`` to run under ``backend`` (see :data:`BACKENDS`), or None for the
    torch path. ``applies``: whether the kernel takes these inputs (device, dtype, layout:
    the caller decides); ``reads``: the tensors it reads, which must be :func:`real`;
    ``where`` names the caller in errors."""
    if backend not in BACKENDS:
        raise ValueError(f"{where}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return None
    found = lib(name) if applies and real(*reads) else None
    if found is None and backend == "kernel":
        why = ("does not take these inputs (CPU tensors of the kernel's dtype)" if not applies
               else "cannot run while tracing (torch.compile, jit.trace, vmap, fake tensors)"
               if not real(*reads) else
               "is not built (QUANTSCOPE_NO_KERNEL, no C compiler, or a failed build)")
        raise ValueError(f"{where}: backend='kernel', but the C kernel {name!r} {why}")
    return found


def build_all() -> dict[str, bool]:
    """Build (or find) every shipped library now: ``{name: usable}``."""
    return {name: lib(name) is not None for name in SIGNATURES}


def buffer(*shape: int, zero: bool = False) -> torch.Tensor:
    """A float32 CPU tensor for a kernel to write into (``zero``: zero-filled), whatever
    torch's default dtype and device: the kernels write float32 host memory."""
    return (torch.zeros if zero else torch.empty)(shape, dtype=torch.float32, device="cpu")


def out_buffers(n: int, out_for=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ``[n]`` float32 tensors for a kernel to write: ``out_for(n)``'s (the caller's
    memory, e.g. an observer's previous state: reused pages cost less than fresh ones of a
    large result) where a kernel can write them as they are (contiguous ``[n]`` float32 CPU
    tensors, :func:`real`), else two new :func:`buffer` s. :func:`wrote` after the call."""
    out = None if out_for is None else out_for(n)
    if out is not None and flat_f32(n, *out) and real(*out):
        return out
    return buffer(n), buffer(n)


def flat_f32(n: int, *ts: torch.Tensor) -> bool:
    """Whether each of ``ts`` is a contiguous ``[n]`` float32 CPU tensor, as a kernel writes
    ``n`` float32s (:func:`real` aside: hot paths test it once for all their tensors)."""
    return all(t.shape == (n,) and t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()
               for t in ts)


def wrote(out: tuple[torch.Tensor, ...], failed: int) -> tuple[torch.Tensor, ...] | None:
    """``out`` (:func:`out_buffers`) after a kernel's call into it returned ``failed``: its
    versions bumped where the kernel wrote them, as in-place torch ops would (0, or a failure
    after writing: -2, out of memory; not -1, sizes refused before any write); None where
    the call failed."""
    if failed != -1:
        increment_version(out)
    return None if failed else out


#: the tensor types whose memory is their values: no subclass (a FakeTensor has none)
_REAL_TYPES = (torch.Tensor, torch.nn.Parameter)
_FAKE, _PROXY = _TorchDispatchModeKey.FAKE, _TorchDispatchModeKey.PROXY
# bound once (a hot path): Dynamo knows the function object, whatever its name
_compiling = torch.compiler.is_compiling


def real(*tensors: torch.Tensor) -> bool:
    """Whether the memory of each of ``tensors`` holds its values here, for a C kernel or a
    host read: a plain ``torch.Tensor`` / ``Parameter`` (not a FakeTensor or other subclass),
    not meta, not functorch-wrapped (a vmap BatchedTensor, a grad / jvp wrapper), not a
    negative view (``x.conj().imag``, ``torch._neg_view``: its memory holds ``-x``); and no
    ``torch.compile`` / ``torch.jit.trace`` tracing (a trace records a kernel's outputs as
    constants), functorch transform (vmap, grad, jvp) or fake / proxy dispatch mode
    (FakeTensorMode, make_fx: a fresh ``torch.empty`` is a fake there) active. The one rule
    every kernel call site relies on (most through :func:`plain`); ``real()``: the context
    alone; several tensors test it once (hot paths)."""
    # compiling first: Dynamo must not trace the C calls after it (it folds this to True)
    if (_compiling() or _jit_tracing() or _transforming()
            or (_len_torch_dispatch_stack() and (_get_dispatch_mode(_FAKE) is not None
                                                 or _get_dispatch_mode(_PROXY) is not None))):
        return False
    return all(map(real_tensor, tensors))


def real_tensor(t: torch.Tensor) -> bool:
    """:func:`real`'s test of one tensor, the context aside (callers that test it apart)."""
    # the type first: the cheapest test, and the one a FakeTensor fails
    return type(t) in _REAL_TYPES and not t.is_meta and not t.is_neg() and not _wrapped(t)


def plain(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Whether a kernel can read and write ``t``'s memory as it is: a contiguous CPU tensor
    of ``dtype`` that is :func:`real`."""
    return real() and plain_tensor(t, dtype)  # (the context first: Dynamo folds it)


def plain_tensor(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """:func:`plain`'s test of one tensor, the context aside (callers that test it apart:
    a state of several tensors tests it once)."""
    return t.is_cpu and t.dtype == dtype and t.is_contiguous() and real_tensor(t)


def writable(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Whether a kernel may write ``t`` in place: :func:`plain`, and not a tensor made under
    ``torch.inference_mode`` written outside it (torch refuses that write; a kernel writing
    through ``data_ptr()`` must leave it to the torch path, which raises torch's error)."""
    return plain(t, dtype) and not write_refused(t)


def contiguous(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``t`` as a contiguous tensor of ``dtype``: ``t`` itself when it is one (no op, no
    copy: this runs in hot paths, where even a no-op ``.float()`` is a dispatch)."""
    t = t if t.dtype == dtype else t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


#: the C type of each dtype :func:`read`, :func:`write` and :func:`first_value` take
_CTYPES = {torch.float32: ctypes.c_float, torch.int64: ctypes.c_int64, torch.bool: ctypes.c_bool}


def _values(t: torch.Tensor, count: int, strict: bool = True):
    """``t``'s first ``count`` values as a ctypes array over its memory; where ``t`` is not
    :func:`plain` (or too short), a ``ValueError``, or None when not ``strict``."""
    if not (t.dtype in _CTYPES and plain(t, t.dtype) and t.numel() >= count):
        if not strict:
            return None
        raise ValueError(f"kernels.read / write: a contiguous CPU float32, int64 or bool tensor "
                         f"of at least {count} values, not tracing (kernels.plain), got {t.dtype} "
                         f"{type(t).__name__} {tuple(t.shape)} on {t.device}")
    return (_CTYPES[t.dtype] * count).from_address(t.data_ptr())


def read(t: torch.Tensor, count: int = 1, strict: bool = True) -> list | None:
    """The first ``count`` values of a plain float32 / int64 / bool CPU tensor (:func:`plain`) as
    Python numbers, read from its memory: no tensor op (``.item()`` is a dispatch, and right
    after a C pass has streamed a batch through the caches and the TLB one costs ten times
    its few microseconds). Another ``t``: a ``ValueError``, or None when not ``strict`` (one
    check where a caller would test :func:`plain` first)."""
    values = _values(t, count, strict)
    return None if values is None else values[:]


def first_value(t: torch.Tensor, dtype: torch.dtype = torch.float32):
    """:func:`read`'s first value for callers that test the context apart (a hot path):
    ``t``'s first value (a float32, int64 or bool ``dtype``) where :func:`plain_tensor` and
    not empty, else None (another device or dtype, a fake or traced tensor: the caller reads
    it with torch)."""
    if plain_tensor(t, dtype) and t.numel():
        return _CTYPES[dtype].from_address(t.data_ptr()).value
    return None


def write(t: torch.Tensor, *values) -> None:
    """Write ``values`` into the first elements of a plain float32 / int64 / bool CPU tensor, in
    place and without a tensor op (see :func:`read`); its version counter is bumped, as an
    in-place torch op would (``torch.autograd.graph.increment_version``)."""
    _values(t, len(values))[:] = values
    increment_version(t)


def add(t: torch.Tensor, value: int, context: bool = True) -> bool:
    """Add the integer ``value`` to the first element of an int64 counter ``t`` through its
    memory, as :func:`write` of :func:`read` plus ``value`` (one check, one view: an
    observer's token count on each call); False, nothing done, where ``t`` is not a
    :func:`plain` int64 tensor (the caller adds with a torch op). ``context=False``: the
    caller tested the context (:func:`real`), only ``t`` is (:func:`plain_tensor`)."""
    if not ((not context or real()) and plain_tensor(t, torch.int64) and t.numel()):
        return False
    ctypes.c_int64.from_address(t.data_ptr()).value += value
    increment_version(t)
    return True


def threads(requested: int | None = None) -> int:
    """The thread count a kernel call runs on: ``requested``, else torch's
    (``torch.get_num_threads()``), at least 1. Each kernel also caps it by its work."""
    return max(1, torch.get_num_threads() if requested is None else int(requested))


def qparams_consts(spec) -> list[float] | None:
    """``csrc/qs_qparams.h``'s constants for ``spec`` (qmin, qmax, min_scale, symmetric, the
    symmetric zero point), or None where it does not apply (float formats, scale encodings
    other than fp32): those price with qparams_from_range."""
    fmt = spec.format
    if not isinstance(fmt, IntFormat) or spec.scale.kind != "fp32":
        return None
    qmin, qmax = float(spec.qmin), float(spec.qmax)
    zsym = 0.0 if fmt.signed else float(int(qmin + qmax + 1) // 2)
    return [qmin, qmax, float(spec.min_scale), float(spec.symmetric), zsym]
