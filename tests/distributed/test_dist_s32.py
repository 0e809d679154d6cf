"""Distributed defects of session 32: a float64 model in the ranks' weight check (and a
rank-local failure there reaching every rank), torch.ao's compat observers in
``sync_observers`` (min-max ones sync as one process; the moving averages and the histogram
refuse, saying why), and what ``memoryless_minmax``'s synced range equals per layout.

One spawn of 2 gloo processes runs every scenario; each rank computes the one-process figure
it compares with from every rank's (seeded) data. The process group's timeout is short, so a
rank left waiting fails in seconds, not minutes.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from ports import error_text, rank_results, spawn_ranks

import quantscope
from quantscope import QuantSpec, comm
from quantscope import distributed as qd
from quantscope.calibration import Runtime
from quantscope.calibration.run import gather
from quantscope.compat import torch_ao
from quantscope.layout import Channel, Group, Tensor, Token

pytestmark = pytest.mark.dist  # spawns its own process group

TIMEOUT = 20  # seconds a collective waits for a peer; the spawn gets a few times that
WORLD = 2
DOCS = pathlib.Path(__file__).parents[2] / "docs" / "guide" / "distributed.md"


def _x(seed, shape, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 4)).to(dtype)


def _scales(cal) -> dict:
    return {(layer, role): s.qparams.scale for layer, roles in cal.states.items()
            for role, s in roles.items()}


def _float64_weights(r) -> dict:
    """A float64 model on every rank (distributed and one process), on rank 1 only, a
    float64 weight beyond float32's range, and a weight check that fails on rank 1 only
    (a weight left on the meta device)."""
    batches = [_x(i, (2 + i, 8)).double() for i in range(3)]
    dist_cal, one = (quantscope.calibrate(_model(torch.float64), batches, "w8a8",
                                          observer="static_minmax", progress=False,
                                          runtime=Runtime(distributed=d)) for d in (True, False))
    dtype = torch.float64 if r == 1 else torch.float32
    big = _x(5, (4, 4)).double() * 1e300
    return {
        "f64/dist": _scales(dist_cal), "f64/one": _scales(one),
        "f64/rank1": error_text(quantscope.calibrate, _model(dtype),
                                [b.to(dtype) for b in batches], "w8a8",
                                progress=False, runtime=Runtime(distributed=True)),
        "f64/big": error_text(gather.check_same_weights, {"w": big}),
        "f64/meta": error_text(gather.check_same_weights,
                               {"w": torch.ones(4, 4, device="meta" if r == 1 else "cpu")}),
        "f64/after": comm.all_sum(r + 1),
    }


def _ao_batches(r, name, ch_axis):
    """Rank 0 sees batches 0 and 1, rank 1 batch 2 (with a NaN in channel 1 in ``nan``);
    one process sees all three."""
    xs = [_x(i, (3 + i, 6) if ch_axis == 1 else (6, 3 + i), 1 + i) for i in range(3)]
    if name == "nan":
        xs[2][0, 1] = float("nan")
        xs[2][1, 3] = float("inf")
    return [xs[0], xs[1]] if r == 0 else [xs[2]], xs


def _torch_ao_sync(r) -> dict:
    """torch.ao's min-max compat classes after a sync, and one process's over every batch;
    per channel, an idle rank (empty buffers) too; then one more batch on rank 1 and a
    second sync; and the same observer synced with a native one in one call."""
    out = {}
    cases = {"tensor": (torch_ao.MinMaxObserver, {}, 1),
             "sym": (torch_ao.MinMaxObserver, {"qscheme": torch.per_tensor_symmetric}, 1),
             "channel1": (torch_ao.PerChannelMinMaxObserver, {"ch_axis": 1}, 1),
             "channel0": (torch_ao.PerChannelMinMaxObserver, {"ch_axis": 0}, 0),
             "nan": (torch_ao.PerChannelMinMaxObserver, {"ch_axis": 1}, 1)}
    for name, (cls, kw, axis) in cases.items():
        mine, every = _ao_batches(r, name, axis)
        obs, ref = cls(**kw), cls(**kw)
        for x in mine:
            obs(x)
        for x in every:
            ref(x)
        assert obs.sync() is obs
        out[f"ao/{name}"] = [(o.min_val.clone(), o.max_val.clone()) for o in (obs, ref)]
        if name != "nan":
            out[f"ao/{name}/qparams"] = [o.calculate_qparams() for o in (obs, ref)]
        more = _x(7, every[0].shape, 9.0)
        if r == 1:
            obs(more)
        ref(more)
        qd.sync_observers([obs])
        out[f"ao/{name}/again"] = [(o.min_val.clone(), o.max_val.clone()) for o in (obs, ref)]
    # an idle rank (rank 1 observes nothing): its empty per-channel buffers take the result
    obs, ref = torch_ao.PerChannelMinMaxObserver(), torch_ao.PerChannelMinMaxObserver()
    if r == 0:
        obs(_x(3, (5, 4)))
    ref(_x(3, (5, 4)))
    obs.sync()
    out["ao/idle"] = [(o.min_val.clone(), o.max_val.clone()) for o in (obs, ref)]
    # with a native observer, in one call
    ao, native = torch_ao.MinMaxObserver(), quantscope.get_observer("static_minmax", QuantSpec())
    for o in (ao, native):
        o(_x(r, (4, 8), 1 + r))
    qd.sync_observers([native, ao])
    every = torch.cat([_x(i, (4, 8), 1 + i) for i in range(WORLD)])
    out["ao/mixed"] = [(float(ao.min_val), float(ao.max_val)),
                       (float(native.min_vals), float(native.max_vals)),
                       (float(every.min()), float(every.max()))]
    return out


def _torch_ao_refusals(r) -> dict:
    out = {}
    for cls in (torch_ao.MovingAverageMinMaxObserver,
                torch_ao.MovingAveragePerChannelMinMaxObserver, torch_ao.HistogramObserver):
        obs = cls()
        obs(_x(r, (4, 8)))
        out[f"refuse/{cls.__name__}"] = error_text(obs.sync)
    out["refuse/after"] = comm.all_sum(r + 1)
    return out


#: layouts where the synced range is the concatenation's (along the dim named), and the
#: others: there each unit is the MIN / MAX of the ranks' same unit
_CONCAT = {"tensor": (Tensor(), 0), "channel_last": (Channel(-1), 0),
           "channel0": (Channel(0), 1)}
_UNITWISE = {"group4": Group(4), "token": Token()}


def _memoryless(r) -> dict:
    """Rank r's last tensor (an earlier one first, which must not count)."""
    out = {}
    for name, (layout, dim) in _CONCAT.items():
        shape = (6, 3 + 2 * r) if dim == 1 else (3 + 2 * r, 6)
        lasts = [_x(10 + i, (6, 3 + 2 * i) if dim == 1 else (3 + 2 * i, 6), 1 + i)
                 for i in range(WORLD)]
        obs = quantscope.get_observer("memoryless_minmax", QuantSpec(layout=layout))
        obs(_x(99, shape, 50.0))  # not the last: forgotten
        obs(lasts[r])
        obs.sync()
        ref = quantscope.get_observer("memoryless_minmax", QuantSpec(layout=layout))
        ref(torch.cat(lasts, dim))
        out[f"memoryless/{name}"] = [(o.min_vals.clone(), o.max_vals.clone(),
                                      o.calculate_qparams().scale) for o in (obs, ref)]
    for name, layout in _UNITWISE.items():
        lasts = [_x(20 + i, (4, 8), 1 + i) for i in range(WORLD)]
        obs = quantscope.get_observer("memoryless_minmax", QuantSpec(layout=layout))
        obs(lasts[r])
        obs.sync()
        own = []
        for x in lasts:
            one = quantscope.get_observer("memoryless_minmax", QuantSpec(layout=layout))
            one(x)
            own.append((one.min_vals, one.max_vals))
        cat = quantscope.get_observer("memoryless_minmax", QuantSpec(layout=layout))
        cat(torch.cat(lasts))
        out[f"memoryless/{name}"] = (
            obs.min_vals.clone(), obs.max_vals.clone(),
            torch.minimum(*[lo for lo, _ in own]), torch.maximum(*[hi for _, hi in own]),
            obs.min_vals.numel(), cat.min_vals.numel())
    return out


