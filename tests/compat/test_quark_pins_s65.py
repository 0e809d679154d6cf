"""compat.quark's Quark histogram observers, scale formulas and block observers where the s65
mutation round (quark_histogram.py, quark_scales.py, quark_block.py) found behaviour no .venv
test pinned: a symmetric batch's histogram range (``|x|`` from 0, nudged only when all zero),
the edges' dtype of ``min_val`` after a module cast, Quark's percentile (its value, the 0..100
bounds, the two-sided tail, the target capped at the cdf's end, a zero-mass histogram), the MSE
search (start_bin 2045, fewer than two edges, a negative candidate centre), the counts'
float32 after a cast, Quark's grid growth, the per-group default axis, the float32 / e5m3 /
E8M0 scale formulas, float16 and float64 integer widths and scales, BFP16's scales (before
data, the +127.5 overflow edge, a block below E8M0's range) and MX's amax (its dtype
promotion, padded blocks, +0.0, the ch_axis assert). Expected values come from Quark 0.13's
observer code (quoted in the docstrings) and compat.quark's docstrings; nothing imports
Quark."""

from __future__ import annotations

import pytest
import torch

from quantscope.compat import quark
from quantscope.compat.quark_scales import (
    _quark_layout,
    _QuarkGrid,
    quark_e8m0_scale,
    quark_float_scale,
    quark_half_width,
)


def test_symmetric_constant_batch_bins_from_zero_to_its_magnitude():
    """Quark, symmetric: ``x = x.abs(); x_max = max(x); x_min = 0.0``; the nudge applies only
    where ``x_min == x_max``, so a constant -1e-6 bins over [0, 1e-6], not [0, bins * eps]."""
    c = torch.tensor(-1e-6)
    for name in ("PerTensorHistogramObserver", "PerTensorMSEObserver",
                 "PerTensorPercentileObserver"):
        obs = getattr(quark, name)({"dtype": "int8", "symmetric": True})
        obs(torch.full((4, 8), c.item()))
        edges = obs.calib_bin_edges
        assert edges[0].item() == 0.0 and edges[-1].item() == c.abs().item(), (name, edges[-1])


def test_asymmetric_range_after_a_half_cast_is_in_the_edges_dtype():
    """``min_val`` / ``max_val``: 0-dim, in the bin edges' dtype (a module cast's): Quark's
    ``bin_edges[idx]`` of edges that ``.half()`` converted, both ends."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    for name in ("PerTensorHistogramObserver", "PerTensorPercentileObserver"):
        obs = getattr(quark, name)({"dtype": "int8", "symmetric": False})
        obs(x)
        obs.half()
        obs._calculate_qparams()
        assert obs.calib_bin_edges.dtype == torch.float16
        assert obs.min_val.dtype == obs.max_val.dtype == torch.float16, name
        assert obs.min_val.shape == obs.max_val.shape == ()


def test_percentile_is_quarks():
    """Quark's ``PerTensorPercentileObserver.__init__``: ``self.percentile = 99.99999999``."""
    obs = quark.PerTensorPercentileObserver({"dtype": "int8", "symmetric": True})
    assert obs.percentile == 99.99999999


def _percentile(symmetric: bool) -> quark.PerTensorPercentileObserver:
    return quark.PerTensorPercentileObserver({"dtype": "int8", "symmetric": symmetric})


@pytest.mark.parametrize("p", [0.0, 100.0])
def test_percentile_bounds_0_and_100_are_taken(p):
    """Quark raises only for ``percentile < 0 or percentile > 100``. Symmetric: the first bin
    whose cdf reaches ``min(p / 100, cdf[-1])``, its left edge."""
    obs = _percentile(True)
    counts, edges = torch.tensor([1.0, 2.0, 0.0, 1.0, 0.0]), torch.arange(6.0)
    lo, hi = obs.get_min_max_by_percentile(counts, edges, p)
    assert (lo.item(), hi.item()) == (0.0, 0.0 if p == 0.0 else 3.0)


@pytest.mark.parametrize("p", [-1e-9, 100.000001])
def test_percentile_outside_0_100_is_refused(p):
    with pytest.raises(ValueError, match="Percentile value must be between 0 and 100"):
        _percentile(True).get_min_max_by_percentile(torch.ones(4), torch.arange(5.0), p)


@pytest.mark.parametrize("p, top", [(50.0, 0.0), (40.0, 1.0)])
def test_asymmetric_percentile_tail_is_half_of_100_minus_p(p, top):
    """Quark, symmetric=False: ``side = (100 - p) / 200``; max = the left edge of the first bin
    with ``cdf >= side`` (cdf .25, .5, .75, 1: p=50 -> side .25 -> bin 0; p=40 -> .3 -> bin 1),
    min = the first edge (its ``cdf <= 1 - side`` holds from bin 0)."""
    counts, edges = torch.ones(4), torch.arange(5.0)
    lo, hi = _percentile(False).get_min_max_by_percentile(counts, edges, p)
    assert (lo.item(), hi.item()) == (0.0, top)


