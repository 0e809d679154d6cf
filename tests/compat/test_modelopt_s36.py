"""Probe s36 of the ModelOpt calibrators against ModelOpt 0.47: fp8 batches in both
``collect`` (one upcast), ``"mse"`` amaxes as ModelOpt's float32 bin centres of its own
edges, histograms of subnormal-only data (ModelOpt's and the native first grid's: no silent
0), and saved calibrators that load with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch

from quantscope import Channel, QuantSpec, presets
from quantscope.compat import horizon
from quantscope.compat.modelopt import HistogramCalibrator, MaxCalibrator
from quantscope.observers.histogram import (
    EntropyObserver,
    HistogramMSEObserver,
    MixObserver,
    PercentileObserver,
)


def _modelopt():
    pytest.importorskip("modelopt")
    with warnings.catch_warnings():  # (transformers' version, untested by ModelOpt)
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization.calib as mo
    return mo


# ------------------------------------------------------------------ fp8 batches
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_batches_read_as_float32_in_both_calibrators(dtype):
    x = (torch.randn(64, 32, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    mx, ref_mx = MaxCalibrator(axis=0), MaxCalibrator(axis=0)
    mx.collect(x)
    ref_mx.collect(x.float())
    assert mx.compute_amax().dtype == torch.float32  # ModelOpt's upcast
    assert torch.equal(mx.compute_amax(), ref_mx.compute_amax())
    hist, ref = HistogramCalibrator(num_bins=256), HistogramCalibrator(num_bins=256)
    for k in (1, 2):  # the second grows the grid
        hist.collect((x.float() * k).to(dtype))
        ref.collect((x.float() * k).to(dtype).float())
    assert torch.equal(hist._calib_hist, ref._calib_hist)
    for method in ("percentile", "entropy", "mse"):
        assert torch.equal(hist.compute_amax(method), ref.compute_amax(method)), method


# ------------------------------------------------------------------ mse: ModelOpt's centres
def _modelopt_mse_amax(ref, stride, start_bin=128):
    """ModelOpt's _compute_amax_mse for (4, 3) (its own call fails: scaled_e4m3 without its
    bias): the centres ``(edges[i] + edges[i + 1]) / 2`` of its float32 edges, the first
    least ``mean(counts * (scaled_e4m3(c, amax) - c) ** 2)``."""
    from modelopt.torch.quantization.tensor_quant import scaled_e4m3

    counts, edges = ref._calib_hist.float(), ref._calib_bin_edges.float()
    c = (edges[1:] + edges[:-1]) / 2
    picks = range(start_bin, len(c), stride)
    mses = [((scaled_e4m3(c, c[i], None, 4, 3) - c) ** 2 * counts).mean() for i in picks]
    return c[picks[int(np.argmin(mses))]]


@pytest.mark.peers
@pytest.mark.parametrize("seed", range(20))
def test_mse_amax_is_modelopts_centre_bits(seed):
    mo = _modelopt()
    torch.manual_seed(seed)
    x = torch.rand(300, 3) * 3
    ref, ours = mo.HistogramCalibrator(num_bits=(4, 3), num_bins=512), \
        HistogramCalibrator(num_bits=(4, 3), num_bins=512)
    ref.collect(x)
    ours.collect(x)
    assert torch.equal(ours._calib_bin_edges, ref._calib_bin_edges)
    for stride in (1, 5):  # lo + (i + 0.5) * w was 1 ulp off in 9 of these 40
        got = ours.compute_amax("mse", stride=stride)
        assert got.dtype == torch.float32 and got.shape == ()
        assert got.item() == _modelopt_mse_amax(ref, stride).item(), stride


@pytest.mark.peers
def test_mse_amax_is_modelopts_centre_bits_on_a_grown_grid():
    mo = _modelopt()
    g = torch.Generator().manual_seed(7)
    xs = [torch.rand(200, 4, generator=g) * s for s in (1.0, 2.7, 4.1)]
    ref, ours = mo.HistogramCalibrator(num_bits=(4, 3), num_bins=300), \
        HistogramCalibrator(num_bits=(4, 3), num_bins=300)
    for x in xs:
        ref.collect(x)
        ours.collect(x)
    assert torch.equal(ours._calib_bin_edges, ref._calib_bin_edges.cpu())
    for stride in (1, 3):
        got = ours.compute_amax("mse", stride=stride, start_bin=64)
        assert got.item() == _modelopt_mse_amax(ref, stride, start_bin=64).item(), stride


# ------------------------------------------------------------------ subnormal-only data
_TINY = [(torch.tensor([1e-45, -1e-44]), 256),
         (torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 1e-43, 2048),
         (torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 1e-43, 256)]


@pytest.mark.peers
@pytest.mark.parametrize("case", range(len(_TINY)))
def test_subnormal_histogram_amax_is_modelopts(case):
    mo = _modelopt()
    x, bins = _TINY[case]
    ref, ours = mo.HistogramCalibrator(num_bins=bins), HistogramCalibrator(num_bins=bins)
    ref.collect(x)
    ours.collect(x)
    assert torch.equal(ours._calib_hist, ref._calib_hist)
    assert torch.equal(ours._calib_bin_edges, ref._calib_bin_edges)
    for method, kw in (("percentile", {}), ("entropy", {})):  # were 0
        got, want = ours.compute_amax(method, **kw), ref.compute_amax(method, **kw)
        assert got.item() == want.item() > 0, method
    # below the middle ModelOpt's linspace edges read 0 there (its step underflows): its
    # value, said in a warning
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = ours.compute_amax("percentile", percentile=50.0)
    assert got.item() == ref.compute_amax("percentile", percentile=50.0).item()
    assert (got.item() == 0) == any("ModelOpt's edges" in str(w.message) for w in seen)
    # mse (ModelOpt's own returns its first candidate: the module doc): a centre of its edges
    edges = ref._calib_bin_edges
    mse = ours.compute_amax("mse")
    assert mse.item() > 0 and bool(((edges[1:] + edges[:-1]) / 2 == mse).any())


def _scaled_back(t, k):
    return (t.double() * 2.0 ** -k).float()


def _assert_scaled_back(tiny, normal, k=140):
    """``tiny``'s range (of subnormal data) is ``normal``'s (of that data times ``2 ** k``)
    scaled back, rounded once, and not the old silent 0."""
    got, want = tiny.calculate_range(), normal.calculate_range()
    assert bool((got[1] > 0).all())
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, _scaled_back(w, k))


@pytest.mark.parametrize("make", [
    lambda: PercentileObserver(grid="first", bins=256),
    lambda: PercentileObserver(QuantSpec("int8", symmetric=False), grid="first", bins=256),
    lambda: HistogramMSEObserver(grid="first", bins=256),
    lambda: HistogramMSEObserver(QuantSpec("int8", symmetric=False), grid="first", bins=256),
    lambda: EntropyObserver(grid="first", bins=256),
    lambda: MixObserver(grid="first", bins=256),
    lambda: MixObserver(QuantSpec("int8", symmetric=False), grid="first", bins=256),
    lambda: horizon.KLObserver(bins=256, averaging_constant=0.5),
    lambda: horizon.PercentileObserver(bins=256),
    lambda: HistogramCalibrator(num_bins=256),  # forward / qparams: entropy
], ids=["percentile", "percentile-asym", "mse", "mse-asym", "entropy", "mix", "mix-asym",
        "horizon-kl", "horizon-percentile", "modelopt"])
@pytest.mark.parametrize("case", range(len(_TINY)))
def test_native_first_grid_of_subnormal_data_is_the_scaled_estimate(make, case):
    # the first grid's width (hi - lo) / bins underflowed float32 (to 0: every edge read lo,
    # a range of 0); now the estimate of the data scaled by 2 ** 140 (well above the least
    # scale, float32's eps, that MSE's and mix's scores price), scaled back, rounded once
    x, _ = _TINY[case]
    tiny, normal = make(), make()
    # a second batch on the same grid (exact: no product rounds a subnormal); the EMA
    # classes take one (their EMA then rounds in subnormal steps)
    batches = [x, -x[: x.numel() // 2]]
    for b in batches[:1] if tiny.averaging_constant is not None else batches:
        tiny(b)
        normal((b.double() * 2.0 ** 140).float())
    _assert_scaled_back(tiny, normal)


@pytest.mark.parametrize("cls", [HistogramMSEObserver, MixObserver])
def test_global_scale_first_grid_of_subnormal_data_is_scaled_by_one_factor(cls):
    # NVFP4's candidates are priced under the tensor-wide amax: every block (unit) scaled by
    # the same power of two keeps their ratios
    t = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 1e-43
    tiny, normal = cls(presets.get("nvfp4"), grid="first", bins=256), \
        cls(presets.get("nvfp4"), grid="first", bins=256)
    tiny(t)
    normal((t.double() * 2.0 ** 140).float())
    _assert_scaled_back(tiny, normal)


@pytest.mark.parametrize("cls", [HistogramMSEObserver, MixObserver])
def test_global_scale_blocks_of_unlike_magnitudes_share_one_factor(cls):
    """``normal_width(common=True)`` for a global-scale spec: blocks 2 ** 16 apart are all
    scaled by the largest one's power of two, so the tensor-wide amax the candidates are
    priced under scales with every block (a factor per block would scale it by the first
    block's alone and price the larger blocks' FP8 scales against an amax 2 ** 16 too large).
    The range is then that of the data scaled into the normal range, scaled back."""
    t = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 1e-43
    t[1:] = (t[1:].double() * 2.0 ** 16).float()  # every block's width still underflows
    tiny, normal = cls(presets.get("nvfp4"), grid="first", bins=256), \
        cls(presets.get("nvfp4"), grid="first", bins=256)
    tiny(t)
    normal((t.double() * 2.0 ** 140).float())
    _assert_scaled_back(tiny, normal)


def test_per_channel_first_grid_scales_only_its_subnormal_units():
    g = torch.Generator().manual_seed(4)
    rows = [torch.randn(512, generator=g) * 1e-43, torch.randn(512, generator=g)]
    spec = QuantSpec("int8", Channel(0))
    both = PercentileObserver(spec, percentile=90.0, grid="first", bins=2048)
    both(torch.stack(rows))
    got = both.calculate_range()[1]
    for i, (row, k) in enumerate(zip(rows, (140, 0), strict=True)):  # the normal row as it was
        one = PercentileObserver(spec, percentile=90.0, grid="first", bins=2048)
        one((row.double() * 2.0 ** k).float()[None])
        assert torch.equal(got[i:i + 1], _scaled_back(one.calculate_range()[1], k)), i


def test_native_pow2_grid_of_subnormal_data_is_unchanged():
    # the power-of-two grid's widths are at least 2 ** -126 (normal): nothing scaled
    x, _ = _TINY[1]
    obs = PercentileObserver(bins=256)
    obs(x)
    amax = x.abs().max()
    assert torch.equal(obs.calculate_range()[1], amax.reshape(1))


# ------------------------------------------------------------------ saved calibrators
def _saved(c) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(c, buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("make", [lambda: MaxCalibrator(8, 0, False),
                                  lambda: MaxCalibrator((4, 3)),
                                  lambda: HistogramCalibrator(8, None, True, num_bins=256)],
                         ids=["max-axis", "max-fp8", "hist-unsigned"])
def test_saved_calibrators_load_weights_only(make):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    c = make()
    c.collect(x)
    c.collect(x * 1.5)
    loaded = torch.load(_saved(c), weights_only=True)
    assert type(loaded) is type(c)
    assert loaded.spec == c.spec and loaded._config == c._config
    if isinstance(c, MaxCalibrator):
        assert torch.equal(loaded.compute_amax(), c.compute_amax())
    else:
        for method in ("percentile", "entropy", "mse"):
            assert torch.equal(loaded.compute_amax(method), c.compute_amax(method))
        loaded.collect(x * 3)  # a loaded one goes on collecting
        c.collect(x * 3)
        assert torch.equal(loaded._calib_hist, c._calib_hist)


def test_safe_globals_are_the_calibrators_only():
    # the calibrators pickle without their spec (rebuilt from ModelOpt's arguments): no
    # quantscope class but these two is a safe global
    names = {getattr(g, "__qualname__", repr(g)) for g in torch.serialization.get_safe_globals()
             if getattr(g, "__module__", "").startswith("quantscope")}
    assert names == {"MaxCalibrator", "HistogramCalibrator"}
    c = HistogramCalibrator((4, 3), num_bins=64)
    c.collect(torch.randn(32))
    buf = _saved(c)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(buf) == []
    added = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:  # what the pickle names beyond torch's own allowlist
        buf.seek(0)
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(buf)
    finally:
        torch.serialization.add_safe_globals(added)
    assert unsafe == ["quantscope.compat.modelopt.HistogramCalibrator"]


@pytest.mark.peers
def test_saved_calibrators_load_as_modelopts():
    mo = _modelopt()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    for ours, ref in ((MaxCalibrator(), mo.MaxCalibrator()),
                      (HistogramCalibrator(num_bins=256), mo.HistogramCalibrator(num_bins=256))):
        for c in (ours, ref):
            c.collect(x)
        a = torch.load(_saved(ours), weights_only=True)
        b = torch.load(_saved(ref), weights_only=True)
        if isinstance(ours, MaxCalibrator):
            assert torch.equal(a.compute_amax(), b.compute_amax())
        else:
            assert torch.equal(a.compute_amax("percentile"), b.compute_amax("percentile"))
