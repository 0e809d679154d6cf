"""Tied weights: one weight several modules hold (a tied ``lm_head`` and its embedding, or
distinct Parameters over one memory, as ``load_state_dict(..., assign=True)`` makes).
``apply()`` fake-quantizes that memory once, so every holder runs it quantized; an exporter
would write it quantized for one holder and float for the others, so every exporter refuses
it. :func:`memory` is the one rule telling which weights are one: ``apply()``, its warning
and the exporters all go through it. SmoothQuant, which rescales a tensor in place, asks the
wider question, any memory in common (:func:`sharers`)."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .placement import plain

__all__ = ["extent", "holders", "memory", "sharers", "tied_weights"]


def memory(t: torch.Tensor):
    """Which values ``t`` is: distinct Parameters over the same memory (another model's
    weights loaded with ``load_state_dict(..., assign=True)``) are one weight, to quantize
    once, restore once, and export for every holder alike."""
    # no memory to tell apart (empty, lazy; meta tensors all report address 0), none to read
    if is_lazy(t) or not t.numel() or not plain(t) or t.device.type == "meta":
        return id(t)
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()))


def extent(t: torch.Tensor) -> int:
    """The storage index of ``t``'s last element: its offset plus each dimension's reach."""
    return t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _span(t: torch.Tensor) -> tuple:
    """``(memory, first byte, last byte)`` of ``t``'s elements; the memory is its device and
    storage address, or ``t`` itself where there is none to compare (empty, meta, a tensor
    subclass: then only ``t`` itself is found to share it)."""
    if not t.numel() or not plain(t) or t.device.type == "meta":
        return ("object", id(t)), 0, 0
    size = t.element_size()
    return ((t.device, t.untyped_storage().data_ptr()), t.storage_offset() * size,
            (extent(t) + 1) * size - 1)


def holders(model: nn.Module) -> dict:
    """``{memory: [(name, module, attribute, first byte, last byte)]}`` (:func:`_span`): every
    parameter and buffer of ``model``, a module under each of its names, for :func:`sharers`."""
    found: dict = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for attr, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                key, first, last = _span(t)
                found.setdefault(key, []).append((name, module, attr, first, last))
    return found


def sharers(found: dict, module: nn.Module, attr: str) -> list[str]:
    """The other places of ``found`` (:func:`holders`) holding some of the bytes
    ``module.attr`` lies in, as ``name.attribute`` (one name each): the same Parameter,
    another Parameter over its memory, or an overlapping slice of one tensor. Writing
    ``module.attr`` in place changes what each of them holds. Slices whose spans of one
    storage do not meet (q / k / v rows of one fused tensor) share nothing; ones that
    interleave (a split of columns) are counted as sharing."""
    key, first, last = _span(getattr(module, attr))
    out, seen = [], {(id(module), attr)}
    for name, other, a, lo, hi in found.get(key, []):
        if (id(other), a) not in seen and lo <= last and first <= hi:
            seen.add((id(other), a))
            out.append(f"{name}.{a}" if name else a)
    return out


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
