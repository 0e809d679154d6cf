"""Off the CPU the MX and NVFP4 block qparams come from the ops (``quantscope::e8m0_block_scales``,
``quantscope::nvfp4_block_scales``: Triton on CUDA), bitwise the torch branch of
``qparams_from_range``. The ops' CPU implementations stand in for the device here (the Triton
kernels are held to them under the interpreter in tests/kernels/test_triton_kernels.py); the
meta device proves the dispatch."""

from __future__ import annotations

import pytest
import torch
from op_names import OpNames

from quantscope import QuantSpec, presets, qparams
from quantscope.layout import Block

SPECS = {
    "mxfp4": presets.MXFP4,
    "mxfp6-e3m2": presets.MXFP6_E3M2,
    "mxfp8": presets.MXFP8,
    "mxfp4-even": QuantSpec("fp4_e2m1", Block(32), scale="e8m0:even"),
    "nvfp4": presets.NVFP4,
    "nvfp4-e3m2": QuantSpec("fp6_e3m2", Block(16), scale="fp8_e4m3"),
}


def _ranges(n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo = -torch.rand(n, generator=g) * 2.0 ** torch.randint(-30, 30, (n,), generator=g)
    hi = torch.rand(n, generator=g) * 2.0 ** torch.randint(-30, 30, (n,), generator=g)
    lo[:4], hi[:4] = 0.0, 0.0  # empty blocks: the min scale
    lo[4], hi[4] = -1e-40, 1e-40  # subnormal
    hi[5] = 448.0 * 6 * 2 ** 20  # past the fp8 block range
    return lo, hi


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("given_amax", [False, True])
def test_op_branch_is_the_torch_branch(name, given_amax):
    spec = SPECS[name]
    lo, hi = _ranges()
    ga = torch.tensor(3.5e6) if given_amax else None
    ours = qparams._block_qparams_op(lo, hi, spec, ga)
    ref = qparams._block_qparams(qparams.amax_of_range(lo.clamp(max=0), hi.clamp(min=0)), spec,
                                 ga)
    assert torch.equal(ours.scale, ref.scale)
    assert torch.equal(ours.zero_point, ref.zero_point)
    assert (ours.global_scale is None) == (ref.global_scale is None)
    if ref.global_scale is not None:
        assert torch.equal(ours.global_scale, ref.global_scale)


@pytest.mark.parametrize("name, op", [("mxfp4", "quantscope.e8m0_block_scales"),
                                      ("nvfp4", "quantscope.nvfp4_block_scales")])
def test_off_the_cpu_qparams_call_the_op(name, op):
    lo, hi = (t.to("meta") for t in _ranges())
    with OpNames() as seen:
        qp = qparams.qparams_from_range(lo, hi, SPECS[name], check_finite=False)
    assert op in seen.names
    assert qp.scale.shape == lo.shape and qp.scale.device.type == "meta"


def test_integer_formats_keep_the_torch_branch_off_the_cpu():
    lo, hi = (t.to("meta") for t in _ranges())
    with OpNames() as seen:
        qparams.qparams_from_range(lo, hi, QuantSpec("int8"), check_finite=False)
    assert not any(n.startswith("quantscope.") for n in seen.names)
