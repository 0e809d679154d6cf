"""Fusion groups: layers a runtime runs as one, so they must share their scales.

vLLM (and SGLang, TensorRT-LLM) fuse the Linear layers that read the same input into
one GEMM: ``q_proj`` / ``k_proj`` / ``v_proj`` into ``qkv_proj``, ``gate_proj`` /
``up_proj`` into ``gate_up_proj``, DeepSeek's ``q_a_proj`` / ``kv_a_proj_with_mqa``.
A fused layer has one NVFP4 global scale, one static input scale, and (vLLM's FP8
path) one per-tensor weight scale: see ``docs/runtime-fusion.md``.

Groups are **found, not listed**: :func:`find_groups` runs one forward with hooks and
groups the layers whose input is the same tensor (the same object, or a view of the
same data) among the last few inputs seen, within one parent module (a runtime fuses one
module's shards: every expert reads the same tensor under ``MoE(all_experts=True)``, and
T5's decoder blocks all read the encoder's output). An expert of a ``ModuleList`` of
experts that the detection batch routed no token to takes its siblings' groups. A recipe
adds groups
(``Recipe.fuse``: tuples of name patterns, members bucketed by their parent module) and
splits members out (``Recipe.split``).

Sharing (done by the session): a group's static / local input role is one slot that
observes the members' inputs once each (the same tensor is observed once), so its
statistics are the group's merged statistics; a group's weight role, where the runtime
shares a weight scale (:func:`shares_weight_scale`), is observed on the members'
weights concatenated along the output dimension by one observer, and the qparams are
split back per member (:func:`split_state`) -- exactly what the runtime's fused
tensor holds, and search observers then minimise the group's total error.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import replace

import torch
from torch import nn

from ..._checks import version_of
from ...exporters.moe_slots import expert_index
from ...layout import Block, Channel, Group, Tensor, Tile
from ..recipe_dict import matches
from ..results.result import RoleState
from ..run.batches import (
    eval_mode,
    forward_batch,
    input_name,
    map_tensors,
    module_input,
    peek,
)
from .conv1d import is_conv1d
from .moe import expert_items, is_expert_list

__all__ = ["detect", "find_groups", "join_weights", "one_fusion", "peek", "shares_weight_scale",
           "split_state"]

#: shards that read one tensor but that the runtime runs apart: DeepSeek's MLA without a query
#: LoRA (``q_lora_rank=None``), where vLLM splits ``q_proj`` across tensor-parallel ranks and
#: replicates ``kv_a_proj_with_mqa`` (it fuses only ``q_a_proj`` with it)
APART = (frozenset({"q_proj", "kv_a_proj_with_mqa"}),)

#: how many distinct recent inputs a layer's input is compared with (DeepSeek's
#: ``kv_a_proj_with_mqa`` reads the hidden state after ``q_a_proj`` -> ``q_b_proj`` ran)
WINDOW = 8


def _where(x: torch.Tensor) -> tuple:
    """Which elements ``x`` reads, and how: its data pointer, shape, strides, dtype and
    version (an in-place change between two calls makes a new input; inference tensors,
    what an inference-mode forward makes, keep no version)."""
    return (x.data_ptr(), x.shape, x.stride(), x.dtype,
            version_of(x))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same tensor object, or a view of the same data with the same shape and strides.
    An empty tensor is only itself: every empty tensor has data pointer 0 (an MoE expert
    given no token, and its down_proj, would read "the same" input)."""
    return a is b or (a.numel() > 0 and b.numel() > 0 and _where(a) == _where(b))


def same_input(a, b) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same(a, b)


def mark(x: torch.Tensor):
    """What :func:`seen` later compares with ``x``, holding no reference to its memory.

    A weak reference to ``x``'s storage, not to ``x``: members given fresh views of one
    tensor (``q(x.view(..))``, ``k(x.view(..))``) free the first view before the next runs,
    while the storage lives on with ``x``; and memory cannot be reused while its storage
    lives, so a live storage with the same :func:`_where` is the same data. A strong
    reference would keep every group's input alive until its next call, in the next batch.
    An empty input (observing it changes nothing) is never marked."""
    if x.numel() == 0:
        return None
    return weakref.ref(x.untyped_storage()), _where(x)


