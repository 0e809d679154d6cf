"""compat.quark against AMD Quark 0.13 on bfloat16 / float16 input: the dtypes Quark computes
its scales in (MX's float32 even_round, BFP16's floor formula in the input's dtype, integer
scales in the range's dtype before ``scale_type``), the float dtypes Quark prices with its
integer formula (it asserts), and, on every input dtype, the ``scale_format`` that formula
never reads (integer dtypes) or that fp4 cannot do without.

Every test imports Quark and compares with its own classes (the peers' venv).
"""

from __future__ import annotations

import pytest
import torch
from quark_twins import qo

from quantscope.compat import quark

pytestmark = [pytest.mark.peers, pytest.mark.xdist_group("quark")]
pytest.importorskip("quark")  # quark_twins imports quark.torch when a test first uses it

HALF = [torch.bfloat16, torch.float16]


def twins(name, **kw):
    """Quark's class and ours on one ``QTensorConfig`` (it takes our class as observer_cls)."""
    from quark.torch.quantization.config.config import QTensorConfig
    from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType

    kw = {"qscheme": "per_tensor", "round_method": RoundType.half_even, "scale_type": "float",
          "is_dynamic": False, **kw}
    kw["dtype"], kw["qscheme"] = Dtype(kw["dtype"]), QSchemeType(kw["qscheme"])
    kw["scale_type"] = ScaleType(kw["scale_type"])
    c = QTensorConfig(observer_cls=getattr(quark, name), **kw)
    return getattr(qo, name)(c), getattr(quark, name)(c)


def same(theirs, ours):
    """Equal values (NaN-free), the same dtype and shape."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (theirs, ours)
    assert torch.equal(ours, theirs), (theirs, ours)


def both_raise(theirs, ours, exc, our_exc, match):
    """Quark's class raises ``exc`` and ours ``our_exc`` (matching ``match``) from
    ``_calculate_qparams()`` and from ``calculate_qparams(min_val, max_val)``."""
    with pytest.raises(exc):
        theirs._calculate_qparams()
    with pytest.raises(our_exc, match=match):
        ours._calculate_qparams()
    with pytest.raises(exc):
        theirs.calculate_qparams(theirs.min_val, theirs.max_val)
    with pytest.raises(our_exc, match=match):
        ours.calculate_qparams(ours.min_val, ours.max_val)


def bfp(**kw):
    return twins("PerBlockBFPObserver", dtype="bfp16", qscheme="per_group", group_size=8,
                 ch_axis=-1, **kw)


def positive_max(x: torch.Tensor) -> torch.Tensor:
    """Each block of 8 signed so that its largest magnitude is positive (Quark's BFP16 checks
    positive overflow only, quantscope either sign: a documented difference)."""
    blocks = x.reshape(-1, 8)
    top = blocks.gather(1, blocks.abs().argmax(1, keepdim=True))
    return (blocks * torch.where(top < 0, -1, 1).to(x.dtype)).reshape(x.shape)


@pytest.mark.parametrize("element", ["fp4", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scale_type", ["float", "float32", "float16"])
@pytest.mark.parametrize("dtype", [*HALF, torch.float32])
def test_mx_even_scale_of_zero_and_tiny_blocks(element, scale_type, dtype):
    """Quark's even_round is float32 whatever the input: a float16 zero block's 2 ** -127
    and a block of 1e-6 (2 ** -28 for fp8_e4m3) do not underflow before scale_type's cast."""
    x = torch.cat([torch.zeros(1, 32), torch.full((1, 32), 1e-6), torch.randn(2, 32)])
    theirs, ours = twins("PerBlockMXObserver", dtype=element, qscheme="per_group",
                         group_size=32, ch_axis=-1, scale_format="e8m0", scale_type=scale_type)
    theirs(x.to(dtype))
    ours(x.to(dtype))
    for a, b in zip(theirs._calculate_qparams(), ours._calculate_qparams(), strict=True):
        same(a, b)


@pytest.mark.parametrize("scale_type", ["float", "float32", "float16"])
def test_bfp_scale_fills_eps_where_the_half_formula_underflows(scale_type):
    """Quark's 2 ** (floor(log2 amax) - 6) underflows to 0 in float16 below 2 ** -18 and
    takes eps there (the float32 formula does not underflow); before data, eps in
    scale_type's dtype."""
    x = torch.tensor([[1e-4, -2e-5, 3e-5, 0, 0, 0, 0, 0], [1e-6] * 8, [2.0 ** -19 * 1.5] * 8,
                      [2.0 ** -18] * 8, [0.0] * 8])
    for dtype in (*HALF, torch.float32):
        theirs, ours = bfp(scale_type=scale_type)
        for a, b in zip(theirs._calculate_qparams(), ours._calculate_qparams(), strict=True):
            same(a, b)
        theirs(x.to(dtype))
        ours(x.to(dtype))
        for a, b in zip(theirs._calculate_qparams(), ours._calculate_qparams(), strict=True):
            same(a, b)


