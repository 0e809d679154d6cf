"""``quantscope compare`` (several recipes x observers in one pass, side by side) and
``quantscope plot`` (a compare run's plots drawn again from its report.json)."""

from __future__ import annotations

import os
import sys
import time
from collections import Counter

from .._jsonfile import read_json
from .checks import (
    UsageError,
    check_activation_args,
    check_calib_file,
    check_distinct,
    check_library_args,
    check_model_arg,
    check_observer_name,
    check_out,
    check_recipe_name,
    suggest,
)
from .options import add_common, add_recipes_args
from .recipes import build_recipe
from .running import Phases, calibration_options, command_inputs, load_setup, signed


def add_compare_parser(sub) -> None:
    p = sub.add_parser("compare", help="several recipes x observers side by side, in one pass",
                       description="Calibrate every recipe with every observer in one pass over "
                                   "the data, evaluate each, print the comparison table and "
                                   "write report.md, report.json and plots.")
    add_recipes_args(p)
    p.add_argument("--auto-metric", default="model",
                   choices=["model", "joint", "fisher", "tensor", "output"],
                   help="what 'auto' minimises: the divergence of the model's output from "
                        "float, choosing among whole configurations (default); per layer the "
                        "output error x W^T with weight and input chosen together (joint), "
                        "weighted by the loss's g^2 (fisher); the quantized tensor's own error "
                        "(tensor), or one role's error in x W^T (output)")
    p.add_argument("--score-tokens", type=int, default=1024, metavar="N",
                   help="calibration tokens 'auto' scores on, with --auto-metric model or "
                        "fisher (default: 1024; more decides closer calls at one forward of "
                        "them per candidate)")
    p.add_argument("--plot-layer", default=None, metavar="NAME",
                   help="layer of the histogram plot (default: where observers differ most)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    add_common(p, "runs/compare")


def add_plot_parser(sub) -> None:
    p = sub.add_parser("plot", help="redraw the plots of a compare run from its report.json",
                       description="Draw the activation histogram of a layer with each observer's "
                                   "clipping range, and SQNR per layer for each observer.")
    p.add_argument("run", metavar="RUN", help="a compare output directory or its report.json")
    p.add_argument("--layer", default=None,
                   help="layer for the histogram (default: where observers differ most)")
    p.add_argument("--role", default="input", choices=["input", "output"],
                   help="the activation role plotted (default: input)")
    p.add_argument("--recipe", default=None, help="only this recipe's clipping ranges")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where hist.png and sqnr.png go (default: the run directory); an "
                        "existing one is replaced only where quantscope wrote it into its "
                        "output folder (a compare run), another only with --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing hist.png / sqnr.png in --out quantscope did not "
                        "write there (your own file of that name)")


def _short_obs(name: str) -> str:
    return name.removeprefix("memoryless_")


def compare_rows(report: dict) -> tuple[list[str], list[list]]:
    """The comparison table (headers, rows of strings) of a compare report. ``calib s`` is
    each configuration's calibration time within the one pass: the pass's shared time
    (forwards, planning, report) plus its own observers' (observing and qparams); for
    ``auto``, every candidate's observers once, then the choice (scoring forwards, searches)."""
    fp = report["fp32"]
    causal = "perplexity" in fp
    # a metric that was NaN or inf is None in the report (strict JSON): printed "-"
    f = lambda v, d: "-" if v is None else f"{v:.{d}f}"
    delta = lambda v, ref, d: "-" if v is None or ref is None else signed(v - ref, d)
    tail_headers = ["calib s", "weight SQNR dB", "input SQNR dB", "input clipped %",
                    "auto chose (weight; input)"]
    if causal:
        headers = ["recipe", "observer", "perplexity", "vs fp32", *tail_headers]
        rows = [["fp32", "-", f(fp["perplexity"], 2), "", "", "-", "-", "-", ""]]
    else:
        headers = ["recipe", "observer", "Lee r", "r - fp32", "cosine vs fp32", *tail_headers]
        rows = [["fp32", "-", f(fp["lee_r"], 4), "", "1.0000", "", "-", "-", "-", ""]]
    for run in report["runs"].values():
        m, s = run["metrics"], run["summary"]
        w, i = s.get("weight", {}), s.get("input", {})
        chose = ""
        if run["observer"] == "auto":  # the tensors auto chose for (not dynamic or named ones)
            asked = [r for r in run.get("layers", ()) if r.get("requested") == "auto"]
            chose = "; ".join(", ".join(f"{_short_obs(k)} {v}" for k, v in Counter(
                r["observer"] for r in asked if r["role"] == role).most_common()) or "-"
                for role in ("weight", "input"))
        tail = [f(run.get("info", {}).get("calibration_seconds"), 1),
                f(w.get("mean_sqnr_db"), 1), f(i.get("mean_sqnr_db"), 1),
                f(100 * i["mean_clipped"], 3) if i else "-", chose]
        if causal:
            rows.append([run["recipe"], run["observer"], f(m["perplexity"], 2),
                         delta(m["perplexity"], fp["perplexity"], 2), *tail])
        else:
            rows.append([run["recipe"], run["observer"], f(m["lee_r"], 4),
                         delta(m["lee_r"], fp["lee_r"], 4), f(m["cosine"], 4), *tail])
    return _kv_column(report, headers, rows)


