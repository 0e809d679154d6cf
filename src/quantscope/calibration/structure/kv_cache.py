"""The KV cache: each attention layer's keys and values as the cache holds them.

A runtime that quantizes its KV cache (vLLM's ``kv_cache_dtype="fp8"``) stores every
attention layer's key and value states, **after** the rotary embedding, with one scale
each (``k_scale`` / ``v_scale``). No ``nn.Linear`` hook sees those tensors: ``k_proj``'s
output is not yet rotated. transformers 5 hands them to an attention function chosen by
``config._attn_implementation`` (``ALL_ATTENTION_FUNCTIONS``); :func:`attach` registers,
per underlying implementation, one that passes key and value through a callback and then
runs the original (with the original's mask function), and points the attention modules'
configs at it until the returned undo is called. Calibration observes through the
callback (roles ``"key"`` / ``"value"`` of the attention module); ``apply()``
fake-quantizes through it. The routed function finds each call's callback by its module, so
models built on one config object (``from_config(a.config)``) route it once, each reaching
its own callbacks (a module attached to no callback runs the original): the config is
restored when the last of their attachments detaches.

Attention modules are found as transformers builds them: a module with a ``k_proj``,
``v_proj`` or ``qkv_proj`` child (one is enough: Gemma 4's ``attention_k_eq_v`` layers have
no ``v_proj`` and cache ``k_proj``'s output as values too; Phi-3 fuses all three) and a
``config`` carrying ``_attn_implementation``, whose keys and values a cache holds: causal
(``is_causal`` not False) and taking the cache in its ``forward`` (compressed-tensors'
``is_cached_attention_module`` rule, with transformers 5.24's ``cache`` name). An
encoder's attention (a VLM's SigLIP vision tower, an encoder-decoder's encoder and its
cross-attention) gets no KV-cache roles: no runtime caches it.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Callable

import torch
from torch import nn

from ..._locks import ForkSafeLock
from ..._versions import require

__all__ = ["ROLES", "attach", "attention_modules", "check_asked", "projection"]

ROLES = ("key", "value")
_PREFIX = "quantscope_kv_"
#: the forward argument that hands an attention module the cache, by transformers version
_CACHE_ARGS = ("past_key_value", "past_key_values", "cache")
#: the projections that mark an attention module (compressed-tensors' rule, less DeepSeek's
#: ``kv_b_proj``: MLA caches the compressed latent, which no attention function sees)
_PROJECTIONS = ("k_proj", "v_proj", "qkv_proj")
#: attention module -> callback(role, tensor) -> tensor, while attached; weak, as apply()'s
#: registry: a model dropped with its QDQ handle never removed takes its entries with it
#: (the callbacks hold role states, never the module)
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, Callable[[str, torch.Tensor], torch.Tensor]] = \
    weakref.WeakKeyDictionary()
#: routed config's id -> (a weak reference to it, the implementation the user chose last):
#: one entry per config, whichever models share it (the last to detach restores the choice)
_CHOSEN: dict[int, tuple[weakref.ref, str | None]] = {}
#: _ACTIVE's and _CHOSEN's writes and the configs' routing: two threads may attach and detach
#: models sharing one config (re-entrant: attach routes under it; renewed in a forked child)
_LOCK = ForkSafeLock(reentrant=True)


def check_asked(model: nn.Module, recipes) -> None:
    """A recipe's ``kv_cache`` needs an attention module in the model (a sequential piece
    may have none): else the ``ValueError`` naming the recipe."""
    asked = [r.name for r in recipes if r.kv_cache is not None]
    if asked and not attention_modules(model):
        raise ValueError(f"calibrate: recipe {asked[0]!r} sets kv_cache but the model has no "
                         f"attention module with k_proj, v_proj or qkv_proj (transformers')")


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of the attention modules whose keys and values a cache holds."""
    return {name: m for name, m in model.named_modules()
            if any(isinstance(getattr(m, p, None), nn.Module) for p in _PROJECTIONS)
            and hasattr(getattr(m, "config", None), "_attn_implementation") and _cached(m)}


def projection(attention: nn.Module, role: str) -> str | None:
    """The child of ``attention`` whose output it caches as its ``role`` (``"key"`` or
    ``"value"``), the weight that role's scales were calibrated through: ``k_proj`` /
    ``v_proj``, else a fused ``qkv_proj``, else ``k_proj`` (values without a ``v_proj``:
    Gemma 4's ``attention_k_eq_v`` layers); None where it has none of them."""
    own = "k_proj" if role == "key" else "v_proj"
    return next((p for p in (own, "qkv_proj", "k_proj")
                 if isinstance(getattr(attention, p, None), nn.Module)), None)


