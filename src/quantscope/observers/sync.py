"""The sync of observers' state across processes (see :mod:`quantscope.distributed`).

Each observer declares how its buffers reduce in
:meth:`~quantscope.observers.Observer.sync_plan` (``{buffer: MIN | MAX | SUM | AVG}`` from
:mod:`quantscope.comm`, or a :class:`~quantscope.comm.CustomSync` such as
:class:`~quantscope.stats.histogram_sync.HistogramSync`); :func:`sync_observers` then syncs
any number of observers in a handful of collectives, and :func:`step_sync` exchanges one
step's statistic in ``sync_every_step`` mode. The protocol is described in
:mod:`quantscope.distributed`.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch
import torch.distributed as dist

from ..comm import (
    AVG,
    MIN,
    SUM,
    CustomSync,
    LocalError,
    Op,
    all_gather,
    all_reduce,
    group_device,
    is_distributed,
    raise_on_all,
    reset_stats,
)
from . import record

__all__ = ["empty_step", "step_sync", "sync_observers"]

_MAXD = 8  # dims recorded per shape in the header
_COUNTERS = ("observed_tokens", "non_finite_count")  # the base's counters: always summed
# an observer's state since its last sync on this rank (the header carries it)
_FRESH, _SYNCED, _OBSERVED_SINCE = 0, 1, 2
_FAILED = 1 << 32  # in the plan check: the local part failed here (above any crc32)
# the tagged exchanges (:func:`_tagged_max`): what a rank is in, so that a peer in another
# (sync_every_step set on some ranks only) raises on both, where it paired them and hung
_PLANS, _STEP_RANGE, _STEP_UNITS = 1, 2, 3
_IN = {_PLANS: "syncs observers (sync())", _STEP_RANGE: "exchanges a min-max step",
       _STEP_UNITS: "exchanges a step's units"}


def _plan(obs) -> list:
    """The observer's declared plan as ``[(name, Op) | CustomSync]``."""
    declared = getattr(obs, "sync_plan", None)  # None: no quantscope Observer (torch.ao's)
    try:
        if declared is None:
            raise NotImplementedError
        plan = declared()
    except NotImplementedError:
        if declared is not None and _declares_plan(obs):
            raise  # the observer's own reason (e.g. grid='first' histograms)
        raise NotImplementedError(
            f"{type(obs).__name__}: the observer does not declare how its state syncs "
            f"across processes; implement sync_plan() (formerly _sync_plan) returning "
            f"{{buffer: MIN|MAX|SUM|AVG}}"
            + ("" if declared is not None else " (it is no quantscope Observer: those and "
               "torch.ao's min-max ones of quantscope.compat.torch_ao sync)")
        ) from None
    items = list(plan.items()) if isinstance(plan, dict) else list(plan)
    for it in items:
        if not (isinstance(it, CustomSync)
                or (isinstance(it, tuple) and len(it) == 2 and isinstance(it[1], Op))):
            raise TypeError(f"{type(obs).__name__}.sync_plan(): expected (buffer, Op) pairs "
                            f"or CustomSync objects, got {it!r}")
    return items


def _declares_plan(obs) -> bool:
    """Whether the observer's class overrides :meth:`Observer.sync_plan` (told by name:
    base imports this module, which cannot import it back)."""
    f = getattr(type(obs), "sync_plan", None)
    return (getattr(f, "__module__", None), getattr(f, "__qualname__", None)) \
        != (f"{__package__}.base", "Observer.sync_plan")


def _names(plan) -> list[str]:
    """Every buffer a plan touches, in plan order (their shapes go in the header)."""
    out = []
    for it in plan:
        out += list(it.names) if isinstance(it, CustomSync) else [it[0]]
    return out


def _encode_shape(shape, obs, what: str) -> list[int]:
    shape = tuple(shape)
    if len(shape) > _MAXD:
        raise ValueError(f"sync: {obs.describe()}: {what} has {len(shape)} dims; distributed "
                         f"sync takes at most {_MAXD}")
    return [len(shape), *shape, *([0] * (_MAXD - len(shape)))]