def _kv_column(report: dict, headers: list[str], rows: list[list]):
    """A "KV cache" column (the specs and how many tensors) where a configuration quantizes
    the KV cache: those tensors are not sampled, so no SQNR column counts them."""
    runs = list(report["runs"].values())
    if not any(run.get("kv_cache") for run in runs):
        return headers, rows

    def cell(run):
        kv = run.get("kv_cache") or []
        specs = ", ".join(dict.fromkeys(r["spec"] for r in kv))
        return f"{specs} ({len(kv)} tensor{'s' * (len(kv) != 1)})" if kv else "-"
    return [*headers, "KV cache"], [rows[0] + [""]] + [r + [cell(run)]
                                                      for r, run in zip(rows[1:], runs)]


def cmd_compare(args) -> int:
    recipes, observers = _check_compare_args(args)
    phases = Phases(quiet=getattr(args, "rank", 0) != 0)
    model, batches, ev, fp, setup, plan = load_setup(
        args, phases, lambda m: _plan(args, m, recipes, observers))
    if args.smooth is not None:
        setup["smooth"] = args.smooth
    # auto's candidates: the other observers, where auto is one (else Auto(candidates=) would
    # be refused: no recipe has an auto role)
    candidates = ([o for o in observers if o != "auto"] or None) if "auto" in observers else None
    t = time.perf_counter()
    calibs = _calibrate_all(args, phases, model, batches, plan, candidates)
    if getattr(args, "rank", 0) != 0:  # torchrun: rank 0 evaluates, writes and prints
        return 0
    calib_seconds = time.perf_counter() - t
    t = time.perf_counter()
    runs, reports = _evaluate_all(calibs, ev, phases)
    histograms = _histograms(calibs)
    eval_seconds = time.perf_counter() - t
    report = {"setup": setup, "fp32": fp, "candidates": candidates,
              "timings": {"calibration_seconds": round(calib_seconds, 2),
                          "evaluation_seconds": round(eval_seconds, 2)},
              "runs": runs,
              "histograms": {f"{k[0]}/{k[1]}": v for k, v in histograms.items()}}
    headers, rows = compare_rows(report)
    title = _title(setup)
    drawn = _write_report(args, report, headers, rows, title, calib_seconds, eval_seconds)
    from ..calibration.results.report import print_table

    if args.verbose:  # each configuration's layers (also in report.json), then the comparison
        for rep in reports:
            rep.print()
    print_table(headers, rows, title)
    plotted = f" and plots ({', '.join(drawn)})" if drawn else ""
    print(f"calibration {calib_seconds:.1f} s (one pass), evaluation {eval_seconds:.1f} s; "
          f"wrote {os.path.join(args.out, 'report.md')}, report.json{plotted}")
    return 0


