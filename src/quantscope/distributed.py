"""Statistics sync across processes on ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Data-parallel calibration gives each process different batches; before
qparams are computed the observers must agree. Every observer declares how its
state reduces in :meth:`Observer._sync_plan` (``{buffer name: MIN | MAX | SUM | AVG}``,
or a :class:`CustomSync` such as a histogram that first agrees on a common grid);
:func:`sync_observers` then syncs any number of observers in a handful of
collectives:

0. one tiny ``all_reduce`` checking that every rank syncs the same observers;
1. one ``all_gather`` of a small fixed-length int64 header per rank (whether the
   observer saw data, whether it saw NaN / inf, the state shapes), so that a rank
   with no batches learns the shapes and fills its state with the identity of each
   reduction (+inf for MIN, -inf for MAX, 0 for SUM), and every rank reaches the
   same decision (including the same error) without a further exchange;
2. one ``all_reduce`` of the grid parameters of every custom sync (histograms), if any;
3. one ``all_reduce`` per (reduction, dtype) bucket: buffers are flattened and
   concatenated; MIN is folded into MAX by negation (exact), AVG into SUM.

Exactness. MIN / MAX / SUM states (static min-max, histogram counts, token counts)
after sync equal, bitwise, those of one process that saw every batch: min and
max are exact in any order and histogram counts are int64. Moving averages are
order-dependent, so two modes:

* default, approximate (as llm-compressor's DDP sync): AVG of the final per-rank
  averages, over the ranks that saw data. Cheap, one collective, no sync in forward.
* ``observer.sync_every_step = True``: exact. At every call the observers of all
  ranks exchange the step's statistic before updating their state, so the result
  equals, bitwise, one process that observed at each step the concatenation (along
  the batch) of every rank's batch of that step. Min-max observers exchange only the
  per-unit min / max (2 small collectives per call); every other observer gathers the
  step's units from all ranks (moves the activations). This puts collectives inside
  ``forward``: every rank must call every step-synced observer the same number of
  times in the same order; a rank without data for a step calls it with an empty
  tensor (``observer(x[:0])``) or :func:`empty_step`. After the last step
  :func:`sync_observers` only adds up the counters of step-synced observers.

NaN / inf. The "seen non-finite" flag travels in the header (MAX), so after a sync
every rank raises the same ``ValueError`` from ``calculate_qparams`` instead of one
rank raising while the others wait in a collective.

Outside an initialised process group (or with one process) every function here is
a no-op, so code written for ``torchrun`` also runs in a single process.
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import itertools
import os
import zlib
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
    "HistogramSync",
    "Op",
    "SyncStats",
    "all_or_none",
    "all_sum",
    "assign_by_size",
    "empty_step",
    "gather_failures",
    "gather_qparams",
    "gather_samples",
    "init_from_env",
    "is_distributed",
    "is_main",
    "last_stats",
    "rank",
    "shard",
    "step_sync",
    "sync_observers",
    "weight_owners",
    "world_size",
]

_MAXD = 8  # dims recorded per shape in the header


class Op(enum.Enum):
    """How a state buffer reduces across processes."""

    MIN = "min"
    MAX = "max"
    SUM = "sum"
    AVG = "avg"  # mean over the ranks that saw data (approximate mode of moving averages)


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
        raise NotImplementedError

    def grid(self, obs) -> torch.Tensor:
        raise NotImplementedError

    def rebin(self, obs, grid: torch.Tensor) -> dict[str, Op]:
        raise NotImplementedError

    # Batching: customs with equal ``batch_key`` (the same on every rank) are handled by
    # one ``grid_many`` / ``rebin_many`` call; the defaults loop over the items.
    def batch_key(self, obs):
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


# ----------------------------------------------------------------------------- basics
def is_distributed(group=None) -> bool:
    """True inside an initialised process group of more than one process."""
    return (dist.is_available() and dist.is_initialized()
            and dist.get_world_size(group) > 1)


def rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def world_size(group=None) -> int:
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


def all_sum(value: int, group=None) -> int:
    """``value`` summed over the ranks (e.g. the number of calibration batches)."""
    if not is_distributed(group):
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=_device(group))
    dist.all_reduce(t, group=group)
    return int(t)


@contextlib.contextmanager
def all_or_none(what: str = "a step", group=None):
    """Run a local step so that if it raises on any rank, it raises on every rank.

    Without this, a rank that fails (bad input, a layer that cannot take a spec)
    leaves the others waiting in their next collective until the timeout. After the
    block every rank exchanges one flag: the failing rank re-raises its own error,
    the others raise ``RuntimeError`` naming the failing ranks.
    """
    err = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 -- re-raised below, after the ranks agree
        err = e
    if not is_distributed(group):
        if err is not None:
            raise err
        return
    flags = _all_gather(torch.tensor([int(err is not None)], dtype=torch.int64,
                                     device=_device(group)), group).reshape(-1).cpu()
    if err is not None:
        raise err
    if bool(flags.any()):
        bad = torch.nonzero(flags).reshape(-1).tolist()
        raise RuntimeError(f"distributed: {what} failed on rank(s) {bad}; see their error")


def _device(group):
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(t: torch.Tensor, op, group):
    _STATS.collectives += 1
    _STATS.bytes += t.numel() * t.element_size()
    dist.all_reduce(t, op=op, group=group)


def _all_gather(t: torch.Tensor, group) -> torch.Tensor:
    _STATS.collectives += 1
    _STATS.bytes += t.numel() * t.element_size()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return torch.stack(out)


def _identity(op: Op, dtype: torch.dtype):
    if op is SUM or op is AVG:
        return 0
    if dtype == torch.bool:
        return op is MIN
    if dtype.is_floating_point:
        return float("inf") if op is MIN else float("-inf")
    info = torch.iinfo(dtype)
    return info.max if op is MIN else info.min


def _plan(obs) -> list:
    """The observer's declared plan as ``[(name, Op) | CustomSync]``."""
    try:
        plan = obs._sync_plan()
    except NotImplementedError:
        raise NotImplementedError(
            f"{type(obs).__name__}: the observer does not declare how its state syncs "
            f"across processes; implement _sync_plan() returning {{buffer: MIN|MAX|SUM|AVG}}"
        ) from None
    items = list(plan.items()) if isinstance(plan, dict) else list(plan)
    for it in items:
        if not (isinstance(it, CustomSync)
                or (isinstance(it, tuple) and len(it) == 2 and isinstance(it[1], Op))):
            raise TypeError(f"{type(obs).__name__}._sync_plan(): expected (buffer, Op) pairs "
                            f"or CustomSync objects, got {it!r}")
    return items


