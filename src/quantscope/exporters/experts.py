"""MoE experts as checkpoints store them: one module per expert, gate and up apart.

transformers 5 runs an experts module on 3-D parameters (``gate_up_proj``
``[experts, 2 x intermediate, hidden]``, ``down_proj``) and quantscope calibrates one
state per expert slice (``<experts>.<e>.gate_up_proj``, ``<experts>.<e>.down_proj``, see
:mod:`quantscope.calibration.structure.moe`). Checkpoints on disk, and vLLM's loader, name
every expert apart: ``<experts>.<e>.gate_proj`` / ``up_proj`` / ``down_proj`` (Qwen-MoE,
DeepSeek) or ``w1`` / ``w3`` / ``w2`` (Mixtral); vLLM fuses gate and up back into ``w13``.
:func:`unfuse_experts` rewrites a model copy and its states into that layout before
compression: the gate rows and the up rows become two ``nn.Linear`` whose per-row qparams
are the matching rows of the fused state, and whose per-tensor ones (global scale, static
input scale, per-tensor weight scale) are the shared value, as the runtime's ``w13`` needs.
The on-disk names come from transformers' own checkpoint conversion mapping for the model
type; a model type whose checkpoints keep the 3-D tensors (no such mapping: gpt-oss's
interleaved ``gate_up_proj``, for one) is refused, naming the module, unless the
calibration holds no state of it: then it is written in float, as the model holds it.

Reading such a checkpoint back is the inverse: :func:`unfuse_for_reading` gives the model
skeleton the per-expert modules, :func:`disk_to_module` maps the disk names back onto them,
and :func:`fuse_expert_states` joins gate and up into the ``gate_up_proj`` state of the
calibration that was exported (rows concatenated; shared per-tensor values must agree, but
for float8 per-tensor weight scales: other toolkits calibrate gate and up apart, and vLLM
re-quantizes both to the larger scale, ``process_fp8_weight_tensor_strategy_moe``, so the
larger is read, with a warning).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..calibration.run.disk_names import checkpoint_names, expert_names
from ..calibration.structure import fusion
from ..calibration.structure.expert_views import is_gated
from ..calibration.structure.moe import is_routed
from ..layout import Tensor

__all__ = ["checkpoint_names", "disk_to_module", "expert_names", "fuse_expert_states",
           "unfuse_experts", "unfuse_for_reading"]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta",
                    dtype=weight.dtype)
    # one copy, row-major even from a transposed view
    lin.weight = nn.Parameter(weight.detach().clone(memory_format=torch.contiguous_format),
                              requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return lin


def _gate_and_up(state, shape, layer: str) -> list:
    """A fused ``gate_up_proj`` weight state as its gate and up halves (rows), each shaped
    ``shape``: the fusion code's split (a run-time state has no qparams to split)."""
    if state.qparams is None:
        return [state, state]
    if not fusion.splittable(state.spec, [shape, shape]):
        raise ValueError(f"export compressed-tensors: expert layer {layer!r}: {state.spec} "
                         f"has units spanning rows of both gate and up ({shape[0]} rows "
                         f"each), so they cannot be written apart; expected a layout whose "
                         f"units hold rows of one half (tile or row-run rows dividing {shape[0]})")
    return fusion.split_state(state, [shape, shape])


def _expert_module(parent: nn.Module, e: int, names) -> nn.Module:
    gate, up, down = names
    transposed = getattr(parent, "is_transposed", False)
    has_bias = getattr(parent, "has_bias", False)
    gated = is_gated(parent)
    expert = nn.Module()

    def weight(name):
        w = getattr(parent, name).data[e]
        b = getattr(parent, f"{name}_bias", None) if has_bias else None
        return (w.t() if transposed else w), (None if b is None else b.data[e])

    w, b = weight("gate_up_proj" if gated else "up_proj")
    if gated:
        half = w.shape[0] // 2
        expert.add_module(gate, _linear(w[:half], None if b is None else b[:half]))
        expert.add_module(up, _linear(w[half:], None if b is None else b[half:]))
    else:
        expert.add_module(up, _linear(w, b))
    expert.add_module(down, _linear(*weight("down_proj")))
    return expert


