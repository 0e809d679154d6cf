"""SmoothQuant's channel ranges (:func:`channel_ranges`): ``max - min`` of every input channel
of each mapping's balanced Linears, in a forward that also checks each mapping's data flow
(:class:`_Flow`). Across ranks they are reduced so that every rank holds what one process
given all the ranks' batches measures: a channel NaN on any rank is NaN (gloo's MIN / MAX
keeps a NaN or drops it by the ranks' order), and a mapping no rank ran has no range, as
where one process ran none.
"""

from __future__ import annotations

import math
import weakref
from contextlib import nullcontext

import torch
from torch import nn

from ... import comm as qd
from ...stats.minmax_layouts import column_minmax
from ..run.batches import eval_mode, forward_batch, input_name, module_input

__all__ = ["channel_ranges"]


@torch.no_grad()
def channel_ranges(model: nn.Module, batches, mappings: list, distributed: bool = False,
                   group=None, flow: dict | None = None) -> dict[str, torch.Tensor]:
    """``max - min`` of every input channel of each mapping's balanced Linears
    (:class:`~.smooth.Mapping` s) over ``batches`` (one forward each, in eval mode); a
    mapping that never ran has none. With ``distributed`` inside a process group, the range
    over every rank's batches (every rank must call it then). ``flow``, a dict, receives
    ``{previous: why}`` for each mapping whose data flow does not fit (:class:`_Flow`), in
    the same forward."""
    modules = dict(model.named_modules())
    lo, hi = {}, {}
    tracer = _Flow(modules, mappings) if flow is not None else None

    def hook(key, keyword):
        def f(_module, args, kwargs):
            x = module_input(args, kwargs, keyword)
            if not isinstance(x, torch.Tensor) or not x.numel():
                return
            a, b = column_minmax(x.detach().reshape(-1, x.shape[-1]).float().contiguous())
            lo[key] = a if key not in lo else torch.minimum(lo[key], a)
            hi[key] = b if key not in hi else torch.maximum(hi[key], b)
        return f

    handles = [modules[m.balance[0]].register_forward_pre_hook(
        hook(m.previous, input_name(modules[m.balance[0]])), with_kwargs=True)
        for m in mappings]
    handles += tracer.hooks() if tracer is not None else []
    shared = distributed and qd.is_distributed(group)
    local = qd.LocalError()  # shared: a failed forward is raised on every rank, after the
    with local if shared else nullcontext():  # reduction (not left waiting in it)
        try:
            with eval_mode(model):  # as the calibration pass (dropout: random ranges)
                for batch in batches:
                    if tracer is not None:
                        tracer.reset()
                    forward_batch(model, batch)
        finally:
            for h in handles:
                h.remove()
    why = tracer.why if tracer is not None else {}
    if shared:  # every rank must smooth alike
        widths = [modules[m.balance[0]].in_features for m in mappings]
        _reduce(mappings, widths, lo, hi, why if tracer is not None else None, local.error,
                group)
    if flow is not None:
        flow.update(why)
    return {k: hi[k] - lo[k] for k in hi}


def _reduce(mappings, widths, lo, hi, why, error, group) -> None:
    """``lo`` / ``hi`` (and ``why``, where the data flow was traced) in place, over every
    rank, in one MIN all_reduce: per mapping its mins, its negated maxes and -1 per channel
    where NaN came; with ``why``, 1 per mapping whose data flow fits (0: not); last, -1 where
    this rank's forward failed (``error``: raised on every rank, after the reduction)."""
    parts = []
    for m, w in zip(mappings, widths):
        a = lo.get(m.previous, torch.full((w,), math.inf)).cpu()  # the identities: no call
        b = hi.get(m.previous, torch.full((w,), -math.inf)).cpu()
        parts += [a, -b, -(a.isnan() | b.isnan()).float()]
    fits = [] if why is None else [torch.tensor([float(m.previous not in why) for m in mappings])]
    flat = torch.cat(parts + fits + [torch.tensor([0.0 if error is None else -1.0])])
    flat = flat.to(qd.group_device(group))
    qd.all_reduce(flat, torch.distributed.ReduceOp.MIN, group)
    *parts, failed = flat.cpu().split([w for w in widths for _ in range(3)]
                                      + [len(mappings)] * len(fits) + [1])
    qd.raise_on_all(error, bool(failed < 0), "SmoothQuant's ranges", group, same_type=True)
    for k, m in enumerate(mappings):
        a, b, nan = parts[3 * k], -parts[3 * k + 1], parts[3 * k + 2] < 0
        if not nan.any() and bool((b < a).all()):  # the identities: no rank ran it
            continue
        lo[m.previous], hi[m.previous] = a.masked_fill(nan, math.nan), b.masked_fill(nan, math.nan)
        if fits and not parts[-1][k] and m.previous not in why:
            why[m.previous] = "its data flow does not fit on another rank"