def _scenarios(r, out):
    for scenario in (_float64_weights, _torch_ao_sync, _torch_ao_refusals, _memoryless):
        out.update(scenario(r))


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, WORLD, TIMEOUT)


# ------------------------------------------------------------------ 1. the weight check
def test_a_float64_model_calibrates_distributed_as_one_process(ranks):
    for got, one in zip(rank_results(ranks, "f64/dist"), rank_results(ranks, "f64/one")):
        assert got.keys() == one.keys()
        assert all(torch.equal(got[k], one[k]) for k in one), (got, one)


def test_a_float64_model_on_one_rank_only_is_named_on_every_rank(ranks):
    for err in rank_results(ranks, "f64/rank1"):
        assert err.startswith("ValueError: calibrate: the ranks hold different weights: "
                              "layer '0' is float32:"), err
        assert "but float64" in err and "on rank 1" in err


def test_float64_weights_beyond_float32s_range_compare_equal(ranks):
    assert rank_results(ranks, "f64/big") == [None] * WORLD


def test_a_weight_check_failing_on_one_rank_raises_on_every_rank(ranks):
    own, peer = rank_results(ranks, "f64/meta")[1], rank_results(ranks, "f64/meta")[0]
    assert own.startswith("NotImplementedError: Cannot copy out of meta tensor"), own
    assert peer == own + " (calibrate's weight check failed on rank(s) [1])"
    assert rank_results(ranks, "f64/after") == [3] * WORLD  # still in step


