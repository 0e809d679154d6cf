"""Pins found by mutation (s36) in the exporters: an interrupted folder write removes the
parents it made; compressed-tensors' matching refuses its internal modules named exactly; a
folder read back names the stray tensor of a layer it lacks, and gives one recipe rule per
config group; and vLLM's embedding rule (weight-only int per channel / group) and the
embeddings it applies to (every nn.Embedding / nn.EmbeddingBag, subclasses too)."""

import json
import os
import warnings

import pytest
import torch
from torch import nn

from quantscope import QuantSpec
from quantscope.exporters import atomic, serving
from quantscope.layout import Channel, Group

torch.set_num_threads(1)

W8 = {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False}
A8 = {"type": "int", "num_bits": 8, "strategy": "token", "symmetric": True, "dynamic": True}
MAY_LOAD = "passes quant_config"  # the message where recent vLLM may load the embedding
REFUSED = "serves a quantized embedding only as weight-only symmetric int per channel"


def _llama(vocab=50, hidden=32):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=vocab,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def _batches(vocab=50):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, vocab, (1, 8), generator=g)} for _ in range(2)]


def _export(model, recipe, folder):
    pytest.importorskip("compressed_tensors")
    from quantscope.calibration import calibrate

    calibrate(model, _batches(model.config.vocab_size), recipe, progress=False).export(
        model, folder)
    return folder


def _weight_rule(targets, spec):
    from quantscope.calibration import Role, Rule

    return Rule(tuple(targets), weight=Role(spec, "minmax"))


# ---- atomic_dir: an interrupt is a failure too ---------------------------------------------------

def test_an_interrupted_folder_write_removes_the_parents_it_made(tmp_path):
    """A KeyboardInterrupt (a BaseException, no Exception) inside atomic_dir's block fails
    the write as any error does: neither the output nor the missing parents it made stay."""
    (tmp_path / "keep").mkdir()
    with pytest.raises(KeyboardInterrupt), \
            atomic.atomic_dir(tmp_path / "keep" / "a" / "b" / "out") as tmp:
        assert os.path.isdir(tmp)
        assert (tmp_path / "keep" / "a" / "b").is_dir()  # made for the write
        raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]
    assert list((tmp_path / "keep").iterdir()) == []


# ---- ct_match.Targets: compressed-tensors' internal modules --------------------------------------

