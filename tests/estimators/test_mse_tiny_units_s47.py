"""MSE searches on units of tiny values (``|x|`` ~ 1e-21 .. 1e-24).

Each candidate was priced by float32 squares ``d * d`` (summed in float64), which lose
precision below ``|d|`` ~ 1e-19 and underflow to 0 below ~3e-23: there the candidates tied
and the tie rule chose (``pow2_mse`` measured 16x, ``linear_mse`` 88x min-max's error,
``memoryless_mse`` 1 % worse than min-max). The squares are exact in float64 now, on every
engine, so a power-of-two scaling of the data, which scales every error exactly, changes no
choice: each search chooses on ``x * 2 ** k`` what it chooses on ``x``, its ranges scaled by
exactly ``2 ** k``, and never with more error than min-max. The compat classes keep their
toolkit's float32 squares (Horizon's ``linalg.norm``; llm-compressor's ``|d| ** 2``).
"""

from __future__ import annotations

import pytest
import torch

import quantscope
from quantscope import QuantSpec, kernels, presets
from quantscope.compat import horizon as hz
from quantscope.estimators.mse import mse_search
from quantscope.estimators.weighted import imatrix_range
from quantscope.qdq import fake_quantize_units
from quantscope.qparams import qparams_from_range
from quantscope.stats.minmax import unit_minmax

#: 2 ** -70 ~ 8.5e-22 (the float32 squares lose bits), 2 ** -80 ~ 8.3e-25 (they vanish)
KS = (-70, -80)
#: integer specs take scales that small with a float32-subnormal eps
SPECS = {"int8_channel": QuantSpec("int8", "channel:0", eps=1e-45),
         "int4_g32_asym": QuantSpec("int4", "group:32", symmetric=False, eps=1e-45),
         "mxfp4": presets.MXFP4, "mxint8": presets.MXINT8, "nvfp4": presets.NVFP4}
LINEAR = [1 - 0.01 * i for i in range(95)]
#: the native searches' candidates and rules (observers/mse.py: memoryless_mse,
#: linear_mse, pow2_mse), one global amax for NVFP4
SEARCHES = {"memoryless_mse": {},
            "linear_mse": {"factors": LINEAR, "tie": "last", "patience": None},
            "pow2_mse": {"factors": [4.0, 2.0, 1.0, 0.5, 0.25], "patience": None,
                         "incumbent": False}}
_KERNEL = pytest.param("kernel", marks=pytest.mark.skipif(
    not kernels.available("mse_search"), reason="no C compiler (or QUANTSCOPE_NO_KERNEL)"))


def weight(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 64, generator=g) * torch.linspace(0.2, 3, 64)
    x[3, 7] = 9.0
    return x


def exact_error(units, lo, hi, spec, global_amax=None):
    """Per-unit float64 squared error of the quantizer of ``(lo, hi)`` (NVFP4: under
    ``global_amax``, what the search priced its candidates under)."""
    qp = qparams_from_range(lo, hi, spec, global_amax=global_amax)
    q = fake_quantize_units(units, qp.effective_scale.expand_as(lo)[:, None],
                            qp.zero_point.float().expand_as(lo)[:, None], spec)
    return (q.double() - units.double()).square().sum(-1)


#: (spec, search) as the observers run them: linear_mse refuses an asymmetric spec
SPEC_SEARCHES = [(name, search) for name in sorted(SPECS) for search in sorted(SEARCHES)
                 if search != "linear_mse" or SPECS[name].symmetric]


@pytest.mark.parametrize("backend", ["torch", "ops", _KERNEL])
@pytest.mark.parametrize(("name", "search"), SPEC_SEARCHES)
def test_searches_choose_alike_at_any_power_of_two_scale(name, search, backend):
    spec = SPECS[name]
    rule = {**SEARCHES[search], "global_grid": 1, "backend": backend}
    units = spec.layout.to_units(weight())
    lo, hi = unit_minmax(units)
    if search == "linear_mse":
        amax = torch.maximum(-lo, hi)
        lo, hi = -amax, amax
    ref = mse_search(units, lo, hi, spec, **rule)
    for k in KS:
        f = 2.0 ** k
        u, lo_k, hi_k = units * f, lo * f, hi * f
        res = mse_search(u, lo_k, hi_k, spec, **rule)
        assert torch.equal(res.index, ref.index), (k, res.index, ref.index)
        assert torch.equal(res.lo, ref.lo * f) and torch.equal(res.hi, ref.hi * f), k
        ga = res.global_amax  # NVFP4: the min-max range's, scaled alike
        got = exact_error(u, res.lo, res.hi, spec, ga)
        assert bool((got <= exact_error(u, lo_k, hi_k, spec, ga)).all()), k


@pytest.mark.parametrize("name", ["memoryless_mse", "mse", "linear_mse", "pow2_mse"])
@pytest.mark.parametrize("spec", [SPECS["int8_channel"], presets.MXFP4, presets.MXINT8],
                         ids=str)
