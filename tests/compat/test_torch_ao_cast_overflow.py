"""compat.torch_ao.HistogramObserver whose state a module cast (``.half()``) overflowed:
torch.ao's raises a RuntimeError at the next batch (torch.histc of [-inf, inf]) and returns a
NaN scale from calculate_qparams; quantscope's raises StateOverflowError (a RuntimeError and
a ValueError) naming the class at both, never a NaN scale."""

import pytest
import torch
from torch.ao.quantization import HistogramObserver as AOHistogramObserver

from quantscope.compat.torch_ao import HistogramObserver, StateOverflowError


def _overflowed(cls):
    torch.manual_seed(0)
    obs = cls()
    obs(torch.randn(1000) * 1e5)  # |x| up to ~4e5: past float16's max 65504
    return obs.half()


def test_torch_ao_itself_fails_there():
    ao = _overflowed(AOHistogramObserver)
    assert torch.isinf(ao.min_val) and torch.isinf(ao.max_val)
    assert torch.isnan(ao.calculate_qparams()[0]).all()  # what quantscope refuses to return
    with pytest.raises(RuntimeError):
        ao(torch.randn(100).half())


def test_the_next_batch_raises_a_named_runtime_error():
    obs = _overflowed(HistogramObserver)
    with pytest.raises(StateOverflowError, match="HistogramObserver: a module cast to "
                                                 "torch.float16 overflowed"):
        obs(torch.randn(100).half())
    assert issubclass(StateOverflowError, RuntimeError)


def test_qparams_raise_instead_of_a_nan_scale():
    with pytest.raises(StateOverflowError, match="reset"):
        _overflowed(HistogramObserver).calculate_qparams()


def test_a_state_within_range_casts_and_matches_torch_ao():
    torch.manual_seed(1)
    x = torch.randn(1000) * 100
    ours, ao = HistogramObserver(), AOHistogramObserver()
    ours(x), ao(x)
    ours, ao = ours.half(), ao.half()
    y = torch.randn(500).half() * 50
    ours(y), ao(y)
    for a, b in zip(ours.calculate_qparams(), ao.calculate_qparams(), strict=True):
        assert torch.equal(a, b)
