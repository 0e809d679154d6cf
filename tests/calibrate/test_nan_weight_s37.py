"""A NaN / inf a layer's input brings is named at its cause where the model's own parameter
holds it (it blamed the calibration batch: "fix that batch"); a batch's own NaN still is."""

import pytest
import torch
from torch import nn

from quantscope import calibrate


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


@pytest.mark.parametrize("sequential", [False, True])
def test_a_non_finite_weight_is_named_not_the_batch(sequential):
    from tiny_models import llama

    model, batches = llama()
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"layer 'model.layers.1.self_attn.o_proj' input: .*"
                                         r"parameter 'model.layers.1.self_attn.q_proj.weight' "
                                         r"holds NaN or inf"):
        calibrate(model, batches[:1], "w8a8", progress=False, sequential=sequential)


def test_a_batchs_own_nan_is_the_batchs():
    x = torch.randn(4, 8)
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"layer '0' input: calibration batch 0 .*fix that "
                                         r"batch"):
        calibrate(_mlp(), [x], "w8a8", progress=False)
