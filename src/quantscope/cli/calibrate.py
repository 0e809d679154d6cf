"""``quantscope calibrate`` (one recipe: calibrate, evaluate, save) and ``quantscope
evaluate`` (a saved run's qparams applied again)."""

from __future__ import annotations

import os
import shlex
import time

from .checks import (
    UsageError,
    check_calib_file,
    check_library_args,
    check_model_arg,
    check_out,
    check_recipe_args,
    run_model_path,
    run_qparams,
)
from .names import TASKS
from .options import add_common, add_other_weights_arg, add_recipe_args, add_threads_arg
from .recipes import build_recipe, float_note, observer_label, read_recipe_file
from .running import (
    Evaluator,
    Phases,
    calibration_options,
    command_inputs,
    fit_length,
    load_setup,
    metric_line,
    resolve_device,
    set_threads,
)


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="calibrate one recipe, evaluate, save qparams and report",
                       description="Calibrate a model with one recipe, apply the qparams (QDQ), "
                                   "evaluate against float, and save the qparams and report.")
    add_recipe_args(p)
    add_common(p, "runs/calibrate")


def add_evaluate_parser(sub) -> None:
    p = sub.add_parser("evaluate", help="apply saved qparams (no calibration) and evaluate",
                       description="Apply the qparams of a `quantscope calibrate` run (its "
                                   "folder or its qparams/) to the model it recorded, and "
                                   "evaluate against float.")
    p.add_argument("run", metavar="RUN", help="a calibrate output folder (or its qparams/)")
    p.add_argument("--model", metavar="PATH", default=None,
                   help="the float model (default: the one the run recorded)")
    p.add_argument("--task", choices=TASKS, default=None, help="default: the run's")
    p.add_argument("--device", default="auto")
    p.add_argument("--eval-max-length", type=int, default=None, help="default: the run's")
    add_threads_arg(p)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON line")
    add_other_weights_arg(p)


def cmd_calibrate(args) -> int:
    check_recipe_args(args)
    check_model_arg(args.model)
    check_calib_file(args)
    check_out(args.out, command_inputs(args), what="calibrate-run")
    check_library_args(args)  # imports torch: after the checks above, which need none
    if args.recipe_file:  # read now (its Recipe imports torch), before the model loads
        read_recipe_file(args.recipe_file)
    from ..calibration import calibrate

    phases = Phases(quiet=getattr(args, "rank", 0) != 0)
    t0 = time.perf_counter()
    model, batches, ev, fp, setup, rec = load_setup(args, phases,
                                                    lambda m: build_recipe(args, m))
    calib = phases.run(f"calibrating {rec.name} ({setup['calib_docs']} documents, "
                       f"{setup['calib_tokens']} tokens)",
                       lambda: calibrate(model, batches, rec, **calibration_options(args)))
    if getattr(args, "rank", 0) != 0:  # torchrun: rank 0 evaluates, writes and prints
        return 0
    t = time.perf_counter()
    q = phases.run("evaluating quantized", lambda: ev.quantized(calib))
    observer = observer_label(rec)
    calib.label = f"{rec.name}/{observer}"
    calib.info.update(setup, eval_seconds=round(time.perf_counter() - t, 2))
    metrics = {**q, **{f"{k}_fp32": v for k, v in fp.items()}}
    report = calib.report(metrics)
    save_run(args.out, calib, report, phases,
             inputs=[setup["model"], *command_inputs(args)])
    if args.verbose:
        report.print()
    print(f"quantscope calibrate: {setup['name']} ({setup['task']}), "
          f"{rec.name}, observer {observer}")
    print(f"  {metric_line(ev.primary, fp[ev.primary], q[ev.primary])}")
    if "cosine" in q:
        print(f"  cosine to float embeddings: {q['cosine']:.4f}")
    note = float_note(rec, model)
    if note:
        print(f"  {note}")
    kept = calib.info.get("keep_float", {})
    if kept.get("n"):
        whole = len(kept["tensors"]) - kept["n"]  # a fused group's shared input: its members
        print(f"  --keep-float: {kept['n']} activations {kept['mode']} instead of static "
              + (f"({len(kept['tensors'])} layers' inputs, fused groups whole; " if whole else "(")
              + f"first: {kept['tensors'][0]}; all in qparams/quantscope.json)")
    smoothed = calib.info.get("smooth")
    if smoothed:
        print(f"  --smooth {smoothed['alpha']:g}: {len(smoothed['smoothed'])} modules' outputs "
              f"smoothed into the next layers' weights"
              + (f" ({len(smoothed['skipped'])} left as they were)" if smoothed["skipped"]
                 else ""))
    print(f"  calibration {calib.info.get('calibration_seconds', 0):.1f} s, total "
          f"{time.perf_counter() - t0:.1f} s")
    run = shell_word(args.out)  # the commands shown run as pasted into a shell
    print(f"  report: {os.path.join(args.out, 'report.md')}   next: quantscope evaluate {run} | "
          f"quantscope export {run} --out DIR")
    return 0


