"""Native histogram observers: option checks at construction, calculate_range before data,
valid ranges on data inside one bin (torch.ao's HistogramObserver as the reference)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.ao.quantization import HistogramObserver as TorchHistogramObserver

import quantscope
from quantscope import QuantSpec, Tensor
from quantscope.estimators import entropy_amax
from quantscope.observers.histogram import (
    EntropyObserver,
    HistogramMSEObserver,
    L2HistogramObserver,
    MixObserver,
    PercentileObserver,
)
from quantscope.stats.histogram import Hist

ALL = (PercentileObserver, HistogramMSEObserver, EntropyObserver, L2HistogramObserver,
       MixObserver)
ASYM = QuantSpec("int8", symmetric=False)


# ------------------------------------------------------- entropy: bins < start_bin
@pytest.mark.parametrize("make", [lambda: EntropyObserver(bins=64),
                                  lambda: MixObserver(bins=64),
                                  lambda: MixObserver(start_bin=5000),
                                  lambda: EntropyObserver(bins=100, start_bin=101)])
def test_entropy_without_a_candidate_is_refused_at_construction(make):
    # TensorRT / ModelOpt have no threshold to pick there either (argmin of nothing)
    with pytest.raises(ValueError, match=r"start_bin=\d+ .*bins=\d+"):
        make()


def test_entropy_with_start_bin_equal_to_bins_has_its_one_candidate():
    x = torch.randn(16, 64)
    o = EntropyObserver(bins=128)
    o(x)
    amax = x.abs().max()  # the last edge (or the last non-empty bin's right edge), clipped
    assert [t.item() for t in o.calculate_range()] == [-amax.item(), amax.item()]


def test_mix_without_entropy_takes_few_bins():
    # histogram MSE starts at the last bin of a small histogram (as Quark)
    o = MixObserver(bins=64, candidates=("minmax", "mse"))
    o(torch.randn(16, 64))
    lo, hi = o.calculate_range()
    assert bool((lo <= hi).all())


def test_entropy_amax_refuses_a_histogram_smaller_than_start_bin():
    h = Hist(torch.ones(1, 64, dtype=torch.long), torch.zeros(1), torch.full((1,), 64.0), True)
    with pytest.raises(ValueError, match="start_bin=128 .*bins=64"):
        entropy_amax(h)


@pytest.mark.parametrize("smooth", [1, 9])
def test_entropy_amax_unit_ending_below_start_bin_gets_its_last_bin(smooth):
    # as its docstring says: data ending below bin start_bin -> right edge of the last bin
    c = torch.zeros(2, 2048, dtype=torch.long)
    c[0, :50], c[1, 7] = 3, 1
    h = Hist(c, torch.zeros(2), torch.full((2,), 2048.0), True)
    assert entropy_amax(h, smooth=smooth).tolist() == [50.0, 8.0]


# ------------------------------------------------------- calculate_range before data
@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("ema", [None, 0.5])
@pytest.mark.parametrize("batches", [[], [torch.empty(0, 8)]])
def test_calculate_range_before_data_is_the_calculate_qparams_error(cls, ema, batches):
    o = cls(averaging_constant=ema)
    for b in batches:
        o(b)
    with pytest.raises(ValueError, match="before any tensor was observed") as want:
        o.calculate_qparams()
    with pytest.raises(ValueError) as got:
        o.calculate_range()
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("cls", ALL)
def test_calculate_range_after_nan_is_an_error_not_nan(cls):
    x = torch.randn(4, 8)
    x[0, 0] = float("nan")
    o = cls()
    o(x)
    with pytest.raises(ValueError, match="NaN or inf"):
        o.calculate_range()


def test_calculate_range_with_ignored_nan_warns_once_per_qparams():
    x = torch.randn(4, 8)
    x[0, 0] = float("nan")
    o = PercentileObserver(non_finite="ignore")
    o(x)
    with pytest.warns(UserWarning, match="ignored 1 NaN") as record:
        o.qparams()
    assert len(record) == 1
    lo, hi = o.calculate_range()
    assert bool(torch.isfinite(lo).all() and torch.isfinite(hi).all())


# ------------------------------------------------------- asymmetric ranges inside one bin
def _ao_range(x):
    o = TorchHistogramObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    o(x)
    lo, hi = o._non_linear_param_search()
    return lo.item(), hi.item()


@pytest.mark.parametrize("make", [
    lambda: PercentileObserver(ASYM),
    lambda: PercentileObserver(ASYM, convention="lower"),
    lambda: PercentileObserver(ASYM, convention="upper"),
    lambda: HistogramMSEObserver(ASYM),
    lambda: MixObserver(ASYM),
    lambda: L2HistogramObserver(ASYM)])
@pytest.mark.parametrize("v", [3.0, -3.0, 0.0, 1e-3])
def test_constant_data_gives_its_value_as_torch_ao(make, v):
    x = torch.full((64,), v)
    o = make()
    o(x)
    lo, hi = o.calculate_range()
    assert (lo.item(), hi.item()) == _ao_range(x) == (x[0].item(),) * 2


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), base=st.sampled_from([3.0, -3.0, 0.7, -1e-3]),
       spread=st.sampled_from([0.0, 1e-7, 1e-5, 1e-3]),
       convention=st.sampled_from(["lower", "center", "upper"]),
       p=st.sampled_from([50.0, 99.0, 99.99, 100.0]), per_row=st.booleans())
def test_asymmetric_percentile_is_a_valid_range_inside_the_data(seed, base, spread, convention,
                                                               p, per_row):
    # data inside one or two bins: each tail's estimate may fall past the data or cross
    g = torch.Generator().manual_seed(seed)
    x = base + spread * torch.rand(4, 64, generator=g)
    spec = QuantSpec("int8", "channel:0" if per_row else "tensor", symmetric=False)
    for o in (PercentileObserver(spec, percentile=p, convention=convention),
              HistogramMSEObserver(spec)):
        o(x)
        lo, hi = o.calculate_range()
        mn, mx = (x.amin(1), x.amax(1)) if per_row else (x.min()[None], x.max()[None])
        assert bool((mn <= lo).all() and (lo <= hi).all() and (hi <= mx).all()), (lo, hi)


# ------------------------------------------------------- options checked at construction
@pytest.mark.parametrize("kw, err, match", [
    ({"candidates": ["foo"]}, ValueError, "candidates"),
    ({"candidates": ()}, ValueError, "candidates"),
    ({"candidates": "percentile"}, TypeError, "candidates"),
    ({"convention": "bad"}, ValueError, "convention"),
    ({"percentiles": [150]}, ValueError, "percentiles"),
    ({"percentiles": [99.9, "99"]}, TypeError, "percentiles"),
    ({"percentiles": [True]}, TypeError, "percentiles"),
    ({"percentiles": 99.9}, TypeError, "percentiles"),
    ({"percentiles": (), "candidates": ("percentile",)}, ValueError, "percentiles"),
])
def test_mix_checks_its_options_at_construction(kw, err, match):
    with pytest.raises(err, match=f"MixObserver: .*{match}"):
        MixObserver(**kw)


@pytest.mark.parametrize("bad, err", [("99", TypeError), (True, TypeError), (None, TypeError),
                                      (0, ValueError), (100.5, ValueError),
                                      (float("nan"), ValueError)])
def test_percentile_rejects_bad_percentile_naming_it(bad, err):
    with pytest.raises(err, match="PercentileObserver: percentile must be"):
        PercentileObserver(percentile=bad)


@pytest.mark.parametrize("p", [99, 99.9, np.float32(99.5), np.float64(100.0)])
def test_percentile_takes_numbers(p):
    o = PercentileObserver(percentile=p)
    assert o.percentile == float(p) and type(o.percentile) is float


@pytest.mark.parametrize("make", [
    lambda: quantscope.get_observer("percentile", QuantSpec("int8", Tensor()),
                                    averaging_constant=0.1),
    lambda: quantscope.get_observer("horizon:KLObserver")])  # EMA by default
def test_ema_histograms_record_inf_in_forward_and_raise_at_qparams(make):
    """As every observer does: the EMA step in forward estimated on the inf range and raised
    'histogram observers take |x| < 2**126 ... use a min-max or MSE observer' (which refuse
    inf too) mid-forward, in a model's hook."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    x[10, 7] = float("inf")
    obs = make()
    obs(x)
    obs(torch.randn(64, 256))
    with pytest.raises(ValueError, match="observed NaN or inf values"):
        obs.calculate_qparams()