def _decode_shape(row) -> tuple[int, ...]:
    return tuple(int(v) for v in row[1:1 + int(row[0])])


def _signature(observers, plans) -> str:
    """What every rank must agree on, per observer: its class, spec and bins (they give the
    state its meaning: a histogram of |x| or of x, a format's range) and its plan, each
    buffer with its reduction and each custom sync with its settings (``absolute``)."""
    def item(it):
        if isinstance(it, CustomSync):  # its plain settings (no object reprs: ids differ)
            return type(it).__name__, tuple(it.names), sorted(
                (k, v) for k, v in vars(it).items() if isinstance(v, (bool, int, float, str)))
        return it[0], it[1].value

    return repr([(type(o).__name__, str(getattr(o, "spec", None)), getattr(o, "bins", None),
                  [item(it) for it in p]) for o, p in zip(observers, plans)])


def _tagged_max(tag: int, values: list[int], dev, group, obs=None) -> list[int]:
    """MAX all_reduce of ``[tag, -tag, *values]``: 4 values in every tagged exchange (gloo
    aborts on other lengths); a peer in another exchange raises on every rank (``obs``: the
    step-synced observer here; None: this rank syncs)."""
    t = torch.tensor([tag, -tag, *values], dtype=torch.int64, device=dev)
    all_reduce(t, dist.ReduceOp.MAX, group)
    top, low, *out = t.tolist()
    if top != -low:
        here = "this rank" if obs is None else obs.describe()
        what = (f"{here} {_IN[tag]} while another rank "
                f"{_IN[-low if top == tag else top]}")
        if -low == _PLANS:
            raise ValueError(f"sync: sync_every_step set on some ranks only, or stepped apart: "
                             f"{what}; set it and step it alike on every rank")
        raise ValueError(f"sync: the ranks step different observers: {what}; every rank must "
                         f"call the same step-synced observers in the same order")
    return out


def _check_same_plans(observers, plans, local: LocalError, dev, group) -> None:
    """One tiny all_reduce: every rank must sync the same observers with the same plans
    (else the header all_gather would mismatch); a difference raises on every rank. It also
    carries whether the local part (``local``: plans, header) failed on a rank: then every
    rank raises that error (:func:`~quantscope.comm.raise_on_all`), no rank waits."""
    failed = local.error is not None
    sigs = [] if failed else [zlib.crc32(_signature([o], [p]).encode())
                              for o, p in zip(observers, plans)]
    sig = _FAILED if failed else zlib.crc32(repr(sigs).encode())
    n = len(observers)
    most, least, top, low = _tagged_max(_PLANS, [n, -n, sig, -sig], dev, group)
    raise_on_all(local.error, top >= _FAILED, "sync", group, same_type=True)
    if most != -least:
        raise ValueError(f"sync: the ranks sync different observers ({n} here, "
                         f"between {-least} and {most} on the ranks); every rank must "
                         f"pass the same observers in the same order")
    if top != -low:  # every rank is here: one more exchange names the first that differs
        got = all_gather(torch.tensor(sigs, dtype=torch.int64, device=dev), group)
        i = int((got != got[0]).any(0).nonzero()[0])
        raise ValueError(f"sync: the ranks sync different observers: the first that differs, "
                         f"#{i} of {n} ({observers[i].describe()} here), has another class, "
                         f"spec, bins or sync plan on some rank; every rank must pass the same "
                         f"observers, configured alike, in the same order")


