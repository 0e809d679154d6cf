"""Pins on the KV-cache attention modules and the placement checks of calibration
(``calibration.structure.kv_cache`` / ``placement``): behaviours a mutation round (s69) over
those two files found no test held, each checked on small modules against the modules'
docstrings (which attention modules a cache holds, how attach routes and restores a
config's implementation, which weights are refused and how the refusals name them)."""

import sys
import types

import pytest
import torch
from test_structure_pins_s64 import _CachedAttention
from torch import nn
from torch.nn.utils import parametrize

from quantscope import _versions
from quantscope.calibration.structure import kv_cache, placement


@pytest.mark.parametrize("is_causal, cached", [(True, True), (None, True), (False, False)])
def test_only_is_causal_false_marks_an_encoders_attention(is_causal, cached):
    """The cache holds a causal attention's keys: ``is_causal`` not False (None included)."""
    attn = _CachedAttention("k_proj", "v_proj")
    attn.is_causal = is_causal
    found = kv_cache.attention_modules(nn.ModuleDict({"attn": attn}))
    assert list(found) == (["attn"] if cached else [])


def test_attention_needs_a_config_naming_its_attention_implementation():
    """A module with projections and a cache argument but no transformers config (no
    ``_attn_implementation`` to route) is no attention module."""
    attn = _CachedAttention("k_proj", "v_proj")
    attn.config = object()
    plain = _CachedAttention("k_proj", "v_proj")
    del plain.config
    assert kv_cache.attention_modules(nn.ModuleDict({"a": attn, "b": plain})) == {}


class _OlderAttention(nn.Module):
    """An attention module of an older transformers: the cache named ``past_key_value``."""

    def __init__(self):
        super().__init__()
        self.config = _CachedAttention().config
        self.k_proj = nn.Linear(2, 2)

    def forward(self, hidden_states, past_key_value=None):
        return hidden_states


def test_the_older_past_key_value_argument_marks_a_cached_attention():
    assert list(kv_cache.attention_modules(nn.ModuleDict({"attn": _OlderAttention()}))) == \
        ["attn"]


def test_attach_with_no_callbacks_needs_no_recent_transformers(monkeypatch):
    """A calibration without a KV cache attaches nothing: an older transformers is fine."""
    monkeypatch.setattr(_versions, "_installed", lambda dist: "4.57.6")
    model = nn.ModuleDict({"attn": _CachedAttention("k_proj", "v_proj")})
    kv_cache.attach(model, {})()
    assert model["attn"].config._attn_implementation == "eager"


def test_attach_routes_only_the_configs_of_the_modules_it_attaches():
    pytest.importorskip("transformers")
    model = nn.ModuleDict({"a": _CachedAttention("k_proj"), "b": _CachedAttention("k_proj")})
    detach = kv_cache.attach(model, {"a": lambda role, t: t})
    try:
        assert model["a"].config._attn_implementation == "quantscope_kv_eager"
        assert model["b"].config._attn_implementation == "eager"
    finally:
        detach()
    assert model["a"].config._attn_implementation == "eager"


def test_a_config_naming_no_implementation_is_routed_as_eager_and_restored_to_none():
    pytest.importorskip("transformers")
    attn = _CachedAttention("k_proj", "v_proj")
    attn.config._attn_implementation = None
    detach = kv_cache.attach(nn.ModuleDict({"attn": attn}), {"attn": lambda role, t: t})
    try:
        assert attn.config._attn_implementation == "quantscope_kv_eager"
    finally:
        detach()
    assert attn.config._attn_implementation is None


def test_an_interrupt_while_attaching_leaves_no_module_routed(monkeypatch):
    """A Ctrl-C (no Exception) as attach routes the config: the callbacks are dropped."""
    pytest.importorskip("transformers")
    attn = _CachedAttention("k_proj", "v_proj")

    def interrupted(cfg):
        raise KeyboardInterrupt
    monkeypatch.setattr(kv_cache, "_route", interrupted)
    with pytest.raises(KeyboardInterrupt):
        kv_cache.attach(nn.ModuleDict({"attn": attn}), {"attn": lambda role, t: t})
    assert attn not in kv_cache._ACTIVE
    assert attn.config._attn_implementation == "eager"


