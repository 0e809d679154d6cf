"""Scoring candidate ranges on a histogram: :class:`HistogramScorer` (the one scoring
function that ``histogram_mse``, ``mix`` and ``l2`` share) and the searches along a
:class:`Line` of candidates. :func:`~quantscope.estimators.error.histogram_error` is its
one-call form.

Every bin stands for its count of values at its centre, as ModelOpt and Quark
score: ``error = sum_i count_i * (fake_quant(c_i) - c_i) ** 2``. The scale of a
candidate comes from :func:`quantscope.qparams_from_range` (so scale encodings
and zero points are those that run).

On CPU a small C kernel (:mod:`quantscope.kernels`) scores the candidates: the same
float32 operations per point as :func:`fake_quantize_units` (integer formats: divide, add
the zero point, round half to even, clamp, subtract, multiply; float element formats, MX
and NVFP4 blocks included: divide, ``FloatFormat.round``'s steps, multiply, subtract), so
the same quantized values; only the float64 sum runs in another order (tests compare it
with the torch path to 1e-12). With fp32 scales (integer formats) the kernel also derives
each candidate's scale and zero point itself (``kernels/csrc/qs_qparams.h``, bitwise
``qparams_from_range``), and a search along a :class:`Line` builds only the candidates
it visits: one C call per line instead of some thirty small torch ops. The torch path
stays the reference and the fallback.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import torch

from .. import kernels
from .._checks import check_int
from ..formats import FloatFormat, IntFormat
from ..qdq import fake_quantize_units
from ..qparams import amax_of_range, qparams_from_range
from ..spec import QuantSpec
from ..stats.histogram import Hist

__all__ = ["ELEMENT_BUDGET", "MOVE_HI", "MOVE_LO", "SYMMETRIC", "HistogramScorer", "Line",
           "LineBest", "tensor_amax"]

#: elements of one chunk of the ``[units, candidates, bins]`` work (bounded memory)
ELEMENT_BUDGET = 1 << 18


def _kernel():
    return kernels.lib("hist_error")


def tensor_amax(spec: QuantSpec, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor | None:
    """A global-scale spec's (NVFP4) tensor-wide ``max |x|`` from the data's per-unit
    ``lo``, ``hi`` ``[U]``: the global amax its candidates are scored, and its qparams run,
    under (None for other specs, or no data)."""
    if not spec.scale.has_global_scale or not lo.numel():
        return None
    return amax_of_range(lo.amin(), hi.amax())


class HistogramScorer:
    """:func:`~quantscope.estimators.error.histogram_error` of one histogram for many
    candidate sets: the occupied bins' points and weights are prepared once (searches score
    several rounds of candidates).
    ``global_amax``: a global-scale spec's (NVFP4) tensor-wide ``max |x|``, required there."""

    def __init__(self, hist: Hist, spec: QuantSpec, *, centers: torch.Tensor | None = None,
                 points: int = 1, backend: str | None = None,
                 global_amax: torch.Tensor | None = None):
        if spec.scale.has_global_scale and global_amax is None:
            raise ValueError(f"HistogramScorer: {spec} has a global scale: pass global_amax "
                             f"(the tensor's max |x|), the one its qparams run under")
        points = check_int("HistogramScorer", "points", points, 1)
        self.spec, self.units = spec, hist.counts.shape[0]
        self.global_amax = global_amax
        applies = (hist.counts.device.type == "cpu" and hist.counts.dtype == torch.int64
                   and isinstance(spec.format, (IntFormat, FloatFormat)))
        self.kernel = kernels.choose(backend, "hist_error", "HistogramScorer", applies,
                                     (hist.counts, hist.lo, hist.hi)) is not None
        self._derive, self._q, self._fmt = _kernel_consts(spec)
        counts = hist.counts
        width = hist.width.float()  # both paths: float32 ends and widths, as the kernel reads
        off = _offsets(points, counts.device)  # sub-points at (i + (k + 0.5) / points) w
        if self.kernel and centers is None:  # the same points and weights, in one C call
            U, B = counts.shape
            # the kernel reads float32 ends and widths (a Hist of float64 ends is public API)
            cc, lo, wd = counts.contiguous(), kernels.contiguous(hist.lo), width.contiguous()
            args = cc.data_ptr(), lo.data_ptr(), wd.data_ptr(), off.data_ptr()
            # room for every bin when that is small, else a first call counts the occupied
            n = B if U * B * points <= ELEMENT_BUDGET else \
                _kernel().qs_points(*args, None, None, U, B, points)
            x = kernels.buffer(U * n * points)
            w = torch.empty(U * n * points, dtype=torch.float64)
            m = _kernel().qs_points(*args, x.data_ptr(), w.data_ptr(), U, B, points)
            self._flat = (x[:U * m * points].view(U, m * points),
                          w[:U * m * points].view(U, m * points))
            self.centers = self.counts = None  # [U, 1, P] views when the torch path asks
            return
        nz = counts > 0
        centers = (Hist(counts, hist.lo.float(), hist.hi.float(), step=width).centers()
                   if centers is None else centers.float())
        if counts.shape[0] == 1:  # one unit: index the occupied bins directly
            keep = nz[0].nonzero()[:, 0]
            if keep.numel() < counts.shape[1]:
                centers, counts = centers[:, keep], counts[:, keep]
        else:
            m = int(nz.sum(1).max()) if counts.numel() else 0
            if m < counts.shape[1]:  # score only occupied bins (empty ones add nothing): [U, m]
                keep = torch.sort((~nz).to(torch.int8), dim=1, stable=True).indices[:, :m]
                centers, counts = centers.gather(1, keep), counts.gather(1, keep)
        centers = centers[:, None, :]  # [U, 1, B]
        counts = counts.double()[:, None, :]
        if points > 1:
            centers = (centers[..., None] + off * width[:, None, None, None]).flatten(-2)
            counts = (counts[..., None] / points).expand(*counts.shape, points).flatten(-2)
        self.centers, self.counts = centers, counts  # [U, 1, P]
        self._flat = None

    def __call__(self, lo: torch.Tensor, hi: torch.Tensor, *, torch_only: bool = False
                 ) -> torch.Tensor:
        """Errors ``[U, C]`` of the candidate ranges ``lo``, ``hi`` ``[U, C]``
        (``torch_only``: the torch path even where the scorer has its kernel)."""
        U = self.units
        if lo.dim() != 2 or lo.shape != hi.shape or lo.shape[0] != U:
            raise ValueError(f"histogram_error: lo and hi must be [units, candidates] with "
                             f"{U} units, got {tuple(lo.shape)} and {tuple(hi.shape)}")
        C = lo.shape[1]
        if self.kernel and not torch_only and kernels.real(lo, hi):
            x, w = self._points()
            lo, hi = lo.float().contiguous(), hi.float().contiguous()
            s, z = self._qparams(lo, hi)
            out = torch.empty(U, C, dtype=torch.float64)
            _kernel().qs_hist_error(x.data_ptr(), w.data_ptr(), lo.data_ptr(), hi.data_ptr(),
                                    _ptr(s), _ptr(z), self._q.data_ptr(), _ptr(self._fmt),
                                    out.data_ptr(), U, C, x.shape[1], kernels.threads())
            return out
        return self._torch(*self._qparams(lo, hi, torch_only=True))

    def _points(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The points and weights ``[U, P]`` (contiguous), as the kernel takes them."""
        if self._flat is None:
            self._flat = (kernels.contiguous(self.centers[:, 0]),
                          kernels.contiguous(self.counts[:, 0], torch.float64))
        return self._flat

    def _qparams(self, lo, hi, torch_only: bool = False):
        """``(scale, zero point)`` float32 ``[U, C]`` of the ranges; ``(None, None)`` where the
        kernel derives them itself (kernels/csrc/qs_qparams.h)."""
        if self._derive and not torch_only:
            return None, None
        # one global amax for every candidate: derived from them all, a candidate's score
        # would depend on the others', and differ from the qparams that run
        qp = qparams_from_range(lo, hi, self.spec, global_amax=self.global_amax,
                                check_finite=False)
        U, C = lo.shape
        return (qp.effective_scale.float().expand(U, C).contiguous(),
                qp.zero_point.float().expand(U, C).contiguous())

    def _torch(self, scale, zp):
        if self.centers is None:
            self.centers, self.counts = (t[:, None, :] for t in self._flat)
        centers, counts, U = self.centers, self.counts, self.units
        C = scale.shape[1]
        step = max(1, ELEMENT_BUDGET // max(1, U * centers.shape[-1]))
        out = []
        for c in range(0, C, step):
            s, z = scale[:, c:c + step, None], zp[:, c:c + step, None]
            d = fake_quantize_units(centers, s, z, self.spec) - centers
            out.append((d.double().square_() * counts).sum(-1))
        return torch.cat(out, dim=1)

    def line_argmin(self, line: Line, mid: int, coarse=1, *, first: bool = False,
                    torch_only: bool = False) -> LineBest:
        """Best candidate along each unit's ``line``: a :class:`LineBest` (``[U]`` each).
        ``coarse``: the strides of the rounds, ``(k0, k1, ..., 1)`` (an int ``k`` means
        ``(k, 1)``): every ``k0``-th candidate (``mid`` among them) is scored, then those
        ``k1`` apart within ``k0`` of the best so far, and so on. A candidate wins only if
        strictly lower (ties keep ``mid``, then the first), with ``first`` also if equal and
        earlier (ties: the first in the line, as ``argmin``). The kernel generates and
        prices only the candidates it visits; the torch path builds the whole line
        (:meth:`Line.ranges`), scores all and picks by the same rule (``torch_only``: that
        path even where the scorer has its kernel)."""
        U, n = self.units, line.n
        lv = _levels(coarse)
        per_unit = (line.lo, line.hi, line.width, *(line.bounds or (None, None)))
        if any(t is not None and t.shape != (U,) for t in per_unit) or not 0 <= mid < n:
            raise ValueError(f"line_argmin: the line's ends, width and bounds must be [{U}] "
                             f"(one per unit) and 0 <= mid < {n}, got shapes "
                             f"{[None if t is None else tuple(t.shape) for t in per_unit]} "
                             f"and mid={mid}")
        if self.kernel and not torch_only and kernels.real(*(t for t in per_unit if t is not None)):
            x, w = self._points()
            f = [None if t is None else t.float().contiguous() for t in per_unit]
            s = z = None
            if not self._derive:  # scale encodings the kernel does not derive
                s, z = self._qparams(*line.ranges(), torch_only=True)
            idx = torch.empty(U, dtype=torch.long)
            err = torch.empty(U, dtype=torch.float64)
            blo, bhi = kernels.buffer(2, U).unbind(0)
            lvt = _as_tensor(lv)
            _kernel().qs_line_search(x.data_ptr(), w.data_ptr(), *map(_ptr, f), _ptr(s),
                                     _ptr(z), self._q.data_ptr(), _ptr(self._fmt),
                                     idx.data_ptr(), err.data_ptr(), blo.data_ptr(),
                                     bhi.data_ptr(), U, x.shape[1], line.kind,
                                     n, line.mul, line.add, line.div, mid, lvt.data_ptr(),
                                     len(lv), int(first), kernels.threads())
            return LineBest(blo, bhi, idx, err)
        clo, chi = line.ranges()
        idx, err = _line_pick(self._torch(*self._qparams(clo, chi, torch_only=True)), mid, lv,
                              first)
        return LineBest(clo.gather(1, idx[:, None])[:, 0], chi.gather(1, idx[:, None])[:, 0],
                        idx, err)


class LineBest(NamedTuple):
    """:meth:`HistogramScorer.line_argmin`'s choice per unit: its range, index and error."""

    lo: torch.Tensor
    hi: torch.Tensor
    index: torch.Tensor
    error: torch.Tensor


class Line(NamedTuple):
    """``n`` candidate ranges per unit, one line of a search, built alike by :meth:`ranges`
    (torch, the reference) and by the kernel (which builds only those it visits): with
    ``t_k = float32(k * mul + add) / div * width`` (float32), candidate ``k`` is
    ``(lo + t_k, hi)`` (``kind`` :data:`MOVE_LO`), ``(lo, hi + t_k)`` (:data:`MOVE_HI`) or
    ``(-t_k, t_k)`` (:data:`SYMMETRIC`), ordered, then clipped to ``bounds = (lo_min,
    hi_max)``."""

    kind: int
    lo: torch.Tensor | None
    hi: torch.Tensor | None
    width: torch.Tensor
    n: int
    mul: int
    add: int
    div: int
    bounds: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def move(cls, lo, hi, width, side: int, radius: int, steps: int, bounds=None) -> Line:
        """``lo`` (``side`` 0, ``hi`` fixed) or ``hi`` (``side`` 1) moved by ``d`` bin widths,
        ``d`` from ``-radius`` to ``radius`` in ``1 / steps`` (``mid = radius * steps`` is no
        move)."""
        return cls(side, lo, hi, width, 2 * radius * steps + 1, 1, -radius * steps, steps,
                   bounds)

    @classmethod
    def centres(cls, width, start: int, stride: int, n: int, bounds=None) -> Line:
        """``(-c, c)`` for the bin centres ``c = (j + 0.5) width``, ``j = start + k stride``
        (ModelOpt's and Quark's candidates; ``(2 j + 1) / 2`` is ``j + 0.5`` exactly)."""
        return cls(SYMMETRIC, None, None, width, n, 2 * stride, 2 * start + 1, 2, bounds)

    def ranges(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every candidate, ``(lo, hi)`` ``[U, n]``."""
        k = torch.arange(self.n, device=self.width.device)
        t = (k * self.mul + self.add).float() / self.div * self.width[:, None]
        if self.kind == MOVE_LO:
            a, b = self.lo[:, None] + t, self.hi[:, None].expand_as(t)
        elif self.kind == MOVE_HI:
            a, b = self.lo[:, None].expand_as(t), self.hi[:, None] + t
        else:
            a, b = -t, t
        lo, hi = torch.minimum(a, b), torch.maximum(a, b)
        if self.bounds is not None:
            lo = torch.maximum(lo, self.bounds[0][:, None])
            hi = torch.minimum(hi, self.bounds[1][:, None])
        return lo, hi


#: :class:`Line` kinds
MOVE_LO, MOVE_HI, SYMMETRIC = 0, 1, 2


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _levels(coarse) -> tuple[int, ...]:
    if isinstance(coarse, int):
        coarse = (coarse, 1) if coarse > 1 else (1,)
    lv = tuple(coarse)
    if (not lv or any(not isinstance(k, int) or k < 1 for k in lv)
            or any(a <= b for a, b in itertools.pairwise(lv))):
        raise ValueError(f"line_argmin: coarse must be a positive int or decreasing positive "
                         f"ints, got {coarse!r}")
    return lv


def _line_pick(err: torch.Tensor, mid: int, levels, first: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`HistogramScorer.line_argmin`'s rule on the errors of every candidate
    ``[U, G, n]``."""
    n = err.shape[-1]
    ar = torch.arange(n, device=err.device)

    def pick(mask, cur):
        e_cur = err.gather(-1, cur[..., None])[..., 0]
        cand = torch.where(mask, err, torch.full_like(err, float("inf")))
        k = cand.argmin(-1)  # first minimum
        v = cand.gather(-1, k[..., None])[..., 0]
        better = (v < e_cur) | ((v == e_cur) & (k < cur)) if first else v < e_cur
        return torch.where(better, k, cur)

    cur = torch.full(err.shape[:-1], mid, dtype=torch.long, device=err.device)
    cur = pick(((ar - mid) % levels[0] == 0).expand_as(err), cur)
    for prev, st in itertools.pairwise(levels):
        d = ar - cur[..., None]
        cur = pick((d % st == 0) & (d.abs() < prev), cur)
    return cur, err.gather(-1, cur[..., None])[..., 0]


@functools.lru_cache(maxsize=32)
def _as_tensor(levels: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(levels, dtype=torch.long)


@functools.lru_cache(maxsize=32)
def _kernel_consts(spec: QuantSpec) -> tuple[bool, torch.Tensor, torch.Tensor | None]:
    """Whether the kernel derives ``spec``'s scales itself, its constants (float64):
    :func:`kernels.qparams_consts`, else just ``qmin, qmax``, and a float element format's
    ``max, min_exp, mbits`` (None for an integer format; float scales are always given)."""
    consts = kernels.qparams_consts(spec)
    fmt = spec.format
    ffmt = (torch.tensor([float(fmt.max), float(fmt.min_exp), float(fmt.mbits)],
                         dtype=torch.float64) if isinstance(fmt, FloatFormat) else None)
    return consts is not None, torch.tensor(consts or [float(spec.qmin), float(spec.qmax)],
                                            dtype=torch.float64), ffmt


@functools.lru_cache(maxsize=8)
def _offsets(points: int, device) -> torch.Tensor:
    """Offsets ``(k + 0.5) / points - 0.5`` of a bin's points, in bin widths (float32)."""
    return (torch.arange(points, dtype=torch.float32, device=device) + 0.5) / points - 0.5



