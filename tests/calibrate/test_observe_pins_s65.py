"""Pins of the calibration pass's observation (``calibration.run.observe``) from a mutation
round (s65): ``auto``'s candidate list, the spec a ``dynamic="local"`` role observes, the
weights observed now or later (owner rank, ``imatrix_mse`` waiting for importance), each
observer's time (a grouped launch shared by elements, counted once across recipes), the
slots a plan makes (sampled roles, per-tensor rows, the run-time NaN check), the hooks
(odd inputs counted, a fusion group's shared input observed once, hooks of a copy), the
row sample's axis, width and budget, and a fusion group's merged input slot."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from quantscope import presets
from quantscope.calibration import Recipe, preset
from quantscope.calibration.recipe import Role, Rule
from quantscope.calibration.run import observe
from quantscope.layout import Tensor
from quantscope.spec import QuantSpec

_INT8 = QuantSpec("int8", Tensor())


def _lin():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4))


def _recipe(**roles):
    return Recipe((Rule(("Linear",), **roles),))


def _observing(slot, x, n=1):
    """Feed ``x`` ``n`` times to ``slot``'s output hook as the pass does."""
    _, post = observe._hook([slot])
    token = observe._IN_PASS.set(True)
    try:
        for _ in range(n):
            post(None, (), x)
    finally:
        observe._IN_PASS.reset(token)


def _minmax_slot(**kw):
    slot = observe.Slot("l", "output", nn.Linear(8, 4), **kw)
    key = ("minmax", _INT8, ())
    slot.observers[key] = observe.get_observer("minmax", _INT8)
    return slot, slot.observers[key]


def test_auto_among_the_candidates_is_skipped_in_any_case():
    assert observe.candidates_for("input", ("AUTO", "minmax", "Auto")) == ["minmax"]


def test_an_unknown_explicit_candidate_raises_naming_it():
    with pytest.raises(ValueError, match=r"Auto.candidates names 'no_such_observer'"):
        observe.candidates_for("input", ("minmax", "no_such_observer"))


def test_no_candidate_left_raises():
    with pytest.raises(ValueError, match=r"'auto' has no candidate observers for input"):
        observe.candidates_for("input", ("auto",))


def test_weight_candidates_are_memoryless_input_ones_are_not():
    assert observe.candidates_for("input", ("minmax",)) == ["minmax"]
    assert observe.candidates_for("weight", ("minmax",)) == ["memoryless_minmax"]


def test_a_local_role_observes_its_format_per_tensor_symmetric():
    role = Role(presets.NVFP4, "minmax", "local")
    assert observe.observed_spec(role) == QuantSpec(presets.NVFP4.format, "tensor",
                                                    symmetric=True)
    static = Role(presets.NVFP4, "minmax")
    assert observe.observed_spec(static) is presets.NVFP4


def test_another_ranks_weight_is_not_observed():
    slots, _ = observe.make_plan(_lin(), {"r": preset("w8a8")}, None, owns=lambda layer: False)
    (obs,) = slots[("0", "weight")].observers.values()
    assert not obs.has_observed


def test_make_observer_alone_observes_a_weight_at_once():
    model = _lin()
    slot = observe.Slot("0", "weight", model[0])
    key = ("memoryless_minmax", presets.INT8_PER_CHANNEL, ())
    observe.make_observer(slot, key, False)
    assert slot.observers[key].has_observed
    assert key in slot.seconds


def _weights(n):
    out = []
    for i in range(n):
        slot = observe.Slot(f"l{i}", "weight", None)
        key = ("minmax", _INT8, (("i", i),))
        slot.observers[key] = object()
        out.append((slot, key, slot.observers[key], None, True))
    return out


def _clock(monkeypatch, total):
    """``observe``'s clock reading 0 then ``total`` (observe_weights' start and end)."""
    ticks = iter([0.0, total])
    monkeypatch.setattr(observe, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))


def test_observe_weights_shares_the_time_by_each_observers_measure(monkeypatch):
    weights = _weights(2)
    monkeypatch.setattr(observe, "observe_many", lambda pairs, on_error: [1.0, 3.0])
    _clock(monkeypatch, 8.0)
    observe.observe_weights(weights)
    assert [s.seconds[k] for s, k, *_ in weights] == [2.0, 6.0]


