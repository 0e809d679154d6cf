"""The argument groups that ``calibrate`` and ``compare`` share: the model and its data,
what is quantized, the output, and the recipe (one, or several with their observers)."""

from __future__ import annotations

import argparse

from .names import (
    DEFAULT_IGNORE,
    DEFAULT_OBSERVERS,
    DEFAULT_TARGETS,
    DEMO_MODELS,
    KV_CACHE_NAMES,
    RECIPE_NAMES,
    TASKS,
)


def add_common(p: argparse.ArgumentParser, out_default: str | None) -> None:
    """The model, data, target and output arguments of a calibrating command."""
    add_model_args(p)
    add_target_args(p)
    add_output_args(p, out_default)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, its device, the calibration data and the run's resources."""
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
                   help="calibration text, UTF-8, one document per line (default: "
                        "gensim's lee_background.cor, 300 news documents)")
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
    add_threads_arg(g)
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the order of the calibration batches and the activation "
                        "rows sampled (default: 0)")


def add_threads_arg(p) -> None:
    """``--threads``: of every command that runs the model (calibrate, compare, evaluate)."""
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="torch CPU threads (default: torch's choice). On a busy machine 1 is "
                        "often fastest")


def add_other_weights_arg(p) -> None:
    """``--allow-other-weights``: of the commands that apply a saved run (evaluate, export)."""
    p.add_argument("--allow-other-weights", action="store_true",
                   help="apply the run's scales to a model whose weights differ from those "
                        "calibrated (fine-tuned since), not refuse it: no fingerprint check; "
                        "values past the calibrated ranges clip")


def add_target_args(p: argparse.ArgumentParser) -> None:
    """Which modules are quantized, and how the recipe adapts to them."""
    r = p.add_argument_group("what is quantized")
    # None: not given (a recipe file's rules keep their own targets)
    r.add_argument("--targets", nargs="*", default=None, metavar="PATTERN",
                   help=f"modules quantized: class names, name globs or re:regex (default: "
                        f"{' '.join(DEFAULT_TARGETS)}; with --recipe-file, the modules its "
                        f"rules take, which --targets narrows; no pattern: no layer, only "
                        f"--kv-cache's KV cache). Targets that match no module are an error, "
                        f"with --kv-cache too")
    r.add_argument("--ignore", nargs="*", default=DEFAULT_IGNORE, metavar="PATTERN",
                   help=f"modules left in float (default: {' '.join(DEFAULT_IGNORE)}: the output "
                        f"head and pooler stay float, as the peers' recipes leave them; with "
                        f"--recipe-file, added to its ignore list)")
    r.add_argument("--group-size", type=int, default=None, metavar="N",
                   help="the group size of grouped weights (W4A16 ...; default: the recipe's)")
    r.add_argument("--kv-cache", choices=KV_CACHE_NAMES, default=None,
                   help="also calibrate the KV cache (keys after the rotary embedding, values; "
                        "static per tensor, with the recipe's observer): vLLM's "
                        "kv_cache_dtype, exported as k_scale / v_scale")
    r.add_argument("--on-indivisible", choices=("error", "float"), default="error",
                   help="a layer whose width the group size (or an MX / NVFP4 format's "
                        "block) does not divide: stop with an error naming the sizes that "
                        "would (default), or leave it in float")


def add_output_args(p: argparse.ArgumentParser, out_default: str | None) -> None:
    """Progress, verbosity and the output folder (none where ``out_default`` is None)."""
    o = p.add_argument_group("output")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    o.add_argument("--verbose", action="store_true", help="also print the per-layer table")
    if out_default is not None:
        o.add_argument("--out", default=out_default, metavar="DIR",
                       help=f"output folder, replaced if quantscope wrote it (never the model "
                            f"or the working folder; default: {out_default})")


def add_recipe_args(p: argparse.ArgumentParser) -> None:
    """One recipe: a preset, a scheme or a file, and its observers."""
    g = p.add_argument_group("recipe (one of --recipe, --scheme, --recipe-file)")
    g.add_argument("--recipe", default=None,
                   help=f"a quantscope preset: {', '.join(RECIPE_NAMES)} (default: w8a8)")
    g.add_argument("--scheme", default=None,
                   help="a compressed-tensors preset scheme: W8A8, W8A16, W4A16, W4A16_ASYM, "
                        "W4A8, FP8, FP8_DYNAMIC, NVFP4, MXFP4 ... (as llm-compressor names them)")
    g.add_argument("--recipe-file", default=None, metavar="FILE",
                   help="a recipe as JSON or YAML, the structure of Recipe.to_dict()")
    # None: not given (a recipe file's roles keep their own observers)
    g.add_argument("--observer", default=None,
                   help="observer of every calibrated role: a native registry name or "
                        "'auto' "
                        "(default: the preset's or scheme's own, minmax unless it names "
                        "another; with --recipe-file, the file's observers)")
    g.add_argument("--weight-observer", default=None, help="observer of the weights only")
    g.add_argument("--input-observer", default=None,
                   help="observer of the input activations (an error where the recipe "
                        "calibrates none: W4A16 has no input role, dynamic inputs none)")
    add_activation_args(g)


def add_activation_args(g) -> None:
    """What helps static activations where no range fits (issue 17): SmoothQuant, and the
    float fallback of the activations the model feels most."""
    g.add_argument("--smooth", type=float, default=None, metavar="ALPHA",
                   help="SmoothQuant before calibrating: move each decoder layer's activation "
                        "outliers into the next weights with strength ALPHA in [0, 1] "
                        "(llm-compressor's smoothing_strength; 0.8 is a good start for static "
                        "per-tensor int8; changes the weights written by export)")
    g.add_argument("--keep-float", type=int, default=0, metavar="N",
                   help="keep the N activations whose quantization moves their layer's output "
                        "most out of static quantization (ranked on the first batch; "
                        "default: 0)")
    g.add_argument("--fallback", choices=("dynamic", "float"), default="dynamic",
                   help="what --keep-float's activations become: quantized per token at run "
                        "time (dynamic, default) or float")


def add_recipes_args(p: argparse.ArgumentParser) -> None:
    """Several recipes, each calibrated with each observer."""
    g = p.add_argument_group("recipes and observers (each recipe with each observer)")
    g.add_argument("--recipes", default="w8a8,w4a8",
                   help=f"comma-separated quantscope presets, lower case "
                        f"({', '.join(RECIPE_NAMES)}), or compressed-tensors scheme names as "
                        f"it spells them (W8A8, W4A16, FP8 ...): w8a8 is the preset (static "
                        f"inputs), W8A8 the scheme (dynamic inputs); default: w8a8,w4a8")
    g.add_argument("--observers", default=DEFAULT_OBSERVERS,
                   help=f"comma-separated observer names; 'auto' chooses among the others "
                        f"as --auto-metric says (default: {DEFAULT_OBSERVERS})")
    add_activation_args(g)
