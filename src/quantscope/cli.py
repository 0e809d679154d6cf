"""``quantscope``: calibrate a model, compare observers, evaluate, export, plot.

Every command runs on a demo model (``minilm``, the default: all-MiniLM-L6-v2; or
``smollm2-135m``: SmolLM2-135M-Instruct) or on any Hugging Face model folder given with
``--model``. The model class and the metric follow the folder's config (``--task``
overrides): a causal LM is scored by its perplexity on the 50 held-out Lee documents, an
encoder by the Lee similarity benchmark (the Pearson correlation of its documents'
embedding cosines with 1,225 human scores) and the mean cosine of quantized to fp32
embeddings. Calibration text: gensim's Lee background corpus, or ``--calib-file``.

Names (recipes, schemes, observers) and the output folder are checked before anything
heavy is imported or loaded; an error is one line on stderr and exit code 2 (``--debug``
shows the traceback). Progress goes to stderr; stdout ends with a short summary.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
import time

__all__ = ["OBSERVER_NAMES", "RECIPE_NAMES", "SCHEME_NAMES", "build_parser", "main"]

# The names the CLI accepts, known without importing torch (so --help and a typo answer at
# once); tests/cli/test_cli_names.py holds each list equal to its registry.
RECIPE_NAMES = ("w8a8", "w8a8-dynamic", "w4a16", "w4a16-asym", "w4a8", "fp8", "fp8-dynamic",
                "mxfp4", "nvfp4", "fp8-kv")
KV_CACHE_NAMES = ("fp8",)
SCHEME_NAMES = ("FP8", "FP8_BLOCK", "FP8_DYNAMIC", "INT8", "MXFP4", "MXFP4A16", "MXFP4XFP8",
                "MXFP6A16", "MXFP6A8", "MXFP8", "MXFP8A16", "NVFP4", "NVFP4A16", "W2A16", "W2A4",
                "W2A8", "W3A16", "W3A4", "W3A8", "W4A16", "W4A16_ASYM", "W4A4", "W4A8", "W4AFP8",
                "W5A16", "W5A8", "W6A16", "W6A8", "W7A16", "W7A8", "W8A16", "W8A8")
OBSERVER_NAMES = (
    "auto", "entropy", "fouroversix", "histogram", "histogram_mse", "horizon:KLObserver",
    "horizon:MSEObserver", "horizon:MinMaxObserver", "horizon:MixObserver",
    "horizon:MovingAverageMinMaxObserver", "horizon:MovingAveragePerChannelMinMaxObserver",
    "horizon:PercentileObserver", "horizon_mse", "imatrix_mse", "kl", "l2_histogram", "linear_mse",
    "llmcompressor:memoryless_minmax", "llmcompressor:memoryless_mse", "llmcompressor:minmax",
    "llmcompressor:mse", "llmcompressor:nvfp4_expanded_mse", "llmcompressor:static_minmax",
    "memoryless_minmax", "memoryless_mse", "minmax", "mix", "moving_average_minmax",
    "moving_average_mse", "mse", "nvfp4_expanded_mse", "percentile", "placeholder", "pow2_mse",
    "quark:PerBlockBFPObserver", "quark:PerBlockMXObserver", "quark:PerChannelMinMaxObserver",
    "quark:PerGroupMinMaxObserver", "quark:PerTensorHistogramObserver",
    "quark:PerTensorHistogramObserverPro", "quark:PerTensorMSEObserver",
    "quark:PerTensorMinMaxObserver", "quark:PerTensorPercentileObserver",
    "quark:PlaceholderObserver", "quark:UniformScalingObserver", "static_minmax",
    "torch.ao:HistogramObserver", "torch.ao:MinMaxObserver",
    "torch.ao:MovingAverageMinMaxObserver", "torch.ao:MovingAveragePerChannelMinMaxObserver",
    "torch.ao:PerChannelMinMaxObserver")
TASKS = ("causal-lm", "embedding")
DEMO_MODELS = ("minilm", "smollm2-135m")
DEFAULT_OBSERVERS = "minmax,mse,percentile,entropy,mix,auto"
#: left in float unless --ignore says otherwise: the output head and the pooler (unused by
#: mean-pooled embeddings), as the peers' recipes leave them; embeddings are not Linear
DEFAULT_IGNORE = ["*pooler*", "*lm_head*"]


class UsageError(Exception):
    """A mistake in the command line: one line on stderr, exit code 2."""


# ---------------------------------------------------------------------------- parser
def _common(p: argparse.ArgumentParser, out_default: str | None) -> None:
    g = p.add_argument_group("model and data")
    g.add_argument("--model", metavar="PATH", default=None,
                   help=f"a Hugging Face model folder, or a demo model: {', '.join(DEMO_MODELS)} "
                        f"(default: minilm)")
    g.add_argument("--task", choices=TASKS, default=None,
                   help="what the model does, hence its class and metric (default: from its "
                        "config: ...ForCausalLM is a causal LM scored by perplexity)")
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
                   help="tokens per held-out Lee document at evaluation (default: 256)")
    g.add_argument("--sample-tokens", type=int, default=2048,
                   help="activation rows kept per layer for 'auto' and the report (default 2048)")
    g.add_argument("--sample-budget-mb", type=float, default=None, metavar="MB",
                   help="memory of those rows, all layers together; fewer rows per layer when "
                        "they would not fit (default: 64)")
    g.add_argument("--sequential", nargs="?", const="float", choices=("float", "quantized"),
                   default=None,
                   help="calibrate one block (decoder layer) at a time on cached inputs; "
                        "'quantized': each block fake-quantized before it feeds the next "
                        "(default when given: float, the whole-model pass's qparams)")
    g.add_argument("--threads", type=int, default=0, metavar="N",
                   help="torch CPU threads (default: torch's choice). On a busy machine 1 is "
                        "often fastest")
    g.add_argument("--seed", type=int, default=0)
    r = p.add_argument_group("what is quantized")
    r.add_argument("--targets", nargs="+", default=["Linear"], metavar="PATTERN",
                   help="modules quantized: class names, name globs or re:regex (default: Linear)")
    r.add_argument("--ignore", nargs="*", default=DEFAULT_IGNORE, metavar="PATTERN",
                   help=f"modules left in float (default: {' '.join(DEFAULT_IGNORE)}: the output "
                        f"head and pooler stay float, as the peers' recipes leave them)")
    r.add_argument("--group-size", type=int, default=None, metavar="N",
                   help="the group size of grouped weights (W4A16 ...; default: the recipe's)")
    r.add_argument("--kv-cache", choices=KV_CACHE_NAMES, default=None,
                   help="also calibrate the KV cache (keys after the rotary embedding, values; "
                        "static per tensor, with the recipe's observer): vLLM's "
                        "kv_cache_dtype, exported as k_scale / v_scale")
    r.add_argument("--on-indivisible", choices=("error", "float"), default="error",
                   help="a layer whose width the group size does not divide: stop with an "
                        "error naming the sizes that would (default), or leave it in float")
    o = p.add_argument_group("output")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    o.add_argument("--verbose", action="store_true", help="also print the per-layer table")
    if out_default is not None:
        o.add_argument("--out", default=out_default, metavar="DIR",
                       help=f"output folder, replaced if it exists (default: {out_default})")


def _recipe_args(p: argparse.ArgumentParser, many: bool) -> None:
    g = p.add_argument_group("recipe (one of --recipe, --scheme, --recipe-file)")
    if many:
        g.add_argument("--recipes", default="w8a8,w4a8",
                       help=f"comma-separated presets ({', '.join(RECIPE_NAMES)}) or scheme "
                            f"names (W8A8, W4A16, FP8 ...); default: w8a8,w4a8")
        g.add_argument("--observers", default=DEFAULT_OBSERVERS,
                       help=f"comma-separated observer names; 'auto' chooses per layer among "
                            f"the others (default: {DEFAULT_OBSERVERS})")
        return
    g.add_argument("--recipe", default=None,
                   help=f"a quantscope preset: {', '.join(RECIPE_NAMES)} (default: w8a8)")
    g.add_argument("--scheme", default=None,
                   help="a compressed-tensors preset scheme: W8A8, W8A16, W4A16, W4A16_ASYM, "
                        "W4A8, FP8, FP8_DYNAMIC, NVFP4, MXFP4 ... (as llm-compressor names them)")
    g.add_argument("--recipe-file", default=None, metavar="FILE",
                   help="a recipe as JSON or YAML, the structure of Recipe.to_dict()")
    g.add_argument("--observer", default="minmax",
                   help="observer of every calibrated role: a registry name or 'auto' "
                        "(default: minmax)")
    g.add_argument("--weight-observer", default=None, help="observer of the weights only")
    g.add_argument("--input-observer", default=None, help="observer of the input activations")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quantscope",
        description="Calibrate a model, compare observers, evaluate, export, plot.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  quantscope calibrate --scheme W8A8 --out runs/w8a8\n"
               "  quantscope calibrate --model smollm2-135m --scheme W4A16 --group-size 64 "
               "--out runs/smol\n"
               "  quantscope evaluate runs/smol\n"
               "  quantscope export runs/smol --out smol-w4a16\n"
               "  quantscope compare --recipes w8a8,w4a8 --observers minmax,mse,auto\n"
               "  quantscope plot runs/compare --layer encoder.layer.5.output.dense")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("calibrate", help="calibrate one recipe, evaluate, save qparams and report",
                       description="Calibrate a model with one recipe, apply the qparams (QDQ), "
                                   "evaluate against float, and save the qparams and report.")
    _recipe_args(p, many=False)
    _common(p, "runs/calibrate")

    p = sub.add_parser("compare", help="several recipes x observers side by side, in one pass",
                       description="Calibrate every recipe with every observer in one pass over "
                                   "the data, evaluate each, print the comparison table and "
                                   "write report.md, report.json and plots.")
    _recipe_args(p, many=True)
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
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON line")

    p = sub.add_parser("plot", help="redraw the plots of a compare run from its report.json",
                       description="Draw the activation histogram of a layer with each observer's "
                                   "clipping range, and SQNR per layer for each observer.")
    p.add_argument("run", metavar="RUN", help="a compare output directory or its report.json")
    p.add_argument("--layer", default=None,
                   help="layer for the histogram (default: where observers differ most)")
    p.add_argument("--role", default="input", choices=["input", "output"])
    p.add_argument("--recipe", default=None, help="only this recipe's clipping ranges")
    p.add_argument("--out", default=None, metavar="DIR", help="default: the run directory")

    p = sub.add_parser("export", help="write a saved calibration as a checkpoint runtimes load",
                       description="Export a `quantscope calibrate --out RUN` folder (or its "
                                   "qparams/) as a model folder runtimes load "
                                   "(compressed-tensors: transformers, vLLM).")
    p.add_argument("run", metavar="RUN", help="a calibrate output folder or its qparams/")
    p.add_argument("--out", required=True, metavar="DIR", help="the model folder to write")
    p.add_argument("--model", metavar="PATH", default=None,
                   help="the float model (default: the one the run recorded)")
    p.add_argument("--format", default="compressed-tensors", help="default: compressed-tensors")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DIR")
    p.add_argument("--allow-lossy", action="store_true",
                   help="write what the format cannot express exactly in its nearest form "
                        "(says what changed) instead of refusing")

    p = sub.add_parser("check", help="check a compressed-tensors checkpoint's fused layers",
                       description="List the fused layers (q/k/v, gate/up, w1/w3, MLA q_a/kv_a) "
                                   "whose shards disagree on a scale the runtime keeps once; "
                                   "exit 1 if any do.")
    p.add_argument("path", metavar="DIR", help="a compressed-tensors checkpoint folder")

    sub.add_parser("formats", help="the synthetic format table (quantscope.demo)",
                   description="Print the synthetic table of formats and observers.")
    return parser


# ---------------------------------------------------------------------------- checks
def _closest(name: str, names, what: str) -> UsageError:
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close
            else f"expected one of {', '.join(names)}")
    return UsageError(f"unknown {what} {name!r}; {hint}")


def _check_name(name: str, names, what: str, fold=str.lower) -> str:
    by = {fold(n): n for n in names}
    if fold(name) not in by:
        raise _closest(name, list(names), what)
    return by[fold(name)]


def _check_positive(args, *names) -> None:
    for n in names:
        v = getattr(args, n, None)
        if v is not None and v < 1:
            raise UsageError(f"--{n.replace('_', '-')} must be a positive integer, got {v}")


def _check_model_arg(path) -> None:
    if path is None or str(path).lower() in DEMO_MODELS:
        return
    if not os.path.exists(path):
        raise UsageError(f"--model {path!r} does not exist (a Hugging Face model folder, or one "
                         f"of the demo models {', '.join(DEMO_MODELS)})")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"--model {path!r} is not a Hugging Face model folder (no config.json)")


def _check_out(path) -> None:
    from .export.atomic import check_writable_target

    try:
        check_writable_target(path, overwrite=True)
    except (OSError, ValueError) as e:
        raise UsageError(f"--out: {e}") from None


def _check_recipe_args(args) -> None:
    """Every name, before anything heavy is imported: torch loads in seconds, a model in more."""
    given = [a for a in ("recipe", "scheme", "recipe_file") if getattr(args, a)]
    if len(given) > 1:
        raise UsageError(f"give one of --recipe, --scheme, --recipe-file (got "
                         f"{', '.join('--' + g.replace('_', '-') for g in given)})")
    if args.recipe:
        args.recipe = _check_name(args.recipe, RECIPE_NAMES, "recipe")
    if args.scheme:
        args.scheme = _check_name(args.scheme, SCHEME_NAMES, "scheme", str.upper)
    if args.recipe_file and not os.path.isfile(args.recipe_file):
        raise UsageError(f"--recipe-file {args.recipe_file!r} does not exist")
    if not given:
        args.recipe = "w8a8"
    for flag in ("observer", "weight_observer", "input_observer"):
        if getattr(args, flag):
            setattr(args, flag, _check_name(getattr(args, flag), OBSERVER_NAMES,
                                            f"observer (--{flag.replace('_', '-')})", str))


# ---------------------------------------------------------------------------- running
class _Phases:
    """Phase messages with times on stderr (only rank 0 speaks under torchrun)."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    def say(self, msg: str) -> None:
        if self.quiet:
            return
        print(msg, file=sys.stderr, flush=True)

    def run(self, what: str, fn):
        t = time.perf_counter()
        self.say(f"{what} ...")
        out = fn()
        self.say(f"{what}: {time.perf_counter() - t:.1f} s")
        return out


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


