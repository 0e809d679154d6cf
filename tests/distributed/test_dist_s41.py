"""Distributed defect of probe s41: options that differ between ranks. Auto's metric or
smoothing on one rank ran exchanges the others did not (gloo aborted every process, or a
rank waited out the timeout); keep_float or the sample size on one rank gave the ranks
different calibrations, silently. Now every rank raises the same ValueError naming the
option; the options that may differ (the sampling seed, progress) still may.

One spawn of 2 gloo processes; the group's timeout is short, so a rank left waiting fails
in seconds."""

from __future__ import annotations

import pytest
import torch
from ports import error_text, rank_results, spawn_ranks

import quantscope
from quantscope.calibration import Auto, Outliers, Runtime, Sampling, calibrate_many

pytestmark = pytest.mark.dist  # spawns its own process group

TIMEOUT = 20
WORLD = 2


def _calibrate(**options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    return quantscope.calibrate(model, batches, "w8a8", progress=False,
                                runtime=Runtime(distributed=True), **options)


def _scenarios(r, out):
    out["metric"] = error_text(_calibrate, observer="auto", auto=Auto(
        candidates=["minmax", "mse"], metric="model" if r == 0 else "tensor"))
    out["keep_float"] = error_text(_calibrate, outliers=Outliers(keep_float=r))
    out["tokens"] = error_text(_calibrate, observer="auto", sampling=Sampling(
        tokens=4 if r else 64), auto=Auto(candidates=["minmax", "mse"], metric="tensor"))
    # the same options spelt apart: a set of labels (its order is each process's string
    # hashing), a budget of 64 and of 64.0 (a reviewer found both refused, or a bare
    # StopIteration)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    out["spelt"] = error_text(
        calibrate_many, model, [torch.randn(4, 16)], {"a": "w8a8", "b": "w8a8"},
        progress=False, sampling=Sampling(budget_mb=64 if r else 64.0),
        runtime=Runtime(distributed=True, time_groups={"g": {"a", "b"}} if r else
                        {"g": ["b", "a"]}))
    # what may differ: the seed (the sample is gathered from every rank) and progress
    cal = _calibrate(sampling=Sampling(seed=r))
    out["scales"] = [s.qparams.scale.tolist() for roles in cal.states.values()
                     for s in roles.values() if s.qparams is not None]
    _option_checks(r, out)


def _loss(out, ref, batch):
    return 0.0


def _a_loss():
    return lambda out, ref, batch: 0.0


def _option_checks(r, out):
    """check_same_options itself, per case (s42's mutants): a loss counts by whether it is
    given (a lambda on each rank, their reprs apart by more than an address, agree; a loss
    on one rank only does not); a mapping's keys in another order, and 0.0 against -0.0
    (equal, their reprs not), agree."""
    from quantscope.calibration.options import Options
    from quantscope.calibration.run.gather import check_same_options

    groups = {"g": ["a", "b"], "h": ["c"]}
    cases = {
        "loss_one": Options(auto=Auto(metric="model", loss=_loss if r == 0 else None)),
        "loss_both": Options(auto=Auto(metric="model", loss=(
            lambda out, ref, batch: 1.0) if r == 0 else _a_loss())),
        "groups_order": Options(runtime=Runtime(time_groups=dict(
            reversed(groups.items())) if r else groups)),
        "smooth_zero": Options(outliers=Outliers(smooth=-0.0 if r else 0.0)),
    }
    for name, opts in cases.items():
        out[name] = error_text(check_same_options, opts)


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, WORLD, TIMEOUT)


@pytest.mark.parametrize("option, values", [
    ("metric", "Auto.metric is 'model' on rank 0, 'tensor' on rank 1"),
    ("keep_float", "Outliers.keep_float is 0 on rank 0, 1 on rank 1"),
    ("tokens", "Sampling.tokens is 64 on rank 0, 4 on rank 1")])
def test_an_option_differing_between_ranks_raises_on_every_rank(ranks, option, values):
    got = rank_results(ranks, option)
    assert got[0] == got[1] and got[0].startswith("ValueError: calibrate: the ranks give "
                                                  "different options: "), got
    assert values in got[0]


def test_options_that_may_differ_still_calibrate_alike(ranks):
    scales = rank_results(ranks, "scales")
    assert scales[0] == scales[1] and scales[0]


def test_the_same_options_spelt_apart_agree(ranks):
    assert rank_results(ranks, "spelt") == [None, None]


def test_options_check_compares_given_losses_and_canonical_values(ranks):
    got = rank_results(ranks, "loss_one")
    assert got[0] == got[1] and got[0].startswith("ValueError: calibrate: the ranks give "
                                                  "different options: "), got
    assert "Auto.loss is True on rank 0, False on rank 1" in got[0]
    for case in ("loss_both", "groups_order", "smooth_zero"):
        assert rank_results(ranks, case) == [None, None], case