# ------------------------------------------------------------------ 2. torch.ao observers
@pytest.mark.parametrize("name", ["tensor", "sym", "channel1", "channel0", "nan"])
def test_torch_ao_min_max_observers_sync_as_one_process(ranks, name):
    for key in (f"ao/{name}", f"ao/{name}/again"):
        for (lo, hi), (ref_lo, ref_hi) in rank_results(ranks, key):
            for got, ref in ((lo, ref_lo), (hi, ref_hi)):
                torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
    if name == "nan":  # the NaN stays in its channel, the inf is a value
        (lo, hi), _ = rank_results(ranks, "ao/nan")[0]
        assert lo.isnan().tolist() == [False, True, False, False, False, False]
        assert hi[3] == float("inf")
        return
    for (scale, zp), (ref_scale, ref_zp) in rank_results(ranks, f"ao/{name}/qparams"):
        assert torch.equal(scale, ref_scale) and torch.equal(zp, ref_zp)


def test_an_idle_rank_takes_the_torch_ao_per_channel_result(ranks):
    for (lo, hi), (ref_lo, ref_hi) in rank_results(ranks, "ao/idle"):
        assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi)


def test_torch_ao_and_native_observers_sync_in_one_call(ranks):
    for ao, native, every in rank_results(ranks, "ao/mixed"):
        assert ao == native == every


@pytest.mark.parametrize("cls, why", [
    ("MovingAverageMinMaxObserver", "moving average of min / max"),
    ("MovingAveragePerChannelMinMaxObserver", "moving average of min / max"),
    ("HistogramObserver", "bins depend on the order in which its range grew")])
def test_torch_ao_observers_that_cannot_sync_say_why_on_every_rank(ranks, cls, why):
    for err in rank_results(ranks, f"refuse/{cls}"):
        assert err.startswith(f"NotImplementedError: {cls}: the observer does not declare how "
                              f"its state syncs across processes: torch.ao's "), err
        assert why in err and "observers of quantscope.get_observer sync" not in err
    assert rank_results(ranks, "refuse/after") == [3] * WORLD


# ------------------------------------------------------------------ 3. memoryless_minmax
@pytest.mark.parametrize("name", list(_CONCAT))
def test_memoryless_minmax_synced_is_the_concatenations_per_tensor_and_channel(ranks, name):
    for got, ref in rank_results(ranks, f"memoryless/{name}"):
        assert all(torch.equal(g, f) for g, f in zip(got, ref)), (got, ref)


@pytest.mark.parametrize("name", list(_UNITWISE))
def test_memoryless_minmax_synced_is_unitwise_for_other_layouts(ranks, name):
    for lo, hi, ref_lo, ref_hi, units, cat_units in rank_results(ranks, f"memoryless/{name}"):
        assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi)
        assert units * WORLD == cat_units  # the concatenation has other units


def test_the_guide_says_which_layouts_give_the_concatenations_range():
    row = next(line for line in DOCS.read_text().splitlines()
               if line.startswith("| the last result of memoryless searches"))
    assert "per-tensor and per-channel" in row and "unit" in row, row
    guide = DOCS.read_text()
    assert "Any observer syncs" not in guide
    assert "torch.ao" in guide and "MinMaxObserver" in guide
