"""The MSE search's pricing as ``torch.library`` custom ops: ``quantscope::mse_price_int``
(integer formats) and ``quantscope::mse_price_fp`` (float element formats), re-exported by
:mod:`quantscope.kernels.ops` with the other ops (whose contract they follow: a CPU
implementation, a CUDA one, a fake one; bad input raises ``ValueError`` naming the argument).

* ``mse_price_int(units, scale, zero_point, qmin, qmax, weights=None, norm=2.0,
  float32_squares=False) -> err``:
  float64 ``[K, U]`` squared fake-quant errors of candidates ``scale`` (float32) /
  ``zero_point`` (int32) ``[K, U]`` on float32 ``units [U, E]``.
* ``mse_price_fp(units, scale, fmax, min_exp, mbits, weights=None, norm=2.0,
  float32_squares=False) -> err``: the same for a float element
  format given by ``FloatFormat``'s ``max``, ``min_exp`` and ``mbits`` (zero point 0: fp8 /
  fp6 / fp4 elements of MX and NVFP4 blocks) under candidate effective scales ``scale``
  (float32 ``[K, U]``; NVFP4's global scale folded in), the elements rounded as
  ``FloatFormat.round``.
* Each element's term is ``float64(d) * float64(d)``, the square of the float32 error taken
  in float64, where it is exact (a float32 square loses precision below ``|d|`` ~ 1e-19 and
  underflows to 0 below ~ 3e-23), summed in float64; with ``weights`` (float32 ``[U, E]``
  on ``units``' device, e.g. imatrix importance) ``float64(w) * (float64(d) * float64(d))``,
  the product rounded once (the weighted search's arithmetic,
  :mod:`quantscope.estimators.weighted`). ``float32_squares`` rounds each square to float32
  first, ``float64(d * d)`` as torch's ``d.square()`` (the arithmetic of the toolkits whose
  compat classes price here: Horizon's, llm-compressor's at norm 2). On every device: prices
  agree across devices up to the order of the float64 sum (1e-12).
* ``norm`` (positive; llm-compressor's searches use 2.4): each term is ``float64(|d| **
  norm)``, the float32 power as torch's ``d.abs().pow(norm)`` computes it on the op's device.
  Norms 1, 2 and 3 are exact arithmetic on every device; the others are the device's
  functions (0.5 a square root): torch's on the CPU (its AVX-512 float32 ``sqrt`` and ``pow``
  are not always correctly rounded), CUDA's ``sqrtf`` / ``powf`` in the Triton kernel (what
  torch's CUDA ``pow`` calls), an ulp or so apart where both raise to the float32 exponent,
  so prices agree across devices to about 1e-7 for those norms; but torch's CPU ``pow``
  takes the float64 exponent in its scalar tail (the elements past its vector loop: all of a
  tensor shorter than the vector width), about 9.5e-8 x ``|ln |d||`` off a term there (2e-6
  at ``|d| = 1e8``), as in llm-compressor's own torch search, whose compat class keeps it.

CPU: the C kernel (``csrc/mse_search.c``: ``qs_mse_price_w`` / ``qs_mse_price_fp_w``,
``weights`` or a null pointer, the sums ``estimators.mse_kernel.price`` gets) where it is
built, ``units`` is a contiguous CPU tensor and ``norm`` is 2, else the torch path
(``qdq.fake_quantize_units`` one candidate at a time, then :func:`price_sums`). CUDA: the
Triton kernel (:mod:`.triton.mse`, the same terms); the torch path where triton is not
installed.

It lives beside :mod:`.ops` rather than in it for the size rule (500 lines a module).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._checks import check_code_range, check_number
from .._oplib import define
from ..formats import INT8, FloatFormat
from ..qdq import fake_quantize_units
from . import lib as _c_lib
from . import plain as _plain
from . import threads as _threads
from . import triton as _triton

__all__ = ["mse_price_fp", "mse_price_int", "price_sums"]


@dataclass(frozen=True)
class _IntBounds:
    """What ``fake_quantize_units`` reads of a spec, for an integer code range."""

    qmin: float
    qmax: float
    is_float: bool = False
    format = INT8  # its round() clamps to the qmin / qmax it is given


@dataclass(frozen=True)
class _FloatBounds:
    """What ``fake_quantize_units`` reads of a spec, for a float element format given by its
    ``max``, ``min_exp`` and ``mbits``: its own format, rounding as ``FloatFormat.round``."""

    max: float
    min_exp: int
    mbits: int
    is_float = True
    round = FloatFormat.round

    @property
    def format(self):
        return self


# ---- checks ------------------------------------------------------------------------------

def _check_weights(who: str, units: Tensor, weights: Tensor | None) -> None:
    """``weights``: None, or float32 of ``units``' shape on its device."""
    if weights is not None and (tuple(weights.shape) != tuple(units.shape)
                                or weights.dtype != torch.float32
                                or weights.device != units.device):
        raise ValueError(f"quantscope::{who}: weights must be None or a float32 "
                         f"{tuple(units.shape)} tensor on {units.device} (one per element of "
                         f"units), got {weights.dtype} {tuple(weights.shape)} on "
                         f"{weights.device}")


