"""The MSE search's selection rules as the op ``quantscope::mse_select`` (re-exported by
:mod:`quantscope.kernels.ops`, whose docstring describes it), and the global rule's
helpers the block-scale searches share (:func:`improved_rows`, :func:`stop_after`).

``mse_select(err, same, incumbent, ext_start, patience, per_unit, use_global, tie_last)
-> (idx, best)`` applies ``estimators.mse_tiles._State``'s rules to priced ``[K, U]``
candidates: per-unit patience over plateaus, the global rule, ties kept first or last.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._oplib import define
from . import triton as _triton

__all__ = ["beats", "check_ext_start", "improved_rows", "mse_select", "stop_after"]


def beats(err: Tensor, best: Tensor, tie_last: bool) -> Tensor:
    """Where error ``err`` replaces the running ``best``: strictly lower, or ``<=`` with
    ``tie_last``, but never a non-finite error (an overflowed one ties every other
    overflowed one, and ``<=`` would keep the last of them)."""
    if tie_last:
        return (err <= best) & (err < float("inf"))
    return err < best


def _check_select(err, same, incumbent, ext_start) -> None:
    who = "mse_select"
    if err.dim() != 2 or err.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"quantscope::{who}: err must be a float32 or float64 [candidates, "
                         f"units] tensor, got {err.dtype} {tuple(err.shape)}")
    if same.shape != err.shape or same.dtype != torch.bool or same.device != err.device:
        raise ValueError(f"quantscope::{who}: same must be a bool tensor of err's shape "
                         f"{tuple(err.shape)} on {err.device}, got {same.dtype} "
                         f"{tuple(same.shape)} on {same.device}")
    if incumbent.shape != err.shape[1:] or incumbent.dtype != err.dtype \
            or incumbent.device != err.device:
        raise ValueError(f"quantscope::{who}: incumbent must be a {err.dtype} tensor of shape "
                         f"({err.shape[1]},) on {err.device}, got {incumbent.dtype} "
                         f"{tuple(incumbent.shape)} on {incumbent.device}")
    check_ext_start(who, ext_start, err.shape[0])


def check_ext_start(who: str, ext_start: int, candidates: int) -> None:
    """``ValueError`` unless the extension's first row ``ext_start`` is in ``[0,
    candidates]``."""
    if not 0 <= ext_start <= candidates:
        raise ValueError(f"quantscope::{who}: ext_start must be in [0, {candidates}], got "
                         f"{ext_start}")


def improved_rows(err: Tensor, best: Tensor, tie_last: bool = False) -> Tensor:
    """Which rows (candidates) of ``err [K, U]`` improve some unit on its running best,
    starting from ``best [U]`` (strictly, or ``<=`` with ``tie_last``): what the global
    rules (stop after ``patience`` rows improving no unit) count. A NaN error never becomes
    the running best, as :func:`beats` never takes it (the search's state, llm-compressor's
    ``err < best``): the units' later improvements still count."""
    passed = torch.where(err[:-1].isnan(), float("inf"), err[:-1])  # (a NaN best stays one)
    before = torch.cat((best[None], passed)).cummin(0).values  # each unit's best before
    return beats(err, before, tie_last).any(1)


def _global_stop(err: Tensor, incumbent: Tensor, ext_start: int, patience: int,
                 tie_last: bool) -> Tensor:
    """The grid candidate after which the global rule has stopped (``ext_start`` if never),
    as a one-value int64 tensor on ``err``'s device (no host read): until then every unit
    is searching, so a unit improves at ``k`` exactly when ``err[k]`` beats its running
    best; the rule stops ``patience`` candidates after the last one that improved any."""
    grid = err[:ext_start]
    improved = (improved_rows(grid, incumbent, tie_last) if patience >= 0
                else grid.new_zeros(grid.shape[0], dtype=torch.bool))  # no rule: not read
    return stop_after(improved, patience)


def stop_after(improved: Tensor, patience: int) -> Tensor:
    """The candidate after which the global rule stops (``len(improved)`` if never), as a
    one-value int64 tensor: ``patience`` candidates after the last that ``improved`` some
    unit (``patience < 0``: never)."""
    K = improved.shape[0]
    if K == 0 or patience < 0:
        return torch.full((1,), K, dtype=torch.int64, device=improved.device)
    k = torch.arange(K, device=improved.device)
    last = torch.where(improved, k, -1).cummax(0).values
    hit = (k - last) >= patience
    first = hit.to(torch.int8).argmax()
    return torch.where(hit.any(), first, K).reshape(1)


def _torch_mse_select(err, same, incumbent, ext_start, patience, per_unit, use_global,
                      tie_last):
    """The rules of ``mse_tiles._State.step``, candidate by candidate over ``[U]`` vectors."""
    _check_select(err, same, incumbent, ext_start)
    gstop = _global_stop(err, incumbent, ext_start, patience, tie_last)[0]
    U = err.shape[1]
    best, idx = incumbent.clone(), torch.full((U,), -1, dtype=torch.int64, device=err.device)
    stale = torch.zeros(U, dtype=torch.int64, device=err.device)
    stopped = torch.zeros(U, dtype=torch.bool, device=err.device)
    for i in range(err.shape[0]):
        grid_row = use_global and i < ext_start
        g_stopped = (gstop < i) & grid_row
        if patience < 0:
            active = torch.ones_like(stopped)
        elif per_unit:
            active = ~(stopped & (g_stopped if grid_row else True))
        else:
            active = ~g_stopped.expand_as(stopped)
        better = active & beats(err[i], best, tie_last)
        best = torch.where(better, err[i], best)
        idx = torch.where(better, i, idx)
        if patience >= 0 and per_unit:
            stale = torch.where(better, 0, stale + (active & ~better & ~same[i]).long())
            stopped |= stale >= patience
    return idx, best


def _cuda_mse_select(err, same, incumbent, ext_start, patience, per_unit, use_global, tie_last):
    kernel = _triton.launchers("mse", err)
    if kernel is None:
        return _torch_mse_select(err, same, incumbent, ext_start, patience, per_unit,
                                 use_global, tie_last)
    _check_select(err, same, incumbent, ext_start)
    gstop = _global_stop(err, incumbent, ext_start, patience, tie_last)
    return kernel.mse_select(err.contiguous(), same.contiguous(), incumbent.contiguous(), gstop,
                             ext_start, None if patience < 0 else patience, per_unit,
                             use_global, tie_last)


def _fake_mse_select(err, same, incumbent, ext_start, patience, per_unit, use_global, tie_last):
    _check_select(err, same, incumbent, ext_start)
    return (err.new_empty(err.shape[1], dtype=torch.int64), err.new_empty(err.shape[1]))


mse_select = define(
    "mse_select(Tensor err, Tensor same, Tensor incumbent, SymInt ext_start, SymInt patience, "
    "bool per_unit, bool use_global, bool tie_last) -> (Tensor, Tensor)",
    _torch_mse_select, cuda=_cuda_mse_select, fake=_fake_mse_select)
