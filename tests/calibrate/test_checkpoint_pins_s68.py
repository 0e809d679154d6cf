"""Pins found by a mutation round (s68) on the weights-on-demand reader and the checkpoint
names of a model's tensors: :func:`empty_model`'s refusals (no config.json, architectures of
another config type, a damaged layer count) and buffers (a persistent one read in the model's
dtype and shape-checked, the initializer's random state kept), which tensors a sharded
checkpoint's index makes part of it, the refusals of a non-string or ``.`` shard and of any
``quantization_config``, what :func:`load_params` loads (meta parameters named, a tied alias,
an integer parameter) and refuses (integer codes wider than a byte), a partly loaded model
still a skeleton, the 3-D experts' bias keys, non-gated and damaged experts, the unused
tensors warned about (sorted, buffers by last name, the class's ignore patterns searched),
and :func:`expert_names` / :func:`checkpoint_names` from transformers' conversion mapping."""

from __future__ import annotations

import pytest
import torch
from test_sequential_parts_pins_s64 import _folder, _index, _Prefixed, _Tied, _tied_ckpt, _unused
from torch import nn

from quantscope.calibration.run import checkpoint as ck
from quantscope.calibration.run import disk_names

# ---- empty_model / _real_buffers ----------------------------------------------------------------


def test_empty_model_of_a_folder_without_config_is_refused(tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(FileNotFoundError, match=r"is not a Hugging Face model folder"):
        ck.empty_model(tmp_path)


def test_empty_model_refuses_architectures_of_another_config_type(tmp_path):
    """A config.json whose architectures names a class of another model type (a Bert class in
    a Llama config) is refused before anything is built, pointing at ``task=``."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, vocab_size=16)
    config.architectures = ["BertModel"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"architectures names BertModel, whose config is "
                                         r"BertConfig, not the folder's LlamaConfig; pass task="):
        ck.empty_model(tmp_path)


def test_empty_model_builds_no_model_far_larger_than_its_checkpoint(tmp_path):
    """A damaged ``num_hidden_layers``: the skeleton may hold ``8 * tensors + 1024``
    parameters (one tensor here), not the 200 layers' thousands."""
    transformers = pytest.importorskip("transformers")
    from quantscope.calibration.run.hf_loader import ConfigTooLarge

    transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=200,
                             num_attention_heads=2, vocab_size=16).save_pretrained(tmp_path)
    _folder(tmp_path, {"model.embed_tokens.weight": torch.ones(16, 8)})
    with pytest.raises(ConfigTooLarge, match=r"more than 1032 parameters"):
        ck.empty_model(tmp_path)


class _Buffered(nn.Module):
    """A persistent buffer (read from the checkpoint) and a computed one; the initializer, as
    transformers' do, sets the tensors not marked loaded (``table``: random numbers)."""

    def __init__(self):
        super().__init__()
        with torch.device("meta"):
            self.lin = nn.Linear(2, 2)
            self.register_buffer("scale", torch.empty(3))
            self.register_buffer("table", torch.empty(2), persistent=False)

    def initialize_weights(self):
        from transformers import initialization as init

        init.zeros_(self.scale)
        init.zeros_(self.lin.weight)
        init.normal_(self.table)


def test_same_is_false_for_equal_values_of_another_shape():
    assert not ck._same(torch.ones(1), torch.ones(2))


def test_real_buffers_read_a_persistent_one_in_the_models_dtype(tmp_path):
    pytest.importorskip("transformers")
    model = _Buffered()
    ckpt = ck.Checkpoint(_folder(tmp_path, {"scale": torch.tensor([1.0, 2, 3]).half()}))
    state = torch.random.get_rng_state()
    ck._real_buffers(model, ckpt, "here")
    assert model.scale.dtype == torch.float32 and model.scale.device.type == "cpu"
    assert torch.equal(model.scale, torch.tensor([1.0, 2, 3]))
    # the initializer's random numbers the same in both runs, the caller's state as it was
    assert model.table.device.type == "cpu" and torch.equal(torch.random.get_rng_state(), state)
    assert model.lin.weight.is_meta


def test_real_buffers_refuse_a_persistent_one_of_another_shape(tmp_path):
    pytest.importorskip("transformers")
    ckpt = ck.Checkpoint(_folder(tmp_path, {"scale": torch.ones(4)}))
    with pytest.raises(ValueError, match=r"^here: checkpoint tensor 'scale' gives shape \(4,\), "
                                         r"the model's buffer \(3,\)$"):
        ck._real_buffers(_Buffered(), ckpt, "here")


