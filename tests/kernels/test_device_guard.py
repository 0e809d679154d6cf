"""The CUDA implementations run with their tensors' device current (``_oplib.on_tensors_device``).

Triton launches on the current device; the dispatcher gives a Python kernel no device guard.
Without a GPU the device switch is observed through fake ``cuda:N`` tensors and a recording
stand-in for ``torch.cuda.device``."""

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from quantscope import _oplib


@pytest.fixture
def switches(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def device(d):
        entered.append(torch.device(d).index)
        yield

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", device)
    return entered


def _seen(fn):
    """``fn`` wrapped; returns (wrapped, the device index current at each call)."""
    current = []

    def kernel(*args, **kwargs):
        current.append(kwargs.get("tag"))
        return fn(*args)

    return _oplib.on_tensors_device(kernel), current


@pytest.mark.parametrize("index,expect", [(1, [1]), (3, [3]), (0, [])])
def test_switches_to_the_first_tensors_device(switches, index, expect):
    wrapped, _ = _seen(lambda x, y: x.shape)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(4, device=f"cuda:{index}")
        assert wrapped(x, 2.0) == (4,)
    assert switches == expect  # cuda:0 is current: no switch


def test_tensor_lists_and_leading_scalars(switches):
    wrapped, _ = _seen(lambda n, xs: len(xs))
    with FakeTensorMode(allow_non_fake_inputs=True):
        xs = [torch.empty(2, device="cuda:2"), torch.empty(3, device="cuda:2")]
        assert wrapped(5, xs) == 2
    assert switches == [2]


@pytest.mark.parametrize("devices, expect", [
    (("cuda:0", "cuda:1"), []),  # the first tensor is on the current device: no switch
    (("cpu", "cuda:1"), []),  # the first tensor's device has no index: no switch
    ((None, "cuda:2"), [2]),  # an empty list first: the next tensor decides
], ids=["first-current", "first-cpu", "empty-list-first"])
def test_the_first_tensor_decides_the_device(switches, devices, expect):
    wrapped = _oplib.on_tensors_device(lambda *a: len(a))
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [[] if d is None else torch.empty(1, device=d) for d in devices]
        assert wrapped(*args) == 2
    assert switches == expect


def test_no_tensor_no_switch(switches):
    wrapped, _ = _seen(lambda n: n + 1)
    assert wrapped(1) == 2
    assert switches == []


def test_every_cuda_implementation_is_wrapped(monkeypatch):
    """``define`` registers the wrapped CUDA kernel, not the bare one."""
    registered = {}
    monkeypatch.setattr(_oplib._LIB, "impl",
                        lambda name, fn, key, **kw: registered.__setitem__(key, fn))
    monkeypatch.setattr(torch.library, "register_fake", lambda *a, **k: None)

    def bare(x):
        return x

    import quantscope.kernels.ops  # noqa: F401  (the op exists: define() defines nothing new)

    op = "unit_minmax"
    _oplib.define(f"{op}(Tensor units) -> (Tensor, Tensor)", bare, fake=bare, cuda=bare)
    # each kernel inside the refusal of inputs that require grad; CUDA's inside the guard too
    cpu, cuda = registered["CompositeExplicitAutograd"], registered["CUDA"]
    assert cpu.__wrapped__ is bare
    assert cuda.__wrapped__ is not bare and cuda.__wrapped__.__wrapped__ is bare
