"""Distributed defect of probe s45: ``observer="auto"`` (metric ``"model"``) with ranks
passing their own batches, where one rank holds no scoring piece: its only batch brings NaN
under ``non_finite="ignore"``, its attention mask is all 0, or it passes none. That rank
decided "no piece left" on its own count and raised while the others went on into the
scoring's collectives (gloo aborted the process, or a peer's connection was reset). Now the
decision is made on every rank's counts, as one process given all their batches makes it:
the rank with no piece scores with none, the others' pieces are scored; where no rank holds
one, every rank raises that one process's error.

One spawn of 2 gloo processes; the group's timeout is short, so a rank left waiting fails
in seconds."""

from __future__ import annotations

import warnings

import pytest
import tiny_models
import torch
from ports import rank_results, spawn_ranks

import quantscope
from quantscope import comm
from quantscope.calibration import Auto, Runtime, calibrate_many, preset
from quantscope.calibration.choice.auto import OutputDivergence, choose

pytestmark = pytest.mark.dist  # spawns its own process group

TIMEOUT = 20
DIST = Runtime(distributed=True)
NAMES = ("static_minmax", "mse")


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _x(seed, nan=False):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
    if nan:
        x[0, 0] = float("nan")
    return x


def _docs(masked=False):
    ids = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros_like(ids) if masked else torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": mask}


def _auto(model, mine, recipe="w8a8", observer="auto", loss=None):
    """``mine``'s distributed auto calibration: ``(what info['auto'] says, the scales)``, or
    the error text; then a tiny all_sum both ranks must reach together."""
    def run():
        auto = Auto(candidates=NAMES, loss=loss) if observer in ("auto", None) else None
        c = quantscope.calibrate(model, mine, recipe, observer=observer, progress=False,
                                 runtime=DIST, auto=auto)
        info = {k: c.info["auto"].get(k) for k in ("chose", "roles", "scores", "score_pieces",
                                                   "score_tokens", "non_finite_pieces")}
        return info, {(n, r): s.qparams.scale for n, rs in c.states.items()
                      for r, s in rs.items() if s.qparams is not None}
    try:
        got = run()
    except Exception as e:  # noqa: BLE001 -- the parent compares the ranks' errors
        got = f"{type(e).__name__}: {e}"
    return got, comm.all_sum(1)


def _nan_on_one_rank(r, out):
    """Rank 1's only batch brings NaN (non_finite='ignore'): rank 0's two batches are scored.
    The reference: one process scoring every rank's batches (the NaN one left out) with the
    candidates as the same distributed pass calibrates them."""
    recipe = preset("w8a8", "auto", non_finite="ignore")
    everyone = {0: [_x(0), _x(1)], 1: [_x(9, nan=True)]}
    out["nan"] = _auto(_mlp(), everyone[r], recipe, observer=None)
    singles = calibrate_many(_mlp(), everyone[r], {n: preset("w8a8", n, non_finite="ignore")
                                                   for n in NAMES}, progress=False, runtime=DIST)
    one = OutputDivergence(_mlp(), [*everyone[0], *everyone[1]])
    left_out = one.drop_non_finite()
    _, scores = choose(one, {n: c.states for n, c in singles.items()}, NAMES[0])
    out["nan/one process"] = ({n: mean for n, (mean, _) in scores.items()}, left_out)
    out["all nan"] = _auto(_mlp(), [_x(8 + r, nan=True)], recipe, observer=None)
    # rank 1's third batch is 8 wide: outside its share of the pass (every 2nd batch from
    # its 2nd), so its float forward first runs in the scoring, and fails there alone
    narrow = _x(3)[:, :8]
    out["forward fails"] = _auto(_mlp(), [_x(0), _x(1)] if r == 0 else [_x(2), _x(4), narrow])
    # s56: the loss fails on rank 1's pieces only: its score raised before the exchange
    # (an UnboundLocalError hid its error) and rank 0 was left in the all_gather

    def loss(out, ref, batch):
        if batch.shape[0] == 3:
            raise RuntimeError("the loss refuses a 3-row batch")
        return float((out - ref).pow(2).mean())
    out["loss fails"] = _auto(_mlp(), [_x(0), _x(1)] if r == 0 else [_x(2)[:3]], loss=loss)
    # s56: planning (fusion detection forwards each rank's first batch) failed on rank 1
    # alone: rank 0 raised a bare "planning failed on rank(s) [1]; see their error"
    out["planning fails"] = _auto(_mlp(), [_x(0) if r == 0 else _x(0)[:, :8]],
                                  observer="static_minmax")


