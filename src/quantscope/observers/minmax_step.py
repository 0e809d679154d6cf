"""A min-max observer's common CPU call in one C pass, its decisions cached.

:meth:`~quantscope.observers.base.Observer.forward` decides per call what it does with ``x``
(checks, layout, padding, which reduction, the kernel's own tests): ~30 us of Python a call
where the pass over a small batch takes 1-5 us, and torch.ao's whole ``MinMaxObserver`` 14.
Those decisions follow from the input's ``(shape, stride, dtype)`` and the observer's spec,
so :func:`cpu_step` makes them once per such key (:func:`_plan`, which also runs
``leave_inference_mode`` and ``check_input``, as forward's first steps: its errors are the
general path's, in its state) and each later call with that key only tests what can change
between calls (the context, the state's tensors, the settings), then runs the same C pass
the general path makes: an accumulating observer's fused state update, a memoryless one's
(an instance that does not accumulate: Quark's dynamic and per-group ones too, whose state is
the scratch pair their general path writes and makes the state: :func:`_scratch_state`)
min / max written into its state in place, with the ends it keeps for the global amax. The
same state, bit for bit, the same versions bumped, the same flag and count. Anything else,
or a test failing, returns False: the general path runs (and raises whatever it raises). The
plan cache is :mod:`.step_cache`'s.
"""

from __future__ import annotations

import ctypes
import math
import operator
import weakref

import torch
from torch.autograd.graph import increment_version

from .. import kernels
from ..layout import Block, Channel, Group, Token
from ..layout import Tensor as TensorLayout
from ..stats import minmax as _stats  # (its module: tests swap its _kernel, _kernel_reads)
from ..stats.minmax import KERNEL_DTYPES, UPDATES
from .shape import tokens_of
from .step_cache import begin

__all__ = ["PLAN_CHECKED", "cpu_step", "state_ends"]

_UNITS = operator.itemgetter(0)  #: a plan's unit count (its U)

#: the steps of forward the cached call stands for: a class overriding any of them, or an
#: instance given its own (a test's spy), keeps the general path (the override must run),
#: unless the class defining the override (the first in the MRO to define it) names it in its
#: own ``_step_overrides`` and it is one of :data:`PLAN_CHECKED` (a subclass overriding it
#: again names it again: a parent's declaration vouches for the parent's code only).
#: (A step patched onto the base class itself after a class's first call is not seen.)
_STEPS = frozenset(("check_input", "leave_inference_mode", "_check_unit_count",
                    "_unit_minmax", "_minmax_out", "_record_non_finite", "_observe", "_update",
                    "count_batch", "set_shape", "_one_op_units"))
#: the steps a class may override and still take the cached call, by naming them in its
#: ``_step_overrides``: a ``check_input`` whose answer follows from the input's ``(shape,
#: stride, dtype)`` and the spec alone (the plan runs it once per key, as the base's), a
#: ``set_shape`` (then run on every call, as ``count_batch`` runs it)
PLAN_CHECKED = frozenset(("check_input", "set_shape"))
_classes: dict[type, tuple] = {}


def _declared(cls: type, name: str) -> bool:
    """Whether the class that defines ``cls``'s step ``name`` names it in its own
    ``_step_overrides`` (one of :data:`PLAN_CHECKED`), not through a parent's."""
    owner = next(c for c in cls.__mro__ if name in vars(c))
    return name in PLAN_CHECKED and name in vars(owner).get("_step_overrides", ())


def _runs_steps_of(cls: type, base: type) -> bool:
    """Whether ``cls`` runs ``base``'s steps (or overrides their definers declare:
    :func:`_declared`)."""
    return issubclass(cls, base) and all(
        getattr(cls, n) is getattr(base, n) or _declared(cls, n) for n in _STEPS)


