"""From observers to results: each recipe's :class:`RoleState` s and report rows.

:func:`build_states` turns every slot's observers into states (one per observer, shared
by the recipes that use it), lets ``auto`` pick per layer (or per fusion group), gives
fusion groups their shared weight scales, MoE experts their sound activation ranges, and
records the roles that saw no data under the ``missing`` policy.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import replace

import torch

from ..._checks import check_float32_range, outside_quantscope
from ...observers.registry import get_observer
from ...qparams import amax_of_range
from ..choice import layer_choice
from ..recipe import Role
from ..results.apply import qdq_tensor
from ..results.report import tensor_stats
from ..results.result import RoleState
from ..structure import fusion, moe
from ..structure.conv1d import is_conv1d, linear_output
from .observe import candidate_options, observed_spec, observer_key


def _share_inputs(states, plan, slots, groups, made, errors) -> None:
    """``auto`` in a fusion group: its one input slot gets one observer for all members,
    the candidate with the least total error over them (``auto_metric="output"`` weighs
    each member's own weights, "joint" / "fisher" its own picked weight, so members alone
    could choose differently)."""
    for group in groups:
        members = [m for m in group if (m, "input") in plan]
        cfg, names = plan[(members[0], "input")] if members else (None, ())
        if len(members) < 2 or len(names) < 2:
            continue
        totals = {}
        for n in names:
            okey = observer_key(n, cfg, slots[(members[0], "input")].module)
            errs = [errors.get((m, "input", okey, cfg.dynamic)) for m in members]
            if all(e is not None for e in errs):
                totals[okey] = sum(errs)
        if totals:
            okey = min(totals, key=totals.get)
            for m in members:
                states[m]["input"] = replace(made[(m, "input", okey, cfg.dynamic)],
                                             requested=cfg.observer)


def _joined_options(name: str, cfg: Role, slot) -> dict:
    """Observer ``name``'s options on a fusion group's joined weight: an ``imatrix_mse``
    member's gathered importance too (the members share one input: .imatrix_roles)."""
    options = dict(candidate_options(name, cfg))
    held = slot.observers.get(observer_key(name, cfg))
    importance = getattr(held, "importance", None)
    if "importance" not in options and isinstance(importance, torch.Tensor) \
            and importance.numel():
        options["importance"] = importance
    return options


def _share_weights(states, plan, slots, groups) -> list[dict]:
    """Each group's weights, where the runtime shares a weight scale, observed concatenated
    by one observer (``auto``: the candidate with the least total error) and split back per
    member; returns what was done per group (for the report). A ``"local"`` weight shares
    its calibrated global scale (block scales are the runtime's, per call: nothing to split);
    a ``dynamic=True`` one has nothing calibrated to share."""
    done = []
    for group in groups:  # (the pass's groups: narrowed to this recipe's layers)
        group = [m for m in group if (m, "weight") in plan or (m, "input") in plan]
        if len(group) < 2:
            continue
        members, why = joined_weights(group, plan, slots)
        entry = {"layers": group, "weight": why or "per layer",
                 "input": _input_sharing(group, plan, slots)}
        done.append(entry)
        if not members:
            continue
        cfg, names = plan[(members[0], "weight")]
        mods = [slots[(m, "weight")].module for m in members]
        shapes = [tuple(m.weight.shape) for m in mods]
        best = _joined_state(fusion.join_weights(mods), cfg, names, slots[(members[0], "weight")])
        for m, st in zip(members, fusion.split_state(best, shapes)):
            states[m]["weight"] = st
        entry["weight"] = f"shared ({best.observer})"
    return done


def _joined_state(w: torch.Tensor, cfg: Role, names, slot) -> RoleState:
    """The state of a group's weights ``w`` (concatenated) under ``cfg``: each observer of
    ``names`` watching the spec the members' own would (:func:`observed_spec`: a ``"local"``
    weight's global amax per tensor), the one with the least QDQ error kept."""
    best, failed = None, []
    for n in names:
        try:
            obs = get_observer(n, observed_spec(cfg), **_joined_options(n, cfg, slot)).to(
                w.device)
            obs(w)
        except (ValueError, TypeError) as e:
            if len(names) == 1:
                raise
            failed.append(f"{n}: {e}")
            continue
        state = replace(_state_from(obs, cfg, tuple(w.shape)), requested=cfg.observer)
        err = (float((qdq_tensor(w, state).float() - w.float()).square().sum())
               if len(names) > 1 else 0.0)
        if best is None or err < best[1]:
            best = (state, err)
    if best is None:  # each member's weight took a candidate, the joined weight none
        raise ValueError(f"calibrate: no candidate observer takes the joined weights of "
                         f"{slot.layer!r}'s fusion group: " + "; ".join(failed))
    return best[0]


