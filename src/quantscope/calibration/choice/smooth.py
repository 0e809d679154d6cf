"""SmoothQuant: move the activations' per-channel outliers into the next layers' weights.

A static per-tensor activation range must cover every channel of every token. In LLMs a
few input channels carry outliers hundreds of times the rest (SmolLM2-135M's MLP
down-projection inputs reach 2,379 where most values are below 1), so one scale either
clips them or rounds everything else to a few levels; no choice of range fixes that
(docs/benchmarks.md, "auto by end-to-end effect"). SmoothQuant (Xiao et al., 2023)
divides each input channel ``j`` by ``s_j`` where the activation is produced and
multiplies column ``j`` of the next weights by the same ``s_j``: the model computes the
same function, the activation's channels are flatter, the weights (quantized per output
channel) take the difference.

The scales are llm-compressor's ``SmoothQuantModifier``'s, so a recipe moves over with the
same ``smoothing_strength``:

    s_j = range_j ** alpha / (2 max_i |W_ij|) ** (1 - alpha),  at least 1e-5

with ``range_j = max - min`` of channel ``j`` of the balanced layers' input over the
batches given, and ``max_i |W_ij|`` over all the balanced layers' rows (``range_j`` where
that column is all zero).

What may be smoothed (:data:`MAPPINGS`): a decoder layer's ``input_layernorm`` into its
``q_proj`` / ``k_proj`` / ``v_proj``, its ``post_attention_layernorm`` into ``gate_proj`` /
``up_proj`` (llm-compressor's default mappings; its per-architecture ones under the names
Phi-3, BLOOM, DeepSeek-V2/3, Whisper and OPT use), and a gated MLP's ``up_proj`` into its
``down_proj`` (``down(act(gate(x)) * up(x))`` is linear in ``up``'s output; the mapping
AWQ uses, and the one SmolLM2 needs most). Names match by suffix only, so each mapping
found is checked twice before the model is touched. Its data flow, by hooks in the forward
that measures the ranges: every balanced Linear must read exactly the previous module's
output (the same tensor, or one bit for bit equal) and no other Linear may read it, so a
norm that also feeds the MLP (Cohere's and Phi's parallel blocks) or whose output is not the
MLP's input (OLMo2's post-norm ``post_attention_layernorm``) is left alone. And a probe (run
with the model's forward hooks set aside: a user's see only real batches): the balanced
layers' outputs of a random input must stay the same (to float rounding) with the new
parameters, so a norm that is not ``x * weight (+ bias)`` (Gemma's ``x * (1 + weight)``)
or an MLP that is not gated is left alone, not broken. And no parameter a mapping scales may
share memory with another module's (a tied Parameter, one over the same memory, an
overlapping slice): that module would change too, or, another mapping's, be scaled twice;
the probe and the data flow see modules, not memory. ``info["why"]`` says why each skipped
mapping was.

:func:`smooth` changes the model's parameters in place, as llm-compressor does: calibrate,
apply, evaluate and export that same model object. A calibration made with ``smooth=``
belongs to the smoothed weights and keeps their scales (``Calibration.smoothing``, saved
beside its qparams; ``info["smooth"]`` names the alpha and the modules): :func:`reapply`
smooths a freshly loaded copy of the float model alike, as ``quantscope evaluate`` and
``quantscope export`` do.
"""

from __future__ import annotations

import numbers
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from ..._checks import outside_quantscope
from ..run.batches import check_batches
from ..structure.tied import holders, memory, sharers
from .smooth_ranges import channel_ranges

__all__ = ["MAPPINGS", "MIN_SCALE", "Mapping", "channel_ranges", "check", "find_mappings",
           "reapply", "restore", "smooth", "smoothing_scales"]