def seen(last, x: torch.Tensor) -> bool:
    """Whether ``x`` is the tensor :func:`mark` made ``last`` from (by :func:`_same`'s rule)."""
    return (last is not None and x.numel() > 0 and last[0]() is not None
            and last[1] == _where(x))


def _recall(x: torch.Tensor) -> tuple:
    """What :func:`_recalls` compares with a later input, holding no reference to ``x``'s
    memory: a weak reference to ``x`` itself (an empty tensor is only itself) and
    :func:`mark`'s (its storage's, and :func:`_where`)."""
    return weakref.ref(x), mark(x)


def _recalls(ref: tuple, x: torch.Tensor) -> bool:
    """Whether ``x`` is the tensor :func:`_recall` made ``ref`` from, by :func:`_same`'s
    rule (a freed input is never recalled: nothing can pass it again)."""
    return ref[0]() is x or seen(ref[1], x)


def find_groups(model: nn.Module, batch, names) -> list[tuple[str, ...]]:
    """Groups (2+ members, in call order) of the modules ``names`` of one parent module whose
    forward input is the same tensor in one forward of ``batch``."""
    names = list(names)
    if batch is None or len(names) < 2:
        return []
    # weak references (:func:`_recall`): strong ones would keep WINDOW activations alive
    recent: list[tuple[tuple, list[str]]] = []
    order: list[list[str]] = []

    def hook_for(name):
        key = input_name(model.get_submodule(name))  # the input calibration observes

        def pre(module, args, kwargs):
            x = module_input(args, kwargs, key)
            if not isinstance(x, torch.Tensor):
                return
            for ref, members in recent:
                if _recalls(ref, x):
                    if name not in members:
                        members.append(name)
                    return
            members = [name]
            order.append(members)
            recent.append((_recall(x), members))
            del recent[:-WINDOW]  # a freed input keeps its place: the window is as it was
        return pre

    handles = []
    try:
        for name in names:
            handles.append(model.get_submodule(name).register_forward_pre_hook(
                hook_for(name), with_kwargs=True))
        with eval_mode(model), torch.inference_mode():
            # a copy: a forward that changes its input in place leaves the batch as the
            # observed pass would, which then sees it untouched
            forward_batch(model, map_tensors(torch.clone, batch))
    finally:
        for h in handles:
            h.remove()
        recent.clear()
    grouped, groups = set(), []
    for members in order:  # a module called twice keeps its first group
        members = [m for m in members if m not in grouped]
        grouped.update(members)
        groups += _by_parent(members)
    return groups + _sibling_groups(model, groups, names)


def one_fusion(recipes: dict) -> dict:
    """``recipes`` (``{label: Recipe}``), refused unless they share their fusion options: the
    pass finds one set of groups for them all (checked before any forward)."""
    opts = {(r.fusion, r.fuse, r.split) for r in recipes.values()}
    if len(opts) > 1:
        raise ValueError(f"calibrate_many: the recipes' fusion options (fusion, fuse, split) "
                         f"differ: {sorted(map(str, opts))}; calibrate them separately")
    return recipes


def detect(model: nn.Module, batches, recipes: dict, slots) -> tuple:
    """``(batches, groups)``: the fusion groups of the layers with a weight or input slot
    (``(layer, role)`` keys), found by one forward of the first batch (:func:`find_groups`)
    and edited by the recipes' ``fuse`` / ``split``, which every recipe must share; batches
    unconsumed."""
    first = next(iter(one_fusion(recipes).values()))
    on, fuse, split = first.fusion, first.fuse, first.split
    if not on:
        return batches, []
    modules = dict(model.named_modules())
    names = [n for n in modules if (n, "weight") in slots or (n, "input") in slots]
    names = [n for n in names if _gemm(modules[n])]
    first, batches = peek(batches)
    return batches, edit_groups(find_groups(model, first, names), names, modules, fuse, split)


def _gemm(module: nn.Module) -> bool:
    """Whether ``module`` multiplies its input by a Linear's ``[out, in]`` weight: a runtime
    fuses only those (not an embedding's lookup, whose ids other tables may read too)."""
    w = getattr(module, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and not is_conv1d(module)
            and not isinstance(module, (nn.Embedding, nn.EmbeddingBag)))


