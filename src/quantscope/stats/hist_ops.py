"""``quantscope::hist_add``: histogram binning (:func:`.histogram.add_values`), and
``quantscope::hist_regrid_``: the grid change before it (``histogram._update_grid``), in
place, as ``torch.library`` custom ops, beside the ops of :mod:`quantscope.kernels.ops`.

It lives here, not in ``kernels.ops``, because its CPU implementation is this package's
``histogram.bin_values`` (the C kernel, else the torch reference), which the kernels layer
may not import; ``histogram.add_values`` calls it off the CPU (``torch.ops``: importing
this package registers it). CUDA: the Triton kernel (:mod:`quantscope.kernels.triton.histogram`),
the torch path where triton is not installed or the bins exceed its limit.

``hist_regrid_(counts, exp, first, lo, hi, batch_lo, batch_hi, absolute)``: the state
(``counts [U, B]`` int64, ``exp``, ``first`` int64 ``[U]``, ``lo``, ``hi`` float32 ``[U]``)
updated in place for a batch of per-unit min / max ``batch_lo``, ``batch_hi`` (float32
``[U]``) that may widen its range: the values ``_update_grid`` returns. ``histogram.update``
calls it off the CPU: one launch on CUDA (the Triton kernel) where the torch code is some
hundred one-element ops, and in place, where fresh tensors copied back into an observer's
buffers cost six more ops a call (a unit whose grid stays costs no pass over its bins
either). CPU: the C kernel (``hist_kernel.regrid``), else the torch code.

``hist_add(counts, units, exp, first, absolute)``: ``counts [U, B]`` int64 (contiguous,
updated in place), ``units [U, E]`` float (bf16 / fp16 / fp32), ``exp``, ``first`` int64
``[U]``; bad input raises ``ValueError`` naming the argument.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._oplib import define
from ..kernels import triton as _triton
from . import hist_kernel, histogram
from .minmax import MINMAX_DTYPES

__all__ = ["hist_add", "hist_regrid_"]


def _check_counts(who: str, counts: Tensor) -> int:
    """The number of units of ``counts``, or the ``ValueError``: a contiguous int64
    ``[units, bins]`` tensor with at least one bin (with none the C kernel's last bin, -1,
    is written out of bounds)."""
    if counts.dim() != 2 or counts.dtype != torch.int64 or not counts.is_contiguous() \
            or counts.shape[1] < 1:
        raise ValueError(f"{who}: counts must be a contiguous int64 [units, bins] tensor with "
                         f"bins >= 1, got {counts.dtype} {tuple(counts.shape)}")
    return counts.shape[0]


def _check(counts: Tensor, units: Tensor, exp: Tensor, first: Tensor) -> None:
    who = "quantscope::hist_add"
    U = _check_counts(who, counts)
    if units.dim() != 2 or units.shape[0] != U or units.dtype not in MINMAX_DTYPES \
            or units.device != counts.device:
        raise ValueError(f"{who}: units must be a float32 / bfloat16 / float16 [{U}, elements] "
                         f"tensor on {counts.device}, got {units.dtype} {tuple(units.shape)} "
                         f"on {units.device}")
    for name, t in (("exp", exp), ("first", first)):
        if t.shape != (U,) or t.dtype != torch.int64 or t.device != counts.device:
            raise ValueError(f"{who}: {name} must be an int64 tensor of shape ({U},) on "
                             f"{counts.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def _torch_hist_add(counts: Tensor, units: Tensor, exp: Tensor, first: Tensor,
                    absolute: bool) -> None:
    _check(counts, units, exp, first)
    histogram.bin_values(counts, units, exp, first, absolute)


def _cuda_hist_add(counts, units, exp, first, absolute):
    _check(counts, units, exp, first)
    kernel = _triton.launchers("histogram", units, writes=(counts,))
    if kernel is None or counts.shape[1] + 1 > kernel.MAX_BINS:
        return _torch_hist_add(counts, units, exp, first, absolute)
    units = units if units.stride(1) == 1 else units.contiguous()
    kernel.hist_add(counts, units, exp.contiguous(), first.contiguous(), absolute)
    return None


def _fake_hist_add(counts, units, exp, first, absolute):
    _check(counts, units, exp, first)


hist_add = define(
    "hist_add(Tensor(a!) counts, Tensor units, Tensor exp, Tensor first, bool absolute) -> ()",
    _torch_hist_add, cuda=_cuda_hist_add, fake=_fake_hist_add)


def _check_regrid(counts: Tensor, exp: Tensor, first: Tensor, lo: Tensor, hi: Tensor,
                  batch_lo: Tensor, batch_hi: Tensor) -> None:
    who = "quantscope::hist_regrid_"
    U = _check_counts(who, counts)
    for name, t, dtype in (("exp", exp, torch.int64), ("first", first, torch.int64),
                           ("lo", lo, torch.float32), ("hi", hi, torch.float32),
                           ("batch_lo", batch_lo, torch.float32),
                           ("batch_hi", batch_hi, torch.float32)):
        if t.shape != (U,) or t.dtype != dtype or t.device != counts.device:
            raise ValueError(f"{who}: {name} must be a {dtype} tensor of shape ({U},) on "
                             f"{counts.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def _torch_hist_regrid_(counts, exp, first, lo, hi, batch_lo, batch_hi, absolute):
    _check_regrid(counts, exp, first, lo, hi, batch_lo, batch_hi)
    state = histogram.HistState(counts, exp, first, lo, hi)
    new = hist_kernel.regrid(state, batch_lo, batch_hi, absolute, inplace=True)
    if new is None:
        new = histogram._update_grid(state, batch_lo, batch_hi, absolute)
    for old, value in zip(state, new):
        if value is not old:
            old.copy_(value)


def _cuda_hist_regrid_(counts, exp, first, lo, hi, batch_lo, batch_hi, absolute):
    _check_regrid(counts, exp, first, lo, hi, batch_lo, batch_hi)
    kernel = _triton.launchers("histogram", counts, writes=(counts, exp, first, lo, hi))
    if kernel is None or not all(t.is_contiguous() for t in (exp, first, lo, hi)):
        return _torch_hist_regrid_(counts, exp, first, lo, hi, batch_lo, batch_hi, absolute)
    kernel.regrid_(counts, exp, first, lo, hi, batch_lo.contiguous(), batch_hi.contiguous(),
                   absolute)
    return None


def _fake_hist_regrid_(counts, exp, first, lo, hi, batch_lo, batch_hi, absolute):
    _check_regrid(counts, exp, first, lo, hi, batch_lo, batch_hi)


hist_regrid_ = define(
    "hist_regrid_(Tensor(a!) counts, Tensor(b!) exp, Tensor(c!) first, Tensor(d!) lo, "
    "Tensor(e!) hi, Tensor batch_lo, Tensor batch_hi, bool absolute) -> ()",
    _torch_hist_regrid_, cuda=_cuda_hist_regrid_, fake=_fake_hist_regrid_)
