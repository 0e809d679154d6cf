"""The histogram scorer's C kernel on float element formats (fp8, fp6, fp4, MX and NVFP4
blocks): the same scores as its torch path (float64 sums in another order: 1e-12), the same
line-search picks, and the same observer qparams with the kernel off."""

import pytest
import torch

import quantscope as qs
from quantscope import kernels
from quantscope.estimators.scorer import HistogramScorer, Line
from quantscope.stats.histogram import Hist

pytestmark = pytest.mark.skipif(not kernels.available("hist_error"),
                                reason="no C compiler (or QUANTSCOPE_NO_KERNEL): torch path only")

SPECS = [qs.QuantSpec(fmt, layout) for fmt in ("fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp4_e2m1")
         for layout in ("tensor", "channel:0", "group:16")] + [qs.presets.NVFP4,
                                                                qs.presets.MXFP4]
IDS = [str(s) for s in SPECS]


def _weight(seed=0, rows=8, cols=64):
    """Values over many binades (subnormal under most candidates' scales), rows of very
    different magnitude, a few exact zeros and an outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, cols, generator=g) * 3)
    x = x * torch.logspace(-3, 3, rows)[:, None]
    x[:, ::7] = 0.0
    x[1, 5] = 1e4
    return x


def _observed(name, spec, x, **kw):
    o = qs.get_observer(name, spec, **kw)
    o(x)
    return o


def _candidates(o):
    """Two sets of ranges [U, C]: from far inside the data (most values saturate) to just
    past it, and far past it (most round in the subnormal range, even fp8_e5m2's)."""
    f = torch.cat([torch.logspace(-4, 0, 24), torch.tensor([1.0, 1.5, 3.0])])
    g = torch.tensor([1e3, 1e5, 1e7])
    return [(o.min_vals[:, None] * f, o.max_vals[:, None] * f.flip(0)),
            (o.min_vals[:, None] * g, o.max_vals[:, None] * g)]


def _coverage(sc, lo, hi):
    """Whether the points include values that round in the subnormal range, and values past
    the format's max."""
    x, _ = sc._points()
    s, _ = sc._qparams(lo, hi, torch_only=True)
    fmt = sc.spec.format
    t = (x[:, None, :] / s[..., None]).abs()
    return torch.stack([((t > 0) & (t < 2.0 ** fmt.min_exp)).any(), (t > fmt.max).any()])


@pytest.mark.parametrize("points", [1, 2, 4])
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_float_scores_equal_the_torch_path(spec, points):
    o = _observed("histogram_mse", spec, _weight(), bins=256)
    h = o.current_histogram()
    assert bool((h.counts == 0).any())  # empty bins among the points
    ga = o.global_amax()  # NVFP4's, None for the others
    sc = HistogramScorer(h, spec, points=points, global_amax=ga)
    assert sc.kernel  # float formats score in C (the torch path before)
    t = HistogramScorer(h, spec, points=points, backend="torch", global_amax=ga)
    assert not t.kernel
    covered = torch.zeros(2, dtype=torch.bool)
    for lo, hi in _candidates(o):
        covered |= _coverage(sc, lo, hi)
        a, b = sc(lo, hi), sc(lo, hi, torch_only=True)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
        assert torch.equal(a.argmin(1), b.argmin(1))
        assert torch.equal(t(lo, hi), b)
    assert covered.all()  # subnormal and saturated values both priced


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_float_line_search_picks_as_the_torch_path(spec):
    o = _observed("histogram_mse", spec, _weight(1), bins=512)
    h = o.current_histogram()
    sc = HistogramScorer(h, spec, points=2, global_amax=o.global_amax())
    assert sc.kernel
    lo, hi, w = o.min_vals * 0.3, o.max_vals * 0.7, h.width
    bounds = (o.min_vals, o.max_vals)
    lines = [(Line.move(lo, hi, w, side, radius, steps, b), mid, coarse, first)
             for side, radius, steps, mid, coarse, first in (
                 (0, 64, 1, 64, 8, False), (1, 8, 4, 32, 4, False), (1, 300, 1, 300, (24, 5, 1),
                                                                     True))
             for b in (None, bounds)]
    lines += [(Line.centres(w, start, stride, n, b), 0, coarse, True)
              for start, stride, n, coarse in ((100, 1, 400, 16), (3, 7, 60, 5))
              for b in (None, bounds)]
    for line, mid, coarse, first in lines:
        bk = sc.line_argmin(line, mid, coarse, first=first)
        bt = sc.line_argmin(line, mid, coarse, first=first, torch_only=True)
        assert torch.equal(bk.index, bt.index)
        assert torch.equal(bk.lo, bt.lo) and torch.equal(bk.hi, bt.hi)
        torch.testing.assert_close(bk.error, bt.error, rtol=1e-12, atol=0)


def test_float_scores_on_a_sparse_histogram_equal_the_torch_path():
    # a histogram built directly: most bins empty, ends straddling zero, tiny and huge units
    g = torch.Generator().manual_seed(5)
    U, B = 40, 300
    counts = torch.randint(1, 50, (U, B), generator=g) * (torch.rand(U, B, generator=g) < 0.05)
    mag = torch.logspace(-6, 6, U)
    lo = -torch.rand(U, generator=g) * mag
    h = Hist(counts, lo, lo + 2 * mag)
    f = torch.logspace(-5, 0.5, 40)
    clo, chi = h.lo[:, None] * f, h.hi[:, None] * f
    for fmt in ("fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp4_e2m1"):
        spec = qs.QuantSpec(fmt, "channel:0")
        sc = HistogramScorer(h, spec, points=3)
        assert sc.kernel
        torch.testing.assert_close(sc(clo, chi), sc(clo, chi, torch_only=True), rtol=1e-12,
                                   atol=0)


@pytest.mark.parametrize("name", ["histogram", "histogram_mse", "mix"])
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_float_observer_qparams_equal_without_the_kernel(name, spec, monkeypatch):
    o = _observed(name, spec, _weight(2), bins=512)
    ref = o.calculate_qparams()
    with monkeypatch.context() as m:  # QUANTSCOPE_NO_KERNEL, as the library first loads
        m.setenv("QUANTSCOPE_NO_KERNEL", "1")
        m.delitem(kernels._libs, "hist_error")
        assert not HistogramScorer(o.current_histogram(), spec,
                                   global_amax=o.global_amax()).kernel
        qp = o.calculate_qparams()
    assert torch.equal(qp.scale, ref.scale) and torch.equal(qp.zero_point, ref.zero_point)
    if qp.global_scale is not None or ref.global_scale is not None:
        assert torch.equal(qp.global_scale, ref.global_scale)
