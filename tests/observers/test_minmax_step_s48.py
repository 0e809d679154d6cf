"""The cached CPU step (``observers/minmax_step.py``), s48 mutation round: a subclass overriding
any step of the general forward keeps that forward (each step named, not only the two
test_minmax_step_s47 overrides), and an input that is no tensor gets the general path's
TypeError, not an AttributeError from the cached call's tests of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantscope import Channel, QuantSpec, Tensor
from quantscope.observers import StaticMinMaxObserver
from quantscope.stats import minmax as stats

pytestmark = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")

#: the general forward's steps, each of which a subclass may override
STEPS = ("check_input", "leave_inference_mode", "_check_unit_count", "_unit_minmax",
         "_minmax_out", "_record_non_finite", "_observe", "_update", "count_batch",
         "set_shape", "_one_op_units")


def g(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("step", STEPS)
def test_a_subclass_overriding_any_step_keeps_the_general_forward(step):
    """The override is the class's own method (it delegates): the cached call, which stands
    for the base class's steps, must not run in its place; the state is the base class's."""
    def override(self, *args, **kwargs):
        return getattr(StaticMinMaxObserver, step)(self, *args, **kwargs)

    cls = type("Overriding", (StaticMinMaxObserver,), {step: override})
    spec = QuantSpec("int8", Channel(0))
    obs, plain = cls(spec), StaticMinMaxObserver(spec)
    plain.cached_cpu_step = False
    for i in range(3):
        obs(g(i, 8, 32))
        plain(g(i, 8, 32))
    assert "_cpu_plans" not in obs.__dict__  # never the cached call
    assert torch.equal(obs.min_vals, plain.min_vals) and torch.equal(obs.max_vals, plain.max_vals)


@pytest.mark.parametrize("bad", [[1.0, 2.0], np.ones((2, 3), np.float32), 3.0, None],
                         ids=["list", "ndarray", "float", "None"])
def test_an_input_that_is_no_tensor_is_the_general_paths_type_error(bad):
    obs = StaticMinMaxObserver(QuantSpec("int8", Tensor()))
    obs(g(0, 4, 64))  # (a plan cached first)
    with pytest.raises(TypeError, match=f"expected a torch.Tensor, got {type(bad).__name__}"):
        obs(bad)
