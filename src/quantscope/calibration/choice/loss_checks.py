"""Checks of what ``auto``'s scoring computes on a batch: a user's loss, the batch, the model's
output. Shared by the ``"model"`` metric (:class:`.auto.OutputDivergence`) and ``"fisher"``
(:func:`.layer_choice.fisher_weights`), so both say the same of the same mistake."""

from __future__ import annotations

import numbers

import torch

from ..run.batches import tensors_in

__all__ = ["batch_error", "batch_name", "finite", "loss_error", "none_left_error", "scalar"]


def scalar(who: str, what: str, value, where: str = "", graph: bool = False) -> float:
    """``value``, what the user's callable ``what`` returned, as a float: a real number or a
    one-element tensor; else ``TypeError`` naming ``who``'s ``what`` (a vector or None:
    not Python's bare ``float()`` error). ``where``: said after it (" on batch 3").
    ``graph``: a loss to differentiate, so only a one-element tensor that requires grad."""
    need = ("a one-element tensor with a graph back to the model's output" if graph
            else "a number or a one-element tensor")
    got = None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        if graph and not value.requires_grad:
            got = "a tensor that does not require grad"
        value = value.detach().item()
    elif graph and not isinstance(value, torch.Tensor):  # a number: nothing to differentiate
        got = type(value).__name__
    if got is None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        got = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
               else type(value).__name__)
    if got is not None:
        raise TypeError(f"{who}: {what} must return a finite scalar ({need}), got {got}{where}")
    return float(value)


def finite(value, logits: bool = False) -> bool:
    """Whether every floating tensor of ``value`` (a batch, an output) is finite; ``logits``:
    -inf allowed (a banned token's logit: probability 0) in a real tensor, not a complex one."""
    def ok(t):
        return ~(t.isnan() | t.isposinf()) if logits and not t.is_complex() else t.isfinite()
    return all(bool(ok(t).all()) for t in tensors_in(value)
               if t.is_floating_point() or t.is_complex())


def batch_name(k: int) -> str:
    """What the errors call the ``k``-th batch."""
    return f"batch {k} (counting from 0)"


def batch_error(who: str, where: str) -> ValueError:
    """The error of the batch ``where`` names (:func:`batch_name`, or auto's scoring piece)
    bringing NaN / inf (in it, or in the float model's output on it), as calibrate says of a
    calibration batch."""
    return ValueError(f"{who}: {where} brought NaN or inf values (the float model's output on "
                      f"it is not finite); fix that batch (or what makes the model produce "
                      f"them)")


def loss_error(who: str, what: str, where: str, value: float, outputs: str) -> ValueError:
    """The error of the user's loss ``what`` returning the non-finite ``value`` on the batch
    ``where`` names, where the outputs it was given are finite (``outputs`` says which)."""
    return ValueError(f"{who}: {what} returned {value} on {where}, where {outputs} finite; "
                      f"{what} must return a finite scalar")


def none_left_error(who: str, n: int, purpose: str) -> ValueError:
    """The error of ``non_finite='ignore'`` leaving out all ``n`` scoring batches (each brought
    NaN / inf, or made the float model's output so): none is left to ``purpose``."""
    return ValueError(f"{who}: every scoring batch ({n}) brought NaN or inf values (or made the "
                      f"float model's output so), which non_finite='ignore' leaves out of the "
                      f"scoring: none is left to {purpose}; give finite batches")
