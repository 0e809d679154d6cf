"""A fault at the edge of apply() / remove() leaves the model as it was, or undoable."""

import copy

import pytest
import torch
from tiny_models import llama

from quantscope import calibrate
from quantscope.calibration import preset
from quantscope.calibration.results import apply as apply_module
from quantscope.calibration.structure import kv_cache


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_an_interrupt_as_apply_records_its_handle_leaves_nothing_applied(monkeypatch):
    """A Ctrl-C in apply()'s last steps (recording the handle, under a lock) left the weights
    fake-quantized and the hooks on, with no handle to undo them, and every later apply()
    refused."""
    model, batches = llama()
    calib = calibrate(model, batches, "w8a8", progress=False)
    m = copy.deepcopy(model)
    before, hooks = copy.deepcopy(m.state_dict()), _hooks(m)
    real = apply_module._track

    def interrupted(handle, active):
        if active:
            raise KeyboardInterrupt
        real(handle, active)
    monkeypatch.setattr(apply_module, "_track", interrupted)
    with pytest.raises(KeyboardInterrupt):
        calib.apply(m)
    monkeypatch.undo()
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    assert _hooks(m) == hooks
    with calib.apply(m):  # applies again
        pass


def test_remove_run_again_finishes_a_kv_cache_detach_that_failed(monkeypatch):
    """A step of the KV-cache undo that raised was dropped before it ran: a second remove()
    returned with the attention still routed through quantscope, and apply() refused for
    good."""
    model, batches = llama()
    calib = calibrate(model, batches, preset("w8a8", kv_cache="fp8"), progress=False)
    m = copy.deepcopy(model)
    chosen = m.config._attn_implementation
    handle = calib.apply(m)
    assert m.config._attn_implementation != chosen
    real, calls = kv_cache._unroute, []

    def fails_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("interrupted")
        real(*args)
    monkeypatch.setattr(kv_cache, "_unroute", fails_once)
    with pytest.raises(RuntimeError, match="interrupted"):
        handle.remove()
    handle.remove()
    assert m.config._attn_implementation == chosen
    with calib.apply(m):
        pass
