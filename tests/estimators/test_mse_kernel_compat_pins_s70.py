"""Pins from session 70's mutation round of the MSE search's C engines
(:mod:`quantscope.estimators.mse_kernel`, :mod:`quantscope.estimators.mse_compat`): what
each engine accepts (``usable``, ``applies``, ``scanned``); the kernel's prices of strided
units, of an int32 unit subset, of one row of scales broadcast against several rows of zero
points, with ``float32_squares``; the kernel search against ``mse_tiles.search`` (a first
candidate that is not the min-max range, strided units, ``float32_squares``, independent
ends, an extension budget under one candidate per unit, a global stop just before the last
candidate over several chunks); the compat engine's bound (``tolerance`` as its module doc
composes it), its model of torch's parallel split (``_vector_only``), its torch fallback
keeping ``tie`` and ``patience``, its global patience reset by an improvement, and near
candidates settled by torch's errors. Each test fails on a mutant the earlier tests let
through."""

from __future__ import annotations

import pytest
import torch

from quantscope import kernels, presets
from quantscope.estimators import mse_compat, mse_kernel, mse_search, mse_tiles
from quantscope.layout import Channel, Group
from quantscope.qdq import fake_quantize_units
from quantscope.qparams import qparams_from_range
from quantscope.spec import QuantSpec
from quantscope.stats.minmax import unit_minmax

needs_search = pytest.mark.skipif(not kernels.available("mse_search"),
                                  reason="no C compiler (or QUANTSCOPE_NO_KERNEL)")
needs_pnorm = pytest.mark.skipif(not kernels.available("mse_pnorm"),
                                 reason="no C compiler (or QUANTSCOPE_NO_KERNEL)")
ASYM = QuantSpec("int4", Group(32), symmetric=False)


def _units(rows=6, cols=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g).add_(0.1)


def _candidates(u, spec, factors=(1.0, 0.8, 0.6)):
    lo, hi = unit_minmax(u)
    f = torch.tensor(factors)[:, None]
    qp = qparams_from_range(lo[None] * f, hi[None] * f, spec)
    return qp.effective_scale.expand(len(factors), u.shape[0]), qp.zero_point


def _exact_prices(u, scale, zp, spec, float32_squares=False):
    """The module doc's price: float32 ``d``, its square in float64 (or rounded to float32
    first), summed in float64."""
    d = fake_quantize_units(u[None], scale[..., None], zp.float()[..., None], spec) - u[None]
    return ((d * d).double() if float32_squares else d.double() ** 2).sum(-1)


@needs_search
def test_the_kernel_refuses_units_that_need_autograd():
    """``usable``: 'no autograd' (the kernel writes no graph)."""
    u = _units(4, 32)
    assert mse_kernel.usable(u, ASYM, 2.0)
    assert not mse_kernel.usable(u.requires_grad_(), ASYM, 2.0)


@needs_search
def test_kernel_prices_strided_units_as_their_values():
    """A transposed view of ``[U, E]`` units: the prices of its values, not of its memory."""
    u = _units(64, 6).t()  # [6, 64], not contiguous
    scale, zp = _candidates(u.contiguous(), ASYM)
    got = mse_kernel.price(u, scale, zp, ASYM)
    assert torch.allclose(got, _exact_prices(u, scale, zp, ASYM), rtol=1e-12, atol=0)


@needs_search
def test_kernel_prices_an_int32_subset_of_units():
    u = _units(8, 64)
    scale, zp = _candidates(u, ASYM)
    sub = torch.tensor([5, 0, 7])
    ref = mse_kernel.price(u, scale, zp, ASYM)[:, sub]
    part = mse_kernel.price(u, scale[:, sub], zp[:, sub], ASYM, sub=sub.int())
    assert torch.equal(part, ref)


@needs_search
def test_kernel_prices_one_row_of_scales_against_every_row_of_zero_points():
    """``k`` candidates are the rows of scale and zero point broadcast together."""
    u = _units(6, 64)
    scale, zp = _candidates(u, ASYM)
    one = scale[:1]  # [1, U] against zero points [3, U]
    got = mse_kernel.price(u, one, zp, ASYM)
    assert got.shape == zp.shape
    assert torch.allclose(got, _exact_prices(u, one.expand_as(zp), zp, ASYM), rtol=1e-12,
                          atol=0)


