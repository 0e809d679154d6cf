"""Compat histogram classes: Quark's functions against a literal port of Quark's code and
(tests marked ``peers``, run by ``make test`` in the peers' venv) Quark's classes themselves,
Horizon's smoothing against its definition, the registry names."""

import numpy as np
import pytest
import torch
from tiers import each_value

import quantscope as qs
from quantscope.compat import horizon as hz
from quantscope.compat import quark as qk
from quantscope.estimators.entropy import _smooth


def _quark_percentile(histogram, bin_edges, percentile, symmetric):
    """Quark 0.13 PerTensorPercentileObserver.get_min_max_by_percentile, as written."""
    hist_total = histogram.sum()
    cumulative_dist = torch.cumsum(histogram / hist_total, dim=0)
    last_idx = cumulative_dist.numel() - 1
    if symmetric is False:
        target_pct_one_side = (100.0 - percentile) / 200.0
        upper_matches = (cumulative_dist >= target_pct_one_side).nonzero()
        upper_idx = upper_matches.min().item() if upper_matches.numel() > 0 else last_idx
        max_value = bin_edges[upper_idx]
        lower_matches = (cumulative_dist <= (1 - target_pct_one_side)).nonzero()
        lower_idx = lower_matches.min().item() if lower_matches.numel() > 0 else 0
        min_value = bin_edges[lower_idx]
    else:
        target_pct = min(percentile / 100.0, cumulative_dist[-1].item())
        upper_matches = (cumulative_dist >= target_pct).nonzero()
        upper_idx = upper_matches.min().item() if upper_matches.numel() > 0 else last_idx
        max_value = bin_edges[upper_idx]
        min_value = torch.tensor(0.0)
    return min_value, max_value


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("p", [99.0, 99.99, 99.99999999])
def test_quark_percentile_function_equals_quarks_code(symmetric, p):
    g = torch.Generator().manual_seed(int(p * 100) + symmetric)
    hist = torch.randint(0, 1000, (4200,), generator=g).float() * (torch.rand(4200, generator=g)
                                                                   < 0.3)
    edges = torch.linspace(0.0, 7.5, 4201)
    obs = qk.PerTensorPercentileObserver({"dtype": "int8", "symmetric": symmetric})
    mn, mx = obs.get_min_max_by_percentile(hist, edges, p)
    rmn, rmx = _quark_percentile(hist, edges, p, symmetric)
    assert float(mn) == float(rmn) and float(mx) == float(rmx)


@pytest.mark.parametrize("fmt", ["int8", "uint8", "fp8_e4m3"])
def test_quark_mse_function_equals_a_loop_of_its_steps(fmt):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g).abs() * 3
    hist = torch.histc(x, 2048, 0, float(x.max()))
    edges = torch.linspace(0, float(x.max()), 2049)
    obs = qk.PerTensorMSEObserver({"dtype": fmt, "symmetric": True})
    _, amax = obs.get_min_max_by_mse(hist, edges, stride=3, start_bin=1800)
    centers = (edges[1:] + edges[:-1]) / 2
    mses = []
    for i in range(1800, 2048, 3):  # Quark's loop: candidate (0, centre_i), error * count
        if fmt == "fp8_e4m3":
            qp = qs.qparams_from_range(torch.zeros(1), centers[i].reshape(1), obs.spec)
            q = qs.fake_quantize(centers, qp, qs.QuantSpec(obs.spec.format, symmetric=True))
        else:  # Quark's symmetric integer rule: zero point 0 (uint8 too), half the code span
            scale = float(centers[i] / ((obs.quant_max - obs.quant_min) / 2))
            q = torch.fake_quantize_per_tensor_affine(centers, scale, 0, obs.quant_min,
                                                      obs.quant_max)
        mses.append(float(((q - centers).double() ** 2 * hist.double()).mean()))
    assert float(amax) == float(centers[1800 + 3 * int(np.argmin(mses))])


def test_quark_mse_of_subnormal_data_searches_quarks_own_grid():
    """Quark's searches read its own grid (``scales_subnormal`` is False: the histogram goes
    to them as it is, not scaled into the normal range as the native first grids' estimates
    are). Over subnormal-only data Quark's linspace edges round in steps of ``2 ** -149``;
    the range is still Quark's MSE function of those counts and edges, not a finer one."""
    x = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 1e-43
    obs = qk.PerTensorMSEObserver({"dtype": "int8", "symmetric": False})
    obs(x)
    obs.calculate_qparams()
    _, want = obs.get_min_max_by_mse(obs.calib_hist, obs.calib_bin_edges)
    assert torch.equal(obs.max_val, want)


