"""Pins found by a mutation round (s64) on the parts of sequential calibration and of the
roles' checks, each called on tiny inputs: the checkpoint reader (a folder of safetensors
written in ``tmp_path``: its index, its duplicates, ``base_model_prefix`` keys, parameters
loaded and put back, unused tensors warned about), the remote-code guard and the parameter
budget of the transformers loader, the spill cache's budget and files, the block-order
trace's helpers (blocks found, contexts split and filled, the chain's checks) and how a
module takes a role (Conv1D, ConvTranspose, conv activations)."""

from __future__ import annotations

import json
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from quantscope import QuantSpec
from quantscope.calibration.options import Auto
from quantscope.calibration.recipe import Role
from quantscope.calibration.run import checkpoint as ck
from quantscope.calibration.run import hf_loader, imatrix_roles, tied_roles
from quantscope.calibration.run.block_order import (
    NotAChain,
    Trace,
    _prefix_cache,
    _replayable,
    chain_order,
    check_disjoint,
    find_blocks,
    free_zeros,
    split_contexts,
    trace_batches,
)
from quantscope.calibration.run.module_roles import activation_width, check_role_shape
from quantscope.calibration.run.observe import observer_key
from quantscope.calibration.run.seq_cache import Cache, Contexts


def _folder(path, tensors, config=None, name="model.safetensors"):
    save_file(tensors, str(path / name))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


# ---- checkpoint: the folder and its index --------------------------------------------------------

@pytest.mark.parametrize("archs, task", [
    (["GPT2LMHeadModel"], "causal-lm"), (["LlamaForCausalLM"], "causal-lm"),
    (["BertModel"], "embedding"), ([], "embedding")])
def test_model_task_reads_the_architectures(tmp_path, archs, task):
    """A ``...LMHeadModel`` is a causal LM as a ``...ForCausalLM`` is; no architectures: an
    embedding model."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": archs}))
    assert ck.model_task(tmp_path) == task


def test_empty_model_refuses_an_unknown_task(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"task must be one of .*'classifier'"):
        ck.empty_model(tmp_path, task="classifier")


def test_same_buffer_values_nan_in_both_and_dtype():
    """An initializer's own NaN in both runs is no unset value; another dtype is not alike."""
    a = torch.tensor([math.nan, 1.0])
    assert ck._same(a, a.clone())
    assert not ck._same(a, torch.tensor([0.0, 1.0]))
    assert not ck._same(torch.ones(2), torch.ones(2, dtype=torch.float64))


def test_a_tensor_in_two_unindexed_files_is_refused(tmp_path):
    _folder(tmp_path, {"w": torch.ones(2)}, name="a.safetensors")
    _folder(tmp_path, {"w": torch.zeros(2)}, name="b.safetensors")
    with pytest.raises(ValueError, match=r"tensor 'w' is in both"):
        ck.Checkpoint(tmp_path)


def _index(path, weight_map):
    (path / ck.INDEX).write_text(json.dumps({"weight_map": weight_map}))


def test_an_index_naming_a_tensor_its_shard_lacks_is_refused(tmp_path):
    _folder(tmp_path, {"w": torch.ones(2)}, name="s1.safetensors")
    _index(tmp_path, {"w": "s1.safetensors", "v": "s1.safetensors"})
    with pytest.raises(ValueError, match=r"puts tensor 'v' in .*which does not hold it"):
        ck.Checkpoint(tmp_path)


@pytest.mark.parametrize("shard", ["..", "sub/s1.safetensors"])
def test_an_index_shard_that_is_a_path_is_refused(tmp_path, shard):
    (tmp_path / "sub").mkdir()
    _folder(tmp_path / "sub", {"w": torch.ones(2)}, name="s1.safetensors")
    _index(tmp_path, {"w": shard})
    with pytest.raises(ValueError, match=r"not a shard file name of the folder"):
        ck.Checkpoint(tmp_path)


def test_a_single_file_checkpoint_of_a_quantized_model_is_refused(tmp_path):
    """Given the file itself, the ``config.json`` beside it still tells it is quantized."""
    _folder(tmp_path, {"w": torch.ones(2)},
            {"quantization_config": {"quant_method": "compressed-tensors"}})
    with pytest.raises(ValueError, match=r"is quantized .*compressed-tensors"):
        ck.Checkpoint(tmp_path / "model.safetensors")


