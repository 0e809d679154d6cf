"""Every min-max observer class and every Quark compat class, fed CPU batches (so the cached
C step ran where the class takes it: accumulating instances and ones that do not accumulate,
Quark's dynamic and per-group ones among them), pickles, goes through ``torch.save`` /
``torch.load`` and ``copy.deepcopy``, and the copy holds the original's state and goes on
observing as it does. The cached memoryless call keeps weak references in
``_state_ends``; the code before dropped them from a pickle only on
``MemorylessMinMaxObserver``, so Quark's dynamic / per-group / block ones raised ``TypeError:
cannot pickle 'weakref.ReferenceType' object`` after their second CPU batch."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from state_checks import assert_same_buffers
from tiers import each_value

from quantscope import Channel, Group, QParams, QuantSpec, Tensor
from quantscope.compat import horizon, quark, torch_ao
from quantscope.compat import llmcompressor_legacy as llmc
from quantscope.compat.modelopt import MaxCalibrator
from quantscope.observers import MemorylessMinMaxObserver, StaticMinMaxObserver
from quantscope.observers.histogram import PercentileObserver
from quantscope.observers.minmax import MovingAverageMinMaxObserver
from quantscope.presets import NVFP4

GROUP = {"dtype": "int4", "qscheme": "per_group", "ch_axis": -1, "group_size": 32}
MX = {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1, "group_size": 32,
      "scale_format": "e8m0"}
BFP = {"dtype": "bfp16", "qscheme": "per_group", "ch_axis": -1, "group_size": 8}
CHANNEL = {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0}
LLMC = {"num_bits": 4, "strategy": "group", "group_size": 16}

MAKERS = {
    "memoryless": lambda: MemorylessMinMaxObserver(QuantSpec("int8", Channel(0))),
    "memoryless-nvfp4": lambda: MemorylessMinMaxObserver(NVFP4),
    "static": lambda: StaticMinMaxObserver(QuantSpec("int8", Group(16))),
    "ema": lambda: MovingAverageMinMaxObserver(QuantSpec("int8", Tensor())),
    "llmc-memoryless": lambda: llmc.MemorylessMinMaxObserver("weight", LLMC),
    "llmc-static": lambda: llmc.StaticMinMaxObserver("weight", LLMC),
    "llmc-minmax": lambda: llmc.MinMaxObserver("weight", LLMC),
    "horizon-minmax": lambda: horizon.MinMaxObserver(),
    "horizon-ema": lambda: horizon.MovingAverageMinMaxObserver(),
    "horizon-ema-channel": lambda: horizon.MovingAveragePerChannelMinMaxObserver(),
    "modelopt-max": lambda: MaxCalibrator(axis=0),
    "ao-minmax": lambda: torch_ao.MinMaxObserver(),
    "ao-channel": lambda: torch_ao.PerChannelMinMaxObserver(),
    "ao-ema": lambda: torch_ao.MovingAverageMinMaxObserver(),
    "ao-ema-channel": lambda: torch_ao.MovingAveragePerChannelMinMaxObserver(),
}
for dynamic in (False, True):
    tag = "dynamic" if dynamic else "static"
    for name, q in (("UniformScalingObserver", {"dtype": "int8"}),
                    ("PerTensorMinMaxObserver", {"dtype": "int8"}),
                    ("PerChannelMinMaxObserver", CHANNEL),
                    ("PerBlockMXObserver", MX), ("PerBlockBFPObserver", BFP)):
        MAKERS[f"quark-{name}-{tag}"] = (
            lambda name=name, q=q, dynamic=dynamic:
            getattr(quark, name)({**q, "is_dynamic": dynamic}))
MAKERS["quark-PerGroupMinMaxObserver"] = lambda: quark.PerGroupMinMaxObserver(GROUP)
for name in ("PerTensorHistogramObserver", "PerTensorPercentileObserver",
             "PerTensorMSEObserver", "PerTensorHistogramObserverPro"):
    MAKERS[f"quark-{name}"] = lambda name=name: getattr(quark, name)({"dtype": "int8"})
# a native per-tensor histogram observer (the cached histogram step: its plans stay behind too)
MAKERS["percentile"] = lambda: PercentileObserver(QuantSpec("int8", Tensor()))
MAKERS["quark-PlaceholderObserver"] = lambda: quark.PlaceholderObserver({"dtype": "bfloat16"})


def g(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def observe(obs, x):
    return obs.collect(x) if isinstance(obs, MaxCalibrator) else obs(x)


def loaded(obs, how):
    if how == "pickle":
        return pickle.loads(pickle.dumps(obs))
    if how == "deepcopy":
        return copy.deepcopy(obs)
    buf = io.BytesIO()
    torch.save(obs, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def qparams(obs):
    """What the class answers: its own qparams (Quark's, torch.ao's, ModelOpt's amax) where
    it has them, and the native ones."""
    out = [obs.qparams()]
    for name in ("calculate_qparams", "compute_amax"):
        if hasattr(type(obs), name):
            got = getattr(obs, name)()
            out.extend(got if isinstance(got, (tuple, list)) else (got,))
            break
    return [t for v in out for t in ((v.scale, v.zero_point, v.global_scale)
                                     if isinstance(v, QParams) else (v,))]


def same(a, b):
    assert_same_buffers(a, b, versions=False)  # (a pickle keeps no in-place versions)
    x, y = qparams(a), qparams(b)
    assert len(x) == len(y)
    for u, v in zip(x, y):
        assert (u is None and v is None) or (u.dtype == v.dtype and torch.equal(u, v))


@pytest.mark.parametrize(("observer", "how"),
                         each_value(list(MAKERS), ["pickle", "torch.save", "deepcopy"]))
def test_copies_after_cpu_batches_hold_the_state(observer, how):
    obs = MAKERS[observer]()
    for i in range(3):  # the first call sizes the state; the next ones take a cached step
        observe(obs, g(i, 8, 64) * (i + 1))
    back = loaded(obs, how)
    # nothing of the kept ends travels (weak references to the original's tensors)
    assert back.__dict__.get("_state_ends") is None
    # nor the scratch pair, the pending ends or the cached steps' plans (remade on next call)
    for name in ("_scratch", "_pending_ends", "_cpu_plans", "_cpu_ends", "_hist_plans",
                 "_hist_scratch", "_first_plans", "_first_scratch"):  # (step_cache.CACHES)
        assert name not in back.__dict__, name
    same(back, obs)
    for i in (3, 4):
        x = g(i, 8, 64)
        observe(obs, x)
        observe(back, x)
        same(back, obs)


def test_a_copy_of_nvfp4_derives_its_global_amax():
    """The kept ends do not travel: the copy's global amax is derived, the same value."""
    obs = MemorylessMinMaxObserver(NVFP4)
    for i in range(3):
        obs(g(i, 8, 64))
    assert obs.global_amax() is not None  # the ends kept (the cached call's)
    back = pickle.loads(pickle.dumps(obs))
    assert back.global_amax() is None
    assert torch.equal(back.qparams().global_scale, obs.qparams().global_scale)
