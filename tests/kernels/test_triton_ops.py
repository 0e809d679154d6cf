"""The ``quantscope::`` custom ops (quantscope.kernels.ops): schema, fake (meta) and autograd
registrations (``torch.library.opcheck``), one graph under ``torch.compile``, clear errors,
and on a GPU the CUDA (Triton) implementation bitwise equal to the CPU one."""

from __future__ import annotations

import pytest
import torch

from quantscope import QuantSpec
from quantscope.kernels import ops
from quantscope.qdq import fake_quantize_units
from quantscope.qparams import qparams_from_range
from quantscope.stats import histogram as H
from quantscope.stats.ao_histogram import ao_histc
from quantscope.stats.hist_ops import hist_add, hist_regrid_
from quantscope.stats.minmax import record_non_finite

CUDA = torch.cuda.is_available()


def _hist_state(lo, hi, g):
    """A 64-bin histogram state of half the batch's range, counts in every bin: the batch
    (``lo``, ``hi``) then coarsens its grid."""
    state = H._update_grid(H.empty_state(lo.shape[0], 64), lo / 2, hi / 2, False)
    return state._replace(counts=torch.randint(0, 1000, (lo.shape[0], 64), generator=g))


def _cases(device="cpu"):
    g = torch.Generator().manual_seed(0)
    u = torch.randn(6, 40, generator=g)
    lo, hi = torch.aminmax(u, dim=1)
    f = torch.tensor([[1.0], [0.9], [0.8]])
    cand = qparams_from_range(lo[None] * f, hi[None] * f, QuantSpec("int4", symmetric=False))
    scale, zp = torch.rand(6, generator=g) + 0.05, torch.randint(-3, 3, (6,), generator=g).float()
    mx = torch.exp2(torch.floor(torch.log2(hi.abs().maximum(lo.abs())[None] * f / 6.0)))
    w = torch.rand(6, 40, generator=g).mul_(4)  # importance: per-element weights
    cases = {
        "unit_minmax": (ops.unit_minmax, (u,)),
        "unit_minmax_bf16": (ops.unit_minmax, (u.bfloat16(),)),
        "unit_minmax_tiles": (ops.unit_minmax, (u.view(3, 2, 5, 8).permute(0, 2, 1, 3),)),
        "grouped_unit_minmax": (ops.grouped_unit_minmax, ([u, u[:4, :7], u.t()],)),
        "fake_quant_int": (ops.fake_quant_int, (u, scale, zp, -8.0, 7.0)),
        # probing: a transposed input gave the CPU output its strides, the fake contiguous
        # ones (opcheck failed, torch.compile crashed); likewise a transposed range's zp
        "fake_quant_int_strided": (ops.fake_quant_int, (u.t().contiguous().t(), scale, zp,
                                                        -8.0, 7.0)),
        "int_qparams_sym_strided": (ops.int_qparams, (lo.view(2, 3).t(), hi.view(2, 3).t(),
                                                      [0.0, 255.0, 1e-8, 1.0, 128.0])),
        "e8m0_block_scales_strided": (ops.e8m0_block_scales, (lo.view(2, 3).t(),
                                                              hi.view(2, 3).t(), "fp4_e2m1",
                                                              "even")),
        "mse_price_int": (ops.mse_price_int, (u, cand.scale, cand.zero_point, -8.0, 7.0)),
        "mse_price_fp": (ops.mse_price_fp, (u, mx, 6.0, 0, 1)),  # fp4_e2m1, E8M0 scales
        # llm-compressor's error |d| ** 2.4 (on the CPU: the torch path, not the C kernel)
        "mse_price_int_norm": (ops.mse_price_int, (u, cand.scale, cand.zero_point, -8.0, 7.0,
                                                   None, 2.4)),
        "mse_price_fp_norm": (ops.mse_price_fp, (u, mx, 6.0, 0, 1, None, 3.0)),
        "mse_select": (ops.mse_select, (torch.rand(5, 6, generator=g, dtype=torch.float64),
                                        torch.rand(5, 6, generator=g) < 0.3,
                                        torch.ones(6, dtype=torch.float64), 4, 2, True, True,
                                        False)),
        "hist_add": (hist_add, (torch.zeros(6, 64, dtype=torch.int64), u,
                                torch.full((6,), -4, dtype=torch.int64),
                                torch.full((6,), -40, dtype=torch.int64), False)),
        "hist_regrid_": (hist_regrid_, (*_hist_state(lo, hi, g), lo, hi, False)),
        "hist_regrid_abs": (hist_regrid_, (*_hist_state(lo, hi, g), lo, hi, True)),
        "ao_histc": (ao_histc, (u, 64, -1.5, 2.0)),
        "ao_histc_bf16": (ao_histc, (u.bfloat16(), 100, -2.0, 1.0)),
        "int_qparams": (ops.int_qparams, (lo, hi, [-8.0, 7.0, 1e-8, 0.0, 0.0])),
        "int_qparams_sym": (ops.int_qparams, (lo, hi, [0.0, 255.0, 1e-8, 1.0, 128.0])),
        "e8m0_block_scales": (ops.e8m0_block_scales, (lo, hi, "fp4_e2m1", "even")),
        "nvfp4_qparams": (ops.nvfp4_qparams, (lo, hi, None, "fp4_e2m1", 1e-8)),
        "nvfp4_qparams_strided": (ops.nvfp4_qparams, (lo.view(2, 3).t(), hi.view(2, 3).t(),
                                                      None, "fp4_e2m1", 1e-8)),
        # probing: the CPU answered a 0-d range with block scales of shape [1]
        "nvfp4_qparams_0d": (ops.nvfp4_qparams, (lo[0], hi[0], None, "fp4_e2m1", 1e-8)),
        # probing: no units divided by zero in the launcher; the CPU failed on amin of nothing
        "unit_minmax_empty": (ops.unit_minmax, (u[:0],)),
        "record_non_finite_empty": (record_non_finite, (lo[:0], hi[:0],
                                                        torch.zeros(1, dtype=torch.bool))),
        "nvfp4_qparams_amax": (ops.nvfp4_qparams, (lo, hi, torch.tensor([7.0]), "fp4_e2m1",
                                                   1e-8)),
        "nvfp4_mse": (ops.nvfp4_mse, (u, lo, hi, torch.tensor([1 - i / 100 for i in range(50)]),
                                      lo, hi, torch.tensor([3.0]), "fp4_e2m1", 2.0 ** -9, 20, 5,
                                      True, True, False)),
        "nvfp4_search": (ops.nvfp4_search, (u, lo * 1.8, hi * 1.8,
                                            torch.tensor([1.8 * (1 - i / 200) for i in range(111)]),
                                            lo, hi, torch.tensor([3.0]), "fp4_e2m1", 2.0 ** -9)),
        "mx_mse": (ops.mx_mse, (u, lo, hi, torch.tensor([1 - i / 100 for i in range(50)]), lo,
                                hi, "fp4_e2m1", "floor", 20, 5, True, True, False)),
        "mx_mse_rceil": (ops.mx_mse, (u, lo * 1.8, hi * 1.8, torch.tensor([1.0, 0.5, 0.3]), lo,
                                      hi, "fp8_e4m3", "rceil", 3, -1, False, False, True)),
        "mx_mse_int": (ops.mx_mse, (u, lo, hi, torch.tensor([1 - i / 100 for i in range(50)]),
                                    lo, hi, "int8_narrow", "even", 20, 5, True, True, False)),
        # the importance-weighted searches (imatrix_mse): each term times its weight
        "nvfp4_mse_weighted": (ops.nvfp4_mse, (u, lo, hi, torch.tensor([1 - i / 100
                                                                         for i in range(50)]),
                                               lo, hi, torch.tensor([3.0]), "fp4_e2m1",
                                               2.0 ** -9, 20, 5, True, True, False, w)),
        "nvfp4_search_weighted": (ops.nvfp4_search, (u, lo, hi, torch.tensor([1 - i / 100
                                                                              for i in range(20)]),
                                                     lo, hi, torch.tensor([3.0]), "fp4_e2m1",
                                                     2.0 ** -9, w)),
        "mx_mse_weighted": (ops.mx_mse, (u, lo, hi, torch.tensor([1 - i / 100 for i in range(50)]),
                                         lo, hi, "int8_narrow", "even", 50, -1, False, False,
                                         False, w)),
    }

    def to(a):
        if isinstance(a, list):
            return [to(t) for t in a]
        return a.to(device) if isinstance(a, torch.Tensor) else a

    return {k: (op, tuple(to(a) for a in args)) for k, (op, args) in cases.items()}


