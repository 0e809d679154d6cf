"""AMD Quark's scale formulas, layouts and shapes, token count, error types and histogram
grids (part of :mod:`quantscope.compat.quark`, which re-exports the public names)."""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np
import torch

from .. import kernels
from ..formats import FloatFormat
from ..layout import Block, Channel, Group, Tensor
from . import UnsupportedInputError

__all__ = ["FP8_E5M3", "InvertedRangeError", "QuarkAssertionError", "StateShapeError",
           "UnsupportedElementError", "UnsupportedInputError", "quark_e8m0_scale",
           "quark_float_scale"]

#: Quark's unsigned E5M3 (bias 15, subnormals down to 2 ** -17, largest 1.75 * 2 ** 16: the
#: top code is not a number): the scale format of AMD's FP4 and of its second-level scales
FP8_E5M3 = FloatFormat("fp8_e5m3", 5, 3, 114688.0)
_F32_EPS = torch.finfo(torch.float32).eps
#: from this many elements the token count takes the rows' max and min (vectorized float
#: reductions), below it ``x.any(-1)`` (one op); both skip the bool copy of ``x != 0``
_AMAX_ROWS_FROM = 1 << 14
_COUNTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: numpy counts a CPU batch of these dtypes below this many elements in a fraction of torch's
#: time (float16: numpy's compare is emulated, slower from 4K elements); float32 / float64 at
#: any size on one torch thread (above these torch's reductions split over the threads)
_HOST_COUNT_BELOW = {torch.float32: 1 << 17, torch.float64: 1 << 17, torch.float16: 1 << 12}
#: the dtypes the C token count reads, by its code (csrc/unit_minmax.c, qs_nonzero_rows)
_KERNEL_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


class QuarkAssertionError(ValueError, AssertionError):
    """A qspec or argument Quark's observer asserts against: an ``AssertionError`` as Quark's,
    and a ``ValueError`` as quantscope's bad-argument errors."""


class UnsupportedElementError(QuarkAssertionError):
    """An element dtype a Quark observer refuses (an integer one in ``PerBlockMXObserver``, a
    float one Quark prices with its integer formula): an ``AssertionError`` as Quark's, and a
    ``ValueError`` as quantscope's bad-argument errors."""


class StateShapeError(ValueError, RuntimeError):
    """A batch whose Quark ``(rows, blocks)`` differ from a static ``PerBlockBFPObserver``'s
    state: a ``RuntimeError`` as Quark's (its ``torch.max`` of the two amax cannot broadcast),
    and a ``ValueError`` as quantscope's bad-input errors."""


class AxisRangeError(ValueError, IndexError):
    """A ``ch_axis`` the batch has no dimension for (a 1-D batch per channel along axis 1, a
    0-dim one): an ``IndexError`` as Quark's (its ``x.shape[ch_axis]``), and a ``ValueError``
    as quantscope's bad-input errors."""


class InvertedRangeError(ValueError, AssertionError, RuntimeError):
    """``min_val > max_val`` given to ``calculate_qparams``: Quark asserts (``AssertionError``
    on a 0-dim range, ``RuntimeError`` from ``torch._assert_async`` on a wider one); a
    ``ValueError`` as quantscope's bad-argument errors."""


def quark_e8m0_scale(amax: torch.Tensor, emax: int, mode: str, *, eps=_F32_EPS) -> torch.Tensor:
    """Quark's E8M0 ``floor`` / ``ceil`` scale ``2 ** (floor / ceil(log2 amax) - emax)``, in
    ``amax``'s dtype, not clamped to E8M0's range; a zero amax gives ``eps`` (Quark's fill).
    Quark's ``even`` mode is the native MX rule: :func:`quantscope.scales.e8m0_scale`."""
    if mode not in ("floor", "ceil"):
        raise ValueError(f"Unsupported scale_calculation_mode: {mode!r}; quark_e8m0_scale takes "
                         f"'floor' or 'ceil' (Quark's 'even' is the native MX rule, "
                         f"quantscope.scales.e8m0_scale(amax, fmt, 'even'))")
    rounding = torch.floor if mode == "floor" else torch.ceil
    scale = torch.pow(2, rounding(torch.log2(amax)) - emax)
    return scale.masked_fill(scale == 0.0, eps)


