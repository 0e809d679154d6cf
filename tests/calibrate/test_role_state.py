"""``RoleState.quantizes_like`` compares what QDQ uses: an NVFP4 activation's global amax
through the global scale it gives. A checkpoint's reader finds an amax giving the stored
global scale, which may lie an ulp from the calibrated amax: the same QDQ read as different
(found on an exported Qwen3-MoE run: 3.1633975 against 3.1633973)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

import quantscope
from quantscope.observers.runtime import qdq_tensor
from quantscope.scales import nvfp4_global_scale


def _nvfp4_input_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32)).eval()
    calibration = quantscope.calibrate(model, [torch.randn(4, 64)], "nvfp4", progress=False)
    st = calibration.states["0"]["input"]
    assert st.dynamic == "local" and st.global_amax is not None
    return st


def test_an_amax_giving_the_same_global_scale_quantizes_alike():
    st = _nvfp4_input_state()
    fmt, shape = st.spec.format, st.global_amax.shape
    amax = torch.tensor(3.1633975)  # and the float32 below it: the pair the probe found
    near = torch.nextafter(amax, torch.tensor(0.0))
    assert torch.equal(nvfp4_global_scale(near, fmt), nvfp4_global_scale(amax, fmt))
    st = replace(st, global_amax=amax.reshape(shape))
    other = replace(st, global_amax=near.reshape(shape))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 3
    assert torch.equal(qdq_tensor(x, st), qdq_tensor(x, other))  # what the answer is about
    assert st.quantizes_like(other) and other.quantizes_like(st)
    far = replace(st, global_amax=st.global_amax * 2)
    assert not st.quantizes_like(far)
    assert not torch.equal(qdq_tensor(x, st), qdq_tensor(x, far))
