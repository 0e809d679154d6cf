"""Export a :class:`~quantscope.calibrate.Calibration` to the formats runtimes load.

One module per format, each registering itself with :func:`register`; :func:`export`
dispatches by name. An exporter is a pure translation of a calibration (plus the model)
into the runtime's format, built with that format's own library; what the format cannot
express is an error before anything is written, and everything is written through
:func:`~quantscope.export.atomic.atomic_dir` / :func:`~quantscope.export.atomic.atomic_file`
(a temporary name renamed into place), so a failure leaves nothing that looks complete.

Formats are imported lazily (their libraries are optional extras): the name -> module
table below is the one registration point.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from .check import check

__all__ = ["FORMATS", "check", "export", "exporter", "register"]

#: format name -> the module that registers it (imported on first use)
FORMATS: dict[str, str] = {
    "compressed-tensors": "quantscope.export.compressed_tensors",
    "onnx": "quantscope.export.onnx",
}

_EXPORTERS: dict[str, Callable] = {}


def register(name: str):
    """Decorator: ``@register("onnx") def export_onnx(calibration, model, path, **options)``."""
    def deco(fn):
        _EXPORTERS[name] = fn
        return fn
    return deco


def exporter(name: str) -> Callable:
    """The export function registered for format ``name``."""
    if name not in FORMATS and name not in _EXPORTERS:
        raise ValueError(f"export: unknown format {name!r}; expected one of {sorted(FORMATS)}")
    if name not in _EXPORTERS:
        importlib.import_module(FORMATS[name])
    return _EXPORTERS[name]


def export(calibration, model, path, format: str = "compressed-tensors", **options):
    """Write ``calibration`` applied to ``model`` to ``path`` in ``format``; returns the path."""
    return exporter(format)(calibration, model, path, **options)