@needs_search
@pytest.mark.parametrize("spec", [ASYM, presets.MXFP4], ids=["int4-asym", "mxfp4"])
def test_kernel_prices_float32_squares(spec):
    """``float32_squares``: each square rounded to float32 (torch's ``d * d``), then summed
    in float64; a different number from the exact squares' sum."""
    u = _units(6, 64) * 0.37
    scale, zp = _candidates(u, spec)
    got = mse_kernel.price(u, scale, zp, spec, float32_squares=True)
    ref = _exact_prices(u, scale, zp, spec, float32_squares=True)
    assert torch.allclose(got, ref, rtol=1e-12, atol=0)
    assert not torch.allclose(got, _exact_prices(u, scale, zp, spec), rtol=1e-12, atol=0)


@needs_search
@pytest.mark.parametrize(("f_hi", "strided"), [([0.7, 0.9, 0.8], False),
                                               ([1.0, 0.9, 0.8], True)],
                         ids=["first-candidate-not-the-incumbent", "strided-units"])
def test_kernel_search_is_mse_tiles_search(f_hi, strided):
    """``search``: ``mse_tiles.search``'s arguments and choices. A first candidate
    ``(lo * 1, hi * 0.7)`` is not the min-max incumbent (priced on its own); units may be a
    strided view."""
    u = _units(256, 6, seed=1).t() if strided else _units(6, 64, seed=1)
    lo, hi = unit_minmax(u)
    kw = {"norm": 2.0, "patience": 2, "per_unit": True, "tie": "first", "exact": False,
          "incumbent": (lo, hi), "global_amax": None, "chunk_elems": 1 << 20,
          "chunk_candidates": None, "early_stop": True}
    f_lo = [1.0, 0.9, 0.8]
    got = mse_kernel.search(u, lo, hi, ASYM, f_lo, f_hi, **kw)
    ref = mse_tiles.search(u, lo, hi, ASYM, f_lo, f_hi, **kw)
    for a, b in zip(got[:2] + got[3:], ref[:2] + ref[3:]):
        assert torch.equal(a, b)
    assert torch.allclose(got[2], ref[2].double(), rtol=1e-12, atol=0)


def _composed(n, norm):
    """Module doc, step 2: torch's float32 sum (``gamma_(n-1)``, u = 2^-24), its terms
    (``rho``), the kernel's terms (``kappa = 2^-18 (1 + norm)``) and its float64 sum
    (``gamma64_n``), composed."""
    u, u64 = 2.0 ** -24, 2.0 ** -53
    g32 = (n - 1) * u / (1 - (n - 1) * u)
    g64 = n * u64 / (1 - n * u64)
    kappa = 2.0 ** -18 * (1 + norm)
    return (1 + g32) * (1 + mse_compat.RHO[norm]) / ((1 - kappa) * (1 - g64)) - 1


@pytest.mark.parametrize("n", [1, 64, 4096, 32767])
@pytest.mark.parametrize("norm", sorted(mse_compat.RHO))
def test_tolerance_is_the_composed_bound(n, norm):
    """``tol`` at least the composition of the four bounds and at most a hair above it; ``a``
    at least ``n`` terms' absolute error ``2^-140`` each."""
    tol, a = mse_compat.tolerance(n, norm)
    rel = _composed(n, norm)
    assert rel <= tol <= rel * 1.002 + 2.0 ** -39
    assert n * 2.0 ** -140 <= a < 1e-30


@pytest.mark.parametrize(("numel", "threads", "vector"), [
    (32832, 4, False), (32832, 1, True), (24576, 4, True), (65664, 4, True)])
def test_vector_only_splits_as_parallel_for(monkeypatch, numel, threads, vector):
    """``t = min(threads, ceil(numel / grain))`` chunks of ``ceil(numel / t)``: 32832
    elements over 4 threads are 2 chunks of 16416 (not a multiple of 64), 65664 are 3 of
    21888."""
    monkeypatch.setattr(kernels, "threads", lambda requested=None: threads)
    assert mse_compat._vector_only(numel) is vector