def _same(x: torch.Tensor, out: torch.Tensor) -> bool:
    """``x`` is ``out``, or holds the same values bit for bit (a copy, a view)."""
    return x is out or (x.numel() == out.numel() and x.dtype == out.dtype
                        and x.device == out.device and torch.equal(x.reshape(-1),
                                                                   out.reshape(-1)))


class _Flow:
    """Who reads each mapping's ``previous`` output, by hooks in the ranges forward. Matching
    names promise nothing: Cohere's and Phi's ``input_layernorm`` feeds the MLP too, OLMo2's
    ``post_attention_layernorm`` normalizes the attention output while the MLP reads the
    residual. Scaling such a norm changes the function, so a mapping is kept only if every
    balanced Linear reads exactly that output (a norm's; a Linear's ``previous`` is checked
    with its parent on the probe) and no other Linear reads it."""

    def __init__(self, modules: dict[str, nn.Module], mappings: list):
        self.modules = modules
        self.maps = {m.previous: m for m in mappings}
        self.owner = {b: m.previous for m in mappings for b in m.balance
                      if not isinstance(modules[m.previous], nn.Linear)}
        self.scope = {m.previous: m.prefix for m in mappings}
        self.why: dict[str, str] = {}
        self.reset()

    def reset(self) -> None:
        # held: the outputs of one decoder layer only (the copies compared bit for bit; all
        # layers' would keep every activation alive); live: every output, by identity
        self.held: dict[str, torch.Tensor] = {}
        self.live: dict[int, tuple[str, weakref.ref]] = {}

    def hooks(self) -> list:
        hs = [self.modules[p].register_forward_hook(self._wrote(p)) for p in self.maps]
        return hs + [mod.register_forward_pre_hook(self._read(n, input_name(mod)), with_kwargs=True)
                     for n, mod in self.modules.items() if isinstance(mod, nn.Linear)]

    def _wrote(self, prev: str):
        def f(_module, _args, out):
            scope = self.scope[prev]
            self.held = {p: t for p, t in self.held.items() if self.scope[p] == scope}
            if isinstance(out, torch.Tensor):
                self.held[prev] = out
                self.live[id(out)] = (prev, weakref.ref(out))
        return f

    def _sources(self, x) -> set[str]:
        """The mappings whose ``previous`` output ``x`` is."""
        if not isinstance(x, torch.Tensor):
            return set()
        hit = self.live.get(id(x))
        found = {hit[0]} if hit is not None and hit[1]() is x else set()
        return found | {p for p, t in self.held.items() if p not in found and _same(x, t)}

    def _read(self, name: str, keyword: str | None):
        def f(_module, args, kwargs):
            read = self._sources(module_input(args, kwargs, keyword))
            for prev in read:
                if name not in self.maps[prev].balance:
                    self.why.setdefault(prev, f"its output also feeds {name}, which the "
                                              f"mapping does not balance")
            own = self.owner.get(name)
            if own is not None and own not in read:
                self.why.setdefault(own, f"the balanced layer {name} reads another tensor "
                                         f"than its output")
        return f