@pytest.mark.parametrize("dtype", HALF)
def test_bfp_exponent_from_the_half_log2(dtype):
    """Quark takes log2(amax) in the input's dtype: bfloat16's log2(31.75) and log2(508) round
    up to 5 and 9 (scale 2x the float32 one); float16's log2(2 * 15.984375) rounds up once
    the overflowing amax is doubled (scale 4x). A float16 block near 65504: Quark's doubled
    amax overflows to an infinite scale, quantscope's is the native one (finite; documented)."""
    x = torch.tensor([[31.75, 1, 2, 3, -4, 5, 6, 7], [508, 1, 2, 3, 4, 5, 6, -7],
                      [15.984375, 4.9, -10.7, 4.5, 0, 1, 2, 3]])
    if dtype == torch.float16:
        x = torch.cat([x, torch.tensor([[65504.0, 1, 2, 3, 4, 5, 6, 7]])])
    theirs, ours = bfp()
    theirs(x.to(dtype))
    ours(x.to(dtype))
    (a, za), (b, zb) = theirs._calculate_qparams(), ours._calculate_qparams()
    same(za, zb)
    same(a[:3], b[:3])
    if dtype == torch.float16:
        assert torch.isinf(a[3]) and b[3] == 1024.0  # 2 ** (15 + 1 - 6): 65504 / 512 rounds to 128


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("spread", [1e-5, 0.02, 1.0, 10.0, 300.0, 5000.0])
def test_bfp_random_half_blocks(dtype, spread):
    g = torch.Generator().manual_seed(int(spread * 1000) % 9973)
    x = positive_max((torch.randn(512, 64, generator=g) * spread).to(dtype))
    theirs, ours = bfp(is_dynamic=True)
    theirs(x)
    ours(x)
    same(theirs._calculate_qparams()[0], ours._calculate_qparams()[0])


@pytest.mark.parametrize("name, extra", [
    ("PerTensorMinMaxObserver", {}),
    ("PerChannelMinMaxObserver", {"qscheme": "per_channel", "ch_axis": 0}),
    ("PerGroupMinMaxObserver", {"qscheme": "per_group", "ch_axis": -1, "group_size": 4})])
