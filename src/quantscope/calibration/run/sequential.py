"""Sequential (layer-by-layer) calibration: one block of the model in memory at a time.

The model's blocks (the largest ``nn.ModuleList`` of identical modules, e.g. a decoder's
``model.layers``; ``blocks=`` names another) are calibrated one after the other:

1. the model runs on every batch with each block standing in by a pass-through that
   records the call order (:mod:`.block_order`: a chain in any order is followed, anything
   else refused), and the first block's inputs are caught, and every block's other
   arguments, positional and keyword (attention mask, position embeddings: each block its
   own, as Gemma's sliding-window and full-attention layers take different masks), without
   the KV cache;
2. each block is loaded (from ``checkpoint``'s safetensors, memory-mapped, when the model
   is an empty skeleton: :func:`.checkpoint.empty_model`), calibrated over the cached inputs of all
   batches with the ordinary observers (:func:`~.session.calibrate_many` on that block
   alone, its modules keeping their full names), and unloaded; its outputs are the next
   block's inputs;
3. the parts outside the blocks (final norm, ``lm_head`` ...) are calibrated by running the
   model with every block replaced by the last block's cached outputs.

With ``mode="quantized"`` a block is fake-quantized with its just-computed qparams before
it produces the next block's inputs, so later blocks are calibrated on the activations the
quantized model will see (errors that compound are seen); ``mode="float"`` (``True``)
gives the qparams of the whole-model pass.

Cached activations are kept in memory up to ``cache_budget_mb`` and spilled to a
temporary folder beyond it, made once the checkpoint is opened and its warnings given, and
removed at the end, on an error, Ctrl-C or SIGTERM too (:func:`.seq_cache.sigterm_unwinds`);
not where the process is killed (SIGKILL, the out-of-memory killer): then ``cache_dir``
keeps a ``quantscope-seq-*`` folder to delete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import shutil
import time

import torch
from torch import nn

from ..._checks import is_finite
from ..structure import kv_cache, moe
from . import heap
from .batches import batch_count, eval_mode, forward_batch, map_tensors
from .block_order import NotAChain, check_disjoint, find_blocks, free_zeros, trace_batches
from .checkpoint import Checkpoint, is_meta, load_params, open_checkpoint, unload_params
from .seq_cache import Cache, Contexts, sigterm_unwinds, spill_folder

__all__ = ["DEFAULT_CACHE_BUDGET_MB", "MODES", "batch_source", "calibrate_sequential",
           "find_blocks"]

#: what ``sequential=`` accepts (True means "float")
MODES = ("float", "quantized")
#: cached block inputs / outputs kept in memory, all batches together; the rest on disk
DEFAULT_CACHE_BUDGET_MB = 512


# ---------------------------------------------------------------- the pieces
class _Indexed:
    """``items`` read in order, the index of the one now out in ``i``; its length only where
    ``known`` (the whole-model pass on a generator spreads its row samples as over a stream
    of unknown length: the pieces must too); ``source``: the user's batches, by number."""

    def __init__(self, items, known: bool, source=None):
        self.items, self.known, self.i, self.source = items, known, 0, source

    def __iter__(self):
        for i, item in enumerate(self.items):
            self.i = i
            yield item

    def __len__(self) -> int:
        if not self.known:
            raise TypeError("the calibration batches have no length")
        return len(self.items)


class _Replay(nn.Module):
    """Stands in for every block: returns the last block's cached output of the batch
    ``batches`` (an :class:`_Indexed`) has out now; where the block returned a tuple, a
    tuple as long, its other items from ``rest`` (:meth:`_Feed.forward`)."""

    def __init__(self, outputs: Cache, batches: _Indexed, rest: dict):
        super().__init__()
        self.outputs, self.batches, self.rest = outputs, batches, rest

    def forward(self, *args, **kwargs):
        # a copy: the forward may change it in place (h += ...) and run a batch twice
        h = self.outputs.get(self.batches.i).clone()
        rest = self.rest.get(self.batches.i)
        return h if rest is None else (h, *rest)


