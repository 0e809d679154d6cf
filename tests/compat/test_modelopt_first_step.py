"""ModelOpt's ``HistogramCalibrator`` on its cached CPU step (observers/first_step.py): a
one-unit CPU batch on the first batch's ``[0, max |x|]`` grid is the C min / max pass, the
grid's growth and one C histc of ``|x|`` (``qs_ao_histc64``), its decisions kept per input.
Each check runs a calibrator beside a twin that always takes the general path
(``cached_cpu_step = False``) and compares every buffer (values bit for bit, dtype, shape,
tensor version), the grown grid, ModelOpt's ``_calib_hist`` / ``_calib_bin_edges``, every
``compute_amax`` method and the errors; the property test draws batch sequences (sizes,
float32 / bf16 / fp16 / integer batches, fixed, growing and shrinking ranges, growth past
``GROW_LIMIT``, zeros, -0.0, NaN / inf through ``collect`` and ``forward``). Others check where
the cached call runs (counting calls of the general forward), inference mode, copies and the
min / max update (the kernel: tests/kernels/test_ao_histc64.py)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantscope import kernels
from quantscope.compat.modelopt import HistogramCalibrator
from quantscope.observers import base as observer_base

pytestmark = pytest.mark.skipif(kernels.lib("ao_hist") is None, reason="no compiled kernel")


def pair(**options):
    cal, twin = HistogramCalibrator(**options), HistogramCalibrator(**options)
    twin.cached_cpu_step = False
    return cal, twin


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32,
                                8: torch.int64}[t.element_size()])


def same(a, b) -> None:
    """Every buffer bit for bit (and its version), the grid and what ModelOpt reads."""
    assert set(a._buffers) == set(b._buffers)
    for name, buf in a._buffers.items():
        other = b._buffers[name]
        assert buf.shape == other.shape and buf.dtype == other.dtype, name
        assert torch.equal(bits(buf), bits(other)), name
        assert buf._version == other._version, (name, buf._version, other._version)
    assert a._last_shape == b._last_shape and a._pass[1] == b._pass[1]
    for name in ("_grown_top", "_grown_edge"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None) and (x is None or torch.equal(bits(x), bits(y))), name
    for name in ("_calib_hist", "_calib_bin_edges"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None) and (x is None or torch.equal(bits(x), bits(y))), name


def amaxes(cal) -> list:
    out = []
    for method, kw in (("percentile", {"percentile": 99.9}), ("percentile", {}),
                       ("mse", {"start_bin": 1}), ("entropy", {"start_bin": 1})):
        out.append(outcome(lambda m=method, k=kw: cal.compute_amax(m, **k)))
    return out


def outcome(fn):
    """``fn()``'s value (a tensor as its dtype and bits) or its error (type and message)."""
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - the error is the outcome compared
        return type(e), str(e)
    return value if not isinstance(value, torch.Tensor) else (value.dtype, bits(value).tolist())


def feed(cal, twin, x, how: str) -> None:
    """``x`` into both (``collect`` or ``forward``): the same outcome, the same state."""
    results = [outcome(lambda o=o: o.collect(x) if how == "collect" else o(x).shape)
               for o in (cal, twin)]
    assert results[0] == results[1]
    same(cal, twin)


BATCH = st.tuples(
    st.sampled_from([1, 7, 16, 33, 256, 1000, 4096, 70000]),  # elements
    st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16, torch.int8]),
    st.sampled_from([1.0, 1.0, 0.5, 1.3, 3.0, 40.0, 200.0, 0.0]),  # scale of the last batch
    st.sampled_from(["none", "none", "none", "nan", "inf", "zeros", "negzero", "pos0",
                     "posneg0"]),
    st.sampled_from(["collect", "collect", "forward"]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bins=st.sampled_from([16, 128, 2048]), seed=st.integers(0, 2**16),
       batches=st.lists(BATCH, min_size=1, max_size=8), threads=st.sampled_from([1, 2]))
