"""Observers under ``torch.set_default_dtype(torch.float64)`` give the qparams they give under
float32 (found by review: buffers the C kernels write float32 into took torch's default
dtype, so min / max and histograms came back as garbage, without an error)."""

import contextlib
import sys
import warnings

import pytest
import torch
from tiers import each_value
from torch.ao.quantization import HistogramObserver as TorchHistogramObserver

from quantscope import QuantSpec, presets, qparams_from_range
from quantscope.compat.torch_ao import HistogramObserver
from quantscope.estimators.error import histogram_error
from quantscope.estimators.weighted import importance_units
from quantscope.observers.registry import get_observer, list_observers
from quantscope.observers.sync import empty_step
from quantscope.stats.histogram import Hist

NAMES = [n for n in list_observers() if ":" not in n and n != "placeholder"]
HISTOGRAMS = {"histogram", "histogram_mse", "l2_histogram", "entropy", "kl", "percentile", "mix"}
SPECS = {"channel:0": QuantSpec("int8", "channel:0"), "group:32": QuantSpec("int4", "group:32"),
         "group:128:0": QuantSpec("int8", "group:128:0"),
         "nvfp4": QuantSpec("fp4_e2m1", "block:16", scale="fp8_e4m3")}


def _qparams(name, spec, xs):
    obs = get_observer(name, spec)
    for x in xs:
        obs(x)
    return obs.calculate_qparams()


@pytest.mark.parametrize(("name", "spec"), each_value(NAMES, list(SPECS)))
def test_default_dtype_float64_changes_nothing(name, spec):
    if name in HISTOGRAMS and spec in ("nvfp4", "group:32"):
        pytest.skip("histograms of many units (slow): their kernels run on channel, group:128:0")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 512, generator=g)  # large enough for the C kernels
    xs = [w, w.t().contiguous().t() * 2]  # the second a transposed view
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            want = _qparams(name, SPECS[spec], xs)
        except (ValueError, TypeError) as e:  # a spec the observer refuses
            pytest.skip(f"{name} refuses {spec}: {e}")
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            got = _qparams(name, SPECS[spec], xs)
        finally:
            torch.set_default_dtype(default)
    assert torch.equal(got.scale.double(), want.scale.double())
    assert torch.equal(got.zero_point, want.zero_point)


# ---- float16 / float64 defaults, state and qparams bitwise, fresh caches -----------------

FAMILY_SPECS = {"int8 channel": presets.INT8_PER_CHANNEL,
                "int4 group:32": QuantSpec("int4", "group:32"),
                "fp8 tensor": presets.FP8_PER_TENSOR, "mxfp4": presets.MXFP4,
                "nvfp4": presets.NVFP4}


