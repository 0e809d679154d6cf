"""Calibration's cross-process gathers: weight ownership, activation samples, failures.

Used by :mod:`quantscope.calibration.run.session` when calibration runs data-parallel: weights
are observed once, on the rank that owns them (:func:`weight_owners`), and the samples
and failed candidates of every rank are merged so that every rank decides alike. Outside
a process group every function returns its input. Re-exported by
:mod:`quantscope.distributed`.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ...comm import LocalError, all_gather, group_device, is_distributed, raise_on_all, world_size
from ..structure.fingerprint import digest, fingerprint, fingerprint_text
from .batches import tensors_in

__all__ = ["RankPieces", "assign_by_size", "check_same_slots", "check_same_weights",
           "gather_failures", "gather_parts", "gather_qparams", "gather_samples",
           "share_pieces", "weight_owners"]


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
    it owns; :func:`~quantscope.observers.sync.sync_observers` then gives every rank the
    owner's state exactly (a state observed on one rank only reduces to that rank's values).
    """
    keep = None if names is None else set(names)
    sizes = {name: m.weight.numel() for name, m in model.named_modules()
             if isinstance(getattr(m, "weight", None), torch.Tensor)
             and (keep is None or name in keep)}
    return assign_by_size(sizes, group=group)


#: the dtypes a sample's rows travel back to, by code (float32 for any other)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _dtype_code(t: torch.Tensor | None) -> int:
    return _DTYPES.index(t.dtype) if t is not None and t.dtype in _DTYPES else 0


def gather_samples(samples: dict, limit: int, group=None) -> dict:
    """``{key: [row tensors]}`` of every rank, merged on every rank: per key, the rows of
    rank 0, then rank 1 ..., cut to ``limit`` rows, in the dtype of the first rank that has
    rows (a rank without rows of its own casts them alike, so every rank scores the same
    values). Every rank passes the same keys (in any order), each key's rows of one width
    on every rank; else a ``ValueError`` on every rank (before the payload's exchange, whose
    sizes would differ: gloo aborts the process there).

    Two tensor all_gathers (row counts, widths and dtypes, then one flat payload per rank),
    not pickled objects: activation samples are tens of MB and pickling them dominates. The
    payload is float32 (exact for float32, bfloat16 and float16 rows), float64 where any
    rank has float64 rows: those come back as sent, not rounded (or beyond float32's range
    made inf).
    """
    if not is_distributed(group):
        return samples
    dev = group_device(group)
    keys = sorted(samples, key=repr)  # one order on every rank, whatever each dict's
    heads, local = _sample_heads(samples, keys, dev, group)
    sizes = [sum(n * w for n, w, _ in h) for h in heads]
    wide = any(_DTYPES[c] == torch.float64 for h in heads for n, _, c in h if n)
    kind = torch.float64 if wide else torch.float32  # the same on every rank (from heads)
    payload = torch.zeros(max(sizes), dtype=kind, device=dev)
    if sizes[dist.get_rank(group)]:
        flat = torch.cat([t.reshape(-1).to(kind) for t in local if t is not None])
        payload[:flat.numel()] = flat.to(dev)
    allp = all_gather(payload, group)
    merged = {}
    offsets = [0] * len(heads)
    for i, k in enumerate(keys):
        parts, dtype = [], None
        for r, h in enumerate(heads):
            n, w, code = h[i]
            if n:
                parts.append(allp[r, offsets[r]:offsets[r] + n * w].reshape(n, w))
                offsets[r] += n * w
                dtype = _DTYPES[code] if dtype is None else dtype
        like = local[i]
        if parts:
            rows = torch.cat(parts)[:limit].to(dtype)
            if like is not None:
                rows = rows.to(like.device).reshape(-1, *like.shape[1:])
            merged[k] = [rows.clone()]
        else:
            merged[k] = []
    return {k: merged[k] for k in samples}