def test_quark_observers_record_quarks_histogram_on_the_first_batch():
    torch.manual_seed(1)
    x = torch.randn(64, 256)
    x[:, 3] *= 20
    for sym in (True, False):
        obs = qk.PerTensorHistogramObserver({"dtype": "int8", "symmetric": sym})
        obs(x)
        obs(x * 0.5)
        y = x.abs() if sym else x
        lo, hi = (0.0, float(y.max())) if sym else (float(y.min()), float(y.max()))
        ref = torch.histc(y, 2048, lo, hi) + torch.histc(y * 0.5, 2048, lo, hi)
        assert torch.equal(obs.calib_hist, ref)
        assert torch.allclose(obs.calib_bin_edges, torch.linspace(lo, hi, 2049), atol=1e-5)
    skip = qk.PerTensorPercentileObserver({"dtype": "int8", "symmetric": True})
    z = x.clone()
    z[:10] = 0
    skip(z)
    assert int(skip.calib_hist.sum()) == int((z != 0).sum())  # Quark skips zeros


def test_horizon_smoothing_is_a_centred_mean_over_valid_candidates():
    g = torch.Generator().manual_seed(2)
    kl = torch.rand(2, 40, generator=g, dtype=torch.float64)
    kl[0, 30:] = float("nan")  # candidates past the data
    kl[1, 5] = float("inf")
    out = _smooth(kl, 9)
    for u in range(2):
        valid = [i for i in range(40) if not np.isnan(float(kl[u, i]))]
        for i in valid:
            win = [float(kl[u, j]) for j in range(max(0, i - 4), min(40, i + 5)) if j in valid]
            ref = float("inf") if any(np.isinf(win)) else sum(win) / len(win)
            assert float(out[u, i]) == pytest.approx(ref, rel=1e-12)


def test_horizon_observers_are_emas_of_per_interval_estimates():
    """KL every ``update_interval`` batches on the interval's histogram, then an EMA of the
    thresholds. Each interval's first batch holds its range, so Horizon's histogram of the
    interval ([0, max |x|] of its first batch) is that of one batch holding both."""
    torch.manual_seed(3)
    batches = [torch.randn(32, 64) * s for s in (3.0, 1.0, 2.0, 0.5)]
    batches[0][0, 0], batches[2][0, 0] = 12.0, 8.0  # the first batch of each its largest
    obs = hz.KLObserver(update_interval=2, averaging_constant=0.5)
    ref = None
    for k in range(0, 4, 2):
        one = hz.KLObserver()
        one(torch.cat(batches[k:k + 2]))
        for b in batches[k:k + 2]:
            obs(b)
        r = one.calculate_qparams()[0].double()
        ref = r.clone() if ref is None else ref + 0.5 * (r - ref)
    s, zp = obs.calculate_qparams()
    assert torch.allclose(s.double(), ref, rtol=1e-6) and int(zp) == 0
    for cls in (hz.PercentileObserver, hz.MixObserver):  # per tensor only, as Horizon's
        with pytest.raises(hz.HorizonArgumentError, match="per_tensor_symmetric"):
            cls(ch_axis=1, qscheme=torch.per_channel_symmetric)


def test_horizon_reads_finished_intervals_and_defaults_before_data():
    """Horizon's ``calculate_qparams``: the ends of the finished intervals (a KL interval
    still open is not read), and ``(1.0, 0)`` with a warning before any ends."""
    torch.manual_seed(4)
    batches = [torch.randn(32, 64) * s for s in (3.0, 1.0, 2.0)]
    for cls in (hz.MinMaxObserver, hz.PercentileObserver, hz.KLObserver, hz.MSEObserver,
                hz.MixObserver):
        with pytest.warns(UserWarning, match="default scale 1.0"):
            s, zp = cls().calculate_qparams()
        assert s.tolist() == [1.0] and zp.tolist() == [0] and zp.dtype == torch.int64
    obs, done = hz.KLObserver(update_interval=2), hz.KLObserver(update_interval=2)
    for b in batches[:2]:
        obs(b)
        done(b)
    obs(batches[2])  # opens the second interval
    assert torch.equal(obs.calculate_qparams()[0], done.calculate_qparams()[0])
    one = hz.KLObserver(update_interval=2)
    one(batches[0])
    with pytest.warns(UserWarning, match="no update_interval finished"):
        s, _ = one.calculate_qparams()
    assert s.tolist() == [1.0]


