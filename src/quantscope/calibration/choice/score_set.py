"""Which calibration documents ``auto``'s model-level scoring runs on (:mod:`.auto`): the
first ``score_tokens`` real tokens of the calibration batches (:func:`score_batches`), cut in
pieces scored one after the other (:func:`score_plan`).

A batch's real tokens: a dict's attention mask's ones, else the entries of its
``input_ids`` (or first tensor) as of a bare tensor: every entry of token ids, every row of
features (one token each). Only dict batches are cut, by rows (documents), and only those
whose arguments are tensors or hold none (no KV cache).
"""

from __future__ import annotations

import itertools

import torch

from ..run.batches import (
    is_kv_cache,
    keyword_batch,
    keywords_of,
    leaves_in,
    sized_like,
    tensors_in,
)

__all__ = ["FIRST_PIECE", "mask_of", "no_batches_error", "no_token_error", "piece_names",
           "piece_of", "rows_of", "score_batches", "score_pieces", "score_plan", "scoring_prefix",
           "take_rows", "tokens_of", "with_tokens"]

#: the first scoring piece: this share of the first batch's rows (an early, cheap round
#: that drops the candidates far behind, :func:`.auto.choose`)
FIRST_PIECE = 0.25


def mask_of(batch):
    """A dict batch's ``attention_mask``, None for another batch or none."""
    if keyword_batch(batch):
        return keywords_of(batch).get("attention_mask")
    return None


def _counted(b):
    """``(tensor, whether a mask)`` a batch's tokens are counted on: a dict's attention mask,
    else its ``input_ids`` (else its first tensor); a tuple's first item; a tensor itself."""
    if (mask := mask_of(b)) is not None:
        return mask, True
    if keyword_batch(b):  # (without a mask, every id is real)
        t = keywords_of(b).get("input_ids")
        return (t if isinstance(t, torch.Tensor) else next(tensors_in(b), None)), False
    return (b[0] if isinstance(b, (tuple, list)) and b else b), False


def rows_of(batch) -> int | None:
    """A dict batch's rows (documents, which a scoring piece cuts), None for other batches
    and for a dict batch :func:`take_rows` cannot cut: one with an argument that is no tensor
    but holds one, or a KV cache (a prefix of each row)."""
    t, mask = _counted(batch) if keyword_batch(batch) else (None, 0)
    ok = isinstance(t, torch.Tensor) and (t.dim() == 2 if mask else t.dim() > 1)
    return t.shape[0] if ok and all(map(_cut_whole, keywords_of(batch).values())) else None


def _cut_whole(value) -> bool:
    """Whether :func:`take_rows` cuts all of an argument: a tensor, or what holds no tensor
    and no KV cache."""
    return isinstance(value, torch.Tensor) or not any(
        isinstance(v, torch.Tensor) or is_kv_cache(v) for v in leaves_in(value))


def take_rows(batch, start: int, stop: int):
    """Rows ``start:stop`` of a dict batch (every tensor whose first dimension is the rows)."""
    n = rows_of(batch)
    return {k: (v[start:stop] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n
                else v) for k, v in keywords_of(batch).items()}


def tokens_of(b, per_row: bool = False):
    """A batch's real tokens: a mask's ones, token ids' entries, features' rows (one token
    each); ``per_row``: a list, one count per row of a dict batch (:func:`rows_of`)."""
    t, mask = _counted(b)
    if mask:
        return t.sum(-1).tolist() if per_row else int(t.sum())
    if per_row:  # without a mask every row holds as many
        return [tokens_of(t[0])] * t.shape[0]
    if not isinstance(t, torch.Tensor):
        return 1
    if not (t.is_floating_point() or t.is_complex()):  # token ids: every entry is a token
        return t.numel()
    return t.shape[:-1].numel() if t.dim() > 1 else 1  # features: one token per row


def with_tokens(batches) -> list[int]:
    """The indices of ``batches`` (or pieces) holding a real token (:func:`tokens_of`): one
    whose attention mask is all 0 (documents of padding only) has no position to compare the
    model's outputs on (where none holds one: :func:`no_token_error`)."""
    return [k for k, b in enumerate(batches) if tokens_of(b)]