def _expert_of(model: nn.Module, name: str) -> str | None:
    """The item of a ``ModuleList`` / ``ModuleDict`` of experts (``...experts.<e>``,
    ``...experts.expert_<e>``) that holds ``name``."""
    parts = name.split(".")
    for k in range(len(parts) - 1, 0, -1):
        owner = ".".join(parts[:k - 1])
        if (k > 1 and expert_index(parts[k - 1]) is not None
                and is_expert_list(owner, model.get_submodule(owner))):
            return ".".join(parts[:k])
    return None


def _sibling_groups(model: nn.Module, groups, names) -> list[tuple[str, ...]]:
    """The groups found in one expert of a ``ModuleList`` / ``ModuleDict`` of experts, given
    (by relative name) to its siblings that have those layers and no group of theirs: the
    detection forward runs only the experts the first batch routes tokens to, and the runtime
    fuses every expert's ``w1`` / ``w3`` alike."""
    names, taken, out = set(names), {m for g in groups for m in g}, []
    for group in groups:
        item = _expert_of(model, group[0])
        if item is None:
            continue
        owner = item.rpartition(".")[0]
        rel = [m[len(item):] for m in group]
        for _, key, _ in expert_items(model.get_submodule(owner)):
            sib = tuple(f"{owner}.{key}{r}" for r in rel)
            if all(m in names and m not in taken for m in sib):
                out.append(sib)
                taken.update(sib)
    return out


def _by_parent(members: list[str]) -> list[tuple[str, ...]]:
    """``members`` split by parent module (in call order), groups of 2+ kept: a runtime
    fuses the shards of one module (one attention's q / k / v, one MLP's or one expert's
    gate / up), never layers of two modules that read one tensor (every expert under
    ``MoE(all_experts=True)``, T5's cross-attention k / v of every decoder block reading the
    encoder's output, Falcon's parallel attention and MLP, a router beside its experts); nor
    the pairs of :data:`APART`."""
    parts: dict = {}
    for m in members:
        parts.setdefault(_parent(m), []).append(m)
    return [tuple(p) for p in parts.values()
            if len(p) > 1 and frozenset(m.rpartition(".")[2] for m in p) not in APART]


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def edit_groups(groups, names, modules: dict, fuse=(), split=()) -> list[tuple[str, ...]]:
    """``groups`` with the recipe's edits: ``fuse`` entries (tuples of patterns) join the
    matching modules of each parent module into one group (taking them out of any found
    group); ``split`` patterns take modules out of their groups."""
    groups = [list(g) for g in groups]
    for patterns in fuse:
        patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
        by_parent: dict[str, list[str]] = {}
        for n in names:
            if any(matches(p, n, modules[n]) for p in patterns):
                by_parent.setdefault(_parent(n), []).append(n)
        for members in by_parent.values():
            if len(members) < 2:
                continue
            groups = [[m for m in g if m not in members] for g in groups]
            groups.append(members)
    for p in split:
        groups = [[m for m in g if not matches(p, m, modules[m])] for g in groups]
    return [tuple(g) for g in groups if len(g) > 1]


def shares_weight_scale(spec) -> bool:
    """Whether a runtime fusing the group gives its weights one shared scale: a global
    scale (NVFP4 and any two-level tensor-group scale) always; a per-tensor scale for a
    float format (vLLM's FP8 path re-quantizes the shards to the largest scale). An int
    per-tensor weight scale is widened to per-channel by vLLM's INT8 path: kept per layer."""
    if spec.scale.has_global_scale:
        return True
    return isinstance(spec.layout, Tensor) and spec.format.is_float


def _row_units(layout, ndim: int) -> tuple[int, int] | None:
    """``(qparam axis, rows)``: the axis of the qparam grid that runs along the weight's
    rows (dim 0, the dim a fused layer concatenates) and how many rows one unit spans;
    ``None`` where one unit spans every row (a channel of another axis) or the units'
    column order is the member's own (act-order groups: spec equality ignores ``g_idx``)."""
    if isinstance(layout, Channel):
        return (0, 1) if layout.axis % ndim == 0 else None
    if isinstance(layout, (Group, Block)):
        if getattr(layout, "order", None) is not None:
            return None
        return (-1, layout.size) if layout.axis % ndim == 0 else (0, 1)  # (*rest, runs)
    if isinstance(layout, Tile):
        return (-2, layout.rows) if ndim == 2 else (0, 1)  # leading dims: tiles of their own
    return None