def _names(plan) -> list[str]:
    """Every buffer a plan touches, in plan order (their shapes go in the header)."""
    out = []
    for it in plan:
        out += list(it.names) if isinstance(it, CustomSync) else [it[0]]
    return out


def _encode_shape(shape) -> list[int]:
    shape = tuple(shape)
    if len(shape) > _MAXD:
        raise ValueError(f"sync: state of {len(shape)} dims; at most {_MAXD} are supported")
    return [len(shape), *shape, *([0] * (_MAXD - len(shape)))]


def _decode_shape(row) -> tuple[int, ...]:
    return tuple(int(v) for v in row[1:1 + int(row[0])])


def _check_same_plans(observers, plans, dev, group) -> None:
    """One tiny all_reduce: every rank must sync the same observers with the same plans
    (else the header all_gather would mismatch); a difference raises on every rank."""
    text = repr([(type(o).__name__, _names(p)) for o, p in zip(observers, plans)])
    sig = zlib.crc32(text.encode())
    t = torch.tensor([len(observers), -len(observers), sig, -sig], dtype=torch.int64,
                     device=dev)
    _all_reduce(t, dist.ReduceOp.MAX, group)
    if int(t[0]) != -int(t[1]) or int(t[2]) != -int(t[3]):
        raise ValueError(f"sync: the ranks sync different observers ({len(observers)} here, "
                         f"between {-int(t[1])} and {int(t[0])} on the ranks) or different "
                         f"state; every rank must pass the same observers in the same order")


