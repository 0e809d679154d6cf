"""Calibration: observe a model's weights once and its activations over the batches.

:func:`calibrate` runs one recipe; :func:`calibrate_many` runs several in **one**
pass over the data: the observers of all recipes are attached together, and a
recipe that asks for the same (layer, role, spec, observer) as another shares
its observer. ``observer="auto"`` observes every candidate and keeps, per layer
and role, the one whose qparams give the lowest squared error on that layer's
data: the weight itself, or a sample of the calibration activations kept for the
purpose (``auto_metric="tensor"``, the default); or the lowest error in the
layer's output ``x W^T`` on the sampled inputs (``"output"``).

Hooks are removed in a ``finally``, whatever happens; the model's train / eval
mode is restored; forwards run under ``torch.inference_mode``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from .. import distributed as qd
from ..layout import Channel, Tensor
from ..observers.registry import get_observer, observer_class
from . import auto as _auto
from .apply import qdq_tensor
from .recipe import AUTO, DEFAULT_CANDIDATES, Recipe, Role, preset, weight_observer
from .report import tensor_stats
from .result import Calibration, RoleState

__all__ = ["AUTO_METRICS", "calibrate", "calibrate_many"]

#: what ``auto`` can minimise (see :func:`calibrate_many`); "model", "joint" and "fisher"
#: live in :mod:`.auto`
AUTO_METRICS = ("model", "joint", "fisher", "tensor", "output")


@dataclass
class _Slot:
    """One observed tensor of one layer: its observers, keyed by (name, spec, options)."""

    layer: str
    role: str
    module: nn.Module
    observers: dict = field(default_factory=dict)
    sample: list = field(default_factory=list)
    sampled: int = 0
    needs_sample: bool = False
    failed: dict = field(default_factory=dict)


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


def _observer_key(name, role_cfg: Role):
    return (name, role_cfg.spec, role_cfg.options)


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
                if role != "weight":
                    slot.needs_sample = True
                names = []
                if cfg.dynamic is not True:
                    if cfg.observer == AUTO:
                        names = _candidates(role, candidates)
                    else:
                        names = [cfg.observer]
                for n in names:
                    _make_observer(slot, _observer_key(n, cfg), cfg.observer == AUTO, owns)
                plan[(layer, role)] = (cfg, names)
        plans[label] = plan
    return slots, plans


def _hook(slots: list[_Slot], per_batch: int, limit: int, gen: torch.Generator):
    def observe(x):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return
        for slot in slots:
            for (name, _, _), obs in slot.observers.items():
                if obs.observed_tokens.device != x.device:
                    obs.to(x.device)
                try:
                    obs(x)
                except ValueError as e:
                    raise ValueError(f"calibrate: layer {slot.layer!r} {slot.role}: observer "
                                     f"{name!r}: {e}") from None
            if slot.needs_sample and slot.sampled < limit:
                rows = x.detach().reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
                take = min(rows.shape[0], per_batch, limit - slot.sampled)
                idx = torch.randperm(rows.shape[0], generator=gen)[:take].to(rows.device)
                slot.sample.append(rows.index_select(0, idx))  # index_select copies already
                slot.sampled += take

    def pre(module, args):
        if args:
            observe(args[0])

    def post(module, args, output):
        observe(output)

    return pre, post


def _run(model, batches, slots, sample_tokens, progress, seed):
    """Forward every batch with observing hooks; returns the number of batches."""
    by_module: dict[int, dict[str, list[_Slot]]] = {}
    for slot in slots.values():
        if slot.role == "weight" or not (slot.observers or slot.needs_sample):
            continue
        by_module.setdefault(id(slot.module), {"module": slot.module, "input": [], "output": []})
        by_module[id(slot.module)][slot.role].append(slot)
    if not by_module:
        return 0
    total = len(batches) if hasattr(batches, "__len__") else None
    per_batch = math.ceil(sample_tokens / total) if total else max(1, sample_tokens // 8)
    gen = torch.Generator().manual_seed(seed)
    handles = []
    was_training = model.training
    n = 0
    try:
        for entry in by_module.values():
            module = entry["module"]
            if entry["input"]:
                pre, _ = _hook(entry["input"], per_batch, sample_tokens, gen)
                handles.append(module.register_forward_pre_hook(pre))
            if entry["output"]:
                _, post = _hook(entry["output"], per_batch, sample_tokens, gen)
                handles.append(module.register_forward_hook(post))
        model.eval()
        it = batches
        if progress:
            try:
                from tqdm.auto import tqdm

                it = tqdm(batches, total=total, desc="calibrating", unit="batch", leave=False)
            except ImportError:
                pass
        with torch.inference_mode():
            for batch in it:
                _forward(model, batch)
                n += 1
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return n


def _forward(model, batch):
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _state_from(obs, cfg: Role, shape) -> RoleState:
    """The RoleState of one observer: one range estimate gives both range and qparams."""
    lo, hi, qp = obs.range_and_qparams()
    lo, hi = lo.detach().clone(), hi.detach().clone()
    if cfg.dynamic == "local":
        gam = obs.global_amax()
        if gam is None:
            gam = torch.maximum(-lo.min().clamp(max=0), hi.max().clamp(min=0))
        return RoleState(cfg.spec, obs.name, cfg.observer, "local", cfg.options,
                         global_amax=gam.detach().clone().reshape(()), lo=lo, hi=hi)
    qp.scale, qp.zero_point = qp.scale.clone(), qp.zero_point.clone()
    if qp.global_scale is not None:
        qp.global_scale = qp.global_scale.clone()
    return RoleState(cfg.spec, obs.name, cfg.observer, False, cfg.options, qparams=qp, lo=lo,
                     hi=hi, shape=shape)


def _finish(slots, plans, recipes, auto_metric="tensor", fisher=None):
    """Build each recipe's states and report rows; ``auto`` picks by squared error (or,
    ``auto_metric`` "joint" / "fisher", by :func:`.auto.joint_choice`)."""
    cache = {}
    data = {}
    for key, slot in slots.items():
        if slot.role == "weight":
            data[key] = slot.module.weight.detach()
        elif slot.sample:
            data[key] = torch.cat(slot.sample)

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
        states, rows = {}, []
        for (layer, role), (cfg, names) in plan.items():
            slot = slots[(layer, role)]
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
                    okey = _observer_key(n, cfg)
                    if okey not in slot.observers:
                        continue
                    obs = slot.observers[okey]
                    if not obs.has_observed:
                        raise ValueError(
                            f"calibrate: layer {layer!r} {role} was never called during "
                            f"calibration (is the module used by the model's forward?)")
                    skey = (layer, role, okey, cfg.dynamic)
                    cand = state_of(obs, cfg, skey, shape)
                    st = stats_of((layer, role), skey, cand)
                    err = auto_error(layer, role, skey, cand, st) if len(names) > 1 else None
                    if best is None or (err is not None and (best[2] is None or err < best[2])):
                        best = (cand, st, err)
                if best is None:
                    raise ValueError(f"calibrate: layer {layer!r} {role}: no candidate observer "
                                     f"could take {cfg.spec}: {slot.failed}")
                state, st, _ = best
            states.setdefault(layer, {})[role] = state
            if st is not None:
                rows.append(_row(layer, role, state, st))
        results[label] = (states, rows)
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
                   sample_tokens: int = 2048, progress: bool = True,
                   seed: int = 0, distributed: bool = False, group=None,
                   auto_metric: str = "model", loss=None,
                   score_tokens: int = 1024) -> dict[str, Calibration]:
    """Calibrate several recipes in one pass over ``batches``.

    Args:
        model: any ``nn.Module``.
        batches: an iterable of model inputs: a dict (``model(**b)``), a tuple / list
            (``model(*b)``) or a tensor (``model(b)``).
        recipes: ``{label: recipe}`` or a list of recipes (labelled by name); a recipe
            is a :class:`Recipe` or a preset name.
        candidates: the observers ``auto`` chooses from (default: those of
            :data:`~quantscope.calibrate.recipe.DEFAULT_CANDIDATES` that are registered).
        sample_tokens: activation rows kept per layer for ``auto`` and the report.
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
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"calibrate: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(sample_tokens, int) or sample_tokens < 1:
        raise ValueError(f"calibrate: sample_tokens must be a positive integer, got "
                         f"{sample_tokens!r}")
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
    t0 = time.perf_counter()
    if batches is None:
        batches = []
    if auto_metric == "model":
        return _auto.calibrate_end_to_end(
            calibrate_many, model, batches, recipes, candidates=candidates,
            score_tokens=score_tokens, loss=loss, sample_tokens=sample_tokens,
            progress=progress, seed=seed, distributed=distributed, group=group)
    fisher = None
    if auto_metric == "fisher":
        batches = list(batches)
        layers = {layer for r in recipes.values() if _auto._has_auto(r)
                  for layer in r.match(model)}
        fisher = _auto.fisher_weights(model, _auto.score_batches(batches, score_tokens),
                                      sorted(layers), loss)
    if distributed and qd.is_distributed(group):
        return _calibrate_distributed(model, batches, recipes, candidates, sample_tokens,
                                      progress, seed, group, t0, auto_metric)
    slots, plans = _plan(model, recipes, candidates)
    needs_data = any(s.role != "weight" and (s.observers or s.needs_sample)
                     for s in slots.values())
    n = _run(model, batches, slots, sample_tokens, progress, seed) if needs_data else 0
    return _conclude(slots, plans, recipes, n, needs_data, t0, auto_metric=auto_metric,
                     fisher=fisher)