# ------------------------------------------------------------------------ full sync
def sync_observers(observers: Iterable, group=None) -> None:
    """Make the state of ``observers`` the same on every rank, as if one process saw it all.

    Every rank must call it with the same observers, in the same order (e.g.
    ``session.observers()`` of the same model and recipe). Collectives: a tiny check that
    they do, one ``all_gather`` of headers, one ``all_reduce`` of histogram grids if there
    are histograms, and one ``all_reduce`` per (reduction, dtype) bucket (usually 2-3).

    Syncing again is safe: an observer no rank has updated since its last sync is left
    alone, and one observed further counts only what each rank added since (min / max are
    idempotent; the counters sum the ranks' increments). A histogram (or a plan's SUM
    state) observed after its sync raises: its counts would be counted once per rank (sync
    once, after the last batch).

    An error of the local part on one rank (a plan, e.g. a histogram folding its last
    batches into its average; a header) raises on every rank: the failing rank its own, the
    others the same exception type and message, naming the failing ranks.
    """
    observers = list(observers)
    reset_stats()
    if not is_distributed(group):
        return
    dev = group_device(group)
    plans = header = None
    with LocalError() as local:  # local steps: an error on one rank raises on every rank
        observers = [o._sync_view() if hasattr(o, "_sync_view") else o for o in observers]
        plans = [_plan(o) for o in observers]
        header = _header(observers, plans, dev)
    # even with no observers here: a peer that has some waits in this check
    _check_same_plans(observers, plans, local, dev, group)
    if not observers:  # none on any rank (the check passed)
        return
    allh = all_gather(header, group).cpu().tolist()  # plain Python: cheap decisions
    me = dist.get_rank(group)
    work = _decide(observers, plans, allh, me)
    extra = _sync_customs(work, dev, group)
    _reduce_buckets(_buckets(work, extra, me), dev, group)
    for obs, *_ in work:
        _mark_synced(obs)
        getattr(obs, "write_back", lambda: None)()  # a torch.ao observer's view: into its buffers


def _mark_synced(obs) -> None:
    """Remember the counters every rank now holds: a later sync tells from them whether the
    observer saw data since (any batch adds tokens; reset() forgets the mark, a saved
    state keeps it: :func:`synced_record`), and sums only each rank's increments on top."""
    obs._synced = {n: getattr(obs, n).clone() for n in _COUNTERS}


def synced_record(obs) -> dict:
    """The mark of :func:`_mark_synced` as an entry of the saved state's record: a state
    loaded from it on every rank is the same synced state there, as after the sync itself,
    so a later sync adds only what each rank observed since (not the state once per rank)."""
    mark = obs._synced
    return {} if mark is None else {"synced": [int(mark[n]) for n in _COUNTERS]}


def loaded_mark(obs, state_dict, prefix) -> dict | None:
    """The sync mark of a state being loaded (None: it was not synced; then it is this
    rank's own)."""
    saved = record.decode(state_dict.get(prefix + record.RECORD), obs.describe()) or {}
    mark = saved.get("synced")
    if mark is None:
        return None
    if not (isinstance(mark, list) and len(mark) == len(_COUNTERS)
            and all(type(v) is int for v in mark)):
        raise ValueError(f"{obs.describe()}: the state's record has a damaged sync mark")
    return {n: torch.tensor(v, dtype=torch.int64, device=getattr(obs, n).device)
            for n, v in zip(_COUNTERS, mark)}


def _header(observers, plans, dev) -> torch.Tensor:
    """1. this rank's header, all_gathered: ``[has_observed, seen_non_finite, step_synced,
    state since the last sync, last shape, shape per buffer]`` per observer; int64."""
    rows, at, since = [], [], []
    for obs, plan in zip(observers, plans):
        seen = obs.has_observed
        if obs._synced is not None:  # 1 + whether it counted tokens since: set on the device
            at.append(len(rows) + 3)
            since.append(obs.observed_tokens.ne(obs._synced["observed_tokens"]).to(dev))
        rows += [int(seen), int(bool(obs.seen_non_finite)), int(obs.sync_every_step), _FRESH]
        rows += _encode_shape(obs.shape if seen else (), obs, "the tensor observed last")
        for name in _names(plan):
            rows += _encode_shape(getattr(obs, name).shape if seen else (), obs, repr(name))
    header = torch.tensor(rows, dtype=torch.int64, device=dev)
    if at:
        header[at] = torch.stack(since).to(torch.int64) + _SYNCED
    return header


