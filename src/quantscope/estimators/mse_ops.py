"""The MSE search as ``quantscope::`` ops: every candidate priced in one pass, then selected.

The engine for units off the CPU (a CUDA tensor: the ops run their Triton kernels there).
Where the C engine (:mod:`.mse_kernel`) walks unit by unit and stops each unit early, this
one has no host loop to stop: every candidate of the grid and of its extension is priced
(``quantscope::mse_price_int`` for integer formats, ``quantscope::mse_price_fp`` for float
element formats), and ``quantscope::mse_select`` then applies the rules of
``mse_tiles._State``. Each rule looks only at the candidates before the one it judges, so
pricing them all and selecting afterwards chooses what the early-stopping searches choose,
and nothing is read back to the host. Block-scale searches are one op with their
selection, which computes the candidates' block scales itself and prices each distinct one
once: NVFP4's ``quantscope::nvfp4_search`` where the rules keep the first lowest error (no
patience can stop them: ``nvfp4_expanded_mse``), ``quantscope::nvfp4_mse`` under any
rules; MX's ``quantscope::mx_mse`` (E8M0 block scales over float or integer elements,
MXINT8 and BFP included; one factor for both ends).

The other formats' candidate qparams come from
:func:`~quantscope.qparams.qparams_from_range`, in chunks of units (``[candidates, chunk]``
blocks of at most ``chunk_elems`` x 16 values), and plateaus (a candidate whose encoded
qparams equal the previous one's) are found from them as the torch path finds them (the
block-scale ops are defined by the same steps). Errors are float64 sums of the float32
fake-quant errors' squares, exact in float64, as the other engines', so on the CPU (where
the ops run the C kernel) this engine chooses what :mod:`.mse_kernel` chooses (tests compare
them bit for bit).

Other norms and llm-compressor's search (``compat="llmcompressor"``: no incumbent, the first
candidate always wins, global patience; norm 2.4) run here too, priced by the same ops:
float64 sums of torch's float32 ``|d| ** norm`` (at norm 2 too: ``float32_squares``). The
torch path sums those terms in float32, in an order its reduction picks per device and
shape, so where two candidates' errors lie within float32 rounding of each other (about
``n * 2^-24`` relatively, ``n`` a unit's elements) this engine may pick the other one. On
the CPU, :mod:`.mse_compat` settles such ties in torch and reproduces the torch path bit for
bit; on CUDA no sum order is the reference (llm-compressor's own CUDA backend is a Triton
kernel with rules of its own), and this engine is the default there.
"""

from __future__ import annotations

import torch

from .._numerics import upload
from ..formats import FloatFormat, IntFormat, named
from ..kernels import ops
from ..spec import QuantSpec
from .mse_tiles import candidate_qparams

__all__ = ["search", "usable"]

#: a chunk's ``[candidates, units]`` qparams hold at most this many times ``chunk_elems``
#: values: the qparams are [K, U] where the tiles were [K, U, E]
_QPARAMS_PER_TILE = 16
#: llm-compressor's initial best error: the first candidate always wins
_FLT_MAX = float(torch.finfo(torch.float32).max)


def usable(units: torch.Tensor, spec: QuantSpec, norm: float) -> bool:
    """Whether the ops price this search: integer formats without a global scale or float
    element formats (any norm), float32 units, no autograd."""
    fmt = spec.format
    return ((isinstance(fmt, IntFormat) and not spec.scale.has_global_scale
             or isinstance(fmt, FloatFormat))
            and units.dtype == torch.float32 and not units.requires_grad)


def _price(units: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
           spec: QuantSpec, norm: float, weights: torch.Tensor | None,
           sq32: bool) -> torch.Tensor:
    """float64 ``[K, n]`` errors of effective scales / zero points ``[K, n]`` on ``units``
    (``sq32``: the ops' ``float32_squares``)."""
    if spec.is_float:
        fmt = spec.format
        return ops.mse_price_fp(units, scale, float(fmt.max), int(fmt.min_exp), int(fmt.mbits),
                                weights, norm, sq32)
    return ops.mse_price_int(units, scale, zero_point, float(spec.qmin), float(spec.qmax),
                             weights, norm, sq32)


def _price_chunk(units, lo, hi, f_lo, f_hi, incumbent, spec, global_amax, norm, weights,
                 sq32):
    """Errors ``[1 + K, n]`` of the incumbent (row 0; None: none, and the row is float32's
    max, which the first finite candidate beats) and the candidates on units ``n``, and
    ``same [K, n]``: candidate ``k``'s encoded qparams equal row ``k``'s (the previous)."""
    first = (lo, hi) if incumbent is None else incumbent  # its qparams: only for `same`
    lo_c = torch.cat((first[0][None], lo[None] * f_lo[:, None]))
    hi_c = torch.cat((first[1][None], hi[None] * f_hi[:, None]))
    qp = candidate_qparams(lo_c, hi_c, spec, global_amax)
    scale = qp.effective_scale.expand_as(lo_c).contiguous()
    zp = qp.zero_point.expand_as(lo_c).to(torch.int32).contiguous()
    enc = qp.scale.expand_as(lo_c)
    same = (enc[1:] == enc[:-1]) & (zp[1:] == zp[:-1])
    if incumbent is None:
        err = _price(units, scale[1:], zp[1:], spec, norm, weights, sq32)
        return torch.cat((torch.full_like(err[:1], _FLT_MAX), err)), same
    return _price(units, scale, zp, spec, norm, weights, sq32), same


