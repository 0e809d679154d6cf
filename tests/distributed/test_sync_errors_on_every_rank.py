"""sync_observers' errors across processes: an error on one rank reaches every rank (no rank
waits in a collective until the timeout), ranks whose observers differ in spec, bins or
histogram kind raise instead of summing incompatible states, and an observer's own reason
for not syncing is kept.

One spawn of 2 gloo processes runs every scenario (a spawn costs seconds); the process
group's timeout is short, so a rank left waiting fails the scenario in seconds, not minutes.
"""

from __future__ import annotations

import pytest
import torch
from ports import error_text, rank_results, spawn_ranks

import quantscope
from quantscope import comm
from quantscope.observers import sync as qsync
from quantscope.observers.histogram import PercentileObserver
from quantscope.spec import QuantSpec

# the tests of the spawned ranks are extended (they spawn their own process group)
pytestmark = pytest.mark.dist

TIMEOUT = 20  # seconds a collective waits for a peer; the spawn gets a few times that


def _synced_range(r):
    """A good sync after a failed one: the ranks are still in step (no pending collective)."""
    obs = quantscope.get_observer("static_minmax", QuantSpec())
    obs(torch.tensor([float(r), -2.0 * r]))
    obs.sync()
    return obs.min_vals.item(), obs.max_vals.item()


def _one_rank_fails(r) -> dict:
    out = {}
    # a 9-D state on rank 0 only (rank 1 saw nothing): its header cannot be encoded
    obs = quantscope.get_observer("static_minmax", QuantSpec())
    if r == 0:
        obs(torch.randn(*(1,) * 8, 4))
    out["9d"] = error_text(obs.sync)
    out["9d/after"] = _synced_range(r)
    # a moving-average histogram folds its pending batches in sync_plan: |x| too large on 0
    obs = quantscope.get_observer("percentile", QuantSpec(), bins=64, averaging_constant=0.5,
                                  update_interval=2)
    x = torch.randn(4, 32)
    if r == 0:
        x[0, 0] = 1e38
    obs(x)
    out["ema_huge"] = error_text(obs.sync)
    out["ema_huge/after"] = _synced_range(r)
    return out


def _percentile(absolute: bool):
    """A percentile observer class, of one name, with its histogram of |x| or of x."""
    class Percentile(PercentileObserver):
        pass

    Percentile.absolute = absolute
    return Percentile


def _make(name, spec, **opts):
    """An observer from a registry name or a class."""
    if isinstance(name, str):
        return quantscope.get_observer(name, spec, **opts)
    return name(spec, **opts)


def _mismatches(r) -> dict:
    """Observers that differ only in what their state means: each must raise everywhere."""
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(r)) + 0.5
    cases = {
        "sym_vs_asym": ("percentile", QuantSpec(symmetric=r == 0), {"bins": 64}),
        "int8_vs_fp8": ("static_minmax", QuantSpec("int8" if r == 0 else "fp8_e4m3"), {}),
        "absolute": (_percentile(absolute=r == 0), QuantSpec(), {"bins": 64}),
        "bins": ("percentile", QuantSpec(), {"bins": 64 if r == 0 else 128}),
    }
    out = {}
    for key, (name, spec, opts) in cases.items():
        obs = _make(name, spec, **opts)
        if r == 0 or key != "bins":  # bins: rank 1 saw nothing (it would take rank 0's)
            obs(x)
        out[key] = error_text(obs.sync)
    return out


def _calibrate_fails_on_one_rank(group) -> str | None:
    from quantscope.calibration import calibrate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    batches = [torch.randn(*(1,) * 8, 8), torch.randn(2, 8)]  # rank 0 takes the 9-D one
    return error_text(lambda: calibrate(model, batches, "w8a8", observer="static_minmax",
                                    progress=False, distributed=True, group=group))


