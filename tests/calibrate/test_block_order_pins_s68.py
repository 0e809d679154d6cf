"""Pins found by a mutation round (s68) on the block-order trace that sequential calibration
relies on, on one calibration at a time per model and on the glibc heap switches: which
``nn.ModuleList`` holds the blocks, what a shaped trace records of a block (its output,
its tuple's other items, whether the pass-through stood for it), how the other arguments of
each call are told apart, what the modules outside the blocks compute once every block has
been called, which wirings are refused and how (the error, ``no_shape``, ``batch``),
weightless or repeated modules in ``check_disjoint``, the models ``calibrating`` holds and
releases, and ``QUANTSCOPE_HEAP=0`` or a failing libc. Each test runs on tiny modules, most
through :func:`trace_batches` alone (no calibration)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from test_heap_trim_pass import _Libc
from test_sequential_parts_pins_s64 import _Lists, _trace
from torch import nn

from quantscope.calibration.run import heap
from quantscope.calibration.run.block_order import (
    NotAChain,
    Trace,
    _replayable,
    check_disjoint,
    fill,
    find_blocks,
    split_contexts,
    trace_batches,
)
from quantscope.calibration.run.exclusive import calibrating

W = 4


class _Block(nn.Module):
    """A square Linear; ``ctx``, when given, added to its output."""

    def __init__(self, width=W, out=None):
        super().__init__()
        self.fc = nn.Linear(width, out or width)

    def forward(self, h, ctx=None):
        return self.fc(h) if ctx is None else self.fc(h) + ctx


class _Net(nn.Module):
    """``embed``, ``blocks``, ``side``, ``head`` and ``extra`` modules, wired by
    ``run(model, x)``."""

    def __init__(self, run, n=3, blocks=None, **extra):
        super().__init__()
        self.embed, self.side, self.head = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, 2)
        self.blocks = nn.ModuleList(blocks or [_Block() for _ in range(n)])
        for name, module in extra.items():
            self.add_module(name, module)
        self.run = run

    def forward(self, x):
        return self.run(self, x)


def _chain(m, x):
    h = m.embed(x)
    for b in m.blocks:
        h = b(h)
    return m.head(h)


def _traced(run, n=3, batches=1, shaped=False, blocks=None, **extra):
    """``(order, [(batch index, trace)], model)`` of ``trace_batches`` on a ``_Net``."""
    torch.manual_seed(0)
    model, kept = _Net(run, n, blocks, **extra), []
    xs = [torch.randn(2, W) + 1 for _ in range(batches)]
    order, count = trace_batches(model, xs, "blocks", model.blocks, shaped,
                                 lambda i, t: kept.append((i, t)))
    assert count == batches
    return order, kept, model


# ---- find_blocks ---------------------------------------------------------------------------------

def test_find_blocks_a_list_whose_name_extends_anothers_is_not_inside_it():
    """``layers2`` is a sibling of ``layers``, not a list inside one of its blocks."""
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    model.layers2 = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
    assert find_blocks(model)[0] == "layers2"


def test_find_blocks_counts_children_before_parameters():
    model = _Lists([nn.Linear(2, 2) for _ in range(3)], [nn.Linear(8, 8) for _ in range(2)])
    assert find_blocks(model)[0] == "l0"


# ---- one recorded call ---------------------------------------------------------------------------

class _Cast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, h):
        return self.fc(h).double()


class _Triple(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, h):
        return self.fc(h), h.sum(-1), h.mean(-1)


def _shaped_call(block, h):
    trace = Trace(shaped=True)
    return trace, trace.call(0, block, (h,), {}, "blocks")


def test_a_shaped_call_of_a_square_block_is_faithful():
    trace, out = _shaped_call(nn.Linear(W, W), torch.randn(3, W))
    assert trace.faithful and out.shape == (3, W) and not out.any()


@pytest.mark.parametrize("block, h, shape, dtype", [
    (nn.Linear(W, 2 * W), torch.randn(3, W), (3, 2 * W), torch.float32),
    (_Cast(), torch.randn(3, W), (3, W), torch.float64),
    (nn.Linear(W, W), torch.randn(W, 3).t(), (3, W), torch.float32),
], ids=["widens", "casts", "non-contiguous-input"])
def test_a_shaped_call_is_not_faithful_where_the_pass_through_differs(block, h, shape, dtype):
    """Zeros shaped as the block's output, in its dtype; ``faithful`` only for one tensor of
    its contiguous input's shape and dtype."""
    trace, out = _shaped_call(block, h)
    assert out.shape == shape and out.dtype == dtype and not out.any()
    assert trace.faithful is False


