"""bench/bench_sass.py's instruction counts on a fixed listing: the loop found, division
slow-path stubs left out, other branches kept (the kernels' own sm_90 compiles run in
tests/kernels/test_triton_ptx.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("quantscope_bench_sass",
                                                      BENCH / "bench_sass.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


sass = _load()

#: a loop (0x0010 .. 0x00b0) holding one division's slow-path stub (0x0050 .. 0x0070, skipped)
#: and a predicated branch over ordinary code (0x0080 .. 0x0090, counted)
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   MUFU.RCP R3, R2 ;
        /*0020*/                   FCHK P0, R4, R2 ;
        /*0030*/                   FFMA R5, R3, R4, RZ ;
        /*0040*/              @!P0 BRA 0x80 ;
        /*0050*/                   MOV R6, R4 ;
        /*0060*/                   CALL.REL.NOINC 0x100 ;
        /*0070*/                   MOV R5, R7 ;
        /*0080*/               @P1 BRA 0xa0 ;
        /*0090*/                   FADD R5, R5, 1 ;
        /*00a0*/                   F2F.F64.F32 R8, R5 ;
        /*00b0*/               @P2 BRA 0x10 ;
        /*00c0*/                   EXIT ;
        /*0100*/                   RET.REL.NODEC R14 0x0 ;
"""


def test_the_loop_is_counted_without_division_stubs():
    ops = sass.hot_region(LISTING)
    assert sum(ops.values()) == 8  # 0x10 .. 0xb0 is 11 instructions, less the 3-long stub
    assert ops["MUFU"] == 1 and ops["F2F"] == 1 and ops["FADD"] == 1 and ops["BRA"] == 3
    assert "CALL" not in ops and "MOV" not in ops
    assert [sum(b.values()) for b in sass.loops(LISTING)] == [8]


def test_without_a_loop_the_kernel_body_up_to_exit():
    body = "\n".join(line for line in LISTING.splitlines() if "0x10 ;" not in line)
    assert sum(sass.hot_region(body).values()) == 1 + 7 + 1  # MOV, the body, EXIT


_CHECK = """
import bench_sass
bench_sass._peer_site = lambda: None  # our kernels only
cases = bench_sass.cases()  # (compiles the block kernels: sass() checks their arguments)
assert cases
for case in cases:
    fn = case["kernel"]()
    given = set(case["sig"]) | set(case["const"])
    assert set(fn.arg_names) <= given, (case["who"], set(fn.arg_names) - given)
"""


@pytest.mark.extended
def test_our_cases_give_every_argument_of_their_kernels():
    """A kernel that gains an argument (the price kernel's SQ32) fails here, not as triton's
    nameless compile error in `make bench`. Compiled for sm_90 outside the interpreter the
    suite runs Triton under, in a process of its own."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH.parent / "src"), str(BENCH)])
    done = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, check=False,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