def _check_price(who: str, units: Tensor, scale: Tensor, zero_point: Tensor | None) -> None:
    """What both prices take: float32 ``units [U, E]``, candidates ``scale`` float32 ``[K, U]``
    (and an integer format's ``zero_point``, int32 of its shape) on ``units``' device."""
    if units.dim() != 2 or units.dtype != torch.float32:
        raise ValueError(f"quantscope::{who}: units must be a 2-D float32 [units, elements] "
                         f"tensor, got {units.dtype} {tuple(units.shape)}")
    k_u = (scale.shape[0] if scale.dim() == 2 else -1, units.shape[0])
    named = [("scale", scale, torch.float32)]
    if zero_point is not None:
        named.append(("zero_point", zero_point, torch.int32))
    both = " (scale and zero_point of one shape)" if zero_point is not None else ""
    for name, t, dtype in named:
        if t.dim() != 2 or tuple(t.shape) != k_u or t.dtype != dtype or t.device != units.device:
            raise ValueError(f"quantscope::{who}: {name} must be a {dtype} [candidates, "
                             f"{units.shape[0]}] tensor on {units.device}{both}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")


def _check_price_int(units, scale, zero_point, qmin, qmax, weights=None, norm=2.0) -> None:
    _check_price("mse_price_int", units, scale, zero_point)
    _check_weights("mse_price_int", units, weights)
    check_number("quantscope::mse_price_int", "norm", norm, 0.0, lo_open=True)
    check_code_range("quantscope::mse_price_int", qmin, qmax)


def _check_price_fp(units, scale, fmax, min_exp, mbits, weights=None, norm=2.0) -> None:
    _check_price("mse_price_fp", units, scale, None)
    _check_weights("mse_price_fp", units, weights)
    check_number("quantscope::mse_price_fp", "norm", norm, 0.0, lo_open=True)
    who = "quantscope::mse_price_fp"
    if not 0.0 < fmax < math.inf:
        raise ValueError(f"{who}: fmax must be the format's largest value, positive and finite, "
                         f"got {fmax}")
    if not 0 <= mbits <= 23:
        raise ValueError(f"{who}: mbits must be in [0, 23], got {mbits}")
    if not mbits - 126 <= min_exp <= 127:  # the rounding step 2 ** (e - mbits) a normal float32
        raise ValueError(f"{who}: min_exp must be in [mbits - 126, 127] = [{mbits - 126}, 127], "
                         f"got {min_exp}")


# ---- the CPU implementations both share ----------------------------------------------------

def _c_price(entry: str, units: Tensor, scale: Tensor, zero_point: Tensor, *fmt,
             weights: Tensor | None = None, norm: float = 2.0,
             float32_squares: bool = False) -> Tensor | None:
    """The C kernel's prices (``entry``: ``qs_mse_price_w`` or ``qs_mse_price_fp_w``, with
    ``weights`` or without), or None where it does not run (not built, ``units`` no
    contiguous CPU tensor, or a norm other than 2)."""
    K, U = scale.shape
    lib = _c_lib("mse_search") if _plain(units) and U and K and norm == 2.0 else None
    if lib is None:
        return None
    out = torch.empty((K, U), dtype=torch.float64)
    sc, zp = scale.contiguous(), zero_point.contiguous()
    w = None if weights is None else weights.contiguous()
    getattr(lib, entry)(units.data_ptr(), None if w is None else w.data_ptr(), units.shape[1],
                        None, U, sc.data_ptr(), zp.data_ptr(), K, *fmt, out.data_ptr(),
                        _threads(), int(float32_squares))
    return out


def price_sums(d: Tensor, weights: Tensor | None = None, norm: float = 2.0,
               float32_squares: bool = False) -> Tensor:
    """The prices' arithmetic on float32 errors ``d [..., E]``, per row (the last dim):
    ``sum_e t`` in float64, ``t`` the exact square ``float64(d) * float64(d)``
    (``float32_squares``: ``float64(d * d)``, the square rounded to float32; another
    ``norm``: torch's float32 ``|d| ** norm``), with ``weights`` ``float64(w) * t``."""
    if norm == 2.0 and not float32_squares:
        t = d.double().square_()  # exact: 24-bit significands square into 48 bits
    else:
        t = (d.square() if norm == 2.0 else d.abs().pow(norm)).double()
    return (t if weights is None else t.mul_(weights.double())).sum(-1)


