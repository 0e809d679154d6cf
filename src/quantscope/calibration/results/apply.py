"""Apply calibrated qparams to a model as fake quantization (QDQ), reversibly.

Weights are replaced in place by ``fake_quantize(weight)`` (the same Parameter
object, so tied or shared references stay valid; QDQ'd once, however many modules share
it); activations are fake-quantized by forward hooks. :meth:`QDQHandle.remove` removes
the hooks and copies the saved float weights back, bit for bit, into the weights the model
holds then (after ``model.to(dtype)``: cast to it, as ``.to()`` casts; in every module that
held it, should a cast have split a tie).

:func:`runtime_qparams` is the one place that decides the qparams a role uses on
a given tensor: the calibrated ones (static), ones computed from the tensor
itself (``dynamic=True``), or run-time block scales under a calibrated global
scale (``dynamic="local"``, NVFP4 activations). QDQ, the report and ``auto``
all go through it.
"""

from __future__ import annotations

import copy
import itertools
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

# the quantizer of a role lives below calibration/ (report and apply both use it): re-exported
from ..._checks import outside_quantscope, write_refused
from ..._locks import ForkSafeLock
from ...observers.runtime import qdq_tensor, runtime_qparams
from ...qdq import clip_edges
from ..run.batches import input_name, module_input
from ..structure import kv_cache, moe
from ..structure.expert_views import expert_weight
from ..structure.fingerprint import layer_weight
from ..structure.placement import (
    check_module,
    check_placement,
    held_weight,
    plain,
    refuse_compiled,
    restore_problem,
    stored,
)
from ..structure.tied import extent, memory, tied_weights
from .role_state import RoleState

__all__ = ["QDQHandle", "apply", "clip_edges", "fake_quantized", "qdq_tensor",
           "refuse_applied", "runtime_qparams"]

_ATTR = "_quantscope_qdq"
#: the handle's token on every module apply() fake-quantized, cleared by remove(): a copy of
#: one (deepcopy, torch.save) carries its QDQ'd weight and hooks and a token no live handle
#: holds, refused (a whole model's copy copies its handle, and the token with it)
_PART = "_quantscope_qdq_part"
#: the active handles: another apply() reaching one of their weights (through a model nested
#: in the first, or holding it) would save its QDQ values as the float ones (:func:`_held`).
#: A handle dropped without remove() leaves the set with it (weak).
_APPLIED: weakref.WeakSet[QDQHandle] = weakref.WeakSet()
#: apply() and remove() in other threads (on other models) add to and discard from it while
#: one thread reads it
_APPLIED_LOCK = ForkSafeLock()


def _track(handle: QDQHandle, active: bool) -> None:
    with _APPLIED_LOCK:
        if active:
            _APPLIED.add(handle)
        else:
            _APPLIED.discard(handle)


@dataclass
class _Saved:
    """One fake-quantized weight and its float values. Where the weight lives is looked up
    when needed, not held: ``model.to()`` gives modules new tensors (new Parameters under
    ``torch.__future__.set_overwrite_module_params_on_conversion``, one per module: a tie
    splits), and an expert view's storage parts from its 3-D parameter's then."""

    # every (module, attribute) holding the weight at apply time (a tied one: several), or
    # the 3-D experts module and its parameter's name
    holders: list[tuple[nn.Module, str]]
    expert: int | None  # the expert's index into that parameter; None: the whole tensor
    original: torch.Tensor  # the float values, as apply() found them

    def params(self) -> list[torch.Tensor]:
        """The weight as the holders hold it now, once per distinct tensor (one while a tie
        holds)."""
        now = {}
        for module, name in self.holders:
            t = stored(module, name)
            now.setdefault(id(t), t)
        return list(now.values())

    def present(self) -> bool:
        """Whether the holders still hold a weight: a copy whose weights were taken away (an
        exporter's, compressed; dropped, its handle left until gc collects it) holds none."""
        return all(isinstance(getattr(m, n, None), torch.Tensor) for m, n in self.holders)

    def targets(self) -> list[torch.Tensor]:
        """The weight as the model holds it now (an expert's ``[out, in]`` slice)."""
        if self.expert is None:
            return self.params()
        (owner, name), = self.holders
        return [expert_weight(owner, name, self.expert)]


