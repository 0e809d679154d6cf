"""Per-unit streaming histograms with exact merges.

Every histogram observer keeps, per unit, ``bins`` int64 counts on a grid of
bin width ``w = 2 ** e`` aligned to multiples of ``w`` (bin ``i`` of a unit holds
``[(first + i) w, (first + i + 1) w)``). Because the grid is aligned to a shared
origin (zero) and widths are powers of two:

* a value's bin is ``floor(x * 2 ** -e)``, exact in float32 (multiplying by a power
  of two is exact), so it never depends on the batch the value came in;
* when the range grows, bins merge by ``2 ** m`` (integer floor division of the
  absolute bin index): exact, no interpolation;
* ``e`` is the smallest exponent whose grid holds the unit's range and zero in
  ``bins`` bins (and at least ``exponent(amax) - 22``, so bin indices stay
  below ``2 ** 23``); it depends only on the range seen, so the same data in any
  batch order, or split across processes and merged, gives the same counts. One limit:
  a negative value below ``2 ** (e - 150)`` (a unit whose data spans more than about
  ``2 ** 140``) makes ``x * 2 ** -e`` underflow to ``-0``, so it counts in bin 0 or bin
  -1 depending on the grid it was binned on; both hold values within ``2 ** e`` of zero
  (the running min / max are unaffected).

Memory is fixed: ``bins`` counts per unit; the range occupies between half and
all of them. ``absolute=True`` histograms ``|x|`` from zero (``first = 0``).

:class:`Hist` is the read-only view estimators take: counts, the left edge of bin
0 and the right edge of the last bin per unit (bin width ``(hi - lo) / bins``).
The same view describes a reference grid (torch.ao / Quark: ``bins`` bins
between the first batch's min and max), so the estimators serve both;
:func:`linear_counts` bins values exactly as ``torch.histc`` does, but for finite ends
whose span overflows float32 (beyond ~1.7e38 each side): torch then counts nothing, here
every value in the range goes to bin 0 (:func:`binned_counts`), so that the estimators read
the data's min and max rather than an empty histogram.

The torch code here is the reference; on CPU ``add_values`` and ``update``'s grid
change run as C kernels that equal it bitwise (:mod:`.hist_kernel`, which says
what each pass cost).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._numerics import as_float32
from . import hist_kernel

__all__ = ["E_MAX", "E_MIN", "STATE_BUFFERS", "Hist", "HistState", "add_values", "binned_counts",
           "check_state", "empty_state", "fold_abs", "grid_exponent", "grid_first",
           "linear_counts", "merge", "normal_width", "padding_zeros", "pow2", "rebin", "scaled",
           "union_grid", "update", "view"]

E_MIN, E_MAX = -126, 126  # 2**e and 2**-e both normal float32
_MAG_BITS = 22  # bin indices stay below 2**23: exact in float32 and int32


class Hist(NamedTuple):
    """A histogram as estimators see it: ``counts [U, B]`` int64, bin 0 starts at ``lo [U]``,
    the last bin ends at ``hi [U]``; ``absolute`` if it counts ``|x|``. ``step``: the bin
    width ``(hi - lo) / B`` if already computed (:func:`view`, :func:`fold_abs`; the
    estimators read it a dozen times per estimate), else None."""

    counts: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    absolute: bool = False
    step: torch.Tensor | None = None

    @property
    def bins(self) -> int:
        return self.counts.shape[-1]

    @property
    def width(self) -> torch.Tensor:
        """Bin width per unit ``[U]`` (float32, as torch.ao computes it)."""
        return self.step if self.step is not None else _width(self.lo, self.hi, self.bins)

    def edges(self) -> torch.Tensor:
        """Left edges of every bin and the right edge of the last, ``[U, B + 1]``."""
        i = torch.arange(self.bins + 1, device=self.lo.device, dtype=torch.float32)
        return self.lo[:, None] + i * self.width[:, None]

    def centers(self) -> torch.Tensor:
        """Bin centres ``[U, B]``."""
        i = torch.arange(self.bins, device=self.lo.device, dtype=torch.float32) + 0.5
        return self.lo[:, None] + i * self.width[:, None]


def _width(lo: torch.Tensor, hi: torch.Tensor, bins: int) -> torch.Tensor:
    return (hi - lo) / bins


class HistState(NamedTuple):
    """The streaming state: ``counts [U, B]`` int64, exponent ``exp [U]`` int64, absolute
    index ``first [U]`` int64 of bin 0, and the running ``lo``, ``hi`` of the data [U]."""

    counts: torch.Tensor
    exp: torch.Tensor
    first: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor


#: the buffers a histogram observer keeps its :class:`HistState` in, in its order (the
#: observers' and their cached CPU step's one list)
STATE_BUFFERS = ("hist_counts", "hist_exp", "hist_first", "hist_lo", "hist_hi")


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exactly ``2.0 ** e`` as float32 for integer ``e`` in ``[-126, 127]`` (from the bits)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _fits(lo, hi, e, bins):
    inv = pow2(-e)
    return (torch.floor(hi * inv) - torch.floor(lo * inv) + 1) <= bins


def grid_exponent(lo: torch.Tensor, hi: torch.Tensor, bins: int) -> torch.Tensor:
    """Smallest ``e`` (int64 ``[U]``) whose aligned grid of width ``2 ** e`` covers ``[lo, hi]``
    in ``bins`` bins; never below ``exponent(amax) - 22``, clamped to ``[E_MIN, E_MAX]``.

    Monotone in the interval, so the exponent of a union is that of the data it holds,
    whatever the order the data came in.
    """
    lo, hi = lo.float(), hi.float()
    span = hi.double() - lo.double()
    guess = torch.ceil(torch.log2(span / (bins - 1))).nan_to_num(nan=0.0, posinf=E_MAX,
                                                                  neginf=E_MIN)
    guess = guess.clamp(E_MIN, E_MAX).long()
    e = torch.full_like(guess, E_MAX)
    for d in (1, 0, -1, -2):  # exact test around the estimate; keep the smallest that fits
        cand = (guess + d).clamp(E_MIN, E_MAX)
        e = torch.where(_fits(lo, hi, cand, bins), torch.minimum(e, cand), e)
    amax = torch.maximum(lo.abs(), hi.abs())
    # the magnitude floor only where there is a magnitude: frexp(0) reads 0, not -inf
    mag = torch.where(amax > 0, torch.frexp(amax).exponent.long() - 1 - _MAG_BITS, E_MIN)
    return torch.maximum(e, mag).clamp(E_MIN, E_MAX)


def grid_first(lo: torch.Tensor, e: torch.Tensor, absolute: bool) -> torch.Tensor:
    """Absolute index of bin 0: the bin of ``lo`` (0 for ``|x|`` histograms)."""
    if absolute:
        return torch.zeros_like(e)
    return torch.floor(lo.float() * pow2(-e)).long()


def rebin(counts: torch.Tensor, exp: torch.Tensor, first: torch.Tensor,
          new_exp: torch.Tensor, new_first: torch.Tensor) -> torch.Tensor:
    """``counts`` moved exactly onto the coarser (or equal) grid ``(new_exp, new_first)``.

    Bin ``first + i`` at width ``2 ** exp`` lies inside bin ``floor((first + i) / 2 ** m)``
    at width ``2 ** (exp + m)``: each old bin goes whole into one new bin. Needs
    ``new_exp >= exp`` and the old data inside the new grid (empty bins may fall
    outside; they are dropped).
    """
    _U, B = counts.shape
    m = (new_exp - exp).clamp(0, 62)
    absolute = first[:, None] + torch.arange(B, device=counts.device)
    idx = torch.div(absolute, (1 << m)[:, None], rounding_mode="floor") - new_first[:, None]
    idx = idx.clamp_(0, B - 1)
    return torch.zeros_like(counts).scatter_add_(1, idx, counts)


_CHUNK = 1 << 18  # elements per pass: temporaries stay in cache and are reused, not page-faulted


def add_values(counts: torch.Tensor, units: torch.Tensor, exp: torch.Tensor,
               first: torch.Tensor, absolute: bool = False) -> torch.Tensor:
    """Add every value of ``units [U, E]`` (``|x|`` of them if ``absolute``) to ``counts``
    (in place) on the grid ``(exp, first)``; values off the grid are clamped into the end
    bins (the caller sizes the grid so that none are), NaN into bin 0.

    Off the CPU the op ``quantscope::hist_add`` does it (:mod:`.hist_ops`, registered
    with this package: the Triton kernel on CUDA), else :func:`bin_values`.
    """
    if units.device.type != "cpu":
        torch.ops.quantscope.hist_add(counts, units, exp, first, absolute)
        return counts
    return bin_values(counts, units, exp, first, absolute)


def bin_values(counts: torch.Tensor, units: torch.Tensor, exp: torch.Tensor,
               first: torch.Tensor, absolute: bool = False) -> torch.Tensor:
    """:func:`add_values` here, without the op: on the CPU (float32 / bf16 / fp16) a C
    kernel (:mod:`.hist_kernel`), else the torch code below, the reference it equals (it
    reads bf16 / fp16 exactly too: the products with ``2 ** -e`` are float32)."""
    if hist_kernel.bin_values(counts, units, exp, first, absolute):
        return counts
    return _add_values_torch(counts, units, exp, first, absolute)


def _add_values_torch(counts, units, exp, first, absolute=False):
    U, B = counts.shape
    inv = pow2(-exp)
    if U == 1:  # one unit: 1-D ops are much faster than the row-wise ones
        flat, f = units.reshape(-1), first.float()
        one = torch.ones(1, dtype=counts.dtype, device=counts.device)
        for s, e in _spans(flat.numel(), _CHUNK):
            idx = _bin(flat[s:e] * inv, f, B, absolute)
            counts.view(-1).index_add_(0, idx, one.expand(idx.numel()))
        return counts
    cols = max(1, _CHUNK // U)
    f, inv = first.float()[:, None], inv[:, None]
    one = torch.ones(1, 1, dtype=counts.dtype, device=counts.device)
    for s, e in _spans(units.shape[1], cols):
        idx = _bin(units[:, s:e] * inv, f, B, absolute).long()
        counts.scatter_add_(1, idx, one.expand_as(idx))
    return counts


def _spans(n, step) -> list[tuple[int, int]]:
    """``(start, stop)`` of each pass over ``n`` values; compiled, one pass: a loop over a
    symbolic size guards on it (one graph per token count)."""
    if torch.compiler.is_compiling():
        return [(0, n)]
    return [(s, s + step) for s in range(0, n, step)]


def _bin(t, first, bins, absolute):
    if absolute:
        t.abs_()  # |x| * 2**-e == |x * 2**-e|: exact, and no extra copy of the data
    # NaN (non-finite input, reported by the observer later) to bin 0: a defined index
    return t.floor_().sub_(first).clamp_(0, bins - 1).nan_to_num_(0.0).to(torch.int32)


def padding_zeros(units: torch.Tensor, parts) -> torch.Tensor | None:
    """How many padding zeros every unit of ``units [U, E]`` holds (int64 ``[U]``), from its
    padded ``parts`` (:meth:`quantscope.layout.Layout.padded_parts`); None: no padding. An
    observer takes them out of the bin of zero after :func:`update` (no host sync)."""
    if not parts:
        return None
    n = torch.zeros(units.shape[0], dtype=torch.int64, device=units.device)
    for idx, vals in parts:
        n.index_fill_(0, idx, units.shape[1] - vals.shape[1])
    return n


def empty_state(units: int, bins: int, device=None) -> HistState:
    """A state that has seen nothing (exponent ``E_MIN``, empty range)."""
    z = torch.zeros(units, dtype=torch.int64, device=device)
    return HistState(torch.zeros(units, bins, dtype=torch.int64, device=device),
                     torch.full_like(z, E_MIN), z.clone(),
                     torch.full((units,), float("inf"), dtype=torch.float32, device=device),
                     torch.full((units,), float("-inf"), dtype=torch.float32, device=device))


def union_grid(lo, hi, exp, bins: int, absolute: bool):
    """The grid ``(exp, first)`` of the range ``[lo, hi]``, at least exponent ``exp``; where
    the range is empty (``lo > hi``: the unit saw nothing) :func:`empty_state`'s ``(E_MIN, 0)``."""
    empty = lo > hi
    e = torch.maximum(exp, grid_exponent(lo, hi, bins)).masked_fill(empty, E_MIN)
    return e, grid_first(lo, e, absolute).masked_fill(empty, 0)