def test_scanned_needs_a_scanned_cpu_capability(monkeypatch):
    """``scanned``: this torch *and* CPU capabilities AVX512 or AVX2; elsewhere norm 2.4
    steps aside while the exact-pow norms still apply."""
    monkeypatch.setattr(torch, "__version__", mse_compat._SCANNED[0] + "0")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert not mse_compat.scanned()
    u = _units(4, 128)
    spec = QuantSpec("int4", Channel(0))
    assert not mse_compat.applies(u, spec, 2.4, 20, 1 << 20, None)
    assert mse_compat.applies(u, spec, 2.0, 20, 1 << 20, None)


def test_compat_engine_applies_to_rows_up_to_chunk_elems():
    """``applies``: units of ``n_elems <= chunk_elems`` (a row fills a tile exactly)."""
    u = _units(4, 128)
    spec = QuantSpec("int4", Channel(0))
    assert mse_compat.applies(u, spec, 2.0, 20, 128, None)
    assert not mse_compat.applies(u, spec, 2.0, 20, 127, None)


@pytest.mark.parametrize("shape", [(0, 128), (4, 0)], ids=["no-units", "empty-rows"])
def test_compat_engine_refuses_empty_units(shape):
    """``applies``: at least one unit of at least one element."""
    spec = QuantSpec("int4", Channel(0))
    assert not mse_compat.applies(torch.zeros(shape), spec, 2.0, 20, 1 << 20, None)


def test_compat_search_of_no_units_chooses_nothing():
    """No units: empty choices (the engine, which reads its largest error, steps aside)."""
    u = torch.zeros(0, 128)
    res = mse_search(u, *unit_minmax(u), QuantSpec("int4", Channel(0)), compat="llmcompressor",
                     norm=2.0)
    assert res.index.shape == (0,) and res.lo.shape == (0,) and res.hi.shape == (0,)


@needs_search
def test_kernel_search_keeps_float32_squares():
    """The search's errors under ``float32_squares`` are the torch path's (float32 squares
    summed in float64), not the exact squares' sums."""
    u = _units(8, 64, seed=2) * 0.37
    lo, hi = unit_minmax(u)
    got = mse_search(u, lo, hi, ASYM, backend="kernel", float32_squares=True)
    ref = mse_search(u, lo, hi, ASYM, backend="torch", float32_squares=True)
    exact = mse_search(u, lo, hi, ASYM, backend="torch")
    assert torch.equal(got.index, ref.index)
    assert torch.allclose(got.error, ref.error, rtol=1e-12, atol=0)
    assert not torch.allclose(got.error, exact.error, rtol=1e-12, atol=0)


@needs_pnorm
def test_compat_prices_strided_units_as_their_values():
    u = _units(128, 6).t()  # [6, 128], not contiguous
    spec = QuantSpec("int4", Channel(0))
    scale, zp = _candidates(u.contiguous(), spec)
    got = mse_compat.price(u, scale, zp, spec, 2.4)
    assert torch.equal(got, mse_compat.price(u.contiguous(), scale, zp, spec, 2.4))


@needs_pnorm
@pytest.mark.parametrize("tie", ["first", "last"])
def test_compat_fallback_to_torch_keeps_tie_and_patience(tie):
    """Kernel errors past ``2^100`` (torch's float32 errors still finite) send the search to
    the torch path, with the caller's ``tie`` and ``patience``: a row of zeros ties at every
    candidate."""
    row = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)) * 1e17
    u = torch.cat((row, torch.zeros(1, 64)))  # patience 1 stops this row's search early
    lo, hi = unit_minmax(u)
    spec = QuantSpec("int4", Channel(0))
    kw = {"compat": "llmcompressor", "norm": 2.0, "tie": tie, "patience": 1}
    got = mse_search(u, lo, hi, spec, **kw)
    ref = mse_search(u, lo, hi, spec, backend="torch", **kw)
    assert torch.isfinite(ref.error).all()
    assert torch.equal(got.index, ref.index) and torch.equal(got.lo, ref.lo)
    assert torch.equal(got.hi, ref.hi) and torch.equal(got.error, ref.error)


