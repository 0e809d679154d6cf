"""The pass gives the host heap's free pages back after each batch only where the model runs
on the CPU: ``malloc_trim`` walks the whole heap (8-12 ms a call on a fragmented GB), and a
model on a GPU (the ``meta`` device stands in) keeps its activations off the host heap."""

import pytest
import torch
from torch import nn

import quantscope as qs
from quantscope.calibration import preset
from quantscope.calibration.run import heap, observe
from quantscope.calibration.run.non_finite import FirstBad


def _model(device):
    with torch.device(device):
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _trims(monkeypatch):
    calls = []
    monkeypatch.setattr(observe.heap, "trim", lambda: calls.append(1) or True)
    return calls


def test_a_cpu_model_trims_after_every_batch(monkeypatch):
    calls = _trims(monkeypatch)
    qs.calibrate(_model("cpu"), [torch.randn(4, 16) for _ in range(3)], "w8a8", progress=False)
    assert len(calls) == 3


class _PassEnded(Exception):
    """Raised where the pass ends (the flags' check, the first host read on meta)."""


def test_a_model_off_the_cpu_does_not_trim(monkeypatch, meta_as_device):
    calls = _trims(monkeypatch)

    def end(self, model=None):
        raise _PassEnded
    monkeypatch.setattr(FirstBad, "check", end)
    with pytest.raises(_PassEnded):
        qs.calibrate(_model("meta"), [torch.empty(4, 16, device="meta") for _ in range(3)],
                     preset("w8a8"), progress=False)
    assert calls == []


def test_runs_on_host():
    assert heap.runs_on_host(_model("cpu")) and heap.runs_on_host(nn.ReLU())
    assert not heap.runs_on_host(_model("meta"))
    mixed = _model("meta")
    mixed.register_buffer("steps", torch.zeros(()))  # one tensor on the CPU: its heap
    assert heap.runs_on_host(mixed)


class _Libc:
    """A glibc stand-in that records the ``mallopt`` / ``malloc_trim`` calls heap makes."""

    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append(("mallopt", param, value))
        return 1  # glibc's success

    def malloc_trim(self, pad):
        self.calls.append(("malloc_trim", pad))
        return 1


def test_prepare_fixes_glibcs_mmap_threshold_at_one_mib(monkeypatch):
    """docs/memory.md "The C heap": prepare is what MALLOC_MMAP_THRESHOLD_=1048576 does,
    ``mallopt(M_MMAP_THRESHOLD, 1 MiB)`` (M_MMAP_THRESHOLD is -3 in glibc's <malloc.h>; -1,
    M_TRIM_THRESHOLD, would leave the threshold where glibc's dynamic rule raised it), once a
    process; trim is ``malloc_trim(0)`` and changes no setting."""
    libc = _Libc()
    monkeypatch.delenv("QUANTSCOPE_HEAP", raising=False)
    monkeypatch.setattr(heap, "_libc", libc)
    monkeypatch.setattr(heap, "_looked", True)
    monkeypatch.setattr(heap, "_prepared", False)
    assert heap.prepare() is True and heap.prepare() is True
    assert libc.calls == [("mallopt", -3, 1048576)]
    assert heap.trim() is True
    assert libc.calls[1:] == [("malloc_trim", 0)]
