"""The block-scale MSE searches' Triton kernels (quantscope.kernels.triton.block_search)
against their definitions (``kernels.ops``: every candidate's block scales priced, then
``mse_select``): NVFP4's e4m3 block scales under a global scale and MX's E8M0 ones, each
distinct scale of a unit priced once where its candidates fall through consecutive codes.

Run as tests/kernels/test_triton_kernels.py runs (the interpreter on the CPU without a
GPU, compiled with one; a child process where triton was imported first).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import each_value
from triton_interpreter import fresh_interpreter_test

from quantscope.formats import get_format
from quantscope.kernels.triton.block_search import _scale_code, _scale_value
from quantscope.scales import E8M0_MODES

pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


test_in_a_fresh_interpreter = fresh_interpreter_test(__file__)


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    bits = lambda t: t.float().cpu().view(torch.int32)
    assert got.shape == want.shape and torch.equal(bits(got), bits(want))


# ---- NVFP4's searches: each distinct block scale priced once --------------------------------

@triton.jit
def _code_kernel(q_ptr, code_ptr, value_ptr, n, ENC: tl.constexpr, BLOCK: tl.constexpr):
    # its helpers come from the module's imports: Triton's compiler refuses an import in a
    # kernel's body (the interpreter runs one)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    c = _scale_code(tl.load(q_ptr + offs, mask=mask, other=1.0), ENC, -6, 3, 512.0)
    tl.store(code_ptr + offs, c, mask=mask)
    tl.store(value_ptr + offs, _scale_value(c, ENC, -6, 3, 512.0), mask=mask)


#: every block scale of each encoding, in increasing order: e4m3's 0 .. 448 (NVFP4, ENC -1),
#: E8M0's 2 ** -127 (a float32 subnormal) .. 2 ** 127 (MX, ENC 0)
_SCALES = {-1: torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float(),
           0: torch.tensor([2.0 ** k for k in range(-127, 128)], dtype=torch.float32)}


@pytest.mark.parametrize("enc", list(_SCALES))
def test_block_scale_codes_count_the_scales_in_order(device, enc):
    """``_scale_code`` numbers an encoding's block scales 0, 1, ... in increasing order and
    ``_scale_value`` gives each back exactly: the searches enumerate block scales by code."""
    values = _SCALES[enc]
    n = values.numel()
    assert values[0] >= 0 and torch.all(values[1:] > values[:-1])
    codes = torch.empty(n, dtype=torch.int32, device=device)
    back = torch.empty(n, device=device)
    _code_kernel[(1,)](values.to(device), codes, back, n, ENC=enc, BLOCK=256)
    assert torch.equal(codes.cpu(), torch.arange(n, dtype=torch.int32))
    _assert_bitwise(back, values)


@settings(max_examples=30, deadline=None)
@given(st.floats(1.0001, 1.0625 - 1e-5), st.floats(-30, 30), st.integers(0, 2 ** 31 - 1))
def test_finely_falling_factors_step_block_codes_by_at_most_one(ratio, log_ga, seed):
    """The fused search's premise (torch, no kernel): factors that fall by less than
    ``1 + 1/16`` from one to the next move a unit's e4m3 block scale (``qparams``' formula,
    under any global scale) by 0 or 1 code, so a unit's distinct candidate scales are
    every code between its first candidate's and its last's."""
    from quantscope.formats import FP4_E2M1
    from quantscope.qparams import nvfp4_block_scales, nvfp4_global_scale

    g = torch.Generator().manual_seed(seed)
    ga = torch.tensor(2.0 ** log_ga)
    amax = ga * torch.rand(512, generator=g).pow(8)  # every block scale code, saturation too
    amax[:4] = torch.tensor([0.0, float("inf"), 2.0 * ga, 1e-30])
    f = torch.tensor([1.8 / ratio ** k for k in range(80)], dtype=torch.float32)
    gs = nvfp4_global_scale(ga, FP4_E2M1).reshape(1)
    block = nvfp4_block_scales(amax[None] * f[:, None], gs, FP4_E2M1, 0.0)
    codes = block.to(torch.float8_e4m3fn).view(torch.uint8).long()
    steps = codes[:-1] - codes[1:]
    assert ((steps == 0) | (steps == 1)).all()


def _nvfp4_search_case(kind: str):
    """(units, lo, hi, factors, inc_lo, inc_hi, global_amax) of a search case."""
    g = torch.Generator().manual_seed(len(kind))
    U, E = (30, 12) if kind == "e12" else (45, 16)
    units = torch.randn(U, E, generator=g) * torch.rand(U, 1, generator=g).pow(3).mul(4)
    units[3] = 0.0  # codes 0: min_scale
    units[4] *= 1e-6  # block scales below e4m3's subnormals
    units[5, 2] = 40.0  # an outlier: shrinking pays
    units[6] = units[6].abs() + 0.5  # a range without 0 (a negative factor swaps its ends)
    if kind == "exact":
        return _nvfp4_exact_case(g)
    factors = {"expanded": [1.8 * (1 - i / 200) for i in range(111)],
               "native": [1 - i / 100 for i in range(50)],
               "coarse": [1.3, 0.95, 0.7, 0.45],  # codes that skip: every candidate priced
               "rising": [0.5, 0.8, 1.0, 1.2],
               "one": [0.9], "negative": [-0.9],  # (lo * f, hi * f) swaps its ends
               "inf": [float("inf")], "nan-factor": [1.0, float("nan"), 0.9],
               "through-zero": [0.02, 0.01, 0.0, -0.01]}.get(
                   kind, [1 - i / 100 for i in range(20)])
    lo, hi = torch.aminmax(units, dim=1)
    ga = units.abs().max().reshape(1)
    expand = 1.8 if kind == "expanded" else 1.0
    if kind == "nan":
        units[7, 1] = float("nan")
        lo, hi = torch.aminmax(units, dim=1)
    if kind == "huge":  # block scales saturate at e4m3's 448
        ga = ga / 1e6
    return (units, lo * expand, hi * expand, torch.tensor(factors), lo, hi, ga)


def _nvfp4_exact_case(g):
    """Units on the fp4 grid of an e4m3 block scale (global scale 1): the incumbent and the
    first candidates price 0, every smaller scale clips the unit's +-6; so under ties kept
    last each unit improves only while its first code lasts, and the global rule stops."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    q0 = torch.tensor([1.0, 0.875, 1.25, 2.0, 3.5, 0.5, 0.625, 5.0, 7.0])
    units = grid[torch.randint(0, 8, (9, 16), generator=g)]
    units *= torch.randint(0, 2, (9, 16), generator=g) * 2.0 - 1.0
    units[:, 0] = 6.0
    units *= q0[:, None]
    lo, hi = torch.aminmax(units, dim=1)
    return (units, lo, hi, torch.tensor([1 - i / 100 for i in range(50)]), lo, hi,
            torch.tensor([448.0 * 6.0]))


