"""The names a checkpoint on disk gives a model's tensors, from transformers' own checkpoint
conversion mapping: one place for the exporter (which writes them, :mod:`quantscope.exporters.
experts`) and the sequential loader (which reads them, :mod:`.checkpoint`).

transformers 5 renames some modules on loading (Mixtral's ``block_sparse_moe`` is the
model's ``mlp``) and joins the per-expert tensors of MoE checkpoints (``experts.<e>.w1`` /
``w3`` / ``w2``, or ``gate_proj`` / ``up_proj`` / ``down_proj``) into 3-D parameters.
"""

from __future__ import annotations

import re

from torch import nn

__all__ = ["QPARAM_TENSORS", "checkpoint_names", "expert_names", "split_names"]


def expert_names(model: nn.Module) -> tuple[str, str, str] | None:
    """The checkpoint's (gate, up, down) names of one expert, e.g. ``w1, w3, w2`` for Mixtral;
    None when transformers maps no per-expert tensors onto the model's 3-D ones."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        mapping = get_checkpoint_conversion_mapping(model_type) or []
    except (ImportError, AttributeError, KeyError):  # older transformers, no mapping
        return None
    fused, down = None, None
    for conv in mapping:
        target = getattr(conv, "target_patterns", None)
        sources = getattr(conv, "source_patterns", None)
        if not target or not sources:
            continue
        target = target[0] if isinstance(target, (list, tuple)) else target
        names = [m.group(1) for s in ([sources] if isinstance(sources, str) else sources)
                 if (m := re.search(r"experts\.\*\.(\w+)\.weight", s))]
        if target.endswith("experts.gate_up_proj") and len(names) == 2:
            fused = names
        elif target.endswith("experts.down_proj") and len(names) == 1:
            down = names[0]
    if fused is None or down is None:
        return None
    return fused[0], fused[1], down


def checkpoint_names(model: nn.Module, names) -> dict[str, str]:
    """``{module name: the name its tensors have on disk}``: transformers' own reverse
    renamings (Mixtral's ``mlp`` is ``block_sparse_moe`` on disk), so that a checkpoint's
    ``targets`` / ``ignore`` name the modules of a loader that reads the disk names (vLLM).
    Without a mapping (or an older transformers) every name maps to itself."""
    renamings = _renamings(model)
    return {n: _renamed(f"{n}.weight", renamings).removesuffix(".weight") for n in names}


#: the tensors a compressed-tensors checkpoint stores beside a layer's weight
QPARAM_TENSORS = ("weight_scale", "weight_zero_point", "weight_global_scale", "weight_packed",
                  "weight_shape", "weight_g_idx", "input_scale", "input_zero_point",
                  "input_global_scale")


def split_names(model: nn.Module, roles) -> dict[str, tuple[str, str]]:
    """The modules of ``roles`` (``{module: its quantized roles}``) whose weight transformers
    renames on disk by a rule some tensor of their roles misses (PhiMoE's router:
    ``router.weight`` is ``gate.weight``, while ``router.input_scale``, or with transformers
    5.24 ``router.weight_scale`` too, stays): ``{module: (the weight's disk name, that
    tensor's)}``."""
    renamings = _renamings(model)
    out = {}
    for n, quantized in roles.items():
        weight = _renamed(f"{n}.weight", renamings).removesuffix(".weight")
        for t in QPARAM_TENSORS:
            other = _renamed(f"{n}.{t}", renamings).removesuffix(f".{t}")
            if t.split("_")[0] in quantized and other != weight:
                out[n] = (weight, other)
                break
    return out


def _renamings(model: nn.Module) -> list:
    """transformers' reverse renamings of ``model``'s keys, in save_pretrained's order (none
    without a mapping or with an older transformers)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightRenaming

        convs = getattr(model, "_weight_conversions", None)
        if convs is None:  # as save_pretrained does for a model not from from_pretrained
            convs = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                     if not isinstance(c, PrefixChange)]
        return [r for r in (c.reverse_transform() for c in convs[::-1])
                if isinstance(r, WeightRenaming)]
    except (ImportError, AttributeError, KeyError, TypeError):  # older transformers
        return []


def _renamed(key: str, renamings) -> str:
    """``key`` through every renaming in turn, as save_pretrained renames it (transformers'
    ``apply_renamings``, which 5.17 lacks: each renaming's own method)."""
    for renaming in renamings:
        key, _ = renaming.rename_source_key(key)
    return key
