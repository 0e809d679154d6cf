"""Pins from session 68's mutation round over compat.llmcompressor_legacy (the seed's observer
API) and compat.llmcompressor_parts (flatten_for_calibration, FusionHandler, the fused layer
groups): each test pins a behaviour that a mutant changed while every other test kept passing.
Expected values come from llm-compressor 0.14's definitions (its ``_act_sync_dict``,
``is_weight_obs``, ``flatten_for_calibration``, ``FusionHandler`` and ``FUSED_LAYER_NAMES``)
and compressed-tensors' formulas (symmetric int8 scale ``amax / 127.5``, NVFP4 global scale
``448 * 6 / amax``), not from quantscope's output."""

from __future__ import annotations

import gc

import pytest
import torch
from test_legacy_gidx_probe_fixes import NVFP4, _weight
from test_llmc_mx_half import AMAX, WANT_FP16
from test_llmcompressor_api import INT8, _attention

from quantscope.compat import llmcompressor as lc
from quantscope.compat import llmcompressor_legacy as legacy
from quantscope.compat.llmcompressor_parts import (
    FusionHandler,
    flatten_for_calibration,
    mx_scale_in_dtype,
)
from quantscope.formats import FP4_E2M1
from quantscope.scales import e8m0_scale


# ------------------------------------------------------------ llmcompressor_legacy.py
@pytest.mark.parametrize("cls, args", [
    (legacy.MemorylessMinMaxObserver, INT8),
    (legacy.MemorylessMSEObserver, INT8),
    (legacy.NVFP4ExpandedMSEObserver, NVFP4)])
def test_memoryless_observers_reduce_nothing_across_ranks(cls, args):
    """llm-compressor's memoryless observers declare an empty ``_act_sync_dict``."""
    assert cls("input", dict(args)).sync_plan() == {}


@pytest.mark.parametrize("base_name", ["weight", "input", "output", "q", "k", "v"])
def test_is_weight_obs_only_for_the_weight(base_name):
    obs = legacy.MemorylessMinMaxObserver(base_name, dict(INT8))
    assert obs.is_weight_obs is (base_name == "weight")


def test_call_observer_kwargs_override_the_args_ones():
    """``observer_kwargs`` given to the constructor win over ``args.observer_kwargs``: a
    constant of 1 makes the moving average the last batch's range."""
    args = {**INT8, "observer_kwargs": {"averaging_constant": 0.5}}
    obs = legacy.MinMaxObserver("input", args, averaging_constant=1.0)
    obs(torch.tensor([[[-10.0, 10.0]]]))
    scale, zp = obs(torch.tensor([[[-2.0, 2.0]]]))
    torch.testing.assert_close(scale, torch.tensor([2.0 / 127.5]))
    assert not zp.any()


def test_mse_observers_take_llmcompressors_options_and_defaults():
    """observer_kwargs expand and norm reach the search; without them, llm-compressor's
    exact search (norm 2.4)."""
    args = {**INT8, "observer_kwargs": {"norm": 3.0, "expand": 1.5}}
    for cls in (legacy.MemorylessMSEObserver, legacy.NVFP4ExpandedMSEObserver,
                legacy.MovingAverageMSEObserver):
        options = cls("weight", dict(args)).options
        assert (options["norm"], options["expand"]) == (3.0, 1.5)
    options = legacy.MemorylessMSEObserver("weight", dict(INT8)).options
    assert (options["norm"], options["compat"]) == (2.4, "llmcompressor")


def test_forward_of_an_empty_tensor_observes_nothing_and_returns_none():
    """Empty tensors pass through observers (docs/SECURITY.md): no qparams, no error."""
    obs = legacy.MemorylessMinMaxObserver("weight", {**INT8, "strategy": "channel"})
    assert obs(torch.empty(0, 8)) is None
    assert not obs.has_observed


def test_get_qparams_global_scale_without_observed_is_refused():
    obs = legacy.MemorylessMinMaxObserver("weight", dict(NVFP4))
    obs(_weight())
    with pytest.raises(ValueError, match="g_idx and global_scale need observed"):
        obs.get_qparams(global_scale=torch.ones(1))


def test_get_qparams_hands_out_a_new_dict_each_call():
    """A caller that edits the returned dict does not edit the next answer."""
    obs = legacy.MemorylessMinMaxObserver("weight", {**INT8, "strategy": "channel"})
    obs(_weight())
    first = obs.get_qparams()
    first.pop("scale")
    assert set(obs.get_qparams()) == {"scale", "zero_point", "global_scale"}


def test_get_global_scale_observes_the_tensor_given():
    """NVFP4's global scale ``448 * 6 / amax`` of the tensor passed; None for int8."""
    w = torch.zeros(4, 32)
    w[1, 3] = -3.0
    obs = legacy.MemorylessMinMaxObserver("weight", dict(NVFP4))
    torch.testing.assert_close(obs.get_global_scale(w), torch.tensor([448.0 * 6 / 3.0]))
    int8 = legacy.MemorylessMinMaxObserver("weight", {**INT8, "strategy": "channel"})
    assert int8.get_global_scale(w) is None and int8.has_observed