def test_symmetric_percentile_target_is_capped_at_the_cdfs_last_value():
    """Quark: ``target = min(p / 100, cdf[-1])`` and the first bin with ``cdf >= target``.
    A float32 cdf that ends below 1 (rounded fractions) still finds the last non-empty bin
    (index 5), not the fallback last bin (index 7)."""
    counts = torch.tensor([46.0, 35.0, 27.0, 12.0, 5.0, 46.0, 0.0, 0.0])
    assert torch.cumsum(counts / counts.sum(), 0)[-1].item() < 1.0  # the case
    lo, hi = _percentile(True).get_min_max_by_percentile(counts, torch.arange(9.0), 99.99999999)
    assert (lo.item(), hi.item()) == (0.0, 5.0)


@pytest.mark.parametrize("symmetric", [True, False])
def test_zero_mass_histogram_percentile_is_zero_range(symmetric):
    """Quark: ``if hist_total.item() <= 0`` -> a zero range (no NaN cdf read)."""
    lo, hi = _percentile(symmetric).get_min_max_by_percentile(torch.zeros(4),
                                                              torch.arange(1.0, 6.0), 99.0)
    assert (lo.item(), hi.item()) == (0.0, 0.0)


def _mse(dtype: str, symmetric: bool = False) -> quark.PerTensorMSEObserver:
    return quark.PerTensorMSEObserver({"dtype": dtype, "symmetric": symmetric})


@pytest.mark.parametrize("dtype", ["uint4", "uint8", "int4"])
def test_mse_search_starts_at_bin_2045(dtype):
    """Quark's ``get_min_max_by_mse(..., stride=1, start_bin=2045)`` prices ``(0, centre_i)``
    for ``i >= 2045`` (uint4 / int4 among its dtypes). All the mass in bin 2045: its centre
    is the largest code (asymmetric, zero point 0: ``amax / (qmax - qmin)`` steps) and
    quantizes to itself, an error of 0 the later centres do not reach."""
    counts, edges = torch.zeros(2048), torch.arange(2049.0)
    counts[2045] = 3.0
    lo, hi = _mse(dtype).get_min_max_by_mse(counts, edges)
    assert (lo.item(), hi.item()) == (0.0, 2045.5)


def test_mse_search_refuses_fewer_than_two_edges():
    with pytest.raises(ValueError, match="calib_bin_edges must have at least 2 elements, got 1"):
        _mse("int8").get_min_max_by_mse(torch.ones(0), torch.ones(1))


def test_int_mse_refuses_a_negative_candidate_even_when_a_later_one_wins():
    """Quark's int pricing asserts ``min <= max`` for each candidate ``(0, centre)``: a grid
    whose centre 2045 is negative fails, whatever the best centre would be."""
    edges = torch.arange(-2046.0, 3.0)  # centres ..., -0.5 (index 2045), 0.5, 1.5
    counts = torch.zeros(2048)
    counts[-1] = 1.0
    with pytest.raises(ValueError, match="a centre is negative"):
        _mse("uint8").get_min_max_by_mse(counts, edges)


@pytest.mark.parametrize("name", ["PerTensorMSEObserver", "PerTensorPercentileObserver"])
def test_counts_turn_float32_with_the_next_batch_after_a_half_cast(name):
    """Quark bins each batch with ``torch.histc(x.float(), ...)`` and adds the old counts to
    that: a batch after ``.half()`` gives float32 counts, while the edges (no batch widened
    them) keep the cast's float16."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    obs = getattr(quark, name)({"dtype": "int8", "symmetric": True})
    obs(x)
    obs.half()
    assert obs.calib_hist.dtype == torch.float16
    obs(x * 0.5)
    assert obs.calib_hist.dtype == torch.float32
    assert obs.calib_bin_edges.dtype == torch.float16


def _grid() -> _QuarkGrid:
    """Quark's first grid of [0, 4] in 4 bins of width 1, one count in each."""
    return _QuarkGrid(torch.ones(4), torch.linspace(0.0, 4.0, 5), 4)


def test_grid_grows_above_by_whole_bins_of_its_width():
    """Quark: ``_num_bins += ceil((x_max - edges[-1]) / width)``, edges ``arange(edges[0],
    x_max + width, width)``, the batch's histc over all bins plus the old counts in front:
    5.5 above [0, 4] -> 2 bins more, edges 0..6, the value in bin 5."""
    grid = _grid()
    assert grid.grow(torch.tensor([5.5]), 0.0, 5.5) is True
    assert grid.bins == 6
    assert grid.edges.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert grid.counts.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]