def _decide(observers, plans, allh, me) -> list[tuple]:
    """2. decisions from the headers, identical on every rank (so errors are too): fills
    the state of a rank that saw nothing with each reduction's identity; returns
    ``[(obs, plan, observed_locally, n_observed, step_synced, again)]`` of the observers to
    sync (``again``: synced before, so the counters sum only the increments since)."""
    pos = 0
    work = []
    for obs, plan in zip(observers, plans):
        pos, item = _decide_one(obs, plan, allh, pos, me)
        if item is not None:
            work.append(item)
    return work


def _decide_one(obs, plan, allh, pos, me):
    seen_r = [row[pos] for row in allh]
    nonfinite = any(row[pos + 1] for row in allh)
    steps = [row[pos + 2] for row in allh]
    states = {row[pos + 3] for row in allh}
    step_synced = any(steps)
    if step_synced and not all(steps):
        raise ValueError(f"sync: {obs.describe()} has sync_every_step set on some ranks only")
    again = _again(obs, plan, states, step_synced)
    seen_ranks = [r for r, v in enumerate(seen_r) if v]
    shape = _decode_shape(allh[seen_ranks[-1]][pos + 4:]) if seen_ranks else None
    pos += 4 + 1 + _MAXD
    shapes = {}
    for name in _names(plan):
        block = [allh[r][pos:pos + 1 + _MAXD] for r in seen_ranks]
        pos += 1 + _MAXD
        if any(b != block[0] for b in block):
            got = [_decode_shape(b) for b in block]
            raise ValueError(
                f"sync: {obs.describe()} has state {name!r} of different shapes on different "
                f"ranks ({got}); the layout must give the same units on every rank")
        if block:
            shapes[name] = _decode_shape(block[0])
    n_seen = len(seen_ranks)
    if nonfinite:
        obs.seen_non_finite = torch.ones_like(obs.seen_non_finite)
    if n_seen == 0 or states == {_SYNCED}:  # nothing anywhere, or already the same everywhere
        return pos, None
    observed = bool(seen_r[me])
    if not observed and not step_synced:  # agreed shapes, filled with the identity
        _fill_identity(obs, plan, shapes)
    obs.set_shape(shape)
    return pos, (obs, plan, observed, n_seen, step_synced, again)


def _again(obs, plan, states, step_synced) -> bool:
    """Whether this is a sync after an earlier one (every rank holds the same synced state,
    plus what it observed since); raises where that cannot be reduced exactly."""
    if _FRESH not in states:
        summed = ["histogram counts" if isinstance(it, CustomSync) else f"SUM state {it[0]!r}"
                  for it in plan if isinstance(it, CustomSync) or it[1] is SUM]
        if not step_synced and summed and _OBSERVED_SINCE in states:
            raise ValueError(
                f"sync: {obs.describe()} was observed after its last sync; its "
                f"{', '.join(summed)} would be counted once per rank. Sync once, after the last "
                f"batch (or reset() the observer on every rank and observe again)")
        return True
    if states != {_FRESH}:
        raise ValueError(f"sync: {obs.describe()} was reset or loaded on some ranks only since "
                         f"its last sync; reset (or load) it on every rank")
    return False


def _fill_identity(obs, plan, shapes) -> None:
    for it in plan:
        if isinstance(it, CustomSync):
            it.empty(obs, shapes)
            continue
        buf = getattr(obs, it[0])
        setattr(obs, it[0], torch.full(shapes[it[0]], it[1].identity(buf.dtype),
                                       dtype=buf.dtype, device=buf.device))


