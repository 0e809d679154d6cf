"""empty_model and the sequential pass from a checkpoint, as a probe found them: buffers left
as uninitialised memory, a task model's head dropped, loaded parameters not requiring grad."""

import os

import pytest
import torch
from torch import nn

import quantscope
from quantscope.calibration import Sequential, empty_model
from quantscope.calibration.run.checkpoint import Checkpoint, load_params

transformers = pytest.importorskip("transformers")


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64))


def _gemma3_vlm():
    text = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=300, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"])
    vision = transformers.SiglipVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        image_size=32, patch_size=8)
    return transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
        image_token_index=299, boi_token_index=297, eoi_token_index=298))


def _bart():
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64,
        max_position_embeddings=32))


def _qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, vocab_size=64))


def _folder(tmp_path, make):
    torch.manual_seed(0)
    make().save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("make", [_llama, _gemma3_vlm, _bart, _qwen3_moe],
                         ids=["llama", "gemma3-vlm", "bart", "qwen3-moe"])
def test_empty_model_is_the_class_and_buffers_from_pretrained_gives(tmp_path, make):
    # the probe: a Gemma3 VLM's SigLIP position_ids were uninitialised memory (only the top
    # model's _init_weights ran), and a *ForConditionalGeneration was built as its base model
    folder = _folder(tmp_path, make)
    skeleton = empty_model(folder)
    ref = type(make()).from_pretrained(folder)
    assert type(skeleton) is type(ref)
    got, want = dict(skeleton.named_buffers()), dict(ref.named_buffers())
    assert sorted(got) == sorted(want)
    for name, b in want.items():
        assert got[name].device.type == "cpu", name
        assert got[name].dtype == b.dtype and torch.equal(got[name], b), name
    assert all(p.device.type == "meta" for p in skeleton.parameters())


def test_empty_model_refuses_a_buffer_its_initializer_leaves_unset(tmp_path, monkeypatch):
    folder = _folder(tmp_path, _llama)
    monkeypatch.setattr(transformers.LlamaPreTrainedModel, "_init_weights",
                        lambda self, module: None)  # sets no rotary table
    with pytest.raises(ValueError, match=r"empty_model: .*initializer of LlamaForCausalLM "
                                         r"leaves the buffers \['model\.rotary_emb\.inv_freq'"):
        empty_model(folder)


def test_empty_model_refuses_an_unknown_task(tmp_path):
    folder = _folder(tmp_path, _bart)
    with pytest.raises(ValueError, match=r"^empty_model: task must be one of \('causal-lm', "
                                         r"'embedding'\).*got 'seq2seq'$"):
        empty_model(folder, task="seq2seq")
    assert type(empty_model(folder, task="embedding")) is transformers.BartModel


def test_sequential_bart_gives_the_whole_task_models_states(tmp_path):
    folder = _folder(tmp_path, _bart)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "decoder_input_ids": ids[:, :4]}]
    model = transformers.BartForConditionalGeneration.from_pretrained(folder).eval()
    whole = quantscope.calibrate(model, batches, "w8a8", progress=False)
    seq = quantscope.calibrate(empty_model(folder), batches, "w8a8", progress=False,
                               sequential=Sequential(checkpoint=folder))
    assert "lm_head" in seq.states and sorted(seq.states) == sorted(whole.states)
    _assert_same_states(whole, seq)
    seq.apply(model).remove()  # the checkpoint's model takes it


def test_sequential_gemma3_vlm_is_the_whole_pass_bit_for_bit(tmp_path):
    # garbage SigLIP position_ids (an IndexError), and its pooling head's MultiheadAttention
    # 1 ulp off the whole pass (loaded parameters not requiring grad)
    folder = _folder(tmp_path, _gemma3_vlm)
    ids = torch.randint(0, 290, (2, 12), generator=torch.Generator().manual_seed(1))
    ids[:, 2:6] = 299
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator()),
                "token_type_ids": (ids == 299).long()}]
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder).eval()
    whole = quantscope.calibrate(model, batches, "w8a8", progress=False)
    seq = quantscope.calibrate(empty_model(folder), batches, "w8a8", progress=False,
                               sequential=Sequential(checkpoint=folder))
    assert sorted(seq.states) == sorted(whole.states)
    _assert_same_states(whole, seq)


def _assert_same_states(whole, seq):
    for layer, roles in whole.states.items():
        for role, state in roles.items():
            if state.qparams is not None:
                assert torch.equal(state.qparams.scale,
                                   seq.states[layer][role].qparams.scale), (layer, role)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.fc = nn.Linear(64, 64)

    def forward(self, h):  # query is not key: torch's kernel follows requires_grad
        return h + self.fc(self.attn(h * 0.5, h, h)[0])


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 64)
        self.layers = nn.ModuleList(_Block() for _ in range(2))
        self.out = nn.Linear(64, 4)

    def forward(self, x):
        h = self.inp(x)
        for block in self.layers:
            h = block(h)
        return self.out(h)


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_sequential_multihead_attention_is_the_whole_pass_bit_for_bit(tmp_path, seed):
    # loaded parameters were made requires_grad=False: another MultiheadAttention kernel,
    # 1 ulp off the whole-model pass
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = _Net().eval()
    file = os.fspath(tmp_path / "model.safetensors")
    save_file(model.state_dict(), file)
    with torch.device("meta"):
        skeleton = _Net().eval()
    batches = [torch.randn(2, 16, 4)]
    whole = quantscope.calibrate(model, batches, "w8a8", progress=False)
    seq = quantscope.calibrate(skeleton, batches, "w8a8", progress=False,
                               sequential=Sequential(checkpoint=file))
    _assert_same_states(whole, seq)


def test_load_params_keeps_the_skeletons_requires_grad(tmp_path):
    from safetensors.torch import save_file

    save_file(nn.Linear(4, 4).state_dict(), tmp_path / "model.safetensors")
    with torch.device("meta"):
        skeleton = nn.Linear(4, 4)
    skeleton.bias.requires_grad_(False)
    replaced = load_params(skeleton, {"weight", "bias"}, Checkpoint(tmp_path), "cpu")
    assert skeleton.weight.requires_grad and not skeleton.bias.requires_grad
    assert set(replaced) == {"weight", "bias"}
