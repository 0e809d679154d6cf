"""Triton kernel tests without a GPU: they run under Triton's interpreter on CPU tensors.

The interpreter needs ``TRITON_INTERPRET=1`` before triton's first import (tests/conftest.py
sets it where no GPU is present). In a process where something imported triton sooner, the
``device`` fixture (tests/kernels/conftest.py) skips and the file's
:func:`fresh_interpreter_test` runs the whole file in a child process instead.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from quantscope.kernels import triton as qs_triton


def fresh_interpreter_test(path: str):
    """A test that runs the test file ``path`` in a child process under the interpreter,
    where this process cannot."""

    def test_in_a_fresh_interpreter():
        if qs_triton.runs_on("cuda" if torch.cuda.is_available() else "cpu"):
            pytest.skip("the kernels run in this process")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-x",
                              path], env=env, capture_output=True, text=True, check=False)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        assert " passed" in run.stdout and " skipped" in run.stdout  # only this one skips
    return test_in_a_fresh_interpreter
