"""Pins from a mutation round over the min-max observers (observers/minmax.py) and their
cached CPU step (observers/minmax_step.py): the reductions each family's ``sync_plan``
declares (docs/guide/pipelines.md), the EMA's repr, the dtypes of the placeholder's fixed
qparams (docs/guide/observers.md), the NVFP4 global amax kept from a memoryless pass only
while the max is the tensor it found, a dynamic Quark observer's state on its first cached
call out of inference mode, and a parent's declared step override vouching for no
subclass's. Each test kills a mutant the suite let through."""

from __future__ import annotations

import pytest
import torch
from test_minmax_step_memoryless import g, planned

import quantscope
from quantscope import Channel, QuantSpec, presets
from quantscope.comm import AVG, MAX, MIN
from quantscope.compat import quark
from quantscope.observers import StaticMinMaxObserver
from quantscope.qparams import qparams_from_range
from quantscope.stats import minmax as stats

needs_kernel = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")


@pytest.mark.parametrize(("name", "plan"), [
    ("static_minmax", {"min_vals": MIN, "max_vals": MAX}),
    ("memoryless_minmax", {"min_vals": MIN, "max_vals": MAX}),
    ("minmax", {"min_vals": AVG, "max_vals": AVG}),
])
def test_sync_plan_reductions_per_family(name, plan):
    """MIN / MAX for the running and memoryless min / max, AVG for the EMA (pipelines.md)."""
    assert quantscope.get_observer(name, QuantSpec()).sync_plan() == plan


def test_moving_average_repr_names_its_constant():
    obs = quantscope.get_observer("minmax", QuantSpec(), averaging_constant=0.25)
    assert "averaging_constant=0.25" in repr(obs)


def test_placeholder_qparams_are_float32_scales_and_int32_zero_points():
    """Scale 1 and zero point 0 per unit, in QParams' dtypes (docs/guide/observers.md)."""
    obs = quantscope.get_observer("placeholder", QuantSpec("int8", Channel(0)))
    obs(g(0, 5, 3))
    qp = obs.qparams()
    assert qp.scale.dtype == torch.float32 and torch.equal(qp.scale, torch.ones(5, 1))
    assert qp.zero_point.dtype == torch.int32 and not qp.zero_point.any()


def test_nvfp4_global_amax_follows_a_replaced_max():
    """A max replaced since the pass (another tensor, even at the same in-place version; the
    min untouched) derives the global amax from the ranges: the new range's qparams."""
    obs = quantscope.get_observer("memoryless_minmax", presets.NVFP4)
    x = g(1, 8, 64)
    obs(g(0, 8, 64))
    obs(x)
    assert torch.equal(obs.global_amax(), x.abs().max())
    new = obs.max_vals * 4
    while new._version < obs.max_vals._version:  # a new tensor, at the old one's version
        new.mul_(1)
    obs.max_vals = new
    assert obs.global_amax() is None
    want = qparams_from_range(obs.min_vals, obs.max_vals, presets.NVFP4,
                              shape=presets.NVFP4.layout.qparam_shape(x.shape))
    assert torch.equal(obs.qparams().global_scale, want.global_scale)


@needs_kernel
def test_dynamic_quark_minmax_holds_the_last_range_after_inference_mode():
    """A dynamic Quark observer's state is its last batch's range, also on the first cached
    call after calls under ``torch.inference_mode`` (the state cloned out of it)."""
    obs = quark.PerTensorMinMaxObserver({"dtype": "int8", "is_dynamic": True})
    with torch.inference_mode():
        obs(g(0, 4, 64))
        obs(g(1, 4, 64))
    x = g(2, 4, 64, scale=3)
    obs(x)
    assert planned(obs)
    assert torch.equal(obs.min_vals, x.min().reshape(1))
    assert torch.equal(obs.max_vals, x.max().reshape(1))


class _Declared(StaticMinMaxObserver):
    _step_overrides = ("check_input",)  # vouches for this class's check_input only

    def check_input(self, x):
        return super().check_input(x)


class _Again(_Declared):
    def __init__(self, spec):
        super().__init__(spec)
        self.calls = 0

    def check_input(self, x):  # overridden again, undeclared: it must run on every call
        self.calls += 1
        return super().check_input(x)


def test_a_parents_declared_override_does_not_vouch_for_a_subclass():
    obs = _Again(QuantSpec("int8"))
    for i in range(3):
        obs(g(i, 4, 64))
    assert obs.calls == 3