def search(units, lo, hi, spec, f_lo, f_hi, *, patience, per_unit, tie, incumbent,
           global_amax, chunk_elems, norm=2.0, extend=(), weights=None,
           float32_squares=False, **_):
    """``mse_tiles.search`` (same arguments, same choices for native searches: an incumbent,
    squared error) as ops: ``(lo, hi, error, index)`` per unit. Without an incumbent
    (llm-compressor's search, ``compat``) the first candidate always wins, and near ties
    may fall otherwise than in torch's float32 sums (module doc). ``weights``: float32
    ``[U, E]`` (contiguous) weighting each element's term (an imatrix search), or None.
    ``float32_squares``: the prices' squares rounded to float32 (a compat class's toolkit
    arithmetic: the block ops, which square exactly, are not used)."""
    dev = units.device
    ext = list(extend) if extend and per_unit and patience is not None else []
    one_factor = list(f_lo) == list(f_hi)  # (host lists) both ends scaled alike
    f_lo = upload(list(f_lo) + ext, dev, torch.float32)
    f_hi = upload(list(f_hi) + ext, dev, torch.float32)
    # what the block ops price; they take the element format by name
    blocks = incumbent is not None and float(norm) == 2.0 and named(spec.format) \
        and not float32_squares
    if blocks and spec.scale.has_global_scale and global_amax is not None:
        idx, best = _nvfp4(units, lo, hi, f_lo, incumbent, global_amax, spec, patience,
                           per_unit, tie, len(ext), weights)
    elif blocks and spec.scale.kind == "e8m0" and one_factor and _format_bounds(spec):
        idx, best = ops.mx_mse(units, lo, hi, f_lo, *incumbent, spec.format.name,
                               spec.scale.mode, *_rules(f_lo.shape[0] - len(ext), patience,
                                                        per_unit, tie), weights)
    else:
        step = max(1, chunk_elems * _QPARAMS_PER_TILE // (f_lo.shape[0] + 1))
        idx, best = _price_and_select(units, lo, hi, spec, f_lo, f_hi, patience, per_unit, tie,
                                      incumbent, global_amax, step, len(ext), norm, weights,
                                      float32_squares)
    j, take = idx.clamp(min=0), idx >= 0
    if incumbent is None:  # no candidate priced below float32's max: the first, as torch's
        incumbent = (lo * f_lo[0], hi * f_hi[0])
    return (torch.where(take, lo * f_lo[j], incumbent[0]),
            torch.where(take, hi * f_hi[j], incumbent[1]), best, idx)


def _nvfp4(units, lo, hi, f, incumbent, global_amax, spec, patience, per_unit, tie, n_ext,
           weights):
    """``(idx, best)`` of an NVFP4 search (fp8 block scales under a given global amax; block
    scales are symmetric, so ``f_lo`` is ``f_hi``) as one op: ``nvfp4_search`` where the
    rules keep the first lowest error (a patience above the candidates' count stops no
    unit, nor the global rule), else ``nvfp4_mse``. Their CPU definitions make
    ``[candidates, chunk]`` qparams; on CUDA nothing that size."""
    K = f.shape[0]
    args = (units, lo, hi, f, incumbent[0], incumbent[1],
            upload(global_amax, units.device, torch.float32).reshape(1), spec.format.name,
            float(spec.min_scale))
    if tie == "first" and (patience is None or patience > K):
        return ops.nvfp4_search(*args, weights)
    return ops.nvfp4_mse(*args, *_rules(K - n_ext, patience, per_unit, tie), weights)


def _format_bounds(spec: QuantSpec) -> bool:
    """Whether the spec's codes are its format's (``mx_mse`` takes the format, not the
    spec): an integer element's ``[qmin, qmax]``; always for float elements."""
    fmt = spec.format
    return not isinstance(fmt, IntFormat) or (spec.qmin, spec.qmax) == (fmt.qmin, fmt.qmax)


def _rules(ext_start, patience, per_unit, tie) -> tuple:
    """``mse_select``'s rule arguments of the search's options."""
    # native per-unit patience waits for the global rule too, within the grid (mse_tiles)
    return (ext_start, -1 if patience is None else int(patience), bool(per_unit),
            patience is not None, tie == "last")


def _price_and_select(units, lo, hi, spec, f_lo, f_hi, patience, per_unit, tie, incumbent,
                      global_amax, step, n_ext, norm, weights, sq32):
    """``(idx, best)``: every candidate priced into ``[K + 1, U]`` errors, then selected."""
    dev, (K, U) = units.device, (f_lo.shape[0], units.shape[0])
    err = torch.empty((K + 1, U), dtype=torch.float64, device=dev)
    same = torch.empty((K, U), dtype=torch.bool, device=dev)
    for a in range(0, U, step):
        b = min(a + step, U)
        inc = None if incumbent is None else (incumbent[0][a:b], incumbent[1][a:b])
        err[:, a:b], same[:, a:b] = _price_chunk(
            units[a:b], lo[a:b], hi[a:b], f_lo, f_hi, inc, spec, global_amax, norm,
            None if weights is None else weights[a:b], sq32)
    return ops.mse_select(err[1:], same, err[0], *_rules(K - n_ext, patience, per_unit, tie))
