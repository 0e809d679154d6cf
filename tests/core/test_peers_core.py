"""Differential tests of the core against the installed peers.

* compressed-tensors 0.20 ``calculate_qparams`` / ``generate_gparam`` / ``fake_quantize``:
  bitwise for int (tensor, channel, group, block, token), fp8, fp6 e2m3, fp4 and NVFP4 (the
  operation order is the same: ``scale / global_scale`` first, then ``x / scale``).
* torch.ao ``_calculate_qparams`` (torch 2.13): bitwise scales; zero points equal wherever
  the two formulas must agree (see ``test_torch_ao_qparams``).
* torchao 0.18 ``to_mx``: E8M0 scales in all four modes and the dequantized values.
"""

import math
import warnings

import pytest
import torch

from quantscope import QParams, QuantSpec, fake_quantize, presets, qparams_from_range
from quantscope.layout import Block, Channel, Group, Tensor, Tile, Token

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam


def observe(x, spec):
    u = spec.layout.to_units(x.float())
    return qparams_from_range(u.min(1).values, u.max(1).values, spec).reshape(
        spec.layout.qparam_shape(x.shape))


def weights(shape, seed=0):
    """Gaussian rows of different magnitudes with a few outliers: realistic weight ranges."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x = x * torch.exp2(torch.randint(-4, 4, (*shape[:-1], 1), generator=g).float())
    x.view(-1)[:: 251] *= 12
    return x


def ct_range(x, args):
    """Per-unit (min, max) in compressed-tensors' own reshapes (peers.md, ct_example.py)."""
    s = args.strategy
    if s == "tensor":
        return x.min(), x.max()
    if s == "channel":
        return x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    if s == "token":
        return x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    if s in ("group", "tensor_group"):
        g = x.unflatten(-1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    bh, bw = args.block_structure
    r, c = x.shape
    p = torch.nn.functional.pad(x, (0, -c % bw, 0, -r % bh))
    b = p.reshape(p.shape[0] // bh, bh, p.shape[1] // bw, bw).transpose(1, 2)
    return b.amin((-1, -2)), b.amax((-1, -2))


CT_CASES = [
    ("int8 tensor sym", {"num_bits": 8, "strategy": "tensor"}, QuantSpec("int8", Tensor())),
    ("int8 tensor asym", {"num_bits": 8, "strategy": "tensor", "symmetric": False},
     QuantSpec("int8", Tensor(), symmetric=False)),
    ("int8 channel", {"num_bits": 8, "strategy": "channel"}, presets.INT8_PER_CHANNEL),
    ("int8 channel asym", {"num_bits": 8, "strategy": "channel", "symmetric": False},
     QuantSpec("int8", Channel(0), symmetric=False)),
    ("int4 group128", {"num_bits": 4, "strategy": "group", "group_size": 128}, presets.INT4_GROUP128),
    ("int4 group128 asym", {"num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": False},
     presets.INT4_GROUP128_ASYM),
    ("int2 group32 asym", {"num_bits": 2, "strategy": "group", "group_size": 32, "symmetric": False},
     QuantSpec("int2", Group(32), symmetric=False)),
    ("int8 block 128x128 (padded)", {"num_bits": 8, "strategy": "block", "block_structure": [128, 128]},
     QuantSpec("int8", Tile(128, 128))),
    ("fp8 tensor", {"num_bits": 8, "type": "float", "strategy": "tensor"}, presets.FP8_PER_TENSOR),
    ("fp8 channel", {"num_bits": 8, "type": "float", "strategy": "channel"}, presets.FP8_PER_CHANNEL),
    ("fp8 block 64x32 (padded)", {"num_bits": 8, "type": "float", "strategy": "block",
                                      "block_structure": [64, 32]}, QuantSpec("fp8", Tile(64, 32))),
    ("fp8 group", {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 64},
     QuantSpec("fp8", Group(64))),
    ("fp6 e2m3 group", {"num_bits": 6, "type": "float", "strategy": "group", "group_size": 32},
     QuantSpec("fp6_e2m3", Group(32))),
    ("fp4 group", {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16},
     QuantSpec("fp4", Group(16))),
    # compressed-tensors' MX scales round amax to the FP4 mantissa first: our E8M0 'even' mode
    ("mxfp4 (CT)", {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                        "scale_dtype": torch.uint8}, QuantSpec("fp4", Block(32), scale="e8m0:even")),
]


def _ct_version() -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int(p) for p in version("compressed-tensors").split(".")[:2])


@pytest.mark.parametrize("name,kwargs,spec", CT_CASES, ids=[c[0] for c in CT_CASES])
def test_compressed_tensors_qparams_and_fake_quantize(name, kwargs, spec):
    if name.startswith("fp6") and _ct_version() < (0, 20):
        pytest.skip("compressed-tensors 0.19 (the oldest supported) has no fp6")
    args = QuantizationArgs(**kwargs)
    x = weights((200, 384) if args.strategy == "block" else (64, 512))
    ct_scale, ct_zp = calculate_qparams(*ct_range(x, args), args)
    q = observe(x, spec)
    assert torch.equal(q.scale, ct_scale.reshape(q.scale.shape).float())
    assert torch.equal(q.zero_point, ct_zp.reshape(q.zero_point.shape).int())
    out = ct_fake_quantize(x, ct_scale, ct_zp, args)
    assert torch.equal(fake_quantize(x, q, spec), out)


def test_compressed_tensors_token():
    args = QuantizationArgs(num_bits=8, strategy="token", dynamic=True, symmetric=False)
    spec = QuantSpec("int8", Token(), symmetric=False)
    x = weights((4, 32, 256), seed=1)
    ct_scale, ct_zp = calculate_qparams(*ct_range(x, args), args)
    q = observe(x, spec)
    assert q.scale.shape == ct_scale.shape == (4, 32, 1)
    assert torch.equal(q.scale, ct_scale) and torch.equal(q.zero_point, ct_zp.int())
    assert torch.equal(fake_quantize(x, q, spec), ct_fake_quantize(x, ct_scale, ct_zp, args))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compressed_tensors_nvfp4(seed):
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                            scale_dtype=torch.float8_e4m3fn)
    x = weights((64, 512), seed)
    x[3, :16] = 0  # an all-zero block: CT replaces the zero scale by 0.125, as we do
    gs = generate_gparam(x.min(), x.max())
    ct_scale, ct_zp = calculate_qparams(*ct_range(x, args), args, global_scale=gs)
    q = observe(x, presets.NVFP4)
    assert torch.equal(q.global_scale, gs)
    assert torch.equal(q.scale, ct_scale)
    assert (ct_zp.float() == 0).all() and (q.zero_point == 0).all()
    out = ct_fake_quantize(x, ct_scale, ct_zp, args, global_scale=gs)
    assert torch.equal(fake_quantize(x, q, presets.NVFP4), out)
    # the tensors as a compressed-tensors checkpoint stores them: float8 scales and zero points
    e4m3 = torch.float8_e4m3fn
    stored = QParams(ct_scale.to(e4m3), ct_zp.to(e4m3), gs)
    assert torch.equal(fake_quantize(x, stored, presets.NVFP4), out)


