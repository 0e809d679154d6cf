"""Mismatches across ranks that used to pair unrelated collectives or raise on one rank only:
``sync_every_step`` set on one rank (its step exchange met the other's sync() check: one
rank raised, the other hung until the group's timeout), ranks syncing observers that differ
(the error named none), and ``export`` with bad arguments (rank 0 raised, rank 1 returned
the path as if written).

One spawn of 2 gloo processes runs every scenario; the group's timeout is short, so a rank
left waiting fails in seconds, and each error must come at once on every rank.
"""

from __future__ import annotations

import tempfile
import time

import pytest
import torch
from ports import error_text, rank_results, spawn_ranks

import quantscope
from quantscope import QuantSpec
from quantscope import distributed as qd
from quantscope.calibration import Runtime

pytestmark = [pytest.mark.dist, pytest.mark.extended]  # spawns its own process group

TIMEOUT = 10  # seconds a collective waits for a peer; the spawn gets a few times that


def _timed(fn) -> tuple[str | None, float]:
    t = time.monotonic()
    return error_text(fn), time.monotonic() - t


def _in_step(r) -> tuple[float, float]:
    """A good sync after the error: the ranks are still in step (no pending collective)."""
    obs = quantscope.get_observer("static_minmax", QuantSpec())
    obs(torch.tensor([float(r), -2.0 * r]))
    obs.sync()
    return obs.min_vals.item(), obs.max_vals.item()


def _step_on_rank_0(r, family, other=None) -> tuple:
    """Rank 0 step-syncs ``family`` and feeds it; rank 1 syncs (or step-syncs ``other``)."""
    obs = quantscope.get_observer(family if r == 0 else other or family, QuantSpec())
    obs.sync_every_step = r == 0 or other is not None

    def run():
        obs(torch.randn(8, 64))
        obs.sync()

    return (*_timed(run), _in_step(r))


def _different_observers(r) -> tuple:
    same = quantscope.get_observer("static_minmax", QuantSpec())
    other = quantscope.get_observer("static_minmax", QuantSpec(symmetric=r == 0))
    for o in (same, other):
        o(torch.randn(4, 16))
    return (*_timed(lambda: qd.sync_observers([same, other])), _in_step(r))


def _exports(r) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16)).eval()
    cal = quantscope.calibrate(model, [torch.randn(4, 16) for _ in range(2)], "w8a8",
                               runtime=Runtime(distributed=True), progress=False)
    cases = {"model": ((), {}), "option": ((), {"bogus": 1}), "onnx": (("onnx",), {}),
             "opset": (("onnx",), {"example_inputs": torch.randn(2, 16), "opset": 13})}
    with tempfile.TemporaryDirectory() as d:  # (nothing is written: the arguments are wrong)
        return {f"export/{k}": error_text(quantscope.export, cal, model, f"{d}/{k}", *args, **kw)
                for k, (args, kw) in cases.items()}


def _scenarios(r, out):
    out["step/minmax"] = _step_on_rank_0(r, "minmax")
    out["step/percentile"] = _step_on_rank_0(r, "percentile")
    out["step/other"] = _step_on_rank_0(r, "minmax", other="percentile")
    out["different"] = _different_observers(r)
    out.update(_exports(r))


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, 2, TIMEOUT)


def _at_once_everywhere(ranks, key, *parts):
    got = rank_results(ranks, key)
    for err, took, after in got:
        assert err is not None and all(p in err for p in parts), got
        assert took < TIMEOUT / 2, got  # no rank waited for the group's timeout
        assert after == (-2.0, 1.0), got  # and the ranks are in step after it
    return [err for err, _, _ in got]


@pytest.mark.parametrize("family", ["minmax", "percentile"])
def test_sync_every_step_on_one_rank_raises_at_once_on_every_rank(ranks, family):
    here, there = _at_once_everywhere(ranks, f"step/{family}",
                                      "ValueError: sync: sync_every_step set on some ranks only")
    assert "('" + family + "', int8 tensor sym) exchanges a" in here, here
    assert "this rank syncs observers (sync()) while another rank exchanges a" in there, there


def test_ranks_stepping_different_observers_raise_at_once(ranks):
    _at_once_everywhere(ranks, "step/other", "ValueError: sync: the ranks step different "
                        "observers", "min-max step", "step's units")


def test_different_observers_are_named(ranks):
    errs = _at_once_everywhere(ranks, "different", "ValueError: sync: the ranks sync different "
                               "observers: the first that differs, #1 of 2 (")
    assert "int8 tensor sym) here" in errs[0] and "int8 tensor asym) here" in errs[1], errs


@pytest.mark.parametrize(("key", "message"), [
    ("model", "TypeError: export compressed-tensors: model must be a transformers"),
    ("option", "TypeError: export_compressed_tensors() got an unexpected keyword argument"),
    ("onnx", "ValueError: onnx export: example_inputs is required"),
    ("opset", "ValueError: onnx export: opset must be an integer >= 21"),
])
def test_export_argument_errors_raise_on_every_rank(ranks, key, message):
    got = rank_results(ranks, f"export/{key}")
    assert all(g is not None and g.startswith(message) for g in got), got
