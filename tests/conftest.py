"""Shared test setup.

Under pytest-xdist (``make test`` runs ``-n 2``) every worker is its own process; with
torch's default of one thread per core, two workers oversubscribe a 2-core machine and
OpenMP's spinning threads slow small tensor ops 10-100x. One torch thread per worker.
"""

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Triton's kernels run under its interpreter on CPU tensors where no GPU is present. Triton
# fixes compiled or interpreted at its first import (which transformers' Llama reaches through
# torchao while tests are collected), so the setting goes here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import patch_language_once

    patch_language_once()


def _share_torchlib_ops():
    """Every ``torch.onnx.export`` rebuilds its op registry from onnxscript's torchlib,
    parsing the source of ~500 functions (~0.7 s of a small model's 1.5-2 s export). The
    list depends only on the installed onnxscript, so the suite's exports share one, cached
    at the first export (private names: where they have moved, exports run uncached)."""
    import functools
    import importlib

    import torch.onnx

    export = torch.onnx.export

    @functools.wraps(export)
    def first_export(*args, **kwargs):
        torch.onnx.export = export
        try:
            from torch.onnx._internal import _lazy_import

            apis = importlib.import_module(_lazy_import.onnxscript_apis._name)
            apis.get_torchlib_ops = functools.cache(apis.get_torchlib_ops)
        except (ImportError, AttributeError):
            pass
        return export(*args, **kwargs)

    torch.onnx.export = first_export


_share_torchlib_ops()

_SYNCS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture
def forbid_host_sync(monkeypatch):
    """Make every Python-level device-to-host read raise while active."""

    def guard(name):
        def raise_(*a, **k):
            raise AssertionError(f"host sync: Tensor.{name} called in forward")
        return raise_

    def arm():
        for n in _SYNCS:
            monkeypatch.setattr(torch.Tensor, n, guard(n))

    return arm


@pytest.fixture
def meta_as_device(monkeypatch):
    """Let ``calibrate`` take a model on the ``meta`` device, standing in for a GPU (any host
    read there fails in torch itself); a user's meta model holds no data and is refused."""
    from quantscope.calibration.run import session

    monkeypatch.setattr(session, "check_placement", lambda *args, **kwargs: None)


@pytest.fixture(autouse=True, scope="session")
def _torch_factories_cached_before_any_test():
    """torch caches its factory functions (``torch.utils._device._device_constructors``) at
    the first ``with torch.device(...)`` of a process. A test that patched one
    (``torch.tensor``) while that ran left the wrapper in the cache: every later device
    context of that worker left the real function on the CPU (transformers' meta init then
    made ``from_pretrained`` hold uninitialised rotary tables, two files later). Filled here
    with the real factories before any test runs (a fill, not a check: nothing patches them
    yet)."""
    from torch.utils import _device

    _device._device_constructors()
    yield
