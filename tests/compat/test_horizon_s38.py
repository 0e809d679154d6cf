"""Probe s38 on compat.horizon: MSE's kept min-max incumbent (index -1) scaled the ends by
1.01 (past the data; near float32's max, inf); ``averaging_constant=None`` was taken by the
histogram classes, which then never averaged (qparams: the no-data default beside data);
a ``ch_axis`` string / list failed in a bare comparison, ``is_sync_quantize="no"`` read as
True; a Horizon state with NaN / inf ends loaded and failed at read time naming nothing."""

from __future__ import annotations

import pytest
import torch

from quantscope.compat import horizon as hz

HISTOGRAM = [hz.PercentileObserver, hz.KLObserver, hz.MixObserver]
ALL = [hz.MinMaxObserver, hz.MovingAverageMinMaxObserver, hz.MSEObserver, *HISTOGRAM]


@pytest.mark.parametrize("x", [
    torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 1e25,
    torch.tensor([3.39e38, -1.0, 2.0]),  # finite, valid: the ends were inf
])
def test_mse_keeps_the_data_ends_where_it_keeps_min_max(x):
    o = hz.MSEObserver()
    o(x)
    # the candidates' factors are 1 - 0.01 i <= 1: never past the data
    assert 0 < float(o.max_val) <= float(x.max()) and float(x.min()) <= float(o.min_val) < 0
    scale, _ = o.calculate_qparams()
    amax = float(x.abs().max())
    assert torch.isfinite(scale).all() and float(scale) <= amax / 127.5 * (1 + 1e-6)


@pytest.mark.parametrize("cls", HISTOGRAM)
def test_averaging_constant_none_is_refused(cls):
    with pytest.raises(hz.HorizonArgumentError, match=r"averaging_constant must be a number "
                                                      r"in \(0, 1\], got None"):
        cls(averaging_constant=None)


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("ch_axis", ["0", [0], 1.5])
def test_a_ch_axis_of_another_type_is_named(cls, ch_axis):
    with pytest.raises(hz.HorizonArgumentError, match=r"ch_axis must be an integer \(or None\)"):
        cls(ch_axis=ch_axis)


def test_numpy_axes_are_integers():
    np = pytest.importorskip("numpy")
    o = hz.MovingAveragePerChannelMinMaxObserver(ch_axis=np.int64(1))
    o(torch.randn(4, 3))
    assert o.calculate_qparams()[0].shape == (3,)


@pytest.mark.parametrize("value", ["no", 2, None, 1.0])
def test_is_sync_quantize_takes_a_bool_only(value):
    with pytest.raises(ValueError, match=r"is_sync_quantize must be True / False \(or 1 / 0\)"):
        hz.MinMaxObserver(is_sync_quantize=value)


@pytest.mark.parametrize("value", [0, 1, True, False])
def test_is_sync_quantize_takes_1_and_0_as_horizon_code_passes_them(value):
    assert hz.MinMaxObserver(is_sync_quantize=value).is_sync_quantize is bool(value)


@pytest.mark.parametrize("cls", [hz.MinMaxObserver, hz.PercentileObserver, hz.KLObserver])
@pytest.mark.parametrize("lo,hi", [(float("nan"), 1.0), (-2.0, float("inf")),
                                   (float("inf"), float("-inf"))])
def test_a_horizon_state_with_non_finite_ends_is_refused_at_load(cls, lo, hi):
    o = cls()
    eps = torch.tensor([torch.finfo(torch.float32).eps])
    with pytest.raises(ValueError, match=r"cannot load Horizon's min_val / max_val: they must "
                                         r"be finite"):
        o.load_state_dict({"min_val": torch.tensor([lo]), "max_val": torch.tensor([hi]),
                           "eps": eps})


@pytest.mark.parametrize("cls", ALL)
def test_ignored_values_are_said_once_per_qparams_read(cls):
    import warnings

    o = cls(non_finite="ignore")
    o(torch.tensor([1.0, float("nan"), -2.0]))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        o.calculate_qparams()
    said = [x for x in w if "ignored 1 NaN / inf values" in str(x.message)]
    assert len(said) == 1, [str(x.message) for x in w]


def test_the_per_tensor_ema_class_refuses_axis_0():
    with pytest.raises(hz.HorizonArgumentError, match=r"per tensor only, ch_axis must be "
                                                      r"negative, got ch_axis=0"):
        hz.MovingAverageMinMaxObserver(qscheme=torch.per_channel_symmetric, ch_axis=0)


def test_mse_keeps_min_max_exactly_where_every_candidate_prices_inf():
    x = torch.tensor([3.39e38, -3.39e38, 1.0])
    o = hz.MSEObserver()
    o(x)
    assert float(o.min_val) == float(x.min()) and float(o.max_val) == float(x.max())
