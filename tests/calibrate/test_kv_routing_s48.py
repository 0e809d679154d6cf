"""KV-cache routing (``calibration.structure.kv_cache``): cases a mutation round on its shared
config routing found untested (s48): an implementation the user chose while attached is kept
at detach, a config copied from a routed one is restored to its twin's implementation, and
configs dropped while routed are forgotten."""

import copy
import gc

import pytest
import torch
from tiny_models import llama

from quantscope.calibration.structure import kv_cache

transformers = pytest.importorskip("transformers")


def _callbacks(model, seen=None):
    return {n: (lambda role, t: t if seen is None else seen.append(role) or t)
            for n in kv_cache.attention_modules(model)}


def test_a_choice_made_while_attached_is_kept_at_detach():
    """The user sets another implementation while attached, and no forward has routed it
    since: detach leaves the user's choice (it is not routed), not the one at attach."""
    model, _ = llama()
    cfg = model.config
    assert cfg._attn_implementation == "sdpa"
    detach = kv_cache.attach(model, _callbacks(model))
    assert cfg._attn_implementation == "quantscope_kv_sdpa"
    cfg._attn_implementation = "eager"  # (as transformers' set_attn_implementation sets it)
    detach()
    assert cfg._attn_implementation == "eager"
    assert kv_cache._chosen(cfg) is None


def test_a_config_copied_from_a_routed_one_is_restored_to_its_twin():
    """A model built on a copy of a routed config (``deepcopy(a.config)`` while ``a`` is
    attached) names the routed function: attaching it records the twin's implementation,
    and its detach puts that back, while ``a``'s config stays routed until ``a`` detaches."""
    a, batches = llama()
    detach_a = kv_cache.attach(a, _callbacks(a))
    cfg = copy.deepcopy(a.config)
    assert cfg._attn_implementation == "quantscope_kv_sdpa"
    torch.manual_seed(1)
    b = transformers.LlamaForCausalLM(cfg).eval()
    seen = []
    detach_b = kv_cache.attach(b, _callbacks(b, seen))
    with torch.inference_mode():
        b(batches[0])
    assert seen == ["key", "value"] * 2  # b's own callbacks ran (2 layers)
    detach_b()
    assert cfg._attn_implementation == "sdpa" and kv_cache._chosen(cfg) is None
    assert a.config._attn_implementation == "quantscope_kv_sdpa"
    detach_a()
    assert a.config._attn_implementation == "sdpa"


def test_configs_dropped_while_routed_are_forgotten():
    """A model dropped while attached (its undo never called): its config's entry goes at
    the next routing, not kept for the process's life."""
    for _ in range(3):
        model, _ = llama()
        kv_cache.attach(model, _callbacks(model))  # (the undo dropped: never detached)
        del model
    gc.collect()
    other, _ = llama()
    detach = kv_cache.attach(other, _callbacks(other))
    try:
        assert all(ref() is not None for ref, _ in kv_cache._CHOSEN.values())
    finally:
        detach()


def test_equal_configs_of_two_models_are_restored_each_at_its_own_detach():
    """Two models on two config objects that compare equal (a copy's): each config is
    restored when its own model detaches (identity, not equality, says which modules are
    still attached on a config)."""
    a, _ = llama()
    b = copy.deepcopy(a)
    assert b.config is not a.config
    detach_a = kv_cache.attach(a, _callbacks(a))
    detach_b = kv_cache.attach(b, _callbacks(b))
    assert a.config._attn_implementation == b.config._attn_implementation == "quantscope_kv_sdpa"
    assert a.config == b.config  # (transformers compares a config's fields)
    detach_a()
    assert a.config._attn_implementation == "sdpa"
    assert b.config._attn_implementation == "quantscope_kv_sdpa"
    detach_b()
    assert b.config._attn_implementation == "sdpa"
