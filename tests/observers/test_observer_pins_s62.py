"""Pins from the s62 mutation run over ``quantscope.observers``: behaviour the rest of the suite
left free. Each test states the rule it holds, derived from the module docs (or torch.histc,
the reference binning of ``grid="first"``), never from a printed result."""

import pytest
import torch

from quantscope import QuantSpec, presets
from quantscope.observers import get_observer
from quantscope.qparams import qparams_from_range

ASYM = QuantSpec("uint8", symmetric=False)


def _first_grid(bins=64):
    return get_observer("percentile", ASYM, grid="first", bins=bins)


def _uniform(n=1000, seed=0):
    return torch.rand(1, n, generator=torch.Generator().manual_seed(seed))


def test_a_first_grid_batch_ending_at_the_grid_top_stays_on_the_reference_grid():
    """Later batches inside the first batch's range (its max included: histc's last bin is
    closed) are added on the same grid, so the counts are torch.histc's of all the data."""
    x = _uniform()
    o = _first_grid()
    o(x)
    o(x.clone())  # max == the grid's top: inside, not past it
    assert bool(o.linear_grid)
    want = torch.histc(torch.cat([x, x], 1), 64, float(x.min()), float(x.max())).long()
    assert torch.equal(o.current_histogram().counts[0], want)


def test_a_first_grid_batch_below_the_grid_leaves_it_and_keeps_every_count():
    """A batch whose min lies below the first grid leaves the range: the counts move to the
    native grid and the batch is counted whole (histc would drop the values outside)."""
    x = _uniform()
    o = _first_grid()
    o(x)
    o(x - 1.5)  # wholly below the first grid
    assert not bool(o.linear_grid)
    assert int(o.current_histogram().counts.sum()) == 2 * x.numel()


def test_leaving_a_first_grid_moves_each_bin_to_the_native_bin_of_its_centre():
    """The one approximate step: each first-grid bin's count goes to the native bin holding
    that bin's centre."""
    x = torch.full((1, 300), 0.25)
    x[0, :100] = 0.75  # first grid [0.25, 0.75]: 200 values in bin 0, 100 in the last
    o = _first_grid()
    o(x)
    width = 0.5 / 64
    o(torch.tensor([[2.0]]))  # leaves the first grid
    h = o.current_histogram()
    for centre, count in ((0.25 + width / 2, 200), (0.75 - width / 2, 100)):
        i = int(torch.floor((centre - h.lo[0]) / h.width[0]))
        assert int(h.counts[0, i]) == count


def test_a_histogram_refuses_a_value_of_exactly_two_to_the_126():
    """Histogram observers take ``|x| < 2**126`` (the grid's edges must stay finite in
    float32): ``|x| == 2**126`` itself is refused with the ValueError naming the limit."""
    o = get_observer("percentile", QuantSpec("int8"))
    o(torch.tensor([[1.0, -(2.0**126)]]))
    with pytest.raises(ValueError, match="2\\*\\*126"):
        o.calculate_qparams()


@pytest.mark.parametrize("spec", [ASYM, QuantSpec("int8")], ids=str)
def test_a_first_grid_l2_histogram_is_not_bounded_by_the_data(spec):
    """torch.ao's search is not clipped (``L2HistogramObserver._bounds``): with
    ``grid="first"``, also once a batch left the first grid, the range is the search and
    polish of the histogram with no bounds, not one scored inside the data's min / max."""
    from quantscope.estimators.l2 import l2_polished_range

    g = torch.Generator().manual_seed(0)
    o = get_observer("histogram", spec, grid="first", bins=256)
    o(torch.randn(1, 4000, generator=g) * 0.5 + 0.3)
    o(torch.randn(1, 4000, generator=g) * 3)  # leaves the first grid
    inf = torch.full((1,), float("inf"))
    want = l2_polished_range(o.current_histogram(), spec, o.dst_nbins, o.polish, (-inf, inf),
                             o.global_amax())
    for got, ref in zip(o.calculate_range(), want, strict=True):
        assert torch.equal(got, ref)


def test_imatrix_nvfp4_keeps_the_global_amax_its_search_priced_under():
    """NVFP4's candidates are priced under the weight's own ``max |x|`` (the incumbent's
    global amax): the observer keeps it, so its qparams carry that global scale, not one
    derived from the chosen ranges, which the search shrank below it."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g)
    importance = torch.rand(64, generator=g) + 0.1
    w[0, 0], importance[0] = 6.0, 1e-3  # an outlier of an input channel that hardly matters
    o = get_observer("imatrix_mse", presets.NVFP4, importance=importance)
    o(w)
    amax = w.abs().max()
    assert float(torch.maximum(-o.min_vals, o.max_vals).max()) < float(amax)
    assert torch.equal(o.global_amax(), amax)
    want = qparams_from_range(o.min_vals, o.max_vals, presets.NVFP4, global_amax=amax)
    assert torch.equal(o.qparams().global_scale, want.global_scale)