#: ``(previous module, balanced Linears)`` as name suffixes within one decoder layer: the
#: pairs of llm-compressor's SmoothQuant mappings (its ``MAPPINGS_REGISTRY``) that balance a
#: norm's whole output, matched by the names each architecture uses, then AWQ's up -> down.
#: A model holds at most one of a norm's alternatives (each needs all its Linears).
MAPPINGS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("input_layernorm", ("self_attn.qkv_proj",)),  # Phi-3
    ("input_layernorm", ("self_attention.query_key_value",)),  # BLOOM
    ("input_layernorm", ("self_attn.q_proj", "self_attn.kv_a_proj_with_mqa")),  # DeepSeek-V2/3
    ("input_layernorm", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")),
    ("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("post_attention_layernorm", ("mlp.gate_up_proj",)),  # Phi-3
    ("post_attention_layernorm", ("mlp.dense_h_to_4h",)),  # BLOOM
    ("final_layer_norm", ("fc1",)),  # Whisper, OPT (self_attn_layer_norm above too)
    ("mlp.up_proj", ("mlp.down_proj",)),
)

#: llm-compressor's ``MINIMUM_SMOOTHING_SCALE``
MIN_SCALE = 1e-5

#: rows of the random probe each mapping is checked on
_PROBE_ROWS = 8


@dataclass
class Mapping:
    """One smoothable pair: ``previous`` produces the input of every Linear in ``balance``
    (``parent`` contains both; it is run on the probe when ``previous`` is a Linear;
    ``prefix``: the names' common part before :data:`MAPPINGS`' suffixes)."""

    previous: str
    balance: tuple[str, ...]
    parent: str
    prefix: str = ""


def find_mappings(model: nn.Module) -> list[Mapping]:
    """The :data:`MAPPINGS` present in ``model`` whose shapes fit (checked on a probe only
    by :func:`smooth`), kind by kind in :data:`MAPPINGS`' order."""
    modules = dict(model.named_modules())
    found = []
    for prev, balance in MAPPINGS:  # in data-flow order: up_proj's columns before its rows
        for name, module in modules.items():
            if not (name == prev or name.endswith("." + prev)):
                continue
            prefix = name[: len(name) - len(prev)]
            lins = [modules.get(prefix + b) for b in balance]
            if not all(isinstance(m, nn.Linear) for m in lins):
                continue
            width = _width(module)
            if width is None or any(m.in_features != width for m in lins):
                continue
            parent = name
            if isinstance(module, nn.Linear):  # up_proj -> down_proj: their MLP runs the probe
                parent = (prefix + balance[0]).rsplit(".", 1)[0]
                if name.rsplit(".", 1)[0] != parent:
                    continue
            found.append(Mapping(name, tuple(prefix + b for b in balance), parent, prefix))
    return found


def _width(module: nn.Module) -> int | None:
    """Channels ``module`` outputs, if its parameters scale them one by one: a Linear's
    rows, a norm's ``weight [C]``."""
    if isinstance(module, nn.Linear):
        return module.out_features
    w = getattr(module, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 1:
        return w.shape[0]
    return None


def smoothing_scales(ranges: torch.Tensor, weights: list[torch.Tensor],
                     alpha: float) -> torch.Tensor:
    """llm-compressor's SmoothQuant scales (module doc) of channels with activation
    ``ranges [C]`` feeding ``weights`` (each ``[out, C]``), float32."""
    w = 2.0 * torch.stack([x.detach().abs().amax(0).float() for x in weights]).amax(0)
    s = ranges.float().pow(alpha) / w.pow(1.0 - alpha)
    return torch.where(w > 0, s, ranges.float()).clamp(min=MIN_SCALE)


def _written(modules: dict[str, nn.Module], m: Mapping) -> list[tuple[str, str]]:
    """``(module, parameter)`` names of every parameter the mapping scales: the previous
    module's weight and bias (by row), each balanced Linear's weight (by column)."""
    width = modules[m.balance[0]].in_features
    rows = [(m.previous, n) for n, p in modules[m.previous].named_parameters(recurse=False)
            if n in ("weight", "bias") and p.dim() and p.shape[0] == width]
    return rows + [(b, "weight") for b in m.balance]


def _new_params(modules: dict[str, nn.Module], m: Mapping,
                s: torch.Tensor) -> dict[str, torch.Tensor]:
    """Fully qualified name -> smoothed value of every parameter the mapping changes
    (``modules``: the model's, by name)."""
    new = {}
    for owner, pname in _written(modules, m):
        p = getattr(modules[owner], pname)
        t = s.to(p)
        new[f"{owner}.{pname}"] = (p / (t if p.dim() == 1 else t[:, None])
                                   if owner == m.previous else p * t[None, :])
    return new


def _shared_why(modules: dict[str, nn.Module], m: Mapping, found: dict) -> str | None:
    """Why the mapping cannot be written, None if it can: a parameter it scales shares memory
    (:func:`~..structure.tied.sharers`; ``found``: the model's holders) with a place outside
    it, whose function would change too (a tied Parameter of another layer or mapping), or
    with another one of its own but for another value (written twice). Two balanced weights
    over one memory (:func:`~..structure.tied.memory`) get one value; and the same module
    under a second name is no other place."""
    written = _written(modules, m)
    mine = {f"{a}.{b}": getattr(modules[a], b) for a, b in written}
    cols = {f"{a}.{b}" for a, b in written if a != m.previous}
    for owner, pname in written:
        k = f"{owner}.{pname}"
        for other in sharers(found, modules[owner], pname):
            if other not in mine:
                return (f"{k} shares memory with {other} (tied), which is outside this "
                        f"mapping: smoothing would change it too")
            if not ({k, other} <= cols and memory(mine[other]) == memory(mine[k])):
                return (f"{k} shares memory with {other}, which this mapping scales "
                        f"otherwise: smoothing would write it twice")
    return None


def _probe_why(modules: dict[str, nn.Module], m: Mapping,
               new: dict[str, torch.Tensor]) -> str | None:
    """Why the probe rejects ``new``, None if it holds: the balanced Linears' outputs of a
    random input must be the same with ``new`` (the previous module as a norm:
    ``linear(norm(x))``; as a Linear: its parent, e.g. the MLP, whole)."""
    prev = modules[m.previous]
    p0 = next(prev.parameters())
    gen = torch.Generator(device="cpu").manual_seed(0)
    if isinstance(prev, nn.Linear):
        parent = modules[m.parent]
        x = torch.randn(_PROBE_ROWS, prev.in_features, generator=gen).to(p0)
        local = {k[len(m.parent) + 1:]: v for k, v in new.items()}
        try:
            with _hooks_aside(parent):
                before, after = parent(x), functional_call(parent, local, (x,))
        except (TypeError, RuntimeError, ValueError) as e:  # not a module run on one tensor
            return (f"the probe could not run {m.parent} on one [{_PROBE_ROWS}, "
                    f"{prev.in_features}] tensor ({type(e).__name__}: {e})")
        pairs = [(before, after)]
    else:
        x = torch.randn(_PROBE_ROWS, _width(prev), generator=gen).to(p0)
        local = {k[len(m.previous) + 1:]: v for k, v in new.items() if k.startswith(
            m.previous + ".") and k[len(m.previous) + 1:] in ("weight", "bias")}
        with _hooks_aside(prev):
            y0, y1 = prev(x), functional_call(prev, local, (x,))
        pairs = [(torch.nn.functional.linear(y0, modules[b].weight, modules[b].bias),
                  torch.nn.functional.linear(y1, new[f"{b}.weight"], modules[b].bias))
                 for b in m.balance]
    for a, b in pairs:
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"the probe's run of {m.parent} returned {type(a).__name__}, not a tensor"
        tol = 1e-3 if a.dtype == torch.float32 else 2e-2
        if (a.shape != b.shape or not bool(torch.isfinite(b).all())
                or float((a.float() - b.float()).norm()) > tol * max(float(a.float().norm()),
                                                                      1e-12)):
            return "the probe's outputs changed with the new parameters"
    return None


@contextmanager
def _hooks_aside(module: nn.Module):
    """Run the probe without the forward hooks and pre-hooks of ``module`` and its submodules
    (a user's, e.g. a logger: quantscope's own are off the model while :func:`smooth` runs):
    they were written for the model's batches, not the probe's random 2-D rows. The same
    dicts are put back. torch's global hooks stay: swapping process-wide state would hide
    them from another thread's model."""
    kept = [(m, m._forward_hooks, m._forward_pre_hooks) for m in module.modules()]
    try:
        for m, _, _ in kept:
            m._forward_hooks, m._forward_pre_hooks = OrderedDict(), OrderedDict()
        yield
    finally:
        for m, post, pre in kept:
            m._forward_hooks, m._forward_pre_hooks = post, pre


def check(alpha, sequential: bool = False) -> float | None:
    """``alpha`` as a Python float (None stays None); raises unless it is a real number in
    ``[0, 1]`` (numpy's too, not a bool) and, with ``sequential``, unless it is None."""
    if alpha is None:
        return None
    if (isinstance(alpha, bool) or not isinstance(alpha, numbers.Real)
            or not 0 <= alpha <= 1):
        raise ValueError(f"smooth: alpha must be a number in [0, 1] (llm-compressor's "
                         f"smoothing_strength), got {alpha!r}")
    if sequential:
        raise ValueError("calibrate: smooth needs the whole model in one forward; it is not "
                         "available with sequential (smooth the model first with "
                         "quantscope.calibration.choice.smooth.smooth)")
    return float(alpha)


@torch.no_grad()
def smooth(model: nn.Module, batches, alpha: float = 0.5, *, distributed: bool = False,
           group=None, originals: dict | None = None) -> dict:
    """Smooth ``model`` in place (module doc) with ranges from ``batches`` (``distributed``:
    every rank's batches, :func:`~.smooth_ranges.channel_ranges`; the session gives the
    first batch of the lowest rank that holds one, on that rank: :mod:`~..run.outliers`);
    returns ``{"alpha", "smoothed": [previous module names], "skipped": [names left as they
    were], "why": {skipped name: reason}, "scales": {name: [C] float32}}``. A mapping is
    skipped when it never ran or saw NaN / inf, when its data flow does not fit
    (:class:`~.smooth_ranges._Flow`), when a parameter it scales shares memory with another
    module's (:func:`_shared_why`) or when the probe rejects it. ``alpha`` in ``[0, 1]``: 0
    leaves the activations, 1 moves all of their range into the weights. ``originals``, a
    dict, receives a CPU copy of every parameter before it is changed, for :func:`restore`."""
    alpha = check(alpha)
    check_batches(batches, "smooth")  # one dict or tensor would run as its keys or rows
    mappings = find_mappings(model)
    if not mappings:  # an option set in vain: said, as keep_float says its own
        warnings.warn("smooth: the model has no pair SmoothQuant smooths (MAPPINGS: a decoder "
                      "layer's input_layernorm into q/k/v_proj, post_attention_layernorm into "
                      "gate/up_proj, up_proj into down_proj, by name); nothing was smoothed",
                      stacklevel=outside_quantscope())
    flow: dict[str, str] = {}
    ranges = (channel_ranges(model, batches, mappings, distributed, group, flow=flow)
              if mappings else {})
    modules, found = dict(model.named_modules()), holders(model)
    done, why, scales = [], {}, {}
    for m in mappings:
        r = ranges.get(m.previous)
        if r is None or not bool(torch.isfinite(r).all()):  # nothing to go by
            why[m.previous] = "never ran" if r is None else "saw NaN or inf"
            continue
        shared = flow.get(m.previous) or _shared_why(modules, m, found)
        if shared is not None:  # scaling it would change what other layers compute
            why[m.previous] = shared
            continue
        s = smoothing_scales(r, [modules[b].weight for b in m.balance], alpha)
        new = _new_params(modules, m, s)
        rejected = _probe_why(modules, m, new)
        if rejected is not None:
            why[m.previous] = rejected
            continue
        if originals is not None:
            for k in new:
                originals.setdefault(k, model.get_parameter(k).detach().to("cpu", copy=True))
        _write(modules, new)
        done.append(m.previous)
        scales[m.previous] = s.cpu()
    if mappings and not ranges:  # no rank ran a batch: said, as a model with no pair is
        warnings.warn("smooth: no layer it smooths saw a batch (is batches empty?); "
                      "nothing was smoothed", stacklevel=outside_quantscope())
    return {"alpha": float(alpha), "smoothed": done, "skipped": list(why), "why": why,
            "scales": scales}


@torch.no_grad()
def reapply(model: nn.Module, calibration) -> None:
    """Smooth a fresh copy of the float model as :func:`smooth` smoothed the one
    ``calibration`` was made on (its ``smoothing`` scales; nothing if it has none). Raises,
    before any write, where a scale does not fit or its parameters share memory here
    (:func:`_shared_why`)."""
    scales = calibration.smoothing
    mappings = find_mappings(model)  # in smooth's order (a saved dict's may differ)
    modules = dict(model.named_modules())
    unknown = sorted(set(scales) - {m.previous for m in mappings})
    if unknown:
        raise ValueError(f"smooth: the calibration smoothed {unknown[0]!r}, which this model "
                         f"does not have as a smoothable module")
    todo, found = [m for m in mappings if m.previous in scales], holders(model)
    for m in todo:  # every check before the first write: a refusal leaves the model as it was
        shape = tuple(torch.as_tensor(scales[m.previous]).shape)
        channels = modules[m.balance[0]].weight.shape[1]
        if shape != (channels,):
            raise ValueError(f"smooth: the calibration's scale for {m.previous!r} has shape "
                             f"{shape}; this model's {m.balance[0]} takes {channels} channels")
        shared = _shared_why(modules, m, found)
        if shared is not None:
            raise ValueError(f"smooth: the calibration smoothed {m.previous!r}, but in this "
                             f"model {shared}; untie it (.clone()) or calibrate this model")
    for m in todo:
        _write(modules, _new_params(modules, m, torch.as_tensor(scales[m.previous])))


@torch.no_grad()
def restore(model: nn.Module, originals: dict[str, torch.Tensor]) -> None:
    """Undo :func:`smooth` exactly: each parameter back to its value in ``originals``."""
    for k, v in originals.items():
        model.get_parameter(k).copy_(v)


def _write(modules: dict[str, nn.Module], new: dict[str, torch.Tensor]) -> None:
    for k, v in new.items():
        owner, _, pname = k.rpartition(".")
        getattr(modules[owner], pname).copy_(v)
    # inside torch.autocast, the ranges forward cached casts of the old weights, which the
    # probe and every later forward of the region would read
    torch.clear_autocast_cache()
