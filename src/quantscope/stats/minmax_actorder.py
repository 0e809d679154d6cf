"""Per-unit min / max of activation-order groups (``Group(size, g_idx=...)``) read where the
tensor lies, on the CPU.

``layout.to_units`` permutes such a tensor's columns (``index_select`` by the stable
``argsort(g_idx)``) before its groups are rows: a copy of the whole tensor, and
``index_select`` along the last axis is slow (the min-max observers took 13-23x a plain
``Group``'s time on a 4096 x 4096 weight, found by probing). The C kernel
(``qs_actorder_minmax``, ``csrc/unit_minmax.c``) reads the tensor once instead: with AVX2, 8
rows at a time, each column's 8 values folded into its group's running min / max (one vector
lane a row), then the units whose min or max is a zero and the blocks of rows that held NaN
reduced again in the row kernel's order; without AVX2 (and for those), a chunk of groups at a
time gathered in the permuted order into a buffer that stays in cache, which the row kernel's
own reduction reads. Every unit's min / max are the permuted copy's bit for bit (NaN
propagated, the sign of a -0.0 / +0.0 tie included), whatever the thread count.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..layout import Group
from .minmax import KERNEL_DTYPES, _kernel, _threads

__all__ = ["actorder_minmax"]


def _rows(v: torch.Tensor) -> torch.Tensor | None:
    """``v [..., n]`` as a 2-D ``[rows, n]`` view of its memory (any strides), or None where
    its leading dims do not collapse into one stride (a slice across them)."""
    try:
        return v.view(-1, v.shape[-1])
    except RuntimeError:
        return None


def actorder_minmax(x: torch.Tensor, layout, out_for=None
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-unit ``(lo, hi)`` (float32, ``layout.to_units``' unit order) of ``x`` under an
    activation-order ``Group`` layout, without the permuted copy: for a CPU float32 / bf16 /
    fp16 ``x`` without autograd, contiguous or any view whose rows are one stride apart (a
    transposed weight, a column slice), with more than one unit. None elsewhere (other
    layouts and dtypes, another device, a trace, a single unit, whose copy torch reduces
    whole; the ``non_finite="ignore"`` and units-reading observers build the units anyway):
    the caller builds the units. ``out_for(U)``: two ``[U]`` tensors to write into (None:
    new ones), taken where they fit, as :func:`~quantscope.stats.minmax.unit_minmax` takes
    its ``out`` (fresh pages of a large result cost more than reused ones)."""
    if not isinstance(layout, Group) or layout.g_idx is None or x.dtype not in KERNEL_DTYPES \
            or not x.is_cpu or x.requires_grad or not kernels.real(x):
        return None
    a, n, count = layout._geometry(x.shape)  # (raises what to_units would)
    m = _rows(x if a == x.dim() - 1 else x.movedim(a, -1))
    lib = _kernel()
    if m is None or lib is None or m.shape[0] * count < 2:
        return None
    U, size = m.shape[0] * count, layout.size
    perm = layout._perm.to("cpu")  # (g_idx's device: a no-op where it is the CPU's)
    lo, hi = out = kernels.out_buffers(U, out_for)
    failed = lib.qs_actorder_minmax(m.data_ptr(), m.shape[0], n, m.stride(0), m.stride(1),
                                    perm.data_ptr(), size, lo.data_ptr(), hi.data_ptr(),
                                    _threads(U * size, U), KERNEL_DTYPES[x.dtype])
    return kernels.wrote(out, failed)
