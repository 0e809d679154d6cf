"""Probe fixes of the core functions' argument checks (bad-input probe): bool / integer
options read loosely, quantize's NaN codes, dequantize's non-codes, meta tensors and
device mismatches in QDQ, and arguments that raised AttributeError instead of naming
themselves."""

from __future__ import annotations

import pytest
import torch

import quantscope as qs
from quantscope import QuantSpec, get_observer, presets, qparams_from_range, scales
from quantscope.calibration import qdq_tensor
from quantscope.estimators.mse import mse_search
from quantscope.formats import get_format

INT8 = QuantSpec("int8")


def _qp(spec=INT8):
    return qparams_from_range(torch.tensor([-1.0]), torch.tensor([1.0]), spec)


# --------------------------------------------------------------- bool / integer options
@pytest.mark.parametrize("value", ["no", "false", 0, 1, None])
def test_histogram_skip_zeros_must_be_a_bool(value):
    # probing: skip_zeros was bool()-coerced, so "no" turned zero-skipping on (percentile
    # scale 0.0211 where skip_zeros=False gives 0.0130)
    with pytest.raises(ValueError, match=r"PercentileObserver: skip_zeros must be True or "
                                         r"False, got"):
        get_observer("percentile", QuantSpec(), skip_zeros=value)


def test_histogram_skip_zeros_bools_still_run():
    torch.manual_seed(0)
    x = torch.cat([torch.zeros(9000), torch.randn(1000)])
    scales_by = {}
    for flag in (False, True):
        obs = get_observer("percentile", QuantSpec(), percentile=99.0, skip_zeros=flag)
        obs(x)
        scales_by[flag] = float(obs.calculate_qparams().scale)
    assert scales_by[True] > scales_by[False]  # skipping the zeros raises the percentile


@pytest.mark.parametrize("value", [True, 1.0, 2.5, 0, "2"])
def test_histogram_update_interval_must_be_an_integer(value):
    # probing: update_interval=True was accepted (isinstance(True, int))
    with pytest.raises(ValueError, match=r"update_interval must be an integer >= 1, got"):
        get_observer("percentile", QuantSpec(), update_interval=value)


@pytest.mark.parametrize("value", [1.5, True, 4.9, 0, "4"])
def test_mse_global_grid_must_be_an_integer(value):
    # probing: global_grid=1.5 / True / 4.9 were int()-truncated silently (the observer
    # runs a trial search when constructed: the option is refused there)
    with pytest.raises(ValueError, match=r"global_grid must be an integer in \[1, 65536\], got"):
        get_observer("memoryless_mse", presets.NVFP4, global_grid=value)
    x = torch.randn(16, 32)
    with pytest.raises(ValueError, match=r"mse_search: global_grid must be an integer in \[1, "):
        mse_search(x, None, None, presets.NVFP4, global_grid=value)


def test_mse_global_grid_integers_still_run():
    obs = get_observer("memoryless_mse", presets.NVFP4, global_grid=2)
    obs(torch.randn(8, 64))
    assert torch.isfinite(obs.calculate_qparams().scale).all()


@pytest.mark.parametrize("kw", [{"ste": "yes"}, {"check": "no"}, {"ste": 1}, {"check": None}])
def test_fake_quantize_flags_must_be_bools(kw):
    # probing: ste="yes" / check="no" were read as truthy
    name = next(iter(kw))
    with pytest.raises(ValueError, match=rf"fake_quantize: {name} must be True or False"):
        qs.fake_quantize(torch.randn(4), _qp(), INT8, **kw)


# ------------------------------------------------------------ quantize / dequantize values
def test_quantize_refuses_nan_input():
    # probing: quantize gave NaN codes (stored as int8: 0) though it documents codes in
    # [qmin, qmax]
    with pytest.raises(ValueError, match=r"quantize: x holds NaN \(non-finite input\), which "
                                         r"has no code"):
        qs.quantize(torch.tensor([float("nan"), 0.5]), _qp(), INT8)


def test_quantize_saturates_inf_and_skips_the_check_on_request():
    q = qs.quantize(torch.tensor([float("inf"), -float("inf"), 0.5]), _qp(), INT8)
    assert q.tolist() == [127.0, -128.0, 64.0]
    assert qs.quantize(torch.tensor([float("nan")]), _qp(), INT8, check=False).isnan().all()


@pytest.mark.parametrize("codes", [[1000.0, 0.5], [0.5], [-129.0], [float("nan")]])
def test_dequantize_refuses_values_that_are_no_int8_codes(codes):
    # probing: codes 1000 and 0.5 dequantized without a word
    with pytest.raises(ValueError, match=r"dequantize: q must hold codes of int8 .*integers "
                                         r"in \[-128, 127\]"):
        qs.dequantize(torch.tensor(codes), _qp(), INT8)


