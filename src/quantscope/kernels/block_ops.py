"""The block-scale MSE searches as ``torch.library`` custom ops: ``quantscope::nvfp4_mse``,
``quantscope::nvfp4_search`` and ``quantscope::mx_mse``, re-exported by
:mod:`quantscope.kernels.ops` (whose docstring describes them and whose contract they
follow: a CPU implementation, a CUDA one, a fake one; bad input raises ``ValueError``
naming the argument), and their pricing, :func:`nvfp4_price` and :func:`mx_price`.

Each takes ``weights`` (None, or float32 ``[U, E]`` of ``units``' shape and device: an
imatrix search's importance), priced as ``mse_price_fp`` / ``mse_price_int`` price them:
``float64(w) * (float64(d) * float64(d))`` summed in float64 (each square exact).

CPU: the definition (every candidate's block scales computed, chunk by chunk of units, and
priced by ``mse_price_fp`` / ``mse_price_int``: the C kernel; then ``mse_select``'s rules).
CUDA: :mod:`.triton.block_search` (each distinct block scale of a unit priced once); the
definition where triton is not installed or a row is longer than a tile.

It lives beside :mod:`.ops` rather than in it for the size rule (500 lines a module).
"""

from __future__ import annotations

import torch

from .._checks import check_nvfp4_min_scale, check_op_global_amax, check_per_unit, op_float_format
from .._oplib import define
from ..formats import IntFormat, get_format
from ..qparams import e8m0_block_scales_op as e8m0_block_scales
from ..qparams import nvfp4_qparams_op as nvfp4_qparams
from ..scales import E8M0_MODES
from . import triton as _triton
from .price_ops import _check_weights, mse_price_fp, mse_price_int
from .select_ops import _torch_mse_select, check_ext_start, stop_after

__all__ = ["mx_mse", "mx_price", "nvfp4_mse", "nvfp4_price", "nvfp4_search"]

#: the definitions' ``[candidates, chunk]`` qparams hold at most this many values
_BLOCK_CHUNK = 1 << 22


def _check_block(who, units, lo, hi, factors, inc_lo, inc_hi, ext_start=0, weights=None):
    if units.dim() != 2 or units.dtype != torch.float32:
        raise ValueError(f"quantscope::{who}: units must be a 2-D [units, elements] float32 "
                         f"tensor, got {units.dtype} {tuple(units.shape)}")
    for name, t in (("lo", lo), ("hi", hi), ("inc_lo", inc_lo), ("inc_hi", inc_hi)):
        check_per_unit(f"quantscope::{who}", name, t, units.shape[0], units.device)
    if factors.dim() != 1 or not factors.numel() or factors.dtype != torch.float32 \
            or factors.device != units.device:
        raise ValueError(f"quantscope::{who}: factors must be a non-empty 1-D float32 tensor "
                         f"on {units.device}, got {factors.dtype} {tuple(factors.shape)} on "
                         f"{factors.device}")
    check_ext_start(who, ext_start, factors.shape[0])
    _check_weights(who, units, weights)


def _check_nvfp4(who, units, lo, hi, factors, inc_lo, inc_hi, global_amax, format, min_scale,
                 ext_start=0, weights=None):
    _check_block(who, units, lo, hi, factors, inc_lo, inc_hi, ext_start, weights)
    check_op_global_amax(global_amax, units.device, who)
    check_nvfp4_min_scale(who, min_scale)
    return op_float_format(format, who)


def _check_mx(who, units, lo, hi, factors, inc_lo, inc_hi, format, mode, ext_start=0,
              weights=None):
    """MX's element format: a float format, or a signed integer one (MXINT8, BFP)."""
    _check_block(who, units, lo, hi, factors, inc_lo, inc_hi, ext_start, weights)
    if mode not in E8M0_MODES:
        raise ValueError(f"quantscope::{who}: mode must be one of {E8M0_MODES}, got {mode!r}")
    fmt = get_format(format)
    if isinstance(fmt, IntFormat) and not fmt.signed:
        raise ValueError(f"quantscope::{who}: format must be a float or a signed integer "
                         f"format, got {format!r}")
    return fmt


# ---- the pricing, defined ------------------------------------------------------------------

def _element_price(fmt):
    """``price(units, effective scales, weights)``: ``mse_price_fp`` under a float element
    format, ``mse_price_int`` (zero points 0) under an integer one."""
    if isinstance(fmt, IntFormat):
        return lambda u, s, w: mse_price_int(u, s, torch.zeros_like(s, dtype=torch.int32),
                                             float(fmt.qmin), float(fmt.qmax), w)
    return lambda u, s, w: mse_price_fp(u, s, fmt.max, fmt.min_exp, fmt.mbits, w)


