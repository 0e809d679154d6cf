"""What ``calibrate``'s pass gives each batch's forward (s48, after test_pass_scope_s47): torch's
inference mode, and the batch's number as its caller knows it (``batch_index``: a rank's shard
of the batches numbered by their place among all of them)."""

from __future__ import annotations

import torch
from torch import nn

import quantscope
from quantscope.calibration.run import observe

RECIPE = quantscope.calibrate.preset("w8a8", "static_minmax")


class Recorder(nn.Module):
    """A Linear that records the mode and the batch number each of its forwards ran under."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)
        self.seen = []

    def forward(self, x):
        self.seen.append((torch.is_inference_mode_enabled(), observe._BATCH.get()))
        return self.fc(x)


def _batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 4, 8, generator=g) for _ in range(n)]


def test_each_batch_is_forwarded_in_inference_mode():
    model = Recorder()
    quantscope.calibrate(model, _batches(), RECIPE, progress=False)
    assert model.seen == [(True, 0), (True, 1), (True, 2)]
    assert not torch.is_inference_mode_enabled()  # (the pass's alone)


def test_batches_are_numbered_by_batch_index():
    """``batch_index(i)``: the number of the ``i``-th batch for the pass (its errors and its
    samples), where a caller forwards a shard of the batches."""
    model = Recorder()
    n = observe.observe_batches(model, _batches(), {}, 0, False, 0,
                                batch_index=lambda i: 7 + 2 * i, forward=True)
    assert n == 3
    assert model.seen == [(True, 7), (True, 9), (True, 11)]