def quark_bfp16_scale(amax: torch.Tensor, native: torch.Tensor, max_vals: torch.Tensor, fmt,
                      scale_dtype: torch.dtype | None, eps: float) -> torch.Tensor:
    """Quark's BFP16 scale ``2 ** (floor(log2 amax) - 6)`` in ``amax``'s dtype (a half log2
    can round up to the next integer: a scale that never overflows), of the amax doubled where
    its forward finds the block overflowing; eps where it is 0 there. Where it is subnormal
    (float32 / bfloat16 blocks below ``2 ** -120``), or infinite (the doubled amax of a
    float16 block near 65504 overflows: Quark's scale is inf), the ``native`` scale (the
    'even' E8M0 rule's, in ``amax``'s dtype). ``max_vals``: the blocks' positive ends, in
    ``amax``'s shape; ``fmt``: the element format (int8); ``scale_dtype``: ``scale_type``'s."""
    floor = quark_e8m0_scale(amax, fmt.emax, "floor", eps=0.0)  # eps=0: finds the zeros
    flushed = floor.to(scale_dtype or floor.dtype) == 0
    # Quark's overflow: a code of 128, the block's positive end at 127.5 steps or more
    # (its negative end rounds to -128 at most, which int8 holds, where the native 'even'
    # rule bumps on either end: not there), or a scale that scale_type's dtype flushes
    # to 0 (float16 below 2 ** -24), whose codes Quark's forward finds overflowing, on a
    # block its fake-quantization does not round to 0
    top = fmt.qmax + 0.5  # the largest code's rounding edge: 127.5
    over = max_vals.to(amax.dtype) >= top * floor
    native = torch.where((native == 2 * floor) & ~over, floor, native)
    bumped = (floor > 0) & (over | (flushed & (amax > 2.0 ** -127)))
    floor = quark_e8m0_scale(torch.where(bumped, 2 * amax, amax), fmt.emax, "floor", eps=0.0)
    floor = torch.where(torch.isinf(floor), native, floor)  # never an infinite scale
    return torch.maximum(native, floor).masked_fill(floor == 0, eps)


