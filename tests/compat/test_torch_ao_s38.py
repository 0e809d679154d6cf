"""Probe s38 on the torch.ao compat: ``torch_ao_spec`` took any qscheme (a string, None) as
per-tensor affine; a loaded float32 state with an infinite end was blamed on a module cast."""

import pytest
import torch

from quantscope.compat import torch_ao
from quantscope.compat.torch_ao import StateOverflowError, torch_ao_spec


@pytest.mark.parametrize("qscheme", ["per_channel_symmetric", None, torch.float32])
def test_torch_ao_spec_refuses_what_is_not_a_qscheme(qscheme):
    with pytest.raises(ValueError, match=r"torch_ao_spec: qscheme must be a torch.qscheme"):
        torch_ao_spec(qscheme=qscheme)


@pytest.mark.parametrize("qscheme,layout,symmetric", [
    (torch.per_tensor_affine, "Tensor", False), (torch.per_tensor_symmetric, "Tensor", True),
    (torch.per_channel_affine, "Channel", False), (torch.per_channel_symmetric, "Channel", True),
    (torch.per_channel_affine_float_qparams, "Channel", False)])
def test_torch_ao_spec_still_takes_every_qscheme(qscheme, layout, symmetric):
    spec = torch_ao_spec(qscheme=qscheme)
    assert type(spec.layout).__name__ == layout and spec.symmetric is symmetric


def test_a_loaded_infinite_float32_end_is_named_as_loaded_not_only_as_a_cast():
    o = torch_ao.HistogramObserver()
    o.load_state_dict({"histogram": torch.rand(2048), "min_val": torch.tensor(float("-inf")),
                       "max_val": torch.tensor(1.0), "eps": o.eps.clone()})
    with pytest.raises(StateOverflowError, match=r"range \[-inf, 1.0\] is not finite: a "
                                                 r"loaded min_val / max_val held inf"):
        o.calculate_qparams()
    with pytest.raises(StateOverflowError, match="not finite"):
        o(torch.randn(8))


def test_a_cast_there_and_back_is_still_named():
    o = torch_ao.HistogramObserver()
    o(torch.tensor([-1e6, 2e5]))
    o.half().float()  # float16 overflowed the ends to inf; float32 keeps them
    with pytest.raises(StateOverflowError, match=r"module cast \(.half\(\)\) overflowed it"):
        o(torch.randn(8))
