"""Sequential (layer-by-layer) calibration: one block of the model in memory at a time.

The model's blocks (the largest ``nn.ModuleList`` of identical modules, e.g. a decoder's
``model.layers``; ``blocks=`` names another) are calibrated one after the other:

1. the part before the first block (embeddings, rotary tables ...) runs on every batch and
   the first block's inputs are caught, positional and keyword (attention mask, position
   embeddings), then the forward stops;
2. each block is loaded (from ``checkpoint``'s safetensors, memory-mapped, when the model
   is an empty skeleton: :func:`empty_model`), calibrated over the cached inputs of all
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
temporary folder beyond it (removed at the end, whatever happens).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from . import heap
from .batches import forward_batch

__all__ = ["DEFAULT_CACHE_BUDGET_MB", "MODES", "calibrate_sequential", "empty_model",
           "find_blocks"]

#: what ``sequential=`` accepts (True means "float")
MODES = ("float", "quantized")
#: cached block inputs / outputs kept in memory, all batches together; the rest on disk
DEFAULT_CACHE_BUDGET_MB = 512


# ---------------------------------------------------------------- finding the blocks
def find_blocks(model: nn.Module, blocks: str | None = None) -> tuple[str, nn.ModuleList]:
    """``(name, module list)`` of the model's repeated blocks: ``blocks`` if given, else the
    ``nn.ModuleList`` with the most children all of one class (ties: the most parameters)."""
    modules = dict(model.named_modules())
    if blocks is not None:
        found = modules.get(blocks)
        if not isinstance(found, nn.ModuleList) or not len(found):
            lists = [n for n, m in modules.items() if isinstance(m, nn.ModuleList)]
            raise ValueError(f"calibrate: blocks={blocks!r} is not a non-empty nn.ModuleList "
                             f"of the model; its module lists are {lists}")
        return blocks, found
    best, key = None, None
    for name, m in modules.items():
        if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1:
            k = (len(m), sum(p.numel() for p in m.parameters()))
            if key is None or k > key:
                best, key = name, k
    if best is None:
        raise ValueError("calibrate: sequential=True found no nn.ModuleList of repeated blocks "
                         "in the model; name them with blocks='...'")
    return best, modules[best]


# ---------------------------------------------------------------- weights on demand
def empty_model(path, task: str | None = None) -> nn.Module:
    """The model of a Hugging Face folder with every parameter on the meta device (no
    weights in memory): the skeleton :func:`calibrate_sequential` loads block by block.
    Buffers are real: read from the checkpoint, or (non-persistent ones such as rotary
    tables) computed by the model's ``_init_weights``, as transformers' loader does."""
    import transformers

    from ..demo import models

    path = models.resolve_model_path(path)
    config = transformers.AutoConfig.from_pretrained(path)
    task = task or models.model_task(path)
    auto = (transformers.AutoModelForCausalLM if task == "causal-lm"
            else transformers.AutoModel)
    with torch.device("meta"):  # nothing allocated, not even transiently (RLIMIT_DATA)
        model = auto.from_config(config)
    ckpt = _Checkpoint(path)
    for module in model.modules():  # buffers are small: from the checkpoint, or computed
        meta = [n for n, b in module.named_buffers(recurse=False) if b.device.type == "meta"]
        for n in meta:
            module._buffers[n] = torch.empty_like(module._buffers[n], device="cpu")
        if meta:
            init = getattr(model, "_init_weights", None)
            if init is None:
                raise ValueError(f"calibrate: cannot compute the buffers {meta} of "
                                 f"{type(module).__name__} built on the meta device")
            init(module)  # transformers' own initializer (rotary tables ...)
    for name, b in model.named_buffers():
        if name in ckpt.where:
            b.copy_(ckpt.get(name))
    model.eval()
    return model


class _Checkpoint:
    """The tensors of a folder's ``*.safetensors`` files, read one at a time (mmap)."""

    def __init__(self, path):
        path = Path(path)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise ValueError(f"calibrate: checkpoint {str(path)!r} has no .safetensors files")
        from safetensors import safe_open

        self._open = safe_open
        self.where = {}
        for f in files:
            with safe_open(f, "pt") as st:
                for k in st.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                    self.where[k] = f

    def get(self, name: str) -> torch.Tensor:
        return self.get_many([name])[name]

    def get_many(self, names) -> dict[str, torch.Tensor]:
        """Each file opened once: its tensors are views of one mapping of the file (a
        handle per tensor would map the whole file once per tensor)."""
        by_file = {}
        for n in names:
            by_file.setdefault(self.where[n], []).append(n)
        out = {}
        for f, ns in by_file.items():
            with self._open(f, "pt") as st:
                for n in ns:
                    out[n] = st.get_tensor(n)
        return out


