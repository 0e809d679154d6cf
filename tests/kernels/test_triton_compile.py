"""Triton kernels compiled for a GPU (sm_90) without one: what the interpreter cannot show.

The interpreter runs a kernel's body as Python, so CI (no GPU) passes constructs Triton's
compiler refuses: an import in a kernel's body, ``.to()`` on an int argument the JIT turns into
a constant because it equals 1. Each case here is compiled, as a GPU launch would compile it, in
a child process without ``TRITON_INTERPRET`` (Triton's ``compile`` to a cubin needs no device);
the same child says which devices the compiled launchers take.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).parent

#: a child process: compile each kernel with the given signature and constants (by argument
#: name; the JIT's specialization of an int equal to 1 is a constant), print the failures
_CHILD = r"""
import json
import sys
import triton
from quantscope.kernels import triton as t

runs_on = [t.runs_on(d) for d in DEVICES]
try:  # Triton's ahead-of-time compile (3.x)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:
    print(json.dumps({"runs_on": runs_on, "unavailable": str(e)}))
    sys.exit(0)

from quantscope.kernels.triton import histogram
from quantscope.kernels.triton._jit import LAUNCH
from test_triton_block_search import _code_kernel

F32, I32, I64 = "*fp32", "*i32", "*i64"
CASES = {
    # B == 1 (one bin): the JIT passes it as a constant
    "histogram._regrid_kernel, B=1": (
        histogram._regrid_kernel,
        dict(blo_ptr=F32, bhi_ptr=F32, counts_ptr=I64, exp_ptr=I64, first_ptr=I64, lo_ptr=F32,
             hi_ptr=F32, scratch_ptr=I64),
        dict(B=1, ABSOLUTE=False, BLOCK=1024)),
    # the test's own kernel: its helpers come from the module's imports
    "test_triton_block_search._code_kernel": (
        _code_kernel, dict(q_ptr=F32, code_ptr=I32, value_ptr=F32, n="i32"),
        dict(ENC=-1, BLOCK=256)),
}
failed = []
for name, (fn, types, constants) in CASES.items():
    names = fn.arg_names
    sig = {n: types.get(n, "constexpr") for n in names}
    consts = {(names.index(n),): v for n, v in constants.items()}
    try:
        triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options=dict(LAUNCH))
    except Exception as e:  # the compiler's message names the construct
        failed.append(f"{name}: {type(e).__name__}: {str(e).strip()[-600:]}")
print(json.dumps({"runs_on": runs_on, "failed": failed}))
"""
DEVICES = ("cuda", "cpu", "meta", "mps", "xpu")


@pytest.fixture(scope="module")
def compiled():
    """What the child (Triton compiling, not interpreting) printed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent),
                                         env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", f"DEVICES = {DEVICES!r}\n{_CHILD}"], env=env,
                         capture_output=True, text=True, check=False, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_kernels_compile_for_a_gpu(compiled):
    if "unavailable" in compiled:
        pytest.skip(f"this Triton has no ahead-of-time compile: {compiled['unavailable']}")
    assert not compiled["failed"], "\n".join(compiled["failed"])


@pytest.mark.parametrize("interpret", [False, True])
def test_launchers_take_only_their_device(interpret, compiled):
    """Compiled, the launchers take CUDA tensors only (a meta, mps or xpu tensor takes the
    op's other path, not a Triton launch); interpreted, CPU tensors only. The compiled
    launchers as the child saw them; the interpreted ones in this process where it interprets
    (no GPU), else in a child of their own."""
    if not interpret:
        got = compiled["runs_on"]
    elif os.environ.get("TRITON_INTERPRET") == "1":
        from quantscope.kernels import triton as t

        got = [t.runs_on(d) for d in DEVICES]
    else:
        code = ("from quantscope.kernels import triton as t\n"
                f"print(*(t.runs_on(d) for d in {DEVICES!r}))")
        run = subprocess.run([sys.executable, "-c", code],
                             env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                             text=True, check=True, timeout=120)
        got = [w == "True" for w in run.stdout.split()]
    assert got == ([False, True, False, False, False] if interpret
                   else [True, False, False, False, False])
