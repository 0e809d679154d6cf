"""Which calibration batch first brought NaN or inf to an observer, named with no sync during
the pass.

An observer in ``non_finite="error"`` mode keeps a flag (``seen_non_finite``) that its
``forward`` sets without reading anything back; the flag stays set. :class:`FirstBad` stacks
every such flag at each batch's end and counts, per flag, the batches after which it was
set: two ops per device a batch (not one per observer call: a GPU's host pays for each op),
memory that grows with the observers' moves to another device, not with the batches, and
nothing read back before the pass ends (then one read per device, and one per batch where
observers moving device changed a device's rows: those counts kept unread till then).
Ranks that forwarded their shares of the batches agree on one process's answer
(:func:`first_of`).

A run-time (``dynamic``) role has no observer: where it raises on NaN / inf and no observer of
its tensor does, the calibration's hook keeps a flag of its own, set by :func:`flag_tensor`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ...kernels import ops
from ...stats.minmax import (
    KERNEL_MIN_NUMEL,
    MINMAX_DTYPES,
    any_non_finite,
    record_non_finite,
    unit_minmax,
)
from .batches import nan_parameter

__all__ = ["NONE", "FirstBad", "Watched", "exchanged", "first_of", "flag_tensor", "watched"]

#: what :func:`exchanged` sends for no bad batch: above every row and batch number
NONE = 2**63 - 1


class Watched(NamedTuple):
    """A row :class:`FirstBad` names: the holder of a ``seen_non_finite`` flag, an observer
    (named ``observer``) or, with ``runtime``, a run-time role's slot (no observer: its error
    names the option that reads NaN / inf as zero instead)."""

    layer: str
    role: str
    observer: str
    holder: object
    runtime: bool = False


class FirstBad:
    """The flags of ``watched`` (:class:`Watched` rows, in the order the errors name them,
    :func:`watched`), counted at the end of each batch (:meth:`end_batch`): a flag stays
    set, so a flag set after ``c`` of ``n`` batches was first set after batch ``n - c``
    (counting from 0). ``batch_index(k)``: the number errors give the ``k``-th batch (None:
    k; :func:`~.observe.observe_batches`' own ``batch_index``)."""

    def __init__(self, watched: list[Watched], batch_index=None):
        self.watched, self.batch_index, self.ended = watched, batch_index, 0
        self.counts: dict = {}  # device -> (rows of watched, int64 [rows]: batches set after)
        # (rows, counts, batches ended): a device's counts before its rows changed (observers
        # moved there or away: observe.py moves each to its data's device at its first call),
        # kept unread (a GPU's read is a host sync) for first(): one per device and batch where
        # its rows changed
        self.retired: list = []
        self.settled: dict[int, int] = {}  # row -> first set batch (first() reads into it)

    def end_batch(self) -> None:
        """Count the flags set after the batch that just ran."""
        if not self.watched:
            return
        by_device: dict = {}
        for i, row in enumerate(self.watched):
            flag = row.holder.seen_non_finite  # read each time: moving an observer makes a new one
            rows, flags = by_device.setdefault(flag.device, ([], []))
            rows.append(i)
            flags.append(flag)
        for device in [d for d, (rows, _) in self.counts.items()
                       if by_device.get(d, (None,))[0] != rows]:  # observers moved
            self.retired.append((*self.counts.pop(device), self.ended))  # read in first()
        for device, (rows, flags) in by_device.items():
            if device not in self.counts:  # (a row set before it moved here: retired)
                self.counts[device] = (rows, torch.zeros(len(rows), dtype=torch.int64,
                                                         device=device))
            self.counts[device][1].add_(torch.stack(flags))
        self.ended += 1

    def first(self) -> tuple[int, int] | None:
        """``(row of watched, batch)`` of the first watched observer (in ``watched``'s order)
        whose flag is set, and the first batch after which it was; None: none is set. One
        read per counts tensor: a device's, and each retired one (:attr:`retired`)."""
        held = [*self.retired, *((*self.counts.pop(d), self.ended) for d in list(self.counts))]
        self.retired = []
        for rows, counts, ended in held:
            for i, c in zip(rows, counts.tolist()):
                if c:
                    self.settled[i] = min(ended - c, self.settled.get(i, NONE))
        if not self.settled:
            return None
        i = min(self.settled)
        k = self.settled[i]
        return i, k if self.batch_index is None else self.batch_index(k)

    def check(self, model=None) -> None:
        """Raise :meth:`error` of :meth:`first`, if any."""
        found = self.first()
        if found is not None:
            raise self.error(*found, model)

    def error(self, i: int, batch: int, model=None) -> ValueError:
        """The ``ValueError`` naming the layer, role and batch where watched observer ``i``
        first saw NaN or inf, and a parameter of ``model`` that holds them, the likelier
        cause."""
        layer, role, name, _, runtime = self.watched[i]
        own = nan_parameter(model)
        cause = (f"the model's own parameter {own!r} holds NaN or inf: fix it" if own
                 else "fix that batch (or what makes the model produce them)")
        kind = "dynamic role, " if runtime else ""
        if runtime:  # the option that reads them as zero instead
            cause += ", or give the role options={'non_finite': 'ignore'} to read them as zero"
        return ValueError(f"calibrate: layer {layer!r} {role}: calibration batch {batch} "
                          f"(counting from 0) brought NaN or inf values ({kind}observer "
                          f"{name!r}); {cause}")


def exchanged(found: tuple[int, int] | None) -> list[int]:
    """:meth:`FirstBad.first`'s answer as two integers for a collective (:data:`NONE` twice
    where there is none)."""
    return [NONE, NONE] if found is None else list(found)


def first_of(answers) -> tuple[int, int] | None:
    """One process's :meth:`FirstBad.first` from each rank's :func:`exchanged` answer over
    its own share of the batches (numbered as one process numbers them; the ranks watch the
    same rows): the least row, then the least batch of that row. A rank's answer is its
    least row and that row's first batch, and a rank whose least row is another never set
    this one's flag, so the pair least in that order is one process's answer over them all."""
    i, batch = min(map(tuple, answers))
    return None if i == NONE else (i, batch)


def watched(slots) -> list:
    """The rows :class:`FirstBad` names, in the order of ``slots`` (the pass's observed
    slots, each once): the observers whose NaN / inf raise, and where a run-time role raises
    on them but no observer of its slot does, the slot's own flag (made here, on the CPU;
    :func:`flag_tensor` moves it to the data)."""
    out = []
    for slot in slots:
        rows = [Watched(slot.layer, slot.role, key[0], obs)
                for key, obs in slot.observers.items()
                if getattr(obs, "non_finite", None) == "error"
                and getattr(obs, "seen_non_finite", None) is not None]
        slot.seen_non_finite = None
        if not rows and slot.runtime_check is not None:
            slot.seen_non_finite = torch.zeros((), dtype=torch.bool)
            layer, observer = slot.runtime_check
            rows = [Watched(layer, slot.role, observer, slot, runtime=True)]
        out += rows
    return out


def flag_tensor(x: torch.Tensor, slot) -> None:
    """``slot.seen_non_finite`` (one bool, moved to ``x``'s device as the observers are) set
    where the float tensor ``x`` (not empty) holds NaN or an infinity (min / max propagate
    both). Off the CPU, reading nothing back: two ops of the observers' own (``unit_minmax``
    of its rows, ``record_non_finite``: two launches). On the CPU a read costs nothing: the
    tensor's two ends, tested here (torch's ``aminmax`` for a small tensor, 2-3 us; one C
    pass from :data:`KERNEL_MIN_NUMEL` elements on, where it is the faster)."""
    if slot.seen_non_finite.device != x.device:
        slot.seen_non_finite = slot.seen_non_finite.to(x.device, non_blocking=True)
    seen = slot.seen_non_finite
    if x.is_cpu:  # float64 as it is (as float32, a finite value past its range overflows)
        small = x.numel() < KERNEL_MIN_NUMEL or x.dtype not in MINMAX_DTYPES
        lo, hi = torch.aminmax(x) if small else unit_minmax(x.reshape(1, -1))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            seen.fill_(True)
    elif x.dtype not in MINMAX_DTYPES:
        seen.bitwise_or_(any_non_finite(torch.stack(torch.aminmax(x))))
    else:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
        record_non_finite(*ops.unit_minmax(rows), seen)
