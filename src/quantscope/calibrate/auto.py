"""``auto`` by end-to-end effect: choose ranges by what they do to the layer's or model's output.

Three criteria, from local to global (``calibrate(..., auto_metric=...)``):

* ``"joint"`` (item a): per Linear, the weight and input candidates are chosen *together*
  by the layer's output error ``||X W^T - Q(X) Q(W)^T||^2`` on the sampled calibration
  inputs (coordinate descent: the weight given min-max inputs, then the input given that
  weight; more ``rounds`` in :func:`joint_choice`). Weights also get an importance-weighted MSE candidate
  (:func:`~quantscope.estimators.weighted.imatrix_range`, ``imatrix``).
* ``"fisher"`` (item b): the same error with each output feature weighted by the mean
  squared gradient ``g^2`` of the model's loss with respect to it (ModelOpt's
  ``sum g^2 (Y - Yq)^2``): errors in outputs the loss is sensitive to count more.
* ``"model"`` (the default ``auto``): every candidate observer is calibrated in the same
  pass; each whole-model configuration is scored by the divergence of the model's output
  from the float model's on a few calibration documents (:class:`OutputDivergence`), piece
  by piece, candidates far behind dropped early (:func:`choose`), and the best is kept.
  Min-max is always among them, so on the scoring pieces min-max was scored on, ``auto`` is
  never worse than min-max. See the README for why this is the default (measured on both
  demo models).

Per-layer criteria cannot see that an outlier one layer clips costs more downstream than a
coarse step everywhere; the model-level score does, at the price of one forward of the
scoring documents per candidate (fewer for those dropped early).
"""

from __future__ import annotations

import math
import types
from dataclasses import replace

import torch
from torch import nn

from ..estimators.weighted import imatrix_range
from ..qparams import qparams_from_range
from .apply import apply, qdq_tensor
from .batches import forward_batch
from .recipe import AUTO, Recipe
from .result import Calibration, RoleState

__all__ = [
    "LAYER_METRICS",
    "OutputDivergence",
    "calibrate_end_to_end",
    "fisher_weights",
    "imatrix_state",
    "joint_choice",
]

#: per-layer criteria computed in the session's ``_finish`` through :func:`joint_choice`
LAYER_METRICS = ("joint", "fisher")
#: sampled input rows the joint error uses per layer (its cost: a few matmuls of this many rows)
JOINT_ROWS = 256
IMATRIX = "imatrix"
#: ``auto_metric="model"`` scores each configuration piece by piece (the first piece this
#: share of the scoring documents), dropping after each piece the candidates this many times
#: worse than the best so far (:func:`choose`)
FIRST_PIECE = 0.25
DROP_FACTOR = 1.5


# ----------------------------------------------------------------------------- model output


def _mask(batch):
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        return batch.get("attention_mask")
    return None


