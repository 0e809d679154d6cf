"""What ``calibrate`` and ``compare`` run on: the model, its calibration batches and its
metric, and phase messages with their times."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from .checks import UsageError, calib_documents


class Phases:
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


def resolve_device(name: str) -> str:
    """``--device`` as torch names it, checked against the devices this torch sees (the
    spelling is checked before torch is imported: checks.check_resource_args)."""
    import torch

    from ..calibration.options import check_device

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        check_device(torch.device(name), "--device")
    except ValueError as e:
        raise UsageError(str(e)) from None
    return name


class Evaluator:
    """The metric of a task: perplexity on held-out text (causal LM), or the Lee benchmark
    and cosine to fp32 embeddings (encoder). ``reference()`` scores the float model once."""

    def __init__(self, task, model, tok, max_length, progress):
        self.task, self.model, self.tok, self.max_length = task, model, tok, max_length
        self.progress = progress
        from ..demo import data

        self.docs = data.lee_documents()
        self.pairs = data.lee_pairs() if task == "embedding" else None
        self.ref = None

    @property
    def primary(self) -> str:
        return "perplexity" if self.task == "causal-lm" else "lee_r"

    def _score(self, desc) -> dict:
        from ..demo import models

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


def metric_line(primary: str, fp: float, q: float) -> str:
    """The summary's metric, float then quantized, and the change; a change that is no number
    (inf -> inf: both perplexities overflowed, a mean NLL over 709 nats; or a NaN metric) is
    said to be undefined, not printed as +nan."""
    name, d = ("perplexity", 2) if primary == "perplexity" else ("Lee r", 4)
    line = f"{name}: float {fp:.{d}f} -> quantized {q:.{d}f}"
    if math.isnan(q - fp):
        return f"{line} (change undefined)"
    if primary == "perplexity":
        return f"{line} ({signed(q - fp, 2)}, {signed(100 * (q / fp - 1), 1)} %)"
    return f"{line} ({signed(q - fp, 4)})"


def signed(change: float, digits: int) -> str:
    """A change with its sign (``+0.0037``), none where it rounds to zero: ``0.0000``, not
    ``-0.0000`` (a change of -0.00002) nor ``+0.0 %``."""
    text = f"{change:+.{digits}f}"
    return text[1:] if float(text) == 0 else text


def spread(docs: list, n: int) -> list:
    """``n`` of ``docs`` taken evenly over all of them (every ``len / n``-th), in order."""
    n = min(n, len(docs))
    return [docs[i * len(docs) // n] for i in range(n)]


def set_threads(args) -> None:
    """torch's CPU threads as ``--threads`` says (0: torch's choice); the caller's count is
    kept in ``args.threads_before`` for ``main`` to put back."""
    if args.threads:
        import torch

        args.threads_before = torch.get_num_threads()
        torch.set_num_threads(args.threads)


def load_setup(args, phases: Phases, prepare=None):
    """Model, calibration batches, evaluator, the float model's metrics, the run's settings
    and ``prepare(model)``: run once the model is loaded, before any forward (the recipe and
    its checks against the model's shapes and attention: a mistake costs seconds, not an
    evaluation)."""
    from ..demo import data, models

    set_threads(args)
    device = resolve_device(args.device)
    path = models.resolve_model_path(args.model)
    task = args.task or models.model_task(path)
    check_text_config(path, task)  # before the tokenizer: an image model has none
    model, tok = phases.run(f"loading {models.model_name(path)} ({task})",
                            lambda: models.load_model(path, device, task=task))
    _check_text_model(model, path)
    args.max_length = fit_length(model, args.max_length, "--max-length", phases)
    args.eval_max_length = fit_length(model, args.eval_max_length, "--eval-max-length", phases)
    prepared = prepare(model) if prepare is not None else None
    docs = calib_documents(args.calib_file) if args.calib_file else data.lee_background()
    calib = spread(docs, args.calib_docs)
    batches = models.token_batches(tok, calib, args.max_length, args.batch_size, device,
                                   args.seed)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    _check_token_ids(model, tok, batches, path)
    ev = Evaluator(task, model, tok, args.eval_max_length, not args.no_progress)
    fp = None
    if getattr(args, "rank", 0) == 0:  # only rank 0 evaluates (under torchrun)
        fp = phases.run("evaluating float", ev.reference)
    # absolute: evaluate / export of the run from another folder load this model, this data
    calib_file = str(Path(args.calib_file).resolve()) if args.calib_file else None
    setup = {"model": str(Path(path).resolve()), "name": models.model_name(path), "task": task,
             "device": device,
             "calib_file": calib_file, "calib_docs": len(calib), "calib_tokens": tokens,
             "max_length": args.max_length, "batch_size": args.batch_size,
             "eval_docs": len(ev.docs), "eval_max_length": args.eval_max_length,
             "seed": args.seed}
    if task == "embedding":
        setup["eval_pairs"] = len(ev.pairs[0])
    return model, batches, ev, fp, setup, prepared


def check_text_config(path, task: str) -> None:
    """:func:`_check_text_class` from the folder's config and the class ``task`` loads, before
    anything else of the folder is read; a config transformers maps to no class of that task
    is checked once the model is loaded."""
    from .._versions import require

    require("transformers", "--model")  # before its import: the error names what to install
    from transformers.models.auto import modeling_auto

    from ..calibration.run.hf_loader import load_config

    config = load_config(path, "--model")  # never runs the folder's code
    mapping = (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING if task == "causal-lm"
               else modeling_auto.MODEL_MAPPING)
    try:
        cls = mapping[type(config)]
    except KeyError:
        return
    _check_text_class(cls, config, path)


def _check_text_model(model, path) -> None:
    _check_text_class(type(model), model.config, path)


def _check_text_class(cls, config, path) -> None:
    """The command line feeds text (token ids) to a causal LM or a text encoder: refuse, before
    an evaluation fails inside the model, an encoder-decoder (T5, Whisper) or a model whose
    input is not token ids (ViT's pixel_values, an audio model's input_values)."""
    takes = getattr(cls, "main_input_name", "input_ids")
    if getattr(config, "is_encoder_decoder", False) or takes != "input_ids":
        kind = "an encoder-decoder" if takes == "input_ids" else f"a model of {takes}"
        raise UsageError(f"model {str(path)!r} ({cls.__name__}) is {kind}; the command "
                         f"line calibrates causal LMs and text encoders on text: calibrate it "
                         f"from Python, quantscope.calibrate(model, batches, recipe)")


def _check_token_ids(model, tok, batches, path) -> None:
    """Refuse a tokenizer whose ids pass the model's embedding (another model's tokenizer in
    the folder) before a forward fails with torch's bare IndexError."""
    rows = model.get_input_embeddings().num_embeddings
    top = max((int(b["input_ids"].max()) for b in batches if b["input_ids"].numel()), default=-1)
    if top >= rows:
        raise UsageError(f"model {str(path)!r}: its tokenizer gives token id {top} (it holds "
                         f"{len(tok)} tokens) but the model's embedding has {rows} rows "
                         f"(config vocab_size {getattr(model.config, 'vocab_size', None)}); "
                         f"is the tokenizer another model's?")


