"""Sensitivity analysis and float fallback: which tensors' quantization the model feels.

:func:`~.session.sensitivity` quantizes one tensor at a time (a layer's weight, or its input
activation) with a calibration's qparams, everything else in float, and measures how far
the model's output moves on held-out batches (:class:`~.auto.OutputDivergence`: KL of the
next-token distributions for a causal LM, ``1 - cosine`` of mean-pooled embeddings for an
encoder, or a loss you pass). Cost: one forward of the held-out batches per quantized
tensor, plus one for the float reference (2 x layers + 1 for w8a8); no activation is
cached, so the figure is exact for any model, including ones whose layers are not run in
a simple chain.

:func:`keep_float` is the fallback: the ``n`` most sensitive activations are left in float
(or quantized per token at run time), and :func:`fallback_curve` measures the quality /
cost trade-off over ``n`` (a table and a Pareto plot).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import replace

from torch import nn

from ..._checks import outside_quantscope
from ...exporters.moe_slots import expert_slot
from ...layout import Token
from ..results.result import Calibration, RoleState
from ..structure import moe
from ..structure.conv1d import is_conv1d, linear_output
from .loss_checks import scalar
from .output_sensitivity import check_call, convolutions, measure
from .ranking import Sensitivity, count_arg
from .ranking import save as _save

__all__ = ["FALLBACK_MODES", "Sensitivity", "fallback_curve", "keep_float", "layer_sensitivity",
           "measure", "plot_fallback"]

#: input rows per layer and batch :func:`layer_sensitivity` measures the error on
LAYER_ROWS = 256

FALLBACK_MODES = ("float", "dynamic")


def _is_conv(module) -> bool:
    """A convolution whose output :func:`_outputs` computes with the module's own
    ``_conv_forward`` (stride, padding, groups ...); a transposed one is not ranked."""
    return isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d))


def _sample(x):
    """Up to :data:`LAYER_ROWS` of ``x``'s rows (its first dimension), evenly spread over it:
    every ``ceil(N / LAYER_ROWS)``-th (``N // LAYER_ROWS`` took the first 256 of 257..511)."""
    return x[::max(1, -(-x.shape[0] // LAYER_ROWS))]


def _outputs(mod, x, states):
    """``(float output, {role: output with only that role quantized})`` of up to
    :data:`LAYER_ROWS` rows of ``x``, ``mod``'s input: an Embedding's lookup of its ids (only
    its weight is quantized), a convolution's output without bias on up to as many samples,
    else ``x W^T`` (a Conv1D holds ``W^T``: ``x @ weight``)."""
    import torch.nn.functional as F

    from ..results.apply import qdq_tensor

    w = mod.weight.detach()
    if isinstance(mod, nn.Embedding):
        ids = _sample(x.detach().reshape(-1))
        return F.embedding(ids, w.float()), {
            role: F.embedding(ids, qdq_tensor(w, st).float())
            for role, st in states.items() if role == "weight"}
    if _is_conv(mod):  # a row is a sample (its whole map); an unbatched input is one
        x = x.detach() if x.dim() == w.dim() else x.detach().unsqueeze(0)
        out = lambda a, b: mod._conv_forward(a, b, None)
    else:
        x, t = x.detach().reshape(-1, x.shape[-1]), is_conv1d(mod)
        out = lambda a, b: linear_output(a, b, t)
    x, w32 = _sample(x).float(), w.float()
    return out(x, w32), {
        role: (out(qdq_tensor(x, st).float(), w32) if role == "input"
               else out(x, qdq_tensor(w, st).float()))
        for role, st in states.items()}


def _layer_errors(model, batches, todo):
    """``(squared output errors per (layer, role), squared outputs per layer, batches)``
    over ``batches``, hooks on the layers of ``todo`` (``{layer: (module, {role: state})}``)."""
    import torch

    from ..run.batches import eval_mode, forward_batch, input_name, module_input

    err: dict[tuple[str, str], float] = {}
    ref: dict[str, float] = {}
    n = 0

    def hook_for(layer, module, states):
        key = input_name(module)

        def hook(mod, args, kwargs):
            x = module_input(args, kwargs, key)
            if not isinstance(x, torch.Tensor) or not x.numel():
                return
            y, qs = _outputs(mod, x, states)
            r = float(y.double().square().sum())
            if not math.isfinite(r):  # float64 sums of float32 squares: NaN / inf in x or W
                raise _non_finite(layer, n, "brought NaN or inf values (the float layer's "
                                  "output is not finite); fix that batch (or what makes the "
                                  "model produce them)")
            ref[layer] = ref.get(layer, 0.0) + r
            for role, q in qs.items():
                e = float((q - y).double().square().sum())
                if not math.isfinite(e):
                    raise _non_finite(layer, n, f"makes the output with only its {role} "
                                      f"quantized not finite")
                err[(layer, role)] = err.get((layer, role), 0.0) + e
        return hook

    handles = [m.register_forward_pre_hook(hook_for(layer, m, st), with_kwargs=True)
               for layer, (m, st) in todo.items()]
    try:
        with eval_mode(model), torch.inference_mode():
            for batch in batches:
                forward_batch(model, batch)
                n += 1
    finally:
        for h in handles:
            h.remove()
    return err, ref, n


def _non_finite(layer: str, batch: int, what: str) -> ValueError:
    return ValueError(f"layer_sensitivity: layer {layer!r}: batch {batch} (counting from 0) "
                      f"{what}")


def layer_sensitivity(model: nn.Module, batches, calibration: Calibration, *,
                      roles=("weight", "input")) -> Sensitivity:
    """The cheap ranking: per (layer, role), the relative error quantizing only that tensor
    causes in the layer's own output, ``||Q(X) W^T - X W^T||^2 / ||X W^T||^2`` (input) or
    ``||X Q(W)^T - X W^T||^2 / ||X W^T||^2`` (weight), on up to :data:`LAYER_ROWS` input rows
    per batch of ``batches`` (e.g. calibration batches). One forward per batch, against
    ``2 x layers + 1`` for :func:`~.session.sensitivity`; it does not see what an error does
    downstream, but on SmolLM2 its first 16 inputs are the ones whose fallback matters
    (docs/benchmarks.md). Layers with a 2-D weight and convolutions (``Conv1d`` / ``2d`` /
    ``3d``: their output without bias, ``conv(X, W)``, on up to as many samples; a transposed
    one is not ranked); an Embedding's output is its lookup,
    ``||Q(W)[ids] - W[ids]||^2 / ||W[ids]||^2`` (its input, the token ids, is not ranked).

    A layer whose own forward never runs on ``batches`` has no row, with a warning naming its
    tensors: ``nn.MultiheadAttention``'s ``out_proj`` (the attention reads its weight without
    calling it), an MoE expert no token was routed to. :func:`measure`
    (``quantscope.sensitivity``), by the whole model's output, ranks them. ``model`` must be
    the one calibrated, as ``calibration.apply`` checks (``Calibration.check_model``)."""
    batches = check_call("layer_sensitivity", model, batches, calibration)
    return _layer_ranking(model, batches, calibration, roles)


def _layer_ranking(model: nn.Module, batches, calibration: Calibration,
                   roles) -> Sensitivity:
    """:func:`layer_sensitivity` past its checks (calibrate's fallback: on the model it has
    just calibrated, whose weights need no second fingerprint pass)."""
    t0 = time.perf_counter()
    with _expert_views(model):  # the calibration names MoE experts by their views
        todo = _ranked(model, calibration, roles)
        err, ref, n = _layer_errors(model, batches, todo)
    if n == 0:
        raise ValueError("layer_sensitivity: batches is empty")
    _say_unmeasured([(layer, role) for layer, (_, st) in todo.items() for role in st
                     if (layer, role) not in err])
    rows = [{"layer": layer, "role": role, "observer": todo[layer][1][role].observer,
             "divergence": e / max(ref.get(layer, 0.0), 1e-30)}
            for (layer, role), e in err.items()]
    rows.sort(key=lambda r: -r["divergence"])
    for k, r in enumerate(rows, 1):
        r["rank"] = k
    return Sensitivity(rows, {"metric": "relative layer output error", "forwards": n,
                              "batches": n, "seconds": round(time.perf_counter() - t0, 2),
                              "convolutions": convolutions(
                                  {layer: m for layer, (m, _) in todo.items()})})


def _say_unmeasured(missed: list[tuple[str, str]]) -> None:
    """Warn of the calibrated tensors :func:`layer_sensitivity` has no error of: an error is
    not made up, and a ranking silently without them would never let keep_float pick them."""
    if missed:
        names = ", ".join(f"{layer!r} {role}" for layer, role in missed[:8])
        more = f" and {len(missed) - 8} more" if len(missed) > 8 else ""
        warnings.warn(f"layer_sensitivity: {len(missed)} calibrated tensor(s) not ranked: "
                      f"their layer saw no row of batches (batches of 0 rows; or its forward "
                      f"never ran: MultiheadAttention's out_proj, whose weight it reads "
                      f"without calling it; an MoE expert no token was routed to): "
                      f"{names}{more}. quantscope.sensitivity (measure) "
                      f"ranks them by the model's output", stacklevel=outside_quantscope())


def _ranked(model: nn.Module, calibration: Calibration, roles) -> dict:
    """:func:`_layer_errors`'s ``{layer: (module, {role: state})}``: the calibration's tensors
    of ``roles`` that :func:`layer_sensitivity` ranks (a 2-D weight layer's, a conv's)."""
    import torch

    todo = {}
    for layer, rs in calibration.states.items():
        module = _module(model, layer, "layer_sensitivity")
        w = getattr(module, "weight", None)
        kinds = ("weight",) if isinstance(module, nn.Embedding) else ("weight", "input")
        mine = {r: st for r, st in rs.items() if r in roles and r in kinds and st is not None}
        if mine and isinstance(w, torch.Tensor) and (w.dim() == 2 or _is_conv(module)):
            todo[layer] = (module, mine)
    if not todo:
        raise _NothingRanked(f"layer_sensitivity: the calibration quantizes no tensor of roles "
                             f"{roles} of a layer it ranks (a 2-D weight layer's: Linear, "
                             f"Conv1D, an Embedding's weight; a Conv1d / 2d / 3d's)")
    return todo


def _module(model: nn.Module, layer: str, who: str) -> nn.Module:
    """``model``'s module ``layer``; raises as ``apply()`` does where it has none."""
    try:
        return model.get_submodule(layer)
    except AttributeError:
        raise ValueError(f"{who}: the model has no module {layer!r} (calibrated on another "
                         f"model?)") from None


class _NothingRanked(ValueError):
    """No tensor of the calibration that :func:`layer_sensitivity` ranks."""


def _expert_views(model: nn.Module):
    """MoE experts held as 3-D parameters as the per-expert Linear views a calibration names
    (``...experts.0.down_proj``), attached until the ``with`` block ends (as ``apply()`` does);
    nothing to attach otherwise."""
    if not moe.has_experts_3d(model):
        return contextlib.nullcontext()
    return moe.attach(model, count=False)


def _fallback_state(st: RoleState, mode: str, conv: bool) -> RoleState | None:
    """The state a fallen-back activation runs: none (float), or its format with scales
    from each call: per token, or, for a block-scale spec (NVFP4), its own blocks with the
    global scale of each call too (a block scale needs its Block layout). A convolution's
    (``conv``) ``[N, C, *spatial]`` has no tokens: float."""
    if mode == "float" or (not st.spec.scale.is_block and conv):
        return None
    spec = st.spec if st.spec.scale.is_block else replace(st.spec, layout=Token())
    return RoleState(spec, "memoryless_minmax", st.requested, True, ())


def _static_activations(calibration: Calibration) -> list[tuple[str, str]]:
    """The ``(layer, role)`` of layer inputs / outputs quantized with calibrated ranges: what
    a fallback can take out (not weights, not those already quantized per token, not a KV
    cache's key / value: a runtime quantizes both or neither, and a pair split in two
    exports nowhere; to leave the cache in float, calibrate without ``kv_cache``)."""
    return [(layer, r) for layer, rs in calibration.states.items() for r, st in rs.items()
            if r in ("input", "output") and st is not None and st.dynamic is not True]


def _convolutions_of(sens: Sensitivity, calibration: Calibration) -> set[str]:
    """The layers whose activations have no tokens: the convolutions the ranking recorded
    from the model (:func:`measure`, :func:`layer_sensitivity`); for a ranking without that
    record (one built by hand), the layers whose weight state is more than 2-D."""
    if "convolutions" in sens.info:
        return set(sens.info["convolutions"])
    return {layer for layer, rs in calibration.states.items()
            if len(getattr(rs.get("weight"), "shape", None) or ()) > 2}


def keep_float(calibration: Calibration, sens: Sensitivity, n: int, *,
               mode: str | None = None) -> Calibration:
    """A copy of ``calibration`` whose ``n`` most sensitive activations (input / output
    roles, ranked by ``sens``; those already dynamic do not count) are not statically
    quantized: left in float (``mode="float"``) or quantized per token at run time in the same
    format (``"dynamic"``; a block-scale format such as NVFP4 keeps its blocks, its global
    scale then from each call too; a convolution's, with no tokens, float and a warning: a
    convolution as ``sens.info["convolutions"]`` names them, which :func:`measure` and
    :func:`layer_sensitivity` read from the model; a ranking without it, by a weight state
    of more than 2 dims). Weights are kept, and so is a KV cache's key / value (a runtime
    quantizes the pair or none; a ranking's key / value rows are passed over). A fused
    group's shared input (q / k / v, gate / up: one input of the runtime's fused layer)
    counts once and falls back whole: a fused layer runs one scheme
    (``info["keep_float"]["tensors"]`` lists every member); so do the gate / up (w13) inputs, and
    the down (w2) inputs, of all experts of one MoE module. Their report rows and histograms go (the
    report lists them apart); the rest, smoothing included, is the calibration's. On a calibration
    with a fallback already, this one adds to it, in its ``mode`` (the default there; else
    ``"float"``; another is refused: ``info["keep_float"]`` then counts and lists both)."""
    for arg, value, kind in (("calibration", calibration, Calibration),
                             ("sens", sens, Sensitivity)):  # not an AttributeError inside
        if not isinstance(value, kind):
            raise TypeError(f"keep_float: {arg} must be a {kind.__name__}, got "
                            f"{type(value).__name__}")
    n = count_arg("keep_float", n)
    earlier = calibration.info.get("keep_float") or {"n": 0, "mode": None, "tensors": []}
    if mode is None:  # the earlier fallback's
        mode = earlier["mode"] if earlier["tensors"] else "float"
    if mode not in FALLBACK_MODES:
        raise ValueError(f"keep_float: mode must be one of {FALLBACK_MODES}, got {mode!r}")
    if earlier["tensors"] and earlier["mode"] != mode:  # info / the report: one mode for all
        raise ValueError(f"keep_float: the calibration's earlier fallback runs "
                         f"{earlier['mode']!r}; a second one must too, got mode={mode!r}")
    static = set(_static_activations(calibration))
    together = _shared_inputs(calibration)
    picks: dict[tuple[tuple[str, str], ...], None] = {}  # in ranking order, O(1) lookups
    for r in sens.rows:
        key = (r["layer"], r["role"])
        unit = together.get(key, (key,))
        if key in static and unit not in picks and len(picks) < n:
            picks[unit] = None
    if len(picks) < n:  # fewer than asked: say so, not a silent smaller fallback
        warnings.warn(f"keep_float: {n} activations asked for, {len(picks)} kept float: the "
                      f"ranking holds only {len(picks)} of the calibration's static "
                      f"activations (a ranking of weights only, or of a KV cache's key / "
                      f"value, has none)", stacklevel=outside_quantscope())
    chosen = [key for unit in picks for key in unit if key in static]
    states = {layer: dict(roles) for layer, roles in calibration.states.items()}
    convs = _convolutions_of(sens, calibration)
    for layer, role in chosen:
        new = _fallback_state(states[layer][role], mode, layer in convs)
        if new is None and mode == "dynamic":  # calibrate refuses per token on a conv
            warnings.warn(f"keep_float: layer {layer!r} {role} is a convolution's, whose "
                          f"[N, C, *spatial] has no tokens to quantize per token: kept in "
                          f"float (mode='dynamic')", stacklevel=outside_quantscope())
        if new is None:
            del states[layer][role]
        else:
            states[layer][role] = new
    states = {layer: roles for layer, roles in states.items() if roles}
    # a second fallback adds to the first: info and the report list every tensor taken out
    info = dict(calibration.info, keep_float={
        "n": earlier["n"] + len(picks), "mode": mode,
        "tensors": list(earlier["tensors"]) + [f"{a} {b}" for a, b in chosen]})
    # the report describes what apply() runs: the static rows of the tensors taken out go
    # (their calibration-time samples are gone: a dynamic one's figures are not known);
    # every other field (smoothing, ...) is the calibration's own
    out = set(chosen)
    return replace(calibration, states=states, info=info,
                   stats=[r for r in calibration.stats if (r["layer"], r["role"]) not in out],
                   histograms={k: h for k, h in calibration.histograms.items() if k not in out})


def _shared_inputs(calibration: Calibration) -> dict[tuple[str, str], tuple]:
    """``(layer, "input") -> every member's (layer, "input")`` of the inputs the runtime holds
    once: a fused group's shared input (``info["fusion_groups"]``), and the gate / up (w13)
    or the down (w2) inputs of all the experts of one experts module (vLLM's fused MoE: one
    input scale per slot, one scheme: :func:`~quantscope.exporters.moe_slots.expert_slot`)."""
    units = [[(layer, "input") for layer in g["layers"]]
             for g in calibration.info.get("fusion_groups", ()) if g.get("input") == "shared"]
    slots: dict[tuple[str, str], list] = {}
    for layer, roles in calibration.states.items():
        slot = expert_slot(layer)
        if slot is not None and "input" in roles:
            slots.setdefault(slot, []).append((layer, "input"))
    out: dict[tuple[str, str], tuple] = {}
    for members in units + list(slots.values()):  # an expert's gate / up group joins its slot
        unit = tuple(dict.fromkeys(m for key in members for m in out.get(key, (key,))))
        out.update(dict.fromkeys(unit, unit))
    return out


def check_fallback(n, mode, sequential: bool = False) -> None:
    """:func:`~.session.calibrate_many`'s ``keep_float`` / ``fallback``, before any batch runs."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"calibrate: keep_float must be a non-negative integer, got {n!r}")
    if mode not in FALLBACK_MODES:
        raise ValueError(f"calibrate: fallback must be one of {FALLBACK_MODES}, got {mode!r}")
    if n and sequential:
        raise ValueError("calibrate: keep_float needs the whole model's forward (its ranking "
                         "runs one); with sequential=..., call keep_float() on the result")


def fall_back(model: nn.Module, batch, calibration: Calibration, n: int,
              mode: str, ranker=None) -> Calibration:
    """:func:`keep_float` of ``n`` with the ranking of :func:`layer_sensitivity` on ``batch`` (what
    ``calibrate(..., outliers=Outliers(keep_float=n, fallback=mode))`` does after calibrating).
    ``ranker``: ``callable(rank) -> Sensitivity`` that gets the ranking from where ``rank()``
    runs (across ranks, on the one rank whose batch every rank ranks on: ``batch`` may then
    be None here); None runs ``rank()`` here."""
    if batch is None and ranker is None:
        raise ValueError("calibrate: keep_float needs a batch to rank the activations on, "
                         "and batches is empty")
    if not any(role == "input" for _, role in _static_activations(calibration)):
        # nothing the ranking sees (weight-only, dynamic or static-output schemes): no
        # forward, and no silent smaller fallback
        warnings.warn(f"calibrate: Outliers(keep_float={n}) ranks only static inputs, and the "
                      f"calibration {calibration.label!r} quantizes none (weight-only, "
                      f"dynamic, or static outputs): no activation kept float. Rank the "
                      f"outputs yourself: "
                      f"quantscope.keep_float(calibration, quantscope.sensitivity(..., "
                      f"roles=('output',)), n)", stacklevel=outside_quantscope())
        return keep_float(calibration, Sensitivity([]), 0, mode=mode)
    rank = lambda: _fallback_ranking(model, batch, calibration, n)
    return keep_float(calibration, rank() if ranker is None else ranker(rank), n, mode=mode)


def _fallback_ranking(model: nn.Module, batch, calibration: Calibration, n: int) -> Sensitivity:
    """:func:`fall_back`'s ranking: the static inputs only (keep_float takes out
    activations, never weights)."""
    try:
        return _layer_ranking(model, [batch], calibration, ("input",))
    except _NothingRanked:
        raise ValueError(f"calibrate: Outliers(keep_float={n}) ranks the static inputs of "
                         f"Linear layers (a 2-D weight) and of Conv1d / 2d / 3d (not "
                         f"transposed); the calibration quantizes none. Rank them yourself: "
                         f"quantscope.keep_float(calibration, quantscope.sensitivity(...), "
                         f"n)") from None


def _macs(model: nn.Module, layer: str) -> int:
    w = getattr(_module(model, layer, "fallback_curve"), "weight", None)
    return 0 if w is None else w.numel()


def fallback_curve(model: nn.Module, calibration: Calibration, sens: Sensitivity, evaluate,
                   ns=(0, 1, 2, 4, 8, 16), *, mode: str | None = None) -> list[dict]:
    """Quality over the fallback budget: for each ``n``, ``evaluate(model)`` (higher or lower
    is better, as you define it) with :func:`keep_float` of ``n`` applied (its ``mode``, by
    default an earlier fallback's, else ``"float"``), and the share of the
    quantized layers' multiply-adds (weight elements) whose activations left static int (a
    layer counted once; an earlier fallback's too). Rows ``{"n", "quality", "float_macs_pct",
    "tensors"}``. ``evaluate`` returns a number (or a one-element tensor); a NaN or inf is
    kept in its row with a warning (the rows' JSON then is not strict JSON)."""
    of = lambda tensors: {t.rsplit(" ", 1)[0] for t in tensors}  # "layer role" -> layer
    earlier = of((calibration.info.get("keep_float") or {}).get("tensors", ()))
    layers = {layer for layer, _ in _static_activations(calibration)} | earlier
    with _expert_views(model):  # MoE experts' layers are their views; apply() attaches its own
        macs = {layer: _macs(model, layer) for layer in layers}
    total = sum(macs.values()) or 1
    out = []
    for n in ns:
        c = keep_float(calibration, sens, n, mode=mode)
        with c.apply(model):
            q = scalar("fallback_curve", "evaluate", evaluate(model), f" for n={n}")
        if not math.isfinite(q):  # a broken model's inf perplexity can be a fair answer
            warnings.warn(f"fallback_curve: evaluate returned {q} for n={n}; the row keeps it "
                          f"(its JSON is not strict: NaN / Infinity)",
                          stacklevel=outside_quantscope())
        kept = c.info["keep_float"]["tensors"]
        fell = sum(macs[layer] for layer in of(kept))
        out.append({"n": n, "quality": q, "float_macs_pct": round(100 * fell / total, 2),
                    "tensors": kept})
    return out


def plot_fallback(rows: list[dict], path, quality_label: str = "quality") -> None:
    """The Pareto curve of :func:`fallback_curve`: quality against the share of multiply-adds
    with float (or dynamic) activations."""
    from ..results.plots import figure

    fig = figure(figsize=(5, 3.5))
    ax = fig.subplots()
    xs = [r["float_macs_pct"] for r in rows]
    ax.plot(xs, [r["quality"] for r in rows], "o-")
    for r in rows:
        ax.annotate(f"N={r['n']}", (r["float_macs_pct"], r["quality"]), fontsize=7,
                    textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("multiply-adds with float activations (%)")
    ax.set_ylabel(quality_label)
    _save(fig, path)