def _scenarios(r, out):
    # first the scenarios after which the ranks stay in step even when they go wrong
    obs = quantscope.get_observer("percentile", QuantSpec(), grid="first")
    obs(torch.randn(8, 16))
    out["grid_first"] = error_text(obs.sync)
    out.update(_mismatches(r))
    out["mismatch/after"] = _synced_range(r)
    out.update(_one_rank_fails(r))
    out["calibrate"] = _calibrate_fails_on_one_rank(None)
    out["calibrate/after"] = _synced_range(r)


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, 2, TIMEOUT)


@pytest.mark.parametrize(("key", "message"), [
    ("9d", "ValueError: sync: "),  # (its 9 dims: the observed tensor's, s39)
    ("ema_huge", ("ValueError: PercentileObserver('percentile', int8 tensor sym): observed "
                  "|x| up to 1e+38")),
    ("calibrate", "ValueError: sync: "),
])
@pytest.mark.extended
def test_an_error_on_one_rank_raises_the_same_error_on_every_rank(ranks, key, message):
    # rank 0 raises its own error; rank 1, which would wait in a collective, the same type
    # and message, naming the failing rank
    got = rank_results(ranks, key)
    assert got[0].startswith(message), got[0]
    assert key == "ema_huge" or "observed last has 9 dims; distributed sync takes at most 8" \
        in got[0], got[0]
    assert got[1] == f"{got[0]} (sync failed on rank(s) [0])"


@pytest.mark.extended
@pytest.mark.parametrize("key", ["9d", "ema_huge", "mismatch", "calibrate"])
def test_the_ranks_stay_in_step_after_the_error(ranks, key):
    # rank r observed [r, -2r]: the global range is the same on both ranks
    assert rank_results(ranks, f"{key}/after") == [(-2.0, 1.0)] * 2


@pytest.mark.extended
@pytest.mark.parametrize("key", ["sym_vs_asym", "int8_vs_fp8", "absolute", "bins"])
def test_observers_configured_differently_raise_on_every_rank(ranks, key):
    for got in rank_results(ranks, key):
        assert got is not None and got.startswith(
            "ValueError: sync: the ranks sync different observers"), got


@pytest.mark.extended
def test_the_observers_own_reason_is_kept(ranks):
    for got in rank_results(ranks, "grid_first"):
        assert got.startswith("NotImplementedError: ") and "grid='first' histograms" in got, got


# ------------------------------------------------------------- in one process (no spawn)
def test_plan_keeps_the_reason_of_an_observer_that_declares_its_plan():
    obs = quantscope.get_observer("percentile", QuantSpec(), grid="first")
    with pytest.raises(NotImplementedError, match="grid='first' histograms .* do not sync"):
        qsync._plan(obs)


def test_plan_explains_an_observer_without_a_plan():
    class Bare(quantscope.Observer):
        def _observe(self, units, lo, hi):
            pass

    with pytest.raises(NotImplementedError, match="does not declare how its state syncs"):
        qsync._plan(Bare(QuantSpec()))


def _sig(name, spec, **opts):
    obs = _make(name, spec, **opts)
    return qsync._signature([obs], [qsync._plan(obs)])


def test_signature_tells_apart_what_changes_the_states_meaning():
    assert _sig("percentile", QuantSpec(), bins=64) == _sig("percentile", QuantSpec(), bins=64)
    assert _sig("percentile", QuantSpec(), bins=64) != _sig("percentile", QuantSpec(
        symmetric=False), bins=64)
    assert _sig("percentile", QuantSpec(), bins=64) != _sig("percentile", QuantSpec(), bins=128)
    assert _sig(_percentile(True), QuantSpec(), bins=64) != _sig(_percentile(False),
                                                                 QuantSpec(), bins=64)
    assert _sig("static_minmax", QuantSpec("int8")) != _sig("static_minmax",
                                                            QuantSpec("fp8_e4m3"))


def test_a_peers_error_is_rebuilt_with_its_type():
    e = comm._rebuilt("builtins", "ValueError", "bad", " (sync failed on rank(s) [0])")
    assert type(e) is ValueError and str(e) == "bad (sync failed on rank(s) [0])"
    e = comm._rebuilt("no.such.module", "Oops", "bad", "")  # never imported: RuntimeError
    assert type(e) is RuntimeError and "no.such.module.Oops: bad" in str(e)
