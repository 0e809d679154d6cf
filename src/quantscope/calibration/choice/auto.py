"""``auto`` by end-to-end effect: choose ranges by what they do to the model's output.

``auto_metric="model"`` (the default ``auto``): every candidate observer is calibrated in the
same pass; each whole-model configuration is scored by the divergence of the model's output
from the float model's on a few calibration documents (:class:`OutputDivergence`), piece by
piece, candidates far behind dropped early (:func:`choose`), and the best is kept; then each
role is re-chosen with the other fixed (:func:`choose_roles`). Min-max is always among the
candidates, so on the scoring pieces min-max was scored on, ``auto`` is never worse than
min-max. See the README for why this is the default (measured on both demo models). The
per-layer criteria ``"joint"`` and ``"fisher"`` live in :mod:`.layer_choice`.

Per-layer criteria cannot see that an outlier one layer clips costs more downstream than a
coarse step everywhere; the model-level score does, at the price of one forward of the
scoring documents per candidate (fewer for those dropped early).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import nn

from ...comm import LocalError
from ..recipe import AUTO, Recipe, weight_observer
from ..results.apply import apply
from ..results.result import Calibration
from ..run.batches import eval_mode, forward_batch
from ..run.gather import share_pieces
from ..run.sequential import batch_source
from .candidates import (
    auto_keys,
    check_options,
    expand,
    has_auto,
    ignores_non_finite,
    reads_as_zero,
)
from .importance import InputImportance, imatrix_config, imatrix_rows
from .layer_choice import IMATRIX
from .loss_checks import (
    batch_error,
    batch_name,
    finite,
    loss_error,
    none_left_error,
    scalar,
)
from .references import FloatOutputs, summary
from .score_set import (
    mask_of,
    no_batches_error,
    no_token_error,
    piece_names,
    piece_of,
    score_batches,
    score_pieces,
    score_plan,
    scoring_prefix,
    tokens_of,
    with_tokens,
)

__all__ = ["OutputDivergence", "Tally", "calibrate_end_to_end", "check_options", "choose",
           "choose_roles", "no_batches_error", "score_batches",
           "score_pieces", "scoring_prefix"]  # (the last four: .score_set's)

#: ``auto_metric="model"`` scores each configuration piece by piece (the first piece
#: :data:`.score_set.FIRST_PIECE` of the scoring documents), dropping after each piece the
#: candidates this many times worse than the best so far (:func:`choose`)
DROP_FACTOR = 1.5


# ----------------------------------------------------------------------------- model output
class Tally(NamedTuple):
    """What :class:`OutputDivergence` scores on: the batches (pieces) ``given``, those holding
    a ``real`` token, those ``kept`` (finite: what it scores), and the real ``tokens`` of
    those kept."""

    given: int
    real: int
    kept: int
    tokens: int


#: logits whose KL :func:`_divergence` computes at once: its float64 temporaries (three
#: of this many values, 128 MiB each) do not grow with the scoring tokens
KL_CHUNK = 2 ** 24


def _divergence(kind, q, ref):
    """KL(p_ref || p_q) of next-token logits, or ``1 - cosine``, mean over positions; in
    float64, each position's at least 0 as its true value is (float32's rounding left a
    near-zero KL as likely negative as positive, float64's still does below 1e-15)."""
    if kind != "kl":
        d = (1 - (q * ref).sum(-1)).clamp_(min=0)
        # a zero row has no direction: two agree (0); against a nonzero row, already 1
        return float(d.masked_fill_(~(q.any(-1) | ref.any(-1)), 0.0).mean())
    total = torch.zeros((), dtype=torch.float64, device=q.device)
    step = max(1, KL_CHUNK // max(q.shape[-1], 1))
    for i in range(0, q.shape[0], step):
        r = torch.log_softmax(ref[i:i + step].double(), -1)
        d = r - torch.log_softmax(q[i:i + step].double(), -1)
        banned = r.isneginf()  # p = 0 (a -inf logit): 0 log 0 = 0, not 0 * (-inf - -inf)
        total += r.exp_().mul_(d).masked_fill_(banned, 0.0).sum(-1).clamp_(min=0).sum()
    return float(total / q.shape[0])


class OutputDivergence:
    """How far a (quantized) model's output is from the float model's on ``batches``.

    The float outputs are computed once, at construction (``references``: those already
    known, as :func:`.references.summary` gives them, None where not). ``loss(output,
    reference_output, batch) -> float`` replaces the default: KL divergence of the
    next-token distributions for a model with ``logits`` (causal LM), ``1 - cosine`` of the
    mean-pooled embeddings otherwise. Each call runs one forward per batch (under
    ``inference_mode``). ``who``: the function named in errors (``auto``'s scoring,
    ``sensitivity``). ``real``: the user's batches that ``batches`` stand for where they are
    not those (a sequential block's pieces, ``(number, start, stop)``): their attention
    masks say which positions count; one with none (a mask all 0) is left out, for every
    configuration alike. ``names``: what errors call each batch (``auto``'s: its scoring
    pieces). ``alone=False``: whether any batch is left to score is decided on more counts
    than this process's (every rank's: :func:`~..run.gather.share_pieces`, then
    :meth:`check_left`), so none here (no batch, none with a real token, none finite) raises
    nothing yet.
    """

    #: every rank's :meth:`tally`, where the ranks score different pieces (share_pieces)
    totals: Tally | None = None

    def __init__(self, model: nn.Module, batches, loss=None, references=None, who="auto",
                 real=None, names=None, alone=True):
        self.who, self.alone = who, alone
        if not isinstance(model, nn.Module):
            raise TypeError(f"OutputDivergence: model must be an nn.Module, got "
                            f"{type(model).__name__}")
        self.model, self.batches, self.loss = model, list(batches), loss
        if not self.batches and alone:
            raise ValueError("OutputDivergence: batches is empty: need at least one batch to "
                             "compare the model's outputs on")
        if loss is not None and not callable(loss):
            raise TypeError("OutputDivergence: loss must be callable(output, reference, batch)")
        self.real = self.batches if real is None else list(real)
        # float outputs already at hand (e.g. caught in the calibration pass) are not recomputed
        known = list(references or [None] * len(self.batches))
        self.names = list(names or map(batch_name, range(len(self.batches))))
        self.given = self.batches  # (the ranks compare them: share_pieces)
        keep = with_tokens(self.real)  # (a mask all 0: KL over no position is 0 / 0)
        self.batches, self.real, self.names, known = (
            [x[k] for k in keep] for x in (self.batches, self.real, self.names, known))
        self.real_pieces = len(keep)
        if alone:
            self.check_left()
        self.references = [self._run(k) if r is None else r for k, r in enumerate(known)]
        self.forwards = sum(r is None for r in known)
        self.pieces, self.ranks = len(self.batches), None  # across ranks: share_pieces

    def tally(self) -> Tally:
        """This process's counts (:class:`Tally`)."""
        return Tally(len(self.given), self.real_pieces, len(self.batches),
                     sum(tokens_of(p) for p in self.real))

    def counts(self) -> Tally:
        """The counts of the scoring: every rank's where the ranks score different pieces
        (:attr:`totals`), else this process's."""
        return self.tally() if self.totals is None else self.totals

    def check_left(self) -> None:
        """Raise, on :meth:`counts`, where no batch is left to score: none given, none holding
        a real token, or ``non_finite='ignore'`` left out every one of those."""
        given, real, kept, _ = self.counts()
        if not given:
            raise no_batches_error()
        if not real:
            raise no_token_error(self.who)
        if not kept:
            raise none_left_error(self.who, real, "compare the model's outputs on")

    def _run(self, k):
        with eval_mode(self.model), torch.inference_mode():
            out = forward_batch(self.model, self.batches[k])
        return out if self.loss is not None else summary(out, mask_of(self.real[k]))

    def on(self, k: int) -> float:
        """The divergence of the model as it is now on batch ``k`` alone (one forward)."""
        batch, ref = self.batches[k], self.references[k]
        out = self._run(k)
        d = (scalar(self.who, "loss", self.loss(out, ref, batch), f" on {self.names[k]}")
             if self.loss is not None else _divergence(out[0], out[1], ref[1]))
        if not math.isfinite(d):
            raise self._non_finite(k, d, out)
        self.forwards += 1
        return d

    def _non_finite(self, k: int, d: float, out) -> ValueError:
        """The error of a non-finite divergence on batch ``k``: the batch's (NaN / inf in it,
        or in the float model's output on it, as calibrate says of a calibration batch),
        a custom ``loss``'s where the quantized output ``out`` is finite too, else the
        quantized model's."""
        if not (finite(self.batches[k]) and finite(self.references[k], logits=True)):
            return batch_error(self.who, self.names[k])
        if self.loss is not None and finite(out, logits=True):
            return loss_error(self.who, "loss", self.names[k], d,
                              "the quantized and the float outputs are")
        return ValueError(f"{self.who}: the output divergence on {self.names[k]} "
                          f"is {d}: the quantized model's output is not finite there")

    def drop_non_finite(self) -> int:
        """Leave out the batches that bring NaN / inf (or whose float output does); returns
        how many. Raises where none is left to score on (``alone``: :meth:`check_left`)."""
        keep = [k for k, (b, r) in enumerate(zip(self.batches, self.references))
                if finite(b) and finite(r, logits=True)]
        left_out = len(self.batches) - len(keep)
        self.batches, self.real, self.names, self.references = (
            [x[k] for k in keep] for x in (self.batches, self.real, self.names, self.references))
        self.pieces = len(keep)
        if self.alone:
            self.check_left()
        return left_out

    def __call__(self) -> float:
        """The mean divergence of the model as it is now (e.g. under QDQ) over the batches."""
        return sum(self.on(k) for k in range(len(self.batches))) / len(self.batches)

    def of(self, states, k: int | None = None) -> float:
        """The divergence with ``states`` (``{layer: {role: RoleState}}``) applied: over all
        batches, or on batch ``k`` alone (every rank's piece ``k``, where ``ranks``)."""
        def here():
            with apply(self.model, states):
                return self() if k is None else self.on(k)
        return here() if self.ranks is None or k is None else self.ranks.piece(
            here if k < len(self.batches) else None)


def choose(div: OutputDivergence, configs: dict, first: str, drop: float = DROP_FACTOR,
           pieces: dict | None = None):
    """The configuration (``{name: states}``) with the least mean divergence, scored piece by
    piece (``div.pieces``): after each piece, a candidate whose mean so far exceeds
    ``drop`` times the best mean so far (``best + (drop - 1) |best|``: the best always stays)
    is dropped, unscored on the later pieces (an early choice: such a candidate cannot catch
    up unless the pieces disagree by that factor). Ties keep ``first`` (the first candidate
    listed: min-max by default). Returns ``(best, {name: (mean, pieces scored)})``;
    ``pieces`` (a dict) receives each candidate's divergence piece by piece."""
    totals, seen = dict.fromkeys(configs, 0.0), dict.fromkeys(configs, 0)
    pieces = {} if pieces is None else pieces
    alive = list(configs)
    for k in range(div.pieces):
        for n in alive:
            d = div.of(configs[n], k)
            pieces.setdefault(n, []).append(d)
            totals[n] += d
            seen[n] += 1
        best = min(totals[n] / seen[n] for n in alive)
        # ``drop`` times the best, measured from the best: a best below 0 (rounding) stays
        alive = [n for n in alive if totals[n] / seen[n] <= best + (drop - 1) * abs(best)]
    best = min(alive, key=lambda n: (totals[n] / seen[n], n != first))
    return best, {n: (totals[n] / seen[n], seen[n]) for n in configs}


def choose_roles(div: OutputDivergence, configs: dict, best: str, best_pieces: list[float],
                 alive: list[str]) -> tuple[dict[str, str], dict[str, tuple[float, int]]]:
    """After :func:`choose`: each role re-chosen with the others fixed, by the same score.

    Whole configurations tie a role's observer to the others' (``mse`` weights come only
    with ``mse`` inputs); on MiniLM the best pair mixes them (docs/benchmarks.md). Weights
    try every candidate's distinct weight observer (only a few: histogram observers' weights
    are min-max); the other roles the candidates still ``alive`` after :func:`choose`. A
    trial is scored piece by piece and abandoned as soon as its mean so far exceeds the kept
    configuration's on the same pieces (``best_pieces``: ``best``'s divergence on each
    piece); one that completes every piece with a lower mean is kept. Returns ``({role:
    configuration it comes from}, {"role=name": (mean, pieces scored)})``, every role
    present (``best`` where nothing won)."""
    chosen = configs[best].states
    roles = sorted({role for rs in chosen.values() for role in rs},
                   key=lambda r: (r != "weight", r))
    pick, kept, tried = dict.fromkeys(roles, best), list(best_pieces), {}

    def observer_of(name, role):  # a configuration's observers of ``role``, layer by layer
        return tuple(rs[role].observer for rs in configs[name].states.values() if role in rs)

    for role in roles:
        pool = list(configs) if role == "weight" else alive
        seen = {observer_of(pick[role], role)}
        for n in pool:
            obs = observer_of(n, role)
            if not obs or obs in seen or configs[n].states.keys() != chosen.keys():
                continue
            seen.add(obs)
            trial = dict(pick, **{role: n})
            states = {layer: {r: configs[trial[r]].states[layer][r] for r in rs}
                      for layer, rs in chosen.items()}
            got = []
            for k in range(div.pieces):
                got.append(div.of(states, k))
                if sum(got) > sum(kept[:k + 1]):
                    break
            tried[f"{role}={n}"] = (sum(got) / len(got), len(got))
            if len(got) == len(kept) and sum(got) < sum(kept):
                pick, kept = trial, got
    return pick, tried


# ----------------------------------------------------------------------------- model level
def calibrate_end_to_end(calibrate_with, model, batches, recipes: dict[str, Recipe], opts):
    """``Auto(metric="model")``: calibrate every auto recipe's candidates in one pass, score
    each whole configuration by :class:`OutputDivergence` on the first ``score_tokens``
    calibration tokens, keep the best. ``calibrate_with(model, batches, recipes, opts)`` is
    the session's pass; ``opts`` its :class:`~.options.Options`.

    Each auto recipe ``R`` is expanded to ``R`` with its ``auto`` roles running each
    candidate observer (:func:`.candidates.as_candidate`: the others as named); they share
    observers with each other (and with the other recipes) in the session's
    single pass, whose float forwards also give the scoring pieces' references. The scoring
    documents are cut in pieces scored one after the other (:func:`score_plan`,
    :func:`choose`): a candidate far behind after a piece is not scored further. Then each
    role is re-chosen (:func:`choose_roles`); where the candidates give the weights a
    choice, the importance-weighted weight search (:mod:`.importance`, its mean ``x^2``
    gathered in the same pass) is one more weight candidate there.
    The per-layer ``joint`` choice is not a candidate here: on SmolLM2 its configuration
    scored worst but the clipping observers (docs/benchmarks.md), and it costs its own
    matmuls and imatrix searches; ``auto_metric="joint"`` asks for it.
    """
    from ..run.observe import candidates_for as _candidates  # the one list of auto's candidates

    candidates, score_tokens, loss = opts.auto.candidates, opts.auto.score_tokens, opts.auto.loss
    autos = [label for label, r in recipes.items() if has_auto(r)]
    expanded, names, refused = expand(model, recipes, autos, list(dict.fromkeys(
        _candidates("input", candidates))))
    source = batch_source(model)  # a sequential block runs on these batches' numbers
    # only the scoring prefix is held (a block's numbers: all, indexed by its source's plan);
    # across ranks, empty on some: _scoring
    head, batches = scoring_prefix(batches if source is None else list(batches), score_tokens)
    plan = score_plan(head if source is None else source, score_tokens) if autos else []
    caught = FloatOutputs(model, head, plan) if autos and loss is None else None
    weighted = any(len({weight_observer(n) for n in names[label]}) > 1 for label in autos)
    importance = _importance(model, recipes, autos) if weighted else None
    try:
        try:
            calibs = calibrate_with(model, batches, expanded,  # the scoring's options: below
                                    opts.but(auto=type(opts.auto)(candidates, "tensor")))
        finally:
            refs = caught.references() if caught is not None else None
        out = {label: c for label, c in calibs.items() if label in recipes}
        if not autos:
            return out
        t0 = time.perf_counter()
        # a sequential block's pieces are its batch numbers and rows; the user's batches'
        # rows (``real``) say which of their positions are real tokens
        real = [piece_of(head[i] if source is None else source[i], a, b) for i, a, b in plan]
        pieces = real if source is None else [(head[i], a, b) for i, a, b in plan]
        # non_finite="ignore" (the observers read NaN / inf as 0): not scored on those batches
        ignore = all(ignores_non_finite(recipes[label]) for label in autos)
        score = _scoring(model, (plan, pieces, real), loss, refs, ignore, importance,
                         opts.runtime)
        means = {} if importance is None else importance.means(
            opts.runtime.distributed, opts.runtime.group)
    finally:
        if importance is not None:
            importance.remove()
    built = score.forwards  # the references' forwards, which every recipe's scoring needs
    for label in autos:
        score.forwards = built  # each recipe counts its own scoring's forwards, as alone
        out[label] = _decide(model, score, recipes[label], label,
                             {n: calibs[(label, n)] for n in names[label]}, means)
    spent = time.perf_counter() - t0
    left_out = score.counts().real - score.counts().kept  # (every rank's, as the others)
    for label in autos:
        info = out[label].info
        info["calibration_seconds"] = round(info["calibration_seconds"] + spent, 3)
        info["auto"]["score_seconds"] = round(spent, 3)
        if refused[label]:
            info["auto"]["refused"] = refused[label]
        if left_out:
            info["auto"]["non_finite_pieces"] = left_out
    return {label: out[label] for label in recipes}  # the caller's order, as other metrics


def _scoring(model, plan, loss, refs, ignore: bool, importance, runtime) -> OutputDivergence:
    """The :class:`OutputDivergence` of auto's scoring pieces (``plan``: the plan, the pieces
    and the user's rows they stand for), those bringing NaN / inf left out where ``ignore``.
    Across ranks (``runtime.distributed``) whether any piece is left is decided on every
    rank's counts, as one process given all their batches decides, and an error here raises
    on every rank (:func:`~..run.gather.share_pieces`): a rank given no batch, or all of
    whose pieces are left out, scores with none, not alone into an error."""
    (plan, pieces, real), across = plan, runtime.distributed
    failed, score = LocalError() if across else contextlib.nullcontext(), None
    with failed:
        # a pass without forwards (weight-only recipes): the scoring pieces' float forwards
        with (importance.counting() if importance is not None and not importance.seen()
              else contextlib.nullcontext()):
            score = OutputDivergence(model, pieces, loss, refs, real=real,
                                     names=piece_names(plan), alone=not across)
        if ignore:
            score.drop_non_finite()
    if across:  # ranks scoring their own batches: the same choice
        share_pieces(score, runtime.group, failed.error)
    return score


def _importance(model, recipes, autos) -> InputImportance:
    """The input importance of the auto recipes' layers with ``auto`` weights (the imatrix
    weight candidate replaces no weight observer the user named); a layer one of whose roles
    reads NaN / inf as zero (``non_finite="ignore"``) reads them so in its sums too (one inf
    would make its importance, and so its imatrix weight candidate, unusable)."""
    layers, ignore = set(), set()
    for label in autos:
        for layer, (_, roles) in recipes[label].match(model).items():
            if "weight" in roles and roles["weight"].observer == AUTO:  # not a named one
                layers.add(layer)
                if reads_as_zero(roles.values()):
                    ignore.add(layer)
    return InputImportance(model, sorted(layers), ignore)


def _decide(model, score: OutputDivergence, recipe: Recipe, label, configs: dict,
            means: dict) -> Calibration:
    """One auto recipe's result from its candidates' calibrations ``configs`` (min-max
    first): the best whole configuration (:func:`choose`), then each role re-chosen
    (:func:`choose_roles`, the imatrix weights among the weight trials where ``means``, the
    input importance, is known)."""
    names, per_piece = list(configs), {}
    best, scores = choose(score, {n: c.states for n, c in configs.items()}, names[0],
                          pieces=per_piece)
    alive = [n for n in names if scores[n][1] == score.pieces]
    asked = auto_keys(model, recipe)  # this recipe's auto roles (the others: as named)
    means = {layer: m for layer, m in means.items() if (layer, "weight") in asked}
    extra = imatrix_config(model, configs[names[0]], means) if means else None
    if extra is not None:  # the weighted weight search: a weight candidate of the role step
        configs = {**configs, IMATRIX: extra}
    roles, trials = choose_roles(score, configs, best, per_piece[best], alive)
    if roles.get("weight") == IMATRIX:  # its report rows, made for the kept weights only
        extra.stats = imatrix_rows(model, extra, configs[names[0]])
    chosen = configs[best]
    supplier = {role: configs[n] for role, n in roles.items()}
    states = {layer: {role: _requested(supplier.get(role, chosen).states[layer][role],
                                       (layer, role) in asked) for role in rs}
              for layer, rs in chosen.states.items()}
    # its time so far: its candidates' group, timed by the session's pass (_time_groups)
    info, groups = dict(chosen.info), dict(chosen.info["group_seconds"])
    info["calibration_seconds"] = groups.pop((AUTO, label))
    info.pop("group_seconds")
    if groups:  # the user's (Runtime.time_groups): its scoring added by the session
        info["group_seconds"] = groups
    roles = {k: n for k, n in roles.items() if any(k == r for _, r in asked)}
    info["auto"] = {"metric": "model", "chose": best, "roles": roles,
                    "scores": {k: float(f"{v:.6g}") for k, (v, _) in scores.items()},
                    "role_scores": {k: float(f"{v:.6g}") for k, (v, _) in trials.items()},
                    "role_pieces": {k: p for k, (_, p) in trials.items()},
                    "pieces_scored": {k: p for k, (_, p) in scores.items()},
                    "score_pieces": score.counts().kept,  # (every rank's, where they differ)
                    "score_tokens": score.counts().tokens,
                    "score_forwards": score.forwards}  # (this rank's, as its seconds)
    stats = [_requested(row, (row["layer"], row["role"]) in asked)
             for n, c in configs.items() for row in c.stats if supplier.get(
                 row["role"], chosen) is c]
    return Calibration(recipe, states, label, stats, chosen.histograms, info,
                       writer_rank=chosen.writer_rank)


def _requested(state, auto: bool):
    """A role's state (or report row) as ``auto`` served it: requested ``"auto"`` where the
    recipe asked for it; a role naming its observer keeps its name."""
    if not auto:
        return state
    return dict(state, requested=AUTO) if isinstance(state, dict) else replace(
        state, requested=AUTO)
