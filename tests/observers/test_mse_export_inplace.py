"""Memoryless MSE observers under torch.export (non-strict): a warmed state keeps updating as
eager does (the buffers are written in place; export drops a reassigned buffer's update)."""

import copy
import warnings

import pytest
import torch
from torch import nn

import quantscope
import quantscope.presets as P
from quantscope import QuantSpec
from quantscope.layout import Channel

INT8_CH = QuantSpec("int8", Channel(0))
CASES = [("pow2_mse", INT8_CH, {}, ("min_vals", "max_vals")),
         ("pow2_mse", P.NVFP4, {}, ("min_vals", "max_vals", "global_amax_val")),
         ("memoryless_mse", INT8_CH, {"compat": "llmcompressor"}, ("min_vals", "max_vals")),
         ("memoryless_mse", INT8_CH, {"patience": None}, ("min_vals", "max_vals"))]


class _Holder(nn.Module):
    def __init__(self, obs):
        super().__init__()
        self.obs = obs

    def forward(self, x):
        self.obs(x)
        return x * 2


@pytest.mark.parametrize("name,spec,kw,keys", CASES)
def test_exported_memoryless_mse_state_follows_eager(name, spec, kw, keys):
    torch.manual_seed(0)
    eager = _Holder(quantscope.get_observer(name, spec, **kw))
    eager(torch.randn(4, 64))  # one eager batch sizes the state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = torch.export.export(copy.deepcopy(eager), (torch.randn(4, 64),),
                                  strict=False).module()
    x = torch.randn(4, 64) * 10  # a 10x wider range: a stale state shows
    eager(x)
    mod(x)
    got = mod.state_dict()
    for k in keys:
        assert torch.equal(got[f"obs.{k}"], getattr(eager.obs, k)), f"{name} {kw}: {k} stale"
