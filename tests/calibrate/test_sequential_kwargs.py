"""Sequential calibration replays each block's own arguments (Gemma's sliding-window and
full-attention layers take different masks), never the KV cache, and reads a checkpoint
folder as transformers does (its shard index; the base model's prefix added or removed)."""

import pytest
import torch
import transformers
from calib_checks import assert_same_qparams
from safetensors.torch import load_file, save_file
from torch import nn

from quantscope.calibration import Sequential, calibrate, empty_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _ids(n=2, tokens=12):
    return [torch.randint(0, 100, (2, tokens), generator=torch.Generator().manual_seed(i))
            for i in range(n)]


def _gemma(kind):
    torch.manual_seed(0)
    common = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 100, "sliding_window": 4, "max_position_embeddings": 64}
    if kind == "gemma2":
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common)).eval()
    cfg = transformers.Gemma3TextConfig(**common,
                                        layer_types=["sliding_attention", "full_attention"])
    return transformers.Gemma3ForCausalLM(cfg).eval()


def _llama(layers=3, tied=True, cls=transformers.LlamaForCausalLM):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100,
                                   tie_word_embeddings=tied)
    return cls(cfg).eval()


# ---------------------------------------------------------------- each block's arguments
@pytest.mark.parametrize("budget", [0, 64])
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_alternating_attention_layers_get_their_own_masks(kind, budget):
    """A window of 4 over 12 tokens: the sliding layer's mask differs from the full layer's
    (Gemma3: its rotary tables too); each block must see its own, cached or spilled."""
    model = _gemma(kind)
    whole = calibrate(model, _ids(), "w8a8", progress=False)
    seq = calibrate(model, _ids(), "w8a8", progress=False,
                    sequential=Sequential(cache_budget_mb=budget))
    assert_same_qparams(seq, whole)


class _Opts:
    """An object of the model's own among a block's arguments (not a tensor)."""

    def __init__(self, shift):
        self.shift = shift


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h, gain, bias=None, opts=None):
        return torch.relu(self.fc(h) * gain + bias + opts.shift)


class _Net(nn.Module):
    """Blocks each called with a gain (positional), a bias and an object of their own."""

    def __init__(self, n=3):
        super().__init__()
        self.embed, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.layers = nn.ModuleList(_Block() for _ in range(n))

    def forward(self, x):
        h = self.embed(x)
        gains = torch.linspace(0.5, 2.0, len(self.layers))
        for j, block in enumerate(self.layers):
            h = block(h, gains[j], bias=torch.full((16,), 0.1 * j), opts=_Opts(float(j)))
        return self.head(h)


@pytest.mark.parametrize("budget", [0, 64])
def test_each_block_gets_its_own_positional_and_keyword_arguments(budget):
    torch.manual_seed(0)
    model = _Net().eval()
    batches = [torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    whole = calibrate(model, batches, "w8a8", progress=False)
    seq = calibrate(model, batches, "w8a8", progress=False,
                    sequential=Sequential(cache_budget_mb=budget))
    assert_same_qparams(seq, whole)


def test_a_block_output_passed_as_an_argument_is_refused():
    class Block(nn.Linear):
        def forward(self, h, skip=None):
            return super().forward(h) + skip

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block(8, 8) for _ in range(3))

        def forward(self, x):
            h = skip = x
            for block in self.layers:
                h, skip = block(h, skip=skip), h
            return h

    with pytest.raises(ValueError, match=r"output of block layers\.0 is read elsewhere"):
        calibrate(Net().eval(), [torch.randn(2, 8)], "w8a8", progress=False, sequential=True)


# ---------------------------------------------------------------- the KV cache
@pytest.mark.parametrize("how", [{"sequential": "quantized"},
                                 {"sequential": True, "observer": "auto"},
                                 {"sequential": Sequential(cache_budget_mb=0)}],
                         ids=["quantized", "auto", "spilled"])
def test_the_kv_cache_is_not_replayed(how):
    """Batches asking for the cache (use_cache=True): transformers 5 hands each layer a
    DynamicCache as ``cache=``; a block run twice on a batch would attend over the keys its
    first run left there, and a spilled cache is no tensor to read back. The whole-model pass
    does not depend on it, nor may the sequential one."""
    model = _llama()
    plain = [{"input_ids": x} for x in _ids(tokens=8)]
    cached = [{"input_ids": x, "use_cache": True} for x in _ids(tokens=8)]
    assert_same_qparams(calibrate(model, cached, "w8a8", progress=False),
          calibrate(model, plain, "w8a8", progress=False))
    assert_same_qparams(calibrate(model, cached, "w8a8", progress=False, **how),
          calibrate(model, plain, "w8a8", progress=False, **how))


# ---------------------------------------------------------------- the checkpoint's files
def test_the_shard_index_says_which_files_hold_the_model(tmp_path):
    """A stale ``old.safetensors`` with the same names beside an indexed sharded checkpoint:
    transformers reads the files the index names, and so must the sequential pass."""
    model = _llama(layers=2, tied=False)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    stale = {k: v * 0.5 for f in tmp_path.glob("model-*.safetensors")
             for k, v in load_file(f).items()}
    save_file(stale, tmp_path / "old.safetensors", metadata={"format": "pt"})
    whole = calibrate(transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval(),
                      _ids(tokens=8), "w8a8", progress=False)
    seq = calibrate(empty_model(tmp_path), _ids(tokens=8), "w8a8", progress=False,
                    sequential=Sequential(checkpoint=tmp_path))
    assert_same_qparams(seq, whole)


def test_a_tensor_in_two_unindexed_files_is_refused(tmp_path):
    model = _llama(layers=2)
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({k: v * 0.5 for k, v in tensors.items()}, tmp_path / "old.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"is in both .*model\.safetensors.* and "
                                         r".*old\.safetensors"):
        calibrate(empty_model(tmp_path), _ids(tokens=8), "w8a8", progress=False,
                  sequential=Sequential(checkpoint=tmp_path))


def test_base_model_from_a_task_models_checkpoint(tmp_path):
    """A saved BertForSequenceClassification (``bert.embeddings...``) read as BertModel
    (``embeddings...``, ``task="embedding"``), as ``AutoModel.from_pretrained`` reads it: the
    prefix is removed."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=2, vocab_size=100)
    transformers.BertForSequenceClassification(cfg).eval().save_pretrained(tmp_path)
    whole = calibrate(transformers.AutoModel.from_pretrained(tmp_path).eval(),
                      _ids(tokens=8), "w8a8", progress=False)
    skeleton = empty_model(tmp_path, task="embedding")
    assert type(skeleton).__name__ == "BertModel"
    seq = calibrate(skeleton, _ids(tokens=8), "w8a8", progress=False,
                    sequential=Sequential(checkpoint=tmp_path))
    assert_same_qparams(seq, whole)


def test_task_model_from_a_base_models_checkpoint(tmp_path):
    """The reverse: a saved LlamaModel (``layers.0...``) read as LlamaForCausalLM
    (``model.layers.0...``; its head tied to the embeddings): the prefix is added."""
    _llama(layers=2, cls=transformers.LlamaModel).save_pretrained(tmp_path)
    whole = calibrate(transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval(),
                      _ids(tokens=8), "w8a8", progress=False)
    seq = calibrate(empty_model(tmp_path, task="causal-lm"), _ids(tokens=8), "w8a8",
                    progress=False, sequential=Sequential(checkpoint=tmp_path))
    assert_same_qparams(seq, whole)