# ------------------------------------------------------------------------ full sync
def sync_observers(observers: Iterable, group=None) -> None:
    """Make the state of ``observers`` the same on every rank, as if one process saw it all.

    Every rank must call it with the same observers, in the same order (e.g.
    ``session.observers()`` of the same model and recipe). Collectives: a tiny check that
    they do, one ``all_gather`` of headers, one ``all_reduce`` of histogram grids if there
    are histograms, and one ``all_reduce`` per (reduction, dtype) bucket (usually 2-3).
    """
    observers = list(observers)
    _STATS.collectives = 0
    _STATS.bytes = 0
    if not observers or not is_distributed(group):
        return
    dev = _device(group)
    me = dist.get_rank(group)
    plans = [_plan(o) for o in observers]
    _check_same_plans(observers, plans, dev, group)

    # 1. headers: [has_observed, seen_non_finite, step_synced, last shape, shape per buffer item]
    rows = []
    for obs, plan in zip(observers, plans):
        seen = obs.has_observed
        rows += [int(seen), int(bool(obs.seen_non_finite)), int(obs.sync_every_step)]
        rows += _encode_shape(obs.shape if seen else ())
        for name in _names(plan):
            rows += _encode_shape(getattr(obs, name).shape if seen else ())
    header = torch.tensor(rows, dtype=torch.int64, device=dev)
    allh = _all_gather(header, group).cpu()  # [world, L]

    # 2. decisions from the headers: identical on every rank, so errors are too
    allh = allh.tolist()  # plain Python from here: cheap per-observer decisions
    pos = 0
    work = []  # (obs, plan, observed_locally, n_observed, step_synced)
    for obs, plan in zip(observers, plans):
        seen_r = [row[pos] for row in allh]
        nonfinite = any(row[pos + 1] for row in allh)
        steps = [row[pos + 2] for row in allh]
        step_synced = any(steps)
        if step_synced and not all(steps):
            raise ValueError(f"sync: {obs._who()} has sync_every_step set on some ranks only")
        seen_ranks = [r for r, v in enumerate(seen_r) if v]
        shape = _decode_shape(allh[seen_ranks[-1]][pos + 3:]) if seen_ranks else None
        pos += 3 + 1 + _MAXD
        shapes = {}
        for name in _names(plan):
            block = [allh[r][pos:pos + 1 + _MAXD] for r in seen_ranks]
            pos += 1 + _MAXD
            if any(b != block[0] for b in block):
                got = [_decode_shape(b) for b in block]
                raise ValueError(
                    f"sync: {obs._who()} has state {name!r} of different shapes on different "
                    f"ranks ({got}); the layout must give the same units on every rank")
            if block:
                shapes[name] = _decode_shape(block[0])
        n_seen = len(seen_ranks)
        if nonfinite:
            obs.seen_non_finite = torch.ones_like(obs.seen_non_finite)
        if n_seen == 0:
            continue
        observed = bool(seen_r[me])
        if not observed and not step_synced:  # agreed shapes, filled with the identity
            for it in plan:
                if isinstance(it, CustomSync):
                    it.empty(obs, shapes)
                    continue
                buf = getattr(obs, it[0])
                setattr(obs, it[0], torch.full(shapes[it[0]], _identity(it[1], buf.dtype),
                                               dtype=buf.dtype, device=buf.device))
        obs._set_shape(shape)
        work.append((obs, plan, observed, n_seen, step_synced))

    # 3. custom syncs (histograms): agree on the grid, re-bin exactly
    groups: dict = {}  # same-kind customs are handled together (one batched re-bin)
    for obs, plan, _, _, step in work:
        for it in plan:
            if isinstance(it, CustomSync) and not step:
                groups.setdefault(it.batch_key(obs), []).append((obs, it))
    extra: dict[int, list] = {}
    if groups:
        grids = [[g.to(torch.float64).reshape(-1) for g in type(pairs[0][1]).grid_many(pairs)]
                 for pairs in groups.values()]
        sizes = [len(g) for gl in grids for g in gl]
        flat = torch.cat([g for gl in grids for g in gl]).to(dev)
        _all_reduce(flat, dist.ReduceOp.MAX, group)
        parts = iter(flat.split(sizes))
        for pairs, gl in zip(groups.values(), grids):
            done = type(pairs[0][1]).rebin_many(pairs, [next(parts) for _ in gl])
            for (obs, _), ops in zip(pairs, done):
                extra.setdefault(id(obs), []).extend(ops.items())

    # 4. buckets: (reduction, dtype) -> [(obs, name, op, n_seen, observed)]
    buckets: dict[tuple, list] = {}

    def add(obs, name, op, n_seen, observed):
        buf = getattr(obs, name)
        red = dist.ReduceOp.SUM if op in (SUM, AVG) else dist.ReduceOp.MAX
        dtype = torch.uint8 if buf.dtype == torch.bool else buf.dtype
        buckets.setdefault((red, dtype), []).append((obs, name, op, n_seen, observed))

    for obs, plan, observed, n_seen, step in work:
        add(obs, "observed_tokens", SUM, n_seen, observed)
        add(obs, "non_finite_count", SUM, n_seen, observed)
        if step:  # the state is already global after every step
            continue
        for it in plan:
            if not isinstance(it, CustomSync):
                add(obs, *it, n_seen, observed)
        for name, op in extra.get(id(obs), ()):
            add(obs, name, op, n_seen, observed)

    for (red, dtype), entries in buckets.items():
        parts = []
        for obs, name, op, n_seen, observed in entries:
            v = getattr(obs, name).detach().reshape(-1).to(dtype)
            if op is MIN:
                v = -v
            elif op is AVG and not observed:
                v = torch.zeros_like(v)
            parts.append(v)
        flat = torch.cat(parts).to(dev)
        _all_reduce(flat, red, group)
        flat = flat.to(parts[0].device)  # a bucket holds at least one entry
        for (obs, name, op, n_seen, _), v in zip(entries,
                                                  flat.split([p.numel() for p in parts])):
            if op is MIN:
                v = -v
            elif op is AVG:
                v = v / n_seen
            buf = getattr(obs, name)  # a new tensor, not copy_: buffers may be inference tensors
            setattr(obs, name, v.reshape(buf.shape).to(device=buf.device, dtype=buf.dtype,
                                                        copy=True))


