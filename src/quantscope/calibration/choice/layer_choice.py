"""``auto`` by each layer's output error: the ``"joint"`` and ``"fisher"`` criteria.

* ``"joint"`` (issue 17 item 2a): per Linear, the weight and input candidates are chosen
  *together* by the layer's output error ``||X W^T - Q(X) Q(W)^T||^2`` on the sampled
  calibration inputs (coordinate descent: the weight given min-max inputs, then the input
  given that weight; more ``rounds`` in :func:`joint_choice`). Weights also get an
  importance-weighted MSE candidate
  (:func:`~quantscope.estimators.weighted.imatrix_range`, ``imatrix``).
* ``"fisher"`` (item 2b): the same error with each output feature weighted by the mean
  squared gradient ``g^2`` of the model's loss with respect to it (ModelOpt's
  ``sum g^2 (Y - Yq)^2``): errors in outputs the loss is sensitive to count more.

The session's finish step calls :func:`layer_pick` per layer; the model-level default
(``"model"``) lives in :mod:`.auto`.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import nn

from ..._checks import outside_quantscope
from ...comm import LocalError
from ...estimators.weighted import imatrix_qparams
from ...layout import Tile
from ..results.apply import qdq_tensor
from ..results.result import RoleState
from ..run.batches import (
    eval_mode,
    forward_batch,
    keyword_batch,
    keywords_of,
    map_tensors,
    tensors_in,
)
from ..run.gather import gather_parts
from ..structure.conv1d import is_conv1d, linear_output, transposed_layout
from .loss_checks import batch_error, batch_name, finite, loss_error, none_left_error, scalar
from .score_set import no_token_error, tokens_of

__all__ = ["IMATRIX", "JOINT_ROWS", "LAYER_METRICS", "fisher_weights", "imatrix_state",
           "joint_choice", "layer_pick", "spread_rows"]

#: per-layer criteria computed in the session's finish step through :func:`layer_pick`
LAYER_METRICS = ("joint", "fisher")
#: sampled input rows the joint error uses per layer (its cost: a few matmuls of this many rows),
#: evenly strided over the layer's whole row sample (:func:`spread_rows`)
JOINT_ROWS = 256
IMATRIX = "imatrix"


# ----------------------------------------------------------------------------- fisher
#: the errors of the ``"fisher"`` weights name the metric
_FISHER = "auto (metric 'fisher')"


def fisher_weights(model: nn.Module, batches, layers, loss=None,
                   ignore_non_finite: bool = False, distributed: bool = False,
                   group=None) -> dict[str, torch.Tensor]:
    """Per layer, the mean squared gradient of the loss w.r.t. each output feature.

    ``loss(output, batch) -> scalar tensor``; by default the model's own loss on the batch's
    ``labels``, or without them the inputs as labels (a causal LM's next-token loss; padded
    positions ignored). The gradients are taken w.r.t. the layers' outputs only: no
    parameter's ``.grad`` is written, and on a frozen model (``requires_grad_(False)``) the
    layers' weights require grad for the call only, their flags restored after.

    A loss value that is not finite raises ``ValueError`` naming the batch (NaN / inf in it or
    in the model's output on it, else the loss), as does a gradient that is not: NaN weights
    would make every error NaN. ``ignore_non_finite`` (the ``auto`` roles read NaN / inf as
    zero, ``non_finite="ignore"``): a batch holding NaN / inf, or whose output does, is left
    out of the sums instead, as the ``"model"`` metric leaves it out of its score (none left
    raises). A batch of padding only (its attention mask all 0) has no token to take a loss
    on: it is left out, as ``"model"`` leaves it out (none holding a token raises).
    ``distributed`` (inside the process group ``group``): where the ranks were given
    different batches, every rank's sums are joined, so each gets the mean over all their
    batches (and "none left" counts all of them), one process's; an error on one rank raises
    on every rank (:func:`~..run.gather.gather_parts`).
    """
    batches = list(batches)
    failed, part = LocalError() if distributed else contextlib.nullcontext(), None
    with failed:
        part = _fisher_sums(model, batches, layers, loss, ignore_non_finite)
    if distributed:  # (CPU copies: another rank's CUDA tensors would unpickle on its device)
        every = gather_parts(lambda: _on_cpu(part), batches, "auto's fisher weights", group,
                             failed.error)
        part = part if every is None else _joined(model, every)
    sums, counts, (seen, real, used) = part
    if seen and not real:
        raise no_token_error(_FISHER)
    if real and not used:
        raise none_left_error(_FISHER, real, "take the loss's gradients on")
    return {n: s / counts[n] for n, s in sums.items() if s is not None}


def _fisher_sums(model, batches, layers, loss, ignore_non_finite):
    """:func:`fisher_weights`' sums on this process's ``batches``: ``({layer: sum of g^2 over
    its output rows, None where none}, {layer: rows}, (batches seen, of them holding a real
    token, used))``."""
    mods = {name: model.get_submodule(name) for name in layers}
    sums = {name: None for name in mods}
    counts = dict.fromkeys(mods, 0)
    caught: list[tuple[str, torch.Tensor]] = []  # this batch's (layer, output)

    def hook_for(name):
        def fwd(module, args, out):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                caught.append((name, out))
        return fwd

    # the outputs need a graph to the loss; the users' frozen weights are thawed meanwhile
    frozen = [p for m in mods.values() for p in m.parameters(recurse=False)
              if not p.requires_grad and p.is_floating_point()]
    handles = [m.register_forward_hook(hook_for(name)) for name, m in mods.items()]
    seen = real = used = 0
    try:
        for p in frozen:
            p.requires_grad_(True)
        # a graph needs normal mode: calibrate is often called under inference_mode
        with eval_mode(model), torch.inference_mode(False):
            for seen, batch in enumerate(batches, 1):
                if not tokens_of(batch):  # padding only: no position to take a loss on
                    continue
                real += 1
                caught.clear()
                squares = _squared_grads(model, batch, seen - 1, loss, caught,
                                         ignore_non_finite)
                used += squares is not None
                for name, g in squares or ():
                    sums[name] = g.sum(0) if sums[name] is None else sums[name] + g.sum(0)
                    counts[name] += g.shape[0]
    finally:
        caught.clear()
        for h in handles:
            h.remove()
        for p in frozen:
            p.requires_grad_(False)
    return sums, counts, (seen, real, used)


def _on_cpu(part):
    """:func:`_fisher_sums`' result with its sums on the CPU."""
    sums, counts, tallies = part
    return {n: None if s is None else s.cpu() for n, s in sums.items()}, counts, tallies


def _joined(model, every):
    """Every rank's :func:`_fisher_sums` (on the CPU) added up, each layer's sum on the
    device of its weight (where this rank's would be)."""
    sums, counts = {}, {}
    tallies = tuple(map(sum, zip(*(part[2] for part in every))))
    for part_sums, part_counts, _ in every:
        for n, s in part_sums.items():
            counts[n] = counts.get(n, 0) + part_counts[n]
            if s is not None:
                sums[n] = s if sums.get(n) is None else sums[n] + s
    device = {n: model.get_submodule(n).weight.device for n in sums}
    return {n: s.to(device[n]) for n, s in sums.items()}, counts, tallies


def _squared_grads(model, batch, k, loss, caught, ignore_non_finite):
    """``[(layer, g^2 rows)]`` of batch ``k`` (its forward fills ``caught`` with the layers'
    outputs), or None where ``ignore_non_finite`` leaves the batch out (:func:`fisher_weights`
    says which, and what raises)."""
    with torch.enable_grad():
        out, value = _loss_of(model, _saveable(batch), loss, k)
        # a vector or a number: refused naming the loss, not autograd's bare error
        d = scalar(_FISHER, "Auto.loss" if loss is not None else "the model's own loss",
                   value, f" on batch {k} (counting from 0)", graph=True)
        clean = finite(batch) and finite(_output_alone(out), logits=True)
        if ignore_non_finite and not clean:
            return None
        if not math.isfinite(d):
            raise batch_error(_FISHER, batch_name(k)) if not clean else _loss_error(k, d, loss)
        grads = torch.autograd.grad(value, [o for _, o in caught],
                                    allow_unused=True) if caught else ()
    out = []
    for (name, _), g in zip(caught, grads):
        if g is None:
            continue
        g = g.detach().float().reshape(-1, g.shape[-1]).square()
        if not bool(torch.isfinite(g).all()):  # NaN weights: every error NaN
            raise ValueError(f"{_FISHER}: the squared gradient of the loss w.r.t. layer "
                             f"{name!r}'s output is not finite on batch {k} (counting from 0), "
                             f"where the batch, the model's output and the loss are finite; "
                             f"the loss cannot weigh that layer's errors")
        out.append((name, g))
    return out


def _output_alone(out):
    """The model output ``out`` without its ``loss`` (judged as the loss, not the output)."""
    if isinstance(out, Mapping) and "loss" in out:
        return [v for key, v in out.items() if key != "loss"]
    return out


def _loss_error(k: int, value: float, loss) -> ValueError:
    """The error of a non-finite loss on batch ``k`` where the batch and the output are finite:
    ``Auto.loss``'s, or the model's own (the default)."""
    if loss is not None:
        return loss_error(_FISHER, "Auto.loss", batch_name(k), value, "the model's output is")
    return ValueError(f"{_FISHER}: the model's own loss (the default: no Auto.loss) returned "
                      f"{value} on batch {k} (counting from 0), where the model's output is "
                      f"finite (a batch without one labelled token?); pass "
                      f"Auto.loss=callable(output, batch) returning a finite scalar")


def _saveable(batch):
    """``batch`` with its inference tensors (made under ``inference_mode``) cloned, its type
    kept for the loss: autograd cannot save those for backward. Without any, the batch."""
    if not any(t.is_inference() for t in tensors_in(batch)):
        return batch
    return map_tensors(lambda t: t.clone() if t.is_inference() else t, batch,
                       keyword_batch(batch))


def _loss_of(model, batch, loss, k):
    """``(output, loss)``: the model's output on ``batch`` (batch ``k``) and the scalar loss
    :func:`fisher_weights` differentiates."""
    if loss is not None:
        out = forward_batch(model, batch)
        return out, loss(out, batch)
    default = ("the default loss (no Auto.loss: the model's own, labelled by the batch's "
               "'labels', else its 'input_ids')")
    fix = "; pass Auto.loss=callable(output, batch) returning a scalar tensor"
    if not keyword_batch(batch):
        raise ValueError(f"{_FISHER}: {default} needs dict batches, got a "
                         f"{type(batch).__name__} as batch {k} (counting from 0){fix}")
    batch = keywords_of(batch)  # (``in`` and ``get`` on what only has ``keys()`` and ``[]``)
    if "labels" not in batch and "input_ids" not in batch:
        raise ValueError(f"{_FISHER}: {default} needs 'labels' or 'input_ids' in the batch; "
                         f"batch {k} (counting from 0) has {sorted(map(str, batch.keys()))}"
                         f"{fix}")
    out = forward_batch(model, {**batch, "labels": _labels(batch)})  # (its caches copied)
    value = getattr(out, "loss", None)
    if value is None:
        raise ValueError(f"{_FISHER}: the model returns no loss on batch {k} (counting from "
                         f"0), which {default} takes{fix}")
    return out, value


def _labels(batch) -> torch.Tensor:
    """The default loss's labels: the batch's own (a data collator's), else its input ids
    with padding left out."""
    if "labels" in batch:
        return batch["labels"]
    labels = batch["input_ids"].clone()
    if "attention_mask" in batch:
        labels[batch["attention_mask"] == 0] = -100
    return labels


# ----------------------------------------------------------------------------- joint choice
def imatrix_state(w: torch.Tensor, importance: torch.Tensor, base: RoleState,
                  conv1d: bool = False) -> RoleState:
    """The weight state of the importance-weighted MSE search under ``base``'s spec
    (``importance``: the mean ``x^2`` of each input channel), with the qparams the search
    priced (:func:`~quantscope.estimators.weighted.imatrix_qparams`). ``conv1d``: ``w`` is a
    Conv1D's ``[in, out]``, searched as the Linear ``w.T`` under the layout transposed back
    (the same units in the same order; not tiles, whose order transposes)."""
    spec, shape = base.spec, tuple(w.shape)
    if conv1d:
        if isinstance(spec.layout, Tile):
            raise ValueError("imatrix: a Conv1D's weight tiles are not searched")
        w, spec = w.T, replace(spec, layout=transposed_layout(spec.layout))
    lo, hi, qp = imatrix_qparams(w, importance, spec)
    return replace(base, observer=IMATRIX, qparams=qp.reshape(base.spec.layout.qparam_shape(
        shape)), lo=lo, hi=hi)


def joint_choice(x: torch.Tensor, w: torch.Tensor, w_states: list[RoleState],
                 x_states: list[RoleState], out_weights: torch.Tensor | None = None,
                 rounds: int = 1) -> tuple[int, int, float]:
    """``(i, j, error)``: the weight state ``i`` and input state ``j`` with the lowest
    ``sum_o c_o ||X W^T - Q_j(X) Q_i(W)^T||_o^2`` found by coordinate descent (start: the
    first of each list, min-max by convention). Exhaustive when either list has one entry."""
    i, j, err = _descent(x, w, w_states, x_states, out_weights, rounds)
    return i, j, err(i, j)


def _descent(x, w, w_states, x_states, out_weights, rounds, conv1d=False, who="joint_choice"):
    """:func:`joint_choice`'s ``(i, j, err)``, ``err(a, b)`` the cached error of a pair (the
    last step priced every input under weight ``i``: a fusion group sums those). ``conv1d``:
    ``w`` is a Conv1D's ``W^T`` (``[in, out]``), quantized as held, output ``x @ w``. A NaN
    error raises ``ValueError`` (``who`` says whose): ``min`` would keep the first candidate."""
    x, w = x.float(), w.float()
    ref = linear_output(x, w, conv1d)
    wq = [None] * len(w_states)
    xq = [None] * len(x_states)
    cache = {}

    def err(i, j):
        if (i, j) not in cache:
            if wq[i] is None:
                wq[i] = qdq_tensor(w, w_states[i]).float()
            if xq[j] is None:
                xq[j] = qdq_tensor(x, x_states[j]).float()
            e = (linear_output(xq[j], wq[i], conv1d) - ref).square()
            if out_weights is not None:
                e = e * out_weights
            cache[(i, j)] = float(e.double().sum())
            if math.isnan(cache[(i, j)]):
                raise ValueError(f"{who}: the output error of weight candidate "
                                 f"{w_states[i].observer!r} with input candidate "
                                 f"{x_states[j].observer!r} is NaN: no candidate can be "
                                 f"chosen by it")
        return cache[(i, j)]

    i, j = 0, 0
    for _ in range(max(1, rounds)):
        i = min(range(len(w_states)), key=lambda a: (err(a, j), a))
        j = min(range(len(x_states)), key=lambda b: (err(i, b), b))
    return i, j, err


def layer_pick(layer, plan, slots, data, state_of, fisher=None):
    """For the session: the ``{"weight": state, "input": state}`` :func:`joint_choice` picks
    among ``layer``'s candidate observers (plus the ``imatrix`` weight search), with
    ``"input_errors"``: ``{state key: error}`` of every input candidate under the picked
    weight (a fusion group's one input is the least total over its members). A run-time
    input (``dynamic=True``: per token) has no candidates: the weight alone is chosen, priced
    against the input's run-time QDQ (``"input"`` None). None where the layer has no static
    2-D weight and input sample: a weight-only recipe samples no input, so its weights fall
    back to their own error (metric ``"tensor"``), said once per calibration."""
    if (layer, "weight") not in plan:
        return None
    wcfg, wnames = plan[(layer, "weight")]
    w = slots[(layer, "weight")].module.weight.detach()
    conv1d = is_conv1d(slots[(layer, "weight")].module)  # w: [in, out]
    x = data.get((layer, "input")) if (layer, "input") in plan else None
    if wcfg.dynamic is not False or w.dim() != 2:
        return None
    if x is None:
        if len(wnames) > 1:
            _say_fallback(slots, "joint" if fisher is None else "fisher", layer, plan)
        return None
    if x.shape[-1] != w.shape[0 if conv1d else 1]:
        return None
    xcfg, xnames = plan[(layer, "input")]
    ws = [st for _, st in _states(layer, slots, state_of, "weight", wcfg, wnames,
                                  tuple(w.shape))]
    if xcfg.dynamic is True:  # its one run-time state, as apply() runs it (no key: no choice)
        keyed = [(None, RoleState(xcfg.spec, xcfg.observer, xcfg.observer, True,
                                  xcfg.options))]
    else:
        keyed = _states(layer, slots, state_of, "input", xcfg, xnames, None)
    xkeys, xs = [k for k, _ in keyed], [st for _, st in keyed]
    if not ws or not xs:
        return None
    if len(wnames) > 1:
        try:
            ws.append(imatrix_state(w, x.float().square().mean(0), ws[0], conv1d))
        except ValueError:  # a layout the weighted search cannot take: not a candidate
            pass
    c = None if fisher is None else fisher.get(layer)
    metric = "joint" if fisher is None else "fisher"
    i, j, err = _descent(spread_rows(x, JOINT_ROWS), w, ws, xs, c, 1, conv1d,
                         f"calibrate: auto metric {metric!r}, layer {layer!r}")
    return {"weight": ws[i], "input": None if xcfg.dynamic is True else xs[j],
            "input_errors": {k: err(i, b) for b, k in enumerate(xkeys) if k is not None}}


def spread_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` rows of the row sample ``x`` evenly strided over all of it (``x`` where it has no
    more). The sample holds its batches' rows in batch order, each batch's a random draw of
    its rows (:class:`~quantscope.calibration.run.samples.RowSample`): its first ``n`` rows
    would be the first batch's alone; strided, every batch keeps its share. Deterministic."""
    if x.shape[0] <= n:
        return x
    return x.index_select(0, torch.arange(n, device=x.device) * x.shape[0] // n)


def _states(layer, slots, state_of, role, cfg, names, shape):
    """``[(state key, state)]`` of ``layer``'s ``role`` candidates, min-max first: the
    descent starts from it, ties keep it."""
    from ..run.observe import observer_key as _observer_key

    slot, out = slots[(layer, role)], []
    for n in names:
        okey = _observer_key(n, cfg)
        if okey in slot.observers:
            skey = (layer, role, okey, cfg.dynamic)
            out.append((skey, state_of(slot.observers[okey], cfg, skey, shape)))
    return sorted(out, key=lambda ks: not ks[1].observer.endswith("minmax"))


#: per calibration (its first slot, alive while it runs), whether the fallback was said
_SAID = weakref.WeakValueDictionary()


def _say_fallback(slots, metric: str, layer: str, plan) -> None:
    """Warn, once per calibration, that ``metric`` chose ``layer``'s weight (and the other
    layers without an input sample) by the weight's own error."""
    first = next(iter(slots.values()))
    if _SAID.get(id(first)) is first:
        return
    _SAID[id(first)] = first
    why = ("the recipe quantizes no input of it (weight-only): no input is sampled"
           if (layer, "input") not in plan else "its input saw no tokens")
    warnings.warn(f"calibrate: auto metric {metric!r} prices a weight by the layer's output "
                  f"error on sampled inputs; layer {layer!r} has none ({why}), so its weight "
                  f"(and any other such layer's) is chosen by its own error, as metric "
                  f"'tensor' does", stacklevel=outside_quantscope())