NVFP4_CASES = ["expanded", "native", "coarse", "rising", "nan", "huge", "e12", "one",
               "negative", "through-zero", "inf", "nan-factor"]


#: (ext_start, patience, per_unit, use_global, tie_last) of nvfp4_mse, by name; ext_start
#: of 20 (or all candidates, fewer): the candidates after it are the per-unit extension
NVFP4_RULES = {"native": (20, 5, True, True, False), "global-rule": (20, 3, False, True, False),
               "tie-last": (20, 4, True, True, True), "no-patience": (20, -1, False, False, False),
               "no-global": (20, 2, True, False, False)}


def _importance(units: torch.Tensor) -> torch.Tensor:
    """Weights as an imatrix gives them: positive, spread over decades, some 0."""
    g = torch.Generator().manual_seed(units.numel())
    w = torch.exp(torch.randn(units.shape, generator=g) * 1.5)
    return w.masked_fill_(torch.rand(units.shape, generator=g) < 0.1, 0.0)


def _programs_of(args, block_u):
    """The case's first 4 programs' units when a program holds ``block_u`` units (16 rows for
    4: the special rows 3 - 7 span two programs, the global rule all four) at a third of the
    interpreter's time of every row; the factors and global amax unchanged."""
    if block_u is None:
        return args
    rows = 4 * block_u
    return tuple(a if i in (3, 6) else a[:rows] for i, a in enumerate(args))


