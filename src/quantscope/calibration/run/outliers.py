"""What goes around the calibration pass (:class:`~..options.Outliers`): SmoothQuant before it,
its ranges from the first batch, and the float fallback after it, ranked on that batch.

Across ranks (``Runtime(distributed=True)``) the ranks may pass their own batches, so each
holds another first batch, or none. SmoothQuant reduces its ranges over every rank's first
batch (:func:`~..choice.smooth.channel_ranges`). The fallback is ranked once: on the lowest
rank that holds a batch, on its first one, and every rank keeps what that ranking says,
what one process ranking on that batch keeps; ranked on each rank's own, the ranks would
keep different tensors in float (the writing rank's calibration not the others').
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ... import comm as qd
from ..choice import smooth as _smooth
from ..choice.sensitivity import fall_back
from ..options import Outliers, Runtime
from ..structure.fusion import peek

__all__ = ["around"]


def around(model, batches, run, outliers: Outliers, runtime: Runtime) -> dict:
    """``run(batches)``, the calibration itself, with what goes around it: SmoothQuant
    before (ranges from the first batch), the float fallback after (ranked on it). A call
    that raises leaves the weights unsmoothed: their values from before are kept (a CPU
    copy of the smoothed ones) until it returns."""
    smoothed, originals = None, {}
    try:
        if outliers.smooth is not None:
            first, batches = peek(batches)
            smoothed = _smooth.smooth(model, [] if first is None else [first], outliers.smooth,
                                      distributed=runtime.distributed, group=runtime.group,
                                      originals=originals)
        if not outliers.keep_float:
            out = run(batches)
        else:
            first, batches = peek(batches)
            out = run(batches)
            ranker = _ranker(first is not None, runtime)
            out = {k: fall_back(model, first, c, outliers.keep_float, outliers.fallback, ranker)
                   for k, c in out.items()}
    except BaseException:
        _smooth.restore(model, originals)
        raise
    if smoothed is not None:
        scales = smoothed.pop("scales")
        for c in out.values():
            c.smoothing, c.info["smooth"] = dict(scales), dict(smoothed)
    return out


def _ranker(holds: bool, runtime: Runtime):
    """:func:`~..choice.sensitivity.fall_back`'s ``ranker``: None in one process, and across
    ranks where no rank holds a batch (each then raises one process's error); else the
    ranking made on the lowest rank that ``holds`` one, shared with every rank."""
    group = runtime.group
    if not (runtime.distributed and qd.is_distributed(group)):
        return None
    flags = qd.all_gather(torch.tensor([int(holds)], device=qd.group_device(group)), group)
    holders = flags.flatten().nonzero().flatten().tolist()
    if not holders:
        return None
    src = holders[0]

    def ranker(rank):
        sens = [None]
        # an error there (a forward of its batch) raises on every rank, not only on src
        with qd.all_or_none("keep_float's ranking", group, same_type=True):
            if qd.rank(group) == src:
                sens[0] = rank()
        dist.broadcast_object_list(sens, group=group, group_src=src)
        return sens[0]

    return ranker
