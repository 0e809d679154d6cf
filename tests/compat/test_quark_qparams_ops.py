"""compat.quark's ``_calculate_qparams`` on the CPU: the native qparams made in Quark's shape
(per tensor, per channel, groups / blocks along the last axis), no view, no tensor of
constants, and a signed symmetric format's zero point the native's zeros (an unsigned one's
and one of groups off the last axis: zeros of Quark's, in the scale's shape); the same values as
pricing its ``(min_val, max_val)`` (Quark's ``calculate_qparams(min_val, max_val)``, whose
path reshapes nothing). The code before made a constants tensor, three or four views and a
zeros tensor per call. No Quark needed (dict qspecs)."""

from __future__ import annotations

import pytest
import torch
from op_names import OpNames

from quantscope import kernels
from quantscope.compat import quark

pytestmark = pytest.mark.skipif(not kernels.available("int_qparams"), reason="no kernel")

INT = [("PerTensorMinMaxObserver", {"dtype": "int8"}),
       ("PerChannelMinMaxObserver", {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0}),
       ("PerGroupMinMaxObserver", {"dtype": "int4", "qscheme": "per_group", "ch_axis": -1,
                                   "group_size": 32})]
OTHERS = [("PerTensorMinMaxObserver", {"dtype": "uint8", "symmetric": False}),
          ("PerTensorMinMaxObserver", {"dtype": "uint8"}),
          ("PerChannelMinMaxObserver", {"dtype": "int4", "qscheme": "per_channel",
                                        "ch_axis": 1, "symmetric": False}),
          ("PerGroupMinMaxObserver", {"dtype": "uint4", "qscheme": "per_group", "ch_axis": 0,
                                      "group_size": 4, "symmetric": False}),
          ("PerTensorMinMaxObserver", {"dtype": "int8", "scale_type": "float16"})]


def _observed(name, qspec, x):
    obs = getattr(quark, name)(qspec)
    obs(x)
    return obs


@pytest.mark.parametrize(("name", "qspec"), INT, ids=[n for n, _ in INT])
def test_signed_symmetric_qparams_are_the_kernels_outputs(name, qspec):
    obs = _observed(name, qspec, torch.randn(8, 64))
    obs._calculate_qparams()
    with OpNames() as mode:
        scale, zp = obs._calculate_qparams()
    # the flag and count read back (check_ready), then the kernel's two outputs
    assert mode.order == ["aten._local_scalar_dense.default"] * 2 + ["aten.empty.memory_format"] * 2
    assert zp.dtype == torch.int32 and not bool(zp.any()) and zp.shape == scale.shape


@pytest.mark.parametrize(("name", "qspec"), INT + OTHERS, ids=[n for n, _ in INT + OTHERS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(8, 64), (4, 8, 32)], ids=str)
def test_the_same_values_as_pricing_the_range(name, qspec, dtype, shape):
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    obs = _observed(name, qspec, x)
    got = obs._calculate_qparams()
    want = obs.calculate_qparams(obs.min_val, obs.max_val)
    if name == "PerGroupMinMaxObserver":  # Quark's given range comes back (-1, group_count)
        want = tuple(t.reshape(got[0].shape) for t in want)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


SYMMETRIC = [  # (class, qspec, batch shape, Quark's qparams shape: Quark 0.13's, peers venv)
    ("PerTensorMinMaxObserver", {"dtype": "uint8"}, (8, 64), ()),
    ("PerTensorMinMaxObserver", {"dtype": "uint8", "is_dynamic": True}, (8, 64), ()),
    ("PerChannelMinMaxObserver", {"dtype": "uint8", "qscheme": "per_channel", "ch_axis": 0},
     (8, 64), (8,)),
    ("PerGroupMinMaxObserver", {"dtype": "uint4", "qscheme": "per_group", "ch_axis": -1,
                                "group_size": 32}, (8, 64), (8, 2)),
    # groups along an inner axis of a 3-D batch: Quark's (rows, groups), not the layout's
    ("PerGroupMinMaxObserver", {"dtype": "int4", "qscheme": "per_group", "ch_axis": 1,
                                "group_size": 32}, (4, 64, 8), (32, 2)),
    ("PerGroupMinMaxObserver", {"dtype": "int8", "qscheme": "per_group", "ch_axis": 0,
                                "group_size": 16, "is_dynamic": True}, (64, 4, 8), (32, 4))]


@pytest.mark.parametrize(("name", "qspec", "shape", "want"), SYMMETRIC,
                         ids=[f"{n}-{q['dtype']}-{s}{'-dynamic' * q.get('is_dynamic', 0)}"
                              for n, q, s, _ in SYMMETRIC])
def test_a_symmetric_zero_point_is_zeros_in_the_scales_shape(name, qspec, shape, want):
    """Quark's symmetric zero point is 0 for unsigned formats too (not the native mid code,
    128 / 8), and has the scale's shape, Quark's, where groups lie off the last axis (not
    the layout's order of the native qparams)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    scale, zp = _observed(name, {**qspec, "symmetric": True}, x)._calculate_qparams()
    assert tuple(scale.shape) == tuple(zp.shape) == want
    assert zp.dtype == torch.int32 and not bool(zp.any())
