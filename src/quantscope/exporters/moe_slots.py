"""How a runtime's fused MoE layer reads an experts module's layers, by name.

vLLM stacks the per-expert layers ``<experts module>.<expert>.<layer>`` of one module into
one fused layer with two input slots: ``w13`` (the gate / up inputs: ``gate_up_proj``,
``gate_proj``, ``up_proj``, ``w1``, ``w3``) and ``w2`` (the down inputs). It holds one
input scale, and runs one scheme, per module and slot. Calibration (sharing and falling
back inputs) and the checkpoint checker group experts by this one rule. In the core
layer, as :mod:`.registry`: a name rule, no exporter.
"""

from __future__ import annotations

import re

__all__ = ["EXPERT", "expert_index", "expert_slot", "proj_slot"]

#: an expert's layers whose inputs the runtime's fused ``w13`` reads (the rest: ``w2``)
_W13 = frozenset({"gate_up_proj", "gate_proj", "up_proj", "w1", "w3"})
#: an expert's item in its experts module: ``<e>`` (a 3-D module's view, a ModuleList item) or
#: ``expert_<e>`` (transformers' ModuleDict experts: SwitchTransformers, NLLB-MoE)
_ITEM = r"(?:expert_)?(\d+)"
#: ``<experts module>.<expert>.<layer>``: an expert's layer (a 3-D module's view, a
#: ModuleList / ModuleDict item's Linear) or a checkpoint's per-expert tensors, which vLLM's
#: loader stacks
EXPERT = re.compile(rf"^(.*experts)\.{_ITEM}\.([^.]+)$")


def expert_index(key: str) -> int | None:
    """The expert number of an experts module's item named ``key`` (``3``, ``expert_3``);
    None for a key of no expert (NLLB-MoE's ``token_dropout``)."""
    hit = re.fullmatch(_ITEM, key)
    return None if hit is None else int(hit.group(1))


def proj_slot(proj: str) -> str:
    """The fused MoE slot of an expert's layer named ``proj``: ``"w13"`` or ``proj``."""
    return "w13" if proj in _W13 else proj


def expert_slot(layer: str) -> tuple[str, str] | None:
    """``(experts module, slot)`` of an expert's layer (:data:`EXPERT`), slot as
    :func:`proj_slot`; None for a layer of no expert."""
    hit = EXPERT.match(layer)
    return None if hit is None else (hit.group(1), proj_slot(hit.group(3)))
