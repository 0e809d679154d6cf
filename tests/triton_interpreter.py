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


def patch_language_once() -> None:
    """Make Triton's interpreter skip re-patching ``triton.language`` at each ``@triton.jit``
    helper's call inside a kernel: the kernel's launch has patched the same modules already
    (the repeat only walks them again with ``inspect.getmembers``), and the block searches
    call helpers thousands of times per launch (a fifth to a third of their tests' time).
    A helper whose module sees a language module the launch did not patch is patched as
    before; so is every launch (which restores the language when it ends)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or getattr(patch, "once", False):
        return

    def patch_once(fn):
        langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        if langs and not any(tl.core.is_builtin(lang.arange) for lang in langs):
            return interpreter._LangPatchScope()  # patched: nothing to restore
        return patch(fn)

    patch_once.once = True
    interpreter._patch_lang = patch_once


CHILD = "QUANTSCOPE_FRESH_INTERPRETER"  # set in the child process's environment


def fresh_interpreter_test(path: str):
    """A test that runs the test file ``path`` in a child process under the interpreter,
    where this process cannot.

    It skips where triton is not installed (the optional ``gpu`` extra): a child could not
    run the kernels either, and its own copy of this test would start another child, a
    chain with no end. In a child (:data:`CHILD` set) that still cannot run them, it fails
    instead of starting another."""

    def test_in_a_fresh_interpreter():
        if not qs_triton.available():
            pytest.skip("triton is not installed (the gpu extra)")
        if qs_triton.runs_on("cuda" if torch.cuda.is_available() else "cpu"):
            pytest.skip("the kernels run in this process")
        if os.environ.get(CHILD):
            pytest.fail("the kernels do not run in the fresh interpreter either")
        env = {**os.environ, "TRITON_INTERPRET": "1", CHILD: "1"}
        run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-x",
                              path], env=env, capture_output=True, text=True, check=False)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        assert " passed" in run.stdout and " skipped" in run.stdout  # only this one skips
    return test_in_a_fresh_interpreter
