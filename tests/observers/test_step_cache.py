"""What the cached CPU steps share (observers/step_cache.py), tested on each step that uses
it (minmax_step, hist_step, first_step: ModelOpt's HistogramCalibrator): the inference-mode
test each step's start makes (``leave_inference_mode``: only outside torch.inference_mode,
only for a buffer that is there), and the unit count a new shape is tested against
(``begin``'s ``units``)."""

from __future__ import annotations

import pytest
import torch

from quantscope import Channel, QuantSpec, get_observer, kernels
from quantscope.compat.modelopt import HistogramCalibrator
from quantscope.observers import base as observer_base
from quantscope.stats import hist_kernel
from quantscope.stats import minmax as stats

pytestmark = pytest.mark.skipif(
    stats._kernel() is None or hist_kernel._kernel() is None or kernels.lib("ao_hist") is None,
    reason="no compiled kernel")

#: an observer of each cached step, and the attribute its plans are kept in
STEPS = {"minmax": "_cpu_plans", "percentile": "_hist_plans", "modelopt": "_first_plans"}


def _make(step, cls=None):
    if step == "modelopt":
        return (cls or HistogramCalibrator)(num_bins=64)
    return (cls or type(get_observer(step, QuantSpec())))(QuantSpec())


def _batches(n):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(8, 64, generator=gen) * (1 + i) for i in range(n)]


@pytest.mark.parametrize("step", STEPS)
def test_a_subclass_with_an_unset_buffer_keeps_the_cached_step(step):
    """A subclass that adds an optional buffer (``register_buffer(name, None)``, which
    ``Observer.leave_inference_mode`` skips) overrides no step: it keeps the cached step,
    and its state is its parent's (pins S06: the None buffer's ``is_inference()`` read on
    every call)."""
    parent = type(_make(step))

    class WithOptional(parent):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.register_buffer("calibration_mask", None)

    obs, ref = _make(step, WithOptional), _make(step)
    ref.cached_cpu_step = False
    for x in _batches(4):
        obs(x)
        ref(x)
    assert obs.__dict__[STEPS[step]][1]  # the cached step made plans: it ran
    for name, buf in ref._buffers.items():
        assert torch.equal(obs._buffers[name], buf), name
    assert obs.calibration_mask is None


@pytest.mark.parametrize("step", STEPS)
def test_inside_inference_mode_the_steps_never_leave_it(step, monkeypatch):
    """Inside torch.inference_mode (where calibrate observes) there is nothing to leave:
    the cached calls make no ``Observer.leave_inference_mode`` call (pins S05: the
    inference-mode test dropped, every call walks the buffers and calls it)."""
    calls = []
    real = observer_base.Observer.leave_inference_mode
    monkeypatch.setattr(observer_base.Observer, "leave_inference_mode",
                        lambda self: calls.append(1) or real(self))
    xs = _batches(6)
    with torch.inference_mode():
        obs = _make(step)
        obs(xs[0])  # the general path sizes the state
        del calls[:]
        for x in xs[1:]:
            obs(x)
    assert obs.__dict__[STEPS[step]][1] and calls == []


def test_a_per_channel_step_takes_new_shapes_of_the_same_units(monkeypatch):
    """Channel(0) min-max of [8, E] batches whose E changes: each a new shape of the same 8
    units, which the cached step takes (``begin``'s ``units``: the plan's unit count); one
    general forward, the first, which sizes the state (pins S08 / S09: one unit, or E,
    taken for the count: every new shape handed to the general path)."""
    calls = []
    real = observer_base.Observer.forward
    monkeypatch.setattr(observer_base.Observer, "forward",
                        lambda self, x: calls.append(1) or real(self, x))
    spec = QuantSpec("int8", Channel(0))
    obs, ref = get_observer("minmax", spec), get_observer("minmax", spec)
    ref.cached_cpu_step = False
    gen = torch.Generator().manual_seed(0)
    for e in (64, 32, 48, 16, 100, 32, 7):
        x = torch.randn(8, e, generator=gen)
        obs(x)
        n = len(calls)
        ref(x)
        assert len(calls) == n + 1  # (the reference: always the general forward)
    assert len(calls) - 7 == 1
    assert torch.equal(obs.min_vals, ref.min_vals) and torch.equal(obs.max_vals, ref.max_vals)