def _histograms(calibs: dict) -> dict:
    """The activation histograms of every configuration, together: one pass, so a tensor's
    histogram is the same in each; ``keep_float`` took its fallen-back tensors out of its own
    configuration's, which another configuration may keep static (and plot)."""
    out = {}
    for calib in calibs.values():
        for key, hist in calib.histograms.items():
            out.setdefault(key, hist)
    return out


def _check_compare_args(args) -> tuple[list[str], list[str]]:
    """The recipe and observer names, checked (and spelled as their registries spell them),
    with the model and output arguments."""
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    observers = [o.strip() for o in args.observers.split(",") if o.strip()]
    for flag, names, given in (("--recipes", recipes, args.recipes),
                               ("--observers", observers, args.observers)):
        if not names:
            raise UsageError(f"compare: {flag} {given!r} names no "
                             f"{flag[2:-1]}; give one or more, comma-separated")
    # spelt exactly, as calibrate's --recipe / --scheme spell them: w8a8 is the quantscope
    # preset (static inputs), W8A8 compressed-tensors' scheme (dynamic inputs)
    recipes = [check_recipe_name(r) for r in recipes]
    observers = [check_observer_name(o, "observer") for o in observers]
    check_distinct("--recipes", recipes)
    check_distinct("--observers", observers)
    check_activation_args(args)
    configurations = len(recipes) * len(observers)
    if getattr(args, "sequential", None) == "quantized" and configurations > 1:
        # calibrate_many's own refusal comes after the model loads and names no flag
        raise UsageError(f"--sequential quantized calibrates each block on the earlier "
                         f"blocks quantized with one configuration's qparams: give one recipe "
                         f"in --recipes and one observer in --observers (got {configurations} "
                         f"configurations), or use --sequential float")
    if args.score_tokens < 1:
        raise UsageError(f"--score-tokens must be a positive number of tokens, got "
                         f"{args.score_tokens}")
    if "auto" not in observers and (args.auto_metric != "model" or args.score_tokens != 1024):
        raise UsageError("--auto-metric / --score-tokens say how the 'auto' observer chooses: "
                         "add auto to --observers")
    if args.score_tokens != 1024 and args.auto_metric not in ("model", "fisher"):  # Auto's rule
        raise UsageError(f"--score-tokens is read only by --auto-metric model or fisher; "
                         f"--auto-metric {args.auto_metric} scores no tokens")
    if args.plot_layer is not None and args.no_plots:
        raise UsageError("--plot-layer chooses the layer of the histogram plot: not with "
                         "--no-plots, which draws none")
    check_model_arg(args.model)
    check_calib_file(args)
    check_out(args.out, command_inputs(args), what="compare-run")
    check_library_args(args)  # imports torch: after the checks above, which need none
    return recipes, observers


def _plan(args, model, recipes, observers) -> dict:
    """Every configuration's recipe, checked against the model's layers, and --plot-layer
    against the layers whose input they quantize statically: once the model is loaded, not
    once every configuration has been calibrated and evaluated."""
    from ..calibration.recipe import has_groups

    plan = {f"{r}/{o}": build_recipe(args, model, o, r, groups_optional=True)
            for r in recipes for o in observers}
    if args.group_size is not None and not any(map(has_groups, plan.values())):
        raise UsageError(f"--group-size {args.group_size}: none of --recipes "
                         f"{', '.join(recipes)} has grouped weights to change")
    if args.plot_layer is not None:  # statically: a dynamic input has no range to draw
        layers = list(dict.fromkeys(name for rec in plan.values()
                                    for name, (_, roles) in rec.match(model).items()
                                    if "input" in roles and roles["input"].dynamic is not True))
        if not layers:
            raise UsageError(f"--plot-layer {args.plot_layer!r}: none of --recipes quantizes "
                             f"an input statically (weight-only or dynamic inputs): no "
                             f"histogram has a clipping range to draw; drop --plot-layer")
        if args.plot_layer not in layers:
            raise UsageError(f"--plot-layer {args.plot_layer!r} is not a layer whose input "
                             f"the recipes quantize statically (a dynamic one has no clipping "
                             f"range to draw); {suggest(args.plot_layer, layers, 8)}")
    return plan


