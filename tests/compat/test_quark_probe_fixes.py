"""compat.quark against AMD Quark 0.13 where a read-only probe found it differ: int16 zero
points, the histogram classes' fp8 / fp4 scales (eps, half scale_type, symmetric=False),
PerBlockMXObserver's amax dtype across batches, the observed-token count and
``zero_point_type`` float32. Runs in the peers' venv."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

pytestmark = [pytest.mark.peers, pytest.mark.xdist_group("quark")]

pytest.importorskip("quark")  # quark_twins imports quark.torch when a test first uses it

from quark_twins import qo, qtypes, quark_config, quark_twins

from quantscope.compat import quark

HISTOGRAMS = ["PerTensorPercentileObserver", "PerTensorMSEObserver", "PerTensorHistogramObserver"]


def _qparams(obs):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return obs._calculate_qparams()


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, (x, y)
        assert torch.equal(x, y), (x, y)


def _int16_ranges(n: int = 20000):
    g = torch.Generator().manual_seed(0)
    return -torch.rand(n, generator=g) * 3, torch.rand(n, generator=g) * 3


@pytest.mark.parametrize("scale_type", ["float", "float16", "float32"])
def test_int16_asymmetric_zero_points_as_quark(scale_type):
    # Quark: qmin - round(min / scale); round(qmin - min / scale) is a code off on some
    theirs, ours = quark_twins("PerTensorMinMaxObserver", dtype="int16", symmetric=False,
                         scale_type=scale_type, is_dynamic=True)
    lo, hi = _int16_ranges()
    _assert_same(ours.calculate_int_quant_params(lo, hi),
                 theirs.calculate_int_quant_params(lo, hi))


def test_int16_asymmetric_zero_point_of_observed_data_as_quark():
    from quantscope.qparams import qparams_from_range

    lo, hi = _int16_ranges()
    theirs = qo.PerTensorMinMaxObserver(quark_config("PerTensorMinMaxObserver", dtype="int16",
                                             symmetric=False, is_dynamic=True))
    want = theirs.calculate_int_quant_params(lo, hi)[1]
    native = qparams_from_range(lo, hi, quark.quark_spec({"dtype": "int16", "symmetric": False}))
    k = int((native.zero_point != want).nonzero()[0])  # a range the native rule sets a code off
    x = torch.stack([lo[k], hi[k]]).reshape(1, 2)
    theirs, ours = quark_twins("PerTensorMinMaxObserver", dtype="int16", symmetric=False)
    theirs(x)
    ours(x)
    _assert_same(_qparams(ours), _qparams(theirs))


@pytest.mark.parametrize("name", HISTOGRAMS)
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("magnitude", [1e-6, 1e-9])
def test_histogram_fp8_small_scales_are_not_clamped_to_eps(name, dtype, magnitude):
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2)) * magnitude
    theirs, ours = quark_twins(name, dtype=dtype, symmetric=True)
    theirs(x)
    ours(x)
    want = _qparams(theirs)
    if name == "PerTensorHistogramObserver":  # Quark's recorder never sets a range
        want = qo.PerTensorMinMaxObserver(theirs.qspec).calculate_fp8_quant_parameters(
            x.min(), x.max())
    _assert_same(_qparams(ours), want)


@pytest.mark.parametrize("name", ["PerTensorPercentileObserver", "PerTensorMSEObserver"])
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scale_type", ["float16", "bfloat16"])
def test_histogram_fp8_half_scale_type_as_quark(name, dtype, scale_type):
    # Quark casts amax to scale_type's dtype before it divides
    g = torch.Generator().manual_seed(5)
    for seed in range(12):
        x = torch.randn(16, 64, generator=g) * (1 + seed)
        theirs, ours = quark_twins(name, dtype=dtype, symmetric=True, scale_type=scale_type)
        theirs(x)
        ours(x)
        _assert_same(_qparams(ours), _qparams(theirs))


def test_histogram_fp4_float32_small_scales_as_quark():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2)) * 1e-7
    theirs, ours = quark_twins("PerTensorPercentileObserver", dtype="fp4", scale_format="float32",
                         symmetric=True)
    theirs(x)
    ours(x)
    _assert_same(_qparams(ours), _qparams(theirs))


@pytest.mark.parametrize("name", ["PerTensorPercentileObserver", "PerTensorMSEObserver"])
@pytest.mark.parametrize("shift", [0.0, 0.5])
def test_histogram_fp8_asymmetric_bins_min_to_max_as_quark(name, shift):
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(5)) + shift
    theirs, ours = quark_twins(name, dtype="fp8_e4m3", symmetric=False)
    theirs(x)
    ours(x)
    want = _qparams(theirs)
    assert torch.equal(ours.calib_bin_edges, theirs.calib_bin_edges)
    _assert_same(_qparams(ours), want)
    _assert_same((ours.min_val, ours.max_val), (theirs.min_val, theirs.max_val))


@pytest.mark.parametrize("scale_format", ["float32", "e8m0"])
@pytest.mark.parametrize("first, second", [(torch.float32, torch.bfloat16),
                                           (torch.bfloat16, torch.float32),
                                           (torch.bfloat16, torch.float16),
                                           (torch.bfloat16, torch.bfloat16)])
def test_static_mx_amax_dtype_promotes_across_batches_as_quark(scale_format, first, second):
    theirs, ours = quark_twins("PerBlockMXObserver", dtype="fp4", qscheme="per_group", ch_axis=-1,
                         group_size=32, scale_format=scale_format)
    g = torch.Generator().manual_seed(1)
    for dtype in (first, second):
        x = torch.randn(4, 64, generator=g).to(dtype)
        theirs(x)
        ours(x)
    assert ours.amax.dtype == theirs.amax.dtype
    assert torch.equal(ours.amax, theirs.amax)
    _assert_same(_qparams(ours), _qparams(theirs))


@pytest.mark.parametrize("x", [
    torch.zeros(6, 8),  # an expert no token was routed to
    torch.cat([torch.zeros(3, 8), torch.randn(2, 8)]),
    torch.randn(8),  # 1-D: Quark counts nothing
    torch.randn(2, 3, 8),
], ids=["zero-rows", "some-zero-rows", "1d", "3d"])
def test_num_observed_tokens_as_quark(x):
    theirs, ours = quark_twins("PerTensorMinMaxObserver", dtype="int8", symmetric=True)
    for obs in (theirs, ours):
        for _ in range(2):
            obs.record_observed_tokens(x)
            obs(x)
    assert ours._num_observed_tokens == theirs._num_observed_tokens
    ours.reset_state()  # Quark's count survives a reset
    assert ours._num_observed_tokens == theirs._num_observed_tokens


@pytest.mark.parametrize("name, kw", [
    ("PerTensorMinMaxObserver", {}),
    ("PerGroupMinMaxObserver", {"qscheme": "per_group", "ch_axis": -1, "group_size": 8}),
    ("PerTensorPercentileObserver", {}),
])
def test_zero_point_type_float32_raises(name, kw):
    c = quark_config(name, dtype="uint4", symmetric=False,
                     zero_point_type=qtypes.ZeroPointType.float32, **kw)
    with pytest.raises(ValueError, match="zero_point_type"):
        getattr(quark, name)(c)


def test_zero_point_type_float32_accepted_where_quark_ignores_it():
    # symmetric ranges and torch.ao's Pro never read it in Quark
    c = quark_config("PerTensorMinMaxObserver", dtype="int8", symmetric=True,
             zero_point_type=qtypes.ZeroPointType.float32)
    quark.PerTensorMinMaxObserver(c)
    c = quark_config("PerTensorHistogramObserverPro", dtype="uint8", symmetric=False,
             zero_point_type=qtypes.ZeroPointType.float32)
    quark.PerTensorHistogramObserverPro(c)
