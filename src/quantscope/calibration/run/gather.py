"""Calibration's cross-process gathers: weight ownership, activation samples, failures.

Used by :mod:`quantscope.calibration.run.session` when calibration runs data-parallel: weights
are observed once, on the rank that owns them (:func:`weight_owners`), and the samples
and failed candidates of every rank are merged so that every rank decides alike. Outside
a process group every function returns its input. Re-exported by
:mod:`quantscope.distributed`.
"""

from __future__ import annotations

import heapq

import torch
import torch.distributed as dist

from ...comm import all_gather, group_device, is_distributed, world_size

__all__ = ["assign_by_size", "gather_failures", "gather_qparams", "gather_samples",
           "weight_owners"]


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
    values). Every rank passes the same keys.

    Two tensor all_gathers (row counts, widths and dtypes, then one flat float32 payload per
    rank), not pickled objects: activation samples are tens of MB and pickling them dominates.
    """
    if not is_distributed(group):
        return samples
    dev = group_device(group)
    keys = list(samples)
    local = [torch.cat(samples[k]) if samples[k] else None for k in keys]
    head = torch.tensor([[0, 0, 0] if t is None else [t.shape[0], t[0].numel(), _dtype_code(t)]
                         for t in local], dtype=torch.int64, device=dev).reshape(-1)
    heads = all_gather(head, group).cpu().reshape(-1, len(keys), 3).tolist()  # [W, K, 3]
    sizes = [sum(n * w for n, w, _ in h) for h in heads]
    payload = torch.zeros(max(sizes), dtype=torch.float32, device=dev)
    if sizes[dist.get_rank(group)]:
        flat = torch.cat([t.reshape(-1).float() for t in local if t is not None])
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
