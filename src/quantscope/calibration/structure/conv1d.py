"""transformers' ``Conv1D`` (GPT-2's ``c_attn`` / ``c_proj`` / ``c_fc``): a Linear holding its
weight transposed, ``[in, out]``, ``y = x @ W + b``. Recipes are written for a Linear's
``[out, in]``: a Conv1D weight takes their layouts transposed (the same units), and what
multiplies by a weight multiplies as the layer does."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ...layout import Block, Channel, Group, Tile

__all__ = ["is_conv1d", "linear_output", "observer_options", "transposed_layout"]


def is_conv1d(module: nn.Module | None) -> bool:
    """transformers' ``Conv1D``, a subclass or a copy of it in transformers, by class name and
    package (any module may have its ``nf`` attribute; transformers is not imported)."""
    return any(c.__name__ == "Conv1D" and c.__module__.startswith("transformers.")
               for c in type(module).__mro__)


def transposed_layout(lay):
    """A Linear weight's layout on its transpose (a Conv1D's): the same units."""
    if isinstance(lay, (Channel, Group, Block)) and -2 <= lay.axis < 2:
        return replace(lay, axis=1 - lay.axis % 2)
    return Tile(lay.cols, lay.rows) if isinstance(lay, Tile) else lay


def observer_options(name: str, module: nn.Module, role: str, options) -> dict:
    """Observer ``name``'s keywords on ``module``'s ``role``: ``options``, and on a Conv1D's
    weight what its ``[in, out]`` orientation needs said (``imatrix_mse``'s input channels
    are its dim 0, where the user gave no ``input_dim``)."""
    options = dict(options)
    if name == "imatrix_mse" and role == "weight" and is_conv1d(module):
        options.setdefault("input_dim", 0)
    return options


def linear_output(x: torch.Tensor, w: torch.Tensor, conv1d: bool) -> torch.Tensor:
    """``x W^T``, the layer's output without bias, for a weight as the module holds it: a
    Linear's ``[out, in]``, or a Conv1D's ``[in, out]`` (``conv1d``)."""
    return x @ (w if conv1d else w.T)
