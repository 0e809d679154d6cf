"""Process-group helpers and the vocabulary of cross-process reductions.

The lowest layer of data-parallel calibration: what a state buffer's reduction is
(:class:`Op`: ``MIN | MAX | SUM | AVG``, and :class:`CustomSync` for states that must agree
on a grid first), who this process is (:func:`rank`, :func:`world_size`, :func:`shard`),
and counted collectives (:func:`all_reduce`, :func:`all_gather`, :func:`last_stats`).
Statistics and observers import this module to declare how their state syncs; the sync
itself is :mod:`quantscope.observers.sync`; :mod:`quantscope.distributed` re-exports all.

Outside an initialised process group (or with one process) every function here is a
no-op, so code written for ``torchrun`` also runs in a single process.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "AVG",
    "MAX",
    "MIN",
    "SUM",
    "CustomSync",
    "LocalError",
    "Op",
    "SyncStats",
    "all_gather",
    "all_or_none",
    "all_reduce",
    "all_sum",
    "group_device",
    "init_from_env",
    "is_distributed",
    "is_main",
    "is_writer",
    "last_stats",
    "main_global_rank",
    "raise_on_all",
    "rank",
    "reset_stats",
    "shard",
    "world_size",
    "writes_here",
]


class Op(enum.Enum):
    """How a state buffer reduces across processes."""

    MIN = "min"
    MAX = "max"
    SUM = "sum"
    AVG = "avg"  # mean over the ranks that saw data (approximate mode of moving averages)

    def identity(self, dtype: torch.dtype):
        """The value a state of ``dtype`` that saw nothing holds: the reduction's identity."""
        if self is Op.SUM or self is Op.AVG:
            return 0
        if dtype == torch.bool:
            return self is Op.MIN
        if dtype.is_floating_point:
            return float("inf") if self is Op.MIN else float("-inf")
        info = torch.iinfo(dtype)
        return info.max if self is Op.MIN else info.min


MIN, MAX, SUM, AVG = Op.MIN, Op.MAX, Op.SUM, Op.AVG


class CustomSync:
    """A state that needs agreement before it can be summed (histograms).

    Protocol, called in this order on every rank:

    * ``names``: the buffers it owns; their shapes travel in the header.
    * ``empty(obs, shapes)``: on a rank that saw nothing, allocate the empty state of the
      agreed ``shapes`` (``{name: shape}``).
    * ``grid(obs) -> float64 [G]``: parameters all ranks must agree on, reduced with MAX
      (encode a MIN as a negated value); an empty state gives the MAX identity (``-inf``).
    * ``rebin(obs, grid) -> {buffer: Op}``: move the local state exactly onto the agreed
      grid and return the buffers that now reduce plainly (counts: SUM).
    """

    names: tuple[str, ...] = ()

    def empty(self, obs, shapes: dict) -> None:
        """On a rank that saw nothing: give ``obs`` the empty state of the agreed ``shapes``."""
        raise NotImplementedError

    def grid(self, obs) -> torch.Tensor:
        """``float64 [G]`` parameters all ranks must agree on, reduced with MAX (empty: -inf)."""
        raise NotImplementedError

    def rebin(self, obs, grid: torch.Tensor) -> dict[str, Op]:
        """Move ``obs``'s state exactly onto the agreed ``grid``; ``{buffer: Op}`` to reduce."""
        raise NotImplementedError

    # Batching: customs with equal ``batch_key`` (the same on every rank) are handled by
    # one ``grid_many`` / ``rebin_many`` call; the defaults loop over the items.
    def batch_key(self, obs):
        """Equal for customs one ``grid_many`` / ``rebin_many`` call takes (``id``: alone)."""
        return id(self)

    @classmethod
    def grid_many(cls, pairs) -> list[torch.Tensor]:
        return [it.grid(obs) for obs, it in pairs]

    @classmethod
    def rebin_many(cls, pairs, grids) -> list[dict[str, Op]]:
        return [it.rebin(obs, g) for (obs, it), g in zip(pairs, grids)]


@dataclass
class SyncStats:
    """What the last :func:`sync_observers` call moved (for benchmarks)."""

    collectives: int = 0
    bytes: int = 0  # payload bytes sent per rank (all_gather: own contribution)


_STATS = SyncStats()


def last_stats() -> SyncStats:
    """Collectives and payload bytes of the last :func:`sync_observers` on this rank."""
    return SyncStats(_STATS.collectives, _STATS.bytes)


def reset_stats() -> None:
    """Start counting afresh (each :func:`~quantscope.observers.sync.sync_observers` does)."""
    _STATS.collectives = 0
    _STATS.bytes = 0


# ----------------------------------------------------------------------------- basics
def is_distributed(group=None) -> bool:
    """True inside an initialised process group of more than one process."""
    return (dist.is_available() and dist.is_initialized()
            and dist.get_world_size(group) > 1)


def rank(group=None) -> int:
    """This process's rank in ``group`` (0 outside a process group)."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def world_size(group=None) -> int:
    """The number of processes in ``group`` (1 outside a process group)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def shard(items: Iterable, group=None):
    """This rank's share of ``items``: every ``world``-th item from index ``rank``.

    Round-robin, so ranks differ by at most one item and step ``t`` of all ranks
    together holds items ``t * world .. t * world + world - 1`` (the global batch of
    the step-synced mode). A sequence gives a list; any other iterable is read lazily.
    """
    r, w = rank(group), world_size(group)
    if isinstance(items, Sequence):
        return list(items)[r::w]
    return itertools.islice(items, r, None, w)