def joined_weights(group, plan, slots) -> tuple[list[str], str | None]:
    """``(members, why not)``: the members of fusion ``group`` (narrowed to ``plan``'s layers)
    whose weights one observer sees joined (:func:`_share_weights`: the runtime shares their
    weight scale), or ``[]`` and, for the report, why each keeps its own where that needs
    saying (else None)."""
    members = [m for m in group if (m, "weight") in plan]
    if len(members) < 2:
        return [], None
    cfg = plan[(members[0], "weight")][0]
    if len({plan[(m, "weight")][0] for m in members}) != 1:
        return [], "per layer (the members' weight specs differ)"
    if cfg.dynamic is True or not fusion.shares_weight_scale(cfg.spec):
        return [], None
    shapes = [tuple(slots[(m, "weight")].module.weight.shape) for m in members]
    if cfg.dynamic is False and not fusion.splittable(cfg.spec, shapes):
        return [], (f"per layer ({cfg.spec.layout} does not split into rows "
                    f"{[s[0] for s in shapes]})")
    return members, None


def _input_sharing(group, plan, slots) -> str:
    """What a group's input scale is: one slot merges the members' inputs, but each
    (observer, spec) it holds is an observer of its own, so members whose input roles
    differ keep scales of their own."""
    held = [m for m in group if (m, "input") in plan]  # (slots: every recipe's)
    if not held or len({id(slots[(m, "input")]) for m in held}) > 1:
        return "none"
    if len({plan[(m, "input")][0] for m in held if (m, "input") in plan}) > 1:
        return "per layer (the members' input roles differ)"
    return "shared"


def _state_from(obs, cfg: Role, shape) -> RoleState:
    """The RoleState of one observer: one range estimate gives both range and qparams."""
    lo, hi, qp = obs.range_and_qparams()
    lo, hi = lo.detach().clone(), hi.detach().clone()
    if cfg.dynamic == "local":
        gam = obs.global_amax()
        if gam is None:
            gam = amax_of_range(lo.min().clamp(max=0), hi.max().clamp(min=0))
        return RoleState(cfg.spec, obs.name, cfg.observer, "local", cfg.options,
                         global_amax=gam.detach().clone().reshape(()), lo=lo, hi=hi,
                         shape=shape)
    qp.scale, qp.zero_point = qp.scale.clone(), qp.zero_point.clone()
    if qp.global_scale is not None:
        qp.global_scale = qp.global_scale.clone()
    return RoleState(cfg.spec, obs.name, cfg.observer, False, cfg.options, qparams=qp, lo=lo,
                     hi=hi, shape=shape)


#: what calibration does with an activation role that saw no tokens (see calibrate_many)
MISSING_POLICIES = ("skip", "float", "error")


def _missing(layer, role, slot, names, cfg, policy, experts=None, forwarded=True):
    """None if the role observed data (or is an MoE expert's: :func:`moe.shrink` gives it its
    layer's pooled statistics); else the record of the fallback (or the error). A run-time
    (dynamic) role needs no data, only its module called: one never called (``nn.
    MultiheadAttention`` reads its ``out_proj.weight`` itself) never reaches ``apply``'s
    input hook either. A call with 0 rows does, and no batch at all (``forwarded`` False,
    the one case with no calls to count) proves nothing: both keep the role. A call that
    brought no floating-point tensor (a tuple output, integer ids) feeds no observer and
    ``apply`` passes it by: such a role is missing, named by what came."""
    if role == "weight" or (cfg.dynamic is True  # a float call: apply() quantizes those
                            and (slot.calls > slot.odd_calls or not forwarded)):
        return None
    if experts is not None and layer in experts.layers:
        return None
    if any(slot.observers[k].has_observed for k in (observer_key(n, cfg) for n in names)
           if k in slot.observers):
        return None
    got = None if slot.odd is None else _odd_value(slot.odd)
    if got:
        came = f"returned {got}" if role == "output" else f"was given {got} as its {role}"
        what = (f"was called {slot.calls} times but {came}; the {role} role needs a "
                f"floating-point tensor")
    else:
        what = (f"was called {slot.calls} times but saw no tokens (0 rows)" if slot.calls else
                "was never called during calibration (is the module used by the model's "
                "forward?)")
    if policy == "error":
        raise ValueError(f"calibrate: layer {layer!r} {role} {what}; pass "
                         f"runtime=Runtime(missing='skip') or Runtime(missing='float') to "
                         f"calibrate the rest without it")
    fallback = "float layer" if policy == "float" else f"{role} not quantized"
    gap = {"layer": layer, "role": role, "calls": slot.calls, "fallback": fallback}
    if got:  # the summary warning of the roles that saw no tokens does not say what came
        gap["got"] = got
        warnings.warn(f"calibrate: layer {layer!r} {role} {what}; it falls back ({fallback}, "
                      f"in calibration.info['missing'])",
                      stacklevel=outside_quantscope())
    return gap