def test_cached_step_equals_the_general_path(bins, seed, batches, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cal, twin = pair(num_bins=bins)
        g = torch.Generator().manual_seed(seed)
        scale = 1.0
        for n, dtype, grow, bad, how in batches:
            scale = scale * grow if grow else 1.0
            x = torch.randn(n, generator=g) * scale
            if bad == "zeros":
                x.zero_()
            elif bad == "negzero":
                x[::3] = -0.0
            elif bad in ("pos0", "posneg0"):  # a min of 0.0 or -0.0: ties with the state's
                x = x.abs()
                x[::4] = 0.0 if bad == "pos0" else -0.0
            elif bad in ("nan", "inf") and dtype.is_floating_point:
                x[n // 2] = float(bad)
            x = x.clamp(-100, 100).round().to(dtype) if dtype == torch.int8 else x.to(dtype)
            if dtype == torch.int8 and how == "forward":
                how = "collect"  # (forward takes floating-point batches)
            feed(cal, twin, x, how)
        assert amaxes(cal) == amaxes(twin)
    finally:
        torch.set_num_threads(before)


def test_growth_past_the_limit_and_shapes():
    cal, twin = pair(num_bins=16)
    g = torch.Generator().manual_seed(0)
    for scale, shape in ((1.0, (2, 8, 64)), (1.0, (2, 8, 64)), (5.0, (4, 64)), (0.1, (1024,)),
                         (500.0, (2, 8, 64)), (2.0, (2, 8, 64)), (3000.0, (7,))):
        feed(cal, twin, torch.randn(shape, generator=g) * scale, "collect")
    assert not cal._linear  # moved to the native grid past GROW_LIMIT x bins, as the twin
    assert amaxes(cal) == amaxes(twin)


def test_non_finite_batches_as_documented():
    """collect: a first NaN / inf batch is ModelOpt's RuntimeError, a later inf its
    OverflowError, a later NaN a ValueError, the state as it was; forward records it, and
    compute_amax refuses it."""
    for how, bad, error in (("collect", "inf", OverflowError), ("collect", "nan", ValueError)):
        cal, twin = pair()
        x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))
        feed(cal, twin, x, how)
        y = x.clone()
        y[0, 0, 0] = float(bad)
        with pytest.raises(error):
            cal.collect(y)
        feed(cal, twin, y, how)
    cal, twin = pair()
    feed(cal, twin, x, "forward")
    feed(cal, twin, y, "forward")
    assert bool(cal.seen_non_finite)
    with pytest.raises(ValueError):
        cal.compute_amax("percentile")


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
@pytest.mark.parametrize("first", [[1.0, 2.0], [1e37, -2e36]])
def test_forward_records_a_later_non_finite_batch(bad, first):
    """forward of a later batch holding NaN / inf, on the cached step and the general path:
    recorded, and qparams() / compute_amax() refuse it with a ValueError (the module doc, and
    the code before the end-past-float32 check, which had raised its RuntimeError for inf)."""
    cal, twin = pair(num_bins=16)
    feed(cal, twin, torch.tensor(first), "collect")
    x = torch.tensor([bad, 1.0])
    for o in (cal, twin):
        assert o(x) is x  # recorded, not raised
    same(cal, twin)
    for o in (cal, twin):
        assert bool(o.seen_non_finite)
        for method in ("percentile", "mse", "entropy"):
            with pytest.raises(ValueError, match="observed NaN or inf"):
                o.compute_amax(method, start_bin=1)
        with pytest.raises(ValueError, match="observed NaN or inf"):
            o.qparams()


def test_a_grid_grown_past_float32_is_modelopts_error_with_nothing_changed():
    """A batch whose grown grid ends past float32's range (ModelOpt's ``arange(0, max |x| +
    width, width)``, data near its max): ModelOpt's RuntimeError, raised before anything
    changes, by the cached step and the general path alike, collect and forward (the counts
    had grown to the batch's 544 bins on the old grid, and the general path's min / max to it,
    silently: a later batch binned at the wrong width); later batches bin as if it never
    came. Past GROW_LIMIT too (ModelOpt raises there as well)."""
    first, huge = torch.tensor([1e37, -2e36, 5e36]), torch.tensor([3.4e38, -1.0, 2.0])
    cal, twin = pair(num_bins=16)
    never = HistogramCalibrator(num_bins=16)  # ModelOpt's histogram after the error
    for o in (cal, twin, never):
        o.collect(first)
    before = {k: (bits(b).clone(), b._version) for k, b in cal._buffers.items()}
    for how in ("collect", "forward"):
        for o in (cal, twin):
            with pytest.raises(RuntimeError, match="^unsupported range: 0 -> inf"):
                o.collect(huge) if how == "collect" else o(huge)
        same(cal, twin)
        assert {k: (bits(b), b._version) for k, b in cal._buffers.items()}.keys() == before.keys()
        for k, b in cal._buffers.items():
            assert torch.equal(bits(b), before[k][0]) and b._version == before[k][1], k
        assert cal._grown_top is None and cal.hist_counts.shape == (1, 16)
    for x in (torch.tensor([2e37, 3e36, 1.0]), torch.tensor([5e36, -3e36, 2.0])):
        feed(cal, twin, x, "collect")
        never.collect(x)
    for name in ("_calib_hist", "_calib_bin_edges", "min_vals", "max_vals"):
        assert torch.equal(getattr(cal, name), getattr(never, name)), name
    assert amaxes(cal) == amaxes(never)
    top = torch.finfo(torch.float32).max  # + width 6.25e31 rounds to inf; 5e6 bins needed
    tiny, twin = pair(num_bins=16)
    feed(tiny, twin, torch.tensor([1e33, 2.0e32, 0.0]), "collect")
    for o in (tiny, twin):
        with pytest.raises(RuntimeError, match="unsupported range"):
            o.collect(torch.tensor([top, 1.0, 0.0]))
    same(tiny, twin)
    assert tiny._linear  # not moved to the native grid