class _Evaluator:
    """The metric of a task: perplexity on held-out text (causal LM), or the Lee benchmark
    and cosine to fp32 embeddings (encoder). ``reference()`` scores the float model once."""

    def __init__(self, task, model, tok, max_length, progress):
        self.task, self.model, self.tok, self.max_length = task, model, tok, max_length
        self.progress = progress
        from .demo import data

        self.docs = data.lee_documents()
        self.pairs = data.lee_pairs() if task == "embedding" else None
        self.ref = None

    @property
    def primary(self) -> str:
        return "perplexity" if self.task == "causal-lm" else "lee_r"

    def _score(self, desc) -> dict:
        from .demo import models

        bar = desc if self.progress else None
        if self.task == "causal-lm":
            return {"perplexity": models.perplexity(self.model, self.tok, self.docs,
                                                    self.max_length, progress=bar)}
        emb = models.embed(self.model, self.tok, self.docs, self.max_length, progress=bar)
        if self.ref is None:
            self.ref = emb
        return {"lee_r": models.lee_correlation(emb, self.pairs),
                "cosine": float((emb * self.ref).sum(-1).mean())}

    def reference(self) -> dict:
        return self._score("evaluating float")

    def quantized(self, calibration) -> dict:
        with calibration.apply(self.model):
            return self._score("evaluating quantized")


