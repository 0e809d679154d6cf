"""What ``auto``'s model-level scoring compares (:class:`.auto.OutputDivergence`): a model
output's :func:`summary` (the next-token logits of the real positions, or normalised
embeddings), and the float references of the scoring pieces, caught during the calibration
pass (:class:`FloatOutputs`), so that they need no forward of their own."""

from __future__ import annotations

import types

import torch

from ..run.batches import tensors_in
from .score_set import mask_of, piece_of

__all__ = ["FloatOutputs", "summary"]


def summary(out, mask):
    """What a divergence compares, from a model output: the next-token logits of the real
    positions (``mask``: the batch's attention mask, None where all are; causal LM; float32,
    their log-probabilities taken in float64 where compared), mean-pooled normalised
    embeddings (encoder, float64: ``[rows, hidden]``), or the tensor; an output of one value
    per row (a regression head, HF's ``num_labels=1`` logits too) as one vector over the
    batch."""
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, dict):
        logits = out.get("logits")
    if logits is not None and logits.shape[-1] > 1:  # one logit (a regression head): no KL
        rows = logits.reshape(-1, logits.shape[-1])
        if mask is not None and logits.dim() == 3 and mask.shape == logits.shape[:2]:
            rows = logits[mask.to(logits.device).bool()]  # (a block's: the user's batch's)
        # a copy: a stored reference keeps no view of the whole output alive
        return ("kl", rows.to(torch.float32, copy=True))
    hidden = logits if logits is not None else getattr(out, "last_hidden_state", None)
    if hidden is None:
        hidden = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"cannot compare model outputs of type {type(out).__name__} (auto's "
                        f"and sensitivity's divergence reads logits, last_hidden_state or a "
                        f"tensor); pass loss=callable(output, reference_output, batch)")
    hidden = hidden.double()
    if hidden.dim() == 3:
        m = (torch.ones(hidden.shape[:2], device=hidden.device) if mask is None
             or mask.shape != hidden.shape[:2] else mask).to(hidden.device, hidden.dtype)
        hidden = (hidden * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp(min=1)
    rows = hidden.reshape(hidden.shape[0], -1)
    if rows.shape[1] == 1:  # one value a row has no direction: the batch's column is the vector
        rows = rows.reshape(1, -1)
    return ("cos", torch.nn.functional.normalize(rows, dim=-1))


class FloatOutputs:
    """Catches, during the calibration pass (a float forward of every batch), the summaries
    :class:`.auto.OutputDivergence` compares for the scoring pieces: their float references need
    no forward of their own. Only for the default divergence (a user's ``loss`` sees whole
    outputs) and outputs with ``logits`` or ``last_hidden_state``."""

    def __init__(self, model, batches, plan):
        self.plan, self.batches = plan, batches
        # a batch by the identities of all its tensors: the first alone is not its own (a
        # mask shared by every batch, first in each dict, took the last batch's index and
        # scored the candidates against the first batch's float output, found by probing);
        # batches of the same tensors have the same float output
        self.want = {}
        for i, _, _ in plan:
            if (key := _identity(batches[i])) is not None:
                self.want.setdefault(key, []).append(i)
        self.got = {}
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, out):
        for i in self.want.get(_identity(kwargs if kwargs else args), ()):
            if i not in self.got:
                self._catch(i, out)

    def _catch(self, i, out):
        for k, (j, a, b) in enumerate(self.plan):
            if j != i:
                continue
            for name in ("logits", "last_hidden_state"):
                t = getattr(out, name, None)
                if isinstance(t, torch.Tensor):
                    cut = types.SimpleNamespace(**{name: t if b is None else t[a:b]})
                    piece = piece_of(self.batches[i], a, b)
                    self.got.setdefault(i, {})[k] = summary(cut, mask_of(piece))
                    break
        self.got.setdefault(i, {})

    def references(self):
        self.handle.remove()
        return [self.got.get(i, {}).get(k) for k, (i, _, _) in enumerate(self.plan)]


def _identity(x) -> tuple[int, ...] | None:
    """The ids of the tensors of a batch (or of a forward's arguments), None without any."""
    return tuple(map(id, tensors_in(x))) or None