def no_batches_error() -> ValueError:
    """The error of ``auto``'s model-level scoring given no calibration batch (on no rank)."""
    return ValueError("calibrate: batches is empty: observer='auto' scores its candidates on "
                      "the model's outputs (Auto(metric='model')); give calibration batches, "
                      "or choose per tensor with Auto(metric='tensor')")


def no_token_error(who: str) -> ValueError:
    """The error of scoring documents none of which holds a real token (:func:`with_tokens`),
    naming ``who``."""
    return ValueError(f"{who}: the documents compared hold no real token (batches of 0 "
                      f"rows, or every attention mask all 0): nothing to compare the model's "
                      f"outputs on; give batches with real tokens")


def score_batches(batches, tokens: int):
    """The first calibration batches holding at least ``tokens`` real tokens (at least one);
    the last one cut to the rows (documents) needed where it is a dict batch."""
    out, n = [], 0
    for b in batches:
        need = tokens - n
        rows = rows_of(b)
        if rows is not None and rows > 1 and tokens_of(b) > need:
            per_row = tokens_of(b, per_row=True)
            k = next(i for i, n_i in enumerate(itertools.accumulate(per_row), 1)
                     if n_i >= need)
            b = take_rows(b, 0, k)
        out.append(b)
        n += tokens_of(b)
        if n >= tokens:
            break
    return out


def scoring_prefix(batches, tokens: int):
    """``(prefix, batches)``: the first batches :func:`score_batches` reads (those holding
    ``tokens`` real tokens), and every batch once in order, the prefix first. A list or a
    tuple is its own prefix and stays itself; any other iterable (a generator, a DataLoader)
    is read only as far as the prefix, so its later batches are freed as the pass reads
    them rather than all held until the call returns; the stream keeps the source's length
    (:func:`~..run.batches.sized_like`)."""
    if isinstance(batches, (list, tuple)):
        return batches, batches
    it, prefix = iter(batches), []

    def taken():  # what score_batches reads, kept: its own rule says where the prefix ends
        for b in it:
            prefix.append(b)
            yield b

    score_batches(taken(), tokens)
    return prefix, sized_like(itertools.chain(prefix, it), batches)


def score_plan(batches, tokens: int, first: float = FIRST_PIECE):
    """Where the scoring pieces come from: ``[(batch index, rows start, rows stop)]``. The
    scoring set is the first calibration documents holding ``tokens`` real tokens
    (:func:`score_batches`); its first dict batch is cut by rows in two pieces, the first
    ``first`` of its rows (at least one), so that the early round that drops the far-off
    candidates (:func:`.auto.choose`) is cheap; any further batch is one more piece."""
    out = score_batches(batches, tokens)
    plan = [(i, 0, rows_of(b)) for i, b in enumerate(out)]
    rows = rows_of(out[0]) if out else None  # (no batch: a rank given none holds no piece)
    if rows is None or rows < 2:
        return plan
    cut = min(rows - 1, max(1, round(rows * first)))
    return [(0, 0, cut), (0, cut, rows), *plan[1:]]


def score_pieces(batches, tokens: int, first: float = FIRST_PIECE):
    """The scoring pieces themselves (:func:`score_plan`)."""
    batches = list(batches)
    return [piece_of(batches[i], a, b) for i, a, b in score_plan(batches, tokens, first)]


def piece_of(batch, start, stop):
    """A scoring piece of ``batch``: its rows ``start:stop`` (the whole where ``stop`` is
    None or all its rows)."""
    return batch if stop is None or (start == 0 and stop == rows_of(batch)) else take_rows(
        batch, start, stop)


def piece_names(plan) -> list[str]:
    """What errors call each scoring piece of ``plan`` (:func:`score_plan`): its number and
    the calibration batch (and rows) it comes from."""
    return [f"scoring piece {k} ({'' if b is None else f'rows {a}:{b} of '}calibration "
            f"batch {i}, counting from 0)" for k, (i, a, b) in enumerate(plan)]