def test_a_shaped_tuple_keeps_the_hidden_states_and_every_other_item():
    trace, out = _shaped_call(_Triple(), torch.randn(3, W))
    assert trace.outputs == [out[0]] and not trace.faithful
    assert len(trace.extras[0]) == 2 and all(e is o for e, o in zip(trace.extras[0], out[1:]))


def test_the_first_reader_of_a_tuples_other_item_is_named():
    item = torch.zeros(2)
    trace = Trace(extras=[[item]])
    trace.note((item,), "read by add")
    trace.note((item,), "read by mul")
    assert trace.extra_used == {0: "read by add"}


def test_the_first_input_is_kept_as_it_was_before_the_forward_changed_it_in_place():
    def run(m, x):
        h = m.embed(x)
        m.embedded = h.clone()
        for b in m.blocks:
            h = b(h)
        h.add_(1.0)  # the pass-through shares the first input's storage
        return h
    _, kept, model = _traced(run)
    assert torch.equal(kept[0][1].first, model.embedded)


def test_a_positional_kv_cache_is_dropped_from_the_replay():
    from transformers import DynamicCache

    h = torch.ones(2)
    args, kwargs = _replayable((h, DynamicCache(), 3), {})
    assert args[0] is h and args[1] is None and args[2] == 3 and kwargs == {}


# ---- split_contexts ------------------------------------------------------------------------------

_M, _P = torch.zeros(1), torch.ones(1)


@pytest.mark.parametrize("first, second", [
    (((_M,), {}), ((_M, _P), {})),  # one argument more
    (((), {"mask": _M}), ((), {"mask": _M, "pos": _P})),  # one keyword more
    (((), {"mask": _M, "pos": _P}), ((), {"mask": _M})),  # one keyword less
    (((), {"window": 1024}), ((), {"window": None})),  # another value (Gemma's sliding window)
    (((), {"dims": (1, 2)}), ((), {"dims": [1, 2]})),  # a list for a tuple
], ids=["argument", "keyword", "keyword-less", "value", "list"])
def test_a_call_whose_arguments_differ_from_the_firsts_keeps_its_own(first, second):
    tensors, template, own = split_contexts(_trace([first, second]))
    assert list(own) == [1]
    args, kwargs = fill(own[1], tensors)
    assert len(args) == len(second[0]) and all(a is b for a, b in zip(args, second[0]))
    assert kwargs.keys() == second[1].keys()
    assert all(kwargs[k] is v or kwargs[k] == v for k, v in second[1].items())
    assert fill(template, tensors)[1].keys() == first[1].keys()


def test_own_templates_are_keyed_by_block_not_by_call():
    a, b = torch.zeros(2), torch.ones(2)
    trace = _trace([((), {"mask": a}), ((), {"mask": b}), ((), {"mask": a})],
                   calls=[(2, None), (0, 0), (1, 1)])
    tensors, _, own = split_contexts(trace)
    assert list(own) == [0] and fill(own[0], tensors)[1]["mask"] is b


# ---- the trace of a forward ----------------------------------------------------------------------

def test_reading_a_block_outputs_metadata_is_no_use_of_it():
    def run(m, x):
        h = m.blocks[0](m.embed(x))
        assert h.shape == h.size() == (2, W) and h.dim() == 2 and h.dtype == torch.float32
        return m.head(m.blocks[2](m.blocks[1](h)))
    assert _traced(run)[0] == [0, 1, 2]


