"""Sync across processes where a rank's own view is not the whole story: a padded layout's
zeros in a step-synced histogram, imatrix_mse's per-element importance in a step exchange,
a synced state loaded on every rank and synced again, a static role's NaN in a distributed
calibration, and an observer that is no quantscope Observer.

One spawn of 2 gloo processes runs every scenario; each rank computes the one-process
figure to compare with locally. The process group's timeout is short, so a rank left
waiting fails in seconds, not minutes.
"""

from __future__ import annotations

import pytest
import torch
from ports import error_text, rank_results, spawn_ranks

import quantscope
from quantscope import QuantSpec, comm
from quantscope import distributed as qd
from quantscope.calibration import Runtime
from quantscope.compat import torch_ao
from quantscope.layout import Block, Channel
from quantscope.presets import MXFP8

pytestmark = [pytest.mark.dist, pytest.mark.extended]  # spawns its own process group

TIMEOUT = 20  # seconds a collective waits for a peer; the spawn gets a few times that


def _x(seed, shape, shift=0.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) + shift


def _padded_step(r) -> dict:
    """Block 32 on a last dim of 40 (the second block: 8 values, 24 padding zeros), data away
    from zero; step 2: rank 1 has no data. One process sees each step's batches in turn."""
    out = {}
    for name, spec in (("mxfp8", MXFP8), ("asym", QuantSpec(layout=Block(32), symmetric=False))):
        xs = [_x(i, (4, 40), 3.0) for i in range(3)]
        obs = quantscope.get_observer("percentile", spec, bins=128, percentile=50.0)
        obs.sync_every_step = True
        ref = quantscope.get_observer("percentile", spec, bins=128, percentile=50.0)
        obs(xs[r])
        obs(xs[2]) if r == 0 else qd.empty_step([obs])
        for x in xs:
            ref(x)
        out[f"pad/{name}"] = [(o.hist_counts.clone(), o.min_vals.clone(), *o.calculate_range())
                              for o in (obs, ref)]
    return out


def _imatrix_step(r) -> dict:
    """imatrix_mse with sync_every_step: the range of the step's tensors concatenated."""
    out = {}
    imp = _x(9, (32,)).abs() + 0.1
    for name, spec in (("tensor", QuantSpec()), ("channel", QuantSpec(layout=Channel(-1)))):
        xs = [_x(i, (2, 4, 32)) * (1 + i) for i in range(3)]
        obs = quantscope.get_observer("imatrix_mse", spec, importance=imp)
        obs.sync_every_step = True
        ref = quantscope.get_observer("imatrix_mse", spec, importance=imp)
        obs(xs[r])
        ref(torch.cat(xs[:2]))
        first = (obs.min_vals.clone(), ref.min_vals.clone())
        obs(xs[2]) if r == 0 else qd.empty_step([obs])  # rank 1 without data
        ref(xs[2])
        out[f"imatrix/{name}"] = [first, (obs.calculate_qparams().scale,
                                          ref.calculate_qparams().scale)]
    return out


def _load_then_sync(r) -> dict:
    """A synced state saved, loaded on every rank, fed further and synced again."""
    out = {}
    a = [_x(i, (16, 64)) for i in range(2)]
    b = [_x(5 + i, (4, 64)) * 20 for i in range(2)]
    for fam in ("static_minmax", "percentile"):
        obs = quantscope.get_observer(fam, QuantSpec())
        obs(a[r])
        obs.sync()
        resumed = quantscope.get_observer(fam, QuantSpec())
        resumed.load_state_dict(obs.state_dict())
        resumed.sync()  # no rank fed it: the same state
        idle = int(resumed.observed_tokens)
        resumed(b[r])
        err = error_text(resumed.sync)
        ref = quantscope.get_observer(fam, QuantSpec())
        for x in a + b:
            ref(x)
        out[f"load/{fam}"] = (idle, err, int(resumed.observed_tokens), resumed.min_vals.clone(),
                              int(ref.observed_tokens), ref.min_vals.clone())
    return out


def _static_nan(r) -> dict:
    """A NaN in rank 1's batch, in a static activation role."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 4)).eval()
    batches = [_x(i, (2, 8)) for i in range(2)]
    batches[1][0, 0] = float("nan")
    return {f"nan/{d}": error_text(lambda d=d: quantscope.calibrate(
        model, batches, "w8a8", progress=False, runtime=Runtime(distributed=d)))
        for d in (False, True)} | {"nan/after": comm.all_sum(r + 1)}


def _torch_ao(r) -> dict:
    obs = torch_ao.HistogramObserver()
    obs(_x(r, (4, 8)))
    return {"ao": error_text(lambda: qd.sync_observers([obs]))}


def _scenarios(r, out):
    for scenario in (_padded_step, _imatrix_step, _load_then_sync, _static_nan, _torch_ao):
        out.update(scenario(r))


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, 2, TIMEOUT)


@pytest.mark.parametrize("name", ["mxfp8", "asym"])
def test_step_synced_histogram_drops_every_ranks_padding_zeros(ranks, name):
    for got, ref in rank_results(ranks, f"pad/{name}"):
        assert all(torch.equal(g, f) for g, f in zip(got, ref)), (got, ref)


@pytest.mark.parametrize("name", ["tensor", "channel"])
def test_step_synced_imatrix_equals_one_process_on_the_concatenation(ranks, name):
    for first, last in rank_results(ranks, f"imatrix/{name}"):
        assert torch.equal(*first) and torch.equal(*last), (first, last)


def test_a_loaded_synced_state_counts_once_in_a_later_sync(ranks):
    for idle, err, tokens, lo, ref_tokens, ref_lo in rank_results(ranks, "load/static_minmax"):
        assert (idle, err, tokens) == (32, None, ref_tokens) and torch.equal(lo, ref_lo)
    # a histogram fed after its (loaded) sync raises everywhere, as after the sync itself
    for idle, err, *_ in rank_results(ranks, "load/percentile"):
        assert idle == 32 and "was observed after its last sync" in err


def test_a_static_roles_nan_raises_the_one_process_value_error_on_every_rank(ranks):
    one = rank_results(ranks, "nan/False")
    assert one[0].startswith("ValueError: calibrate: layer '0' input: calibration batch 1")
    assert rank_results(ranks, "nan/True") == one  # word for word (probe s45)
    assert rank_results(ranks, "nan/after") == [3, 3]


def test_syncing_a_torch_ao_observer_says_why_it_cannot(ranks):
    for err in rank_results(ranks, "ao"):
        assert err.startswith("NotImplementedError: HistogramObserver: the observer does not "
                              "declare how its state syncs"), err
