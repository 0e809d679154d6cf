"""Distributed defects of probe s45 in ``Auto(metric="fisher")``: each rank computed the
``g^2`` weights on its own batches before the pass and then dropped them (the distributed
pass never received them: ``"fisher"`` chose as ``"joint"`` does, silently); and an error
there on one rank (a batch bringing NaN, none left under ``non_finite="ignore"``) raised on
that rank alone while the others went on into the pass's collectives. Now the weights reach
the choice on every rank, joined over every rank's batches where the ranks were given
different ones (the mean ``g^2`` one process given all of them computes), and an error, or
no batch left on any rank, raises on every rank.

One spawn of 2 gloo processes; the group's timeout is short, so a rank left waiting fails
in seconds."""

from __future__ import annotations

import warnings

import pytest
import torch
from ports import rank_results, spawn_ranks

import quantscope
from quantscope import comm
from quantscope.calibration import Auto, Runtime, preset
from quantscope.calibration.choice.layer_choice import fisher_weights

pytestmark = pytest.mark.dist  # spawns its own process group

TIMEOUT = 20
DIST = Runtime(distributed=True)
NAMES = ("static_minmax", "percentile", "mse")


def _loss(out, batch):
    """A loss that cares about output feature 0 far more than the others: its ``g^2``
    weights make "fisher" choose otherwise than "joint" here."""
    return (out[:, 0] * 30).square().mean() + out[:, 1:].sum() * 1e-3


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batches(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(8, 16, generator=g) * torch.linspace(0.1, 4, 16) for _ in range(n)]
    for x in out:
        x[0, 3] = 20.0  # an outlier the candidates clip differently
    return out


def _nan(x):
    x = x.clone()
    x[1, 1] = float("nan")
    return x


def _observers(batches, metric, recipe="w8a8", runtime=None):
    """The observer of each role ``auto`` chose (or the error text), then a tiny all_sum both
    ranks must reach together where ``runtime`` is distributed."""
    try:
        c = quantscope.calibrate(_mlp(), batches, recipe, observer=None if recipe != "w8a8"
                                 else "auto", progress=False, runtime=runtime or Runtime(),
                                 auto=Auto(candidates=NAMES, metric=metric,
                                           loss=_loss if metric == "fisher" else None))
        got = {(n, r): s.observer for n, rs in c.states.items() for r, s in rs.items()}
    except Exception as e:  # noqa: BLE001 -- the parent compares the ranks' errors
        got = f"{type(e).__name__}: {e}"
    return got, comm.all_sum(1) if runtime is not None else 2


def _weights(batches, distributed, ignore=False):
    return fisher_weights(_mlp(), batches, ["0", "2"], _loss, ignore, distributed=distributed)


def _scenarios(r, out):
    warnings.simplefilter("ignore")
    same = _batches()
    out["same"] = _observers(same, "fisher", runtime=DIST)
    out["same/one process"] = (_observers(same, "fisher"), _observers(same, "joint"))
    ignore = preset("w8a8", "auto", non_finite="ignore")
    out["nan on one rank"] = _observers(
        _batches(2) if r == 0 else [_nan(_batches(1)[0])], "fisher", ignore, DIST)
    out["nan everywhere"] = _observers([_nan(_batches(1, seed=r)[0])], "fisher", ignore, DIST)
    out["nan error"] = _observers(_batches(2) if r == 0 else [_nan(_batches(1)[0])], "fisher",
                                  runtime=DIST)
    # the weights themselves: every rank's batches (rank 1's NaN one left out) joined
    mine = {0: _batches(2, seed=1), 1: [*_batches(1, seed=2), _nan(_batches(1, seed=3)[0])]}
    out["weights"] = _weights(mine[r], True, ignore=True)
    out["weights/one process"] = _weights([*mine[0], *mine[1]], False, ignore=True)
    out["same weights"] = (_objects_sent(lambda: _weights(same, True)), _weights(same, False))


def _objects_sent(call):
    """``(call()'s result, how many all_gather_object it made)``."""
    sent, real = [], torch.distributed.all_gather_object
    torch.distributed.all_gather_object = lambda *a, **k: sent.append(1) or real(*a, **k)
    try:
        return call(), len(sent)
    finally:
        torch.distributed.all_gather_object = real


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, 2, TIMEOUT)


def _agreed(ranks, key):
    (a, after_a), (b, after_b) = rank_results(ranks, key)
    assert after_a == after_b == 2, (after_a, after_b)
    return a, b


def test_fisher_across_ranks_chooses_as_one_process_not_as_joint(ranks):
    a, b = _agreed(ranks, "same")
    (fisher, _), (joint, _) = rank_results(ranks, "same/one process")[0]
    assert fisher != joint  # the case tells them apart (layer 2's input here)
    assert a == b == fisher, (a, joint)


def test_fisher_weights_are_the_mean_over_every_ranks_batches(ranks):
    want = rank_results(ranks, "weights/one process")[0]
    for got in rank_results(ranks, "weights"):
        assert got.keys() == want.keys() == {"0", "2"}
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-6, atol=0)


def test_a_rank_whose_batches_are_all_left_out_takes_the_others_weights(ranks):
    a, b = _agreed(ranks, "nan on one rank")
    assert isinstance(a, dict) and a == b, (a, b)


@pytest.mark.parametrize("key, message", [
    ("nan everywhere", "ValueError: auto (metric 'fisher'): every scoring batch (2) brought"),
    ("nan error", "ValueError: auto (metric 'fisher'): batch 0 (counting from 0) brought NaN"),
])
def test_a_fisher_error_raises_on_every_rank(ranks, key, message):
    errs = _agreed(ranks, key)
    assert all(isinstance(e, str) and e.startswith(message) for e in errs), errs


def test_ranks_given_the_same_batches_send_no_weights(ranks):
    # review (s45): every rank's g^2 sums (tens of MB on a large model) were all-gathered
    # and then dropped where the ranks' batches were the same (a CRC of them now goes first)
    for (got, sent), want in rank_results(ranks, "same weights"):
        assert sent == 0
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_batches_crc_tells_the_same_bytes_in_another_shape_or_dtype_apart():
    """Ranks are given the same batches only where their tensors' dtypes and shapes match
    too: token ids 0..11 as (2, 6) and as (3, 4) are other documents, the same bytes as
    float32 and as int32 other values; their parts must be exchanged."""
    from quantscope.calibration.run.gather import _crc

    ids = torch.arange(12)
    assert _crc([ids.reshape(2, 6)]) != _crc([ids.reshape(3, 4)])
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    assert _crc([x]) != _crc([x.view(torch.int32)])
    assert _crc([x]) == _crc([x.clone()]) == _crc([{"x": x.t().contiguous().t()}])
