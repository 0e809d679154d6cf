"""Other toolkits' observer classes, with their own names and signatures.

Each module holds thin adapters over the native observers: a toolkit's
configuration (llm-compressor's ``QuantizationArgs``, Quark's ``QTensorConfig``,
Horizon's and torch.ao's keywords) is translated into a :class:`~quantscope.QuantSpec`
by ONE function per toolkit, a mixin class per toolkit turns the native
:class:`~quantscope.QParams` into the toolkit's return values, and each class is
``class Name(ToolkitMixin, NativeObserver)``. They register with a prefix
(``"llmcompressor:minmax"``, ``"quark:PerBlockMXObserver"``,
``"horizon:MinMaxObserver"``, ``"torch.ao:PerChannelMinMaxObserver"``,
``"modelopt:HistogramCalibrator"``; ModelOpt's calibrators add its ``collect`` /
``compute_amax`` API).

==========================  ===============================  ==========================
module                      translation function             mixin / base
==========================  ===============================  ==========================
``llmcompressor``           ``llmcompressor_spec(args)``     ``Observer`` (0.14's API)
``llmcompressor_legacy``    ``llmcompressor_spec(args)``     ``LLMCompressorObserver``
``quark``                   ``quark_spec(qspec)``            ``QuarkObserver``
``horizon``                 ``horizon_spec(**kwargs)``       ``HorizonObserver``
``torch_ao``                ``torch_ao_spec(**kwargs)``      ``TorchAOObserver``
``modelopt``                ``modelopt_spec(num_bits, ..)``  ``ModelOptCalibrator``
==========================  ===============================  ==========================

A new compat class for another native observer (MSE, histogram ...) is::

    @register("horizon:MSEObserver")
    class MSEObserver(HorizonObserver, NativeMSEObserver):
        def __init__(self, stride=1, averaging_constant=0.01, ..., **kwargs):
            super().__init__(..., **kwargs)   # unknown keywords go to the native class

llm-compressor has two observer API generations: ``llmcompressor`` is 0.14's (``forward``
returns the observer, ``get_qparams()`` a dict, statistics as attributes; its own registry,
``Observer.load_from_registry``), ``llmcompressor_legacy`` the seed's (``forward`` returns
``(scale, zero_point)``; registered here as ``"llmcompressor:<name>"``).

``torch_ao`` is the exception: its classes are torch.ao's own, subclassed
(``class HistogramObserver(TorchAOObserver, torch.ao...HistogramObserver)``), so that
torch.ao's state, TorchScript and every argument rule come with them unchanged; only the
histogram's step and search run quantscope's code.
"""

from __future__ import annotations

import enum
from typing import ClassVar

__all__ = ["SavesNoState", "UnsupportedInputError", "enum_name", "field"]


def field(config, name: str, default=None):
    """``config.name`` or ``config[name]``: configs are duck-typed (objects or dicts)."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def enum_name(value) -> str | None:
    """Lower-case name of an enum member or string (``QuantizationStrategy.GROUP`` ->
    ``"group"``)."""
    if value is None:
        return None
    if isinstance(value, enum.Enum):
        value = value.value if isinstance(value.value, str) else value.name
    return str(value).lower()


class UnsupportedInputError(TypeError, NotImplementedError):
    """An input dtype whose torch ops fail in the toolkit's observer (complex data in
    llm-compressor's, ``abs`` of a bool tensor in Quark's): a ``NotImplementedError`` as the
    toolkit's, and a ``TypeError`` as quantscope's bad-input errors."""


class SavesNoState:
    """Mixin, first in a compat class's bases: the toolkit's object keeps no state in a
    state_dict (Quark's non-persistent buffers, ModelOpt's calibrators, plain objects), so
    this one saves and loads nothing (before any load step of the native class), and a strict
    load flags any key under its prefix, as torch. ``_saves_state = True`` on a subclass
    saves the native state after all."""

    _saves_state: ClassVar[bool] = False

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self._saves_state:
            super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if self._saves_state:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                          missing_keys, unexpected_keys, error_msgs)
        elif strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix)
                                   and k[len(prefix):].split(".", 1)[0] not in self._modules)
