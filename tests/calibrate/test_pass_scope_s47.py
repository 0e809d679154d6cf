"""What ``calibrate``'s pass observes: each batch's forward, not a forward that the batches'
own iterator runs (it was recorded as data: a generator filtering by the model's output
moved an input range 23x); and a layer the forward runs on a thread pool, where the pool is
given the pass's context (docs/guide/calibrating.md)."""

from __future__ import annotations

import contextvars
from concurrent import futures

import torch
from torch import nn

import quantscope

RECIPE = quantscope.calibrate.preset("w8a8", "static_minmax")


class MLP(nn.Module):
    def __init__(self, pool=None):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.pool = nn.Linear(16, 32), nn.Linear(32, 16), pool

    def forward(self, x):
        if self.pool is not None:  # fc1 on a worker, given the caller's context and mode
            x = self.pool.submit(contextvars.copy_context().run, self._fc1,
                                 torch.is_inference_mode_enabled(), x).result()
        else:
            x = self.fc1(x)
        return self.fc2(torch.relu(x))

    def _fc1(self, inference, x):
        with torch.inference_mode(inference):  # (torch's grad mode is per thread too)
            return self.fc1(x)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, 16, generator=g) * (1 + i) for i in range(3)]


def _ranges(cal):
    return {(layer, role): (s.lo, s.hi) for layer, roles in cal.states.items()
            for role, s in roles.items()}


def _same(a, b):
    ra, rb = _ranges(a), _ranges(b)
    assert ra.keys() == rb.keys()
    for k in ra:
        assert all(torch.equal(x, y) for x, y in zip(ra[k], rb[k])), k


def test_a_forward_inside_the_batch_generator_is_no_data():
    want = quantscope.calibrate(MLP(), _batches(), RECIPE, progress=False)
    model, look = MLP(), torch.full((2, 8, 16), 100.0)

    def batches():
        for b in _batches():
            with torch.no_grad():
                model(look)  # the generator's own look at the model
            yield b

    got = quantscope.calibrate(model, batches(), RECIPE, progress=False)
    _same(got, want)
    assert float(got.states["fc1"]["input"].hi.max()) < 100.0


def test_a_pool_given_the_pass_context_is_observed():
    want = quantscope.calibrate(MLP(), _batches(), RECIPE, progress=False)
    with futures.ThreadPoolExecutor(1) as pool:
        got = quantscope.calibrate(MLP(pool), _batches(), RECIPE, progress=False)
    _same(got, want)