@pytest.mark.parametrize("name", list(_cases()))
def test_opcheck(name):
    op, args = _cases()[name]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("name", [n for n in _cases() if n.endswith("qparams_strided")
                                  or n == "e8m0_block_scales_strided"])
def test_qparams_ops_give_contiguous_outputs_for_strided_ranges(name):
    """The Triton kernels write contiguous outputs: the CPU implementation and the fake give
    the same strides (else a compiled graph expects strides the GPU does not give)."""
    op, args = _cases()[name]
    assert not args[0].is_contiguous()
    assert all(t.is_contiguous() for t in _flat(op(*args)))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(_cases()))
def test_opcheck_cuda(name):
    op, args = _cases("cuda")[name]
    torch.library.opcheck(op, args)


def _flat(out) -> list:
    """An op's outputs as one list of tensors (grouped_unit_minmax returns lists)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [t for o in outs for t in (o if isinstance(o, list) else (o,))]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(_cases()))
def test_cuda_op_equals_cpu_op(name):
    """The Triton kernels (the CUDA implementations) give the CPU's bits; the float64 error
    sums (the same exact squares) agree up to their order of summation, a fractional
    power's up to the devices' powf (an ulp a term: 1.4e-7 of a sum on an H200)."""
    op, args = _cases()[name]
    cuda_args = _cases("cuda")[name][1]
    want, got = op(*args), op(*cuda_args)
    if want is None:  # an op that writes its first argument (hist_add's counts)
        want, got = args[0], cuda_args[0]
    for w, g in zip(_flat(want), _flat(got), strict=True):
        if w.dtype in (torch.int64, torch.bool):
            assert torch.equal(g.cpu(), w)
        elif w.dtype == torch.float64:
            rtol = 1e-6 if name == "mse_price_int_norm" else 1e-12  # its norm 2.4: powf
            torch.testing.assert_close(g.cpu(), w, rtol=rtol, atol=0)
        else:
            assert torch.equal(g.cpu().view(torch.int32), w.view(torch.int32))


def test_one_graph_under_compile():
    """Each op is one node to torch.compile: a full graph, the eager results."""
    op, args = _cases()["fake_quant_int"]
    fn = torch.compile(lambda *a: op(*a), backend="aot_eager", fullgraph=True)
    assert torch.equal(fn(*args), op(*args))


def _int64s(n):
    return (torch.zeros(3, dtype=torch.int64),) * n


@pytest.mark.parametrize(("call", "match"), [
    (lambda: ops.unit_minmax(torch.zeros(3)), r"units must be a \[units, elements\] or"),
    (lambda: ops.unit_minmax(torch.zeros(3, 4, dtype=torch.int32)), "of float32, bfloat16"),
    (lambda: ops.unit_minmax(torch.zeros(3, 0)), "at least one element"),
    (lambda: ops.grouped_unit_minmax([torch.zeros(3, 4), torch.zeros(2, 4).bfloat16()]),
     r"units\[1\] must be a 2-D tensor"),
    (lambda: ops.fake_quant_int(torch.zeros(3, 4), torch.ones(2), torch.zeros(3), -8.0, 7.0),
     "scale must be a float32 tensor of shape"),
    (lambda: ops.fake_quant_int(torch.zeros(3, 4), torch.ones(3), torch.zeros(3, 1), -8.0, 7.0),
     "zero_point must be"),
    (lambda: ops.fake_quant_int(torch.zeros(3, 4), torch.ones(3), torch.zeros(3), 7.0, -8.0),
     "qmin must be below qmax"),
    (lambda: ops.mse_price_int(torch.zeros(3, 4), torch.ones(2, 3), torch.zeros(2, 3), -8.0, 7.0),
     "zero_point must be a torch.int32"),
    (lambda: ops.mse_price_int(torch.zeros(3, 4), torch.ones(2, 4),
                               torch.zeros(2, 4, dtype=torch.int32), -8.0, 7.0),
     r"scale must be a torch.float32 \[candidates, 3\]"),
    (lambda: ops.mse_price_fp(torch.zeros(3, 4).double(), torch.ones(2, 3), 6.0, 0, 1),
     "mse_price_fp: units must be a 2-D float32"),
    (lambda: ops.mse_price_fp(torch.zeros(3, 4), torch.ones(2, 4), 6.0, 0, 1),
     r"mse_price_fp: scale must be a torch.float32 \[candidates, 3\] tensor on cpu, got"),
    (lambda: ops.mse_price_fp(torch.zeros(3, 4), torch.ones(2, 3), 0.0, 0, 1),
     "fmax must be the format's largest value"),
    (lambda: ops.mse_price_fp(torch.zeros(3, 4), torch.ones(2, 3), float("inf"), 0, 1),
     "fmax must be"),
    (lambda: ops.mse_price_fp(torch.zeros(3, 4), torch.ones(2, 3), 6.0, 0, 24), "mbits must be"),
    (lambda: ops.mse_price_fp(torch.zeros(3, 4), torch.ones(2, 3), 6.0, -130, 1),
     r"min_exp must be in \[mbits - 126, 127\]"),
    (lambda: ops.mse_price_fp(torch.zeros(3, 4), torch.ones(2, 3), 6.0, 0, 1, norm=0.0),
     r"mse_price_fp: norm must be a finite number in \(0.0, inf\), got 0.0"),
    (lambda: ops.mse_price_int(torch.zeros(3, 4), torch.ones(2, 3),
                               torch.zeros(2, 3, dtype=torch.int32), -8.0, 7.0,
                               norm=float("inf")), "mse_price_int: norm must be a finite number"),
    (lambda: ops.mse_select(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), 2, 1, True,
                            True, False), "same must be a bool tensor"),
    (lambda: ops.mse_select(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool),
                            torch.zeros(3), 5, 1, True, True, False), "ext_start must be in"),
    (lambda: hist_add(torch.zeros(3, 8), torch.zeros(3, 4), torch.zeros(3, dtype=torch.int64),
                      torch.zeros(3, dtype=torch.int64), False), "counts must be a contiguous"),
    (lambda: hist_add(torch.zeros(3, 8, dtype=torch.int64), torch.zeros(3, 4),
                      torch.zeros(3), torch.zeros(3, dtype=torch.int64), False),
     "exp must be an int64 tensor"),
    (lambda: hist_regrid_(torch.zeros(3, 8, dtype=torch.int64), *_int64s(2), torch.zeros(3),
                          torch.zeros(3), torch.zeros(3), torch.zeros(4), False),
     r"batch_hi must be a torch.float32 tensor of shape \(3,\)"),
    (lambda: hist_regrid_(torch.zeros(3, 8, dtype=torch.int64), *_int64s(2),
                          torch.zeros(3, dtype=torch.float64), torch.zeros(3), torch.zeros(3),
                          torch.zeros(3), False), "lo must be a torch.float32 tensor"),
    (lambda: hist_regrid_(torch.zeros(3, 8), *_int64s(2), *(torch.zeros(3),) * 4, True),
     "counts must be a contiguous int64"),
    (lambda: ops.e8m0_block_scales(torch.zeros(3), torch.zeros(4), "fp4_e2m1", "floor"),
     "lo and hi must be float32 tensors of one shape"),
    (lambda: ops.e8m0_block_scales(torch.zeros(3), torch.zeros(3), "fp4_e2m1", "round"),
     "mode must be one of"),
    (lambda: ops.nvfp4_qparams(torch.zeros(3), torch.zeros(3), torch.ones(2), "fp4_e2m1",
                               1e-8), "global_amax must be None or one float32 value"),
    (lambda: ops.nvfp4_qparams(torch.zeros(3), torch.zeros(3), None, "int4", 1e-8),
     "format must be a float format"),
    (lambda: ops.nvfp4_search(torch.zeros(3, 16).double(), *(torch.zeros(3),) * 2,
                              torch.ones(4), *(torch.zeros(3),) * 2, torch.ones(1), "fp4_e2m1",
                              0.1), "nvfp4_search: units must be a 2-D"),
    (lambda: ops.nvfp4_search(torch.zeros(3, 16), torch.zeros(3), torch.zeros(4), torch.ones(4),
                              *(torch.zeros(3),) * 2, torch.ones(1), "fp4_e2m1", 0.1),
     r"nvfp4_search: hi must be a float32 tensor of shape \(3,\)"),
    (lambda: ops.nvfp4_search(torch.zeros(3, 16), *(torch.zeros(3),) * 2, torch.ones(0),
                              *(torch.zeros(3),) * 2, torch.ones(1), "fp4_e2m1", 0.1),
     "factors must be a non-empty 1-D float32"),
    (lambda: ops.nvfp4_search(torch.zeros(3, 16), *(torch.zeros(3),) * 2, torch.ones(4),
                              *(torch.zeros(3),) * 2, torch.ones(2), "fp4_e2m1", 0.1),
     "global_amax must be one float32 value"),
    (lambda: ops.nvfp4_search(torch.zeros(3, 16), *(torch.zeros(3),) * 2, torch.ones(4),
                              *(torch.zeros(3),) * 2, torch.ones(1), "int4", 0.1),
     "nvfp4_search: format must be a float format"),
    (lambda: ao_histc(torch.zeros(3, 16).double(), 8, 0.0, 1.0),
     "ao_histc: x must be a float32, bfloat16 or float16 tensor"),
    (lambda: ao_histc(torch.zeros(3, 16), 0, 0.0, 1.0), "ao_histc: bins must be a positive"),
    (lambda: ops.nvfp4_mse(torch.zeros(3, 16), *(torch.zeros(3),) * 2, torch.ones(4, 1),
                           *(torch.zeros(3),) * 2, torch.ones(1), "fp4_e2m1", 0.1, 4, 5, True,
                           True, False), "nvfp4_mse: factors must be a non-empty 1-D float32"),
    (lambda: ops.nvfp4_mse(torch.zeros(3, 16), *(torch.zeros(3),) * 2, torch.ones(4),
                           *(torch.zeros(3),) * 2, torch.ones(1), "fp4_e2m1", 0.1, 5, 5, True,
                           True, False), r"nvfp4_mse: ext_start must be in \[0, 4\], got 5"),
    (lambda: ops.mx_mse(torch.zeros(3, 16), *(torch.zeros(3),) * 2, torch.ones(4),
                        *(torch.zeros(3),) * 2, "fp4_e2m1", "round", 4, 5, True, True, False),
     "mx_mse: mode must be one of"),
    (lambda: ops.mx_mse(torch.zeros(3, 16), *(torch.zeros(3),) * 2, torch.ones(4),
                        *(torch.zeros(3),) * 2, "uint8", "floor", 4, 5, True, True, False),
     "mx_mse: format must be a float or a signed integer format"),
    (lambda: ops.mx_mse(torch.zeros(3, 16), torch.zeros(2), torch.zeros(3), torch.ones(4),
                        *(torch.zeros(3),) * 2, "fp4_e2m1", "floor", 4, 5, True, True, False),
     r"mx_mse: lo must be a float32 tensor of shape \(3,\)"),
    (lambda: ops.mx_mse(torch.zeros(3, 16), *(torch.zeros(3),) * 2, torch.ones(4),
                        *(torch.zeros(3),) * 2, "fp4_e2m1", "floor", 7, 5, True, True, False),
     r"mx_mse: ext_start must be in \[0, 4\], got 7"),
    (lambda: ops.nvfp4_search(torch.zeros(3, 16), *(torch.zeros(3),) * 2, torch.ones(4),
                              *(torch.zeros(3),) * 2, torch.ones(1), "fp4_e2m1", 0.1,
                              torch.ones(3, 8)),
     r"nvfp4_search: weights must be None or a float32 \(3, 16\) tensor"),
    (lambda: ops.mx_mse(torch.zeros(3, 16), *(torch.zeros(3),) * 2, torch.ones(4),
                        *(torch.zeros(3),) * 2, "fp4_e2m1", "floor", 4, 5, True, True, False,
                        torch.ones(3, 16).double()),
     r"mx_mse: weights must be None or a float32 \(3, 16\) tensor"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_bad_format_is_refused_on_the_meta_device_too():
    # probing: e8m0_block_scales checked its format on the CPU only; meta / fake accepted it
    for dev in ("cpu", "meta"):
        with pytest.raises(ValueError, match="format: unknown name 'nonsense'"):
            ops.e8m0_block_scales(torch.zeros(3, device=dev), torch.zeros(3, device=dev),
                                  "nonsense", "floor")


FP_FORMATS = ["fp4_e2m1", "fp6_e3m2", "fp6_e2m3", "fp8_e4m3", "fp8_e5m2"]


def _fp_case(name: str, device="cpu"):
    """Units with NaN / inf / zero / huge elements and NVFP4-like candidate scales (e4m3
    block scales over a global scale): the op's arguments for format ``name``."""
    from quantscope.formats import FP8_E4M3, get_format

    fmt = get_format(name)
    g = torch.Generator().manual_seed(len(name))
    u = torch.randn(7, 48, generator=g) * torch.exp2(torch.randint(-6, 7, (7, 1), generator=g))
    amax = u.abs().amax(1)
    u[0, 3], u[1, :2], u[2] = float("nan"), torch.tensor([float("inf"), 3e38]), 0.0
    gs = FP8_E4M3.max * fmt.max / amax.max()
    f = torch.linspace(1.0, 0.8, 5)[:, None]
    scale = FP8_E4M3.round(amax[None] * f / fmt.max * gs).clamp(min=2.0 ** -9) / gs
    return u.to(device), scale.to(device), fmt.max, fmt.min_exp, fmt.mbits