class _Holder(nn.Module):
    """A module with a tensor ``t`` of its own (a parameter, or a buffer) and a Linear."""

    def __init__(self, t, buffer=False):
        super().__init__()
        self.inner = nn.Linear(2, 2)
        if buffer:
            self.register_buffer("t", t)
        else:
            self.t = nn.Parameter(t, requires_grad=False)


def test_only_parameters_must_be_dense_a_sparse_buffer_passes():
    placement.check_placement(_Holder(torch.eye(2).to_sparse(), buffer=True), "calibrate")
    with pytest.raises(ValueError, match=r"'t' is a tensor of type Parameter"):
        placement.check_placement(_Holder(torch.eye(2).to_sparse()), "calibrate")


def test_a_skeleton_under_offload_hooks_is_refused_with_the_sequential_way_out():
    """skeleton: meta weights under accelerate's hooks are its offload; the refusal names
    the sequential calibration from the checkpoint, as ``calibrating`` does."""
    model = _Holder(torch.empty(2, device="meta"))
    model._hf_hook = object()  # (what accelerate's dispatch sets on a module)
    with pytest.raises(ValueError, match=r"apply: 't' is offloaded by accelerate.*without "
                                         r"offload, or calibrate it block by block"):
        placement.check_placement(model, "apply", skeleton=True)


def test_a_parametrization_with_any_right_inverse_is_a_restore_problem():
    class Id(nn.Module):
        def forward(self, w):
            return w

    class Inverse(Id):
        def right_inverse(self, w):
            return w
    lin = nn.Linear(2, 2)
    parametrize.register_parametrization(lin, "weight", Id())
    assert placement.restore_problem(lin, "weight") is None
    parametrize.register_parametrization(lin, "weight", Inverse())
    why, fix = placement.restore_problem(lin, "weight")
    assert "right_inverse" in why and "remove_parametrizations" in fix


def test_an_inference_tensor_weight_is_a_restore_problem_outside_inference_mode():
    with torch.inference_mode():
        lin = nn.Linear(2, 2)
    why, fix = placement.restore_problem(lin, "weight")
    assert "inference tensor" in why and fix == "call remove() in inference mode"
    with torch.inference_mode():
        assert placement.restore_problem(lin, "weight") is None


def test_a_weight_buffer_is_a_held_weight():
    lin = nn.Linear(2, 2)
    w = lin.weight.detach().clone()
    del lin.weight
    lin.register_buffer("weight", w)
    assert placement.held_weight("apply", "l", lin) is w


def test_a_lazy_parameter_is_no_own_weight_yet():
    lazy = nn.LazyLinear(3)
    assert placement.own_weights(lazy) == []
    assert not placement.is_block(nn.Sequential(lazy))


def test_a_module_with_a_1d_weight_is_no_block_of_the_layers_in_it():
    """A norm-like module holding a Linear: its own (1-D) weight makes it no block."""
    holder = _Holder(torch.ones(2))
    holder.weight = holder.t
    assert not placement.is_block(holder)
    assert placement.is_block(nn.Sequential(nn.Linear(2, 2)))


class _Wrapper(nn.Module):
    """Stands for torch.compile's OptimizedModule (its ``_orig_mod`` the module it wraps)."""

    def __init__(self):
        super().__init__()
        self._orig_mod = nn.Linear(2, 2)


@pytest.mark.parametrize("where, model, inner", [
    ("the model", _Wrapper, "model._orig_mod"),
    ("the submodule 'inner'", lambda: nn.ModuleDict({"inner": _Wrapper()}), "inner._orig_mod")])
def test_a_compiled_module_is_refused_naming_what_it_wraps(monkeypatch, where, model, inner):
    monkeypatch.setitem(sys.modules, "torch._dynamo.eval_frame",
                        types.SimpleNamespace(OptimizedModule=_Wrapper))
    with pytest.raises(ValueError, match=rf"calibrate: {where} is a torch\.compile'd module"
                                         rf".*pass the module it wraps \({inner}\)"):
        placement.refuse_compiled(model(), "calibrate")


@pytest.mark.parametrize("model", [None, "model", {"weight": torch.ones(2)}])
def test_check_module_refuses_anything_but_a_module(model):
    with pytest.raises(TypeError, match=rf"^x: model must be a torch\.nn\.Module, got "
                                        rf"{type(model).__name__}$"):
        placement.check_module(model, "x")
