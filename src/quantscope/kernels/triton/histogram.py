"""Histogram binning on aligned power-of-two grids (Triton): ``stats.histogram.add_values``.

A value ``x`` of unit ``u`` goes to bin ``clamp(floor(x * 2 ** -exp[u]) - first[u], 0, B - 1)``
(``|x|`` for absolute histograms; NaN to bin 0), every step exact in float32 as in the torch
reference. Two ways to count, equal bit for bit (counts are integers: the order of the
adds cannot change them): each value's bin written (offset by its row's, as float64) and
counted by ``torch.histc``, whose shared-memory histogram is the fast one (on an H200, a
16 x 2048 x 4096 bf16 batch, 2048 bins: the private histograms 13.3 ms, bins written as int32
then ``torch.bincount`` 1.2 ms, ``torch.histc`` of a float32 copy 1.2 ms:
``bench/gpu_hist_variants.py``; this float64 form, for histc's exact ``x * N / N`` and no host
read, 1.4 ms), where all units' bins fit its shared memory; or, past it,
while a CUDA graph is captured or deterministic algorithms are asked for (histc's CUDA
kernel is flagged nondeterministic), each program's private ``tl.histogram`` of its chunk
(one extra bin takes the padding of the last tile) added to the unit's counts with one
atomic add per non-empty bin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import LAUNCH, cdiv, next_power_of_2, widen

__all__ = ["MAX_BINS", "hist_add", "regrid_"]

#: the most bins a program's private histogram holds (registers)
MAX_BINS = 1 << 14
#: elements a program bins at least (fewer programs per unit above)
MIN_CHUNK = 1 << 13
#: values whose bins one counted pass writes (float64: 128 MB), and the most bins it counts
SLICE = 1 << 24
#: the most bins (units x bins) counted by default: CUDA's histc counts in shared memory up
#: to about 6,100 float64 bins (48 KB), beyond them with one global atomic a value
SHARED_BINS = 6000


@triton.jit
def _pow2(e):
    """Exactly ``2.0 ** e`` as float32 for integer ``e`` in [-126, 127], from the bits."""
    return ((e.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _unit_grid(exp_ptr, first_ptr, u):
    """Unit ``u``'s grid: ``2 ** -exp[u]`` (exact) and ``first[u]``, as float32."""
    return _pow2(-tl.load(exp_ptr + u)), tl.load(first_ptr + u).to(tl.float32)


@triton.jit
def _grid_bin(x, inv, first, B, ABSOLUTE: tl.constexpr):
    """The bin of each loaded ``x`` (float32 bin numbers): ``clamp(floor(x * inv) - first, 0,
    B - 1)``, of ``|x|`` where ``ABSOLUTE``, NaN to bin 0, as the torch reference."""
    t = widen(x) * inv
    if ABSOLUTE:
        t = tl.abs(t)
    t = tl.minimum(tl.maximum(tl.floor(t) - first, 0.0), B - 1.0)
    return tl.where(t != t, 0.0, t)  # noqa: PLR0124


@triton.jit
def _hist_kernel(x_ptr, counts_ptr, exp_ptr, first_ptr, E, stride_u, chunk, B,
                 ABSOLUTE: tl.constexpr, NB: tl.constexpr, BLOCK_E: tl.constexpr):
    u = tl.program_id(0)
    start = tl.program_id(1).to(tl.int64) * chunk  # a unit may pass 2 ** 31 elements
    inv, first = _unit_grid(exp_ptr, first_ptr, u)
    local = tl.zeros([NB], tl.int32)
    for e0 in range(0, chunk, BLOCK_E):
        within = e0 + tl.arange(0, BLOCK_E)
        cols = start + within
        mask = (cols < E) & (within < chunk)
        x = tl.load(x_ptr + u.to(tl.int64) * stride_u + cols, mask=mask, other=0.0)
        t = _grid_bin(x, inv, first, B, ABSOLUTE)
        idx = tl.where(mask, t.to(tl.int32), B)  # the padding to the extra bin B
        local += tl.histogram(idx, NB)
    bins = tl.arange(0, NB)
    tl.atomic_add(counts_ptr + u.to(tl.int64) * B + bins, local.to(tl.int64),
                  mask=(bins < B) & (local > 0))


