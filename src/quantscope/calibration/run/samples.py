"""Activation rows kept during calibration, in fixed buffers under one memory budget.

``auto`` and the report score candidates on a sample of each layer's activations. The
sample is drawn per batch (random rows of each batch, spread evenly over every batch where
their number is known, until ``capacity`` rows), into one buffer allocated on first use:
memory is bounded up front and nothing is concatenated afterwards. :func:`capacities`
divides a total budget among the sampled tensors by their width, so the sample memory does
not grow with the number of layers, observers or recipes; each buffer keeps within its
part of the budget at the width and item size of its first batch."""

from __future__ import annotations

import math
import zlib

import torch

from ..._numerics import upload

__all__ = ["Capacity", "RowSample", "capacities", "generator_for"]


#: bytes per value :func:`capacities` plans with (float32); a wider dtype (float64) keeps fewer
#: rows, a narrower one (bfloat16) the same rows (:meth:`RowSample.add`)
PLANNED_ITEMSIZE = 4


class Capacity(int):
    """Rows a sample may keep, and ``budget``: the bytes of the sample budget they are given
    (None: unbounded). :class:`RowSample` fits the rows to it at its first batch, whose width
    and dtype may differ from the plan's."""

    budget: int | None

    def __new__(cls, rows: int, budget: int | None = None):
        out = super().__new__(cls, rows)
        out.budget = budget
        return out