def _regrid(state: HistState, lo, hi, bins, absolute, exp=None) -> HistState:
    """``state`` re-binned onto the grid of its range joined with ``[lo, hi]`` (and at least
    exponent ``exp``, another histogram's, for a merge); where the joined range is empty
    (a merge of two empty states) the state stays :func:`empty_state`'s."""
    lo = torch.minimum(state.lo, lo)
    hi = torch.maximum(state.hi, hi)
    least = state.exp if exp is None else torch.maximum(state.exp, exp)
    e, first = union_grid(lo, hi, least, bins, absolute)
    counts = rebin(state.counts, state.exp, state.first, e, first)
    return HistState(counts, e, first, lo, hi)


def update(state: HistState, units: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
           absolute: bool = False, inplace: bool = False) -> HistState:
    """The state after observing ``units [U, E]`` whose per-unit min / max are ``lo``, ``hi``.

    No host synchronisation: the grid change is tensor math (on CPU a C kernel,
    :func:`.hist_kernel.regrid`: the same arithmetic without the fixed cost of some 60
    one-element torch ops; off the CPU the op ``quantscope::hist_regrid_``, :mod:`.hist_ops`:
    one Triton launch on CUDA).

    ``state`` is not modified, unless ``inplace``: then its tensors may be updated in place
    and returned (the caller gives ``state`` up): a batch inside the grid costs O(values)."""
    if units.device.type != "cpu":
        new = state if inplace else HistState(*(t.clone() for t in state))
        torch.ops.quantscope.hist_regrid_(*new, lo.float(), hi.float(), absolute)
    else:
        new = hist_kernel.regrid(state, lo, hi, absolute, inplace)
    state = HistState(*new) if new is not None else _update_grid(state, lo, hi, absolute)
    add_values(state.counts, units, state.exp, state.first, absolute)
    return state


