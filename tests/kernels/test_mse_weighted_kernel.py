"""The weighted pricing of the imatrix search: the C kernel's weighted entry points
(``qs_mse_price_w`` / ``qs_mse_price_fp_w``, through ``quantscope::mse_price_int`` /
``mse_price_fp`` with ``weights``) against a float64 torch reference, and
``weighted_search``'s choices on the kernel bitwise equal to its torch path's.

The arithmetic (estimators.weighted): ``sum_e float64(w_e) * (float64(d_e) * float64(d_e))``,
``d`` the float32 fake-quant error (its square exact in float64); the reference below sums the
same terms with ``math.fsum`` (exact), so the kernel's sum differs only by its rounding
(1e-12)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantscope import kernels
from quantscope.estimators import weighted
from quantscope.estimators.weighted import weighted_search
from quantscope.kernels import ops, price_ops
from quantscope.layout import Channel, Group
from quantscope.presets import MXFP4, NVFP4
from quantscope.qdq import fake_quantize_units
from quantscope.qparams import qparams_from_range
from quantscope.spec import QuantSpec

pytestmark = pytest.mark.skipif(not kernels.available("mse_search"),
                                reason="the C kernel is not built")

SPECS = {
    "int4_channel": QuantSpec("int4", Channel(0)),
    "int8_channel": QuantSpec("int8", Channel(0)),
    "int4_group": QuantSpec("int4", Group(32)),
    "int4_group_asym": QuantSpec("int4", Group(32), symmetric=False),
    "mxfp4": MXFP4,
    "nvfp4": NVFP4,  # with its global scale
}


def _weight(seed, rows=12, cols=96):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w[0, 3] = 9.0  # an outlier: ranges worth shrinking
    imp = torch.rand(cols, generator=g) ** 3 * 10  # importance spread over decades
    return w, imp


def _candidates(units, spec, factors):
    """Candidate (scale, zero point) [k, U] as weighted_search builds them."""
    lo, hi = units.amin(1), units.amax(1)
    qps = [qparams_from_range(lo * f, hi * f, spec) for f in factors]
    scale = torch.stack([q.effective_scale.expand_as(lo).reshape(-1) for q in qps])
    zp = torch.stack([q.zero_point.expand_as(lo).reshape(-1) for q in qps]).to(torch.int32)
    return scale, zp


def _price(units, scale, zp, spec, weights):
    if spec.is_float:
        f = spec.format
        return ops.mse_price_fp(units, scale, float(f.max), int(f.min_exp), int(f.mbits),
                                weights)
    return ops.mse_price_int(units, scale, zp, float(spec.qmin), float(spec.qmax), weights)


def _reference(units, scale, zp, spec, weights):
    """Exact (fsum) sums of float64(w) * float64(d) ** 2, d from fake_quantize_units."""
    out = torch.empty(scale.shape, dtype=torch.float64)
    for k in range(scale.shape[0]):
        d = fake_quantize_units(units, scale[k, :, None], zp[k, :, None].float(), spec) - units
        terms = weights.double() * d.double().square()
        for u in range(units.shape[0]):
            out[k, u] = math.fsum(terms[u].tolist())
    return out


@pytest.mark.parametrize("name", sorted(SPECS))
def test_weighted_prices_equal_the_float64_reference(name):
    spec = SPECS[name]
    w, imp = _weight(1, cols=100 if spec.layout == Channel(0) else 96)  # a SIMD tail
    units = spec.layout.to_units(w).contiguous()
    weights = weighted.importance_units(imp, w.shape, spec).contiguous()
    scale, zp = _candidates(units, spec, [1.0, 0.95, 0.9, 0.8, 0.55])
    got = _price(units, scale, zp, spec, weights)
    ref = _reference(units, scale, zp, spec, weights)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("name", ["int4_group_asym", "nvfp4"])
def test_unit_weights_give_the_unweighted_prices_bit_for_bit(name):
    spec = SPECS[name]
    w, _ = _weight(2)
    units = spec.layout.to_units(w).contiguous()
    scale, zp = _candidates(units, spec, [1.0, 0.9, 0.7])
    ones = torch.ones_like(units)
    assert torch.equal(_price(units, scale, zp, spec, ones), _price(units, scale, zp, spec, None))


def _torch_path(monkeypatch):
    """The ops' torch pricing (as where no kernel is built)."""
    monkeypatch.setattr(price_ops, "_c_lib", lambda name: None)


def _both(monkeypatch, units, weights, spec, **kw):
    on_kernel = weighted_search(units, weights, spec, **kw)
    with monkeypatch.context() as m:
        _torch_path(m)
        on_torch = weighted_search(units, weights, spec, **kw)
    return on_kernel, on_torch