def test_an_internal_module_named_exactly_is_not_matched():
    """compressed-tensors' is_match never takes its InternalModule (an observer attached to a
    layer), even by its exact dotted name; the lookup of dotted names must refuse it as well,
    while a plain module of a dotted name is taken."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors import InternalModule
    from compressed_tensors.utils.match import is_match

    from quantscope.exporters.ct_match import Targets, match_named

    class Obs(InternalModule):
        pass

    model = nn.Module()
    model.lin = nn.Linear(2, 2)
    model.lin.obs = Obs()
    model.lin.sub = nn.Linear(2, 2)
    assert not is_match("lin.obs", model.lin.obs, ["lin.obs"])  # the reference
    assert Targets(["lin.obs"])("lin.obs", model.lin.obs) is False
    assert Targets(["lin.sub", "lin.obs"])("lin.sub", model.lin.sub) is True
    assert [n for n, _ in match_named(model, ["lin.obs", "lin.sub"])] == ["lin.sub"]


# ---- from_compressed_tensors -----------------------------------------------------------------

def test_a_layer_without_tensors_names_the_folders_stray_tensor(tmp_path):
    """A folder whose layer is saved under another name (another toolkit's names): the read
    says the expected layer has no tensor, and which tensor of the folder names no module."""
    from safetensors.torch import load_file, save_file

    from quantscope.calibration import Calibration, Recipe

    rec = Recipe((_weight_rule(("Linear",), QuantSpec("int8", Channel(0))),), ("lm_head",),
                 "w8")
    folder = _export(_llama(), rec, tmp_path / "ct")
    (f,) = folder.glob("*.safetensors")
    tensors = load_file(f)
    q = "model.layers.0.self_attn.q_proj."
    for key in [k for k in tensors if k.startswith(q)]:
        tensors[key.replace(".q_proj.", ".query.")] = tensors.pop(key)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        Calibration.from_compressed_tensors(folder)
    msg = str(e.value)
    assert "layer model.layers.0.self_attn.q_proj has no tensor in the folder" in msg, msg
    assert "; the folder's 'model.layers.0.self_attn.query." in msg, msg
    assert "names no module of the model built from config.json" in msg, msg


def test_the_read_recipe_has_one_rule_per_config_group(tmp_path):
    """A mixed-precision export lists each group's layers by name; read back, each group is
    one rule holding its targets (they resolve alike: exact names), not one rule per layer."""
    from quantscope.calibration import Calibration, Recipe

    rec = Recipe((_weight_rule(("*mlp*",), QuantSpec("int4", Group(16))),
                  _weight_rule(("Linear",), QuantSpec("int8", Channel(0)))), ("lm_head",),
                 "mix")
    folder = _export(_llama(), rec, tmp_path / "ct")
    groups = json.loads((folder / "config.json").read_text())[
        "quantization_config"]["config_groups"]
    written = sorted(sorted(g["targets"]) for g in groups.values())
    assert [len(t) for t in written] == [3, 4]  # the MLP's 3 layers, attention's 4
    back = Calibration.from_compressed_tensors(folder)
    assert len(back.recipe.rules) == len(groups) == 2, [r.targets for r in back.recipe.rules]
    assert sorted(sorted(r.targets) for r in back.recipe.rules) == written
    for r in back.recipe.rules:
        bits = 4 if all(".mlp." in t for t in r.targets) else 8
        assert r.weight.spec.format.bits == bits, (r.targets, r.weight.spec)


# ---- serving: vLLM and quantized embeddings ---------------------------------------------------

def test_an_embedding_with_a_quantized_input_is_refused():
    """vLLM's quantized embedding (CompressedTensorsEmbeddingWNA16Int) is weight-only: a
    scheme that quantizes the input too gets the refusal, which says so, even where the
    weights alone would qualify."""
    assert MAY_LOAD in serving.vllm_embedding_refusal(W8, None, "pack-quantized")
    msg = serving.vllm_embedding_refusal(W8, A8, "pack-quantized")
    assert MAY_LOAD not in msg, msg
    assert REFUSED in msg and "an input quantized" in msg, msg
    assert "leave it in float (ignore it)" in msg, msg


def test_a_per_tensor_int_embedding_is_refused():
    """vLLM's embedding scheme takes int weights per channel or group only
    (_is_wNa16_group_channel): per-tensor int weights get the refusal, naming the strategy."""
    for strategy in ("channel", "group"):
        assert MAY_LOAD in serving.vllm_embedding_refusal(dict(W8, strategy=strategy), None,
                                                          "pack-quantized")
    msg = serving.vllm_embedding_refusal(dict(W8, strategy="tensor"), None, "pack-quantized")
    assert MAY_LOAD not in msg, msg
    assert REFUSED in msg and "got int8 tensor, pack-quantized" in msg, msg


def test_embedding_bags_and_embedding_subclasses_are_embeddings(tmp_path):
    """vLLM builds every embedding as its VocabParallelEmbedding: nn.EmbeddingBag and
    subclasses of nn.Embedding are found as plain ones are, and an export quantizing a
    subclassed embedding warns as for nn.Embedding."""
    class MyEmbedding(nn.Embedding):
        pass

    model = nn.Module()
    model.bag, model.sub, model.plain = (nn.EmbeddingBag(10, 4), MyEmbedding(10, 4),
                                         nn.Embedding(10, 4))
    model.lin = nn.Linear(4, 4)
    assert serving.embedding_layers(model) == ["bag", "sub", "plain"]

    from quantscope.calibration import Recipe

    llama = _llama(vocab=64, hidden=64)
    old = llama.model.embed_tokens
    llama.model.embed_tokens = MyEmbedding(old.num_embeddings, old.embedding_dim)
    llama.model.embed_tokens.weight.data.copy_(old.weight.data)
    rec = Recipe((_weight_rule(("Embedding",), QuantSpec("int8", Channel(0))),), ("lm_head",),
                 "emb")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _export(llama, rec, tmp_path / "ct")
    said = [str(w.message) for w in caught if "quantizes the embeddings" in str(w.message)]
    assert len(said) == 1 and "'model.embed_tokens'" in said[0], [str(w.message)
                                                                  for w in caught]
    assert MAY_LOAD in said[0], said[0]


@pytest.mark.parametrize("spec", [QuantSpec("int8", Channel(1)), QuantSpec("int8", Channel(-1))],
                         ids=str)
def test_a_per_column_weight_scale_is_refused_even_where_the_layer_is_square(tmp_path, spec):
    """compressed-tensors' ``channel`` is one scale per output row: a weight scaled per input
    column has no equivalent. On a square layer the column scales fit the row scales' shape,
    so only the layout check stands between them and a checkpoint that decodes to other
    weights than ``apply`` runs (probe s60)."""
    from quantscope.calibration import Recipe

    model = _llama()
    recipe = Recipe((_weight_rule([r"re:.*self_attn\.(q|o)_proj$"], spec),))
    with pytest.raises(ValueError, match=r"layout Channel\(axis=-?1\).* has no compressed-"
                                         r"tensors equivalent"):
        _export(model, recipe, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()
