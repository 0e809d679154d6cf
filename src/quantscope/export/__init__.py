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

__all__ = ["FORMATS", "check", "export", "export_run", "exporter", "register"]


def check(path) -> list[dict]:
    """The fused layers of a compressed-tensors checkpoint whose shards disagree on a scale the
    runtime keeps once (see :mod:`quantscope.export.consistency`); empty when all agree."""
    from .consistency import check as _check

    return _check(path)


def export(calibration, model, path, format: str = "compressed-tensors", **options):
    """Write ``calibration`` applied to ``model`` to ``path`` in ``format``; returns the path."""
    return exporter(format)(calibration, model, path, **options)


def export_run(run_dir, out, format: str = "compressed-tensors", model=None, *,
               overwrite: bool = False, allow_lossy: bool = False) -> str:
    """Export a saved calibration (what ``quantscope export RUN_DIR`` runs); returns the path.

    ``run_dir`` is a ``quantscope calibrate --out RUN`` folder (its ``qparams/``) or a
    qparams folder itself; ``model`` the model folder or demo name (default: the one the
    calibration recorded in ``info["model"]``).
    """
    import os

    from ..calibrate import load
    from ..demo import models

    run_dir = os.fspath(run_dir)
    qdir = os.path.join(run_dir, "qparams")
    qdir = qdir if os.path.isdir(qdir) else run_dir
    calibration = load(qdir)
    source = model or calibration.info.get("model")
    if not source:
        raise ValueError(f"export: {run_dir} does not record its model; pass model= (--model)")
    path = models.resolve_model_path(source)
    from .atomic import check_writable_target

    # before the (slow) load: the run and the model are inputs, never to be replaced
    check_writable_target(out, overwrite=overwrite, kind="file" if format == "onnx" else
                          "folder", inputs=[run_dir, qdir, path])
    float_model, tokenizer = models.load_model(path, task=calibration.info.get("task"))
    if calibration.smoothing:  # calibrated on SmoothQuant's weights: write those
        from ..calibrate.smooth import reapply

        reapply(float_model, calibration)
    if format == "onnx":  # a traced graph: the exporter runs the model on an example batch
        example = dict(tokenizer(["quantscope exports this model."], return_tensors="pt"))
        return export(calibration, float_model, out, format=format, overwrite=overwrite,
                      example_inputs=example)
    return export(calibration, float_model, out, format=format, overwrite=overwrite,
                  allow_lossy=allow_lossy, model_path=str(path))


class _CallableModule(type(__import__("sys"))):
    """``quantscope.export(calibration, model, path)`` calls :func:`export` while
    ``quantscope.export.register`` etc. stay reachable: the package itself is callable."""

    def __call__(self, calibration, model, path, format="compressed-tensors", **options):
        return export(calibration, model, path, format=format, **options)


__import__("sys").modules[__name__].__class__ = _CallableModule