@pytest.mark.parametrize("name", FP_FORMATS)
def test_mse_price_fp_cpu_is_the_c_kernel(name):
    """On the CPU the op is the C kernel (``estimators.mse_kernel.price``, bit for bit) where
    it is built; its torch path (units not contiguous) sums the same exact squares in
    another order: they agree to 1e-12 (NaN and inf alike)."""
    from quantscope import kernels
    from quantscope.estimators import mse_kernel

    u, scale, *fmt = _fp_case(name)
    got = ops.mse_price_fp(u, scale, *fmt)
    strided = torch.empty(u.shape[1], u.shape[0]).t().copy_(u)  # the torch path
    torch_path = ops.mse_price_fp(strided, scale, *fmt)
    assert got.dtype == torch.float64 and got.shape == scale.shape
    if not kernels.available("mse_search"):
        pytest.skip("the C kernels are not built here")
    want = mse_kernel.price(u, scale, torch.zeros(1, 1), QuantSpec(name))
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    torch.testing.assert_close(torch_path, got, rtol=1e-12, atol=0, equal_nan=True)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", FP_FORMATS)
def test_mse_price_fp_cuda_equals_cpu(name):
    """The Triton kernel (CUDA) against the CPU op: the same terms summed in another order
    (1e-12), NaN and inf where the CPU has them."""
    u, scale, *fmt = _fp_case(name)
    want = ops.mse_price_fp(u, scale, *fmt)
    got = ops.mse_price_fp(u.cuda(), scale.cuda(), *fmt)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=0, equal_nan=True)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("norm", [2.4, 1.5, 0.5, 3.0])