def _sample_heads(samples: dict, keys: list, dev, group) -> tuple[list, list]:
    """Every rank's ``[K, 3]`` rows, widths and dtype codes of ``samples`` (``keys`` in one
    order), and this rank's rows of each key in one tensor (or None), after one exchange of
    each rank's key count and fingerprint: different keys, or a key whose rows differ in
    width here or across the ranks, raise on every rank."""
    widths = [{math.prod(t.shape[1:]) for t in samples[k]} for k in keys]
    mine = [len(keys), zlib.crc32(repr(keys).encode()), int(any(len(w) > 1 for w in widths))]
    marks = all_gather(torch.tensor(mine, dtype=torch.int64, device=dev), group)
    marks = marks.cpu().reshape(-1, 3).tolist()
    if any(m[:2] != marks[0][:2] for m in marks):
        raise ValueError(f"gather_samples: the ranks pass different keys ({[m[0] for m in marks]} "
                         f"keys by rank); every rank must pass the same keys")
    if any(m[2] for m in marks):
        raise ValueError(f"gather_samples: rank(s) {[r for r, m in enumerate(marks) if m[2]]} "
                         f"hold rows of different widths under one key; a key's rows must be "
                         f"of one width")
    local = [torch.cat(samples[k]) if samples[k] else None for k in keys]
    head = torch.tensor([[0, 0, 0] if t is None or not t.shape[0] else
                         [t.shape[0], t[0].numel(), _dtype_code(t)] for t in local],
                        dtype=torch.int64, device=dev).reshape(-1)
    heads = all_gather(head, group).cpu().reshape(-1, len(keys), 3).tolist()  # [W, K, 3]
    for i, k in enumerate(keys):
        across = sorted({h[i][1] for h in heads if h[i][0]})
        if len(across) > 1:
            raise ValueError(f"gather_samples: key {k!r} holds rows of widths {across} on "
                             f"different ranks; a key's rows must be of one width")
    return heads, local


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


def check_same_slots(keys, group=None) -> None:
    """Raise the same ``ValueError`` on every rank unless every rank plans the same
    ``(layer, role)`` keys (their recipes match the same layers): the later exchanges pair
    the ranks' slots key by key. One tiny all_gather; names the first differing key."""
    if not is_distributed(group):
        return
    keys = sorted(keys)
    crc = zlib.crc32(repr(keys).encode())
    got = all_gather(torch.tensor([crc, len(keys)], dtype=torch.int64,
                                  device=group_device(group)), group).cpu()
    if bool((got == got[0]).all()):
        return
    every: list = [None] * world_size(group)  # only on a mismatch: name the difference
    dist.all_gather_object(every, keys, group=group)
    sets = [set(k) for k in every]
    odd = min(set().union(*sets) - set.intersection(*sets), default=None)
    which = [r for r, k in enumerate(sets) if odd in k]
    raise ValueError(f"calibrate: the ranks' recipes match different layers (layer {odd[0]!r} "
                     f"{odd[1]} is planned on rank(s) {which} only; slots per rank "
                     f"{[len(k) for k in every]}); every rank must calibrate the same model "
                     f"with the same recipes" if odd else
                     "calibrate: the ranks' recipes match different layers")


#: the options that decide a distributed calibration's exchanges or its result, which every
#: rank must give alike (the group, the device, progress and the sampling seed may differ)
AGREED = ("sampling.tokens", "sampling.budget_mb", "auto.candidates", "auto.metric",
          "auto.loss", "auto.score_tokens", "moe.all_experts", "moe.min_tokens",
          "outliers.smooth", "outliers.keep_float", "outliers.fallback", "runtime.missing",
          "runtime.time_groups")


def check_same_options(opts, group=None, recipes=None) -> None:
    """Raise the same ``ValueError`` on every rank unless every rank gives the same
    :data:`AGREED` options (``opts``: the call's ``Options``) and ``recipes`` (``{label:
    Recipe}``, by their ``to_dict``: an observer's option on one rank, a percentile, gave the
    ranks different or mixed results): one rank scoring auto on the model's output, or
    smoothing, runs exchanges the others do not (gloo then aborts or waits out its timeout);
    keep_float or the sample size on one rank gives the ranks different results. A loss
    counts by whether it is given. One tiny all_gather; names the first option that
    differs, with each rank's value."""
    if not is_distributed(group):
        return
    values, given = {}, {}  # compared; as given (the message's text)
    if recipes is not None:
        values["the recipe (by label)"] = tuple(recipes)
        given["the recipe (by label)"] = repr(tuple(recipes))
    for label, recipe in (recipes or {}).items():  # leaf by leaf: the message names one
        for where, v in _leaves(recipe.to_dict(), f"recipe {label!r}: "):
            plain = v is None or isinstance(v, (str, int, float, list, tuple, torch.Tensor))
            values[where] = _canonical(v) if plain else repr(v)
            given[where] = (f"a tensor {list(v.shape)} of fingerprint {values[where][2]}"
                            if isinstance(v, torch.Tensor) else repr(v))
    for path in AGREED:
        kind, name = path.split(".")
        v = getattr(getattr(opts, kind), name)
        key = f"{type(getattr(opts, kind)).__name__}.{name}"
        values[key] = v is not None if name == "loss" else _canonical(v)
        given[key] = repr(values[key] if name == "loss" else v)
    crc = zlib.crc32(repr(values).encode())
    got = all_gather(torch.tensor([crc], dtype=torch.int64, device=group_device(group)),
                     group).cpu()
    if bool((got == got[0]).all()):
        return
    every: list = [None] * world_size(group)  # only on a mismatch: name the difference
    dist.all_gather_object(every, (values, given), group=group)
    keys = dict.fromkeys(k for e in every for k in e[0])  # (recipes: not on every rank)
    odd = next((k for k in keys if any(e[0].get(k, _ABSENT) != every[0][0].get(k, _ABSENT)
                                       for e in every)), None)
    if odd is None:  # (a value whose repr is not canonical: equal, let it pass)
        return
    said = (f"{e[1].get(odd, 'absent')} on rank {r}" for r, e in enumerate(every))
    raise ValueError(f"calibrate: the ranks give different options: {odd} is "
                     f"{', '.join(said)}; "
                     f"every rank of a distributed calibration must give the same options "
                     f"(they decide its exchanges and its result)")


