"""Distributed calibration where the ranks are given different inputs (probe 2): a rank that
syncs no observers, recipes that match different layers, a check failing on one rank
before the pass, ``auto`` scoring each rank's own batches, ranks holding different weights
(or dtypes), and float64 sample rows. Each raises the same clear error on every rank (no
rank left waiting) or gives every rank the same result.

One spawn of 2 gloo processes runs every scenario; the process group's timeout is short,
so a rank left waiting fails in seconds, not minutes.
"""

from __future__ import annotations

import pytest
import torch
from ports import error_text, rank_results, spawn_ranks

import quantscope
from quantscope import comm
from quantscope import distributed as qd
from quantscope.calibration import Auto, Runtime, Sequential, preset
from quantscope.calibration.choice.auto import OutputDivergence, choose
from quantscope.calibration.run.gather import share_pieces

pytestmark = [pytest.mark.dist, pytest.mark.extended]  # spawns its own process group

TIMEOUT = 15  # seconds a collective waits for a peer; the spawn gets a few times that
DIST = Runtime(distributed=True)


def _mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 64)).to(dtype).eval()


def _batches(n=4, seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 64, generator=g) * scale for _ in range(n)]


def _calibrate(r, model=None, recipe="w8a8", **kw):
    """The error text of a distributed calibration, then a tiny all_sum: both ranks must
    reach it together (a rank left behind would pair it with a collective of its own)."""
    model = _mlp() if model is None else model
    dtype = next(model.parameters()).dtype  # each rank's batches in its model's dtype
    err = error_text(quantscope.calibrate, model, [b.to(dtype) for b in _batches()], recipe,
                     progress=False, runtime=DIST, **kw)
    return err, comm.all_sum(r + 1)


def _sync_none_here(r) -> dict:
    obs = quantscope.get_observer("static_minmax", quantscope.QuantSpec())
    obs(torch.randn(8, 8))
    return {"sync/direct": (error_text(qd.sync_observers, [obs] if r == 0 else []),
                            comm.all_sum(r + 1)),
            "sync/calibrate": _calibrate(r, recipe="w8a8" if r == 0 else "w8a8-dynamic")}


def _other_layers(r) -> dict:
    return {"layers": _calibrate(r, recipe=preset("w8a8", "static_minmax",
                                                  ignore=["2"] if r else []))}


def _checks_fail_on_one_rank(r) -> dict:
    # int4 group 128 cannot take 64 columns; sequential does not combine with distributed
    return {"check/shape": _calibrate(r, recipe="w4a8" if r else "w8a8"),
            "check/sequential": _calibrate(r, sequential=Sequential() if r else None)}
    # (auto given no batch on one rank scores the others': test_dist_s45_pieces.py)


def _other_weights(r) -> dict:
    return {"weights/seed": _calibrate(r, _mlp(seed=r)),
            "weights/dtype": _calibrate(r, _mlp(dtype=torch.bfloat16 if r else torch.float32)),
            "weights/same": _calibrate(r, _mlp())}


def _auto_own_batches(r) -> dict:
    """Each rank passes its own batches: the choice and scores must be the same everywhere."""
    mine = _batches(seed=100 + r, scale=1 + 3 * r)
    c = quantscope.calibrate(_mlp(), mine, "w8a8", observer="auto", progress=False,
                             auto=Auto(candidates=("static_minmax", "percentile",
                                                   "histogram_mse")), runtime=DIST)
    said = {k: c.info["auto"][k] for k in ("score_pieces", "score_tokens")}
    return {"auto/calibrate": (c.info["auto"]["roles"], c.info["auto"]["scores"],
                               c.states["0"]["input"].qparams.scale, said,
                               comm.all_sum(sum(b.shape[0] for b in mine)))}


def _auto_scores_union(r) -> dict:
    """The scoring alone, on fixed candidate configurations: rank 0 scores 2 pieces, rank 1
    one; the means equal one process's over all 3 pieces (to rounding)."""
    model = _mlp()
    calib = _batches(seed=7)
    configs = {n: quantscope.calibrate(model, calib, "w8a8", observer=n, progress=False).states
               for n in ("static_minmax", "histogram_mse", "mse")}
    pieces = _batches(3, seed=50, scale=2.0)
    mine = pieces[:2] if r == 0 else pieces[2:]
    div = OutputDivergence(model, mine)
    share_pieces(div)
    got = choose(div, configs, "static_minmax", drop=1e9)
    one = choose(OutputDivergence(model, pieces), configs, "static_minmax", drop=1e9)
    return {"auto/union": (got, one, div.pieces)}