def test_group_gidx_against_compressed_tensors_on_permuted_columns():
    """compressed-tensors 0.19/0.20 dropped g_idx from fake_quantize (peers.md #1); its former
    semantics, and GPTQ's, are: permute columns by argsort(g_idx), group, permute back."""
    x = weights((32, 256), seed=3)
    g = torch.Generator().manual_seed(4)
    g_idx = torch.randperm(256, generator=g) // 64
    perm = torch.argsort(g_idx, stable=True)
    args = QuantizationArgs(num_bits=4, strategy="group", group_size=64, symmetric=False)
    xp = x[:, perm]
    ct_scale, ct_zp = calculate_qparams(*ct_range(xp, args), args)
    expect = torch.empty_like(x)
    expect[:, perm] = ct_fake_quantize(xp, ct_scale, ct_zp, args)
    spec = QuantSpec("int4", Group(64, g_idx=g_idx), symmetric=False)
    q = observe(x, spec)
    assert torch.equal(q.scale, ct_scale) and torch.equal(q.zero_point, ct_zp.int())
    assert torch.equal(fake_quantize(x, q, spec), expect)


# torch.ao --------------------------------------------------------------------------------------

def _ao_observer(dtype, qscheme, **kw):
    from torch.ao.quantization.observer import PerChannelMinMaxObserver
    return PerChannelMinMaxObserver(ch_axis=0, dtype=dtype, qscheme=qscheme, **kw)


