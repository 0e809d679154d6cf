"""A histogram state that no observer could have written is refused on load, naming the
buffer: negative or overflowing counts, a native grid not starting at its data's bin. Each
loaded without a word before and estimated a wrong range (a scale ~2000x too small)."""

import itertools

import pytest
import torch

from quantscope import QuantSpec, get_observer

NAMES = ("percentile", "entropy", "histogram_mse", "mix")


def _saved(name, symmetric=True, **kw):
    spec = QuantSpec("int8", "tensor", symmetric=symmetric)
    obs = get_observer(name, spec, **kw)
    torch.manual_seed(0)
    for i in range(3):  # a growing range: the grid is re-binned
        obs(torch.randn(64, 16) * (1 + 3 * i) + 0.5)
    return spec, obs, obs.state_dict()


@pytest.mark.parametrize("name", NAMES)
def test_negative_or_overflowing_counts_are_refused(name):
    spec, _, saved = _saved(name)
    for counts in (-saved["hist_counts"], saved["hist_counts"] + 2 ** 61):
        with pytest.raises(ValueError, match="hist_counts: counts must be >= 0"):
            get_observer(name, spec).load_state_dict({**saved, "hist_counts": counts})


@pytest.mark.parametrize("name,symmetric", [("percentile", True), ("histogram_mse", False)])
def test_a_grid_not_at_its_datas_bin_is_refused(name, symmetric):
    spec, _, saved = _saved(name, symmetric)
    with pytest.raises(ValueError, match="hist_first: a native grid starts"):
        get_observer(name, spec).load_state_dict({**saved, "hist_first": saved["hist_first"] + 7})


@pytest.mark.parametrize("name,symmetric,ema,grid", list(itertools.product(
    NAMES, (True, False), (None, 0.1), ("pow2", "first"))))
def test_every_state_an_observer_writes_loads_and_gives_its_qparams(name, symmetric, ema, grid):
    spec, obs, saved = _saved(name, symmetric, averaging_constant=ema, grid=grid)
    back = get_observer(name, spec, averaging_constant=ema, grid=grid)
    back.load_state_dict(saved)
    want, got = obs.qparams(), back.qparams()
    assert torch.equal(want.scale, got.scale) and torch.equal(want.zero_point, got.zero_point)


def test_an_observed_state_on_the_meta_device_loads_with_assign():
    """A skeleton's state has no values to check (it failed reading them back before)."""
    spec, _, saved = _saved("percentile")
    meta = {k: v.to("meta") if v.dtype != torch.uint8 else v for k, v in saved.items()}
    with torch.device("meta"):
        into = get_observer("percentile", spec)
    into.load_state_dict(meta, assign=True)
    assert into.hist_counts.is_meta and into.hist_counts.shape == saved["hist_counts"].shape
