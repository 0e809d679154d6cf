"""Which calibration batch first brought NaN or inf to an observer, named without a sync.

An observer in ``non_finite="error"`` mode keeps a flag (``seen_non_finite``) that its
``forward`` sets without reading anything back; the flag stays set. :class:`FirstBad` stacks
every such flag once per batch, one op per device at the batch's end (not one per observer
call: a GPU's host pays for each op), and reads them all once after the pass.
"""

from __future__ import annotations

import torch

from .batches import nan_parameter

__all__ = ["FirstBad"]


class FirstBad:
    """The flags of ``watched`` (``(layer, role, name, observer)`` rows, in the order the
    errors name them), stacked at the end of each batch (:meth:`end_batch`)."""

    def __init__(self, watched: list[tuple]):
        self.watched = watched
        self.batches: list = []  # (batch number, [(rows, flags of those rows)] per device)

    def end_batch(self, batch) -> None:
        """Stack the flags after batch ``batch`` (its number, as errors name it)."""
        if not self.watched:
            return
        by_device: dict = {}
        for i, row in enumerate(self.watched):
            flag = row[3].seen_non_finite  # read each time: moving an observer makes a new one
            rows, flags = by_device.setdefault(flag.device, ([], []))
            rows.append(i)
            flags.append(flag)
        self.batches.append((batch, [(rows, torch.stack(flags)) for rows, flags in
                                     by_device.values()]))

    def first(self) -> tuple[int, object] | None:
        """``(row of watched, batch)`` of the first watched observer (in ``watched``'s order)
        whose flag is set, and the first batch after which it was; None: none is set. One
        read per device where no flag is set (then, to name the batch, one per batch up to
        it)."""
        if not self.batches:
            return None
        last = _read(self.batches[-1][1])  # the flags stay set: the last batch has them all
        bad = [i for i, flag in last.items() if flag]
        if not bad:
            return None
        i = min(bad)
        for batch, groups in self.batches:  # the first batch that had it (once per pass)
            if _read(groups).get(i):
                return i, batch
        return i, None

    def check(self, model=None) -> None:
        """Raise ``ValueError`` naming the layer, role and batch where a watched observer first
        saw NaN or inf, and a parameter of ``model`` that holds them, the likelier cause."""
        found = self.first()
        if found is None:
            return
        i, batch = found
        layer, role, name, _ = self.watched[i]
        where = "a calibration batch" if batch is None else f"calibration batch {batch}"
        own = nan_parameter(model)
        cause = (f"the model's own parameter {own!r} holds NaN or inf: fix it" if own
                 else "fix that batch (or what makes the model produce them)")
        raise ValueError(f"calibrate: layer {layer!r} {role}: {where} (counting from 0) "
                         f"brought NaN or inf values (observer {name!r}); {cause}")


def _read(groups) -> dict[int, bool]:
    """Row of watched -> its flag, from one batch's stacked flags (one read per device)."""
    out = {}
    for rows, flags in groups:
        out.update(zip(rows, flags.tolist()))
    return out
