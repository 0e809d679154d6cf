"""compat.quark's min-max and block observers take the shared cached CPU step
(observers/minmax_step.py): static ones its accumulating call, dynamic and per-group ones its
memoryless call, per-group and MX blocks being rows of the batch. Each is held to a twin of
the same config kept on the general path (``cached_cpu_step = False``): the native state and
its versions, Quark's statistics, token count, input dtype, group count, qparams and errors,
call for call. The code before ran the general path for every one of them. No Quark needed
(dict qspecs)."""

from __future__ import annotations

import pytest
import torch
from state_checks import assert_same_buffers

from quantscope.compat import quark
from quantscope.stats import minmax as stats

pytestmark = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")

CASES = [
    ("PerTensorMinMaxObserver", {"dtype": "int8"}),
    ("PerTensorMinMaxObserver", {"dtype": "uint8", "symmetric": False, "is_dynamic": True}),
    ("PerTensorMinMaxObserver", {"dtype": "fp8_e4m3"}),
    ("PerChannelMinMaxObserver", {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0}),
    ("PerChannelMinMaxObserver", {"dtype": "int4", "qscheme": "per_channel", "ch_axis": 0,
                                  "is_dynamic": True, "symmetric": False}),
    ("PerGroupMinMaxObserver", {"dtype": "int4", "qscheme": "per_group", "ch_axis": -1,
                                "group_size": 32}),
    ("PerBlockMXObserver", {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1,
                            "group_size": 32, "scale_format": "e8m0", "is_dynamic": True}),
    ("PerBlockMXObserver", {"dtype": "fp8_e4m3", "qscheme": "per_group", "ch_axis": -1,
                            "group_size": 32, "scale_format": "e8m0"}),
    ("PerBlockBFPObserver", {"dtype": "bfp16", "qscheme": "per_group", "ch_axis": -1,
                             "group_size": 8}),
]
IDS = [f"{name}-{'dynamic' if q.get('is_dynamic') else q['dtype']}" for name, q in CASES]