class QDQHandle:
    """What :func:`apply` did to a model; :meth:`remove` undoes it exactly.

    Also a context manager: ``with calib.apply(model): ...``.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._hooks: list = []
        self._weights: list[_Saved] = []
        self._wired: list[str] = []  # what a deepcopy of the model cannot carry (__deepcopy__)
        self._parts: list[nn.Module] = []  # the modules marked _PART, with self._token
        self._token = object()
        self.active = True

    def remove(self) -> None:
        """Remove the activation hooks and restore the float weights (idempotent)."""
        for saved in self._weights:  # before any change: remove() is all or nothing
            _refuse_inverted(saved, self.model)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        with torch.no_grad():
            for saved in reversed(self._weights):
                for t in saved.targets():
                    t.copy_(saved.original)  # casts, as model.to(dtype) did
        torch.clear_autocast_cache()  # an autocast region's casts of the QDQ'd weights
        self._weights.clear()
        self._wired.clear()
        for module in self._parts:
            module.__dict__.pop(_PART, None)
        self._parts.clear()
        _track(self, False)
        if getattr(self.model, _ATTR, None) is self:
            delattr(self.model, _ATTR)
        self.active = False

    def __deepcopy__(self, memo):
        """A deepcopy of the applied model gets its own handle, over its own weights."""
        self._refuse_wired("deepcopy")
        new = memo[id(self)] = type(self).__new__(type(self))
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        if new.active:
            _track(new, True)  # the nested-apply refusal covers the copy's weights too
        return new

    def __getstate__(self):
        self._refuse_wired("pickle (torch.save)")
        return self.__dict__

    def __setstate__(self, state):
        """A loaded applied model (torch.load) is applied as its original was: remove()
        restores its float weights, and apply() over its weights is refused."""
        self.__dict__.update(state)
        if self.active:
            _track(self, True)

    def _refuse_wired(self, how: str) -> None:
        """Refused where QDQ is wired to the model's modules by identity (MoE expert views
        and their routed forward, the KV-cache routing): a copy would run or undo the
        original's."""
        if self._wired:
            raise TypeError(
                f"{how}: the model has quantscope QDQ applied through {self._wired[0]}, "
                f"which a copy cannot carry (it would stay wired to the original); copy "
                f"the model before apply() or after remove(), then apply the calibration to "
                f"the copy")

    def _mark(self, module: nn.Module) -> None:
        if module.__dict__.get(_PART) is None:
            setattr(module, _PART, self._token)
            self._parts.append(module)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


class _InputQDQ:
    """The forward pre-hook fake-quantizing a module's input (an object, not a closure, so
    that an applied model pickles)."""

    def __init__(self, state: RoleState, name: str):
        self.state, self.name = state, name

    def __call__(self, module, args, kwargs):
        x = module_input(args, kwargs, self.name, rows=False)  # (a nested one: qdq_tensor's)
        if not isinstance(x, torch.Tensor):
            return None
        if args:
            return (qdq_tensor(x, self.state), *args[1:]), kwargs
        return args, {**kwargs, self.name: qdq_tensor(x, self.state)}


class _OutputQDQ:
    """The forward hook fake-quantizing a module's output."""

    def __init__(self, state: RoleState):
        self.state = state

    def __call__(self, module, args, output):
        if isinstance(output, torch.Tensor):
            return qdq_tensor(output, self.state)
        return None


