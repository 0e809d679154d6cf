"""quantize / dequantize / fake_quantize: every preset and layout, dtypes, STE, errors.

The reference here broadcasts the qparams against the tensor in its own shape (what a
kernel consuming the checkpoint does), independently of the layouts' units view.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantscope import QuantSpec, dequantize, fake_quantize, presets, qparams_from_range, quantize
from quantscope.layout import Block, Channel, Group, Tensor, Tile, Token
from quantscope.qdq import fake_quantize_units
from quantscope.qparams import QParams

SPECS = {name: presets.get(name) for name in sorted(presets.PRESETS)}
SPECS.update({
    "int8-ch1-asym": QuantSpec("int8", Channel(1), symmetric=False),
    "uint4-g32-asym": QuantSpec("uint4", Group(32), symmetric=False),
    "int2-g16": QuantSpec("int2", Group(16)),
    "int8-tile": QuantSpec("int8", Tile(16, 24)),
    "fp8-tile": QuantSpec("fp8_e4m3", Tile(128, 128)),
    "fp8-e5m2-token": QuantSpec("fp8_e5m2", Token()),
    "fp6-e3m2-ch": QuantSpec("fp6_e3m2", Channel(0)),
    "int8-pow2": QuantSpec("int8", Channel(0), scale="pow2:round"),
    "int4-g64-axis0": QuantSpec("int4", Group(64, axis=0)),
    "int16": QuantSpec("int16", symmetric=False),
    "mxfp4-rceil": QuantSpec("fp4", Block(32), scale="e8m0:rceil"),
    "int8-reduce-range": QuantSpec("int8", quant_min=-64, quant_max=63),
})


def observe(x, spec):
    u = spec.layout.to_units(x.float())
    return qparams_from_range(u.min(1).values, u.max(1).values, spec).reshape(
        spec.layout.qparam_shape(x.shape))


def broadcast_view(x, layout):
    """x reshaped so that the qparams broadcast against it, and the inverse."""
    if isinstance(layout, (Tensor, Channel, Token)):
        return x, lambda y: y
    if isinstance(layout, (Group, Block)):
        a = layout.axis % x.dim()
        m = x.movedim(a, -1)
        n = m.shape[-1]
        pad = -n % layout.size
        m = torch.nn.functional.pad(m, (0, pad)).unflatten(-1, (-1, layout.size))
        return m, lambda y: y.flatten(-2)[..., :n].movedim(-1, a)
    r, c = x.shape[-2:]
    rows, cols = layout.rows, layout.cols
    p = torch.nn.functional.pad(x, (0, -c % cols, 0, -r % rows))
    v = p.unflatten(-1, (-1, cols)).unflatten(-3, (-1, rows))  # (..., rt, rows, ct, cols)
    return v, lambda y: y.flatten(-2).flatten(-3, -2)[..., :r, :c]


def reference_fake_quant(x, q, spec):
    v, back = broadcast_view(x.float(), spec.layout)
    s = q.effective_scale
    zp = q.zero_point.float()
    if isinstance(spec.layout, (Group, Block)):
        s, zp = s[..., None], zp[..., None]
    elif isinstance(spec.layout, Tile):
        s, zp = s[..., :, None, :, None], zp[..., :, None, :, None]
    if spec.is_float:
        codes = spec.format.round(v / s)
    else:
        codes = torch.clamp(torch.round(v / s + zp), spec.qmin, spec.qmax)
    return back((codes - zp) * s), back(codes)


def shape_for(spec):
    if isinstance(spec.layout, Tile):
        return (3, 200, 100)
    if isinstance(spec.layout, Group) and spec.layout.axis == 0:
        return (128, 48)
    return (2, 16, 256) if isinstance(spec.layout, Token) else (48, 256)


@pytest.mark.parametrize("name", list(SPECS))
def test_every_spec_matches_the_broadcast_reference(name):
    spec = SPECS[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape_for(spec), generator=g) * torch.exp2(
        torch.randint(-3, 4, shape_for(spec)[:-1] + (1,), generator=g).float())
    x.view(-1)[::97] *= 20  # outliers, so that ranges and clipping matter
    q = observe(x, spec)
    assert q.scale.shape == spec.layout.qparam_shape(x.shape)
    codes = quantize(x, q, spec)
    out = fake_quantize(x, q, spec)
    ref_out, ref_codes = reference_fake_quant(x, q, spec)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(out, ref_out)
    assert torch.equal(dequantize(codes, q, spec), out)
    assert (codes >= spec.qmin).all() and (codes <= spec.qmax).all()
    assert torch.equal(spec.format.round(codes) if spec.is_float else codes.round(), codes)
    # a second pass is a fixed point (every dequantized value is on the grid)
    assert torch.equal(fake_quantize(out, q, spec), out)
    # error is at most half a step for signed symmetric max-abs ranges (they never clip); a
    # rounded zero point (asymmetric, unsigned) may clip one end by up to half a step more
    if spec.scale.kind == "fp32" and not spec.is_float and spec.quant_min is None:
        bound = 0.5 if spec.symmetric and spec.format.signed else 1.0
        assert ((out - x).abs() <= bound * 1.0001 * scale_like(q, spec, x)).all()


def scale_like(q, spec, x):
    """The effective scale of every element, in x's shape."""
    ones = torch.ones_like(x)
    v, back = broadcast_view(ones, spec.layout)
    s = q.effective_scale
    if isinstance(spec.layout, (Group, Block)):
        s = s[..., None]
    elif isinstance(spec.layout, Tile):
        s = s[..., :, None, :, None]
    return back(v * s)


