"""``quantscope``: calibrate a model, compare observers, plot, evaluate saved qparams.

Every command runs on the embedded default (all-MiniLM-L6-v2 calibrated on
gensim's Lee background corpus, evaluated on the Lee similarity benchmark) or on
any Hugging Face model folder given with ``--model PATH``. Evaluation embeds the
50 Lee documents (mean-pooled, normalised last hidden states) and reports the
Pearson correlation of their cosine similarities with the 1,225 human scores,
and the mean cosine between quantized and fp32 embeddings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

__all__ = ["build_parser", "main"]

DEFAULT_OBSERVERS = "minmax,mse,percentile,entropy,mix,auto"
DEFAULT_IGNORE = ["*pooler*", "*lm_head*"]


def _common(p: argparse.ArgumentParser, out_default: str) -> None:
    g = p.add_argument_group("model and data")
    g.add_argument("--model", metavar="PATH", default=None,
                   help="a Hugging Face model folder (default: the embedded all-MiniLM-L6-v2)")
    g.add_argument("--device", default="auto",
                   help="cpu, cuda, cuda:1 ... (default: cuda if available, else cpu)")
    g.add_argument("--calib-file", metavar="PATH", default=None,
                   help="calibration text, one document per line (default: gensim's "
                        "lee_background.cor, 300 news documents)")
    g.add_argument("--calib-docs", type=int, default=32, metavar="N",
                   help="documents taken evenly from the calibration text (default: 32)")
    g.add_argument("--max-length", type=int, default=128, metavar="T",
                   help="calibration tokens per document, truncated (default: 128)")
    g.add_argument("--batch-size", type=int, default=8,
                   help="calibration documents per batch, grouped by length (default: 8)")
    g.add_argument("--eval-max-length", type=int, default=256, metavar="T",
                   help="tokens per Lee document at evaluation (default: 256, the model's "
                        "sentence-transformers max_seq_length)")
    g.add_argument("--ignore", nargs="*", default=DEFAULT_IGNORE, metavar="PATTERN",
                   help="modules left in float: class names, name globs or re:regex "
                        f"(default: {' '.join(DEFAULT_IGNORE)}; the pooler is unused by "
                        "mean-pooled embeddings)")
    g.add_argument("--sample-tokens", type=int, default=2048,
                   help="activation rows kept per layer for 'auto' and the report (default 2048)")
    g.add_argument("--threads", type=int, default=0, metavar="N",
                   help="torch CPU threads (default: torch's choice). On a busy machine 1 is "
                        "often fastest: spinning OpenMP threads slow small ops 10x or more")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", default=out_default, metavar="DIR",
                   help=f"output directory (default: {out_default})")


def build_parser() -> argparse.ArgumentParser:
    from .calibrate.recipe import PRESETS

    presets = ", ".join(PRESETS)
    parser = argparse.ArgumentParser(
        prog="quantscope",
        description="Calibrate a model, compare observers, plot, evaluate saved qparams.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  quantscope calibrate --recipe w8a8 --observer mse\n"
               "  quantscope compare --recipes w8a8,w4a8 --observers minmax,mse,auto\n"
               "  quantscope plot runs/compare --layer encoder.layer.5.output.dense\n"
               "  quantscope evaluate runs/calibrate/qparams\n"
               "  quantscope calibrate --model /path/to/hf-model --recipe fp8")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("calibrate", help="calibrate one recipe, evaluate, save qparams and report",
                       description="Calibrate a model with one recipe and observer, apply the "
                                   "qparams (QDQ), evaluate, and save the qparams and report.")
    p.add_argument("--recipe", default="w8a8", help=f"a preset: {presets} (default: w8a8)")
    p.add_argument("--observer", default="minmax",
                   help="an observer name (quantscope.list_observers()) or 'auto' (default: minmax)")
    _common(p, "runs/calibrate")

    p = sub.add_parser("compare", help="several recipes x observers side by side, in one pass",
                       description="Calibrate every recipe with every observer in one pass over "
                                   "the data, evaluate each, print the comparison table and "
                                   "write report.md, report.json and plots.")
    p.add_argument("--recipes", default="w8a8,w4a8",
                   help=f"comma-separated presets ({presets}); default: w8a8,w4a8")
    p.add_argument("--observers", default=DEFAULT_OBSERVERS,
                   help=f"comma-separated observer names; 'auto' chooses per layer among the "
                        f"others (default: {DEFAULT_OBSERVERS})")
    p.add_argument("--auto-metric", default="model",
                   choices=["model", "joint", "fisher", "tensor", "output"],
                   help="what 'auto' minimises: the divergence of the model's output from "
                        "float, choosing among whole configurations (default); per layer the "
                        "output error x W^T with weight and input chosen together (joint), "
                        "weighted by the loss's g^2 (fisher); the quantized tensor's own error "
                        "(tensor), or one role's error in x W^T (output)")
    p.add_argument("--plot-layer", default=None, metavar="NAME",
                   help="layer of the histogram plot (default: where observers differ most)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    _common(p, "runs/compare")

    p = sub.add_parser("plot", help="redraw the plots of a compare run from its report.json",
                       description="Draw the activation histogram of a layer with each observer's "
                                   "clipping range, and SQNR per layer for each observer.")
    p.add_argument("run", metavar="RUN", help="a compare output directory or its report.json")
    p.add_argument("--layer", default=None,
                   help="layer for the histogram (default: where observers differ most)")
    p.add_argument("--role", default="input", choices=["input", "output"])
    p.add_argument("--recipe", default=None, help="only this recipe's clipping ranges")
    p.add_argument("--out", default=None, metavar="DIR", help="default: the run directory")

    p = sub.add_parser("evaluate", help="apply saved qparams (no calibration) and evaluate",
                       description="Load qparams written by `quantscope calibrate`, apply them to "
                                   "the model and evaluate.")
    p.add_argument("qparams", metavar="DIR", help="a directory written by calibrate (qparams/)")
    p.add_argument("--model", metavar="PATH", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--eval-max-length", type=int, default=256)
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON line")

    sub.add_parser("formats", help="the synthetic format table (quantscope.demo)",
                   description="Print the synthetic table of formats and observers.")
    return parser


# ---------------------------------------------------------------------------- helpers
def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _say(msg: str) -> None:
    from .distributed import is_main

    if is_main():  # under torchrun only rank 0 speaks
        print(msg, file=sys.stderr, flush=True)


def _check_positive(args, *names):
    for n in names:
        v = getattr(args, n)
        if v is not None and v < 1:
            raise SystemExit(f"quantscope: --{n.replace('_', '-')} must be a positive integer, "
                             f"got {v}")


def _setup(args):
    """Model, tokenizer, calibration batches, Lee documents and pairs, fp32 embeddings."""
    from . import data, models

    _check_positive(args, "calib_docs", "max_length", "batch_size", "eval_max_length",
                    "sample_tokens")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    device = _device(args.device)
    model, tok = models.load_model(args.model, device)
    docs = data.read_corpus(args.calib_file) if args.calib_file else data.lee_background()
    step = max(1, len(docs) // args.calib_docs)
    calib = docs[::step][: args.calib_docs]
    batches = models.token_batches(tok, calib, args.max_length, args.batch_size, device,
                                    args.seed)
    lee, pairs = data.lee_documents(), data.lee_pairs()
    ref = fp32 = None
    if getattr(args, "rank", 0) == 0:  # only rank 0 evaluates (under torchrun)
        ref = models.embed(model, tok, lee, args.eval_max_length)
        fp32 = {"lee_r": models.lee_correlation(ref, pairs), "cosine": 1.0}
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    setup = {"model": str(args.model or models.default_model_path()), "device": device,
             "calib_docs": len(calib), "calib_tokens": tokens, "max_length": args.max_length,
             "batch_size": args.batch_size, "eval_docs": len(lee), "eval_pairs": len(pairs[0]),
             "eval_max_length": args.eval_max_length, "load_seconds":
             round(time.perf_counter() - t0, 2)}
    _say(f"model {setup['model']} on {device}; calibration: {len(calib)} documents "
         f"({tokens} tokens, <= {args.max_length} each); fp32 Lee r = "
         f"{fp32['lee_r'] if fp32 else float('nan'):.4f}")
    return model, tok, batches, lee, pairs, ref, fp32, setup


def _evaluate(model, tok, calibration, lee, pairs, ref, max_length) -> dict:
    from . import models

    with calibration.apply(model):
        emb = models.embed(model, tok, lee, max_length)
    return {"lee_r": models.lee_correlation(emb, pairs),
            "cosine": float((emb * ref).sum(-1).mean())}


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


# ---------------------------------------------------------------------------- commands
def cmd_calibrate(args) -> int:
    from .calibrate import calibrate, preset

    model, tok, batches, lee, pairs, ref, fp32, setup = _setup(args)
    recipe = preset(args.recipe, args.observer, ignore=args.ignore)
    calib = calibrate(model, batches, recipe, sample_tokens=args.sample_tokens,
                      progress=not args.no_progress, seed=args.seed,
                      distributed=getattr(args, "world", 1) > 1)
    if getattr(args, "rank", 0) != 0:  # torchrun: rank 0 evaluates, writes and prints
        return 0
    t = time.perf_counter()
    metrics = _evaluate(model, tok, calib, lee, pairs, ref, args.eval_max_length)
    metrics = {"lee_r": metrics["lee_r"], "lee_r_fp32": fp32["lee_r"],
               "cosine_vs_fp32": metrics["cosine"]}
    calib.info.update(setup, eval_seconds=round(time.perf_counter() - t, 2))
    calib.label = f"{args.recipe}/{args.observer}"
    report = calib.report(metrics)
    os.makedirs(args.out, exist_ok=True)
    calib.save(os.path.join(args.out, "qparams"))
    report.to_json(os.path.join(args.out, "report.json"))
    report.to_markdown(os.path.join(args.out, "report.md"))
    report.print()
    _say(f"wrote {args.out}/report.md, report.json and qparams/ (reload with "
         f"`quantscope evaluate {args.out}/qparams`)")
    return 0


def _short_obs(name: str) -> str:
    return name.removeprefix("memoryless_")


def compare_rows(report: dict) -> tuple[list[str], list[list]]:
    """The comparison table (headers, rows of strings) of a compare report."""
    headers = ["recipe", "observer", "Lee r", "r - fp32", "cosine vs fp32", "weight SQNR dB",
               "input SQNR dB", "input clipped %", "auto chose (weight; input)"]
    fp = report["fp32"]
    f = lambda v, d: "-" if v is None else f"{v:.{d}f}"
    rows = [["fp32", "-", f(fp["lee_r"], 4), "", "1.0000", "-", "-", "-", ""]]
    for run in report["runs"].values():
        m, s = run["metrics"], run["summary"]
        w, i = s.get("weight", {}), s.get("input", {})
        chose = ""
        if run["observer"] == "auto":
            chose = "; ".join(", ".join(f"{_short_obs(k)} {v}" for k, v in sorted(
                s.get(role, {}).get("observers", {}).items(), key=lambda kv: -kv[1]))
                for role in ("weight", "input"))
        rows.append([run["recipe"], run["observer"], f(m["lee_r"], 4),
                     f"{m['lee_r'] - fp['lee_r']:+.4f}", f(m["cosine"], 4),
                     f(w.get("mean_sqnr_db"), 1), f(i.get("mean_sqnr_db"), 1),
                     f(100 * i["mean_clipped"], 3) if i else "-", chose])
    return headers, rows


def cmd_compare(args) -> int:
    from .calibrate import calibrate_many, preset
    from .calibrate.report import markdown_table, print_table
    from .observers.registry import observer_class

    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    observers = []
    for o in (o.strip() for o in args.observers.split(",") if o.strip()):
        if o != "auto":
            try:
                observer_class(o)
            except ValueError as e:
                _say(f"warning: skipping observer {o!r}: {e}")
                continue
        observers.append(o)
    if not recipes or not observers:
        raise SystemExit("quantscope compare: need at least one recipe and one observer")
    for r in recipes:
        preset(r)  # unknown names fail here, before the model loads
    model, tok, batches, lee, pairs, ref, fp32, setup = _setup(args)
    plan = {f"{r}/{o}": preset(r, o, ignore=args.ignore) for r in recipes for o in observers}
    candidates = [o for o in observers if o != "auto"] or None
    t = time.perf_counter()
    calibs = calibrate_many(model, batches, plan, candidates=candidates,
                            sample_tokens=args.sample_tokens, progress=not args.no_progress,
                            seed=args.seed, distributed=getattr(args, "world", 1) > 1,
                            auto_metric=args.auto_metric)
    if getattr(args, "rank", 0) != 0:  # torchrun: rank 0 evaluates, writes and prints
        return 0
    calib_seconds = time.perf_counter() - t
    t = time.perf_counter()
    runs = {}
    items = calibs.items()
    if not args.no_progress:
        try:
            from tqdm.auto import tqdm

            items = tqdm(items, desc="evaluating", unit="config", leave=False)
        except ImportError:
            pass
    for label, calib in items:
        m = _evaluate(model, tok, calib, lee, pairs, ref, args.eval_max_length)
        d = calib.report(m).to_dict()
        d["recipe"], d["observer"] = label.split("/", 1)
        runs[label] = d
    histograms = next(iter(calibs.values())).histograms  # one pass: every recipe shares them
    eval_seconds = time.perf_counter() - t
    report = {"setup": setup, "fp32": fp32, "candidates": candidates,
              "timings": {"calibration_seconds": round(calib_seconds, 2),
                          "evaluation_seconds": round(eval_seconds, 2)},
              "runs": runs,
              "histograms": {f"{k[0]}/{k[1]}": v for k, v in histograms.items()}}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    headers, rows = compare_rows(report)
    name = "all-MiniLM-L6-v2" if args.model is None else os.path.basename(
        setup["model"].rstrip("/"))
    title = (f"quantscope compare: {name}, "
             f"{setup['calib_docs']} calibration docs ({setup['calib_tokens']} tokens), "
             f"Lee similarity over {setup['eval_pairs']} pairs")
    print_table(headers, rows, title)
    md = [f"# {title}", "", markdown_table(headers, rows), "",
          (f"Calibration (one pass, all observers): {calib_seconds:.1f} s; evaluation: "
          f"{eval_seconds:.1f} s."), ""]
    if not args.no_plots:
        md += _plots(report, args.out, args.plot_layer)
    _write(os.path.join(args.out, "report.md"), "\n".join(md))
    _say(f"wrote {args.out}/report.md and report.json"
         f"{'' if args.no_plots else ', hist.png and sqnr.png'}")
    return 0


def _plots(report: dict, out: str, layer: str | None, role: str = "input",
           recipe: str | None = None) -> list[str]:
    from .calibrate import plots

    try:
        layer = layer or plots.pick_layer(report, role)
        lines = []
        if layer is not None:
            plots.plot_histogram(report, layer, os.path.join(out, "hist.png"), role, recipe)
            lines.append(f"![{layer} {role} histogram](hist.png)")
        plots.plot_sqnr(report, os.path.join(out, "sqnr.png"))
        lines.append("![SQNR per layer](sqnr.png)")
        return lines
    except ImportError as e:
        _say(f"warning: no plots: {e}")
        return []


def cmd_plot(args) -> int:
    path = args.run
    if os.path.isdir(path):
        path = os.path.join(path, "report.json")
    if not os.path.isfile(path):
        raise SystemExit(f"quantscope plot: {args.run!r} is not a compare run directory or "
                         f"report.json (no {path})")
    with open(path) as f:
        report = json.load(f)
    if "runs" not in report:
        raise SystemExit(f"quantscope plot: {path} is not a compare report (no 'runs')")
    out = args.out or os.path.dirname(os.path.abspath(path))
    os.makedirs(out, exist_ok=True)
    from .calibrate import plots

    layer = args.layer or plots.pick_layer(report, args.role)
    if layer is None:
        raise SystemExit(f"quantscope plot: the report has no static {args.role} activations")
    plots.plot_histogram(report, layer, os.path.join(out, "hist.png"), args.role, args.recipe)
    plots.plot_sqnr(report, os.path.join(out, "sqnr.png"))
    _say(f"wrote {out}/hist.png ({layer} {args.role}) and {out}/sqnr.png")
    return 0


def cmd_evaluate(args) -> int:
    from . import data, models
    from .calibrate import load

    calib = load(args.qparams)
    device = _device(args.device)
    model, tok = models.load_model(args.model, device)
    lee, pairs = data.lee_documents(), data.lee_pairs()
    ref = models.embed(model, tok, lee, args.eval_max_length)
    m = _evaluate(model, tok, calib, lee, pairs, ref, args.eval_max_length)
    fp32 = models.lee_correlation(ref, pairs)
    if args.json:
        print(json.dumps({"lee_r": m["lee_r"], "lee_r_fp32": fp32, "cosine": m["cosine"]}))
        return 0
    from .calibrate.report import print_table

    print_table(["qparams", "Lee r", "fp32 Lee r", "cosine vs fp32"],
                [[args.qparams, f"{m['lee_r']:.4f}", f"{fp32:.4f}", f"{m['cosine']:.4f}"]])
    return 0


def cmd_formats(args) -> int:
    from .demo import format_table

    print(format_table())
    return 0


COMMANDS = {"calibrate": cmd_calibrate, "compare": cmd_compare, "plot": cmd_plot,
            "evaluate": cmd_evaluate, "formats": cmd_formats}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    # under torchrun (WORLD_SIZE > 1): join the process group; calibration is data-parallel
    import torch.distributed as dist

    from . import distributed as qd

    had_group = dist.is_available() and dist.is_initialized()  # a caller's group stays up
    joined = args.command in ("calibrate", "compare") and qd.init_from_env() and not had_group
    args.rank, args.world = qd.rank(), qd.world_size()
    try:
        return COMMANDS[args.command](args)
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(f"quantscope {args.command}: error{f' (rank {args.rank})' if args.world > 1 else ''}: "
              f"{e}", file=sys.stderr)
        return 1
    finally:
        if joined:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
