"""How a calibration batch is fed to a model: the one rule every pass (calibration, fusion
detection, auto's scoring, sensitivity) uses."""

from __future__ import annotations

import torch

__all__ = ["forward_batch", "map_tensors", "tensors_in"]


def forward_batch(model, batch):
    """``model(**batch)`` for a dict (a tokenizer's output), ``model(*batch)`` for a tuple or
    list, ``model(batch)`` otherwise."""
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def tensors_in(value):
    """The tensors of a nested tuple / list / dict (a batch, a block's arguments or output)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)


def map_tensors(fn, value):
    """``value`` with ``fn`` applied to each of its tensors, the nesting kept."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(fn, v) for k, v in value.items()}
    return value