def _takes_class(cls: type, base: type, memoryless: type) -> tuple:
    """``(accumulating, memoryless, set_shape each call, runs base's steps)``: whether
    ``cls`` runs the min-max ``base``'s steps, fusing an accumulating update (its instances
    that accumulate), and whether an instance that does not accumulate keeps the last call's
    min / max as ``memoryless`` (the class, or ``base``'s steps, whose ``_observe`` runs its:
    where it runs ``base``'s, the last, its memoryless state is the ``_minmax_out`` scratch
    pair :func:`_scratch_state` keeps)."""
    if cls.needs_units:
        return False, False, False, False
    runs_base = _runs_steps_of(cls, base)
    accumulating = runs_base and cls.state_update in UPDATES and bool(cls.accumulates)
    keeps_last = runs_base or _runs_steps_of(cls, memoryless)
    return accumulating, keeps_last, cls.set_shape is not base.set_shape, runs_base


def _scratch_state(obs, bufs, slo: torch.Tensor, shi: torch.Tensor, n: int) -> tuple:
    """The pair a memoryless call writes where the class runs the base's steps (Quark's
    dynamic and per-group ones): the general path writes its ``_minmax_out`` scratch pair and
    ``_observe`` makes it the state. So the state ``slo`` / ``shi`` once it is that pair
    (each call after the first, as a rule); else (a buffer replaced since: inference mode
    left, which cloned it; a load) the pair the state then takes, the same tensors and
    in-place versions as there."""
    s = obs.__dict__.get("_scratch")
    if s is not None and s[0] is slo and s[1] is shi:
        return slo, shi
    slo, shi = obs._minmax_out(n)
    bufs["min_vals"], bufs["max_vals"] = slo, shi
    return slo, shi


def _row_view(layout, shape) -> bool:
    """Whether the units of a contiguous tensor of ``shape`` are rows of its memory that the
    general forward reads with the fused kernel (not ``layout_minmax``'s other reductions:
    groups and blocks without an order are rows of ``x`` where the plan finds them so)."""
    if isinstance(layout, (TensorLayout, Token)):
        return True
    if isinstance(layout, Channel):  # the channel axis leads: no dim before it holds more
        return len(shape) < 2 or math.prod(shape[:layout.axis % len(shape)]) == 1
    return isinstance(layout, (Group, Block)) and getattr(layout, "g_idx", None) is None


def _plan(obs, x: torch.Tensor) -> tuple[int, int, int] | None:
    """``(units, elements, dtype code)`` the fused kernel reads ``x``'s memory as, where the
    general forward would make that one call; None where it does something else. Raises what
    ``check_input`` raises, after ``leave_inference_mode``: the general forward's first two
    steps (its error leaves the general path's state)."""
    obs.leave_inference_mode()
    if not obs.check_input(x) or x.dtype not in KERNEL_DTYPES or not x.is_contiguous():
        return None  # empty, float64 (its range check reads values), strided: general path
    layout = obs.spec.layout
    if layout.pads_at(x.shape) or not _row_view(layout, x.shape):
        return None
    units = layout.to_units(x)
    if units.dim() != 2 or not units.is_contiguous() or units.data_ptr() != x.data_ptr():
        return None
    U, E = units.shape
    numel = U * E
    if U == 1 and _stats.THREAD_MIN_NUMEL <= numel < 2 * _stats.THREAD_MIN_NUMEL:
        return None  # the kernel or torch by the thread count of the call: decided per call
    # the general path's choice for these units (forward detaches them first)
    if not _stats._kernel_reads(units.detach(), True):
        return None
    return U, E, KERNEL_DTYPES[x.dtype]


def _float32_state(t: torch.Tensor, n: int) -> bool:
    """A state tensor the kernel updates in place: a real contiguous float32 CPU ``[n]``."""
    return (t.shape == (n,) and t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()
            and kernels.real_tensor(t))


def _ends(obs):
    """``(tensor, floats)``: this observer's ``(2,)`` float32 tensor a call's pass writes its
    ends into (a memoryless call's are its state's, which it keeps: :func:`state_ends`), and
    the values of its memory. One per observer: each call's ends replace the last's."""
    e = obs.__dict__.get("_cpu_ends")
    if e is None:
        t = torch.empty(2, dtype=torch.float32)
        e = obs.__dict__["_cpu_ends"] = (t, (ctypes.c_float * 2).from_address(t.data_ptr()))
    return e


