"""A batch that only has ``keys()`` and ``[]`` (what ``**`` reads: a tokenizer-like mapping
without ``get`` or ``in``) calibrates as its dict in ``auto``'s scoring too: its attention
mask counted, its rows cut into pieces, and the "fisher" default loss labelled from it.
Found by probing: the scoring read ``batch.get`` and raised AttributeError."""

from __future__ import annotations

import pytest
import torch
from tiny_models import llama

import quantscope
from quantscope.calibration import Auto

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class KeysOnly:
    def __init__(self, d):
        self.d = d

    def keys(self):
        return self.d.keys()

    def __getitem__(self, k):
        return self.d[k]


def _batches():
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(3):
        ids = torch.randint(0, 100, (4, 10), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 7:] = 0  # padding: the mask, not the ids, counts the tokens
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _choices(c):
    return {(layer, role): (s.observer, s.qparams.scale)
            for layer, roles in c.states.items() for role, s in roles.items()}


@pytest.mark.parametrize("metric", ["model", "joint", "fisher"])
def test_keys_only_batches_score_as_their_dicts(metric):
    model, _ = llama()
    batches = _batches()
    cut = {"score_tokens": 50} if metric != "joint" else {}  # pieces of the batches' rows
    kw = {"observer": "auto", "progress": False, "auto": Auto(metric=metric, candidates=("minmax", "mse"), **cut)}
    listed = quantscope.calibrate(model, batches, "w8a8", **kw)
    got = quantscope.calibrate(model, [KeysOnly(b) for b in batches], "w8a8", **kw)
    for key in ("chose", "scores", "score_pieces", "score_tokens"):
        assert got.info.get("auto", {}).get(key) == listed.info.get("auto", {}).get(key), key
    a, b = _choices(listed), _choices(got)
    assert a.keys() == b.keys()
    for k, (obs, scale) in a.items():
        assert b[k][0] == obs and torch.equal(b[k][1], scale), k


def test_the_attention_mask_counts_the_tokens_of_every_keyword_batch():
    # s57 mutants: a BatchEncoding's mask was read only through keyword_batch's rule
    from quantscope.calibration.choice.score_set import tokens_of

    batch = _batches()[0]  # 4 rows of 10, row 1 padded after 7
    for wrap in (dict, KeysOnly, transformers.BatchEncoding):
        assert tokens_of(wrap(batch)) == 37, wrap
        assert tokens_of(wrap(batch), per_row=True) == [10, 7, 10, 10], wrap
