"""What goes around the calibration pass (:class:`~..options.Outliers`): SmoothQuant before it,
its ranges from the first batch, and the float fallback after it, ranked on that batch. The
first batch is the first that holds a value: one of 0 rows passes every module through, and
would leave SmoothQuant no range to measure and the fallback nothing to rank.

Across ranks (``Runtime(distributed=True)``) the ranks may pass their own batches, so each
holds another first batch, or none. Both steps then read one batch: the first of the lowest
rank that holds one (holding a value, where any rank's does), on that rank. SmoothQuant's
ranges are measured there (the other ranks add the reduction's identities) and the
fallback's ranking is made there, then shared: every rank smooths and keeps in float what
one process given that batch first does. Each on its own first batch, the ranks would keep
different tensors in float (the writing rank's calibration not the others') and smooth on
the union of their first batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ... import comm as qd
from ..choice import smooth as _smooth
from ..choice.sensitivity import fall_back
from ..options import Outliers, Runtime
from .batches import peek, tensors_in

__all__ = ["around"]


def around(model, batches, run, outliers: Outliers, runtime: Runtime) -> dict:
    """``run(batches)``, the calibration itself, with what goes around it: SmoothQuant
    before (ranges from the first batch), the float fallback after (ranked on it). A call
    that raises leaves the weights unsmoothed: their values from before are kept (a CPU
    copy of the smoothed ones) until it returns."""
    if outliers.smooth is None and not outliers.keep_float:
        return run(batches)
    first, batches = peek(batches, _holds_value)
    group = runtime.group
    across = runtime.distributed and qd.is_distributed(group)
    held = 0 if first is None else 1 + _holds_value(first)
    src = _lowest_holder(held, group) if across else None
    mine = first if not across or src == qd.rank(group) else None  # the batch read here
    smoothed, originals = None, {}
    try:
        if outliers.smooth is not None:
            smoothed = _smooth.smooth(model, [] if mine is None else [mine], outliers.smooth,
                                      distributed=runtime.distributed, group=group,
                                      originals=originals)
        out = run(batches)
        if outliers.keep_float:
            ranker = _ranker(src, group) if across and src is not None else None
            out = {k: fall_back(model, mine, c, outliers.keep_float, outliers.fallback, ranker)
                   for k, c in out.items()}
    except BaseException:
        _smooth.restore(model, originals)
        raise
    if smoothed is not None:
        scales = smoothed.pop("scales")
        for c in out.values():
            c.smoothing, c.info["smooth"] = dict(scales), dict(smoothed)
    return out


def _lowest_holder(held: int, group) -> int | None:
    """The rank whose first batch the outliers' steps read: the lowest of ``group`` whose
    batch ``held`` most (2: a value, 1: a batch of 0 rows only, 0: no batch); None where none
    holds a batch (every rank then smooths nothing and raises keep_float's error, as one
    process given no batch)."""
    ranks = qd.all_gather(torch.tensor([held], device=qd.group_device(group)), group)
    ranks = ranks.flatten().tolist()
    return ranks.index(max(ranks)) if max(ranks) else None


def _holds_value(batch) -> bool:
    """Whether ``batch`` (a tensor, or a mapping / sequence of them) holds an element: False
    where it holds tensors and each is empty (0 rows); True where it holds no tensor at all
    (nothing to tell by)."""
    found = [t.numel() > 0 for t in tensors_in(batch)]
    return not found or any(found)


def _ranker(src: int, group):
    """:func:`~..choice.sensitivity.fall_back`'s ``ranker``: the ranking made on rank
    ``src``, shared with every rank."""
    def ranker(rank):
        sens = [None]
        # an error there (a forward of its batch) raises on every rank, not only on src
        with qd.all_or_none("keep_float's ranking", group, same_type=True):
            if qd.rank(group) == src:
                sens[0] = rank()
        dist.broadcast_object_list(sens, group=group, group_src=src)
        return sens[0]

    return ranker
