"""Entropy (KL divergence) calibration, TensorRT's steps exactly, vectorized.

For every candidate threshold bin ``i`` in ``range(start_bin, n + 1, stride)`` of an
``|x|`` histogram ``h`` of ``n`` bins (TensorRT / ModelOpt ``_compute_amax_entropy``):

* ``h[0] = h[1]`` first (zeros would dominate);
* reference ``P = h[:i]`` with every count beyond ``i`` added to ``P[i-1]``;
* ``Q``: the ``i`` bins split into ``nq = 2 ** (bits - 1)`` groups (bin ``j`` in group
  ``floor(nq j / i)``, exactly ``np.digitize`` on ``linspace(0, i, nq + 1)``), each
  group's total spread evenly over its non-empty bins, empty bins 0;
* ``KL(P || Q)`` of the normalised distributions (``scipy.stats.entropy``: infinite
  where ``P > 0 = Q``);
* the last minimum wins; ``amax = edges[i]``.

Instead of a Python loop over ~1900 thresholds rebuilding ``P`` and ``Q``, the
divergence of every candidate is a closed form over prefix sums (float64):
``KL = (sum P log P - sum_g G_g log(G_g / n_g) - S_i log Q_{i-1}) / T - log T + log C_i``
with ``T`` the total, ``C_i = sum h[:i]``, ``S_i = T - C_i``, ``G_g`` / ``n_g`` a
group's count and non-empty bins (gathered from prefix sums at the group
boundaries ``ceil(g i / nq)``). Work is ``units x candidates x nq``, chunked.

On CPU a C kernel (:mod:`quantscope.kernels`) evaluates the same closed form: every
group's ``G log(G / n)`` depends only on its first bin and its size (at most
``ceil(B / nq)``), so where that is fewer logs than ``candidates x nq`` it tabulates
those once per unit (at most ``B x ceil(B / nq)`` logs: only groups ending by the unit's
last candidate) and each candidate's cross term is ``nq`` table reads; else (few groups:
int2 / int4, or many bins per group) it computes each candidate's ``nq`` terms directly,
the same values in the same order, in O(B) memory. No terms at all for a candidate that is infinite
anyway (its last bin empty with counts beyond it); threads over units. Same
float64 terms, summed in another order (tested against the torch form to 1e-12
and against the literal loop). Note: TensorRT's groups are ``np.digitize`` on
``linspace(0, i, nq + 1)`` -- sizes ``floor`` or ``ceil(i / nq)`` spread over
the range, not ``nq - 1`` equal chunks and a remainder -- so groups are not shared
between candidates with the same ``i // nq``.

Where ``P`` and ``Q`` are proportional the literal loop computes ``KL = 0`` exactly (every
``p / q`` is 1) and the last such threshold wins; the closed form leaves rounding noise of
either sign there, which would pick among them at random. Both forms therefore set those
divergences to 0: the one non-empty bin below ``i`` is ``i - 1``, or no counts lie beyond
``i`` and every group is flat (its non-empty bins hold one count; exact, from a prefix count
of the bins whose count differs from the previous non-empty bin's). Other equal
divergences (thresholds whose groups differ but whose KL is the same in exact arithmetic)
stay decided by rounding, in the loop as here.

``smooth`` averages each divergence with its neighbours (a centred window over the valid
candidates; any infinite divergence in the window makes the average infinite) before the
argmin. Horizon's KLObserver has its own rule, :func:`horizon_entropy_amax`.

On quantscope's own histograms the candidates run up to the last non-empty bin
(TensorRT's histogram ends at the data's maximum).

A candidate with no counts below its threshold (after ``h[0] = h[1]``) scores infinite
here; ModelOpt 0.47's ``compute_amax("entropy")`` gets NaN from ``scipy.stats.entropy``
there (an all-zero ``P``) and ``np.argmin`` returns the first NaN, so it picks that
candidate (data on quarter steps up to 4: ModelOpt 0.25, quantscope 4.0).
"""

from __future__ import annotations

import torch

from .. import kernels
from .._checks import check_bool, check_int
from ..formats import IntFormat
from ..stats.histogram import Hist, fold_abs

