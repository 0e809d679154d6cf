"""Probe s38: the histogram observers' EMA mode (``averaging_constant``, Horizon's classes)
and first grid replaced ``ema_*`` / ``window_*`` / ``hist_lo`` / ``hist_hi`` with new tensor
objects every batch, where the observers' rule is that state buffers keep theirs
(``Observer._store``); the values stay bitwise those of plain reassignment."""

import pytest
import torch

import quantscope
from quantscope.compat import horizon as hz
from quantscope.observers.base import Observer
from quantscope.spec import QuantSpec

INT8 = QuantSpec("int8")
MAKERS = {
    "percentile ema": lambda: quantscope.get_observer("percentile", INT8, averaging_constant=0.5),
    "percentile ema first grid": lambda: quantscope.get_observer(
        "percentile", INT8, averaging_constant=0.5, grid="first"),
    "percentile first grid": lambda: quantscope.get_observer("percentile", INT8, grid="first"),
    "kl ema interval 2": lambda: quantscope.get_observer("kl", INT8, averaging_constant=0.5,
                                                         update_interval=2),
    "horizon percentile": hz.PercentileObserver,
    "horizon kl": lambda: hz.KLObserver(update_interval=2),
    "horizon mix": hz.MixObserver,
}


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(8, 64, generator=g) * s for s in (1, 3, 0.5, 2, 4)]


@pytest.mark.parametrize("name", list(MAKERS))
def test_every_state_buffer_keeps_its_object(name, monkeypatch):
    obs, batches = MAKERS[name](), _batches()
    obs(batches[0])
    obs(batches[1])  # every buffer sized (an interval of 2 finished)
    before = dict(obs.named_buffers())
    for x in batches[2:]:
        obs(x)
    replaced = [k for k, v in obs.named_buffers() if v is not before[k]]
    assert not replaced, f"{name}: {replaced} replaced, not updated in place"
    monkeypatch.setattr(Observer, "_store", lambda self, ns, vs: self._buffers.update(zip(ns, vs)))
    ref = MAKERS[name]()
    for x in batches:
        ref(x)
    got = obs.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k], v), f"{name}: {k} not bitwise"