def _sync_customs(work, dev, group) -> dict[int, list]:
    """3. custom syncs (histograms): agree on the grid in one MAX all_reduce, re-bin
    exactly; returns ``{id(obs): [(buffer, Op)]}`` of the buffers that now reduce plainly."""
    groups: dict = {}  # same-kind customs are handled together (one batched re-bin)
    for obs, plan, _, _, step, _ in work:
        for it in plan:
            if isinstance(it, CustomSync) and not step:
                groups.setdefault(it.batch_key(obs), []).append((obs, it))
    extra: dict[int, list] = {}
    if not groups:
        return extra
    grids = [[g.to(torch.float64).reshape(-1) for g in type(pairs[0][1]).grid_many(pairs)]
             for pairs in groups.values()]
    sizes = [len(g) for gl in grids for g in gl]
    flat = torch.cat([g for gl in grids for g in gl]).to(dev)
    all_reduce(flat, dist.ReduceOp.MAX, group)
    parts = iter(flat.split(sizes))
    for pairs, gl in zip(groups.values(), grids):
        done = type(pairs[0][1]).rebin_many(pairs, [next(parts) for _ in gl])
        for (obs, _), ops in zip(pairs, done):
            extra.setdefault(id(obs), []).extend(ops.items())
    return extra


def _buckets(work, extra, me) -> dict[tuple, list]:
    """4. ``(reduction, dtype) -> [(obs, name, op, n_seen, observed, base)]``: MIN folds
    into MAX (:func:`_reversed`), AVG into SUM; the base's counters always sum. ``base``: the synced
    value a rank other than 0 takes off its counter in a sync after an earlier one."""
    buckets: dict[tuple, list] = {}

    def add(obs, name, op, n_seen, observed, base=None):
        buf = getattr(obs, name)
        red = dist.ReduceOp.SUM if op in (SUM, AVG) else dist.ReduceOp.MAX
        dtype = torch.uint8 if buf.dtype == torch.bool else buf.dtype
        buckets.setdefault((red, dtype), []).append((obs, name, op, n_seen, observed, base))

    for obs, plan, observed, n_seen, step, again in work:
        for name in _COUNTERS:
            base = obs._synced[name] if again and me else None
            add(obs, name, SUM, n_seen, observed, base)
        if step:  # the state is already global after every step
            continue
        for it in plan:
            if not isinstance(it, CustomSync):
                add(obs, *it, n_seen, observed)
        for name, op in extra.get(id(obs), ()):
            add(obs, name, op, n_seen, observed)
    return buckets


def _reduce_buckets(buckets, dev, group) -> None:
    """5. one all_reduce per bucket of flattened, concatenated buffers."""
    for (red, dtype), entries in buckets.items():
        parts = []
        for obs, name, op, n_seen, observed, base in entries:
            v = getattr(obs, name).detach().reshape(-1).to(dtype)
            if base is not None:
                v = v - base.reshape(-1).to(v)
            if op is MIN:
                v = _reversed(v)
            elif op is AVG and not observed:
                v = torch.zeros_like(v)
            parts.append(v)
        flat = torch.cat(parts).to(dev)
        all_reduce(flat, red, group)
        flat = flat.to(parts[0].device)  # a bucket holds at least one entry
        for (obs, name, op, n_seen, *_), v in zip(entries,
                                                  flat.split([p.numel() for p in parts])):
            if op is MIN:
                v = _reversed(v)
            elif op is AVG:
                v = v / n_seen
            buf = getattr(obs, name)  # a new tensor, not copy_: buffers may be inference tensors
            setattr(obs, name, v.reshape(buf.shape).to(device=buf.device, dtype=buf.dtype,
                                                        copy=True))


def _reversed(v: torch.Tensor) -> torch.Tensor:
    """An exact order-reversing map, its own inverse (MIN as MAX): ``-v`` for floats, ``~v``
    for integers (``-v`` overflows at int8's -128, and wraps 0 / 1 of bools as uint8)."""
    return -v if v.is_floating_point() else ~v


