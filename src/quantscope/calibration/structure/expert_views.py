"""The per-expert views of a transformers-5 experts module (:mod:`.moe`): an expert's two
``nn.Linear`` over the slices of the module's 3-D parameters, the eager routing loop through
them, and the ``state_dict`` hook that leaves their keys out. Hooks and forwards are objects,
not closures: pickling an applied model reaches the handle's refusal, which names the MoE
wiring, not pickle's "Can't pickle local object"."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MARK", "DropViews", "Expert", "RoutedForward", "expert_weight", "is_experts_3d",
           "is_gated", "view_source", "view_weight"]


def is_experts_3d(module: nn.Module) -> bool:
    """A transformers-5 experts module: 3-D ``down_proj`` and ``gate_up_proj`` / ``up_proj``."""
    up = getattr(module, "gate_up_proj", None)
    if up is None:
        up = getattr(module, "up_proj", None)
    down = getattr(module, "down_proj", None)
    return (isinstance(up, nn.Parameter) and isinstance(down, nn.Parameter)
            and up.dim() == 3 and down.dim() == 3 and up.shape[0] == down.shape[0])


def is_gated(module: nn.Module) -> bool:
    """An experts module whose ``gate_up_proj`` holds gate rows then up rows (not an
    ungated ``up_proj``)."""
    return getattr(module, "has_gate", True) and hasattr(module, "gate_up_proj")


MARK = "_quantscope_expert"


class _ExpertLinear(nn.Linear):
    """One expert's Linear: ``weight`` (and ``bias``) are frozen views of the 3-D parameters'
    slices, what observers and the report read; the forward takes the slices from the experts
    module's parameters as it holds them now, so autograd reaches them (training under
    ``apply``) and a cast of the model (``model.to``) is what runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, *self._live())


def _view_linear(parent: nn.Module, name: str, e: int) -> nn.Linear:
    """Expert ``e``'s Linear over the slice ``e`` of ``parent``'s 3-D parameter ``name`` (and of
    its bias, where the module has one)."""
    has_bias = getattr(parent, "has_bias", False)
    bias = getattr(parent, f"{name}_bias", None) if has_bias else None
    weight = expert_weight(parent, name, e)
    lin = _ExpertLinear(1, 1, bias=False, device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=False)
    lin.in_features, lin.out_features = weight.shape[1], weight.shape[0]
    lin.bias = None if bias is None else nn.Parameter(bias.data[e], requires_grad=False)
    # a plain attribute, not a submodule: the parent holds the child
    lin._live = _LiveSlices(parent, name, e, bias is not None)
    setattr(lin, MARK, True)
    return lin


class _LiveSlices:
    """Expert ``e``'s weight (and bias) slices of ``parent``'s 3-D parameter ``name`` as the
    module holds them now."""

    def __init__(self, parent: nn.Module, name: str, e: int, has_bias: bool):
        self.parent, self.name, self.e, self.has_bias = parent, name, e, has_bias

    def __call__(self):
        bias = getattr(self.parent, f"{self.name}_bias")[self.e] if self.has_bias else None
        return expert_weight(self.parent, self.name, self.e, live=True), bias


class Expert(nn.Module):
    """One expert of a 3-D experts module, as two Linear views (its gate_up and down)."""

    def __init__(self, parent: nn.Module, e: int):
        super().__init__()
        for child in ("gate_up_proj", "down_proj"):
            self.add_module(child, _view_linear(parent, view_source(parent, child), e))
        self.gated = is_gated(parent)


def view_source(parent: nn.Module, child: str) -> str:
    """The 3-D parameter of ``parent`` that an expert's ``child`` Linear views."""
    if child == "gate_up_proj":
        return "gate_up_proj" if is_gated(parent) else "up_proj"
    return child


def expert_weight(parent: nn.Module, name: str, e: int, live: bool = False) -> torch.Tensor:
    """Expert ``e``'s ``[out, in]`` weight: a view of the slice of ``parent``'s 3-D parameter
    ``name``, as it holds it now (``live``: through autograd; else of its ``.data``)."""
    w = getattr(parent, name)[e] if live else getattr(parent, name).data[e]
    return w.t() if getattr(parent, "is_transposed", False) else w


def view_weight(model: nn.Module, layer: str) -> torch.Tensor | None:
    """The slice the expert Linear ``layer`` of :func:`attach` views (``<experts>.<e>.
    gate_up_proj`` / ``down_proj``), read without attaching; None where there is none."""
    owner, _, child = layer.rpartition(".")
    name, _, e = owner.rpartition(".")
    try:
        parent = model.get_submodule(name)
    except AttributeError:
        return None
    if child not in ("gate_up_proj", "down_proj") or not e.isdigit() \
            or not is_experts_3d(parent) or int(e) >= parent.down_proj.shape[0]:
        return None
    return expert_weight(parent, view_source(parent, child), int(e))


def _activate(parent, expert: Expert, h: torch.Tensor) -> torch.Tensor:
    if not expert.gated:
        return parent.act_fn(h)
    if hasattr(parent, "_apply_gate"):  # transformers' own (concatenated or interleaved)
        return parent._apply_gate(h)
    gate, up = h.chunk(2, dim=-1)
    return parent.act_fn(gate) * up


class RoutedForward:
    """The eager routing loop of transformers' experts modules, through the children."""

    def __init__(self, parent, n_exp: int, counts: list[int] | None, all_experts: bool):
        self.parent, self.n_exp, self.counts, self.all_experts = parent, n_exp, counts, all_experts

    def __call__(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        parent, counts, all_experts = self.parent, self.counts, self.all_experts
        out = torch.zeros_like(hidden_states)
        for e in range(self.n_exp):
            expert = parent._modules[str(e)]
            # (k position, token) in the same order as transformers' one_hot mask
            pos, tok = torch.where(top_k_index.t() == e)
            if counts is not None:
                counts[e] += int(tok.numel()) if not all_experts else hidden_states.shape[0]
            if all_experts:  # every token observed; the routed rows kept
                y = expert.down_proj(_activate(parent, expert, expert.gate_up_proj(
                    hidden_states)))[tok]
            elif tok.numel():
                y = expert.down_proj(_activate(parent, expert, expert.gate_up_proj(
                    hidden_states[tok])))
            else:
                continue
            if getattr(parent, "has_post_expert_norm", False):  # transformers' eager order
                y = parent.post_expert_norm(y)
            y = y * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class DropViews:
    """A ``state_dict`` post-hook leaving out the per-expert views' keys: the 3-D parameters
    hold the same values, and a model without views would refuse the keys when loading."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, module, state_dict, prefix, local_metadata):
        views = tuple(f"{prefix}{e}." for e in range(self.n))
        for key in [k for k in state_dict if k.startswith(views)]:
            del state_dict[key]