def test_blocks_called_with_hidden_states_by_keyword_form_a_chain():
    """transformers calls a layer as ``layer(hidden_states=h, ...)``: ``h`` is the input,
    the other keywords its context."""
    def run(m, x):
        h, m.mask = m.embed(x), m.side(x)
        for b in m.blocks:
            h = b(hidden_states=h, ctx=m.mask)
        return m.head(h)
    order, kept, model = _traced(run)
    assert order == [0, 1, 2]
    assert all(args == () and list(kw) == ["ctx"] and kw["ctx"] is model.mask
               for args, kw in kept[0][1].contexts)


def test_modules_outside_the_blocks_give_only_a_shape_once_every_block_ran():
    """The head (after the blocks) gives zeros of its output's shape; the embedding (before
    them) computes."""
    def run(m, x):
        m.embedded = m.embed(x)
        m.logits = _chain(m, x)
        return m.logits
    _, _, model = _traced(run)
    assert model.logits.shape == (2, 2) and not model.logits.any()
    assert model.embedded.abs().sum() > 0


def test_a_module_called_between_the_last_two_blocks_computes_its_values():
    """A weighted module the forward calls on the batch between the blocks feeds them: its
    output is kept as the last block's argument, not zeros."""
    def run(m, x):
        h = m.blocks[0](m.embed(x))
        m.mask = m.side(x)
        return m.head(m.blocks[1](h, m.mask))
    _, kept, model = _traced(run, n=2)
    (arg,), _ = kept[0][1].contexts[1]
    assert arg is model.mask and arg.abs().sum() > 0


def test_a_head_that_cannot_run_on_meta_computes():
    class Picky(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, h):
            return (h * self.scale)[h > 0]  # data-dependent: no meta shape

    def run(m, x):
        m.picked = m.picky(_chain(m, x))
        return m.picked
    order, _, model = _traced(run, picky=Picky())
    assert order == [0, 1, 2] and model.picked.ndim == 1


def test_forwards_are_put_back_after_the_trace():
    def run(m, x):
        return _chain(m, x)
    torch.manual_seed(0)
    model = _Net(run)
    original = model.embed.forward

    def hooked(*args, **kwargs):  # an accelerate-like hook
        return original(*args, **kwargs)
    model.embed.forward = hooked
    trace_batches(model, [torch.randn(2, W)], "blocks", model.blocks, False, lambda i, t: None)
    assert model.embed.__dict__["forward"] is hooked
    assert "forward" not in model.head.__dict__ and "forward" not in model.side.__dict__
    x = torch.randn(2, W)
    assert torch.equal(model(x), model.head(model.blocks[2](model.blocks[1](
        model.blocks[0](model.embed(x))))))


def test_keep_gets_each_batch_by_its_index():
    order, kept, _ = _traced(_chain, batches=3)
    assert order == [0, 1, 2] and [i for i, _ in kept] == [0, 1, 2]


@pytest.mark.parametrize("wiring, says", [
    ("fork", r"block blocks\.2 takes the same input as block blocks\.1: parallel blocks"),
    ("last_two", r"the output of block blocks\.1 is read elsewhere than by block blocks\.2"),
    ("head_reads", r"the output of block blocks\.0 is read elsewhere than by block blocks\.1"),
], ids=["fork", "last_two", "head_reads"])
def test_what_is_not_a_chain_is_refused(wiring, says):
    """A block on an earlier (not the previous) block's output; the output of the block
    before the last read again; a module after the blocks reading an earlier output."""
    def run(m, x):
        h0 = m.blocks[0](m.embed(x))
        if wiring == "fork":
            return m.head(m.blocks[1](h0) + m.blocks[2](h0))
        h1 = m.blocks[1](h0)
        h2 = m.blocks[2](h1)
        if wiring == "last_two":
            return m.head(h2 + h1)
        return m.head(h2) + m.side(h0)[:, :2]
    with pytest.raises(NotAChain, match=says):
        _traced(run)


def test_the_models_own_error_before_any_block_is_raised_as_it_is():
    def run(m, x):
        raise KeyError("the model's own")
    with pytest.raises(KeyError, match="the model's own"):
        _traced(run)


def test_a_forward_that_never_calls_the_blocks_is_refused():
    def run(m, x):
        return m.head(m.embed(x))
    with pytest.raises(ValueError, match=r"the model's forward never reached its blocks"):
        _traced(run)


