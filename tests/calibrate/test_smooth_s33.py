"""SmoothQuant on the architectures llm-compressor smooths under their own names (session
33): Phi-3's fused ``qkv_proj`` / ``gate_up_proj``, BLOOM's ``query_key_value`` /
``dense_h_to_4h``, DeepSeek-V3's ``q_a_proj`` / ``kv_a_proj_with_mqa``, and the
``self_attn_layer_norm`` / ``final_layer_norm`` of Whisper and OPT were matched by no mapping:
each got a "no pair SmoothQuant smooths" warning and no smoothing."""

import pytest
import torch
from smooth_models import KINDS, build

from quantscope.calibration.choice.smooth import smooth

pytest.importorskip("transformers")

#: the smoothed modules of layer ``{i}`` (both layers of each stack), from the modeling code
SMOOTHED = {
    "phi3": ["model.layers.{i}.input_layernorm", "model.layers.{i}.post_attention_layernorm"],
    "bloom": ["transformer.h.{i}.input_layernorm", "transformer.h.{i}.post_attention_layernorm"],
    # layer 0 is dense (first_k_dense_replace=1): its MLP's default mappings too
    "deepseek_v3": ["model.layers.{i}.input_layernorm"],
    "opt": ["model.decoder.layers.{i}.self_attn_layer_norm",
            "model.decoder.layers.{i}.final_layer_norm"],
    "whisper": [f"model.{s}.layers.{{i}}.{n}" for s in ("encoder", "decoder")
                for n in ("self_attn_layer_norm", "final_layer_norm")],
}
_DENSE_DEEPSEEK = ["model.layers.0.post_attention_layernorm", "model.layers.0.mlp.up_proj"]


def _logits(model, batches):
    with torch.no_grad():
        return torch.cat([model(**b).logits for b in batches])


@pytest.mark.parametrize("kind", KINDS)
def test_each_architectures_norms_are_smoothed_and_the_function_kept(kind):
    model, batches = build(kind)
    ref = _logits(model, batches)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    info = smooth(model, batches[:1], 0.5)
    want = {n.format(i=i) for n in SMOOTHED[kind] for i in (0, 1)}
    want |= set(_DENSE_DEEPSEEK) if kind == "deepseek_v3" else set()
    assert set(info["smoothed"]) == want and not info["skipped"], info
    torch.testing.assert_close(_logits(model, batches), ref, rtol=1e-5, atol=1e-5)
    for n in want - {"model.layers.0.mlp.up_proj"}:  # each norm's weight (and bias) / scales
        for p in ("weight", "bias"):
            if f"{n}.{p}" in before:
                got = model.get_parameter(f"{n}.{p}").detach()
                assert torch.equal(got, before[f"{n}.{p}"] / info["scales"][n]), (n, p)
