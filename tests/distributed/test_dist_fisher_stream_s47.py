"""Mutation round s47 on the session's ``_held`` across ranks: ``Auto(metric="fisher")`` given
a DataLoader-like stream (a length, not a list) on each rank lists it, as the distributed pass
needs (``comm.shard`` keeps a length only for a list; the activation sample, which the
choice reads, is spread over that length): the choices equal the list's.

One spawn of 2 gloo processes."""

from __future__ import annotations

import warnings

import pytest
import torch
from ports import rank_results, spawn_ranks

import quantscope
from quantscope.calibration import Auto, Runtime, Sampling

pytestmark = pytest.mark.dist  # spawns its own process group

TIMEOUT = 20
NAMES = ("static_minmax", "percentile", "mse")


def _loss(out, batch):
    return (out[:, 0] * 30).square().mean() + out[:, 1:].sum() * 1e-3


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batches(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(8, 16, generator=g) * torch.linspace(0.1, 4, 16) for _ in range(n)]
    for i, x in enumerate(out):
        x[i % 8, 3] = 20.0 + i
    return out


class Stream:
    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return (b.clone() for b in self.batches)

    def __len__(self):
        return len(self.batches)


def _choices(batches):
    c = quantscope.calibrate(_mlp(), batches, "w8a8", observer="auto", progress=False,
                             runtime=Runtime(distributed=True), sampling=Sampling(tokens=4),
                             auto=Auto(candidates=NAMES, metric="fisher", loss=_loss))
    return {(n, r): (s.observer, s.qparams.scale.tolist())
            for n, rs in c.states.items() for r, s in rs.items()}


def _scenarios(r, out):
    warnings.simplefilter("ignore")
    mine = _batches(seed=r)
    out["list"] = _choices(mine)
    out["stream"] = _choices(Stream(mine))


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, 2, TIMEOUT)


def test_a_stream_on_each_rank_chooses_as_the_list(ranks):
    for listed, streamed in zip(rank_results(ranks, "list"), rank_results(ranks, "stream")):
        assert streamed == listed