def _check_nvfp4_mse(device, kind, rules, block_u, weighted=False, op=True):
    """The kernel's choices on ``kind``'s case under ``rules`` equal the torch path's; with
    ``op`` also the op's CUDA implementation's (the same kernel: its launcher's arguments)."""
    from quantscope.kernels import block_ops, ops
    from quantscope.kernels.triton import block_search

    args = _programs_of(_nvfp4_search_case(kind), block_u)
    w = _importance(args[0]) if weighted else None
    ext, patience, per_unit, use_global, tie_last = NVFP4_RULES[rules]
    ext = min(ext, args[3].shape[0])
    want_idx, want_best = block_ops._torch_nvfp4_mse(*args, "fp4_e2m1", 2.0 ** -9, ext,
                                                     patience, per_unit, use_global, tie_last,
                                                     w)
    fmt, dev_args = get_format("fp4_e2m1"), [a.to(device) for a in args]
    dev_w = None if w is None else w.to(device)
    seen = []

    def stop(improved):  # the global rule's flags, as the kernel gathered them
        seen.append(improved.cpu())
        return ops.stop_after(improved, patience)

    got = [block_search.block_mse(*dev_args, fmt.max, fmt.min_exp, fmt.mbits,
                                  block_search.NVFP4, 2.0 ** -9, ext,
                                  None if patience < 0 else patience, per_unit, use_global,
                                  tie_last, stop, weights=dev_w, block_u=block_u)]
    if op and (block_u is None or weighted):  # the op's CUDA implementation (the launcher's
        # arguments from the formats), once per rule set and weighting: its programs the default
        got.append(block_ops._cuda_nvfp4_mse(*dev_args, "fp4_e2m1", 2.0 ** -9, ext, patience,
                                             per_unit, use_global, tie_last, dev_w))
    for idx, best in got:
        assert torch.equal(idx.cpu(), want_idx)
        torch.testing.assert_close(best.cpu(), want_best, rtol=1e-12, atol=0, equal_nan=True)
    err, _ = ops.nvfp4_price(*args, "fp4_e2m1", 2.0 ** -9, w)
    G = ext if use_global and patience >= 0 else 0
    assert torch.equal(seen[0], ops.improved_rows(err[1:G + 1], err[0], tie_last))
    return want_idx


@pytest.mark.parametrize("kind", NVFP4_CASES)
def test_nvfp4_mse_is_price_then_select(device, kind):
    """NVFP4's search under patience (each distinct block scale priced once into a scratch
    where a unit's candidates fall through consecutive codes, every candidate elsewhere;
    the global rule's flags per program; the candidates then walked in order, each error
    read from its code's row) chooses what pricing every candidate (``nvfp4_price``) and
    ``mse_select`` choose."""
    idx = _check_nvfp4_mse(device, kind, "native", None, op=kind == "native")
    if kind == "native":  # both outcomes exercised
        assert (idx >= 0).any() and (idx < 0).any()


@pytest.mark.parametrize(("block_u", "kind", "rules"),
                         each_value([None, 4], ["native", "coarse", "nan", "exact"],
                                    list(NVFP4_RULES)))
def test_nvfp4_mse_rules(device, kind, rules, block_u):
    """Every rule set of ``mse_select`` (per-unit patience over plateaus, the global rule
    from every program's flags, ties kept last, none) on codes and on candidates, over
    programs of 4 units too (the global rule then spans programs)."""
    _check_nvfp4_mse(device, kind, rules, block_u)


