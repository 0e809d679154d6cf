"""compat.quark's asymmetric MSE search refuses negative top ends with a message that names
both causes (probing: data spanning zero whose grid grew wide was told it was all negative)."""

import pytest
import torch

from quantscope.compat import quark


def test_a_grown_grid_is_named_as_the_cause():
    g = torch.Generator().manual_seed(0)
    obs = quark.PerTensorMSEObserver({"dtype": "fp8_e4m3", "symmetric": False})
    for i in range(3):  # a range that grows batch by batch, on both sides of zero
        obs((torch.randn(16, 64, generator=g) * (1 + 4 * i)).to(torch.bfloat16))
    with pytest.raises(ValueError, match="grid grew wider than start_bin bins below zero"):
        obs._calculate_qparams()
