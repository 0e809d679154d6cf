"""Calibration: observe a model's weights once and its activations over the batches.

:func:`calibrate` runs one recipe; :func:`calibrate_many` runs several in **one**
pass over the data: the observers of all recipes are attached together, and a
recipe that asks for the same (layer, role, spec, observer) as another shares
its observer. ``observer="auto"`` observes every candidate and keeps what
``auto_metric`` says is best: by default (``"model"``) the whole configuration
whose model output is closest to the float model's (:mod:`.auto`); per layer, the
candidates with the least error in the layer's output (``"joint"``, ``"fisher"``,
``"output"``) or in the tensor itself (``"tensor"``).

Hooks are removed in a ``finally``, whatever happens; the model's train / eval
mode is restored; forwards run under ``torch.inference_mode``.
"""

from __future__ import annotations

import math
import time
import warnings
import weakref
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import torch
from torch import nn

from .. import comm as qd
from ..layout import Channel, Tensor
from ..observers.registry import get_observer, observer_class
from ..observers.sync import sync_observers
from ..qparams import amax_of_range
from ..spec import QuantSpec
from . import auto as _auto
from . import fusion, gather, heap, kv_cache, moe
from . import sequential as _sequential
from .apply import input_name, module_input, qdq_tensor
from .batches import forward_batch
from .recipe import AUTO, DEFAULT_CANDIDATES, Recipe, Role, preset, weight_observer
from .report import tensor_stats
from .result import Calibration, RoleState
from .samples import RowSample, capacities

__all__ = ["AUTO_METRICS", "DEFAULT_SAMPLE_BUDGET_MB", "calibrate", "calibrate_many"]

#: what ``auto`` can minimise (see :func:`calibrate_many`); "model", "joint" and "fisher"
#: live in :mod:`.auto`
AUTO_METRICS = ("model", "joint", "fisher", "tensor", "output")
# the activation rows kept for auto and the report, all layers together (see docs/memory.md)
DEFAULT_SAMPLE_BUDGET_MB = 64


@dataclass
class _Slot:
    """One observed tensor of one layer: its observers, keyed by (name, spec, options)."""

    layer: str
    role: str
    module: nn.Module
    observers: dict = field(default_factory=dict)
    sample: RowSample | None = None  # rows for auto and the report, made by _run
    needs_sample: bool = False
    failed: dict = field(default_factory=dict)
    also: list = field(default_factory=list)  # a fusion group's other layers (shared input)
    last: object = None  # the input last observed, so a group's shared input counts once
    calls: int = 0  # forwards that reached the hook, empty ones included


def _as_recipe(recipe, observer) -> Recipe:
    if isinstance(recipe, str):
        recipe = preset(recipe, observer or "minmax")
    elif not isinstance(recipe, Recipe):
        raise TypeError(f"calibrate: recipe must be a preset name or a Recipe, got "
                        f"{type(recipe).__name__}")
    elif observer is not None:
        recipe = recipe.with_observer(observer)
    return recipe


def _candidates(role: str, candidates) -> list[str]:
    explicit = candidates is not None
    names = list(DEFAULT_CANDIDATES if candidates is None else candidates)
    out = []
    for n in names:
        if n == AUTO:
            continue
        try:
            observer_class(n)
        except ValueError:
            if explicit:
                raise
            continue
        out.append(weight_observer(n) if role == "weight" else n)
    if not out:
        raise ValueError(f"calibrate: observer 'auto' has no candidate observers for {role} "
                         f"(asked for {names})")
    return list(dict.fromkeys(out))


def _check_static_layout(layer: str, role: str, spec) -> None:
    lay = spec.layout
    if isinstance(lay, Tensor) or (isinstance(lay, Channel) and lay.axis == -1):
        return
    raise ValueError(
        f"calibrate: layer {layer!r} {role}: static activation qparams need a layout whose "
        f"units do not depend on the batch (tensor, or channel:-1), got {spec}; use "
        f"dynamic=True for per-token or block activations")


def _activation_width(module: nn.Module, role: str):
    attr = "in_features" if role == "input" else "out_features"
    return getattr(module, attr, None)


def _observer_key(name, role_cfg: Role, module=None):
    return (name, _observed_spec(role_cfg), role_cfg.options)


def _observed_spec(role_cfg: Role):
    """The spec a role's observer watches. ``dynamic="local"`` (NVFP4 activations) calibrates
    only the global amax, a whole-tensor statistic: its observer takes the element format
    per tensor, so batches of any token count (an MoE expert's vary by batch) accumulate
    into one range (block units would change in number with the tokens)."""
    if role_cfg.dynamic != "local":
        return role_cfg.spec
    return QuantSpec(role_cfg.spec.format, "tensor", symmetric=True)