def _clear_caches():
    """quantscope's functools caches emptied: a fresh process, whose first call may come
    under another default dtype (a cached tensor made then outlived it)."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("quantscope") and mod is not None:
            for v in list(vars(mod).values()):
                if hasattr(v, "cache_clear") and getattr(v, "__module__", None) == name:
                    v.cache_clear()


@contextlib.contextmanager
def _default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _observed(name, spec, xs, dtype, fresh=True):
    """``(qparams, state)`` of a fresh observer fed ``xs`` under the default ``dtype``."""
    if fresh:
        _clear_caches()
    with _default_dtype(dtype), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obs = get_observer(name, spec)
        made = {f"made {k}": v.clone() for k, v in obs.state_dict().items()
                if isinstance(v, torch.Tensor)}  # the buffers before any data
        for x in xs:
            obs(x)
        qp = obs.calculate_qparams()
        lo, hi = obs.calculate_range()
    state = {k: v for k, v in obs.state_dict().items() if isinstance(v, torch.Tensor)}
    return (qp.scale, qp.zero_point, qp.global_scale, lo, hi), {**made, **state}


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return (a.dtype == b.dtype and a.shape == b.shape
            and (torch.equal(a, b) or a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                 and torch.equal(a.nan_to_num(), b.nan_to_num())))


def _assert_same(want, got, what):
    for field, w, g in zip(("scale", "zero_point", "global_scale", "lo", "hi"), want[0], got[0],
                           strict=True):
        assert _same(w, g), f"{what}: {field} {w} != {g}"
    assert want[1].keys() == got[1].keys(), what
    for k, w in want[1].items():
        g = got[1][k]
        assert _same(w, g), f"{what}: state {k} {w.dtype} {tuple(w.shape)} != " \
                            f"{g.dtype} {tuple(g.shape)}"


@pytest.mark.parametrize(("name", "spec"), each_value([*NAMES, "placeholder"], list(FAMILY_SPECS)))
def test_default_dtype_float16_float64_change_no_state_or_qparams(name, spec):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 128, generator=g, dtype=torch.float32)
    xs = [x, torch.randn(16, 128, generator=g, dtype=torch.float32) * 3]  # the range grows
    try:
        want = _observed(name, FAMILY_SPECS[spec], xs, torch.float32)
    except (ValueError, TypeError) as e:  # a spec the observer refuses
        pytest.skip(f"{name} refuses {spec}: {e}")
    for dtype in (torch.float64, torch.float16):
        _assert_same(want, _observed(name, FAMILY_SPECS[spec], xs, dtype), f"{name} {dtype}")
    # the default restored: nothing made under the other one is reused
    _assert_same(want, _observed(name, FAMILY_SPECS[spec], xs, torch.float32, fresh=False),
                 f"{name} after float16")


def _ao_state(obs):
    return [obs.histogram, obs.min_val, obs.max_val, *obs.calculate_qparams()]


@pytest.mark.parametrize("made", ["float32", "default"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=str)
def test_torch_ao_histogram_under_another_default_dtype_is_torch_aos(dtype, made):
    """The batch that widens the range under float64 / float16 (the C path gave the kernel
    that dtype's linspace): torch.ao's histogram, bitwise, whether the buffers were made
    under float32 or under that default (torch.ao's then are of that dtype)."""
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(32, 128, generator=g, dtype=torch.float32)
    x2 = torch.randn(32, 128, generator=g, dtype=torch.float32) * 3  # widens the range
    with _default_dtype(torch.float32 if made == "float32" else dtype):
        ours, ref = HistogramObserver(), TorchHistogramObserver()
    ours(x1)
    ref(x1)
    with _default_dtype(dtype):
        ours(x2)
        ref(x2)
        for a, b in zip(_ao_state(ours), _ao_state(ref), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (a, b)


def test_qparams_of_a_float_global_amax_past_float16_max_under_float16_default():
    lo, hi = torch.full((2, 16), -2.0e5), torch.full((2, 16), 3.0e5)  # blocks of 16
    want = qparams_from_range(lo, hi, presets.NVFP4, global_amax=3.0e5)
    with _default_dtype(torch.float16):  # the number is no float16: it was "not finite"
        got = qparams_from_range(lo, hi, presets.NVFP4, global_amax=3.0e5)
    assert _same(got.scale, want.scale) and _same(got.global_scale, want.global_scale)


@pytest.mark.parametrize("given", ["centres", "none"])
@pytest.mark.parametrize("kind", ["float64 ends", "float32 counts"])
def test_histogram_error_kernel_reads_a_hist_of_other_dtypes_as_its_values(kind, given):
    """A Hist of float64 ends or float counts (public API): the kernel read their memory as
    float32 widths, float32 points or int64 counts."""
    g = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 50, (3, 64), generator=g)
    lo, hi = -torch.rand(3, generator=g) - 1, torch.rand(3, generator=g) + 1
    cand = torch.linspace(0.5, 1.0, 5, dtype=torch.float32)
    args = (lo[:, None] * cand, hi[:, None] * cand, presets.INT8_PER_CHANNEL)
    hist = Hist(counts, lo, hi)
    centers = hist.centers() if given == "centres" else None
    want = histogram_error(hist, *args, points=4, centers=centers, backend="torch")
    other = (Hist(counts, lo.double(), hi.double()) if kind == "float64 ends"
             else Hist(counts.float(), lo, hi))
    got = histogram_error(other, *args, points=4, centers=centers)
    # given centres spread by float64 widths: points rounded once more than float32's
    rtol = 1e-6 if kind == "float64 ends" and given == "centres" else 1e-12
    torch.testing.assert_close(got, want, rtol=rtol, atol=0)


def test_importance_ones_are_float32_under_float64_default():
    with _default_dtype(torch.float64):
        w = importance_units(None, (4, 64), presets.INT8_PER_CHANNEL)
    assert w.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=str)
def test_horizon_mse_observer_state_is_float32_whatever_the_default(dtype):
    """Horizon scales the ends by a Python float factor (float32 arithmetic); ours took the
    default dtype: a float64 state, or float16-rounded factors."""
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(16, 64, generator=g, dtype=torch.float32) * s for s in (1, 3)]
    states = []
    for d in (torch.float32, dtype):
        with _default_dtype(d):
            obs = get_observer("horizon:MSEObserver")
            for x in xs:
                obs(x)
        states.append([obs.min_vals, obs.max_vals, *obs.calculate_qparams()])
    for w, g_ in zip(*states, strict=True):
        assert _same(w, g_), (w, g_)


