"""A bf16 / fp16 model's compressed-tensors export holds the codes quantscope's QDQ computes
with the scales it wrote (found by probing: compressed-tensors divided a bf16 weight by a bf16
scale in bf16, so 9 % of the int8 codes were one off ``round(w / s)`` and the checkpoint no
longer ran as ``apply(float_model)``); the scales are still written in the model's dtype."""

import warnings

import pytest
import torch

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

import quantscope
from quantscope.calibration import Calibration, calibrate

torch.set_num_threads(1)


def _model(dtype):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval().to(dtype)
    g = torch.Generator().manual_seed(1)
    return model, [torch.randint(0, 128, (2, 16), generator=g) for _ in range(2)]


@pytest.mark.parametrize("scheme", ["w8a8", "w4a16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_model_checkpoint_codes_are_quantscopes_qdq(scheme, dtype, tmp_path):
    model, batches = _model(dtype)
    cal = calibrate(model, batches, scheme, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the scales rounded to the model's dtype (lossy)
        path = quantscope.export(cal, model, tmp_path / "ct", allow_lossy=True)
        deployed = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        deployed.hf_quantizer.compressor.decompress_model(deployed)
    back = Calibration.from_compressed_tensors(path)
    stored = safetensors.load_file(f"{path}/model.safetensors")
    differ = 0
    for layer, roles in back.states.items():
        state = roles["weight"]
        assert stored[f"{layer}.weight_scale"].dtype == dtype  # written as before
        w = model.get_submodule(layer).weight.detach()
        qdq = quantscope.fake_quantize(w, state.qparams, state.spec)
        differ += int((qdq != deployed.get_submodule(layer).weight.detach()).sum())
    assert differ == 0