__all__ = ["entropy_amax", "entropy_divergences", "entropy_range", "horizon_entropy_amax",
           "spec_bits"]

_BUDGET = 1 << 18


def _kernel():
    return kernels.lib("entropy")


def _xlogx(x):
    return torch.where(x > 0, x * torch.log(x.clamp(min=1e-300)), torch.zeros_like(x))


def entropy_divergences(counts: torch.Tensor, *, num_bits: int = 8, unsigned: bool = False,
                        start_bin: int = 128, stride: int = 1, stop=None,
                        copy_zero_bin: bool = True, backend: str | None = None, pick=None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(divergences [U, C], candidates [C])``: KL of every candidate bin of ``|x|``
    histograms ``counts [U, B]``; candidates past a unit's ``stop`` (default ``B``; a
    ``[U]`` tensor for per-unit ends) are NaN. ``backend``: see
    :data:`quantscope.kernels.BACKENDS` (``"torch"``: the reference the C kernel is tested
    against). ``pick``: an int64 ``[U]`` tensor the
    kernel fills with each unit's last-argmin bin (-1: no finite divergence), set to -2
    when the torch form ran."""
    kl, picked = _divergences(counts, num_bits, unsigned, start_bin, stride, stop,
                              copy_zero_bin, backend, pick)
    if pick is not None and not picked:
        pick.fill_(-2)
    return kl, _candidates(start_bin, counts.shape[1], stride, counts.device)


#: the widest integer format's bits: more quantized bins than any histogram holds (the
#: loops grow as ``2 ** num_bits``)
MAX_BITS = 16


def spec_bits(spec) -> tuple[int, bool]:
    """``(num_bits, unsigned)`` of the KL for a spec: the integer format's bits (else 8,
    TensorRT's default), and TensorRT's unsigned mode (``2 ** bits`` levels over
    ``[0, amax]``) only where the quantizer's codes may all lie on one side of zero: an
    unsigned format with a free zero point (asymmetric; non-negative data put it at 0). A
    symmetric unsigned spec has its zero point mid-range (uint8: 128), codes on both sides,
    the signed format's quantizer: ``2 ** (bits - 1)`` levels per side, as every signed
    format."""
    fmt = spec.format
    if isinstance(fmt, IntFormat):
        return fmt.bits, not fmt.signed and not spec.symmetric
    return 8, False


#: the most bins an option may count (the histograms' bins are int32-indexed)
_MAX_BINS = 2**31 - 1


def check_options(who: str = "entropy", *, num_bits: int = 8, start_bin: int = 128,
                  stride: int = 1, smooth: int = 1, bins: int | None = None,
                  copy_zero_bin: bool = True) -> tuple[int, int, int, int]:
    """``(num_bits, start_bin, stride, smooth)`` as Python ints (numpy's accepted: a numpy
    ``num_bits`` has no ``bit_length``). Raise ``ValueError`` naming the option unless every
    one is in range (the C kernel
    indexes with them: a negative ``start_bin`` would read outside the histogram), and,
    given ``bins``, unless ``start_bin <= bins`` (TensorRT / ModelOpt fail there too: no
    candidate threshold, ``argmin`` of nothing); ``copy_zero_bin`` is True or False (a
    string such as ``"no"`` would pass as true, or fail later in ``int()``)."""
    if not isinstance(copy_zero_bin, bool):
        # a ValueError, as check_int's for the other options
        raise ValueError(  # noqa: TRY004
            f"{who}: copy_zero_bin must be True or False, got {copy_zero_bin!r}")
    num_bits = check_int(who, "num_bits", num_bits, 2, MAX_BITS)
    # bin counts: a histogram holds far fewer (2 ** 64 wrapped to 0 in the kernel's int64)
    start_bin = check_int(who, "start_bin", start_bin, 0, _MAX_BINS)
    stride = check_int(who, "stride", stride, 1, _MAX_BINS)
    smooth = check_int(who, "smooth", smooth, 1, _MAX_BINS)
    if bins is not None and start_bin > bins:
        raise ValueError(f"{who}: start_bin={start_bin} leaves no candidate threshold in a "
                         f"histogram of bins={bins}; use bins >= start_bin or a smaller "
                         f"start_bin")
    return num_bits, start_bin, stride, smooth


def _candidates(start_bin: int, bins: int, stride: int, device) -> torch.Tensor:
    """The candidate thresholds ``i`` (TensorRT's ``range(start_bin, bins + 1, stride)``)."""
    return torch.arange(start_bin, bins + 1, stride, device=device)


#: ``stop`` of :func:`_divergences`: each unit's candidates end at its last non-empty bin
_LAST = object()


def _last_nonempty(counts: torch.Tensor) -> torch.Tensor:
    """One past each unit's last non-empty bin ``[U]`` (0 for an empty unit)."""
    ar = torch.arange(counts.shape[1], device=counts.device)
    return torch.where(counts > 0, ar, -1).amax(-1) + 1


def _divergences(counts, num_bits, unsigned, start_bin, stride, stop, copy_zero_bin, backend,
                 pick, fallback=False):
    """``(divergences, whether the kernel ran)`` of :func:`entropy_divergences`; ``stop`` may
    also be :data:`_LAST`. When the kernel ran it wrote each unit's last-argmin bin into
    ``pick`` (if given), where no divergence is finite -1, or with ``fallback`` one past the
    unit's last non-empty bin."""
    U, B = counts.shape
    unsigned = check_bool("entropy", "unsigned", unsigned)  # int("no") fails naming nothing
    num_bits, start_bin, stride, _ = check_options(
        num_bits=num_bits, start_bin=start_bin, stride=stride, bins=B, copy_zero_bin=copy_zero_bin)
    dev = counts.device
    nq = 1 << (num_bits - 1 + int(unsigned))
    if stop is None:
        stop = torch.full((U,), B, device=dev)
    elif stop is not _LAST:
        stop = torch.as_tensor(stop, dtype=torch.int64, device=dev)
    applies = dev.type == "cpu" and U > 0 and counts.dtype == torch.int64
    lib = kernels.choose(backend, "entropy", "entropy_divergences", applies, (counts,))
    if lib is not None:
        kl = _kernel_divergences(lib, counts, nq, start_bin, stride, stop, copy_zero_bin, pick,
                                 fallback)
        if kl is not None:
            return kl, True
        if backend == "kernel":
            raise ValueError("entropy_divergences: backend='kernel', but the C kernel declined "
                             "these counts")
    if stop is _LAST:
        stop = _last_nonempty(counts)
    return _torch_divergences(counts, nq, start_bin, stride, stop, copy_zero_bin), False


def _kernel_divergences(lib, counts, nq, start_bin, stride, stop, copy_zero_bin, pick,
                        fallback):
    """The C kernel's divergences ``[U, C]`` (None where it declined: the torch form runs)."""
    U, B = counts.shape
    C = len(range(start_bin, B + 1, stride))
    # int64 counts in: the zero-bin copy and float64 cast happen in C
    out = torch.empty(U, C, dtype=torch.float64)
    st = None if stop is _LAST else stop.contiguous()
    if lib.qs_entropy(counts.contiguous().data_ptr(), None if st is None else st.data_ptr(),
                      out.data_ptr(), None if pick is None else pick.data_ptr(), U, B,
                      start_bin, stride, C, nq.bit_length() - 1, int(copy_zero_bin),
                      int(fallback), kernels.threads()):
        return None
    return out


def _torch_divergences(counts, nq, start_bin, stride, stop, copy_zero_bin) -> torch.Tensor:
    """TensorRT's KL of every candidate in closed form ``[U, C]``, from prefix sums: the
    quantized distribution's groups are sums of runs of bins, so every candidate costs a
    few gathers instead of a loop over its bins."""
    U, B = counts.shape
    dev = counts.device
    b = counts.to(torch.float64, copy=True)
    if copy_zero_bin and B > 1:
        b[:, 0] = b[:, 1]
    cand = _candidates(start_bin, B, stride, dev)
    zero = torch.zeros(U, 1, dtype=torch.float64, device=dev)
    cs = torch.cat([zero, b.cumsum(1)], 1)  # cs[:, k] = sum b[:, :k]
    nz = torch.cat([zero, (b > 0).double().cumsum(1)], 1)
    bl = torch.cat([zero, _xlogx(b).cumsum(1)], 1)
    T = cs[:, -1:]
    ci = cs[:, cand]  # C_i  [U, C]
    si = T - ci  # outliers
    b_last = b[:, cand - 1]
    p_last = b_last + si
    plogp = bl[:, cand - 1] + _xlogx(p_last)
    cross, q_last, flat = _group_terms(b, cs, nz, cand, nq)
    out_term = torch.where(si > 0, si * torch.log(q_last.clamp(min=1e-300)), torch.zeros_like(si))
    kl = (plogp - cross - out_term) / T - torch.log(T) + torch.log(ci)
    # P and Q proportional (the one non-empty bin below i is the last, or no outliers and
    # every group flat): TensorRT's loop gets 0 exactly, the closed form rounding noise of
    # either sign, which would decide ties among such thresholds
    one = (nz[:, cand] == 1) & (b_last > 0)
    kl = torch.where(one | ((si == 0) & flat), torch.zeros_like(kl), kl)
    inf = torch.full_like(kl, float("inf"))
    kl = torch.where((si > 0) & (b_last == 0), inf, kl)  # P > 0 where Q = 0
    kl = torch.where(ci > 0, kl, inf)
    return torch.where(cand[None, :] <= stop[:, None], kl, torch.full_like(kl, float("nan")))


def _group_terms(b, cs, nz, cand, nq):
    """Per unit and candidate ``i``, over the ``nq`` groups of bins ``[0, i)``:
    ``(sum G log(G / n), the last group's mean count, whether every group is flat)``, with
    ``G`` a group's count and ``n`` its non-empty bins (the cross term of the KL, the
    quantized value the outliers meet, and the test for P and Q proportional)."""
    U, B = b.shape
    C = len(cand)
    dev = b.device
    # group boundaries ceil(g i / nq), g = 0..nq, for every candidate i: [C, nq + 1]
    g = torch.arange(nq + 1, device=dev)
    bnd = (g[None, :] * cand[:, None] + nq - 1) // nq
    # group of bin i - 1 (threshold 0 has none: group 0 of no bin, scored infinite by ci = 0)
    last_g = ((nq * (cand - 1)) // cand.clamp(min=1)).clamp(min=0)
    nzn, chg = _runs(b)
    flat = torch.empty(U, C, dtype=torch.bool, device=dev)
    cross = torch.empty(U, C, dtype=torch.float64, device=dev)
    q_last = torch.empty(U, C, dtype=torch.float64, device=dev)
    step = max(1, _BUDGET // max(1, C * (nq + 1)))
    for u in range(0, U, step):  # chunks of units bound the [units, C, nq] work
        idx = bnd.reshape(-1)
        c_at = cs[u:u + step][:, idx].reshape(-1, C, nq + 1)
        n_at = nz[u:u + step][:, idx].reshape(-1, C, nq + 1)
        G = c_at[..., 1:] - c_at[..., :-1]
        n = (n_at[..., 1:] - n_at[..., :-1]).clamp_(min=1)
        cross[u:u + step] = torch.xlogy(G, G / n).sum(-1)  # G log(G / n), 0 where G = 0
        gl = last_g[None, :, None].expand(G.shape[0], C, 1)
        q_last[u:u + step] = (G.gather(2, gl) / n.gather(2, gl).clamp(min=1))[..., 0]
        # every group flat: its non-empty bins hold one count (no change after its first)
        first = nzn[u:u + step][:, idx].reshape(-1, C, nq + 1)[..., :-1]
        ends = bnd[None, :, 1:].expand_as(first)
        c_end = chg[u:u + step][:, bnd[:, 1:].reshape(-1)].reshape(-1, C, nq)
        c_first = chg[u:u + step].gather(1, (first + 1).clamp(max=B).reshape(len(first), -1))
        flat[u:u + step] = ((first >= ends) | (c_end == c_first.reshape_as(first))).all(-1)
    return cross, q_last, flat


def _runs(b):
    """``(next non-empty bin >= k [U, B + 1], changes of count among the non-empty bins
    before k [U, B + 1])``: a group is flat when no change falls after its first non-empty
    bin."""
    U, B = b.shape
    dev = b.device
    ar = torch.arange(B, device=dev)
    nzn = torch.where(b > 0, ar, B).flip(1).cummin(1).values.flip(1)  # next non-empty bin >= k
    nzn = torch.cat([nzn, torch.full((U, 1), B, device=dev)], 1)
    prev = torch.where(b > 0, ar, -1).cummax(1).values  # last non-empty bin <= k
    prev = torch.cat([torch.full((U, 1), -1, device=dev), prev[:, :-1]], 1)  # ... < k
    chg = (b > 0) & (prev >= 0) & (b != b.gather(1, prev.clamp(min=0)))
    chg = torch.cat([torch.zeros(U, 1, dtype=torch.long, device=dev), chg.long().cumsum(1)], 1)
    return nzn, chg


def _smooth(kl: torch.Tensor, width: int) -> torch.Tensor:
    """Centred moving average over the valid (non-NaN) candidates; inf stays inf."""
    if width <= 1:
        return kl
    h = width // 2
    valid = ~torch.isnan(kl)
    isinf = torch.isinf(kl) & valid
    finite = torch.where(valid & ~isinf, kl, torch.zeros_like(kl))
    pad = lambda t: torch.nn.functional.pad(t.cumsum(-1), (1, 0))
    s, n, k = pad(finite), pad(valid.double()), pad(isinf.double())
    C = kl.shape[-1]
    i = torch.arange(C, device=kl.device)
    a, z = (i - h).clamp(min=0), (i + h + 1).clamp(max=C)
    cnt = n[:, z] - n[:, a]
    out = (s[:, z] - s[:, a]) / cnt.clamp(min=1)
    out = torch.where(k[:, z] - k[:, a] > 0, torch.full_like(out, float("inf")), out)
    return torch.where(valid, out, kl)


def entropy_amax(hist: Hist, *, num_bits: int = 8, unsigned: bool = False, start_bin: int = 128,
                 stride: int = 1, smooth: int = 1, copy_zero_bin: bool = True,
                 trim: bool = True) -> torch.Tensor:
    """Per-unit ``amax`` minimising KL (last minimum), ``edges[i]`` of the ``|x|`` histogram.

    ``trim`` ends each unit's candidates at its last non-empty bin. A unit whose data ends
    below bin ``start_bin`` (or with no data) gets the right edge of its last non-empty bin;
    a histogram of fewer than ``start_bin`` bins is a ``ValueError`` (no candidate at all,
    as in TensorRT / ModelOpt: observers refuse it at construction).
    """
    num_bits, start_bin, stride, smooth = check_options(
        num_bits=num_bits, start_bin=start_bin, stride=stride, smooth=smooth)
    trim = check_bool("entropy", "trim", trim)  # "no" would trim
    h = fold_abs(hist)
    U, B = h.counts.shape
    # one pass: the kernel trims, picks the last argmin and falls back to the last bin itself
    pick = torch.empty(U, dtype=torch.int64, device=h.counts.device) if smooth <= 1 else None
    kl, picked = _divergences(h.counts, num_bits, unsigned, start_bin, stride,
                              _LAST if trim else None, copy_zero_bin, None, pick, fallback=True)
    if pick is not None and picked:
        return h.lo + pick * h.width
    kl = _smooth(kl, smooth)
    cand = _candidates(start_bin, B, stride, kl.device)
    key = torch.where(torch.isnan(kl), torch.full_like(kl, float("inf")), kl).flip(-1)
    # last argmin: first minimum of the reversed row; a row of only inf/NaN falls back
    pick = cand.numel() - 1 - key.argmin(-1)
    ok = (~torch.isnan(kl)).any(-1) & torch.isfinite(key).any(-1)
    i = torch.where(ok, cand[pick], _last_nonempty(h.counts))
    return h.lo + i * h.width


def entropy_range(hist: Hist, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(-amax, amax)`` of :func:`entropy_amax` (entropy calibration is symmetric)."""
    amax = entropy_amax(hist, **kwargs)
    return -amax, amax


def horizon_entropy_amax(hist: Hist, *, num_bits: int = 8, start_bin: int = 128, stride: int = 1,
                         smooth: int = 9) -> torch.Tensor:
    """Per-unit ``amax`` of Horizon's KLObserver (observer_v2 ``_compute_amax_entropy``).

    TensorRT's ``P`` and ``Q`` (``h[0] = h[1]``, every bin up to the histogram's end a
    candidate), but the divergence is ``sum p log(p / (q + 1e-10))`` of the normalised
    counts (``_entropy_torch``: finite where ``P > 0 = Q``), the ``smooth``-wide windows are
    summed only where full (``range(len(div) - smooth - 1)``), the last minimum wins and
    ``amax = edges[j * stride + start_bin + smooth // 2]``.
    """
    num_bits, start_bin, stride, smooth = check_options(
        "horizon_entropy", num_bits=num_bits, start_bin=start_bin, stride=stride, smooth=smooth)
    if start_bin < 1:  # Horizon's loop fails there too (the last bin of none)
        raise ValueError("horizon_entropy: start_bin=0 is a threshold of no bin; Horizon's KL "
                         "starts at start_bin >= 1")
    h = fold_abs(hist)
    B = h.counts.shape[1]
    cand = _candidates(start_bin, B, stride, h.counts.device)
    windows = len(cand) - smooth - 1
    if windows < 1:  # Horizon: argmin of no window
        raise ValueError(f"horizon_entropy: {len(cand)} candidate thresholds (bins={B}, "
                         f"start_bin={start_bin}, stride={stride}) leave no full smooth={smooth} "
                         f"window; Horizon needs bins >= 256")
    kl = _horizon_divergences(h.counts, 1 << (num_bits - 1), cand)
    sums = kl.unfold(-1, smooth, 1)[:, :windows].sum(-1)
    j = windows - 1 - sums.flip(-1).argmin(-1)  # the last minimum
    return h.lo + (j * stride + start_bin + smooth // 2) * h.width


#: elements of each ``[U, c, B]`` temporary of :func:`_horizon_divergences` (about seven are
#: alive at once): cache-sized chunks were the fastest too (one 2048-bin histogram: 216 ms and
#: +230 MB with chunks of 4M elements, 82 ms and +8 MB with these)
_HORIZON_CHUNK = 1 << 16


def _horizon_divergences(counts: torch.Tensor, nq: int, cand: torch.Tensor) -> torch.Tensor:
    """Horizon's ``_entropy_torch(P, Q)`` of every candidate ``[U, C]``, dense (float64)."""
    U, B = counts.shape
    b = counts.to(torch.float64, copy=True)
    if B > 1:
        b[:, 0] = b[:, 1]
    k = torch.arange(B, device=b.device)
    total = b.sum(1, keepdim=True)
    out = []
    step = max(1, _HORIZON_CHUNK // max(1, U * (B + nq)))
    for c in cand.split(step):  # chunks of candidates bound the [U, c, B] work
        inside = k[None, :] < c[:, None]  # [c, B]
        grp = torch.where(inside, k[None, :] * nq // c[:, None], 0)  # np.digitize's group
        full = (b[:, None, :] > 0) & inside  # the bins Q spreads over
        val = torch.where(full, b[:, None, :], 0.0)
        idx = grp.expand(U, -1, -1)
        G = val.new_zeros(U, len(c), nq).scatter_add_(2, idx, val)
        n = val.new_zeros(U, len(c), nq).scatter_add_(2, idx, full.double())
        q = torch.where(full, (G / n.clamp(min=1)).gather(2, idx), 0.0)
        p = torch.where(inside, b[:, None, :], 0.0)
        beyond = total - b.cumsum(1).gather(1, (c - 1).expand(U, -1))  # counts past c
        p.scatter_add_(2, (c - 1)[None, :, None].expand(U, -1, 1), beyond[..., None])
        p = p / torch.where(p.sum(-1, keepdim=True) != 0, p.sum(-1, keepdim=True), 1.0)
        q = q / torch.where(q.sum(-1, keepdim=True) != 0, q.sum(-1, keepdim=True), 1.0) + 1e-10
        out.append((-q * torch.special.entr(p / q)).sum(-1))
    return torch.cat(out, -1)
