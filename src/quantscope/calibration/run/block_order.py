"""The order in which a model's forward calls its blocks (the ``nn.ModuleList`` that
:func:`find_blocks` finds), traced before sequential calibration (:mod:`.sequential`)
relies on it.

Sequential calibration feeds block ``k``'s cached outputs to the next block and the last
block's outputs to the rest of the model: that equals the whole-model pass only when the
blocks form a **chain**: each called once per forward, each on the output of the block
called before it, and no block's output used anywhere else. The first pass replaces every
block by a recorder that passes its input through (a new tensor object, so that the next
call's input is recognized by identity, ``is``) and notes which block was called on whose
output; a torch-function mode notes every other use of a block's output. Where passing the
input through cannot work (blocks that change its shape, or return tuples) a second trace
gives zeros shaped as each block's output, found by running the block on the meta device.
A chain in any order is followed; anything else is refused with an error naming the block
(:class:`NotAChain`), as is a weighted module shared by two blocks (:func:`check_disjoint`),
a tuple output whose other items are read (T5's ``position_bias``: the replay gives hidden
states only) and a batch carrying a KV cache that holds a prefix (the replay runs without
the cache).
Each call's other arguments are kept (:func:`split_contexts`): blocks of one model may take
different ones (Gemma's sliding-window and full-attention layers each their own mask).
Weighted modules outside the blocks compute as usual until every block has been called
(one the forward calls between the blocks on the batch feeds them its values), then give
only their output's shape (:func:`_shape_only`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .batches import batch_arguments, forward_batch, is_kv_cache, map_tensors, tensors_in

__all__ = ["NotAChain", "Trace", "chain_order", "check_disjoint", "fill", "find_blocks",
           "free_zeros", "recorders", "refuse", "split_contexts", "trace_batches"]

#: reading these tells nothing of a tensor's values: not a use of a block's output
_METADATA = {"shape", "dtype", "device", "ndim", "layout", "is_cuda", "is_meta",
             "requires_grad", "size", "dim", "numel", "is_floating_point", "is_contiguous",
             "stride", "element_size", "get_device"}


def find_blocks(model: nn.Module, blocks: str | None = None) -> tuple[str, nn.ModuleList]:
    """``(name, module list)`` of the model's repeated blocks: ``blocks`` if given, else of
    the outermost ``nn.ModuleList`` s whose children are all of one class, the one with the
    most children (ties: the most parameters); not a list inside a block (an MoE layer's
    experts, more than the layers in a small model)."""
    modules = dict(model.named_modules())
    if blocks is not None:
        found = modules.get(blocks)
        if not isinstance(found, nn.ModuleList) or not len(found):
            lists = [n for n, m in modules.items() if isinstance(m, nn.ModuleList)]
            raise ValueError(f"calibrate: blocks={blocks!r} is not a non-empty nn.ModuleList "
                             f"of the model; its module lists are {lists}")
        return blocks, found
    lists = [n for n, m in modules.items()
             if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1]
    best, key = None, None
    for name in lists:
        if any(name.startswith(f"{outer}.") for outer in lists):
            continue  # inside a block of another list
        m = modules[name]
        k = (len(m), sum(p.numel() for p in m.parameters()))
        if key is None or k > key:
            best, key = name, k
    if best is None:
        raise ValueError("calibrate: sequential=True found no nn.ModuleList of repeated blocks "
                         "in the model; name them with blocks='...'")
    return best, modules[best]


@dataclasses.dataclass
class Trace:
    """One forward's block calls: ``calls[k] = (block index, index of the call whose output
    is its input, or None)``, ``inputs[k]`` / ``outputs[k]`` the tensors it took and gave;
    ``used``: the calls whose output something other than a block read; ``contexts[k]``
    its arguments besides the hidden states (:func:`_replayable`); ``extras[k]`` the other
    tensors of a tuple output and ``extra_used`` the calls one of which was read (the
    replay gives the hidden states only), with where. A plain trace
    passes each input through; a ``shaped`` one gives zeros shaped as the block's output
    (its tuple too), from a run of the block on the meta device: for blocks that change the
    shape of their input or return tuples. ``faithful``: each shaped output is one tensor of
    its (contiguous) input's shape and dtype, so the plain trace's pass-through stood for
    every block as it is (a forward failing with it fails without the trace too)."""

    shaped: bool = False
    calls: list = dataclasses.field(default_factory=list)
    outputs: list = dataclasses.field(default_factory=list)
    inputs: list = dataclasses.field(default_factory=list)
    used: set = dataclasses.field(default_factory=set)
    contexts: list = dataclasses.field(default_factory=list)
    extras: list = dataclasses.field(default_factory=list)
    extra_used: dict = dataclasses.field(default_factory=dict)
    count: int = 0  # the blocks: the rest of the model runs shape only once all were called
    first: object = None  # a copy of the first call's input, as it was then
    inside: bool = False  # a recorder is running: its own ops are no use
    faithful: bool = True

    def call(self, j: int, block: nn.Module, args: tuple, kwargs: dict, name: str):
        h = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(h, torch.Tensor):
            raise TypeError(f"calibrate: sequential=True: block {name}.{j} was called without "
                            f"a tensor as its first argument ({type(h).__name__}); name "
                            f"other blocks with blocks='...' or use sequential=False")
        args, kwargs = _replayable(args, kwargs)
        context = (args[1:], kwargs) if args else (
            (), {k: v for k, v in kwargs.items() if k != "hidden_states"})
        # a block's output as another's argument: not a chain
        self.note(context, f"passed to block {name}.{j} as an argument")
        self.contexts.append(context)
        if not self.calls:  # a plain trace passes it through (its storage): the forward
            self.first = h.clone()  # may change that in place after the blocks (h += ...)
        self.calls.append((j, self.output_index(h)))
        self.inputs.append(h)
        self.inside = True
        try:  # the same values as a new object (its readers are told apart), or zeros shaped
            out = _shaped_output(block, args, kwargs, h.device) if self.shaped else h.view_as(h)
        finally:
            self.inside = False
        self.faithful &= (isinstance(out, torch.Tensor) and out.shape == h.shape
                          and out.dtype == h.dtype and h.is_contiguous())
        self.outputs.append(out[0] if isinstance(out, tuple) else out)
        self.extras.append(list(tensors_in(out[1:])) if isinstance(out, tuple) else [])
        return out

    def output_index(self, t) -> int | None:
        return next((k for k, o in enumerate(self.outputs) if o is t), None)

    def note(self, value, where: str) -> None:
        """The block outputs among ``value``'s tensors are read (by ``where``)."""
        for t in tensors_in(value):
            k = self.output_index(t)
            if k is not None:
                self.used.add(k)
            k = next((k for k, ts in enumerate(self.extras) if any(e is t for e in ts)), None)
            if k is not None:
                self.extra_used.setdefault(k, where)

    def order(self) -> list[int]:
        return [j for j, _ in self.calls]


