"""The data-parallel pass of :func:`~.session.calibrate_many` (``Runtime(distributed=True)``
inside a process group): batches sharded round-robin, each weight observed on its owner
rank, the observers synced, ``auto``'s samples gathered; before any of it, the ranks check
that they plan the same slots on the same weights (a rank given another recipe or
checkpoint raises, with every other rank, rather than leaving them waiting or mixing).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ... import comm as qd
from ...observers.sync import sync_observers
from ..recipe import AUTO
from ..structure import fusion
from . import gather, imatrix_roles, non_finite
from .observe import (
    fed,
    make_plan,
    observe_batches,
    sample_budget,
    share_group_inputs,
    unique_slots,
    waits_for_importance,
)
from .samples import RowSample
from .tied_roles import check_groups

__all__ = ["calibrate_distributed"]


def _plan(model, batches, recipes, opts, group):
    """Every rank's plan, checked alike everywhere: the same ``(layer, role)`` slots, the same
    weights (:func:`~.gather.check_same_weights`), the weight candidates that failed on their
    owner dropped on every rank. Returns ``(slots, plans, batches, fusion groups)``."""
    quantized = {layer for r in recipes.values()
                 for layer, (_, roles) in r.match(model).items() if "weight" in roles}
    owners = gather.weight_owners(model, quantized, group)
    me = qd.rank(group)
    with qd.all_or_none("planning", group, same_type=True):
        slots, plans = make_plan(model, recipes, opts.auto.candidates,
                                 owns=lambda l: owners.get(l, me) == me)
        batches, found = fusion.detect(model, batches, recipes, slots)
    batches, groups = share_group_inputs(model, batches, recipes, slots,
                                         _agreed_groups(found, group))
    with qd.all_or_none("the tied weights' check", group, same_type=True):
        check_groups(plans, groups, slots)
    gather.check_same_slots(slots, group)  # the exchanges below pair the slots by key
    weights = {k: s for k, s in slots.items() if s.role == "weight"}
    gather.check_same_weights({k[0]: s.module.weight for k, s in weights.items()}, group)
    _drop_failed(weights, group)
    sync_observers([o for s in weights.values() for k, o in s.observers.items()
                    if not waits_for_importance(k)], group)  # those: after the pass
    return slots, plans, batches, groups


def _agreed_groups(found: list, group) -> list:
    """The fusion groups of the lowest rank that found any, on every rank: each rank detects
    on the first batch of its own list, and one passed none (or other batches) would merge
    other input slots than the rest, which the exchanges pair one by one."""
    every: list = [None] * qd.world_size(group)
    dist.all_gather_object(every, found, group=group)
    return next((g for g in every if g), [])


def _drop_failed(weights, group) -> None:
    """A weight candidate that failed on its owner is dropped on every rank."""
    failed = gather.gather_failures({k: s.failed for k, s in weights.items()}, group)
    for k, f in failed.items():
        weights[k].failed.update(f)
        for key in f:
            weights[k].observers.pop(key, None)


def _observe_imatrix(slots, importance, group) -> None:
    """The ``imatrix_mse`` weights, on their owners, with every rank's input importance
    (:mod:`.imatrix_roles`), then their states shared."""
    means = importance.means(distributed=True, group=group)  # a collective, outside the guard
    with qd.all_or_none("imatrix_mse weights", group, same_type=True):
        imatrix_roles.observe_waiting(slots, means)
    _drop_failed({k: s for k, s in slots.items() if s.role == "weight"}, group)
    sync_observers(imatrix_roles.held(slots), group)


def calibrate_distributed(model, batches, recipes, opts, t0, experts, conclude, fisher=None):
    """``calibrate_many`` across the ranks of ``group``, every rank returning the same result
    (``conclude``: the session's ``_conclude``, which builds it from the synced slots;
    ``fisher``: the ``"fisher"`` metric's weights, the same on every rank).

    Batches are sharded round-robin; each weight is observed by one rank (balanced by
    size) and its state shared; after the local forwards, the activation observers are
    synced (exact for min / max and histograms, AVG for moving averages: see
    :mod:`quantscope.distributed`). With ``auto`` the sampled rows are gathered so every
    rank decides on the same data; otherwise the report rows (activation SQNR, clipping)
    come from rank 0's own sample and are empty on the other ranks. Local steps run under
    :func:`~quantscope.distributed.all_or_none`: an error on one rank raises on all.
    """
    group, sampling = opts.runtime.group, opts.sampling
    sample_tokens, seed = sampling.tokens, sampling.seed
    world, me = qd.world_size(group), qd.rank(group)
    slots, plans, batches, groups = _plan(model, batches, recipes, opts, group)
    experts.reset_counts()
    needs_data = any(map(fed, slots.values()))
    # 'auto' decides on the sampled rows, so every rank needs the same sample: gather it;
    # otherwise the sample only feeds the report, which rank 0 makes from its own rows
    auto = any(cfg.observer == AUTO for p in plans.values() for cfg, _ in p.values())
    n, held = 0, []  # held: the pass's NaN / inf flags (FirstBad), checked below
    importance = imatrix_roles.gather(model, slots)  # imatrix_mse weights: their inputs' x^2
    if needs_data or importance is not None:
        # same_type: an error of the pass is the failing rank's ValueError everywhere
        with qd.all_or_none("calibration", group, same_type=True):
            try:
                n = observe_batches(
                    model, qd.shard(batches, group), slots,
                    -(-sample_tokens // world) if auto else sample_tokens,
                    opts.progress and qd.is_main(group), seed + me,
                    sample_budget(sampling.budget_mb) / world if auto else sampling.budget_mb,
                    batch_index=lambda i: i * world + me,  # qd.shard's round robin
                    forward=importance is not None, flags=held.append)
            finally:
                if importance is not None:
                    importance.remove()
        acts = {k: s for k, s in slots.items() if s.role != "weight"}
        n, first = _global_counts(n, acts, held[0] if held else None, group)
        if first is not None:  # the batch one process names, on every rank
            raise held[0].error(*first, model)
        sync_observers([o for s in unique_slots(acts.values()) for o in s.observers.values()],
                          group)
        if auto:
            local = {k: [] if s.sample is None or not s.sample.count else [s.sample.rows()]
                     for k, s in acts.items()}
            merged = gather.gather_samples(local, sample_tokens, group)
            for k, rows in merged.items():
                acts[k].sample = RowSample.holding(rows[0]) if rows else None
        elif not qd.is_main(group):  # no report rows here: the qparams are all that matter
            for s in acts.values():
                s.sample = None
    if importance is not None:
        _observe_imatrix(slots, importance, group)
    for counts in experts.counts.values():  # every rank reports the global counts
        counts[:] = [qd.all_sum(c, group) for c in counts]
    return conclude(slots, plans, recipes, n, needs_data, t0, opts, world, groups, experts,
                    model, fisher=fisher)


def _global_counts(n, acts, first_bad, group):
    """``(batches, first bad (row, batch))`` over every rank, each activation slot's ``calls``
    made the total over the ranks (what ``missing`` reports), in one all_gather. The first bad
    batch is one process's (:func:`.first_of`), from each rank's :class:`.FirstBad`
    ``first_bad`` (None: none watched), a run-time role's own flag among them
    (:func:`.non_finite.watched`): its NaN / inf raise on every rank, wherever they fell."""
    own = unique_slots(acts.values())
    first = non_finite.exchanged(None if first_bad is None else first_bad.first())
    t = torch.tensor([n, *first] + [s.calls for s in own], dtype=torch.int64,
                     device=qd.group_device(group))
    every = qd.all_gather(t, group).tolist()  # [rank][n, first bad (2), calls...]
    sums = [sum(col) for col in zip(*every)]
    for s, calls in zip(own, sums[3:]):
        s.calls = calls
    return sums[0], non_finite.first_of(r[1:3] for r in every)


def check_group(group, distributed: bool) -> None:
    """``Runtime.group``: None or a ``torch.distributed`` process group (else the pass fails
    inside torch.distributed, naming no field), and only with ``distributed`` (else it is
    never read: each rank would calibrate alone without a word)."""
    if group is None:
        return
    if dist.is_available() and group is dist.GroupMember.NON_GROUP_MEMBER:  # new_group's answer
        raise ValueError("calibrate: this process is not in Runtime.group (new_group gave it "
                         "GroupMember.NON_GROUP_MEMBER): call calibrate only on the group's "
                         "ranks")
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"calibrate: Runtime.group must be a torch.distributed ProcessGroup "
                        f"or None (the default group), got {type(group).__name__} {group!r}")
    if not distributed:
        raise ValueError("calibrate: Runtime.group is read only with distributed=True; pass "
                         "Runtime(distributed=True, group=...) or drop group")