def test_registry_names_of_the_compat_classes():
    names = {n.lower() for n in qs.list_observers()}
    for n in ("torch.ao:HistogramObserver", "quark:PerTensorHistogramObserver",
              "quark:PerTensorHistogramObserverPro", "quark:PerTensorPercentileObserver",
              "quark:PerTensorMSEObserver", "horizon:KLObserver", "horizon:PercentileObserver",
              "horizon:MixObserver"):
        assert n.lower() in names
    o = qs.get_observer("torch.ao:HistogramObserver", bins=256)
    o(torch.randn(100))
    assert o.calculate_qparams()[0].shape == (1,)


# ------------------------------------------- the real peers (the peers' venv only)
@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name", ["PerTensorPercentileObserver", "PerTensorMSEObserver",
                                  "PerTensorHistogramObserverPro"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_against_quark_histogram_observers(name, symmetric):
    # Quark's own classes on the same batches: binning (histc of |x| or of x, zeros skipped by
    # the percentile observer), edges, the estimate and the qparams, while every batch stays
    # inside the first one's range (beyond it Quark appends bins, quantscope re-grids)
    pytest.importorskip("quark.torch.quantization.observer.observer")
    from quark.torch.quantization.config.config import QTensorConfig
    from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType
    from quark.torch.quantization.observer import observer as qo

    cfg = QTensorConfig(dtype=Dtype.int8 if symmetric else Dtype.uint8,
                        observer_cls=getattr(qo, name), qscheme=QSchemeType.per_tensor,
                        symmetric=symmetric, round_method=RoundType.half_even,
                        scale_type=ScaleType.float, is_dynamic=False)
    theirs, ours = getattr(qo, name)(cfg), getattr(qk, name)(cfg)
    g = torch.Generator().manual_seed(3 + symmetric)
    first = torch.randn(64, 256, generator=g) * 2 + (0 if symmetric else 1)
    first[0, :3] = torch.tensor([25.0, -9.0, 0.0])  # outliers, and a zero to skip
    for x in (first, first * 0.5, first[:16].flip(0) * 0.9):
        theirs(x)
        ours(x)
    (s, z), (rs, rz) = ours._calculate_qparams(), theirs._calculate_qparams()
    assert torch.equal(s, rs.reshape(s.shape).to(s.dtype)), (s, rs)
    assert torch.equal(z.float(), rz.reshape(z.shape).float()), (z, rz)


@pytest.mark.peers
@pytest.mark.parametrize(("num_bits", "unsigned", "stride", "seed", "ties"),
                         each_value([(8, False, 1), (8, True, 1), (4, False, 3)],
                                    [(0, False), (1, False), (2, True)]))
def test_against_modelopt_entropy_and_percentile(seed, ties, num_bits, unsigned, stride):
    # ModelOpt's HistogramCalibrator (TensorRT's steps: collect |x| on [0, amax], then
    # compute_amax) against quantscope's estimators on its histogram: the same threshold bin
    calib = pytest.importorskip("modelopt.torch.quantization.calib.histogram")
    from quantscope.estimators import entropy_amax, percentile_range
    from quantscope.stats.histogram import Hist

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40000, generator=g) * torch.rand(40000, generator=g).add_(0.2)
    if ties:  # few distinct values: many equal divergences, the last minimum must win
        x = (x * 4).round() / 4
    theirs = calib.HistogramCalibrator(num_bits, None, unsigned, num_bins=512)
    theirs.collect(x)
    edges = theirs._calib_bin_edges
    h = Hist(theirs._calib_hist.long()[None], edges[:1], edges[-1:], absolute=True)

    def bin_of(amax):  # amax is edges[i]: ModelOpt's from linspace, quantscope's lo + i w
        return int(torch.round(torch.as_tensor(amax) / h.width))

    t = theirs.compute_amax("entropy", stride=stride, start_bin=128)
    ours = entropy_amax(h, num_bits=num_bits, unsigned=unsigned, stride=stride, trim=False)
    assert bin_of(ours) == bin_of(t)
    for p in (99.0, 99.9, 99.99):
        _, ours = percentile_range(h, p, convention="lower")
        assert bin_of(ours) == bin_of(theirs.compute_amax("percentile", percentile=p)), p
