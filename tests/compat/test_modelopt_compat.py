"""quantscope.compat.modelopt: ModelOpt 0.47's calibrators, against the formulas of
REFERENCES.md ("NVIDIA calibrators") and (``peers``) ModelOpt's own classes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiers import each_value

import quantscope
from quantscope.compat.modelopt import HistogramCalibrator, MaxCalibrator, ModelOptArgumentError


def _data(kind, seed, n=4000):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if kind == "heavy":
        return x / torch.rand(n, generator=g).clamp_min(1e-3) ** 0.5
    if kind == "relu":
        return torch.relu(x)
    return x


# ------------------------------------------------------------------ formulas (.venv)
@pytest.mark.parametrize("axis", [None, 0, -1, (0, 2), (-1, -3), ()])
def test_max_amax_is_the_running_absmax_over_the_axes_not_kept(axis):
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(1))
    cal = MaxCalibrator(axis=axis)
    assert cal.compute_amax() is None
    for k in (1.0, -3.0, 2.0):
        cal.collect(x * k)
    kept = () if axis is None else (axis if isinstance(axis, tuple) else (axis,))
    kept = {a % 3 for a in kept}
    red = tuple(i for i in range(3) if i not in kept)
    want = (3 * x).abs().amax(dim=red, keepdim=True) if kept else (3 * x).abs().amax()
    got = cal.compute_amax()
    assert torch.equal(got, want.squeeze() if want.numel() == 1 else want)
    cal.reset()
    assert cal.compute_amax() is None


def test_max_dtypes_track_amax_and_errors():
    x = torch.randn(4, 8).bfloat16()
    cal = MaxCalibrator(axis=0, track_amax=True)
    cal.collect(x)
    assert cal.compute_amax().dtype == torch.bfloat16
    assert cal.amaxs[0].dtype == np.float32 and cal.amaxs[0].shape == (4, 1)
    with pytest.raises(RuntimeError, match="amax shape changed"):
        cal.collect(torch.randn(5, 8))
    with pytest.raises(AssertionError):
        cal.collect(torch.full((4, 8), float("nan")))
    assert issubclass(ModelOptArgumentError, ValueError)
    with pytest.raises(AttributeError, match="amaxs"):
        MaxCalibrator().amaxs  # noqa: B018
    with pytest.raises(ValueError, match="axis"):
        MaxCalibrator(axis=3).collect(x)
    with pytest.raises(ValueError, match="num_bits"):
        MaxCalibrator(num_bits=(3, 3))  # (4, 3) is fp8 e4m3: test_modelopt_flows_s34


def _ref_hist(batches, bins=2048):
    """ModelOpt's torch_hist collection: histc over the first [0, max], bins of the same
    width appended (REFERENCES.md)."""
    top = batches[0].abs().max()
    hist = torch.histc(batches[0].abs(), bins, 0, top).long()
    w = top.double() / bins
    for x in batches[1:]:
        m = x.abs().max()
        nb = max(hist.numel(), int(torch.ceil(m.double() / w)))
        new = torch.histc(x.abs(), nb, 0, float(w * nb)).long()
        new[:hist.numel()] += hist
        hist = new
    return hist, w


def test_histogram_grows_by_bins_of_the_first_width():
    xs = [_data("normal", s) * (1 + s) for s in range(4)]
    cal = HistogramCalibrator()
    for x in xs:
        cal.collect(x)
    hist, _ = _ref_hist(xs)
    assert torch.equal(cal.hist_counts[0], hist)


@pytest.mark.parametrize("kind", ["normal", "heavy", "relu"])
def test_histogram_percentile_and_mse_formulas(kind):
    x = _data(kind, 3)
    cal = HistogramCalibrator()
    cal.collect(x)
    hist, w = _ref_hist([x])
    cum = hist.cumsum(0)
    i = int(torch.searchsorted(cum, torch.tensor(int(np.ceil(0.9999 * int(cum[-1]))))))
    assert float(cal.compute_amax("percentile")) == pytest.approx(i * float(w), rel=1e-6)
    # MSE on the centres, int8 symmetric: round(c / s) clamped to 127, weighted by counts
    c = (torch.arange(2048, dtype=torch.float64) + 0.5) * w
    errs = []
    for j in range(128, 2048):
        s = c[j] / 127
        errs.append(float((((c / s).round().clamp(-127, 127) * s - c) ** 2 * hist).sum()))
    # the pick is a candidate centre whose error is the least (near-ties: to rounding)
    got = float(cal.compute_amax("mse"))
    j = round(got / float(w) - 0.5)
    assert got == pytest.approx(float(c[j]), rel=1e-6)
    assert errs[j - 128] <= min(errs) * (1 + 1e-9)  # ModelOpt's narrow amax / 127 grid


def test_histogram_arguments_and_registry():
    with pytest.raises(NotImplementedError, match="per tensor"):
        HistogramCalibrator(axis=0)
    cal = quantscope.get_observer("modelopt:HistogramCalibrator", num_bins=256)
    assert cal.compute_amax("entropy") is None
    with pytest.raises(TypeError, match="method"):
        cal.compute_amax("max")
    with pytest.raises(ValueError, match="percentile"):
        cal.compute_amax("percentile", percentile=101)
    cal.collect(torch.randn(100))
    with pytest.raises(ValueError, match="start_bin"):
        cal.compute_amax("entropy", start_bin=300)
    assert cal.compute_amax("entropy").shape == ()
    assert "modelopt:MaxCalibrator" in quantscope.list_observers("modelopt")


# --------------------------------------------------------------- ModelOpt (peers)
def _mo():
    return pytest.importorskip("modelopt.torch.quantization.calib")


def _batches(kind, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(4):
        x = _data("heavy" if kind == "heavy" else "normal", seed * 10 + i)
        if kind == "relu":
            x = torch.relu(x)
        if kind == "grow":
            x = x * (1 + i + torch.rand((), generator=g))
        if kind == "zeros":
            x = torch.where(torch.rand(x.shape, generator=g) < 0.3, 0.0, x)
        out.append(x.to(dtype))
    return out


@pytest.mark.peers
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 1), (0, -3), (2, 0), (0, 1, 2), ()])
def test_max_equals_modelopt(axis, dtype):
    mo = _mo()
    ref, ours = mo.MaxCalibrator(axis=axis), MaxCalibrator(axis=axis)
    g = torch.Generator().manual_seed(7)
    for k in range(3):
        x = (torch.randn(3, 4, 5, generator=g) * (k + 1)).to(dtype)
        ref.collect(x)
        ours.collect(x)
    a, b = ref.compute_amax(), ours.compute_amax()
    assert a.shape == b.shape and a.dtype == b.dtype
    if dtype == torch.float64:  # the state is float32 (a documented difference)
        torch.testing.assert_close(a, b, rtol=2**-24, atol=0)
    else:
        assert torch.equal(a, b)


@pytest.mark.peers
@pytest.mark.parametrize(("dtype", "skip_zeros", "kind"),
                         each_value([torch.float32, torch.bfloat16, torch.float16],
                                    [False, True], ["normal", "heavy", "relu", "grow", "zeros"]))
def test_histogram_equals_modelopt(kind, skip_zeros, dtype):
    mo = _mo()
    # ModelOpt's entropy is a Python loop over every candidate (O(bins^2)): the default 2048
    # bins on one kind; a grown 2048-bin histogram took a minute a case there
    bins = 2048 if kind == "normal" else 512
    ref = mo.HistogramCalibrator(num_bins=bins, skip_zeros=skip_zeros)
    ours = HistogramCalibrator(num_bins=bins, skip_zeros=skip_zeros)
    for x in _batches(kind, 5, dtype):
        ref.collect(x)
        ours.collect(x)
    assert torch.equal(ref._calib_hist.long(), ours.hist_counts[0])
    for kw in ({}, {"stride": 3, "start_bin": 200}):  # bit for bit: one of ModelOpt's edges
        a, b = ref.compute_amax("entropy", **kw), ours.compute_amax("entropy", **kw)
        assert torch.equal(a, b), (kw, a, b)
    for p in (99.0, 99.9, 99.99):
        hist = ref._calib_hist.int().numpy()
        cdf = np.cumsum(hist / hist.sum())
        i = int(np.searchsorted(cdf, p / 100))
        if i and abs(cdf[i - 1] - p / 100) < 1e-12:  # ModelOpt's rounding decides (doc)
            continue
        a, b = ref.compute_amax("percentile", percentile=p), \
            ours.compute_amax("percentile", percentile=p)
        assert torch.equal(a, b), (p, a, b)


@pytest.mark.peers
@pytest.mark.parametrize("kind", ["normal", "heavy", "relu", "grow"])
def test_histogram_mse_equals_modelopt_loop_with_its_quantizer(kind):
    # ModelOpt's own _compute_amax_mse, with fake_tensor_quant's arguments by name (its call
    # passes num_bits as bias: the documented difference)
    mo = _mo()
    from modelopt.torch.quantization.tensor_quant import fake_tensor_quant
    ref, ours = mo.HistogramCalibrator(), HistogramCalibrator()
    for x in _batches(kind, 9):
        ref.collect(x)
        ours.collect(x)
    counts = ref._calib_hist.float()
    edges = ref._calib_bin_edges.float()
    centers = (edges[1:] + edges[:-1]) / 2
    mses = [((fake_tensor_quant(centers, centers[i], None, 8, False) - centers) ** 2
             * counts).mean() for i in range(128, len(centers))]
    want = centers[128 + int(np.argmin(mses))]
    torch.testing.assert_close(ours.compute_amax("mse"), want, rtol=1e-6, atol=0)


@pytest.mark.peers
def test_known_differences_with_modelopt():
    mo = _mo()
    # entropy on quarter steps up to 4: ModelOpt picks a NaN divergence (0.25)
    x = torch.arange(17.0) / 4
    ref, ours = mo.HistogramCalibrator(), HistogramCalibrator()
    ref.collect(x)
    ours.collect(x)
    assert float(ours.compute_amax("entropy")) > float(ref.compute_amax("entropy"))
    # a first batch of zeros: ModelOpt cannot grow it
    ref, ours = mo.HistogramCalibrator(), HistogramCalibrator()
    ref.collect(torch.zeros(10))
    ours.collect(torch.zeros(10))
    with pytest.raises(OverflowError):
        ref.collect(torch.ones(10))
    ours.collect(torch.ones(10))
    assert float(ours.compute_amax("percentile", percentile=100)) > 0