def _metric_line(primary: str, fp: float, q: float) -> str:
    if primary == "perplexity":
        return (f"perplexity: float {fp:.2f} -> quantized {q:.2f} ({q - fp:+.2f}, "
                f"{100 * (q / fp - 1):+.1f} %)")
    return f"Lee r: float {fp:.4f} -> quantized {q:.4f} ({q - fp:+.4f})"


def _setup(args, phases: _Phases):
    """Model, calibration batches, evaluator, the float model's metrics, the run's settings."""
    from .demo import data, models

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    device = _device(args.device)
    path = models.resolve_model_path(args.model)
    task = args.task or models.model_task(path)
    model, tok = phases.run(f"loading {models.model_name(path)} ({task})",
                            lambda: models.load_model(path, device, task=task))
    docs = data.read_corpus(args.calib_file) if args.calib_file else data.lee_background()
    step = max(1, len(docs) // args.calib_docs)
    calib = docs[::step][: args.calib_docs]
    batches = models.token_batches(tok, calib, args.max_length, args.batch_size, device,
                                   args.seed)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    ev = _Evaluator(task, model, tok, args.eval_max_length, not args.no_progress)
    fp = None
    if getattr(args, "rank", 0) == 0:  # only rank 0 evaluates (under torchrun)
        fp = phases.run("evaluating float", ev.reference)
    setup = {"model": str(path), "name": models.model_name(path), "task": task,
             "device": device,
             "calib_file": args.calib_file, "calib_docs": len(calib), "calib_tokens": tokens,
             "max_length": args.max_length, "batch_size": args.batch_size,
             "eval_docs": len(ev.docs), "eval_max_length": args.eval_max_length,
             "seed": args.seed}
    if task == "embedding":
        setup["eval_pairs"] = len(ev.pairs[0])
    return model, batches, ev, fp, setup


def _build_recipe(args, model, observer=None, recipe_name=None):
    """The recipe the flags describe, checked against the model's layers."""
    from dataclasses import replace

    from .calibrate import recipe as R

    observer = observer or args.observer
    kw = {"targets": tuple(args.targets), "ignore": tuple(args.ignore or ())}
    name = recipe_name or args.recipe
    if getattr(args, "recipe_file", None):
        rec = _read_recipe_file(args.recipe_file)
    elif name is not None and name.lower() in RECIPE_NAMES:
        rec = R.preset(name, observer, **kw)
    else:
        rec = R.scheme(name or args.scheme, observer, **kw)
    if args.group_size is not None:
        rec = R.with_group_size(rec, args.group_size)
    if getattr(args, "kv_cache", None):
        rec = replace(rec, kv_cache=replace(R.kv_cache_role(args.kv_cache), observer=(
            "minmax" if observer == R.AUTO else observer)))
    if getattr(args, "weight_observer", None):
        rec = R.with_role_observer(rec, "weight", args.weight_observer)
    if getattr(args, "input_observer", None):
        rec = R.with_role_observer(rec, "input", args.input_observer)
    return _indivisible(rec, model, args.on_indivisible)


def _read_recipe_file(path):
    from .calibrate.recipe import Recipe

    with open(path) as f:
        text = f.read()
    try:
        d = json.loads(text)
    except json.JSONDecodeError:
        try:
            import yaml
        except ImportError:
            raise UsageError(f"--recipe-file {path!r} is not JSON, and YAML needs pyyaml"
                             ) from None
        d = yaml.safe_load(text)
    try:
        return Recipe.from_dict(d)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UsageError(f"--recipe-file {path!r}: not a recipe ({type(e).__name__}: {e}); "
                         f"expected the structure of Recipe.to_dict()") from None


def _indivisible(rec, model, policy: str):
    """Layers whose weight a grouped spec cannot take: an error naming the layer and the group
    sizes that would divide it, or (``policy == "float"``) those layers added to ``ignore``."""
    from dataclasses import replace

    from .layout import Group

    bad = {}
    for layer, (module, roles) in rec.match(model).items():
        role = roles.get("weight")
        if role is None or not isinstance(role.spec.layout, Group):
            continue
        width = module.weight.shape[role.spec.layout.axis]
        if width % role.spec.layout.size:
            bad[layer] = (width, role.spec.layout.size)
    if not bad:
        return rec
    if policy == "float":
        return replace(rec, ignore=rec.ignore + tuple(bad))
    layer, (width, size) = next(iter(bad.items()))
    divisors = [d for d in (16, 32, 64, 96, 128, 192, 256) if width % d == 0]
    raise UsageError(f"layer {layer!r} has width {width}, which group size {size} does not "
                     f"divide ({len(bad)} such layers); --group-size "
                     f"{' / '.join(map(str, divisors)) or '(none of 16..256)'} would, or "
                     f"--on-indivisible float leaves them in float")


def _save_run(out: str, calib, report, phases) -> None:
    from .export.atomic import atomic_dir

    def write():
        with atomic_dir(out, overwrite=True) as tmp:
            calib.save(os.path.join(tmp, "qparams"))
            report.to_json(os.path.join(tmp, "report.json"))
            report.to_markdown(os.path.join(tmp, "report.md"))
    phases.run(f"saving {out}", write)


def _float_note(rec, model) -> str:
    """Which modules the ignore list left in float (a short list)."""
    from .calibrate.recipe import _matches

    names = [n for n, m in model.named_modules()
             if n and any(_matches(p, n, m) for p in rec.ignore)]
    top = [n for n in names if not any(n.startswith(m + ".") for m in names)]
    if not top:
        return ""
    shown = ", ".join(top[:4]) + (f" and {len(top) - 4} more" if len(top) > 4 else "")
    return f"left in float: {shown} (--ignore to change)"


# ---------------------------------------------------------------------------- commands
def _sequential(args) -> dict:
    """The calibrate keywords of --sequential (none without it)."""
    mode = getattr(args, "sequential", None)
    if mode is None:
        return {}
    if getattr(args, "world", 1) > 1:
        raise UsageError("--sequential does not combine with torchrun (distributed) runs")
    return {"sequential": mode}


def cmd_calibrate(args) -> int:
    _check_recipe_args(args)
    _check_model_arg(args.model)
    _check_out(args.out)
    from .calibrate import calibrate

    phases = _Phases(quiet=getattr(args, "rank", 0) != 0)
    t0 = time.perf_counter()
    model, batches, ev, fp, setup = _setup(args, phases)
    rec = _build_recipe(args, model)
    calib = phases.run(f"calibrating {rec.name} ({setup['calib_docs']} documents, "
                       f"{setup['calib_tokens']} tokens)",
                       lambda: calibrate(model, batches, rec, sample_tokens=args.sample_tokens,
                                         sample_budget_mb=args.sample_budget_mb,
                                         **_sequential(args),
                                         progress=not args.no_progress, seed=args.seed,
                                         distributed=getattr(args, "world", 1) > 1))
    if getattr(args, "rank", 0) != 0:  # torchrun: rank 0 evaluates, writes and prints
        return 0
    t = time.perf_counter()
    q = phases.run("evaluating quantized", lambda: ev.quantized(calib))
    observer = "/".join(dict.fromkeys(
        o for o in (args.weight_observer, args.input_observer) if o)) or args.observer
    calib.label = f"{rec.name}/{observer}"
    calib.info.update(setup, eval_seconds=round(time.perf_counter() - t, 2))
    metrics = {**q, **{f"{k}_fp32": v for k, v in fp.items()}}
    report = calib.report(metrics)
    _save_run(args.out, calib, report, phases)
    if args.verbose:
        report.print()
    print(f"quantscope calibrate: {setup['name']} ({setup['task']}), "
          f"{rec.name}, observer {observer}")
    print(f"  {_metric_line(ev.primary, fp[ev.primary], q[ev.primary])}")
    if "cosine" in q:
        print(f"  cosine to float embeddings: {q['cosine']:.4f}")
    note = _float_note(rec, model)
    if note:
        print(f"  {note}")
    print(f"  calibration {calib.info.get('calibration_seconds', 0):.1f} s, total "
          f"{time.perf_counter() - t0:.1f} s")
    print(f"  report: {args.out}/report.md   next: quantscope evaluate {args.out} | "
          f"quantscope export {args.out} --out DIR")
    return 0


def _short_obs(name: str) -> str:
    return name.removeprefix("memoryless_")


def compare_rows(report: dict) -> tuple[list[str], list[list]]:
    """The comparison table (headers, rows of strings) of a compare report."""
    fp = report["fp32"]
    causal = "perplexity" in fp
    f = lambda v, d: "-" if v is None else f"{v:.{d}f}"
    if causal:
        headers = ["recipe", "observer", "perplexity", "vs fp32", "weight SQNR dB",
                   "input SQNR dB", "input clipped %", "auto chose (weight; input)"]
        rows = [["fp32", "-", f(fp["perplexity"], 2), "", "-", "-", "-", ""]]
    else:
        headers = ["recipe", "observer", "Lee r", "r - fp32", "cosine vs fp32", "weight SQNR dB",
                   "input SQNR dB", "input clipped %", "auto chose (weight; input)"]
        rows = [["fp32", "-", f(fp["lee_r"], 4), "", "1.0000", "-", "-", "-", ""]]
    for run in report["runs"].values():
        m, s = run["metrics"], run["summary"]
        w, i = s.get("weight", {}), s.get("input", {})
        chose = ""
        if run["observer"] == "auto":
            chose = "; ".join(", ".join(f"{_short_obs(k)} {v}" for k, v in sorted(
                s.get(role, {}).get("observers", {}).items(), key=lambda kv: -kv[1]))
                for role in ("weight", "input"))
        tail = [f(w.get("mean_sqnr_db"), 1), f(i.get("mean_sqnr_db"), 1),
                f(100 * i["mean_clipped"], 3) if i else "-", chose]
        if causal:
            rows.append([run["recipe"], run["observer"], f(m["perplexity"], 2),
                         f"{m['perplexity'] - fp['perplexity']:+.2f}", *tail])
        else:
            rows.append([run["recipe"], run["observer"], f(m["lee_r"], 4),
                         f"{m['lee_r'] - fp['lee_r']:+.4f}", f(m["cosine"], 4), *tail])
    return headers, rows


def cmd_compare(args) -> int:
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    observers = [o.strip() for o in args.observers.split(",") if o.strip()]
    if not recipes or not observers:
        raise UsageError("compare: need at least one recipe and one observer")
    # a quantscope preset wins over the scheme of the same letters (w8a8 is static, W8A8 not)
    recipes = [_check_name(r, SCHEME_NAMES + RECIPE_NAMES, "recipe or scheme") for r in recipes]
    observers = [_check_name(o, OBSERVER_NAMES, "observer", str) for o in observers]
    _check_model_arg(args.model)
    _check_out(args.out)
    from .calibrate import calibrate_many
    from .calibrate.report import markdown_table, print_table

    phases = _Phases(quiet=getattr(args, "rank", 0) != 0)
    model, batches, ev, fp, setup = _setup(args, phases)
    plan = {f"{r}/{o}": _build_recipe(args, model, o, r) for r in recipes for o in observers}
    candidates = [o for o in observers if o != "auto"] or None
    t = time.perf_counter()
    calibs = phases.run(f"calibrating {len(plan)} configurations in one pass", lambda: (
        calibrate_many(model, batches, plan, candidates=candidates,
                       sample_tokens=args.sample_tokens,
                       sample_budget_mb=args.sample_budget_mb, progress=not args.no_progress,
                       **_sequential(args),
                       seed=args.seed, distributed=getattr(args, "world", 1) > 1,
                       auto_metric=args.auto_metric)))
    if getattr(args, "rank", 0) != 0:  # torchrun: rank 0 evaluates, writes and prints
        return 0
    calib_seconds = time.perf_counter() - t
    t = time.perf_counter()
    runs = {}
    for k, (label, calib) in enumerate(calibs.items()):
        phases.say(f"evaluating {label} ({k + 1}/{len(calibs)})")
        d = calib.report(ev.quantized(calib)).to_dict()
        d["recipe"], d["observer"] = label.split("/", 1)
        runs[label] = d
    histograms = next(iter(calibs.values())).histograms  # one pass: every recipe shares them
    eval_seconds = time.perf_counter() - t
    report = {"setup": setup, "fp32": fp, "candidates": candidates,
              "timings": {"calibration_seconds": round(calib_seconds, 2),
                          "evaluation_seconds": round(eval_seconds, 2)},
              "runs": runs,
              "histograms": {f"{k[0]}/{k[1]}": v for k, v in histograms.items()}}
    headers, rows = compare_rows(report)
    name = setup["name"]
    metric = ("perplexity on" if setup["task"] == "causal-lm" else "Lee similarity over") + (
        f" {setup['eval_docs']} held-out documents")
    title = (f"quantscope compare: {name}, {setup['calib_docs']} calibration docs "
             f"({setup['calib_tokens']} tokens), {metric}")
    md = [f"# {title}", "", markdown_table(headers, rows), "",
          (f"Calibration (one pass, all observers): {calib_seconds:.1f} s; evaluation: "
           f"{eval_seconds:.1f} s."), ""]
    from .export.atomic import atomic_dir

    with atomic_dir(args.out, overwrite=True) as tmp:
        with open(os.path.join(tmp, "report.json"), "w") as f:
            json.dump(report, f, indent=1)
        if not args.no_plots:
            md += _plots(report, tmp, args.plot_layer)
        with open(os.path.join(tmp, "report.md"), "w") as f:
            f.write("\n".join(md))
    print_table(headers, rows, title)
    print(f"calibration {calib_seconds:.1f} s (one pass), evaluation {eval_seconds:.1f} s; "
          f"wrote {args.out}/report.md, report.json{'' if args.no_plots else ' and plots'}")
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
        print(f"warning: no plots: {e}", file=sys.stderr)
        return []


def cmd_plot(args) -> int:
    path = args.run
    if os.path.isdir(path):
        path = os.path.join(path, "report.json")
    if not os.path.isfile(path):
        raise UsageError(f"plot: {args.run!r} is not a compare run directory or report.json "
                         f"(no {path})")
    with open(path) as f:
        report = json.load(f)
    if "runs" not in report:
        raise UsageError(f"plot: {path} is not a compare report (no 'runs')")
    out = args.out or os.path.dirname(os.path.abspath(path))
    os.makedirs(out, exist_ok=True)
    from .calibrate import plots

    layer = args.layer or plots.pick_layer(report, args.role)
    if layer is None:
        raise UsageError(f"plot: the report has no static {args.role} activations")
    plots.plot_histogram(report, layer, os.path.join(out, "hist.png"), args.role, args.recipe)
    plots.plot_sqnr(report, os.path.join(out, "sqnr.png"))
    print(f"wrote {out}/hist.png ({layer} {args.role}) and {out}/sqnr.png")
    return 0


def _run_qparams(run: str) -> str:
    """The qparams folder of a calibrate run folder (or the folder itself)."""
    for cand in (os.path.join(run, "qparams"), run):
        if os.path.isfile(os.path.join(cand, "quantscope.json")):
            return cand
    raise UsageError(f"{run!r} is not a `quantscope calibrate` run (no qparams/quantscope.json "
                     f"in it)")


def cmd_evaluate(args) -> int:
    if not os.path.isdir(args.run):
        raise UsageError(f"evaluate: {args.run!r} is not a folder")
    qdir = _run_qparams(args.run)
    _check_model_arg(args.model)
    from .calibrate import load
    from .demo import models

    phases = _Phases(quiet=args.json)
    calib = load(qdir)
    info = calib.info
    source = args.model or info.get("model")
    if source is None:
        raise UsageError(f"evaluate: {qdir} does not record its model; pass --model")
    path = models.resolve_model_path(source)
    task = args.task or info.get("task") or models.model_task(path)
    max_length = args.eval_max_length or info.get("eval_max_length", 256)
    model, tok = phases.run(f"loading {models.model_name(path)} ({task})",
                            lambda: models.load_model(path, _device(args.device), task=task))
    ev = _Evaluator(task, model, tok, max_length, not (args.no_progress or args.json))
    fp = phases.run("evaluating float", ev.reference)
    q = phases.run("evaluating quantized", lambda: ev.quantized(calib))
    if args.json:
        print(json.dumps({**q, **{f"{k}_fp32": v for k, v in fp.items()}}))
        return 0
    print(f"quantscope evaluate: {qdir} on {models.model_name(path)} ({task})")
    print(f"  {_metric_line(ev.primary, fp[ev.primary], q[ev.primary])}")
    if "cosine" in q:
        print(f"  cosine to float embeddings: {q['cosine']:.4f}")
    return 0


def cmd_export(args) -> int:
    if not os.path.isdir(args.run):
        raise UsageError(f"export: {args.run!r} is not a folder")
    _run_qparams(args.run)
    _check_model_arg(args.model)
    from .export import FORMATS, export_run
    from .export.atomic import check_writable_target

    if args.format not in FORMATS:
        raise _closest(args.format, sorted(FORMATS), "format")
    try:
        check_writable_target(args.out, overwrite=args.overwrite)
    except (OSError, ValueError) as e:
        raise UsageError(f"--out: {e}") from None
    phases = _Phases()
    out = phases.run(f"exporting {args.run} as {args.format}", lambda: export_run(
        args.run, args.out, args.format, args.model, overwrite=args.overwrite,
        allow_lossy=args.allow_lossy))
    print(f"quantscope export: wrote {out} ({args.format})")
    return 0


def cmd_check(args) -> int:
    if not os.path.isfile(os.path.join(args.path, "config.json")):
        raise UsageError(f"check: {args.path!r} is not a model folder (no config.json)")
    from .export.consistency import check, format_problems

    problems = check(args.path)
    if problems:
        print(format_problems(problems))
        return 1
    print(f"{args.path}: the fused layers' shards agree")
    return 0


def cmd_formats(args) -> int:
    from .demo.formats import format_table

    print(format_table())
    return 0


COMMANDS = {"calibrate": cmd_calibrate, "compare": cmd_compare, "plot": cmd_plot,
            "evaluate": cmd_evaluate, "export": cmd_export, "check": cmd_check,
            "formats": cmd_formats}


# ---------------------------------------------------------------------------- main
class _DropMessages(logging.Filter):
    """Drops the import-time notices other libraries log on every run (exactly these)."""

    NOISE = ("Failed to load ",  # torchao: its CUDA-only extensions on a CPU build
             "is an Enum subclass and is now natively supported")  # torch's _pytree, via torchao

    def filter(self, record):
        msg = record.getMessage()
        return not any(n in msg for n in self.NOISE)


def _quiet_third_parties() -> None:
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).addFilter(_DropMessages())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    _quiet_third_parties()
    args.rank, args.world = 0, 1
    joined = False
    try:
        _check_positive(args, "calib_docs", "max_length", "batch_size", "eval_max_length",
                        "sample_tokens", "group_size")
        budget = getattr(args, "sample_budget_mb", None)
        if budget is not None and not (0 < budget < float("inf")):
            raise UsageError(f"--sample-budget-mb must be a positive number of MB, got {budget}")
        # under torchrun (WORLD_SIZE > 1): join the process group; calibration is
        # data-parallel (only then is torch.distributed imported before the checks)
        if args.command in ("calibrate", "compare") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import torch.distributed as dist

            from . import distributed as qd

            had_group = dist.is_available() and dist.is_initialized()
            joined = qd.init_from_env() and not had_group
            args.rank, args.world = qd.rank(), qd.world_size()
        return COMMANDS[args.command](args)
    except BrokenPipeError:  # `quantscope formats | head`: the reader left; say nothing
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"quantscope {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line, exit 2; --debug shows where
        if args.debug:
            raise
        where = f" (rank {args.rank})" if args.world > 1 else ""
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        kind = "" if isinstance(e, (UsageError, FileNotFoundError, ValueError)) else (
            f"{type(e).__name__}: ")
        print(f"quantscope {args.command}: error{where}: {kind}{msg}", file=sys.stderr)
        return 2
    finally:
        if joined:
            import torch.distributed as dist

            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
