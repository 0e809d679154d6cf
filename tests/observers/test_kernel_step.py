"""An observer's step on a small CPU tensor (below 64K elements) as one pass of the C kernel:
the per-unit min / max, their ends (the non-finite check) and the state update, where torch
took a dozen small ops (their dispatch cost more than the data: Quark's classes 2-5x slower
per call than Quark's own, found by benchmarking). The state, the non-finite flag, the token
count and the qparams must equal the torch path's for every update kind (memoryless too),
layout and input dtype, NaN and infinities included."""

from __future__ import annotations

import pytest
import torch

from quantscope import Block, Channel, Group, QuantSpec, Tensor, Tile, Token
from quantscope.compat import quark
from quantscope.observers import (
    MemorylessMinMaxObserver,
    MovingAverageMinMaxObserver,
    StaticMinMaxObserver,
)
from quantscope.stats import minmax as stats

pytestmark = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")

LAYOUTS = {"tensor": Tensor(), "channel0": Channel(0), "channel1": Channel(1), "token": Token(),
           "group16": Group(16), "block8": Block(8, 0), "tile": Tile(4, 8)}


class LerpObserver(MovingAverageMinMaxObserver):
    state_update = "ema_lerp"  # llm-compressor's rounding (compat.llmcompressor's classes)


def native(layout, kind):
    spec = QuantSpec("int8", layout)
    if kind in ("min", "memoryless"):
        return (StaticMinMaxObserver if kind == "min" else MemorylessMinMaxObserver)(spec)
    cls = LerpObserver if kind == "lerp" else MovingAverageMinMaxObserver
    return cls(spec, averaging_constant={"ema": 0.3, "ema1": 1.0, "lerp": 0.25}[kind])


def batches(dtype, seed, specials):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(4):
        x = torch.randn(8, 32, generator=g) * (1 + 10 * i)
        if specials and i == 2:
            x[1, 3], x[5, 30], x[6, 0] = float("nan"), float("inf"), -float("inf")
            x[0] = 0.0
        if specials and i == 3:
            x[2] = -0.0
        out.append(x.to(dtype))
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (NaN where NaN; +-0 tie, as the general path's own vector widths do)."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        ((a == b) | (a.isnan() & b.isnan())).all())


class Spy:
    """The kernel library, counting its min / max passes."""

    def __init__(self, lib):
        self.lib, self.calls = lib, 0

    def __getattr__(self, name):
        fn = getattr(self.lib, name)

        def call(*args):
            self.calls += 1
            return fn(*args)
        return call


def run_pair(monkeypatch, make, xs):
    """``xs`` observed by ``make()`` through the C kernel, then by another in torch only; both
    observers and the kernel's pass count (every buffer must be equal)."""
    spy = Spy(stats._kernel())
    monkeypatch.setattr(stats, "_kernel", lambda: spy)
    obs = make()
    for x in xs:
        obs(x)
    monkeypatch.setattr(stats, "_kernel_reads", lambda units, step: False)
    twin = make()
    for x in xs:
        twin(x)
    for name, buf in obs._buffers.items():
        assert same(buf, twin._buffers[name]), name
    return spy.calls, obs, twin


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("kind", ["min", "memoryless", "ema", "ema1", "lerp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("specials", [False, True], ids=["finite", "nonfinite"])
def test_native_kernel_step_equals_general_path(monkeypatch, layout, kind, dtype, specials):
    fast, obs, twin = run_pair(monkeypatch, lambda: native(LAYOUTS[layout], kind),
                               batches(dtype, 1, specials))
    assert fast == 4  # one pass per batch
    assert bool(obs.seen_non_finite) is specials
    assert int(obs.observed_tokens) == 32
    if not specials:
        a, b = obs.qparams(), twin.qparams()
        assert torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)
    else:
        for o in (obs, twin):
            with pytest.raises(ValueError, match="NaN|inf"):
                o.qparams()


def test_kernel_step_bumps_state_versions():
    obs = StaticMinMaxObserver(QuantSpec("int8", Channel(0)))
    x = torch.randn(8, 32)
    obs(x)
    before = obs.min_vals._version, obs.max_vals._version
    obs(x * 2)
    assert obs.min_vals._version > before[0] and obs.max_vals._version > before[1]


@pytest.mark.parametrize("qscheme", ["per_tensor", "per_channel", "per_group"])
def test_quark_kernel_step_equals_general_path(monkeypatch, qscheme):
    cls = {"per_tensor": quark.PerTensorMinMaxObserver,
           "per_channel": quark.PerChannelMinMaxObserver,
           "per_group": quark.PerGroupMinMaxObserver}[qscheme]
    config = {"dtype": "int4" if qscheme == "per_group" else "int8", "qscheme": qscheme,
              "ch_axis": 0 if qscheme == "per_channel" else -1, "group_size": 16,
              "symmetric": False}
    fast, obs, twin = run_pair(monkeypatch, lambda: cls(config), batches(torch.float32, 2, False))
    assert fast == 4
    for a, b in zip(obs._calculate_qparams(), twin._calculate_qparams()):
        assert torch.equal(a, b)


def test_one_unit_takes_torch_only_where_its_thread_pool_wins(monkeypatch):
    """One float32 unit: the kernel's one pass (one thread) below ``THREAD_MIN_NUMEL``, and
    split over its threads from twice that; between, torch's pool where it has threads."""
    spy = Spy(stats._kernel())
    monkeypatch.setattr(stats, "_kernel", lambda: spy)
    obs = StaticMinMaxObserver(QuantSpec("int8", Tensor()))
    obs(torch.randn(256, 256))
    assert spy.calls == 1
    monkeypatch.setattr(stats.kernels, "threads", lambda requested=None: 2)
    obs(torch.randn(stats.THREAD_MIN_NUMEL // 1024, 1024))
    assert spy.calls == 1  # torch's two threads
    monkeypatch.setattr(stats.kernels, "threads", lambda requested=None: 1)
    obs(torch.randn(stats.THREAD_MIN_NUMEL // 1024, 1024))
    assert spy.calls == 2


