"""Mutation round s47 on ``score_set.scoring_prefix`` / ``batches.sized_like`` / the session's
``_held``: with a small activation sample (its rows drawn evenly over the batches' number,
which ``auto``'s "fisher" choice reads), a DataLoader-like stream (a length, read once) and a
generator must give the list's result. A stream that lost its length, or a generator not
listed for "fisher", spreads the sample otherwise and chooses otherwise."""

from __future__ import annotations

import pytest
import torch
from tiny_models import llama

import quantscope
from quantscope.calibration import Auto, Sampling

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

N = 6


def _batches():
    _, ids = llama()
    ids = ids + [torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(9 + i))
                 for i in range(N - len(ids))]
    return [{"input_ids": t, "attention_mask": torch.ones_like(t)} for t in ids]


class Stream:
    """A DataLoader's shape: a length, each iteration fresh copies."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return ({k: v.clone() for k, v in b.items()} for b in self.batches)

    def __len__(self):
        return len(self.batches)


def _choices(c):
    return {(layer, role): (s.observer, s.qparams.scale)
            for layer, roles in c.states.items() for role, s in roles.items()}


def _same(a, b):
    assert a.keys() == b.keys()
    for k, (obs, scale) in a.items():
        assert b[k][0] == obs and torch.equal(b[k][1], scale), k


def test_fisher_with_a_small_sample_streams_as_the_list():
    model, _ = llama()
    batches = _batches()
    kw = {"observer": "auto", "progress": False, "sampling": Sampling(tokens=8),
          "auto": Auto(metric="fisher", score_tokens=48)}
    listed = _choices(quantscope.calibrate(model, batches, "w8a8", **kw))
    _same(_choices(quantscope.calibrate(model, Stream(batches), "w8a8", **kw)), listed)
    _same(_choices(quantscope.calibrate(model, (b for b in batches), "w8a8", **kw)), listed)