@pytest.mark.parametrize(("first", "huge"), [
    ([1.0, 0.5], torch.finfo(torch.float32).max),  # 5.4e39 bins of 1/16; the end is finite
    ([1e-3, 2e-4], 1e38),
    ([1e-40, 3e-41], 0.5)])  # a subnormal first grid, then normal data
def test_a_bin_count_past_float32_is_modelopts_overflow_error_with_nothing_changed(first, huge):
    """A finite batch whose bin count ceil(max |x| / width) is past float32's range on a first
    grid of a positive width: ModelOpt's OverflowError (its int(inf)), raised before
    anything changes, by the cached step and the general path, collect and forward (the grid
    had moved to the power-of-two one, whose last edge read inf: amax 3.19e38); later
    batches bin as if it never came."""
    cal, twin = pair(num_bins=16)
    never = HistogramCalibrator(num_bins=16)
    for o in (cal, twin, never):
        o.collect(torch.tensor(first))
    before = {k: (bits(b).clone(), b._version) for k, b in cal._buffers.items()}
    x = torch.tensor([huge, first[1]])
    for how in ("collect", "forward"):
        for o in (cal, twin):
            with pytest.raises(OverflowError, match="^cannot convert float infinity to integer"):
                o.collect(x) if how == "collect" else o(x)
        same(cal, twin)
        for k, b in cal._buffers.items():
            assert torch.equal(bits(b), before[k][0]) and b._version == before[k][1], k
        assert cal._linear and cal._grown_top is None
    for y in (torch.tensor(first) * 0.5, torch.tensor(first) * 2):  # inside, then grown
        feed(cal, twin, y, "collect")
        never.collect(y)
    for name in ("_calib_hist", "_calib_bin_edges", "min_vals", "max_vals"):
        assert torch.equal(getattr(cal, name), getattr(never, name)), name
    assert amaxes(cal) == amaxes(never)


def count_general(monkeypatch) -> list:
    calls = []
    general = observer_base.Observer.forward

    def spy(self, x):
        calls.append(x.shape)
        return general(self, x)
    monkeypatch.setattr(observer_base.Observer, "forward", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32])
def test_collect_takes_the_cached_step(monkeypatch, dtype):
    """After the batch that sizes the state, neither a batch inside the grid nor one that
    grows it runs the general forward (it did on every batch: ~180 us a call on 1K values)."""
    calls = count_general(monkeypatch)
    cal = HistogramCalibrator()
    g = torch.Generator().manual_seed(2)
    for scale in (1.0, 1.0, 0.5, 2.0, 3.0, 1.0):
        cal.collect((torch.randn(2, 8, 64, generator=g) * scale * 20).to(dtype))
    cal(torch.randn(2, 8, 64, generator=g))
    assert len(calls) == 1
    assert cal._grown_top is not None


def test_hooks_and_the_switch_keep_the_general_path(monkeypatch):
    calls = count_general(monkeypatch)
    seen = []
    cal = HistogramCalibrator()
    cal.register_forward_hook(lambda m, args, out: seen.append(1))
    for _ in range(3):
        cal.collect(torch.randn(64))
    # with a hook collect calls self(x), as before (its hook fires); forward's step runs
    assert len(seen) == 3 and len(calls) == 1
    off = HistogramCalibrator()
    off.cached_cpu_step = False
    for _ in range(3):
        off.collect(torch.randn(64))
    assert len(calls) == 4