def test_dequantize_takes_stored_codes_and_float_values():
    stored = torch.tensor([-128, 0, 127], dtype=torch.int8)
    assert qs.dequantize(stored, _qp(), INT8).shape == (3,)
    assert qs.dequantize(torch.tensor([1000.0]), _qp(), INT8, check=False).item() > 1
    fp8 = QuantSpec("fp8_e4m3")
    qp = _qp(fp8)
    qs.dequantize(torch.tensor([448.0, -0.3]), qp, fp8)  # inside the range: runs
    with pytest.raises(ValueError, match=r"values in \[-448.0, 448.0\]"):
        qs.dequantize(torch.tensor([449.0]), qp, fp8)


# ------------------------------------------------------------------ meta and devices
def test_qparams_from_range_on_meta_says_meta_holds_no_data():
    # probing: NotImplementedError "Cannot copy out of meta tensor" from the finite check
    lo = torch.tensor([-1.0], device="meta")
    with pytest.raises(ValueError, match=r"qparams_from_range: .*meta tensors hold no data.*"
                                         r"check_finite=False"):
        qparams_from_range(lo, -lo, INT8)
    assert qparams_from_range(lo, -lo, INT8, check_finite=False).scale.is_meta  # shapes only


def test_fake_quantize_names_both_devices():
    # probing: RuntimeError "Tensor on device cpu is not on the expected device meta!"
    x = torch.randn(2, 4, device="meta")
    with pytest.raises(ValueError, match=r"fake_quantize: x is on meta but qparams on cpu: "
                                         r".*meta tensors hold no data"):
        qs.fake_quantize(x, _qp(), INT8)
    with pytest.raises(ValueError, match=r"fake_quantize: .*meta tensors hold no data.*"
                                         r"check=False"):
        qs.fake_quantize(x, _qp().to("meta"), INT8)
    assert qs.fake_quantize(x, _qp().to("meta"), INT8, check=False).shape == (2, 4)


def test_dequantize_names_q_and_the_qparams_device():
    with pytest.raises(ValueError, match=r"dequantize: q is on meta but qparams on cpu"):
        qs.dequantize(torch.zeros(3, device="meta"), _qp(), INT8)


# --------------------------------------------------------------------- global amax
def test_qparams_from_range_global_amax_type():
    # probing: global_amax="1" gave torch's "new(): invalid data type 'str'"
    lo, hi = -torch.ones(16), torch.ones(16)
    for bad in ("1", [1.0, "x"], True, 1j):
        with pytest.raises(TypeError, match=r"qparams_from_range: global_amax must be a real "
                                            r"number or tensor"):
            qparams_from_range(lo, hi, presets.NVFP4, global_amax=bad)
    got = qparams_from_range(lo, hi, presets.NVFP4, global_amax=2.0).global_scale
    assert got.item() == pytest.approx(448 * 6 / 2.0)


# ------------------------------------------------------------- names of wrong arguments
def test_presets_get_names_its_argument():
    # probing: AttributeError "'NoneType' object has no attribute 'lower'"
    with pytest.raises(TypeError, match=r"preset: name must be a str"):
        presets.get(None)


def test_encode_scale_takes_names_as_quantspec_does():
    # probing: encode_scale(t, "fp16") -> AttributeError "'str' object has no attribute 'kind'"
    t = torch.tensor([0.1, 0.3])
    for name in ("fp16", "bf16", "pow2:floor", "FP8_E4M3"):
        want = scales.encode_scale(t, scales.ScaleEncoding.parse(name))
        assert torch.equal(scales.encode_scale(t, name), want)
    with pytest.raises(TypeError, match=r"encode_scale: encoding must be a ScaleEncoding or its "
                                        r"name"):
        scales.encode_scale(t, None)


def test_e8m0_scale_takes_format_names_as_quantspec_does():
    # probing: e8m0_scale(t, "fp4_e2m1") -> AttributeError "'str' object has no attribute 'emax'"
    amax = torch.tensor([1.0, 5.0, 0.0])
    want = scales.e8m0_scale(amax, get_format("fp4_e2m1"), "even")
    assert torch.equal(scales.e8m0_scale(amax, "fp4_e2m1", "even"), want)
    with pytest.raises(TypeError, match=r"e8m0_scale: fmt must be a format"):
        scales.e8m0_scale(amax, None)


def test_qdq_tensor_names_its_state():
    # probing: AttributeError "'NoneType' object has no attribute 'spec'"
    for state in (None, INT8, "int8"):
        with pytest.raises(TypeError, match=r"qdq_tensor: state must be a RoleState"):
            qdq_tensor(torch.randn(2, 2), state)


def test_numpy_bools_and_integers_are_options_as_python_ones():
    """The review found the new checks refusing numpy scalars the old code took."""
    import numpy as np

    from quantscope._checks import check_bool, check_int

    assert check_bool("f", "flag", np.True_) is True and check_bool("f", "flag", False) is False
    assert check_int("f", "n", np.int64(4), 1) == 4
    assert type(check_int("f", "n", np.int32(4), 1)) is int
    for bad in ("no", 1, None, torch.tensor(True)):
        with pytest.raises(ValueError, match="flag must be True or False"):
            check_bool("f", "flag", bad)
    for bad in (True, np.True_, 1.5, np.float64(4.0)):
        with pytest.raises(ValueError, match="n must be an integer >= 1"):
            check_int("f", "n", bad, 1)
