"""Tied weights: one weight Parameter several modules hold (a tied ``lm_head`` and its
embedding). ``apply()`` fake-quantizes the one Parameter, so every holder runs it quantized;
an exporter would write it quantized for one holder and float for the others, so every
exporter refuses it."""

from __future__ import annotations

from collections import defaultdict

from torch import nn

__all__ = ["tied_weights"]


def tied_weights(model: nn.Module, layers) -> dict[str, list[str]]:
    """``{layer: the other modules holding its weight}`` for each of ``layers`` whose weight
    Parameter another module shares."""
    owners = defaultdict(list)
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, module in modules.items():
        w = getattr(module, "weight", None)
        if isinstance(w, nn.Parameter):
            owners[id(w)].append(name)
    tied = {}
    for layer in layers:
        module = modules.get(layer)
        w = getattr(module, "weight", None)
        # another module holding it; the layer's own module under a second name is no other
        others = sorted(n for n in owners[id(w)] if modules[n] is not module) \
            if isinstance(w, nn.Parameter) else []
        if others:
            tied[layer] = others
    return tied