# ---- step syncs (2 gloo ranks) under a float16 default ------------------------------------

def _step_synced(r, out):
    """Rank 1 without data in a min-max step (its placeholder ends joined rank 0's float32
    ends in one all_reduce), and a histogram step's gathered units (each rank 4097 values:
    the exchange's 24-bit tail slots and the values are exact in float32 only)."""
    xs = [torch.randn(1, 4097, generator=torch.Generator().manual_seed(i),
                      dtype=torch.float32) * (1 + i) for i in range(2)]
    with _default_dtype(torch.float16):
        for name in ("static_minmax", "percentile"):
            obs = get_observer(name, QuantSpec())
            obs.sync_every_step = True
            if r == 0 or name == "percentile":
                obs(xs[r])
            else:
                empty_step([obs])
            out[name] = [t.clone() for t in (obs.min_vals, obs.max_vals,
                                             *obs.calculate_range())]


@pytest.mark.dist
@pytest.mark.extended  # spawns its own process group
def test_step_sync_under_float16_default_equals_one_process_float32():
    from ports import rank_results, spawn_ranks

    ranks = spawn_ranks(_step_synced, 2, 20)
    xs = [torch.randn(1, 4097, generator=torch.Generator().manual_seed(i),
                      dtype=torch.float32) * (1 + i) for i in range(2)]
    for name, data in (("static_minmax", xs[0]), ("percentile", torch.cat(xs, 1))):
        ref = get_observer(name, QuantSpec())
        ref(data)
        want = [ref.min_vals, ref.max_vals, *ref.calculate_range()]
        for got in rank_results(ranks, name):
            for w, g in zip(want, got, strict=True):
                assert _same(w, g), (name, w, g)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_spec_and_checkpoint_reading_constants_are_float32(dtype):
    """QuantSpec's eps check (float32's max in float16 is inf: any eps passed) and the NVFP4
    global scale read back from a checkpoint made their constants in the default dtype."""
    from quantscope.exporters.read import _global_amax

    gs = torch.tensor([448.0 * 6.0 / 3.0])
    want = _global_amax(gs, presets.NVFP4, "k")
    with _default_dtype(dtype):
        with pytest.raises(ValueError, match="above the largest fp16 scale"):
            QuantSpec("int8", scale="fp16", eps=1e6)
        got = _global_amax(gs, presets.NVFP4, "k")
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