def _torch_price(units: Tensor, scale: Tensor, zero_point: Tensor, bounds,
                 weights: Tensor | None = None, norm: float = 2.0,
                 float32_squares: bool = False) -> Tensor:
    """:func:`price_sums` of each candidate's fake-quant errors, one candidate at a time
    (one ``[U, E]`` temporary)."""
    out = torch.empty(tuple(scale.shape), dtype=torch.float64, device=units.device)
    for k in range(scale.shape[0]):
        d = fake_quantize_units(units, scale[k, :, None], zero_point[k, :, None].float(),
                                bounds) - units
        out[k] = price_sums(d, weights, norm, float32_squares)
    return out


# ---- quantscope::mse_price_int --------------------------------------------------------------

def _torch_mse_price_int(units: Tensor, scale: Tensor, zero_point: Tensor, qmin: float,
                         qmax: float, weights: Tensor | None = None, norm: float = 2.0,
                         float32_squares: bool = False) -> Tensor:
    _check_price_int(units, scale, zero_point, qmin, qmax, weights, norm)
    units = units.contiguous()  # torch's row sums add in an order that follows the strides
    out = _c_price("qs_mse_price_w", units, scale, zero_point, float(qmin), float(qmax),
                   weights=weights, norm=norm, float32_squares=float32_squares)
    return out if out is not None else _torch_price(
        units, scale, zero_point, _IntBounds(float(qmin), float(qmax)), weights, norm,
        float32_squares)


def _rows(t: Tensor | None) -> Tensor | None:
    """``t`` with contiguous rows (what the Triton kernels read)."""
    return t if t is None or t.stride(1) == 1 else t.contiguous()


def _cuda_mse_price_int(units, scale, zero_point, qmin, qmax, weights=None, norm=2.0,
                        float32_squares=False):
    kernel = _triton.launchers("mse", units)
    if kernel is None:
        return _torch_mse_price_int(units, scale, zero_point, qmin, qmax, weights, norm,
                                    float32_squares)
    _check_price_int(units, scale, zero_point, qmin, qmax, weights, norm)
    return kernel.mse_price_int(_rows(units), scale.contiguous(), zero_point.contiguous(), qmin,
                                qmax, weights=_rows(weights), norm=norm,
                                float32_squares=float32_squares)


def _fake_mse_price_int(units, scale, zero_point, qmin, qmax, weights=None, norm=2.0,
                        float32_squares=False):
    _check_price_int(units, scale, zero_point, qmin, qmax, weights, norm)
    return units.new_empty(tuple(scale.shape), dtype=torch.float64)


mse_price_int = define(
    "mse_price_int(Tensor units, Tensor scale, Tensor zero_point, float qmin, float qmax, "
    "Tensor? weights=None, float norm=2.0, bool float32_squares=False) -> Tensor",
    _torch_mse_price_int, cuda=_cuda_mse_price_int, fake=_fake_mse_price_int)


# ---- quantscope::mse_price_fp ---------------------------------------------------------------

def _torch_mse_price_fp(units: Tensor, scale: Tensor, fmax: float, min_exp: int,
                        mbits: int, weights: Tensor | None = None, norm: float = 2.0,
                        float32_squares: bool = False) -> Tensor:
    _check_price_fp(units, scale, fmax, min_exp, mbits, weights, norm)
    units = units.contiguous()  # torch's row sums add in an order that follows the strides
    # zero points: the C kernel's argument, which float formats ignore (as the torch path)
    zero = torch.zeros(tuple(scale.shape), dtype=torch.int32, device=units.device)
    fmt = (float(fmax), int(min_exp), int(mbits))
    out = _c_price("qs_mse_price_fp_w", units, scale, zero, *fmt, weights=weights, norm=norm,
                   float32_squares=float32_squares)
    return out if out is not None else _torch_price(units, scale, zero, _FloatBounds(*fmt),
                                                    weights, norm, float32_squares)


def _cuda_mse_price_fp(units, scale, fmax, min_exp, mbits, weights=None, norm=2.0,
                       float32_squares=False):
    kernel = _triton.launchers("mse", units)
    if kernel is None:
        return _torch_mse_price_fp(units, scale, fmax, min_exp, mbits, weights, norm,
                                   float32_squares)
    _check_price_fp(units, scale, fmax, min_exp, mbits, weights, norm)
    return kernel.mse_price_fp(_rows(units), scale.contiguous(), fmax, min_exp, mbits,
                               weights=_rows(weights), norm=norm,
                               float32_squares=float32_squares)


def _fake_mse_price_fp(units, scale, fmax, min_exp, mbits, weights=None, norm=2.0,
                       float32_squares=False):
    _check_price_fp(units, scale, fmax, min_exp, mbits, weights, norm)
    return units.new_empty(tuple(scale.shape), dtype=torch.float64)


mse_price_fp = define(
    "mse_price_fp(Tensor units, Tensor scale, float fmax, SymInt min_exp, SymInt mbits, "
    "Tensor? weights=None, float norm=2.0, bool float32_squares=False) -> Tensor",
    _torch_mse_price_fp, cuda=_cuda_mse_price_fp, fake=_fake_mse_price_fp)
