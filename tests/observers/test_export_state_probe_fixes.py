"""Probe fixes: a warmed observer's state keeps updating under torch.export (strict and
non-strict) and keeps its buffer objects (in-place writes: CUDA graphs too); imatrix_mse
checks a constant importance once, at construction, and never reads it back in forward."""

import copy
import warnings

import pytest
import torch
from torch import nn

import quantscope
import quantscope.presets as P
from quantscope.estimators.weighted import imatrix_range
from quantscope.observers.base import Observer
from quantscope.observers.imatrix import IMatrixMSEObserver

CASES = [("histogram", P.INT8_PER_TENSOR), ("percentile", P.INT8_PER_TENSOR),
         ("percentile", P.INT8_PER_CHANNEL), ("imatrix_mse", P.INT8_PER_CHANNEL)]
STATE = {"histogram": ("hist_counts", "hist_exp", "hist_first", "hist_lo", "hist_hi",
                       "min_vals", "max_vals", "observed_tokens"),
         "imatrix_mse": ("min_vals", "max_vals", "observed_tokens")}


class _Holder(nn.Module):
    def __init__(self, obs):
        super().__init__()
        self.obs = obs

    def forward(self, x):
        return self.obs(x) * 2


def _batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 64, generator=g) * (i + 5) for i in range(n)]  # ranges grow


def _key_state(name):
    return STATE["imatrix_mse" if name == "imatrix_mse" else "histogram"]


# strict export (torch.export's other tracer) in the extended tier
@pytest.mark.parametrize("strict", [False, pytest.param(True, marks=pytest.mark.extended)])
@pytest.mark.parametrize("name,spec", CASES)
def test_exported_warmed_observer_keeps_updating_as_eager(name, spec, strict):
    torch.manual_seed(0)
    eager = _Holder(quantscope.get_observer(name, spec))
    eager(torch.randn(4, 64))  # one eager batch sizes the state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = torch.export.export(copy.deepcopy(eager), (torch.randn(4, 64),),
                                  strict=strict).module()
    for x in _batches():
        eager(x)
        mod(x)
    got = {k[len("obs."):]: v for k, v in mod.state_dict().items() if k.startswith("obs.")}
    want = eager.obs.state_dict()
    for k in _key_state(name):  # strict export drops only buffers the graph never touches
        assert k in got, f"{name}: the exported module lost {k}"
    for k, v in got.items():
        assert torch.equal(v, want[k]), f"{name} strict={strict}: {k} differs from eager"
    fresh = quantscope.get_observer(name, spec)
    fresh.load_state_dict({**want, **got})
    assert torch.equal(fresh.qparams().scale, eager.obs.qparams().scale)


@pytest.mark.parametrize("name,spec", CASES)
def test_state_buffers_keep_identity_and_results_stay_bitwise(name, spec, monkeypatch):
    batches = [torch.randn(4, 64, generator=torch.Generator().manual_seed(2)), *_batches()]
    obs = quantscope.get_observer(name, spec)
    obs(batches[0])
    before = dict(obs.named_buffers())
    for x in batches[1:]:
        obs(x)
    for k in _key_state(name):
        assert obs._buffers[k] is before[k], f"{name}: {k} was replaced, not updated in place"
    # the same batches with every state write a plain reassignment (the earlier code)
    monkeypatch.setattr(Observer, "_store", lambda self, ns, vs: self._buffers.update(zip(ns, vs)))
    ref = quantscope.get_observer(name, spec)
    for x in batches:
        ref(x)
    got = obs.state_dict()
    for k, v in ref.state_dict().items():
        if k != "_extra_state":
            assert torch.equal(got[k], v), f"{name}: {k} not bitwise"
    assert torch.equal(obs.qparams().scale, ref.qparams().scale)


def test_histogram_state_updates_in_place_on_meta():
    obs = quantscope.get_observer("percentile", P.INT8_PER_CHANNEL).to("meta")
    obs(torch.empty(4, 64, device="meta"))
    counts = obs.hist_counts
    obs(torch.empty(4, 64, device="meta"))
    assert obs.hist_counts is counts and counts.shape == (4, obs.bins)


def test_imatrix_importance_forward_reads_nothing_back():
    obs = IMatrixMSEObserver(P.INT8_PER_CHANNEL, importance=torch.rand(128)).to("meta")
    obs(torch.empty(16, 128, device="meta"))  # a read-back raises on meta
    assert obs.min_vals.shape == (16,)
    torch._dynamo.reset()
    cpu = IMatrixMSEObserver(P.INT8_PER_CHANNEL, importance=torch.rand(128))
    w = torch.randn(16, 128)
    torch.compile(cpu, backend="eager", fullgraph=True)(w)  # no data-dependent branch
    ref = IMatrixMSEObserver(P.INT8_PER_CHANNEL, importance=cpu.importance.clone())
    ref(w)
    assert torch.equal(cpu.min_vals, ref.min_vals) and torch.equal(cpu.max_vals, ref.max_vals)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_bad_importance_refused_at_construction_naming_observer_and_argument(bad):
    imp = torch.ones(8)
    imp[3] = bad
    with pytest.raises(ValueError, match=r"IMatrixMSEObserver\('imatrix_mse'.*importance must "
                                         r"be finite and non-negative"):
        IMatrixMSEObserver(P.INT8_PER_CHANNEL, importance=imp)


def test_bad_loaded_importance_refused_at_load():
    obs = IMatrixMSEObserver(P.INT8_PER_CHANNEL, importance=torch.ones(8))
    obs(torch.randn(4, 8))
    sd = obs.state_dict()
    sd["importance"] = torch.full((8,), float("nan"))
    with pytest.raises(ValueError, match="IMatrixMSEObserver.*importance must be finite"):
        IMatrixMSEObserver(P.INT8_PER_CHANNEL, importance=torch.ones(8)).load_state_dict(sd)


def test_imatrix_range_still_checks_its_per_call_importance():
    with pytest.raises(ValueError, match="imatrix_range: importance must be finite"):
        imatrix_range(
            torch.randn(4, 8), torch.full((8,), float("nan")), P.INT8_PER_CHANNEL)
