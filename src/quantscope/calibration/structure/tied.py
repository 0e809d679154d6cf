"""Tied weights: one weight several modules hold (a tied ``lm_head`` and its embedding, or
distinct Parameters over one memory, as ``load_state_dict(..., assign=True)`` makes).
``apply()`` fake-quantizes that memory once, so every holder runs it quantized; an exporter
would write it quantized for one holder and float for the others, so every exporter refuses
it. :func:`memory` is the one rule telling which weights are one: ``apply()``, its warning
and the exporters all go through it."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from .placement import plain

__all__ = ["memory", "tied_weights"]


def memory(t: torch.Tensor):
    """Which values ``t`` is: distinct Parameters over the same memory (another model's
    weights loaded with ``load_state_dict(..., assign=True)``) are one weight, to quantize
    once, restore once, and export for every holder alike."""
    # no memory to tell apart (empty; meta tensors all report address 0), none to read
    if not t.numel() or not plain(t) or t.device.type == "meta":
        return id(t)
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()))


def tied_weights(model: nn.Module, layers) -> dict[str, list[str]]:
    """``{layer: the other modules holding its weight}`` for each of ``layers`` whose weight
    another module holds too (the same Parameter, or one over its memory: :func:`memory`)."""
    owners = defaultdict(list)
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, module in modules.items():
        w = getattr(module, "weight", None)
        if isinstance(w, nn.Parameter):
            owners[memory(w)].append(name)
    tied = {}
    for layer in layers:
        module = modules.get(layer)
        w = getattr(module, "weight", None)
        # another module holding it; the layer's own module under a second name is no other
        others = sorted(n for n in owners[memory(w)] if modules[n] is not module) \
            if isinstance(w, nn.Parameter) else []
        if others:
            tied[layer] = others
    return tied
