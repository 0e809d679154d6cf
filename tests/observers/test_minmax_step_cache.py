"""The cached CPU step of the accumulating min-max observers (observers/minmax_step.py):
its decisions are kept per ``(shape, stride, dtype)`` of the input and per spec object, so a
call whose input differs in any of them, or whose observer changed (device, settings, spec),
must give the general path's state and raise its errors. Each check runs one observer
through a sequence of inputs beside a twin that always takes the general path; a cache keyed
on less (no stride, no dtype, the number of elements for the shape, not following the spec)
reads the memory wrongly or skips a check, and fails here."""

from __future__ import annotations

import pytest
import torch
from state_checks import assert_same_buffers

from quantscope import Channel, QuantSpec, Tensor, Token
from quantscope.observers import MovingAverageMinMaxObserver, StaticMinMaxObserver
from quantscope.stats import minmax as stats

pytestmark = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")


class GeneralStatic(StaticMinMaxObserver):
    def _observe(self, units, lo, hi):  # an override of a step: never the cached call
        super()._observe(units, lo, hi)


class GeneralEMA(MovingAverageMinMaxObserver):
    def _observe(self, units, lo, hi):
        super()._observe(units, lo, hi)


def pair(layout, ema):
    spec = QuantSpec("int8", layout)
    if ema:
        return MovingAverageMinMaxObserver(spec, averaging_constant=0.3), GeneralEMA(
            spec, averaging_constant=0.3)
    return StaticMinMaxObserver(spec), GeneralStatic(spec)


def same_state(a, b):
    assert_same_buffers(a, b, versions=False)
    assert a.shape == b.shape