class _Prefixed(nn.Module):
    base_model_prefix = "base"


def test_key_adds_or_removes_the_base_model_prefix(tmp_path):
    """As transformers' loader: a base model's name read from a task model's checkpoint
    (prefix added), a task model's from a base model's (prefix removed)."""
    ckpt = ck.Checkpoint(_folder(tmp_path, {"base.a": torch.ones(1), "b": torch.ones(1)}))
    model = _Prefixed()
    assert ck._key(model, "a", ckpt) == "base.a"
    assert ck._key(model, "base.b", ckpt) == "b"
    assert ck._key(model, "c", ckpt) is None


# ---- checkpoint: load_params / unload_params / warn_unused ---------------------------------------

class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        with torch.device("meta"):
            self.emb = nn.Linear(3, 2, bias=False)
            self.head = nn.Linear(3, 2, bias=False)
            self.norm = nn.LayerNorm(3)
        self.head.weight = self.emb.weight
        self.norm.weight.requires_grad_(False)


def _tied_ckpt(tmp_path, **over):
    tensors = {"emb.weight": torch.arange(6.0).reshape(2, 3).half(),
               "norm.weight": torch.ones(3), "norm.bias": torch.zeros(3), **over}
    return ck.Checkpoint(_folder(tmp_path, tensors))


def test_load_params_casts_keeps_requires_grad_and_ties_then_unloads(tmp_path):
    model = _Tied()
    meta_w, meta_norm = model.emb.weight, model.norm.weight
    replaced = ck.load_params(model, {"emb.weight", "head.weight", "norm.weight"},
                              _tied_ckpt(tmp_path), "cpu")
    assert set(replaced) == {"emb.weight", "head.weight", "norm.weight"}
    assert model.emb.weight.dtype == torch.float32  # the parameter's dtype, not the file's
    assert torch.equal(model.emb.weight, torch.arange(6.0).reshape(2, 3))
    assert model.head.weight is model.emb.weight  # tied names stay one tensor
    assert not model.norm.weight.requires_grad and model.emb.weight.requires_grad
    assert model.norm.bias.is_meta  # not asked for
    ck.unload_params(model, replaced)
    assert model.emb.weight is meta_w and model.head.weight is meta_w
    assert model.norm.weight is meta_norm


@pytest.mark.parametrize("bad, match", [
    (torch.ones(3, 2), r"gives shape \(3, 2\), the model expects \(2, 3\)"),
    (torch.ones(2, 3).to(torch.float8_e4m3fn), r"holds torch.float8_e4m3fn .*quantized codes"),
    (torch.ones(2, 3, dtype=torch.int8), r"holds torch.int8 .*quantized codes")])
def test_load_params_refuses_a_bad_tensor_and_loads_nothing(tmp_path, bad, match):
    model = _Tied()
    with pytest.raises(ValueError, match=match):
        ck.load_params(model, {"emb.weight", "norm.weight"},
                       _tied_ckpt(tmp_path, **{"emb.weight": bad}), "cpu")
    assert ck.is_meta(model) and model.norm.weight.is_meta


def _unused(model, ckpt):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck.warn_unused(model, ckpt, "ckpt")
    return [str(w.message) for w in caught]


def test_warn_unused_names_five_then_an_ellipsis(tmp_path):
    model = _Tied()
    extra = {f"x{i}": torch.ones(1) for i in range(6)}
    msgs = _unused(model, _tied_ckpt(tmp_path, **extra))
    assert len(msgs) == 1 and "holds 6 tensors unused" in msgs[0]
    assert "(x0, x1, x2, x3, x4, ...)" in msgs[0]
    del extra["x5"]
    (tmp_path / "model.safetensors").unlink()
    msgs = _unused(model, _tied_ckpt(tmp_path, **extra))
    assert len(msgs) == 1 and "(x0, x1, x2, x3, x4):" in msgs[0]


def test_warn_unused_leaves_out_tensors_named_as_a_buffer(tmp_path):
    """A rotary table older versions saved is no unused tensor."""
    model = _Tied()
    model.register_buffer("inv_freq", torch.ones(2), persistent=False)
    assert _unused(model, _tied_ckpt(tmp_path, **{"rotary.inv_freq": torch.ones(2)})) == []