def _block_price(units, lo, hi, factors, inc_lo, inc_hi, fmt, scales, weights):
    """The block-scale searches' pricing, defined: float64 ``err [K + 1, U]`` (row 0 the
    incumbent ``(inc_lo, inc_hi)``, row ``1 + k`` candidate ``k``: the block scales of ``(lo
    * factors[k], hi * factors[k])``, priced by ``mse_price_fp``, or ``mse_price_int`` for
    integer elements, under ``weights``) and ``same [K, U]`` (the stored block scale equals
    the previous candidate's), chunk by chunk of units; ``scales(lo, hi)``: the stored and
    the effective block scales of ranges."""
    K, U = factors.shape[0], units.shape[0]
    err = units.new_empty((K + 1, U), dtype=torch.float64)
    same = units.new_empty((K, U), dtype=torch.bool)
    f, price = factors[:, None], _element_price(fmt)
    step = max(1, _BLOCK_CHUNK // (K + 1))
    for a in range(0, U, step):
        b = min(a + step, U)
        stored, effective = scales(torch.cat((inc_lo[None, a:b], lo[None, a:b] * f)),
                                   torch.cat((inc_hi[None, a:b], hi[None, a:b] * f)))
        err[:, a:b] = price(units[a:b], effective.contiguous(),
                            None if weights is None else weights[a:b])
        same[:, a:b] = stored[1:] == stored[:-1]
    return err, same


def nvfp4_price(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format, min_scale,
                weights=None):
    """:func:`_block_price` of NVFP4's block scales: ``nvfp4_qparams`` under
    ``global_amax`` (effective: block / global scale)."""
    def scales(lo, hi):
        scale, gs = nvfp4_qparams(lo, hi, global_amax.reshape(1), format, min_scale)
        return scale, scale / gs
    return _block_price(units, lo, hi, factors, inc_lo, inc_hi,
                        op_float_format(format, "nvfp4_price"), scales, weights)


def mx_price(units, lo, hi, factors, inc_lo, inc_hi, format, mode, weights=None):
    """:func:`_block_price` of MX's block scales: ``e8m0_block_scales`` in ``mode``."""
    def scales(lo, hi):
        scale = e8m0_block_scales(lo, hi, format, mode)
        return scale, scale
    return _block_price(units, lo, hi, factors, inc_lo, inc_hi, get_format(format), scales,
                        weights)


# ---- the ops -------------------------------------------------------------------------------

def _block_kernel(units, weights):
    """``kernels.triton.block_search``'s launchers where they apply to ``units`` (else None:
    no triton, rows longer than a tile or not contiguous, weights' rows not contiguous). It
    reads their second dimension: the op's checks come first (2-D, else an IndexError)."""
    kernel = _triton.launchers("block_search", units)
    if kernel is None or units.shape[1] > kernel.MAX_TILE or units.stride(1) != 1 \
            or weights is not None and weights.stride(1) != 1:
        return None
    return kernel


def _launch_rules(ext_start, patience, per_unit, use_global, tie_last):
    """The launcher's rule arguments of an op's: ``patience < 0`` is None, and the global
    rule's stop from the kernels' flags."""
    return (ext_start, None if patience < 0 else patience, per_unit, use_global, tie_last,
            lambda improved: stop_after(improved, patience))


def _contiguous(*tensors):
    """``tensors``, each contiguous (what the launchers read)."""
    return tuple(t.contiguous() for t in tensors)


def _nvfp4_args(kernel, units, lo, hi, factors, inc_lo, inc_hi, global_amax, fmt, min_scale):
    """The NVFP4 launchers' leading arguments (``block_mse``'s and ``nvfp4_search``'s): the
    ranges contiguous, the global amax as one value, the element format, the scale encoding."""
    return (units, *_contiguous(lo, hi, factors, inc_lo, inc_hi), global_amax.reshape(1),
            fmt.max, fmt.min_exp, fmt.mbits, kernel.NVFP4, min_scale)


def _fake_block_search(units):
    return (units.new_empty(units.shape[0], dtype=torch.int64),
            units.new_empty(units.shape[0], dtype=torch.float64))


def _torch_nvfp4_mse(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format, min_scale,
                     ext_start, patience, per_unit, use_global, tie_last, weights=None):
    """The definition: ``mse_select`` of :func:`nvfp4_price`."""
    _check_nvfp4("nvfp4_mse", units, lo, hi, factors, inc_lo, inc_hi, global_amax, format,
                 min_scale, ext_start, weights)
    err, same = nvfp4_price(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format,
                            min_scale, weights)
    return _torch_mse_select(err[1:], same, err[0], ext_start, patience, per_unit, use_global,
                             tie_last)


def _cuda_nvfp4_mse(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format, min_scale,
                    ext_start, patience, per_unit, use_global, tie_last, weights=None):
    rules = (ext_start, patience, per_unit, use_global, tie_last)
    fmt = _check_nvfp4("nvfp4_mse", units, lo, hi, factors, inc_lo, inc_hi, global_amax,
                       format, min_scale, ext_start, weights)
    kernel = _block_kernel(units, weights)
    if kernel is None:
        return _torch_nvfp4_mse(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format,
                                min_scale, *rules, weights)
    return kernel.block_mse(*_nvfp4_args(kernel, units, lo, hi, factors, inc_lo, inc_hi,
                                         global_amax, fmt, min_scale),
                            *_launch_rules(*rules), weights=weights)


def _fake_nvfp4_mse(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format, min_scale,
                    ext_start, patience, per_unit, use_global, tie_last, weights=None):
    _check_nvfp4("nvfp4_mse", units, lo, hi, factors, inc_lo, inc_hi, global_amax, format,
                 min_scale, ext_start, weights)
    return _fake_block_search(units)


nvfp4_mse = define(
    "nvfp4_mse(Tensor units, Tensor lo, Tensor hi, Tensor factors, Tensor inc_lo, "
    "Tensor inc_hi, Tensor global_amax, str format, float min_scale, SymInt ext_start, "
    "SymInt patience, bool per_unit, bool use_global, bool tie_last, Tensor? weights=None) "
    "-> (Tensor, Tensor)",
    _torch_nvfp4_mse, cuda=_cuda_nvfp4_mse, fake=_fake_nvfp4_mse)


def _torch_nvfp4_search(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format,
                        min_scale, weights=None):
    """The definition: ``nvfp4_mse`` without patience (the first lowest error kept)."""
    _check_nvfp4("nvfp4_search", units, lo, hi, factors, inc_lo, inc_hi, global_amax, format,
                 min_scale, weights=weights)
    return _torch_nvfp4_mse(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format,
                            min_scale, factors.shape[0], -1, False, False, False, weights)


def _cuda_nvfp4_search(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format, min_scale,
                       weights=None):
    fmt = _check_nvfp4("nvfp4_search", units, lo, hi, factors, inc_lo, inc_hi, global_amax,
                       format, min_scale, weights=weights)
    kernel = _block_kernel(units, weights)
    if kernel is None:
        return _torch_nvfp4_search(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format,
                                   min_scale, weights)
    return kernel.nvfp4_search(*_nvfp4_args(kernel, units, lo, hi, factors, inc_lo, inc_hi,
                                            global_amax, fmt, min_scale), weights=weights)


def _fake_nvfp4_search(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format, min_scale,
                       weights=None):
    _check_nvfp4("nvfp4_search", units, lo, hi, factors, inc_lo, inc_hi, global_amax, format,
                 min_scale, weights=weights)
    return _fake_block_search(units)


nvfp4_search = define(
    "nvfp4_search(Tensor units, Tensor lo, Tensor hi, Tensor factors, Tensor inc_lo, "
    "Tensor inc_hi, Tensor global_amax, str format, float min_scale, Tensor? weights=None) "
    "-> (Tensor, Tensor)",
    _torch_nvfp4_search, cuda=_cuda_nvfp4_search, fake=_fake_nvfp4_search)


def _torch_mx_mse(units, lo, hi, factors, inc_lo, inc_hi, format, mode, ext_start, patience,
                  per_unit, use_global, tie_last, weights=None):
    """The definition: ``mse_select`` of :func:`mx_price`."""
    _check_mx("mx_mse", units, lo, hi, factors, inc_lo, inc_hi, format, mode, ext_start,
              weights)
    err, same = mx_price(units, lo, hi, factors, inc_lo, inc_hi, format, mode, weights)
    return _torch_mse_select(err[1:], same, err[0], ext_start, patience, per_unit, use_global,
                             tie_last)


def _cuda_mx_mse(units, lo, hi, factors, inc_lo, inc_hi, format, mode, ext_start, patience,
                 per_unit, use_global, tie_last, weights=None):
    rules = (ext_start, patience, per_unit, use_global, tie_last)
    fmt = _check_mx("mx_mse", units, lo, hi, factors, inc_lo, inc_hi, format, mode, ext_start,
                    weights)
    kernel = _block_kernel(units, weights)
    if kernel is None:
        return _torch_mx_mse(units, lo, hi, factors, inc_lo, inc_hi, format, mode, *rules,
                             weights)
    enc = kernel.Encoding(E8M0_MODES.index(mode), emax=fmt.emax, mbits=fmt.mbits)
    # integer elements: [qmin, qmax], qmax their max (signed: E8M0 needs codes around 0)
    ints = isinstance(fmt, IntFormat)
    return kernel.block_mse(
        units, *_contiguous(lo, hi, factors, inc_lo, inc_hi), None, fmt.max,
        0 if ints else fmt.min_exp, 0 if ints else fmt.mbits, enc, 0.0, *_launch_rules(*rules),
        qmin=float(fmt.qmin) if ints else None, weights=weights)


def _fake_mx_mse(units, lo, hi, factors, inc_lo, inc_hi, format, mode, ext_start, patience,
                 per_unit, use_global, tie_last, weights=None):
    _check_mx("mx_mse", units, lo, hi, factors, inc_lo, inc_hi, format, mode, ext_start,
              weights)
    return _fake_block_search(units)


mx_mse = define(
    "mx_mse(Tensor units, Tensor lo, Tensor hi, Tensor factors, Tensor inc_lo, "
    "Tensor inc_hi, str format, str mode, SymInt ext_start, SymInt patience, bool per_unit, "
    "bool use_global, bool tie_last, Tensor? weights=None) -> (Tensor, Tensor)",
    _torch_mx_mse, cuda=_cuda_mx_mse, fake=_fake_mx_mse)