class _Feed:
    """What a :class:`_Piece` runs: ``forward(i)`` runs the block on batch ``i``'s cached
    ``inputs`` (``forward(i, start, stop)``: its output's rows ``start:stop``, an auto scoring
    piece of the batch's documents, :func:`batch_source`); ``context(i)``: its other
    arguments. A plain object, not the piece's attributes: those are the model's module names
    (blocks under ``block``, ``inputs``, ``source`` ... as any other)."""

    def __init__(self, block: nn.Module, inputs: Cache, context, source=None):
        self.block, self.inputs, self.context = block, inputs, context
        self.outputs: Cache | None = None  # where forward records its outputs, if set
        self.copy_inputs = False
        # batch -> the other items of a tuple output (None: not a tuple), for the replay
        self.rest: dict = {}
        self.source = source  # the user's batches, which the numbers ``i`` stand for

    def forward(self, i, start=0, stop=None):
        args, kwargs = self.context(i)
        h = self.inputs.get(i)
        out = self.block(h.clone() if self.copy_inputs else h, *args, **kwargs)
        tup = isinstance(out, tuple)
        # the parent may unpack a tuple (h, aux = block(h)): the replay gives one as long.
        # The trace refused reading the other items' values (block_order), so their tensors
        # are free zeros of their shape (metadata may be read), other objects as they were
        self.rest[i] = map_tensors(lambda t: free_zeros(t.shape, t.dtype, t.device),
                                   out[1:]) if tup else None
        h = out[0] if tup else out
        if self.outputs is not None:
            self.outputs.put(i, h)
        # the whole batch run (its cached arguments are not cut), the rows kept: the
        # outputs of a decoder block are [rows, positions, hidden], as its input
        return h if stop is None else h[start:stop]


class _Piece(nn.Module):
    """One block under its full name (``model.layers.3``), so recipes match it as in the
    whole model, run by ``feed`` (a :class:`_Feed`). Its only attribute of its own is
    ``forward``, which no module can be named (nn.Module has one): every name of the model's
    modules is free for its path."""

    def __init__(self, name: str, feed: _Feed):
        super().__init__()
        *path, last = name.split(".")
        holder = self
        for part in path:
            holder.add_module(part, nn.Module())
            holder = holder._modules[part]
        holder.add_module(last, feed.block)
        self.forward = feed.forward


def batch_source(model):
    """The user's batches (a list) whose numbers a sequential block (:class:`_Piece`) is
    calibrated on, None for any other model: auto's scoring plan is made on them, as the
    whole-model pass's, each piece forwarded as ``(number, rows start, rows stop)``."""
    return model.forward.__self__.source if isinstance(model, _Piece) else None


def _matches(recipe, module) -> bool:
    """Whether ``recipe`` takes a module of this piece (its experts' views attached)."""
    try:
        recipe.match(module)
    except ValueError as e:
        if "no module matches" in str(e) or "none takes a role of its rule" in str(e):
            return False  # (the piece's matches take no role: an Embedding's input)
        raise
    return True


def _for_piece(recipe, piece):
    """``recipe`` as one piece takes it, None where it takes nothing there: without its
    KV-cache roles where the piece has no attention module (the embeddings, the head;
    calibrate_many checks the whole model has some); its KV cache alone where its rules take
    nothing in a piece with attention (a block the targets leave out: whether they take
    anything at all is the whole model's question, asked before the first block)."""
    if recipe.kv_cache is not None and not kv_cache.attention_modules(piece):
        if not recipe.rules:  # the KV cache alone: nothing here
            return None
        recipe = dataclasses.replace(recipe, kv_cache=None)
    if _matches(recipe, piece):
        return recipe
    if recipe.kv_cache is None:
        return None
    kv_only = dataclasses.replace(recipe, rules=())
    return kv_only if _matches(kv_only, piece) else None


def _pieces_todo(recipes: dict, piece) -> dict:
    """``{label: recipe as piece takes it}`` of those taking some module (MoE experts: views)."""
    with moe.attach(piece, count=False):
        return {k: r for k, r in ((k, _for_piece(r, piece)) for k, r in recipes.items()) if r}


@contextlib.contextmanager
def _no_kv_cache(model):
    config = getattr(model, "config", None)
    had = getattr(config, "use_cache", None)
    if had is not None:
        config.use_cache = False
    try:
        yield
    finally:
        if had is not None:
            config.use_cache = had


