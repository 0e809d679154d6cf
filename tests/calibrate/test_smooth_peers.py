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


@pytest.mark.parametrize("kind, arch", [
    ("phi3", "Phi3ForCausalLM"), ("bloom", "BloomForCausalLM"),
    ("deepseek_v3", "DeepseekV3ForCausalLM"), ("whisper", "WhisperForConditionalGeneration")])
def test_the_norms_llmcompressor_smooths_are_found_with_its_balance_layers(kind, arch):
    """Every mapping llm-compressor resolves from its registry's entry for the architecture
    is one quantscope finds, with the same balance layers, but one: in Whisper's decoder
    llm-compressor also balances ``self_attn_layer_norm`` into ``encoder_attn``'s q / k / v
    (its ``.*q_proj`` regexes match them), which read the encoder's output and
    ``encoder_attn_layer_norm``'s, not that norm's: scaling their columns would change the
    function, and quantscope's mapping leaves them out."""
    from llmcompressor.modifiers.transform.smoothquant.utils import MAPPINGS_REGISTRY
    from smooth_models import build

    from quantscope.calibration.choice.smooth import find_mappings

    model, _ = build(kind)
    names = {m: n for n, m in model.named_modules()}
    resolved = SmoothQuantModifier(mappings=MAPPINGS_REGISTRY[arch])._resolve_mappings(model)
    theirs = {r.smooth_name: {names[b] for b in r.balance_layers} for r in resolved}
    cross = {s: {b for b in bs if ".encoder_attn." in b} for s, bs in theirs.items()}
    assert any(cross.values()) == (kind == "whisper")
    ours = {m.previous: set(m.balance) for m in find_mappings(model)}
    assert theirs and {s: ours.get(s) for s in theirs} == {
        s: bs - cross[s] for s, bs in theirs.items()}