# ---- Checkpoint: the index ----------------------------------------------------------------------


def test_an_index_reads_only_the_tensors_it_names(tmp_path):
    """As transformers reads a sharded checkpoint: a shard's tensor the index does not list
    is no part of it."""
    _folder(tmp_path, {"w": torch.ones(2), "stray": torch.zeros(2)}, name="s1.safetensors")
    _index(tmp_path, {"w": "s1.safetensors"})
    assert set(ck.Checkpoint(tmp_path).where) == {"w"}


@pytest.mark.parametrize("shard", [1, None])
def test_an_index_whose_shard_is_not_a_string_is_refused(tmp_path, shard):
    _folder(tmp_path, {"w": torch.ones(2)}, name="s1.safetensors")
    _index(tmp_path, {"w": shard})
    with pytest.raises(ValueError, match=r"has no weight_map of tensor names to files"):
        ck.Checkpoint(tmp_path)


@pytest.mark.parametrize("shard", [".", ""])
def test_an_index_shard_naming_the_folder_itself_is_refused(tmp_path, shard):
    _folder(tmp_path, {"w": torch.ones(2)}, name="s1.safetensors")
    _index(tmp_path, {"w": shard})
    with pytest.raises(ValueError, match=rf"weight_map\['w'\] is '{shard}', not a shard file"):
        ck.Checkpoint(tmp_path)


def test_an_index_naming_a_missing_shard_names_it(tmp_path):
    _folder(tmp_path, {"w": torch.ones(2)}, name="s1.safetensors")
    _index(tmp_path, {"w": "s1.safetensors", "v": "s2.safetensors"})
    with pytest.raises(ValueError, match=r"index\.json names \[.*s2\.safetensors'\], not files"):
        ck.Checkpoint(tmp_path)


def test_a_folder_without_safetensors_says_so(tmp_path):
    with pytest.raises(ValueError, match=r"has no \.safetensors files$"):
        ck.Checkpoint(tmp_path)


def test_a_missing_single_file_says_there_are_no_safetensors(tmp_path):
    """No index involved: the message names no index."""
    with pytest.raises(ValueError, match=r"checkpoint '.*nope\.safetensors' has no \.safetensors"
                                         r" files$"):
        ck.Checkpoint(tmp_path / "nope.safetensors")


def test_any_quantization_config_is_refused_even_with_an_empty_method(tmp_path):
    """The refusal is of a ``quantization_config`` in config.json, whatever it calls itself."""
    _folder(tmp_path, {"w": torch.ones(2)}, {"quantization_config": {"quant_method": ""}})
    with pytest.raises(ValueError, match=r"is quantized .*quant_method ''"):
        ck.Checkpoint(tmp_path)


def test_key_prefers_the_name_itself_to_a_prefixed_one(tmp_path):
    ckpt = ck.Checkpoint(_folder(tmp_path, {"a": torch.ones(1), "base.a": torch.ones(1)}))
    assert ck._key(_Prefixed(), "a", ckpt) == "a"


# ---- load_params / is_meta ----------------------------------------------------------------------


def test_a_partly_loaded_model_is_still_a_skeleton():
    model = _Tied()
    model.norm.weight = nn.Parameter(torch.ones(3))
    assert ck.is_meta(model)
    assert not ck.is_meta(nn.Linear(2, 2))


def test_load_params_leaves_a_parameter_held_in_memory(tmp_path):
    """Only parameters on the meta device are loaded: one the model holds stays that object,
    and is not among those :func:`unload_params` puts back."""
    model = _Tied()
    held = nn.Parameter(torch.full((3,), 5.0))
    model.norm.weight = held
    replaced = ck.load_params(model, {"norm.weight", "norm.bias"}, _tied_ckpt(tmp_path), "cpu")
    assert set(replaced) == {"norm.bias"}
    assert model.norm.weight is held


def test_load_params_without_a_checkpoint_loads_nothing_when_nothing_is_meta():
    model = nn.Linear(2, 2)
    assert ck.load_params(model, {"weight", "bias"}, None, "cpu") == {}


def test_load_params_reads_a_tied_name_from_its_alias(tmp_path):
    """``lm_head.weight`` absent from the checkpoint takes ``embed_tokens.weight``'s value."""
    model = _Tied()
    replaced = ck.load_params(model, {"head.weight"}, _tied_ckpt(tmp_path), "cpu")
    assert set(replaced) == {"emb.weight", "head.weight"}
    assert torch.equal(model.head.weight, torch.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16])