# ---------------------------------------------------------------- the engine
@dataclasses.dataclass
class _Run:
    """What one sequential calibration holds while it runs: the model and where its weights
    come from, the parameters it loaded (unloaded at the end), the activation caches'
    shared budget and folder (made by :func:`_restoring`), and each recipe's calibrated
    pieces (``(name, Calibration)``)."""

    model: nn.Module
    ckpt: Checkpoint | None
    device: object
    budget: list
    parts: dict
    folder: str | None = None
    loaded: list = dataclasses.field(default_factory=list)

    def load(self, names: set[str]) -> dict:
        """Load ``names`` (those on the meta device); returns what :meth:`unload` takes."""
        replaced = load_params(self.model, names, self.ckpt, self.device)
        self.loaded.append(replaced)
        return replaced

    def unload(self, replaced: dict) -> None:
        unload_params(self.model, replaced)
        self.loaded.remove(replaced)

    def cache(self, tag: str) -> Cache:
        return Cache(self.budget, self.folder, tag)


def _check_mode(mode, recipes, options, cache_budget_mb):
    """``(mode, cache_budget_mb)`` checked (``True`` is ``"float"``; None the default)."""
    if mode is False:
        raise TypeError("calibrate: checkpoint, blocks, cache_budget_mb, cache_dir and device "
                        "are options of sequential calibration; pass sequential=True")
    if mode is True:
        mode = "float"
    if mode not in MODES:
        raise ValueError(f"calibrate: sequential must be True or one of {MODES}, got {mode!r}")
    if mode == "quantized" and len(recipes) != 1:
        raise ValueError(f"calibrate: sequential='quantized' quantizes each block with its "
                         f"recipe's qparams, so it takes one recipe, got {len(recipes)}")
    if options.get("distributed"):
        raise ValueError("calibrate: sequential and distributed calibration do not combine")
    if cache_budget_mb is None:
        cache_budget_mb = DEFAULT_CACHE_BUDGET_MB
    # bool is an int to Python (True would be 1 MB); inf / NaN have no byte count
    if (isinstance(cache_budget_mb, bool) or not isinstance(cache_budget_mb, (int, float))
            or not is_finite(cache_budget_mb) or cache_budget_mb < 0):
        raise ValueError(f"calibrate: cache_budget_mb must be a finite number of MB >= 0, got "
                         f"{cache_budget_mb!r}")
    return mode, cache_budget_mb


@contextlib.contextmanager
def _restoring(run, layers, originals, cache_dir):
    """``run``'s spill folder made (in ``cache_dir``), and whatever happens inside (SIGTERM
    too): the model's own blocks back in ``layers``, the loaded weights unloaded, the folder
    removed."""
    with sigterm_unwinds() as unwinding:
        try:
            run.folder = spill_folder(cache_dir)
            yield
        finally:
            unwinding.quiet = True  # a SIGTERM from here waits for the cleanup's end
            for j, block in enumerate(originals):
                layers[j] = block
            for names in list(run.loaded):
                run.unload(names)
            if run.folder is not None:
                shutil.rmtree(run.folder, ignore_errors=True)


def calibrate_sequential(calibrate_many, model, batches, recipes, *, mode="float",
                         checkpoint=None, blocks=None, cache_budget_mb=None,
                         cache_dir=None, device=None, progress=True, **options):
    """:func:`~.session.calibrate_many` one block at a time (see the module's doc);
    ``options`` go to it for every piece. Returns ``{label: Calibration}``."""
    from ..results.result import Calibration

    mode, cache_budget_mb = _check_mode(mode, recipes, options, cache_budget_mb)
    t0 = time.perf_counter()
    heap.prepare()  # freed weights and activations go back to the system (heap.py)
    # the pieces see the batches' number as the whole-model pass does (their samples spread so)
    known = batch_count(batches) is not None
    if not isinstance(batches, (list, tuple)):  # read twice (first block's inputs, then the
        batches = list(batches)  # head): a DataLoader's second pass would shuffle again
    name, layers = find_blocks(model, blocks)
    check_disjoint(model, name, layers)
    with moe.attach(model, count=False):  # a misspelt target, before any block runs (a KV
        for recipe in recipes.values():  # cache's attention matches in a block; experts as
            recipe.match(model)         # Linear views)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    outside = {n for n in params if not n.startswith(name + ".")}
    # the checkpoint read (its warnings, maybe errors) before the spill folder is made
    run = _Run(model, open_checkpoint(model, checkpoint, device), device,
               [int(cache_budget_mb * 2**20)], {label: [] for label in recipes})
    originals = list(layers)
    with eval_mode(model), _restoring(run, layers, originals, cache_dir):
        hidden, context, n, order = _first_inputs(run, batches, name, layers, outside)
        spilled, rest = 0, {}
        for k, j in enumerate(order):
            full, block = f"{name}.{j}", originals[j]
            nxt, rest = _calibrate_block(
                run, full, block, {p for p in params if p.startswith(full + ".")}, hidden,
                functools.partial(context.get, j), _Indexed(range(n), known, batches),
                recipes, mode, calibrate_many, options)
            spilled += hidden.spilled
            hidden.clear()
            hidden = nxt
            if progress:
                print(f"\rcalibrating {full} ({k + 1}/{len(originals)})", end="", flush=True)
        if progress:
            print()
        _calibrate_rest(run, _Indexed(batches, known), name, layers, outside, hidden,
                        rest, recipes, calibrate_many, options)
        spilled += hidden.spilled + context.tensors.spilled
    seconds = round(time.perf_counter() - t0, 3)
    out = {}
    for label, recipe in recipes.items():
        out[label] = _merge(Calibration, recipe, label, run.parts[label], n, seconds,
                            {"blocks": name, "count": len(originals), "order": order, "mode": mode,
                             "cache_budget_mb": cache_budget_mb, "spilled_batches": spilled})
    return out


