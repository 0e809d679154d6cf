"""quantscope's hot loops as ``torch.library`` custom ops (namespace ``quantscope``).

Each op has a CPU implementation (the torch path: the reference the C kernels equal bit for
bit), a CUDA one (the Triton kernel of :mod:`quantscope.kernels.triton`; the same torch path
where triton is not installed) and a fake (meta) one, so ``torch.compile``, CUDA graphs and
``torch.export`` see one op with known output shapes, and callers write no branch per device.

* ``unit_minmax(units) -> (lo, hi)``: per-row min / max of ``units [U, E]`` (bf16 / fp16 /
  fp32, any strides; E >= 1), float32 ``[U]`` each, NaN propagated; or of a
  ``[U1, U2, E1, E2]`` view (units ``(u1, u2)``, elements ``(e1, e2)``): the layouts whose
  units are no row view (a channel axis in the middle, tiles) read in place.
* ``grouped_unit_minmax(units) -> (lo, hi)``: per-row min / max of a list of ``[U_i, E_i]``
  tensors of one dtype and device, in ONE launch on CUDA (a layer's or a model's weights of
  mixed shapes): two lists, float32 ``[U_i]`` per tensor, each its own tensor (an observer
  keeps them as its state: views of one buffer would make every state_dict carry it all).
* ``fake_quant_int(units, scale, zero_point, qmin, qmax) -> out``: integer fake-quantization
  of ``units [U, E]`` with float32 per-unit ``scale`` / ``zero_point`` ``[U]``; float32
  ``[U, E]`` (``qdq.fake_quantize_units``).
* ``mse_price_int(units, scale, zero_point, qmin, qmax, weights, norm) -> err`` and
  ``mse_price_fp(units, scale, fmax, min_exp, mbits, weights, norm) -> err``: the MSE
  search's pricing, float64 ``[K, U]`` squared fake-quant errors of every candidate on
  float32 ``units [U, E]``, integer formats (scale float32, zero_point int32 ``[K, U]``) and
  float element formats (``FloatFormat``'s max, min_exp, mbits; effective scales float32
  ``[K, U]``), optionally weighted per element or to another ``norm`` (``|d| ** norm``):
  defined in :mod:`.price_ops` (the C kernel on the CPU, Triton on CUDA: the same float32
  terms summed in float64, so they agree up to the order of the sum).
* ``mse_select(err, same, incumbent, ext_start, patience, per_unit, use_global, tie_last)
  -> (idx, best)``: the search's selection rules (``estimators.mse_tiles._State``) over the
  priced ``[K, U]`` candidates: ``same[k, u]``, candidate ``k``'s qparams equal the previous
  one's (a plateau: not counted by per-unit patience); rows from ``ext_start`` on are the
  extension (per-unit rule only). ``patience < 0``: none. ``idx`` -1: the incumbent.
  Defined in :mod:`.select_ops`.
* ``nvfp4_mse(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format, min_scale,
  ext_start, patience, per_unit, use_global, tie_last) -> (idx, best)``: an NVFP4 MSE
  search: candidate ``k``'s block scales are ``nvfp4_qparams`` of ``(lo * factors[k], hi *
  factors[k])`` under ``global_amax``, priced on ``units`` as ``mse_price_fp`` prices them
  (the incumbent: ``(inc_lo, inc_hi)``; :func:`nvfp4_price`), then ``mse_select``'s rules
  (the rest of the arguments are its). On CUDA (:mod:`.triton.block_search`) each distinct
  block scale is priced once (a unit's candidates fall through consecutive e4m3 codes: ~9
  scales where the native grid has 50 factors) and no ``[candidates, units]`` tensor of
  errors or qparams is made.
* ``mx_mse(units, lo, hi, factors, inc_lo, inc_hi, format, mode, ext_start, patience,
  per_unit, use_global, tie_last) -> (idx, best)``: the same for MX: block scales
  ``e8m0_block_scales`` in ``mode`` (:func:`mx_price`) over float or signed integer elements
  (MXINT8, BFP: priced as ``mse_price_int`` prices them); on CUDA 2-4 distinct E8M0 scales
  a unit where the grid has 20-50 factors.
* ``nvfp4_search(...) -> (idx, best)``, ``nvfp4_mse``'s first nine arguments: the search
  whose rule is the first lowest error (no patience can stop it: ``nvfp4_expanded_mse``):
  ``nvfp4_mse`` without patience, on CUDA in one launch (the codes priced in order, then a
  bisection for the first candidate of the chosen code).
* ``int_qparams(lo, hi, consts) -> (scale, zero_point)``: an integer format's fp32 scales and
  int32 zero points of the ranges (``consts``: ``kernels.qparams_consts(spec)``), as
  ``qparams_from_range`` gives them.
* ``e8m0_block_scales(lo, hi, format, mode) -> scale``: MX scales of the ranges
  (``scales.e8m0_scale`` of their amax); float32 ranges of one shape.
* ``nvfp4_qparams(lo, hi, global_amax, format, min_scale) -> (scale, global_scale)``:
  NVFP4's e4m3 block scales (``qparams.nvfp4_block_scales``) and their global scale, computed
  on the device from ``global_amax`` (one float32 value, or None: the ranges' largest
  absolute value), so NVFP4's qparams take no host read and no chain of small ops.
  These three are defined in :mod:`quantscope.qparams`, beside their formulas, which call them
  off the CPU (this module builds on qparams, so it cannot be the other way round).

Beside their torch references, in :mod:`quantscope.stats`: ``hist_add`` and ``hist_regrid``
(histogram binning and grid change), ``record_non_finite`` and ``minmax_update`` (an observer's
non-finite flag and min-max state update), and ``minmax_observe`` (an accumulating min-max
observer's whole ``forward``: those steps after its min / max, one dispatch).

Bad input raises ``ValueError`` naming the argument, on every device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._oplib import define
from ..formats import IntFormat, get_format
from ..qdq import fake_quantize_units
from ..qparams import _check_global_amax, _float_format
from ..qparams import e8m0_block_scales_op as e8m0_block_scales
from ..qparams import int_qparams_op as int_qparams
from ..qparams import nvfp4_qparams_op as nvfp4_qparams
from ..scales import E8M0_MODES
from . import triton as _triton
from .price_ops import _IntBounds, mse_price_fp, mse_price_int
from .select_ops import _torch_mse_select, check_ext_start, improved_rows, mse_select, stop_after

__all__ = ["e8m0_block_scales", "fake_quant_int", "grouped_unit_minmax", "improved_rows",
           "int_qparams", "mse_price_fp", "mse_price_int", "mse_select", "mx_mse", "mx_price",
           "nvfp4_mse", "nvfp4_price", "nvfp4_qparams", "nvfp4_search", "stop_after",
           "unit_minmax"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_units(units: Tensor, who: str) -> None:
    if units.dim() != 2 or units.dtype not in _FLOATS:
        raise ValueError(f"quantscope::{who}: units must be a 2-D [units, elements] tensor of "
                         f"float32, bfloat16 or float16, got {units.dtype} {tuple(units.shape)}")


def _check_per_unit(t: Tensor, name: str, units: int, device, who: str) -> None:
    if t.shape != (units,) or t.dtype != torch.float32 or t.device != device:
        raise ValueError(f"quantscope::{who}: {name} must be a float32 tensor of shape "
                         f"({units},) on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}")


# ---- unit_minmax ---------------------------------------------------------------------------

def _check_minmax(units: Tensor) -> None:
    if units.dim() not in (2, 4) or units.dtype not in _FLOATS:
        raise ValueError("quantscope::unit_minmax: units must be a [units, elements] or "
                         "[U1, U2, E1, E2] tensor of float32, bfloat16 or float16, got "
                         f"{units.dtype} {tuple(units.shape)}")
    if units.shape[1 if units.dim() == 2 else 2:].numel() == 0:
        raise ValueError("quantscope::unit_minmax: units must have at least one element per "
                         f"unit, got shape {tuple(units.shape)}")


def _torch_unit_minmax(units: Tensor) -> tuple[Tensor, Tensor]:
    _check_minmax(units)
    if units.dim() == 4:
        units = units.reshape(units.shape[0] * units.shape[1], -1)  # a copy where strided
    lo, hi = torch.aminmax(units, dim=1)  # the torch path (stats.minmax.torch_unit_minmax)
    return lo.float(), hi.float()


def _cuda_unit_minmax(units):
    kernel = _triton.launchers("minmax", units)
    if kernel is None:
        return _torch_unit_minmax(units)
    _check_minmax(units)
    return kernel.unit_minmax(units)


def _fake_unit_minmax(units):
    _check_minmax(units)
    U = units.shape[0] if units.dim() == 2 else units.shape[0] * units.shape[1]
    out = units.new_empty(U, dtype=torch.float32)
    return out, torch.empty_like(out)


unit_minmax = define(
    "unit_minmax(Tensor units) -> (Tensor, Tensor)",
    _torch_unit_minmax, cuda=_cuda_unit_minmax, fake=_fake_unit_minmax)


# ---- grouped_unit_minmax -------------------------------------------------------------------

def _check_group(units: list[Tensor]) -> None:
    who = "quantscope::grouped_unit_minmax"
    if not units:
        raise ValueError(f"{who}: units must be a non-empty list of [units, elements] tensors")
    first = units[0]
    for i, t in enumerate(units):
        if t.dim() != 2 or t.dtype != first.dtype or t.device != first.device \
                or t.dtype not in _FLOATS or t.shape[1] == 0:
            raise ValueError(f"{who}: units[{i}] must be a 2-D tensor with elements, of one "
                             f"float dtype (float32, bfloat16, float16) and device with "
                             f"units[0] ({first.dtype} on {first.device}), got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")


def _torch_grouped_unit_minmax(units: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    _check_group(units)
    pairs = [_torch_unit_minmax(t) for t in units]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _cuda_grouped_unit_minmax(units):
    kernel = _triton.launchers("minmax", units[0]) if units else None
    if kernel is None:
        return _torch_grouped_unit_minmax(units)
    _check_group(units)
    return kernel.grouped_unit_minmax([t if t.stride(1) == 1 else t.contiguous()
                                       for t in units])


def _fake_grouped_unit_minmax(units):
    _check_group(units)
    lo = [t.new_empty(t.shape[0], dtype=torch.float32) for t in units]
    return lo, [torch.empty_like(t) for t in lo]


# one lo / hi pair per tensor, not views of one buffer: an observer keeps its tensor's pair as
# its state, and state_dict would carry (torch.save) or refuse (safetensors) a shared buffer
grouped_unit_minmax = define(
    "grouped_unit_minmax(Tensor[] units) -> (Tensor[], Tensor[])",
    _torch_grouped_unit_minmax, cuda=_cuda_grouped_unit_minmax, fake=_fake_grouped_unit_minmax)


# ---- fake_quant_int ------------------------------------------------------------------------

def _check_fake_quant(units, scale, zero_point, qmin, qmax) -> None:
    who = "fake_quant_int"
    _check_units(units, who)
    _check_per_unit(scale, "scale", units.shape[0], units.device, who)
    _check_per_unit(zero_point, "zero_point", units.shape[0], units.device, who)
    if not qmin < qmax:
        raise ValueError(f"quantscope::{who}: qmin must be below qmax, got {qmin} and {qmax}")


def _torch_fake_quant_int(units: Tensor, scale: Tensor, zero_point: Tensor, qmin: float,
                          qmax: float) -> Tensor:
    _check_fake_quant(units, scale, zero_point, qmin, qmax)
    return fake_quantize_units(units.float(), scale[:, None], zero_point[:, None],
                               _IntBounds(float(qmin), float(qmax)))


def _cuda_fake_quant_int(units, scale, zero_point, qmin, qmax):
    kernel = _triton.launchers("fakequant", units)
    if kernel is None:
        return _torch_fake_quant_int(units, scale, zero_point, qmin, qmax)
    _check_fake_quant(units, scale, zero_point, qmin, qmax)
    return kernel.fake_quant_int(units, scale.contiguous(), zero_point.contiguous(), qmin, qmax)


def _fake_fake_quant_int(units, scale, zero_point, qmin, qmax):
    _check_fake_quant(units, scale, zero_point, qmin, qmax)
    return units.new_empty(units.shape, dtype=torch.float32)


fake_quant_int = define(
    "fake_quant_int(Tensor units, Tensor scale, Tensor zero_point, float qmin, float qmax) "
    "-> Tensor",
    _torch_fake_quant_int, cuda=_cuda_fake_quant_int, fake=_fake_fake_quant_int)


# ---- the block-scale searches: each distinct block scale priced once -----------------------

#: the definitions' ``[candidates, chunk]`` qparams hold at most this many values
_BLOCK_CHUNK = 1 << 22


def _check_block(who, units, lo, hi, factors, inc_lo, inc_hi, ext_start=0):
    if units.dim() != 2 or units.dtype != torch.float32:
        raise ValueError(f"quantscope::{who}: units must be a 2-D [units, elements] float32 "
                         f"tensor, got {units.dtype} {tuple(units.shape)}")
    for name, t in (("lo", lo), ("hi", hi), ("inc_lo", inc_lo), ("inc_hi", inc_hi)):
        _check_per_unit(t, name, units.shape[0], units.device, who)
    if factors.dim() != 1 or not factors.numel() or factors.dtype != torch.float32 \
            or factors.device != units.device:
        raise ValueError(f"quantscope::{who}: factors must be a non-empty 1-D float32 tensor "
                         f"on {units.device}, got {factors.dtype} {tuple(factors.shape)} on "
                         f"{factors.device}")
    check_ext_start(who, ext_start, factors.shape[0])


def _check_nvfp4(who, units, lo, hi, factors, inc_lo, inc_hi, global_amax, format,
                 ext_start=0):
    _check_block(who, units, lo, hi, factors, inc_lo, inc_hi, ext_start)
    _check_global_amax(global_amax, units.device, who)
    return _float_format(format, who)


def _check_mx(who, units, lo, hi, factors, inc_lo, inc_hi, format, mode, ext_start=0):
    """MX's element format: a float format, or a signed integer one (MXINT8, BFP)."""
    _check_block(who, units, lo, hi, factors, inc_lo, inc_hi, ext_start)
    if mode not in E8M0_MODES:
        raise ValueError(f"quantscope::{who}: mode must be one of {E8M0_MODES}, got {mode!r}")
    fmt = get_format(format)
    if isinstance(fmt, IntFormat) and not fmt.signed:
        raise ValueError(f"quantscope::{who}: format must be a float or a signed integer "
                         f"format, got {format!r}")
    return fmt


