"""The export formats' one registration point: which module writes (and reads) each format.

A format module registers its writer with :func:`register` (and a reader, where the format
can be read back, with :func:`register_reader`); the tables below name the module of each
format, imported on first use (their libraries are optional extras). A new format is one
module under ``exporters/`` and one line in :data:`FORMATS`.

This module sits in the core layer (beside :mod:`.atomic`, and like
:mod:`quantscope.observers.registry`, it holds names, not the formats' code), so that
``Calibration.export`` and ``Calibration.from_compressed_tensors`` reach a format through
it without importing the export layer.

Inside a process group of more than one process, every registered writer writes a
calibration made across the group (or read from disk) on its ``writer_rank`` only, as
transformers' ``save_pretrained`` on the main process: the other ranks return the path at
once, with no collective, and log that they wrote nothing (:func:`register` wraps the
writer, so no format can forget it). A calibration this process made alone (``writer_rank``
None) is written where it is exported.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable

from .._plainchecks import check_path

__all__ = ["FORMATS", "READERS", "exporter", "reader", "register", "register_reader"]

#: format name -> the module that registers its writer
FORMATS: dict[str, str] = {
    "compressed-tensors": "quantscope.exporters.compressed_tensors",
    "onnx": "quantscope.exporters.onnx",
}
#: format name -> the module that registers its reader (checkpoint -> Calibration)
READERS: dict[str, str] = {
    "compressed-tensors": "quantscope.exporters.read",
}

_writers: dict[str, Callable] = {}
_readers: dict[str, Callable] = {}


def register(name: str, check: Callable | None = None):
    """Decorator: ``@register("onnx") def export_onnx(calibration, model, path, **options)``;
    the writer it returns (and registers) writes on the calibration's writer only (module
    doc). ``check``: the
    writer's checks of its arguments that need neither the disk nor a collective (the model's
    type, the options), run on every rank with the writer's arguments by name (defaults
    applied; ``**options`` as one dict)."""
    def deco(fn):
        _writers[name] = _on_writer(fn, name, check)
        return _writers[name]
    return deco


def _on_writer(write: Callable, name: str, check: Callable | None) -> Callable:
    """``write(calibration, model, path, **options)`` run on the calibration's ``writer_rank``
    (or outside a process group of several); another rank writes nothing and returns
    ``path`` as the writer does (its absolute path), at once: no collective, so a caller
    that exports on the writer alone does not hang, and ranks sharing one path do not race
    (a reader waits at a barrier). Every rank checks the arguments first: a wrong one raises
    everywhere, not on the writer alone."""
    @functools.wraps(write)
    def writer(calibration, model, path, **options):
        _check_arguments(name, calibration, path)
        calibration.check_model(model, "export")  # its model (SmoothQuant: smoothed once)
        try:  # an option the writer does not take, as the call itself would say
            bound = inspect.signature(write).bind(calibration, model, path, **options)
        except TypeError as e:
            raise TypeError(f"{write.__name__}() {e}") from None
        if check is not None:
            bound.apply_defaults()
            check(**bound.arguments)
        from .. import comm  # here: importing the exporters (their atomic writes) needs no torch

        if not comm.writes_here(getattr(calibration, "writer_rank", None), f"export {name}",
                                path):
            return os.path.abspath(os.fspath(path))
        return write(calibration, model, path, **options)
    return writer


def _check_arguments(name: str, calibration, path) -> None:
    # by its states, not its class: the export layer sits below calibration (test_layering)
    if not isinstance(getattr(calibration, "states", None), dict):
        raise TypeError(f"export {name}: calibration must be a Calibration (what calibrate() "
                        f"returns), got {type(calibration).__name__}")
    check_path(f"export {name}", path)


def register_reader(name: str):
    """Decorator: ``@register_reader("compressed-tensors") def read(path) -> Calibration``."""
    def deco(fn):
        _readers[name] = fn
        return fn
    return deco


def _lookup(what: str, table: dict[str, str], found: dict[str, Callable], name: str):
    if name not in table and name not in found:
        raise ValueError(f"{what}: unknown format {name!r}; expected one of {sorted(table)}")
    if name not in found:
        importlib.import_module(table[name])
    return found[name]


def exporter(name: str) -> Callable:
    """The export function registered for format ``name``."""
    return _lookup("export", FORMATS, _writers, name)


def reader(name: str) -> Callable:
    """The function that reads a checkpoint of format ``name`` into a Calibration."""
    return _lookup("read", READERS, _readers, name)