def apply(model: nn.Module, states: dict[str, dict[str, RoleState]]) -> QDQHandle:
    """Fake-quantize ``model`` with ``{layer: {role: RoleState}}``; returns the undo handle.

    Raises ``ValueError`` naming the layer if the model lacks a module or a weight
    has another shape than the one calibrated, if layers sharing one weight Parameter (tied)
    have states that quantize it differently, or if the model is a ``torch.compile``
    wrapper; nothing is left applied then. A shared weight is fake-quantized once; the
    modules sharing it without a state are named in a warning.
    """
    check_module(model, "apply")
    if not isinstance(states, Mapping):  # apply(model, calibration): its .states, or its apply
        raise TypeError(f"apply: states must be a {{layer: {{role: RoleState}}}} mapping (a "
                        f"Calibration's .states; or call calibration.apply(model)), got "
                        f"{type(states).__name__}")
    if getattr(model, _ATTR, None) is not None:
        raise ValueError("apply: this model already has quantscope QDQ applied; call remove() "
                         "on the handle first")
    refuse_compiled(model, "apply")
    check_placement(model, "apply")
    handle = QDQHandle(model)
    kv: dict[str, dict[str, RoleState]] = {}  # attention layer -> key / value states
    weights: dict = {}  # memory(w) -> (w, where, [(layer, st)])
    held = _held(slices=True)  # an expert view's memory is its slice's, not the 3-D tensor's
    try:
        experts = _attach_experts(model, states, handle)
        for name, roles in states.items():
            try:
                module = model.get_submodule(name)
            except AttributeError:
                raise ValueError(f"apply: the model has no module {name!r} (calibrated on "
                                 f"another model?)") from None
            for role, state in roles.items():
                if role == "weight":
                    w = _checked_weight(name, module, state, held)
                    same = weights.setdefault(memory(w), (w, _where(name, module, experts), []))
                    same[2].append((name, state.to(w.device)))
                elif role == "input":
                    handle._mark(module)
                    handle._hooks.append(module.register_forward_pre_hook(
                        _InputQDQ(state.to(_device(module)), input_name(module)),
                        with_kwargs=True))
                elif role == "output":
                    handle._mark(module)
                    handle._hooks.append(module.register_forward_hook(
                        _OutputQDQ(state.to(_device(module)))))
                elif role in kv_cache.ROLES:
                    kv.setdefault(name, {})[role] = state.to(_device(module))
                else:
                    raise ValueError(f"apply: unknown role {role!r} for {name!r}")
        _refuse_parts(model, "apply", handle)  # (weights another apply holds: named above)
        _qdq_weights(model, weights.values(), handle)
        if kv:
            handle._hooks.append(SimpleNamespace(remove=kv_cache.attach(
                model, {name: _kv_qdq(roles) for name, roles in kv.items()})))
            handle._wired.append("the KV cache (attention routed by module identity)")
        _track(handle, True)
        setattr(model, _ATTR, handle)
    except BaseException:
        handle.remove()
        raise
    return handle


def refuse_applied(model: nn.Module, who: str, why: str = "calibrating a fake-quantized "
                   "model gives ranges of the quantized values") -> None:
    """Refuse a model with quantscope QDQ applied (to it, a module of it, or a model holding
    it): calibrating it would observe the fake-quantized weights and activations, an export
    would write them (``why``: the reason the message gives)."""
    held = _held()
    if (any(getattr(m, _ATTR, None) is not None for m in model.modules())
            or (held and any(memory(p) in held for p in model.parameters()))):
        raise ValueError(f"{who}: the model has quantscope QDQ applied (calibration.apply); "
                         f"remove() the handle first: {why}")
    _refuse_parts(model, who)


def _refuse_parts(model: nn.Module, who: str, handle: QDQHandle | None = None) -> None:
    """Refuse a model holding a module apply() fake-quantized (marked ``_PART``): any for
    calibrate (``handle`` None); for ``handle``'s apply only a copy's, whose mark no live
    handle holds (its weights are the QDQ'd values, its hooks no handle removes; a live
    handle's weights are :func:`_held`'s to refuse, where this apply reaches them)."""
    with _APPLIED_LOCK:
        live = {getattr(h, "_token", None) for h in _APPLIED}
    for name, module in model.named_modules():
        mark = module.__dict__.get(_PART)
        if mark is not None and (handle is None or mark is not handle._token
                                 and mark not in live):
            raise ValueError(
                f"{who}: module {name or 'model'!r} ({type(module).__name__}) has quantscope "
                f"QDQ applied by another apply(), or is a copy (copy.deepcopy, torch.save) of "
                f"a module of an applied model, whose fake-quantized weights and hooks it "
                f"carries without their handle: remove() that handle first, or copy the "
                f"module before apply() or after remove()")