def _update_grid(state: HistState, lo, hi, absolute: bool) -> HistState:
    """``update``'s grid change in torch (the reference of :func:`.hist_kernel.regrid`)."""
    if absolute:
        hi = torch.maximum(lo.abs(), hi.abs())
        lo = torch.zeros_like(hi)
    else:  # the grid always holds zero (every quantization range does): |x| folds exactly
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    return _regrid(state, lo.float(), hi.float(), state.counts.shape[1], absolute)


def merge(a: HistState, b: HistState, absolute: bool = False) -> HistState:
    """Exact merge: both re-binned onto the common grid of the union, counts added.

    ``merge(a, b)`` equals, bitwise, the state of one observer that saw both data sets
    (up to a negative value below ``2 ** (e - 150)``, which counts in bin 0 or -1 by the
    grid it was binned on: see the module doc); two empty states merge to an empty one.
    """
    bins = a.counts.shape[1]
    if b.counts.shape != a.counts.shape:
        raise ValueError(f"merge: histograms of shapes {tuple(a.counts.shape)} and "
                         f"{tuple(b.counts.shape)} cannot merge")
    s = _regrid(a, b.lo, b.hi, bins, absolute, b.exp)
    return s._replace(counts=s.counts + rebin(b.counts, b.exp, b.first, s.exp, s.first))