def step_sync(obs, units, lo, hi, group=None):
    """Exchange one step's statistic of ``obs`` (called by ``Observer.forward`` in
    ``sync_every_step`` mode); ``lo`` None: this rank has no data this step (``units`` is
    also None where forward took ``lo`` / ``hi`` straight from the tensor: min-max).

    Returns the global ``(units, lo, hi)`` of the step, or None when no rank had data.
    Observers whose step statistic is the range (``step_sync_range_only = True``:
    min-max) exchange only ``lo`` / ``hi``; the
    others gather the units, concatenated along the elements in rank order.
    """
    if not is_distributed(group):
        return None if lo is None else (units, lo, hi)
    dev = group_device(group)
    has = lo is not None
    U = lo.shape[0] if has else 0
    E = units.shape[1] if units is not None else 0
    bad = bool(has) and not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all())
    if getattr(obs, "step_sync_range_only", False):
        # the largest and (negated) smallest unit count of the ranks with data: vectors of
        # other lengths would abort the backend's reduction (gloo: SIGABRT), not raise
        U, least, any_has, any_bad = _tagged_max(
            _STEP_RANGE, [U, -U if has else -(1 << 62), int(has), int(bad)], dev, group, obs)
        if not any_has:
            return None
        _same_units(obs, U, -least)
        v = (torch.cat([-lo, hi]) if has else  # no data: float32, as the others' lo / hi
             torch.full((2 * U,), float("-inf"), dtype=torch.float32)).to(dev)
        all_reduce(v, dist.ReduceOp.MAX, group)
        ref = lo if has else obs.observed_tokens
        glo, ghi = (-v[:U]).to(ref.device), v[U:].to(ref.device)
        if any_bad:
            glo = glo + float("nan")
        return (units if has else glo.reshape(U, 1)), glo, ghi
    return _gather_step(obs, units, lo, hi, (U, E, has), dev, group)


def _gather_step(obs, units, lo, hi, sizes, dev, group):
    """:func:`step_sync` of observers that read the units: gathers every rank's units,
    concatenated along the elements in rank order, and the step's per-unit lo / hi."""
    U, E, has = sizes
    U, least, any_has, Emax = _tagged_max(
        _STEP_UNITS, [U, -U if has else -(1 << 62), int(has), E], dev, group, obs)
    if not any_has:
        return None
    _same_units(obs, U, -least)
    # each rank's lo / hi and padding-zero count go with its units: only the rank knows its
    # padding (from its shape), and an observer to which padding is no data (histograms:
    # ``_step_zeros``) took it out of lo / hi already; the gathered units cannot tell.
    # The tail: whether it has data and its E (24 bits a slot: exact), to cut its padding
    W = 3 + Emax
    flat = torch.zeros(U * W + 3, dtype=torch.float32, device=dev)  # 24-bit slots: exact
    if has:
        zeros = getattr(obs, "_step_zeros", None)
        pad = flat[:-3].view(U, W)
        pad[:, 0], pad[:, 1] = lo.to(dev), hi.to(dev)
        pad[:, 2] = 0 if zeros is None else zeros.to(dev)
        pad[:, 3:3 + E] = units.to(dev)
        flat[-3:] = torch.tensor([1, E >> 24, E & 0xFFFFFF])
    ref = units if has else obs.observed_tokens
    allf = all_gather(flat, group)
    tails = [[int(v) for v in t] for t in allf[:, -3:].tolist()]  # one device read
    fed = [r for r, t in enumerate(tails) if t[0]]
    allu = allf[fed, :-3].reshape(len(fed), U, W).to(ref.device)
    g = torch.cat([allu[i, :, 3:3 + (tails[r][1] << 24) + tails[r][2]]
                   for i, r in enumerate(fed)], dim=1)
    if hasattr(obs, "_step_zeros"):  # every rank's padding zeros, for the histogram to drop
        obs._step_zeros = allu[:, :, 2].sum(0).to(torch.int64)
    return g, allu[:, :, 0].amin(0), allu[:, :, 1].amax(0)


def _same_units(obs, most: int, least: int) -> None:
    """Raise (on every rank: each read the same exchange) unless the ranks with data this
    step had one unit count."""
    if most != least:
        raise ValueError(f"sync: {obs.describe()} got between {least} and {most} units on "
                         f"different ranks in one step; sync_every_step needs the same units "
                         f"on every rank")


def empty_step(observers, group=None) -> None:
    """Take part in the step collectives of step-synced ``observers`` without data."""
    for obs in observers:
        if obs.sync_every_step:
            obs.step_empty(group)