def unfuse_experts(model: nn.Module, states: dict) -> dict:
    """Rewrite ``model`` (a copy: it is changed in place) so that every 3-D experts module
    becomes a ``ModuleList`` of per-expert modules under the checkpoint's names, and return
    ``states`` renamed to match (the gate and up halves of ``gate_up_proj`` split by rows)."""
    names = expert_names(model)
    out = dict(states)
    for name, module in list(model.named_modules()):
        if not is_routed(module):  # the only ones a calibration holds states of
            continue
        if names is None or not getattr(module, "is_concatenated", True):
            if not any(k.startswith(f"{name}.") for k in states):
                continue  # in float: written as the model holds it
            why = ("transformers maps no per-expert names onto them" if names is None
                   else "their gate and up rows are interleaved")
            raise ValueError(
                f"export compressed-tensors: experts module {name!r} "
                f"({type(model).__name__}): its checkpoints keep 3-D expert tensors ({why}), "
                f"which compressed-tensors cannot compress; leave the experts in float "
                f"(ignore them in the recipe)")
        gate, up, down = names
        n = (module.gate_up_proj if hasattr(module, "gate_up_proj") else module.up_proj).shape[0]
        experts = nn.ModuleList([_expert_module(module, e, names) for e in range(n)])
        for e in range(n):
            fused, lower = f"{name}.{e}.gate_up_proj", f"{name}.{e}.down_proj"
            if lower in out:
                out[f"{name}.{e}.{down}"] = out.pop(lower)
            if fused not in out:
                continue
            roles = out.pop(fused)
            if not hasattr(experts[e], gate):  # no gate: up_proj alone
                out[f"{name}.{e}.{up}"] = roles
                continue
            shape = tuple(experts[e].get_submodule(gate).weight.shape)
            halves = (_gate_and_up(roles["weight"], shape, fused) if "weight" in roles
                      else [None, None])
            for shard, half in zip((gate, up), halves):
                out[f"{name}.{e}.{shard}"] = {
                    role: half if role == "weight" else st for role, st in roles.items()}
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, experts)
    return out


def disk_to_module(model: nn.Module) -> dict[str, str]:
    """``{name on disk: module name}`` for every module of ``model`` whose names differ: the
    inverse of :func:`checkpoint_names`, for a reader of the checkpoint's names."""
    names = [n for n, _ in model.named_modules() if n]
    return {disk: n for n, disk in checkpoint_names(model, names).items() if disk != n}


def unfuse_for_reading(model: nn.Module) -> dict[str, tuple[int, tuple[str, str, str], bool]]:
    """Give ``model`` (a skeleton, changed in place) the per-expert modules the exporter
    writes; returns ``{experts module: (experts, (gate, up, down) names, gated)}`` for
    :func:`fuse_expert_states`."""
    names = expert_names(model)
    found = {}
    for name, module in model.named_modules():
        if is_routed(module):
            gated = is_gated(module)
            n = (module.gate_up_proj if gated else module.up_proj).shape[0]
            found[name] = (n, names, gated)
    if not found or names is None:  # no per-expert tensors on disk: nothing to map
        return {}
    unfuse_experts(model, {})
    return found


def _same(a, b, what: str) -> None:
    if not a.quantizes_like(b):
        raise ValueError(what)


def _widens(spec) -> bool:
    """Whether the runtime joins gate and up weight scales that differ: a float8 per-tensor
    scale (vLLM re-quantizes w1 / w3 to the larger); a global scale (NVFP4: vLLM takes w1's)
    or an int scale is never reconciled, so those must agree."""
    return fusion.shares_weight_scale(spec) and not spec.scale.has_global_scale