def _summary(out, batch):
    """What a divergence compares, from a model output: next-token log-probabilities of the
    real positions (causal LM), mean-pooled normalised embeddings (encoder), or the tensor."""
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, dict):
        logits = out.get("logits")
    mask = _mask(batch)
    if logits is not None:
        logits = logits.float()
        if mask is not None:
            keep = mask.bool()
            if logits.dim() == 3 and keep.shape == logits.shape[:2]:
                return ("kl", torch.log_softmax(logits[keep], -1))
        return ("kl", torch.log_softmax(logits.reshape(-1, logits.shape[-1]), -1))
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None:
        hidden = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"auto: cannot compare model outputs of type {type(out).__name__}; "
                         f"pass loss=callable(output, reference_output, batch)")
    hidden = hidden.float()
    if hidden.dim() == 3:
        m = (torch.ones(hidden.shape[:2], device=hidden.device) if mask is None
             else mask.to(hidden.dtype))
        hidden = (hidden * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp(min=1)
    return ("cos", torch.nn.functional.normalize(hidden.reshape(hidden.shape[0], -1), dim=-1))


def _divergence(kind, q, ref):
    if kind == "kl":  # KL(p_ref || p_q), mean over positions
        return float((ref.exp() * (ref - q)).sum(-1).mean())
    return float((1 - (q * ref).sum(-1)).mean())


class OutputDivergence:
    """How far a (quantized) model's output is from the float model's on ``batches``.

    The float outputs are computed once, at construction (``references``: those already
    known, as :func:`_summary` gives them, None where not). ``loss(output, reference_output,
    batch) -> float`` replaces the default: KL divergence of the next-token distributions
    for a model with ``logits`` (causal LM), ``1 - cosine`` of the mean-pooled embeddings
    otherwise. Each call runs one forward per batch (under ``inference_mode``).
    """

    def __init__(self, model: nn.Module, batches, loss=None, references=None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"OutputDivergence: model must be an nn.Module, got "
                            f"{type(model).__name__}")
        self.model, self.batches, self.loss = model, list(batches), loss
        if not self.batches:
            raise ValueError("OutputDivergence: batches is empty: need at least one batch to "
                             "compare the model's outputs on")
        if loss is not None and not callable(loss):
            raise TypeError("OutputDivergence: loss must be callable(output, reference, batch)")
        # float outputs already at hand (e.g. caught in the calibration pass) are not recomputed
        known = list(references or [None] * len(self.batches))
        self.references = [self._run(b) if r is None else r for b, r in zip(self.batches, known)]
        self.forwards = sum(r is None for r in known)

    def _run(self, batch):
        was = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                out = forward_batch(self.model, batch)
        finally:
            self.model.train(was)
        return out if self.loss is not None else _summary(out, batch)

    def on(self, k: int) -> float:
        """The divergence of the model as it is now on batch ``k`` alone (one forward)."""
        batch, ref = self.batches[k], self.references[k]
        out = self._run(batch)
        d = (float(self.loss(out, ref, batch)) if self.loss is not None
             else _divergence(out[0], out[1], ref[1]))
        if not math.isfinite(d):
            raise ValueError(f"auto: the output divergence is {d} (non-finite output of the "
                             f"quantized model?)")
        self.forwards += 1
        return d

    def __call__(self) -> float:
        """The mean divergence of the model as it is now (e.g. under QDQ) over the batches."""
        return sum(self.on(k) for k in range(len(self.batches))) / len(self.batches)

    def of(self, states, k: int | None = None) -> float:
        """The divergence with ``states`` (``{layer: {role: RoleState}}``) applied: over all
        batches, or on batch ``k`` alone."""
        with apply(self.model, states):
            return self() if k is None else self.on(k)


def _rows(batch) -> int | None:
    mask = _mask(batch)
    return None if mask is None or mask.dim() != 2 else mask.shape[0]


def _take_rows(batch, start: int, stop: int):
    """Rows ``start:stop`` of a dict batch (every tensor whose first dimension is the rows)."""
    n = _rows(batch)
    return {k: (v[start:stop] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n
                else v) for k, v in batch.items()}


def _tokens(b) -> int:
    mask = _mask(b)
    if mask is not None:
        return int(mask.sum())
    t = b if isinstance(b, torch.Tensor) else (b[0] if isinstance(b, (tuple, list)) else None)
    return t.shape[:-1].numel() if isinstance(t, torch.Tensor) and t.dim() > 1 else 1


def score_batches(batches, tokens: int):
    """The first calibration batches holding at least ``tokens`` real tokens (at least one);
    the last one cut to the rows (documents) needed where it is a dict with a mask."""
    out, n = [], 0
    for b in batches:
        need = tokens - n
        rows = _rows(b)
        if rows is not None and rows > 1 and _tokens(b) > need:
            per_row = _mask(b).sum(-1).tolist()
            k = next(i for i in range(1, rows + 1) if sum(per_row[:i]) >= need)
            b = _take_rows(b, 0, k)
        out.append(b)
        n += _tokens(b)
        if n >= tokens:
            break
    return out


def score_plan(batches, tokens: int, first: float = FIRST_PIECE):
    """Where the scoring pieces come from: ``[(batch index, rows start, rows stop)]``. The
    scoring set is the first calibration documents holding ``tokens`` real tokens
    (:func:`score_batches`); its first dict batch is cut by rows in two pieces, the first
    ``first`` of its rows (at least one), so that the early round that drops the far-off
    candidates (:func:`choose`) is cheap; any further batch is one more piece."""
    out = score_batches(batches, tokens)
    plan = [(i, 0, _rows(b)) for i, b in enumerate(out)]
    rows = _rows(out[0])
    if rows is None or rows < 2:
        return plan
    cut = min(rows - 1, max(1, round(rows * first)))
    return [(0, 0, cut), (0, cut, rows), *plan[1:]]


def score_pieces(batches, tokens: int, first: float = FIRST_PIECE):
    """The scoring pieces themselves (:func:`score_plan`)."""
    batches = list(batches)
    return [_piece(batches[i], a, b) for i, a, b in score_plan(batches, tokens, first)]


def _piece(batch, start, stop):
    return batch if stop is None or (start == 0 and stop == _rows(batch)) else _take_rows(
        batch, start, stop)


class _FloatOutputs:
    """Catches, during the calibration pass (a float forward of every batch), the summaries
    :class:`OutputDivergence` compares for the scoring pieces: their float references need
    no forward of their own. Only for the default divergence (a user's ``loss`` sees whole
    outputs) and outputs with ``logits`` or ``last_hidden_state``."""

    def __init__(self, model, batches, plan):
        self.plan, self.batches = plan, batches
        firsts = {i: _first_tensor(batches[i]) for i, _, _ in plan}
        self.want = {id(t): i for i, t in firsts.items() if t is not None}
        self.got = {}
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, out):
        t = _first_tensor(kwargs if kwargs else args)
        i = None if t is None else self.want.get(id(t))
        if i is None or i in self.got:
            return
        for k, (j, a, b) in enumerate(self.plan):
            if j != i:
                continue
            for name in ("logits", "last_hidden_state"):
                t = getattr(out, name, None)
                if isinstance(t, torch.Tensor):
                    cut = types.SimpleNamespace(**{name: t if b is None else t[a:b]})
                    self.got.setdefault(i, {})[k] = _summary(cut, _piece(self.batches[i], a, b))
                    break
        self.got.setdefault(i, {})

    def references(self):
        self.handle.remove()
        return [self.got.get(i, {}).get(k) for k, (i, _, _) in enumerate(self.plan)]


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, dict) or hasattr(x, "keys"):
        x = list(x.values())
    if isinstance(x, (tuple, list)):
        for v in x:
            if isinstance(v, torch.Tensor):
                return v
    return None