def view(state: HistState, absolute: bool = False) -> Hist:
    """The estimator view of a state: edges ``first * w`` and ``(first + B) * w`` (exact)."""
    w = pow2(state.exp)
    bins = state.counts.shape[1]
    lo, hi = state.first.float() * w, (state.first + bins).float() * w
    return Hist(state.counts, lo, hi, absolute, w)  # (hi - lo) / bins is w exactly


_HISTC_ROWS = 64  # up to this many rows, torch.histc row by row beats one bincount (12x at 8M)
_HISTC_CHUNK = 1 << 24  # float32 counts are exact up to 2 ** 24


def linear_counts(units: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                  bins: int) -> torch.Tensor:
    """``torch.histc(u, bins, min=lo, max=hi)`` of every row, as int64 counts ``[U, bins]``
    (int64: they do not saturate at ``2 ** 24``).

    A few float32 rows on the CPU over finite, non-empty ranges go to ``torch.histc`` itself,
    in chunks of ``2 ** 24`` values whose float32 counts are exact; every other case to
    :func:`binned_counts`, its emulation.
    """
    lo, hi = lo.float(), hi.float()
    span = hi - lo
    if units.device.type == "cpu" and units.dtype == torch.float32 and \
            0 < units.shape[0] <= _HISTC_ROWS and bool(((span > 0) & span.isfinite()).all()):
        return torch.stack([exact_histc(row, bins, a, b)
                            for row, a, b in zip(units, lo.tolist(), hi.tolist(), strict=True)])
    return binned_counts(units, lo, hi, bins)


