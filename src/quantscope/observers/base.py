"""The observer base: a ``torch.nn.Module`` that watches tensors and yields qparams.

``forward(x)`` validates ``x``, maps it to the spec layout's ``[units, elements]`` view in
float32, takes the per-unit min / max (the one pass every family needs) and hands all three to
:meth:`Observer._observe`; it returns ``x`` itself (an observer can sit in a hook or a model).

``calculate_qparams()`` asks :meth:`Observer.calculate_range` for per-unit ``(lo, hi)`` and
turns it into :class:`~quantscope.QParams` shaped for the layout of the last observed tensor.

Rules every subclass keeps:

* State lives in registered buffers, so ``state_dict()`` saves it, ``.to()`` moves it and
  ``torch.distributed`` can reduce it. Buffers whose size depends on the data start empty, are
  resized on first use and on load, and keep their tensor objects (:meth:`Observer._store`:
  torch.export keeps only in-place buffer writes, a CUDA graph replays on their memory).
  ``_extra_state`` records what they mean (layout, ``|x|`` histogram): no other meaning loads.
* No host synchronisation in ``forward``: no ``.item()``, no Python branch on a tensor value.
  Non-finite input is therefore *recorded* in forward (from the per-unit min / max, which NaN
  and inf reach) and reported by ``calculate_qparams`` as a ``ValueError`` naming the
  observer. With ``non_finite="ignore"`` NaN / inf are replaced by zero before anything is
  recorded (zero is always inside the range), counted, and a warning says how many were
  ignored, as torch.ao and TensorRT do.
"""

from __future__ import annotations

import warnings
from typing import ClassVar

import torch
from torch import nn

from .. import kernels
from .._checks import check_float32_range, check_number, check_spec, dtensor_error, is_dtensor
from ..qparams import QParams, qparams_from_range
from ..spec import QuantSpec
from ..stats.minmax import (
    KERNEL_MIN_NUMEL,
    MINMAX_DTYPES,
    extreme_ends,
    record_ends,
    record_non_finite,
    unit_minmax,
    zero_non_finite,
)
from ..stats.minmax_layouts import layout_minmax, unpad_minmax_
from . import record
from .overflow import range_overflow
from .shape import record_shape, tokens_of, units_before
from .step_cache import CACHES
from .sync import loaded_mark, step_sync, sync_observers, synced_record

__all__ = ["NON_FINITE_MODES", "Observer", "dtensor_error", "is_dtensor", "only_observes",
           "tokens_of"]

NON_FINITE_MODES = ("error", "ignore")


def only_observes(forward):
    """Marks a ``forward`` whose every step :meth:`Observer.observe_minmax` also takes (a
    faster route to the same state at most). A subclass overriding ``forward`` without it
    (Quark's keeps the input dtype and starts over on a new shape) is observed through its
    ``forward``, never grouped: :attr:`Observer.takes_minmax`."""
    forward.only_observes = True
    return forward


