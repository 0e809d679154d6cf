"""Mutation round s47 on the cached CPU step (observers/minmax_step.py): each test below
kills a mutant the existing tests let through. The cached call must stand for the general
forward exactly: a subclass's overridden step runs, a state tensor replaced between calls
(another dtype, strided, a negative view) is updated as the general path updates it, an
input that is a negative view is read by its values, the scratch follows the unit count
after a reset, the instance's settings are read per call, and the plans stay bounded."""

from __future__ import annotations

import pytest
import torch

from quantscope import Channel, QuantSpec, Tensor, Token
from quantscope.observers import MovingAverageMinMaxObserver, StaticMinMaxObserver, step_cache
from quantscope.stats import minmax as stats

pytestmark = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")


def g(seed, *shape, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def pair(layout, ema=False):
    """The observer and its twin on the general path (``cached_cpu_step = False``)."""
    spec = QuantSpec("int8", layout)
    make = ((lambda: MovingAverageMinMaxObserver(spec, averaging_constant=0.3)) if ema
            else (lambda: StaticMinMaxObserver(spec)))
    obs, twin = make(), make()
    twin.cached_cpu_step = False
    return obs, twin


def same(a, b):
    for name in ("min_vals", "max_vals", "observed_tokens", "seen_non_finite"):
        x, y = a._buffers[name], b._buffers[name]
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert torch.equal(x, y), (name, x, y)


@pytest.mark.parametrize("step", ["_observe", "count_batch"])
def test_an_overridden_step_runs_on_every_call(step):
    """A subclass that overrides one of the steps the cached call stands for keeps the
    general path: its override runs on every call, the cached ones included."""
    calls = []

    def override(self, *args, **kwargs):
        calls.append(step)
        return getattr(StaticMinMaxObserver, step)(self, *args, **kwargs)

    cls = type("Counting", (StaticMinMaxObserver,), {step: override})
    obs = cls(QuantSpec("int8", Channel(0)))
    for i in range(4):
        obs(g(i, 8, 32))
    assert len(calls) == 4
    assert "_cpu_plans" not in obs.__dict__  # never the cached call


@pytest.mark.parametrize("ema", [False, True], ids=["static", "ema"])
@pytest.mark.parametrize("make", ["float64", "strided", "neg_view"])
def test_state_replaced_between_calls(make, ema):
    """The state tensors are tested on every call, not cached with the plan: a float64, a
    strided or a negative-view state is updated by the general path's torch ops, never
    written as float32 memory through its pointer."""
    obs, twin = pair(Channel(0), ema)
    for o in (obs, twin):
        o(g(0, 8, 32))
        o(g(1, 8, 32))  # the plan is cached now
    assert "_cpu_plans" in obs.__dict__

    def replaced(t):
        if make == "float64":
            return t.double()
        if make == "strided":
            return torch.stack((t, torch.zeros_like(t)), 1)[:, 0]
        return torch._neg_view(-t)  # the same values, read through a negation

    for o in (obs, twin):
        o._buffers["min_vals"] = replaced(o._buffers["min_vals"])
        o._buffers["max_vals"] = replaced(o._buffers["max_vals"])
    for i in range(2, 5):
        x = g(i, 8, 32, scale=3.0)
        obs(x)
        twin(x)
    for name in ("min_vals", "max_vals"):
        assert torch.equal(obs._buffers[name], twin._buffers[name]), name
    ref = StaticMinMaxObserver(QuantSpec("int8", Channel(0)))
    if not ema:  # the running min / max of every batch, whatever the state's form
        for i in range(5):
            ref(g(i, 8, 32, scale=1.0 if i < 2 else 3.0))
        assert torch.equal(obs.min_vals.float(), ref.min_vals)
        assert torch.equal(obs.max_vals.float(), ref.max_vals)


@pytest.mark.parametrize("layout", [Tensor(), Channel(0), Token()], ids=str)
def test_negative_view_input_is_read_by_its_values(layout):
    """``x.conj().imag``-style inputs (a negative view: the memory holds -x) are read by
    their values, as the general path reads them, not as the memory's raw floats."""
    obs, twin = pair(layout)
    for i in range(3):
        x = torch._neg_view(g(i, 8, 32))
        assert x.is_neg()
        obs(x)
        twin(x)
        same(obs, twin)
    if isinstance(layout, Tensor):  # the values' range, not the memory's (-x)
        values = torch.stack([g(i, 8, 32).neg() for i in range(3)])
        assert torch.equal(obs.max_vals, values.amax().reshape(1))
        assert torch.equal(obs.min_vals, values.amin().reshape(1))


def test_reset_then_another_unit_count():
    """After reset() the observer may take another unit count; the cached call must follow
    it (the state's size, the ends of the new units), not keep the first plan's."""
    obs, twin = pair(Channel(0))
    for o in (obs, twin):
        o(g(0, 8, 32))
        o(g(1, 8, 32))
    assert obs.__dict__["_cpu_plans"]  # the cached step ran
    for o in (obs, twin):
        o.reset()
    for i in range(2, 6):
        x = g(i, 64, 32, scale=i)
        obs(x)
        twin(x)
        same(obs, twin)
    x = g(9, 64, 32)
    x[63, 31] = float("inf")  # the max end lies past the first scratch's size
    obs(x)
    twin(x)
    same(obs, twin)
    assert bool(obs.seen_non_finite)


def test_instance_settings_are_read_per_call():
    """A state update switched off on the instance after the plan was cached: the cached
    call must not run (the general path raises its error, on both)."""
    obs, twin = pair(Channel(0))
    for o in (obs, twin):
        o(g(0, 8, 32))
        o(g(1, 8, 32))
        o.state_update = None
    errors = []
    for o in (obs, twin):
        with pytest.raises(ValueError, match="unknown kind") as e:
            o(g(2, 8, 32))
        errors.append(str(e.value))
    assert errors[0] == errors[1]


def test_plans_stay_bounded_over_many_shapes():
    """Activations of ever new token counts: at most MAX_PLANS plans are kept."""
    obs = StaticMinMaxObserver(QuantSpec("int8", Tensor()))
    for t in range(1, 3 * step_cache.MAX_PLANS + 2):
        obs(g(t, t, 16))
        assert len(obs.__dict__["_cpu_plans"][1]) <= step_cache.MAX_PLANS