def init_from_env(backend: str | None = None) -> bool:
    """Join the process group ``torchrun`` describes (``WORLD_SIZE`` > 1 in the environment).

    Backend: NCCL when CUDA is available (each process on ``cuda:LOCAL_RANK``), else gloo.
    Returns whether this process is now one of several; a no-op without torchrun.
    """
    if dist.is_available() and dist.is_initialized():
        return is_distributed()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    return True


def is_main(group=None) -> bool:
    """True on the rank that writes files and prints (rank 0, or no process group)."""
    return rank(group) == 0


def main_global_rank(group=None) -> int:
    """The global rank of ``group``'s rank 0 (0 outside a process group): the process that
    writes what a calibration in ``group`` saves and exports."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_global_rank(group, 0)


def is_writer(global_rank: int | None) -> bool:
    """Whether this process writes a calibration's files: global rank ``global_rank`` (its
    :attr:`~quantscope.calibration.Calibration.writer_rank`, no default: a group's writer is
    :func:`main_global_rank`, not a literal 0; None: the calibration is this process's own,
    made here), or no process group."""
    return (global_rank is None or not (dist.is_available() and dist.is_initialized())
            or dist.get_rank() == global_rank)


def writes_here(global_rank: int | None, who: str, path) -> bool:
    """:func:`is_writer`, and where this process writes nothing, a record that says so
    (logger ``quantscope``, level INFO: the other ranks of a distributed calibration do so
    on every save, as documented, so not a warning)."""
    if is_writer(global_rank):
        return True
    logging.getLogger("quantscope").info(
        "%s: global rank %d writes nothing to %s: the calibration's writer_rank is global "
        "rank %d, which writes it (docs/guide/distributed.md)", who, dist.get_rank(),
        os.fspath(path), global_rank)
    return False


def all_sum(value: int, group=None) -> int:
    """``value`` summed over the ranks (e.g. the number of calibration batches)."""
    if not is_distributed(group):
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=group_device(group))
    dist.all_reduce(t, group=group)
    return int(t)


class LocalError(contextlib.AbstractContextManager):
    """Keeps (``error``) the exception a local step raised, for :func:`raise_on_all` to
    raise on every rank once the ranks have exchanged whether it failed anywhere."""

    error: Exception | None = None

    def __exit__(self, kind, error, tb) -> bool:
        if isinstance(error, Exception):
            self.error = error
            return True  # re-raised by raise_on_all, after the ranks agree
        return False


@contextlib.contextmanager
def all_or_none(what: str = "a step", group=None, same_type: bool = False):
    """Run a local step so that if it raises on any rank, it raises on every rank.

    Without this, a rank that fails (bad input, a layer that cannot take a spec)
    leaves the others waiting in their next collective until the timeout. After the
    block every rank exchanges one flag: the failing rank re-raises its own error,
    the others raise ``RuntimeError`` naming the failing ranks or, with ``same_type``,
    the first failing rank's exception type and message (:func:`raise_on_all`).
    """
    local = LocalError()
    with local:
        yield
    if not is_distributed(group):
        if local.error is not None:
            raise local.error
        return
    flags = all_gather(torch.tensor([int(local.error is not None)], dtype=torch.int64,
                                     device=group_device(group)), group)
    raise_on_all(local.error, bool(flags.any()), what, group, same_type)


def raise_on_all(error: Exception | None, failed: bool, what: str, group=None,
                 same_type: bool = False) -> None:
    """The raising half of :func:`all_or_none`, for callers that exchange the flag in a
    collective of their own: ``failed`` (the same on every rank) says whether a local step
    raised on some rank; ``error`` is this rank's. The failing ranks re-raise their error;
    the others raise ``RuntimeError`` naming them or, with ``same_type``, the exception type
    and message of the first failing rank. One more exchange, only when some rank failed."""
    if not failed:
        return
    errs: list = [None] * world_size(group)
    mine = None if error is None else (type(error).__module__, type(error).__qualname__,
                                       str(error))
    dist.all_gather_object(errs, mine, group=group)
    if error is not None:
        raise error
    bad = [r for r, e in enumerate(errs) if e is not None]
    if not same_type:
        raise RuntimeError(f"distributed: {what} failed on rank(s) {bad}; see their error")
    raise _rebuilt(*errs[bad[0]], f" ({what} failed on rank(s) {bad})")


def _rebuilt(module: str, qualname: str, message: str, where: str) -> Exception:
    """A peer's exception from its type's name (looked up among the modules already
    imported here, never imported) and message; RuntimeError where that cannot be built."""
    cls = sys.modules.get(module)
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        with contextlib.suppress(Exception):
            return cls(message + where)
    return RuntimeError(f"{module}.{qualname}: {message}{where}")


def group_device(group) -> torch.device:
    """The device collectives of ``group`` run on (CUDA for NCCL, else CPU)."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(t: torch.Tensor, op, group) -> None:
    """``dist.all_reduce`` in place, counted in :func:`last_stats`."""
    _STATS.collectives += 1
    _STATS.bytes += t.numel() * t.element_size()
    dist.all_reduce(t, op=op, group=group)


def all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``t`` stacked along a new first dim (``[world, ...]``), counted."""
    _STATS.collectives += 1
    _STATS.bytes += t.numel() * t.element_size()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return torch.stack(out)