def test_mse_price_norms_cuda_are_torchs_cuda_pow(norm):
    """llm-compressor's error ``|d| ** norm`` priced on CUDA against torch's CUDA
    ``d.abs().pow(norm)`` summed in float64: 0.5 (sqrtf) and 3 up to the order of the sums
    (1e-12); 1.5 and 2.4 (libdevice's powf without flush-to-zero) up to an ulp a term, as
    the lent H200 measured (Triton 3.6, torch 2.11: 5.9e-8 of a sum), where the kernel's
    terms had been expected to be torch's own."""
    from quantscope.kernels.triton._jit import LAUNCH

    if norm not in (0.5, 3.0) and "enable_reflect_ftz" not in LAUNCH:
        pytest.skip("this Triton cannot compile libdevice without flush-to-zero")
    u, scale, *fmt = _fp_case("fp4_e2m1")
    u = u.nan_to_num(0.0, 0.0, 0.0)
    got = ops.mse_price_fp(u.cuda(), scale.cuda(), *fmt, norm=norm)
    want = torch.stack([
        (fake_quantize_units(u.cuda(), s.cuda()[:, None], torch.zeros(1, 1, device="cuda"),
                             QuantSpec("fp4_e2m1")) - u.cuda()).abs().pow(norm).double().sum(1)
        for s in scale])
    torch.testing.assert_close(got, want, rtol=1e-12 if norm in (0.5, 3.0) else 1e-6, atol=0)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_ops_replay_in_a_cuda_graph():
    """Min-max and MXFP4 scales of a weight captured once in a CUDA graph and replayed on new
    data: no host read inside, the eager results."""
    w = torch.randn(256, 512, device="cuda")

    def qparams():
        lo, hi = ops.unit_minmax(w.view(-1, 32))
        return ops.e8m0_block_scales(lo, hi, "fp4_e2m1", "even")

    qparams()  # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qparams()
    w.copy_(torch.randn_like(w) * 3)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, qparams())


