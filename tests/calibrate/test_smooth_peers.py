"""SmoothQuant's scales against llm-compressor's own (its ``SmoothQuantModifier``), in the
peers' venv: the same ``smoothing_strength`` gives the same scales."""

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.peers

pytest.importorskip("llmcompressor")
from llmcompressor.modifiers.transform.smoothquant.base import (
    MINIMUM_SMOOTHING_SCALE,
    SmoothQuantModifier,
)

from quantscope.calibration.choice.smooth import MIN_SCALE, smoothing_scales


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.8, 1.0])
def test_scales_are_llmcompressors(alpha):
    g = torch.Generator().manual_seed(int(alpha * 10))
    layers = [nn.Linear(48, n) for n in (16, 32, 8)]
    with torch.no_grad():
        for lin in layers:
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g))
        layers[1].weight[:, 7] *= 30  # an outlier column
        for lin in layers:
            lin.weight[:, 11] = 0  # an all-zero column: llm-compressor keeps the range
    ranges = torch.rand(48, generator=g) * 4
    ranges[[2, 5]] = 300.0
    ranges[9] = 0.0
    theirs = SmoothQuantModifier(smoothing_strength=alpha)._calculate_smoothing_scales(
        layers, ranges)
    theirs = torch.maximum(theirs, torch.tensor([MINIMUM_SMOOTHING_SCALE]))
    assert MIN_SCALE == MINIMUM_SMOOTHING_SCALE
    assert torch.equal(smoothing_scales(ranges, [lin.weight for lin in layers], alpha), theirs)