def test_open_checkpoint_of_a_model_in_memory_reads_nothing(tmp_path):
    ckpt_path = _folder(tmp_path, {"weight": torch.ones(2, 2)})
    with pytest.warns(UserWarning, match=r"is not read: every parameter"):
        assert ck.open_checkpoint(nn.Linear(2, 2, bias=False), ckpt_path) is None


def test_expert_parts_read_gate_rows_then_up_rows(monkeypatch):
    """A 3-D ``gate_up_proj`` ``[experts, 2 * inter, hidden]`` from per-expert tensors:
    expert by expert, its gate (``w1``) rows then its up (``w3``) rows; a checkpoint with
    exactly as many tensors as the keys still holds them all."""
    monkeypatch.setattr(ck, "expert_names", lambda model: ("w1", "w3", "w2"))
    module = nn.Module()
    module.gate_up_proj = nn.Parameter(torch.zeros(2, 4, 3))
    module.down_proj = nn.Parameter(torch.zeros(2, 3, 2))
    keys, build = ck._expert_parts(None, module, "gate_up_proj", "mlp.experts", 4)
    assert keys == [f"mlp.experts.{e}.{s}.weight" for e in (0, 1) for s in ("w1", "w3")]
    parts = [torch.full((2, 3), float(i)) for i in range(4)]
    got = build(parts)
    assert got.shape == (2, 4, 3)
    assert torch.equal(got[1, :2], parts[2]) and torch.equal(got[1, 2:], parts[3])
    assert ck._expert_parts(None, module, "gate_up_proj", "mlp.experts", 3) is None

# ---- hf_loader -----------------------------------------------------------------------------------

def test_parameter_budget_allows_exactly_its_limit():
    """``8 * tensors + 1024`` parameters registered pass; one more is refused."""
    m = nn.Module()
    with hf_loader.parameter_budget(0, "here"):
        for i in range(1024):
            m.register_parameter(f"p{i}", nn.Parameter(torch.empty(0)))
    with pytest.raises(hf_loader.ConfigTooLarge, match=r"more than 1032 parameters"), \
            hf_loader.parameter_budget(1, "here"):
        for i in range(1033):
            m.register_parameter(f"q{i}", nn.Parameter(torch.empty(0)))


def _config(path, name="config.json", **data):
    (path / name).write_text(json.dumps(data))
    return path


def test_remote_code_guard(tmp_path):
    """A known model_type's auto_map is not needed; a tokenizer's auto_map with a
    tokenizer_class neither; an unknown model_type is; trust_remote_code is a bool."""
    hf_loader.check_no_remote_code(_config(tmp_path, model_type="llama",
                                           auto_map={"AutoModel": "m.M"}))
    hf_loader.check_no_remote_code(_config(tmp_path, "tokenizer_config.json",
                                           auto_map={"AutoTokenizer": ["t.T", None]},
                                           tokenizer_class="LlamaTokenizer"))
    with pytest.raises(ValueError, match=r"must be True or False, got 'yes'"):
        hf_loader.check_no_remote_code(tmp_path, trust_remote_code="yes")
    with pytest.raises(hf_loader.RemoteCodeRefused, match=r"has no model_type 'nope-x'"):
        hf_loader.check_no_remote_code(_config(tmp_path, model_type="nope-x"))


def test_model_class_skips_attributes_that_are_no_model_class():
    import transformers

    got = hf_loader.model_class(["PretrainedConfig", "LlamaForCausalLM"], "here")
    assert got is transformers.LlamaForCausalLM


# ---- seq_cache -----------------------------------------------------------------------------------

def test_cache_keeps_a_value_of_exactly_the_budget_in_memory(tmp_path):
    budget = [16]
    cache = Cache(budget, str(tmp_path), "h")
    cache.put(0, torch.ones(4))  # 16 bytes
    assert budget == [0] and cache.spilled == 0 and not list(tmp_path.iterdir())
    cache.put(0, torch.ones(2))  # put again: the old value's bytes come back first
    assert budget == [8]
    cache.drop(0)
    assert budget == [16] and cache.held == set()