def state_ends(ends: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple | None:
    """What a memoryless observer keeps of the ``(2,)`` ``ends`` its pass found for the state
    ``lo`` / ``hi`` (its ``_state_ends``: valid while both are those tensors at these in-place
    versions); None for inference tensors, which keep no versions (derive it instead)."""
    try:
        return ends, weakref.ref(lo), lo._version, weakref.ref(hi), hi._version
    except RuntimeError:
        return None


def _takes_call(obs, x, takes) -> int | None:
    """The :data:`UPDATES` code of ``obs``'s cached call on ``x`` (0: memoryless), or None
    where the general path runs (the class's ``takes``, then the instance's settings, which
    can change, and the input's kind)."""
    if obs.accumulates:  # (its state update: the instance's settings)
        kind = UPDATES.get(obs.state_update) if takes[0] else None
    else:
        kind = 0 if takes[1] else None
    if kind is None or not isinstance(x, torch.Tensor) or not x.is_cpu \
            or x.layout != torch.strided or obs.non_finite != "error" or obs.sync_every_step \
            or obs._padded_call or not obs.cached_cpu_step or not _STEPS.isdisjoint(obs.__dict__):
        return None
    return kind


def _pass(obs, lib, x, plan, kind: int, slo: torch.Tensor, shi: torch.Tensor):
    """The C pass of ``x`` under ``plan`` into the state ``slo`` / ``shi``: fused into an
    accumulating update (``kind``; the batch's min / max are not kept) or, ``kind`` 0, the
    min / max written into them (the memoryless state); the two ends it found (floats)."""
    U, E, code = plan
    ends, floats = _ends(obs)
    if kind:
        # (the running min / max reads no constant: no nn.Module.__getattr__ miss for it)
        c = 0.0 if kind == UPDATES["min"] else float(getattr(obs, "averaging_constant", 0.0))
        _stats.kernel_pass(lib, x.data_ptr(), U, E, None, None, ends.data_ptr(), kind, c,
                           slo.data_ptr(), shi.data_ptr(), code)
    else:
        _stats.kernel_pass(lib, x.data_ptr(), U, E, slo.data_ptr(), shi.data_ptr(),
                           ends.data_ptr(), 0, 0.0, None, None, code)
    return floats[0], floats[1]


def cpu_step(obs, x, base: type, memoryless: type) -> bool:
    """``obs.forward(x)``'s whole step where it is one C pass over ``x`` on the CPU (``obs``:
    a min-max observer, an instance of ``base``, the class whose steps it stands for, or of
    ``memoryless``, whose steps an instance that does not accumulate runs); False, nothing
    done, elsewhere."""
    cls = type(obs)
    takes = _classes.get(cls)
    if takes is None:
        takes = _classes[cls] = _takes_class(cls, base, memoryless)
    kind = _takes_call(obs, x, takes)
    if kind is None:
        return False
    lib = _stats._kernel()  # None: no kernel, or a trace / compile / fake mode (kernels.real)
    if lib is None or not kernels.real_tensor(x):  # (after the context: Dynamo folds it)
        return False
    started = begin(obs, x, "_cpu_plans", _plan, units=_UNITS)
    if started is None:
        return False
    plan, shape_is_new = started
    bufs = obs._buffers
    slo, shi, tokens = bufs["min_vals"], bufs["max_vals"], bufs["observed_tokens"]
    if not (_float32_state(slo, plan[0]) and _float32_state(shi, plan[0])):
        return False  # a first call sizes the state
    if not kind and takes[3]:
        slo, shi = _scratch_state(obs, bufs, slo, shi, plan[0])
    ends = _pass(obs, lib, x, plan, kind, slo, shi)
    increment_version((slo, shi))  # written by the C, as the general path bumps them
    if not (math.isfinite(ends[0]) and math.isfinite(ends[1])):
        bufs["seen_non_finite"].fill_(True)
    if not kind:  # the memoryless state's ends, as its _observe keeps them
        obs.__dict__.update(_pending_ends=None, _state_ends=state_ends(_ends(obs)[0], slo, shi))
    n = tokens_of(x)
    if not kernels.add(tokens, n):
        tokens.add_(n)
    if shape_is_new or takes[2]:
        obs.set_shape(x.shape)
    return True
