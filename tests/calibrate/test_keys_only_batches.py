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


# ---- probe s58: batches with neither a mask nor ids, inference tensors, cycles ----------------

def _embeds():
    g = torch.Generator().manual_seed(3)
    return [{"inputs_embeds": torch.randn(4, 10, 64, generator=g)} for _ in range(3)]


def test_keys_only_embeddings_count_their_rows_and_tokens():
    """Without a mask or ids the first tensor counts: it was not found in a keys-only batch
    (1 token, no rows), so auto scored other batches than the dict's, uncut."""
    from quantscope.calibration.choice.score_set import rows_of, score_batches, tokens_of

    batches = _embeds()
    for wrap in (dict, KeysOnly):
        assert tokens_of(wrap(batches[0])) == 40, wrap
        assert rows_of(wrap(batches[0])) == 4, wrap
        assert len(score_batches([wrap(b) for b in batches], 50)) == 2, wrap


def test_keys_only_inference_tensors_take_the_fisher_gradients():
    """Inference tensors are cloned for autograd in a keys-only batch too (it raised
    autograd's bare 'Inference tensors cannot be saved for backward')."""
    with torch.inference_mode():
        batches = _batches()
    kw = {"observer": "auto", "progress": False,
          "auto": Auto(metric="fisher", candidates=("minmax", "mse"))}
    model, _ = llama()
    listed = quantscope.calibrate(model, batches, "w8a8", **kw)
    got = quantscope.calibrate(model, [KeysOnly(b) for b in batches], "w8a8", **kw)
    assert _choices(got).keys() == _choices(listed).keys()
    for k, (obs, scale) in _choices(listed).items():
        assert _choices(got)[k][0] == obs and torch.equal(_choices(got)[k][1], scale), k


def test_keys_only_empty_first_batch_is_passed_over_for_keep_float():
    """``keep_float``'s analysis starts at the first batch with a value: a keys-only batch's
    tensors were not seen, so its empty first batch was taken (and nothing kept float)."""
    from quantscope.calibration import Outliers

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
            self.c = torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.c(torch.relu(self.b(torch.relu(self.a(x)))))

    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.zeros(0, 16)}] + [
        {"x": torch.randn(8, 16, generator=g) * (1 + 5 * (i == 0))} for i in range(2)]
    kept = [quantscope.calibrate(M(), [wrap(b) for b in batches], "w8a8", progress=False,
                                 outliers=Outliers(keep_float=1)).info["keep_float"]["tensors"]
            for wrap in (dict, KeysOnly)]
    assert kept[0] == kept[1] == ["c input"]


@pytest.mark.parametrize("observer", ["minmax", "auto"])
def test_a_batch_holding_itself_calibrates(observer):
    """A list inside a batch that holds itself: fusion detection's copy and auto's walk
    recursed without end (RecursionError); each container is now walked once."""
    from quantscope.calibration.run.batches import map_tensors, tensors_in

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x, meta=None):
            return self.l2(self.l1(x))

    loop = [torch.ones(2)]
    loop.append(loop)
    batch = {"x": torch.randn(4, 8), "meta": loop}
    assert len(list(tensors_in(batch))) == 2
    copied = map_tensors(torch.clone, batch)
    assert copied["meta"][0] is not loop[0] and torch.equal(copied["meta"][0], loop[0])
    calib = quantscope.calibrate(M(), [batch], "w8a8", observer=observer, progress=False)
    assert set(calib.states) == {"l1", "l2"}


def test_input_ids_count_before_other_tensors_without_a_mask():
    # s58 mutants: with no mask the ids count the tokens, not the batch's first tensor
    from quantscope.calibration.choice.score_set import tokens_of

    batch = {"pixel_values": torch.zeros(2, 3, 4, 4),
             "input_ids": torch.ones(2, 5, dtype=torch.long)}
    for wrap in (dict, KeysOnly):
        assert tokens_of(wrap(batch)) == 10, wrap
        assert tokens_of(wrap(batch), per_row=True) == [5, 5], wrap
