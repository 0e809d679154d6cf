"""How a calibration batch is fed to a model: the one rule every pass (calibration, fusion
detection, auto's scoring, sensitivity) uses."""

from __future__ import annotations

import copy
import inspect
import itertools
import operator
import sys
from collections import UserDict
from collections.abc import Iterable, Mapping
from contextlib import contextmanager

import torch

from ...observers.runtime import nested_rows
from ...stats.minmax import any_non_finite

__all__ = ["batch_arguments", "check_batches", "eval_mode", "forward_batch", "input_name",
           "is_kv_cache", "keyword_batch", "keywords_of", "leaves_in", "length_checked",
           "map_tensors", "module_input", "nan_parameter", "peek", "sized_like", "tensors_in"]


@contextmanager
def eval_mode(model):
    """``model`` and all its submodules in eval mode inside; on leaving, every module's own
    ``training`` flag as it was (``model.train(was)`` would set them all to the root's)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, was in modes:
            m.training = was


def forward_batch(model, batch):
    """``model(**batch)`` for a dict (a tokenizer's output), ``model(*batch)`` for a tuple or
    list, ``model(batch)`` otherwise; each KV cache object in it a copy (:func:`_fresh_caches`)."""
    batch = _fresh_caches(batch)
    if keyword_batch(batch):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def keyword_batch(batch) -> bool:
    """Whether :func:`forward_batch` passes ``batch`` as keyword arguments: a dict, or
    anything with ``keys()`` (a tokenizer's ``BatchEncoding``), as ``**`` reads it."""
    return isinstance(batch, dict) or hasattr(batch, "keys")


def keywords_of(batch) -> dict:
    """A keyword batch (:func:`keyword_batch`) as the dict ``**`` makes of it: a dict itself,
    else its ``keys()`` read (an object with ``keys()`` and ``[]`` only has no ``get``)."""
    return batch if isinstance(batch, dict) else {k: batch[k] for k in batch.keys()}  # noqa: SIM118


def batch_arguments(batch) -> list[tuple[str, object]]:
    """``(name, value)`` of each argument :func:`forward_batch` passes: a keyword batch's
    keys, a tuple's or list's ``argument i``, a lone input's ``input``."""
    if keyword_batch(batch):
        return list(keywords_of(batch).items())
    if isinstance(batch, (tuple, list)):
        return [(f"argument {i}", v) for i, v in enumerate(batch)]
    return [("input", batch)]


def is_kv_cache(value) -> bool:
    """Whether ``value`` is a transformers ``Cache`` (``DynamicCache`` ...; transformers not
    imported: none was made)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    return cache_utils is not None and isinstance(value, cache_utils.Cache)


#: what holds no KV cache: :func:`_fresh` returns it at once
_LEAVES = (torch.Tensor, str, bytes, int, float, complex)


def _fresh_caches(batch):
    """``batch`` with each KV cache object in it (an argument, or inside one: a dict a
    wrapper model takes positionally) replaced by a copy: a forward fills the cache it is
    given, and a batch is forwarded more than once (fusion detection, the pass, auto's
    scoring): each forward starts from the cache as given (an empty one: as with none, the
    sequential pass's result), and the user's stays as it was. A batch holding none is
    returned as it is."""
    return _fresh(batch, keyword_batch(batch))


def _fresh(value, keywords: bool = False, path: frozenset = frozenset()):
    """``value`` with its KV caches copied, at any depth (``keywords``: read as a mapping, as
    ``**`` reads a batch; any Mapping inside); ``value`` itself where it holds none (a
    container holding itself is not walked again: ``path``, the ids above), else a copy: of
    its type for a tuple, list or :func:`_mapping_like`'s mappings."""
    if isinstance(value, _LEAVES) or value is None or id(value) in path:
        return value
    if is_kv_cache(value):
        return _copy_cache(value)
    path |= {id(value)}
    if keywords or isinstance(value, Mapping):
        new = {k: _fresh(value[k], path=path) for k in value.keys()}  # noqa: SIM118 (as **)
        return value if all(new[k] is value[k] for k in new) else _mapping_like(value, new)
    if not isinstance(value, (tuple, list)):
        return value
    new = [v if isinstance(v, _LEAVES) else _fresh(v, path=path) for v in value]  # (long ids)
    if all(map(operator.is_, new, value)):
        return value
    return type(value)(*new) if hasattr(value, "_fields") else type(value)(new)


def _mapping_like(value: Mapping, items: dict) -> Mapping:
    """``items`` in a mapping of ``value``'s type where its copy has storage of its own: a
    dict's or a ``UserDict``'s (a ``BatchEncoding``; a ``ModelOutput``), its other attributes
    kept; else a plain dict (another mapping's shallow copy may share the user's storage,
    which the new items would overwrite)."""
    if type(value) is dict or not isinstance(value, (dict, UserDict)):
        return items
    out = copy.copy(value)
    for k, v in items.items():  # (not update(): a ModelOutput refuses it)
        out[k] = v
    return out


def _copy_cache(cache):
    """A deep copy of a KV cache, its tensors detached clones (``copy.deepcopy`` refuses a
    tensor a graph made: a prefix computed with gradients)."""
    memo, seen, todo = {}, set(), [cache]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            memo[id(obj)] = obj.detach().clone()
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif isinstance(obj, Mapping):
            todo.extend(obj.values())
        elif hasattr(obj, "__dict__"):
            todo.extend(vars(obj).values())
    return copy.deepcopy(cache, memo)


def check_batches(batches, who: str = "calibrate") -> None:
    """Raise unless ``batches`` is an iterable of batches: one dict (a tokenizer's output)
    would be iterated over its key strings, each fed to the model as a batch, and one tensor
    over its rows, each a batch without the batch dimension."""
    if isinstance(batches, (dict, torch.Tensor)) or hasattr(batches, "keys"):
        split = " (or list(t.unbind(0)): one batch per row)" if torch.is_tensor(batches) else ""
        raise TypeError(f"{who}: batches must be an iterable of batches, got one "
                        f"{type(batches).__name__} (a single batch); wrap it in a list: "
                        f"[batch]{split}")
    # not iter(batches): a DataLoader's would start its workers; nor a str, read one
    # character per batch
    iterable = isinstance(batches, Iterable) or hasattr(batches, "__getitem__")
    if not iterable or isinstance(batches, (str, bytes)):
        raise TypeError(f"{who}: batches must be an iterable of batches (tensors, tuples or "
                        f"dicts, e.g. a tokenizer's output per batch), got "
                        f"{type(batches).__name__} {_short(batches)}")


def length_checked(batches, lengths: bool = True, who: str = "calibrate"):
    """``batches`` checked by :func:`check_batches`, and (``lengths``) each batch by
    :func:`check_length`: a list or tuple all now (before any forward), a stream (a
    generator, a DataLoader) each batch as it is read, so before its first forward (its
    length kept: :func:`batch_count`)."""
    check_batches(batches, who)
    if not lengths:
        return batches
    if isinstance(batches, (list, tuple)):
        for i, batch in enumerate(batches):
            check_length(batch, i, who)
        return batches
    return _LengthChecked(batches, who)


class _LengthChecked:
    def __init__(self, source, who: str):
        self.source, self.who, self.read = source, who, 0

    def __iter__(self):
        it = iter(self.source)
        once = it is self.source  # a generator: a second read goes on where the first stopped
        i = self.read if once else 0
        for batch in it:
            check_length(batch, i, self.who)
            i += 1
            self.read = i if once else 0
            yield batch

    def __len__(self) -> int:
        return len(self.source)  # TypeError where it has none, as the source's

    def __bool__(self) -> bool:
        return bool(self.source)  # (not len's: a generator is true, as the source is)


#: a keyword batch's main input, in this order: what :func:`check_length` reads first
_MAIN_INPUTS = ("input_ids", "inputs_embeds")


def check_length(batch, i: int, who: str = "calibrate") -> None:
    """Raise where batch ``i``'s input (a dict's ``input_ids`` or ``inputs_embeds`` wherever it
    sits, else the first tensor) has rows but an empty dimension after them (sequences of 0
    tokens): the model fails on it somewhere inside its forward (an attention's reshape), the
    sequential pass elsewhere. A batch of 0 rows is not refused here (a plain module passes
    it through; the model says whether it takes one), as before. Shapes only: no tensor is
    read."""
    arguments = batch_arguments(batch)  # the main input first, wherever a dict holds it
    for name, value in sorted(arguments, key=lambda a: a[0] not in _MAIN_INPUTS):
        t = next(tensors_in(value), None)
        if t is None:
            continue
        if not t.is_nested and t.dim() >= 2 and t.shape[0] > 0 and 0 in t.shape[1:]:
            d = list(t.shape).index(0, 1)
            what = " (sequences of 0 tokens)" if d == 1 else ""
            raise ValueError(f"{who}: batch {i}'s {name} has shape {tuple(t.shape)}: its "
                             f"dimension {d} is empty{what}, so the model has nothing to "
                             f"run on; leave the batch out")
        return


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def batch_count(batches) -> int | None:
    """How many batches ``batches`` holds, or None where it cannot say (a generator; a
    DataLoader over an IterableDataset, whose ``len()`` raises ``TypeError``)."""
    try:
        return len(batches)
    except TypeError:
        return None


class _Sized:
    """An iterator with the length of the iterable it was read from."""

    def __init__(self, it, n: int):
        self.it, self.n = it, n

    def __iter__(self):
        return self.it

    def __len__(self) -> int:
        return self.n


def sized_like(it, source):
    """``it`` (an iterator over ``source``'s batches) with ``source``'s length where it has one
    (a DataLoader's): the activation sample is spread over that many batches
    (:func:`batch_count`), as over ``source`` itself."""
    n = batch_count(source)
    return it if n is None else _Sized(it, n)


def peek(batches, wanted=None):
    """``(the first batch, batches)`` with nothing consumed from ``batches``: a stream stays
    one (no list of all the batches) and keeps its source's length (:func:`sized_like`).
    With ``wanted``, the first batch it holds for, else the first (a stream is read up to
    it, the batches before it kept); None where there is no batch."""
    if isinstance(batches, (list, tuple)):
        first = batches[0] if batches else None
        return next((b for b in batches if wanted is None or wanted(b)), first), batches
    it, seen, found = iter(batches), [], 0
    for b in it:
        seen.append(b)
        if wanted is None or wanted(b):
            found = len(seen) - 1
            break
    if not seen:
        return None, []
    return seen[found], sized_like(itertools.chain(seen, it), batches)


def tensors_in(value):
    """The tensors of a nested tuple / list / mapping (a batch, a block's arguments or
    output), an object with ``keys()`` and ``[]`` read as ``**`` reads it."""
    return (v for v in leaves_in(value) if isinstance(v, torch.Tensor))


def leaves_in(value, path: frozenset = frozenset()):
    """What a nested tuple / list / mapping holds that is none of them (tensors, KV caches,
    numbers ...), walked as :func:`tensors_in` walks it; a container holding itself is not
    walked again (``path``: the ids above)."""
    if isinstance(value, _LEAVES) or value is None:
        yield value
        return
    if id(value) in path:
        return
    if isinstance(value, (tuple, list)):
        items = value
    elif isinstance(value, Mapping) or _keyed(value):
        items = keywords_of(value).values()
    else:
        yield value
        return
    path |= {id(value)}
    for v in items:
        yield from leaves_in(v, path)


def _keyed(value) -> bool:
    """Whether ``value`` reads as a mapping under ``**``: ``keys()`` and ``[]``."""
    return hasattr(value, "keys") and hasattr(value, "__getitem__")


def map_tensors(fn, value, keywords: bool = False, path: frozenset = frozenset()):
    """``value`` with ``fn`` applied to each of its tensors, the nesting kept (a namedtuple
    and a ``UserDict``, a tokenizer's ``BatchEncoding``, keep their type; another mapping
    becomes a dict, as does ``value`` itself read as ``**`` reads a batch: ``keywords``); a
    container holding itself is not walked again (``path``: the ids above)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if id(value) in path or not (keywords or isinstance(value, (tuple, list, Mapping))):
        return value
    path |= {id(value)}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple: by position
        return type(value)(*(map_tensors(fn, v, path=path) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(fn, v, path=path) for v in value)
    # a dict subclass as a dict (what a spill file can hold)
    items = {k: map_tensors(fn, v, path=path) for k, v in keywords_of(value).items()}
    return items if isinstance(value, dict) else _mapping_like(value, items)


def input_name(module: torch.nn.Module) -> str | None:
    """The name of ``module.forward``'s first parameter (``input`` for ``nn.Linear``): where
    its input is when a caller passes it as a keyword (``lin(input=x)``); without a
    positional one, its first keyword-only one (``forward(self, *, x)``)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for kinds in ((inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD),
                  (inspect.Parameter.KEYWORD_ONLY,)):
        name = next((p.name for p in params if p.kind in kinds), None)
        if name is not None:
            return name
    return None


def module_input(args: tuple, kwargs: dict, name: str | None, rows: bool = True):
    """A module call's input: the first positional argument, else the keyword ``name``; a
    nested tensor as its rows (:func:`~quantscope.observers.runtime.nested_rows`: what
    observers see of it) unless ``rows=False``."""
    x = args[0] if args else kwargs.get(name) if name is not None else None
    return nested_rows(x) if rows and isinstance(x, torch.Tensor) and x.is_nested else x


def nan_parameter(model) -> str | None:
    """The name of the first parameter of ``model`` holding NaN or inf (None: none; meta and
    offloaded ones are not read): a calibration batch's NaN is as often the model's own."""
    for name, p in model.named_parameters() if model is not None else ():
        if p.is_floating_point() and not p.is_meta and bool(any_non_finite(p.detach())):
            return name
    return None