def test_the_module_is_no_submodule_of_the_observer():
    """The observed layer is not registered under the observer (no state_dict entries)."""
    lin = torch.nn.Linear(8, 4)
    obs = legacy.MemorylessMinMaxObserver("weight", dict(INT8), module=lin)
    assert list(obs.children()) == []
    assert not [k for k in obs.state_dict() if k.startswith("module")]


# ------------------------------------------------------------ llmcompressor_parts.py
def test_no_strategy_is_the_tensor_view():
    """compressed-tensors' default strategy is tensor: one unit for a weight, each token one
    observation for an activation."""
    w, x = torch.randn(4, 8), torch.randn(2, 3, 8)
    assert torch.equal(flatten_for_calibration(w, "weight", {}), w.reshape(1, 1, 32))
    assert torch.equal(flatten_for_calibration(x, "input", {}), x.reshape(6, 1, 8))


def test_attention_views_are_per_token():
    """``[batch, heads, seq, head_dim]`` as ``batch * seq`` observations: attn_head
    ``(n, heads, 1, 1, head_dim)``, tensor ``(n, 1, heads * head_dim)``."""
    value = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    head = flatten_for_calibration(value, "k", {"strategy": "attn_head"})
    whole = flatten_for_calibration(value, "q", {"strategy": "tensor"})
    assert head.shape == (8, 3, 1, 1, 5) and whole.shape == (8, 1, 15)
    for b in range(2):
        for s in range(4):
            assert torch.equal(head[b * 4 + s, :, 0, 0], value[b, :, s])
            assert torch.equal(whole[b * 4 + s, 0], value[b, :, s].reshape(-1))


def _fused(n):
    mods = [torch.nn.Linear(16, 2, bias=False) for _ in range(n)]
    observers = [lc.MemorylessMinMaxObserver("weight", dict(NVFP4)) for _ in mods]
    FusionHandler.fuse(zip(observers, mods))
    return observers, mods


def test_fused_statistics_are_the_own_then_each_other_members_once():
    observers, mods = _fused(3)
    with torch.no_grad():
        for i, mod in enumerate(mods):
            mod.weight.fill_(0.0)
            mod.weight[0, 0] = i + 1.0
    stats = observers[1].fusion_handler.get_fused_statistics()
    assert [float(s["max_vals"].max()) for s in stats] == [2.0, 1.0, 3.0]


def test_a_collected_fused_module_is_an_assertion():
    observers, mods = _fused(2)
    del mods[1]
    gc.collect()
    with pytest.raises(AssertionError, match="garbage collected before its weight"):
        observers[0].fusion_handler.get_fused_statistics()


def test_moe_w1_w3_weight_observers_are_fused():
    parent = torch.nn.Module()
    for name in ("w1", "w3"):
        layer = torch.nn.Linear(16, 2, bias=False)
        layer.weight_observer = lc.MemorylessMinMaxObserver("weight", dict(NVFP4))
        setattr(parent, name, layer)
    lc.fuse_weight_observers(parent)
    assert parent.w1.weight_observer.fusion_handler.is_fused
    assert parent.w3.weight_observer.fusion_handler.module is parent.w3


def test_a_fused_layer_without_an_observer_is_refused():
    model = _attention(["tensor_group", "tensor_group", "tensor_group"])
    del model.attn.v_proj.weight_observer
    with pytest.raises(AssertionError, match="have no weight observer"):
        lc.fuse_weight_observers(model)


def test_mx_scale_in_dtype_takes_the_amax_of_either_end():
    """A block's amax is ``max(|lo|, |hi|)``: blocks of negative values only (hi 0) get the
    scales of their ``-lo``."""
    amax = torch.tensor(AMAX)
    half = mx_scale_in_dtype(e8m0_scale(amax, FP4_E2M1), -amax, torch.zeros_like(amax),
                             FP4_E2M1, torch.float16)
    assert half.float().log2().tolist() == WANT_FP16[4]


def test_mx_scale_in_dtype_rounds_the_amax_into_the_dtype_first():
    """A float32 amax just under 0.75 of float16's smallest normal is held by float16 as
    ``1.5 * 2**-15`` (subnormal spacing ``2**-24``), which carries: fp4's scale ``2**-16``."""
    amax = torch.tensor([767.75 * 2.0 ** -24])
    assert amax.half().item() == 1.5 * 2.0 ** -15  # the case: float16 rounds it up
    half = mx_scale_in_dtype(e8m0_scale(amax, FP4_E2M1), -amax, amax, FP4_E2M1, torch.float16)
    assert half.float().log2().tolist() == [-16.0]