def _make_observer(slot: _Slot, key, for_auto: bool, owns=None):
    if key in slot.observers or key in slot.failed:
        return
    name, spec, options = key
    try:
        obs = get_observer(name, spec, **dict(options))
        # distributed: only the owner rank observes a weight (the others get its state)
        if slot.role == "weight" and (owns is None or owns(slot.layer)):
            w = slot.module.weight.detach()
            obs.to(w.device)
            with torch.inference_mode():
                obs(w)
    except (ValueError, TypeError) as e:
        if not for_auto:
            raise ValueError(f"calibrate: layer {slot.layer!r} {slot.role}: observer {name!r} "
                             f"with {spec}: {e}") from None
        slot.failed[key] = str(e)  # auto drops a candidate that cannot take this spec
        return
    slot.observers[key] = obs


def _plan(model, recipes, candidates, owns=None):
    slots: dict[tuple[str, str], _Slot] = {}
    plans = {}
    for label, recipe in recipes.items():
        plan = {}
        for layer, (module, roles) in recipe.match(model).items():
            for role, cfg in roles.items():
                spec = cfg.spec
                if role == "weight":
                    shape = tuple(module.weight.shape)
                    try:
                        spec.layout.check(shape)
                    except ValueError as e:
                        raise ValueError(f"calibrate: layer {layer!r} weight of shape {shape} "
                                         f"cannot take {spec}: {e}") from None
                else:
                    if cfg.dynamic is False:
                        _check_static_layout(layer, role, spec)
                    width = _activation_width(module, role)
                    if width is not None:
                        try:
                            spec.layout.check((1, width))
                        except ValueError as e:
                            raise ValueError(f"calibrate: layer {layer!r} {role} of width {width} "
                                             f"cannot take {spec}: {e}") from None
                slot = slots.setdefault((layer, role), _Slot(layer, role, module))
                if role in ("input", "output"):  # the KV cache is not sampled
                    slot.needs_sample = True
                names = []
                if cfg.dynamic is not True:
                    if cfg.observer == AUTO:
                        names = _candidates(role, candidates)
                    else:
                        names = [cfg.observer]
                for n in names:
                    _make_observer(slot, _observer_key(n, cfg, module), cfg.observer == AUTO,
                                   owns)
                plan[(layer, role)] = (cfg, names)
        plans[label] = plan
    return slots, plans


def _hook(slots: list[_Slot], input_key: str | None = None):
    def observe(x):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return
        for slot in slots:
            slot.calls += 1
            if slot.also:  # a fusion group's slot: q, k and v read one tensor, observe it once
                if fusion.same_input(slot.last and slot.last(), x):
                    continue
                slot.last = weakref.ref(x)  # a strong ref would keep every group's input alive
            for (name, _, _), obs in slot.observers.items():
                if obs.observed_tokens.device != x.device:
                    obs.to(x.device)
                try:
                    obs(x)
                except ValueError as e:
                    raise ValueError(f"calibrate: layer {slot.layer!r} {slot.role}: observer "
                                     f"{name!r}: {e}") from None
            if slot.sample is not None:
                try:
                    slot.sample.add(x)
                except ValueError as e:
                    raise ValueError(f"calibrate: layer {slot.layer!r} {slot.role}: {e}") from None

    def pre(module, args, kwargs):  # the input, positional or keyword (``lin(input=x)``)
        observe(module_input(args, kwargs, input_key))

    def post(module, args, output):
        observe(output)

    return pre, post


def _run(model, batches, slots, sample_tokens, progress, seed, sample_budget_mb=None):
    """Forward every batch with observing hooks; returns the number of batches."""
    by_module: dict[int, dict[str, list[_Slot]]] = {}
    kv: dict[str, dict[str, list[_Slot]]] = {}  # attention layer -> key / value slots
    for slot in _unique(slots.values()):
        if slot.role == "weight" or not (slot.observers or slot.needs_sample):
            continue
        if slot.role in kv_cache.ROLES:
            kv.setdefault(slot.layer, {}).setdefault(slot.role, []).append(slot)
            continue
        for module in (slot.module, *slot.also):
            by_module.setdefault(id(module), {"module": module, "input": [], "output": []})
            by_module[id(module)][slot.role].append(slot)
    if not by_module and not kv:
        return 0
    total = len(batches) if hasattr(batches, "__len__") else None
    gen = torch.Generator().manual_seed(seed)
    _make_samples(_unique(slots.values()), sample_tokens, sample_budget_mb, total, gen)
    handles = []
    was_training = model.training
    n = 0
    try:
        for entry in by_module.values():
            module = entry["module"]
            if entry["input"]:
                pre, _ = _hook(entry["input"], input_name(module))
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            if entry["output"]:
                _, post = _hook(entry["output"])
                handles.append(module.register_forward_hook(post))
        if kv:
            handles.append(SimpleNamespace(remove=kv_cache.attach(
                model, {layer: _kv_observer(roles) for layer, roles in kv.items()})))
        model.eval()
        heap.prepare()  # large tensors mmapped, freed to the system (heap.py)
        it = batches
        if progress:
            try:
                from tqdm.auto import tqdm

                it = tqdm(batches, total=total, desc="calibrating", unit="batch", leave=False)
            except ImportError:
                pass
        with torch.inference_mode():
            for batch in it:
                forward_batch(model, batch)
                heap.trim()  # the fragmented heap's free pages back (heap.py)
                n += 1
    finally:
        for h in handles:
            h.remove()
        for slot in slots.values():
            slot.last = None
        model.train(was_training)
    return n