def positions(model) -> int | None:
    """The tokens a model's position embeddings hold (``config.max_position_embeddings``),
    None when its config does not say."""
    n = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(n, int) or n < 1:
        return None
    import torch

    words = model.get_input_embeddings()
    for m in model.modules():  # RoBERTa's positions count from after its padding row
        if isinstance(m, torch.nn.Embedding) and m is not words and m.num_embeddings == n \
                and m.padding_idx is not None and n - m.padding_idx - 1 >= 1:
            return n - m.padding_idx - 1
    return n


def fit_length(model, length: int, flag: str, phases: Phases) -> int:
    """``length`` tokens, or fewer when the model holds fewer positions (a small BERT): longer
    documents are truncated to what the model can take, and the run says so."""
    n = positions(model)
    if n is None or length <= n:
        return length
    phases.say(f"{flag} {length}: the model takes {n} positions, so documents are truncated "
               f"to {n} tokens")
    return n


def command_inputs(args) -> list:
    """The paths a calibrating command reads, which its ``--out`` must never replace (a demo
    model's name is resolved with the run's setup, at save time; a folder of that name here
    is a path: :func:`~quantscope._plainchecks.demo_model_name`)."""
    from .._plainchecks import demo_model_name

    model = args.model if args.model and demo_model_name(args.model) is None else None
    return [p for p in (model, getattr(args, "calib_file", None),
                        getattr(args, "recipe_file", None)) if p]


def calibration_options(args, candidates=None) -> dict:
    """The option objects of ``calibrate`` / ``calibrate_many`` the flags describe
    (:mod:`quantscope.calibration.options`), as keywords; ``candidates``: auto's observers."""
    from ..calibration.options import Auto, Outliers, Runtime, Sampling

    mode, world = getattr(args, "sequential", None), getattr(args, "world", 1)
    if mode is not None and world > 1:
        raise UsageError("--sequential does not combine with torchrun (distributed) runs")
    return {"sampling": Sampling(args.sample_tokens, args.sample_budget_mb, args.seed),
            "auto": Auto(candidates, getattr(args, "auto_metric", "model"),
                         score_tokens=getattr(args, "score_tokens", 1024)),
            "outliers": Outliers(args.smooth, args.keep_float, args.fallback),
            "sequential": mode, "runtime": Runtime(distributed=world > 1),
            "progress": not args.no_progress}