def test_observers_scale_their_qparams_with_tiny_weights(name, spec):
    x = weight()
    ref = quantscope.get_observer(name, spec)
    ref(x)
    for k in KS:
        o = quantscope.get_observer(name, spec)
        o(x * 2.0 ** k)
        got, want = o.calculate_qparams(), ref.calculate_qparams()
        assert torch.equal(got.effective_scale, want.effective_scale * 2.0 ** k), k
        assert torch.equal(got.zero_point, want.zero_point)


@pytest.mark.parametrize("spec", [SPECS["int8_channel"], presets.MXFP4], ids=str)
def test_imatrix_search_scales_with_tiny_weights(spec):
    x = weight()
    imp = torch.rand(64, generator=torch.Generator().manual_seed(2)) ** 3 * 10
    lo, hi = imatrix_range(x, imp, spec)
    for k in KS:
        lo_k, hi_k = imatrix_range(x * 2.0 ** k, imp, spec)
        assert torch.equal(lo_k, lo * 2.0 ** k) and torch.equal(hi_k, hi * 2.0 ** k), k


def horizon_ends(x):
    """Horizon's MSEObserver on one batch, written out: ``torch.linalg.norm`` of the float32
    error of ``amax * (1 - 0.01 i)`` (qint8: scale ``/ 127.5``), the last minimum; the batch's
    signed ends times its factor."""
    mn, mx = torch.aminmax(x)
    errs = []
    for i in range(95):
        s = torch.max(-mn, mx) * (1 - 0.01 * i) / 127.5
        errs.append(torch.linalg.norm(torch.round(x / s).clamp(-128, 127) * s - x))
    last = 94 - int(torch.argmin(torch.stack(errs[::-1])))
    return mn * (1.0 - last * 0.01), mx * (1.0 - last * 0.01), last


def test_horizon_compat_keeps_horizons_float32_squares():
    # at 2 ** -80 Horizon's float32 squares vanish: every candidate's norm is 0 and the last
    # (0.06x) wins; its compat class does as Horizon does, the native search does not (the
    # ends: the scales are clamped at Horizon's eps, float32's, here)
    x = weight().flatten() * 2.0 ** -80
    o = hz.MSEObserver()
    o(x)
    mn, mx, last = horizon_ends(x)
    assert last == 94
    assert float(o.min_val) == pytest.approx(float(mn), rel=1e-6)
    assert float(o.max_val) == pytest.approx(float(mx), rel=1e-6)
    native = quantscope.get_observer("linear_mse", QuantSpec("int8", eps=1e-45))
    native(x)
    assert float(native.calculate_range()[1]) > 10 * float(mx)


@pytest.mark.parametrize("backend", ["ops", _KERNEL])
def test_llmcompressor_compat_at_norm_2_keeps_float32_squares(backend):
    # their search prices float32 |d| ** 2 (torch, in float32): on tiny units every
    # candidate prices 0 and the first (min-max) stands; the ops and the compat kernel too
    spec = QuantSpec("int8", "channel:0", eps=1e-45)
    units = weight() * 2.0 ** -80
    kw = {"compat": "llmcompressor", "norm": 2.0}
    ref = mse_search(units, None, None, spec, backend="torch", **kw)
    got = mse_search(units, None, None, spec, backend=backend, **kw)
    assert ref.index.tolist() == [0] * units.shape[0]
    assert torch.equal(got.index, ref.index)
    assert torch.equal(got.lo, ref.lo) and torch.equal(got.hi, ref.hi)


@pytest.mark.parametrize("backend", ["torch", "ops", _KERNEL])
@pytest.mark.parametrize("seed", [2, 4])  # the lowest total under global amax 1, 3 of 0..3
def test_nvfp4_global_amax_is_chosen_alike_on_tiny_weights(seed, backend):
    # the totals that pick NVFP4's global amax were sums of float32 errors, 0 for every
    # global amax at 2 ** -80: the first stood. They are float64 sums of the float64 errors
    spec = presets.NVFP4
    units = spec.layout.to_units(weight(seed))
    ref = mse_search(units, None, None, spec, backend=backend)
    assert float(ref.global_amax) > float(units.abs().max())  # not the first global amax
    for k in KS:
        res = mse_search(units * 2.0 ** k, None, None, spec, backend=backend)
        assert torch.equal(res.global_amax, ref.global_amax * 2.0 ** k), k
        assert torch.equal(res.index, ref.index), k
        assert torch.equal(res.hi, ref.hi * 2.0 ** k), k


@pytest.mark.parametrize(("name", "seed"), [("memoryless_mse", 4), ("nvfp4_expanded_mse", 3)])
def test_nvfp4_observers_scale_their_qparams_with_tiny_weights(name, seed):
    x = weight(seed)  # a lowest total under another global amax than the first
    ref = quantscope.get_observer(name, presets.NVFP4)
    ref(x)
    for k in KS:
        o = quantscope.get_observer(name, presets.NVFP4)
        o(x * 2.0 ** k)
        got, want = o.calculate_qparams(), ref.calculate_qparams()
        assert torch.equal(got.effective_scale, want.effective_scale * 2.0 ** k), k
