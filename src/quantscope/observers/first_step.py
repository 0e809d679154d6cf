"""A one-unit first-grid histogram's common CPU call in two C passes, its decisions cached.

A ``grid="first"`` histogram observer (ModelOpt's ``HistogramCalibrator``, the one class
that calls this step: an ``|x|`` histogram on its first batch's ``torch.histc`` grid, grown by
bins of that width) ran ``forward``'s general path on every batch (and ``collect`` a host read
of ``aminmax`` before it): ~200 us a call on 256-1K values, one thread (the checks, the layout,
the ends tensor, the min / max update, ``|x|``, the grid tests' host reads, ``torch.histc`` of
one row stacked and cast to int64, the token count), where ModelOpt's own ``collect`` takes
31-37 us. Those decisions follow from the input's ``(shape, stride, dtype)`` and the spec, so
:func:`cpu_step` makes them once per such key (:func:`_plan`, cached by
:func:`~quantscope.observers.step_cache.cached_plan`, the cache the min-max and native histogram
steps share) and each later call tests only what can change between calls (the context, the
state's tensors, the settings), then does what the general path does: the C min / max pass
``unit_minmax`` makes (:func:`~quantscope.stats.minmax.kernel_pass`, the same call), the
grid's growth by the observer's own ``_append_bins`` (or the float method it names) and
``_linear_top``, the min / max state's ``torch.minimum`` / ``maximum`` as their one-value
loop writes them (:func:`_running`), and ``torch.histc`` of ``|x|`` on that grid added to the
int64 counts in one C pass (``qs_ao_histc64``, ``csrc/ao_hist.c``: histc's float32 bin
arithmetic, bitwise its counts). The same state, bit for bit, the same tensor versions, flag
and token count: ~23 us a call there. NaN / inf, a first batch, a grid the counts leave (past
``GROW_LIMIT``), and anything else it does not take: False, nothing changed, and the general
path runs, as it does for an observer with ``cached_cpu_step = False`` (the native histogram
step's switch); NaN / inf is found before the step leaves inference mode (``collect`` refuses
that batch before its general path would: its buffers stay the tensors they were). A grid that
would grow past float32's range (its bin count or its end) raises ModelOpt's OverflowError or
RuntimeError from the grid itself (``ModelOptGrid._grow_to``), again with nothing changed, as
the general path does.
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch.autograd.graph import increment_version
from torch.nn.modules import module as _nn

from .. import kernels
from ..stats import histogram as H
from ..stats import minmax as _stats
from .shape import tokens_of
from .step_cache import begin, leave_inference_mode

__all__ = ["calls_forward", "cpu_step"]

#: the steps of forward the cached call stands for: a class overriding any of them, or an
#: instance given its own (a test's spy), keeps the general path (the override must run);
#: the grid's own ``_linear_top`` / ``_append_bins`` / ``_bins_needed`` are called
_STEPS = frozenset((
    "check_input", "leave_inference_mode", "_check_unit_count", "_check_size", "_unit_minmax",
    "_minmax_out", "_padding", "_record_non_finite", "_observe", "_observe_linear", "_linear",
    "_state", "_set_state", "_drop_zeros", "_interval_batch", "count_batch", "set_shape",
    "units_in_input_dtype", "unpads", "needs_units"))
_classes: dict[type, bool] = {}
_F32, _I64 = torch.float32, torch.int64
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # (bf16 / fp16: a float32 copy)


def _takes_class(cls: type, base: type) -> bool:
    """Whether ``cls`` runs the histogram ``base``'s steps (and an accumulating state)."""
    return (issubclass(cls, base) and cls.accumulates
            and all(getattr(cls, n) is getattr(base, n) for n in _STEPS))


