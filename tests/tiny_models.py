"""Small models built in place for tests that span packages (no download, no real weights):
a word-level tokenizer, random-weight BERT (with MiniLM's tokenizer) and Llama folders, a
Llama in memory, a random-weight Mixtral whose routers starve one expert, a layer whose
output is NaN on a finite input, and a Linear called twice (calibrated: ``twice_calibrated``)."""

import math

import torch

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "and", "ran", "far", "away", "home",
         "fast", "slow", "big", "small"]
STARVED = 3  # mixtral(): the router never picks this expert (in every layer)


def tokenizer(pad: bool):
    """A word-level fast tokenizer; ``pad=False`` gives one without a padding token."""
    import transformers
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tm

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *WORDS])}
    tok = Tokenizer(tm.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    kw = {"pad_token": "</s>"} if pad else {}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                eos_token="</s>", **kw)


def bert_folder(path, **config):
    """A saved random-weight BERT (1 layer of width 32 unless ``config`` says otherwise) with
    the demo MiniLM's tokenizer files, as ``--model`` takes it; skips the test where
    transformers or the demo model is missing."""
    import shutil

    import pytest

    transformers = pytest.importorskip("transformers")
    from quantscope.demo import models

    try:
        src = models.default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    config = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, **config}
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(**config)).save_pretrained(path)
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / f, path / f)
    return path


def llama_folder(path, **config):
    """A saved random-weight Llama (2 layers of width 64 unless ``config`` says otherwise)
    with :func:`tokenizer` (no padding token), as ``--model`` takes it; returns ``path``."""
    import transformers

    torch.manual_seed(0)
    tok = tokenizer(pad=False)
    config = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, **config}
    cfg = transformers.LlamaConfig(vocab_size=len(tok), **config)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def require_lee_corpus():
    """Skip the calling test module where gensim's test data (the Lee corpus, the demo's
    evaluation text) is not installed; call at module level."""
    import pytest

    data = pytest.importorskip("quantscope.demo.data")
    try:
        data.test_data_dir()
    except FileNotFoundError:
        pytest.skip("gensim's test data (the Lee corpus) is not installed",
                    allow_module_level=True)


def starve(router, expert=STARVED):
    """Re-route as transformers' TopK router does, with ``expert``'s logit at -inf."""
    def hook(mod, args, out):
        logits = out[0].clone()
        logits[:, expert] = -math.inf
        probs = torch.softmax(logits.float(), -1)
        top, idx = torch.topk(probs, mod.top_k, -1)
        return out[0], top / top.sum(-1, keepdim=True), idx
    return router.register_forward_hook(hook)


class Sqrt(torch.nn.Module):
    """The square root of its input: NaN where that is negative, so that a finite batch makes
    a model's float output NaN (the batch's fault, not a loss's or a quantizer's)."""

    def forward(self, x):
        return x.sqrt()


class SharedInput(torch.nn.Module):
    """q and k reading one input: a fusion group (one runtime input scale), q its lead."""

    def __init__(self, width=16, out=8, bias=True):
        super().__init__()
        self.q = torch.nn.Linear(width, out, bias=bias)
        self.k = torch.nn.Linear(width, out, bias=bias)

    def forward(self, x):
        return self.q(x) + self.k(x)


class LinearTwice(torch.nn.Module):
    """A Linear called twice, then another: in an ONNX export its codes feed two
    DequantizeLinear nodes."""

    def __init__(self, width=64, out=32):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, out)

    def forward(self, x):
        return self.b(torch.relu(self.a(torch.relu(self.a(x)))))


def twice_calibrated(seed=0):
    """``(LinearTwice, its w8a8 calibration on 3 batches, an input)``, all from ``seed``."""
    from quantscope import calibrate

    torch.manual_seed(seed)
    model = LinearTwice().eval()
    g = torch.Generator().manual_seed(seed)
    calib = calibrate(model, [torch.randn(3, 64, generator=g) for _ in range(3)], "w8a8",
                      progress=False)
    return model, calib, torch.randn(3, 64, generator=g)


def llama(seed=0):
    """A 2-layer Llama (hidden 64, GQA: 2 key / value heads), in memory; 3 batches."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=100)
    model = transformers.LlamaForCausalLM(cfg).eval()
    batches = [torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    return model, batches


def mixtral(seed=0):
    """A 2-layer Mixtral (4 experts, top-2) whose expert ``STARVED`` gets no token; 3 batches."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=100, num_local_experts=4, num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(cfg).eval()
    for layer in model.model.layers:
        starve(layer.mlp.gate)
    batches = [torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    return model, batches


def qwen2_moe(seed=0):
    """A 2-layer Qwen2-MoE (4 experts, top-2, a shared expert); 3 batches."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2MoeConfig(hidden_size=64, intermediate_size=128,
                                      moe_intermediate_size=64, shared_expert_intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, num_experts=4,
                                      num_experts_per_tok=2, decoder_sparse_step=1)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    batches = [torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    return model, batches


def qwen3_moe(seed=0, layers=2, n_batches=3):
    """A Qwen3-MoE (4 experts of width 32, top-2, transformers 5's 3-D experts); 16-token
    batches."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, head_dim=16)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    batches = [torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(i))
               for i in range(n_batches)]
    return model, batches


def gpt_oss(seed=0):
    """A 1-layer GptOss (4 experts with biases, top-2, transposed 3-D weights); 1 batch."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    vocab_size=100, num_local_experts=4, num_experts_per_tok=2,
                                    layer_types=["full_attention"])
    return transformers.GptOssForCausalLM(cfg).eval(), [torch.randint(0, 100, (1, 6))]