def capacities(widths: dict, max_rows: int, budget_bytes: int,
               itemsize: int = PLANNED_ITEMSIZE) -> dict:
    """Rows per key (a :class:`Capacity`): ``max_rows`` each, or fewer, equal for all, when
    their buffers ``sum(rows * width * itemsize)`` would exceed ``budget_bytes``; at least one
    row each. ``widths[key]`` is None where the width is not known before the first batch:
    such a key is planned at the widest known width, or, where no width is known, at
    ``max_rows`` with an equal part of the budget; each key's ``budget`` (its rows' bytes as
    planned) then bounds its rows at its real width and item size (:meth:`RowSample.add`)."""
    if max_rows < 1 or budget_bytes < 1:
        raise ValueError(f"capacities: max_rows and budget_bytes must be positive, got "
                         f"{max_rows} and {budget_bytes}")
    known = [w for w in widths.values() if w]
    if not known:  # nothing to plan rows with: bytes, fitted at the first batch
        share = budget_bytes // max(len(widths), 1)
        return {k: Capacity(max_rows, share) for k in widths}
    widest = max(known)
    total = sum((w or widest) for w in widths.values()) * itemsize
    rows = max(1, min(max_rows, budget_bytes // total))
    return {k: Capacity(rows, rows * (w or widest) * itemsize) for k, w in widths.items()}


def generator_for(seed: int, name: str) -> torch.Generator:
    """The random rows of the tensor called ``name``: a generator of its own, from ``seed``
    and the name (not one shared in the order the layers are reached), so that a layer's
    sample is the same whatever else is calibrated with it (sequential calibration's pieces
    reach the layers in another order than the whole-model pass)."""
    mixed = (seed + zlib.crc32(name.encode()) * 0x9E37_79B9_7F4A_7C15) % 2**64
    return torch.Generator().manual_seed(mixed)


class RowSample:
    """Up to ``capacity`` rows of the tensors passed to :meth:`add`, spread over ``batches``
    batches: after the ``k``-th, ``capacity * k // batches`` rows (a batch with fewer rows
    leaves its share to the next). ``batches`` None (a stream of unknown length): an eighth
    of the capacity per batch. A batch is what :meth:`add`'s ``batch`` names (the calibration
    batch being forwarded: a layer called several times per forward shares that batch's
    rows among its calls); without it, each call counts as a batch.

    A row runs along ``axis`` (its size is the width): the last dim of a Linear's
    ``[..., features]``, or a conv's channel axis (``-3`` for ``[N, C, H, W]``), whose size
    is fixed where H and W vary by batch. A batch of another width than the first one's
    raises ``ValueError``, or, with ``skip_other_widths``, is left out (its share passes to
    the next). A batch of another dtype (a layer fed float32, then bfloat16) promotes the
    buffer (``torch.promote_types``, exact between float dtypes): every row is kept as it
    came, and :meth:`rows` (what ``auto`` and the report score) has the promoted dtype.

    A :class:`Capacity` (what :func:`capacities` plans) also bounds the buffer's bytes: the
    rows are fitted to its ``budget`` at the first batch's width and item size (a width not
    known when planning, a float64 model), and again if a wider dtype promotes the buffer
    (the rows past the new capacity are dropped)."""

    def __init__(self, capacity: int, batches: int | None, generator: torch.Generator,
                 axis: int = -1, skip_other_widths: bool = False):
        self.capacity, self.batches, self.generator = int(capacity), batches, generator
        # a Capacity's bytes: the rows are fitted to them at the first batch (:meth:`_fit`)
        self.planned, self.budget = int(capacity), getattr(capacity, "budget", None)
        self.axis, self.skip_other_widths = axis, skip_other_widths
        self.buffer: torch.Tensor | None = None
        self.count = self.seen = 0  # seen: the batches so far
        self._batch, self._batch_start = None, 0  # the batch now and the count before it

    def _share(self, batch=None) -> int:
        """Rows the next call, from ``batch``, may add."""
        if batch is None or batch != self._batch:  # a new batch (unnamed: each call)
            self.seen += 1
            self._batch, self._batch_start = batch, self.count
        if not self.batches:
            return max(1, self.capacity // 8) - (self.count - self._batch_start)
        return min(self.seen, self.batches) * self.capacity // self.batches - self.count

    def add(self, x: torch.Tensor, batch=None) -> None:
        """Rows of ``x``, which batch ``batch`` (its number, or None) brought."""
        if self.count >= self.capacity:
            return
        rows = self._rows(x.detach() if x.requires_grad else x)  # an op per call saved
        if self.buffer is None and x.numel():  # the first rows: their width and dtype known
            self._fit(rows.shape[-1], rows.element_size())
        share = self._share(batch)  # an empty batch counts too: later batches take its share
        if x.numel() == 0:
            return
        n, width = math.prod(rows.shape[:-1]), rows.shape[-1]
        take = min(n, share, self.capacity - self.count)
        if take <= 0 or not self._buffer_for(rows):
            return
        take = min(take, self.capacity - self.count)  # a promoted buffer may keep fewer rows
        idx = torch.randperm(n, generator=self.generator)[:take]
        idx = idx if rows.is_cpu else upload(idx, rows.device)
        out = self.buffer[self.count:self.count + take]
        if rows.is_contiguous() and rows.dtype == out.dtype:  # a view: no copy of the batch
            torch.index_select(rows.reshape(n, width), 0, idx, out=out)
        else:  # a conv's channel rows of NCHW, or narrower rows: only the rows taken, cast
            out.copy_(rows[torch.unravel_index(idx, rows.shape[:-1])])
        self.count += take

    def _fit(self, width: int, itemsize: int) -> None:
        """The capacity within :attr:`budget` (if any) for rows of ``width`` values of
        ``itemsize`` bytes, at least :data:`PLANNED_ITEMSIZE` (the plan's float32: bfloat16
        keeps the planned rows, float64 half of them); never above the planned rows, and at
        least one."""
        if self.budget is not None:
            per_row = max(width * max(itemsize, PLANNED_ITEMSIZE), 1)
            self.capacity = max(1, min(self.planned, self.budget // per_row))

    def _buffer_for(self, rows: torch.Tensor) -> bool:
        """Whether ``rows`` go into the buffer (allocated at the first rows): False for
        another width, with ``skip_other_widths``. A wider dtype promotes the buffer, cut to
        the rows that fit :attr:`budget` at its item size."""
        width = rows.shape[-1]
        if self.buffer is None:
            self.buffer = rows.new_empty((self.capacity, width))
            return True
        if self.buffer.shape[1] != width:
            if self.skip_other_widths:
                return False
            raise ValueError(f"sample: rows of width {width} after rows of width "
                             f"{self.buffer.shape[1]}")
        wide = self.buffer.dtype if rows.dtype == self.buffer.dtype else \
            torch.promote_types(self.buffer.dtype, rows.dtype)
        if wide != self.buffer.dtype:  # once per wider dtype: the rows so far, exactly
            self._fit(width, wide.itemsize)
            self.count = min(self.count, self.capacity)
            self.buffer = self.buffer[:self.capacity].to(wide)
        return self.count < self.capacity

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """A view of ``x`` as ``[..., width]``, the width along :attr:`axis` last."""
        if not x.dim():
            return x.reshape(1, 1)
        if x.dim() < -self.axis or self.axis == -1:  # fewer dims than the axis needs, or
            return x  # the rows along the last already (a movedim that moves nothing: an op)
        return x.movedim(self.axis, -1)

    @classmethod
    def holding(cls, rows: torch.Tensor) -> RowSample:
        """A full sample made of ``rows`` (e.g. merged from several processes)."""
        out = cls(rows.shape[0], 1, torch.Generator())
        out.buffer, out.count = rows, rows.shape[0]
        return out

    def rows(self) -> torch.Tensor | None:
        """The rows kept so far (a view of the buffer), or None if none."""
        return None if self.count == 0 else self.buffer[:self.count]

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()
