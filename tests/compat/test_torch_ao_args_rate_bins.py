"""compat.torch_ao against torch.ao 2.13: ``with_args`` / ``with_callable_args``
chains resolve as torch.ao's ``_PartialWrapper`` does (the last mention of an argument wins),
``HistogramObserver.upsample_rate`` set after construction re-bins as torch.ao's
``_upscale_histogram`` does, and ``bins=0`` fails in ``forward`` with a ``RuntimeError``."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from torch.ao import quantization as tq

from quantscope.compat import torch_ao as qa
from quantscope.stats import ao_histogram


# ------------------------------------------------------------------ with_args chains
def _lazy(calls, tag, value):
    def make():
        calls.append(tag)
        return value
    return make


# each step: ("args", kwargs) or ("callable", {name: (tag, value)})
CHAINS = {
    "callable_then_args": [("callable", {"eps": ("f", 1e-3)}), ("args", {"eps": 0.5})],
    "args_then_callable": [("args", {"eps": 0.5}), ("callable", {"eps": ("f", 1e-3)})],
    "probe_chain2": [("args", {"dtype": torch.qint8}), ("callable", {"eps": ("f", 1e-3)}),
                     ("args", {"dtype": torch.quint8, "eps": 0.25})],
    "callable_args_callable": [("callable", {"eps": ("f", 1e-3)}), ("args", {"eps": 0.5}),
                               ("callable", {"eps": ("g", 2e-3)})],
    "callable_other_args_callable": [("callable", {"eps": ("f", 1e-3)}),
                                     ("args", {"dtype": torch.qint8}),
                                     ("callable", {"eps": ("g", 2e-3)})],
    "args_callable_other_args": [("args", {"eps": 0.5}), ("callable", {"eps": ("f", 1e-3)}),
                                 ("args", {"dtype": torch.qint8})],
    "two_callables_one_overridden": [
        ("callable", {"eps": ("f", 1e-3), "quant_max": ("h", 100)}),
        ("args", {"quant_min": 0, "quant_max": 50}), ("args", {"dtype": torch.quint8})],
}


def _build(cls, steps, calls):
    ctor = cls
    for kind, kw in steps:
        if kind == "args":
            ctor = ctor.with_args(**kw)
        else:
            ctor = ctor.with_callable_args(**{k: _lazy(calls, tag, v)
                                              for k, (tag, v) in kw.items()})
    return ctor


def _state(obs):
    return (obs.dtype, obs.eps.item(), obs.quant_min, obs.quant_max)


@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("call_kw", [{}, {"eps": 0.125}])
def test_with_args_chains_resolve_as_torch(chain, call_kw):
    got_calls, want_calls = [], []
    ours = _build(qa.MinMaxObserver, CHAINS[chain], got_calls)
    ref = _build(tq.MinMaxObserver, CHAINS[chain], want_calls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, want = ours(**call_kw), ref(**call_kw)
    assert isinstance(got, qa.MinMaxObserver) and ours.__name__ == "MinMaxObserver"
    assert _state(got) == _state(want)
    # the same callables run, once each (a shadowed one never runs, as in torch.ao)
    assert collections.Counter(got_calls) == collections.Counter(want_calls)


# ------------------------------------------------------------------ upsample_rate
def _growing(seed, n=5, size=300):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) * (1 + i) ** 1.5 + 0.3 * i for i in range(n)]


def _observe_both(rate, batches, bins, dtype=torch.float32):
    obs = [tq.HistogramObserver(bins=bins), qa.HistogramObserver(bins=bins)]
    for o in obs:
        o.upsample_rate = rate  # torch.ao's attribute, set after construction
        for x in batches:
            o(x.to(dtype))
    return obs


@pytest.mark.parametrize("rate", [0, 1, 2, 4, 16, 32])
@pytest.mark.parametrize("bins", [8, 64, 2048])
def test_upsample_rate_attribute_rebins_as_torch(rate, bins):
    ref, ours = _observe_both(rate, _growing(bins + rate), bins)
    for name in ("histogram", "min_val", "max_val"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    for a, b in zip(ref.calculate_qparams(), ours.calculate_qparams()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rate", [1, 4, 32])
def test_upsample_rate_on_the_tensor_path_as_torch(rate):
    # float64 batches take the tensor path (torch.ao bins them in float64)
    ref, ours = _observe_both(rate, _growing(rate), 64, torch.float64)
    assert torch.equal(ours.histogram, ref.histogram)
    for a, b in zip(ref.calculate_qparams(), ours.calculate_qparams()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rate", [1, 3, 4, 32])
def test_upscale_kernel_and_torch_path_take_the_rate(rate):
    g = torch.Generator().manual_seed(rate)
    hist = torch.rand(128, generator=g) * 50
    got = ao_histogram.upscale(hist, -1.0, 2.0, -3.0, 5.5, rate=rate)
    want = ao_histogram.upscale(hist, -1.0, 2.0, -3.0, 5.5, backend="torch", rate=rate)
    obs = tq.HistogramObserver(bins=128)
    obs.upsample_rate = rate
    ends = [torch.tensor(v) for v in (-1.0, 2.0, -3.0, 5.5)]
    assert torch.equal(want, obs._upscale_histogram(hist, *ends))
    assert torch.equal(got, want)


def test_upsample_rate_is_no_constructor_argument_as_torch():
    with pytest.raises(TypeError) as want:
        tq.HistogramObserver(upsample_rate=4)
    with pytest.raises(TypeError) as got:
        qa.HistogramObserver(upsample_rate=4)
    assert "upsample_rate" in str(want.value) and "upsample_rate" in str(got.value)
    assert qa.HistogramObserver().upsample_rate == tq.HistogramObserver().upsample_rate == 16


def test_scripted_observer_takes_the_rate():
    scripted = torch.jit.script(qa.HistogramObserver(bins=32))
    scripted.upsample_rate = 4
    ref = tq.HistogramObserver(bins=32)
    ref.upsample_rate = 4
    for x in _growing(7):
        scripted(x)
        ref(x)
    assert torch.equal(scripted.histogram, ref.histogram)


# ------------------------------------------------------------------ bins=0
@pytest.mark.parametrize("x", [torch.randn(4), torch.tensor([1.0, float("nan")])])
def test_no_bins_raises_a_runtime_error_in_forward_as_torch(x):
    ref, ours = tq.HistogramObserver(bins=0), qa.HistogramObserver(bins=0)  # both accept it
    with pytest.raises(RuntimeError, match="bins must be > 0"):
        ref(x)
    with pytest.raises(RuntimeError, match="bins must be a positive integer") as got:
        ours(x)
    assert isinstance(got.value, ValueError)
    assert isinstance(got.value, qa.NoBinsError)


def test_no_bins_warns_on_inf_first_and_skips_an_all_inf_batch_as_torch():
    for obs in (tq.HistogramObserver(bins=0), qa.HistogramObserver(bins=0)):
        with pytest.warns(UserWarning, match="torch.inf detected"), pytest.raises(RuntimeError):
            obs(torch.tensor([1.0, float("inf")]))
        with pytest.warns(UserWarning, match="torch.inf detected"):
            obs(torch.tensor([float("inf")]))  # nothing left to bin: no error