# ------------------------------------------------------------------------ histograms
class HistogramSync(CustomSync):
    """Exact sync of a :mod:`quantscope.stats.histogram` state kept in five buffers.

    The ranks agree on the union range (``lo`` MIN, ``hi`` MAX) and the largest bin
    exponent in one MAX all-reduce; each rank then re-bins its counts exactly onto the
    grid :func:`~quantscope.stats.histogram.merge` would choose for the union (power-of-two
    bin merges), and the counts are summed. The result equals, bitwise, the histogram
    of one process that saw every batch.

    ``names``: the buffers holding ``HistState(counts, exp, first, lo, hi)``.
    """

    def __init__(self, counts="hist_counts", exp="hist_exp", first="hist_first",
                 lo="hist_lo", hi="hist_hi", absolute: bool = False):
        self.names = (counts, exp, first, lo, hi)
        self.absolute = bool(absolute)

    def _state(self, obs):
        from .stats.histogram import HistState

        return HistState(*(getattr(obs, n) for n in self.names))

    def _set(self, obs, state) -> None:
        for n, v in zip(self.names, state):
            setattr(obs, n, v)

    def empty(self, obs, shapes):
        from .stats.histogram import empty_state

        units, bins = shapes[self.names[0]]
        self._set(obs, empty_state(units, bins, device=getattr(obs, self.names[0]).device))

    def grid(self, obs):
        return self.grid_many([(obs, self)])[0]

    def rebin(self, obs, grid):
        return self.rebin_many([(obs, self)], [grid])[0]

    def batch_key(self, obs):
        c = getattr(obs, self.names[0])
        return (HistogramSync, c.shape[1], self.absolute, c.device, c.dtype)

    @classmethod
    def grid_many(cls, pairs):
        # one [-lo, hi, exp] vector over the units of every histogram of the group
        sts = [it._state(obs) for obs, it in pairs]
        return [torch.cat([-torch.cat([st.lo for st in sts]).double(),
                           torch.cat([st.hi for st in sts]).double(),
                           torch.cat([st.exp for st in sts]).double()])]

    @classmethod
    def rebin_many(cls, pairs, grids):
        from .stats.histogram import grid_exponent, grid_first, rebin

        sts = [it._state(obs) for obs, it in pairs]
        units = [st.counts.shape[0] for st in sts]
        U, bins = sum(units), sts[0].counts.shape[1]
        g = grids[0].to(sts[0].counts.device)
        lo, hi = (-g[:U]).float(), g[U:2 * U].float()
        e = torch.maximum(g[2 * U:].long(), grid_exponent(lo, hi, bins))
        first = grid_first(lo, e, pairs[0][1].absolute)
        old_e = torch.cat([st.exp for st in sts])
        old_first = torch.cat([st.first for st in sts])
        # only units whose grid moves are re-binned (none, once the ranks agree)
        moved = torch.nonzero((e != old_e) | (first != old_first)).reshape(-1)
        start = 0
        out = []
        for (obs, it), st, n in zip(pairs, sts, units):
            rows = moved[(moved >= start) & (moved < start + n)]
            counts = st.counts
            if rows.numel():
                local = rows - start
                counts = counts.clone()
                counts[local] = rebin(st.counts[local], old_e[rows], old_first[rows], e[rows],
                                      first[rows])
            sl = slice(start, start + n)
            it._set(obs, (counts, e[sl].clone(), first[sl].clone(), lo[sl].clone(),
                          hi[sl].clone()))
            out.append({it.names[0]: SUM})
            start += n
        return out