@pytest.mark.parametrize("patience", [None, 2])
@pytest.mark.parametrize("weighted_", [True, False])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_search_choices_equal_the_torch_path(monkeypatch, name, weighted_, patience):
    spec = SPECS[name]
    w, imp = _weight(3, rows=16, cols=128)
    units = spec.layout.to_units(w)
    weights = weighted.importance_units(imp, w.shape, spec) if weighted_ else None
    factors = [1 - i / 40 for i in range(1, 30)]
    (lo_k, hi_k), (lo_t, hi_t) = _both(monkeypatch, units, weights, spec, factors=factors,
                                       patience=patience)
    assert torch.equal(lo_k, lo_t) and torch.equal(hi_k, hi_t)


def test_the_search_spans_several_blocks_of_factors(monkeypatch):
    """Factors priced in blocks (a small block here) choose as one at a time."""
    spec = SPECS["int4_group"]
    w, imp = _weight(4, rows=16, cols=128)
    units = spec.layout.to_units(w)
    weights = weighted.importance_units(imp, w.shape, spec)
    factors = [1 - i / 50 for i in range(1, 40)]
    whole = weighted_search(units, weights, spec, factors=factors, patience=3)
    monkeypatch.setattr(weighted, "_BLOCK_CANDIDATES", units.shape[0] * 3)
    blocks = weighted_search(units, weights, spec, factors=factors, patience=3)
    _torch_path(monkeypatch)
    on_torch = weighted_search(units, weights, spec, factors=factors, patience=3)
    for a, b, c in zip(whole, blocks, on_torch):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_the_chosen_range_is_the_best_weighted_error():
    """The kernel's search picks a range no candidate beats under the reference error."""
    spec = SPECS["int4_channel"]
    w, imp = _weight(5)
    units = spec.layout.to_units(w).contiguous()
    weights = weighted.importance_units(imp, w.shape, spec).contiguous()
    factors = [1 - i / 20 for i in range(1, 10)]
    lo, hi = weighted_search(units, weights, spec, factors=factors)
    chosen = qparams_from_range(lo, hi, spec)
    z = chosen.zero_point.expand_as(lo).reshape(1, -1).to(torch.int32)
    mine = _reference(units, chosen.effective_scale.reshape(1, -1), z, spec, weights)[0]
    scale, zp = _candidates(units, spec, [1.0, *factors])
    every = _reference(units, scale, zp, spec, weights)
    assert torch.equal(mine, every.amin(0))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2 ** 16), rows=st.integers(1, 9), groups=st.integers(1, 4),
       name=st.sampled_from(["int4_group", "int4_group_asym", "nvfp4", "mxfp4"]),
       patience=st.sampled_from([None, 1, 3]), scale=st.sampled_from([1e-3, 1.0, 300.0]))
def test_property_search_choices_equal_the_torch_path(seed, rows, groups, name, patience, scale):
    spec = SPECS[name]
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, 32 * groups, generator=g) * scale
    imp = torch.rand(32 * groups, generator=g)
    imp[imp < 0.2] = 0.0  # ignored columns
    units = spec.layout.to_units(w)
    weights = weighted.importance_units(imp, w.shape, spec)
    factors = [1 - i / 25 for i in range(1, 20)]
    with pytest.MonkeyPatch.context() as m:
        (lo_k, hi_k), (lo_t, hi_t) = _both(m, units, weights, spec, factors=factors,
                                           patience=patience)
    assert torch.equal(lo_k, lo_t) and torch.equal(hi_k, hi_t)


def test_bad_weights_shape_is_a_clear_error():
    units = torch.randn(4, 32)
    with pytest.raises(ValueError, match="weights must be None or a tensor of units' shape"):
        weighted_search(units, torch.ones(4, 16), SPECS["int4_channel"])
    scale = torch.ones(2, 4)
    zp = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="mse_price_int: weights must be None or a float32"):
        ops.mse_price_int(units, scale, zp, -8.0, 7.0, torch.ones(4, 31))
    with pytest.raises(ValueError, match="mse_price_fp: weights must be None or a float32"):
        ops.mse_price_fp(units, scale, 6.0, 0, 1, torch.ones(4, 32, dtype=torch.float64))


def test_opcheck_with_weights():
    units = torch.randn(5, 40)
    scale = torch.rand(3, 5) + 0.05
    zp = torch.randint(-3, 3, (3, 5), dtype=torch.int32)
    weights = torch.rand(5, 40)
    torch.library.opcheck(ops.mse_price_int, (units, scale, zp, -8.0, 7.0, weights))
    torch.library.opcheck(ops.mse_price_fp, (units, scale, 6.0, 0, 1, weights))