def choose(div: OutputDivergence, configs: dict, first: str, drop: float = DROP_FACTOR):
    """The configuration (``{name: states}``) with the least mean divergence, scored piece by
    piece (each of ``div.batches``): after each piece, a candidate whose mean so far exceeds
    ``drop`` times the best mean so far is dropped, unscored on the later pieces (an early
    choice: such a candidate cannot catch up unless the pieces disagree by that factor).
    Ties keep ``first`` (min-max). Returns ``(best, {name: (mean, pieces scored)})``."""
    totals, seen = dict.fromkeys(configs, 0.0), dict.fromkeys(configs, 0)
    alive = list(configs)
    for k in range(len(div.batches)):
        for n in alive:
            totals[n] += div.of(configs[n], k)
            seen[n] += 1
        best = min(totals[n] / seen[n] for n in alive)
        alive = [n for n in alive if totals[n] / seen[n] <= drop * best]
    best = min(alive, key=lambda n: (totals[n] / seen[n], n != first))
    return best, {n: (totals[n] / seen[n], seen[n]) for n in configs}


# ----------------------------------------------------------------------------- fisher
def fisher_weights(model: nn.Module, batches, layers, loss=None) -> dict[str, torch.Tensor]:
    """Per layer, the mean squared gradient of the loss w.r.t. each output feature.

    ``loss(output, batch) -> scalar tensor``; by default the model's own loss with the
    inputs as labels (a causal LM's next-token loss; padded positions ignored).
    """
    mods = {name: model.get_submodule(name) for name in layers}
    sums = {name: None for name in mods}
    counts = dict.fromkeys(mods, 0)
    handles = []

    def hook_for(name):
        def fwd(module, args, out):
            if not (isinstance(out, torch.Tensor) and out.requires_grad):
                return

            def grad(g):
                g = g.detach().float().reshape(-1, g.shape[-1]).square()
                sums[name] = g.sum(0) if sums[name] is None else sums[name] + g.sum(0)
                counts[name] += g.shape[0]
            out.register_hook(grad)
        return fwd

    was = model.training
    model.eval()
    try:
        for name, m in mods.items():
            handles.append(m.register_forward_hook(hook_for(name)))
        for batch in batches:
            model.zero_grad(set_to_none=True)
            with torch.enable_grad():
                if loss is not None:
                    value = loss(forward_batch(model, batch), batch)
                else:
                    if not (isinstance(batch, dict) or hasattr(batch, "keys")):
                        raise ValueError("fisher_weights: the default loss needs dict batches "
                                         "(input_ids); pass loss=callable(output, batch)")
                    labels = batch["input_ids"].clone()
                    if "attention_mask" in batch:
                        labels[batch["attention_mask"] == 0] = -100
                    value = getattr(model(**batch, labels=labels), "loss", None)
                    if value is None:
                        raise ValueError("fisher_weights: the model returns no loss; pass "
                                         "loss=callable(output, batch)")
                value.backward()
        model.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    return {n: s / counts[n] for n, s in sums.items() if s is not None}


