"""The GPU searches' instruction budgets, read from the compiled kernels (no GPU needed).

Issue 35's GPU table waits for a lent GPU; this bench says beforehand what each search's
kernel costs, from its machine code. Each Triton kernel is compiled here for an H100 / H200
(sm_90) with the ptxas that Triton bundles, specialized as its launcher specializes it
(pointers and sizes divisible by 16 marked so), and its SASS is counted: the instructions of
the hot region (the candidates' loop, or the unrolled body) per element and candidate. The
slow-path stubs of IEEE divisions (a branch over a call, taken when the operands are in the
fast range: a few instructions around a call) are not counted; other branches are (libdevice's ``pow`` in llm-compressor's
kernels has several, so their figures are upper bounds). Times the candidates each method
prices per element in the issue's case, over the SM's issue rate (4 schedulers x 32 lanes
per clock), this is each search's compute floor on an H200: a measurement can only be
slower. MUFU (the reciprocal, log and exp unit) and F2F (float64 conversion) are shown
apart: each runs at 16 lanes per clock per SM, an eighth of the issue rate.

Peers' kernels (llm-compressor 0.14's ``mse_quant``, ModelOpt 0.47's
``nvfp4_fp8_sweep``) are imported from the peers' venv (``.peers`` or
$QUANTSCOPE_PEER_PYTHON's site-packages) and compiled with this venv's Triton. The
candidate counts: quantscope's, counted from the ops its search calls on the CPU (the same
engine runs on CUDA); llm-compressor's, from its observers' defaults (``int(maxshrink *
grid)`` steps, all priced: the patience runs after pricing); ModelOpt's, its candidate list.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PEER_PY = Path(os.environ.get("QUANTSCOPE_PEER_PYTHON", HERE.parent / ".peers" / "bin" / "python"))

#: an H200 (or H100 SXM): 132 SMs at 1.98 GHz, each issuing 4 x 32 lane-instructions a clock
SMS, CLOCK_HZ, LANES_PER_CLOCK = 132, 1.98e9, 128
#: the MUFU and F2F pipes: 16 lanes a clock per SM
SLOW_PIPE_LANES = 16
HBM_BYTES_PER_S = 4.8e12

_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[.\w]*\s*(.*)")
_TARGET = re.compile(r"0x([0-9a-f]+)")
#: the longest slow-path stub (arguments moved, the call, the result moved back)
_STUB = 8


def _peer_site() -> str | None:
    """The peers' site-packages (appended to sys.path: this venv's torch and triton stay)."""
    try:
        code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        return subprocess.run([str(PEER_PY), "-c", code],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def sass(fn, signature: dict, constexprs: dict, num_warps: int, div16=()) -> str:
    """``fn`` compiled for sm_90 as its launcher would specialize it, disassembled."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quantscope.kernels.triton._jit import LAUNCH

    names = fn.arg_names
    missing = [a for a in names if a not in signature and a not in constexprs]
    if missing:  # (triton's own error names no argument)
        raise ValueError(f"bench_sass: {fn.__name__} takes {missing}, which its case's sig and "
                         "const do not give: the kernel's arguments changed")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items()
             if t.startswith("*") or a in div16}
    options = {"num_warps": num_warps}
    if fn.__module__.startswith("quantscope"):
        options.update(LAUNCH)  # our launches' options (no FMA contraction)
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                      attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"qs_sass_{os.getpid()}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    try:
        return subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
    finally:
        cubin.unlink()


def _parse(text: str) -> list[tuple]:
    """(address, opcode, predicated, branch target) of each SASS instruction."""
    ins = []
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m:
            target = _TARGET.search(m.group(4))
            ins.append((int(m.group(1), 16), m.group(3), bool(m.group(2)),
                        int(target.group(1), 16) if target and m.group(3) == "BRA" else None))
    return ins


def _executed(region: list[tuple]) -> collections.Counter:
    """Opcode counts of ``region`` less the division slow-path stubs it branches over."""
    skipped = set()
    for a, op, pred, t in region:
        if op == "BRA" and pred and t is not None and t > a:
            inside = [i for i in region if a < i[0] < t]
            if len(inside) <= _STUB and any(i[1] == "CALL" for i in inside):
                skipped.update(i[0] for i in inside)
    return collections.Counter(op for a, op, _, _ in region if a not in skipped)


