"""Pins from the s69 mutation round over ``estimators/mse_tiles`` (the torch path's tiles and
selection state) and ``estimators/mse_ops`` (the search as ``quantscope::`` ops): the
factors' magnitude in ``finite_candidates``, ``_tile_error``'s rounding identity against the
fake quantizer, element slices of long units, the last partial chunk of ``tile_numels``,
the early stop that waits for the global rule, float32's max as the no-incumbent start (in
both engines), and the ops engine's weighted chunks and ``float32_squares`` block formats.
Each test here failed on a mutant of those modules that the rest of the suite let through."""

from __future__ import annotations

import pytest
import torch

from quantscope import kernels, presets
from quantscope.estimators import mse_ops, mse_search, mse_tiles
from quantscope.estimators.mse_tiles import finite_candidates, tile_numels
from quantscope.estimators.weighted import weighted_search
from quantscope.qdq import fake_quantize_units
from quantscope.qparams import qparams_from_range
from quantscope.spec import QuantSpec

BIG = torch.finfo(torch.float32).max
INT4 = QuantSpec("int4", "channel", symmetric=False)


@pytest.mark.parametrize(("factors", "finite"), [([-2.0, 0.5], False), ([-0.5, 1.0], True)])
def test_finite_candidates_bounds_by_the_factors_magnitude(factors, finite):
    """``|end| * |factor|``: a negative factor of magnitude 2 takes ``BIG / 1.5`` past
    float32's max, one of magnitude 0.5 does not."""
    ends = (torch.tensor([BIG / 1.5]), torch.tensor([1.0]))
    assert finite_candidates(ends, (torch.tensor(factors),)) is finite


def test_tile_numels_of_a_last_partial_chunk(monkeypatch):
    """20 candidates in chunks of 8 (8, 8, 4), 3 candidates of one 4-element unit per
    12-element tile: tiles of 3, 3, 2 candidates, then 3, 1 in the last chunk; the torch
    path prices exactly those."""
    seen = set()
    real = mse_tiles._tile_error

    def spy(x, scale, *rest):
        seen.add(scale.shape[0] * x.numel())
        return real(x, scale, *rest)

    monkeypatch.setattr(mse_tiles, "_tile_error", spy)
    units = torch.linspace(-1.0, 1.0, 20).reshape(5, 4)
    lo, hi = torch.aminmax(units, dim=1)
    factors = [1 - 0.01 * i for i in range(20)]
    mse_tiles.search(units, lo, hi, INT4, factors, factors, norm=2.0, patience=None,
                     per_unit=True, tie="first", exact=False, incumbent=None,
                     global_amax=None, chunk_elems=12, chunk_candidates=8, early_stop=False)
    assert tile_numels(5, 4, 20, 12, 8) == {12, 8, 4} == seen


@pytest.mark.skipif(not kernels.available("mse_search"), reason="no C compiler")
def test_ops_weighted_search_in_chunks_of_units_is_the_weighted_search():
    """``weights`` are sliced with their units: the ops engine with a chunk of a few units
    (``chunk_elems=1``: one unit per ``[candidates, units]`` block) chooses what
    ``weighted_search`` chooses on the same weights."""
    g = torch.Generator().manual_seed(3)
    units = torch.randn(6, 16, generator=g)
    weights = torch.rand(6, 16, generator=g).pow_(4).contiguous()
    lo0, hi0 = torch.aminmax(units, dim=1)
    factors = [1 - 0.05 * i for i in range(1, 10)]
    lo, hi, _, _ = mse_ops.search(
        units, lo0, hi0, INT4, factors, factors, patience=None, per_unit=False, tie="first",
        incumbent=(lo0, hi0), global_amax=None, chunk_elems=1, weights=weights)
    ref_lo, ref_hi = weighted_search(units, weights, INT4, factors=factors)
    assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi)


@pytest.mark.parametrize("norm", [1.5, 2.4])
@pytest.mark.parametrize(("fmt", "symmetric"), [("uint4", True), ("int4", False),
                                                ("int8", True), ("fp4_e2m1", True)])
def test_tile_error_is_the_fake_quant_error_sum(fmt, symmetric, norm):
    """``_tile_error`` (not ``exact``) scores ``sum |fake_quant(x) - x| ** norm`` of the
    quantizer itself: the rounding identity keeps a symmetric unsigned format's midpoint
    zero point, clamps to ``[qmin, qmax]`` and scales by ``scale ** norm``; float formats
    take the fake quantizer."""
    spec = QuantSpec(fmt, "channel", symmetric=symmetric)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    lo, hi = torch.aminmax(x, dim=1)
    qp = qparams_from_range(lo * 0.8, hi * 0.8, spec)
    scale, zp = qp.effective_scale.expand_as(lo), qp.zero_point.float().expand_as(lo)
    q = fake_quantize_units(x, scale[:, None], zp[:, None], spec)
    want = (q.double() - x.double()).abs().pow(norm).sum(-1)
    got = mse_tiles._tile_error(x, scale[None], zp[None], spec, norm, False)[0]
    assert got.double().tolist() == pytest.approx(want.tolist(), rel=1e-5)


