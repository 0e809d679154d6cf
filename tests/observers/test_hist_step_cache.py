"""The cached CPU step of the histogram observers (observers/hist_step.py): a one-unit float32
batch's forward is one fused C call, its decisions kept per ``(shape, stride, dtype)`` of the
input and per spec object. Each check runs an observer beside a twin of the same class that
always takes the general path (``cached_cpu_step = False``) and compares every buffer (values,
dtype, shape, tensor version), the shape mirror, the errors and the ranges; the differential
property test draws sequences of batches (shapes, dtypes, growing and shrinking ranges, zeros,
NaN / inf under each ``non_finite`` policy, layout changes). Other tests check where the
cached call runs (counting calls of the general forward) and where it must not."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from state_checks import assert_same_buffers

import quantscope
from quantscope import Channel, QuantSpec, Tensor
from quantscope.observers import base as observer_base
from quantscope.observers.histogram import PercentileObserver
from quantscope.stats import hist_kernel

pytestmark = pytest.mark.skipif(hist_kernel._kernel() is None, reason="no compiled kernel")

NAMES = ("percentile", "histogram_mse", "entropy", "histogram", "mix")


def pair(name="percentile", spec=None, **options):
    """An observer and its general-path twin (the same class: the same errors' names)."""
    spec = QuantSpec("int8", Tensor()) if spec is None else spec
    obs = quantscope.get_observer(name, spec, **options)
    twin = quantscope.get_observer(name, spec, **options)
    twin.cached_cpu_step = False
    return obs, twin


def same_state(a, b, versions=True):
    assert_same_buffers(a, b, versions)
    assert a.shape == b.shape and a._pass[1] == b._pass[1]


def call(o, x):
    """``o(x)``: None, or the error's type and message."""
    try:
        o(x)
    except (TypeError, ValueError, RuntimeError) as e:
        return type(e), str(e)
    return None


def feed(obs, twin, xs):
    for x in xs:
        assert call(obs, x) == call(twin, x)
        same_state(obs, twin)


def ranges_equal(obs, twin):
    for o in (obs, twin):  # the state must be usable (no NaN / inf seen)
        o.check_ready(warn=False)
    a, b = obs.calculate_range(), twin.calculate_range()
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def g(seed, *shape, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


class CountGeneral:
    """Counts calls of the general forward (``Observer.forward``, which every histogram
    observer's ``forward`` reaches when the cached step does not take the call)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = observer_base.Observer.forward

        def spy(obs, x):
            self.calls += 1
            return real(obs, x)

        monkeypatch.setattr(observer_base.Observer, "forward", spy)


@pytest.mark.parametrize("name", NAMES)
def test_the_common_call_takes_the_cached_step(name, monkeypatch):
    """After the first batch (which sizes the state) a per-tensor float32 batch never runs
    the general forward, and the state is the general path's bit for bit."""
    obs, twin = pair(name)
    count = CountGeneral(monkeypatch)
    xs = [g(i, 8, 256, scale=1 + 0.1 * i) for i in range(6)]
    feed(obs, twin, xs)
    assert count.calls == 1 + len(xs)  # obs's first call, and every call of the twin
    ranges_equal(obs, twin)
    assert len(obs.__dict__["_hist_plans"][1]) == 1


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n", [1, 7, 256, 2048, 16384, 70000])
def test_sizes_growing_and_shrinking_ranges(symmetric, n):
    """Every size the fused pass takes (a short tail, the direct count, the copies, several
    threads' spans), ranges that grow (a new grid) and shrink (the grid stays)."""
    obs, twin = pair("percentile", QuantSpec("int8", Tensor(), symmetric=symmetric))
    scales = (1.0, 1.3, 0.2, 4.0, 1e-3, 40.0, 2.0, 1e4)
    feed(obs, twin, [g(i, n, scale=s) + (0.5 if i % 3 == 1 else 0.0)
                     for i, s in enumerate(scales)])
    ranges_equal(obs, twin)


def test_misses_run_the_general_path(monkeypatch):
    """A value outside the fused pass's window, NaN, inf: the C call writes nothing and the
    general path (its two-pass update, or its error record) runs: the same state."""
    obs, twin = pair("entropy")
    count = CountGeneral(monkeypatch)
    feed(obs, twin, [g(0, 512), g(1, 512, scale=1e6)])  # far outside the window
    assert count.calls == 4
    bad = g(2, 512)
    bad[5] = float("inf")
    feed(obs, twin, [g(3, 512), bad, g(4, 512)])
    assert bool(obs.seen_non_finite)
    with pytest.raises(ValueError, match="NaN or inf"):
        obs.calculate_qparams()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_miss_reads_the_batch_in_one_fused_call(dtype, monkeypatch):
    """A batch the fused pass misses (a range grown past its window, NaN, inf) takes one
    fused C call, the cached step's: the general path then runs its two-pass update, not its
    own fused attempt (the same call on the same batch and state: a second read to miss
    again, ~1.5x the batch's time). A hit is one call, as on the general path."""
    lib = hist_kernel._kernel()
    calls = []
    real = lib.qs_hist_fused
    monkeypatch.setattr(lib, "qs_hist_fused", lambda *a: calls.append(1) or real(*a))
    obs, twin = pair("percentile")
    feed(obs, twin, [g(0, 4096).to(dtype)])
    general = CountGeneral(monkeypatch)
    nan, inf = g(4, 4096), g(5, 4096)
    nan[7], inf[9] = float("nan"), float("-inf")
    for x, hit in [(g(1, 4096, scale=8.0), False), (g(2, 4096, scale=64.0), False),
                   (g(3, 4096, scale=40.0), True), (g(6, 4096, scale=30.0), True),
                   (nan, False), (inf, False)]:
        x = x.to(dtype)
        for o in (obs, twin):
            calls.clear()
            o(x)
            assert len(calls) == 1, (o.cached_cpu_step, hit)
        assert general.calls == (1 if hit else 2)  # obs's general path ran on a miss
        general.calls = 0
        same_state(obs, twin)
        assert obs._pass[0] is None  # (consumed)
    assert bool(obs.seen_non_finite)


@pytest.mark.parametrize("made_in_inference_mode", [True, False])
def test_an_error_leaves_the_general_paths_state(made_in_inference_mode):
    """An input the layout refuses (its check runs where the cached step plans a new input):
    the same error, and the general path's state: its forward leaves inference mode before
    its checks (buffers made under torch.inference_mode, as calibrate makes them, become
    normal tensors) and records the shape it read (``_pass[1]``) first."""
    spec = QuantSpec("int8", Channel(1))
    with torch.inference_mode(made_in_inference_mode):
        obs, twin = pair("percentile", spec)
    assert obs.hist_counts.is_inference() == made_in_inference_mode
    assert call(obs, g(0, 8)) == call(twin, g(0, 8)) is not None
    same_state(obs, twin)
    assert not obs.hist_counts.is_inference()


def test_not_taken_where_the_general_path_differs(monkeypatch):
    """float64, strided or empty input, several units, the first call, the reference
    grid, the EMA mode, skipped zeros, ignored NaN / inf, sync_every_step (mutant H23 of s50:
    only the 90 s distributed test saw it), an instance or class step, the setting off: each
    runs the general forward on every call."""
    count = CountGeneral(monkeypatch)

    class Overriding(PercentileObserver):
        def _observe(self, units, lo, hi):
            super()._observe(units, lo, hi)

    cases = [
        (pair("percentile"), [g(2, 8, 64).double(), g(3, 64, 8).t(), torch.zeros(0, 64)]),
        (pair("percentile", QuantSpec("int8", Channel(0))), [g(4, 8, 64), g(5, 8, 64)]),
        (pair("percentile", grid="first"), [g(6, 8, 64), g(7, 8, 64)]),
        (pair("percentile", averaging_constant=0.5), [g(8, 8, 64), g(9, 8, 64)]),
        (pair("percentile", skip_zeros=True), [g(10, 8, 64), g(11, 8, 64)]),
        (pair("percentile", non_finite="ignore"), [g(12, 8, 64), g(13, 8, 64)]),
    ]
    obs, twin = pair("percentile")
    obs.sync_every_step = twin.sync_every_step = True  # the step's exchange (one process here)
    cases.append(((obs, twin), [g(20, 8, 64), g(21, 8, 64, scale=0.5), torch.zeros(8, 64)]))
    obs = Overriding(QuantSpec())
    twin = Overriding(QuantSpec())
    twin.cached_cpu_step = False
    cases.append(((obs, twin), [g(14, 8, 64), g(15, 8, 64)]))
    obs, twin = pair("percentile")
    real = obs._record_non_finite
    obs._record_non_finite = lambda *a, **k: real(*a, **k)  # a spy given to the instance
    cases.append(((obs, twin), [g(16, 8, 64), g(17, 8, 64)]))
    for (obs, twin), xs in cases:
        before = count.calls
        feed(obs, twin, xs)
        assert count.calls - before == 2 * len(xs), type(obs).__name__
    obs, twin = pair("percentile")
    twin.cached_cpu_step = obs.cached_cpu_step = False
    feed(obs, twin, [g(18, 8, 64), g(19, 8, 64)])
    assert "_hist_plans" not in obs.__dict__


def test_a_strided_batch_of_a_planned_shape_is_read_as_its_own_values():
    """Plans are kept per ``(shape, stride, dtype)``: a batch of a planned contiguous shape
    that is a strided view (the first half of each row of a wider tensor) is no one block of
    memory, so it takes the general path and counts its own values, not the memory after its
    first row (the other half, here 100s)."""
    wide = g(1, 8, 128)
    wide[:, 64:] = 100.0  # the columns the view leaves out
    obs, twin = pair("percentile")
    feed(obs, twin, [g(0, 8, 64), wide[:, :64]])
    assert float(obs.max_vals.max()) < 100.0
    ranges_equal(obs, twin)


def test_a_first_grid_batch_inside_the_native_window_keeps_the_general_path(monkeypatch):
    """``grid="first"`` (torch.ao's linear grid, set by the first batch) is never the cached
    step's: its state (``hist_exp`` -126, ``hist_first`` 0) leaves the fused pass a window so
    small that ordinary values miss it, but an all-zero batch (a dead ReLU, a padding batch)
    lands in it, and a taken call would rebin the linear counts as a pow2 grid's (mutant H22
    of s50: a percentile range of +-0.95 where the general path keeps +-4.1)."""
    obs, twin = pair("percentile", grid="first")
    count = CountGeneral(monkeypatch)
    xs = [g(0, 8, 64), torch.zeros(8, 64), g(1, 8, 64, scale=0.5), torch.zeros(64)]
    feed(obs, twin, xs)
    assert count.calls == 2 * len(xs)
    assert bool(obs.linear_grid)
    ranges_equal(obs, twin)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_batches_of_one_piece_take_the_cached_step(dtype, monkeypatch):
    """bf16 / fp16 batches up to HALF_PIECE values: the cached step reads their float32 copy
    (as fused_update does on the general path); larger ones take the general path."""
    obs, twin = pair("histogram")
    count = CountGeneral(monkeypatch)
    xs = [g(i, 8, 256, scale=1 + 0.3 * i).to(dtype) for i in range(5)]
    xs[2].view(-1)[:3] = torch.tensor([0.0, -0.0, 1e-7], dtype=dtype)
    feed(obs, twin, xs + [g(9, 8, 256).to(dtype).requires_grad_()])
    assert count.calls == 1 + len(xs) + 1
    ranges_equal(obs, twin)
    monkeypatch.setattr(hist_kernel, "HALF_PIECE", 1000)
    before = count.calls
    feed(obs, twin, [g(10, 8, 256).to(dtype)])
    assert count.calls - before == 2


def test_errors_after_the_plan_is_cached():
    obs, twin = pair("percentile", QuantSpec("int8", Channel(0)))
    feed(obs, twin, [g(0, 8, 32)] * 2)
    # a per-channel state of one unit (sized by (1, E) batches, the cached step's), then
    # (8, E): the general path's "unit count changed" error, nothing counted (mutant H01)
    obs, twin = pair("percentile", QuantSpec("int8", Channel(0)))
    feed(obs, twin, [g(0, 1, 32), g(1, 1, 32)])
    assert call(obs, g(2, 8, 32)) == call(twin, g(2, 8, 32)) is not None
    same_state(obs, twin)
    # per-tensor (8, E) batches, then a per-channel spec: under it the last shape held 8
    # units, the state 1, so a (1, E) batch is the same error (mutant H05)
    obs, twin = pair("percentile")
    feed(obs, twin, [g(0, 8, 32)] * 2)
    for o in (obs, twin):
        o.spec = QuantSpec("int8", Channel(0))
    assert call(obs, g(3, 1, 32)) == call(twin, g(3, 1, 32)) is not None
    same_state(obs, twin)
    obs, twin = pair("histogram")
    feed(obs, twin, [g(0, 8, 32)] * 2)
    assert "_hist_plans" in obs.__dict__
    for x in (torch.zeros(8, 32, dtype=torch.int32), g(2, 8, 32).to_sparse(), [1.0],
              torch.full((8, 32), 1e300, dtype=torch.float64)):
        assert call(obs, x) is not None
        assert call(obs, x) == call(twin, x)
        same_state(obs, twin)
    for o in (obs, twin):  # bins past max_hist_bytes (the state still of 2048): _check_size
        o.bins = 1 << 30
    assert call(obs, g(5, 8, 32)) == call(twin, g(5, 8, 32)) is not None
    for o in (obs, twin):
        o.bins = 2048
    feed(obs, twin, [g(6, 8, 32)])
    for o in (obs, twin):  # a spec whose layout refuses the shape (plans follow the spec)
        o.spec = QuantSpec("int8", Channel(2))
    assert call(obs, g(3, 8, 32)) == call(twin, g(3, 8, 32)) is not None
    for o in (obs, twin):  # the state on another device than the input
        o.spec = QuantSpec("int8", Tensor())
        o.to("meta")
    assert call(obs, g(4, 8, 32)) == call(twin, g(4, 8, 32)) is not None


def test_inference_mode_and_grad_input():
    obs, twin = pair("percentile")
    with torch.inference_mode():
        feed(obs, twin, [g(0, 8, 32), g(1, 8, 32, scale=3)])
    x = g(2, 8, 32, scale=5).requires_grad_()
    feed(obs, twin, [x, g(3, 8, 32), torch.nn.Parameter(g(4, 8, 32))])
    assert not obs.hist_counts.is_inference() and not obs.min_vals.is_inference()
    ranges_equal(obs, twin)


def test_reset_load_and_copies():
    """A reset (the state emptied), a loaded state and a copy: the cached step resumes on
    the state it finds, and a copy or a saved observer carries no cache."""
    from quantscope.observers import step_cache

    obs, twin = pair("percentile")
    feed(obs, twin, [g(0, 4, 64), g(1, 4, 64)])
    obs.reset(), twin.reset()
    feed(obs, twin, [g(2, 4, 64, scale=7), g(3, 4, 64)])
    fresh, fresh_twin = pair("percentile")
    fresh.load_state_dict(obs.state_dict()), fresh_twin.load_state_dict(obs.state_dict())
    feed(fresh, fresh_twin, [g(4, 4, 64, scale=2), g(5, 4, 64)])
    ranges_equal(fresh, fresh_twin)
    clone = copy.deepcopy(obs)
    assert not set(step_cache.CACHES) & set(clone.__dict__)
    saved = io.BytesIO()
    torch.save(obs, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert not set(step_cache.CACHES) & set(loaded.__dict__)
    clone(g(6, 4, 64, scale=50))
    assert float(clone.max_vals) > float(obs.max_vals)
    feed(obs, twin, [g(7, 4, 64)])


def test_plans_are_bounded():
    from quantscope.observers import step_cache

    obs, twin = pair("percentile")
    feed(obs, twin, [g(i, 4, 32 + i) for i in range(step_cache.MAX_PLANS + 3)])
    assert len(obs.__dict__["_hist_plans"][1]) <= step_cache.MAX_PLANS


def test_compiled_and_fake_mode_take_the_general_path():
    """Under torch.compile and FakeTensorMode no C call runs (the general path traces)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    obs, twin = pair("percentile")
    feed(obs, twin, [g(0, 4, 64)] * 2)
    torch._dynamo.reset()
    step = torch.compile(obs, fullgraph=True, backend="eager")
    for i in range(3):
        x = g(1 + i, 4, 64, scale=2)
        step(x)
        twin(x)
    same_state(obs, twin, versions=False)  # (compiled, the shape is copied in every call)
    with FakeTensorMode(allow_non_fake_inputs=True) as fm:
        probe = quantscope.get_observer("percentile", QuantSpec())
        for i in range(3):  # the state sized by the first: then the cached step's checks
            probe(fm.from_tensor(g(5 + i, 4, 64)))
    assert "_hist_plans" not in probe.__dict__  # no plan: the context refused the kernel


# ------------------------------------------------------------------ the differential property
_SHAPES = [(1,), (7,), (256,), (8, 32), (2, 3, 40), (2048,), (64, 256), (1, 300), (1, 2048)]
_DTYPES = [torch.float32] * 4 + [torch.bfloat16, torch.float16, torch.float64]


@st.composite
def batches(draw):
    shape = draw(st.sampled_from(_SHAPES))
    dtype = draw(st.sampled_from(_DTYPES))
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from([0.0, 1e-4, 0.5, 1.0, 1.05, 1.1, 3.0, 100.0, 1e5]))
    shift = draw(st.sampled_from([0.0, 0.0, 0.25, -2.0]))
    x = g(seed, *shape, scale=scale) + shift
    kind = draw(st.sampled_from(["plain"] * 6 + ["zeros", "signed zeros", "nan", "inf",
                                                 "-inf", "strided", "constant"]))
    if kind == "zeros":
        x.view(-1)[:: max(1, x.numel() // 5)] = 0.0
    elif kind == "signed zeros":
        x.view(-1)[::2] = 0.0
        x.view(-1)[1::3] = -0.0
    elif kind in ("nan", "inf", "-inf"):
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = float(kind)
    elif kind == "constant":
        x = torch.full(shape, float(draw(st.sampled_from([0.0, -3.0, 1e-3]))))
    x = x.to(dtype)
    if kind == "strided" and x.dim() >= 2:
        x = x.transpose(0, -1)
    return x


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(NAMES), symmetric=st.booleans(),
       layout=st.sampled_from([Tensor(), Tensor(), Channel(0)]),
       non_finite=st.sampled_from(["error", "ignore"]), bins=st.sampled_from([128, 300, 2048]),
       xs=st.lists(batches(), min_size=1, max_size=8))
def test_cached_and_general_paths_agree(name, symmetric, layout, non_finite, bins, xs):
    """Per channel, a (1, E) batch is one unit (the cached step), others several (the
    general path), and a changed unit count is an error on both."""
    obs, twin = pair(name, QuantSpec("int8", layout, symmetric=symmetric),
                     non_finite=non_finite, bins=bins)
    feed(obs, twin, xs)
    try:
        want = twin.calculate_range()
    except ValueError as e:  # NaN / inf seen, too large a |x|: the same error
        with pytest.raises(ValueError, match=re.escape(str(e))):
            obs.calculate_range()
        return
    got = obs.calculate_range()
    assert all(torch.equal(p, q) for p, q in zip(got, want))