def _odd_value(odd) -> str:
    """What :attr:`.observe.Slot.odd` holds, in words: ``a tuple``, ``a tensor of int64``."""
    if isinstance(odd, torch.dtype):
        return f"a tensor of {str(odd).removeprefix('torch.')}"
    return "None" if odd is type(None) else f"a {odd.__name__}"


def build_states(slots, plans, recipes, auto_metric="tensor", groups=(), experts=None,
            missing="skip", fisher=None, batches=1):
    """Build each recipe's states and report rows; ``auto`` picks by squared error (or,
    ``auto_metric`` "joint" / "fisher", by :func:`.layer_choice.joint_choice`).
    ``batches``: how many the pass forwarded (over every process)."""
    built = _States(slots, auto_metric, fisher, _ignoring(slots, plans))
    results = {label: built.recipe(plan, groups, experts, missing, batches > 0)
               for label, plan in plans.items()}
    hists = {key: _histogram(x, f"calibrate: layer {key[0]!r} {key[1]}")
             for key, x in built.data.items() if key[1] != "weight"}
    return results, hists


def _ignoring(slots, plans) -> set:
    """The slots (by id) every role of which reads NaN / inf as zero (``non_finite="ignore"``):
    their samples, read by ``auto``, the report and the histograms, are zeroed as the
    observers read them (a slot with a role in mode "error" keeps them, for its error)."""
    ignores = {}
    for plan in plans.values():
        for key, (cfg, _) in plan.items():
            ign = dict(cfg.options).get("non_finite") == "ignore"
            ignores[id(slots[key])] = ignores.get(id(slots[key]), True) and ign
    return {sid for sid, ign in ignores.items() if ign}


