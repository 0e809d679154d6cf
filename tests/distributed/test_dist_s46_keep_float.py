"""``Outliers(keep_float=n)`` across ranks that pass their own batches. Each rank ranked the
activations on the first batch of its own list, with no exchange: the ranks could keep
different tensors in float (rank 0, which writes, held another calibration than the rest,
silently), and a rank given ``[]`` raised "keep_float needs a batch" alone. Now the lowest
rank that holds a batch ranks on its first one and every rank keeps what that ranking says:
what one process ranking on that batch keeps (a batch of 0 rows passed over, as one process
passes it over); with no batch on any rank, every rank raises one process's error.

One spawn of 2 gloo processes; each rank calibrates the one-process references too."""

from __future__ import annotations

import warnings

import pytest
import torch
from ports import error_text, rank_results, spawn_ranks

import quantscope
from quantscope.calibration import Outliers, Runtime

pytestmark = pytest.mark.dist  # spawns its own process group

TIMEOUT = 30


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()


def _batch(seed, scale=1.0):
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(seed)) * scale


# ranked first, these keep different inputs float (the last layer's, the first layer's)
WIDE, NARROW, OTHER = _batch(0), _batch(1, 0.05), _batch(100)
ZERO = torch.zeros(0, 16)  # every module passes it through: nothing to rank

#: case -> (rank 0's list, rank 1's list, one process's list: first the batch ranked on,
#: then what the ranks' shares observe); static_minmax: the ranks' union is one process's
CASES = {
    "own": ([WIDE, OTHER], [NARROW, OTHER], [WIDE, OTHER]),  # shares: WIDE | OTHER
    "empty": ([], [NARROW, NARROW], [NARROW]),  # rank 1's share: its second batch
    # rank 0 holds a batch of 0 rows only: rank 1, holding a value, ranks (s50's mutant O06
    # ranked on rank 0's empty batch, keeping nothing in float)
    "zero rows": ([ZERO], [NARROW, NARROW], [ZERO, NARROW]),
}


def _calibrate(batches, recipe="w8a8", distributed=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantscope.calibrate(_model(), batches, recipe, observer="static_minmax",
                                    outliers=Outliers(keep_float=1), progress=False,
                                    runtime=Runtime(distributed=distributed))


def _held(cal) -> dict:
    """What ``apply`` runs: each tensor's scale and zero point, or how it runs without."""
    return {(layer, role): ("dynamic" if st.qparams is None else
                            (st.qparams.scale, st.qparams.zero_point))
            for layer, roles in cal.states.items() for role, st in roles.items()}


def _scenarios(r, out):
    for case, (*lists, _) in CASES.items():
        try:
            cal = _calibrate(lists[r], distributed=True)
        except Exception as e:  # noqa: BLE001 -- the parent compares the ranks' errors
            out[case] = f"{type(e).__name__}: {e}"
            continue
        out[case] = None
        out[f"{case}/kept"] = cal.info["keep_float"]["tensors"]
        out[f"{case}/held"] = _held(cal)
    # no batch on any rank (a run-time input recipe calibrates without one): one error on all
    out["none"] = error_text(_calibrate, [], "w8a8-dynamic", distributed=True)
    # NaN in the batch ranked on alone (rank 1's share is its second): its error on all
    nan = torch.full((8, 16), float("nan"))
    out["nan"] = error_text(_calibrate, [[], [nan, NARROW]][r], distributed=True)


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, 2, TIMEOUT)


@pytest.mark.parametrize("case", sorted(CASES))
def test_ranks_keep_what_one_process_keeps(ranks, case):
    *_, alone = CASES[case]
    errors = rank_results(ranks, case)
    assert errors == [None, None], errors
    one = _calibrate(alone)
    kept = rank_results(ranks, f"{case}/kept")
    assert kept == [one.info["keep_float"]["tensors"]] * 2
    want = _held(one)
    for held in rank_results(ranks, f"{case}/held"):
        assert held.keys() == want.keys()
        for key, value in want.items():
            if value == "dynamic":
                assert held[key] == "dynamic", key
            else:
                assert all(map(torch.equal, held[key], value)), key


def test_cases_rank_differently():
    """The batches do choose differently: a test of the rule, not of one choice."""
    firsts = [_calibrate([b, OTHER]).info["keep_float"]["tensors"] for b in (WIDE, NARROW)]
    assert firsts[0] != firsts[1], firsts


def test_no_batch_anywhere_raises_one_process_error(ranks):
    want = error_text(_calibrate, [], "w8a8-dynamic")
    assert want is not None and "keep_float needs a batch" in want
    assert rank_results(ranks, "none") == [want, want]


def test_ranking_error_raises_on_every_rank(ranks):
    other, ranker = rank_results(ranks, "nan")
    assert ranker is not None and "brought NaN or inf" in ranker, ranker
    assert other == ranker + " (keep_float's ranking failed on rank(s) [1])"