# ----------------------------------------------------------------------------- joint choice
def imatrix_state(w: torch.Tensor, x: torch.Tensor, base: RoleState) -> RoleState:
    """The weight state of the importance-weighted MSE search (importance: mean ``x^2`` per
    input channel over the sampled calibration inputs ``x``)."""
    imp = x.float().square().mean(0)
    lo, hi = imatrix_range(w, imp, base.spec)
    qp = qparams_from_range(lo, hi, base.spec).reshape(base.spec.layout.qparam_shape(w.shape))
    return replace(base, observer=IMATRIX, qparams=qp, lo=lo, hi=hi)


def joint_choice(x: torch.Tensor, w: torch.Tensor, w_states: list[RoleState],
                 x_states: list[RoleState], out_weights: torch.Tensor | None = None,
                 rounds: int = 1) -> tuple[int, int, float]:
    """``(i, j, error)``: the weight state ``i`` and input state ``j`` with the lowest
    ``sum_o c_o ||X W^T - Q_j(X) Q_i(W)^T||_o^2`` found by coordinate descent (start: the
    first of each list, min-max by convention). Exhaustive when either list has one entry."""
    x, w = x.float(), w.float()
    ref = x @ w.T
    wq = [None] * len(w_states)
    xq = [None] * len(x_states)
    cache = {}

    def err(i, j):
        if (i, j) not in cache:
            if wq[i] is None:
                wq[i] = qdq_tensor(w, w_states[i]).float()
            if xq[j] is None:
                xq[j] = qdq_tensor(x, x_states[j]).float()
            e = (xq[j] @ wq[i].T - ref).square()
            if out_weights is not None:
                e = e * out_weights
            cache[(i, j)] = float(e.double().sum())
        return cache[(i, j)]

    i, j = 0, 0
    for _ in range(max(1, rounds)):
        i = min(range(len(w_states)), key=lambda a: (err(a, j), a))
        j = min(range(len(x_states)), key=lambda b: (err(i, b), b))
    return i, j, err(i, j)


def layer_pick(layer, plan, slots, data, state_of, fisher=None):
    """For the session: the ``{"weight": state, "input": state}`` :func:`joint_choice` picks
    among ``layer``'s candidate observers (plus the ``imatrix`` weight search), or None where
    the layer has no static input, 2-D weight and input sample."""
    from .observe import observer_key as _observer_key

    if (layer, "weight") not in plan or (layer, "input") not in plan:
        return None
    (wcfg, wnames), (xcfg, xnames) = plan[(layer, "weight")], plan[(layer, "input")]
    w = slots[(layer, "weight")].module.weight.detach()
    x = data.get((layer, "input"))
    if (wcfg.dynamic is not False or xcfg.dynamic is not False or w.dim() != 2 or x is None
            or x.shape[-1] != w.shape[1]):
        return None

    def states(role, cfg, names, shape):
        slot, out = slots[(layer, role)], []
        for n in names:
            okey = _observer_key(n, cfg)
            if okey in slot.observers:
                out.append(state_of(slot.observers[okey], cfg, (layer, role, okey, cfg.dynamic),
                                    shape))
        # min-max first: coordinate descent starts from it and ties keep it
        return sorted(out, key=lambda st: not st.observer.endswith("minmax"))

    ws = states("weight", wcfg, wnames, tuple(w.shape))
    xs = states("input", xcfg, xnames, None)
    if not ws or not xs:
        return None
    if len(wnames) > 1:
        try:
            ws.append(imatrix_state(w, x, ws[0]))
        except ValueError:  # a layout the weighted search cannot take: not a candidate
            pass
    c = None if fisher is None else fisher.get(layer)
    i, j, _ = joint_choice(x[:JOINT_ROWS], w, ws, xs, c)
    return {"weight": ws[i], "input": xs[j]}