# ------------------------------------------------------------------------ step sync
def step_sync(obs, units, lo, hi, group=None):
    """Exchange one step's statistic of ``obs`` (called by ``Observer.forward`` in
    ``sync_every_step`` mode); ``units`` None: this rank has no data this step.

    Returns the global ``(units, lo, hi)`` of the step, or None when no rank had data.
    Min-max observers (``step_stat = "minmax"``) exchange only ``lo`` / ``hi``; the
    others gather the units, concatenated along the elements in rank order.
    """
    if not is_distributed(group):
        return None if units is None else (units, lo, hi)
    dev = _device(group)
    has = units is not None
    U = units.shape[0] if has else 0
    E = units.shape[1] if has else 0
    bad = bool(has) and not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all())
    if getattr(obs, "step_stat", None) == "minmax":
        h = torch.tensor([U, int(has), int(bad)], dtype=torch.int64, device=dev)
        _all_reduce(h, dist.ReduceOp.MAX, group)
        U, any_has, any_bad = (int(v) for v in h)
        if not any_has:
            return None
        v = (torch.cat([-lo, hi]) if has else torch.full((2 * U,), float("-inf"))).to(dev)
        _all_reduce(v, dist.ReduceOp.MAX, group)
        ref = lo if has else obs.observed_tokens
        glo, ghi = (-v[:U]).to(ref.device), v[U:].to(ref.device)
        if any_bad:
            glo = glo + float("nan")
        return (units if has else glo.reshape(U, 1)), glo, ghi
    h = _all_gather(torch.tensor([U, E, int(has)], dtype=torch.int64, device=dev), group).cpu()
    if not bool(h[:, 2].any()):
        return None
    Us = h[:, 0][h[:, 2].bool()]
    if not bool((Us == Us[0]).all()):
        raise ValueError(f"sync: {obs._who()} got {Us.tolist()} units on different ranks in one "
                         f"step; sync_every_step needs the same units on every rank")
    U, Emax = int(Us[0]), int(h[:, 1].max())
    pad = torch.zeros(U, Emax, device=dev)
    if has:
        pad[:, :E] = units.to(dev)
    allu = _all_gather(pad, group)
    ref = units if has else obs.observed_tokens
    g = torch.cat([allu[r, :, :int(h[r, 1])] for r in range(len(h)) if int(h[r, 2])], dim=1)
    g = g.to(ref.device)
    from .stats.minmax import unit_minmax

    glo, ghi = unit_minmax(g)
    return g, glo, ghi


def empty_step(observers, group=None) -> None:
    """Take part in the step collectives of step-synced ``observers`` without data."""
    for obs in observers:
        if obs.sync_every_step:
            obs._step_empty(group)


