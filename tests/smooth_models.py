"""Tiny random models of the architectures SmoothQuant's per-architecture mappings name
(llm-compressor's ``MAPPINGS_REGISTRY``), for the smoothing tests here and in the peers' venv:
norm weights away from 1 and LayerNorm biases away from 0, so a wrong smoothing shows."""

import torch

_HIDDEN = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "vocab_size": 100, "pad_token_id": 0}


def _configs(T) -> dict:
    mlp = {"intermediate_size": 96}
    return {
        "phi3": (T.Phi3ForCausalLM, T.Phi3Config(**_HIDDEN, **mlp, num_key_value_heads=2)),
        "bloom": (T.BloomForCausalLM, T.BloomConfig(hidden_size=64, n_layer=2, n_head=4,
                                                    vocab_size=100)),
        "deepseek_v3": (T.DeepseekV3ForCausalLM, T.DeepseekV3Config(
            **_HIDDEN, **mlp, moe_intermediate_size=32, num_key_value_heads=4, q_lora_rank=32,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
            topk_group=1)),
        "opt": (T.OPTForCausalLM, T.OPTConfig(**_HIDDEN, ffn_dim=96, word_embed_proj_dim=64)),
        "whisper": (T.WhisperForConditionalGeneration, T.WhisperConfig(
            d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, num_mel_bins=16,
            vocab_size=100, max_source_positions=16, max_target_positions=32, pad_token_id=0,
            decoder_start_token_id=1)),
    }


KINDS = ("phi3", "bloom", "deepseek_v3", "opt", "whisper")


def build(kind: str):
    """``(model, batches)``: the model in eval mode and two batches of its inputs."""
    import transformers

    cls, cfg = _configs(transformers)[kind]
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name or "ln" in name) and p.dim() == 1:
                p.copy_(torch.rand_like(p) + 0.5 if name.endswith("weight")
                        else torch.randn_like(p) * 0.3)
    g = torch.Generator().manual_seed(1)
    if kind == "whisper":
        batches = [{"input_features": torch.randn(2, 16, 32, generator=g),
                    "decoder_input_ids": torch.randint(3, 100, (2, 6), generator=g)}
                   for _ in range(2)]
    else:
        batches = [{"input_ids": torch.randint(3, 100, (2, 12), generator=g)} for _ in range(2)]
    return model, batches