@needs_search
def test_kernel_extension_with_a_budget_below_one_candidate_per_chunk():
    """``chunk_elems`` under a chunk's unit count (256 at least): the extension steps one
    candidate at a time (a block of none would never end) and chooses as the torch path."""
    u = _units(300, 32, seed=4)  # chunks of 256 and 44 units
    lo, hi = unit_minmax(u)
    got = mse_search(u, lo, hi, ASYM, backend="kernel", chunk_elems=100, early_stop=False)
    ref = mse_search(u, lo, hi, ASYM, backend="torch")
    assert torch.equal(got.index, ref.index) and torch.equal(got.lo, ref.lo)


@needs_search
def test_kernel_global_stop_before_the_last_candidate_over_several_chunks():
    """Two chunks of units: factor 1.5 improves no unit, so patience 1 stops the search
    before the last candidate (0.8, which would improve some): the pass redone knowing the
    stop must not choose it."""
    u = torch.randn(300, 128, generator=torch.Generator().manual_seed(6))  # chunks 256, 44
    lo, hi = unit_minmax(u)
    kw = {"factors": [0.95, 1.5, 0.8], "per_unit_patience": False}
    got = mse_search(u, lo, hi, ASYM, backend="kernel", chunk_elems=1000, patience=1, **kw)
    ref = mse_search(u, lo, hi, ASYM, backend="torch", patience=1, **kw)
    assert torch.equal(got.index, ref.index) and torch.equal(got.lo, ref.lo)
    assert int(ref.index.max()) < 2
    assert int(mse_search(u, lo, hi, ASYM, patience=None, **kw).index.max()) == 2


@needs_search
def test_kernel_independent_ends_build_each_end_from_its_factor():
    """An asymmetric 2-D grid of ``(f_lo, f_hi)`` pairs: the chosen range is
    ``(lo * f_lo, hi * f_hi)`` of the chosen pair."""
    u = _units(12, 64, seed=7)
    lo, hi = unit_minmax(u)
    kw = {"independent_ends": True, "ends_grid": 5}
    got = mse_search(u, lo, hi, ASYM, backend="kernel", **kw)
    ref = mse_search(u, lo, hi, ASYM, backend="torch", **kw)
    assert torch.equal(got.index, ref.index)
    assert torch.equal(got.lo, ref.lo) and torch.equal(got.hi, ref.hi)


@needs_pnorm
@pytest.mark.parametrize("tie", ["first", "last"])
def test_compat_two_near_candidates_are_settled_by_torch(tie):
    """Units so small that every kernel error is below the bound's absolute slack ``a``:
    both candidates' intervals start at 0, so each unit's choice is torch's ``T``, every
    pair recomputed (``STATS``)."""
    u = _units(16, 64, seed=8) * 1e-20
    lo, hi = unit_minmax(u)
    spec = QuantSpec("int4", Channel(0))
    kw = {"compat": "llmcompressor", "norm": 2.0, "tie": tie, "factors": [1.0, 0.9],
          "patience": None}
    got = mse_search(u, lo, hi, spec, backend="kernel", **kw)
    assert mse_compat.STATS == {"pairs": 32, "recomputed": 32, "units": 16,
                                "units_recomputed": 16}
    ref = mse_search(u, lo, hi, spec, backend="torch", **kw)
    assert torch.equal(got.index, ref.index) and torch.equal(got.error, ref.error)


@needs_pnorm
def test_compat_global_patience_counts_consecutive_candidates():
    """llm-compressor's global rule: an improvement resets the count, so two candidates
    that improve no unit (1.5) separated by one that does (0.9) do not stop patience 2."""
    u = _units(8, 64, seed=9)
    lo, hi = unit_minmax(u)
    spec = QuantSpec("int4", Channel(0))
    kw = {"compat": "llmcompressor", "norm": 2.0, "patience": 2,
          "factors": [1.0, 1.5, 0.9, 1.5, 0.8]}
    got = mse_search(u, lo, hi, spec, backend="kernel", **kw)
    ref = mse_search(u, lo, hi, spec, backend="torch", **kw)
    assert torch.equal(got.index, ref.index)
    assert int(ref.index.max()) == 4
