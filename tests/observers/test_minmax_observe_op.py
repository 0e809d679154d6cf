"""``quantscope::minmax_observe``: an accumulating min-max observer's whole ``forward`` off
the CPU as one op (one dispatch where the min / max, the non-finite check and the state
update took three: on a GPU an observer call's host time is mostly dispatch).

The op's CPU implementation must give, state for state, what the observer's general path
gives (the same min / max, non-finite flag, update and token count); the observers must
call it with their own update, constant and token count; its Triton implementation is
tested bitwise against the CPU one under the interpreter
(tests/kernels/test_triton_minmax_observe.py).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from op_names import OpNames

import quantscope
from quantscope import QuantSpec
from quantscope.layout import Channel, Group, Tensor, Tile
from quantscope.observers.base import tokens_of
from quantscope.stats import minmax

ACCUMULATING = {"static_minmax": ("min", 0.0), "minmax": ("ema", 0.01),
                "moving_average_minmax": ("ema", 0.01)}
LAYOUTS = [(Tensor(), (4, 16, 32)), (Channel(0), (32, 64)), (Channel(1), (4, 16, 32)),
           (Channel(-1), (4, 16, 32)), (Group(16), (8, 64)), (Tile(8, 16), (2, 32, 64))]


def _batch(shape, dtype, seed, bad=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * (seed % 5 + 0.5)
    if bad is not None:
        x.view(-1)[seed % x.numel()] = bad
    return x.to(dtype)


def _by_op(name, spec, batches, **kwargs):
    """The observer's state after ``batches``, its later calls made by the op's CPU
    implementation with the arguments the observer passes off the CPU."""
    obs = quantscope.get_observer(name, spec, **kwargs)
    obs(batches[0])  # the first call sizes the state
    kind, c = obs.state_update, getattr(obs, "averaging_constant", 0.0)
    for x in batches[1:]:
        minmax.minmax_observe(minmax.op_units(x, spec.layout), obs.min_vals, obs.max_vals,
                              obs.seen_non_finite, obs.observed_tokens, minmax.UPDATES[kind],
                              c, tokens_of(x))
    return obs


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(ACCUMULATING)), case=st.sampled_from(range(len(LAYOUTS))),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seeds=st.lists(st.integers(0, 10**6), min_size=2, max_size=4),
       c=st.sampled_from([0.01, 0.25, 1.0]),
       bad=st.sampled_from([None, float("nan"), float("inf"), float("-inf")]))
def test_the_op_is_the_observers_step(name, case, dtype, seeds, c, bad):
    layout, shape = LAYOUTS[case]
    spec = QuantSpec("int8", layout)
    kwargs = {} if name == "static_minmax" else {"averaging_constant": c}
    batches = [_batch(shape, dtype, s, bad if i == len(seeds) - 1 else None)
               for i, s in enumerate(seeds)]
    ref = quantscope.get_observer(name, spec, **kwargs)
    for x in batches:
        ref(x)
    got = _by_op(name, spec, batches, **kwargs)
    for key, value in ref.state_dict().items():
        mine = got.state_dict()[key]
        assert torch.equal(value.isnan(), mine.isnan()), key
        assert torch.equal(value.nan_to_num(), mine.nan_to_num()), key


@pytest.mark.parametrize("kind", sorted(minmax.UPDATES.values()))
@pytest.mark.parametrize("units", [torch.randn(6, 40), torch.randn(2, 3, 4, 5)],
                         ids=["rows", "4-D"])
def test_opcheck(kind, units):
    n = minmax.op_unit_count(units)
    args = (units, torch.zeros(n), torch.ones(n), torch.zeros((), dtype=torch.bool),
            torch.zeros((), dtype=torch.int64), kind, 0.25, 7)
    torch.library.opcheck(minmax.minmax_observe, args)


def test_bad_arguments_are_named():
    units, n = torch.randn(6, 40), 6
    good = [units, torch.zeros(n), torch.ones(n), torch.zeros((), dtype=torch.bool),
            torch.zeros((), dtype=torch.int64), 1, 0.0, 3]
    for i, bad, match in [(0, torch.randn(6), "units must be"),
                          (0, torch.zeros(6, 40, dtype=torch.int32), "units must be"),
                          (1, torch.zeros(5), "state_lo must be"),
                          (2, torch.zeros(n, dtype=torch.float64), "state_hi must be"),
                          (3, torch.zeros(()), "seen must be"),
                          (4, torch.zeros((), dtype=torch.int32), "tokens must be"),
                          (5, 9, "kind must be")]:
        args = list(good)
        args[i] = bad
        with pytest.raises(ValueError, match=match):
            minmax.minmax_observe(*args)


@pytest.mark.parametrize("name", sorted(ACCUMULATING))
@pytest.mark.parametrize("layout, shape", LAYOUTS, ids=lambda v: str(v))
def test_off_the_cpu_an_accumulating_observer_calls_the_op_once(name, layout, shape):
    """After the call that sizes the state: one dispatched ``quantscope::`` op, with the
    observer's own update, constant and token count, and no float32 copy of a bf16 input."""
    obs = quantscope.get_observer(name, QuantSpec("int8", layout)).to("meta")
    x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    obs(x)
    calls = []

    class Args(OpNames):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func.overloadpacket) == "quantscope.minmax_observe":
                calls.append(args[5:])
            return super().__torch_dispatch__(func, types, args, kwargs)

    with Args() as seen:
        obs(x)
    assert [n for n in seen.names if n.startswith("quantscope.")] == ["quantscope.minmax_observe"]
    assert "aten._to_copy" not in seen.names
    kind, c = ACCUMULATING[name]
    assert calls == [(minmax.UPDATES[kind], c, tokens_of(x))]


def test_a_changed_unit_count_still_raises():
    obs = quantscope.get_observer("static_minmax", QuantSpec("int8", Channel(-1))).to("meta")
    obs(torch.empty(4, 32, device="meta"))
    with pytest.raises(ValueError, match="unit count must not change"):
        obs(torch.empty(4, 16, device="meta"))