@pytest.mark.parametrize("norm", [2.0, 2.4])
def test_errors_of_units_longer_than_a_tile_add_up_the_slices(norm):
    """A unit longer than ``chunk_elems`` is priced in element slices whose partial sums add
    up to the whole unit's error, float64 at ``norm=2`` (the kernel's prices)."""
    units = torch.randn(2, 40, generator=torch.Generator().manual_seed(1))
    lo, hi = torch.aminmax(units, dim=1)
    lo_c, hi_c = lo[None] * torch.tensor([[1.0], [0.7]]), hi[None] * torch.tensor([[1.0], [0.7]])
    whole, _, _ = mse_tiles._errors(units, lo_c, hi_c, INT4, norm, False, None, 1 << 10)
    sliced, _, _ = mse_tiles._errors(units, lo_c, hi_c, INT4, norm, False, None, 16)
    assert sliced.dtype == (torch.float64 if norm == 2.0 else torch.float32)
    assert sliced.flatten().tolist() == pytest.approx(whole.flatten().tolist(), rel=1e-5)


def _priced(monkeypatch, table):
    """``mse_tiles._errors`` replaced by errors looked up per candidate factor (``lo_c`` of
    the units' ``lo = -1``), each candidate a new encoded scale (no plateau)."""
    def errors(units, lo_c, hi_c, *rest):
        err = torch.tensor([table[round(-float(f), 6)] for f in lo_c[:, 0]],
                           dtype=torch.float64)
        return err, lo_c.clone(), torch.zeros_like(lo_c)

    monkeypatch.setattr(mse_tiles, "_errors", errors)


def test_early_stop_waits_for_the_global_rule_when_every_unit_stopped(monkeypatch):
    """Native per-unit patience (1) waits for the global rule: unit 0 stops after candidate 1
    and unit 1 after candidate 0, but each candidate improved some unit, so the search goes
    on and unit 0 takes candidate 2 (one candidate per chunk, early stop on)."""
    _priced(monkeypatch, {1.0: [10.0, 10.0], 0.9: [5.0, 10.0], 0.8: [6.0, 4.0],
                          0.7: [1.0, 9.0]})
    lo, hi = torch.full((2,), -1.0), torch.ones(2)
    f = [0.9, 0.8, 0.7]
    _, _, err, idx = mse_tiles.search(
        torch.zeros(2, 4), lo, hi, INT4, f, f, norm=2.0, patience=1, per_unit=True,
        tie="first", exact=False, incumbent=(lo, hi), global_amax=None, chunk_elems=64,
        chunk_candidates=1, early_stop=True)
    assert idx.tolist() == [2, 1] and err.tolist() == [1.0, 4.0]


def test_without_incumbent_errors_past_float32_max_keep_the_first_candidate(monkeypatch):
    """llm-compressor's search starts from float32's max: candidates priced above it (finite
    float64 sums) never win, and the first candidate's range is returned, index -1."""
    _priced(monkeypatch, {0.9: [1e39], 0.8: [2e39]})
    lo, hi = torch.full((1,), -1.0), torch.ones(1)
    f = [0.9, 0.8]
    rlo, rhi, _, idx = mse_tiles.search(
        torch.zeros(1, 4), lo, hi, INT4, f, f, norm=2.0, patience=None, per_unit=False,
        tie="first", exact=False, incumbent=None, global_amax=None, chunk_elems=64,
        chunk_candidates=None, early_stop=True)
    assert idx.tolist() == [-1]
    assert rlo.tolist() == pytest.approx([-0.9]) and rhi.tolist() == pytest.approx([0.9])


@pytest.mark.skipif(not kernels.available("mse_search"), reason="no C compiler")
@pytest.mark.parametrize("preset", ["MXFP4", "NVFP4"])
def test_ops_float32_squares_of_block_formats_are_the_torch_paths(preset):
    """``float32_squares`` (squares rounded to float32) is not the block ops' arithmetic
    (they square exactly): the ops engine prices it candidate by candidate and returns the
    torch tiles' errors and choices."""
    spec = getattr(presets, preset)
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 3.7
    u = spec.layout.to_units(w).contiguous()
    ops_ = mse_search(u, None, None, spec, backend="ops", float32_squares=True)
    ref = mse_search(u, None, None, spec, backend="torch", float32_squares=True)
    assert torch.equal(ops_.error, ref.error) and torch.equal(ops_.index, ref.index)


@pytest.mark.skipif(not kernels.available("mse_search"), reason="no C compiler")
def test_ops_without_incumbent_errors_past_float32_max_keep_the_first_candidate():
    """No incumbent, every candidate priced above float32's max (finite float64 sums of
    units near 1e21): index -1 and the first candidate's range ``(lo * f[0], hi * f[0])``,
    not the min-max range."""
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)) * 1e21
    lo, hi = torch.aminmax(x, dim=1)
    f = [0.9, 0.8]
    rlo, rhi, _, idx = mse_ops.search(
        x, lo, hi, INT4, f, f, patience=None, per_unit=False, tie="first", incumbent=None,
        global_amax=None, chunk_elems=1 << 14)
    first = torch.tensor(0.9)
    assert idx.tolist() == [-1, -1]
    assert torch.equal(rlo, lo * first) and torch.equal(rhi, hi * first)
