"""The importance-weighted weight search (imatrix) as a weight candidate of ``auto``.

llama.cpp's imatrix and llm-compressor's ``imatrix_mse`` weight each input channel's error
in a weight's range search by that channel's mean ``x^2`` over the calibration activations
(:func:`~quantscope.estimators.weighted.imatrix_range`). The observers see a weight before
any activation, so the search cannot run in the calibration pass itself:
:class:`InputImportance` gathers the mean ``x^2`` with hooks during that pass, and
:func:`imatrix_config` then searches every weight whose quantizer it can take. ``auto``'s role
step (:func:`.auto.choose_roles`) tries the result like any other weight candidate.

On MiniLM W4A8 (int4 groups of 128) it is the weight choice that keeps the output closest to
float, and the one with the best Lee r (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from ... import comm as qd
from ..._checks import outside_quantscope
from ...estimators.weighted import check_importance
from ...stats.minmax import zero_non_finite
from ..results.report import tensor_stats
from ..results.result import Calibration
from ..run.batches import input_name, module_input
from ..run.finish import stats_row
from ..run.observe import in_pass
from ..structure.conv1d import is_conv1d
from ..structure.fusion import shares_weight_scale
from .layer_choice import IMATRIX, imatrix_state

__all__ = ["InputImportance", "imatrix_config", "imatrix_rows"]


class InputImportance:
    """Mean ``x^2`` per input channel of each of ``layers`` (Linear-like: ``in_features``,
    a 2-D weight ``[out, in]``, or transformers' Conv1D, weight ``[in, out]``), gathered by
    forward pre-hooks (from construction to :meth:`remove`) over the floating-point rows of
    the calibration pass's forwards (:func:`.observe.in_pass`), and of those run inside
    :meth:`counting`. Other modules get none (as llm-compressor's imatrix skips modules
    without ``in_features``): an Embedding's input is token ids, whose square weighs nothing.
    The layers of ``ignore`` read NaN / inf as zero, as their observers do with
    ``non_finite="ignore"`` (elsewhere one inf makes the layer's importance unusable)."""

    def __init__(self, model: nn.Module, layers, ignore=()):
        modules = dict(model.named_modules())
        self.sums, self.rows, self.handles, self.live = {}, {}, [], False
        self.ignore = frozenset(ignore)
        for name in layers:
            w = getattr(modules.get(name), "weight", None)
            width = _in_width(modules.get(name), w)
            if width is not None:
                self.sums[name] = torch.zeros(width, dtype=torch.float64)
                self.rows[name] = 0
                self.handles.append(modules[name].register_forward_pre_hook(
                    self._hook(name, input_name(modules[name])), with_kwargs=True))

    def _hook(self, name, keyword):
        def hook(module, args, kwargs):
            x = module_input(args, kwargs, keyword)
            if (not (self.live or in_pass()) or not isinstance(x, torch.Tensor) or x.dim() < 1
                    or not x.is_floating_point() or x.shape[-1] != self.sums[name].numel()
                    or x.numel() == 0):  # nothing to count (reshape(-1, 0) cannot size it)
                return
            x = x.detach().reshape(-1, x.shape[-1]).float()
            if name in self.ignore:  # the observers' rule (their warning counts them)
                x = zero_non_finite(x)[0]
            if self.sums[name].device != x.device:  # once: sums stay where the inputs are,
                self.sums[name] = self.sums[name].to(x.device)  # no host sync per forward
            self.sums[name] += x.square().sum(0, dtype=torch.float64)
            self.rows[name] += x.shape[0]
        return hook

    @contextlib.contextmanager
    def counting(self):
        """Count the forwards run inside (where the pass ran none: weight-only recipes)."""
        self.live = True
        try:
            yield self
        finally:
            self.live = False

    def seen(self) -> bool:
        """Whether some layer has seen a row."""
        return any(self.rows.values())

    def remove(self) -> None:
        """Stop gathering (the hooks removed); :meth:`means` still answers."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def means(self, distributed: bool = False, group=None) -> dict[str, torch.Tensor]:
        """``{layer: float32 [in]}`` on the CPU (the sums, kept on the inputs' device during
        the pass, are copied once here) for each layer that saw a row (the hooks removed). With
        ``distributed``, the sums and row counts of every rank of ``group`` together (a
        collective: every rank calls it)."""
        self.remove()
        names = list(self.sums)
        self.sums = {n: t.cpu() for n, t in self.sums.items()}
        if distributed and qd.is_distributed(group) and names:
            flat = torch.cat([*(self.sums[n] for n in names),
                              torch.tensor([float(self.rows[n]) for n in names],
                                           dtype=torch.float64)])
            flat = flat.to(qd.group_device(group))
            qd.all_reduce(flat, torch.distributed.ReduceOp.SUM, group)
            flat = flat.cpu()
            rows, at = flat[-len(names):], 0
            for n, r in zip(names, rows.tolist()):
                k = self.sums[n].numel()
                self.sums[n], self.rows[n], at = flat[at:at + k], int(r), at + k
        return {n: (self.sums[n] / self.rows[n]).float() for n in names if self.rows[n]}


def _in_width(module, w) -> int | None:
    """A Linear-like module's input width (its weight's ``[out, in]``, a Conv1D's ``[in, out]``)."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    if is_conv1d(module):
        return w.shape[0]
    return w.shape[1] if getattr(module, "in_features", None) == w.shape[1] else None


def imatrix_config(model: nn.Module, base: Calibration, importance: dict) -> Calibration | None:
    """``base`` with each weight the importance-weighted search can take replaced by the
    search's state (``observer="imatrix"``; the others kept), without report rows (those of
    a configuration ``auto`` keeps: :func:`imatrix_rows`); None where no weight changed.
    Left as they are: weights without importance (a layer that saw no rows), not 2-D,
    dynamic, or with a scale a fused runtime layer shares across its members
    (:func:`~.fusion.shares_weight_scale`: NVFP4's global scale, fp8 per-tensor weights),
    which a search per layer would break."""
    modules = dict(model.named_modules())
    states, changed = {}, False
    for layer, roles in base.states.items():
        st, imp = roles.get("weight"), importance.get(layer)
        w = getattr(modules.get(layer), "weight", None)
        states[layer] = dict(roles)
        if (st is None or imp is None or st.dynamic or st.qparams is None
                or not isinstance(w, torch.Tensor) or w.dim() != 2
                or shares_weight_scale(st.spec)):
            continue
        try:  # NaN / inf inputs not ignored, or an x^2 past float32: not a layout, said
            check_importance(f"auto: layer {layer!r} (its inputs' mean x^2)", imp)
        except ValueError as e:
            warnings.warn(f"{e}: no imatrix weight candidate for this layer",
                          stacklevel=outside_quantscope())
            continue
        try:
            new = imatrix_state(w.detach(), imp, st, is_conv1d(modules[layer]))
        except ValueError:  # a layout the weighted search cannot take
            continue
        states[layer]["weight"], changed = new, True
    return (Calibration(base.recipe, states, base.label, writer_rank=base.writer_rank)
            if changed else None)


def imatrix_rows(model: nn.Module, config: Calibration, base: Calibration) -> list[dict]:
    """The weight report rows of ``config`` (:func:`imatrix_config` of ``base``): made for its
    imatrix weights (only for the configuration ``auto`` keeps: a weight-sized QDQ each),
    ``base``'s for the weights the search left as they were (convolutions, embeddings)."""
    modules = dict(model.named_modules())
    rows, searched = [], set()
    for layer, roles in config.states.items():
        st = roles.get("weight")
        if st is not None and st.observer == IMATRIX:
            searched.add(layer)
            rows.append(stats_row(layer, "weight", st,
                                  tensor_stats(modules[layer].weight.detach(), st)))
    return rows + [row for row in base.stats
                   if row["role"] == "weight" and row["layer"] not in searched]