def _first_inputs(run: _Run, batches, name: str, layers, outside: set[str]):
    """``(hidden, context, n, order)``: the first block's inputs for each of the ``n``
    batches, every block's other positional / keyword arguments
    (:class:`.seq_cache.Contexts`), and the order in which the forward calls the blocks
    (:mod:`.block_order`: a chain, or refused; a forward that fails with the blocks traced
    raises the model's own error where the model fails so without the trace too)."""
    model = run.model
    with _no_kv_cache(model), torch.inference_mode():
        outer = run.load(outside)
        try:
            first = err = None
            # blocks that change their input's shape or return tuples break a pass-through
            # trace: then a shaped one (each block run on the meta device) decides
            for shaped in (False, True):
                hidden, context = run.cache("a"), Contexts(run.cache("ctx"))
                try:
                    order, n = trace_batches(model, batches, name, layers, shaped,
                                             functools.partial(_keep, hidden, context, first))
                    break
                except NotAChain as e:
                    hidden.clear()
                    context.clear()
                    first = e if first is None else first
                    err = first if e.no_shape else e
            else:  # neither trace passed (here, not in the except: the model's own error
                # is not shown as raised while handling the refusal)
                if err.batch is not None:
                    _run_whole(run, batches[err.batch], name, layers)
                raise err
        finally:
            run.unload(outer)
    return hidden, context, n, order


def _keep(hidden, context, failed, i: int, trace) -> None:
    """Batch ``i``'s first block input and every block's other arguments into the caches.
    ``failed``: the pass-through trace's failure; where it was this batch's forward and the
    shaped trace shows the pass-through stood for every block as it is, that forward's
    error was the model's own (raised once: the trace ran it a second time): raised."""
    if failed is not None and failed.batch == i and trace.faithful:
        raise failed.__cause__
    hidden.put(i, trace.first)
    context.put(i, trace)


def _run_whole(run: _Run, batch, name: str, layers) -> None:
    """The model's forward on ``batch`` without the trace, each block's weights loaded for
    its call where on the meta device: an error there is the model's own (sequential=False
    meets it too) and propagates; the trace's failure was otherwise about the chain."""
    params = [n for n, _ in run.model.named_parameters(remove_duplicate=False)]
    loaded = {}

    def load(j, *_):
        loaded[j] = run.load({p for p in params if p.startswith(f"{name}.{j}.")})

    def unload(j, *_):
        run.unload(loaded.pop(j))

    hooks = [h for j, b in enumerate(layers) for h in (
        b.register_forward_pre_hook(functools.partial(load, j)),
        b.register_forward_hook(functools.partial(unload, j)))]
    try:
        forward_batch(run.model, batch)
    finally:
        for h in hooks:
            h.remove()


