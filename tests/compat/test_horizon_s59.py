"""Horizon's KL histogram state (s59's probe): a grid grown past its first batch's top is read
at the width of the bins it was saved with, so it loads only into an observer of those bins;
into one of other bins (more than it started with) it was read at the wrong width, silently:
amax 1.238 where 2.476."""

from __future__ import annotations

import warnings

import pytest
import torch

from quantscope.compat.horizon import KLObserver


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.rand(1000, generator=g) * top for top in (1.0, 2.5, 1.0)]


def _fed(bins, batches):
    obs = KLObserver(bins=bins, update_interval=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in batches:
            obs(x)
    return obs


def test_a_grown_grid_loads_into_the_bins_it_was_saved_with():
    x1, x2, x3 = _batches()
    saved = _fed(256, [x1, x2])
    assert saved.hist_counts.shape[-1] == 640  # grown: ceil(2.5 / (1 / 256)) bins
    back = KLObserver(bins=256, update_interval=3)
    back.load_state_dict(saved.state_dict())
    saved(x3)
    back(x3)
    assert torch.equal(back.max_val, saved.max_val)
    assert torch.equal(back.max_val, _fed(256, [x1, x2, x3]).max_val)


@pytest.mark.parametrize("bins", [300, 512])
def test_a_grown_grid_is_refused_by_other_bins(bins):
    saved = _fed(256, _batches()[:2])
    other = KLObserver(bins=bins, update_interval=3)
    with pytest.raises(ValueError, match=rf"cannot load a histogram of 640 bins into one of "
                                         rf"bins={bins}; construct the observer with the bins "
                                         rf"it was saved with"):
        other.load_state_dict(saved.state_dict())


@pytest.mark.parametrize(("saved_bins", "tops", "bins", "nb"), [
    (512, (1.0, 2.5), 256, 1280),  # grown from 512: its data needs 1280 bins of 1 / 512
    (257, (1.0,), 256, 257),  # never grown: one bin more, data within its first top
])
def test_a_state_of_other_bins_is_refused_even_where_its_count_could_be_a_growth(
        saved_bins, tops, bins, nb):
    """More bins than ``bins`` is a growth only where the data's amax passed the first top
    and needs that many bins at this width: a grid grown from 512 bins (1280) read at 256's
    width doubles its top; 257 bins never grown read as grown past 256 stretch it."""
    g = torch.Generator().manual_seed(0)
    saved = _fed(saved_bins, [torch.rand(1000, generator=g) * t for t in tops])
    assert saved.hist_counts.shape[-1] == nb
    other = KLObserver(bins=bins, update_interval=3)
    with pytest.raises(ValueError, match=rf"cannot load a histogram of {nb} bins into one of "
                                         rf"bins={bins}"):
        other.load_state_dict(saved.state_dict())
    assert not other.has_observed  # left empty, not half loaded