class _Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, h):
        return self.fc(h)[h > 0]  # data-dependent: no meta shape


class _Named(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, h):
        return {"hidden": self.fc(h)}


@pytest.mark.parametrize("block", [_Routed, _Named])
def test_a_block_a_shaped_trace_cannot_run_says_no_shape(block):
    """A block that fails on the meta device or gives neither a tensor nor a tuple: the
    refusal says ``no_shape`` and names no batch (no forward of the model's own failed)."""
    with pytest.raises(NotAChain) as e:
        _traced(_chain, blocks=[block() for _ in range(3)], shaped=True)
    assert e.value.no_shape is True and e.value.batch is None


def test_a_forward_that_fails_on_the_pass_through_names_its_batch():
    """Widening blocks: the head fails on the pass-through's width, in batch 0."""
    def run(m, x):
        h = m.embed(x)
        for b in m.blocks:
            h = b(h)
        return m.wide_head(h)
    blocks = [_Block(W, 2 * W), _Block(2 * W, 2 * W)]
    with pytest.raises(NotAChain, match=r"the forward failed after block blocks\.1") as e:
        _traced(run, n=2, blocks=blocks, wide_head=nn.Linear(2 * W, 2))
    assert e.value.no_shape is False and e.value.batch == 0


# ---- check_disjoint ------------------------------------------------------------------------------

class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = self.a


def test_check_disjoint_accepts_a_module_twice_in_one_block_and_a_shared_weightless_one():
    act = nn.ReLU()
    model = _Lists([_Twice(), _Twice()], [nn.Sequential(nn.Linear(2, 2), act) for _ in range(2)])
    assert check_disjoint(model, "l0", model.l0) is None  # accepted: no ValueError
    assert check_disjoint(model, "l1", model.l1) is None


# ---- exclusive -----------------------------------------------------------------------------------

def test_calibrating_a_non_module_holds_nothing():
    """Not a module: nothing to hold (``calibrate``'s own checks name what model must be)."""
    with calibrating("not a model") as held, calibrating(object()) as again:
        assert (held, again) == (None, None)


def test_calibrating_holds_the_model_its_modules_and_a_wrapper_around_it():
    model, leaf = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 2)
    with calibrating(model), calibrating(leaf):
        for other in (model, model[1], nn.Sequential(model), leaf):
            with pytest.raises(ValueError, match="is being calibrated by a call"), \
                    calibrating(other):
                pass
    with calibrating(model[1]), calibrating(leaf):
        pass


def test_calibrating_releases_every_module_when_its_call_raises():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(KeyError), calibrating(model):
        raise KeyError
    with calibrating(model[0]), calibrating(model[1]):
        pass
    with calibrating(model):
        pass


# ---- heap ----------------------------------------------------------------------------------------

def _libc(monkeypatch, libc):
    monkeypatch.setattr(heap, "_libc", libc)
    monkeypatch.setattr(heap, "_looked", True)
    monkeypatch.setattr(heap, "_prepared", False)
    return libc


def test_quantscope_heap_0_turns_prepare_and_trim_off(monkeypatch):
    libc = _libc(monkeypatch, _Libc())
    monkeypatch.setenv("QUANTSCOPE_HEAP", "0")
    assert heap.prepare() is False and heap.trim() is False
    assert libc.calls == []


def test_prepare_is_false_where_mallopt_refuses(monkeypatch):
    """glibc's ``mallopt`` returns 0 on an error: the threshold was not fixed."""
    class Refusing(_Libc):
        def mallopt(self, param, value):
            super().mallopt(param, value)
            return 0
    _libc(monkeypatch, Refusing())
    monkeypatch.delenv("QUANTSCOPE_HEAP", raising=False)
    assert heap.prepare() is False


def test_a_libc_without_malloc_trim_counts_as_no_glibc(monkeypatch):
    """musl / macOS: the C library loads but lacks glibc's functions; both are no-ops."""
    _libc(monkeypatch, None)
    monkeypatch.setattr(heap, "_looked", False)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: object())
    monkeypatch.delenv("QUANTSCOPE_HEAP", raising=False)
    assert heap.prepare() is False and heap.trim() is False