@pytest.mark.parametrize("absolute", [False, True])
def test_hist_regrid_cpu_is_update_grid(absolute):
    """On the CPU the op is ``_update_grid`` (through the C kernel where it is built), in
    the state's own tensors."""
    g = torch.Generator().manual_seed(5)
    lo, hi = torch.aminmax(torch.randn(4, 30, generator=g) * 7, dim=1)
    state = _hist_state(lo, hi, g)
    before = [t.clone() for t in state]
    want = H._update_grid(state, lo, hi, absolute)
    held = [t.data_ptr() for t in state]
    assert hist_regrid_(*state, lo, hi, absolute) is None
    for a, b in zip(state, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert [t.data_ptr() for t in state] == held
    assert not torch.equal(before[0], state.counts)  # the grid did change


@pytest.mark.parametrize("absolute", [False, True])
def test_hist_regrid_cpu_without_the_c_kernel_writes_the_states_own_tensors(monkeypatch,
                                                                             absolute):
    """Where the C kernel is not built (or declines: NaN / inf), the torch grid change's
    fresh tensors are copied into the state's own: the op returns nothing."""
    from quantscope.stats import hist_kernel

    monkeypatch.setattr(hist_kernel, "_kernel", lambda: None)
    g = torch.Generator().manual_seed(5)
    lo, hi = torch.aminmax(torch.randn(4, 30, generator=g) * 7, dim=1)
    state = _hist_state(lo, hi, g)
    want = H._update_grid(state, lo, hi, absolute)
    assert not torch.equal(want.counts, state.counts)  # the grid moves
    assert hist_regrid_(*state, lo, hi, absolute) is None
    for a, b in zip(state, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_hist_regrid_triton_takes_a_strided_state_through_the_torch_path(device):
    """The Triton kernel reads and writes ``exp``, ``first``, ``lo``, ``hi`` through their
    pointers as contiguous ``[U]``: a strided one (a column of a wider tensor) is updated by
    the torch path instead, in place, as ``_update_grid``."""
    from quantscope.stats import hist_ops

    g = torch.Generator().manual_seed(7)
    lo, hi = torch.aminmax(torch.randn(4, 30, generator=g) * 7, dim=1)
    state = _hist_state(lo, hi, g)
    want = H._update_grid(state, lo, hi, False)
    wide = [torch.stack([t, -t], -1).to(device) for t in state[1:]]  # [U, 2]: stride 2
    got = [state.counts.to(device, copy=True), *(w[:, 0] for w in wide)]
    assert not any(t.is_contiguous() for t in got[1:])  # the case
    hist_ops._cuda_hist_regrid_(*got, lo.to(device), hi.to(device), False)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.cpu(), b)
    assert all(torch.equal(w[:, 1].cpu(), -t) for w, t in zip(wide, state[1:]))  # untouched
