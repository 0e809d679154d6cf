"""Distributed NaN / inf of probe s45: batches bringing NaN on both ranks made each rank raise
the error of its own first bad batch (rank 0 named batch 2, rank 1 batch 1), not the
one-process error. Now the ranks agree on the batch one process would name (the first
observer in the layers' order, then the first batch after which it saw them) and every rank
raises that ValueError, word for word. A run-time (dynamic) role's NaN in a row that no
rank's row sample kept raised on neither (or on one process and not on the ranks): now
every row is checked in the pass, and every rank raises the one-process error.

One spawn of 2 gloo processes runs every scenario; each rank also calibrates in one process
(``distributed=False``) for the error to compare with. The process group's timeout is short,
so a rank left waiting fails in seconds."""

from __future__ import annotations

import pytest
import torch
from ports import error_text, rank_results, spawn_ranks

import quantscope
from quantscope import QuantSpec, comm
from quantscope.calibration import Runtime, Sampling
from quantscope.distributed import sync_observers

pytestmark = pytest.mark.dist  # spawns its own process group

TIMEOUT = 20


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight[0].fill_(1e36)  # a batch of 1000s overflows its output row 0 to inf
    return model.eval()


def _batches(kind: str) -> list[torch.Tensor]:
    """Four batches (rank 0 forwards 0 and 2, rank 1 forwards 1 and 3): ``"both"``, NaN in
    layer 0's input in batches 1 and 2; ``"later_layer"``, inf in layer 2's input alone in
    batch 1 (layer 0's output overflows), NaN in layer 0's input in batch 2."""
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    if kind == "both":
        batches[1][0, 0] = float("nan")
    else:
        batches[1] = torch.full((4, 16), 1000.0)
    batches[2][0, 0] = float("nan")
    return batches


def _scenarios(r, out):
    for kind in ("both", "later_layer"):
        for d in (False, True):
            out[f"{kind}/{d}"] = error_text(
                quantscope.calibrate, _mlp(), _batches(kind), "w8a8", observer="static_minmax",
                progress=False, runtime=Runtime(distributed=d))
    for row in range(0, 8, 3):  # one sampled row of 8 per batch: most NaN rows not kept
        batches = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
                   for i in range(4)]
        batches[1][row, 3] = batches[2][row, 5] = float("nan")
        for d in (False, True):
            out[f"dynamic/{row}/{d}"] = error_text(
                quantscope.calibrate, _mlp(), batches, "w8a8-dynamic", progress=False,
                sampling=Sampling(tokens=1), runtime=Runtime(distributed=d))
    # non_finite="ignore": rank r zeroes r + 1 NaN, then the counters sync
    obs = quantscope.get_observer("static_minmax", QuantSpec("int8"), non_finite="ignore")
    x = torch.ones(2, 8)
    x[0, :r + 1] = float("nan")
    obs(x)
    sync_observers([obs])
    out["ignored"] = int(obs.non_finite_count)
    out["after"] = comm.all_sum(comm.rank() + 1)  # the ranks are still in step


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, 2, TIMEOUT)


@pytest.mark.parametrize(("kind", "names"), [
    ("both", "layer '0' input: calibration batch 1 "),
    # layer 0's observer comes first in one process's order: its batch 2, not batch 1's
    # inf, which only layer 2 saw
    ("later_layer", "layer '0' input: calibration batch 2 "),
])
def test_nan_on_both_ranks_raises_the_one_process_error_on_every_rank(ranks, kind, names):
    one = rank_results(ranks, f"{kind}/False")
    assert one[0] == one[1]
    assert one[0].startswith(f"ValueError: calibrate: {names}(counting from 0) brought NaN or "
                             f"inf values (observer 'static_minmax')"), one[0]
    assert rank_results(ranks, f"{kind}/True") == one


@pytest.mark.parametrize("row", range(0, 8, 3))
def test_a_dynamic_roles_unsampled_nan_raises_the_one_process_error_on_every_rank(ranks, row):
    one = rank_results(ranks, f"dynamic/{row}/False")
    assert one[0] == one[1]
    assert one[0] is not None and one[0].startswith(
        "ValueError: calibrate: layer '0' input: calibration batch 1 (counting from 0) brought "
        "NaN or inf values (dynamic role, observer 'memoryless_minmax')"), one[0]
    assert rank_results(ranks, f"dynamic/{row}/True") == one


def test_the_ranks_counts_of_ignored_nan_add_up_in_the_sync(ranks):
    """``non_finite_count`` (what ``non_finite="ignore"`` zeroed, said in the qparams warning)
    is a SUM counter like the token count: after the sync every rank holds one process's
    count of both ranks' batches, 1 + 2, not its own."""
    assert rank_results(ranks, "ignored") == [1 + 2] * 2


def test_the_ranks_stay_in_step_after_the_nan(ranks):
    assert rank_results(ranks, "after") == [1 + 2] * 2
