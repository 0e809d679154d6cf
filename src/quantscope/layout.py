"""Layouts: the only code in quantscope that knows about shapes.

Every granularity is a 2-D view of the tensor, ``[units, elements]``: one row
per set of values that share a scale. Statistics, searches and qparam
formulas are then plain per-row math, vectorized over all units.

=================================  =========================  ===================
layout                             units                      qparam shape
=================================  =========================  ===================
``Tensor()``                       1                          ``(1,)``
``Channel(axis=0)``                channels                   1 everywhere but axis
``Group(size, axis=-1, g_idx)``    groups of every row        ``(*rest, n_groups)``
``Token()``                        all dims but the last      ``(*leading, 1)``
``Block(size, axis=-1)``           blocks, zero-padded        ``(*rest, n_blocks)``
``Tile(rows, cols)``               tiles of the last 2 dims   ``(*leading, r_tiles, c_tiles)``
=================================  =========================  ===================

The per-unit results are ordered so that ``values.reshape(qparam_shape)`` is
the qparam tensor, and ``to_shape(to_units(x), x.shape) == x`` for every layout.

A group size that does not divide the axis is an error, because group
quantization (GPTQ / AWQ checkpoints, compressed-tensors) defines groups to
tile the axis exactly and a ragged last group has no agreed scale position.
Blocks and tiles are padded with zeros instead, as MX / NVFP4 and
block-wise fp8 define: zero is always representable, so padding never moves a
range or adds error. Statistics that count values take the padding back out
(:meth:`Layout.padded_parts`: histogram observers see a padded unit as its real
values alone). A tile longer than a whole dim is cut to it (its unit holds the
tensor's rows, not a tile of padding): same scales, a fraction of the memory.
"""

from __future__ import annotations

import hashlib
import math
import operator
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

import torch

from .formats import as_int, tensor_arg

__all__ = ["Block", "Channel", "Group", "Layout", "Tensor", "Tile", "Token", "parse_layout"]


def _axis(axis: int, shape: tuple[int, ...], who: str) -> int:
    nd = len(shape)
    if not -nd <= axis < nd:
        raise ValueError(
            f"{who}: axis {axis} is out of range for a tensor of shape {tuple(shape)} "
            f"(expected -{nd} <= axis < {nd})")
    return axis % nd


def _int_axis(layout, who: str) -> None:
    """Check ``layout.axis`` at construction and store it as a plain ``int``.

    numpy / torch integers are accepted (``operator.index``); bools are refused, since
    ``True`` would silently mean axis 1.
    """
    axis = layout.axis
    try:
        if isinstance(axis, bool):
            raise TypeError
        value = operator.index(axis)
    except TypeError:
        raise ValueError(f"{who}: axis must be an integer, got {axis!r}") from None
    object.__setattr__(layout, "axis", value)


#: layout kind (the name in ``"group:128"``) -> class; filled by each class's ``kind``
LAYOUTS: dict[str, type] = {}