class Observer(nn.Module):
    """Base class of every quantscope observer.

    Args:
        spec: the quantization scheme (default: int8 per-tensor symmetric).
        non_finite: ``"error"`` (default) or ``"ignore"``; see the module doc.
    """

    #: the family the class belongs to ("minmax", "mse", "histogram", "imatrix", ...):
    #: recipes choose by it (histogram observers calibrate activations only)
    family: ClassVar[str] = ""
    #: True when the state is the last call's only (weights are observed once with these)
    memoryless: ClassVar[bool] = False
    #: registry name of the class (set by :func:`~quantscope.observers.registry.register`)
    name: str = "observer"
    #: sized buffers of one value for the whole tensor (NVFP4's global amax), not one per unit
    _one_value_buffers: ClassVar[tuple[str, ...]] = ()
    #: whether the per-unit state accumulates over calls (then the unit count must not change)
    accumulates: bool = True
    #: whether :meth:`_observe` reads ``units``; False (min-max family) lets forward take the
    #: per-unit min / max straight from the tensor and pass ``units=None``
    needs_units: bool = True
    #: whether :meth:`_observe` takes ``units`` in the input's own float dtype (what it does with
    #: them reads bf16 / fp16 exactly: the ops, the C kernels); False: a float32 copy (the
    #: min-max family's units are in the input's dtype on every device: only its min / max read)
    units_in_input_dtype: bool = False
    #: whether forward gives a unit with Block / Tile zero padding its real values' ``lo`` /
    #: ``hi`` (padding is no data: it moves no range, nor average); histograms do it themselves
    unpads: bool = True
    _padded_call: bool = False  # this call's units carry it (no state update fused then)
    _uncopied: ClassVar[tuple[str, ...]] = CACHES  #: no copy or pickle's: the steps' caches

    def __init__(self, spec: QuantSpec | None = None, *, non_finite: str = "error"):
        super().__init__()
        spec = QuantSpec() if spec is None else spec
        check_spec(type(self).__name__, spec)
        if non_finite not in NON_FINITE_MODES:
            raise ValueError(f"{type(self).__name__}: non_finite must be one of "
                             f"{NON_FINITE_MODES}, got {non_finite!r}")
        self.spec, self.non_finite = spec, non_finite
        self.register_buffer("observed_tokens", torch.zeros((), dtype=torch.int64))
        self.register_buffer("observed_shape", torch.zeros(0, dtype=torch.int64))
        self.register_buffer("non_finite_count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("seen_non_finite", torch.zeros((), dtype=torch.bool))
        self._last_shape: tuple[int, ...] | None = None

    # ------------------------------------------------------------------ observing
    @only_observes
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.leave_inference_mode()
        if not self.check_input(x):
            if self.sync_every_step:  # still take part in the step's collectives
                self.step_empty()
            return x
        layout = self.spec.layout
        padded = self.unpads and layout.pads_at(x.shape)
        if padded != self._padded_call:  # (nn.Module's setattr only when it changes)
            self._padded_call = padded
        minmax_only = not self.needs_units and self.non_finite == "error"
        # bf16 / fp16 read as they are where only the per-unit min / max read the data (the
        # C kernel, the ops) or the class's own code takes them (units_in_input_dtype), else
        # a float32 copy; detached only where needed (a detach is an op per call too)
        as_is = x.dtype in MINMAX_DTYPES and (minmax_only or self.units_in_input_dtype)
        x_read = x.detach() if x.requires_grad else x
        x_read = x_read if as_is else x_read.float()
        # a small CPU tensor: its units (contiguous: a cheap copy at most) in one C pass that
        # also finds the ends and updates the state, where torch takes a dozen small ops
        small = x_read.is_cpu and x_read.numel() < KERNEL_MIN_NUMEL
        fast = None
        if minmax_only and self.unpads and not small:  # (its padded units: real values')
            # min / max straight from x, no units copy (into this call's pair where it can)
            fast = layout_minmax(x_read, layout, self._minmax_out)
        units = None if fast is not None else layout.to_units(x_read)
        units = units.contiguous() if small else units
        count = units.shape[0] if fast is None else fast[0].shape[0]
        self._check_unit_count(count, x.shape)
        if self.non_finite == "ignore":
            units, bad = zero_non_finite(units)
            self.non_finite_count += bad
        ends = None  # smallest min and largest max, for the non-finite check
        if fast is None:
            # the C kernels find them in their pass; off the CPU one op checks lo / hi after
            ends = torch.empty(2, dtype=torch.float32) if units.device.type == "cpu" else None
            lo, hi = self._unit_minmax(units, count, ends)
            if padded:
                unpad_minmax_(layout, units, x.shape, lo, hi)
        else:
            lo, hi = fast
        if self.sync_every_step:  # exchange the step's statistic with the other ranks
            units, lo, hi = step_sync(self, units, lo, hi, self.sync_group)
            ends = None
        if self.non_finite == "error":
            self._record_non_finite(lo, hi, ends)
        self._observe(units, lo, hi)
        self.count_batch(x, direct=True)
        return x

    def check_input(self, x: torch.Tensor) -> bool:
        """Raise ``TypeError`` / ``ValueError`` naming this observer unless ``x`` is a plain
        (not a DTensor) floating-point tensor its layout can take (float64: within float32's
        range); False when ``x`` is empty (nothing to observe)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.describe()}: expected a torch.Tensor, got {type(x).__name__}")
        if is_dtensor(x):
            raise dtensor_error(self.describe(), x)
        if type(x) is not torch.Tensor and getattr(x, "fake_mode", None) and kernels.real():
            raise ValueError(f"{self.describe()}: a FakeTensor outside its FakeTensorMode has no "
                             f"memory to read; observe it inside `with x.fake_mode:`")
        if x.layout != torch.strided:
            raise TypeError(f"{self.describe()}: expected a dense tensor, got {x.layout}; "
                            f"pass x.to_dense()")
        if not x.is_floating_point():
            raise TypeError(f"{self.describe()}: expected a floating-point tensor, got {x.dtype}")
        if x.device != self.seen_non_finite.device:  # the state does not follow the input
            raise ValueError(f"{self.describe()}: input on {x.device}, the observer's state on "
                             f"{self.seen_non_finite.device}; move the observer first: "
                             f".to({str(x.device)!r})")
        if x.numel() == 0:
            return False
        try:
            self.spec.layout.check(x.shape)
        except ValueError as e:
            raise ValueError(f"{self.describe()}: {e}") from None
        # read as float32: a finite float64 past its range would turn inf, then read as
        # NaN / inf input (non_finite='ignore' would drop it as such)
        if x.dtype == torch.float64:  # (describe() is not free: only where it can be needed)
            check_float32_range(self.describe(), x)
        return True

    def _check_unit_count(self, count: int, shape) -> None:
        before = units_before(self) if self.accumulates else None
        if before is not None and before != count:
            layout = self.spec.layout
            raise ValueError(
                f"{self.describe()}: {layout} gave {count} units for shape "
                f"{tuple(shape)}, but {before} before; a {self.name} observer keeps "
                f"per-unit state, so the unit count must not change (use a memoryless "
                f"observer for dynamic per-token ranges)")

    @property
    def takes_minmax(self) -> bool:
        """Whether :meth:`observe_minmax` can stand for ``forward``: the state follows from
        the per-unit min / max alone (``needs_units = False``), non-finite input is an
        error, no step exchange runs in ``forward``, and ``forward`` does nothing else
        (:func:`only_observes`)."""
        return (not self.needs_units and self.non_finite == "error" and not self.sync_every_step
                and getattr(type(self).forward, "only_observes", False))

    def observe_minmax(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """``forward(x)`` where ``x``'s per-unit ``lo`` / ``hi`` (float32 ``[U]``, the
        layout's unit order, NaN propagated) were taken elsewhere, e.g. many weights' in one
        grouped launch (:func:`quantscope.observers.observe_many`). They are handed over:
        the state may keep them (a memoryless observer does) or write its update into them
        (a moving average does), so pass copies where you read them after. Only where
        :attr:`takes_minmax`; ``x`` must pass :meth:`check_input`."""
        if not self.takes_minmax:
            raise TypeError(f"{self.describe()}: observe_minmax needs an observer whose state "
                            f"follows from the per-unit min / max (min-max family, "
                            f"non_finite='error', no sync_every_step); call it on the tensor")
        count = self.spec.layout.num_units(tuple(x.shape))
        if {(t.dtype, tuple(t.shape)) for t in (lo, hi)} != {(torch.float32, (count,))}:
            raise ValueError(f"{self.describe()}: lo and hi must be float32 of the {count} "
                             f"units of shape {tuple(x.shape)} under {self.spec.layout}, got "
                             f"{lo.dtype} {tuple(lo.shape)} and {hi.dtype} {tuple(hi.shape)}")
        self._check_unit_count(count, x.shape)
        self.leave_inference_mode()
        self._record_non_finite(lo, hi)
        self._observe(None, lo.detach(), hi.detach())  # statistics keep no autograd graph
        self.count_batch(x)

    def count_batch(self, x: torch.Tensor, direct: bool = False) -> None:
        """Count ``x``'s tokens into ``observed_tokens`` and record its shape (the end of
        every ``forward``). ``direct``: an eager CPU counter is added through its memory
        (:func:`quantscope.kernels.add`), not by a tensor op (``forward``'s own count: a
        dispatch costs more than a small batch's whole C pass)."""
        tokens = tokens_of(x)
        if not (direct and kernels.add(self.observed_tokens, tokens)):
            self.observed_tokens.add_(tokens)  # add_, not +=: no nn.Module.__setattr__
        self.set_shape(x.shape)

    def _unit_minmax(self, units: torch.Tensor, count: int, ends: torch.Tensor):
        """This call's per-unit ``(lo, hi)`` (a class may fuse its state update in here)."""
        return unit_minmax(units, self._minmax_out(count), ends)

    def _minmax_out(self, count: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Two ``[count]`` tensors forward may write this call's per-unit min / max into
        (reused memory is much faster than fresh pages); None: new tensors. Only for
        classes that do not keep references to an earlier call's ``lo`` / ``hi``."""
        return None

    def leave_inference_mode(self) -> None:
        """Outside ``torch.inference_mode()``, buffers made under it (``quantscope.calibrate``
        observes there) become normal clones: torch refuses in-place updates of inference
        tensors there, where torch.ao's observers go on. Before every update; no host sync."""
        if not (torch.compiler.is_compiling() or torch.is_inference_mode_enabled()):
            for name, buf in self._buffers.items():
                if buf is not None and buf.is_inference():
                    self._buffers[name] = buf.clone()

    def _record_non_finite(self, lo: torch.Tensor, hi: torch.Tensor,
                           ends: torch.Tensor | None = None) -> None:
        # NaN / inf reach a unit's min or max, so the smallest min / largest max hold them
        # (an all-(+inf) unit has min +inf): two values to test (``ends``: unit_minmax's)
        if ends is None and lo.device.type != "cpu" and lo.dim() == 1 \
                and lo.dtype == hi.dtype == torch.float32:
            record_non_finite(lo, hi, self.seen_non_finite)  # one launch where torch takes seven
            return
        record_ends(extreme_ends(lo, hi) if ends is None else ends, self.seen_non_finite)

    def set_shape(self, shape):
        """Record the shape of the last observed tensor (the sync sets the agreed one)."""
        record_shape(self, shape)  # and its Python mirror, so forward never reads a device tensor

    def _observe(self, units: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """Update the statistics from ``units [U, E]`` (float32; the min-max family's in the
        input's dtype, unread) and its per-unit ``lo``, ``hi`` (float32).

        ``units`` is None when the class sets ``needs_units = False`` and the layout has a
        direct min / max path (:func:`~quantscope.stats.minmax_layouts.layout_minmax`)."""
        raise NotImplementedError

    # --------------------------------------------------------------- computing
    def calculate_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-unit ``(lo, hi)`` the qparams are computed from (``[U]`` tensors)."""
        raise NotImplementedError

    def global_amax(self) -> torch.Tensor | None:
        """Whole-tensor absolute maximum for formats with a global scale (NVFP4); None: derive."""
        return None

    def calculate_qparams(self) -> QParams:
        """Scale and zero point (and NVFP4 global scale) shaped for the last observed tensor.

        Compat classes override this to return their toolkit's values; :meth:`qparams`
        always returns the native :class:`~quantscope.QParams`."""
        return self.qparams()

    def qparams(self) -> QParams:
        """The native :class:`~quantscope.QParams`, shaped for the last observed tensor."""
        return self.range_and_qparams()[2]

    def range_and_qparams(self, shape=None) -> tuple[torch.Tensor, torch.Tensor, QParams]:
        """``(lo, hi, qparams)`` of one range estimate (a search runs once), the qparams shaped
        ``shape`` (default: the layout's, for the last tensor observed; a compat class's own)."""
        self.check_ready()
        lo, hi = self.calculate_range()
        shape = self.spec.layout.qparam_shape(self.shape) if shape is None else shape
        try:
            return lo, hi, qparams_from_range(lo, hi, self.spec, global_amax=self.global_amax(),
                                              shape=shape)
        except ValueError as err:  # no NaN / inf came in (check_ready): did the state overflow?
            raise range_overflow(self, lo, hi) or err

    @property
    def shape(self) -> tuple[int, ...] | None:
        """Shape of the last observed tensor (None before the first)."""
        return self._last_shape

    @property
    def has_observed(self) -> bool:
        """Whether a non-empty tensor was observed (or such a state loaded) since :meth:`reset`."""
        return self._last_shape is not None

    def check_ready(self, warn: bool = True) -> None:
        """Raise ``ValueError`` if nothing was observed or NaN / inf was seen (mode ``error``);
        ``warn``: say how many were ignored (mode ``ignore``; once per qparams read)."""
        if not self.has_observed:
            raise ValueError(f"{self.describe()}: calculate_qparams() called before any tensor was "
                             f"observed; call the observer on calibration data first")
        flags = (self._buffers["seen_non_finite"], self._buffers["non_finite_count"])
        if flags[0].is_meta:  # (bool() would raise torch's bare .item() error)
            raise ValueError(f"{self.describe()}: its state is on the meta device, which holds "
                             f"no statistics to compute qparams from; observe on a real device")
        seen, count = flags if flags[0].is_cpu else torch.stack(flags).tolist()  # one sync
        if bool(seen):
            raise ValueError(f"{self.describe()}: observed NaN or inf values; fix the input or "
                             f"construct the observer with non_finite='ignore' to skip them")
        if warn and (count := int(count)):
            warnings.warn(f"{self.describe()}: ignored {count} NaN / inf values", stacklevel=3)

    def reset(self) -> None:
        """Forget everything observed (buffers that hold settings are kept)."""
        self.leave_inference_mode()
        keep = self._setting_buffers()
        for name, buf in self.named_buffers(recurse=False):
            if name in keep:
                continue  # a constructor setting (e.g. imatrix importance), not observed state
            if name in self._sized_buffers() or name == "observed_shape":
                setattr(self, name, buf.new_zeros(0))  # a fresh observer's (hist_counts too)
            else:
                buf.zero_()
        self._last_shape = None
        self._synced = None

    # -------------------------------------------------------------- distributed
    #: exchange every call's statistic across processes before the update (exact moving
    #: averages; puts collectives in forward); see :mod:`quantscope.distributed`
    sync_every_step: bool = False
    #: process group of the step exchange (None: the default group)
    sync_group = None
    #: the counters as of the last sync (set, and saved with the state, by
    #: :mod:`quantscope.observers.sync`: a later sync adds what came since); None: unsynced
    _synced: dict | None = None

    #: in ``sync_every_step`` mode, exchange only each step's per-unit range (min-max
    #: observers); False: gather the step's units from every rank
    step_sync_range_only: bool = False

    def sync_plan(self):
        """How the state reduces across processes: ``{buffer: MIN | MAX | SUM | AVG}`` (the
        :class:`~quantscope.comm.Op` vocabulary) and :class:`~quantscope.comm.CustomSync` items
        (e.g. :class:`~quantscope.stats.histogram_sync.HistogramSync`). The base's counters and
        flags are synced by :mod:`quantscope.observers.sync` itself. Every family overrides
        it; a subclass written against the earlier private name ``_sync_plan`` still works."""
        legacy = getattr(type(self), "_sync_plan", None)
        if legacy is not None:
            return legacy(self)
        raise NotImplementedError

    def sync(self, group=None) -> Observer:
        """Make the state the same on every rank of ``group`` (default: :attr:`sync_group`,
        else the default group); a no-op outside ``torch.distributed``."""
        sync_observers([self], self.sync_group if group is None else group)
        return self

    def step_empty(self, group=None) -> None:
        """Take part in this step's exchange without data (``sync_every_step`` mode)."""
        self.leave_inference_mode()
        out = step_sync(self, None, None, None, group or self.sync_group)
        if out is not None:
            units, lo, hi = out
            if self.non_finite == "error":
                self._record_non_finite(lo, hi)
            self._observe(units, lo, hi)

    # ------------------------------------------------------------------ helpers
    def __getstate__(self):  # (deepcopy, pickle, torch.save) without the caches (_uncopied)
        return {k: v for k, v in super().__getstate__().items() if k not in self._uncopied}

    def _apply(self, fn, recurse=True):
        # a module cast (model.to(torch.bfloat16), .half()) moves the state, keeps its dtypes:
        # float32 statistics rounded to bf16 would clip ranges inward and accumulate in bf16
        before = {n: b for n, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        for n, old in before.items():
            new = self._buffers.get(n)
            if new is not None and new.dtype != old.dtype:
                self._buffers[n] = old.to(new.device)
        return self

    def _sized_buffers(self) -> tuple[str, ...]:
        """Buffers whose shape follows the data (resized on first use and on load)."""
        return ()

    def _setting_buffers(self) -> tuple[str, ...]:
        """Buffers holding a constructor setting, not state: kept by :meth:`reset`, sized on
        load."""
        return ()

    def _store(self, names, values) -> None:
        """Buffers ``names`` take ``values`` as the same tensor objects (see the module doc)."""
        bufs = [self._buffers[n] for n in names]
        if all(b is v for b, v in zip(bufs, values)):  # updated in place (an op's ``(a!)``)
            return
        if bufs[0].is_cpu and not torch.compiler.is_compiling():  # eager: no copy, no checks
            for b, v in zip(bufs, values):
                b.data = v
        elif all(b.shape == v.shape and b.dtype == v.dtype for b, v in zip(bufs, values)):
            torch._foreach_copy_(bufs, list(values))  # in place: one launch on CUDA
        else:  # a first batch, a new unit count
            self._buffers.update(zip(names, values))  # not __setattr__: microseconds each

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        self.leave_inference_mode()  # the load copies into the buffers
        record.check_units(state_dict, prefix, self.spec.layout, self._sized_buffers(),
                           self.describe(), self._one_value_buffers)
        record.check(state_dict, prefix, self._state_record(), self.describe())
        partial = record.partial(state_dict, prefix, self._sized_buffers(), self.describe())
        if partial:  # as a size mismatch is: an error under strict=False too
            error_msgs.append(partial)
        # sized buffers take the saved shape before the copy, so a fresh observer loads any state
        for name in (*self._sized_buffers(), *self._setting_buffers(), "observed_shape"):
            key = prefix + name
            if key in state_dict and (old := getattr(self, name)).shape != state_dict[key].shape:
                setattr(self, name, torch.empty_like(state_dict[key], dtype=old.dtype,
                                                     device=old.device))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        missing_keys[:] = [k for k in missing_keys if k != prefix + record.RECORD]  # older state
        self._synced = loaded_mark(self, state_dict, prefix)  # None: this rank's own state
        # the Python mirror of the shape comes from the saved tensors (readable on the meta
        # device too); a state without them leaves it alone
        tokens, shape = (state_dict.get(prefix + k) for k in ("observed_tokens", "observed_shape"))
        if tokens is not None and shape is not None and not tokens.is_meta and not shape.is_meta:
            self._last_shape = tuple(shape.tolist()) if int(tokens) > 0 else None

    def _state_record(self) -> dict:
        """What the state means (layout; histograms: of ``|x|``?), saved with it; a subclass
        adds entries it takes back in ``set_extra_state``."""
        absolute = getattr(self, "_absolute", None)  # histogram observers set it
        order = getattr(self.spec.layout, "order", None)  # act-order groups' column order
        return {"layout": self.spec.layout.spec_name(), **synced_record(self),
                **({} if absolute is None else {"absolute": bool(absolute)}),
                **({} if order is None else {"order": order})}

    def get_extra_state(self) -> torch.Tensor:
        return record.encode(self._state_record())

    def set_extra_state(self, state) -> None:
        """A subclass takes its own entries back here (the base's were checked before)."""

    def _averaging_constant(self, c: float | None, *, optional: bool = False) -> float | None:
        """Validate an EMA constant (``None`` allowed where the moving average is optional)."""
        if c is None and optional:
            return None
        name = "averaging_constant (or None)" if optional else "averaging_constant"
        return check_number(type(self).__name__, name, c, 0, 1, lo_open=True)  # numpy's too

    def describe(self) -> str:
        """``Class(name, spec)``: how errors name this observer."""
        return f"{type(self).__name__}({self.name!r}, {self.spec})"

    # the earlier private names, for code written against them (other branches, users)
    _who = describe
    _set_shape = set_shape
    _step_empty = step_empty

    def extra_repr(self) -> str:
        return f"spec={self.spec}"
