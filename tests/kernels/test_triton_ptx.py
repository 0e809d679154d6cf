"""The Triton kernels compiled for an H100 (sm_90) here, without a GPU: every kernel compiles,
and the float32 arithmetic that must round as torch's ops round is the IEEE instruction.

In the PTX: divisions ``div.rn.f32`` (never ``div.full`` / ``div.approx`` / ``rcp``), no
``fma`` (every launch passes ``_jit.LAUNCH``: ``enable_fp_fusion=False``), and every f32 add / sub / mul carries
``.rn``, which ptxas never contracts into an FMA. The one exception is libdevice's ``powf``
(the pricing of llm-compressor's norm 2.4), whose FMAs are its algorithm, in torch's CUDA
build too: compiled without flush-to-zero, as there. The compile runs in a child process
without ``TRITON_INTERPRET`` (the interpreter's functions cannot be compiled).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")

#: kernel -> (signature, constexprs) of the launches to compile
_F32 = {"lo_ptr": "*fp32", "hi_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}
_PRICE = {"x_ptr": "*fp32", "w_ptr": "*fp32", "s_ptr": "*fp32", "z_ptr": "*i32",
          "out_ptr": "*fp64", "U": "i32", "E": "i32", "K": "i32", "stride_u": "i32",
          "stride_w": "i32", "qmin": "fp32", "qmax": "fp32", "min_exp": "i32", "mbits": "i32",
          "BLOCK_U": "constexpr", "BLOCK_E": "constexpr", "ONE_TILE": "constexpr",
          "FLOAT": "constexpr", "WEIGHTED": "constexpr", "NORM": "constexpr",
          "SQ32": "constexpr"}
#: what every kernel of kernels/triton/block_search.py takes (its ``_ranges``), and their
#: constants (NVFP4's e4m3 block scales; ``ENC`` / ``TOP`` for the kernels that take MX's too)
_BLOCK_RANGES = {"lo_ptr": "*fp32", "hi_ptr": "*fp32", "f_ptr": "*fp32", "ilo_ptr": "*fp32",
                 "ihi_ptr": "*fp32", "amax_ptr": "*fp32", "U": "i32", "K": "i32",
                 "fmax": "fp32", "bmax": "fp32", "B_MIN_EXP": "constexpr",
                 "B_MBITS": "constexpr", "SUB_STEPS": "constexpr", "RATIO": "constexpr",
                 "BLOCK_K": "constexpr", "BLOCK_U": "constexpr"}
_ANY_BLOCK = {**_BLOCK_RANGES, "emax": "i32", "ENC": "constexpr", "TOP": "constexpr"}
_NVFP4_CONST = {"B_MIN_EXP": -6, "B_MBITS": 3, "SUB_STEPS": 512.0, "RATIO": 1.0625 - 1e-5,
                "BLOCK_K": 64, "BLOCK_U": 128}
_ENC = {"nvfp4": {"ENC": -1, "TOP": 4.0}, "mx": {"ENC": 3, "TOP": 4.0, "RATIO": 2.0 - 1e-5}}
#: the block kernels' tile of units and its weights (``WEIGHTED``: an imatrix search)
_BLOCK_UNITS = {"x_ptr": "*fp32", "w_ptr": "*fp32", "E": "i32", "stride_u": "i32",
                "stride_w": "i32", "WEIGHTED": "constexpr", "BLOCK_E": "constexpr"}
_PRICE_BLOCK = {**_ANY_BLOCK, **_BLOCK_UNITS, "inc_ptr": "*fp64", "scratch_ptr": "*fp64",
                "flags_ptr": "*i8", "G": "i32", "min_exp": "i32", "mbits": "i32",
                "min_scale": "fp32", "qmin": "fp32", "TIE_LAST": "constexpr",
                "FLOAT": "constexpr"}
_SEARCH_BLOCK = {**_BLOCK_RANGES, **_BLOCK_UNITS, "idx_ptr": "*i64", "best_ptr": "*fp64",
                 "min_exp": "i32", "mbits": "i32", "min_scale": "fp32", "STEPS": "constexpr"}
_SELECT_BLOCK = {**_ANY_BLOCK, "inc_ptr": "*fp64", "scratch_ptr": "*fp64", "gstop_ptr": "*i64",
                 "idx_ptr": "*i64", "best_ptr": "*fp64", "ext_start": "i32", "patience": "i32",
                 "min_scale": "fp32", "PER_UNIT": "constexpr", "USE_GLOBAL": "constexpr",
                 "HAS_PATIENCE": "constexpr", "TIE_LAST": "constexpr"}
_SELECT_CONST = {"PER_UNIT": True, "USE_GLOBAL": True, "HAS_PATIENCE": True, "TIE_LAST": False}
_NVFP4 = {"lo_ptr": "*fp32", "hi_ptr": "*fp32", "amax_ptr": "*fp32", "out_ptr": "*fp32",
          "n": "i32", "fmax": "fp32", "bmax": "fp32", "min_scale": "fp32", "gs_ptr": "*fp32",
          "MIN_EXP": "constexpr", "MBITS": "constexpr", "BLOCK_N": "constexpr"}
_PRICE_CONST = {"BLOCK_U": 1, "BLOCK_E": 4096, "ONE_TILE": True, "WEIGHTED": False,
                "NORM": 2.0, "SQ32": False}
CASES = {
    "fakequant._fake_quant_kernel": (
        {"x_ptr": "*bf16", "s_ptr": "*fp32", "z_ptr": "*fp32", "out_ptr": "*fp32", "U": "i32",
         "E": "i32", "stride_u": "i32", "stride_e": "i32", "qmin": "fp32", "qmax": "fp32",
         "BLOCK_U": "constexpr", "BLOCK_E": "constexpr"}, {"BLOCK_U": 4, "BLOCK_E": 1024}),
    "mse._price_kernel": (_PRICE, {**_PRICE_CONST, "FLOAT": False}),
    "mse._price_kernel:fp": (  # the float element formats' (MX, NVFP4): one kernel, FLOAT
        {**_PRICE, "z_ptr": "*fp32"}, {**_PRICE_CONST, "FLOAT": True}),
    "mse._price_kernel:fp_tiles": (  # rows past one tile
        {**_PRICE, "z_ptr": "*fp32"}, {**_PRICE_CONST, "BLOCK_E": 1024, "ONE_TILE": False,
                                       "FLOAT": True}),
    "mse._price_kernel:weighted": (  # the imatrix search's weights (WEIGHTED)
        {**_PRICE, "z_ptr": "*fp32"}, {**_PRICE_CONST, "BLOCK_E": 1024, "ONE_TILE": False,
                                       "FLOAT": True, "WEIGHTED": True}),
    "mse._price_kernel:sq32": (  # the compat classes' squares, rounded to float32
        _PRICE, {**_PRICE_CONST, "FLOAT": False, "SQ32": True}),
    "mse._price_kernel:cube": (  # llm-compressor's norms: 3 is |d| * |d| * |d|, as torch's
        _PRICE, {**_PRICE_CONST, "FLOAT": False, "NORM": 3.0}),
    "mse._price_kernel:sqrt": (  # 0.5: torch's pow calls sqrt, the IEEE one on CUDA
        _PRICE, {**_PRICE_CONST, "FLOAT": False, "NORM": 0.5}),
    "mse._price_kernel:pow": (  # others: libdevice's powf, the function torch's CUDA pow calls
        _PRICE, {**_PRICE_CONST, "FLOAT": False, "NORM": 2.4}),
    "mse._select_kernel": (  # the selection rules over the priced candidates
        {"err_ptr": "*fp64", "same_ptr": "*u8", "inc_ptr": "*fp64", "gstop_ptr": "*i64",
         "idx_ptr": "*i64", "best_ptr": "*fp64", "U": "i32", "K": "i32", "ext_start": "i32",
         "patience": "i32", "PER_UNIT": "constexpr", "USE_GLOBAL": "constexpr",
         "HAS_PATIENCE": "constexpr", "TIE_LAST": "constexpr", "BLOCK_U": "constexpr"},
        {**_SELECT_CONST, "BLOCK_U": 128}),
    "block_search._search_kernel": (  # the fused NVFP4 search: codes, enumeration, bisection
        _SEARCH_BLOCK, {**_NVFP4_CONST, "STEPS": 8, "BLOCK_K": 128, "BLOCK_E": 16,
                        "WEIGHTED": False}),
    "block_search._search_kernel:weighted": (  # an imatrix search's weights
        _SEARCH_BLOCK, {**_NVFP4_CONST, "STEPS": 8, "BLOCK_K": 128, "BLOCK_E": 16,
                        "WEIGHTED": True}),
    "block_search._price_kernel": (  # under patience: the codes into a scratch, the flags
        _PRICE_BLOCK, {**_NVFP4_CONST, **_ENC["nvfp4"], "TIE_LAST": False, "FLOAT": True,
                       "BLOCK_E": 16, "WEIGHTED": False}),
    "block_search._select_kernel": (  # then the candidates walked under mse_select's rules
        _SELECT_BLOCK, {**_NVFP4_CONST, **_ENC["nvfp4"], **_SELECT_CONST}),
    "block_search._price_kernel:mx": (  # MX's E8M0 scales (rceil: MODE 3 below)
        _PRICE_BLOCK, {**_NVFP4_CONST, **_ENC["mx"], "TIE_LAST": False, "FLOAT": True,
                       "BLOCK_E": 32, "WEIGHTED": False}),
    "block_search._price_kernel:mx_int": (  # over integer elements (MXINT8, BFP)
        _PRICE_BLOCK, {**_NVFP4_CONST, **_ENC["mx"], "TIE_LAST": False, "FLOAT": False,
                       "BLOCK_E": 32, "WEIGHTED": True}),
    "block_search._select_kernel:mx": (
        _SELECT_BLOCK, {**_NVFP4_CONST, **_ENC["mx"], **_SELECT_CONST}),
    "block_qparams._e8m0_kernel": (
        {**_F32, "emax": "i32", "fmax": "fp32", "MODE": "constexpr", "TOP": "constexpr",
         "BLOCK_N": "constexpr"}, {"MODE": 3, "TOP": 4.0, "BLOCK_N": 1024}),
    "block_qparams._nvfp4_kernel": (  # the global scale from the global amax, in-kernel
        _NVFP4, {"MIN_EXP": -6, "MBITS": 3, "BLOCK_N": 1024}),
    "block_qparams._global_amax_kernel": (
        {"lo_ptr": "*fp32", "hi_ptr": "*fp32", "out_ptr": "*i32", "n": "i32",
         "BLOCK_N": "constexpr"}, {"BLOCK_N": 1024}),
    "block_qparams._int_kernel": (
        {"lo_ptr": "*fp32", "hi_ptr": "*fp32", "scale_ptr": "*fp32", "zp_ptr": "*i32",
         "n": "i32", "qmin": "fp32", "qmax": "fp32", "min_scale": "fp32", "zsym": "fp32",
         "SYMMETRIC": "constexpr", "BLOCK_N": "constexpr"}, {"SYMMETRIC": False, "BLOCK_N": 1024}),
    "minmax._minmax_kernel": (
        {"x_ptr": "*fp16", "lo_ptr": "*fp32", "hi_ptr": "*fp32", "U": "i32", "E": "i32",
         "U2": "i32", "E2": "i32", "su1": "i32", "su2": "i32", "se1": "i32", "se2": "i32",
         "chunk": "i32", "splits": "i32", "BLOCK_U": "constexpr", "BLOCK_E": "constexpr",
         "FOUR_D": "constexpr"}, {"BLOCK_U": 8, "BLOCK_E": 512, "FOUR_D": True}),
    "minmax._grouped_minmax_kernel": (  # VEC: the launch found 16-byte loads possible
        {"desc_ptr": "*i64", "DTYPE": "constexpr", "BLOCK_U": "constexpr",
         "BLOCK_E": "constexpr", "VEC": "constexpr"},
        {"DTYPE": "tl.bfloat16", "BLOCK_U": 8, "BLOCK_E": 512, "VEC": 8}),
    "minmax._state_kernel": (  # the moving average: s + c * (b - s), no FMA
        {"lo_ptr": "*fp32", "hi_ptr": "*fp32", "slo_ptr": "*fp32", "shi_ptr": "*fp32",
         "seen_ptr": "*i1", "tokens_ptr": "*i64", "count": "i64", "n": "i32", "splits": "i32",
         "c": "fp32", "one_minus_c": "fp32", "KIND": "constexpr", "RECORD": "constexpr",
         "COUNT": "constexpr", "BLOCK_N": "constexpr"},
        {"KIND": 2, "RECORD": True, "COUNT": True, "BLOCK_N": 1024}),
    "minmax._state_kernel:lerp": (  # s * (1 - c) + b * c
        {"lo_ptr": "*fp32", "hi_ptr": "*fp32", "slo_ptr": "*fp32", "shi_ptr": "*fp32",
         "seen_ptr": "*i1", "tokens_ptr": "*i64", "count": "i64", "n": "i32", "splits": "i32",
         "c": "fp32", "one_minus_c": "fp32", "KIND": "constexpr", "RECORD": "constexpr",
         "COUNT": "constexpr", "BLOCK_N": "constexpr"},
        {"KIND": 3, "RECORD": False, "COUNT": False, "BLOCK_N": 1024}),
    "histogram._hist_kernel": (
        {"x_ptr": "*bf16", "counts_ptr": "*i64", "exp_ptr": "*i64", "first_ptr": "*i64",
         "E": "i32", "stride_u": "i32", "chunk": "i32", "B": "i32", "ABSOLUTE": "constexpr",
         "NB": "constexpr", "BLOCK_E": "constexpr"},
        {"ABSOLUTE": True, "NB": 4096, "BLOCK_E": 1024}),
    "histogram._bin_kernel": (  # each value's bin, for torch.histc to count
        {"x_ptr": "*bf16", "idx_ptr": "*fp64", "exp_ptr": "*i64", "first_ptr": "*i64",
         "row0": "i32", "c0": "i32", "C": "i32", "stride_u": "i32", "B": "i32",
         "ABSOLUTE": "constexpr", "BLOCK_E": "constexpr"},
        {"ABSOLUTE": True, "BLOCK_E": 1024}),
    "histogram._regrid_kernel": (  # the grid change: float64 span / (B - 1), float32 fits
        {"blo_ptr": "*fp32", "bhi_ptr": "*fp32", "counts_ptr": "*i64", "exp_ptr": "*i64",
         "first_ptr": "*i64", "lo_ptr": "*fp32", "hi_ptr": "*fp32", "scratch_ptr": "*i64",
         "B": "i32", "ABSOLUTE": "constexpr", "BLOCK": "constexpr"},
        {"ABSOLUTE": False, "BLOCK": 1024}),
}


def _compile_all() -> dict:
    """{kernel: its PTX's float32 instructions, counted} (run in the child)."""
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quantscope.kernels.triton._jit import LAUNCH

    out = {"vector loads": []}  # the kernels whose PTX loads 16 bytes at once
    for name, (signature, constexprs) in CASES.items():
        module, fn = name.split(":")[0].split(".")  # "module.kernel[:variant]"
        kernel = getattr(importlib.import_module(f"quantscope.kernels.triton.{module}"), fn)
        constexprs = {k: getattr(tl, v[3:]) if isinstance(v, str) else v  # "tl.<dtype>"
                      for k, v in constexprs.items()}
        src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options=dict(LAUNCH)).asm["ptx"]  # the launches' options
        # f64 too: the prices' float64 products and sums must not fuse either
        ops = re.findall(r"^\s*((?:div|fma|rcp|add|sub|mul|sqrt)\.[a-z0-9.]*f(?:32|64))\b",
                         ptx, re.MULTILINE)
        out[name] = sorted(set(ops))
        if re.search(r"ld\.global(\.[a-z]+)*\.v4\.", ptx):
            out["vector loads"].append(name)
    return out