class _States:
    """Every recipe's states from the slots' observers, through caches the recipes share (a
    recipe that asks for an observer another already used gets the same state, stats and
    ``auto`` error): one state per observer, keyed ``(layer, role, observer key, dynamic)``."""

    def __init__(self, slots, auto_metric, fisher, ignoring=frozenset()):
        self.slots, self.auto_metric, self.fisher = slots, auto_metric, fisher
        self.data = {}  # what each role's states are scored on
        for key, slot in slots.items():
            if slot.role == "weight":
                self.data[key] = slot.module.weight.detach()
            elif slot.sample is not None and slot.sample.count:
                self.data[key] = slot.sample.rows()  # a view of the slot's buffer: no copy
                if id(slot) in ignoring:  # in place (the pass's samples are inference tensors)
                    with torch.inference_mode():
                        self.data[key].nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        self.cache = {}  # the report's tensor stats of each state
        self.made = {}  # one state per observer, shared by every recipe (and auto) that uses it
        self.errors = {}  # what auto minimises, per state
        self.joint = {}  # the joint (weight, input) choice per layer and configuration

    def recipe(self, plan, groups, experts, missing, forwarded=True):
        """``(states, rows, fusion groups, per-expert ranges, roles that saw no data)`` of one
        recipe's plan (``forwarded``: whether the pass forwarded any batch)."""
        states, rows, absent = {}, [], []
        for (layer, role), (cfg, names) in plan.items():
            gap = _missing(layer, role, self.slots[(layer, role)], names, cfg, missing, experts,
                           forwarded)
            if gap is not None:
                absent.append(gap)
                continue
            state, st = self.role_state(plan, layer, role, cfg, names, experts)
            states.setdefault(layer, {})[role] = state
            if st is not None:
                rows.append(stats_row(layer, role, state, st))
        # what follows may give a role another state (a fusion group's one input or shared
        # weight scale, an expert's shrunk or module-wide range): its row is made again
        before = {(layer, role): st for layer, rs in states.items() for role, st in rs.items()}
        _share_inputs(states, plan, self.slots, groups, self.made,
                      self.joint_errors(plan) if self.auto_metric in layer_choice.LAYER_METRICS
                      else self.errors)
        shared = _share_weights(states, plan, self.slots, groups)
        per_expert = moe.shrink(states, experts, experts.min_tokens) if experts else []
        self._restat(states, rows, before)
        floats = {g["layer"] for g in absent if g["fallback"] == "float layer"}
        states = {k: v for k, v in states.items() if k not in floats}
        rows = [r for r in rows if r["layer"] not in floats]
        return states, rows, shared, per_expert, absent

    def _restat(self, states, rows, before) -> None:
        """The report rows of the roles whose state changed since ``before`` (the states the
        rows were made for): the statistics of the qparams served."""
        at = {(r["layer"], r["role"]): i for i, r in enumerate(rows)}
        for layer, roles in states.items():
            for role, state in roles.items():
                x = self.data.get((layer, role))
                if state is not before.get((layer, role)) and (layer, role) in at and \
                        x is not None:
                    rows[at[(layer, role)]] = stats_row(layer, role, state,
                                                        _stats((layer, role), x, state))

    def role_state(self, plan, layer, role, cfg, names, experts):
        """``(state, stats)`` of one role: the joint choice, the run-time (dynamic) state, or
        the best observed candidate; ``(None, None)`` for an MoE expert without tokens
        (:func:`moe.shrink` pools it later)."""
        slot = self.slots[(layer, role)]
        shape = tuple(slot.module.weight.shape) if role == "weight" else None
        pick = (self.joint_pick(plan, layer)
                if self.auto_metric in layer_choice.LAYER_METRICS
                and len(names) > 1 and role in ("weight", "input") else None)
        if pick is not None:
            state = replace(pick[role], requested=cfg.observer)
            return state, self.stats_of((layer, role), (layer, role, "joint", state.observer,
                                                        cfg), state)
        if cfg.dynamic is True:
            state = RoleState(cfg.spec, cfg.observer, cfg.observer, True, cfg.options)
            return state, self.stats_of((layer, role), (layer, role, "dynamic", cfg), state)
        best = self.best_candidate(plan, layer, role, slot, cfg, names, shape)
        if best is None and shape is not None and 0 in shape:  # observers skip empty tensors
            raise ValueError(f"calibrate: layer {layer!r} weight: its weight {list(shape)} is "
                             f"empty (0 elements: nothing to quantize); leave the layer out of "
                             f"the recipe (ignore=[{layer!r}]) or give it features")
        if best is None and experts is not None and layer in experts.layers:
            return None, None
        if best is None:
            raise ValueError(f"calibrate: layer {layer!r} {role}: no candidate observer "
                             f"could take {cfg.spec}: {slot.failed}")
        return best[0], best[1]

    def best_candidate(self, plan, layer, role, slot, cfg, names, shape):
        """``(state, stats, error)`` of the candidate with the least ``auto`` error (the one
        candidate where there is one), or None where none observed data."""
        best = None
        for n in names:
            okey = observer_key(n, cfg, slot.module)
            if okey not in slot.observers:
                continue
            obs = slot.observers[okey]
            if not obs.has_observed:  # another candidate saw the data, or an expert
                continue              # without tokens (moe.shrink pools it below)
            skey = (layer, role, okey, cfg.dynamic)
            cand = self.state_of(obs, cfg, skey, shape)
            st = self.stats_of((layer, role), skey, cand)
            err = (self.auto_error(plan, layer, role, skey, cand, st) if len(names) > 1
                   else None)
            if best is None or (err is not None and (best[2] is None or err < best[2])):
                best = (cand, st, err)
        return best

    def stats_of(self, key, skey, state):
        if skey not in self.cache:
            x = self.data.get(key)
            self.cache[skey] = None if x is None else _stats(key, x, state)
        return self.cache[skey]

    def state_of(self, obs, cfg, skey, shape):
        if skey not in self.made:
            t0 = time.perf_counter()
            try:
                self.made[skey] = _state_from(obs, cfg, shape)
            except ValueError as e:  # the observer's own error (NaN in a weight) names no layer
                raise ValueError(f"calibrate: layer {skey[0]!r} {skey[1]}: {e}") from None
            self.slots[skey[:2]].spent(skey[2], t0)  # the qparams: the observer's time
        return replace(self.made[skey], requested=cfg.observer)

    def auto_error(self, plan, layer, role, skey, state, st):
        """What ``auto`` minimises: the squared error this role's quantization causes in the
        layer's output ``x W^T`` (metric "output", for 2-D weights with an input sample), or
        in the tensor itself (metric "tensor", and the fallback). Only ``plan``'s own samples
        count: a weight-only plan's weights by their tensor error, as calibrated alone (another
        recipe's input sample would change its choice)."""
        own = (layer, "input") in plan
        ekey = skey if own else (*skey, "tensor")  # a weight's two errors, cached apart
        if ekey in self.errors:
            return self.errors[ekey]
        err = None if st is None else st["noise"]
        module = self.slots[(layer, role)].module_of(layer)  # a fused member: its own weight
        w = getattr(module, "weight", None)
        x = self.data.get((layer, "input")) if own else None
        t = is_conv1d(module)  # its weight is [in, out]
        if (self.auto_metric == "output" and role in ("weight", "input") and w is not None
                and w.dim() == 2 and x is not None and x.shape[-1] == w.shape[0 if t else 1]):
            w, x = w.detach().float(), x.float()
            if role == "input":
                e = linear_output(qdq_tensor(x, state).float() - x, w, t)
            else:
                e = linear_output(x, qdq_tensor(w, state).float() - w, t)
            err = float(e.square().sum())
        self.errors[ekey] = err
        return err

    def joint_errors(self, plan) -> dict:
        """The joint error of each input candidate of ``plan``'s layers under the layer's
        picked weight, by state key: what a fusion group's one input minimises the sum of
        (the picks are cached: no error is computed again)."""
        out = {}
        for (layer, role), (_, names) in plan.items():
            pick = self.joint_pick(plan, layer) if role == "input" and len(names) > 1 else None
            if pick is not None:
                out.update(pick["input_errors"])
        return out

    def joint_pick(self, plan, layer):
        """The (weight, input) states :func:`.layer_choice.joint_choice` picks for ``layer``,
        or None where the layer has no 2-D weight with an input sample and both roles
        calibrated."""
        key = (layer, tuple((r, plan[(layer, r)][0]) for r in ("weight", "input")
                            if (layer, r) in plan))
        if key not in self.joint:
            self.joint[key] = layer_choice.layer_pick(layer, plan, self.slots, self.data,
                                                      self.state_of, self.fisher)
        return self.joint[key]