def _histc_refused(x: torch.Tensor) -> bool:
    """Whether torch.histc raises on ``x``: on CUDA under deterministic algorithms."""
    return x.device.type == "cuda" and torch.are_deterministic_algorithms_enabled()


def exact_histc(x: torch.Tensor, bins: int, lo: float, hi: float) -> torch.Tensor:
    """``torch.histc`` of ``x``'s float32 values as int64 counts ``[bins]``: binned in chunks of
    ``2 ** 24`` values, whose float32 counts are exact, and summed (one call's float32 counts
    stop growing at ``2 ** 24``). An empty range (``lo == hi`` in float32), where histc takes
    the range from the data, is binned at once. On CUDA under deterministic algorithms, where
    torch.histc raises, :func:`binned_counts` bins each chunk over :func:`histc_ends`."""
    x = x.reshape(-1)
    deterministic = _histc_refused(x)
    if not deterministic and (x.numel() <= _HISTC_CHUNK or as_float32(lo) == as_float32(hi)):
        return torch.histc(x.float(), bins, lo, hi).long()
    counts = torch.zeros(bins, dtype=torch.int64, device=x.device)
    ends = histc_ends(x, lo, hi) if deterministic else None
    for part in x.split(_HISTC_CHUNK):
        counts += (binned_counts(part.float()[None], *ends, bins)[0] if deterministic
                   else torch.histc(part.float(), bins, lo, hi).long())
    return counts


