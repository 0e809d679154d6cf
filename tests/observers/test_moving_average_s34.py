"""Moving averages whose ends cross: torch.ao's EMA step ``s + c * (b - s)`` rounds twice and
is not monotonic in ``s``, so a min and a max a rounding step apart can cross by that step
on ordinary data. The range read from the state is the ordered one (qparams as
compressed-tensors computes them from those ends), not a refusal of ``lo > hi``."""

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams
from torch.ao.quantization.observer import MovingAverageMinMaxObserver as AoEMA

import quantscope
from quantscope import QuantSpec

# (c = 0.5) a batch of two values an ulp apart, then one value: both ends average to about
# 0.7305, the min a float32 step above the max
BATCHES = [torch.tensor([-0.30527856496191497, -0.30527851090031594]),
           torch.tensor([1.7662581022737207])]


@pytest.mark.parametrize("name", ["minmax", "mse"])
def test_crossed_moving_average_ends_give_the_qparams_of_the_ordered_range(name):
    obs = quantscope.get_observer(name, QuantSpec("int8"), averaging_constant=0.5)
    for b in BATCHES:
        obs(b)
    assert obs.min_vals.item() > obs.max_vals.item()  # the state crossed
    lo, hi = obs.calculate_range()
    assert torch.equal(lo, obs.max_vals) and torch.equal(hi, obs.min_vals)
    args = QuantizationArgs(num_bits=8, symmetric=True, strategy="tensor")
    scale, zp = calculate_qparams(lo, hi, args)
    got = obs.calculate_qparams()
    assert torch.equal(got.scale.reshape(-1), scale.reshape(-1))
    assert torch.equal(got.zero_point.reshape(-1).int(), zp.reshape(-1).int())


def test_the_crossed_state_is_torch_aos_own():
    ours = quantscope.get_observer("minmax", QuantSpec("int8"), averaging_constant=0.5)
    ao = AoEMA(averaging_constant=0.5, qscheme=torch.per_tensor_symmetric)
    for b in BATCHES:
        ours(b)
        ao(b)
    assert torch.equal(ours.min_vals.reshape(()), ao.min_val)
    assert torch.equal(ours.max_vals.reshape(()), ao.max_val)


@pytest.mark.parametrize("layout", ["tensor", "channel:0"])
def test_a_placeholder_range_before_any_tensor_is_a_clear_error(layout):
    obs = quantscope.get_observer("placeholder", QuantSpec("int8", layout=layout))
    with pytest.raises(ValueError, match="before any tensor was observed"):
        obs.calculate_range()
    obs(torch.randn(4, 8))
    lo, hi = obs.calculate_range()
    assert lo.shape == hi.shape == ((1,) if layout == "tensor" else (4,))