def _calibrate_block(run: _Run, full: str, block, mine: set[str], hidden, context, batches,
                     recipes, mode, calibrate_many, options):
    """Load, calibrate (each recipe that takes something in it) and unload one block on
    ``batches`` (:class:`_Indexed` batch numbers); returns ``(its outputs' cache, the other
    items of its tuple outputs by batch)`` (:attr:`_Feed.rest`)."""
    load = is_meta(block)
    if load:
        loaded = run.load(mine)
    feed = _Feed(block, hidden, context, batches.source)
    piece = _Piece(full, feed)
    nxt = run.cache("b" if hidden.tag == "a" else "a")
    todo = _pieces_todo(recipes, piece)
    auto = any(_has_auto(r) for r in todo.values())
    # the outputs come with the calibration's own forwards, unless those are not the
    # block's plain forwards (auto's scoring, or the quantized block's outputs wanted)
    feed.outputs = nxt if mode == "float" and not auto else None
    # a block may change its input in place (h += ...): the calibration's forwards get a
    # copy, as it may run a batch twice (the fusion groups' detection forward of the first
    # batch, auto's scoring) and a second pass may follow; that pass, the last, gets none
    feed.copy_inputs = True
    got = calibrate_many(piece, batches, todo, progress=False, **options) if todo else {}
    feed.copy_inputs = False
    for k, c in got.items():
        run.parts[k].append((full, c))
    # the outputs by their own pass: wanted quantized, or the calibration's forwards did not
    # give them all (none ran: nothing in the block takes an activation, or no recipe at all)
    if feed.outputs is None or len(nxt.held) < len(batches.items):
        handle = got[next(iter(todo))].apply(piece) if todo and mode == "quantized" else None
        feed.outputs = nxt
        try:
            with torch.inference_mode():
                for i in range(len(batches.items)):
                    piece(i)
        finally:
            if handle is not None:
                handle.remove()
    if load:
        run.unload(loaded)
        # the block's weights (views of the checkpoint's mapping) can stay referenced from
        # reference cycles of the calibration's objects until a collection: collect now, or
        # the unloaded blocks' mappings accumulate (a block in memory has none to release)
        gc.collect()
    heap.trim()  # the block's activations' heap pages back to the system
    return nxt, feed.rest


def _calibrate_rest(run: _Run, batches, name: str, layers, outside: set[str], hidden,
                    extras: dict, recipes, calibrate_many, options) -> None:
    """The parts outside the blocks (final norm, head ...), on the last block's cached
    outputs: every block replaced by a replay of them (``extras``: :attr:`_Feed.rest`)."""
    model = run.model
    rest = _without_blocks(model, name)
    todo = _pieces_todo(recipes, rest)
    if not todo:
        return
    run.load(outside)
    for j in range(len(layers)):
        layers[j] = _Replay(hidden, batches, extras)
    with _no_kv_cache(model):
        got = calibrate_many(model, batches, todo, progress=False, replayed=True, **options)
    for k, c in got.items():
        run.parts[k].append(("rest", c))


def _has_auto(recipe) -> bool:
    from ..choice.candidates import has_auto  # (choice imports run: not at the top)

    return has_auto(recipe)


def _without_blocks(model, name):
    """A view for matching: the model's modules outside the blocks, full names."""
    class _View(nn.Module):
        def named_modules(self, *a, **k):
            for n, m in model.named_modules(*a, **k):
                if n != name and not n.startswith(name + "."):
                    yield n, m

    return _View()


def _merge(Calibration, recipe, label, parts, n, seconds, sequential):
    """One :class:`Calibration` of the ``(piece name, Calibration)`` ``parts``: their states,
    report rows and histograms, and the info the whole-model pass records: its lists joined,
    the MoE threshold, and auto's end-to-end choice of each block (``"model"``: per block)."""
    states, rows, hists, info = {}, [], {}, {"batches": n, "calibration_seconds": seconds,
                                             "sequential": sequential}
    for piece, c in parts:
        states.update(c.states)
        rows.extend(c.stats)
        hists.update(c.histograms)
        for k in ("missing", "unreached", "fusion_groups", "experts", "imatrix_unweighted"):
            if k in c.info:
                info.setdefault(k, []).extend(c.info[k])
        if "expert_min_tokens" in c.info:
            info["expert_min_tokens"] = c.info["expert_min_tokens"]
        if "auto" in c.info:
            info.setdefault("auto", {"metric": c.info["auto"]["metric"], "blocks": {}})
            info["auto"]["blocks"][piece] = c.info["auto"]
    json.dumps(sequential)  # the info stays serializable
    return Calibration(recipe, states, label, rows, hists, info)
