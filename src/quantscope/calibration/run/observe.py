"""The observing pass of a calibration: what is observed, by whom, and the forwards.

A :class:`Slot` is one observed tensor of one layer (its weight, its input, its output, or
an attention layer's cached key / value) with every observer that watches it;
:func:`make_plan` builds the slots of all recipes at once (a recipe asking for an observer
another already asked for shares it); :func:`share_group_inputs` gives each fusion group
one input slot; :func:`observe_batches` runs the forwards with the hooks that feed them
(and the row samples ``auto`` and the report read), removing every hook afterwards.
"""

from __future__ import annotations

import contextvars
import time
import warnings
import weakref
from dataclasses import dataclass, field
from functools import cache, lru_cache
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd

from ..._checks import outside_quantscope
from ...layout import Tensor
from ...observers.grouped import observe_many
from ...observers.registry import get_observer, observer_class
from ...spec import QuantSpec
from ..recipe import AUTO, DEFAULT_CANDIDATES, Role, weight_observer
from ..role_observers import folded, observed
from ..structure import fusion, kv_cache
from ..structure.conv1d import observer_options
from . import heap, non_finite
from .batches import batch_count, eval_mode, forward_batch, input_name, module_input
from .module_roles import activation_width, check_role_shape
from .samples import RowSample, capacities, generator_for

# the activation rows kept for auto and the report, all layers together (see docs/memory.md)
DEFAULT_SAMPLE_BUDGET_MB = 64
_IN_PASS = contextvars.ContextVar("quantscope_in_pass", default=False)
_BATCH = contextvars.ContextVar("quantscope_batch", default=None)  # index of the batch now


def in_pass() -> bool:
    """Whether :func:`observe_batches` is forwarding a calibration batch now. Hooks that
    gather statistics of their own beside the observers (``auto``'s input importance) count
    these forwards only, not the others a calibration runs (finding fusion groups, scoring)."""
    return _IN_PASS.get()


@dataclass
class Slot:
    """One observed tensor of one layer: its observers, keyed by (name, spec, options)."""

    layer: str
    role: str
    module: nn.Module
    observers: dict = field(default_factory=dict)
    sample: RowSample | None = None  # rows for auto and the report, made by observe_batches
    needs_sample: bool = False
    per_tensor: bool = True  # every role on it has a per-tensor layout (a conv: channel rows)
    failed: dict = field(default_factory=dict)
    also: dict = field(default_factory=dict)  # a fusion group's other layers by name (shared input)
    last: object = None  # fusion.mark of the input last observed: a group's counts once
    calls: int = 0  # forwards that reached the hook, empty ones included
    odd: object = None  # a call's value that is no float tensor: its dtype or type (missing=)
    odd_calls: int = 0  # how many calls brought such a value
    seconds: dict = field(default_factory=dict)  # time in each observer: observing, qparams
    # imatrix_mse weights held for their inputs' importance (.imatrix_roles); key -> why unweighted
    waiting: list = field(default_factory=list)
    unweighted: dict = field(default_factory=dict)
    # ``(layer, observer)`` of a run-time role that raises on NaN / inf (non_finite not
    # "ignore"): where no observer of the slot raises on them, the pass's hook flags them
    # (seen_non_finite); the layer is the role's own (a fusion group's member, not its lead)
    runtime_check: tuple[str, str] | None = None
    seen_non_finite: torch.Tensor | None = None

    def module_of(self, layer: str) -> nn.Module:
        """The module of ``layer``: this slot's, or (a fusion group's shared input slot, held
        by its lead) the member's own, whose weight its output error is priced with."""
        return self.also.get(layer, self.module)

    def spent(self, key, since: float) -> None:
        """Count the time from ``since`` (``time.perf_counter()``) to the observer ``key``."""
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - since


def candidates_for(role: str, candidates) -> list[str]:
    explicit = candidates is not None
    names = list(DEFAULT_CANDIDATES if candidates is None else candidates)
    out = {}  # by the name in lower case, the registry's key: "MSE" is "mse", run once
    for n in names:
        n = folded(n)  # as registered: "IMATRIX_MSE" waits for importance as "imatrix_mse"
        if n == AUTO:
            continue
        try:
            observer_class(n)
        except ValueError as e:
            if explicit:
                raise ValueError(f"calibrate: Auto.candidates names {n!r}: {e}") from None
            continue
        name = weight_observer(n) if role == "weight" else n
        out.setdefault(name.lower(), name)
    if not out:
        raise ValueError(f"calibrate: observer 'auto' has no candidate observers for {role} "
                         f"(asked for {names})")
    return list(out.values())


