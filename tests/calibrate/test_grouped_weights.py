"""calibrate observes a model's weights together (issue 35 item 3): off the CPU one
``quantscope::grouped_unit_minmax`` launch per weight dtype for all recipes' min-max weight
observers, none per weight; on the CPU each observer's forward as before. Failures and
timing per observer as when each weight was observed alone.

The ``meta`` device stands in for a GPU where ops are counted; values come from the Triton
launcher interpreted on CPU tensors (the grouped path opened to the CPU for the test).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from op_names import OpNames
from torch import nn

import quantscope as qs
from quantscope.calibration import preset
from quantscope.calibration.run import observe
from quantscope.calibration.run.non_finite import FirstBad
from quantscope.kernels import triton as qs_triton
from quantscope.observers import grouped

RECIPES = {"w8a8": lambda: preset("w8a8"), "w4a16": lambda: preset("w4a16")}


class _Block(nn.Module):
    """A Llama-like layer's seven Linears (hidden 256, MLP 512); the MLP's in ``mlp_dtype``."""

    def __init__(self, device, mlp_dtype=torch.float32):
        super().__init__()
        lin = {"device": device, "bias": False}
        self.q_proj, self.k_proj = nn.Linear(256, 256, **lin), nn.Linear(256, 128, **lin)
        self.v_proj, self.o_proj = nn.Linear(256, 128, **lin), nn.Linear(256, 256, **lin)
        mlp = {**lin, "dtype": mlp_dtype}
        self.gate_proj, self.up_proj = nn.Linear(256, 512, **mlp), nn.Linear(256, 512, **mlp)
        self.down_proj = nn.Linear(512, 256, **mlp)


def _weight_observers(slots):
    return [(slot, key, obs) for (_, role), slot in slots.items() if role == "weight"
            for key, obs in slot.observers.items()]


def _forward_state(slot, key):
    """What the observer ``key`` alone leaves after its forward on ``slot``'s weight."""
    name, spec, options = key
    obs = qs.get_observer(name, spec, **dict(options)).to(slot.module.weight.device)
    with torch.inference_mode():
        obs(slot.module.weight.detach())
    return obs


@pytest.mark.parametrize("recipes", [["w8a8"], ["w4a16"], ["w8a8", "w4a16"]])
@pytest.mark.parametrize("mlp_dtype", [torch.float32, torch.bfloat16])
def test_the_weight_pass_is_one_launch_per_dtype(recipes, mlp_dtype):
    model = _Block("meta", mlp_dtype)
    rec = OpNames()
    with rec:
        slots, _ = observe.make_plan(model, {r: RECIPES[r]() for r in recipes}, None)
    assert rec.calls["quantscope.grouped_unit_minmax"] == (1 if mlp_dtype == torch.float32
                                                            else 2)
    assert "quantscope.unit_minmax" not in rec.names
    found = _weight_observers(slots)
    assert len(found) == 7 * len(recipes)
    for slot, key, obs in found:
        assert obs.shape == tuple(slot.module.weight.shape)
        assert obs.min_vals.shape == _forward_state(slot, key).min_vals.shape


class _PassEnded(Exception):
    pass


def test_calibrate_takes_the_grouped_path(monkeypatch, meta_as_device):
    """The whole calibration on the meta device: its weight pass is one grouped launch."""
    def end_of_pass(bad, model=None):
        raise _PassEnded

    monkeypatch.setattr(FirstBad, "check", end_of_pass)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))
    rec = OpNames()
    with pytest.raises(_PassEnded), rec:
        qs.calibrate(model, [torch.empty(4, 128, device="meta")], preset("w8a8"),
                     progress=False)
    assert rec.calls["quantscope.grouped_unit_minmax"] == 1