AO_CASES = [
    ("qint8 sym", torch.qint8, torch.per_channel_symmetric, {}, QuantSpec("int8")),
    ("qint8 affine", torch.qint8, torch.per_channel_affine, {},
     QuantSpec("int8", symmetric=False)),
    ("quint8 sym", torch.quint8, torch.per_channel_symmetric, {}, QuantSpec("uint8")),
    ("quint8 affine", torch.quint8, torch.per_channel_affine, {},
     QuantSpec("uint8", symmetric=False)),
    ("qint8 reduce_range sym", torch.qint8, torch.per_channel_symmetric, {"reduce_range": True},
     QuantSpec("int8", quant_min=-64, quant_max=63)),
    ("qint8 reduce_range affine", torch.qint8, torch.per_channel_affine, {"reduce_range": True},
     QuantSpec("int8", symmetric=False, quant_min=-64, quant_max=63)),
    ("quint8 reduce_range affine", torch.quint8, torch.per_channel_affine, {"reduce_range": True},
     QuantSpec("uint8", symmetric=False, quant_min=0, quant_max=127)),
    ("qint8 [-127,127] affine (odd qmin)", torch.qint8, torch.per_channel_affine,
     {"quant_min": -127, "quant_max": 127}, QuantSpec("int8_narrow", symmetric=False)),
]


@pytest.mark.parametrize("name,dtype,qscheme,kw,spec", AO_CASES, ids=[c[0] for c in AO_CASES])
def test_torch_ao_qparams(name, dtype, qscheme, kw, spec):
    g = torch.Generator().manual_seed(5)
    n = 4000
    lo = -torch.rand(n, generator=g) * torch.exp2(torch.randint(-8, 8, (n,), generator=g).float())
    hi = torch.rand(n, generator=g) * torch.exp2(torch.randint(-8, 8, (n,), generator=g).float())
    # exact ties: scale 2**-8 and lo / scale = -(k + 1/2); then degenerate ranges
    span = (spec.qmax - spec.qmin) * 2.0**-8
    lo[:4] = -torch.tensor([0.5, 1.5, 2.5, 3.5]) * 2.0**-8
    hi[:4] = lo[:4] + span
    lo[4:8] = torch.tensor([0.0, 0.0, -1e-9, 3.0])
    hi[4:8] = torch.tensor([0.0, 1e-9, 0.0, 5.0])
    obs = _ao_observer(dtype, qscheme, **kw)
    ao_scale, ao_zp = obs._calculate_qparams(lo, hi)
    q = qparams_from_range(lo, hi, spec)
    assert (obs.quant_min, obs.quant_max) == (spec.qmin, spec.qmax)
    assert torch.equal(q.scale, ao_scale)
    if spec.symmetric:
        assert torch.equal(q.zero_point.long(), ao_zp.long())
        return
    # torch.ao computes qmin - round(lo / scale), we (and compressed-tensors) round(qmin - lo / s).
    # Equal, except (a) lo / s a tie k + 1/2 with odd qmin (half-to-even rounds the two to
    # different neighbours) and (b) lo / s within float32 rounding of a tie, where the
    # subtraction qmin - lo / s itself rounds onto the tie. Elsewhere they must agree.
    assert torch.equal(q.scale[:4], torch.full((4,), 2.0**-8))
    t = (lo.clamp(max=0) / q.scale).double()
    near_tie = (t - t.floor() - 0.5).abs() < 1e-4
    diff = q.zero_point.long() - ao_zp.long()
    assert (diff[~near_tie] == 0).all() and (diff.abs() <= 1).all()
    assert near_tie[8:].float().mean() < 1e-3  # the exception is rare on random ranges
    if spec.qmin % 2:
        assert (diff[:4] != 0).all()  # exact ties: one neighbour each
    else:
        assert (diff[:4] == 0).all()


