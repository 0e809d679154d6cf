"""quantscope's hot loops as ``torch.library`` custom ops (namespace ``quantscope``).

Each op has a CPU implementation (the torch path, the reference the C kernels equal bit for
bit; ``mse_price_int`` / ``mse_price_fp``, the block searches that price through them, and
``hist_add`` / ``hist_regrid_`` run the C kernel there where it is built and applies), a CUDA
one (the Triton kernel of :mod:`quantscope.kernels.triton`; the same torch path where triton
is not installed) and a fake (meta) one, so ``torch.compile``, CUDA graphs and
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
* ``mse_price_int(units, scale, zero_point, qmin, qmax, weights, norm, float32_squares)
  -> err`` and ``mse_price_fp(units, scale, fmax, min_exp, mbits, weights, norm,
  float32_squares) -> err``: the MSE
  search's pricing, float64 ``[K, U]`` squared fake-quant errors of every candidate on
  float32 ``units [U, E]``, integer formats (scale float32, zero_point int32 ``[K, U]``) and
  float element formats (``FloatFormat``'s max, min_exp, mbits; effective scales float32
  ``[K, U]``), optionally weighted per element or to another ``norm`` (``|d| ** norm``):
  defined in :mod:`.price_ops` (the C kernel on the CPU, Triton on CUDA: the same terms,
  each square exact in float64 or, ``float32_squares``, rounded to float32, summed in
  float64, so they agree up to the order of the sum).
* ``mse_select(err, same, incumbent, ext_start, patience, per_unit, use_global, tie_last)
  -> (idx, best)``: the search's selection rules (``estimators.mse_tiles._State``) over the
  priced ``[K, U]`` candidates: ``same[k, u]``, candidate ``k``'s qparams equal the previous
  one's (a plateau: not counted by per-unit patience); rows from ``ext_start`` on are the
  extension (per-unit rule only). ``patience < 0``: none. ``idx`` -1: the incumbent.
  Defined in :mod:`.select_ops`.
* ``nvfp4_mse(units, lo, hi, factors, inc_lo, inc_hi, global_amax, format, min_scale,
  ext_start, patience, per_unit, use_global, tie_last, weights=None) -> (idx, best)``: an
  NVFP4 MSE search: candidate ``k``'s block scales are ``nvfp4_qparams`` of ``(lo *
  factors[k], hi * factors[k])`` under ``global_amax``, priced on ``units`` as
  ``mse_price_fp`` prices them, ``weights`` included (the incumbent: ``(inc_lo, inc_hi)``;
  :func:`nvfp4_price`), then ``mse_select``'s rules (the rest of the arguments are its). On
  CUDA (:mod:`.triton.block_search`) each distinct block scale is priced once (a unit's
  candidates fall through consecutive e4m3 codes: ~9 scales where the native grid has 50
  factors) and no ``[candidates, units]`` tensor of errors or qparams is made.
* ``mx_mse(units, lo, hi, factors, inc_lo, inc_hi, format, mode, ext_start, patience,
  per_unit, use_global, tie_last, weights=None) -> (idx, best)``: the same for MX: block scales
  ``e8m0_block_scales`` in ``mode`` (:func:`mx_price`) over float or signed integer elements
  (MXINT8, BFP: priced as ``mse_price_int`` prices them); on CUDA 2-4 distinct E8M0 scales
  a unit where the grid has 20-50 factors.
* ``nvfp4_search(...) -> (idx, best)``, ``nvfp4_mse``'s first nine arguments and
  ``weights``: the search
  whose rule is the first lowest error (no patience can stop it: ``nvfp4_expanded_mse``):
  ``nvfp4_mse`` without patience, on CUDA in one launch (the codes priced in order, then a
  bisection for the first candidate of the chosen code).
  These three are defined in :mod:`.block_ops`.
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

Beside their torch references, in :mod:`quantscope.stats`: ``hist_add`` and ``hist_regrid_``
(histogram binning and grid change), ``record_non_finite`` and ``minmax_update`` (an observer's
non-finite flag and min-max state update), and ``minmax_observe`` (an accumulating min-max
observer's whole ``forward``: those steps after its min / max, one dispatch).

Bad input raises ``ValueError`` naming the argument, on every device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_code_range, check_per_unit
from .._oplib import define
from ..qdq import fake_quantize_units
from ..qparams import e8m0_block_scales_op as e8m0_block_scales
from ..qparams import int_qparams_op as int_qparams
from ..qparams import nvfp4_qparams_op as nvfp4_qparams
from . import triton as _triton
from .block_ops import mx_mse, mx_price, nvfp4_mse, nvfp4_price, nvfp4_search
from .price_ops import _IntBounds, _rows, mse_price_fp, mse_price_int
from .select_ops import improved_rows, mse_select, stop_after

__all__ = ["e8m0_block_scales", "fake_quant_int", "grouped_unit_minmax", "improved_rows",
           "int_qparams", "mse_price_fp", "mse_price_int", "mse_select", "mx_mse", "mx_price",
           "nvfp4_mse", "nvfp4_price", "nvfp4_qparams", "nvfp4_search", "stop_after",
           "unit_minmax"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_units(units: Tensor, who: str) -> None:
    if units.dim() != 2 or units.dtype not in _FLOATS:
        raise ValueError(f"quantscope::{who}: units must be a 2-D [units, elements] tensor of "
                         f"float32, bfloat16 or float16, got {units.dtype} {tuple(units.shape)}")


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
        u1, u2, e1, e2 = units.shape
        units = units.reshape(u1 * u2, e1 * e2)  # a copy where strided (-1: not with 0 units)
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
    if torch.cuda.is_current_stream_capturing():
        # the one launch reads a descriptor table copied from host memory: a CUDA graph would
        # replay that copy from a host buffer reused since; one launch per tensor there
        pairs = [_cuda_unit_minmax(t) for t in units]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    return kernel.grouped_unit_minmax([_rows(t) for t in units])


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
    # scale's values (NaN, 0) go unchecked: reading them would sync the host with the device
    check_per_unit(f"quantscope::{who}", "scale", scale, units.shape[0], units.device)
    check_per_unit(f"quantscope::{who}", "zero_point", zero_point, units.shape[0], units.device)
    check_code_range(f"quantscope::{who}", qmin, qmax)


def _torch_fake_quant_int(units: Tensor, scale: Tensor, zero_point: Tensor, qmin: float,
                          qmax: float) -> Tensor:
    _check_fake_quant(units, scale, zero_point, qmin, qmax)
    # a contiguous result whatever the units' strides, as the Triton kernel's and the fake's
    return fake_quantize_units(units.float().contiguous(), scale[:, None], zero_point[:, None],
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
