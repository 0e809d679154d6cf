"""Export a :class:`~quantscope.calibration.Calibration` to the formats runtimes load.

One module per format, each registering itself with :func:`register` (the name -> module
table is :data:`FORMATS`, in :mod:`.registry`, the one registration point); :func:`export`
dispatches by name. An exporter is a pure translation of a calibration (plus the model)
into the runtime's format, built with that format's own library; what the format cannot
express is an error before anything is written, and everything is written through
:func:`~quantscope.exporters.atomic.atomic_dir` / :func:`~quantscope.exporters.atomic.atomic_file`
(a temporary name renamed into place), so a failure leaves nothing that looks complete.
"""

from __future__ import annotations

from .registry import FORMATS, exporter, register

__all__ = ["FORMATS", "check", "export", "exporter", "register"]


def check(path) -> list[dict]:
    """The fused layers of a compressed-tensors checkpoint whose shards disagree on a scale the
    runtime keeps once (see :mod:`quantscope.exporters.consistency`); empty when all agree."""
    from .consistency import check as _check

    return _check(path)


def export(calibration, model, path, format: str = "compressed-tensors", **options):
    """Write ``calibration`` applied to ``model`` to ``path`` in ``format`` (a name in
    :data:`FORMATS`); returns the path. ``options`` are that format's exporter's keyword
    arguments: :func:`~quantscope.exporters.compressed_tensors.export_compressed_tensors`'s
    for ``"compressed-tensors"`` (``overwrite``, ``allow_lossy``, ``max_shard_size`` ...),
    :func:`~quantscope.exporters.onnx.export_onnx`'s for ``"onnx"`` (``example_inputs``,
    ``uint8``, ``external_data`` ...)."""
    return exporter(format)(calibration, model, path, **options)


# ``quantscope.export`` is the function :func:`export`, while the documented spellings
# ``quantscope.export.register``, ``.FORMATS``, ``.check`` ... keep working: each public name of
# this package is also an attribute of the function. Set here, once, so no module needs to swap
# its class to be callable (issue 36 item 5).
for _name in __all__:
    setattr(export, _name, globals()[_name])
del _name