def _check_kv_cache(model, recipes) -> None:
    """A recipe that asks for the KV cache on a model without attention modules is an error
    (one piece of a sequential calibration may have none; the whole model must)."""
    asked = [r.name for r in recipes.values() if r.kv_cache is not None]
    if asked and not kv_cache.attention_modules(model):
        raise ValueError(f"calibrate: recipe {asked[0]!r} sets kv_cache but the model has no "
                         f"attention module with k_proj / v_proj (transformers')")


def _kv_observer(roles: dict[str, list[_Slot]]):
    """The :func:`kv_cache.attach` callback that observes one attention layer's key and
    value states (and passes them on unchanged)."""
    observers = {role: _hook(slots)[1] for role, slots in roles.items()}

    def callback(role, x):
        if role in observers:
            observers[role](None, (), x)
        return x
    return callback


def _make_samples(slots, sample_tokens, budget_mb, total, gen):
    """One fixed row buffer per sampled slot, all of them within ``budget_mb``: rows are
    drawn evenly from every batch (``capacity / batches`` each) when the count is known."""
    sampled = [s for s in slots if s.role != "weight" and s.needs_sample]
    if not sampled:
        return
    caps = capacities({id(s): _activation_width(s.module, s.role) for s in sampled},
                      sample_tokens, max(int(_budget(budget_mb) * 2**20), 1))
    for s in sampled:
        cap = caps[id(s)]
        per_batch = math.ceil(cap / total) if total else max(1, cap // 8)
        s.sample = RowSample(cap, per_batch, gen)


def _budget(budget_mb) -> float:
    return DEFAULT_SAMPLE_BUDGET_MB if budget_mb is None else budget_mb


def _unique(slots):
    """Each slot once (a fusion group's members share their input slot)."""
    return list({id(s): s for s in slots}.values())


# ---------------------------------------------------------------- fusion groups (fusion.py)
def _fuse(model, batches, recipes, slots):
    """Find the fusion groups (one detection forward of the first batch) and give each
    group one input slot; returns ``(batches, groups)``, batches unconsumed."""
    opts = {(r.fusion, r.fuse, r.split) for r in recipes.values()}
    if len(opts) > 1:
        raise ValueError(f"calibrate_many: the recipes' fusion options (fusion, fuse, split) "
                         f"differ: {sorted(map(str, opts))}; calibrate them separately")
    on, fuse, split = opts.pop()
    if not on:
        return batches, []
    modules = dict(model.named_modules())
    names = [n for n in modules if (n, "weight") in slots or (n, "input") in slots]
    names = [n for n in names if getattr(modules[n], "weight", None) is not None
             and modules[n].weight.dim() == 2]
    first, batches = fusion.peek(batches)
    found = fusion.find_groups(model, first, names)
    groups = fusion.edit_groups(found, names, modules, fuse, split)
    for group in groups:
        keys = [(m, "input") for m in group if (m, "input") in slots]
        lead = slots[keys[0]] if keys else None
        for k in keys[1:]:
            member = slots[k]
            for okey, obs in member.observers.items():
                lead.observers.setdefault(okey, obs)
            lead.failed.update(member.failed)
            lead.needs_sample |= member.needs_sample
            lead.also.append(member.module)
            slots[k] = lead
    return batches, groups


def _share_inputs(states, rows, plan, slots, groups, made, errors, cache) -> None:
    """``auto`` in a fusion group: its one input slot gets one observer for all members,
    the candidate with the least total error over them (``auto_metric="output"`` weighs
    each member's own weights, so members alone could choose differently)."""
    for group in groups:
        members = [m for m in group if (m, "input") in plan]
        cfg, names = plan[(members[0], "input")] if members else (None, ())
        if len(members) < 2 or len(names) < 2:
            continue
        totals = {}
        for n in names:
            okey = _observer_key(n, cfg, slots[(members[0], "input")].module)
            errs = [errors.get((m, "input", okey, cfg.dynamic)) for m in members]
            if all(e is not None for e in errs):
                totals[okey] = sum(errs)
        if totals:
            okey = min(totals, key=totals.get)
            at = {(r["layer"], r["role"]): i for i, r in enumerate(rows)}
            for m in members:
                skey = (m, "input", okey, cfg.dynamic)
                states[m]["input"] = replace(made[skey], requested=cfg.observer)
                if (m, "input") in at and cache.get(skey) is not None:
                    rows[at[(m, "input")]] = _row(m, "input", states[m]["input"], cache[skey])


def _share_weights(states, rows, plan, slots, groups) -> list[dict]:
    """Each group's weights, where the runtime shares a weight scale, observed concatenated
    by one observer (``auto``: the candidate with the least total error) and split back per
    member; returns what was done per group (for the report)."""
    done = []
    for group in groups:
        members = [m for m in group if (m, "weight") in plan]
        entry = {"layers": list(group), "weight": "per layer", "input": "shared"
                 if len({id(slots[(m, "input")]) for m in group if (m, "input") in slots}) == 1
                 and any((m, "input") in slots for m in group) else "none"}
        done.append(entry)
        if len(members) < 2:
            continue
        cfgs = {plan[(m, "weight")][0] for m in members}
        cfg, names = plan[(members[0], "weight")]
        if len(cfgs) != 1:
            entry["weight"] = "per layer (the members' weight specs differ)"
            continue
        if cfg.dynamic is True or not fusion.shares_weight_scale(cfg.spec):
            continue
        if not fusion.splittable(cfg.spec):
            entry["weight"] = f"per layer ({cfg.spec.layout} does not split by rows)"
            continue
        mods = [slots[(m, "weight")].module for m in members]
        w = fusion.join_weights(mods)
        best = None
        for n in names:
            try:
                obs = get_observer(n, cfg.spec, **dict(cfg.options)).to(w.device)
                obs(w)
            except (ValueError, TypeError):
                if len(names) == 1:
                    raise
                continue
            state = replace(_state_from(obs, cfg, tuple(w.shape)), requested=cfg.observer)
            err = (float((qdq_tensor(w, state).float() - w.float()).square().sum())
                   if len(names) > 1 else 0.0)
            if best is None or err < best[1]:
                best = (state, err)
        parts = fusion.split_state(best[0], [tuple(m.weight.shape) for m in mods])
        at = {(r["layer"], r["role"]): i for i, r in enumerate(rows)}
        for m, mod, st in zip(members, mods, parts):
            states[m]["weight"] = st
            if (m, "weight") in at:
                rows[at[(m, "weight")]] = _row(m, "weight", st,
                                               tensor_stats(mod.weight.detach(), st))
        entry["weight"] = f"shared ({best[0].observer})"
    return done


def _state_from(obs, cfg: Role, shape) -> RoleState:
    """The RoleState of one observer: one range estimate gives both range and qparams."""
    lo, hi, qp = obs.range_and_qparams()
    lo, hi = lo.detach().clone(), hi.detach().clone()
    if cfg.dynamic == "local":
        gam = obs.global_amax()
        if gam is None:
            gam = amax_of_range(lo.min().clamp(max=0), hi.max().clamp(min=0))
        return RoleState(cfg.spec, obs.name, cfg.observer, "local", cfg.options,
                         global_amax=gam.detach().clone().reshape(()), lo=lo, hi=hi)
    qp.scale, qp.zero_point = qp.scale.clone(), qp.zero_point.clone()
    if qp.global_scale is not None:
        qp.global_scale = qp.global_scale.clone()
    return RoleState(cfg.spec, obs.name, cfg.observer, False, cfg.options, qparams=qp, lo=lo,
                     hi=hi, shape=shape)


#: what calibration does with an activation role that saw no tokens (see calibrate_many)
MISSING_POLICIES = ("skip", "float", "error")


def _missing(layer, role, slot, names, cfg, policy, experts=None):
    """None if the role observed data (or is an MoE expert's: :func:`moe.shrink` gives it its
    layer's pooled statistics); else the record of the fallback (or the error)."""
    if cfg.dynamic is True or role == "weight":
        return None
    if experts is not None and layer in experts.layers:
        return None
    if any(slot.observers[k].has_observed for k in (_observer_key(n, cfg) for n in names)
           if k in slot.observers):
        return None
    what = (f"was called {slot.calls} times but saw no tokens (0 rows)" if slot.calls else
            "was never called during calibration (is the module used by the model's forward?)")
    if policy == "error":
        raise ValueError(f"calibrate: layer {layer!r} {role} {what}; pass missing='skip' or "
                         f"missing='float' to calibrate the rest without it")
    fallback = "float layer" if policy == "float" else f"{role} not quantized"
    return {"layer": layer, "role": role, "calls": slot.calls, "fallback": fallback}


def _finish(slots, plans, recipes, auto_metric="tensor", groups=(), experts=None,
            missing="skip", fisher=None):
    """Build each recipe's states and report rows; ``auto`` picks by squared error (or,
    ``auto_metric`` "joint" / "fisher", by :func:`.auto.joint_choice`)."""
    cache = {}
    data = {}
    for key, slot in slots.items():
        if slot.role == "weight":
            data[key] = slot.module.weight.detach()
        elif slot.sample is not None and slot.sample.count:
            data[key] = slot.sample.rows()  # a view of the slot's buffer: no copy

    def stats_of(key, skey, state):
        if skey not in cache:
            x = data.get(key)
            cache[skey] = None if x is None else tensor_stats(x, state)
        return cache[skey]

    made = {}  # one state per observer, shared by every recipe (and auto) that uses it
    errors = {}

    def auto_error(layer, role, skey, state, st):
        """What ``auto`` minimises: the squared error this role's quantization causes in the
        layer's output ``x W^T`` (metric "output", for 2-D weights with an input sample), or
        in the tensor itself (metric "tensor", and the fallback)."""
        if skey in errors:
            return errors[skey]
        err = None if st is None else st["noise"]
        module = slots[(layer, role)].module
        w = getattr(module, "weight", None)
        x = data.get((layer, "input"))
        if (auto_metric == "output" and role in ("weight", "input") and w is not None
                and w.dim() == 2 and x is not None and x.shape[-1] == w.shape[1]):
            w, x = w.detach().float(), x.float()
            if role == "input":
                e = (qdq_tensor(x, state).float() - x) @ w.T
            else:
                e = x @ (qdq_tensor(w, state).float() - w).T
            err = float(e.square().sum())
        errors[skey] = err
        return err

    def state_of(obs, cfg, skey, shape):
        if skey not in made:
            made[skey] = _state_from(obs, cfg, shape)
        return replace(made[skey], requested=cfg.observer)

    def joint_pick(plan, layer):
        """The (weight, input) states :func:`.auto.joint_choice` picks for ``layer``, or None
        where the layer has no 2-D weight with an input sample and both roles calibrated."""
        key = (layer, tuple((r, plan[(layer, r)][0]) for r in ("weight", "input")
                            if (layer, r) in plan))
        if key not in joint:
            joint[key] = _auto.layer_pick(layer, plan, slots, data, state_of, fisher)
        return joint[key]

    joint = {}
    results = {}
    for label, plan in plans.items():
        states, rows, absent = {}, [], []
        for (layer, role), (cfg, names) in plan.items():
            slot = slots[(layer, role)]
            gap = _missing(layer, role, slot, names, cfg, missing, experts)
            if gap is not None:
                absent.append(gap)
                continue
            shape = tuple(slot.module.weight.shape) if role == "weight" else None
            pick = (joint_pick(plan, layer) if auto_metric in _auto.LAYER_METRICS
                    and len(names) > 1 and role in ("weight", "input") else None)
            if pick is not None:
                state = replace(pick[role], requested=cfg.observer)
                st = stats_of((layer, role), (layer, role, "joint", state.observer, cfg), state)
            elif cfg.dynamic is True:
                state = RoleState(cfg.spec, cfg.observer, cfg.observer, True, cfg.options)
                st = stats_of((layer, role), (layer, role, "dynamic", cfg), state)
            else:
                best = None
                for n in names:
                    okey = _observer_key(n, cfg, slot.module)
                    if okey not in slot.observers:
                        continue
                    obs = slot.observers[okey]
                    if not obs.has_observed:  # another candidate saw the data, or an expert
                        continue              # without tokens (moe.shrink pools it below)
                    skey = (layer, role, okey, cfg.dynamic)
                    cand = state_of(obs, cfg, skey, shape)
                    st = stats_of((layer, role), skey, cand)
                    err = auto_error(layer, role, skey, cand, st) if len(names) > 1 else None
                    if best is None or (err is not None and (best[2] is None or err < best[2])):
                        best = (cand, st, err)
                if best is None and experts is not None and layer in experts.layers:
                    states.setdefault(layer, {})[role] = None
                    continue
                if best is None:
                    raise ValueError(f"calibrate: layer {layer!r} {role}: no candidate observer "
                                     f"could take {cfg.spec}: {slot.failed}")
                state, st, _ = best
            states.setdefault(layer, {})[role] = state
            if st is not None:
                rows.append(_row(layer, role, state, st))
        _share_inputs(states, rows, plan, slots, groups, made, errors, cache)
        shared = _share_weights(states, rows, plan, slots, groups)
        per_expert = moe.shrink(states, experts, experts.min_tokens) if experts else []
        floats = {g["layer"] for g in absent if g["fallback"] == "float layer"}
        states = {k: v for k, v in states.items() if k not in floats}
        rows = [r for r in rows if r["layer"] not in floats]
        results[label] = (states, rows, shared, per_expert, absent)
    hists = {key: _histogram(x) for key, x in data.items() if key[1] != "weight"}
    return results, hists


def _row(layer, role, state: RoleState, st: dict) -> dict:
    if state.lo is not None:
        lo, hi = float(state.lo.min()), float(state.hi.max())
    else:
        lo, hi = st["min"], st["max"]
    return {"layer": layer, "role": role, "observer": state.observer,
            "requested": state.requested, "spec": str(state.spec),
            "dynamic": state.dynamic, "sqnr_db": st["sqnr_db"], "clipped": st["clipped"],
            "lo": lo, "hi": hi, "clip_lo": st["clip_lo"], "clip_hi": st["clip_hi"],
            "units": st["units"], "numel": st["numel"]}


def _histogram(x: torch.Tensor, bins: int = 256) -> dict:
    x = x.detach().float().flatten()
    lo, hi = float(x.min()), float(x.max())
    if hi <= lo:
        hi = lo + 1.0
    counts = torch.histc(x, bins, lo, hi)
    return {"lo": lo, "hi": hi, "counts": [int(c) for c in counts.tolist()]}


def calibrate_many(model: nn.Module, batches, recipes, *, candidates=None,
                   sample_tokens: int = 2048, sample_budget_mb: float | None = None,
                   progress: bool = True,
                   seed: int = 0, distributed: bool = False, group=None,
                   auto_metric: str = "model", loss=None, score_tokens: int = 1024,
                   all_experts: bool = False, expert_min_tokens: int = moe.MIN_TOKENS,
                   missing: str = "skip", sequential=False,
                   **sequential_options) -> dict[str, Calibration]:
    """Calibrate several recipes in one pass over ``batches``.

    Args:
        model: any ``nn.Module``.
        batches: an iterable of model inputs: a dict (``model(**b)``), a tuple / list
            (``model(*b)``) or a tensor (``model(b)``).
        recipes: ``{label: recipe}`` or a list of recipes (labelled by name); a recipe
            is a :class:`Recipe` or a preset name.
        candidates: the observers ``auto`` chooses from (default: those of
            :data:`~quantscope.calibrate.recipe.DEFAULT_CANDIDATES` that are registered).
        sample_tokens: activation rows kept per layer for ``auto`` and the report, at most.
        sample_budget_mb: the memory of all those rows together (float32, every layer and
            role); when ``sample_tokens`` rows each would not fit, every sampled tensor keeps
            the same smaller number of rows (at least one). Default
            :data:`DEFAULT_SAMPLE_BUDGET_MB` (64 MB). Only ``auto`` and the report's
            activation rows (SQNR, clipping) use the sample; other qparams do not depend on it.
        progress: show a tqdm progress bar over the batches.
        seed: seeds the choice of sampled rows.
        auto_metric: what ``auto`` minimises: ``"model"`` (default) the divergence of the
            model's output from the float model's on the first calibration batches
            (``score_tokens`` tokens), choosing among whole configurations: each candidate
            observer and the ``"joint"`` choice (:mod:`.auto`); per layer, ``"joint"`` the
            layer's output error ``||X W^T - Q(X) Q(W)^T||^2`` with weight and input
            chosen together, ``"fisher"`` that error weighted by the loss's ``g^2`` per
            output feature, ``"tensor"`` the squared error of the quantized tensor itself
            (the report's SQNR), or ``"output"`` the error one role's quantization causes in
            ``x W^T``. See the README for the measurements behind the default.
        loss: for ``"model"``, ``callable(output, reference_output, batch) -> float``
            replacing the default divergence (KL of next-token distributions for causal LMs,
            ``1 - cosine`` of mean-pooled outputs otherwise); for ``"fisher"``,
            ``callable(output, batch) -> scalar tensor`` (default: the model's own loss).
        score_tokens: calibration tokens the ``"model"`` and ``"fisher"`` metrics run on.
        distributed: inside a ``torch.distributed`` process group (e.g. under ``torchrun``),
            calibrate data-parallel: each rank takes every ``world``-th batch and a share of
            the weights, statistics are synced before qparams, every rank returns the same
            result (write files from rank 0 only). A no-op in a single process.
        group: the process group (default: the default group).
        all_experts: MoE experts (see :mod:`~quantscope.calibrate.moe`) each observe every
            token, while the block's output stays the routed one; default: the routed tokens.
        expert_min_tokens: in routed mode, an expert that saw fewer tokens has its activation
            ranges shrunk toward its layer's pooled range (none: the pooled range).
        missing: an activation role that saw no tokens (a layer never called, or called
            only with 0 rows) and is not an MoE expert's: ``"skip"`` (default) leaves that
            role unquantized, the layer keeps its weight quantization (a weight-only
            scheme); ``"float"`` leaves the whole layer in float; ``"error"`` raises. Either
            fallback is listed in ``calibration.info["missing"]`` and warned about.
        sequential: ``True`` / ``"float"`` or ``"quantized"``: one block at a time
            (:mod:`.sequential`, for models larger than memory); ``sequential_options``
            (``checkpoint``, ``blocks``, ``cache_budget_mb``, ``cache_dir``, ``device``) go
            to :func:`.sequential.calibrate_sequential`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"calibrate: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(sample_tokens, int) or sample_tokens < 1:
        raise ValueError(f"calibrate: sample_tokens must be a positive integer, got "
                         f"{sample_tokens!r}")
    if sample_budget_mb is not None and not (
            isinstance(sample_budget_mb, (int, float)) and not isinstance(sample_budget_mb, bool)
            and math.isfinite(sample_budget_mb) and sample_budget_mb > 0):
        raise ValueError(f"calibrate: sample_budget_mb must be a positive number of MB, got "
                         f"{sample_budget_mb!r}")
    if isinstance(recipes, (str, Recipe)):
        recipes = [recipes]
    if not isinstance(recipes, dict):
        recipes = [_as_recipe(r, None) for r in recipes]
        recipes = {r.name: r for r in recipes}
    else:
        recipes = {k: _as_recipe(r, None) for k, r in recipes.items()}
    if not recipes:
        raise ValueError("calibrate: no recipe given")
    if auto_metric not in AUTO_METRICS:
        raise ValueError(f"calibrate: auto_metric must be one of {AUTO_METRICS}, got "
                         f"{auto_metric!r}")
    if missing not in MISSING_POLICIES:
        raise ValueError(f"calibrate: missing must be one of {MISSING_POLICIES}, got "
                         f"{missing!r}")
    if not isinstance(expert_min_tokens, int) or expert_min_tokens < 1:
        raise ValueError(f"calibrate: expert_min_tokens must be a positive integer, got "
                         f"{expert_min_tokens!r}")
    t0 = time.perf_counter()
    if batches is None:
        batches = []
    _check_kv_cache(model, recipes)
    if sequential or sequential_options:
        return _sequential.calibrate_sequential(
            calibrate_many, model, batches, recipes, mode=sequential, progress=progress,
            candidates=candidates, sample_tokens=sample_tokens, sample_budget_mb=sample_budget_mb,
            seed=seed, distributed=distributed, group=group, auto_metric=auto_metric, loss=loss,
            score_tokens=score_tokens, all_experts=all_experts,
            expert_min_tokens=expert_min_tokens, missing=missing, **sequential_options)
    if auto_metric == "model" and any(_auto._has_auto(r) for r in recipes.values()):
        return _auto.calibrate_end_to_end(
            calibrate_many, model, batches, recipes, candidates=candidates,
            score_tokens=score_tokens, loss=loss, sample_tokens=sample_tokens,
            progress=progress, seed=seed, distributed=distributed, group=group,
            all_experts=all_experts, expert_min_tokens=expert_min_tokens, missing=missing,
            sample_budget_mb=sample_budget_mb)
    fisher = None
    if auto_metric == "fisher":
        batches = list(batches)
        layers = {layer for r in recipes.values() if _auto._has_auto(r)
                  for layer, (_, roles) in r.match(model).items() if "weight" in roles}
        fisher = _auto.fisher_weights(model, _auto.score_batches(batches, score_tokens),
                                      sorted(layers), loss)
    # MoE experts become Linear views for the whole calibration (moe.py); restored after
    with moe.attach(model, bool(all_experts)) as experts:
        experts.min_tokens = expert_min_tokens
        if distributed and qd.is_distributed(group):
            return _calibrate_distributed(model, batches, recipes, candidates, sample_tokens,
                                          progress, seed, group, t0, auto_metric, experts,
                                          missing, sample_budget_mb)
        slots, plans = _plan(model, recipes, candidates)
        batches, groups = _fuse(model, batches, recipes, slots)
        experts.reset_counts()
        needs_data = any(s.role != "weight" and (s.observers or s.needs_sample)
                         for s in slots.values())
        n = (_run(model, batches, slots, sample_tokens, progress, seed, sample_budget_mb)
             if needs_data else 0)
        return _conclude(slots, plans, recipes, n, needs_data, t0, auto_metric=auto_metric,
                         groups=groups, experts=experts, model=model, missing=missing,
                         fisher=fisher)


def _conclude(slots, plans, recipes, n, needs_data, t0, processes=1, auto_metric="tensor",
              groups=(), experts=None, model=None, missing="skip", fisher=None):
    if needs_data and n == 0 and any(r.needs_data for r in recipes.values()):
        raise ValueError("calibrate: batches is empty: the recipe quantizes activations "
                         "statically, which needs at least one calibration batch")
    with torch.no_grad():
        results, hists = _finish(slots, plans, recipes, auto_metric, groups, experts, missing,
                                 fisher)
    seconds = time.perf_counter() - t0
    out = {}
    for label, recipe in recipes.items():
        states, rows, shared, per_expert, absent = results[label]
        info = {"batches": n, "calibration_seconds": round(seconds, 3)}
        if absent:
            info["missing"] = absent
            warnings.warn(f"calibrate: {len(absent)} activation roles saw no tokens and fall "
                          f"back ({absent[0]['layer']!r} {absent[0]['role']}: "
                          f"{absent[0]['fallback']}; all in calibration.info['missing'])",
                          stacklevel=3)
        if shared:
            info["fusion_groups"] = shared
        if per_expert:
            info["experts"] = per_expert
            info["expert_min_tokens"] = experts.min_tokens
        missed = moe.unreached(model, recipe) if model is not None else []
        if missed:
            info["unreached"] = missed
            warnings.warn(f"calibrate: recipe {recipe.name!r} targets weights quantscope cannot "
                          f"reach; left in float: {[u['name'] for u in missed]}", stacklevel=3)
        if processes > 1:
            info["processes"] = processes
        out[label] = Calibration(recipe, states, label, rows, hists, info)
    return out


def _calibrate_distributed(model, batches, recipes, candidates, sample_tokens, progress, seed,
                           group, t0, auto_metric="tensor", experts=None, missing="skip",
                           sample_budget_mb=None):
    """``calibrate_many`` across the ranks of ``group``, every rank returning the same result.

    Batches are sharded round-robin; each weight is observed by one rank (balanced by
    size) and its state shared; after the local forwards, the activation observers are
    synced (exact for min / max and histograms, AVG for moving averages: see
    :mod:`quantscope.distributed`). With ``auto`` the sampled rows are gathered so every
    rank decides on the same data; otherwise the report rows (activation SQNR, clipping)
    come from rank 0's own sample and are empty on the other ranks. Local steps run under
    :func:`~quantscope.distributed.all_or_none`: an error on one rank raises on all.
    """
    world = qd.world_size(group)
    quantized = {layer for r in recipes.values()
                 for layer, (_, roles) in r.match(model).items() if "weight" in roles}
    owners = gather.weight_owners(model, quantized, group)
    me = qd.rank(group)
    with qd.all_or_none("planning", group):
        slots, plans = _plan(model, recipes, candidates, owns=lambda l: owners.get(l, me) == me)
        batches, groups = _fuse(model, batches, recipes, slots)
    experts.reset_counts()
    failed = gather.gather_failures({k: s.failed for k, s in slots.items() if s.role == "weight"},
                                group)
    for k, f in failed.items():  # a candidate that failed on its owner is dropped everywhere
        slots[k].failed.update(f)
        for key in f:
            slots[k].observers.pop(key, None)
    sync_observers([o for s in slots.values() if s.role == "weight"
                       for o in s.observers.values()], group)
    needs_data = any(s.role != "weight" and (s.observers or s.needs_sample)
                     for s in slots.values())
    # 'auto' decides on the sampled rows, so every rank needs the same sample: gather it;
    # otherwise the sample only feeds the report, which rank 0 makes from its own rows
    auto = any(cfg.observer == AUTO for p in plans.values() for cfg, _ in p.values())
    n = 0
    if needs_data:
        with qd.all_or_none("calibration", group):
            n = _run(model, qd.shard(batches, group), slots,
                     -(-sample_tokens // world) if auto else sample_tokens,
                     progress and qd.is_main(group), seed + me,
                     _budget(sample_budget_mb) / world if auto else sample_budget_mb)
        n = qd.all_sum(n, group)
        acts = {k: s for k, s in slots.items() if s.role != "weight"}
        sync_observers([o for s in _unique(acts.values()) for o in s.observers.values()],
                          group)
        if auto:
            local = {k: [] if s.sample is None or not s.sample.count else [s.sample.rows()]
                     for k, s in acts.items()}
            merged = gather.gather_samples(local, sample_tokens, group)
            for k, rows in merged.items():
                acts[k].sample = RowSample.holding(rows[0]) if rows else None
        elif not qd.is_main(group):  # no report rows here: the qparams are all that matter
            for s in acts.values():
                s.sample = None
    for counts in experts.counts.values():  # every rank reports the global counts
        counts[:] = [qd.all_sum(c, group) for c in counts]
    return _conclude(slots, plans, recipes, n, needs_data, t0, world, auto_metric, groups,
                     experts, model, missing)


def calibrate(model: nn.Module, batches, recipe="w8a8", *, observer: str | None = None,
              **kwargs) -> Calibration:
    """Calibrate ``model`` on ``batches`` with ``recipe``; returns a :class:`Calibration`.

    ``recipe`` is a preset name (``w8a8``, ``w8a8-dynamic``, ``w4a16``, ``w4a8``,
    ``fp8``, ``mxfp4``, ``nvfp4``) or a :class:`Recipe`; ``observer`` (a registry
    name or ``"auto"``) replaces the recipe's observers. Other keywords as
    :func:`calibrate_many`. Apply the result with ``calibration.apply(model)``.
    """
    r = _as_recipe(recipe, observer)
    return calibrate_many(model, batches, {r.name: r}, **kwargs)[r.name]