def test_cpu_weights_are_each_observers_forward():
    """On the CPU nothing changes: no grouped op; every state what forward leaves."""
    torch.manual_seed(0)
    model = _Block("cpu")
    rec = OpNames()
    with rec:
        slots, _ = observe.make_plan(model, {r: f() for r, f in RECIPES.items()}, None)
    assert "quantscope.grouped_unit_minmax" not in rec.names
    for slot, key, obs in _weight_observers(slots):
        want = _forward_state(slot, key)
        assert torch.equal(obs.min_vals, want.min_vals)
        assert torch.equal(obs.max_vals, want.max_vals)


def test_grouped_weights_are_forwards_bit_for_bit(monkeypatch):
    """The interpreted Triton launcher, one launch per dtype over both recipes' weights:
    every observer's state dict and qparams what its forward gives."""
    if not qs_triton.runs_on("cpu"):
        pytest.skip("the Triton launchers do not run on CPU tensors in this process")
    from quantscope.kernels.triton import minmax

    launches = []

    def launch(units):
        launches.append(len(units))
        return minmax.grouped_unit_minmax(units)

    monkeypatch.setattr(grouped, "_launches", lambda x: x.dtype in grouped._DTYPES)
    monkeypatch.setattr(grouped, "ops", SimpleNamespace(grouped_unit_minmax=launch))
    torch.manual_seed(0)
    model = _Block("cpu", torch.bfloat16)
    slots, _ = observe.make_plan(model, {r: f() for r, f in RECIPES.items()}, None)
    assert sorted(launches) == [6, 8]  # q, k, v, o / the MLP's three, for both recipes
    for slot, key, obs in _weight_observers(slots):
        want = _forward_state(slot, key)
        got_state, want_state = obs.state_dict(), want.state_dict()
        assert list(got_state) == list(want_state)
        for k, v in want_state.items():
            assert torch.equal(got_state[k], v), (slot.layer, key[0], k)
        g, w = obs.calculate_qparams(), want.calculate_qparams()
        assert torch.equal(g.scale, w.scale) and torch.equal(g.zero_point, w.zero_point)


def _int_weights(model):
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(torch.zeros(m.weight.shape, dtype=torch.int8,
                                                device=m.weight.device), requires_grad=False)
    return model


def test_a_weight_an_observer_cannot_take_raises_as_before():
    """Not ``auto``: the error of the observer's forward, named by layer, role, observer."""
    model = _int_weights(nn.Sequential(nn.Linear(16, 8, device="meta")))
    recipe = preset("w8a8")
    spec = recipe.rules[0].weight.spec
    with pytest.raises(TypeError) as forward:
        qs.get_observer("memoryless_minmax", spec)(model[0].weight)
    with pytest.raises(ValueError) as got:
        observe.make_plan(model, {"r": recipe}, None)
    assert str(got.value) == (f"calibrate: layer '0' weight: observer 'memoryless_minmax' "
                              f"with {spec}: {forward.value}")


def test_auto_drops_the_candidates_that_cannot_take_a_weight():
    model = _int_weights(nn.Sequential(nn.Linear(16, 8, device="meta")))
    slots, _ = observe.make_plan(model, {"r": preset("w8a8", "auto")}, None)
    slot = slots[("0", "weight")]
    assert slot.failed and not slot.observers
    for (name, spec, options), why in slot.failed.items():
        with pytest.raises(TypeError) as forward:
            qs.get_observer(name, spec, **dict(options))(model[0].weight)
        assert why == str(forward.value)
    assert not set(slot.seconds) & set(slot.failed)  # no time counted for the dropped


def test_only_the_owner_rank_observes_a_weight():
    model = _Block("meta")
    rec = OpNames()
    with rec:
        slots, _ = observe.make_plan(model, {"r": preset("w8a8")}, None,
                                     owns=lambda layer: layer.endswith("proj") and
                                     layer[0] in "qkv")
    assert rec.calls["quantscope.grouped_unit_minmax"] == 1
    observed = {slot.layer for slot, _, obs in _weight_observers(slots) if obs.has_observed}
    assert observed == {"q_proj", "k_proj", "v_proj"}
    assert len(_weight_observers(slots)) == 7