def _float64_rows(r) -> dict:
    x = torch.tensor([[1e300, 1.0 + 1e-12]], dtype=torch.float64)
    rows = qd.gather_samples({"a": [x * (r + 1)]}, 10)["a"][0]
    return {"samples/float64": (rows.dtype, rows.tolist())}


def _scenarios(r, out):
    for scenario in (_sync_none_here, _other_layers, _checks_fail_on_one_rank, _other_weights,
                     _auto_own_batches, _auto_scores_union, _float64_rows):
        out.update(scenario(r))


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, 2, TIMEOUT)


def _every_rank_raises(ranks, key, *parts):
    got = rank_results(ranks, key)
    for err, after in got:
        assert after == 3, got  # both ranks reached the exchange after it together
        assert err is not None and all(p in err for p in parts), got
    return [err for err, _ in got]


def test_a_rank_syncing_no_observers_raises_with_the_others(ranks):
    _every_rank_raises(ranks, "sync/direct", "ValueError: sync: the ranks sync different "
                       "observers")
    # calibrate compares the recipes first (s59), before any observer syncs
    errs = _every_rank_raises(ranks, "sync/calibrate", "ValueError: calibrate: the ranks give "
                              "different options: the recipe (by label) is ('w8a8',) on rank "
                              "0, ('w8a8-dynamic',) on rank 1")
    assert errs[0] == errs[1]


def test_recipes_matching_different_layers_raise_a_value_error_everywhere(ranks):
    # calibrate compares the recipes first (s59): what makes them match other layers
    errs = _every_rank_raises(ranks, "layers", "ValueError: calibrate: the ranks give "
                              "different options: recipe 'w8a8': ignore is [] on rank 0, ['2'] "
                              "on rank 1")
    assert errs[0] == errs[1]


def test_a_check_failing_on_one_rank_raises_on_every_rank(ranks):
    own, other = _every_rank_raises(ranks, "check/shape", "cannot take int4 group:128")
    assert other.startswith("ValueError: calibrate: layer '0' weight") and \
        own.endswith("(calibrate's checks failed on rank(s) [1])"), (own, other)
    own, other = _every_rank_raises(ranks, "check/sequential",
                                    "sequential and distributed calibration do not combine")
    assert own.endswith("(calibrate's checks failed on rank(s) [1])"), own


def test_ranks_holding_different_weights_or_dtypes_raise_naming_the_layer(ranks):
    errs = _every_rank_raises(ranks, "weights/seed", "ValueError: calibrate: the ranks hold "
                              "different weights: layer '0' is float32:")
    assert errs[0] == errs[1]
    _every_rank_raises(ranks, "weights/dtype", "layer '0' is float32", "but bfloat16")
    assert rank_results(ranks, "weights/same") == [(None, 3), (None, 3)]


def test_auto_chooses_the_same_on_every_rank_from_their_own_batches(ranks):
    (roles0, scores0, s0, said0, rows), (roles1, scores1, s1, said1, _) = rank_results(
        ranks, "auto/calibrate")
    assert roles0 == roles1 and scores0 == scores1 and torch.equal(s0, s1)
    # the pieces and tokens scored are every rank's (each counted its own before)
    assert said0 == said1 and said0["score_tokens"] == rows, (said0, said1, rows)


def test_auto_scores_are_the_mean_over_every_ranks_pieces(ranks):
    for (best, scores, count), (one_best, one_scores) in (
            ((g[0], g[1], c), o) for g, o, c in rank_results(ranks, "auto/union")):
        assert count == 2 and best == one_best
        for n, (mean, _) in one_scores.items():
            assert scores[n][0] == pytest.approx(mean, rel=1e-12), (scores, one_scores)
    assert rank_results(ranks, "auto/union")[0][0] == rank_results(ranks, "auto/union")[1][0]


def test_gather_samples_keeps_float64_rows(ranks):
    for dtype, rows in rank_results(ranks, "samples/float64"):
        assert dtype == torch.float64
        assert rows == [[1e300, 1.0 + 1e-12], [2e300, 2.0 + 2e-12]]