def test_grid_grows_below_from_x_min_minus_a_width_and_adds_old_counts_in_front():
    """Quark: below, ``arange(x_min - width, edges[-1], width)`` (a grid shifted by the
    rounding of x_min, as Quark's) and ``hist[:old.numel()] += old``: -0.5 below [0, 4] ->
    1 bin more, edges -1.5 .. 3.5; the batch [-0.5, 1.2] lands in bins 1 and 2."""
    grid = _grid()
    assert grid.grow(torch.tensor([-0.5, 1.2]), -0.5, 1.2) is True
    assert grid.bins == 5
    assert grid.edges.tolist() == [-1.5, -0.5, 0.5, 1.5, 2.5, 3.5]
    assert grid.counts.tolist() == [1.0, 2.0, 2.0, 1.0, 0.0]


def test_grid_keeps_its_edges_for_a_batch_at_its_ends():
    """Quark widens only for ``x_min < edges[0]`` / ``x_max > edges[-1]``."""
    grid = _grid()
    edges = grid.edges
    assert grid.grow(torch.tensor([0.0, 4.0]), 0.0, 4.0) is False
    assert grid.edges is edges and grid.bins == 4
    assert grid.counts.tolist() == [2.0, 1.0, 1.0, 2.0]


def test_per_group_layout_without_ch_axis_groups_the_last_axis():
    assert _quark_layout("per_group", None, 32, False).axis == -1
    assert _quark_layout("per_group", None, 32, True).axis == -1


def test_float32_scale_divides_in_scale_types_dtype():
    """Quark's ``get_scale`` float32 with ``scale_type`` float16: ``amax.to(dtype) /
    quant_max``, so a float16 result of the rounded amax."""
    amax = torch.tensor([1.0001, 3.0])
    got = quark_float_scale(amax, 6.0, "float32", dtype=torch.float16)
    assert got.dtype == torch.float16
    assert torch.equal(got, amax.half() / 6.0)


def test_e5m3_zero_amax_gives_eps_rounded_to_e5m3():
    """Quark's e5m3 scale: ``amax / quant_max``, zeros -> eps, then E5M3 rounding: eps 1e-5
    rounds to E5M3's smallest subnormal ``2 ** -17`` (1.31 of it)."""
    got = quark_float_scale(torch.tensor([0.0]), 6.0, "e5m3", eps=1e-5)
    assert got.tolist() == [2.0 ** -17]


@pytest.mark.parametrize("mode, want", [("floor", 0.5), ("ceil", 1.0)])
def test_e8m0_floor_ceil_scale_and_eps_for_a_zero_block(mode, want):
    """Quark: ``2 ** (floor / ceil(log2 amax) - emax)``, a zero amax (scale 0) -> eps."""
    got = quark_e8m0_scale(torch.tensor([3.0, 0.0]), 2, mode, eps=2.0 ** -10)
    assert got.tolist() == [want, 2.0 ** -10]


def _bfp() -> quark.PerBlockBFPObserver:
    return quark.PerBlockBFPObserver({"dtype": "bfp16", "ch_axis": -1, "group_size": 8})


def test_bfp_before_data_is_eps_and_an_int32_zero():
    """Quark's formula on its ``amax`` ``tensor(0.)``: the eps scale, zero point int32 0."""
    obs = _bfp()
    scale, zero_point = obs._calculate_qparams()
    assert obs.amax.shape == () and obs.amax.item() == 0.0
    assert scale.item() == obs.eps and scale.shape == ()
    assert zero_point.dtype == torch.int32 and zero_point.item() == 0


def test_bfp_scale_bumps_on_the_positive_end_only():
    """BFP16 ``2 ** (floor(log2 amax) - 6)``, doubled where the block's positive end reaches
    127.5 steps (its code 128 overflows int8); a negative end rounds to -128 at most, which
    int8 holds. Blocks: +127.25 -> 1; -127.75 -> 1; +127.5 -> 2; amax 3 -> 1/32; zeros -> eps."""
    x = torch.zeros(5, 8)
    x[0, 0], x[1, 0], x[1, 1], x[2, 0], x[3, 1] = 127.25, -127.75, 1.0, 127.5, -3.0
    obs = _bfp()
    obs(x)
    scale, zero_point = obs._calculate_qparams()
    assert scale.reshape(-1).tolist() == [1.0, 1.0, 2.0, 1 / 32, obs.eps]
    assert zero_point.dtype == torch.int32 and not zero_point.any()