def _held(slices: bool = False) -> set:
    """The weights (3-D expert parameters; ``slices``: each expert's slice too) the active
    handles fake-quantized, as the models hold them now, by :func:`~..structure.tied.memory`."""
    with _APPLIED_LOCK:
        handles = list(_APPLIED)
    return {memory(t) for h in handles for s in h._weights if s.present()
            for t in (*s.params(), *(s.targets() if slices else ()))}


def fake_quantized(model: nn.Module, layers) -> set[str]:
    """Those of ``layers`` whose weight in ``model`` holds fake-quantized values (an active
    handle's, or a marked copy's), not float ones: ``Calibration.check_model`` compares no
    fingerprint of them, and leaves them to apply()'s own refusals, which say why."""
    held, modules, out = _held(slices=True), dict(model.named_modules()), set()
    for layer in layers:
        w, module = layer_weight(model, layer), modules.get(layer)
        if (module is not None and module.__dict__.get(_PART) is not None) or (
                w is not None and memory(w) in held):
            out.add(layer)
    return out


def _where(name: str, module: nn.Module, experts) -> tuple:
    """Where ``name``'s weight lives for :class:`_Saved`: ``(owner, attribute, expert)``."""
    if experts is not None and name in experts.layers:
        return experts.source(name)
    return module, "weight", None


def _checked_weight(name: str, module: nn.Module, state: RoleState, held) -> torch.Tensor:
    """``module``'s weight, which ``state`` fake-quantizes: raises naming ``name`` if it has
    none, another shape than calibrated, or another apply() holds it (in ``held``)."""
    w = held_weight("apply", name, module)
    if w is None:
        raise ValueError(f"apply: {name} ({type(module).__name__}) has no weight tensor to "
                         f"quantize (calibrated on another model?)")
    state.check_weight("apply", name, w)
    if write_refused(w):
        raise ValueError(f"apply: {name}.weight is an inference tensor (made under "
                         f"torch.inference_mode()), which torch writes only inside it: call "
                         f"apply() inside torch.inference_mode(), or build the model outside it")
    if memory(w) in held:
        raise ValueError(f"apply: {name}.weight is already fake-quantized by another apply() "
                         f"(on a model holding this module, held by it, or sharing its "
                         f"memory); remove() that one first")
    return w


def _qdq_weights(model: nn.Module, weights, handle: QDQHandle) -> None:
    """Fake-quantize each weight once, whatever number of layers share it (a tied lm_head):
    their states must quantize alike (QDQ twice would compound, matching neither), and
    the modules sharing it without a state are named (they run it fake-quantized too)."""
    for w, _, owners in weights:
        (first, state), *rest = owners
        for other, st in rest:
            if not st.quantizes_like(state):
                raise ValueError(
                    f"apply: {first}.weight and {other}.weight are one weight (a tied "
                    f"Parameter, or one memory) with different weight qparams ({state.spec} "
                    f"vs {st.spec}); one QDQ cannot be both: ignore one of the layers in the "
                    f"recipe, or untie the weights")
    _warn_tied(model, [owners[0][0] for _, _, owners in weights],
               {name for _, _, owners in weights for name, _ in owners})
    _refuse_overlaps([(w, owners[0][0]) for w, _, owners in weights])
    holders = _holders(model)
    with torch.no_grad():
        for w, (owner, name, expert), ((_, state), *_) in weights:
            # a module's weight: every module holding its memory (a cast may split the tie)
            places = [(owner, name)] if expert is not None else holders.get(
                memory(w), [(owner, name)])
            handle._weights.append(_Saved(places, expert, w.detach().clone()))
            for module, _ in places:
                handle._mark(module)
            w.copy_(qdq_tensor(w.detach(), state))
    torch.clear_autocast_cache()  # an autocast region's casts of the float weights