def test_copies_and_pickles_carry_no_cache():
    cal = HistogramCalibrator()
    g = torch.Generator().manual_seed(6)
    for scale in (1.0, 3.0, 1.0):  # (the second grows the grid: its first grid is kept)
        cal.collect(torch.randn(256, generator=g) * scale)
    caches = ("_first_plans", "_first_scratch", "_grid_cache")
    assert all(name in cal.__dict__ for name in caches)
    for other in (copy.deepcopy(cal), pickle.loads(pickle.dumps(cal))):
        assert not any(name in other.__dict__ for name in caches)
        x = torch.randn(256, generator=g) * 3
        other.collect(x)
        assert torch.equal(other._calib_hist, ref(cal, x)._calib_hist)


def ref(cal, x):
    """A copy of ``cal`` on the general path, fed ``x``."""
    twin = copy.deepcopy(cal)
    twin.cached_cpu_step = False
    twin.collect(x)
    return twin


def test_running_min_max_as_torch_writes_them():
    """The step's min / max state update (through the state's memory) is torch.minimum /
    maximum's of one value: a tie of -0.0 and 0.0 keeps the state, a NaN state becomes the
    quiet NaN, the versions bumped once."""
    from quantscope.observers.first_step import _running

    values = [0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), 3e-45]
    nan_bits = [0x7FC00000, -1, 0x7F800001]  # NaN states: the quiet one, -nan, a payload
    for s, b in [(s, b) for s in values + nan_bits for b in values]:
        mine = [torch.tensor([0.0 if isinstance(s, int) else s]) for _ in range(2)]
        if isinstance(s, int):
            for t in mine:
                t.view(torch.int32).fill_(s)
        theirs = [t.clone() for t in mine]
        v = [t._version for t in mine]
        _running(*mine, torch.tensor([b]), torch.tensor([b]))
        torch.minimum(theirs[0], torch.tensor([b]), out=theirs[0])
        torch.maximum(theirs[1], torch.tensor([b]), out=theirs[1])
        for a, t, before in zip(mine, theirs, v):
            assert torch.equal(bits(a), bits(t)), (s, b)
            assert a._version == before + 1


@pytest.mark.parametrize("first_inside", [True, False])
def test_inference_mode_batches(first_inside):
    """Batches inside and outside torch.inference_mode (calibrate observes inside it): the
    buffers, their versions and which are inference tensors as on the general path."""
    cal, twin = pair()
    g = torch.Generator().manual_seed(5)
    for i, scale in enumerate((1.0, 1.0, 2.0, 0.5, 3.0)):
        x = torch.randn(256, generator=g) * scale
        with torch.inference_mode() if (i < 3) == first_inside else torch.no_grad():
            cal.collect(x)
            twin.collect(x)
        for name, buf in cal._buffers.items():
            other = twin._buffers[name]
            assert torch.equal(bits(buf), bits(other)), name
            assert buf.is_inference() == other.is_inference(), name
            if not buf.is_inference():
                assert buf._version == other._version, name


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("shape", [(256,), (4, 16)])  # the same shape, a new one
def test_a_refused_collect_after_inference_mode_changes_nothing(bad, shape):
    """collect of a NaN / inf batch outside inference mode, after batches inside it: refused
    (ValueError / OverflowError) with the buffers the same tensors, still inference tensors,
    as the general path (whose check runs before forward; the cached step had left inference
    mode, cloning every buffer, before it found the NaN). forward of it then leaves inference
    mode and records it on both."""
    cal, twin = pair()
    g = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        for scale in (1.0, 2.0):
            x = torch.randn(256, generator=g) * scale
            cal.collect(x)
            twin.collect(x)
    y = torch.randn(shape, generator=g)
    y.view(-1)[3] = float(bad)
    for o in (cal, twin):
        before = dict(o._buffers)
        with pytest.raises(ValueError if bad == "nan" else OverflowError):
            o.collect(y)
        assert all(o._buffers[k] is b for k, b in before.items())
        assert o.hist_counts.is_inference() and o.min_vals.is_inference()
        assert o._last_shape == (256,)
    for name, buf in cal._buffers.items():
        other = twin._buffers[name]
        assert torch.equal(bits(buf), bits(other)), name
        assert buf.is_inference() == other.is_inference(), name
    for o in (cal, twin):
        o(y)
    for o in (cal, twin):
        assert not any(b.is_inference() for b in o._buffers.values())
    same(cal, twin)
    assert bool(cal.seen_non_finite)
