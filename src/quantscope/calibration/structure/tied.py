"""The weights modules hold. Tied weights: one weight Parameter several modules hold (a tied
``lm_head`` and its embedding). ``apply()`` fake-quantizes the one Parameter, so every holder
runs it quantized; an exporter would write it quantized for one holder and float for the
others, so every exporter refuses it. A module's own weights (:func:`own_weights`): what the
refusals of a module quantscope does not quantize name (an LSTM's, a block's layers')."""

from __future__ import annotations

from collections import defaultdict

from torch import nn
from torch.nn.parameter import is_lazy

__all__ = ["is_block", "no_weight_role", "own_weights", "tied_weights"]


def own_weights(module: nn.Module) -> list[str]:
    """The names of ``module``'s own Parameters of 2 dims or more, its submodules' left out: a
    Linear's ``weight``, an LSTM's ``weight_ih_l0`` / ``weight_hh_l0``, none of a block's."""
    return [n for n, p in module.named_parameters(recurse=False)
            if not is_lazy(p) and p.dim() >= 2]


def is_block(module: nn.Module) -> bool:
    """Whether ``module`` holds no weight of its own and the layers in it hold theirs (a
    Sequential, a transformer block): a target for the Linears in it, not for itself."""
    return (getattr(module, "weight", None) is None and not own_weights(module)
            and any(own_weights(m) for m in module.modules() if m is not module))


def no_weight_role(module: nn.Module) -> str:
    """Why ``module`` takes no weight role: its ``weight`` has under 2 dims (a norm's scale),
    or it has none: the layers in it hold theirs, or its own weights are Parameters of other
    names (an LSTM's), or it has no weights."""
    weight = getattr(module, "weight", None)
    if weight is not None:
        return f"has a {weight.dim()}-D weight (a norm's scale), no layer's"
    if is_block(module):
        return "holds no weight for the weight role (the layers in it do)"
    own = own_weights(module)
    if not own:
        return "holds no weight for the weight role"
    names = ", ".join(own[:4]) + (", ..." if len(own) > 4 else "")
    return (f"holds no `weight` for the weight role: its weights are the Parameters {names}, "
            f"which quantscope does not quantize (it quantizes a layer's `weight`: a "
            f"Linear's, a convolution's, an Embedding's); give it a rule with an input role "
            f"alone, or rules on the Linear layers around it")


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