def _plan(obs, x: torch.Tensor) -> int | None:
    """The elements of ``x`` where the general forward reads it (float32, bf16, fp16) as one
    unit of its own contiguous memory, with the C min / max pass; None where it does
    something else, or where ``check_input`` raises (the general path raises it, after what
    ``collect`` tests first)."""
    try:
        if not obs.check_input(x):
            return None  # empty: nothing observed
    except (TypeError, ValueError):
        return None
    if x.dtype not in _DTYPES or not x.is_contiguous() or obs.spec.layout.pads_at(x.shape):
        return None
    units = obs.spec.layout.to_units(x)
    if units.dim() != 2 or units.shape[0] != 1 or not units.is_contiguous() \
            or units.data_ptr() != x.data_ptr():
        return None
    E = units.shape[1]
    # unit_minmax's choice there: torch's aminmax by the call's thread count (decided per call)
    if _stats.THREAD_MIN_NUMEL <= E < 2 * _stats.THREAD_MIN_NUMEL or E >= 1 << 31:
        return None
    return E


def _scratch(obs):
    """This observer's scratch: ``(lo, hi, address of the ends, ends)``: a batch's ``[1]``
    float32 min / max (read into the state by ``torch.minimum`` / ``maximum``, as the general
    path's fresh pair is) and 2 floats for the ends."""
    s = obs.__dict__.get("_first_scratch")
    if s is None:
        ends = (ctypes.c_float * 2)()
        pair = torch.empty(1, dtype=_F32), torch.empty(1, dtype=_F32)
        s = obs.__dict__["_first_scratch"] = (*pair, ctypes.addressof(ends), ends)
    return s


def calls_forward(module: torch.nn.Module) -> bool:
    """Whether ``module(x)`` is ``module.forward(x)``: no hooks (the module's or global ones),
    not compiled (``module.compile()``); a caller may then run a step for it."""
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _nn._global_forward_hooks
                or _nn._global_forward_pre_hooks or _nn._global_backward_hooks
                or _nn._global_backward_pre_hooks or module._compiled_call_impl is not None)


def _takes_call(obs, x, base: type) -> bool:
    """The per-call tests of the class, the settings and the input that need no plan."""
    cls = type(obs)
    takes = _classes.get(cls)
    if takes is None:
        takes = _classes[cls] = _takes_class(cls, base)
    return (takes and kernels.real_tensor(x) and x.is_cpu and x.layout == torch.strided
            and obs.grid == "first" and obs.non_finite == "error" and obs._absolute
            and not obs.sync_every_step and obs.averaging_constant is None
            and not obs.skip_zeros and obs.cached_cpu_step and obs.accumulates
            and _STEPS.isdisjoint(obs.__dict__))


def _grid(bufs) -> float | None:
    """The ``lo`` of a first grid the C pass takes (one unit, plain int64 counts), read as a
    float, else None: no data yet, moved to the native grid, or a state elsewhere. (Read
    before the step leaves inference mode: the clones it may make hold the same values, and
    are writable.)"""
    counts = bufs["hist_counts"]
    if not (counts.dim() == 2 and counts.shape[0] == 1 and kernels.plain_tensor(counts, _I64)
            and kernels.first_value(bufs["linear_grid"], torch.bool)):
        return None
    lo = bufs["hist_lo"]
    glo = kernels.first_value(lo, _F32) if lo.shape == (1,) else None
    return None if glo is None or not math.isfinite(glo) else glo


def _top(obs) -> float | None:
    """The grid's last edge (``_linear_top``: histc's max) as a float, None where unread."""
    return kernels.first_value(obs._linear_top(), _F32)


_QNAN = 0x7FC00000  # the NaN torch.minimum / maximum write (std::numeric_limits quiet_NaN)


