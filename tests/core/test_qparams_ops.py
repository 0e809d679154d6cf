"""Off the CPU the integer (fp32 scales), MX and NVFP4 qparams come from the ops
(``quantscope::int_qparams``, ``quantscope::e8m0_block_scales``,
``quantscope::nvfp4_qparams``: Triton on CUDA), bitwise the torch branch of
``qparams_from_range``. The ops' CPU implementations stand in for the device here (the Triton
kernels are held to them under the interpreter in tests/kernels/test_triton_kernels.py); the
meta device proves the dispatch."""

from __future__ import annotations

import pytest
import torch
from op_names import OpNames

from quantscope import QuantSpec, presets, qparams
from quantscope.layout import Block, Channel, Group

SPECS = {
    "mxfp4": presets.MXFP4,
    "mxfp6-e3m2": presets.MXFP6_E3M2,
    "mxfp8": presets.MXFP8,
    "mxfp4-even": QuantSpec("fp4_e2m1", Block(32), scale="e8m0:even"),
    "nvfp4": presets.NVFP4,
    "mxint8": presets.MXINT8,
    "bfp16": presets.BFP16,
    "nvfp4-e3m2": QuantSpec("fp6_e3m2", Block(16), scale="fp8_e4m3"),
}


def _ranges(n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo = -torch.rand(n, generator=g) * 2.0 ** torch.randint(-30, 30, (n,), generator=g)
    hi = torch.rand(n, generator=g) * 2.0 ** torch.randint(-30, 30, (n,), generator=g)
    lo[:4], hi[:4] = 0.0, 0.0  # empty blocks: the min scale
    lo[4], hi[4] = -1e-40, 1e-40  # subnormal
    hi[5] = 448.0 * 6 * 2 ** 20  # past the fp8 block range
    return lo, hi


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("given_amax", [False, True])
def test_op_branch_is_the_torch_branch(name, given_amax):
    spec = SPECS[name]
    lo, hi = _ranges()
    ga = torch.tensor(3.5e6) if given_amax else None
    ours = qparams._block_qparams_op(lo, hi, spec, ga)
    ref = qparams._block_qparams(qparams.amax_of_range(lo.clamp(max=0), hi.clamp(min=0)), spec,
                                 ga)
    assert torch.equal(ours.scale, ref.scale)
    assert torch.equal(ours.zero_point, ref.zero_point)
    assert (ours.global_scale is None) == (ref.global_scale is None)
    if ref.global_scale is not None:
        assert torch.equal(ours.global_scale, ref.global_scale)


@pytest.mark.parametrize("name, op", [("mxfp4", "quantscope.e8m0_block_scales"),
                                      ("bfp16", "quantscope.e8m0_block_scales"),
                                      ("nvfp4", "quantscope.nvfp4_qparams")])
@pytest.mark.parametrize("given_amax", [False, True])
def test_off_the_cpu_qparams_call_the_op(name, op, given_amax):
    """One op and the zero points' zeros: NVFP4's global scale too is found on the device
    (the torch ops for it were sixteen)."""
    lo, hi = (t.to("meta") for t in _ranges())
    ga = torch.ones((), device="meta") if given_amax else None
    with OpNames() as seen:
        qp = qparams.qparams_from_range(lo, hi, SPECS[name], global_amax=ga, check_finite=False)
    assert [n for n in seen.names if n.startswith("quantscope.")] == [op]
    assert sum(seen.calls.values()) <= 3, seen.calls
    assert qp.scale.shape == lo.shape and qp.scale.device.type == "meta"


@pytest.mark.parametrize("scale", ["bf16", "pow2"])
def test_integer_formats_with_other_scales_keep_the_torch_branch_off_the_cpu(scale):
    lo, hi = (t.to("meta") for t in _ranges())
    with OpNames() as seen:
        qparams.qparams_from_range(lo, hi, QuantSpec("int8", scale=scale), check_finite=False)
    assert not any(n.startswith("quantscope.") for n in seen.names)


INT_SPECS = {"int8": QuantSpec("int8"), "int8-asym": QuantSpec("int8", symmetric=False),
             "uint8": QuantSpec("uint8"), "uint4-asym": QuantSpec("uint4", symmetric=False),
             "int16-eps": QuantSpec("int16", eps=1e-2),
             "int8-reduced": QuantSpec("int8", symmetric=False, quant_min=-64, quant_max=63)}


@pytest.mark.parametrize("name", list(INT_SPECS))
def test_int_op_branch_is_the_torch_branch(name):
    """``quantscope::int_qparams`` (its CPU implementation standing in for the device's) gives
    ``qparams_from_range``'s integer branch bit for bit."""
    spec = INT_SPECS[name]
    lo, hi = _ranges(seed=len(name))
    lo[10], hi[11] = 0.5, -0.5  # ranges on one side of zero
    ours = qparams._int_qparams_op(lo, hi, spec)
    ref = qparams._scale_qparams(lo.clamp(max=0), hi.clamp(min=0), spec)
    assert torch.equal(ours.scale, ref.scale)
    assert torch.equal(ours.zero_point, ref.zero_point)
    assert ours.global_scale is None


@pytest.mark.parametrize("spec", [QuantSpec("int8", scale="bf16"), presets.MXFP4,
                                  QuantSpec("fp6_e2m3")], ids=str)
def test_int_op_is_for_fp32_scales_of_whole_codes(spec):
    """Integer formats and float formats of a whole max (fp8: tests/kernels/
    test_float_affine_qparams.py); not other encodings, block scales, nor e2m3's 7.5."""
    lo, hi = _ranges(8)
    assert qparams._int_qparams_op(lo, hi, spec) is None


@pytest.mark.parametrize("spec", [QuantSpec("int8", Channel(0)),
                                  QuantSpec("int4", Group(128), symmetric=False)], ids=str)
def test_off_the_cpu_integer_qparams_are_one_op(spec):
    lo, hi = (t.to("meta") for t in _ranges())
    with OpNames() as seen:
        qp = qparams.qparams_from_range(lo, hi, spec, check_finite=False)
    assert [n for n in seen.names if n.startswith("quantscope.")] == ["quantscope.int_qparams"]
    assert sum(seen.calls.values()) <= 2, seen.calls  # the op (and a float32 view): was 9
    assert qp.scale.dtype == torch.float32 and qp.zero_point.dtype == torch.int32


def test_int_op_names_bad_arguments():
    lo, hi = _ranges(8)
    with pytest.raises(ValueError, match="consts must be"):
        qparams.int_qparams_op(lo, hi, [1.0, 0.0, 1e-8, 0.0, 0.0])
    with pytest.raises(ValueError, match="lo and hi"):
        qparams.int_qparams_op(lo, hi[:4], [-8.0, 7.0, 1e-8, 0.0, 0.0])


def test_c_kernel_paths_under_torch_compile_equal_eager():
    """A ctypes kernel takes raw pointers: under torch.compile, Dynamo freed a tensor made
    in the traced region and passed only as ``data_ptr()`` (the kernel's constants) before
    the call after its graph break ran, so every int8 channel scale came out eps. While
    tracing, quantscope.kernels.lib gives None: the traced torch path, bitwise the same."""
    spec = QuantSpec("int8", "channel")
    g = torch.Generator().manual_seed(0)
    lo0, hi0 = -torch.rand(64, generator=g) * 3, torch.rand(64, generator=g) * 3
    f = torch.tensor([1.0, 0.9, 0.8, 0.7])

    def scales(lo0, hi0, f):
        qp = qparams.qparams_from_range(lo0[None] * f[:, None], hi0[None] * f[:, None], spec,
                                        check_finite=False)
        return qp.scale, qp.zero_point

    want = scales(lo0, hi0, f)
    got = torch.compile(scales, backend="inductor")(lo0, hi0, f)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