def _calibrate_all(args, phases, model, batches, plan, candidates) -> dict:
    """Every configuration of ``plan`` calibrated in one pass over the batches, in the plan's
    order (--recipes by --observers: ``auto`` is decided after the others, not listed so)."""
    from ..calibration import calibrate_many

    calibs = phases.run(f"calibrating {len(plan)} configurations in one pass", lambda: (
        calibrate_many(model, batches, plan, **calibration_options(args, candidates))))
    return {label: calibs[label] for label in plan}


def _evaluate_all(calibs: dict, ev, phases) -> tuple[dict, list]:
    """Each calibration's report with its metrics: as dicts with its recipe and its observer,
    and as the :class:`Report` objects (for ``--verbose``). A configuration that quantizes
    the model exactly as one already evaluated (``auto`` keeping one candidate's qparams)
    takes its metrics instead of a second evaluation."""
    runs, reports, done = {}, [], []
    for k, (label, calib) in enumerate(calibs.items()):
        same = next((d for d in done if d[1].quantizes_like(calib)), None)
        if same is not None:
            phases.say(f"evaluating {label} ({k + 1}/{len(calibs)}): the qparams of "
                       f"{same[0]}, its metrics")
            metrics = same[2]
        else:
            phases.say(f"evaluating {label} ({k + 1}/{len(calibs)})")
            metrics = ev.quantized(calib)
            done.append((label, calib, metrics))
        calib.label = label  # the report's title: recipe and observer
        reports.append(calib.report(dict(metrics)))
        d = reports[-1].to_dict()
        d["recipe"], d["observer"] = label.split("/", 1)
        runs[label] = d
    return runs, reports


def _title(setup: dict) -> str:
    metric = ("perplexity on" if setup["task"] == "causal-lm" else "Lee similarity over") + (
        f" {setup['eval_docs']} held-out documents")
    smooth = (f", SmoothQuant alpha {setup['smooth']:g} first" if setup.get("smooth") is not None
              else "")
    return (f"quantscope compare: {setup['name']}, {setup['calib_docs']} calibration docs "
            f"({setup['calib_tokens']} tokens){smooth}, {metric}")


def _write_report(args, report: dict, headers, rows, title: str, calib_seconds: float,
                  eval_seconds: float) -> list[str]:
    """report.json, report.md (the table, the timings, the plots) and the plots, written
    whole into ``--out`` or not at all; a plot that fails is a warning, never a lost report.
    Returns the names of the plots drawn."""
    from ..calibration.results.report import json_text, markdown_table
    from ..exporters.atomic import atomic_dir

    md = [f"# {title}", "", markdown_table(headers, rows), "",
          (f"Calibration (one pass, all observers): {calib_seconds:.1f} s; evaluation: "
           f"{eval_seconds:.1f} s."), ""]
    drawn = []
    with atomic_dir(args.out, overwrite=True, what="compare-run",
                    inputs=[report["setup"]["model"], *command_inputs(args)]) as tmp:
        with open(os.path.join(tmp, "report.json"), "w") as f:
            f.write(json_text(report, indent=1))  # strict JSON (fp32's metrics too)
        if not args.no_plots:
            drawn = _plots(report, tmp, args.plot_layer)
            md += [f"![{alt}]({name})" for name, alt in drawn]
        with open(os.path.join(tmp, "report.md"), "w") as f:
            f.write("\n".join(md))
    return [name for name, _ in drawn]


