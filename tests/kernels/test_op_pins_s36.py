"""Pins found by mutation (s36): the integer ops' code range must hold at least two codes."""

from __future__ import annotations

import pytest
import torch

from quantscope.kernels import ops

DEVICES = ["cpu", "meta"]  # meta: the fake implementation, as torch.compile traces it
# one code (qmin == qmax) gives a zero-width grid; qmin > qmax an inverted one: neither is a
# format, and both used to reach the kernels (torch.clamp with min > max returns max)
EMPTY_RANGES = [(3.0, 3.0), (-8.0, -8.0), (7.0, -8.0), (4.0, 3.0)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("qmin", "qmax"), EMPTY_RANGES)
def test_fake_quant_int_refuses_a_range_without_two_codes(device, qmin, qmax, forbid_host_sync):
    units = torch.randn(4, 8).to(device)
    scale, zp = torch.ones(4, device=device), torch.zeros(4, device=device)
    forbid_host_sync()
    with pytest.raises(ValueError, match=r"quantscope::fake_quant_int: qmin must be below qmax"):
        ops.fake_quant_int(units, scale, zp, qmin, qmax)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("qmin", "qmax"), EMPTY_RANGES)
def test_mse_price_int_refuses_a_range_without_two_codes(device, qmin, qmax, forbid_host_sync):
    units = torch.randn(4, 8).to(device)
    scale = torch.ones(2, 4, device=device)
    zp = torch.zeros(2, 4, dtype=torch.int32, device=device)
    forbid_host_sync()
    with pytest.raises(ValueError, match=r"quantscope::mse_price_int: qmin must be below qmax"):
        ops.mse_price_int(units, scale, zp, qmin, qmax)


def test_the_narrowest_range_two_codes_stays_accepted():
    """qmin one below qmax is a format (1-bit, {0, 1}): the check refuses no more than it must."""
    units = torch.tensor([[2.0, -2.0, 0.4, 0.6]])
    out = ops.fake_quant_int(units, torch.ones(1), torch.zeros(1), 0.0, 1.0)
    assert out.tolist() == [[1.0, 0.0, 0.0, 1.0]]
    err = ops.mse_price_int(units, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32),
                            0.0, 1.0)
    assert err.shape == (1, 1)
