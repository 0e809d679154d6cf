"""Pins from the s63 mutation round over ``estimators/mse_ops`` (the MSE search as
``quantscope::`` ops): behaviour no earlier test held, checked against the module's rules."""

import pytest
import torch

from quantscope import QuantSpec, kernels
from quantscope.estimators import mse_search
from quantscope.layout import Channel

pytestmark = pytest.mark.skipif(not kernels.available("mse_search"),
                                reason="no C compiler (or QUANTSCOPE_NO_KERNEL): the ops run "
                                       "the C kernel on the CPU")


def test_compat_search_priced_past_float32_keeps_the_first_candidate():
    """llm-compressor's search starts each unit's best error at float32's max (``_FLT_MAX``):
    units whose every candidate costs more (values near 1e19: squares past 3.4e38) keep the
    first candidate, the min-max range, as torch's float32 sums (all inf) keep it; an
    infinite start would let the float64 prices pick a shrunk range."""
    g = torch.Generator().manual_seed(0)
    u = torch.randn(4, 64, generator=g)
    u[:, 0] = 8.0
    u = u * 1e19
    spec = QuantSpec("int4", Channel(0))
    got = mse_search(u, None, None, spec, backend="ops", compat="llmcompressor")
    assert torch.equal(got.lo, u.amin(1)) and torch.equal(got.hi, u.amax(1))
    assert got.index.tolist() == [-1] * 4
    ref = mse_search(u, None, None, spec, backend="torch", compat="llmcompressor")
    assert torch.equal(got.lo, ref.lo) and torch.equal(got.hi, ref.hi)


@pytest.mark.parametrize(("seed", "patience"), [(4, 2), (16, 2), (26, 1)])
def test_a_zero_point_change_under_an_equal_pow2_scale_is_no_plateau(seed, patience):
    """A plateau (``same``) is a candidate whose *encoded qparams* equal the previous one's,
    scale and zero point (``mse_tiles._State``: it is no evidence for patience). Under pow2
    scales an asymmetric spec's candidates often keep the scale while the zero point moves:
    those count toward patience, and the ops choose what the C engine and the torch tiles
    choose."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(6, 32, generator=g) * torch.rand(6, 1, generator=g).add_(0.1)
         + torch.randn(6, 1, generator=g))
    w[seed % 6, seed % 32] *= 6
    spec = QuantSpec("uint3", Channel(0), symmetric=False, scale="pow2:round")
    u = spec.layout.to_units(w).contiguous()
    ours = mse_search(u, None, None, spec, backend="ops", patience=patience)
    for backend in ("kernel", "torch"):
        ref = mse_search(u, None, None, spec, backend=backend, patience=patience)
        for name in ("lo", "hi", "error", "index"):
            assert torch.equal(getattr(ours, name), getattr(ref, name)), (backend, name)
