"""llm-compressor's own NVFP4 checkpoints: `quantscope check` passes one (llm-compressor
shares the global scales of q/k/v and gate/up) and flags it once one shard's scale is
edited; the reader reads a bf16 model's back."""

import json

import pytest
import torch

pytestmark = pytest.mark.peers


def _llmcompressor_nvfp4(tmp_path, dtype=torch.float32, hidden=64, layers=2, edit=None):
    """A tiny Llama (``edit(model)`` first) calibrated NVFP4 by llm-compressor's oneshot and
    saved compressed; returns the folder."""
    pytest.importorskip("llmcompressor")
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from tiny_models import tokenizer as _tokenizer  # a word-level tokenizer built in place
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _tokenizer(pad=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok))
    model = LlamaForCausalLM(cfg).to(dtype)
    if edit is not None:
        with torch.no_grad():
            edit(model)
    src = tmp_path / "float"  # llm-compressor reads the model's config back from its path
    model.save_pretrained(src)
    tok.save_pretrained(src)
    model = LlamaForCausalLM.from_pretrained(src, dtype=dtype)
    ids = torch.randint(0, len(tok), (4, 16))
    data = [{"input_ids": r.tolist(), "attention_mask": [1] * 16} for r in ids]
    oneshot(model=model, processor=tok, dataset=Dataset.from_list(data),
            recipe=QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head"]),
            num_calibration_samples=4, max_seq_length=16)
    out = tmp_path / "nvfp4"
    model.save_pretrained(out, save_compressed=True)
    assert json.loads((out / "config.json").read_text())["quantization_config"]
    return out


def test_llmcompressor_nvfp4_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    from quantscope.exporters import check

    out = _llmcompressor_nvfp4(tmp_path, edit=lambda m: m.model.layers[0].self_attn.k_proj
                               .weight.mul_(3.0))
    assert check(out) == []
    # edit one shard's global scale apart: now flagged, naming the layers
    f = next(out.glob("*.safetensors"))
    t = load_file(str(f))
    key = "model.layers.0.self_attn.k_proj.weight_global_scale"
    t[key] = t[key] * 2
    save_file(t, str(f), metadata={"format": "pt"})
    problems = check(out)
    assert [(p["group"], p["tensor"]) for p in problems] == [
        ("model.layers.0.self_attn.qkv_proj", "weight_global_scale")]


def test_llmcompressor_nvfp4_checkpoint_of_a_bf16_model_reads_back(tmp_path):
    # llm-compressor computes a bf16 model's input global scales in bf16: 620.0 is no value
    # 448 * 6 / amax takes in float32 for any amax, and the reader raised. It now reads the
    # nearest (one float32 ulp off) and says so.
    import warnings

    from safetensors.torch import load_file

    from quantscope.calibration import Calibration
    from quantscope.scales import nvfp4_global_scale

    out = _llmcompressor_nvfp4(tmp_path, torch.bfloat16, hidden=128, layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = Calibration.from_compressed_tensors(out)
    stored = load_file(next(out.glob("*.safetensors")))
    assert len(back.states) == 7
    for layer, roles in back.states.items():
        want = stored[f"{layer}.input_global_scale"].float().reshape(())
        got = nvfp4_global_scale(roles["input"].global_amax, roles["input"].spec.format)
        assert abs(float(got - want)) <= float(torch.nextafter(want, want * 2) - want), layer