def test_nvfp4_mse_plateaus_are_equal_stored_scales(device):
    """A plateau (not counted by per-unit patience) is a candidate whose STORED block scale
    equals the previous one's: e4m3 0 and 2 ** -9 both store ``min_scale`` 2 ** -9, so the
    unit below goes on to its exact scale 3 * 2 ** -9 at the last candidate."""
    from quantscope.kernels import block_ops

    g = torch.Generator().manual_seed(0)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    units = grid[torch.randint(0, 8, (3, 16), generator=g)] * 2.0 ** -9 * 3
    units[:, 0] = 6.0 * 2.0 ** -9 * 3  # global scale 1: block scale amax / 6 = 3 * 2 ** -9
    lo, hi = torch.aminmax(units, dim=1)
    # codes 0, 1, 1, 1, 3; the incumbent's 0
    args = (units, lo, hi, torch.tensor([0.1, 0.2, 0.3, 0.45, 1.0]), lo * 0.1, hi * 0.1,
            torch.tensor([448.0 * 6.0]), "fp4_e2m1", 2.0 ** -9, 5, 1, True, False, False)
    want = block_ops._torch_nvfp4_mse(*args)
    assert want[0].tolist() == [4, 4, 4] and want[1].tolist() == [0.0] * 3
    idx, best = block_ops._cuda_nvfp4_mse(*(a.to(device) if isinstance(a, torch.Tensor) else a
                                      for a in args))
    assert torch.equal(idx.cpu(), want[0]) and torch.equal(best.cpu(), want[1])


def test_nvfp4_flags_pass_over_a_nan_error_as_the_search_state_does(device):
    """The global rule's running best (``ops.improved_rows``) never takes a NaN error, as
    the search's state and llm-compressor's ``err < best`` never do: a later candidate
    still counts as improving. With ``min_scale`` 0 a block scale coded 0 stores 0, and the
    unit's zeros price NaN (0 / 0): candidate 0 here (factor 0.1); candidate 1 (code 1,
    exact) beats the incumbent (code 3), so it alone is flagged. The running best had
    followed torch's ``cummin`` (NaN from then on), which flagged neither."""
    from quantscope.formats import get_format
    from quantscope.kernels import ops
    from quantscope.kernels.triton import block_search

    q = 2.0 ** -9
    units = torch.zeros(2, 16)
    units[:, 1] = 0.5 * q  # exact under the block scale q, lost under 3 q
    units[:, 2] = 6.0 * q  # the amax: e4m3 code 1 (q) at factor 1, global scale 1
    lo, hi = torch.aminmax(units, dim=1)
    args = (units, lo, hi, torch.tensor([0.1, 1.0]), lo, hi * 3,
            torch.tensor([448.0 * 6.0]))
    err, _ = ops.nvfp4_price(*args, "fp4_e2m1", 0.0)
    assert err[1].isnan().all() and (err[2] < err[0]).all()  # the case is what it says
    want = ops.improved_rows(err[1:], err[0])
    assert want.tolist() == [False, True]
    seen, fmt = [], get_format("fp4_e2m1")

    def stop(improved):
        seen.append(improved.cpu())
        return ops.stop_after(improved, 5)

    block_search.block_mse(*(a.to(device) for a in args), fmt.max, fmt.min_exp, fmt.mbits,
                           block_search.NVFP4, 0.0, 2, 5, True, True, False, stop)
    assert torch.equal(seen[0], want)


@pytest.mark.parametrize(("block_u", "kind"), each_value([None, 4], NVFP4_CASES))
def test_nvfp4_search_is_price_then_select(device, kind, block_u):
    """The fused search (each distinct block scale priced once where a unit's candidates
    fall through consecutive codes; every candidate elsewhere) chooses what pricing every
    candidate and selecting the first lowest chooses (``ops.nvfp4_search``'s definition)."""
    _check_nvfp4_search(device, kind, block_u, False)


@pytest.mark.parametrize("kind", ["expanded", "native", "coarse", "nan", "huge", "e12"])
def test_weighted_nvfp4_search(device, kind):
    """The same weighted (an imatrix search: each term times its element's weight)."""
    _check_nvfp4_search(device, kind, None, True)


