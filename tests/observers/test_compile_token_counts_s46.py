"""A compiled observer takes batches of any token count without a graph per shape (probe s46):
the Python mirror of the last shape was guarded on (``self._last_shape == (4, 64)``) and the
histogram's chunk loop ran over the symbolic size, so ``torch.compile(obs, fullgraph=True)``
recompiled per token count and raised ``FailOnRecompileLimitHit`` at the 9th. llm-compressor's
own static min-max compiles twice for the same batches."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import quantscope
from quantscope import QuantSpec

_STATE = ("observed_tokens", "observed_shape", "min_vals", "max_vals", "hist_counts")


@pytest.mark.parametrize("name", ["static_minmax", "memoryless_minmax", "histogram"])
def test_one_graph_for_every_token_count(name):
    torch._dynamo.reset()
    eager = quantscope.get_observer(name, QuantSpec())  # int8 per tensor
    compiled = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(compiled, fullgraph=True, backend=counter)
    g = torch.Generator().manual_seed(0)
    for rows in range(1, 13):  # activations: 1..12 tokens of 64
        x = torch.randn(rows, 64, generator=g) * rows
        eager(x)
        step(x)
    # the first call sizes the state, torch's automatic-dynamic pass makes the size a symbol;
    # static_minmax's state sized from empty on that first call is one more graph
    assert counter.frame_count == (3 if name == "static_minmax" else 2)
    for key in _STATE:
        if hasattr(eager, key):
            assert torch.equal(getattr(compiled, key), getattr(eager, key)), key
    assert compiled.shape == eager.shape == (12, 64)
    assert all(type(d) is int for d in compiled.shape)  # plain ints, no symbols left
    assert torch.equal(compiled.qparams().scale, eager.qparams().scale)


def test_compiled_unit_count_change_still_refused():
    # the compiled check reads the state's size: a changed unit count is still an error
    torch._dynamo.reset()
    obs = quantscope.get_observer("static_minmax", QuantSpec("int8", "token"))
    step = torch.compile(obs, fullgraph=True, backend="aot_eager")
    step(torch.randn(4, 64))
    with pytest.raises(Exception, match="unit count must not change"):
        step(torch.randn(5, 64))