def loops(text: str) -> list[collections.Counter]:
    """Each loop's body (a backward branch back to its target), in address order."""
    ins = _parse(text)
    return [_executed([i for i in ins if t <= i[0] <= a])
            for a, _, _, t in ins if t is not None and t < a]


def hot_region(text: str) -> collections.Counter:
    """Opcode counts of the hot region: the widest backward branch's loop, else the kernel up
    to its first unconditional EXIT; forward branches over a CALL (a division's slow path,
    skipped in its fast range) not counted."""
    ins = _parse(text)
    loops_ = [(a, t) for a, _, _, t in ins if t is not None and t < a]
    if loops_:
        start, end = min(loops_, key=lambda at: at[1] - at[0])[::-1]
    else:
        start = ins[0][0]
        end = next(a for a, op, pred, _ in ins if op == "EXIT" and not pred)
    return _executed([i for i in ins if start <= i[0] <= end])


def ours_candidates(spec, units_shape, **search) -> int:
    """Candidates quantscope's ops engine prices per unit (summed over its launches), counted
    on the CPU: the ops and their choices are the same on CUDA."""
    from quantscope.estimators.mse import mse_search
    from quantscope.kernels import ops

    priced = []
    names = ("mse_price_int", "mse_price_fp")
    saved = {n: getattr(ops, n) for n in names}

    def wrap(name):
        def call(units, scale, *args, **kwargs):
            priced.append(scale.shape[0])
            return saved[name](units, scale, *args, **kwargs)
        return call
    try:
        for n in names:
            setattr(ops, n, wrap(n))
        mse_search(torch.randn(*units_shape), None, None, spec, backend="ops", **search)
    finally:
        for n, fn in saved.items():
            setattr(ops, n, fn)
    return sum(priced)


_PRICE = {"x_ptr": "*fp32", "w_ptr": "*fp32", "s_ptr": "*fp32", "z_ptr": "*i32",
          "out_ptr": "*fp64", "U": "i32", "E": "i32", "K": "i32", "stride_u": "i32",
          "stride_w": "i32", "qmin": "fp32", "qmax": "fp32", "min_exp": "i32", "mbits": "i32",
          "BLOCK_U": "constexpr", "BLOCK_E": "constexpr", "ONE_TILE": "constexpr",
          "FLOAT": "constexpr", "WEIGHTED": "constexpr", "NORM": "constexpr",
          "SQ32": "constexpr"}
_LLMC = {"observed_ptr": "*fp32", "min_base_ptr": "*fp32", "max_base_ptr": "*fp32",
         "zp_base_ptr": "*fp32", "num_observations": "i32", "num_qparams": "i32",
         "group_size": "i32", "q_min": "fp32", "q_max": "fp32", "norm": "fp32",
         "scale_eps": "fp32", "QUANT_TYPE": "constexpr", "NUM_BITS": "constexpr",
         "HAS_ZP": "constexpr", "SYMMETRIC": "constexpr", "SCALE_ROUND_TYPE": "constexpr",
         "OBSERVED_DTYPE": "constexpr"}
_LLMC_FORMAT = {"QUANT_TYPE": 0, "NUM_BITS": 4, "HAS_ZP": False, "SYMMETRIC": True,
                "SCALE_ROUND_TYPE": 0, "OBSERVED_DTYPE": 0}