def test_observe_weights_shares_unmeasured_time_equally(monkeypatch):
    weights = _weights(4)
    monkeypatch.setattr(observe, "observe_many", lambda pairs, on_error: [0.0] * 4)
    _clock(monkeypatch, 8.0)
    observe.observe_weights(weights)
    assert [s.seconds[k] for s, k, *_ in weights] == [2.0] * 4


def test_observe_weights_drops_a_failed_auto_candidate_and_its_time(monkeypatch):
    weights = _weights(2)

    def many(pairs, on_error):
        on_error(0, TypeError("cannot take it"))
        return [1.0, 1.0]
    monkeypatch.setattr(observe, "observe_many", many)
    observe.observe_weights(weights)
    (slot, key, *_), (other, okey, *_) = weights
    assert slot.failed == {key: "cannot take it"}
    assert key not in slot.observers and key not in slot.seconds
    assert okey in other.observers and other.seconds[okey] >= 0


def test_observer_seconds_counts_a_shared_observer_once():
    slots, plans = observe.make_plan(_lin(), {"a": preset("w8a8"), "b": preset("w8a8")}, None)
    for slot in slots.values():
        slot.seconds = {key: 1.0 for key in slot.observers}
    assert observe.observer_seconds(slots, plans["a"], plans["b"]) == 2.0  # weight, input
    assert observe.observer_seconds(slots, plans["a"]) == 2.0


def test_imatrix_mse_waits_for_importance_only_without_the_users():
    assert observe.waits_for_importance(("imatrix_mse", _INT8, ()))
    assert not observe.waits_for_importance(("imatrix_mse", _INT8, (("importance", 1),)))
    assert not observe.waits_for_importance(("mse", _INT8, ()))


def test_a_waiting_imatrix_weight_is_not_observed_by_make_plan():
    recipe = _recipe(weight=Role(presets.INT8_PER_CHANNEL, "imatrix_mse"))
    slots, _ = observe.make_plan(_lin(), {"r": recipe}, None)
    slot = slots[("0", "weight")]
    assert len(slot.waiting) == 1
    assert not any(obs.has_observed for obs in slot.observers.values())


def test_a_slot_is_per_tensor_only_where_every_recipe_says_so():
    recipes = {"tok": preset("w8a8-dynamic"), "tensor": preset("w8a8")}
    slots, _ = observe.make_plan(_lin(), recipes, None)
    assert slots[("0", "input")].per_tensor is False
    slots, _ = observe.make_plan(_lin(), {"tensor": preset("w8a8")}, None)
    assert slots[("0", "input")].per_tensor is True


def test_an_output_role_is_sampled_a_weight_is_not():
    recipe = _recipe(weight=Role(presets.INT8_PER_CHANNEL), output=Role(_INT8))
    slots, _ = observe.make_plan(_lin(), {"r": recipe}, None)
    assert slots[("0", "output")].needs_sample
    assert not slots[("0", "weight")].needs_sample


def test_a_local_role_is_observed_a_dynamic_one_is_not():
    slots, plans = observe.make_plan(_lin(), {"r": preset("nvfp4")}, None)
    assert slots[("0", "input")].observers
    slots, plans = observe.make_plan(_lin(), {"r": preset("w8a8-dynamic")}, None)
    assert not slots[("0", "input")].observers
    assert plans["r"][("0", "input")][1] == []


def test_the_run_time_check_is_off_for_non_finite_ignore_and_the_first_role_wins():
    token = QuantSpec("int8", presets.INT8_PER_TOKEN.layout)
    ignore = _recipe(input=Role(token, "memoryless_minmax", True, {"non_finite": "ignore"}))
    slots, _ = observe.make_plan(_lin(), {"r": ignore}, None)
    assert slots[("0", "input")].runtime_check is None
    first = _recipe(input=Role(token, "memoryless_minmax", True))
    second = _recipe(input=Role(token, "minmax", True))
    slots, _ = observe.make_plan(_lin(), {"a": first, "b": second}, None)
    assert slots[("0", "input")].runtime_check == ("0", "memoryless_minmax")


