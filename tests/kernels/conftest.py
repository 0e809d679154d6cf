"""The ``device`` the Triton kernel tests run on (tests/triton_interpreter.py), and the
``fresh`` kernel cache the build-cache tests start from."""

import shutil

import pytest
import torch

from quantscope import kernels
from quantscope.kernels import triton as qs_triton

#: the C compiler the build-cache tests name as ``$CC`` (None: none here)
CC = shutil.which("cc") or shutil.which("gcc")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty private cache, ``$CC`` the compiler found here, and a loader that has loaded
    nothing and warned about nothing."""
    monkeypatch.setenv("QUANTSCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", CC or "cc")
    monkeypatch.delenv("QUANTSCOPE_NO_KERNEL", raising=False)
    monkeypatch.setattr(kernels, "_libs", {})
    monkeypatch.setattr(kernels, "_warned", False)
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def device():
    """Where the Triton launchers run in this process: CUDA (compiled) or the CPU
    (interpreted); a skip where triton was imported before ``TRITON_INTERPRET`` was set (the
    file's ``test_in_a_fresh_interpreter`` runs it in a child process instead)."""
    here = "cuda" if torch.cuda.is_available() else "cpu"
    if not qs_triton.runs_on(here):
        pytest.skip("triton was imported before TRITON_INTERPRET was set: these tests run in "
                    "a child process (test_in_a_fresh_interpreter)")
    return torch.device(here)