def _is_meta(module: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in module.parameters())


def _load(model, names: set[str], ckpt: _Checkpoint | None, device) -> None:
    """Give the parameters called ``names`` (full names) their checkpoint values. A name the
    checkpoint lacks takes the value of a tied alias (``lm_head.weight`` is
    ``embed_tokens.weight``)."""
    aliases = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    todo = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)
            if n in names and p.device.type == "meta"]
    if todo and ckpt is None:
        raise ValueError(f"calibrate: parameter {todo[0][0]!r} is on the meta device; pass "
                         f"checkpoint= (the model's safetensors folder)")
    source = {}
    for n, p in todo:
        src = next((a for a in [n, *aliases[id(p)]] if a in ckpt.where), None)
        if src is None:
            raise ValueError(f"calibrate: checkpoint has no tensor {n!r}")
        source[id(p)] = src
    tensors = ckpt.get_many(set(source.values())) if todo else {}
    done = {}
    for n, p in todo:
        if id(p) not in done:
            src = source[id(p)]
            t = tensors.pop(src)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"calibrate: checkpoint tensor {src!r} has shape "
                                 f"{tuple(t.shape)}, the model expects {tuple(p.shape)}")
            done[id(p)] = nn.Parameter(t.to(device=device, dtype=p.dtype), requires_grad=False)
        _set_param(model, n, done[id(p)])


def _set_param(model, name, value) -> None:
    owner, _, attr = name.rpartition(".")
    model.get_submodule(owner)._parameters[attr] = value


def _unload(model, names: set[str]) -> None:
    """Back to the meta device (tied aliases follow: one object per tensor)."""
    done = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if n in names or id(p) in done:
            if id(p) not in done:
                done[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=False)
            _set_param(model, n, done[id(p)])


# ---------------------------------------------------------------- cached activations
class _Cache:
    """Per-batch values (tensors, tuples and dicts of them) in memory while their total
    stays within the shared ``budget`` (bytes, a one-item list), else in files."""

    def __init__(self, budget: list, folder: str, tag: str):
        self.budget, self.folder, self.tag = budget, folder, tag
        self.mem, self.size, self.spilled = {}, {}, 0

    def put(self, i: int, value) -> None:
        self.drop(i)
        value = _detached(value)
        nbytes = _nbytes(value)
        if nbytes <= self.budget[0]:
            self.mem[i], self.size[i] = value, nbytes
            self.budget[0] -= nbytes
            return
        path = os.path.join(self.folder, f"{self.tag}-{i}.pt")
        torch.save(value, path + ".tmp")
        os.replace(path + ".tmp", path)  # a file is whole or absent
        self.spilled += 1

    def get(self, i: int):
        if i in self.mem:
            return self.mem[i]
        return torch.load(os.path.join(self.folder, f"{self.tag}-{i}.pt"), weights_only=False)

    def drop(self, i: int) -> None:
        if i in self.mem:
            del self.mem[i]
            self.budget[0] += self.size.pop(i)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.folder, f"{self.tag}-{i}.pt"))

    def clear(self) -> None:
        for i in list(self.mem):
            self.drop(i)
        for f in Path(self.folder).glob(f"{self.tag}-*.pt"):
            f.unlink()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------- the pieces
class _Stop(Exception):
    pass


class _Catch(nn.Module):
    """Stands in for the first block: keeps its inputs and stops the forward."""

    def __init__(self):
        super().__init__()
        self.caught = None

    def forward(self, *args, **kwargs):
        for k in ("past_key_values", "past_key_value"):  # no KV cache across passes
            if k in kwargs:
                kwargs[k] = None
        self.caught = (args, kwargs)
        raise _Stop