def test_cache_spills_past_the_budget_and_clear_forgets_all(tmp_path):
    cache = Cache([4], str(tmp_path), "h")
    table = torch.arange(1000.0)
    cache.put(0, table[:2])  # 8 bytes, a view of 4000
    cache.put(1, torch.ones(1))
    assert cache.spilled == 1 and cache.held == {0, 1}
    assert torch.equal(cache.get(0), torch.tensor([0.0, 1.0]))
    assert (tmp_path / "h-0.pt").stat().st_size < 2000  # the view alone, not its table
    cache.clear()
    assert cache.held == set() and not list(tmp_path.iterdir())


def _trace(contexts, calls=None):
    trace = Trace()
    trace.contexts = contexts
    trace.calls = calls or [(j, j - 1 if j else None) for j in range(len(contexts))]
    return trace


def test_contexts_give_each_block_its_own_arguments(tmp_path):
    """Gemma's layers alternate masks: block 1's call keeps its own tensor."""
    a, b = torch.zeros(2), torch.ones(2)
    ctx = Contexts(Cache([10**6], str(tmp_path), "c"))
    ctx.put(0, _trace([((), {"mask": a, "flag": 1}), ((), {"mask": b, "flag": 1}),
                       ((), {"mask": a, "flag": 1})]))
    for j, want in enumerate((a, b, a)):
        args, kwargs = ctx.get(j, 0)
        assert args == () and kwargs["flag"] == 1 and torch.equal(kwargs["mask"], want)


def test_split_contexts_stores_a_shared_tensor_once():
    m = torch.ones(2)
    tensors, _, own = split_contexts(_trace([((m,), {}), ((m,), {})]))
    assert len(tensors) == 1 and tensors[0] is m and own == {}


# ---- block_order ---------------------------------------------------------------------------------

class _Lists(nn.Module):
    def __init__(self, *lists):
        super().__init__()
        for i, lst in enumerate(lists):
            self.add_module(f"l{i}", nn.ModuleList(lst))


def test_find_blocks_breaks_a_tie_by_parameters_and_needs_one_class():
    model = _Lists([nn.Linear(2, 2) for _ in range(3)], [nn.Linear(4, 4) for _ in range(3)],
                   [nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU()])
    assert find_blocks(model)[0] == "l1"


def test_find_blocks_refuses_an_empty_list_by_name():
    model = _Lists([nn.Linear(2, 2)], [])
    with pytest.raises(ValueError, match=r"blocks='l1' is not a non-empty nn.ModuleList"):
        find_blocks(model, "l1")


def test_replayable_arguments_drop_the_cache():
    args, kwargs = _replayable((1,), {"use_cache": True, "past_key_value": object(), "x": 2})
    assert args == (1,) and kwargs == {"use_cache": False, "past_key_value": None, "x": 2}


def test_prefix_cache_ignores_an_empty_kv_cache():
    from transformers import DynamicCache

    assert _prefix_cache({"input_ids": torch.ones(1, 2), "past_key_values": DynamicCache()}) \
        is None


def test_chain_order_refuses_a_block_never_called():
    trace = _trace([((), {})] * 2)
    with pytest.raises(NotAChain, match=r"block layers.2 is never called"):
        chain_order(trace, 3, "layers")


def test_chain_order_names_the_first_block_whose_extra_outputs_are_read():
    trace = _trace([((), {})] * 3)
    trace.extra_used = {2: "read by add", 1: "read by mul"}
    with pytest.raises(NotAChain, match=r"block layers.1 returns a tuple whose other items "
                                        r"are read by mul"):
        chain_order(trace, 3, "layers")