def quark_float_scale(amax: torch.Tensor, quant_max: float, scale_format: str, *,
                      eps=_F32_EPS, first_level: float | None = None,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
    """Quark's ``get_scale`` for float32, e4m3 and e5m3 scales of ``amax`` (any shape).

    float32: ``amax / (first_level * quant_max)`` in one division when ``first_level``
    (Quark's ``quant_max_first_level``) is set, else ``amax / quant_max``; zeros -> ``eps``.
    e5m3: ``amax / quant_max``, zeros -> ``eps``, rounded to :data:`FP8_E5M3`. e4m3: NVFP4's
    two levels, the global amax being that of the ``amax`` given (Quark's order of operations,
    so the fp8 rounding sees the same float32 values). ``dtype``: Quark's ``scale_type``.
    """
    if scale_format == "float32":
        amax = amax if dtype is None else amax.to(dtype)
        scale = torch.div(amax, quant_max if first_level is None else first_level * quant_max)
        return scale.masked_fill(scale == 0.0, eps)
    if scale_format == "e5m3":
        scale = torch.div(amax, quant_max)
        scale = scale.masked_fill(scale == 0.0, eps)
        return FP8_E5M3.round(scale, 0.0, FP8_E5M3.max).to(scale.dtype)
    if scale_format == "e4m3":
        two_level = 448.0 * (quant_max / amax.max().float())
        scale = (amax.float() / quant_max * two_level).to(torch.float8_e4m3fn).float() / two_level
        return scale if dtype is None else scale.to(dtype)
    raise ValueError(f"quark: scale_format must be float32, e4m3 or e5m3 here (e8m0 is the "
                     f"native MX rule), got {scale_format!r}")


def quark_token_count(x: torch.Tensor) -> int | torch.Tensor:
    """Quark's token count of ``x`` (its forward counts 2-D+ batches, not empty), as
    :func:`_quark_token_count`: a Python int where the C kernel reads a contiguous CPU float32
    / bf16 / fp16 / float64 batch (``qs_nonzero_rows``: each row up to its first value that is
    not zero, a few ns on most rows) or numpy another CPU float32 / float64 / float16 one (no
    tensor op, no tensor to add the count with), else that function's 0-dim tensor (no host
    sync; traced by torch.compile / torch.export, which trace neither: ``kernels.lib`` is None
    there). Where the kernel would read a 0-dim ``x`` or one with an empty last axis, that
    function counts it (0 rows of no values, a 0-dim one a row), as the expression
    ``(x != 0).any(-1).sum()`` and numpy's ``any(-1)`` do (Quark's forward never counts
    those: it counts 2-D+ batches with values only, as forward calls this)."""
    code, shape = _KERNEL_CODES.get(x.dtype), x.shape
    if (code is not None and x.is_cpu and x.is_contiguous()
            and (lib := kernels.lib("unit_minmax")) is not None and kernels.real_tensor(x)):
        if shape and shape[-1]:  # (it divides by the last axis)
            return lib.qs_nonzero_rows(x.data_ptr(), x.numel() // shape[-1], shape[-1], code)
        return _quark_token_count(x)
    limit = _HOST_COUNT_BELOW.get(x.dtype)
    if (torch.compiler.is_compiling() or limit is None or not x.is_cpu or x.is_neg() or (
            x.numel() >= limit and (x.dtype == torch.float16 or torch.get_num_threads() > 1))
            or not kernels.real(x)):  # (numpy: memory with values, no lazy negation)
        return _quark_token_count(x)
    # numpy's any: a value != 0 (NaN counts, -0.0 does not), as torch's; any strides
    return int(np.count_nonzero((x.detach() if x.requires_grad else x).numpy().any(-1)))


def _quark_token_count(x: torch.Tensor) -> torch.Tensor:
    """Quark's ``record_observed_tokens`` count of ``x`` (any shape): its rows along
    the last axis that hold a value ``!= 0`` (NaN counts, -0.0 does not), int64 0-dim; the
    same count as Quark's ``(x != 0).any(-1)``, in a fraction of its time (no copy of x)."""
    x = x.detach()
    if x.dtype not in _COUNTED_DTYPES:  # (float8: Quark's own expression)
        return x.ne(0).any(-1).sum()
    if x.numel() < _AMAX_ROWS_FROM:
        return x.any(-1).sum()
    # a row is all zeros exactly where its max and min are (NaN propagates: counted)
    return x.amax(-1).ne(0).logical_or_(x.amin(-1).ne(0)).sum()


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, without the call where ``t`` has that dtype (a hot path's no-op)."""
    return t if t.dtype == dtype else t.to(dtype)


def _quark_int_default() -> tuple[torch.Tensor, torch.Tensor]:
    # Quark's answer for a range never observed (it warns and returns these)
    return torch.tensor([1.0]), torch.tensor([0])


def quark_work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype Quark's formulas compute in for a range (or input) of ``dtype``: its own, or
    float32 for integer / bool data (Quark divides it by Python floats), as compat.llmcompressor
    observes integer data in float32."""
    return dtype if dtype.is_floating_point else torch.float32


def quark_half_width(lo: torch.Tensor, hi: torch.Tensor, work: torch.dtype | None = None,
                     symmetric: bool = False) -> torch.Tensor | None:
    """Quark's integer range width (float32) where it rounds it to a float16 / bfloat16 range's
    dtype before it divides: asymmetric ``max(hi, 0) - min(lo, 0)``, ``symmetric`` the amax
    ``max(-min(lo, 0), max(hi, 0))``. None on a float32+ range, or where it overflows (float16:
    Quark's scale is inf, quantscope keeps the native finite). ``work``: the range's
    :func:`quark_work_dtype` where the caller knows it."""
    work = work or quark_work_dtype(torch.result_type(lo, hi))
    if torch.finfo(work).bits >= 32:
        return None
    neg, pos = lo.clamp(max=0).to(work), hi.clamp(min=0).to(work)
    width = (torch.maximum(-neg, pos) if symmetric else pos - neg).float()
    return width if bool(width.isfinite().all()) else None


def quark_float64_scale(lo: torch.Tensor, hi: torch.Tensor, spec, eps: float) -> torch.Tensor:
    """Quark's integer scale of a float64 range, divided in float64 as its formula runs there
    (the native divides in float32: other last bits): ``amax / ((qmax - qmin) / 2)``
    symmetric, else ``(max(hi, 0) - min(lo, 0)) / (qmax - qmin)``; at least ``eps``."""
    neg, pos = lo.double().clamp(max=0), hi.double().clamp(min=0)
    steps = float(spec.qmax - spec.qmin)
    width = torch.maximum(-neg, pos) if spec.symmetric else pos - neg
    return (width / (steps / 2 if spec.symmetric else steps)).clamp(min=eps)


def _quark_int_scale_dtype(work: torch.dtype, zero_dim: bool,
                           eps_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype of Quark's integer scale of a range (no ``scale_type``): the range's ``work``
    dtype (:func:`quark_work_dtype`), promoted with its eps buffer's dtype (float32 unless a
    module cast changed it) when the range is 0-dim (``zero_dim``), as Quark's clamp by that
    0-dim buffer promotes it (a 1-dim+ range keeps its dtype)."""
    return torch.promote_types(work, eps_dtype) if zero_dim and work != eps_dtype else work


def _quark_rows(t: torch.Tensor, shape, axis: int) -> torch.Tensor:
    """Per-group values shaped ``(dims but axis..., groups)`` as Quark's ``(rows, groups)``:
    Quark swaps ``axis`` with the last dim before it flattens the rows, so for a 3-D or
    wider tensor grouped along an inner axis its rows come in another order."""
    n, a = len(shape), axis % len(shape)
    if a == n - 1:  # the last axis: the rows are in order (no permute to dispatch)
        return t.reshape(-1, t.shape[-1])
    ours = [d for d in range(n) if d != a]
    theirs = [n - 1 if d == a else d for d in range(n - 1)]
    return t.permute(*[ours.index(d) for d in theirs], n - 1).reshape(-1, t.shape[-1])


def _quark_layout(qscheme: str, ch_axis, group_size, pad_blocks: bool):
    """The layout of a float32-scaled qscheme (quark_spec's)."""
    if qscheme == "per_tensor":
        return Tensor()
    if qscheme == "per_channel":
        if ch_axis is None:  # Quark's observer raises this at its first batch
            raise ValueError("quark: qscheme per_channel needs a ch_axis (Quark's observer: "
                             "'ch_axis cannot be None')")
        return Channel(ch_axis)
    if qscheme == "per_group":
        if not group_size:
            raise ValueError("quark: qscheme per_group needs a group_size")
        if group_size == -1:  # Quark sizes it by the first batch; a layout's size is fixed
            raise ValueError("quark: group_size=-1 (Quark: one group the whole ch_axis long) "
                             "is not taken: give the axis's length, which gives Quark's values")
        if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or \
                group_size < 1:  # (numpy's integers taken, as Python's)
            raise ValueError(f"quark: group_size must be a positive integer, got {group_size!r}")
        return (Block if pad_blocks else Group)(int(group_size),
                                                -1 if ch_axis is None else ch_axis)
    raise ValueError(f"quark: qscheme must be per_tensor, per_channel or per_group, got "
                     f"{qscheme!r}")


def _quark_edges(hist) -> torch.Tensor:
    """Quark's bin edges ``torch.linspace(lo, hi, bins + 1)`` per row ``[U, B + 1]``: torch's
    linspace counts its upper half down from ``hi``, so ``lo + i * width`` differs in the last
    bits (and with it the percentile / MSE thresholds, which are edges or centres)."""
    return torch.stack([torch.linspace(lo, hi, hist.bins + 1, device=hist.lo.device)
                        for lo, hi in zip(hist.lo.tolist(), hist.hi.tolist(), strict=True)])


@dataclasses.dataclass
class _QuarkGrid:
    """Quark's histogram of one row once a batch left its first range: its counts
    (``calib_hist``, float32), edges (``calib_bin_edges``) and ``_num_bins``, which Quark
    keeps apart from the edges (its ``arange`` may give one edge more or less)."""

    counts: torch.Tensor
    edges: torch.Tensor
    bins: int

    def grow(self, x: torch.Tensor, x_min: float, x_max: float) -> bool:
        """Quark's step for a batch ``x`` (float32, zeros dropped if skipped) with ends
        ``[x_min, x_max]`` (Python floats, compared and subtracted in the edges' float32):
        bins of the current width appended below / above, then the batch binned over all
        bins and the old counts added to the first ones (also where the range grew below:
        Quark's order). True where bins were appended (Quark's new float32 edges)."""
        edges = self.edges
        if x_min < edges[0]:
            width = (edges[1] - edges[0]).item()
            self.bins += int(((edges[0] - x_min) / width).ceil().item())
            edges = torch.arange(x_min - width, edges[-1].item(), width, device=edges.device)
        if x_max > edges[-1]:
            width = (edges[1] - edges[0]).item()
            self.bins += int(((x_max - edges[-1]) / width).ceil().item())
            edges = torch.arange(edges[0].item(), x_max + width, width, device=edges.device)
        counts = torch.histc(x.to(edges.device), bins=self.bins, min=edges[0].item(),
                             max=edges[-1].item())
        counts[:self.counts.numel()] += self.counts
        widened = edges is not self.edges
        self.counts, self.edges = counts, edges
        return widened


_WIDE = {torch.float32, torch.float64}  # a module cast to these keeps a float32 state finite


def _refuse_overflow(observer, state) -> None:
    """Raise where a module cast (``.half()``) turned Quark's ``state`` (tensors) inf."""
    bad = [t.dtype for t in state if bool(t.isinf().any())]
    if bad:
        from .torch_ao import StateOverflowError  # (not loaded with compat.quark)
        to = "" if bad[0] in _WIDE else f" to {bad[0]} (max {torch.finfo(bad[0]).max:.6g})"
        raise StateOverflowError(
            f"{observer.describe()}: a module cast{to} overflowed its state, or Quark's search "
            f"in its dtype (inf: Quark's class fails or prices inf there too); keep the "
            f"observer in float32 or bfloat16, or reset() it")