def test_kernels_compile_for_sm90_with_ieee_float32():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    # the grouped min / max reads its addresses and strides from memory: only the hints
    # that its launch checked (VEC) let it load 16 bytes at once (scalar loads: 4.5x slower)
    assert "minmax._grouped_minmax_kernel" in found.pop("vector loads")
    assert set(found) == set(CASES)
    # powf is a library function: its own FMAs are its algorithm, in torch's build too; without
    # flush-to-zero (_jit.LAUNCH), as torch's CUDA build compiles it
    pow_ops = found.pop("mse._price_kernel:pow")
    assert "fma.rn.f32" in pow_ops and "fma.rn.ftz.f32" not in pow_ops, pow_ops
    assert {"div.rn.f32", "add.rn.f64"} <= set(pow_ops)
    for name, ops in found.items():
        assert not [op for op in ops if op.startswith(("fma", "rcp"))], (name, ops)
        assert all(op.startswith(("div.rn.", "add.rn.", "sub.rn.", "mul.rn.", "sqrt.rn."))
                   for op in ops), (name, ops)
    assert "div.rn.f32" in found["fakequant._fake_quant_kernel"]
    assert "div.rn.f32" in found["mse._price_kernel"]
    assert "div.rn.f32" in found["mse._price_kernel:fp"]
    assert "div.rn.f32" in found["mse._price_kernel:fp_tiles"]
    assert "sqrt.rn.f32" in found["mse._price_kernel:sqrt"]
    assert "div.rn.f32" in found["block_qparams._int_kernel"]
    for name in ("block_search._search_kernel", "block_search._price_kernel",
                 "block_search._select_kernel", "block_search._price_kernel:mx",
                 "block_search._price_kernel:mx_int", "block_search._search_kernel:weighted"):
        assert "div.rn.f32" in found[name], name
    # E8M0 rceil divides nothing: ceil(log2(amax / fmax)) from both exponents and mantissas
    for name in ("block_search._select_kernel:mx", "block_qparams._e8m0_kernel"):
        assert not [op for op in found[name] if op.startswith("div")], (name, found[name])
    # every native price squares in float64, where the square is exact (and weights:
    # float64(w) * that); SQ32 (a compat class's toolkit arithmetic) squares in float32
    for name in ("mse._price_kernel", "mse._price_kernel:fp", "mse._price_kernel:weighted",
                 "block_search._search_kernel", "block_search._search_kernel:weighted",
                 "block_search._price_kernel", "block_search._price_kernel:mx_int"):
        assert "mul.rn.f64" in found[name], name
    assert "mul.rn.f64" not in found["mse._price_kernel:sq32"]
    assert "div.rn.f32" in found["block_qparams._nvfp4_kernel"]
    assert {"mul.rn.f32", "add.rn.f32"} <= set(found["minmax._state_kernel:lerp"])
    assert {"div.rn.f64", "sub.rn.f64"} <= set(found["histogram._regrid_kernel"])