# torchao MX ------------------------------------------------------------------------------------

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor, get_fp_scale, to_mx
    except ImportError:  # pragma: no cover
        to_mx = None

needs_torchao = pytest.mark.skipif(to_mx is None, reason="torchao not installed")
MX_ELEMS = [(torch.float8_e4m3fn, "fp8_e4m3"), (torch.float8_e5m2, "fp8_e5m2"),
            ("fp6_e2m3", "fp6_e2m3"), ("fp6_e3m2", "fp6_e3m2"), (torch.float4_e2m1fn_x2, "fp4")]


def mx_input(seed):
    """Blocks of widely different magnitudes, block maxima on and around powers of two,
    at the element max and its rounding thresholds, and an all-zero block."""
    x = weights((32, 512), seed)
    x = x * torch.exp2(torch.randint(-30, 30, (32, 16, 1)).float()).reshape(32, 16, 1).expand(
        32, 16, 32).reshape(32, 512)
    specials = torch.tensor([1.0, 2.0, 1.75, 1.875, 1.9375, 1.99, 448.0, 464.0, 6.0, 7.0, 7.5,
                             7.75, 28.0, 30.0, 57344.0, 3.0])
    x[:16, 0::32] = specials[:, None].expand(16, 16).T * torch.exp2(torch.arange(-8.0, 8.0))[:, None]
    x[20, 32:64] = 0
    return x.contiguous()


