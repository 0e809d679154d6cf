"""Many observers, each on its own tensor, in a few launches: a layer's or a model's weights.

``observer(x)`` off the CPU is one launch sequence per tensor (the per-unit min / max, the
non-finite check, the state). :func:`observe_many` takes the per-unit min / max of every
tensor it can in ONE ``quantscope::grouped_unit_minmax`` launch per (device, dtype) and hands
each observer its share (:meth:`~quantscope.observers.Observer.observe_minmax`), with the
same state, bit for bit, as ``observer(x)`` would leave.

A pair is grouped where its observer :attr:`~quantscope.observers.Observer.takes_minmax`,
its tensor is off the CPU in float32 / bfloat16 / float16, and the layout's units are rows of
the tensor itself (a view with contiguous rows: per-tensor, the first axis of a weight,
groups). The rest go through ``observer(x)``: units that forward reads in place through
another view (tiles, a channel axis past the first) or copies (padded blocks, activation
order), every other observer family, and everything on the CPU, where the C kernels already
read each tensor once, faster than a grouped torch pass would.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from ..kernels import ops
from .base import Observer

__all__ = ["observe_many", "row_units"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _launches(x: torch.Tensor) -> bool:
    """Whether ``x`` may join a grouped launch: off the CPU, a dtype the op reads."""
    return x.device.type != "cpu" and x.dtype in _DTYPES


def row_units(observer: Observer, x: torch.Tensor) -> torch.Tensor | None:
    """``x``'s units under ``observer``'s layout as a ``[U, E]`` view of ``x`` with
    contiguous rows, where a grouped launch can take ``observer``'s share of it; None: the
    pair goes through ``observer(x)``. ``x`` must have passed ``observer.check_input``."""
    if not observer.takes_minmax or not _launches(x):
        return None
    layout = observer.spec.layout
    # ask on a stand-in without data first: a layout that copies would copy the tensor itself
    probe = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    units = layout.to_units(probe)
    # a view shares the probe's storage (``_base`` would do, but inference mode records none)
    if units.dim() != 2 or units.stride(1) != 1 or not torch._C._is_alias_of(units, probe):
        return None
    return layout.to_units(x.detach())


def observe_many(pairs: Iterable[tuple[Observer, torch.Tensor]],
                 on_error: Callable[[int, Exception], None] | None = None) -> list[float]:
    """``observer(x)`` for every ``(observer, x)`` of ``pairs`` (each observer once), the
    pairs off the CPU in grouped launches (see the module doc); the order of the pairs does
    not change any result.

    Every pair is validated first (``check_input``: the ``TypeError`` / ``ValueError`` that
    forward raises for the tensor itself), before anything is observed; an error that depends
    on an observer's state (a unit count other than before, an imatrix importance of another
    length) comes when its pair is observed, after pairs before it. ``on_error(i, error)``:
    called instead of
    raising for a ``TypeError`` / ``ValueError`` of pair ``i`` (validating or observing it),
    which is then left out. Returns the seconds spent on each pair, a grouped launch shared
    over its pairs by their elements (wall time: off the CPU, the launches' only).
    """
    pairs = list(pairs)
    _check_pairs(pairs)
    seconds = [0.0] * len(pairs)
    alone, groups = [], {}
    for i, (obs, x) in enumerate(pairs):
        t0 = time.perf_counter()
        try:
            units = row_units(obs, x) if obs.check_input(x) else None
        except (TypeError, ValueError) as e:
            _failed(on_error, i, e)
            continue
        if units is None:
            alone.append(i)
        else:
            groups.setdefault((x.device, x.dtype), []).append((i, units))
        seconds[i] += time.perf_counter() - t0
    for i in alone:
        t0 = time.perf_counter()
        _guarded(on_error, i, pairs[i][0], pairs[i][1])
        seconds[i] += time.perf_counter() - t0
    for members in groups.values():
        _observe_group(pairs, members, seconds, on_error)
    return seconds


def _check_pairs(pairs: list) -> None:
    seen: dict[int, int] = {}
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2
                and isinstance(pair[0], Observer)):
            raise TypeError(f"observe_many: pairs[{i}] must be an (Observer, tensor) pair, got "
                            f"{type(pair).__name__}")
        first = seen.setdefault(id(pair[0]), i)
        if first != i:  # a second tensor would make the result depend on the pairs' order
            raise ValueError(f"observe_many: pairs[{i}] has the observer of pairs[{first}]; "
                             f"each observer may come once (call it again for more tensors)")


def _failed(on_error, i: int, error: Exception) -> None:
    if on_error is None:
        raise error
    on_error(i, error)


def _guarded(on_error, i: int, obs: Observer, x: torch.Tensor, lo=None, hi=None) -> None:
    """``obs(x)`` (or ``obs.observe_minmax(x, lo, hi)``), its error to ``on_error``."""
    try:
        if lo is None:
            obs(x)
        else:
            obs.observe_minmax(x, lo, hi)
    except (TypeError, ValueError) as e:
        _failed(on_error, i, e)


def _observe_group(pairs, members, seconds, on_error) -> None:
    """One grouped launch over ``members`` (``(pair index, units)`` of one device and dtype),
    then each observer's share; the launch's time split by elements."""
    t0 = time.perf_counter()
    los, his = ops.grouped_unit_minmax([units for _, units in members])
    launch = time.perf_counter() - t0
    total = sum(units.numel() for _, units in members)
    for (i, units), lo, hi in zip(members, los, his, strict=True):
        t0 = time.perf_counter()
        _guarded(on_error, i, pairs[i][0], pairs[i][1], lo, hi)
        seconds[i] += time.perf_counter() - t0 + launch * units.numel() / total