@pytest.mark.parametrize("scale_type", ["float", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("dtype", [*HALF, torch.float32])
def test_int_scale_rounds_in_the_range_dtype_before_scale_type(name, extra, scale_type, dtype):
    """Quark's integer scale is computed in the range's dtype, then cast to scale_type's."""
    g = torch.Generator().manual_seed(5)
    x = torch.cat([torch.tensor([[2.484375, -1.0, 0.5, 0.25], [-0.3359375, 0.1, 0.2, 0.3]]),
                   torch.randn(6, 4, generator=g) * 3])
    theirs, ours = twins(name, dtype="int8", symmetric=True, scale_type=scale_type, **extra)
    theirs(x.to(dtype))
    ours(x.to(dtype))
    for a, b in zip(theirs._calculate_qparams(), ours._calculate_qparams(), strict=True):
        same(a, b)


@pytest.mark.parametrize("name, dtype, extra", [
    ("PerGroupMinMaxObserver", "fp4", {"qscheme": "per_group", "ch_axis": -1, "group_size": 16}),
    ("PerGroupMinMaxObserver", "fp6_e2m3",
     {"qscheme": "per_group", "ch_axis": -1, "group_size": 16}),
    ("PerTensorMinMaxObserver", "fp6_e3m2", {}),
    ("PerChannelMinMaxObserver", "fp6_e2m3", {"qscheme": "per_channel", "ch_axis": 0})])
@pytest.mark.parametrize("scale_format", ["float32", "e4m3"])
def test_float_dtypes_quark_prices_as_integers_raise_as_quark(name, dtype, extra,
                                                              scale_format):
    """Quark's class sends these dtypes to calculate_int_quant_params: its default before
    data, then the AssertionError of its integer quant_min check."""
    if scale_format == "e4m3" and extra.get("qscheme") != "per_group":
        pytest.skip("block scale formats need per_group")
    theirs, ours = twins(name, dtype=dtype, scale_format=scale_format, **extra)
    for a, b in zip(theirs._calculate_qparams(), ours._calculate_qparams(), strict=True):
        same(a, b)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    theirs(x)
    ours(x)
    both_raise(theirs, ours, AssertionError, quark.UnsupportedElementError,
               rf"{name}: .*integer dtype.*'{dtype}'")


@pytest.mark.parametrize("dtype", HALF)
def test_pro_bins_a_half_batch_as_float32(dtype):
    """The documented difference: Quark's Pro passes the half batch to torch.ao, which bins it
    in that dtype; quantscope's gives Quark's answer for the batch's float32 copy."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 512, generator=g) * 3).to(dtype)
    theirs32, ours = twins("PerTensorHistogramObserverPro", dtype="int8", symmetric=True)
    theirs32(x.float())
    ours(x)
    same(theirs32._calculate_qparams()[0], ours._calculate_qparams()[0])


INT_LAYOUTS = [
    ("PerGroupMinMaxObserver", {"qscheme": "per_group", "ch_axis": -1, "group_size": 16}),
    ("PerChannelMinMaxObserver", {"qscheme": "per_channel", "ch_axis": 0}),
    ("PerTensorMinMaxObserver", {}),
]


@pytest.mark.parametrize("name, extra", INT_LAYOUTS, ids=[n for n, _ in INT_LAYOUTS])
@pytest.mark.parametrize("scale_format", ["e8m0", "e4m3"])
@pytest.mark.parametrize("dtype, symmetric", [("int8", True), ("int4", True), ("uint8", False)])
@pytest.mark.parametrize("xdtype", [*HALF, torch.float32])
def test_integer_dtypes_ignore_scale_format_as_quark(name, extra, scale_format, dtype,
                                                     symmetric, xdtype):
    """Quark's uniform classes price integer dtypes with calculate_int_quant_params, which
    never reads scale_format (and QTensorConfig does not check it): plain amax scales, the
    same as with float32, before data and after, not E8M0 powers of two / an NVFP4 error."""
    if not symmetric and xdtype != torch.float32:
        pytest.skip("documented: Quark's asymmetric half ranges are priced in the half dtype")
    kw = {"dtype": dtype, "symmetric": symmetric, **extra}
    theirs, ours = twins(name, scale_format=scale_format, **kw)
    _, plain = twins(name, scale_format="float32", **kw)
    for a, b in zip(theirs._calculate_qparams(), ours._calculate_qparams(), strict=True):
        same(a, b)
    x = (torch.randn(4, 32, generator=torch.Generator().manual_seed(1)) * 3).to(xdtype)
    for obs in (theirs, ours, plain):
        obs(x)
    for a, b, c in zip(theirs._calculate_qparams(), ours._calculate_qparams(),
                       plain._calculate_qparams(), strict=True):
        same(a, b)
        same(c, b)
    for a, b in zip(theirs.calculate_qparams(theirs.min_val, theirs.max_val),
                    ours.calculate_qparams(ours.min_val, ours.max_val), strict=True):
        same(a, b)


@pytest.mark.parametrize("name, extra", INT_LAYOUTS[1:], ids=[n for n, _ in INT_LAYOUTS[1:]])
def test_fp4_without_scale_format_raises_as_quark(name, extra):
    """Quark's per-tensor / per-channel classes price fp4 with get_scale(scale_format), which
    raises ValueError for a qspec without one: before data, after it, and on a given range."""
    theirs, ours = twins(name, dtype="fp4", **extra)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    for seen in (False, True):
        if seen:
            theirs(x)
            ours(x)
        both_raise(theirs, ours, ValueError, ValueError,
                   rf"{name}: dtype 'fp4' needs a scale_format")
    _, plain = twins(name, dtype="fp4", scale_format="float32", **extra)
    plain(x)  # with float32 the scale is amax / 6, as Quark's
    amax = x.abs().amax(dim=None if name == "PerTensorMinMaxObserver" else 1)
    assert torch.equal(plain._calculate_qparams()[0], amax / 6.0)


HISTOGRAMS = ["PerTensorHistogramObserver", "PerTensorPercentileObserver",
              "PerTensorMSEObserver"]


@pytest.mark.parametrize("name", HISTOGRAMS)
@pytest.mark.parametrize("symmetric", [True, False])
def test_histogram_fp4_without_scale_format_raises_as_quark(name, symmetric):
    """Quark's histogram classes price fp4 with get_scale(scale_format) (MSE: its search
    refuses fp4 first, after data): ValueError before data, after it and on a given range."""
    theirs, ours = twins(name, dtype="fp4", symmetric=symmetric)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    lo, hi = torch.tensor(-1.0), torch.tensor(2.0)
    for seen in (False, True):
        if seen:
            theirs(x)
            ours(x)
        after_mse = seen and name == "PerTensorMSEObserver"
        # Quark's percentile class, before data, fails on an attribute its forward sets
        with pytest.raises(AttributeError if name == HISTOGRAMS[1] and not seen else ValueError):
            theirs._calculate_qparams()
        with pytest.raises(ValueError, match=rf"{name}: " + (
                "Quark's MSE search prices dtypes .*'fp4'" if after_mse
                else "dtype 'fp4' needs a scale_format")):
            ours._calculate_qparams()
        with pytest.raises(ValueError):
            theirs.calculate_qparams(lo, hi)
        with pytest.raises(ValueError, match=rf"{name}: dtype 'fp4' needs a scale_format"):
            ours.calculate_qparams(lo, hi)


@pytest.mark.parametrize("name", HISTOGRAMS[1:])
@pytest.mark.parametrize("dtype", ["fp6_e2m3", "fp6_e3m2"])
@pytest.mark.parametrize("scale_format", [None, "float32"])
def test_histogram_fp6_raises_as_quark(name, dtype, scale_format):
    """Quark prices fp6 with its integer formula (the quant_min assert) on a given range and
    on its percentile estimate; its MSE search refuses fp6 first (ValueError)."""
    kw = {} if scale_format is None else {"scale_format": scale_format}
    theirs, ours = twins(name, dtype=dtype, **kw)
    lo, hi = torch.tensor(-1.0), torch.tensor(2.0)
    with pytest.raises(AssertionError):
        theirs.calculate_qparams(lo, hi)
    with pytest.raises(quark.UnsupportedElementError, match=rf"{name}: .*integer dtype.*"
                                                            rf"'{dtype}'"):
        ours.calculate_qparams(lo, hi)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    theirs(x)
    ours(x)
    if name == "PerTensorMSEObserver":
        exc, our_exc, match = ValueError, ValueError, rf"{name}: Quark's MSE search .*'{dtype}'"
    else:
        exc, our_exc = AssertionError, quark.UnsupportedElementError
        match = rf"{name}: .*integer dtype.*'{dtype}'"
    with pytest.raises(exc):
        theirs._calculate_qparams()
    with pytest.raises(our_exc, match=match):
        ours._calculate_qparams()
    if name == "PerTensorPercentileObserver":  # Quark stores its estimate before it asserts
        same(theirs.max_val, ours.max_val)


@pytest.mark.parametrize("dtype", ["int2", "int16", "fp8_e5m3"])
def test_mse_search_refuses_the_dtypes_quarks_refuses(dtype):
    """Quark's MSE search fake-quantizes int4 / uint4 / int8 / uint8 / fp8_e4m3 / fp8_e5m2
    only: another dtype is a ValueError once data is seen; a given range is still priced."""
    theirs, ours = twins("PerTensorMSEObserver", dtype=dtype, symmetric=True)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    theirs(x)
    ours(x)
    with pytest.raises(ValueError, match="Invalid dtype"):
        theirs._calculate_qparams()
    with pytest.raises(ValueError, match=rf"PerTensorMSEObserver: .*'{dtype}'"):
        ours._calculate_qparams()
    lo, hi = torch.tensor(-1.0), torch.tensor(2.0)
    for a, b in zip(theirs.calculate_qparams(lo, hi), ours.calculate_qparams(lo, hi),
                    strict=True):
        same(a, b)


@pytest.mark.parametrize("dtype", ["fp4", "fp6_e2m3"])
def test_histogram_pro_refuses_float_dtypes_as_quark(dtype):
    """Quark's Pro (torch.ao's observer) takes uint4 / int8 / uint8 only, at construction."""
    from quark.torch.quantization.config.config import QTensorConfig
    from quark.torch.quantization.config.type import Dtype, QSchemeType

    c = QTensorConfig(dtype=Dtype(dtype), qscheme=QSchemeType.per_tensor,
                      observer_cls=quark.PerTensorHistogramObserverPro)
    with pytest.raises(ValueError, match="4bit and 8bit"):
        qo.PerTensorHistogramObserverPro(c)
    with pytest.raises(ValueError, match="4bit and 8bit"):
        quark.PerTensorHistogramObserverPro(c)