def _imatrix_fails(r):
    """s57 mutants: the imatrix_mse weights' search fails on rank 1 alone: rank 0 must raise
    rank 1's own error (its type and text), as a planning error does."""
    from quantscope.calibration.run import imatrix_roles

    def refuse(slots, means):
        raise ValueError("the imatrix search refuses this weight")
    saved = imatrix_roles.observe_waiting
    if r == 1:
        imatrix_roles.observe_waiting = refuse
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 128))
        x = torch.randn(4, 128, generator=torch.Generator().manual_seed(r))
        return _auto(model, [x], "w4a16", observer="imatrix_mse")
    finally:
        imatrix_roles.observe_waiting = saved


def _llama_scenarios(r, out):
    model, _ = tiny_models.llama()
    mine = [_docs(), _docs()]
    out["mask"] = _auto(model, mine if r == 0 else [_docs(masked=True)])
    out["none"] = _auto(model, mine if r == 0 else [])
    out["no token anywhere"] = _auto(model, [_docs(masked=True)])
    out["no batch anywhere"] = _auto(model, [], recipe="w8a8-dynamic")
    # review (s45): static inputs: the pass's own "batches is empty" came first, after every
    # candidate was calibrated; one process refuses before any pass with auto's
    out["no batch anywhere, static inputs"] = _auto(model, [])


def _scenarios(r, out):
    warnings.simplefilter("ignore")  # (the fallback warnings of a rank's empty roles)
    _nan_on_one_rank(r, out)
    out["imatrix fails"] = _imatrix_fails(r)
    _llama_scenarios(r, out)


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, 2, TIMEOUT)


def _agreed(ranks, key):
    """Both ranks' result of ``key``, checked equal (the scales bit for bit), and that both
    reached the exchange after it together."""
    (a, after_a), (b, after_b) = rank_results(ranks, key)
    assert after_a == after_b == 2, (after_a, after_b)
    if isinstance(a, str) or isinstance(b, str):
        return a, b
    assert a[0] == b[0], (a[0], b[0])
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    return a


def test_a_rank_whose_only_batch_brings_nan_scores_with_no_piece(ranks):
    info, _ = _agreed(ranks, "nan")
    want, left_out = rank_results(ranks, "nan/one process")[0]
    assert left_out == 1 and info["non_finite_pieces"] == 1
    assert info["score_pieces"] == 2 and info["score_tokens"] == 8  # rank 0's 2 x 4 rows
    assert info["chose"] == min(want, key=lambda n: (want[n], n != NAMES[0]))
    for n, mean in want.items():
        assert info["scores"][n] == pytest.approx(mean, rel=1e-5), (info["scores"], want)


def test_an_error_in_one_ranks_scoring_raises_on_every_rank(ranks):
    errs = _agreed(ranks, "forward fails")
    assert errs[1] == "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x8 and 16x16)"
    assert errs[0].startswith(errs[1]) and "failed on rank(s) [1]" in errs[0], errs


def test_an_error_of_the_loss_on_one_rank_raises_on_every_rank(ranks):
    errs = _agreed(ranks, "loss fails")
    assert errs[1] == "RuntimeError: the loss refuses a 3-row batch", errs
    assert errs[0].startswith(errs[1]) and "failed on rank(s) [1]" in errs[0], errs


def test_a_planning_error_on_one_rank_is_its_error_on_every_rank(ranks):
    errs = _agreed(ranks, "planning fails")
    assert errs[1].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied"), errs
    assert errs[0] == errs[1] + " (planning failed on rank(s) [1])", errs


def test_an_imatrix_weight_error_on_one_rank_is_its_error_on_every_rank(ranks):
    errs = _agreed(ranks, "imatrix fails")
    assert errs[1] == "ValueError: the imatrix search refuses this weight", errs
    assert errs[0] == errs[1] + " (imatrix_mse weights failed on rank(s) [1])", errs


def test_a_rank_with_no_real_token_or_no_batch_scores_with_no_piece(ranks):
    mask, _ = _agreed(ranks, "mask")
    # rank 0's scoring pieces: its first batch cut by rows (1 + 3 rows), its second whole
    assert mask["score_pieces"] == 3 and mask["score_tokens"] == 2 * 4 * 12
    assert mask["non_finite_pieces"] is None
    none = _agreed(ranks, "none")
    assert none[0] == mask  # the same pass (rank 1's share is empty in both) and pieces
    assert all(torch.equal(none[1][k], s) for k, s in _agreed(ranks, "mask")[1].items())


@pytest.mark.parametrize("key, message", [
    ("all nan", "ValueError: auto: every scoring batch (2) brought NaN or inf values"),
    ("no token anywhere", "ValueError: auto: the documents compared hold no real token"),
    ("no batch anywhere", "ValueError: calibrate: batches is empty: observer='auto' scores"),
    ("no batch anywhere, static inputs",
     "ValueError: calibrate: batches is empty: observer='auto' scores"),
])
def test_no_piece_on_any_rank_raises_one_process_error_on_every_rank(ranks, key, message):
    errs = _agreed(ranks, key)
    assert all(isinstance(e, str) and e.startswith(message) for e in errs), errs
