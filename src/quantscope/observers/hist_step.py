"""A one-unit histogram observer's common CPU call in one C pass, its decisions cached.

A per-tensor histogram observer's ``forward`` on a float32 CPU batch (a bf16 / fp16 one of up
to ``hist_kernel.HALF_PIECE`` values: its float32 copy) is one fused C pass
(:func:`quantscope.stats.hist_kernel.fused_update`: the min / max and the counts in one read)
wrapped in ~60 us of Python per call (the checks, the layout, the state's tests, the kernel's
own tests, the ends tensor, the min / max update, the token count), where torch.ao's whole
``HistogramObserver`` takes ~55 us on 2K elements. Those decisions follow from the input's
``(shape, stride, dtype)`` and the observer's spec, so :func:`cpu_step` makes them once per
such key (:func:`_plan`, which also runs ``leave_inference_mode`` and ``check_input``, as
forward's first steps: its errors are the general path's, in its state), and each later call
only tests what can change between calls (the context, the state's tensors, the settings),
then makes the fused kernel call the general path makes, into fresh state tensors that the
buffers take as the general path's ``_store`` gives them: the same state, bit for bit, the
same tensor versions, flags and counts. The tests are the general path's own (the observer's
``leave_inference_mode``, where :func:`.step_cache.leave_inference_mode` finds it has work,
and ``_check_size``, ``hist_kernel.state_ok``, ``kernels.add``,
``stats.histogram.STATE_BUFFERS``), called with the context tested once. A miss of the fused
pass (a value outside its window, NaN / inf, an empty state) changes nothing but
``obs._pass[0]`` (:data:`MISSED`), and the general path runs with its two-pass update: its
own fused attempt would read the batch again to miss again. Anything else this step does not
take returns False, nothing changed: the general path runs.
"""

from __future__ import annotations

import ctypes

import torch

from .. import kernels
from ..stats import hist_kernel
from ..stats.histogram import STATE_BUFFERS
from .shape import tokens_of
from .step_cache import begin

__all__ = ["MISSED", "cpu_step"]

#: the steps of forward the cached call stands for: a class overriding any of them, or an
#: instance given its own (a test's spy), keeps the general path (the override must run)
_STEPS = frozenset((
    "check_input", "leave_inference_mode", "_check_unit_count", "_check_size", "_unit_minmax",
    "_padding", "_record_non_finite", "_observe", "_observe_linear", "_state", "_set_state",
    "_store", "_drop_zeros", "_interval_batch", "count_batch", "set_shape",
    "units_in_input_dtype", "unpads", "needs_units"))
_classes: dict[type, bool] = {}
#: what :func:`cpu_step` leaves in ``obs._pass[0]`` where its fused C call missed: the general
#: path's ``_unit_minmax`` (which consumes it) then goes straight to the two-pass update
MISSED = ("missed",)
_F32, _I64, _CPU = torch.float32, torch.int64, torch.device("cpu")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # (bf16 / fp16: hist_kernel.widens)


def _takes_class(cls: type, base: type) -> bool:
    """Whether ``cls`` runs the histogram ``base``'s steps (and an accumulating state)."""
    return (issubclass(cls, base) and cls.accumulates
            and all(getattr(cls, n) is getattr(base, n) for n in _STEPS))


def _plan(obs, x: torch.Tensor) -> tuple[int, int] | None:
    """``(elements, tokens)`` where the general forward reads ``x`` (float32, bf16, fp16) as
    one unit of its own contiguous memory (the fused pass's input); None where it does
    something else. Raises what ``check_input`` raises, after ``leave_inference_mode``: the
    general forward's first two steps (its error leaves the general path's state)."""
    obs.leave_inference_mode()
    if not obs.check_input(x) or x.dtype not in _DTYPES or not x.is_contiguous():
        return None  # empty, float64 (its range check reads values), strided: general path
    layout = obs.spec.layout
    if layout.pads_at(x.shape):
        return None
    units = layout.to_units(x)
    if units.dim() != 2 or units.shape[0] != 1 or not units.is_contiguous() \
            or units.data_ptr() != x.data_ptr():
        return None
    return units.shape[1], tokens_of(x)