def _check_nvfp4_search(device, kind, block_u, weighted):
    from quantscope.kernels import block_ops
    from quantscope.kernels.triton import block_search

    args = _nvfp4_search_case(kind)
    w = _importance(args[0]) if weighted else None
    fmt = get_format("fp4_e2m1")
    want_idx, want_best = block_ops._torch_nvfp4_search(*args, "fp4_e2m1", 2.0 ** -9, w)
    dev_args = [a.to(device) for a in args]
    dev_w = None if w is None else w.to(device)
    idx, best = block_search.nvfp4_search(*dev_args, fmt.max, fmt.min_exp, fmt.mbits,
                                          block_search.NVFP4, 2.0 ** -9, weights=dev_w,
                                          block_u=block_u)
    assert torch.equal(idx.cpu(), want_idx)
    torch.testing.assert_close(best.cpu(), want_best, rtol=1e-12, atol=0, equal_nan=True)
    # the op's CUDA implementation (the launcher's arguments from the formats) runs it alike
    idx, best = block_ops._cuda_nvfp4_search(*dev_args, "fp4_e2m1", 2.0 ** -9, dev_w)
    assert torch.equal(idx.cpu(), want_idx)
    torch.testing.assert_close(best.cpu(), want_best, rtol=1e-12, atol=0, equal_nan=True)
    if kind in ("expanded", "native", "coarse"):
        assert (want_idx >= 0).any() and (want_idx < 0).any()  # both outcomes exercised


@pytest.mark.parametrize(("kind", "rules"),
                         each_value(["native", "coarse"], ["native", "global-rule"]))
def test_weighted_nvfp4_mse_rules(device, kind, rules):
    """The weighted search under every rule set, on codes and on candidates, over programs
    of 4 units (the global rule's flags from the weighted errors)."""
    _check_nvfp4_mse(device, kind, rules, 4, weighted=True)


def test_weights_move_the_choices():
    """The cases above can tell weights from none: the definition, weighted, chooses
    otherwise for some units (so a kernel that dropped the weights would fail them)."""
    from quantscope.kernels import block_ops

    for kind in ("native", "expanded"):
        args = _nvfp4_search_case(kind)
        plain, _ = block_ops._torch_nvfp4_search(*args, "fp4_e2m1", 2.0 ** -9)
        weighted, _ = block_ops._torch_nvfp4_search(*args, "fp4_e2m1", 2.0 ** -9,
                                                    _importance(args[0]))
        assert (plain != weighted).sum() >= 3
    args = _mx_case("native")
    for name, moved in (("fp4_e2m1", 1), ("int8_narrow", 3)):
        plain, _ = block_ops._torch_mx_mse(*args, name, "floor", 20, 5, True, True, False)
        weighted, _ = block_ops._torch_mx_mse(*args, name, "floor", 20, 5, True, True, False,
                                              _importance(args[0]))
        assert (plain != weighted).sum() >= moved


@pytest.mark.parametrize("op", ["nvfp4_mse", "nvfp4_search", "mx_mse"])
def test_weights_whose_rows_are_not_contiguous_price_as_the_definition(device, op):
    """Pin (s61 mutation): the Triton searches read a row of weights as contiguous, so
    weights whose rows are not (a view of a transposed ``[E, U]`` tensor, stride ``(1,
    U)``) must not reach them as they are: the op chooses and prices what its definition
    chooses with the same weights."""
    from quantscope.kernels import block_ops

    g = torch.Generator().manual_seed(0)
    units = torch.randn(8, 16, generator=g) * torch.rand(8, 1, generator=g).add(0.1)
    weights = _importance(units)
    lo, hi = torch.aminmax(units, dim=1)
    f, ga = torch.linspace(1.0, 0.5, 8), units.abs().amax().reshape(1)
    rules = (8, 2, True, True, False)
    args = {"nvfp4_mse": (units, lo, hi, f, lo, hi, ga, "fp4_e2m1", 2.0 ** -9, *rules),
            "nvfp4_search": (units, lo, hi, f, lo, hi, ga, "fp4_e2m1", 2.0 ** -9),
            "mx_mse": (units, lo, hi, f, lo, hi, "fp4_e2m1", "floor", *rules)}[op]
    want_idx, want_best = getattr(block_ops, f"_torch_{op}")(*args, weights)
    dev_args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    strided = weights.t().contiguous().t().to(device)  # the same values, rows strided
    assert strided.stride(1) != 1 and torch.equal(strided.cpu(), weights)
    assert block_ops._block_kernel(dev_args[0], strided.contiguous()) is not None  # Triton's
    idx, best = getattr(block_ops, f"_cuda_{op}")(*dev_args, strided)
    assert torch.equal(idx.cpu(), want_idx)
    torch.testing.assert_close(best.cpu(), want_best, rtol=1e-12, atol=0)


