"""The cached CPU step (observers/minmax_step.py) of the memoryless min-max observers, and of
groups and blocks without an order (their units rows of ``x``): the general path's state bit
for bit (buffers, in-place versions, the flag, the count, the kept ends of NVFP4's global
amax), on every input a twin kept on that path (``cached_cpu_step = False``) also gets. The
code before this step ran the general path there (no plan was ever cached)."""

from __future__ import annotations

import pytest
import torch
from op_names import OpNames
from state_checks import assert_same_buffers

from quantscope import Block, Channel, Group, QuantSpec, Tensor, Token
from quantscope.observers import MemorylessMinMaxObserver, StaticMinMaxObserver
from quantscope.observers.minmax import MovingAverageMinMaxObserver
from quantscope.presets import NVFP4
from quantscope.stats import minmax as stats

pytestmark = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")

LAYOUTS = [Tensor(), Channel(0), Token(), Group(16), Block(32), Group(4, 0)]


def rows(layout) -> bool:
    """Whether the units of an (8, 64) batch are rows of its memory (groups along axis 0
    are not: the general path reads them, and so does every call)."""
    return getattr(layout, "axis", -1) != 0 or isinstance(layout, Channel)


def g(seed, *shape, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def pair(cls, spec, **kw):
    obs, twin = cls(spec, **kw), cls(spec, **kw)
    twin.cached_cpu_step = False
    return obs, twin


def same(a, b):
    assert_same_buffers(a, b)
    assert a.shape == b.shape


def planned(obs) -> bool:
    """Whether the cached call took some input (a plan, not None, was made)."""
    return any(p is not None for p in obs.__dict__.get("_cpu_plans", (None, {}))[1].values())


def feed(obs, twin, xs):
    for x in xs:
        assert obs(x) is x and twin(x) is x
        same(obs, twin)


def _inputs():
    nan = g(5, 8, 64)
    nan[3, 7] = float("nan")
    return [g(0, 8, 64), g(1, 8, 64, scale=3), g(2, 64, 8, scale=5).t(),
            g(3, 8, 64).bfloat16(), g(4, 8, 64, scale=2).half(), nan, g(6, 8, 64),
            g(7, 8, 64).double(), g(8, 16, 64, scale=7), g(9, 16, 64)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_memoryless_cached_step_is_the_general_path(layout):
    obs, twin = pair(MemorylessMinMaxObserver, QuantSpec("int8", layout))
    feed(obs, twin, _inputs() * 2)
    assert planned(obs) == rows(layout) and "_cpu_plans" not in twin.__dict__
    assert bool(obs.seen_non_finite)
    with pytest.raises(ValueError, match="NaN or inf"):
        obs.qparams()


@pytest.mark.parametrize("layout", [Group(16), Block(32), Group(4, 0)], ids=str)
@pytest.mark.parametrize("cls", [StaticMinMaxObserver, MovingAverageMinMaxObserver])
def test_groups_and_blocks_take_the_accumulating_step(cls, layout):
    obs, twin = pair(cls, QuantSpec("int8", layout))
    xs = [g(i, 8, 64, scale=i + 1) for i in range(4)] + [g(4, 64, 8).t(), g(5, 8, 64).half()]
    feed(obs, twin, xs * 2)
    assert planned(obs) == rows(layout)
    assert all(torch.equal(a, b) for a, b in zip(obs.qparams(), twin.qparams()))


def test_padded_blocks_keep_the_general_path():
    """A block whose tail is padded: its units are no rows of x (no plan for that shape)."""
    obs, twin = pair(MemorylessMinMaxObserver, QuantSpec("int8", Block(32)))
    feed(obs, twin, [g(0, 8, 70), g(1, 8, 70), g(2, 8, 64), g(3, 8, 64)])
    plans = obs.__dict__["_cpu_plans"][1]
    assert [key[0] for key, plan in plans.items() if plan is None] == [torch.Size((8, 70))]


def test_memoryless_call_runs_no_tensor_op():
    """One C pass writes the state: no tensor op (the general path makes the units, the
    ends tensor and reads them back)."""
    obs = MemorylessMinMaxObserver(QuantSpec("int8", Group(16)))
    x, y = g(0, 8, 64), g(1, 8, 64)
    obs(x)
    obs(x)
    with OpNames() as mode:
        obs(y)
    assert mode.order == []


def test_nvfp4_global_amax_from_the_kept_ends():
    """The ends the pass found stand for the state's global amax (no second read), until the
    state changes; a copy derives it."""
    import copy

    obs, twin = pair(MemorylessMinMaxObserver, NVFP4)
    for i in range(3):
        feed(obs, twin, [g(i, 8, 64, scale=i + 1)])
        kept = obs.__dict__["_cpu_ends"][0] if i else None  # the first call: general path's
        assert obs._state_ends is not None and (not i or obs._state_ends[0] is kept)
        assert torch.equal(obs.global_amax(), twin.global_amax())
        qp, want = obs.qparams(), twin.qparams()
        assert all(torch.equal(a, b) for a, b in zip(
            (qp.scale, qp.zero_point, qp.global_scale),
            (want.scale, want.zero_point, want.global_scale)))
    obs.min_vals.mul_(2)  # a write: the kept ends no longer hold
    assert obs.global_amax() is None
    assert copy.deepcopy(obs)._state_ends is None


def test_inference_mode_and_grad_input():
    obs, twin = pair(MemorylessMinMaxObserver, QuantSpec("int8", Channel(0)))
    with torch.inference_mode():
        feed(obs, twin, [g(0, 8, 32), g(1, 8, 32)])
        assert obs._state_ends is None  # inference tensors keep no versions
    feed(obs, twin, [g(2, 8, 32).requires_grad_(), g(3, 8, 32)])
    assert not obs.min_vals.is_inference() and obs._state_ends is not None


@pytest.mark.parametrize("declared", [(), ("_observe",)], ids=["undeclared", "names-it"])
def test_a_memoryless_subclass_overriding_a_step_keeps_the_general_path(declared):
    """Its override runs on every call, whether or not the class names it in
    ``_step_overrides``: only ``PLAN_CHECKED`` steps can be declared (``_observe`` is a step
    no plan runs)."""
    calls = []

    class Spy(MemorylessMinMaxObserver):
        _step_overrides = declared

        def _observe(self, units, lo, hi):
            calls.append(1)
            super()._observe(units, lo, hi)

    obs = Spy(QuantSpec("int8", Tensor()))
    for i in range(3):
        obs(g(i, 8, 64))
    assert len(calls) == 3 and "_cpu_plans" not in obs.__dict__


def test_declared_overrides_run_where_the_base_steps_would():
    """A class naming ``check_input`` / ``set_shape`` in ``_step_overrides`` takes the
    cached call: its ``check_input`` runs once per plan (a new input key), its ``set_shape``
    on every call, as the general path's ``count_batch`` runs it; an override it does not
    name keeps the general path."""
    seen = {"check_input": 0, "set_shape": 0}

    class Declared(MemorylessMinMaxObserver):
        _step_overrides = ("check_input", "set_shape", "_observe")

        def check_input(self, x):
            seen["check_input"] += 1
            return super().check_input(x)

        def set_shape(self, shape):
            seen["set_shape"] += 1
            super().set_shape(shape)

    obs = Declared(QuantSpec("int8", Tensor()))
    for i in range(4):
        obs(g(i, 8, 64))
    assert planned(obs)  # the cached call ran (calls 2-4)
    assert seen == {"check_input": 2, "set_shape": 4}  # the first call's general path, a plan

    class Undeclared(Declared):
        def _observe(self, units, lo, hi):  # named, but no step the cached call can run
            super()._observe(units, lo, hi)

    obs = Undeclared(QuantSpec("int8", Tensor()))
    for i in range(3):
        obs(g(i, 8, 64))
    assert "_cpu_plans" not in obs.__dict__