def test_bfp_scale_of_a_block_below_e8m0s_range_is_eps():
    """Quark's scale ``2 ** (floor(log2 amax) - 6)`` of amax ``2 ** -145`` is 0 in float32:
    Quark fills eps, not E8M0's smallest scale."""
    x = torch.zeros(1, 8)
    x[0, 0] = 2.0 ** -145
    obs = _bfp()
    obs(x)
    assert obs._calculate_qparams()[0].reshape(-1).tolist() == [obs.eps]


def test_half_width_is_the_amax_when_symmetric():
    """Quark's float16 width: asymmetric ``max(hi, 0) - min(lo, 0)``, symmetric the amax
    ``max(-min(lo, 0), max(hi, 0))``."""
    lo, hi = torch.tensor(-1.5, dtype=torch.float16), torch.tensor(2.25, dtype=torch.float16)
    assert quark_half_width(lo, hi, symmetric=True).item() == 2.25
    assert quark_half_width(lo, hi).item() == 3.75


@pytest.mark.parametrize("symmetric, want", [(True, 2.55 / 127.5), (False, 3.55 / 255)])
def test_float64_range_scale_divides_in_float64(symmetric, want):
    """Quark's integer formula on a float64 range runs in float64: ``amax / ((qmax - qmin) /
    2)`` symmetric, else ``(max(hi, 0) - min(lo, 0)) / (qmax - qmin)``; a zero range: eps."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "int8", "symmetric": symmetric})
    lo, hi = torch.tensor(-1.0, dtype=torch.float64), torch.tensor(2.55, dtype=torch.float64)
    scale, _ = obs.calculate_qparams(lo, hi)
    assert scale.dtype == torch.float64 and scale.item() == want
    zero = torch.tensor(0.0, dtype=torch.float64)
    assert obs.calculate_qparams(zero, zero)[0].item() == float(obs.eps) > 0


def test_a_one_dim_float16_range_keeps_float16_scales():
    """Quark clamps the scale by its 0-dim float32 eps buffer: a 0-dim float16 range's scale
    promotes to float32, a 1-dim one keeps float16 (a 0-dim tensor does not promote it)."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "int8", "symmetric": False})
    lo, hi = torch.tensor([-1.5], dtype=torch.float16), torch.tensor([2.25], dtype=torch.float16)
    assert obs.calculate_qparams(lo, hi)[0].dtype == torch.float16
    assert obs.calculate_qparams(lo[0], hi[0])[0].dtype == torch.float32


def _mx(**kw) -> quark.PerBlockMXObserver:
    return quark.PerBlockMXObserver({"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1,
                                     "group_size": 32, "scale_format": "e8m0", **kw})


def test_static_mx_amax_promotes_with_each_batchs_dtype():
    """Quark's static amax is ``torch.max(running amax, batch's)``: float32 stays float32
    after a float16 batch (type promotion)."""
    obs = _mx(is_dynamic=False)
    obs(torch.randn(2, 64, generator=torch.Generator().manual_seed(0)))
    obs(torch.randn(2, 64, generator=torch.Generator().manual_seed(1)).half())
    assert obs.amax.dtype == torch.float32


def test_static_mx_merges_a_batch_whose_last_block_pads_to_the_same_blocks():
    """A static MX amax starts over only when its ``(rows, blocks)`` change; 48 columns in
    blocks of 32 are 2 blocks (the last padded), as 64: Quark's ``torch.max`` merges them."""
    obs = _mx(is_dynamic=False)
    obs(torch.full((2, 64), 4.0))
    obs(torch.ones(2, 48))
    assert obs.amax.tolist() == [[4.0, 4.0], [4.0, 4.0]]


def test_mx_amax_of_a_zero_block_is_positive_zero():
    """Quark's ``abs().max()``: a block of zeros has amax +0.0, whatever their signs (the
    block's min and max are then 0.0, and ``max(-min, max)`` would be -0.0)."""
    for x in (torch.full((1, 32), -0.0), torch.cat([torch.full((1, 16), -0.0),
                                                    torch.zeros(1, 16)], 1)):
        obs = _mx()
        obs(x)
        assert obs.amax.tolist() == [[0.0]] and not bool(torch.signbit(obs.amax).any())


def test_mx_without_ch_axis_is_refused_as_quarks_assert():
    """Quark's ``PerBlockMXObserver`` asserts a ``ch_axis`` (the axis of its blocks)."""
    with pytest.raises(AssertionError, match="needs a ch_axis"):
        quark.PerBlockMXObserver({"dtype": "fp4", "qscheme": "per_group", "group_size": 32,
                                  "scale_format": "e8m0"})