class _Replay(nn.Module):
    """Stands in for every block: returns the last block's cached output of batch ``i``."""

    def __init__(self, outputs: _Cache, state: dict, as_tuple: bool):
        super().__init__()
        self.outputs, self.state, self.as_tuple = outputs, state, as_tuple

    def forward(self, *args, **kwargs):
        h = self.outputs.get(self.state["i"])
        return (h,) if self.as_tuple else h


class _Piece(nn.Module):
    """One block under its full name (``model.layers.3``), so recipes match it as in the
    whole model; ``forward(i)`` runs the block on batch ``i``'s cached inputs."""

    def __init__(self, name: str, block: nn.Module, inputs: _Cache, context: _Cache):
        super().__init__()
        *path, last = name.split(".")
        holder = self
        for part in path:
            holder.add_module(part, nn.Module())
            holder = getattr(holder, part)
        holder.add_module(last, block)
        self.block, self.inputs, self.context = block, inputs, context
        self.outputs: _Cache | None = None  # where forward records its outputs, if set
        self.as_tuple = False

    def forward(self, i):
        args, kwargs = self.context.get(i)
        out = self.block(self.inputs.get(i), *args, **kwargs)
        self.as_tuple = isinstance(out, tuple)
        h = out[0] if self.as_tuple else out
        if self.outputs is not None:
            self.outputs.put(i, h)
        return h


def _matches(recipe, module) -> bool:
    """Whether ``recipe`` takes any module of this piece (its other errors propagate)."""
    try:
        recipe.match(module)
    except ValueError as e:
        if "no module matches" in str(e):
            return False
        raise
    return True