def shell_word(path: str) -> str:
    """``path`` as one shell word that names it when pasted: ``./`` before a path that starts
    with ``-`` (else the command reads an option: shlex leaves ``-dash`` bare), quoted as the
    shell needs (``shlex``), and a name that is not text (a non-UTF-8 byte, held as a lone
    surrogate, which a terminal would show and copy as U+FFFD) as bash's (and zsh's)
    ``$'...'``, each byte outside printable ASCII ``\\xNN``."""
    if path.startswith("-"):
        path = os.path.join(".", path)
    if not any("\udc80" <= c <= "\udcff" for c in path):
        return shlex.quote(path)
    return "$'" + "".join(chr(b) if 32 <= b < 127 and chr(b) not in "'\\" else f"\\x{b:02x}"
                          for b in os.fsencode(path)) + "'"


def save_run(out: str, calib, report, phases, inputs=()) -> None:
    """The run folder: qparams/, report.json and report.md, written whole or not at all;
    never over ``inputs`` (the model, the data) nor a folder quantscope did not write."""
    from ..exporters.atomic import atomic_dir

    def write():
        with atomic_dir(out, overwrite=True, inputs=inputs, what="calibrate-run") as tmp:
            calib.save(os.path.join(tmp, "qparams"))
            report.to_json(os.path.join(tmp, "report.json"))
            report.to_markdown(os.path.join(tmp, "report.md"))
    phases.run(f"saving {out}", write)


def cmd_evaluate(args) -> int:
    if not os.path.isdir(args.run):
        raise UsageError(f"evaluate: {args.run!r} is not a folder")
    qdir = run_qparams(args.run)
    check_model_arg(args.model)
    device = resolve_device(args.device)  # before the qparams and the model load
    set_threads(args)
    from ..calibration import load
    from ..demo import models

    phases = Phases(quiet=args.json)
    calib = load(qdir)
    if args.allow_other_weights:
        calib = calib.without_fingerprints()
    info = calib.info
    path = run_model_path("evaluate", qdir, args.model, info.get("model"))
    task = args.task or info.get("task") or models.model_task(path)
    max_length = args.eval_max_length or info.get("eval_max_length", 256)
    model, tok = phases.run(f"loading {models.model_name(path)} ({task})", lambda: (
        models.load_model(path, device, task=task)))
    max_length = fit_length(model, max_length, "--eval-max-length", phases)
    if not calib.smoothing:  # other weights: refused before the float evaluation, not after
        calib.check_model(model, "apply")  # (SmoothQuant's weights: once smoothed, below)
    ev = Evaluator(task, model, tok, max_length, not (args.no_progress or args.json))
    fp = phases.run("evaluating float", ev.reference)
    if calib.smoothing:  # calibrated on SmoothQuant's weights: the same function
        from ..calibration.choice.smooth import reapply

        reapply(model, calib)
    q = phases.run("evaluating quantized", lambda: ev.quantized(calib))
    if args.json:  # strict JSON, as report.json: a non-finite metric (inf perplexity) is null
        from ..calibration.results.report import json_text

        print(json_text({**q, **{f"{k}_fp32": v for k, v in fp.items()}}))
        return 0
    print(f"quantscope evaluate: {qdir} on {models.model_name(path)} ({task})")
    print(f"  {metric_line(ev.primary, fp[ev.primary], q[ev.primary])}")
    if "cosine" in q:
        print(f"  cosine to float embeddings: {q['cosine']:.4f}")
    return 0