def _prefix_cache(batch) -> tuple[str, int] | None:
    """``(argument, tokens)`` of a batch's KV cache that already holds tokens (a prefix the
    blocks attend to, with a mask that covers it), if any: no replay without the cache
    (:func:`_replayable`) can equal the whole pass on it. An empty cache changes nothing."""
    for name, value in batch_arguments(batch):
        if is_kv_cache(value) and value.get_seq_length() > 0:
            return name, value.get_seq_length()
    return None


def _replayable(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A block call's arguments without the KV cache (a transformers ``Cache`` under any
    name, transformers 5's ``cache=`` too; ``use_cache`` False): a block runs more than once
    per batch (its calibration, its outputs' pass, auto's scoring), and would attend over the
    keys its own earlier runs left in the cache."""
    args = tuple(None if is_kv_cache(a) else a for a in args)
    kwargs = {k: None if is_kv_cache(v) or k in ("past_key_values", "past_key_value")
              else False if k == "use_cache" else v for k, v in kwargs.items()}
    return args, kwargs


class _Ref:
    """A tensor of a batch's context list (:func:`split_contexts`), by its index."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k


def _map_leaves(fn, value):
    """``value`` with ``fn`` applied to everything that is not a tuple, list or dict."""
    if isinstance(value, (tuple, list)):
        return type(value)(_map_leaves(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _map_leaves(fn, v) for k, v in value.items()}
    return fn(value)


def _same(a, b) -> bool:
    """Two templates alike: the same nesting, tensor indices and other objects (``is``)."""
    if isinstance(a, _Ref) or isinstance(b, _Ref):
        return isinstance(a, _Ref) and isinstance(b, _Ref) and a.k == b.k
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a is b


def split_contexts(trace: Trace) -> tuple[list, tuple, dict]:
    """``(tensors, first, own)``: every block call's other arguments as the distinct tensors
    they hold (each once: blocks of one kind share their mask) and templates (``(args,
    kwargs)``, each tensor as its index in ``tensors``): the first call's, and ``own[j]``
    for block ``j`` where its call's differs from the first's (Gemma's layers alternate)."""
    tensors, index = [], {}

    def ref(v):
        if not isinstance(v, torch.Tensor):
            return v
        if id(v) not in index:
            index[id(v)] = len(tensors)
            tensors.append(v)
        return _Ref(index[id(v)])

    templates = [_map_leaves(ref, c) for c in trace.contexts]
    own = {j: t for (j, _), t in zip(trace.calls[1:], templates[1:])
           if not _same(t, templates[0])}
    return tensors, templates[0], own


def fill(template, tensors: list):
    """A template of :func:`split_contexts` with its tensors back."""
    return _map_leaves(lambda v: tensors[v.k] if isinstance(v, _Ref) else v, template)


class _NoShape(Exception):
    """The block's output shape could not be found on the meta device."""


def _shaped_output(block: nn.Module, args, kwargs, device, zeros=torch.zeros):
    """Zeros shaped as ``block``'s output on these inputs: the block run on the meta device
    (its weights and inputs as meta tensors: no compute, no weights needed)."""
    state = {n: t.to("meta") for n, t in [*block.named_parameters(remove_duplicate=False),
                                          *block.named_buffers(remove_duplicate=False)]}
    meta = lambda t: t.to("meta")
    try:
        out = torch.func.functional_call(block, state, map_tensors(meta, args),
                                         map_tensors(meta, kwargs))
    except Exception as e:  # data-dependent ops (an MoE's routing) do not run on meta
        raise _NoShape(f"{type(e).__name__}: {e}") from e
    if not isinstance(out, torch.Tensor) and not (
            isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor)):
        raise _NoShape(f"it returns {type(out).__name__}, not a tensor or a tuple of them")
    return map_tensors(lambda t: zeros(t.shape, dtype=t.dtype, device=device), out)


class _Recorder(nn.Module):
    """Stands in for block ``j`` in the first pass (``block``: the block, not a child)."""

    def __init__(self, j: int, block: nn.Module, trace: Trace, name: str):
        super().__init__()
        self.j, self.trace, self.list_name = j, trace, name
        self.__dict__["block"] = block

    def forward(self, *args, **kwargs):
        return self.trace.call(self.j, self.block, args, kwargs, self.list_name)


class _Uses(TorchFunctionMode):
    """Notes every torch function that reads a block's output (its values, not its shape)."""

    def __init__(self, trace: Trace):
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(getattr(func, "__self__", None), "__name__", None) \
            if getattr(func, "__name__", None) == "__get__" else getattr(func, "__name__", None)
        if not self.trace.inside and name not in _METADATA and self.trace.outputs:
            self.trace.note((args, kwargs), f"read by {name}")
        return func(*args, **kwargs)


def free_zeros(shape, dtype, device):
    """Zeros that take no memory (one element, expanded)."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def _shape_only(module: nn.Module, trace: Trace, name: str):
    """``module``'s forward for the trace: computed as usual until every block has been
    called (its values may feed the blocks: embeddings before them, a module called between
    them on the batch); after, only its output's shape (the meta device) and the block
    outputs it reads. The head of a language model would otherwise compute every batch's
    logits (batch x tokens x vocabulary floats) only to be thrown away."""
    forward = module.forward

    def shape_only(*args, **kwargs):
        # inside: the meta run of this very call
        if len(trace.calls) < trace.count or trace.inside:
            return forward(*args, **kwargs)
        trace.note((args, kwargs), f"read by {name}")
        device = next(module.parameters(recurse=False)).device
        device = next((t.device for t in tensors_in((args, kwargs))), device)
        trace.inside = True
        try:
            return _shaped_output(module, args, kwargs, device, free_zeros)
        except _NoShape:
            return forward(*args, **kwargs)
        finally:
            trace.inside = False

    return shape_only


@contextlib.contextmanager
def recorders(layers: nn.ModuleList, name: str, trace: Trace, model: nn.Module | None = None):
    """Every block of ``layers`` replaced by a recorder into ``trace`` and every use of their
    outputs noted, for the ``with`` block; the blocks back after. The weighted modules of
    ``model`` outside the blocks give only their output's shape once every block has been
    called (:func:`_shape_only`)."""
    originals = list(layers)
    outside = [(n, m) for n, m in (model.named_modules() if model is not None else ())
               if n != name and not n.startswith(name + ".") and not name.startswith(n + ".")
               and next(m.parameters(recurse=False), None) is not None]
    # an instance attribute (nn.Module.__call__ calls it); one set before (accelerate's
    # hooks) is put back
    before = [m.__dict__.get("forward") for _, m in outside]
    trace.count = len(layers)
    for j in range(len(layers)):
        layers[j] = _Recorder(j, originals[j], trace, name)
    for n, m in outside:
        m.forward = _shape_only(m, trace, n)
    try:
        with _Uses(trace):
            yield trace
    finally:
        for (_, m), f in zip(outside, before):
            if f is None:
                del m.forward
            else:
                m.forward = f
        for j, block in enumerate(originals):
            layers[j] = block


class NotAChain(ValueError):
    """The blocks traced do not form a chain; ``trace``: the forward that showed it;
    ``no_shape``: a shaped trace could not run a block on the meta device; ``batch``: the
    number of the batch whose forward raised with the blocks stood in by recorders (its
    error the ``__cause__``), None where the trace itself refused them. Such a failure may
    be the model's own: :mod:`.sequential` runs that batch without the trace to tell."""

    def __init__(self, message: str, trace: Trace, no_shape: bool = False,
                 batch: int | None = None):
        super().__init__(message)
        self.trace, self.no_shape, self.batch = trace, no_shape, batch


def refuse(name: str, detail: str, trace: Trace) -> NotAChain:
    return NotAChain(
        f"calibrate: sequential=True calibrates the blocks of {name!r} one after the other, "
        f"each on the previous one's outputs, which needs them to form a chain (each called "
        f"once per forward, on the output of the block called before it); but {detail}. "
        f"Name the model's chain of blocks with blocks='...', or calibrate the whole model "
        f"with sequential=False", trace)


def chain_order(trace: Trace, count: int, name: str) -> list[int]:
    """The block indices in the order the forward calls them, when they form a chain (see
    the module's doc); else a ValueError naming the first block that breaks it."""
    seen = {}
    for j, _ in trace.calls:
        seen[j] = seen.get(j, 0) + 1
    for j in range(count):
        if seen.get(j, 0) != 1:
            times = "never called" if j not in seen else f"called {seen[j]} times"
            raise refuse(name, f"block {name}.{j} is {times} in one forward", trace)
    for k, (j, source) in enumerate(trace.calls[1:], 1):
        prev = trace.calls[k - 1][0]
        if source == k - 1:
            continue
        if trace.inputs[k] is trace.inputs[k - 1]:
            detail = (f"block {name}.{j} takes the same input as block {name}.{prev}: "
                      f"parallel blocks (heads), not a chain")
        else:
            detail = (f"block {name}.{j} does not take the output of block {name}.{prev} "
                      f"(called just before it) as its input")
        raise refuse(name, detail, trace)
    for k in sorted(trace.used):
        if k < len(trace.calls) - 1:
            j, nxt = trace.calls[k][0], trace.calls[k + 1][0]
            raise refuse(name, f"the output of block {name}.{j} is read elsewhere than by "
                               f"block {name}.{nxt} (a residual or a sum over the blocks)",
                         trace)
    if trace.extra_used:
        k = min(trace.extra_used)
        raise refuse(name, f"block {name}.{trace.calls[k][0]} returns a tuple whose other "
                           f"items are {trace.extra_used[k]} (as T5's position_bias), while "
                           f"the blocks are replayed with their hidden states only", trace)
    return trace.order()


def trace_batches(model, batches, name: str, layers, shaped: bool, keep) -> tuple[list, int]:
    """Every batch's forward with the blocks recorded; ``keep(i, trace)`` gets batch ``i``'s
    trace (its first block's input, every block's other arguments).
    ``(order, number of batches)``: the blocks' order,
    the same for every batch, or :class:`NotAChain`."""
    order, n = None, 0
    for batch in batches:
        prefix = _prefix_cache(batch)
        if prefix is not None:
            raise ValueError(f"calibrate: sequential=True: batch {n}'s argument {prefix[0]!r} "
                             f"is a KV cache (past_key_values) already holding {prefix[1]} "
                             f"tokens; the blocks are replayed without a cache, so their "
                             f"attention would miss that prefix. Calibrate with "
                             f"sequential=False, which observes the cached keys too")
        trace = Trace(shaped)
        with recorders(layers, name, trace, model):
            try:
                forward_batch(model, batch)
            except Exception as e:
                if not trace.calls:  # the model's own error, before any block
                    raise
                how = "zeros shaped as its output" if shaped else "its input through"
                err = refuse(name, f"with each block giving {how}, the forward failed after "
                                   f"block {name}.{trace.calls[-1][0]} ({type(e).__name__}: "
                                   f"{e})", trace)
                err.no_shape = isinstance(e, _NoShape)
                err.batch = None if err.no_shape else n
                raise err from e
        if not trace.calls:
            raise ValueError(f"calibrate: the model's forward never reached its blocks "
                             f"{name}; name the blocks with blocks='...'")
        got = chain_order(trace, len(layers), name)
        if order is not None and got != order:
            raise refuse(name, f"the forward calls them in the order {got} for batch {n} "
                               f"but {order} for batch 0", trace)
        order = got
        keep(n, trace)
        n += 1
    if n == 0:
        raise ValueError("calibrate: batches is empty: sequential calibration needs at "
                         "least one calibration batch")
    return order, n


def check_disjoint(model: nn.Module, name: str, layers: nn.ModuleList) -> None:
    """Each block holds its own weighted modules: one shared by two blocks (or a block and
    the rest of the model) is one layer of the whole-model pass, observed on all its calls,
    but would be calibrated apart in each piece. Refused, naming both places."""
    owner = {}
    for j, block in enumerate(layers):
        for sub, m in block.named_modules(remove_duplicate=False):
            if next(m.parameters(recurse=False), None) is None:
                continue  # no weights: no observer of its own
            where = f"{name}.{j}" + (f".{sub}" if sub else "")
            if id(m) in owner and owner[id(m)][0] != j:
                raise ValueError(f"calibrate: sequential=True: {where} is the same module as "
                                 f"{owner[id(m)][1]}: block {name}.{j} shares it with another "
                                 f"block, so no block can be calibrated alone; use "
                                 f"sequential=False or name other blocks with blocks='...'")
            owner.setdefault(id(m), (j, where))
    for n, m in model.named_modules(remove_duplicate=False):
        if n != name and not n.startswith(name + ".") and id(m) in owner:
            j, where = owner[id(m)]
            raise ValueError(f"calibrate: sequential=True: {n} (outside the blocks) is the same "
                             f"module as {where}, inside block {name}.{j}; use "
                             f"sequential=False or name other blocks with blocks='...'")