def observer_key(name, role_cfg: Role, module=None):
    return (name, observed_spec(role_cfg), candidate_options(name, role_cfg))


def candidate_options(name: str, role_cfg: Role) -> tuple:
    """The options observer ``name`` runs with on ``role_cfg``'s tensor: the role's own, or
    for an ``auto`` role those of them the candidate ``name`` takes, as ``Auto(metric=
    "model")``'s candidate recipes keep them (:func:`.role_observers.observed`); the others
    are another candidate's (:func:`.auto.check_options` refuses one no candidate takes)."""
    if role_cfg.observer != AUTO or not role_cfg.options:
        return role_cfg.options
    return _taken_options(name, role_cfg)


@lru_cache(maxsize=4096)  # per layer, role and candidate, several times: one signature read
def _taken_options(name: str, role_cfg: Role) -> tuple:
    # ``name`` is the observer itself (a weight's memoryless variant already): not mapped again
    return observed(role_cfg, "input", name, {}).options


def observed_spec(role_cfg: Role):
    """The spec a role's observer watches. ``dynamic="local"`` (NVFP4 activations) calibrates
    only the global amax, a whole-tensor statistic: its observer takes the element format
    per tensor, so batches of any token count (an MoE expert's vary by batch) accumulate
    into one range (block units would change in number with the tokens); a ``"local"``
    weight's alike, alone or a fusion group's concatenated (``finish._joined_state``)."""
    if role_cfg.dynamic != "local":
        return role_cfg.spec
    return QuantSpec(role_cfg.spec.format, "tensor", symmetric=True)


def make_observer(slot: Slot, key, for_auto: bool, owns=None, weights=None):
    """Make ``slot``'s observer ``key`` (``for_auto``: a candidate of ``auto``, dropped into
    ``slot.failed`` where it cannot take the spec or the weight; else the error raises). A
    weight slot's observer also observes the weight (on its owner rank only: ``owns``), at
    once, or, given the list ``weights``, later with the others (:func:`observe_weights`)."""
    if key in slot.observers or key in slot.failed:
        return
    name, spec, options = key
    t0 = time.perf_counter()
    pending = []
    try:
        obs = get_observer(name, spec, **observer_options(name, slot.module, slot.role, options))
        # distributed: only the owner rank observes a weight (the others get its state)
        if slot.role == "weight" and (owns is None or owns(slot.layer)):
            w = slot.module.weight.detach()
            obs.to(w.device, non_blocking=True)  # no stream sync (quantscope._numerics)
            pending.append((slot, key, obs, w, for_auto))
    except (ValueError, TypeError) as e:
        _observer_failed(slot, key, for_auto, e)
        return
    slot.observers[key] = obs  # claimed now: another recipe asking for this key shares it
    slot.spent(key, t0)
    if weights is None:
        observe_weights(pending)
    else:
        weights.extend(pending)


def _observer_failed(slot: Slot, key, for_auto: bool, error: Exception) -> None:
    name, spec, _ = key
    if not for_auto:
        raise ValueError(f"calibrate: layer {slot.layer!r} {slot.role}: observer {name!r} "
                         f"with {spec}: {error}") from None
    slot.observers.pop(key, None)
    slot.seconds.pop(key, None)
    slot.failed[key] = str(error)  # auto drops a candidate that cannot take this spec


def observe_weights(weights) -> None:
    """Every ``(slot, key, observer, weight, for_auto)`` of :func:`make_observer` observed
    at once: off the CPU the weights' min / max in a few grouped launches
    (:func:`~quantscope.observers.observe_many`), each observer's failure handled as
    :func:`make_observer` handles it, its time (a launch's share by elements) counted."""
    def failed(i, error):
        slot, key, _, _, for_auto = weights[i]
        _observer_failed(slot, key, for_auto, error)

    t0 = time.perf_counter()
    with torch.inference_mode():
        seconds = observe_many([(obs, w) for _, _, obs, w, _ in weights], on_error=failed)
    # this module's clock (the one the calibration's times read), shared as observe_many's
    total, measured = time.perf_counter() - t0, sum(seconds)
    for (slot, key, _, _, _), s in zip(weights, seconds, strict=True):
        if key in slot.observers:
            share = s / measured if measured else 1 / len(weights)
            slot.seconds[key] = slot.seconds.get(key, 0.0) + total * share


