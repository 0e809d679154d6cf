"""``quantscope export`` (a saved run as a checkpoint runtimes load) and ``quantscope
check`` (a compressed-tensors checkpoint's scales, fused layers and schemes hold)."""

from __future__ import annotations

import argparse
import os

from .checks import UsageError, check_model_arg, check_name, run_model_path, run_qparams
from .options import add_other_weights_arg
from .running import Phases

#: what each format writes, where it is not a folder
OUTPUT_KIND = {"onnx": "file"}


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="write a saved calibration as a checkpoint runtimes load",
                       description="Export a `quantscope calibrate --out RUN` folder (or its "
                                   "qparams/) as a model folder runtimes load "
                                   "(compressed-tensors: transformers, vLLM).")
    p.add_argument("run", metavar="RUN", help="a calibrate output folder or its qparams/")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the model folder to write (a file for --format onnx)")
    p.add_argument("--model", metavar="PATH", default=None,
                   help="the float model (default: the one the run recorded)")
    p.add_argument("--format", default="compressed-tensors", help="default: compressed-tensors")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing DIR (or file) that quantscope wrote earlier")
    p.add_argument("--allow-lossy", action="store_true",
                   help="compressed-tensors: write what the format cannot express exactly "
                        "in its nearest form (says what changed) instead of refusing")
    p.add_argument("--external-data", action=argparse.BooleanOptionalAction, default=None,
                   help="onnx: the weights in a data file FILE.<16 hex digits>.data beside "
                        "FILE (default: only for a model over protobuf's 2 GiB); "
                        "--no-external-data: one file, a larger model refused")
    add_other_weights_arg(p)


def add_check_parser(sub) -> None:
    p = sub.add_parser("check", help="check a compressed-tensors checkpoint's scales, fused "
                                     "layers and schemes",
                       description="List the fused layers (q/k/v, gate/up, w1/w3, MLA q_a/kv_a) "
                                   "whose shards disagree on a scale the runtime keeps once or "
                                   "on their scheme, whose fp8 weight blocks straddle two "
                                   "shards, the scales that are not finite and > 0, and the "
                                   "config groups vLLM has no scheme for; exit 1 if any.")
    p.add_argument("path", metavar="DIR", help="a compressed-tensors checkpoint folder")


def cmd_export(args) -> int:
    if not os.path.isdir(args.run):
        raise UsageError(f"export: {args.run!r} is not a folder")
    qparams = run_qparams(args.run)
    check_model_arg(args.model)
    from ..exporters import FORMATS
    from ..exporters.atomic import check_writable_target

    args.format = check_name(args.format, sorted(FORMATS), "format")  # any case, as names
    if args.allow_lossy and args.format != "compressed-tensors":  # else it would do nothing
        raise UsageError(f"--allow-lossy applies to --format compressed-tensors only (its "
                         f"packed formats), not {args.format}")
    if args.external_data is not None and args.format != "onnx":
        flag = "--external-data" if args.external_data else "--no-external-data"
        raise UsageError(f"{flag} applies to --format onnx only, not {args.format}")
    try:  # the run and the model are inputs: --out may never replace them
        kind = OUTPUT_KIND.get(args.format, "folder")
        check_writable_target(args.out, overwrite=args.overwrite, kind=kind, inputs=[
            args.run, qparams, args.model], what=args.format if kind == "folder" else None)
    except (OSError, ValueError) as e:
        raise UsageError(f"--out: {e}") from None
    phases = Phases()
    out = phases.run(f"exporting {args.run} as {args.format}", lambda: export_run(
        args.run, args.out, args.format, args.model, overwrite=args.overwrite,
        allow_lossy=args.allow_lossy, allow_other_weights=args.allow_other_weights,
        external_data=args.external_data))
    print(f"quantscope export: wrote {out} ({args.format})")
    return 0


def cmd_check(args) -> int:
    if not os.path.isfile(os.path.join(args.path, "config.json")):
        raise UsageError(f"check: {args.path!r} is not a model folder (no config.json)")
    from ..exporters.consistency import check, format_problems

    problems = check(args.path)
    if problems:
        print(format_problems(problems))
        return 1
    print(f"{args.path}: the scales, the fused layers' shards and the schemes agree")
    return 0


def export_run(run_dir, out, format: str = "compressed-tensors", model=None, *,
               overwrite: bool = False, allow_lossy: bool = False,
               allow_other_weights: bool = False, external_data: bool | None = None) -> str:
    """Export a saved calibration (what ``quantscope export RUN_DIR`` runs); returns the path.

    ``run_dir`` is a ``quantscope calibrate --out RUN`` folder (its ``qparams/``) or a
    qparams folder itself; ``model`` the model folder or demo name (default: the one the
    calibration recorded in ``info["model"]``); ``allow_other_weights``: its weights go
    unchecked (``Calibration.without_fingerprints``); ``external_data``: ONNX only, as
    :func:`~quantscope.exporters.onnx.export_onnx` takes it.
    """
    from ..calibration import load
    from ..calibration.choice.smooth import reapply
    from ..demo import models
    from ..exporters import export
    from ..exporters.atomic import check_writable_target

    if external_data is not None and format != "onnx":  # else it would do nothing
        raise ValueError(f"external_data applies to format='onnx' only, not {format!r}")
    run_dir = os.fspath(run_dir)
    qdir = os.path.join(run_dir, "qparams")
    qdir = qdir if os.path.isdir(qdir) else run_dir
    calibration = load(qdir)
    if allow_other_weights:
        calibration = calibration.without_fingerprints()
    path = run_model_path("export", run_dir, model, calibration.info.get("model"))
    # what the calibration alone decides, before the (slow) load
    if format == "onnx":
        from ..exporters.onnx import check_exportable

        check_exportable(calibration.states)
    elif format == "compressed-tensors":
        from ..exporters.compressed_tensors import check_static_weights

        check_static_weights(calibration.states)
    # before the (slow) load: the run and the model are inputs, never to be replaced
    kind = OUTPUT_KIND.get(format, "folder")
    check_writable_target(out, overwrite=overwrite, kind=kind, inputs=[run_dir, qdir, path],
                          what=format if kind == "folder" else None)
    float_model, tokenizer = models.load_model(path, task=calibration.info.get("task"))
    if calibration.smoothing:  # calibrated on SmoothQuant's weights: write those
        reapply(float_model, calibration)
    if format == "onnx":  # a traced graph: the exporter runs the model on an example batch
        # of two equal sentences: torch.export fixes a dimension of size 1 (a batch-1 graph
        # fails on other batch sizes), and equal lengths need no pad token
        example = dict(tokenizer(["quantscope exports this model."] * 2, return_tensors="pt"))
        return export(calibration, float_model, out, format=format, overwrite=overwrite,
                      example_inputs=example, external_data=external_data)
    return export(calibration, float_model, out, format=format, overwrite=overwrite,
                  allow_lossy=allow_lossy, model_path=str(path))