def _sequential(err, lo0, factors, patience):
    """The rules one factor at a time (the search's definition): the chosen lo."""
    best, lo, stale = err[0].clone(), lo0.clone(), 0
    for f, e in zip(factors[1:], err[1:]):
        better = e < best
        best = torch.where(better, e, best)
        lo = torch.where(better, lo0 * f, lo)
        if patience is not None:
            stale = 0 if bool(better.any()) else stale + 1
            if stale >= patience:
                break
    return lo


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 16), k=st.integers(1, 12), units=st.integers(1, 6),
       block=st.integers(1, 12), patience=st.sampled_from([None, 1, 2, 3]),
       nan=st.booleans())
def test_property_block_selection_is_the_sequential_walk(seed, k, units, block, patience, nan):
    """weighted.select_candidates on blocks of rows chooses as the factor-by-factor walk: ties (few
    distinct values) keep the earliest, NaN never wins, the global rule stops at the row."""
    g = torch.Generator().manual_seed(seed)
    err = torch.randint(0, 4, (k + 1, units), generator=g).double()
    if nan:
        err[torch.rand(err.shape, generator=g) < 0.2] = math.nan
    lo0 = -torch.rand(units, generator=g) - 0.5
    factors = [1.0] + [1 - i / 20 for i in range(1, k + 1)]
    blocks = (err[i:i + block] for i in range(0, k + 1, block))
    lo, hi = weighted.select_candidates(blocks, lo0, -lo0, factors, patience)
    want = _sequential(err, lo0, factors, patience)
    assert torch.equal(lo, want) and torch.equal(hi, -want)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "int4_group_asym"])
def test_candidates_are_priced_as_they_run_under_the_incumbents_global_scale(name):
    """The chosen range is the first best of the candidates' reference errors, each candidate
    quantized as its qparams run (NVFP4: under the min-max range's global amax)."""
    spec = SPECS[name]
    w, imp = _weight(6, rows=8, cols=128)
    units = spec.layout.to_units(w).contiguous()
    weights = weighted.importance_units(imp, w.shape, spec).contiguous()
    factors = [1.0] + [1 - i / 16 for i in range(1, 8)]
    lo0, hi0 = units.amin(1), units.amax(1)
    ga = torch.maximum(lo0.abs(), hi0.abs()).max() if spec.scale.has_global_scale else None
    errs = []
    for f in factors:
        qp = qparams_from_range(lo0 * f, hi0 * f, spec, global_amax=ga)
        s = qp.effective_scale.expand_as(lo0).reshape(1, -1)
        z = qp.zero_point.expand_as(lo0).reshape(1, -1).to(torch.int32)
        errs.append(_reference(units, s, z, spec, weights)[0])
    pick = torch.stack(errs).argmin(0)  # the first minimum
    want = lo0 * torch.tensor(factors)[pick]
    lo, _ = weighted_search(units, weights, spec, factors=factors[1:])
    assert torch.equal(lo, want)


def test_imatrix_observer_runs_the_global_scale_it_priced():
    """NVFP4: the observer's qparams take the global amax the search priced every candidate
    under (the min-max range's), not one derived from the chosen, shrunk ranges: with the
    largest block's range shrunk, the two differ."""
    from quantscope import presets
    from quantscope.observers import get_observer
    from quantscope.scales import nvfp4_global_scale

    g = torch.Generator().manual_seed(2)
    w = torch.randn(8, 64, generator=g)
    w[0, :16] *= 8  # the largest block: its range shrinks (this seed: 10.43 -> 9.29)
    amax = w.abs().max()
    obs = get_observer("imatrix_mse", presets.NVFP4, importance=torch.rand(64, generator=g))
    obs(w)
    assert torch.equal(obs.global_amax(), amax)
    assert torch.maximum(obs.max_vals, -obs.min_vals).max() < amax  # chosen ranges: another
    qp = obs.calculate_qparams()
    assert torch.equal(qp.global_scale.reshape(()),
                       nvfp4_global_scale(amax, presets.NVFP4.format).reshape(()))


def test_imatrix_observer_reads_its_units_once_for_their_ranges(monkeypatch):
    """The observer hands the search the per-unit min / max its forward found (no second
    pass over the weight), and chooses what the search finds from the units alone."""
    from quantscope.estimators.weighted import importance_units
    from quantscope.observers import get_observer

    g = torch.Generator().manual_seed(3)
    w, imp = torch.randn(8, 64, generator=g), torch.rand(64, generator=g)
    want = weighted_search(NVFP4.layout.to_units(w), importance_units(imp, w.shape, NVFP4),
                           NVFP4)

    def read_again(*args, **kwargs):
        raise AssertionError("the search read the units for their ranges again")

    monkeypatch.setattr(weighted, "unit_minmax", read_again)
    obs = get_observer("imatrix_mse", NVFP4, importance=imp)
    obs(w)
    assert torch.equal(obs.min_vals, want[0]) and torch.equal(obs.max_vals, want[1])
