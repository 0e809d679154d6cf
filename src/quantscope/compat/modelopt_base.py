"""The mixin of :mod:`quantscope.compat.modelopt`'s calibrators (ModelOpt's arguments in,
``_num_bits`` / ``_axis`` / ``_unsigned`` settable after construction, pickled without the spec)
and how they read a batch's dtype and type its amax; that module re-exports the public names."""

from __future__ import annotations

import math

import torch

from ..observers import record
from . import SavesNoState
from .modelopt_spec import _axes, modelopt_spec

__all__ = ["ModelOptArgumentError", "ModelOptCalibrator"]

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # no abs / max kernels: read as float32


class ModelOptArgumentError(ValueError, AssertionError):
    """What ModelOpt asserts against: an ``AssertionError`` as ModelOpt's, and a
    ``ValueError`` as quantscope's bad-argument errors."""


def _is_integer(x) -> bool:
    return isinstance(x, torch.Tensor) and not (x.is_floating_point() or x.is_complex()
                                                or x.dtype == torch.bool)


def _upcast(x):
    """An fp8 batch as float32, as ModelOpt's ``reduce_amax`` reads it (fp8 has no abs / max /
    isfinite kernels): both calibrators' ``collect`` take it so."""
    return x.float() if getattr(x, "dtype", None) in FP8 else x


def _float_values(x):
    """``x`` as the native observer reads it: an integer or bool tensor as its float32 values
    (ModelOpt's histogram takes them; its ``MaxCalibrator`` refuses bool first); anything else
    as it is (the native checks name what is wrong)."""
    return x.float() if _is_integer(x) or getattr(x, "dtype", None) == torch.bool else x


def _squeezed(shape: tuple) -> tuple:
    """ModelOpt's amax shape: a single value is 0-d (``reduce_amax``'s ``squeeze_``)."""
    return () if math.prod(shape) == 1 else tuple(shape)


def _as_dtype(amax: torch.Tensor, dtype) -> torch.Tensor:
    """The float32 amax in the input's dtype; an integer one that float32 rounded past the
    dtype's top (int32's ``2 ** 31 - 1`` reads ``2 ** 31``) is the top, not a wrapped value."""
    if dtype.is_floating_point:
        return amax.to(dtype)
    below = math.nextafter(torch.iinfo(dtype).max + 1.0, 0.0)  # truncates to the top
    return amax.double().clamp(max=below).to(dtype)


class ModelOptCalibrator(SavesNoState):
    """Mixin (put it before the native class): ModelOpt's arguments in, ``_num_bits``,
    ``_axis`` and ``_unsigned`` kept as ModelOpt's ``_Calibrator`` keeps them, and settable
    after construction as its ``TensorQuantizer`` sets them (:meth:`_configure`)."""

    # SavesNoState: ModelOpt's calibrators are plain objects, so a TensorQuantizer holding
    # ours (its config takes a calibrator class) saves and loads only its own keys

    def __init__(self, num_bits=8, axis=None, unsigned=False, **native):
        if "spec" in native:
            raise TypeError(f"modelopt {type(self).__name__}: takes ModelOpt's arguments "
                            f"(num_bits, axis, unsigned), not a quantscope spec")
        super().__init__(modelopt_spec(num_bits, axis, unsigned), **native)
        self._config = (num_bits, axis, bool(unsigned))

    def _configure(self, i: int, value) -> None:
        """Set ``(num_bits, axis, unsigned)[i]``: the spec is rebuilt (checked first); a new
        axis starts from no data (the state is per unit of the old layout), the same axis
        (``0`` or ``(0,)``, as the block-quant path sets it every batch) keeps it."""
        config = list(self._config)
        config[i] = value
        self.spec = modelopt_spec(*config)
        before, self._config = self._config, (config[0], config[1], bool(config[2]))
        if i == 1 and not self._same_axis(before[1], value):
            self.reset()

    def _same_axis(self, before, after) -> bool:
        """Whether ``after`` keeps the units ``before`` did (the state is kept then)."""
        return _axes(before) == _axes(after)

    # pickled without the spec, rebuilt from ModelOpt's arguments: a saved calibrator holds no
    # quantscope class but its own (a safe global: torch.load(weights_only=True), as ModelOpt's)
    def __getstate__(self):
        return {k: v for k, v in super().__getstate__().items() if k != "spec"}

    def __setstate__(self, state):
        who = f"modelopt {type(self).__name__}: cannot unpickle a state"
        lost = [f for f in self._pickled_fields(state) if f not in state]
        if lost:
            raise ValueError(f"{who} without {', '.join(lost)} (pickled by another version, "
                             f"or edited); pickle a whole calibrator")
        config = state["_config"]
        if not (isinstance(config, tuple) and len(config) == 3):
            raise ValueError(f"{who} whose _config is {config!r}; expected ModelOpt's arguments "
                             f"(num_bits, axis, unsigned)")
        super().__setstate__(state)
        self.spec = modelopt_spec(*config)
        # load_state_dict checks a state's buffers against the layout; unpickling skips it
        record.check_units(self._buffers, "", self.spec.layout, self._sized_buffers(),
                           f"{self.describe()}: unpickling")

    def _pickled_fields(self, state) -> tuple[str, ...]:
        return ("_config",)  # what __setstate__ needs a state to hold (a subclass adds its own)

    _num_bits = property(lambda self: self._config[0],
                         lambda self, value: self._configure(0, value))
    _axis = property(lambda self: self._config[1], lambda self, value: self._configure(1, value))
    _unsigned = property(lambda self: self._config[2],
                         lambda self, value: self._configure(2, value))