def histc_ends(x: torch.Tensor, lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 ends ``[1]`` torch.histc bins ``x`` between: ``lo`` and ``hi``, but where
    float32 cannot tell them apart (as CUDA's histc compares them; the documented ``0, 0``)
    the data's min and max, and an empty range widened (:func:`widen_empty`). Raises
    RuntimeError, as histc, where they are not finite (NaN or an infinity in the data)."""
    lo32, hi32 = as_float32(lo), as_float32(hi)
    ends = (torch.stack(torch.aminmax(x.reshape(-1))).float() if lo32 == hi32 and x.numel()
            else torch.tensor([lo32, hi32], dtype=torch.float32, device=x.device))
    a, b = widen_empty(ends[:1], ends[1:])
    if not bool(torch.cat([a, b]).isfinite().all()):  # a read back, as CUDA's histc's own
        raise RuntimeError(f"torch.histc: range of [{float(a):g}, {float(b):g}] is not finite")
    return a, b


def widen_empty(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``lo``, ``hi`` with each empty range (``lo == hi``) widened as torch.histc does
    once it has taken the data's range for it (:func:`histc_ends`): by one on each side, or
    where that moves no end (``|x| >= 2 ** 24``) to the float32 neighbour (ATen's wider step)."""
    big, same = torch.finfo(torch.float32).max, lo == hi
    return (torch.where(same, torch.minimum(lo - 1, lo.nextafter(lo.new_tensor(-big))), lo),
            torch.where(same, torch.maximum(hi + 1, hi.nextafter(hi.new_tensor(big))), hi))


def binned_counts(units: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                  bins: int) -> torch.Tensor:
    """:func:`linear_counts` for any rows, dtype and device: the same float32 arithmetic as
    ATen's histc kernel, ``trunc((x - lo) * bins / (hi - lo))``, the right edge inclusive,
    values outside ``[lo, hi]`` dropped and an empty range widened (:func:`widen_empty`), so
    the bins match torch's exactly, in one ``bincount`` over every row."""
    U = units.shape[0]
    lo, hi = widen_empty(lo.float(), hi.float())
    # a range that overflows float32 gives inf / inf: those values go to the first bin
    # (torch.ao's qparams then come from min / max alone), never a NaN index. A value whose
    # (x - lo) * bins overflows (|x| past ~3.4e38 / bins) has position +inf, which histc
    # counts in bin 0 (ATen's int64 cast of inf, on x86-64), so here too; -inf needs x < lo
    pos = ((units - lo[:, None]) * bins / (hi - lo)[:, None]).trunc_().nan_to_num_(0.0, posinf=0.0)
    inside = (units >= lo[:, None]) & (units <= hi[:, None])
    pos = pos.clamp_(0, bins - 1).long()
    pos = torch.where(inside, pos + torch.arange(U, device=units.device)[:, None] * bins,
                      U * bins)
    return torch.bincount(pos.reshape(-1), minlength=U * bins + 1)[:-1].reshape(U, bins)


def normal_width(hist: Hist, common: bool = False) -> tuple[Hist, torch.Tensor | None]:
    """``hist`` on a grid whose bin width is a normal float32, and the float64 factors
    ``[U]`` that take its values back (:func:`scaled`); ``(hist, None)`` where every width is.

    A first grid over subnormal-only data (``bins`` bins over ``[lo, hi]``, as torch.histc)
    has a width ``(hi - lo) / bins`` that float32 rounds coarsely, or to 0, where every edge
    and candidate reads ``lo``. Such a unit is scaled by a power of two (exactly) to
    ``max(|lo|, |hi|)`` in ``[0.5, 1)``, where the estimators' arithmetic is that of normal
    data (they are scale-equivariant: the estimate scaled back is that of the data scaled up,
    rounded once). ``common``: every unit scaled by the largest one's factor (a global scale's
    ratios kept). The power-of-two grid's widths (at least ``2 ** E_MIN``) are normal."""
    under = (hist.width < torch.finfo(torch.float32).tiny) & (hist.hi > hist.lo)
    if not bool(under.any()):
        return hist, None
    top = torch.maximum(hist.lo.abs(), hist.hi.abs())
    e = torch.frexp(top.amax().expand_as(top) if common else top).exponent
    back = torch.ldexp(torch.ones_like(top, dtype=torch.float64), torch.where(
        under | common, e, 0))  # 2 ** 148 is past float32: the factors in float64
    lo, hi = scaled(hist.lo, 1 / back), scaled(hist.hi, 1 / back)
    return Hist(hist.counts, lo, hi, hist.absolute), back


def scaled(values: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``values [U]`` (or ``[U, ...]``) times the float64 ``factor [U]``, rounded once to
    float32 (:func:`normal_width`'s factors: exact unless the result is subnormal); a 0-d
    value (tensor-wide: a global amax) takes the first factor (``common`` ones are all one)."""
    f = factor.reshape(-1, *([1] * (values.dim() - 1))) if values.dim() else factor[0]
    return (values.double() * f).float()


def fold_abs(hist: Hist) -> Hist:
    """The ``|x|`` histogram of a signed one on a grid aligned to zero (exact up to values on
    a bin edge of the negative side, which land one bin lower).

    Needs ``lo = first * w`` with integer ``first`` (the native grid). Returns ``B`` bins
    from zero, of the same width.
    """
    if hist.absolute:
        return hist
    _U, B = hist.counts.shape
    w = hist.width
    first = torch.round(hist.lo / w).long()
    k = first[:, None] + torch.arange(B, device=hist.counts.device)  # absolute bin index
    idx = (k ^ (k >> 63)).clamp_(0, B - 1)  # bin ~k = -1 - k of |x| for k < 0
    counts = torch.zeros_like(hist.counts).scatter_add_(1, idx, hist.counts)
    hi = w * B
    return Hist(counts, torch.zeros_like(hist.lo), hi, True, hi / B)  # (hi - 0) / B


def check_state(who: str, state_dict, prefix: str, bins: int, grow_limit: int,
                first_grid: bool = True) -> None:
    """Refuse a saved histogram state (``{prefix}hist_counts`` / ``hist_exp`` / ``hist_first``)
    an observer of ``bins`` bins cannot take: another bin count (up to ``grow_limit`` times as
    many: grown), a first-batch grid's counts where the observer reads only the native grid
    (``first_grid`` False: it would read them as power-of-two bins), negative counts or a
    unit's total past 2**62, grid exponents outside ``[E_MIN, E_MAX]`` (binning needs 2**e
    and 2**-e normal), or a native grid that does not start where :func:`grid_first` puts
    it: each would estimate a wrong range without a word."""
    counts, exp, first, lo, linear = (state_dict.get(prefix + k) for k in (
        "hist_counts", "hist_exp", "hist_first", "hist_lo", "linear_grid"))
    if not first_grid and isinstance(linear, torch.Tensor) and not linear.is_meta and \
            bool(linear.any()):
        raise ValueError(f"{who}: cannot load {prefix}linear_grid: the state's histogram is "
                         f"on a first-batch grid (grid='first'), which this observer does not "
                         f"read; construct it with grid='first'")
    if counts is not None and counts.dim() == 2 and \
            not bins <= counts.shape[1] <= bins * grow_limit:
        raise ValueError(f"{who}: cannot load a histogram of {counts.shape[1]} bins into one "
                         f"of bins={bins}; construct the observer with bins={counts.shape[1]}")
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in (counts, exp, first, lo)):
        return  # a skeleton's state (assign=True): no values to check
    if isinstance(counts, torch.Tensor) and counts.numel() and not (
            bool((counts >= 0).all()) and float(counts.double().sum(-1).max()) < 2.0 ** 62):
        raise ValueError(f"{who}: cannot load {prefix}hist_counts: counts must be >= 0 and "
                         f"total under 2**62 per unit")
    if isinstance(exp, torch.Tensor) and exp.numel() and not bool(
            ((exp >= E_MIN) & (exp <= E_MAX)).all()):
        raise ValueError(f"{who}: cannot load {prefix}hist_exp: its grid exponents must lie "
                         f"in [{E_MIN}, {E_MAX}], got [{int(exp.min())}, {int(exp.max())}]")
    native = linear is None or not bool(linear)  # a first grid keeps no bin index
    whole = all(isinstance(t, torch.Tensor) for t in (first, exp, lo))  # else: "partial"
    if native and whole and first.numel() and first.shape == exp.shape == lo.shape:
        seen = lo.isfinite()  # an empty unit keeps first = 0
        # 0 throughout (|x|) or the bin of hist_lo throughout (x); the record tells which the
        # observer takes, with its own message
        if not (bool((first[seen] == 0).all())
                or bool((first == grid_first(lo, exp, False))[seen].all())):
            raise ValueError(f"{who}: cannot load {prefix}hist_first: a native grid starts "
                             f"at 0 (|x|) or at the bin of hist_lo (x); the state is not one "
                             f"an observer wrote")