def _code_trips(spec, factors, expand, rows=512, cols=4096, one_global=False
                ) -> tuple[float, int]:
    """The block-scale kernels' codes-loop trips on a Gaussian weight: (codes priced per
    program and global amax tried, summed over those tried, each the program's widest span
    + 1; the global amaxes tried: NVFP4's 4, or with ``one_global`` the weight's amax (the
    imatrix search's), MX's one), from ``qparams``' formulas on the first and last
    candidates."""
    from quantscope.estimators.mse import _global_amaxes
    from quantscope.kernels import ops
    from quantscope.qparams import nvfp4_block_scales, nvfp4_global_scale

    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    size = spec.layout.size
    amax = w.reshape(-1, size).abs().amax(1) * expand
    mx = spec.scale.kind == "e8m0"
    gas = [None] if mx else [w.abs().max()] if one_global else \
        _global_amaxes(w.abs().max(), spec, True, None)
    trips = 0.0
    for ga in gas:
        if mx:  # E8M0 codes: the scales' exponent fields
            first, last = ((ops.e8m0_block_scales(-amax * f, amax * f, spec.format.name,
                                                  spec.scale.mode).view(torch.int32) >> 23)
                           for f in (factors[0], factors[-1]))
        else:
            gs = nvfp4_global_scale(ga, spec.format).reshape(1)
            first, last = (nvfp4_block_scales(amax * f, gs, spec.format, spec.min_scale)
                           .to(torch.float8_e4m3fn).view(torch.uint8).long()
                           for f in (factors[0], factors[-1]))
        span = (first - last).reshape(-1, 2048 // size).amax(1)  # the launcher's BLOCK_U
        trips += float(span.float().mean()) + 1
    return trips, len(gas)


#: the block-scale kernels' arguments (kernels/triton/block_search.py): their ``_ranges``'
#: (``_ANY_BLOCK``: with MX's too), a tile of units, and NVFP4's / MX's constants
_BLOCK_RANGES = {"lo_ptr": "*fp32", "hi_ptr": "*fp32", "f_ptr": "*fp32", "ilo_ptr": "*fp32",
                 "ihi_ptr": "*fp32", "amax_ptr": "*fp32", "U": "i32", "K": "i32",
                 "fmax": "fp32", "bmax": "fp32", "min_scale": "fp32", "B_MIN_EXP": "constexpr",
                 "B_MBITS": "constexpr", "SUB_STEPS": "constexpr", "RATIO": "constexpr",
                 "BLOCK_K": "constexpr", "BLOCK_U": "constexpr"}
_ANY_BLOCK = {**_BLOCK_RANGES, "emax": "i32", "ENC": "constexpr", "TOP": "constexpr"}
_TILE = {"x_ptr": "*fp32", "w_ptr": "*fp32", "E": "i32", "stride_u": "i32",
         "stride_w": "i32", "min_exp": "i32", "mbits": "i32", "WEIGHTED": "constexpr",
         "BLOCK_E": "constexpr"}
_NVFP4_CONST = {"B_MIN_EXP": -6, "B_MBITS": 3, "SUB_STEPS": 512.0, "RATIO": 1.0625 - 1e-5,
                "BLOCK_K": 128, "BLOCK_U": 128}
_ENC = {"nvfp4": {**_NVFP4_CONST, "ENC": -1, "TOP": 4.0, "BLOCK_E": 16},
        "mx": {**_NVFP4_CONST, "ENC": 0, "TOP": 4.0, "RATIO": 2.0 - 1e-5, "BLOCK_U": 64,
               "BLOCK_E": 32}}


def _codes_cost(price, codes: float, others=()) -> tuple[float, float, float]:
    """(SASS, MUFU + F2F SASS, codes priced) per element of a block-scale kernel whose
    pricing loop body ``price`` runs ``codes`` times a thread, and each other loop body of
    ``others`` (``(body, trips)``) its trips. A program's tile is 2048 elements over 128
    threads: 16 a thread in the pricing loop; the per-unit loops run one unit a thread
    (NVFP4: 128 units of 16) or a unit on two threads (MX: 64 of 32), 16 elements each."""
    per_thread = sum(price.values()) * codes + sum(sum(b.values()) * n for b, n in others)
    return per_thread / 16, (price["MUFU"] + price["F2F"]) * codes / 16, codes


def _fused_nvfp4_case(spec, factors, expand, who, case="NVFP4 search 8192 x 4096",
                      weighted=False) -> dict:
    """The fused ``nvfp4_search``: per global amax, the incumbent and each program's codes
    priced (the pricing loop), then a bisection; its candidates column counts the codes.
    ``weighted``: the imatrix search's (one global amax, each term weighted)."""
    from quantscope.kernels.triton import block_search

    trips, passes = _code_trips(spec, factors, expand, one_global=weighted)
    steps = max(1, (len(factors) - 1).bit_length()) + 1

    def cost(text):
        bodies = loops(text)
        price = next(b for b in bodies if b["DADD"])  # the codes' loop (first pricing loop)
        bisect = next(b for b in bodies if not b["DADD"])
        return _codes_cost(price, trips + passes, [(bisect, steps * passes)])

    return {"case": case, "who": who,
            "kernel": lambda: block_search._search_kernel, "warps": 4, "cost": cost,
            "sig": {**_BLOCK_RANGES, **_TILE, "idx_ptr": "*i64", "best_ptr": "*fp64",
                    "STEPS": "constexpr"},
            "const": {**_NVFP4_CONST, "STEPS": steps, "BLOCK_E": 16, "WEIGHTED": weighted},
            "div16": ("U", "E", "stride_u"), "elements": 8192 * 4096}


def _block_mse_case(spec, enc: str, case: str, who: str, elements: int) -> dict:
    """``nvfp4_mse`` / ``mx_mse`` under the native rules (patience 5, the grid's 20 factors
    and the per-unit extension's 30): per global amax, the price kernel (the incumbent and
    each program's codes priced, then the global rule's flags over the grid's candidates)
    and the select kernel (the 50 candidates walked); the candidates column counts the
    codes priced."""
    from quantscope.kernels.triton import block_search

    K, G = 50, 20
    trips, passes = _code_trips(spec, [1 - i / 100 for i in range(K)], 1.0)
    const = {**_ENC[enc], "BLOCK_K": 64}
    select_text = sass(block_search._select_kernel,
                       {**_ANY_BLOCK, "inc_ptr": "*fp64", "scratch_ptr": "*fp64",
                        "gstop_ptr": "*i64", "idx_ptr": "*i64", "best_ptr": "*fp64",
                        "ext_start": "i32", "patience": "i32", "PER_UNIT": "constexpr",
                        "USE_GLOBAL": "constexpr", "HAS_PATIENCE": "constexpr",
                        "TIE_LAST": "constexpr"},
                       {k: v for k, v in const.items() if k != "BLOCK_E"} | {
                           "PER_UNIT": True, "USE_GLOBAL": True, "HAS_PATIENCE": True,
                           "TIE_LAST": False}, 4, ("U",))

    def cost(text):
        bodies = loops(text)
        price = next(b for b in bodies if b["DADD"])  # the codes' loop (first pricing loop)
        flags = [b for b in bodies if not b["DADD"]][-1]
        select = max(loops(select_text), key=lambda b: sum(b.values()))
        return _codes_cost(price, trips + passes, [(flags, G * passes), (select, K * passes)])

    return {"case": case, "who": who, "kernel": lambda: block_search._price_kernel,
            "warps": 4, "cost": cost,
            "sig": {**_ANY_BLOCK, **_TILE, "inc_ptr": "*fp64", "scratch_ptr": "*fp64",
                    "flags_ptr": "*i8", "G": "i32", "qmin": "fp32", "TIE_LAST": "constexpr",
                    "FLOAT": "constexpr"},
            "const": {**const, "TIE_LAST": False, "FLOAT": True, "WEIGHTED": False},
            "div16": ("U", "E", "stride_u"),
            "elements": elements}


def cases() -> list[dict]:
    """Each kernel: how to compile it, the element-candidates one pass of its hot region
    covers per thread, and the candidates it prices per element in the issue's case."""
    from quantscope import presets
    from quantscope.estimators.mse import shrink_factors
    from quantscope.kernels.triton import mse
    from quantscope.spec import QuantSpec

    int4, nvfp4 = QuantSpec("int4"), presets.NVFP4
    expanded = {"maxshrink": 1 - 0.8 / 1.8, "grid": 200, "patience": 1000, "expand": 1.8}
    out = [
        {"case": "MSE int4 per channel 4096 x 4096", "who": "quantscope mse_search (ops)",
         "kernel": lambda: mse._price_kernel, "warps": 4, "per_pass": 4096 // 128,
         "sig": _PRICE, "const": {"BLOCK_U": 1, "BLOCK_E": 4096, "ONE_TILE": True,
                                  "FLOAT": False, "WEIGHTED": False, "NORM": 2.0, "SQ32": False},
         "div16": ("U", "E", "stride_u"),
         "candidates": ours_candidates(int4, (64, 4096)), "elements": 4096 * 4096},
        # the compat classes' search: llm-compressor's rules and norm (CUDA's powf a term)
        {"case": "MSE int4 per channel 4096 x 4096",
         "who": "quantscope, llm-compressor's rules (ops, norm 2.4)",
         "kernel": lambda: mse._price_kernel, "warps": 4, "per_pass": 4096 // 128,
         "sig": _PRICE, "const": {"BLOCK_U": 1, "BLOCK_E": 4096, "ONE_TILE": True,
                                  "FLOAT": False, "WEIGHTED": False, "NORM": 2.4, "SQ32": False},
         "div16": ("U", "E", "stride_u"),
         "candidates": ours_candidates(int4, (64, 4096), compat="llmcompressor", norm=2.4),
         "elements": 4096 * 4096},
    ]
    mx_case = "MSE MXFP4 4096 x 4096 (native: patience 5)"
    imatrix_case = "NVFP4 imatrix search 8192 x 4096 (20 factors, weighted)"
    out += [
        _block_mse_case(nvfp4, "nvfp4", "NVFP4 search 8192 x 4096",
                        "quantscope mse, NVFP4 (patience 5: nvfp4_mse's two kernels)",
                        8192 * 4096),
        _fused_nvfp4_case(nvfp4, shrink_factors(expanded["maxshrink"], expanded["grid"], 1.0),
                          expanded["expand"],
                          "quantscope nvfp4_expanded_mse (fused nvfp4_search)"),
        # the importance-weighted search (imatrix_mse: 1.00 .. 0.81 under the weight's
        # global amax): before, every factor priced by the weighted mse_price_fp (20 and
        # the incumbent); now the fused search, weighted
        {"case": imatrix_case,
         "who": "quantscope imatrix_mse, every candidate priced (before)",
         "kernel": lambda: mse._price_kernel, "warps": 4, "per_pass": 16 * 128 // 128,
         "sig": {**_PRICE, "z_ptr": "*fp32"},
         "const": {"BLOCK_U": 128, "BLOCK_E": 16, "ONE_TILE": True, "FLOAT": True,
                   "WEIGHTED": True, "NORM": 2.0, "SQ32": False}, "div16": ("U", "E", "stride_u"),
         "candidates": len(shrink_factors()) + 1, "elements": 8192 * 4096},
        _fused_nvfp4_case(nvfp4, shrink_factors(), 1.0,
                          "quantscope imatrix_mse (fused nvfp4_search, weighted)",
                          imatrix_case, weighted=True),
        # MX before mx_mse: every candidate's E8M0 scales priced (mse_price_fp), 50 and the
        # incumbent
        {"case": mx_case, "who": "quantscope mse, MXFP4, every candidate priced (before)",
         "kernel": lambda: mse._price_kernel, "warps": 4, "per_pass": 32 * 64 // 128,
         "sig": {**_PRICE, "z_ptr": "*fp32"},
         "const": {"BLOCK_U": 64, "BLOCK_E": 32, "ONE_TILE": True, "FLOAT": True,
                   "WEIGHTED": False, "NORM": 2.0, "SQ32": False}, "div16": ("U", "E", "stride_u"), "candidates": 51,
         "elements": 4096 * 4096},
        _block_mse_case(presets.MXFP4, "mx", mx_case,
                        "quantscope mse, MXFP4 (mx_mse's two kernels)", 4096 * 4096),
    ]
    site = _peer_site()
    if site is None:
        return out
    sys.path.append(site)
    try:
        # its logger's "no accelerator" warning at import: not this bench's output
        os.environ.setdefault("LLM_COMPRESSOR_LOG_DISABLED", "true")
        from llmcompressor.observers import mse_quant
    except ImportError as exc:
        print(f"llm-compressor's kernels not compiled: {exc}")
    else:
        out += [
            {"case": "MSE int4 per channel 4096 x 4096",
             "who": "llm-compressor memoryless_mse (Triton, split kernel)",
             "kernel": lambda: mse_quant._grid_search_mse_triton_split_kernel, "warps": 4,
             "per_pass": 20 * 512 // 128,  # 20 steps unrolled, 512 values per program
             "sig": {**_LLMC, "partial_error_ptr": "*fp32", "grid_points_ptr": "*fp32"},
             "const": {**_LLMC_FORMAT, "BLOCK_VALUES": 512, "NUM_CHUNKS": 8,
                       "TOTAL_STEPS": 20}, "div16": ("num_qparams", "group_size"),
             "candidates": int(0.20 * 100), "elements": 4096 * 4096},
            {"case": "NVFP4 search 8192 x 4096",
             "who": "llm-compressor nvfp4_expanded_mse (Triton, packed kernel)",
             "kernel": lambda: mse_quant._grid_search_mse_triton_packed_kernel, "warps": 4,
             "per_pass": 512 // 128,  # one step a loop pass, 32 blocks of 16 per program
             "sig": {**_LLMC, "best_step_ptr": "*i32", "total_steps": "i32",
                     "grid_points_ptr": "*fp32", "patience": "i32",
                     "triton_error_buffer": "fp32"},
             "const": {**_LLMC_FORMAT, "QUANT_TYPE": 1, "BLOCK_VALUES": 16,
                       "TILE_QPARAMS": 32, "TOTAL_STEPS": 128},
             "div16": ("num_qparams", "group_size"),
             "candidates": int((1 - 0.8 / 1.8) * 200), "elements": 8192 * 4096},
        ]
    try:
        from modelopt.torch.kernels.quantization.gemm import nvfp4_fp8_sweep as sweep
    except ImportError as exc:
        print(f"ModelOpt's kernel not compiled: {exc}")
    else:
        out.append(
            {"case": "NVFP4 search 8192 x 4096",
             "who": "ModelOpt fp8-scale sweep (Triton)",
             "kernel": lambda: sweep._fp8_scale_sweep_kernel.fn, "warps": 8,
             # its autotuner's pick for large tensors: 64 blocks of 16, 8 warps; unrolled
             "per_pass": 126 * 64 * 16 // 256,
             "sig": {"x_ptr": "*fp32", "candidates_ptr": "*fp32", "global_amax_ptr": "*fp32",
                     "best_amax_ptr": "*fp32", "N_BLOCKS": "i32", "BLOCK_SIZE": "constexpr",
                     "NUM_CANDIDATES": "constexpr", "BLOCKS_PER_PROGRAM": "constexpr"},
             "const": {"BLOCK_SIZE": 16, "NUM_CANDIDATES": 126, "BLOCKS_PER_PROGRAM": 64},
             "div16": ("N_BLOCKS",),
             "candidates": int(sweep.fp8_scale_candidates("cpu").numel()),
             "elements": 8192 * 4096})
    return out


def main() -> None:
    from common import Table

    try:
        import triton  # noqa: F401  (the compiler and its bundled ptxas / cuobjdump)
    except ImportError:
        print("bench_sass: not run: needs triton (pip install 'quantscope[gpu]')")
        return

    table = Table("The searches' compute floors from their sm_90 SASS (H200: 132 SMs, "
                  "1.98 GHz)",
                  ["case", "kernel", "SASS / element-candidate", "MUFU + F2F / el.-cand.",
                   "candidates / element", "SASS / element", "issue floor ms",
                   "slow-pipe floor ms", "memory floor ms (fp32 read once)"])
    lane_rate = SMS * CLOCK_HZ * LANES_PER_CLOCK
    slow_rate = SMS * CLOCK_HZ * SLOW_PIPE_LANES
    for c in cases():
        text = sass(c["kernel"](), c["sig"], c["const"], c["warps"], c["div16"])
        if "cost" in c:  # loops of their own trip counts: (SASS, slow, candidates) / element
            total, slow_total, cands = c["cost"](text)
            per, slow = total / cands, slow_total / cands
        else:
            ops = hot_region(text)
            per = sum(ops.values()) / c["per_pass"]
            slow = (ops["MUFU"] + ops["F2F"]) / c["per_pass"]
            cands = c["candidates"]
        work = c["elements"] * cands
        table.add(c["case"], c["who"], f"{per:.1f}", f"{slow:.2f}", f"{cands:.4g}",
                  f"{per * cands:.0f}", f"{work * per / lane_rate * 1e3:.2f}",
                  f"{work * slow / slow_rate * 1e3:.2f}",
                  f"{c['elements'] * 4 / HBM_BYTES_PER_S * 1e3:.3f}")
    table.print()
    print("A kernel's floor is the larger of its issue and slow-pipe floors; each search "
          "reads its weight once (the memory floor), so all are compute-bound.")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