def g(seed, *shape, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def feed(obs, twin, xs):
    for x in xs:
        obs(x)
        twin(x)
        same_state(obs, twin)


@pytest.mark.parametrize("ema", [False, True], ids=["static", "ema"])
def test_stride_and_dtype_changes_under_one_shape(ema):
    """(8, 32) contiguous, then a transposed (8, 32) view, bf16 and fp16 of it: the same
    shape, read as other memory; a key without stride or dtype reads them as the first."""
    for layout in (Tensor(), Channel(0), Token()):
        obs, twin = pair(layout, ema)
        xs = [g(0, 8, 32), g(1, 32, 8, scale=5).t(), g(2, 8, 32, scale=3).bfloat16(),
              g(3, 8, 32, scale=7).half(), g(4, 8, 32), g(5, 32, 8, scale=9).t().contiguous()]
        feed(obs, twin, xs * 2)
        assert len(obs.__dict__["_cpu_plans"][1]) >= 4  # the cached call ran


@pytest.mark.parametrize("ema", [False, True], ids=["static", "ema"])
def test_shape_changes_with_one_unit_count(ema):
    """Per tensor every shape has one unit; per channel (8, E) keeps 8: the elements per
    unit change (a key on the unit count alone reads the wrong length)."""
    obs, twin = pair(Tensor(), ema)
    feed(obs, twin, [g(0, 8, 32), g(1, 8, 16, scale=4), g(2, 4, 64, scale=9), g(3, 8, 32)] * 2)
    obs, twin = pair(Channel(0), ema)
    feed(obs, twin, [g(0, 8, 32), g(1, 8, 16, scale=4), g(2, 8, 4, 4, scale=9), g(3, 8, 32)])


def test_errors_after_the_plan_is_cached():
    obs, twin = pair(Channel(0), False)
    feed(obs, twin, [g(0, 8, 32)] * 2)
    for o in (obs, twin):
        with pytest.raises(TypeError, match="floating-point"):
            o(torch.zeros(8, 32, dtype=torch.int32))
        with pytest.raises(ValueError, match="unit count must not change"):
            o(g(1, 16, 32))
        with pytest.raises(TypeError, match="dense"):
            o(g(2, 8, 32).to_sparse())
    same_state(obs, twin)
    # a float64 batch past float32's range: its range check reads values (general path)
    for o in (obs, twin):
        with pytest.raises(ValueError):
            o(torch.full((8, 32), 1e300, dtype=torch.float64))
    feed(obs, twin, [g(3, 8, 32, scale=2).double()])


def test_spec_change_follows_the_new_layout():
    """The plans follow the spec object: a spec whose layout refuses the shape raises."""
    obs, twin = pair(Channel(0), False)
    feed(obs, twin, [g(0, 8, 32)] * 2)
    for o in (obs, twin):
        o.spec = QuantSpec("int8", Channel(2))
        with pytest.raises(ValueError, match="Channel"):
            o(g(1, 8, 32))


def test_state_moved_or_settings_changed():
    obs, twin = pair(Tensor(), False)
    feed(obs, twin, [g(0, 8, 32)] * 2)
    for o in (obs, twin):  # the state on another device than the input
        o.to("meta")
        with pytest.raises(ValueError, match="observer's state on meta"):
            o(g(1, 8, 32))
    obs, twin = pair(Tensor(), False)
    feed(obs, twin, [g(0, 8, 32)] * 2)
    bad = g(1, 8, 32)
    bad[2, 3] = float("nan")
    for o in (obs, twin):
        o.non_finite = "ignore"  # NaN read as zero and counted, not recorded
    feed(obs, twin, [bad])
    assert not bool(obs.seen_non_finite) and int(obs.non_finite_count) == 1
    for o in (obs, twin):
        o.non_finite = "error"
    feed(obs, twin, [bad, g(2, 8, 32)])
    assert bool(obs.seen_non_finite)


def test_inference_mode_state_and_grad_input():
    obs, twin = pair(Channel(0), True)
    with torch.inference_mode():
        feed(obs, twin, [g(0, 8, 32)] * 2)
    x = g(1, 8, 32).requires_grad_()
    feed(obs, twin, [x, g(2, 8, 32)])
    assert not obs.min_vals.is_inference()


@pytest.mark.parametrize("ema", [False, True], ids=["static", "ema"])
def test_an_error_leaves_inference_mode_as_the_general_path(ema):
    """Buffers made under torch.inference_mode (as calibrate makes them), then outside it an
    input the layout refuses (its check runs where the cached step plans a new input): the
    same error, and the general path's state, whose forward leaves inference mode before
    its checks (the buffers normal tensors, not inference ones)."""
    cls = MovingAverageMinMaxObserver if ema else StaticMinMaxObserver
    with torch.inference_mode():
        obs, twin = cls(QuantSpec("int8", Channel(1))), cls(QuantSpec("int8", Channel(1)))
    twin.cached_cpu_step = False  # (the same class: the same message)
    errors = []
    for o in (obs, twin):
        with pytest.raises(ValueError, match="out of range") as err:
            o(g(0, 8))
        errors.append(str(err.value))
    assert errors[0] == errors[1]
    same_state(obs, twin)
    for name, buf in obs._buffers.items():
        assert not buf.is_inference() and not twin._buffers[name].is_inference(), name


def test_copies_and_saved_observers_carry_no_cache():
    """A copy gets no cache of its original's (its ends' address is the original's memory,
    which the copy would write into after the original is freed), nor does a saved and
    loaded observer."""
    import copy
    import io

    obs = StaticMinMaxObserver(QuantSpec("int8", Tensor()))
    for _ in range(2):
        obs(torch.randn(4, 64))
    assert "_cpu_plans" in obs.__dict__  # the cached step ran
    twin = copy.deepcopy(obs)
    assert not {"_cpu_plans", "_cpu_ends"} & set(twin.__dict__)
    twin(torch.full((4, 64), 9.0))
    assert twin.max_vals.item() == 9.0 and obs.max_vals.item() < 9.0
    buf = io.BytesIO()
    torch.save(obs, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert not {"_cpu_plans", "_cpu_ends"} & set(loaded.__dict__)
    assert torch.equal(loaded.max_vals, obs.max_vals)


def test_a_copys_cached_step_records_its_own_nan():
    """The copy's ends are its own: a NaN batch on a deep copy of a memoryless observer whose
    cached step ran is recorded there (a carried ends view would read the original's memory,
    stale floats, and miss it)."""
    import copy

    from quantscope.observers import MemorylessMinMaxObserver

    obs = MemorylessMinMaxObserver(QuantSpec("int8", Channel(0)))
    for s in range(3):  # sized, then the cached step
        obs(torch.randn(8, 64, generator=torch.Generator().manual_seed(s)))
    twin = copy.deepcopy(obs)
    x = torch.randn(8, 64)
    twin(x.clone())
    x[2, 5] = float("nan")
    twin(x)
    assert bool(twin.seen_non_finite) and not bool(obs.seen_non_finite)


@pytest.mark.parametrize("ema", [False, True], ids=["static", "ema"])
def test_a_step_given_to_an_instance_runs(ema):
    """A step replaced on the instance (a test's spy) runs on every call: the cached step
    stands for the class's steps only."""
    obs, twin = pair(Tensor(), ema)
    calls = []
    real = obs._record_non_finite
    obs._record_non_finite = lambda *a, **k: calls.append(1) or real(*a, **k)
    feed(obs, twin, [g(i, 4, 64) for i in range(3)])
    assert len(calls) == 3


def test_cached_cpu_step_false_keeps_the_general_path():
    obs, twin = pair(Tensor(), False)
    obs.cached_cpu_step = False
    feed(obs, twin, [g(i, 4, 64) for i in range(3)])
    assert "_cpu_plans" not in obs.__dict__  # never looked up


@pytest.mark.parametrize("ema", [False, True], ids=["static", "ema"])
def test_the_general_paths_fused_update_keeps_no_per_unit_pair(ema, monkeypatch):
    """On the general path (``cached_cpu_step = False``) an accumulating observer's C pass
    fuses its state update and, given the ends, writes no per-unit min / max (stats'
    ``unit_minmax`` returns None for them): the state equals the torch path's (the kernel
    hidden), NaN recorded alike, and no scratch pair is kept: the first call's became the
    state, uncopied (one was kept, never written again: memory the size of the state)."""
    spec = QuantSpec("int8", Channel(0))
    xs = [g(i, 300, 40, scale=1 + i) for i in range(3)] + [g(9, 300, 40)]
    xs[-1][5, 7] = float("nan")
    obs, ref = pair(Channel(0), ema)[0], pair(Channel(0), ema)[0]
    assert obs.spec == spec
    obs.cached_cpu_step = ref.cached_cpu_step = False
    obs(xs[0])
    assert "_scratch" not in obs.__dict__  # the state took the first call's pair
    for x in xs[1:]:
        obs(x)
        assert "_scratch" not in obs.__dict__  # nor made again: the update is fused
    with monkeypatch.context() as m:
        m.setattr(stats, "_kernel", lambda: None)
        for x in xs:
            ref(x)
    for name in ("min_vals", "max_vals"):  # (NaN's sign bit aside: C's and torch's differ)
        assert torch.equal(getattr(obs, name).nan_to_num(7.0), getattr(ref, name).nan_to_num(7.0))
    assert bool(obs.seen_non_finite) and bool(ref.seen_non_finite)
    units = xs[0].reshape(300, 40)
    lo, hi = stats.unit_minmax(units, None, torch.empty(2),
                               ("min", 0.0, obs.min_vals.clone(), obs.max_vals.clone()))
    assert lo is None and hi is None


@pytest.mark.parametrize("ema", [False, True], ids=["static", "ema"])
def test_the_cached_steps_keep_no_scratch_pair(ema):
    """Review s55: an accumulating observer's cached C step fuses its update (lo / hi NULL),
    yet the first call's scratch pair was kept for the observer's life (the state's size in
    memory, never written again); now the state is that pair, and the state the same."""
    obs, ref = pair(Channel(0), ema)[0], pair(Channel(0), ema)[0]
    ref.cached_cpu_step = False
    for i in range(4):
        x = g(i, 4096, 256, scale=1 + i)
        obs(x)
        ref(x)
        assert "_scratch" not in obs.__dict__, i
    assert torch.equal(obs.min_vals, ref.min_vals) and torch.equal(obs.max_vals, ref.max_vals)
