"""weighted_search's options: ``expand`` (candidates above the min-max range) and ``patience``
(llm-compressor's global stopping rule). Reference values come from range_error, the error of
one range; the defaults (no expand, no patience) are what the native imatrix search runs."""

from __future__ import annotations

import pytest
import torch

from quantscope.estimators.mse import range_error
from quantscope.estimators.weighted import weighted_search
from quantscope.layout import Channel
from quantscope.spec import QuantSpec

INT4 = QuantSpec("int4", Channel(0))


def _units(seed=0):
    torch.manual_seed(seed)
    return torch.randn(6, 64)


def test_expand_makes_the_expanded_range_the_incumbent():
    u = _units()
    lo, hi = u.amin(1), u.amax(1)
    got = weighted_search(u, None, INT4, factors=[1.0], expand=2.0)
    assert torch.equal(got[0], lo * 2.0) and torch.equal(got[1], hi * 2.0)
    # (lo * 2) * 0.5 is the min-max range exactly: the better of the two per unit
    got = weighted_search(u, None, INT4, factors=[0.5], expand=2.0)
    wide, tight = (range_error(u, lo * f, hi * f, INT4, norm=2.0) for f in (2.0, 1.0))
    pick = tight < wide
    assert torch.equal(got[1], torch.where(pick, hi, hi * 2.0))


def test_patience_stops_after_factors_that_improve_no_unit():
    torch.manual_seed(0)
    u = torch.randn(6, 256)
    lo, hi = u.amin(1), u.amax(1)
    factors = [1.0, 1.0, 0.8]  # two repeats of the incumbent, then a real shrink
    shrink = range_error(u, lo * 0.8, hi * 0.8, INT4) < range_error(u, lo, hi, INT4)
    assert shrink.any()
    free = weighted_search(u, None, INT4, factors=factors)
    assert torch.equal(free[1], torch.where(shrink, hi * 0.8, hi))
    for patience, shrunk in ((1, False), (2, False), (3, True)):
        got = weighted_search(u, None, INT4, factors=factors, patience=patience)
        assert torch.equal(got[1], free[1] if shrunk else hi), patience


def test_uniform_weights_none_equals_ones():
    u = _units(1)
    ones = torch.ones_like(u)
    a = weighted_search(u, None, INT4, norm=2.4)
    b = weighted_search(u, ones, INT4, norm=2.4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("norm", [2.4, 3.0])
def test_other_norms_price_on_the_ops(norm):
    """A norm other than 2 (llm-compressor's imatrix uses 3): float64 sums of
    ``w * |d| ** norm`` (torch's float32 power), one ``mse_price_int`` a block of factors;
    each unit's choice the first lowest of those sums, written out here."""
    from op_names import OpNames

    from quantscope.qdq import fake_quantize_units
    from quantscope.qparams import qparams_from_range

    u = _units(2)
    w = torch.rand_like(u) + 0.1
    factors = [0.95, 0.9, 0.8, 0.7]
    with OpNames() as seen:
        lo, hi = weighted_search(u, w, INT4, factors=factors, norm=norm)
    assert "quantscope.mse_price_int" in seen.names
    lo0, hi0 = u.amin(1), u.amax(1)
    errs = []
    for f in [1.0, *factors]:
        qp = qparams_from_range(lo0 * f, hi0 * f, INT4)
        d = fake_quantize_units(u, qp.effective_scale.reshape(-1, 1),
                                qp.zero_point.float().reshape(-1, 1), INT4) - u
        errs.append((d.abs().pow(norm).double() * w.double()).sum(1))
    f = torch.tensor([1.0, *factors])[torch.stack(errs).argmin(0)]
    assert torch.equal(lo, lo0 * f) and torch.equal(hi, hi0 * f)


def test_zero_factor_is_a_candidate():
    u = torch.zeros(2, 8)
    lo, hi = weighted_search(u, None, INT4, factors=[0.0])
    assert torch.equal(lo, torch.zeros(2)) and torch.equal(hi, torch.zeros(2))


@pytest.mark.parametrize("kwargs,match", [
    ({"expand": 0}, "expand must be a finite positive number"),
    ({"expand": float("inf")}, "expand must be a finite positive number"),
    ({"patience": 0}, "patience must be a positive integer or None"),
    ({"patience": 1.5}, "patience must be a positive integer or None"),
    ({"factors": [1.1]}, r"factors must be in \[0, 1\]"),
    ({"factors": [-0.5]}, r"factors must be in \[0, 1\]"),
    ({"norm": 0}, r"norm must be a finite number in \(0.0, inf\]"),
    ({"norm": float("inf")}, "norm must be a finite number")])
def test_bad_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        weighted_search(_units(), None, INT4, **kwargs)
