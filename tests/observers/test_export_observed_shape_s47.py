"""Mutation round s47 on ``observers.shape.record_shape``: under torch.export (non-strict) an
accumulating min-max observer's ``observed_shape`` is written in place once the first batch
has sized it (export drops a reassigned buffer's update): an exported module with a dynamic
batch dim records the shape it saw, as eager does."""

import copy
import warnings

import pytest
import torch
from torch import nn

import quantscope
from quantscope import QuantSpec


class _Holder(nn.Module):
    def __init__(self, obs):
        super().__init__()
        self.obs = obs

    def forward(self, x):
        self.obs(x)
        return x * 2


@pytest.mark.parametrize("name", ["static_minmax", "minmax"])
def test_exported_observer_records_the_shape_it_saw(name):
    torch.manual_seed(0)
    eager = _Holder(quantscope.get_observer(name, QuantSpec("int8")))
    eager(torch.randn(4, 64))  # sizes the state and the shape buffer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = torch.export.Dim("rows", min=2, max=64)
        mod = torch.export.export(copy.deepcopy(eager), (torch.randn(4, 64),),
                                  dynamic_shapes={"x": {0: rows}}, strict=False).module()
    x = torch.randn(8, 64) * 10
    eager(x)
    mod(x)
    got = mod.state_dict()
    assert got["obs.observed_shape"].tolist() == [8, 64] == eager.obs.observed_shape.tolist()
    for k in ("min_vals", "max_vals", "observed_tokens"):
        assert torch.equal(got[f"obs.{k}"], getattr(eager.obs, k)), k