def _join_rows(gate, up, layer: str, widened: list):
    """The ``gate_up_proj`` weight state from its gate and up halves: per-row values
    concatenated (:func:`fusion.split_state` inverted), per-tensor ones shared (differing
    float8 per-tensor scales: the larger, noted in ``widened`` as ``(layer, gate, up)``)."""
    from dataclasses import replace

    qg, qu = gate.qparams, up.qparams
    if qg is None or qu is None:  # dynamic or local: nothing per row
        _same(gate, up, f"{layer}: gate and up weights are quantized differently")
        return gate

    def join(a, b, what, shared, widen=False):
        if a is None and b is None:
            return None
        if a is None or b is None or (a.numel() == 1) != (b.numel() == 1):
            raise ValueError(f"{layer}: gate and up hold {what} of different layouts")
        if shared:  # one value for the whole weight (a lone block's is per row: joined)
            if torch.equal(a, b):
                return a.clone()
            if not widen:
                raise ValueError(f"{layer}: gate and up hold different per-tensor {what} "
                                 f"({float(a)!r}, {float(b)!r}); the model's fused experts "
                                 f"take one")
            widened.append((layer, float(a), float(b)))
            return torch.maximum(a, b)
        return torch.cat([a, b], 0)

    if gate.spec != up.spec or gate.dynamic != up.dynamic:
        raise ValueError(f"{layer}: gate and up weights are quantized differently")
    per_tensor = isinstance(gate.spec.layout, Tensor)
    qp = type(qg)(join(qg.scale, qu.scale, "weight scales", per_tensor, _widens(gate.spec)),
                  join(qg.zero_point, qu.zero_point, "zero points", per_tensor),
                  join(qg.global_scale, qu.global_scale, "global scales", True))
    shape = None if gate.shape is None or up.shape is None else \
        (gate.shape[0] + up.shape[0], *gate.shape[1:])
    return replace(gate, qparams=qp, shape=shape)


def _join_roles(gate: dict, up: dict, layer: str, widened: list) -> dict:
    if set(gate) != set(up):
        raise ValueError(f"{layer}: gate has roles {sorted(gate)} but up {sorted(up)}")
    out = {}
    for role, state in gate.items():
        if role == "weight":
            out[role] = _join_rows(state, up[role], layer, widened)
        else:  # one input for both halves (the runtime's w13 reads one tensor)
            _same(state, up[role], f"{layer}: gate and up hold different {role} "
                                   f"quantizers; the model's fused experts take one")
            out[role] = state
    return out


def _warn_widened(widened: list) -> None:
    """One warning for every gate / up pair read with the larger of two weight scales."""
    if not widened:
        return
    layer, g, u = widened[0]
    more = f" (and {len(widened) - 1} more experts)" if len(widened) > 1 else ""
    warnings.warn(f"{layer}: gate and up hold different float8 per-tensor weight scales "
                  f"({g!r}, {u!r}){more}; read with the larger of each pair, the scale vLLM "
                  f"serves (it re-quantizes w1 / w3 to it)", stacklevel=3)


def fuse_expert_states(found: dict, states: dict, where: str = "from_compressed_tensors"
                       ) -> dict:
    """``states`` read under the per-expert names (``<experts>.<e>.w1`` ...) renamed and
    joined into the calibration's (``<experts>.<e>.gate_up_proj`` / ``down_proj``):
    :func:`unfuse_experts` inverted. ``found``: :func:`unfuse_for_reading`'s answer."""
    out, widened = dict(states), []
    for name, (n, (gate, up, down), gated) in found.items():
        for e in range(n):
            base = f"{name}.{e}"
            if f"{base}.{down}" in out:
                out[f"{base}.down_proj"] = out.pop(f"{base}.{down}")
            if not gated:
                if f"{base}.{up}" in out:
                    out[f"{base}.gate_up_proj"] = out.pop(f"{base}.{up}")
                continue
            g, u = out.pop(f"{base}.{gate}", None), out.pop(f"{base}.{up}", None)
            if g is None and u is None:
                continue
            layer = f"{where}: experts {base}"
            if g is None or u is None:
                raise ValueError(f"{layer}: only one of {gate} / {up} is quantized; the "
                                 f"model's fused gate_up_proj is one layer")
            out[f"{base}.gate_up_proj"] = _join_roles(g, u, layer, widened)
    _warn_widened(widened)
    return out
