"""Per-layer ``auto`` metrics ``"joint"`` / ``"fisher"`` (layer_choice.py): probe fixes of s44."""

from __future__ import annotations

import torch
from torch import nn

import quantscope
from quantscope.calibration import Auto, calibrate_many, preset
from quantscope.calibration.choice.layer_choice import JOINT_ROWS
from quantscope.calibration.results.apply import qdq_tensor

_CANDIDATES = ("minmax", "mse", "percentile", "mix")


def test_spread_rows_takes_every_batchs_share_evenly():
    from quantscope.calibration.choice.layer_choice import spread_rows

    x = torch.arange(10.0).unsqueeze(1)
    assert spread_rows(x, 5).flatten().tolist() == [0, 2, 4, 6, 8]
    assert spread_rows(x, 4).flatten().tolist() == [0, 2, 5, 7]  # floor(i * 10 / 4)
    assert spread_rows(x, 10) is x and spread_rows(x, 16) is x


def test_joint_prices_the_inputs_on_every_batch_not_the_first_alone():
    # probing (s44): the sample holds rows in batch order and the joint error read its first
    # JOINT_ROWS, here all of batch 0: the input observer best for batch 0 alone was picked,
    # many times worse over the batches; the later batches bring a heavy-tailed channel
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8)).eval()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(JOINT_ROWS, 16, generator=g) for _ in range(2)]
    batches[1][:, 3] = torch.randn(JOINT_ROWS, generator=g) ** 3 * 8
    c = quantscope.calibrate(model, batches, "w8a8", observer="auto", progress=False,
                             auto=Auto(_CANDIDATES, "joint"))
    alone = calibrate_many(model, batches, {n: preset("w8a8", n) for n in _CANDIDATES},
                           progress=False)
    x, w = torch.cat(batches), model[0].weight.detach()
    wq = qdq_tensor(w, c.states["0"]["weight"])

    def error(state):  # the layer's output error over every calibration row
        return float((qdq_tensor(x, state) @ wq.T - x @ w.T).double().square().sum())

    errors = {n: error(alone[n].states["0"]["input"]) for n in _CANDIDATES}
    # priced on a strided half of the rows: near the best over all of them (minmax and mse,
    # batch 0's best, are ~200x worse here)
    assert error(c.states["0"]["input"]) <= 1.1 * min(errors.values()), errors
