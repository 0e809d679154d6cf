"""MSE searches on finite weights that hold float32's largest values.

A candidate ``f * range`` with ``f > 1`` overflows float32 there. ``qparams_from_range``
saturates such a range's scale, whose priced error is finite (values that round to the
saturated code cost nothing), so the searches used to pick it and return an infinite range
that the observer's qparams then refused as "NaN or inf" input. A candidate whose range is
not finite is never chosen now, on every engine.
"""

from __future__ import annotations

import pytest
import torch

import quantscope
from quantscope import QuantSpec, presets
from quantscope.estimators.mse import mse_search, pow2_search

F = torch.finfo(torch.float32).max
SPECS = [QuantSpec("int8"), QuantSpec("fp8_e4m3", "channel:0"),
         QuantSpec("int4", "group:4", symmetric=False)]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_pow2_mse_at_float32_max_keeps_min_max(spec):
    # at |x| ~ 3.4e38 the x4 and x2 ranges are inf (priced NaN, never chosen), and min-max
    # (x1) prices lowest of the others (its squares exact in float64): min-max stands
    w = torch.tensor([[F, -1.0, 2.0, 0.5]])
    mm, p2 = (quantscope.get_observer(n, spec) for n in ("memoryless_minmax", "pow2_mse"))
    mm(w), p2(w)
    assert torch.equal(p2.calculate_qparams().scale, mm.calculate_qparams().scale)
    r = pow2_search(w, w.amin(1), w.amax(1), QuantSpec("int8"))
    assert torch.equal(r.hi, torch.tensor([F])) and torch.equal(r.lo, torch.tensor([-1.0]))


def _weight():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    w[2] *= 1e37  # large, but x1.5 stays finite
    w[:, 3] = F
    w[1, 5] = -F / 1.2
    return w


@pytest.mark.parametrize("spec", [QuantSpec("int8", "channel:0"), presets.MXFP4, presets.NVFP4,
                                  QuantSpec("int4", "group:32", symmetric=False)], ids=str)
def test_expanded_search_never_returns_a_range_past_float32(spec):
    units = spec.layout.to_units(_weight())
    lo, hi = units.amin(1), units.amax(1)
    picks = {}
    for backend in ("torch", "kernel", "ops"):
        r = mse_search(units, None, None, spec, expand=1.5, backend=backend)
        assert bool(torch.isfinite(r.lo).all() and torch.isfinite(r.hi).all()), backend
        # a unit holding ~F: every candidate (lo * 1.5) * p is inf, so min-max (index -1)
        big = torch.maximum(-lo, hi) * 1.5 == float("inf")
        assert bool((r.index[big] == -1).all()), backend
        assert torch.equal(r.lo[big], lo[big]) and torch.equal(r.hi[big], hi[big])
        picks[backend] = r.index
    assert torch.equal(picks["torch"], picks["kernel"])
    assert torch.equal(picks["torch"], picks["ops"])


def test_memoryless_mse_expand_at_float32_max_gives_min_max_qparams():
    w = torch.tensor([[F, -1.0, 2.0, 0.5] * 8])
    mm = quantscope.get_observer("memoryless_minmax", QuantSpec("int8"))
    o = quantscope.get_observer("memoryless_mse", QuantSpec("int8"), expand=1.5)
    mm(w), o(w)
    assert torch.equal(o.calculate_qparams().scale, mm.calculate_qparams().scale)