def test_an_integer_call_is_counted_odd_and_not_observed():
    slot, obs = _minmax_slot()
    _observing(slot, torch.arange(6).reshape(2, 3))
    _observing(slot, (torch.ones(2, 4),))
    _observing(slot, torch.ones(2, 4))
    assert (slot.calls, slot.odd_calls, slot.odd) == (3, 2, tuple)
    slot, obs = _minmax_slot()
    _observing(slot, torch.arange(6).reshape(2, 3))
    assert slot.odd is torch.int64
    assert not obs.has_observed


def test_a_fusion_groups_shared_input_is_observed_once_per_tensor():
    slot, obs = _minmax_slot(also={"k": nn.Linear(8, 4)})
    x = torch.randn(3, 4)
    _observing(slot, x, n=3)  # q, k and v read one tensor
    assert int(obs.observed_tokens) == 3
    _observing(slot, torch.randn(3, 4))
    assert int(obs.observed_tokens) == 6
    assert slot.calls == 4


def test_a_copys_hooks_leave_it_and_a_shallow_copy_keeps_the_owners():
    owner = nn.Linear(4, 4)
    seen = []
    owner.register_forward_hook(observe._only_for(owner, lambda m, a, o: seen.append(m),
                                                  "_forward_hooks"))
    deep = copy.deepcopy(owner)
    deep(torch.ones(1, 4))
    assert seen == [] and not deep._forward_hooks
    shallow = copy.copy(owner)
    shallow(torch.ones(1, 4))
    owner(torch.ones(1, 4))
    assert seen == [owner]


def test_a_pass_forwards_unobserved_batches_when_asked():
    batches = [torch.ones(2, 8)] * 3
    assert observe.observe_batches(_lin(), batches, {}, 0, False, 0) == 0
    assert observe.observe_batches(_lin(), batches, {}, 0, False, 0, forward=True) == 3


def test_a_pass_forgets_the_fusion_marks_after_it():
    model = _lin()
    slots, _ = observe.make_plan(model, {"r": preset("w8a8")}, None)
    slot = slots[("0", "input")]
    slot.also["other"] = nn.Linear(8, 4)
    x = torch.randn(2, 8)
    observe.observe_batches(model, [x], slots, 16, False, 0)
    assert slot.last is None
    observe.observe_batches(model, [x], slots, 16, False, 0)  # the same tensor again
    (obs,) = slot.observers.values()
    assert int(obs.observed_tokens) == 4


def test_a_conv_samples_rows_along_channels_only_per_tensor():
    conv = nn.Conv2d(3, 5, 3)
    assert observe._sample_axis(observe.Slot("c", "input", conv)) == -3
    assert observe._sample_axis(observe.Slot("c", "input", conv, per_tensor=False)) == -1
    assert observe._sample_width(observe.Slot("c", "input", conv), -3) == 3
    assert observe._sample_width(observe.Slot("c", "output", conv), -3) == 5


def test_a_zero_sample_budget_is_zero_and_none_the_default():
    assert observe.sample_budget(0) == 0
    assert observe.sample_budget(None) == observe.DEFAULT_SAMPLE_BUDGET_MB == 64


def test_a_fusion_group_merges_its_members_input_slots_into_the_leads():
    q, k = nn.Linear(4, 4), nn.Linear(4, 4)
    lead = observe.Slot("q", "input", q, failed={"a": "x"})
    member = observe.Slot("k", "input", k, failed={"b": "y"}, needs_sample=True,
                          runtime_check=("k", "minmax"))
    slots = {("q", "input"): lead, ("k", "input"): member}
    observe.share_group_inputs(None, None, None, slots, groups=[["q", "k"]])
    assert slots[("k", "input")] is lead and lead.also == {"k": k}
    assert lead.failed == {"a": "x", "b": "y"}
    assert lead.needs_sample and lead.runtime_check == ("k", "minmax")
    lead.runtime_check, lead.needs_sample = ("q", "mse"), True
    other = observe.Slot("v", "input", nn.Linear(4, 4), runtime_check=("v", "minmax"))
    slots[("v", "input")] = other
    observe.share_group_inputs(None, None, None, slots, groups=[["q", "v"]])
    assert lead.runtime_check == ("q", "mse") and lead.needs_sample