def test_group_gidx_equals_grouping_permuted_columns():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=g)
    perm = torch.randperm(64, generator=g)
    g_idx = torch.empty(64, dtype=torch.int64)
    g_idx[perm] = torch.arange(64) // 16  # columns perm[0:16] form group 0, ...
    spec = QuantSpec("int4", Group(16, g_idx=g_idx), symmetric=False)
    plain = QuantSpec("int4", Group(16), symmetric=False)
    q = observe(x, spec)
    q_plain = observe(x[:, perm], plain)
    assert torch.equal(q.scale, q_plain.scale) and torch.equal(q.zero_point, q_plain.zero_point)
    expect = torch.empty_like(x)
    expect[:, perm] = fake_quantize(x[:, perm], q_plain, plain)
    assert torch.equal(fake_quantize(x, q, spec), expect)


@pytest.mark.parametrize("name", ["int8-channel", "int4-g128-asym", "fp8", "mxfp4", "nvfp4",
                                  "bfp16", "int8-token"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_equal_float32_of_the_same_values(name, dtype):
    spec = SPECS[name]
    x = (torch.randn(2, 16, 256, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    q, q32 = observe(x, spec), observe(x.float(), spec)
    assert torch.equal(q.scale, q32.scale) and torch.equal(q.zero_point, q32.zero_point)
    out = fake_quantize(x, q, spec)
    assert out.dtype == dtype
    assert torch.equal(out, fake_quantize(x.float(), q, spec).to(dtype))
    assert torch.equal(quantize(x, q, spec), quantize(x.float(), q, spec))
    assert dequantize(quantize(x, q, spec), q, spec, dtype=dtype).dtype == dtype


@pytest.mark.parametrize("fmt", ["int8", "int16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_codes_of_a_low_precision_input_are_float32(fmt, dtype):
    # quantize's doc: codes as float32, whatever the input's dtype (int16's codes past 256
    # have no bf16 value), and dequantize's values in the dtype asked for, not the codes'
    spec = QuantSpec(fmt)
    x = torch.linspace(-1, 1, 1001).to(dtype)
    qp = qparams_from_range(x.float().min().reshape(1), x.float().max().reshape(1), spec)
    q = quantize(x, qp, spec)
    assert q.dtype == torch.float32 and torch.equal(q, quantize(x.float(), qp, spec))
    assert dequantize(q, qp, spec, dtype).dtype == dtype


@pytest.mark.parametrize("name", ["int8-channel", "int4-g128-asym", "fp8", "mxfp4", "nvfp4",
                                  "int8-token"])
def test_float64_inputs_equal_float32_of_the_same_values(name):
    """Computed in float32 as every dtype (float64's max was the saturation bound: a float32
    clamp cannot hold it and raised)."""
    spec = SPECS[name]
    x = torch.randn(2, 16, 256, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    q = observe(x.float(), spec)
    out = fake_quantize(x, q, spec)
    assert out.dtype == torch.float64
    assert torch.equal(out, fake_quantize(x.float(), q, spec).double())
    deq = dequantize(quantize(x, q, spec), q, spec, dtype=torch.float64)
    assert deq.dtype == torch.float64 and torch.equal(deq, out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.float32],
                         ids=str)
@pytest.mark.parametrize("spec", [QuantSpec("int8", Channel(-1)), QuantSpec("int8", Channel(1)),
                                  QuantSpec("uint4", Group(8, axis=1), symmetric=False),
                                  QuantSpec("int8", Block(24, 1)), QuantSpec("int8", Tile(8, 16)),
                                  presets.NVFP4, presets.FP8_PER_CHANNEL], ids=str)
def test_qdq_of_a_non_float32_input_runs_in_its_own_copy(spec, dtype):
    """A bf16 / fp16 / float64 ``x``'s QDQ runs in place in the float32 copy it takes (strided
    and padded layouts too): the float32 copy's result, and ``x`` untouched (a float32 ``x``
    is no copy: its QDQ must not run in place)."""
    x = (torch.randn(4, 40, 32, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    before = x.clone()
    q = observe(x.float(), spec)
    out = fake_quantize(x, q, spec)
    assert torch.equal(x, before)
    assert torch.equal(out, fake_quantize(x.float(), q, spec).to(dtype))


@pytest.mark.parametrize("spec", [QuantSpec("int8"), presets.FP8_PER_CHANNEL, presets.MXFP4],
                         ids=str)
def test_ste_forward_keeps_the_bits_of_the_plain_forward(spec):
    """-0.0 included: out + (x - x.detach()) made a -0.0 result +0.0 (a review found it)."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    x[:, :8] = torch.tensor([-0.0, -1e-6, -1e-30, 0.0, 1e-6, -0.0, 2.0, -3.0])
    q = observe(x, spec)
    plain = fake_quantize(x, q, spec)
    ste = fake_quantize(x.clone().requires_grad_(), q, spec, ste=True).detach()
    assert plain.signbit()[:, 1].all() and not plain[:, 1].any()  # the case: -0.0 results
    assert torch.equal(ste.view(torch.int32), plain.view(torch.int32))


@pytest.mark.parametrize("spec", [QuantSpec("int8", symmetric=False), QuantSpec("int4", Group(8)),
                                  presets.FP8_PER_CHANNEL, presets.MXFP4], ids=str)
def test_ste_gradient_is_one_inside_and_zero_where_clipped(spec):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g)
    q = observe(x, spec)
    xs = (x * 1.5).requires_grad_()  # calibrated on x: the larger values now clip
    out = fake_quantize(xs, q, spec, ste=True)
    assert torch.equal(out.detach(), fake_quantize(xs.detach(), q, spec))
    out.sum().backward()
    s = scale_like(q, spec, x)
    if spec.is_float:  # rounding to the nearest value: inside up to half the top step past max
        fmt = spec.format
        top_step = 2.0 ** (fmt.emax - fmt.mbits)
        clipped = (xs.detach() / s).abs() > fmt.max + top_step / 2
    else:
        zp = scale_like(q.__class__(q.zero_point.float(), q.zero_point), spec, x)
        t = torch.round(xs.detach() / s + zp)
        clipped = (t < spec.qmin) | (t > spec.qmax)
    assert clipped.any() and (~clipped).any()
    assert torch.equal(xs.grad, (~clipped).float())
    assert not fake_quantize(xs, q, spec).requires_grad


@pytest.mark.parametrize("name", ["int8", "int4-g128-asym", "fp8", "nvfp4"])
def test_ste_forward_keeps_infinities_saturated(name):
    """The straight-through term adds 0 where a value clips, not ``(x - x) * 0``: that is NaN
    at +-inf (an fp16 activation overflowed), where the forward saturates."""
    spec = SPECS[name]
    w = torch.randn(4, 128, generator=torch.Generator().manual_seed(4))
    q = observe(w, spec)
    x = w.clone()
    x[0, :3] = torch.tensor([math.inf, -math.inf, 1.0])
    xs = x.requires_grad_()
    out = fake_quantize(xs, q, spec, ste=True)
    assert torch.equal(out.detach(), fake_quantize(x.detach(), q, spec))
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert xs.grad[0, :2].tolist() == [0.0, 0.0] and xs.grad[0, 2] == 1.0


def test_ste_passes_the_gradient_of_values_rounded_onto_the_range_end():
    """fp8 min-max maps an absmax such as 0.896 1 ulp past ``448 x scale`` in float32; it
    rounds to 448 without clipping (the report does not count it clipped either): gradient 1,
    as torch.ao's mask passes a code that rounds onto ``quant_max``."""
    spec = presets.FP8_PER_CHANNEL
    amax = torch.tensor([0.8960914611816406, 1.9458763599395752, 2.057272434234619, 1.0])
    w = torch.rand(4, 64, generator=torch.Generator().manual_seed(6)) * 0.5
    w[:, 7] = amax
    q = observe(w, spec)
    s = scale_like(q, spec, w)
    assert ((w / s).abs() > spec.format.max).sum() == 3  # the case: past 448 by rounding
    xs = w.clone().requires_grad_()
    fake_quantize(xs, q, spec, ste=True).sum().backward()
    assert torch.equal(xs.grad, torch.ones_like(w))


def test_ste_matches_torch_ao_fake_quantize_gradient():
    x = torch.linspace(-3, 3, 1001).requires_grad_()
    spec = QuantSpec("int8", symmetric=False)
    q = qparams_from_range(torch.tensor([-1.0]), torch.tensor([2.0]), spec)
    fake_quantize(x, q, spec, ste=True).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    ref = torch.fake_quantize_per_tensor_affine(x2, q.scale, q.zero_point, -128, 127)
    ref.sum().backward()
    assert torch.equal(x.grad, x2.grad)
    # values: torch.ao multiplies by 1 / scale where we divide, so a code can differ by one
    # where x / scale lands on a rounding tie
    diff = (fake_quantize(x.detach(), q, spec) - ref.detach()).abs()
    assert (diff <= q.scale * 1.0001).all() and (diff > 1e-6).sum() <= 5


def test_units_helper_is_the_same_math():
    spec = presets.INT4_GROUP128_ASYM
    x = torch.randn(4, 256)
    q = observe(x, spec)
    u = spec.layout.to_units(x)
    out = fake_quantize_units(u, q.scale.reshape(-1, 1), q.zero_point.reshape(-1, 1).float(), spec)
    assert torch.equal(spec.layout.to_shape(out, x.shape), fake_quantize(x, q, spec))


def test_errors():
    spec = presets.INT8_PER_CHANNEL
    x = torch.randn(4, 8)
    q = observe(x, spec)
    with pytest.raises(ValueError, match="qparams: scale has 4 values.*has 5 units"):
        fake_quantize(torch.randn(5, 8), q, spec)
    with pytest.raises(TypeError, match="fake_quantize: x must be a floating-point tensor"):
        fake_quantize(torch.ones(4, 8, dtype=torch.int32), q, spec)
    with pytest.raises(TypeError, match="quantize: x must be a torch.Tensor"):
        quantize([1.0, 2.0], q, spec)
    with pytest.raises(ValueError, match="Group: size 128 does not divide 100"):
        fake_quantize(torch.randn(4, 100), q, presets.INT4_GROUP128)


def _qp(spec, scale, zero_point, global_scale=None):
    return QParams(torch.tensor(scale, dtype=torch.float32), torch.tensor(zero_point),
                   None if global_scale is None else torch.tensor([global_scale]))


@pytest.mark.parametrize("fn", [quantize, fake_quantize, dequantize])
@pytest.mark.parametrize(("spec", "qp", "field"), [
    # probing: a zero / negative / NaN / inf scale gave NaN or sign-flipped values, a zero
    # point off the code range or between integers shifted every value, silently
    (presets.INT8_PER_CHANNEL, ([0.1, 0.0], [0, 0]), "scale"),
    (presets.INT8_PER_CHANNEL, ([0.1, -0.01], [0, 0]), "scale"),
    (presets.INT8_PER_CHANNEL, ([0.1, float("nan")], [0, 0]), "scale"),
    (presets.INT8_PER_CHANNEL, ([0.1, float("inf")], [0, 0]), "scale"),
    (QuantSpec("uint8", Channel(0), symmetric=False), ([0.1, 0.1], [0, 300]), "zero_point"),
    (QuantSpec("int8", Channel(0), symmetric=False), ([0.1, 0.1], [0.5, 0.0]), "zero_point"),
    (QuantSpec("fp8", Channel(0)), ([0.1, 0.1], [0, 1]), "zero_point"),
    (presets.NVFP4, ([[0.5]] * 2, [[0]] * 2, 0.0), "global_scale"),
    # probing: a missing global scale ran NVFP4 with scales 1 / gs off (a stray one divided
    # other specs' scales), and scales their encoding cannot store ran as given
    (presets.NVFP4, ([[0.5]] * 2, [[0]] * 2), "global_scale"),
    (presets.INT8_PER_CHANNEL, ([0.1, 0.1], [0, 0], 2.0), "global_scale"),
    (presets.MXFP4, ([[0.5]] * 2, [[0]] * 2), None),  # (a power of two: runs)
    (presets.MXFP4, ([[0.3]] * 2, [[0]] * 2), "scale"),
    (QuantSpec("int8", Channel(0), scale="pow2:round"), ([0.25, 0.3], [0, 0]), "scale"),
    (QuantSpec("int8", Channel(0), scale="bf16"), ([0.25, 0.1], [0, 0]), "scale"),
])
def test_qparams_that_cannot_run_raise_naming_the_field(fn, spec, qp, field):
    x = torch.randn(2, 32 if spec is presets.MXFP4 else 16)  # two units
    if field is None:
        fn(x, _qp(spec, *qp), spec)
        return
    with pytest.raises(ValueError, match=rf"{fn.__name__}: qparams\.{field} must be"):
        fn(x, _qp(spec, *qp), spec)
    fn(x, _qp(spec, *qp), spec, check=False)  # the library's own callers skip the host read


def test_dequantize_checks_its_arguments():
    spec = presets.INT8_PER_CHANNEL
    q = observe(torch.randn(4, 8), spec)
    with pytest.raises(TypeError, match="dequantize: q must be a torch.Tensor"):
        dequantize([1, 2], q, spec)
    with pytest.raises(TypeError, match="dequantize: dtype must be a floating-point"):
        dequantize(torch.zeros(4, 8), q, spec, dtype=torch.int8)  # truncated values before


@st.composite
def spec_and_tensor(draw):
    fmt = draw(st.sampled_from(["int2", "int3", "int4", "int8", "int16", "uint4", "uint8",
                                "int8_narrow", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3",
                                "fp4"]))
    is_float = fmt.startswith("fp")
    kind = draw(st.sampled_from(["tensor", "channel", "group", "token", "block", "tile"]))
    rows, cols = draw(st.integers(1, 9)), draw(st.sampled_from([8, 16, 24, 40]))
    layout = {"tensor": Tensor(), "channel": Channel(draw(st.integers(0, 1))),
              "group": Group(8), "token": Token(), "block": Block(draw(st.sampled_from([4, 16, 32]))),
              "tile": Tile(draw(st.integers(1, 4)), draw(st.sampled_from([3, 8])))}[kind]
    scales = ["fp32", "fp16", "bf16", "pow2:round", "pow2:floor", "pow2:ceil"]
    signed = not fmt.startswith("u")
    if kind == "block" and signed:
        scales += ["e8m0:floor", "e8m0:ceil", "e8m0:even", "e8m0:rceil"]
        if is_float:
            scales.append("fp8_e4m3")
    scale = draw(st.sampled_from(scales))
    symmetric = True if is_float or scale.startswith(("e8m0", "fp8")) else draw(st.booleans())
    spec = QuantSpec(fmt, layout, symmetric, scale)
    mag = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    x = x * mag
    if draw(st.booleans()):
        x[0] = 0  # an all-zero row
    return spec, x


@settings(max_examples=150, deadline=None)
@given(spec_and_tensor())
def test_any_valid_spec_quantizes_consistently(case):
    spec, x = case
    q = observe(x, spec)
    s = q.effective_scale
    assert torch.isfinite(s).all() and (s > 0).all()
    codes = quantize(x, q, spec)
    out = fake_quantize(x, q, spec)
    assert torch.isfinite(out).all()
    assert (codes >= spec.qmin).all() and (codes <= spec.qmax).all()
    assert torch.equal(dequantize(codes, q, spec), out)
    assert torch.equal(fake_quantize(out, q, spec), out)  # the grid is a fixed point
    assert (out[x == 0] == 0).all()  # zero is exact
    ref, _ = reference_fake_quant(x, q, spec)  # the broadcast reference
    assert torch.equal(out, ref)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=4),
       st.lists(st.integers(0, 3), min_size=0, max_size=5))
def test_in_place_broadcast_check_is_torchs(t_shape, o_shape):
    # qdq's hand check of "other broadcasts into t without growing it" against torch's rule
    from quantscope.qdq import _fits

    t, o = torch.empty(t_shape), torch.empty(o_shape)
    try:
        want = torch.broadcast_shapes(t.shape, o.shape) == t.shape
    except RuntimeError:
        with pytest.raises(RuntimeError):
            _fits(t, o)
        return
    assert _fits(t, o) == want


@pytest.mark.parametrize("ste", [False, True])
@pytest.mark.parametrize("dims", [4, 5])
@pytest.mark.parametrize("layout", [Tensor(), Channel(0), Channel(1), Token()])
def test_fake_quantize_keeps_a_channels_last_input_channels_last(layout, dims, ste):
    """As torch's fake_quantize_per_tensor / per_channel_affine do: a conv net run
    channels-last would otherwise convert every QDQ'd activation back."""
    fmt = torch.channels_last if dims == 4 else torch.channels_last_3d
    x = torch.randn(2, 8, *([5] * (dims - 2)), generator=torch.Generator().manual_seed(0))
    x = x.to(memory_format=fmt)
    spec = QuantSpec("int8", layout)
    qp = qparams_from_range(*spec.layout.to_units(x).aminmax(dim=1), spec)
    got = fake_quantize(x, qp, spec, ste=ste)
    torchs = torch.fake_quantize_per_tensor_affine(x, 0.1, 0, -128, 127)
    assert got.stride() == torchs.stride() and got.is_contiguous(memory_format=fmt)
    # the values of the contiguous input's (torch's can differ at a tie: it multiplies by the
    # scale's reciprocal, quantscope divides)
    assert torch.equal(got, fake_quantize(x.contiguous(), qp, spec))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, layout", [
    ((3, 5), Tile(128, 128)), ((6, 6), Block(4)), ((6, 6), Group(3, axis=0)),
    ((6, 6), Block(4, axis=0)), ((6, 6), Channel(1)), ((2, 6, 3, 3), Channel(1)),
    ((2, 8, 4, 4), Block(4, axis=1))])
def test_qdq_results_are_contiguous_like_torchs(shape, layout, dtype):
    # a layout's to_shape gives a view (padding sliced off, an axis moved back): each result is
    # copied out, contiguous as torch's fake_quantize_per_* give it, holding only its values
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    spec = QuantSpec("int8", layout)
    qp = qparams_from_range(*spec.layout.to_units(x.float()).aminmax(dim=1), spec)
    q = quantize(x, qp, spec)
    for y in (fake_quantize(x, qp, spec), fake_quantize(x, qp, spec, ste=True), q,
              dequantize(q, qp, spec, dtype)):
        assert y.is_contiguous() and y.shape == x.shape
        assert y.untyped_storage().nbytes() == y.numel() * y.element_size()
    last = x.to(memory_format=torch.channels_last) if x.dim() == 4 else None
    if last is not None:  # and a channels-last input's stays channels-last
        got = fake_quantize(last, qp, spec)
        assert got.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(got, fake_quantize(x, qp, spec))


@pytest.mark.parametrize("view", [lambda x: x[..., ::2], lambda x: x.transpose(-2, -1),
                                  lambda x: x[:, :2]], ids=["step", "transposed", "sliced"])
@pytest.mark.parametrize("dims", [4, 5])
def test_a_strided_input_not_channels_last_gives_contiguous_results(view, dims):
    # only an input in a channels-last format keeps it: any other view's results are
    # contiguous (torch's fake_quantize_per_tensor_affine keeps a transposed input's strides;
    # quantscope copies every result out of its layout's view, docs: _as_input)
    base = torch.randn(2, 3, *([8] * (dims - 2)), generator=torch.Generator().manual_seed(1))
    x = view(base)
    last = torch.channels_last if dims == 4 else torch.channels_last_3d
    assert not x.is_contiguous() and not x.is_contiguous(memory_format=last)
    spec = QuantSpec("int8")
    qp = qparams_from_range(x.min().reshape(1), x.max().reshape(1), spec)
    codes = view(quantize(base, qp, spec))  # codes in the input's strides
    for y in (fake_quantize(x, qp, spec), quantize(x, qp, spec), dequantize(codes, qp, spec)):
        assert y.is_contiguous() and y.shape == x.shape
