"""compat.quark's histogram observers and Quark scale helpers: behaviour the s71 mutation round
(quark_histogram.py, quark_scales.py) found no test pinned, with the peers' tests run too: the
recorder's ``min_val`` / ``max_val`` (copies of the range last priced, not views of the running
state), the shapes and the symmetric zero of ``get_min_max_by_percentile``, the eps fill of an
E8M0 floor / ceil scale that underflows float32, and the token count of a strided batch that
requires grad. Expected values come from Quark 0.13's observer code as the modules' docstrings
quote it; nothing imports Quark."""

from __future__ import annotations

import pytest
import torch

from quantscope.compat import quark
from quantscope.compat.quark_scales import quark_e8m0_scale, quark_token_count

_EPS = torch.finfo(torch.float32).eps


def _percentile() -> quark.PerTensorPercentileObserver:
    return quark.PerTensorPercentileObserver({"dtype": "int8", "symmetric": True})


def test_recorder_min_max_val_keep_the_range_last_priced():
    """``min_val`` / ``max_val`` hold the range the last qparams priced: a later batch that
    widens the data's range leaves them as they were until qparams are priced again."""
    obs = quark.PerTensorHistogramObserver({"dtype": "int8", "symmetric": False})
    obs(torch.tensor([[-3.0, 1.0]]))
    obs.calculate_qparams()
    obs(torch.tensor([[-6.0, 2.0]]))
    assert (obs.min_val.item(), obs.max_val.item()) == (-3.0, 1.0)
    obs.calculate_qparams()
    assert (obs.min_val.item(), obs.max_val.item()) == (-6.0, 2.0)


def test_percentile_of_one_histogram_is_a_pair_of_0_dim_ends_and_of_rows_one_per_row():
    """Quark's function on ``[B]`` / ``[B + 1]`` gives 0-dim ends; the vectorized rows
    ``[U, B]`` / ``[U, B + 1]`` give one end per row ``[U]``."""
    lo, hi = _percentile().get_min_max_by_percentile(torch.ones(4), torch.arange(5.0), 99.0)
    assert lo.shape == hi.shape == ()
    lo, hi = _percentile().get_min_max_by_percentile(torch.ones(3, 4),
                                                     torch.arange(5.0).repeat(3, 1), 99.0)
    assert lo.shape == hi.shape == (3,)


def test_symmetric_percentile_min_is_zero_whatever_the_first_edge():
    """Quark's symmetric branch returns ``(0, edge)``: 0, not the grid's first edge (1 here);
    the max is the left edge of the first bin whose cdf reaches 0.99 (bin 3: edge 4)."""
    lo, hi = _percentile().get_min_max_by_percentile(torch.ones(4), torch.arange(1.0, 6.0), 99.0)
    assert (lo.item(), hi.item()) == (0.0, 4.0)


@pytest.mark.parametrize("mode", ["floor", "ceil"])
def test_e8m0_scale_that_underflows_float32_is_eps(mode):
    """Quark's ``scale.masked_fill(scale == 0.0, eps)``: ``2 ** (-145 - 8)`` is below float32's
    smallest subnormal, a 0 scale, filled with eps as a zero amax's."""
    amax = torch.tensor([2.0 ** -145, 0.0])
    assert quark_e8m0_scale(amax, 8, mode).tolist() == [_EPS, _EPS]


def test_token_count_of_a_strided_batch_that_requires_grad():
    """Quark's ``(x != 0).any(-1).sum()`` needs no grad-free input: a transposed (strided)
    float32 batch that requires grad counts its 3 rows that hold a value, as an int."""
    x = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, -3.0]])
    assert int(quark_token_count(x.requires_grad_().t())) == 3
