"""The ``device`` the Triton kernel tests run on (tests/triton_interpreter.py)."""

import pytest
import torch

from quantscope.kernels import triton as qs_triton


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
