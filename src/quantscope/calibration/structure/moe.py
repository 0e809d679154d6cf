"""Mixture-of-experts: every expert calibrated, with sound qparams even without tokens.

**Experts modules with 3-D parameters** (transformers 5: Mixtral, Qwen2/3-MoE,
DeepSeek-V3, ...): ``gate_up_proj`` ``[experts, 2 x intermediate, hidden]`` (or
``up_proj`` without a gate) and ``down_proj`` ``[experts, hidden, intermediate]``, run
with ``F.linear`` on slices: no ``nn.Linear`` a hook or a recipe can see. While
quantscope calibrates or applies QDQ, :func:`attach` gives each such module one child
per expert holding two ``nn.Linear`` whose weights are **views** of the slices
(``<experts>.<e>.gate_up_proj``, ``<experts>.<e>.down_proj``: the rows of
``gate_up_proj`` are the checkpoint's ``w1`` / ``gate_proj`` then ``w3`` / ``up_proj``,
which vLLM fuses as ``w13``, so they share one state), and replaces the module's
forward by the eager routing loop over those children; :meth:`Experts.detach` removes
both, leaving the module as it was (nothing is copied: the views are the parameters).

**ModuleList experts** (older checkpoints: ``experts[e].w1`` ... as ``nn.Linear``) and
transformers' **ModuleDict experts** (SwitchTransformers, NLLB-MoE: ``experts.expert_<e>.wi``)
are already visible; only their token counts are taken here.

**Tokens.** Routed mode (default): each expert observes the tokens routed to it. An
expert that saw ``n < min_tokens`` tokens gets its activation ranges shrunk toward the
pooled range of its layer's experts (the min / max merge of their ranges):
``range = w * own + (1 - w) * pooled`` with ``w = n / min_tokens`` (computed as
``pooled + w * (own - pooled)``: exact where own is pooled), so none (``n = 0``)
gets the pooled range. ``MoE(all_experts=True)`` makes every expert observe every token while
the block's output stays the routed one (llm-compressor's ``calibrate_all_experts``).

**One input scale per experts module.** A runtime's fused MoE keeps one static input scale
for all experts' ``w13`` and one for their ``w2`` (vLLM's FP8 MoE: ``input_scale.max()``;
its FlashInfer NVFP4 MoE: the largest ``1 / input_global_scale``), so :func:`shrink` ends by
giving every expert of a module the widest range of its experts (the pooled one) for each
static per-tensor input and NVFP4 input global amax: what ``apply()`` runs is what is served.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ...exporters.moe_slots import expert_index, proj_slot
from ...layout import Tensor
from ...qparams import qparams_from_range
from ..run.batches import input_name, module_input
from .expert_views import MARK, DropViews, Expert, RoutedForward, is_experts_3d, view_source

__all__ = ["Experts", "attach", "expert_items", "has_experts", "has_experts_3d", "is_expert_list",
           "is_routed", "share_inputs", "shrink", "unreached"]

#: ``n`` below which an expert's activation range is shrunk toward the pooled one
#: (docs/benchmarks.md "## fusion and MoE": KL against float by threshold)
MIN_TOKENS = 128


def is_expert_list(name: str, module: nn.Module) -> bool:
    """Experts held as modules named ``...experts``: an older checkpoint's ``ModuleList``, or
    transformers' ``ModuleDict`` whose items are ``expert_0`` ... ``expert_<n-1>`` (other keys,
    NLLB-MoE's ``token_dropout``, are no expert). Their items' Linears are already visible;
    :func:`attach` counts their tokens."""
    if not name.endswith("experts"):
        return False
    if isinstance(module, nn.ModuleList):
        return True
    if not isinstance(module, nn.ModuleDict):
        return False
    found = sorted(e for e, _, _ in expert_items(module))
    return bool(found) and found == list(range(len(found)))  # one count per expert 0 .. n-1


def expert_items(module: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """``(expert, key, item)`` of the experts of a :func:`is_expert_list` module."""
    return [(e, key, item) for key, item in module._modules.items()
            if item is not None and (e := expert_index(key)) is not None]


def is_routed(module: nn.Module) -> bool:
    """A 3-D experts module that :func:`attach` can run expert by expert: its forward takes
    transformers' routing (``hidden_states, top_k_index, top_k_weights``). Llama4's text
    experts, for one, take ``hidden_states`` alone (every expert sees its own rows): their
    forward is left as it is, and :func:`unreached` names their weights."""
    if not is_experts_3d(module):
        return False
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 3


@dataclass
class Experts:
    """What :func:`attach` did: per experts module its per-expert token counts."""

    model: nn.Module
    all_experts: bool = False
    min_tokens: int = MIN_TOKENS
    counts: dict = field(default_factory=dict)  # experts module name -> [tokens per expert]
    layers: dict = field(default_factory=dict)  # expert Linear name -> (module, expert index)
    _undo: list = field(default_factory=list)

    def source(self, layer: str) -> tuple[nn.Module, str, int]:
        """``(experts module, 3-D parameter name, expert index)`` whose slice the expert
        Linear ``layer`` views (:func:`expert_weight`)."""
        name, e = self.layers[layer]
        parent = self.model.get_submodule(name)
        return parent, view_source(parent, layer.rpartition(".")[2]), e

    def reset_counts(self) -> None:
        for c in self.counts.values():
            c[:] = [0] * len(c)

    def detach(self) -> None:
        """Remove the children and the forwards added (idempotent)."""
        while self._undo:
            self._undo.pop()()

    def remove(self) -> None:  # a QDQHandle hook
        self.detach()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()

    def _attach_3d(self, name, module, count):
        n = (module.gate_up_proj if hasattr(module, "gate_up_proj") else module.up_proj).shape[0]
        if any(str(e) in module._modules for e in range(n)):
            raise ValueError(f"calibrate: experts module {name!r} already has "
                             f"per-expert children (quantscope QDQ still applied?)")
        counts = [0] * n if count else None
        # the undo goes first: an exception (Ctrl-C) part way leaves nothing on the module
        hooks: list = []
        self._undo.append(_undo_3d(module, n, hooks))
        for e in range(n):
            module.add_module(str(e), Expert(module, e))
            for proj in ("gate_up_proj", "down_proj"):
                self.layers[f"{name}.{e}.{proj}"] = (name, e)
        module.forward = RoutedForward(module, n, counts, self.all_experts)
        hooks.append(module.register_state_dict_post_hook(DropViews(n)))
        if counts is not None:
            self.counts[name] = counts

    def _attach_list(self, name, module):
        if self.all_experts:
            raise ValueError(f"calibrate: moe=MoE(all_experts=True) needs a transformers-5 experts "
                             f"module (3-D parameters); "
                             f"{name!r} holds its experts as modules, whose block routes them "
                             f"itself")
        items = expert_items(module)
        counts = [0] * len(items)
        for layer, e in _list_layers(name, items):
            self.layers[layer] = (name, e)
            lin = self.model.get_submodule(layer)
            setattr(lin, MARK, True)
            self._undo.append(lambda lin=lin: lin.__dict__.pop(MARK, None))

        def counter(e, item):
            key = input_name(item)  # the input calibration observes

            def pre(mod, args, kwargs):
                x = module_input(args, kwargs, key)
                if isinstance(x, torch.Tensor) and x.dim():
                    counts[e] += x.numel() // x.shape[-1]
            return pre
        handles = [item.register_forward_pre_hook(counter(e, item), with_kwargs=True)
                   for e, _, item in items]
        self._undo.append(lambda: [h.remove() for h in handles])
        self.counts[name] = counts


def has_experts_3d(model: nn.Module) -> bool:
    """Whether ``model`` holds MoE experts as 3-D parameters (:func:`attach` gives them views)."""
    return any(is_routed(m) for m in model.modules())


def _ignored(name: str, module: nn.Module, recipes) -> bool:
    """Whether no recipe of ``recipes`` takes any view :func:`attach` would give ``module``."""
    probe = nn.Linear(1, 1, device="meta")
    n = (module.gate_up_proj if hasattr(module, "gate_up_proj") else module.up_proj).shape[0]
    return all(r.rule_for(f"{name}.{e}.{proj}", probe) is None for r in recipes
               for e in range(n) for proj in ("gate_up_proj", "down_proj"))


def _expert_modules(model: nn.Module, recipes=()):
    """``(name, module, routed)`` of the MoE layers :func:`attach` takes: routed 3-D experts
    (``routed``; where ``recipes`` are given, one some recipe quantizes) and expert lists."""
    recipes = list(recipes)
    for name, module in list(model.named_modules()):
        if is_routed(module):
            if not (recipes and _ignored(name, module, recipes)):
                yield name, module, True
        elif is_expert_list(name, module):
            yield name, module, False


def has_experts(model: nn.Module, recipes=()) -> bool:
    """Whether :func:`attach` (with ``recipes``) finds an MoE layer in ``model``."""
    return next(_expert_modules(model, recipes), None) is not None


def attach(model: nn.Module, all_experts: bool = False, count: bool = True,
           recipes=()) -> Experts:
    """Make every expert of ``model`` visible as Linear layers (see the module docstring);
    ``count``: count each expert's tokens; ``recipes``: when given, a 3-D experts module none
    of them quantizes keeps its own forward. Undo with :meth:`Experts.detach`."""
    ex = Experts(model, all_experts)
    try:
        for name, module, routed in _expert_modules(model, recipes):
            if routed:
                ex._attach_3d(name, module, count)
            elif count:
                ex._attach_list(name, module)
    except BaseException:
        ex.detach()
        raise
    return ex


def _undo_3d(module: nn.Module, n: int, hooks: list):
    """The undo of :meth:`Experts._attach_3d` on ``module``, made before it changes anything:
    it removes whatever is in place of the views, the forward swap and ``hooks``."""
    had, old = "forward" in module.__dict__, module.__dict__.get("forward")

    def undo():
        while hooks:
            hooks.pop().remove()
        for e in range(n):
            module._modules.pop(str(e), None)
        if had:
            module.forward = old
        else:
            module.__dict__.pop("forward", None)
    return undo


def _list_layers(name: str, items):
    for e, key, item in items:
        for sub, lin in item.named_modules():
            if isinstance(lin, nn.Linear):
                yield f"{name}.{key}.{sub}" if sub else f"{name}.{key}", e


def _rule(n: int, min_tokens: int, all_experts: bool) -> tuple[float, str]:
    if all_experts:
        return 1.0, "all tokens (all_experts)"
    if n >= min_tokens:
        return 1.0, "own"
    if n == 0:
        return 0.0, "pooled (no tokens)"
    w = n / min_tokens
    return w, f"shrunk: {w:.2f} own + {1 - w:.2f} pooled"


def shrink(states: dict, experts: Experts, min_tokens: int) -> list[dict]:
    """Give every expert's activation roles sound qparams (in place); returns one report
    entry per expert (module, expert, tokens, rule)."""
    report = []
    by_key: dict[tuple[str, str, str], dict[int, str]] = {}
    for layer, (mod, e) in experts.layers.items():
        for role, st in states.get(layer, {}).items():
            if role != "weight" and (st is None or st.dynamic is not True):
                by_key.setdefault((mod, layer.rpartition(".")[2], role), {})[e] = layer
    for mod, counts in experts.counts.items():
        for e, n in enumerate(counts):
            rule = (_rule(n, min_tokens, experts.all_experts)[1] if by_key
                    else "no calibrated activation scale")
            report.append({"module": mod, "expert": e, "tokens": n, "rule": rule})
    for (mod, proj, role), members in by_key.items():
        counts = experts.counts.get(mod)
        seen = {e: states[layer][role] for e, layer in members.items()
                if states[layer][role] is not None and _has_range(states[layer][role])}
        if not seen:
            raise ValueError(f"calibrate: no expert of {mod!r} ({proj} {role}) saw any token: "
                             f"is the MoE block used by the model's forward?")
        template = next(iter(seen.values()))
        pooled = _pooled(list(seen.values()))
        for e, layer in members.items():
            n = counts[e] if counts is not None else 0
            w, _ = _rule(n, min_tokens, experts.all_experts)
            state = states[layer][role]
            if w >= 1.0 and e in seen:
                continue
            states[layer][role] = _blend(state if e in seen else template, pooled,
                                         w if e in seen else 0.0)
    share_inputs(states, by_key)
    return report


def _held_once(state) -> bool:
    """Whether the runtime's fused experts hold one value of this activation role per module:
    a static per-tensor scale (vLLM's FP8 MoE keeps ``input_scale.max()``) or an NVFP4 input
    global scale (its FlashInfer NVFP4 MoE keeps the max of ``1 / input_global_scale``)."""
    if state is None or state.dynamic is True:
        return False
    if state.dynamic == "local":
        return state.global_amax is not None
    return state.qparams is not None and isinstance(state.spec.layout, Tensor)


def share_inputs(states: dict, by_key: dict) -> None:
    """Give the experts of each module one range (in place) for every input role the runtime
    holds once (:func:`_held_once`): the widest of theirs, their ``gate_up`` inputs one and
    their ``down`` inputs another. ``by_key``: ``(module, layer, role) -> {expert: layer}``."""
    slots: dict[tuple[str, str, str], list[str]] = {}
    for (mod, proj, role), members in by_key.items():
        slots.setdefault((mod, proj_slot(proj), role), []).extend(members.values())
    for (_, _, role), layers in slots.items():
        members = [states[layer][role] for layer in layers]
        if not all(_held_once(s) and s.spec == members[0].spec for s in members):
            continue  # schemes differ: the runtime cannot fuse them (check names it)
        pooled = _pooled(members)
        for layer, state in zip(layers, members):
            states[layer][role] = _blend(state, pooled, 0.0)


def _has_range(state) -> bool:
    return state.lo is not None or state.global_amax is not None


def _pooled(states) -> tuple:
    lo = torch.stack([s.lo for s in states]).amin(0) if states[0].lo is not None else None
    hi = torch.stack([s.hi for s in states]).amax(0) if states[0].hi is not None else None
    gam = (torch.stack([s.global_amax.reshape(()) for s in states]).amax()
           if states[0].global_amax is not None else None)
    return lo, hi, gam


def _blend(state, pooled, w: float):
    """``state`` with its range moved to ``w * own + (1 - w) * pooled``; qparams remade
    by the one formula."""
    plo, phi, pgam = pooled
    # as pool + w (own - pool): exactly pool where own == pool (the widest expert), which
    # w own + (1 - w) pool missed by an ulp, widening the shared range (share_inputs)
    mix = (lambda own, pool: pool.clone() if w == 0.0 else pool + w * (own - pool))
    lo = None if state.lo is None else mix(state.lo, plo)
    hi = None if state.hi is None else mix(state.hi, phi)
    if state.dynamic == "local":
        return replace(state, lo=lo, hi=hi, global_amax=mix(state.global_amax, pgam))
    qp = qparams_from_range(lo, hi, state.spec)
    shape = state.qparams.scale.shape
    qp = qp.reshape(*shape)
    return replace(state, qparams=qp, lo=lo, hi=hi)


def unreached(model: nn.Module, recipe) -> list[dict]:
    """Weights that ``recipe``'s targets would cover (Linear-class targets, or a name
    pattern matching the module) that quantscope cannot quantize: ≥3-D parameters of
    modules it does not know how to run expert by expert."""
    from ..recipe_dict import matches

    targets = [t for r in recipe.rules for t in r.targets]
    out = []
    for name, module in model.named_modules():
        if (is_routed(module) or type(module).__module__.startswith("torch.nn")
                or recipe.ignored(name, module)):
            continue  # torch's own layers (Conv3d ...) are not what a Linear target covers
        for pname, p in module.named_parameters(recurse=False):
            if p.dim() < 3 or p.shape[0] == 1:  # experts stack several (ViT's cls_token: one)
                continue
            if "Linear" in targets or any(matches(t, name, module) for t in targets):
                out.append({"name": f"{name}.{pname}" if name else pname,
                            "why": f"{p.dim()}-D parameter of {type(module).__name__}, not an "
                                   f"experts module quantscope can run expert by expert"})
    return out

