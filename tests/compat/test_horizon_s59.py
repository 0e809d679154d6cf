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