def test_load_params_refuses_wide_integer_codes_for_a_float_parameter(tmp_path, dtype):
    """GPTQ's int32 ``qweight`` is no float weight either."""
    model = _Tied()
    ckpt = _tied_ckpt(tmp_path, **{"emb.weight": torch.ones(2, 3, dtype=dtype)})
    with pytest.raises(ValueError, match=rf"holds {dtype} .*quantized codes"):
        ck.load_params(model, {"emb.weight"}, ckpt, "cpu")
    assert model.emb.weight.is_meta


def test_load_params_loads_an_integer_parameter_from_integer_values(tmp_path):
    model = nn.Module()
    model.codes = nn.Parameter(torch.empty(4, dtype=torch.int8, device="meta"),
                               requires_grad=False)
    ckpt = ck.Checkpoint(_folder(tmp_path, {"codes": torch.arange(4, dtype=torch.int8)}))
    ck.load_params(model, {"codes"}, ckpt, "cpu")
    assert torch.equal(model.codes, torch.arange(4, dtype=torch.int8))


# ---- 3-D experts ---------------------------------------------------------------------------------


def _experts(monkeypatch, experts=2, gated=True, transposed=False):
    monkeypatch.setattr(ck, "expert_names", lambda model: ("w1", "w3", "w2"))
    module = nn.Module()
    up = "gate_up_proj" if gated else "up_proj"
    setattr(module, up, nn.Parameter(torch.zeros(experts, 4, 3)))
    module.down_proj = nn.Parameter(torch.zeros(experts, 3, 2))
    setattr(module, f"{up}_bias", nn.Parameter(torch.zeros(experts, 4)))
    module.is_transposed = transposed
    return module


def test_expert_parts_bias_reads_the_per_expert_biases(monkeypatch):
    module = _experts(monkeypatch)
    keys, build = ck._expert_parts(None, module, "gate_up_proj_bias", "m.experts", 100)
    assert keys == [f"m.experts.{e}.{s}.bias" for e in (0, 1) for s in ("w1", "w3")]
    parts = [torch.full((2,), float(i)) for i in range(4)]
    assert torch.equal(build(parts), torch.tensor([[0.0, 0, 1, 1], [2, 2, 3, 3]]))


def test_expert_parts_of_an_ungated_module(monkeypatch):
    """An ungated experts module has an ``up_proj`` (read from the up tensors) and no
    ``gate_up_proj`` to read from gate and up ones."""
    module = _experts(monkeypatch, gated=False)
    module.has_gate = False
    module.gate_up_proj = nn.Parameter(torch.zeros(2, 4, 3))
    assert ck._expert_parts(None, module, "gate_up_proj", "m.experts", 100) is None
    keys, _ = ck._expert_parts(None, module, "up_proj", "m.experts", 100)
    assert keys == ["m.experts.0.w3.weight", "m.experts.1.w3.weight"]


def test_expert_parts_of_a_damaged_count_are_none(monkeypatch):
    """An expert count the checkpoint's tensors cannot hold lists no keys."""
    module = _experts(monkeypatch, experts=10**6)
    assert ck._expert_parts(None, module, "down_proj", "m.experts", 5) is None


def test_expert_parts_transpose_only_a_transposed_module(monkeypatch):
    module = _experts(monkeypatch)
    _, build = ck._expert_parts(None, module, "down_proj", "m.experts", 100)
    parts = [torch.arange(6.0).reshape(3, 2), torch.zeros(3, 2)]
    assert torch.equal(build(parts)[0], parts[0])
    module = _experts(monkeypatch, transposed=True)
    module.down_proj = nn.Parameter(torch.zeros(2, 2, 3))
    _, build = ck._expert_parts(None, module, "down_proj", "m.experts", 100)
    assert torch.equal(build(parts)[0], parts[0].t())


# ---- warn_unused / open_checkpoint ---------------------------------------------------------------


class _Ignoring(_Tied):
    _keys_to_ignore_on_load_unexpected = (r"rotary\.cache",)


def test_warn_unused_leaves_out_the_classs_ignored_keys_searched_anywhere(tmp_path):
    """As transformers: each pattern is searched for (not matched at the start)."""
    msgs = _unused(_Ignoring(), _tied_ckpt(tmp_path, **{"model.rotary.cache": torch.ones(1)}))
    assert msgs == []


def test_warn_unused_leaves_out_a_tensor_named_as_a_submodules_buffer(tmp_path):
    """A rotary table an older version saved under each layer is named as the model's buffer
    ``rotary.inv_freq`` is: by its last name, wherever the two are."""
    model = _Tied()
    model.rotary = nn.Module()
    model.rotary.register_buffer("inv_freq", torch.ones(2), persistent=False)
    over = {"layers.0.attn.rotary_emb.inv_freq": torch.ones(2)}
    assert _unused(model, _tied_ckpt(tmp_path, **over)) == []