def _stats(key, x, state) -> dict:
    """:func:`~.report.tensor_stats` of role ``key`` (``(layer, role)``), errors naming it (a
    run-time input's NaN / inf raised in the pass: :func:`.non_finite.watched`). A run-time
    weight has no observer either: its range, read here, raises on NaN / inf as an observed
    weight's does (unless its options read them as zero)."""
    try:
        st = tensor_stats(x, state)
    except ValueError as e:
        raise ValueError(f"calibrate: layer {key[0]!r} {key[1]}: {e}") from None
    if (key[1] == "weight" and state.dynamic is True
            and dict(state.options).get("non_finite") != "ignore"
            and not (math.isfinite(st["min"]) and math.isfinite(st["max"]))):
        raise ValueError(f"calibrate: layer {key[0]!r} weight holds NaN or inf values (dynamic "
                         f"role, observer {state.observer!r}); fix the model's weights, or give "
                         f"the role options={{'non_finite': 'ignore'}} to read them as zero")
    return st


def stats_row(layer, role, state: RoleState, st: dict) -> dict:
    """The report's row of one role (``st``: :func:`~.report.tensor_stats` of its tensor)."""
    if state.lo is not None:
        lo, hi = torch.stack((state.lo.min(), state.hi.max())).tolist()  # one read back
    else:
        lo, hi = st["min"], st["max"]
    return {"layer": layer, "role": role, "observer": state.observer,
            "requested": state.requested, "spec": str(state.spec),
            "dynamic": state.dynamic, "sqnr_db": st["sqnr_db"], "clipped": st["clipped"],
            "lo": lo, "hi": hi, "clip_lo": st["clip_lo"], "clip_hi": st["clip_hi"],
            "units": st["units"], "numel": st["numel"]}


def _histogram(x: torch.Tensor, who: str, bins: int = 256) -> dict:
    # float64 values past float32's range: a static role's observer refused them already; a
    # run-time role's sample is refused here (its float32 scales would be inf)
    check_float32_range(who, x)
    x = x.detach().float().flatten()
    lo, hi = torch.stack(torch.aminmax(x)).tolist()  # one read back
    if hi <= lo:
        hi = lo + 1.0
    counts = torch.histc(x, bins, lo, hi)
    return {"lo": lo, "hi": hi, "counts": [int(c) for c in counts.tolist()]}
