"""The min-max family: the range is what was seen, over one call, all calls, or an EMA."""

from __future__ import annotations

import torch

from .._checks import write_refused
from ..comm import AVG, MAX, MIN
from ..qparams import QParams, amax_of_range
from ..stats.minmax import (
    UPDATES,
    minmax_observe,
    op_unit_count,
    op_units,
    ordered,
    unit_minmax,
    update_state,
)
from .base import Observer, is_dtensor, only_observes
from .minmax_step import cpu_step, state_ends
from .overflow import EMA_OVERFLOW
from .registry import register
from .shape import tokens_of

__all__ = [
    "MemorylessMinMaxObserver",
    "MinMaxStateObserver",
    "MovingAverageMinMaxObserver",
    "PlaceholderObserver",
    "StaticMinMaxObserver",
]


def _pair(count: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ``[count]`` float32 tensors (as the units the kernels read, whatever torch's
    default dtype)."""
    return (torch.empty(count, device=device, dtype=torch.float32),
            torch.empty(count, device=device, dtype=torch.float32))


class MinMaxStateObserver(Observer):
    """An observer whose state is a per-unit ``min_vals`` / ``max_vals`` pair.

    Subclasses say how a batch's per-unit ``lo`` / ``hi`` update the state
    (:meth:`_update`); the range is the state itself.
    """

    family = "minmax"

    needs_units = False

    def __init__(self, spec=None, **kwargs):
        super().__init__(spec, **kwargs)
        self.register_buffer("min_vals", torch.zeros(0, dtype=torch.float32))
        self.register_buffer("max_vals", torch.zeros(0, dtype=torch.float32))

    def _sized_buffers(self):
        return ("min_vals", "max_vals")

    #: ``(ends, min_vals, its version, max_vals, its version)``: an instance that does not
    #: accumulate (:class:`MemorylessMinMaxObserver`, Quark's dynamic / per-group ones) keeps
    #: the smallest min and largest max of its state (unit_minmax finds them in its pass),
    #: valid while both buffers are those tensors (weak references) at those in-place versions
    _state_ends: tuple | None = None
    #: no copy or pickle carries them (weak references do not pickle): a copy, an unpickled
    #: or a ``torch.load``-ed observer derives its amax from the ranges; every class here,
    #: since any instance that does not accumulate keeps them (the cached step's call too);
    #: nor the scratch pair (:meth:`_minmax_out`, remade on the next call: a saved static
    #: NVFP4 observer would double its size with it)
    _uncopied = (*Observer._uncopied, "_state_ends", "_pending_ends", "_scratch")

    def _minmax_out(self, count):
        # a scratch pair reused across calls: the state is updated from it, never aliases it
        # (a first call's pair the state takes is forgotten then: _observe). Only on the CPU:
        # off it the ops make their own pair (unit_minmax, layout_minmax write none given)
        dev = self._buffers["min_vals"].device
        if dev.type != "cpu":
            return None
        if torch.compiler.is_compiling():  # Inductor gave a cached scratch and the state
            return _pair(count, dev)  # one buffer
        scratch = self.__dict__.get("_scratch")
        if scratch is None or scratch[0].shape != (count,) or scratch[0].device != dev or (
                write_refused(scratch[0])):
            scratch = self._scratch = _pair(count, dev)
        return scratch

    #: the step statistic is the per-unit min / max (quantscope.distributed step sync)
    step_sync_range_only = True

    def sync_plan(self):
        return {"min_vals": MIN, "max_vals": MAX}

    #: the state update (``quantscope.stats.minmax.update_state`` kind) :meth:`_update` does;
    #: forward fuses it into the min / max pass when set
    state_update: str | None = None
    _fused = False
    #: whether the common CPU call may take the cached C step (:mod:`.minmax_step`; the same
    #: state bit for bit); False (on a class or an instance) keeps the general forward
    cached_cpu_step = True

    def _unit_minmax(self, units, count, ends):
        kind = self.state_update
        # the buffers from _buffers: nn.Module.__getattr__ costs a microsecond a lookup here
        state_lo, state_hi = self._buffers["min_vals"], self._buffers["max_vals"]
        if (kind is None or not self.accumulates or self.sync_every_step or self._padded_call
                or state_lo.shape != (count,)
                or not (state_lo.is_cpu and units.is_cpu or state_lo.device == units.device)):
            return super()._unit_minmax(units, count, ends)
        c = getattr(self, "averaging_constant", 0.0)
        # _observe: the state is already updated (a plain bool, set per call: without
        # nn.Module.__setattr__'s checks for parameters, buffers and modules)
        object.__setattr__(self, "_fused", True)
        # with ends (the CPU's) the kernel keeps no per-unit lo / hi: no scratch pair for them
        out = None if ends is not None else self._minmax_out(count)
        return unit_minmax(units, out, ends, (kind, c, state_lo, state_hi))

    @only_observes  # the op minmax_observe: forward's own steps in one launch
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the common CPU call: one C pass, its decisions cached
        if cpu_step(self, x, MinMaxStateObserver, MemorylessMinMaxObserver):
            return x
        units = self._one_op_units(x)
        if units is None:
            return super().forward(x)
        self.leave_inference_mode()
        minmax_observe(units, self.min_vals, self.max_vals, self.seen_non_finite,
                       self.observed_tokens, UPDATES[self.state_update],
                       getattr(self, "averaging_constant", 0.0), tokens_of(x))
        self.set_shape(x.shape)
        return x

    def _one_op_units(self, x) -> torch.Tensor | None:
        """``x``'s units where ``forward``'s whole step can be the op ``minmax_observe`` (off
        the CPU, once the state is sized: the common call of an activation observer), else
        None (the general path, which also raises what is wrong with ``x``)."""
        if not isinstance(x, torch.Tensor) or x.device.type == "cpu" or is_dtensor(x):
            return None  # the C kernels' path, or the general path's checks
        state, other = self.min_vals, self.max_vals
        if (self.state_update is None or not self.accumulates or not self.takes_minmax
                or not x.is_floating_point() or not x.numel() or state.dim() != 1
                or not state.numel() or not all(
                    t.device == x.device and t.dtype == torch.float32 and t.is_contiguous()
                    and t.shape == state.shape for t in (state, other))):
            return None
        try:
            self.spec.layout.check(x.shape)
        except ValueError:
            return None
        if self.spec.layout.pads_at(x.shape):  # forward takes the padding out of lo / hi
            return None
        units = op_units(x.detach() if x.requires_grad else x, self.spec.layout)
        return units if units is not None and op_unit_count(units) == state.numel() else None

    def _observe(self, units, lo, hi):
        if not self.accumulates:  # an instance keeping the last call's alone (Quark's dynamic)
            MemorylessMinMaxObserver._observe(self, units, lo, hi)
        elif self._fused:
            object.__setattr__(self, "_fused", False)
        elif self.min_vals.shape != lo.shape:  # first call (shape, not value: no host sync)
            # this call's scratch pair becomes the state, uncopied: later calls fuse their
            # update (no pair) or make one, so none is kept that no call writes
            s = self.__dict__.get("_scratch")
            if s is not None and s[0] is lo and s[1] is hi:
                del self.__dict__["_scratch"]
            else:
                lo, hi = lo.clone(), hi.clone()
            self.min_vals, self.max_vals = lo, hi
        else:
            self._update(lo, hi)

    def _update(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        update_state(self.state_update, getattr(self, "averaging_constant", 0.0),
                     self.min_vals, self.max_vals, lo, hi)

    def calculate_range(self):  # (the dict: nn.Module.__getattr__ costs a microsecond each)
        return self._buffers["min_vals"], self._buffers["max_vals"]


@register("memoryless_minmax")
class MemorylessMinMaxObserver(MinMaxStateObserver):
    """The range of the last tensor observed (weights; dynamic per-token activations)."""

    memoryless = True

    accumulates = False

    def _minmax_out(self, count):
        # the new min / max go straight into the state (in place, like the other families)
        return self.min_vals, self.max_vals

    def _unit_minmax(self, units, count, ends):
        lo, hi = super()._unit_minmax(units, count, ends)
        self._pending_ends = (ends, lo, hi)  # _observe makes them the state's
        return lo, hi

    def _observe(self, units, lo, hi):
        # (the dicts, not nn.Module.__setattr__: its checks cost microseconds each, per call)
        buffers = self._buffers
        if lo is not buffers["min_vals"]:  # new tensors (off the CPU): the state takes them
            buffers["min_vals"], buffers["max_vals"] = lo, hi
        # (getattr: the min-max state observers run this on an instance that does not
        # accumulate, as Quark's dynamic and per-group ones, which set no pending ends)
        e = getattr(self, "_pending_ends", None)
        ends = None
        # these lo / hi (not a step sync's), with the ends their pass found (CPU; None off it)
        if e is not None and e[0] is not None and e[1] is lo and e[2] is hi:
            ends = state_ends(e[0], lo, hi)
        self.__dict__.update(_pending_ends=None, _state_ends=ends)

    def global_amax(self):
        """NVFP4's whole-tensor amax from the ends the min / max pass found (no second read
        of the ranges); None (derive it from the ranges) once the state has changed since."""
        e = self._state_ends
        if (e is None or not self.spec.scale.has_global_scale or e[1]() is not self.min_vals
                or e[3]() is not self.max_vals or self.min_vals._version != e[2]
                or self.max_vals._version != e[4]):
            return None
        return amax_of_range(e[0][0].clamp(max=0), e[0][1].clamp(min=0))


@register("static_minmax")
class StaticMinMaxObserver(MinMaxStateObserver):
    """The running min and max over every tensor observed."""

    state_update = "min"


@register("minmax", "moving_average_minmax")
class MovingAverageMinMaxObserver(MinMaxStateObserver):
    """Exponential moving average of each batch's min and max (llm-compressor's ``minmax``).

    ``state += averaging_constant * (batch - state)``, as two rounded float32 ops
    (torch.ao's expression, so its EMA observers agree bitwise); the first batch
    initialises. The zero that qparams add to the range is not averaged in, nor the zero
    padding of a Block / Tile unit (its real values' min / max are).
    """

    def __init__(self, spec=None, *, averaging_constant: float = 0.01, **kwargs):
        super().__init__(spec, **kwargs)
        self.averaging_constant = self._averaging_constant(averaging_constant)

    #: ``state += c * (batch - state)``, torch.ao's rounding (compat classes may pick another)
    state_update = "ema"
    overflow_cause = EMA_OVERFLOW

    def calculate_range(self):
        return ordered(self.min_vals, self.max_vals)  # (the EMA's rounding can cross them)

    def sync_plan(self):
        # approximate unless sync_every_step (then exact): see quantscope.distributed
        return {"min_vals": AVG, "max_vals": AVG}

    def extra_repr(self):
        return f"{super().extra_repr()}, averaging_constant={self.averaging_constant}"


@register("placeholder")
class PlaceholderObserver(Observer):
    """For fp16 / bf16 casts: no range. qparams are scale 1, zero point 0 per unit."""

    family = "placeholder"

    accumulates = False

    def _observe(self, units, lo, hi):
        pass

    def sync_plan(self):
        return {}

    def calculate_range(self):
        self.check_ready()  # (no shape to give units to before a tensor was seen)
        n = self.spec.layout.num_units(self.shape)
        dev = self.observed_tokens.device
        return (torch.zeros(n, dtype=torch.float32, device=dev),
                torch.zeros(n, dtype=torch.float32, device=dev))

    def range_and_qparams(self, shape=None):  # calibrate reads this: its fixed qparams
        qp = self.qparams()
        return (*self.calculate_range(), qp if shape is None else qp.reshape(shape))

    def qparams(self):
        self.check_ready()
        shape = self.spec.layout.qparam_shape(self.shape)
        dev = self.observed_tokens.device
        # NVFP4: a global scale of 1 too (fake_quantize needs one), scale 1 / 1 as for the rest
        gs = (torch.ones(1, dtype=torch.float32, device=dev)
              if self.spec.scale.has_global_scale else None)
        return QParams(torch.ones(shape, dtype=torch.float32, device=dev),
                       torch.zeros(shape, dtype=torch.int32, device=dev), gs)
