"""An observer call's host side off the CPU (issue 35: on a GPU the wall time of a min-max
observer is mostly the host's Python and dispatch): what it skips, with the values and the
state as before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantscope
from quantscope import QuantSpec, presets
from quantscope.layout import Channel, Group
from quantscope.observers import base
from quantscope.stats import minmax_layouts

SPECS = {"int8-channel": QuantSpec("int8", Channel(0)), "int4-g32": QuantSpec("int4", Group(32)),
         "nvfp4": presets.NVFP4}


def _x(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 64, generator=g) * (1 + seed)


@pytest.mark.parametrize("sid", list(SPECS))
def test_memoryless_state_takes_the_ops_outputs(sid, monkeypatch):
    """Off the CPU the min / max op returns new tensors, which become the memoryless state
    (as the device path runs it, on the CPU through the op's CPU implementation): the CPU
    observer's qparams bit for bit, the same buffers by name."""
    spec = SPECS[sid]
    cpu = quantscope.get_observer("memoryless_minmax", spec)
    monkeypatch.setattr(base, "layout_minmax", minmax_layouts._op_layout_minmax)
    dev = quantscope.get_observer("memoryless_minmax", spec)
    for seed in (0, 1):
        cpu(_x(seed))
        dev(_x(seed))
        lo, hi = minmax_layouts._op_layout_minmax(_x(seed), spec.layout)
        assert torch.equal(dev.min_vals, lo) and torch.equal(dev.max_vals, hi)
        assert dev.min_vals is dev._buffers["min_vals"]
    assert dev.state_dict().keys() == cpu.state_dict().keys()
    a, b = cpu.calculate_qparams(), dev.calculate_qparams()
    assert torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)
    if a.global_scale is not None:
        assert torch.equal(a.global_scale, b.global_scale)


@pytest.mark.parametrize("name", ["memoryless_minmax", "minmax", "static_minmax"])
def test_minmax_forward_off_the_cpu_sets_no_module_attribute(name, monkeypatch):
    """A min-max observer's call off the CPU (``meta`` stands in for CUDA) writes its state
    and flags without ``nn.Module.__setattr__``, whose checks of parameters, buffers and
    modules cost microseconds a write on every call."""
    obs = quantscope.get_observer(name, SPECS["int8-channel"]).to("meta")
    x = torch.empty(16, 64, device="meta")
    obs(x)  # the first call sizes the state
    calls = []
    setattr_ = nn.Module.__setattr__
    monkeypatch.setattr(nn.Module, "__setattr__",
                        lambda self, k, v: (calls.append(k), setattr_(self, k, v)))
    obs(x)
    assert not calls