def _element_price(fmt):
    """``price(units, effective scales)``: ``mse_price_fp`` under a float element format,
    ``mse_price_int`` (zero points 0) under an integer one."""
    if isinstance(fmt, IntFormat):
        return lambda u, s: mse_price_int(u, s, torch.zeros_like(s, dtype=torch.int32),
                                          float(fmt.qmin), float(fmt.qmax))
    return lambda u, s: mse_price_fp(u, s, fmt.max, fmt.min_exp, fmt.mbits)


def _block_price(units, lo, hi, factors, inc_lo, inc_hi, fmt, scales):
    """The block-scale searches' pricing, defined: float64 ``err [K + 1, U]`` (row 0 the
    incumbent ``(inc_lo, inc_hi)``, row ``1 + k`` candidate ``k``: the block scales of ``(lo
    * factors[k], hi * factors[k])``, priced by ``mse_price_fp``, or ``mse_price_int`` for
    integer elements) and ``same [K, U]`` (the stored block scale equals the previous
    candidate's), chunk by chunk of units; ``scales(lo, hi)``: the stored and the effective
    block scales of ranges."""
    K, U = factors.shape[0], units.shape[0]
    err = units.new_empty((K + 1, U), dtype=torch.float64)
    same = units.new_empty((K, U), dtype=torch.bool)
    f, price = factors[:, None], _element_price(fmt)
    step = max(1, _BLOCK_CHUNK // (K + 1))
    for a in range(0, U, step):
        b = min(a + step, U)
        stored, effective = scales(torch.cat((inc_lo[None, a:b], lo[None, a:b] * f)),
                                   torch.cat((inc_hi[None, a:b], hi[None, a:b] * f)))
        err[:, a:b] = price(units[a:b], effective.contiguous())
        same[:, a:b] = stored[1:] == stored[:-1]
    return err, same


def nvfp4_price(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format, min_scale):
    """:func:`_block_price` of NVFP4's block scales: ``nvfp4_qparams`` under
    ``global_amax`` (effective: block / global scale)."""
    def scales(lo, hi):
        scale, gs = nvfp4_qparams(lo, hi, global_amax.reshape(1), format, min_scale)
        return scale, scale / gs
    return _block_price(units, lo, hi, factors, inc_lo, inc_hi,
                        _float_format(format, "nvfp4_price"), scales)


def mx_price(units, lo, hi, factors, inc_lo, inc_hi, format, mode):
    """:func:`_block_price` of MX's block scales: ``e8m0_block_scales`` in ``mode``."""
    def scales(lo, hi):
        scale = e8m0_block_scales(lo, hi, format, mode)
        return scale, scale
    return _block_price(units, lo, hi, factors, inc_lo, inc_hi, get_format(format), scales)


def _torch_nvfp4_mse(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format, min_scale,
                     ext_start, patience, per_unit, use_global, tie_last):
    """The definition: ``mse_select`` of :func:`nvfp4_price`."""
    _check_nvfp4("nvfp4_mse", units, lo, hi, factors, inc_lo, inc_hi, global_amax, format,
                 ext_start)
    err, same = nvfp4_price(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format,
                            min_scale)
    return _torch_mse_select(err[1:], same, err[0], ext_start, patience, per_unit, use_global,
                             tie_last)


def _block_kernel(units):
    """``kernels.triton.block_search``'s launchers where they apply to ``units`` (else None:
    no triton, rows longer than a tile or not contiguous)."""
    kernel = _triton.launchers("block_search", units)
    if kernel is None or units.shape[1] > kernel.MAX_TILE or units.stride(1) != 1:
        return None
    return kernel


def _launch_rules(ext_start, patience, per_unit, use_global, tie_last):
    """The launcher's rule arguments of an op's: ``patience < 0`` is None, and the global
    rule's stop from the kernels' flags."""
    return (ext_start, None if patience < 0 else patience, per_unit, use_global, tie_last,
            lambda improved: stop_after(improved, patience))


def _cuda_nvfp4_mse(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format, min_scale,
                    *rules):
    kernel = _block_kernel(units)
    if kernel is None:
        return _torch_nvfp4_mse(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format,
                                min_scale, *rules)
    fmt = _check_nvfp4("nvfp4_mse", units, lo, hi, factors, inc_lo, inc_hi, global_amax,
                       format, rules[0])
    return kernel.block_mse(
        units, lo.contiguous(), hi.contiguous(), factors.contiguous(), inc_lo.contiguous(),
        inc_hi.contiguous(), global_amax.reshape(1), fmt.max, fmt.min_exp, fmt.mbits,
        kernel.NVFP4, min_scale, *_launch_rules(*rules))


def _fake_block_search(units):
    return (units.new_empty(units.shape[0], dtype=torch.int64),
            units.new_empty(units.shape[0], dtype=torch.float64))


def _fake_nvfp4_mse(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format, min_scale,
                    ext_start, *rules):
    _check_nvfp4("nvfp4_mse", units, lo, hi, factors, inc_lo, inc_hi, global_amax, format,
                 ext_start)
    return _fake_block_search(units)


nvfp4_mse = define(
    "nvfp4_mse(Tensor units, Tensor lo, Tensor hi, Tensor factors, Tensor inc_lo, "
    "Tensor inc_hi, Tensor global_amax, str format, float min_scale, SymInt ext_start, "
    "SymInt patience, bool per_unit, bool use_global, bool tie_last) -> (Tensor, Tensor)",
    _torch_nvfp4_mse, cuda=_cuda_nvfp4_mse, fake=_fake_nvfp4_mse)


def _torch_nvfp4_search(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format,
                        min_scale):
    """The definition: ``nvfp4_mse`` without patience (the first lowest error kept)."""
    _check_nvfp4("nvfp4_search", units, lo, hi, factors, inc_lo, inc_hi, global_amax, format)
    return _torch_nvfp4_mse(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format,
                            min_scale, factors.shape[0], -1, False, False, False)


def _cuda_nvfp4_search(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format, min_scale):
    kernel = _block_kernel(units)
    if kernel is None:
        return _torch_nvfp4_search(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format,
                                   min_scale)
    fmt = _check_nvfp4("nvfp4_search", units, lo, hi, factors, inc_lo, inc_hi, global_amax,
                       format)
    return kernel.nvfp4_search(
        units, lo.contiguous(), hi.contiguous(), factors.contiguous(), inc_lo.contiguous(),
        inc_hi.contiguous(), global_amax.reshape(1), fmt.max, fmt.min_exp, fmt.mbits,
        kernel.NVFP4, min_scale)


def _fake_nvfp4_search(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format, min_scale):
    _check_nvfp4("nvfp4_search", units, lo, hi, factors, inc_lo, inc_hi, global_amax, format)
    return _fake_block_search(units)


nvfp4_search = define(
    "nvfp4_search(Tensor units, Tensor lo, Tensor hi, Tensor factors, Tensor inc_lo, "
    "Tensor inc_hi, Tensor global_amax, str format, float min_scale) -> (Tensor, Tensor)",
    _torch_nvfp4_search, cuda=_cuda_nvfp4_search, fake=_fake_nvfp4_search)


def _torch_mx_mse(units, lo, hi, factors, inc_lo, inc_hi, format, mode, ext_start, patience,
                  per_unit, use_global, tie_last):
    """The definition: ``mse_select`` of :func:`mx_price`."""
    _check_mx("mx_mse", units, lo, hi, factors, inc_lo, inc_hi, format, mode, ext_start)
    err, same = mx_price(units, lo, hi, factors, inc_lo, inc_hi, format, mode)
    return _torch_mse_select(err[1:], same, err[0], ext_start, patience, per_unit, use_global,
                             tie_last)


def _cuda_mx_mse(units, lo, hi, factors, inc_lo, inc_hi, format, mode, *rules):
    kernel = _block_kernel(units)
    if kernel is None:
        return _torch_mx_mse(units, lo, hi, factors, inc_lo, inc_hi, format, mode, *rules)
    fmt = _check_mx("mx_mse", units, lo, hi, factors, inc_lo, inc_hi, format, mode, rules[0])
    enc = kernel.Encoding(E8M0_MODES.index(mode), emax=fmt.emax, mbits=fmt.mbits)
    # integer elements: [qmin, qmax], qmax their max (signed: E8M0 needs codes around 0)
    ints = isinstance(fmt, IntFormat)
    return kernel.block_mse(
        units, lo.contiguous(), hi.contiguous(), factors.contiguous(), inc_lo.contiguous(),
        inc_hi.contiguous(), None, fmt.max, 0 if ints else fmt.min_exp,
        0 if ints else fmt.mbits, enc, 0.0, *_launch_rules(*rules),
        qmin=float(fmt.qmin) if ints else None)


def _fake_mx_mse(units, lo, hi, factors, inc_lo, inc_hi, format, mode, ext_start, *rules):
    _check_mx("mx_mse", units, lo, hi, factors, inc_lo, inc_hi, format, mode, ext_start)
    return _fake_block_search(units)


mx_mse = define(
    "mx_mse(Tensor units, Tensor lo, Tensor hi, Tensor factors, Tensor inc_lo, "
    "Tensor inc_hi, str format, str mode, SymInt ext_start, SymInt patience, bool per_unit, "
    "bool use_global, bool tie_last) -> (Tensor, Tensor)",
    _torch_mx_mse, cuda=_cuda_mx_mse, fake=_fake_mx_mse)