def _conclude(slots, plans, recipes, n, needs_data, t0, processes=1, auto_metric="tensor",
              fisher=None):
    if needs_data and n == 0 and any(r.needs_data for r in recipes.values()):
        raise ValueError("calibrate: batches is empty: the recipe quantizes activations "
                         "statically, which needs at least one calibration batch")
    with torch.no_grad():
        results, hists = _finish(slots, plans, recipes, auto_metric, fisher)
    seconds = time.perf_counter() - t0
    out = {}
    for label, recipe in recipes.items():
        states, rows = results[label]
        info = {"batches": n, "calibration_seconds": round(seconds, 3)}
        if processes > 1:
            info["processes"] = processes
        out[label] = Calibration(recipe, states, label, rows, hists, info)
    return out


def _calibrate_distributed(model, batches, recipes, candidates, sample_tokens, progress, seed,
                           group, t0, auto_metric="tensor"):
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
    owners = qd.weight_owners(model, quantized, group)
    me = qd.rank(group)
    with qd.all_or_none("planning", group):
        slots, plans = _plan(model, recipes, candidates, owns=lambda l: owners.get(l, me) == me)
    failed = qd.gather_failures({k: s.failed for k, s in slots.items() if s.role == "weight"},
                                group)
    for k, f in failed.items():  # a candidate that failed on its owner is dropped everywhere
        slots[k].failed.update(f)
        for key in f:
            slots[k].observers.pop(key, None)
    qd.sync_observers([o for s in slots.values() if s.role == "weight"
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
                     progress and qd.is_main(group), seed + me)
        n = qd.all_sum(n, group)
        acts = {k: s for k, s in slots.items() if s.role != "weight"}
        qd.sync_observers([o for s in acts.values() for o in s.observers.values()], group)
        if auto:
            merged = qd.gather_samples({k: s.sample for k, s in acts.items()}, sample_tokens,
                                       group)
            for k, rows in merged.items():
                acts[k].sample = rows
        elif not qd.is_main(group):  # no report rows here: the qparams are all that matter
            for s in acts.values():
                s.sample = []
    return _conclude(slots, plans, recipes, n, needs_data, t0, world, auto_metric)


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