@triton.jit
def _bin_kernel(x_ptr, idx_ptr, exp_ptr, first_ptr, row0, c0, C, stride_u, B,
                ABSOLUTE: tl.constexpr, BLOCK_E: tl.constexpr):
    r = tl.program_id(0)  # a row of this slice: unit row0 + r, its columns c0 .. c0 + C
    u = row0 + r
    within = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    mask = within < C
    inv, first = _unit_grid(exp_ptr, first_ptr, u)
    x = tl.load(x_ptr + u.to(tl.int64) * stride_u + c0 + within, mask=mask, other=0.0)
    t = _grid_bin(x, inv, first, B, ABSOLUTE)
    # r * B + bin < 2 ** 24: exact in float32 and float64; histc's (x - 0) * N / N is x again
    tl.store(idx_ptr + r.to(tl.int64) * C + within, (t + r * B).to(tl.float64), mask=mask)


def _counted_add(counts, units, exp, first, absolute, per, block_e):
    """:func:`hist_add` by bins written and counted by ``torch.histc``, a slice of at most
    ``per`` values (whole rows where they fit, columns of one row else) and ``per`` bins at
    a time."""
    (U, E), B = units.shape, counts.shape[1]
    C = min(E, per)
    R = max(1, min(U, per // C, per // B)) if C == E else 1
    idx = torch.empty(R * C, dtype=torch.float64, device=units.device)
    for row0 in range(0, U, R):
        rows = min(R, U - row0)
        # whole tensors where the slice is all of them: a slice view is a host op per call
        part = counts if rows == U else counts[row0:row0 + rows]
        for c0 in range(0, E, C):
            cols = min(C, E - c0)
            out = idx if rows * cols == idx.numel() else idx[:rows * cols]
            _bin_kernel[(rows, cdiv(cols, block_e))](
                units, out, exp, first, row0, c0, cols, units.stride(0), B,
                ABSOLUTE=bool(absolute), BLOCK_E=block_e, **LAUNCH)
            n = rows * B
            part.view(-1).add_(torch.histc(out, n, 0, n).long())


def hist_add(counts: torch.Tensor, units: torch.Tensor, exp: torch.Tensor,
             first: torch.Tensor, absolute: bool, *, chunk: int | None = None,
             block_e: int = 1024, counted: bool | None = None) -> None:
    """Add ``units [U, E]`` (rows contiguous; bf16 / fp16 / fp32) to ``counts [U, B]`` (int64,
    contiguous, in place) on the grids ``exp``, ``first`` (int64 ``[U]``). ``counted``: bins
    written and counted by ``torch.histc`` (default: where all units' bins fit its shared
    memory, :data:`SHARED_BINS`, unless a CUDA graph is being captured or deterministic
    algorithms are asked for), ``chunk`` values a slice; else private histograms, ``chunk``
    values a program."""
    U, E = units.shape
    B = counts.shape[1]
    if B + 1 > MAX_BINS:
        raise ValueError(f"kernels.triton.histogram: at most {MAX_BINS - 1} bins, got {B}")
    if not (U and E):
        return
    if counted is None:  # (measured: one 2048-bin histogram; many units not yet)
        counted = U * B <= SHARED_BINS and not (torch.are_deterministic_algorithms_enabled()
                                                or (units.is_cuda and
                                                    torch.cuda.is_current_stream_capturing()))
    if counted:
        return _counted_add(counts, units, exp, first, absolute,
                            min(SLICE, max(1, chunk or SLICE)), block_e)
    if chunk is None:  # enough programs to fill the GPU, each binning a fair share
        per_unit = max(1, min(cdiv(E, MIN_CHUNK), cdiv(1024, U)))
        chunk = cdiv(cdiv(E, per_unit), block_e) * block_e
    chunk = max(1, chunk)
    _hist_kernel[(U, cdiv(E, chunk))](
        units, counts, exp, first, E, units.stride(0), chunk, B, ABSOLUTE=bool(absolute),
        NB=next_power_of_2(B + 1), BLOCK_E=block_e, **LAUNCH)


# ---- the grid change of ``stats.histogram.update`` ------------------------------------------

#: stats.histogram's E_MIN, E_MAX and _MAG_BITS (the kernels layer may not import stats; a
#: test holds them equal): exponents with 2 ** e and 2 ** -e normal, bin indices below 2 ** 23
E_MIN, E_MAX, MAG_BITS = tl.constexpr(-126), tl.constexpr(126), tl.constexpr(22)
#: bins a program moves per step of the rebin loops
REGRID_BLOCK = 1024


@triton.jit
def _fits(lo, hi, e, B):
    """``histogram._fits``: the aligned grid of width ``2 ** e`` holds [lo, hi] in B bins."""
    inv = _pow2(-e)
    return (tl.floor(hi * inv) - tl.floor(lo * inv) + 1.0) <= tl.cast(B, tl.float32)


@triton.jit
def _ceil_log2(r):
    """``ceil(log2(r))`` of a float64 ``r >= 0`` from its bits, with ``nan_to_num(0, E_MAX,
    E_MIN)``'s ends (0: E_MIN; inf: E_MAX; NaN or negative: 0). Exact where torch's libm
    ``log2`` may be a last ulp off: ``grid_exponent``'s fits test over guess + 1 .. guess - 2
    finds the same exponent from either guess (the smallest fitting one is guess or guess - 1
    of the exact value)."""
    bits = r.to(tl.int64, bitcast=True)
    field = ((bits >> 52) & 0x7FF).to(tl.int32)
    mant = bits & 0xFFFFFFFFFFFFF
    g = field - 1023 + (mant != 0).to(tl.int32)
    g = tl.where(field == 0x7FF, tl.where(mant == 0, E_MAX, 0), g)
    g = tl.where(bits < 0, 0, g)  # a negative span: log2 NaN
    return tl.where((bits & 0x7FFFFFFFFFFFFFFF) == 0, E_MIN, g)  # +-0: log2 -inf


@triton.jit
def _frexp_exponent(a):
    """``torch.frexp(a).exponent`` of a float32 ``a >= 0`` where it can matter: 0 for zero,
    inf and NaN, ``field - 126`` for normal values; subnormals read -126 (frexp: below it,
    and either way the exponent bound they give is below E_MIN)."""
    field = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.where((a == 0.0) | (field == 0xFF), 0, field - 126)


@triton.jit
def _grid_exponent(lo, hi, B):
    """``histogram.grid_exponent`` of one unit (float32 lo <= 0 <= hi): int32."""
    span = hi.to(tl.float64) - lo.to(tl.float64)
    guess = _ceil_log2(span / tl.cast(B - 1, tl.float64))  # float64: div.rn.f64
    guess = tl.minimum(tl.maximum(guess, E_MIN), E_MAX)
    e = E_MAX
    for d in tl.static_range(4):  # exact test around the estimate: guess + 1 .. guess - 2
        cand = tl.minimum(tl.maximum(guess + 1 - d, E_MIN), E_MAX)
        e = tl.where(_fits(lo, hi, cand, B), tl.minimum(e, cand), e)
    amax = tl.maximum(tl.abs(lo), tl.abs(hi), propagate_nan=tl.PropagateNan.ALL)
    # the magnitude floor only where there is a magnitude: frexp(0) reads 0, not -inf
    mag = tl.where(amax > 0.0, _frexp_exponent(amax) - 1 - MAG_BITS, E_MIN)
    return tl.minimum(tl.maximum(tl.maximum(e, mag), E_MIN), E_MAX)


@triton.jit
def _joined_range(blo_ptr, bhi_ptr, slo_ptr, shi_ptr, u, ABSOLUTE: tl.constexpr):
    """``_update_grid``'s clamp (the grid holds zero; ``|x|``: [0, max |x|]) joined with the
    state's range as ``torch.minimum`` / ``maximum`` do (NaN kept; a tie keeps the state's)."""
    blo = tl.load(blo_ptr + u)
    bhi = tl.load(bhi_ptr + u)
    if ABSOLUTE:
        h = tl.maximum(tl.abs(blo), tl.abs(bhi), propagate_nan=tl.PropagateNan.ALL)
        lo = tl.full([], 0.0, tl.float32)
    else:  # clamp(max=0) / clamp(min=0): NaN and -0 kept
        lo = tl.where(blo > 0.0, 0.0, blo)
        h = tl.where(bhi < 0.0, 0.0, bhi)
    slo = tl.load(slo_ptr + u)
    shi = tl.load(shi_ptr + u)
    lo = tl.where(lo != lo, lo, tl.where(lo < slo, lo, slo))  # noqa: PLR0124
    hi = tl.where(h != h, h, tl.where(shi < h, h, shi))  # noqa: PLR0124
    return lo, hi


@triton.jit
def _regrid_kernel(blo_ptr, bhi_ptr, counts_ptr, exp_ptr, first_ptr, lo_ptr, hi_ptr,
                   scratch_ptr, B, ABSOLUTE: tl.constexpr, BLOCK: tl.constexpr):
    u = tl.program_id(0)
    lo, hi = _joined_range(blo_ptr, bhi_ptr, lo_ptr, hi_ptr, u, ABSOLUTE)
    old_e = tl.load(exp_ptr + u)
    old_first = tl.load(first_ptr + u)
    e = tl.maximum(old_e, _grid_exponent(lo, hi, B).to(tl.int64))
    if ABSOLUTE:
        first = e * 0
    else:
        first = tl.floor(lo * _pow2(-e)).to(tl.int64)
    # rebin: old bin i (absolute index old_first + i) goes whole into new bin
    # floor((old_first + i) / 2 ** m) - first (an arithmetic shift), clamped; integer adds,
    # so the order of the atomics cannot change the counts. A grid that stays (a batch
    # inside the range: m = 0, the same first) moves nothing: no pass over the bins
    m = tl.minimum(tl.maximum(e - old_e, 0), 62)
    row = u.to(tl.int64) * B
    if (m != 0) | (first != old_first):  # (uniform: every thread loaded the same unit)
        for b0 in range(0, B, BLOCK):
            i = b0 + tl.arange(0, BLOCK)
            tl.store(scratch_ptr + row + i, tl.zeros([BLOCK], tl.int64), mask=i < B)
        tl.debug_barrier()  # the zeros stored (and visible to the block) before the first add
        for b0 in range(0, B, BLOCK):
            i = b0 + tl.arange(0, BLOCK)
            c = tl.load(counts_ptr + row + i, mask=i < B, other=0)
            k = ((old_first + i) >> m) - first
            k = tl.minimum(tl.maximum(k, 0), B - 1)
            tl.atomic_add(scratch_ptr + row + k, c, mask=(i < B) & (c != 0), sem="relaxed")
        tl.debug_barrier()  # every add done, every old count read, before the row is written
        for b0 in range(0, B, BLOCK):
            i = b0 + tl.arange(0, BLOCK)
            c = tl.load(scratch_ptr + row + i, mask=i < B, other=0)
            tl.store(counts_ptr + row + i, c, mask=i < B)
    tl.debug_barrier()  # every thread read the unit's old grid before it is written over
    tl.store(lo_ptr + u, lo)
    tl.store(hi_ptr + u, hi)
    tl.store(exp_ptr + u, e)
    tl.store(first_ptr + u, first)


def regrid_(counts: torch.Tensor, exp: torch.Tensor, first: torch.Tensor, lo: torch.Tensor,
            hi: torch.Tensor, batch_lo: torch.Tensor, batch_hi: torch.Tensor, absolute: bool,
            *, block: int = REGRID_BLOCK) -> None:
    """``stats.histogram._update_grid`` in one launch, one program per unit, in place: the
    state ``counts [U, B]`` int64, ``exp``, ``first`` int64 ``[U]``, ``lo``, ``hi`` float32
    ``[U]`` (all contiguous) after a batch of per-unit min / max ``batch_lo``, ``batch_hi``
    (float32 ``[U]``). A unit whose grid moves is re-binned through a scratch row; one whose
    grid stays costs its four scalars, not a pass over its bins."""
    U, B = counts.shape
    if U:
        scratch = torch.empty_like(counts)
        _regrid_kernel[(U,)](batch_lo, batch_hi, counts, exp, first, lo, hi, scratch, B,
                             ABSOLUTE=bool(absolute), BLOCK=block, **LAUNCH)
