"""Probe s32 (SmoothQuant): a calibration made with ``smooth=`` refuses to export an
unsmoothed model (it wrote unsmoothed weights beside qparams of the smoothed ones, marked
smoothed), and ``apply`` / ``export`` refuse a model smoothed twice (``reapply`` on the model
calibrate had smoothed in place: its quantized outputs were silently far off)."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import transformers

import quantscope
from quantscope.calibration import Outliers, calibrate
from quantscope.calibration.choice.smooth import reapply


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # outlier channels: smoothing moves them
            layer.post_attention_layernorm.weight[[3, 17]] = 50.0
    batches = [torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(i))
               for i in range(2)]
    return cfg, model, batches


def test_export_refuses_an_unsmoothed_model(tmp_path):
    cfg, model, batches = _llama()
    float_model = transformers.LlamaForCausalLM(cfg).eval()
    float_model.load_state_dict(model.state_dict())  # before calibrate smooths `model`
    cal = calibrate(model, batches, "w8a8", outliers=Outliers(smooth=0.8), progress=False)
    for export in (cal.export, lambda m, p: quantscope.export(cal, m, p)):
        with pytest.raises(ValueError, match="^export: .* is not smoothed"):
            export(float_model, tmp_path / "ct")
        assert not (tmp_path / "ct").exists()
    reapply(float_model, cal)  # smoothed once: the export goes through
    cal.export(float_model, tmp_path / "ct")


def test_apply_and_export_refuse_a_model_smoothed_twice(tmp_path):
    _, model, batches = _llama()
    cal = calibrate(model, batches, "w8a8", outliers=Outliers(smooth=0.8), progress=False)
    cal.apply(model).remove()  # smoothed once, in place: accepted
    reapply(model, cal)
    with pytest.raises(ValueError, match="^apply: .* looks smoothed twice"):
        cal.apply(model)
    with pytest.raises(ValueError, match="^export: .* looks smoothed twice"):
        cal.export(model, tmp_path / "ct")