@needs_torchao
@pytest.mark.parametrize("mode", ["floor", "ceil", "even", "rceil"])
@pytest.mark.parametrize("elem,fmt", MX_ELEMS, ids=[f for _, f in MX_ELEMS])
def test_torchao_e8m0_scales(elem, fmt, mode):
    x = mx_input(6)
    spec = QuantSpec(fmt, Block(32), scale=f"e8m0:{mode}")
    q = observe(x, spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scale_e8m0, _ = to_mx(x, elem, 32, scaling_mode=ScaleCalculationMode(mode))
    ao = get_fp_scale(scale_e8m0)
    if mode != "rceil":
        assert torch.equal(q.scale, ao)
    else:
        # torchao's eager RCEIL takes ceil(torch.log2(amax / max)) in float32: where amax / max
        # lies within a float32 log2 rounding of a power of two from above it comes out one
        # binade low (and the block then saturates). We take the exact ceil; elsewhere equal.
        amax = spec.layout.to_units(x).abs().amax(1).reshape(q.scale.shape)
        ratio = amax / spec.format.max
        off = q.scale != ao
        assert (q.scale[off] == 2 * ao[off]).all()
        assert (ratio[off] / ao[off] <= 1 + 2**-16).all()
        assert (ratio <= q.scale).all()  # ours never saturates
        assert off.float().mean() < 0.01


@needs_torchao
@pytest.mark.parametrize("elem,fmt", MX_ELEMS, ids=[f for _, f in MX_ELEMS])
@pytest.mark.parametrize("mode", ["floor", "even"])
def test_torchao_mx_dequantized_values(elem, fmt, mode):
    x = mx_input(7)
    spec = QuantSpec(fmt, Block(32), scale=f"e8m0:{mode}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mx = MXTensor.to_mx(x, elem, block_size=32, scaling_mode=ScaleCalculationMode(mode))
        ref = mx.dequantize(torch.float32)
    assert torch.equal(fake_quantize(x, observe(x, spec), spec), ref)


@needs_torchao
def test_torchao_floor_presets_are_ocp_mx():
    """presets.MXFP8 / MXFP4 are torchao's default (FLOOR) MX, scale and values."""
    x = mx_input(8)
    for spec, elem in ((presets.MXFP8, torch.float8_e4m3fn), (presets.MXFP4, torch.float4_e2m1fn_x2)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mx = MXTensor.to_mx(x, elem, block_size=32)
            ref = mx.dequantize(torch.float32)
        q = observe(x, spec)
        assert torch.equal(q.scale, get_fp_scale(mx.scale))
        assert torch.equal(fake_quantize(x, q, spec), ref)


@needs_torchao
def test_torchao_rceil_rounds_log2_in_float32():
    """amax / max just above a power of two: torchao's float32 log2 rounds down onto the power
    (so its scale is one binade low and the block saturates); ours is the exact ceil. So does
    its float32 quotient where it is subnormal (just above 2 ** -127: scale byte 0x00 for our
    0x01)."""
    x = torch.zeros(3, 32)
    x[:, 0] = torch.tensor([448 * 2.0**-10 * (1 + 2.0**-23), 448.0, 448 * 2.0**-127])
    x[2, 0] = torch.nextafter(x[2, 0], torch.tensor(1.0))
    spec = QuantSpec("fp8_e4m3", Block(32), scale="e8m0:rceil")
    q = observe(x, spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s, _ = to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL)
    assert q.scale.flatten().tolist() == [2.0**-9, 1.0, 2.0**-126]
    assert get_fp_scale(s).flatten().tolist() == [2.0**-10, 1.0, 2.0**-127]


@needs_torchao
@pytest.mark.parametrize("mode", ["floor", "ceil", "even", "rceil"])
def test_torchao_e8m0_scales_of_subnormal_blocks(mode):
    """Blocks whose amax is a few float32 subnormals: every mode gives E8M0's least scale
    ``2 ** -127``, as torchao. For rceil ``amax / max`` underflows to 0 (log2 -inf); frexp's
    exponent of 0 would make it ``2 ** 0``, a wrong scale found by the MX search's tests."""
    x = torch.zeros(4, 32)
    x[:, 0] = torch.tensor([1.4e-45, -2.8e-45, 1e-40, 1.2e-38])
    spec = QuantSpec("fp4_e2m1", Block(32), scale=f"e8m0:{mode}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s, _ = to_mx(x, torch.float4_e2m1fn_x2, 32, scaling_mode=ScaleCalculationMode(mode))
    ao = get_fp_scale(s).flatten()
    assert torch.equal(observe(x, spec).scale.flatten(), ao)
    if mode == "rceil":
        assert ao[:2].tolist() == [2.0 ** -127] * 2


@needs_torchao
@pytest.mark.parametrize("mode", ["floor", "ceil", "even", "rceil"])
def test_torchao_e8m0_scales_of_non_finite_blocks(mode):
    """A block holding inf gets torchao's scale (inf read through its exponent field: the
    scale saturates high), one holding NaN a NaN scale (E8M0's 0xFF); ``torch.frexp(inf)``'s
    exponent 0 made the first ``2 ** (-1 - emax)``. Reached with ``check_finite=False`` (the
    searches' candidates past float32's max)."""
    x = torch.zeros(3, 32)
    x[:, 0] = torch.tensor([math.inf, -math.inf, math.nan])
    x[2, 1] = 1.0
    spec = QuantSpec("fp4_e2m1", Block(32), scale=f"e8m0:{mode}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s, _ = to_mx(x, torch.float4_e2m1fn_x2, 32, scaling_mode=ScaleCalculationMode(mode))
    units = spec.layout.to_units(x)
    ours = qparams_from_range(units.amin(1), units.amax(1), spec, check_finite=False).scale
    ours_bits = (ours.flatten().view(torch.int32) >> 23) & 255  # the E8M0 code
    assert ours_bits.tolist() == s.view(torch.uint8).flatten().tolist()
    assert ours[2].isnan()