def g(seed, *shape, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def twins(name, qspec):
    obs, twin = (getattr(quark, name)(qspec) for _ in range(2))
    twin.cached_cpu_step = False
    return obs, twin


def _outcome(fn):
    """``fn()``'s result, or its exception's type and message (the two must fail alike)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)


def _raised(fn):
    """None, or what ``fn()`` raised (:func:`_outcome`): a forward returns its input."""
    out = _outcome(fn)
    return None if isinstance(out, torch.Tensor) else out


def same(a, b):
    assert_same_buffers(a, b)
    assert a.shape == b.shape and a._input_dtype == b._input_dtype
    assert a._num_observed_tokens == b._num_observed_tokens
    assert getattr(a, "group_count", None) == getattr(b, "group_count", None)
    for stat in ("min_val", "max_val", "amax"):
        if hasattr(type(a), stat):
            x, y = getattr(a, stat), getattr(b, stat)
            assert x.dtype == y.dtype and torch.equal(x.nan_to_num(), y.nan_to_num()), stat
    x, y = _outcome(a._calculate_qparams), _outcome(b._calculate_qparams)
    if isinstance(x[0], torch.Tensor) or isinstance(y[0], torch.Tensor):
        assert all(u.dtype == v.dtype and torch.equal(u, v) for u, v in zip(x, y))
    else:
        assert x == y


def batches():
    nan = g(9, 8, 64)
    nan[1, 2] = float("nan")
    return [g(0, 8, 64), g(1, 8, 64, scale=4), g(2, 8, 64).bfloat16(), g(3, 8, 64, scale=2),
            g(4, 64, 8, scale=3).t(), g(5, 8, 64).half(), g(6, 8, 64, scale=0.5),
            g(7, 8, 64).double(), torch.zeros(8, 64), g(8, 8, 64), nan, g(10, 8, 64)]


@pytest.mark.parametrize(("name", "qspec"), CASES, ids=IDS)
def test_cached_step_is_the_general_path(name, qspec):
    obs, twin = twins(name, qspec)
    for x in batches():
        assert _raised(lambda: obs(x)) == _raised(lambda: twin(x))  # noqa: B023
        same(obs, twin)
    plans = obs.__dict__.get("_cpu_plans", (None, {}))[1]
    assert any(p is not None for p in plans.values())  # the cached call ran
    assert "_cpu_plans" not in twin.__dict__


@pytest.mark.parametrize(("name", "qspec"), CASES, ids=IDS)
def test_shapes_errors_and_resets(name, qspec):
    """Other shapes (a static per-channel / MX one starts over on new units, as Quark's; a
    per-group one refuses an axis its groups do not divide), integer input, a reset."""
    obs, twin = twins(name, qspec)
    xs = [g(0, 8, 64), g(1, 8, 64), g(2, 16, 64, scale=3), g(3, 16, 64), g(4, 8, 48),
          g(5, 8, 40), torch.arange(512).reshape(8, 64), g(6, 4, 2, 64), g(7, 8, 64)]
    for i, x in enumerate(xs):
        assert _raised(lambda: obs(x)) == _raised(lambda: twin(x))  # noqa: B023
        same(obs, twin)
        if i == 3:
            for o in (obs, twin):
                o.reset_state()
            same(obs, twin)


@pytest.mark.parametrize(("name", "qspec"), CASES, ids=IDS)
def test_inference_mode_then_out_of_it(name, qspec):
    """Calls inside ``torch.inference_mode()``, then outside (``calibrate`` observes inside),
    then a state loaded in: the same buffers and in-place versions as the general path's. A
    dynamic / per-group one's general path writes its scratch pair, which becomes the state
    (the clone leaving inference mode made is dropped): the code before wrote the clone on the
    cached call, one version ahead."""
    obs, twin = twins(name, qspec)
    for o in (obs, twin):
        with torch.inference_mode():
            o(g(0, 8, 64))
            o(g(1, 8, 64))
    same(obs, twin)
    for i in (2, 3, 4):
        for o in (obs, twin):
            o(g(i, 8, 64))
        same(obs, twin)
    for o in (obs, twin):
        o.min_vals = o.min_vals.clone()  # a state replaced (as a load may)
        o.max_vals = o.max_vals.clone()
        o(g(5, 8, 64))
        o(g(6, 8, 64))
    same(obs, twin)


def test_group_count_follows_every_call():
    """Quark's forward sets group_count on every call: so does the cached call (the class's
    own set_shape), an assigned value included."""
    obs, twin = twins(*CASES[5])
    for o in (obs, twin):
        o(g(0, 8, 64))
        o(g(1, 8, 64))
        o.group_count = 7
        o(g(2, 8, 64))
    assert obs.group_count == twin.group_count == 2


def test_a_subclass_check_input_is_not_vouched_for_by_its_parent():
    """A subclass of PerGroupMinMaxObserver overriding ``check_input`` with a test on values
    (which a plan cannot cache) inherits the parent's ``_step_overrides``, not its word for
    the new code: every call runs the check, as on the general path (the code before ran it
    once per input key and took a batch of 100s into max_val). A class naming a step it
    inherits does not vouch for it either; one defining and naming it takes the cached call."""

    class Bounded(quark.PerGroupMinMaxObserver):
        def check_input(self, x):
            if x.abs().max() > 10:
                raise ValueError("batch out of bounds")
            return super().check_input(x)

    class Named(Bounded):  # names check_input, but Bounded defines it
        _step_overrides = ("check_input", "set_shape")

    qspec = CASES[5][1]
    for cls in (Bounded, Named):
        for cached in (True, False):
            obs = cls(qspec)
            obs.cached_cpu_step = cached
            obs(g(0, 8, 64))
            obs(g(1, 8, 64))
            with pytest.raises(ValueError, match="out of bounds"):
                obs(torch.full((8, 64), 100.0))
            assert obs.max_val.max() < 10 and "_cpu_plans" not in obs.__dict__

    class Vouched(quark.PerGroupMinMaxObserver):
        _step_overrides = ("check_input", "set_shape")

        def check_input(self, x):  # the shape alone: a plan may keep its answer
            return super().check_input(x)

    obs, twin = (Vouched(qspec) for _ in range(2))
    twin.cached_cpu_step = False
    for i in range(3):
        obs(g(i, 8, 64))
        twin(g(i, 8, 64))
        same(obs, twin)
    assert obs.__dict__["_cpu_plans"][1]