# ---- MX's search: each distinct E8M0 block scale priced once -------------------------------

@settings(max_examples=30, deadline=None)
@given(st.floats(1.0001, 2.0 - 1e-4), st.sampled_from(E8M0_MODES),
       st.sampled_from(["fp4_e2m1", "fp6_e3m2", "fp8_e4m3"]), st.floats(-100, 100),
       st.integers(0, 2 ** 31 - 1))
def test_finely_falling_factors_step_e8m0_codes_by_at_most_one(ratio, mode, name, log_s,
                                                                 seed):
    """The scratch's premise for MX (torch, no kernel): factors that fall by less than 2
    from one to the next move a unit's E8M0 scale (``e8m0_block_scales``, any mode) by 0 or
    1 code, so a unit's distinct scales are every code between its first candidate's and its
    last's."""
    from quantscope.kernels import ops

    g = torch.Generator().manual_seed(seed)
    amax = 2.0 ** log_s * torch.rand(256, generator=g).pow(8)
    amax[:3] = torch.tensor([0.0, float("inf"), 1e-44])
    f = torch.tensor([1.8 / ratio ** k for k in range(60)], dtype=torch.float32)
    lo, hi = -amax[None] * f[:, None], amax[None] * f[:, None]
    scale = ops.e8m0_block_scales(lo, hi, name, mode)
    codes = (scale.view(torch.int32) >> 23) & 255  # exponent fields: 2 ** -127 reads 0
    steps = codes[:-1] - codes[1:]
    assert ((steps == 0) | (steps == 1)).all()


def _mx_case(kind: str):
    """(units, lo, hi, factors, inc_lo, inc_hi) of an MX search case: NVFP4's cases, and
    factors coarser than E8M0's codes (``mx-coarse``: every candidate priced), units on an
    fp4 grid under power-of-two scales (``mx-exact``: ties), subnormal units (``tiny``), the
    native grid from 1.8x the range (``mx-wide``), candidates past float32's max
    (``mx-overflow``: an inf amax's scale saturates high). At most 64 factors each: compiled on a
    GPU, each block of factors is a kernel variant of its own."""
    if kind in ("mx-coarse", "mx-exact", "tiny", "mx-wide", "mx-overflow"):
        units, lo, hi, factors, inc_lo, inc_hi, _ = _nvfp4_search_case("native")
        if kind == "mx-exact":
            g = torch.Generator().manual_seed(3)
            grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
            units = grid[torch.randint(0, 8, (9, 16), generator=g)]
            units[:, 0] = 6.0  # floor mode: scale 2 ** k, every element exact
            units *= 2.0 ** torch.arange(-4, 5, dtype=torch.float32)[:, None]
            lo, hi = torch.aminmax(units, dim=1)
            inc_lo, inc_hi = lo, hi
        elif kind == "tiny":
            units = units * 1e-41  # float32 subnormals: scales clamp at 2 ** -127
            lo, hi = torch.aminmax(units, dim=1)
            inc_lo, inc_hi = lo, hi
        elif kind == "mx-wide":  # from 1.8x the range down: both outcomes, 50 factors
            lo, hi = lo * 1.8, hi * 1.8
        elif kind == "mx-overflow":  # the first candidates' ranges pass float32's max: inf
            units = units / units.abs().amax(1, keepdim=True).clamp(min=1e-30) * 2.5e38
            lo, hi = torch.aminmax(units, dim=1)
            inc_lo, inc_hi = lo, hi
            factors = torch.tensor([1.8 * (1 - i / 100) for i in range(50)])
        else:
            factors = torch.tensor([4.0, 1.5, 0.3, 0.1])
        return units, lo, hi, factors, inc_lo, inc_hi
    return _nvfp4_search_case(kind)[:6]