def _canonical(v):
    """``v`` in one form for equal values on every rank: a mapping's items sorted, and the
    members of its collections (``time_groups``' labels, given as a set: string hashing, so
    a set's order, differs between processes), sequences as tuples, numbers as floats (``64``
    and ``64.0`` are the same budget), a tensor by its dtype, shape and values (its repr
    rounds them and elides the middle of a large one, and names its device)."""
    if isinstance(v, torch.Tensor):
        return "tensor", tuple(v.shape), fingerprint(v)
    if isinstance(v, Mapping):
        return tuple(sorted((str(k), tuple(sorted(map(repr, x))) if isinstance(
            x, (list, tuple, set, frozenset)) else _canonical(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(map(_canonical, v))
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return v


_ABSENT = "(absent)"  # a recipe's leaf one rank's recipe lacks


def _leaves(v, path: str):
    """``(path, value)`` of each field of a recipe's ``to_dict``, in its order (a rule's place
    decides what it matches): ``rules[0].input.options.percentile``; a list of plain values
    (``ignore``, ``targets``) is one; an empty mapping none (``options={}`` is no option, so
    a rank giving one names it: ``options.percentile is absent on rank 0``)."""
    if isinstance(v, Mapping):
        for k, x in v.items():
            yield from _leaves(x, f"{path}.{k}" if path[-1:] != " " else f"{path}{k}")
    elif isinstance(v, (list, tuple)) and any(isinstance(x, Mapping) for x in v):
        for i, x in enumerate(v):
            yield from _leaves(x, f"{path}[{i}]")
    else:
        yield path, v


def check_same_weights(weights: dict, group=None) -> None:
    """Raise the same ``ValueError`` on every rank unless every rank holds the same weights
    (``{layer: tensor}``, the same layers everywhere: :func:`check_same_slots`): each weight
    is observed on its owner rank only (:func:`weight_owners`), so ranks holding different
    checkpoints (or dtypes) would get a silent mix. One all_gather of each weight's exact
    digest of its bits (:func:`~..structure.fingerprint.digest`, reduced where the weight
    lives), size and dtype: the ranks must agree bit for bit. Names the first differing
    layer. A rank whose own part fails raises there, the others the same error naming it
    (no rank left waiting). Cost: docs/guide/distributed.md."""
    if not is_distributed(group) or not weights:
        return
    dev = group_device(group)
    names = sorted(weights)
    got = torch.zeros(len(names), 5, dtype=torch.int64, device=dev)
    got[:, 4] = 1  # failed here, unless the local part below completes
    with LocalError() as local:
        got = torch.cat([_summaries([weights[n] for n in names], dev),
                         torch.zeros(len(names), 1, dtype=torch.int64, device=dev)], 1)
    got = all_gather(got, group).cpu()  # [W, L, 5]
    raise_on_all(local.error, bool(got[:, :, 4].any()), "calibrate's weight check", group,
                 same_type=True)
    bad = (got[:, :, :4] != got[0, :, :4]).any(-1)
    if not bool(bad.any()):
        return
    i = int(bad.any(0).nonzero()[0])  # the first layer (by name) that differs, and where
    rank = int(bad[:, i].nonzero()[0])
    dtypes = ["other", *[str(d).removeprefix("torch.") for d in _DTYPES]]
    say = [f"{fingerprint_text(dtypes[int(got[r, i, 3])], got[r, i, :2].tolist())} "
           f"({int(got[r, i, 2])} values)" for r in (0, rank)]
    raise ValueError(f"calibrate: the ranks hold different weights: layer {names[i]!r} is "
                     f"{say[0]} on rank 0 but {say[1]} on rank {rank}; every rank must load "
                     f"the same checkpoint in the same dtype (each weight is observed on one "
                     f"rank only and shared)")


def _summaries(ws: list[torch.Tensor], dev) -> torch.Tensor:
    """``[L, 4]`` int64 on ``dev``: each weight's digest (two sums), size and dtype code."""
    sums = torch.stack([digest(w).to(dev) for w in ws])
    meta = torch.tensor([[w.numel(), _DTYPES.index(w.dtype) + 1 if w.dtype in _DTYPES else 0]
                         for w in ws], dtype=torch.int64, device=dev)
    return torch.cat([sums, meta], 1)


class RankPieces:
    """``auto``'s model-level scoring across ranks that score different pieces (each passed
    its own batches): piece ``k`` is every rank's piece ``k`` (ranks with fewer pieces add
    nothing), their divergences summed and scaled by ``count / total`` pieces, so that the
    mean over the ``count`` piece indices that :func:`~..choice.auto.choose` takes is the
    mean over every rank's pieces: what one process scoring all of them gets (up to the
    summation's rounding; its early drops see the pieces in another order). Every rank
    gets the same value, so every rank chooses the same."""

    def __init__(self, counts: list[int], group=None):
        self.group, self.count, self.total = group, max(counts), sum(counts)
        self.scale = self.count / self.total

    def piece(self, score) -> float:
        """This rank's ``score()`` (None: no piece here) with every other rank's, in one
        all_gather; an error of one rank's score raises on every rank."""
        local, value = LocalError(), 0.0  # (an error leaves it: the exchange still runs)
        with local:
            value = 0.0 if score is None else float(score())
        t = torch.tensor([value, float(local.error is not None)], dtype=torch.float64,
                         device=group_device(self.group))
        got = all_gather(t, self.group).cpu()
        raise_on_all(local.error, bool(got[:, 1].any()), "auto's scoring", self.group, True)
        return float(got[:, 0].sum()) * self.scale


def share_pieces(div, group=None, error: Exception | None = None) -> None:
    """Make ``div`` (an :class:`~..choice.auto.OutputDivergence` built with
    ``alone=False``) score across the ranks (:class:`RankPieces`) where they were given
    different scoring pieces; where every rank was given the same (the same batches
    passed everywhere) each scores alone, as one process, with no exchange. Then
    ``div.check_left()``: on every rank's counts (``div.totals``) where they differ, so
    a rank holding no piece (given no batch, or all of whose pieces were left out)
    scores with none while another holds some, and where no rank holds one, every rank
    raises the error one process given all their batches raises. ``error``: what
    building ``div`` (None then) raised here, raised on every rank (the others naming
    this one). One tiny all_gather (a CRC of each rank's pieces and its
    :meth:`~..choice.auto.OutputDivergence.tally`)."""
    if not is_distributed(group):
        if error is not None:
            raise error
        div.check_left()
        return
    mine = [0] * 5 if div is None else [_crc(div.given), *div.tally()]
    got = all_gather(torch.tensor([*mine, int(error is not None)], dtype=torch.int64,
                                  device=group_device(group)), group).cpu()
    raise_on_all(error, bool(got[:, -1].any()), "auto's scoring", group, same_type=True)
    if not bool((got == got[0]).all()):  # the counts of them all, as one process's
        div.totals = type(div.tally())(*got[:, 1:-1].sum(0).tolist())
    div.check_left()  # (before RankPieces: with no piece on any rank, no mean to take)
    if div.totals is not None:
        div.ranks = RankPieces(got[:, 3].tolist(), group)
        div.pieces = div.ranks.count


def gather_parts(part, batches, what: str, group=None, error: Exception | None = None):
    """Every rank's result of its own ``batches``, by rank, where the ranks were given
    different batches; None where every rank was given the same (each keeps its own, one
    process's result: ``auto``'s "fisher" weights, :func:`share_pieces`' rule). ``part()``
    makes this rank's (a picklable value), called only where they differ: a CRC of each
    rank's batches is exchanged first (one tiny all_gather), the parts only then (one
    all_gather_object). ``error``: what computing it raised here (raised on every rank, the
    others naming this one, ``what`` failing)."""
    if not is_distributed(group):
        if error is not None:
            raise error
        return None
    mine = [0 if error is not None else _crc(batches), int(error is not None)]
    got = all_gather(torch.tensor(mine, dtype=torch.int64, device=group_device(group)),
                     group).cpu()
    raise_on_all(error, bool(got[:, 1].any()), what, group, same_type=True)
    if bool((got[:, 0] == got[0, 0]).all()):
        return None
    every: list = [None] * world_size(group)
    dist.all_gather_object(every, part(), group=group)
    return every


def _crc(batches) -> int:
    """A CRC of ``batches``' tensors: their dtypes, shapes and bytes."""
    crc = 0
    for t in (t for b in batches for t in tensors_in(b)):
        crc = zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode(), crc)
        t = t.detach().reshape(-1).contiguous().cpu()
        crc = zlib.crc32(t.view(torch.uint8).numpy().tobytes(), crc)
    return crc
