"""tests/triton_interpreter.fresh_interpreter_test without triton (the optional ``gpu``
extra): it skips. It used to re-run its file in a child pytest, where the kernels could not
run either, so the child's own copy of the test started another child: a chain of pytest
processes with no end (found by a review, s49)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import triton_interpreter

TESTS = Path(__file__).resolve().parents[1]
CHILD = "QUANTSCOPE_FRESH_INTERPRETER"  # triton_interpreter.CHILD


def test_the_helper_skips_without_starting_a_child(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # find_spec then says "not installed"
    monkeypatch.delenv(CHILD, raising=False)

    def no_child(*args, **kwargs):
        raise AssertionError(f"started a child process: {args[0]}")

    monkeypatch.setattr(triton_interpreter.subprocess, "run", no_child)
    with pytest.raises(pytest.skip.Exception, match="triton is not installed"):
        triton_interpreter.fresh_interpreter_test(__file__)()


def test_a_child_that_cannot_run_the_kernels_fails_instead_of_starting_another(monkeypatch):
    monkeypatch.setattr(triton_interpreter.qs_triton, "available", lambda: True)
    monkeypatch.setattr(triton_interpreter.qs_triton, "runs_on", lambda device: False)
    monkeypatch.setenv(CHILD, "1")
    monkeypatch.setattr(triton_interpreter.subprocess, "run", None)  # a call would TypeError
    with pytest.raises(pytest.fail.Exception, match="fresh interpreter either"):
        triton_interpreter.fresh_interpreter_test(__file__)()


def test_a_file_run_without_triton_finishes_and_skips(tmp_path):
    """End to end, as a machine without the extra runs it: triton unimportable in every
    process (a ``sitecustomize``), a file whose only test is the helper's."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text('import sys\nsys.modules["triton"] = None\n')
    test = tmp_path / "test_uses_the_helper.py"
    test.write_text(textwrap.dedent("""
        from triton_interpreter import fresh_interpreter_test

        test_in_a_fresh_interpreter = fresh_interpreter_test(__file__)
    """))
    path = os.pathsep.join([str(site), str(TESTS), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "1"}
    env.pop(CHILD, None)
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                            "-p", "no:xdist", "-rs", str(test)], cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)  # its own group: a chain ends with it
    try:
        out, _ = run.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        run.communicate()
        pytest.fail("the file did not finish in 90 s (a chain of child pytest processes)")
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 0, out[-4000:]
    assert "1 skipped" in out and "triton is not installed" in out, out[-4000:]
