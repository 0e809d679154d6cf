"""One large float32 unit (a per-tensor range) read by the C kernel, in one pass with the ends
and the state update, its elements split over the threads: the per-unit min / max, the
non-finite flag, the token count and the state equal torch's whole-tensor reduction's
(torch.aminmax), NaN and infinities included."""

from __future__ import annotations

import pytest
import torch
from test_kernel_step import Spy  # the kernel library, counting its calls

from quantscope import QuantSpec, Tensor
from quantscope.observers import (
    MemorylessMinMaxObserver,
    MovingAverageMinMaxObserver,
    StaticMinMaxObserver,
)
from quantscope.stats import minmax as stats

pytestmark = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")


def data(n: int, seed: int, special: float | None = None, at: int = 0) -> torch.Tensor:
    """``n`` float32 values (no zeros: a zero extreme's sign is the one thing allowed to
    differ), with ``special`` at index ``at``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) + 0.5
    x[x == 0] = 1.0
    if special is not None:
        x[at] = special
    return x


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


SPECIALS = [None, float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("n", [1 << 16, (1 << 18) + 7])
@pytest.mark.parametrize("special", SPECIALS, ids=str)
def test_one_large_unit_reads_the_kernel(monkeypatch, n, special):
    spy = Spy(stats._kernel())
    monkeypatch.setattr(stats, "_kernel", lambda: spy)
    x = data(n, 0, special, at=n - 3)
    ends = torch.empty(2)
    lo, hi = stats.unit_minmax(x.view(1, n), ends=ends)
    assert spy.calls == 1
    want_lo, want_hi = torch.aminmax(x)
    assert same(lo, want_lo.view(1)) and same(hi, want_hi.view(1))
    assert same(ends, torch.stack((want_lo, want_hi)))


@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("special", SPECIALS, ids=str)
@pytest.mark.parametrize("at", [0, 40_000, 99_999])
@pytest.mark.parametrize("kind", [None, "min", "ema", "ema_lerp"])
def test_one_unit_split_over_threads(monkeypatch, threads, special, at, kind):
    monkeypatch.setattr(stats, "THREAD_MIN_NUMEL", 1024)  # split even this unit
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert stats._threads(100_000, 100_000) == threads
        x = data(100_000, 1, special, at)
        state = (torch.tensor([-0.25]), torch.tensor([0.75]))
        update = None if kind is None else (kind, 0.3, *state)
        want_state = tuple(s.clone() for s in state)
        ends = torch.empty(2)
        lo, hi = stats.unit_minmax(x.view(1, -1), ends=ends, update=update)
    finally:
        torch.set_num_threads(before)
    want_lo, want_hi = torch.aminmax(x)
    assert same(ends, torch.stack((want_lo, want_hi)))
    if kind is None:
        assert same(lo, want_lo.view(1)) and same(hi, want_hi.view(1))
        return
    stats._update_state(kind, 0.3, *want_state, want_lo.view(1).clone(), want_hi.view(1).clone())
    assert same(state[0], want_state[0]) and same(state[1], want_state[1])


@pytest.mark.parametrize("cls", [StaticMinMaxObserver, MovingAverageMinMaxObserver,
                                 MemorylessMinMaxObserver])
def test_per_tensor_observer_equals_the_torch_path(monkeypatch, cls):
    xs = [data(256 * 1024, s).view(256, 1024) for s in range(3)]
    xs.append(data(256 * 1024, 9, float("inf"), at=5).view(256, 1024))
    torch_path = cls(QuantSpec("int8", Tensor()))
    with monkeypatch.context() as m:
        m.setattr(stats, "_kernel", lambda: None)
        for x in xs:
            torch_path(x)
    spy = Spy(stats._kernel())
    monkeypatch.setattr(stats, "_kernel", lambda: spy)
    obs = cls(QuantSpec("int8", Tensor()))
    for x in xs:
        obs(x)
    assert spy.calls == len(xs)
    got, want = obs.state_dict(), torch_path.state_dict()
    assert got.keys() == want.keys()
    for k in got:
        if got[k].is_floating_point():
            assert same(got[k], want[k]), k
        else:
            assert torch.equal(got[k], want[k]), k
    assert bool(obs.seen_non_finite) and int(obs.observed_tokens) == 4 * 256