def _plots(report: dict, out: str, layer: str | None, role: str = "input",
           recipe: str | None = None) -> list[tuple[str, str]]:
    """The plots drawn, ``(file name, caption)``. Each plot that cannot be drawn is a warning
    naming why, and the other is drawn all the same (sqnr.png depends on no layer: a
    --plot-layer that --keep-float, choosing after calibration, took out of every
    configuration loses only the histogram); the report, computed already, is written
    whatever the plots do."""
    from ..calibration.results import plots

    def hist(path):  # the first recipe with static ranges there, not merely the first's
        chosen, drawn = plots.histogram_choice(report, role, recipe, layer)
        plots.plot_histogram(report, chosen, path, role, drawn)
        return f"{chosen} {role} histogram"

    def sqnr(path):
        plots.plot_sqnr(report, path)
        return "SQNR per layer"

    drawn = []
    for name, draw in (("hist.png", hist), ("sqnr.png", sqnr)):
        try:
            caption = draw(os.path.join(out, name))
        except ImportError as e:  # no matplotlib: no plot at all, said once
            print(f"warning: no plots: {e}", file=sys.stderr)
            return drawn
        except Exception as e:  # noqa: BLE001 -- whatever a plot raises, the report is kept
            print(f"warning: no {name}: {e}", file=sys.stderr)
            continue
        drawn.append((name, caption))
    return drawn


def _read_report(run: str) -> tuple[str, dict]:
    path = os.path.join(run, "report.json") if os.path.isdir(run) else run
    if not os.path.isfile(path):
        why = "not a regular file" if os.path.exists(path) else "no such file"
        raise UsageError(f"plot: {run!r} is not a compare run directory or report.json "
                         f"({path}: {why})")
    try:
        report = read_json(path, "plot")
    except ValueError as e:  # else a bare parser message
        raise UsageError(str(e)) from None
    if not isinstance(report, dict) or "runs" not in report:
        raise UsageError(f"plot: {path} is not a compare report (no 'runs')")
    runs = report["runs"]  # (a report compare wrote, edited by hand)
    if not isinstance(runs, dict) or not all(isinstance(v, dict) for v in runs.values()):
        raise UsageError(f"plot: {path}: 'runs' must map each run's name to a mapping of its "
                         f"results")
    return path, report


def _plot_layer(args, report: dict) -> tuple[str, str | None]:
    """--recipe and --layer checked against the report, before --out is made; the layer and
    the recipe whose clipping ranges the histogram draws (by default the first recipe with
    static ones: a weight-only or dynamic-input recipe listed first has none)."""
    from ..calibration.results import plots

    recipes = plots.report_recipes(report)
    if args.recipe is not None and args.recipe not in recipes:
        raise UsageError(f"--recipe {args.recipe!r}: no run of the report has it; "
                         f"{suggest(args.recipe, recipes)}")
    layers = plots.histogram_layers(report, args.role)
    if args.layer is not None and args.layer not in layers:
        raise UsageError(f"--layer {args.layer!r}: the report has no {args.role} histogram of "
                         f"it; {suggest(args.layer, layers, 8)}")
    try:
        return plots.histogram_choice(report, args.role, args.recipe, args.layer)
    except ValueError as e:  # why none can be drawn (naming the recipe and layer asked for)
        raise UsageError(str(e)) from None


def _plot_targets(args, out: str, report_path: str) -> tuple[str, str]:
    """hist.png and sqnr.png in ``out``, both checked before either is drawn (neither may be
    the report read, nor a folder, nor without --overwrite a file quantscope did not write
    into its output folder), so a refused one never leaves the other rewritten."""
    from ..exporters.atomic import check_writable_target

    targets = tuple(os.path.join(out, name) for name in ("hist.png", "sqnr.png"))
    try:
        for target in targets:
            check_writable_target(target, overwrite=args.overwrite, kind="report",
                                  inputs=[report_path])
    except ValueError as e:
        where = "--out" if args.out else "--out (default: the report's folder)"
        raise UsageError(f"{where}: {e}") from None
    return targets


def cmd_plot(args) -> int:
    path, report = _read_report(args.run)
    layer, recipe = _plot_layer(args, report)
    out = args.out or os.path.dirname(os.path.abspath(path))
    hist, sqnr = _plot_targets(args, out, path)
    from ..calibration.results import plots

    plots.plot_histogram(report, layer, hist, args.role, recipe, inputs=[path])
    plots.plot_sqnr(report, sqnr, inputs=[path])
    ranges = f", {recipe}'s clipping ranges" if recipe else ""
    print(f"wrote {hist} ({layer} {args.role}{ranges}) and {sqnr}")
    return 0