def _running(slo: torch.Tensor, shi: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
    """``torch.minimum(slo, lo, out=slo)`` and ``maximum(shi, hi, out=shi)`` of one-value
    float32 CPU tensors (``lo`` / ``hi`` finite), through their memory: torch's one-value loop
    is ``NaN if a or b is NaN else std::min(a, b)`` (a tie, -0.0 and 0.0, keeps ``a``, the
    state; its NaN is the quiet one), and the versions bumped as the ops bump them."""
    if kernels.first_value(slo, _F32) is None or kernels.first_value(shi, _F32) is None:
        torch.minimum(slo, lo, out=slo)
        torch.maximum(shi, hi, out=shi)
        return
    for state, batch, below in ((slo, lo, True), (shi, hi, False)):
        cell = ctypes.c_float.from_address(state.data_ptr())
        value = ctypes.c_float.from_address(batch.data_ptr()).value
        if cell.value != cell.value:
            ctypes.c_uint32.from_address(state.data_ptr()).value = _QNAN
        elif (value < cell.value) if below else (value > cell.value):
            cell.value = value
    increment_version((slo, shi))


def cpu_step(obs, x, base: type) -> bool:
    """``obs.forward(x)``'s whole step where it is the C min / max pass and histc of a
    one-unit CPU ``x`` on an ``|x|`` first grid (``obs``: an instance of ``base``, the class
    whose steps it stands for); False, nothing changed, elsewhere (NaN / inf included)."""
    lib, mm = kernels.lib("ao_hist"), _stats._kernel()  # None: a trace / compile / fake mode
    if lib is None or mm is None or not _takes_call(obs, x, base):
        return False
    started = begin(obs, x, "_first_plans", _plan, leave=False)
    if started is None:
        return False
    E, shape_is_new = started
    bufs = obs._buffers
    slo, shi = bufs["min_vals"], bufs["max_vals"]
    glo = _grid(bufs)
    if (glo is None or slo.shape != (1,) or shi.shape != (1,) or not slo.is_cpu
            or not shi.is_cpu or not bufs["seen_non_finite"].is_cpu
            or (top := _top(obs)) is None):
        return False  # a first call sizes the state; the general path checks the rest
    try:
        obs._check_size(1)
    except ValueError:
        return False  # the general path raises it
    lo, hi, addr, ends = _scratch(obs)
    src = x if x.dtype == _F32 else x.detach().float()  # forward's float32 copy
    _stats.kernel_pass(mm, src.data_ptr(), 1, E, lo.data_ptr(), hi.data_ptr(), addr, 0, 0.0,
                       None, None, 0)  # unit_minmax's call (lo / hi: the general path's)
    if not (math.isfinite(ends[0]) and math.isfinite(ends[1])):
        return False  # recorded (forward) or refused (collect, before its general path
        # leaves inference mode: the buffers kept, the same tensors) by the general path
    leave_inference_mode(obs)  # (it may replace the buffers: the step writes them after)
    slo, shi, counts = bufs["min_vals"], bufs["max_vals"], bufs["hist_counts"]
    amax = max(-ends[0], ends[1])  # max |x| (the grid's lo: 0)
    if glo > 0.0 or amax > top:  # past the grid: grow it (the general path's call; hi as
        # _observe_linear's, a fresh tensor a grid may keep; or the float, to the method the
        # class's _append_bins names for it: ModelOpt's _grow_to, None where it cannot)
        grow = getattr(type(obs)._append_bins, "takes_float", None)
        grown = getattr(obs, grow)(amax) if grow else None
        if grown is None:
            grown = obs._append_bins(torch.full((1,), amax, dtype=_F32))
        if not grown:
            return False  # moves to the native grid: the general path
        counts, top = bufs["hist_counts"], _top(obs)
    _running(slo, shi, lo, hi)  # the min / max state as _observe updates it
    B = counts.shape[1]
    if top is None or lib.qs_ao_histc64(src.data_ptr(), E, glo, top, B, counts.data_ptr(), 1,
                                        kernels.threads()):
        obs.hist_counts += H.linear_counts(src.reshape(1, E).abs(), obs.hist_lo,
                                           obs._linear_top(), B)  # _observe_linear's own
    else:
        increment_version(counts)  # written by the C, as the general path's += bumps it
    obs._pass[1] = x.shape  # as the general forward leaves it
    tokens, n = bufs["observed_tokens"], tokens_of(x)
    if not kernels.add(tokens, n, context=False):  # (count_batch's direct count)
        tokens.add_(n)
    if shape_is_new:
        obs.set_shape(x.shape)
    return True