class Layout:
    """Maps a tensor to ``[units, elements]`` and back.

    A new layout is one class with a ``kind`` (its name in strings such as ``"group:128"``),
    :meth:`from_arg` (the text after ``kind:``) and :meth:`spec_name` (the inverse); defining
    it registers it with :func:`parse_layout` and :class:`~quantscope.QuantSpec`'s names.
    """

    #: the layout's name in strings (``parse_layout``, ``QuantSpec.name``); "" for bases
    kind: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("kind"):
            LAYOUTS[cls.kind] = cls

    @classmethod
    def from_arg(cls, arg: str) -> Layout:
        """The layout of ``"kind:arg"`` (``arg`` may be empty: the defaults; layouts without
        parameters ignore it)."""
        return cls()

    def spec_name(self) -> str:
        """This layout as :func:`parse_layout` reads it back (``"channel:0"``, ``"group:128"``)."""
        return self.kind

    def to_units(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as ``[units, elements]``, ``x``'s dtype: one row per set of values sharing a
        scale, rows in the order of ``qparam_shape(x.shape)`` (Block / Tile rows zero-padded)."""
        raise NotImplementedError

    def to_shape(self, units: torch.Tensor, shape) -> torch.Tensor:
        """The inverse of :meth:`to_units`: ``units`` back to a tensor of ``shape``, padding
        dropped, so that ``to_shape(to_units(x), x.shape)`` equals ``x``."""
        raise NotImplementedError

    def qparam_shape(self, shape) -> tuple[int, ...]:
        """Shape of the scale / zero point of a tensor of ``shape``: one entry per unit, in
        :meth:`to_units`' row order; ``ValueError`` where the tensor cannot take this layout."""
        raise NotImplementedError

    def num_units(self, shape) -> int:
        """The number of units (rows of :meth:`to_units`): the product of :meth:`qparam_shape`."""
        return math.prod(self.qparam_shape(shape))

    def same_units(self, other: Layout, shape) -> bool:
        """Whether ``other`` cuts a tensor of ``shape`` into this layout's units, in this order
        (``"group:4:1"`` does ``"group:4"``'s on a 2-D tensor; ``"group:4:0"`` does not, though
        its qparam shape is the same on a square one). Runs along an axis (groups, blocks,
        tiles) must agree in size and axis: their qparam shape hides the axis; groups in
        column order (``g_idx``, which equality ignores: :attr:`Group.order`)."""
        shape = tuple(shape)
        if self.qparam_shape(shape) != other.qparam_shape(shape):
            return False
        return _runs(self, len(shape)) == _runs(other, len(shape)) and \
            getattr(self, "order", None) == getattr(other, "order", None)

    def check(self, shape) -> None:
        """Raise ``ValueError`` naming layout and shape if the tensor cannot take this layout."""
        self.qparam_shape(tuple(shape))

    @property
    def pads(self) -> bool:
        """Whether units may carry zero padding beyond the tensor's values."""
        return False

    def pads_at(self, shape) -> bool:
        """Whether the units of a tensor of ``shape`` carry padding (from the shape alone)."""
        return self.pads

    def padded_parts(self, units: torch.Tensor, shape) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The units of ``units = to_units(x)`` (``x.shape == shape``) that carry padding, in
        groups of one real length: ``(indices [P] on units' device, real values [P, E'])``,
        each unit holding ``E - E'`` padding zeros; ``[]`` when none does. Read from the
        shape alone (no host sync): statistics that count values (histograms) take the
        padding out with it.
        """
        return []


@dataclass(frozen=True)
class Tensor(Layout):
    """One scale for the whole tensor."""

    kind: ClassVar[str] = "tensor"

    def to_units(self, x):
        return x.reshape(1, -1)

    def to_shape(self, units, shape):
        return units.reshape(shape)

    def qparam_shape(self, shape):
        return (1,)


@dataclass(frozen=True)
class Channel(Layout):
    """One scale per index of ``axis`` (output channels of a Linear / Conv weight by default).

    A ConvTranspose weight is ``[in, out / groups, *k]``: calibration plans a rule's
    ``Channel(0)`` weight there as ``Channel(1)``, its output channels (and refuses it with
    groups > 1, where no axis holds them)."""

    axis: int = 0
    kind: ClassVar[str] = "channel"

    @classmethod
    def from_arg(cls, arg):
        return cls(int(arg) if arg else 0)

    def __post_init__(self):
        _int_axis(self, "Channel")

    def spec_name(self):
        return f"channel:{self.axis}"

    def to_units(self, x):
        a = _axis(self.axis, x.shape, "Channel")
        # explicit sizes, not -1: an empty tensor has no inferable dim; no movedim where the
        # axis is first already (a permute that changes nothing is still an op per call)
        moved = x if a == 0 else x.movedim(a, 0)
        return moved.reshape(x.shape[a], math.prod(x.shape) // max(x.shape[a], 1))

    def to_shape(self, units, shape):
        a = _axis(self.axis, shape, "Channel")
        moved = (shape[a], *shape[:a], *shape[a + 1:])
        return units.reshape(moved).movedim(0, a)

    def qparam_shape(self, shape):
        if len(shape) == 0:
            raise ValueError("Channel: a 0-d tensor has no channels")
        a = _axis(self.axis, shape, "Channel")
        return tuple(n if i == a else 1 for i, n in enumerate(shape))


@dataclass(frozen=True)
class Token(Layout):
    """One scale per token: every index of all dims but the last (dynamic activations)."""

    kind: ClassVar[str] = "token"

    def to_units(self, x):
        return x.reshape(math.prod(x.shape[:-1]), x.shape[-1]) if x.dim() else x.reshape(1, 1)

    def to_shape(self, units, shape):
        return units.reshape(shape)

    def qparam_shape(self, shape):
        return (*shape[:-1], 1) if len(shape) else (1,)


class _Segments(Layout):
    """Shared logic of Group and Block: consecutive runs of ``size`` along ``axis``."""

    size: int
    axis: int

    @classmethod
    def from_arg(cls, arg):
        size, _, axis = arg.partition(":")
        return cls(int(size) if size else 32, int(axis) if axis else -1)

    def spec_name(self):
        return f"{self.kind}:{self.size}" + (f":{self.axis}" if self.axis != -1 else "")
    _pad: bool = False
    _name: str = ""

    def __post_init__(self):
        size = as_int(self.size)  # numpy's too (as axis), kept as a Python int
        if size is None or size <= 0:
            raise ValueError(f"{self._name}: size must be a positive integer, got {self.size!r}")
        object.__setattr__(self, "size", size)
        _int_axis(self, self._name)

    def _geometry(self, shape):
        if len(shape) == 0:
            raise ValueError(f"{self._name}: a 0-d tensor cannot be split into "
                             f"{self._name.lower()}s")
        a = _axis(self.axis, shape, self._name)
        n = shape[a]
        if not self._pad and n % self.size:
            raise ValueError(
                f"{self._name}: size {self.size} does not divide {n}, the size of axis {self.axis} "
                f"of a tensor of shape {tuple(shape)}")
        return a, n, -(-n // self.size)

    def qparam_shape(self, shape):
        a, _, count = self._geometry(shape)
        return (*shape[:a], *shape[a + 1:], count)

    def _columns(self, x):  # permutation hook for activation order
        return x

    def _uncolumns(self, x):
        return x

    def to_units(self, x):
        a, n, count = self._geometry(x.shape)
        x = self._columns(x if a == x.dim() - 1 else x.movedim(a, -1))  # (as Channel's)
        pad = count * self.size - n
        if pad:
            x = torch.nn.functional.pad(x, (0, pad))
        return x.reshape(x.numel() // self.size, self.size)

    def to_shape(self, units, shape):
        a, n, count = self._geometry(shape)
        moved = (*shape[:a], *shape[a + 1:])
        x = units.reshape(*moved, count * self.size)[..., :n]
        return self._uncolumns(x).movedim(-1, a)

    @property
    def pads(self):
        return self._pad

    def pads_at(self, shape):
        _, n, count = self._geometry(shape)
        return self._pad and count * self.size != n

    def padded_parts(self, units, shape):
        _, n, count = self._geometry(shape)
        real = n - (count - 1) * self.size  # the last segment of every line holds the padding
        if real == self.size:
            return []
        idx = torch.arange(count - 1, units.shape[0], count, device=units.device)
        return [(idx, units.reshape(-1, count, self.size)[:, -1, :real])]


@dataclass(frozen=True)
class Group(_Segments):
    """Groups of ``size`` consecutive values along ``axis`` (last by default).

    ``g_idx`` (activation order, as GPTQ and compressed-tensors' ``actorder``
    use it) gives the group of every column: columns are permuted by the stable
    ``argsort(g_idx)`` before grouping and permuted back afterwards. Each group
    must hold exactly ``size`` columns.
    """

    size: int
    axis: int = -1
    g_idx: torch.Tensor | None = field(default=None, compare=False, hash=False)
    _name = "Group"
    kind: ClassVar[str] = "group"

    @classmethod
    def from_arg(cls, arg):
        if not arg.partition(":")[0]:  # no default: checkpoints use 32, 64, 128 alike
            raise ValueError("a group needs its size: 'group:SIZE' (as 'group:128')")
        return super().from_arg(arg)

    def __post_init__(self):
        super().__post_init__()
        if self.g_idx is not None:
            g = tensor_arg("Group", "g_idx", self.g_idx, "a 1-D integer tensor")
            if g.dim() != 1 or g.dtype.is_floating_point or g.is_complex() or (
                    g.dtype == torch.bool):
                raise ValueError(f"Group: g_idx must be a 1-D integer tensor, got {g.dtype} "
                                 f"of shape {tuple(g.shape)}")
            if g.numel() and int(g.min()) < 0:
                raise ValueError(f"Group: g_idx must hold group indices >= 0, got "
                                 f"{int(g.min())}")
            if g.numel() % self.size:  # (before the group indices: "0..-1" said nothing)
                raise ValueError(f"Group: g_idx must hold one group index per column, a "
                                 f"multiple of size={self.size} of them; got {g.numel()}")
            want = (f"Group: g_idx must put exactly size={self.size} columns in each group "
                    f"0..{g.numel() // self.size - 1}")
            if g.numel() and int(g.max()) >= g.numel() // self.size:  # before a count of each
                raise ValueError(f"{want}; got group index {int(g.max())}")
            counts = torch.bincount(g.long().cpu(), minlength=1)
            if g.numel() and (counts != self.size).any():
                raise ValueError(f"{want}; got group counts {counts.tolist()[:8]}...")
            perm = torch.argsort(g.long(), stable=True)
            object.__setattr__(self, "g_idx", g)
            object.__setattr__(self, "_perm", perm)
            object.__setattr__(self, "_inverse", torch.argsort(perm))

    def __repr__(self) -> str:
        # g_idx summarized (a message naming the layout printed every column's group)
        g = self.g_idx
        act = "" if g is None else (f", g_idx=<{g.numel()} columns, " + (
            f"order {self.order}>" if self.order else "column order>"))
        return f"Group(size={self.size}, axis={self.axis}{act})"

    @cached_property
    def order(self) -> str | None:
        """A short digest of the column order ``g_idx`` gives (``None``: column order, no
        ``g_idx`` or one that moves no column), which tells act-order groups apart in
        :meth:`~Layout.same_units` and saved observer states without storing ``g_idx``."""
        if self.g_idx is None or torch.equal(self._perm.cpu(), torch.arange(len(self._perm))):
            return None
        return hashlib.sha256(self._perm.cpu().numpy().tobytes()).hexdigest()[:16]

    def _geometry(self, shape):
        geometry = super()._geometry(shape)
        if self.g_idx is not None and self.g_idx.numel() != geometry[1]:
            raise ValueError(
                f"Group: g_idx has {self.g_idx.numel()} entries but axis {self.axis} of a tensor "
                f"of shape {tuple(shape)} has {geometry[1]}")
        return geometry

    def _columns(self, x):
        return x if self.g_idx is None else x.index_select(-1, self._perm.to(x.device))

    def _uncolumns(self, x):
        return x if self.g_idx is None else x.index_select(-1, self._inverse.to(x.device))


@dataclass(frozen=True)
class Block(_Segments):
    """Blocks of ``size`` along ``axis`` for MX (32), NVFP4 (16) and BFP (8); the tail is
    zero-padded."""

    size: int = 32
    axis: int = -1
    _pad = True
    _name = "Block"
    kind: ClassVar[str] = "block"


@dataclass(frozen=True)
class Tile(Layout):
    """``rows x cols`` tiles of the last two dims (block-wise fp8 weights use 128 x 128).

    Edges are zero-padded. Leading dims, if any, each get their own tiles.
    """

    rows: int = 128
    cols: int = 128
    kind: ClassVar[str] = "tile"

    @classmethod
    def from_arg(cls, arg):
        r, _, c = arg.partition("x")
        return cls(int(r), int(c or r)) if arg else cls()

    def spec_name(self):
        return f"tile:{self.rows}x{self.cols}"

    def __post_init__(self):
        for name in ("rows", "cols"):
            v = getattr(self, name)
            n = as_int(v)  # True is no size; numpy's integers are, kept as Python ints
            if n is None or n <= 0:
                raise ValueError(f"Tile: {name} must be a positive integer, got {v!r}")
            object.__setattr__(self, name, n)

    def _geometry(self, shape):
        """``(r, c, rt, ct, tr, tc)``: the last two dims, the tile grid, and a unit's rows and
        columns: a tile, but never more than the tensor holds (a tile past a whole dim is that
        dim), so a decode-shaped ``[B, 1, C]`` activation's units are its rows, not 128x their
        size in padding zeros that every statistic takes back out."""
        if len(shape) < 2:
            raise ValueError(f"Tile: needs a tensor of at least 2 dims, got shape {tuple(shape)}")
        r, c = shape[-2:]
        return (r, c, -(-r // self.rows), -(-c // self.cols),
                min(self.rows, r) or self.rows, min(self.cols, c) or self.cols)

    def qparam_shape(self, shape):
        _, _, rt, ct, _, _ = self._geometry(shape)
        return (*shape[:-2], rt, ct)

    def to_units(self, x):
        r, c, rt, ct, tr, tc = self._geometry(x.shape)
        pr, pc = rt * tr - r, ct * tc - c
        if pr or pc:
            x = torch.nn.functional.pad(x, (0, pc, 0, pr))
        lead = math.prod(x.shape[:-2])
        x = x.reshape(lead, rt, tr, ct, tc).transpose(2, 3)
        return x.reshape(lead * rt * ct, tr * tc)

    def to_shape(self, units, shape):
        r, c, rt, ct, tr, tc = self._geometry(shape)
        x = units.reshape(math.prod(shape[:-2]), rt, ct, tr, tc).transpose(2, 3)
        x = x.reshape(*shape[:-2], rt * tr, ct * tc)
        return x[..., :r, :c]

    @property
    def pads(self):
        return True

    def pads_at(self, shape):
        r, c, rt, ct, tr, tc = self._geometry(shape)
        return (rt * tr, ct * tc) != (r, c)

    def padded_parts(self, units, shape):
        r, c, rt, ct, tr, tc = self._geometry(shape)
        rv, cv = r - (rt - 1) * tr, c - (ct - 1) * tc  # the edge tiles' real sizes
        if rv == tr and cv == tc:
            return []
        u = units.reshape(-1, rt, ct, tr, tc)
        tiles = torch.arange(units.shape[0], device=units.device).view(-1, rt, ct)
        parts = [(tiles[:, -1, -1], u[:, -1, -1, :rv, :cv])]  # the corner
        if cv < tc and rt > 1:  # the last tile column above it
            parts.append((tiles[:, :-1, -1], u[:, :-1, -1, :, :cv]))
        if rv < tr and ct > 1:  # the last tile row left of it
            parts.append((tiles[:, -1, :-1], u[:, -1, :-1, :rv, :]))
        return [(i.reshape(-1), v.reshape(i.numel(), -1)) for i, v in parts]


def _runs(layout: Layout, ndim: int) -> tuple | None:
    """The runs a layout cuts along an axis (a group's are a block's), ``None`` for others."""
    if isinstance(layout, _Segments):
        return "runs", layout.size, layout.axis % ndim
    if isinstance(layout, Tile):
        return "tiles", layout.rows, layout.cols
    return None


def parse_layout(value: str | Layout) -> Layout:
    """``"tensor"``, ``"channel"``, ``"channel:1"``, ``"group:128"``, ``"token"``, ``"block:32"``,
    ``"tile:128x128"`` or a layout (``"group:SIZE:AXIS"`` for another axis)."""
    if isinstance(value, Layout):
        return value
    name, _, arg = str(value).lower().partition(":")
    try:
        if name in LAYOUTS:
            return LAYOUTS[name].from_arg(arg)
    except ValueError as e:
        if str(e).startswith(("Group", "Block", "Tile", "Channel")):
            raise
        raise ValueError(f"layout: cannot read {value!r}: {e}") from None
    raise ValueError(
        f"layout: unknown {value!r}; expected tensor, channel[:axis], group:SIZE, token, "
        f"block[:SIZE] or tile[:RxC]")