def _cached(module: nn.Module) -> bool:
    """Whether a runtime caches ``module``'s keys and values: not an encoder's bidirectional
    attention (``is_causal`` False: SigLIP, an encoder-decoder's encoder and cross-attention),
    and its forward takes the cache (compressed-tensors gives only those a KV scale)."""
    if getattr(module, "is_causal", True) is False:
        return False
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # an uninspectable forward: as compressed-tensors, skip it
        return False
    return any(p in params for p in _CACHE_ARGS)


def _wrapper(impl: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(module, query, key, value, *args, **kwargs):
        callback = _ACTIVE.get(module)
        if callback is not None:
            key, value = callback("key", key), callback("value", value)
        if impl == "eager":  # the modeling file's own eager function
            fn = sys.modules[type(module).__module__].eager_attention_forward
        else:
            fn = ALL_ATTENTION_FUNCTIONS[impl]
        return fn(module, query, key, value, *args, **kwargs)
    return attention


def _register(impl: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = _PREFIX + impl
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _wrapper(impl))
        if impl in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    return name


def attach(model: nn.Module,
           callbacks: dict[str, Callable[[str, torch.Tensor], torch.Tensor]]) -> Callable[[], None]:
    """Route the key and value states of the attention modules named in ``callbacks``
    (``{name: callback(role, tensor) -> tensor}``) through their callbacks; returns the
    undo (idempotent), which restores every config's attention implementation."""
    if callbacks:  # older transformers run some attention classes around the interface
        require("transformers", "KV-cache calibration")
    modules = attention_modules(model)
    missing = sorted(set(callbacks) - set(modules))
    if missing:
        raise ValueError(f"kv cache: {missing} are not attention modules with k_proj, v_proj "
                         f"or qkv_proj run through transformers' attention interface")
    configs = {id(modules[n].config): modules[n].config for n in callbacks}
    undo: list[Callable[[], None]] = []

    def detach():
        while undo:  # a step that raises stays, for remove() to run again
            undo[-1]()
            undo.pop()
    try:
        with _LOCK:
            taken = sorted(n for n in callbacks if modules[n] in _ACTIVE)
            if taken:
                raise ValueError(f"kv cache: attention {taken[0]!r} is already routed through "
                                 f"quantscope (QDQ still applied, or a calibration running?)")
            # detach runs these last: a config is restored once no module on it is attached
            undo.extend(lambda cfg=cfg: _unroute(cfg) for cfg in configs.values())
            for name, callback in callbacks.items():
                module = modules[name]
                _ACTIVE[module] = callback
                undo.append(lambda module=module: _drop(module))
            for cfg in configs.values():
                _route(cfg)
        for name in callbacks:
            # the user may choose another implementation while routed (transformers'
            # set_attn_implementation): route that one too, before the module runs
            undo.append(modules[name].register_forward_pre_hook(_Reroute()).remove)
    except BaseException:
        detach()
        raise
    return detach


def _drop(module: nn.Module) -> None:
    with _LOCK:
        _ACTIVE.pop(module, None)


class _Reroute:
    """The pre-hook that routes an implementation chosen while attached (an object, not a
    closure: pickling an applied model must reach apply()'s refusal, not fail on it)."""

    def __call__(self, module, args):
        if not _routed(module.config):  # (no lock on the common call: routed already)
            _route(module.config)


def _routed(cfg) -> bool:
    return (cfg._attn_implementation or "").startswith(_PREFIX)


def _route(cfg) -> None:
    """Point ``cfg`` at the routed twin of its implementation, unless it names one already,
    remembering the user's choice for :func:`_unroute`."""
    with _LOCK:
        for key in [k for k, (ref, _) in _CHOSEN.items() if ref() is None]:
            del _CHOSEN[key]  # configs dropped while routed (a QDQ handle never removed)
        impl = cfg._attn_implementation
        if not _routed(cfg):
            _CHOSEN[id(cfg)] = (weakref.ref(cfg), impl)
            cfg._attn_implementation = _register(impl or "eager")
        elif _chosen(cfg) is None:  # routed by no attachment (copied from a routed config):
            _CHOSEN[id(cfg)] = (weakref.ref(cfg), impl[len(_PREFIX):])  # its twin's name


def _chosen(cfg) -> tuple | None:
    entry = _CHOSEN.get(id(cfg))
    return entry if entry is not None and entry[0]() is cfg else None  # (not a dead one's id)


def _unroute(cfg) -> None:
    """The user's last choice back once no attention module on ``cfg`` is attached (another
    model built on it may be), where ``cfg`` is still routed (a choice made since the last
    forward is the user's already)."""
    with _LOCK:
        if any(getattr(m, "config", None) is cfg for m in list(_ACTIVE.keys())):
            return
        entry = _chosen(cfg)
        if entry is None:  # restored already
            return
        del _CHOSEN[id(cfg)]
        if _routed(cfg):
            cfg._attn_implementation = entry[1]