def _refuse_inverted(saved: _Saved, model: nn.Module) -> None:
    """Raise naming the layer where the float values have no place to go back to
    (:func:`~..structure.placement.restore_problem`)."""
    for module, name in saved.holders:
        found = restore_problem(module, name)
        if found is not None:
            problem, fix = found
            where = next((n for n, m in model.named_modules() if m is module), "?")
            raise ValueError(f"remove: {where}.{name} {problem}: the float weight has no "
                             f"place to go back to; {fix}")


def _refuse_overlaps(weights: list[tuple[torch.Tensor, str]]) -> None:
    """Raise naming both where two weights (distinct memories:
    :func:`~..structure.tied.memory`) share some elements (Parameters over overlapping slices
    of one tensor): QDQ in place would quantize the shared values twice. Slices of one tensor
    that only interleave (a split of columns) are told apart element by element, where their
    spans of the storage meet."""
    spans: dict = {}
    for w, layer in weights:
        if w.numel() and plain(w):
            end = extent(w)
            spans.setdefault((w.untyped_storage().data_ptr(), w.element_size()), []).append(
                (w.storage_offset(), end, w, layer))
    for views in spans.values():
        views.sort(key=lambda v: v[0])
        if all(a[1] < b[0] for a, b in itertools.pairwise(views)):
            continue  # disjoint spans (q / k / v rows of one tensor)
        owner = torch.zeros(max(v[1] for v in views) + 1, dtype=torch.int32,
                            device=views[0][2].device)
        for k, (start, _, w, layer) in enumerate(views):
            mine = owner.as_strided(w.shape, w.stride(), start)
            taken = mine[mine != 0]
            if taken.numel():
                other = views[int(taken[0]) - 1][3]
                raise ValueError(
                    f"apply: {other}.weight and {layer}.weight share some of their values "
                    f"(Parameters over overlapping slices of one tensor): fake-quantizing one "
                    f"in place would change the other; give each layer a weight of its own "
                    f"(.clone())")
            mine.fill_(k + 1)


def _holders(model: nn.Module) -> dict:
    """``{memory(parameter): [(module, attribute), ...]}``: every place ``model`` holds each
    weight (a tied one, or distinct Parameters over its memory: several)."""
    out: dict = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                out.setdefault(memory(p), []).append((module, name))
    return out


def _warn_tied(model: nn.Module, layers: list[str], done: set[str]) -> None:
    """One warning naming the modules that share the weight of one of ``layers`` (one per
    Parameter) without a state of their own (not in ``done``)."""
    silent = {layer: sorted(set(others) - done)
              for layer, others in tied_weights(model, layers).items()}
    silent = {layer: others for layer, others in silent.items() if others}
    if silent:
        said = "; ".join(f"{layer}.weight is also the weight of {others}"
                         for layer, others in silent.items())
        warnings.warn(f"apply: {said} (tied): those modules run it fake-quantized too, "
                      f"though the calibration and its report do not cover them; ignore "
                      f"the layer in the recipe, or untie the weights, to keep them float",
                      stacklevel=outside_quantscope())


def _kv_qdq(states: dict[str, RoleState]):
    """The :func:`kv_cache.attach` callback that fake-quantizes a layer's key / value states."""
    def callback(role, x):
        return qdq_tensor(x, states[role]) if role in states else x
    return callback


def _attach_experts(model: nn.Module, states, handle: QDQHandle):
    """MoE experts held as 3-D parameters are QDQ'd through per-expert Linear views
    (:mod:`~quantscope.calibration.structure.moe`), attached until the handle is removed;
    returns the :class:`~quantscope.calibration.structure.moe.Experts` (None: none used)."""
    if not moe.has_experts_3d(model):
        return None
    experts = moe.attach(model, count=False)
    if any(name in experts.layers for name in states):
        handle._hooks.append(experts)  # its remove() detaches the views
        handle._wired.append("MoE experts (3-D parameters run through per-expert views)")
        return experts
    experts.detach()
    return None


def _device(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")