MX_CASES = ["native", "mx-wide", "coarse", "rising", "nan", "e12", "one", "negative",
            "through-zero", "inf", "nan-factor", "mx-coarse", "mx-exact", "tiny", "mx-overflow"]


def _check_mx_mse(device, kind, rules, block_u, name="fp4_e2m1", mode="floor",
                  weighted=False, op=True):
    """As ``_check_nvfp4_mse``, on MX's E8M0 scales of element format ``name``."""
    from quantscope.kernels import block_ops, ops
    from quantscope.kernels.triton import block_search

    args = _programs_of(_mx_case(kind), block_u)
    w = _importance(args[0]) if weighted else None
    ext, patience, per_unit, use_global, tie_last = NVFP4_RULES[rules]
    ext = min(ext, args[3].shape[0])
    want_idx, want_best = block_ops._torch_mx_mse(*args, name, mode, ext, patience, per_unit,
                                                  use_global, tie_last, w)
    fmt, dev_args = get_format(name), [a.to(device) for a in args]
    dev_w = None if w is None else w.to(device)
    enc = block_search.Encoding(E8M0_MODES.index(mode), emax=fmt.emax, mbits=fmt.mbits)
    seen = []

    def stop(improved):  # the global rule's flags, as the kernel gathered them
        seen.append(improved.cpu())
        return ops.stop_after(improved, patience)

    ints = not fmt.is_float
    got = [block_search.block_mse(*dev_args, None, fmt.max, 0 if ints else fmt.min_exp,
                                  0 if ints else fmt.mbits, enc, 0.0, ext,
                                  None if patience < 0 else patience, per_unit, use_global,
                                  tie_last, stop, qmin=float(fmt.qmin) if ints else None,
                                  weights=dev_w, block_u=block_u)]
    if op and (block_u is None or weighted):  # the op's CUDA implementation (the launcher's
        # arguments from the format, mode), once per rule set, format, mode and weighting
        got.append(block_ops._cuda_mx_mse(*dev_args, name, mode, ext, patience, per_unit,
                                          use_global, tie_last, dev_w))
    for idx, best in got:
        assert torch.equal(idx.cpu(), want_idx)
        torch.testing.assert_close(best.cpu(), want_best, rtol=1e-12, atol=0, equal_nan=True)
    err, _ = ops.mx_price(*args, name, mode, w)
    G = ext if use_global and patience >= 0 else 0
    assert torch.equal(seen[0], ops.improved_rows(err[1:G + 1], err[0], tie_last))
    return want_idx


@pytest.mark.parametrize("kind", MX_CASES)
def test_mx_mse_is_price_then_select(device, kind):
    """MX's search (each distinct E8M0 scale priced once into a scratch where a unit's
    candidates fall through consecutive codes, every candidate elsewhere; then walked under
    ``mse_select``'s rules) chooses what pricing every candidate (``mx_price``) and
    ``mse_select`` choose."""
    idx = _check_mx_mse(device, kind, "native", None, op=kind == "native")
    if kind in ("mx-wide", "coarse", "mx-coarse"):  # both outcomes exercised
        assert (idx >= 0).any() and (idx < 0).any()


@pytest.mark.parametrize(("kind", "name", "mode"),
                         each_value(["mx-wide", "mx-exact"], ["fp4_e2m1", "fp8_e4m3"],
                                    E8M0_MODES))