def _jit_float_literals():
    """(file:line, value) of each float literal in a ``@triton.jit`` function here."""
    import ast
    import pathlib

    import quantscope.kernels.triton as package

    for path in sorted(pathlib.Path(package.__file__).parent.glob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, ast.FunctionDef) and any(
                    ast.unparse(d).startswith("triton.jit") for d in fn.decorator_list):
                yield from ((f"{path.name}:{node.lineno}", node.value) for node in ast.walk(fn)
                            if isinstance(node, ast.Constant) and type(node.value) is float)


def test_jit_float_literals_are_float32_to_every_triton():
    """Triton types a float literal outside float32's normal range (a subnormal, say) as
    float64. Triton 3.9 then casts it to a float32 operand's type; Triton 3.6 (on the lent GPU
    machines' image) computes ``tl.maximum(x, 1.4e-45)`` in float64, and ``div_rn`` refuses
    the result at compile time. Such a constant is written as its float32 bits
    (``tl.full([], 1, tl.int32).to(tl.float32, bitcast=True)``)."""
    import math

    literals = list(_jit_float_literals())
    assert any(value == 0.5 for _, value in literals)  # the scan sees the kernels' literals
    odd = [(where, value) for where, value in literals
           if value != 0 and math.isfinite(value)
           and not 2.0 ** -126 <= abs(value) <= (2 - 2.0 ** -23) * 2.0 ** 127]
    assert not odd, odd


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