def test_trace_batches_refuses_no_batches():
    model = _Lists([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"batches is empty"):
        trace_batches(model, [], "l0", model.l0, False, lambda i, t: None)


def test_check_disjoint_refuses_a_module_in_two_blocks_or_outside():
    shared = nn.Linear(2, 2)
    model = _Lists([nn.Sequential(shared), nn.Sequential(shared)])
    with pytest.raises(ValueError, match=r"l0.1.0 is the same module as l0.0.0"):
        check_disjoint(model, "l0", model.l0)
    model = _Lists([nn.Linear(2, 2)])
    model.head = model.l0[0]
    with pytest.raises(ValueError, match=r"head \(outside the blocks\) is the same module"):
        check_disjoint(model, "l0", model.l0)


def test_free_zeros_hold_one_element():
    z = free_zeros((64, 64), torch.float32, "cpu")
    assert z.shape == (64, 64) and not z.any()
    assert z.untyped_storage().nbytes() == 4


# ---- module_roles --------------------------------------------------------------------------------

def _role(layout, dynamic=False):
    return Role(QuantSpec("int8", layout), "minmax", dynamic=dynamic)


def test_conv1d_activation_widths():
    from transformers.pytorch_utils import Conv1D

    module = Conv1D(6, 4)  # weight [in 4, out 6]
    assert activation_width(module, "input") == 4 and activation_width(module, "output") == 6


def test_conv_transpose_weight_takes_per_channel_on_axis_one():
    """``Channel(0)`` of a ConvTranspose's ``[in, out / groups, *k]`` becomes axis 1, the
    output channels; a grouped one has no such axis: refused."""
    got = check_role_shape("0", "weight", _role("channel:0"), nn.ConvTranspose2d(4, 6, 3))
    assert got.spec.layout == QuantSpec("int8", "channel:1").layout
    for layout in ("channel:0", "channel:1"):
        with pytest.raises(ValueError, match=r"groups=2.*needs groups == 1"):
            check_role_shape("0", "weight", _role(layout), nn.ConvTranspose2d(4, 6, 3, groups=2))


@pytest.mark.parametrize("layout", ["tile:2x2", "channel:2", "token"])
def test_conv_units_along_the_kernel_or_image_are_refused(layout):
    conv = nn.Conv2d(4, 4, 3)
    role = "weight" if layout.startswith("tile") else "input"
    with pytest.raises(ValueError, match=r"layer '0' \(Conv2d\).*cannot take"):
        check_role_shape("0", role, _role(layout, dynamic=True), conv)


def test_a_bilinear_input_role_is_refused_its_output_taken():
    module = nn.Bilinear(3, 3, 4)
    with pytest.raises(ValueError, match=r"\(Bilinear\) input: a Bilinear takes two"):
        check_role_shape("b", "input", _role("tensor"), module)
    assert check_role_shape("b", "output", _role("tensor"), module).spec.layout.kind == "tensor"


# ---- tied_roles / imatrix_roles ------------------------------------------------------------------

def test_tied_option_tensors_compare_by_their_values():
    assert tied_roles._equal(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    assert not tied_roles._equal(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]))


def test_auto_chooses_by_the_weight_alone_only_under_the_tensor_metric():
    role = Role(QuantSpec("int8", "channel"), "auto")
    assert tied_roles._by_weight_alone(role, Auto(candidates=("minmax", "mse"), metric="tensor"))
    assert not tied_roles._by_weight_alone(role, Auto(candidates=("minmax", "mse"),
                                                      metric="output"))
    assert not tied_roles._by_weight_alone(role, None)


def test_imatrix_importance_runs_along_the_weights_input_dim():
    """A Conv1D's weight is ``[in, out]``: its input channels on dim 0; a Linear's on -1."""
    from transformers.pytorch_utils import Conv1D

    assert imatrix_roles._input_dim(Conv1D(6, 4)) == 0
    assert imatrix_roles._input_dim(nn.Linear(4, 6)) == -1
    slot = SimpleNamespace(module=Conv1D(6, 4))
    assert imatrix_roles._why_unweighted(slot, torch.ones(4)) is None
    assert "NaN or inf" in imatrix_roles._why_unweighted(slot, torch.tensor([1, math.inf, 1, 1]))


@pytest.mark.parametrize("dynamic, listed", [(False, True), (True, False)])
def test_imatrix_unweighted_lists_static_weight_roles_only(dynamic, listed):
    cfg = Role(QuantSpec("int8", "channel"), "imatrix_mse", dynamic=dynamic)
    module = nn.Linear(4, 4)
    key = observer_key("imatrix_mse", cfg, module)
    slots = {("l", "weight"): SimpleNamespace(module=module, observers={key: object()},
                                              unweighted={key: "never seen"})}
    got = imatrix_roles.unweighted(slots, {("l", "weight"): (cfg, ["imatrix_mse"])})
    assert got == ([{"layer": "l", "reason": "never seen"}] if listed else [])