def test_mx_mse_modes_and_formats(device, mode, name, kind):
    """Every E8M0 rounding mode on MX element formats (the scale's exponent from the
    format's emax, its mantissa bits for ``even``, its max for ``rceil``)."""
    _check_mx_mse(device, kind, "native", None, name, mode)


@pytest.mark.parametrize(("block_u", "kind", "rules"),
                         each_value([None, 4], ["mx-wide", "mx-coarse", "mx-exact", "nan"],
                                    list(NVFP4_RULES)))
def test_mx_mse_rules(device, kind, rules, block_u):
    """Every rule set of ``mse_select`` on codes and on candidates, over programs of 4 units
    too (the global rule then spans programs)."""
    _check_mx_mse(device, kind, rules, block_u)


@pytest.mark.parametrize(("kind", "name", "mode"),
                         each_value(["mx-wide", "nan", "mx-overflow"],
                                    [("int8_narrow", "even"), ("int8", "floor")]))
def test_mx_mse_integer_elements(device, kind, name, mode):
    """E8M0 scales over signed integer elements (BFP16's ``int8_narrow`` under ``even``;
    ``int8``, whose qmin -128 is not -qmax): the codes priced as ``mse_price_int`` prices
    them, zero point 0."""
    idx = _check_mx_mse(device, kind, "native", None, name, mode)
    if kind == "mx-wide":
        assert (idx >= 0).any() and (idx < 0).any()


@pytest.mark.parametrize(("name", "mode"), [("fp4_e2m1", "floor"), ("int8_narrow", "even")])
@pytest.mark.parametrize("kind", ["native", "mx-coarse"])
def test_weighted_mx_mse(device, name, mode, kind):
    """MX's search weighted, over float and integer elements, on codes and on candidates."""
    _check_mx_mse(device, kind, "native", None, name, mode, weighted=True)


# ---- bad arguments: the definition's errors, on the Triton path too ------------------------

#: a 1-D or 0-d ``units`` or ``weights`` (the launchers' selection reads their second dimension)
_BAD_SHAPES = {"1-D units": lambda u, w: (u[0], None), "0-d units": lambda u, w: (u[0, 0], None),
               "1-D weights": lambda u, w: (u, w[0]), "0-d weights": lambda u, w: (u, w[0, 0])}


@pytest.mark.parametrize("op", ["nvfp4_mse", "nvfp4_search", "mx_mse"])
@pytest.mark.parametrize("bad", list(_BAD_SHAPES))
def test_bad_units_or_weights_raise_the_definitions_error(device, op, bad):
    """The ValueError naming the argument, word for word the definition's (the CPU path's),
    where the Triton path raised a bare IndexError: it read the second dimension first."""
    from quantscope.kernels import block_ops

    g = torch.Generator().manual_seed(0)
    u, w = torch.randn(6, 40, generator=g).to(device), torch.rand(6, 40, generator=g).to(device)
    lo, hi = u.aminmax(dim=1)
    f, ga = torch.linspace(1.0, 0.91, 10, device=device), torch.tensor([3.0], device=device)
    assert block_ops._block_kernel(u, w) is not None  # the Triton path, not its fallback
    rules = (5, 2, True, True, False)
    args = {"nvfp4_mse": (lo, hi, f, lo, hi, ga, "fp4_e2m1", 2.0 ** -9, *rules),
            "nvfp4_search": (lo, hi, f, lo, hi, ga, "fp4_e2m1", 2.0 ** -9),
            "mx_mse": (lo, hi, f, lo, hi, "fp4_e2m1", "floor", *rules)}[op]
    units, weights = _BAD_SHAPES[bad](u, w)
    errors = []
    for impl in (f"_torch_{op}", f"_cuda_{op}"):
        with pytest.raises(ValueError, match=rf"quantscope::{op}: {bad.split()[1]} must") as err:
            getattr(block_ops, impl)(units, *args, weights)
        errors.append(str(err.value))
    assert errors[0] == errors[1]