def test_warn_unused_names_the_tensors_sorted_across_files(tmp_path):
    save = _folder(tmp_path, {"emb.weight": torch.ones(2, 3), "zz": torch.ones(1)},
                   name="a.safetensors")
    _folder(save, {"norm.weight": torch.ones(3), "norm.bias": torch.ones(3),
                   "aa": torch.ones(1)}, name="b.safetensors")
    (msg,) = _unused(_Tied(), ck.Checkpoint(tmp_path))
    assert "holds 2 tensors unused by the model (aa, zz):" in msg


def test_warn_unused_passes_over_a_parameter_the_checkpoint_lacks(tmp_path, monkeypatch):
    """A parameter not in the checkpoint (held in memory) is no error, and claims nothing."""
    monkeypatch.setattr(ck, "checkpoint_names", lambda model, names: {})  # no renamings
    ckpt = ck.Checkpoint(_folder(tmp_path, {"emb.weight": torch.ones(2, 3), "x": torch.ones(1)}))
    (msg,) = _unused(_Tied(), ckpt)
    assert "holds 1 tensors unused by the model (x):" in msg


def test_open_checkpoint_names_the_device_only_where_one_is_given(tmp_path):
    path = _folder(tmp_path, {"weight": torch.ones(2, 2)})
    with pytest.warns(UserWarning, match=r"device=cpu moves nothing either"):
        ck.open_checkpoint(nn.Linear(2, 2, bias=False), path, device="cpu")
    with pytest.warns(UserWarning) as caught:
        ck.open_checkpoint(nn.Linear(2, 2, bias=False), path)
    assert all("device=" not in str(w.message) for w in caught)


def test_open_checkpoint_of_a_skeleton_warns_about_unused_tensors(tmp_path):
    ckpt_path = _folder(tmp_path, {"emb.weight": torch.ones(2, 3), "norm.weight": torch.ones(3),
                                   "norm.bias": torch.ones(3), "extra": torch.ones(1)})
    with pytest.warns(UserWarning, match=r"holds 1 tensors unused by the model \(extra\)"):
        assert ck.open_checkpoint(_Tied(), ckpt_path) is not None


# ---- disk_names.expert_names ---------------------------------------------------------------------


def _mapping(monkeypatch, convs):
    from transformers import conversion_mapping

    monkeypatch.setattr(conversion_mapping, "get_checkpoint_conversion_mapping",
                        lambda model_type: convs)


class _Conv:
    def __init__(self, sources, target):
        self.source_patterns, self.target_patterns = sources, target


GATE_UP = _Conv(["mlp.experts.*.w1.weight", "mlp.experts.*.w3.weight"],
                ["mlp.experts.gate_up_proj"])
DOWN = _Conv(["mlp.experts.*.w2.weight"], "mlp.experts.down_proj")


@pytest.mark.parametrize("convs", [
    [DOWN, GATE_UP],
    [_Conv([*GATE_UP.source_patterns, "mlp.experts.*.w1.bias", "mlp.experts.*.w3.bias"],
           "mlp.experts.gate_up_proj"), DOWN]], ids=["weights", "with-biases"])
def test_expert_names_read_gate_up_and_down_from_the_mapping(monkeypatch, convs):
    """The names are those of the per-expert weights (a bias pattern beside them adds none)."""
    pytest.importorskip("transformers")
    _mapping(monkeypatch, convs)
    assert disk_names.expert_names(nn.Module()) == ("w1", "w3", "w2")


def test_checkpoint_names_rename_a_module_itself():
    """Mixtral's ``mlp`` module is ``block_sparse_moe`` on disk, named alone as well as in a
    longer name."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        vocab_size=16, num_local_experts=2)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config)
    assert disk_names.checkpoint_names(model, ["model.layers.0.mlp"]) == {
        "model.layers.0.mlp": "model.layers.0.block_sparse_moe"}


@pytest.mark.parametrize("convs", [
    [GATE_UP], [DOWN], None, [],
    [_Conv(["mlp.experts.*.w1.weight"], "mlp.experts.gate_up_proj"), DOWN]],
    ids=["no-down", "no-gate-up", "none", "empty", "one-fused-name"])
def test_expert_names_none_without_both_conversions(monkeypatch, convs):
    pytest.importorskip("transformers")
    _mapping(monkeypatch, convs)
    assert disk_names.expert_names(nn.Module()) is None
