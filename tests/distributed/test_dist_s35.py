"""Distributed defects of session 35, where one rank's batches differ from the other's: a
SmoothQuant forward failing on one rank left the other waiting in the ranges' reduction
until the group's timeout, and a rank passing no batch found no fusion groups, so the ranks
merged different input slots and the sync aborted the process (a gloo size mismatch).

One spawn of 2 gloo processes; the group's timeout is short, so a rank left waiting fails
in seconds."""

from __future__ import annotations

import pytest
import torch
from ports import error_text, rank_results, spawn_ranks
from tiny_models import llama

import quantscope
from quantscope.calibration import Outliers, Runtime

pytestmark = pytest.mark.dist  # spawns its own process group

TIMEOUT = 20
WORLD = 2


def _scales(cal) -> dict:
    return {(layer, role): s.qparams.scale for layer, roles in cal.states.items()
            for role, s in roles.items()}


def _scenarios(r, out):
    model, batches = llama()
    bad = [b.clone() for b in batches]
    bad[0][0, 0] = 5000  # past the vocabulary: the embedding raises, on rank 1 only
    # the ranges are measured on the lowest rank that holds a batch: rank 0 passes none
    out["smooth"] = error_text(quantscope.calibrate, model, bad if r == 1 else [],
                               "w8a8", observer="static_minmax", progress=False,
                               outliers=Outliers(smooth=0.5),
                               runtime=Runtime(distributed=True))
    cal = quantscope.calibrate(model, batches if r == 0 else [], "w8a8",
                               observer="static_minmax", progress=False,
                               runtime=Runtime(distributed=True))
    out["empty"] = (_scales(cal), cal.info.get("fusion_groups"))
    if r == 0:  # one process over the batches the ranks' shards held (rank 0's 0 and 2)
        one = quantscope.calibrate(model, batches[0::2], "w8a8", observer="static_minmax",
                                   progress=False)
        out["one"] = (_scales(one), one.info.get("fusion_groups"))


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, WORLD, TIMEOUT)


def test_a_smoothquant_forward_failing_on_one_rank_raises_on_every_rank(ranks):
    own, peer = rank_results(ranks, "smooth")[1], rank_results(ranks, "smooth")[0]
    assert own.startswith("IndexError: index out of range"), own
    assert peer == own + " (SmoothQuant's ranges failed on rank(s) [1])", peer


def test_a_rank_without_batches_merges_the_fusion_groups_the_others_found(ranks):
    (got0, groups0), (got1, groups1) = rank_results(ranks, "empty")
    one, one_groups = ranks[0]["one"]
    assert groups0 == groups1 == one_groups and one_groups  # q/k/v and gate/up
    for got in (got0, got1):
        assert got.keys() == one.keys()
        assert all(torch.equal(got[k], one[k]) for k in one)