def observer_seconds(slots, *plans) -> float:
    """The time spent in the observers the recipes' ``plans`` use (each counted once)."""
    used = {(id(slots[lr]), observer_key(n, cfg, slots[lr].module)): slots[lr]
            for plan in plans for lr, (cfg, names) in plan.items() for n in names}
    return sum(slot.seconds.get(key, 0.0) for (_, key), slot in used.items())


def waits_for_importance(key) -> bool:
    """Whether observer ``key`` is the native ``imatrix_mse`` without the user's
    ``importance``: a weight's is observed after the pass, given its layer's input's."""
    return key[0] == "imatrix_mse" and "importance" not in dict(key[2])


def make_plan(model, recipes, candidates, owns=None):
    """``(slots, plans)``: every recipe's observers, the weights (those ``owns`` selects)
    observed now, but a :func:`waits_for_importance` observer's (in ``slot.waiting``)."""
    slots: dict[tuple[str, str], Slot] = {}
    plans = {}
    weights = []  # observed together at the end (observe_weights)
    for label, recipe in recipes.items():
        plan = {}
        for layer, (module, roles) in recipe.match(model).items():
            for role, cfg in roles.items():
                cfg = check_role_shape(layer, role, cfg, module)
                slot = slots.setdefault((layer, role), Slot(layer, role, module))
                if role in ("input", "output"):  # the KV cache is not sampled
                    slot.needs_sample = True
                    slot.per_tensor &= isinstance(cfg.spec.layout, Tensor)
                names = ([] if cfg.dynamic is True else candidates_for(role, candidates)
                         if cfg.observer == AUTO else [cfg.observer])
                if cfg.dynamic is True and dict(cfg.options).get("non_finite") != "ignore":
                    slot.runtime_check = slot.runtime_check or (layer, cfg.observer)
                for n in names:
                    make_observer(slot, observer_key(n, cfg, module), cfg.observer == AUTO,
                                  owns, weights)
                plan[(layer, role)] = (cfg, names)
        plans[label] = plan
    now = []
    for p in weights:
        (p[0].waiting if waits_for_importance(p[1]) else now).append(p)
    observe_weights(now)
    return slots, plans


def _hook(slots: list[Slot], input_key: str | None = None):
    def observe(x):
        # only the pass's own forwards: another thread's (its fresh context) runs plain
        if not _IN_PASS.get():
            return
        odd = not isinstance(x, torch.Tensor) or not x.is_floating_point()
        for slot in slots:
            slot.calls += 1
            if odd:  # a call all the same (a tuple output, integer ids): missing= names it
                slot.odd = x.dtype if isinstance(x, torch.Tensor) else type(x)
                slot.odd_calls += 1
                continue
            if slot.also:  # a fusion group's slot: q, k and v read one tensor, observe it once
                if fusion.seen(slot.last, x):  # detection's rule: a fresh view is the same
                    continue
                slot.last = fusion.mark(x)
            for key, obs in slot.observers.items():
                t0 = time.perf_counter()
                if obs.observed_tokens.device != x.device:
                    obs.to(x.device, non_blocking=True)
                try:
                    obs(x)
                except ValueError as e:
                    raise ValueError(f"calibrate: layer {slot.layer!r} {slot.role}: observer "
                                     f"{key[0]!r}: {e}") from None
                slot.spent(key, t0)
            if slot.seen_non_finite is not None and x.numel():  # a run-time role's own check
                non_finite.flag_tensor(x, slot)
            if slot.sample is not None:
                slot.sample.add(x, _BATCH.get())

    def pre(module, args, kwargs):  # the input, positional or keyword (``lin(input=x)``)
        observe(module_input(args, kwargs, input_key))

    def post(module, args, output):
        observe(output)

    return pre, post