# --------------------------------------------------------------------------- weights
def assign_by_size(sizes: dict[str, int], world: int | None = None, group=None) -> dict[str, int]:
    """Assign each named item to a rank, balancing the total size (largest first, to the
    least loaded rank; ties by name and lowest rank, so every rank computes the same)."""
    world = world_size(group) if world is None else world
    heap = [(0, r) for r in range(world)]
    out = {}
    for name, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        load, r = heapq.heappop(heap)
        out[name] = r
        heapq.heappush(heap, (load + int(size), r))
    return out


def gather_qparams(local: dict, group=None) -> dict:
    """Every rank's ``{name: QParams}`` merged on every rank (one object all_gather).

    Weight observation split across ranks (:func:`assign_by_size`): each rank computes
    the qparams of its share, this shares them. The qparams are small (one value per
    unit), so a pickled all_gather costs little next to the search itself.
    """
    if not is_distributed(group):
        return dict(local)
    moved = {k: v.to("cpu") for k, v in local.items()}
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, moved, group=group)
    merged = {}
    for part in out:
        merged.update(part)
    return merged


def weight_owners(model: torch.nn.Module, names=None, group=None) -> dict[str, int]:
    """``{module name: rank}`` for the modules with a ``weight`` (only those in ``names``, if
    given: the layers actually quantized), balanced by weight size.

    The same on every rank (depends only on the model). Each rank observes the weights
    it owns; :func:`sync_observers` then gives every rank the owner's state exactly (a
    state observed on one rank only reduces to that rank's values).
    """
    keep = None if names is None else set(names)
    sizes = {name: m.weight.numel() for name, m in model.named_modules()
             if isinstance(getattr(m, "weight", None), torch.Tensor)
             and (keep is None or name in keep)}
    return assign_by_size(sizes, group=group)


def gather_samples(samples: dict, limit: int, group=None) -> dict:
    """``{key: [row tensors]}`` of every rank, merged on every rank: per key, the rows of
    rank 0, then rank 1 ..., cut to ``limit`` rows. Every rank passes the same keys.

    Two tensor all_gathers (row counts and widths, then one flat float32 payload per rank),
    not pickled objects: activation samples are tens of MB and pickling them dominates.
    """
    if not is_distributed(group):
        return samples
    dev = _device(group)
    keys = list(samples)
    local = [torch.cat(samples[k]) if samples[k] else None for k in keys]
    head = torch.tensor([[0, 0] if t is None else [t.shape[0], t[0].numel()] for t in local],
                        dtype=torch.int64, device=dev).reshape(-1)
    heads = _all_gather(head, group).cpu().reshape(-1, len(keys), 2).tolist()  # [W, K, 2]
    sizes = [sum(n * w for n, w in h) for h in heads]
    payload = torch.zeros(max(sizes), dtype=torch.float32, device=dev)
    if sizes[dist.get_rank(group)]:
        flat = torch.cat([t.reshape(-1).float() for t in local if t is not None])
        payload[:flat.numel()] = flat.to(dev)
    allp = _all_gather(payload, group)
    merged = {}
    offsets = [0] * len(heads)
    for i, k in enumerate(keys):
        parts = []
        for r, h in enumerate(heads):
            n, w = h[i]
            if n:
                parts.append(allp[r, offsets[r]:offsets[r] + n * w].reshape(n, w))
                offsets[r] += n * w
        like = local[i]
        if parts:
            rows = torch.cat(parts)[:limit]
            if like is not None:
                rows = rows.to(device=like.device, dtype=like.dtype).reshape(-1,
                                                                            *like.shape[1:])
            merged[k] = [rows.clone()]
        else:
            merged[k] = []
    return merged


def gather_failures(local: dict, group=None) -> dict:
    """Union over the ranks of ``{key: {observer key: error}}``, so that every rank drops
    the same candidates (a weight candidate may fail on its owner rank only)."""
    if not is_distributed(group):
        return local
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, local, group=group)
    merged: dict = {}
    for part in out:
        for k, v in part.items():
            merged.setdefault(k, {}).update(v)
    return merged
