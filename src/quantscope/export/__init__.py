"""Export a :class:`~quantscope.calibrate.Calibration` to the formats runtimes load.

One module per format, each registering itself with :func:`register` (the name -> module
table is :data:`FORMATS`, in :mod:`.registry`, the one registration point); :func:`export`
dispatches by name. An exporter is a pure translation of a calibration (plus the model)
into the runtime's format, built with that format's own library; what the format cannot
express is an error before anything is written, and everything is written through
:func:`~quantscope.export.atomic.atomic_dir` / :func:`~quantscope.export.atomic.atomic_file`
(a temporary name renamed into place), so a failure leaves nothing that looks complete.
"""

from __future__ import annotations

from .registry import FORMATS, exporter, register

__all__ = ["FORMATS", "check", "export", "exporter", "register"]


def check(path) -> list[dict]:
    """The fused layers of a compressed-tensors checkpoint whose shards disagree on a scale the
    runtime keeps once (see :mod:`quantscope.export.consistency`); empty when all agree."""
    from .consistency import check as _check

    return _check(path)


def export(calibration, model, path, format: str = "compressed-tensors", **options):
    """Write ``calibration`` applied to ``model`` to ``path`` in ``format``; returns the path."""
    return exporter(format)(calibration, model, path, **options)


class _CallableModule(type(__import__("sys"))):
    """``quantscope.export(calibration, model, path)`` calls :func:`export` while
    ``quantscope.export.register`` etc. stay reachable: the package itself is callable."""

    def __call__(self, calibration, model, path, format="compressed-tensors", **options):
        return export(calibration, model, path, format=format, **options)


__import__("sys").modules[__name__].__class__ = _CallableModule
