"""weighted_search's options: ``expand`` (candidates above the min-max range) and ``patience``
(llm-compressor's global stopping rule). Reference values come from range_error, the error of
one range; the defaults (no expand, no patience) are what the native imatrix search runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantscope import presets
from quantscope.estimators.mse import range_error
from quantscope.estimators.weighted import (
    _engine_search,
    imatrix_range,
    importance_units,
    weighted_search,
)
from quantscope.layout import Channel, Group
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
    ({"expand": 0}, r"expand must be a finite number in \(0.0, inf\)"),
    ({"expand": float("inf")}, r"expand must be a finite number in \(0.0, inf\)"),
    ({"patience": 0}, r"patience \(or None\) must be an integer >= 1"),
    ({"patience": 1.5}, r"patience \(or None\) must be an integer >= 1"),
    ({"patience": True}, r"patience \(or None\) must be an integer >= 1"),
    ({"factors": [1.1]}, r"factors must be in \[0, 1\]"),
    ({"factors": [-0.5]}, r"factors must be in \[0, 1\]"),
    ({"norm": 0}, r"norm must be a finite number in \(0.0, inf\)"),
    ({"norm": float("inf")}, "norm must be a finite number")])
def test_bad_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        weighted_search(_units(), None, INT4, **kwargs)


def test_numpy_options_search_as_python_numbers():
    u = _units()
    want = weighted_search(u, None, INT4, expand=1.5, patience=3)
    got = weighted_search(u, None, INT4, expand=np.float32(1.5), patience=np.int64(3))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


ENGINE_SPECS = {"nvfp4": presets.NVFP4, "mxfp4": presets.MXFP4, "mxint8": presets.MXINT8,
                "fp8-channel": QuantSpec("fp8_e4m3", Channel(0)), "int4-channel": INT4,
                "int4-group16-asym": QuantSpec("int4", Group(16), symmetric=False)}


def _imatrix_case(spec, seed=3):
    """A weight's units under ``spec`` and per-element importance (log-normal, some 0)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 64, generator=g) * torch.rand(16, 1, generator=g).add_(0.05)
    w[1, 3], w[2] = 9.0, 0.0  # an outlier; all-zero units
    imp = torch.exp(torch.randn(64, generator=g) * 1.5)
    imp[::7] = 0.0
    return spec.layout.to_units(w), importance_units(imp, w.shape, spec)


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("norm", [2.0, 2.4])
@pytest.mark.parametrize("name", list(ENGINE_SPECS))
def test_the_engine_search_off_the_cpu_chooses_what_the_blocks_of_factors_choose(name, norm,
                                                                                 weighted):
    """Off the CPU the search (no patience) is the MSE engine's ops: block-scale formats in
    one op that prices each distinct block scale once on CUDA. Run here on the CPU (where
    the ops are their definitions) it gives the ranges of the path the CPU runs (blocks of
    factors priced, then the first lowest kept) bit for bit, and it runs those ops."""
    from op_names import OpNames

    spec = ENGINE_SPECS[name]
    units, w = _imatrix_case(spec)
    w = w if weighted else None
    factors = [1 - i / 100 for i in range(1, 20)] + [0.5]
    want = weighted_search(units, w, spec, factors=factors, norm=norm)
    lo0, hi0 = units.amin(1), units.amax(1)
    with OpNames() as seen:
        got = _engine_search(units, w, spec, lo0, hi0, factors, norm)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    if weighted or spec.scale.kind != "e8m0":  # (unweighted, MX keeps every min-max scale)
        assert (want[1] != hi0).any() and (want[1] == hi0).any()  # both outcomes
    if norm == 2.0 and spec.scale.is_block:
        op = "nvfp4_search" if spec.scale.has_global_scale else "mx_mse"
        assert f"quantscope.{op}" in seen.names


def test_importance_moves_the_engine_search():
    """The case above can tell weights from none on every path it compares."""
    for spec in (presets.NVFP4, presets.MXFP4, INT4):
        units, w = _imatrix_case(spec)
        lo0, hi0 = units.amin(1), units.amax(1)
        factors = [1 - i / 100 for i in range(1, 20)]
        plain = _engine_search(units, None, spec, lo0, hi0, factors, 2.0)
        weighted = _engine_search(units, w, spec, lo0, hi0, factors, 2.0)
        assert not torch.equal(plain[1], weighted[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(ENGINE_SPECS))
def test_cuda_weighted_search_is_the_cpu_search(name):
    """On CUDA (the engine's Triton kernels) the ranges are the CPU's up to the order of the
    float64 sums: near ties may fall the other way, nothing else."""
    spec = ENGINE_SPECS[name]
    units, w = _imatrix_case(spec)
    cpu = weighted_search(units, w, spec)
    cuda = weighted_search(units.cuda(), w.cuda(), spec)
    assert (cuda[1].cpu() == cpu[1]).float().mean() > 0.95


def test_importance_of_other_types():
    # a list or numpy array reads as the tensor it holds (as the observer's constructor
    # takes it); a complex one lost its imaginary part to .float(), a str raised an
    # AttributeError naming nothing
    spec = QuantSpec("int4", Channel(0))
    want = importance_units(torch.tensor([1.0, 2.0, 3.0]), (2, 3), spec)
    assert torch.equal(importance_units([1.0, 2.0, 3.0], (2, 3), spec), want)
    assert torch.equal(importance_units(np.array([1.0, 2.0, 3.0]), (2, 3), spec), want)
    with pytest.raises(TypeError, match="imatrix_range: importance must be real numbers, got "
                                        "torch.complex64"):
        importance_units(torch.tensor([1 + 1j, 2, 3]), (2, 3), spec)
    # a bool mask is no weight (True / False as 1 / 0 would silently drop channels)
    for mask in (torch.tensor([True, False, True]), [True, False, True]):
        with pytest.raises(TypeError, match="importance must be real numbers, got torch.bool"):
            importance_units(mask, (2, 3), spec)
    with pytest.raises(TypeError, match="importance must be real numbers, got torch.bool"):
        imatrix_range(torch.randn(2, 3), torch.tensor([True, False, True]), spec)
    with pytest.raises(TypeError, match="imatrix_range: importance must be a tensor of one "
                                        "value per input channel, got str"):
        importance_units("abc", (2, 3), spec)
    with pytest.raises(ValueError, match="finite and non-negative in float32"):
        importance_units(torch.tensor([1e300, 1.0, 1.0], dtype=torch.float64), (2, 3), spec)