def _only_for(owner: nn.Module, hook, name: str):
    """``hook``, to register in ``owner``'s hooks ``name``, run for ``owner`` only (held by
    weakref: no cycle keeps it alive): a copy of it (``copy.deepcopy`` of the model mid-pass
    copies its hooks) runs as the float model, its copied hooks removed."""
    ref = weakref.ref(owner)

    def owned(module, *args):
        if module is not ref():
            return _unhook_copy(module, ref(), name)
        return hook(module, *args)
    owned._quantscope_owner = ref  # a mark, not a closure over itself (a cycle)
    return owned


def _unhook_copy(module: nn.Module, owner: nn.Module | None, name: str) -> None:
    """Remove from ``module`` (a copy of ``owner``) the observing hooks of ``name`` made for
    another module; never from dicts it shares with ``owner`` (``copy.copy``'s)."""
    hooks = getattr(module, name)
    if owner is not None and hooks is getattr(owner, name):
        return
    for hid, hook in list(hooks.items()):
        mark = getattr(hook, "_quantscope_owner", None)
        if mark is not None and mark() is not module:
            del hooks[hid]  # torch iterates a tuple of the hooks: safe while they run
            getattr(module, name + "_with_kwargs", {}).pop(hid, None)
            if name == "_forward_hooks":
                module._forward_hooks_always_called.pop(hid, None)


def observe_batches(model, batches, slots, sample_tokens, progress, seed, sample_budget_mb=None,
                    batch_index=None, forward=False, flags=None):
    """Forward every batch with observing hooks; returns the number of batches.
    ``batch_index(i)``: the number the user knows the ``i``-th batch by, in errors (a rank's
    shard of the batches: its place among all of them). ``forward``: forward the batches
    even where no slot observes them (statistics gathered beside: :func:`in_pass`).
    ``flags``: called with the pass's :class:`.FirstBad` for the caller to check (the ranks
    agree on the first bad batch first); None: checked here, NaN / inf raising."""
    by_module: dict[int, dict[str, list[Slot]]] = {}
    kv: dict[str, dict[str, list[Slot]]] = {}  # attention layer -> key / value slots
    watched = non_finite.watched(filter(fed, unique_slots(slots.values())))
    for slot in filter(fed, unique_slots(slots.values())):
        if slot.role in kv_cache.ROLES:
            kv.setdefault(slot.layer, {}).setdefault(slot.role, []).append(slot)
            continue
        for module in (slot.module, *slot.also.values()):
            by_module.setdefault(id(module), {"module": module, "input": [], "output": []})
            by_module[id(module)][slot.role].append(slot)
    if not by_module and not kv and not forward:
        return 0
    total = batch_count(batches)
    _make_samples(unique_slots(slots.values()), sample_tokens, sample_budget_mb, total, seed)
    handles, n = [], 0
    try:
        for entry in by_module.values():
            module = entry["module"]
            if entry["input"]:
                pre, _ = _hook(entry["input"], input_name(module))
                pre = _only_for(module, pre, "_forward_pre_hooks")
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            if entry["output"]:
                _, post = _hook(entry["output"])
                post = _only_for(module, post, "_forward_hooks")
                handles.append(module.register_forward_hook(post))
        if kv:
            handles.append(SimpleNamespace(remove=kv_cache.attach(
                model, {layer: _kv_observer(roles) for layer, roles in kv.items()})))
        bad = non_finite.FirstBad(watched, batch_index)
        with eval_mode(model):
            n = _forward_all(model, batches, total, progress, batch_index, bad.end_batch)
        if flags is None:
            bad.check(model)
        else:
            flags(bad)
    finally:
        for h in handles:
            h.remove()
        for slot in slots.values():
            slot.last = None
    return n


def fed(slot: Slot) -> bool:
    """Whether the batches feed ``slot``: an activation observed or sampled."""
    return slot.role != "weight" and bool(slot.observers or slot.needs_sample)


def with_progress(items, progress: bool, who: str, **bar):
    """``items`` in a tqdm progress bar (``bar``: its keywords) where ``progress``; without
    tqdm (an optional dependency), ``items`` as they are and a warning (:func:`_no_tqdm`)."""
    if not progress:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        _no_tqdm(who)
        return items
    return tqdm(items, leave=False, **bar)


@cache  # once a process (each entry point)
def _no_tqdm(who: str) -> None:
    warnings.warn(f"{who}: progress=True shows a tqdm progress bar, but tqdm is not installed: "
                  f"running without one (pip install tqdm, or the extra quantscope[model]; "
                  f"progress=False says nothing)", stacklevel=outside_quantscope())