def _joined(shapes) -> tuple[int, ...]:
    return (sum(s[0] for s in shapes), *shapes[0][1:])


def splittable(spec, shapes=None) -> bool:
    """Whether the qparams of the members' weights concatenated (their ``shapes``) split
    back exactly into each member's: no unit holds rows of two members, so every member
    but the last ends on a unit boundary (a tile's or a row-run's rows divide its rows; the
    last one's padding is its own) and each member takes the layout alone. Without
    ``shapes``: whether that holds for any split of 2-D weights (units of one row)."""
    lay = spec.layout
    if isinstance(lay, Tensor):
        return True
    ndim = 2 if shapes is None else len(shapes[0])
    unit = _row_units(lay, ndim)
    if unit is None or shapes is None:
        return unit is not None and unit[1] == 1
    if any(s[0] % unit[1] for s in shapes[:-1]):
        return False
    try:  # a Group of rows does not pad: each member's rows must be whole groups
        for s in (*shapes, _joined(shapes)):
            lay.qparam_shape(tuple(s))
    except ValueError:
        return False
    return True


def join_weights(modules: list[nn.Module]) -> torch.Tensor:
    """The members' weights as the fused layer holds them: concatenated on the output dim."""
    return torch.cat([m.weight.detach() for m in modules], dim=0)


def _split(t: torch.Tensor | None, grid: tuple[int, ...], axis: int, counts: list[int]
           ) -> list:
    """``t`` (per-unit values of the concatenated weights: the qparam ``grid`` itself, or its
    values flat, unit-major) cut along the grid's ``axis`` into the members' ``counts`` of
    units, each in ``t``'s form; a one-value (per-tensor) ``t`` is every member's."""
    if t is None:
        return [None] * len(counts)
    if t.numel() == 1 or math.prod(grid) == 1:
        return [t.clone() for _ in counts]
    parts = t.reshape(grid).split(counts, axis)
    return [p.clone() if tuple(t.shape) == grid else p.reshape(-1).clone() for p in parts]


def split_state(state: RoleState, shapes: list[tuple[int, ...]]) -> list[RoleState]:
    """The state of the concatenated weights split into one state per member (its rows):
    per-unit values cut along the qparam grid's row axis (a tile grid by tile rows, a
    row-run grid along its last axis), per-tensor ones shared. ``shapes`` must be
    :func:`splittable`. A state with no qparams (a run-time role: ``"local"`` block scales
    under a calibrated global scale) holds per-tensor values only: every member's."""
    lay, qp = state.spec.layout, state.qparams
    if qp is None:
        return [_shared(state, s) for s in shapes]
    if not splittable(state.spec, shapes):
        raise ValueError(f"split_state: {lay} units span rows of two members of shapes "
                         f"{[tuple(s) for s in shapes]}; expected shapes it splits by rows")
    grid = tuple(lay.qparam_shape(_joined(shapes)))
    axis = 0 if isinstance(lay, Tensor) else _row_units(lay, len(shapes[0]))[0]
    counts = [lay.qparam_shape(tuple(s))[axis] for s in shapes]

    def cut(t):
        return _split(t, grid, axis, counts)

    scales, zps, los, his = cut(qp.scale), cut(qp.zero_point), cut(state.lo), cut(state.hi)
    out = []
    for i, shape in enumerate(shapes):
        gs = None if qp.global_scale is None else qp.global_scale.clone()
        member_qp = type(qp)(scales[i].contiguous(), zps[i].contiguous(), gs)
        out.append(replace(state, qparams=member_qp, lo=los[i], hi=his[i], shape=tuple(shape)))
    return out


def _shared(state: RoleState, shape) -> RoleState:
    """A member's copy of a run-time state's per-tensor values (its global amax, range), with
    the member's weight ``shape`` where the state records one (a ``"local"`` weight's)."""
    held = {k: getattr(state, k) for k in ("global_amax", "lo", "hi")}
    many = [k for k, t in held.items() if t is not None and t.numel() != 1]
    if many:
        raise ValueError(f"split_state: a run-time (dynamic={state.dynamic!r}) state holds "
                         f"per-unit {many}; expected per-tensor values, which members share")
    return replace(state, **{k: None if t is None else t.clone() for k, t in held.items()},
                   shape=None if state.shape is None else tuple(shape))
