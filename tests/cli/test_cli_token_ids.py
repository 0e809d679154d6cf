"""The command line's check that the tokenizer's ids fit the model's embedding.

An embedding of ``rows`` rows takes ids ``0 .. rows - 1``: id ``rows`` is torch's IndexError in
the forward, so it is refused first, in one line; a batch of no tokens has no max (torch
raises on it) and is skipped. A mutation round found no test failing where ``rows`` itself
passed or an empty batch raised.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from quantscope.cli.checks import UsageError
from quantscope.cli.running import _check_token_ids


class _Model(nn.Module):
    def __init__(self, rows):
        super().__init__()
        self.emb = nn.Embedding(rows, 2)
        self.config = SimpleNamespace(vocab_size=rows)

    def get_input_embeddings(self):
        return self.emb


def _batches(*rows):
    return [{"input_ids": torch.tensor(r, dtype=torch.long).reshape(1, -1)} for r in rows]


def test_the_first_id_past_the_embedding_is_refused():
    model, tok = _Model(128), list(range(129))
    with pytest.raises(IndexError):
        model.emb(torch.tensor([128]))
    _check_token_ids(model, tok, _batches([0, 5, 127]), "m")  # the last row: fine
    with pytest.raises(UsageError, match=r"token id 128 .*embedding has 128 rows"):
        _check_token_ids(model, tok, _batches([0, 5], [127, 128]), "m")


def test_an_empty_batch_is_skipped():
    model, tok = _Model(128), list(range(128))
    with pytest.raises(RuntimeError):
        torch.tensor([], dtype=torch.long).max()
    _check_token_ids(model, tok, _batches([], [3, 4]), "m")
    _check_token_ids(model, tok, _batches([]), "m")
    with pytest.raises(UsageError, match="token id 200"):
        _check_token_ids(model, tok, _batches([], [200]), "m")