def _forward_all(model, batches, total, progress, batch_index, end_batch) -> int:
    """Forward every batch (the hooks observe), each under its number for errors, then
    ``end_batch()``."""
    heap.prepare()  # large tensors mmapped, freed to the system (heap.py)
    # a model off the CPU keeps its activations off the host heap: no pages to give back,
    # and malloc_trim walks the whole heap (~10 ms a batch on a fragmented GB)
    trim = heap.runs_on_host(model)
    it = with_progress(batches, progress, "calibrate", total=total, desc="calibrating",
                       unit="batch")
    n = 0
    # the pass (hooks live, inference mode) is each batch's forward alone: a forward the
    # batches' own iterator runs (a generator filtering by the model's loss) is no data
    for batch in it:
        number = n if batch_index is None else batch_index(n)
        passing, numbering = _IN_PASS.set(True), _BATCH.set(number)
        try:
            with torch.inference_mode():
                forward_batch(model, batch)
                end_batch()
        finally:
            _IN_PASS.reset(passing)
            _BATCH.reset(numbering)
        if trim:
            heap.trim()  # the fragmented heap's free pages back (heap.py)
        n += 1
    return n


def _kv_observer(roles: dict[str, list[Slot]]):
    """The :func:`kv_cache.attach` callback observing one attention's key and value states."""
    observers = {role: _hook(slots)[1] for role, slots in roles.items()}

    def callback(role, x):
        if role in observers:
            observers[role](None, (), x)
        return x
    return callback


def _make_samples(slots, sample_tokens, budget_mb, total, seed):
    """One fixed row buffer per sampled slot, all of them within ``budget_mb``: rows are
    drawn evenly from every batch when their number (``total``) is known, each slot's by a
    generator of its own (:func:`.samples.generator_for`)."""
    sampled = [s for s in slots if s.role != "weight" and s.needs_sample]
    if not sampled:
        return
    axes = {id(s): _sample_axis(s) for s in sampled}
    caps = capacities({id(s): _sample_width(s, axes[id(s)]) for s in sampled},
                      sample_tokens, max(int(sample_budget(budget_mb) * 2**20), 1))
    for s in sampled:
        s.sample = RowSample(caps[id(s)], total, generator_for(seed, f"{s.layer}:{s.role}"),
                             axes[id(s)], skip_other_widths=True)


def _sample_axis(slot: Slot) -> int:
    """The axis a slot's sampled rows run along. A conv's activations are ``[N, C, *S]``
    with S (image size, audio length) free to vary by batch: per tensor (what the report
    and ``auto`` apply to them ignores the row shape) their rows run along the channels, a
    width every batch has. Else along the last dim, where layouts (channel:-1, group,
    token) put their units; a batch of another width is then left out of the sample."""
    if isinstance(slot.module, _ConvNd) and slot.per_tensor:
        return -1 - len(slot.module.kernel_size)
    return -1


def _sample_width(slot: Slot, axis: int):
    if axis != -1:
        return slot.module.in_channels if slot.role == "input" else slot.module.out_channels
    return activation_width(slot.module, slot.role)


def sample_budget(budget_mb) -> float:
    return DEFAULT_SAMPLE_BUDGET_MB if budget_mb is None else budget_mb


def unique_slots(slots):
    """Each slot once (a fusion group's members share their input slot)."""
    return list({id(s): s for s in slots}.values())


def share_group_inputs(model, batches, recipes, slots, groups=None):
    """Give each fusion group one input slot; the groups found by one detection forward of
    the first batch (:func:`~..structure.fusion.detect`) unless given. Returns ``(batches,
    groups)``, batches unconsumed."""
    if groups is None:
        batches, groups = fusion.detect(model, batches, recipes, slots)
    for group in groups:
        keys = [(m, "input") for m in group if (m, "input") in slots]
        lead = slots[keys[0]] if keys else None
        for k in keys[1:]:
            member = slots[k]
            for okey, obs in member.observers.items():
                lead.observers.setdefault(okey, obs)
            lead.failed.update(member.failed)
            lead.needs_sample |= member.needs_sample
            lead.runtime_check = lead.runtime_check or member.runtime_check
            lead.also[k[0]] = member.module
            slots[k] = lead
    return batches, groups
