"""Options combined (probe s29, interactions): Sequential with Auto(metric="fisher") failed
with a misleading "needs dict batches" (the blocks replay hidden states) or torch's raw
"Inference tensors cannot be saved for backward": refused up front, naming both.
Outliers(smooth=...) on a model with no SmoothQuant pair changed nothing without a word:
warned, as keep_float warns of its own no-op."""

import warnings

import pytest
import torch
from torch import nn

import quantscope
from quantscope.calibration import Auto, MoE, Outliers, Sequential, preset

transformers = pytest.importorskip("transformers")


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=256)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("loss", [None, lambda out, batch: out.logits.float().pow(2).mean()])
def test_sequential_with_fisher_is_refused_naming_both(loss):
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 256, (2, 16), generator=g)} for _ in range(2)]
    with pytest.raises(ValueError, match="fisher.*sequential"):
        quantscope.calibrate(_llama(), batches, preset("w8a8", "auto"),
                             auto=Auto(metric="fisher", loss=loss), sequential=Sequential(),
                             progress=False)


def test_smoothing_a_model_with_nothing_to_smooth_says_so():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).eval()
    batches = [torch.randn(8, 32) for _ in range(2)]
    with pytest.warns(UserWarning, match="no pair SmoothQuant smooths"):
        calib = quantscope.calibrate(model, batches, "w8a8", outliers=Outliers(smooth=0.5),
                                     progress=False)
    assert calib.info["smooth"]["smoothed"] == []
    with warnings.catch_warnings(record=True) as seen:  # a model with pairs: no such warning
        warnings.simplefilter("always")
        quantscope.calibrate(_llama(), [{"input_ids": torch.randint(0, 256, (2, 16))}],
                             "w8a8", outliers=Outliers(smooth=0.5), progress=False)
    assert not [w for w in seen if "SmoothQuant smooths" in str(w.message)]


def test_moe_options_on_a_dense_model_say_they_change_nothing():
    model = nn.Sequential(nn.Linear(8, 8))
    batches = [torch.randn(4, 8)]
    with pytest.warns(UserWarning, match=r"MoE\(all_experts=False, min_tokens=4\) changes "
                                         r"nothing"):
        quantscope.calibrate(model, batches, "w8a8", moe=MoE(min_tokens=4), progress=False)
    with warnings.catch_warnings(record=True) as seen:  # the defaults: nothing to say
        warnings.simplefilter("always")
        quantscope.calibrate(model, batches, "w8a8", progress=False)
    assert not [w for w in seen if "MoE(" in str(w.message)]