# ----------------------------------------------------------------------------- model level
def calibrate_end_to_end(calibrate_many, model, batches, recipes: dict[str, Recipe], *,
                         candidates, score_tokens: int = 1024, loss=None, **kwargs):
    """``auto_metric="model"``: calibrate every auto recipe's candidates in one pass, score
    each whole configuration by :class:`OutputDivergence` on the first ``score_tokens``
    calibration tokens, keep the best.

    Each auto recipe ``R`` is expanded to ``R`` with every candidate observer; they share
    observers with each other (and with the other recipes) in :func:`calibrate_many` 's
    single pass, whose float forwards also give the scoring pieces' references. The scoring
    documents are cut in pieces scored one after the other (:func:`score_plan`,
    :func:`choose`): a candidate far behind after a piece is not scored further.
    The per-layer ``joint`` choice is not a candidate here: on SmolLM2 its configuration
    scored worst but the clipping observers (docs/benchmarks.md), and it costs its own
    matmuls and imatrix searches; ``auto_metric="joint"`` asks for it.
    """
    from .observe import candidates_for as _candidates  # the one list of auto's candidates

    batches = list(batches)
    autos = [label for label, r in recipes.items() if _has_auto(r)]
    expanded = {label: r for label, r in recipes.items() if label not in autos}
    names = list(dict.fromkeys(_candidates("input", candidates)))
    for label in autos:
        for n in names:
            expanded[(label, n)] = recipes[label].with_observer(n)
    plan = score_plan(batches, score_tokens) if autos else []
    caught = _FloatOutputs(model, batches, plan) if autos and loss is None else None
    try:
        calibs = calibrate_many(model, batches, expanded, candidates=candidates,
                                auto_metric="tensor", **kwargs)
    finally:
        refs = caught.references() if caught is not None else None
    out = {label: c for label, c in calibs.items() if label in recipes}
    if not autos:
        return out
    import time

    t0 = time.perf_counter()
    score = OutputDivergence(model, [_piece(batches[i], a, b) for i, a, b in plan], loss, refs)
    for label in autos:
        best, scores = choose(score, {n: calibs[(label, n)].states for n in names}, names[0])
        chosen = calibs[(label, best)]
        states = {layer: {role: replace(st, requested=AUTO) for role, st in roles.items()}
                  for layer, roles in chosen.states.items()}
        info = dict(chosen.info)
        info["auto"] = {"metric": "model", "chose": best,
                        "scores": {k: float(f"{v:.6g}") for k, (v, _) in scores.items()},
                        "pieces_scored": {k: p for k, (_, p) in scores.items()},
                        "score_pieces": len(score.batches),
                        "score_tokens": sum(_tokens(b) for b in score.batches),
                        "score_forwards": score.forwards}
        stats = [dict(r, requested=AUTO) for r in chosen.stats]
        out[label] = Calibration(recipes[label], states, label, stats, chosen.histograms, info)
    spent = time.perf_counter() - t0
    for label in autos:
        out[label].info["calibration_seconds"] = round(
            out[label].info["calibration_seconds"] + spent, 3)
        out[label].info["auto"]["score_seconds"] = round(spent, 3)
    return out


def _has_auto(recipe: Recipe) -> bool:
    return any(role.observer == AUTO for rule in recipe.rules for role in rule.roles().values())