def _for_piece(recipe, piece):
    """``recipe`` for one piece: without its KV-cache roles where the piece has no attention
    module (the embeddings, the head; calibrate_many checks the whole model has some)."""
    from .kv_cache import attention_modules

    if recipe.kv_cache is None or attention_modules(piece):
        return recipe
    return dataclasses.replace(recipe, kv_cache=None)


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
def calibrate_sequential(calibrate_many, model, batches, recipes, *, mode="float",
                         checkpoint=None, blocks=None, cache_budget_mb=None,
                         cache_dir=None, device=None, progress=True, **options):
    """:func:`~.session.calibrate_many` one block at a time (see the module's doc);
    ``options`` go to it for every piece. Returns ``{label: Calibration}``."""
    from .result import Calibration

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
    if not (isinstance(cache_budget_mb, (int, float)) and cache_budget_mb >= 0):
        raise ValueError(f"calibrate: cache_budget_mb must be a number of MB >= 0, got "
                         f"{cache_budget_mb!r}")
    t0 = time.perf_counter()
    heap.prepare()  # freed weights and activations go back to the system (heap.py)
    if iter(batches) is batches:  # read twice (first block's inputs, then the head): keep them
        batches = list(batches)
    ckpt = _Checkpoint(checkpoint) if checkpoint is not None else None
    name, layers = find_blocks(model, blocks)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    outside = {n for n in params if not n.startswith(name + ".")}
    budget = [int(cache_budget_mb * 2**20)]
    folder = tempfile.mkdtemp(prefix="quantscope-seq-", dir=cache_dir)
    parts = {label: [] for label in recipes}
    was_training = model.training
    model.eval()
    originals = list(layers)
    loaded_here = []
    try:
        with _no_kv_cache(model), torch.inference_mode():
            # 1. the first block's inputs, by running the model up to it
            outer = {n for n in outside if _param(model, n).device.type == "meta"}
            _load(model, outer, ckpt, device)
            loaded_here.append(outer)
            hidden, context = _Cache(budget, folder, "a"), _Cache(budget, folder, "ctx")
            catch = _Catch()
            layers[0] = catch
            n = 0
            for batch in batches:
                try:
                    forward_batch(model, batch)
                except _Stop:
                    pass
                else:
                    raise ValueError(f"calibrate: the model's forward never reached its first "
                                     f"block {name}.0; name the blocks with blocks='...'")
                args, kwargs = catch.caught
                h = args[0] if args else kwargs.pop("hidden_states")
                hidden.put(n, h)
                context.put(n, (args[1:], kwargs))
                n += 1
            layers[0] = originals[0]
            if n == 0:
                raise ValueError("calibrate: batches is empty: sequential calibration needs at "
                                 "least one calibration batch")
            _unload(model, outer)
            loaded_here.remove(outer)
        spilled = 0
        as_tuple = False
        # 2. block by block
        for j, block in enumerate(originals):
            full = f"{name}.{j}"
            mine = {n for n in params if n.startswith(full + ".")}
            load = _is_meta(block)
            if load:
                _load(model, mine, ckpt, device)
                loaded_here.append(mine)
            piece = _Piece(full, block, hidden, context)
            nxt = _Cache(budget, folder, "b" if hidden.tag == "a" else "a")
            todo = {k: _for_piece(r, piece) for k, r in recipes.items() if _matches(r, piece)}
            auto = any(_has_auto(r) for r in todo.values())
            piece.outputs = nxt if mode == "float" and not auto else None
            if todo:
                got = calibrate_many(piece, list(range(n)), todo, progress=False, **options)
                for k, c in got.items():
                    parts[k].append(c)
            if piece.outputs is None or not todo:  # the outputs, by their own pass
                handle = (got[next(iter(todo))].apply(piece) if todo and mode == "quantized"
                          else None)
                piece.outputs = nxt
                try:
                    with torch.inference_mode():
                        for i in range(n):
                            piece(i)
                finally:
                    if handle is not None:
                        handle.remove()
            as_tuple = piece.as_tuple
            spilled += hidden.spilled
            hidden.clear()
            hidden = nxt
            if load:
                _unload(model, mine)
                loaded_here.remove(mine)
            # the block's weights (views of the checkpoint's mapping) can stay referenced
            # from reference cycles of the calibration's objects until a collection:
            # collect now, or the unloaded blocks' mappings accumulate
            gc.collect()
            heap.trim()  # the block's activations' heap pages back to the system
            if progress:
                print(f"\rcalibrating {full} ({j + 1}/{len(originals)})", end="", flush=True)
        if progress:
            print()
        # 3. the parts outside the blocks, on the last block's outputs
        rest = _without_blocks(model, name)
        todo = {k: _for_piece(r, rest) for k, r in recipes.items() if _matches(r, rest)}
        if todo:
            outer = {n for n in outside if _param(model, n).device.type == "meta"}
            _load(model, outer, ckpt, device)
            loaded_here.append(outer)
            state = {"i": 0}
            for j in range(len(originals)):
                layers[j] = _Replay(hidden, state, as_tuple)

            def indexed():
                for i, batch in enumerate(batches):
                    state["i"] = i
                    yield batch

            with _no_kv_cache(model):
                got = calibrate_many(model, indexed(), todo, progress=False, **options)
            for k, c in got.items():
                parts[k].append(c)
        spilled += hidden.spilled + context.spilled
    finally:
        for j, block in enumerate(originals):
            layers[j] = block
        for names in loaded_here:
            _unload(model, names)
        shutil.rmtree(folder, ignore_errors=True)
        model.train(was_training)
    seconds = round(time.perf_counter() - t0, 3)
    out = {}
    for label, recipe in recipes.items():
        if not parts[label]:
            recipe.match(model)  # raises the whole-model error: nothing matches
        out[label] = _merge(Calibration, recipe, label, parts[label], n, seconds,
                            {"blocks": name, "count": len(originals), "mode": mode,
                             "cache_budget_mb": cache_budget_mb, "spilled_batches": spilled})
    return out


def _param(model, name):
    return model.get_parameter(name)


def _has_auto(recipe) -> bool:
    from . import auto

    return auto._has_auto(recipe)


def _without_blocks(model, name):
    """A view for matching: the model's modules outside the blocks, full names."""
    class _View(nn.Module):
        def named_modules(self, *a, **k):
            for n, m in model.named_modules(*a, **k):
                if n != name and not n.startswith(name + "."):
                    yield n, m

    return _View()


def _merge(Calibration, recipe, label, parts, n, seconds, sequential):
    states, rows, hists, info = {}, [], {}, {"batches": n, "calibration_seconds": seconds,
                                             "sequential": sequential}
    for c in parts:
        states.update(c.states)
        rows.extend(c.stats)
        hists.update(c.histograms)
        for k in ("missing", "unreached", "fusion_groups", "experts"):
            if k in c.info:
                info.setdefault(k, []).extend(c.info[k])
    json.dumps(sequential)  # the info stays serializable
    return Calibration(recipe, states, label, rows, hists, info)