def _scratch(obs):
    """This observer's scratch: ``(lo, hi, address of the ends, ends)``: a batch's ``[1]``
    float32 min / max (read into the state by ``torch.minimum`` / ``maximum``, as the general
    path's fresh pair is, and kept by nothing) and 2 floats for the ends (unread: a hit's are
    finite)."""
    s = obs.__dict__.get("_hist_scratch")
    if s is None:
        ends = (ctypes.c_float * 2)()
        s = obs.__dict__["_hist_scratch"] = (torch.empty(1, dtype=torch.float32, device=_CPU),
                                             torch.empty(1, dtype=torch.float32, device=_CPU),
                                             ctypes.addressof(ends), ends)
    return s


def _takes_call(obs, x, base: type) -> bool:
    """The per-call tests of the class, the settings and the input that need no plan."""
    cls = type(obs)
    takes = _classes.get(cls)
    if takes is None:
        takes = _classes[cls] = _takes_class(cls, base)
    return (takes and kernels.real_tensor(x) and x.is_cpu and x.layout == torch.strided
            and (x.dtype == _F32 or hist_kernel.widens(x))
            and obs.non_finite == "error" and obs.grid == "pow2"
            and not obs.sync_every_step and obs.averaging_constant is None
            and not obs.skip_zeros and obs.cached_cpu_step and obs.accumulates
            and _STEPS.isdisjoint(obs.__dict__))


def cpu_step(obs, x, base: type) -> bool:
    """``obs.forward(x)``'s whole step where it is one fused C pass over a one-unit CPU ``x``
    (float32; bf16 / fp16 where ``hist_kernel.widens`` them) (``obs``: a histogram observer,
    an instance of ``base``, the class whose steps it stands for); False elsewhere, nothing
    changed (a fused-pass miss: :data:`MISSED` left for the general path)."""
    # the context first (None: no kernel, or a trace / compile / fake mode): Dynamo folds it
    lib = hist_kernel._kernel()
    if lib is None or not _takes_call(obs, x, base):
        return False
    started = begin(obs, x, "_hist_plans", _plan)
    if started is None:
        return False
    plan, shape_is_new = started
    bufs = obs._buffers
    slo, shi = bufs["min_vals"], bufs["max_vals"]
    B = bufs["hist_counts"].shape[-1]
    if (slo.shape != (1,) or shi.shape != (1,) or not 1 <= B <= hist_kernel.MAX_BINS
            or not bufs["seen_non_finite"].is_cpu):
        return False  # a first call sizes the state; the general path checks the rest
    try:
        obs._check_size(1)
    except ValueError:
        return False  # the general path raises it
    state = [bufs[n] for n in STATE_BUFFERS]
    if not hist_kernel.state_ok(state, 1, B):  # (the context: tested above)
        return False
    # the fresh state hist_kernel.fused_update makes (the buffers then take it: _store)
    new = (torch.zeros(1, B, dtype=_I64), torch.empty(1, dtype=_I64),
           torch.empty(1, dtype=_I64), torch.empty(1, dtype=_F32, device=_CPU),
           torch.empty(1, dtype=_F32, device=_CPU))
    lo, hi, addr, _ = _scratch(obs)
    # bf16 / fp16: a float32 copy, as fused_update reads them (hist_kernel.widens)
    src = x if x.dtype == _F32 else (x.detach() if x.requires_grad else x).float()
    if lib.qs_hist_fused(src.data_ptr(), plan[0], B, int(obs._absolute),
                         *(s.data_ptr() for s in state), *(s.data_ptr() for s in new),
                         lo.data_ptr(), hi.data_ptr(), addr, torch.get_num_threads()):
        # a miss, nothing written: the general path's fused attempt would miss again
        obs._pass[0] = MISSED
        return False
    torch.minimum(slo, lo, out=slo)  # the min / max state as _observe updates it
    torch.maximum(shi, hi, out=shi)
    for buf, value in zip(state, new):  # _store's eager CPU swap: the buffers keep their ids
        buf.data = value
    # (a hit read every value inside the window: no NaN / inf, finite ends; seen_non_finite
    # stays as record_ends leaves it)
    tokens = bufs["observed_tokens"]
    if not kernels.add(tokens, plan[1], context=False):  # (count_batch's direct count)
        tokens.add_(plan[1])
    if shape_is_new:
        obs.set_shape(x.shape)
    return True
