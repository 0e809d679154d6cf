"""compat.quark behaves as AMD Quark 0.13's observers (issue 34).

The tests marked ``peers`` import Quark and compare bit for bit with its classes (they run in
the peers' venv); the others check the same rules against values computed from the formulas.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from tiers import each_value

from quantscope.compat import quark
from quantscope.compat.quark import FP8_E5M3, quark_float_scale


def batches(shape, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * (i + 1) for i in range(n)]


def fp8(**kw):
    return {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False, **kw}


def mx(scale_format, **kw):
    return {"dtype": "fp4", "qscheme": "per_group", "group_size": 16, "ch_axis": -1,
            "scale_format": scale_format, "is_dynamic": False, **kw}


# ------------------------------------------------------------- formulas (no peer needed)
def e5m3_grid() -> torch.Tensor:
    """Every finite value of Quark's unsigned E5M3, from its definition (bias 15, 3 mantissa
    bits, subnormals below 2 ** -14, the top code not a number)."""
    sub = [m / 8 * 2.0 ** -14 for m in range(8)]
    normal = [(1 + m / 8) * 2.0 ** (e - 15) for e in range(1, 32) for m in range(8)]
    return torch.tensor(sorted(sub + normal)[:-1], dtype=torch.float64)


def test_e5m3_rounds_to_the_nearest_value_ties_to_even():
    grid = e5m3_grid()
    assert grid[-1] == FP8_E5M3.max == 114688.0
    mids = (grid[1:] + grid[:-1]) / 2
    g = torch.Generator().manual_seed(1)
    x = torch.cat([grid, mids, torch.rand(4000, generator=g, dtype=torch.float64)
                   * 2.0 ** torch.randint(-20, 17, (4000,), generator=g)]).float()
    got = FP8_E5M3.round(x, 0.0, FP8_E5M3.max).double()
    xd = x.double().clamp(max=FP8_E5M3.max)
    i = torch.searchsorted(grid, xd).clamp(1, len(grid) - 1)
    lo, hi = grid[i - 1], grid[i]
    below, above = xd - lo, hi - xd
    code = i  # index of hi; the even code wins a tie
    want = torch.where(below < above, lo, torch.where(above < below, hi,
                                                      torch.where(code % 2 == 0, hi, lo)))
    want = torch.where(xd == hi, hi, want)
    assert torch.equal(got, want)


def test_float32_scale_divides_once_by_the_first_level():
    amax = torch.tensor([7.222282409667969, 0.0, 8.0])
    got = quark_float_scale(amax, 448.0, "float32", first_level=6.0)
    want = amax / 2688.0
    want[1] = torch.finfo(torch.float32).eps  # a zero scale becomes eps
    assert torch.equal(got, want)
    assert not torch.equal(got[:1], amax[:1] / 6.0 / 448.0)  # one division, not two
    assert torch.equal(quark_float_scale(amax[:1], 448.0, "float32"), amax[:1] / 448.0)


def test_quant_max_first_level_on_the_observer():
    obs = quark.PerTensorMinMaxObserver(fp8())
    obs.quant_max_first_level = 6.0
    for v in (5.0, 8.0, 3.0):  # a shared second-level observer: the running max
        obs(torch.tensor([v]))
    scale, zp = obs._calculate_qparams()
    assert torch.equal(scale, torch.tensor(8.0 / 2688.0)) and not zp.any()  # 0-dim, as Quark
    dyn = quark.PerTensorMinMaxObserver(fp8(is_dynamic=True))
    dyn.quant_max_first_level = 6.0
    dyn(torch.tensor([8.0]))
    dyn(torch.tensor([3.14159265]))
    assert torch.equal(dyn._calculate_qparams()[0], torch.tensor(3.14159265) / 2688.0)


def test_calculate_int_and_fp8_quant_params_from_the_formulas():
    obs = quark.PerTensorMinMaxObserver({"dtype": "uint4", "symmetric": False})
    s, z = obs.calculate_int_quant_params(torch.tensor([-1.0, 0.5]), torch.tensor([10.0, 2.0]))
    want_s = torch.tensor([11.0 / 15, 2.0 / 15])
    assert torch.equal(s, want_s)
    assert torch.equal(z, (0 - torch.round(torch.tensor([-1.0, 0.0]) / want_s)).int())
    s, z = quark.PerTensorMinMaxObserver({"dtype": "int8"}).calculate_int_quant_params(
        torch.tensor([-3.0]), torch.tensor([1.0]))
    assert torch.equal(s, torch.tensor([3.0 / 127.5])) and z.dtype == torch.int32
    s, z = obs.calculate_int_quant_params(torch.tensor(float("inf")), torch.tensor(-math.inf))
    assert torch.equal(s, torch.tensor([1.0])) and torch.equal(z, torch.tensor([0]))
    for dtype, top in (("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0), ("fp8_e5m3", 114688.0)):
        o = quark.PerTensorMinMaxObserver(fp8(dtype=dtype))
        s, z = o.calculate_fp8_quant_parameters(torch.tensor([-2.0]), torch.tensor([1.0]))
        assert torch.equal(s, torch.tensor([2.0]) / top) and not z.any()
    with pytest.raises(ValueError, match="integer dtype"):
        quark.PerTensorMinMaxObserver(fp8()).calculate_int_quant_params(
            torch.tensor([0.0]), torch.tensor([1.0]))


def test_mx_amax_is_the_block_absmax_running_or_last():
    xs = batches((4, 64))
    blocks = [x.reshape(4, 4, 16).abs().amax(-1) for x in xs]
    sta, dyn = quark.PerBlockMXObserver(mx("e8m0")), quark.PerBlockMXObserver(
        mx("e8m0", is_dynamic=True))
    assert torch.equal(sta.amax, torch.tensor(0.0))
    for x in xs:
        sta(x)
        dyn(x)
    assert torch.equal(sta.amax, torch.stack(blocks).amax(0))
    assert torch.equal(dyn.amax, blocks[-1])


@pytest.mark.parametrize("scale_format", ["float32", "e5m3", "e4m3"])
def test_mx_float_scale_formats_from_the_amax(scale_format):
    x = batches((8, 64))[1]
    obs = quark.PerBlockMXObserver(mx(scale_format))
    obs(x)
    amax = x.reshape(8, 4, 16).abs().amax(-1)
    scale, zp = obs.calculate_qparams()
    if scale_format == "float32":
        want = amax / 6.0
    elif scale_format == "e5m3":
        want = FP8_E5M3.round(amax / 6.0, 0.0, FP8_E5M3.max)
    else:  # NVFP4's two levels: global amax / (448 * 6)
        two = 448.0 * (6.0 / amax.max())
        want = (amax / 6.0 * two).to(torch.float8_e4m3fn).float() / two
    assert torch.equal(scale, want) and scale.shape == (8, 4) and not zp.any()


@pytest.mark.parametrize("cls, qspec", [
    (quark.PerTensorMinMaxObserver, {"dtype": "int8"}),
    (quark.PerChannelMinMaxObserver, {"dtype": "fp4", "qscheme": "per_channel", "ch_axis": -1}),
    (quark.PerGroupMinMaxObserver, {"dtype": "int4", "qscheme": "per_group", "ch_axis": -1,
                                    "group_size": 16}),
    (quark.PerBlockBFPObserver, {"dtype": "bfp16", "ch_axis": -1, "group_size": 8}),
])
def test_reset_state_reads_inf_and_minus_inf(cls, qspec):
    obs = cls(qspec)
    x = batches((4, 32))[0]
    obs(x)
    assert torch.isfinite(obs.min_val).all()
    obs.reset_state()
    assert torch.equal(obs.min_val, torch.tensor(math.inf))
    assert torch.equal(obs.max_val, torch.tensor(-math.inf))
    y = batches((4, 32), seed=1)[0]
    fresh = cls(qspec)
    obs(y)  # observes again from nothing
    fresh(y)
    assert torch.equal(obs.max_val, fresh.max_val) and torch.equal(obs.min_val, fresh.min_val)


def test_reset_state_after_a_statistic_is_deleted_raises_as_quark():
    mxo = quark.PerBlockMXObserver(mx("e8m0"))
    mxo(batches((2, 32))[0])
    mxo.reset_state()
    assert torch.equal(mxo.amax, torch.tensor(0.0))
    del mxo.amax
    with pytest.raises(RuntimeError, match="amax"):
        mxo.reset_state()
    ch = quark.PerChannelMinMaxObserver({"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0})
    del ch.min_val
    del ch.max_val
    with pytest.raises(AttributeError):
        ch.min_val  # noqa: B018
    with pytest.raises(RuntimeError, match="min_val"):
        ch.reset_state()


def test_no_data_qparams_are_quark_defaults():
    s, z = quark.PerTensorMinMaxObserver({"dtype": "int8"})._calculate_qparams()
    assert torch.equal(s, torch.tensor([1.0])) and torch.equal(z, torch.tensor([0]))
    s, z = quark.PerTensorMinMaxObserver(fp8())._calculate_qparams()
    assert torch.equal(s, torch.tensor(torch.finfo(torch.float32).eps)) and not z.any()


def test_mx_observer_without_scale_format_is_float32_before_and_after_data():
    """No scale_format reads as float32 (quark_spec's default) on both sides of the data."""
    none = quark.PerBlockMXObserver({k: v for k, v in mx("e8m0").items() if k != "scale_format"})
    f32 = quark.PerBlockMXObserver(mx("float32"))
    x = batches((4, 64))[0]
    for _ in range(2):
        for a, b in zip(none._calculate_qparams(), f32._calculate_qparams(), strict=True):
            assert torch.equal(a, b)
        none(x), f32(x)


def test_scale_format_e5m3_accepted_and_unknown_refused():
    spec = quark.quark_spec(mx("e5m3"))
    assert spec.layout.size == 16 and spec.format.name == "fp4_e2m1"
    with pytest.raises(ValueError, match="e5m3"):
        quark.quark_spec(mx("e3m4"))
    with pytest.raises(ValueError, match="per_group"):
        quark.quark_spec(fp8(scale_format="e5m3"))


@pytest.mark.parametrize("name, qspec", [
    *[("PerBlockMXObserver", mx(f, scale_calculation_mode=m)) for f, m in [
        ("e8m0", "even"), ("e8m0", "floor"), ("e8m0", "ceil"), ("e4m3", None), ("e5m3", None),
        ("float32", None)]],
    ("PerTensorMinMaxObserver", fp8()),
    ("PerGroupMinMaxObserver", fp8(qscheme="per_group", group_size=16, ch_axis=-1)),
    ("PerChannelMinMaxObserver", {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0}),
    ("PerTensorMinMaxObserver", {"dtype": "uint8", "symmetric": False}),
    ("PerBlockBFPObserver", {"dtype": "bfp16", "group_size": 8, "ch_axis": -1}),
    ("PerTensorPercentileObserver", {"dtype": "int8"}),
    ("PerTensorMSEObserver", {"dtype": "int8"}),
])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_or_inf_raise_at_calculate_qparams(name, qspec, bad):
    """docs/guide/observers.md: NaN / inf raise a ValueError naming the observer."""
    obs = getattr(quark, name)(qspec)
    x = batches((2, 64))[0]
    x[1, 3] = bad
    obs(x)
    with pytest.raises(ValueError, match=f"{name}.*NaN or inf"):
        obs.calculate_qparams()


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_mse_asymmetric_on_all_negative_data_raises(dtype):
    """Quark's search prices (0, centre) and asserts min <= max; here a ValueError naming the
    observer (not a scale that maps every value to 0)."""
    obs = quark.PerTensorMSEObserver({"dtype": dtype, "symmetric": False})
    obs(-torch.rand(32, 64, generator=torch.Generator().manual_seed(0)) * 3 - 0.5)
    with pytest.raises(ValueError, match="PerTensorMSEObserver.*negative"):
        obs.calculate_qparams()
    sym = quark.PerTensorMSEObserver({"dtype": dtype, "symmetric": True})
    sym(-torch.rand(32, 64) - 0.5)  # |x| from 0: fine
    assert sym.calculate_qparams()[0] > 0.5 / 128


# ------------------------------------------------------- against the installed Quark
def quark_cfg(**kw):
    from quark.torch.quantization.config.config import QTensorConfig
    from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType

    kw = {"qscheme": QSchemeType.per_tensor, "round_method": RoundType.half_even,
          "scale_type": ScaleType.float, "is_dynamic": False, **kw}
    kw["dtype"] = Dtype(kw["dtype"])
    kw["qscheme"] = QSchemeType(kw["qscheme"])
    return QTensorConfig(**kw)


def twins(name, **kw):
    from quark.torch.quantization.observer import observer as qo

    theirs_cls, ours_cls = getattr(qo, name), getattr(quark, name)
    c = quark_cfg(observer_cls=ours_cls, **kw)  # Quark's config takes our class
    return theirs_cls(c), ours_cls(c)


def same(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype or a.is_floating_point() == b.is_floating_point(), (a, b)
    assert torch.equal(a.to(b.dtype), b), (a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("dtype, symmetric", [("int8", True), ("uint8", False),
                                              ("uint4", False), ("int4", True)])
def test_calculate_int_quant_params_against_quark(dtype, symmetric):
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins("PerTensorMinMaxObserver", dtype=dtype, symmetric=symmetric)
    g = torch.Generator().manual_seed(3)
    lo, hi = -torch.rand(64, generator=g) * 5, torch.rand(64, generator=g) * 3
    hi[:4] = 0.0  # one-sided ranges
    for a, b in zip(ours.calculate_int_quant_params(lo, hi),
                    theirs.calculate_int_quant_params(lo, hi), strict=True):
        same(a, b)
    empty = (torch.tensor(math.inf), torch.tensor(-math.inf))
    for a, b in zip(ours.calculate_int_quant_params(*empty),
                    theirs.calculate_int_quant_params(*empty), strict=True):
        same(a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("first_level", [None, 6.0])
@pytest.mark.parametrize("dynamic", [False, True])
def test_fp8_per_tensor_against_quark(dtype, first_level, dynamic):
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins("PerTensorMinMaxObserver", dtype=dtype, is_dynamic=dynamic)
    theirs.quant_max_first_level = ours.quant_max_first_level = first_level
    g = torch.Generator().manual_seed(4)
    lo, hi = -torch.rand(16, generator=g) * 9, torch.rand(16, generator=g) * 9
    for a, b in zip(ours.calculate_fp8_quant_parameters(lo, hi),
                    theirs.calculate_fp8_quant_parameters(lo, hi), strict=True):
        same(a, b)
    for x in batches((4, 32)):
        theirs(x)
        ours(x)
    for a, b in zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True):
        same(a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("scale_format, mode", [("e8m0", "even"), ("e8m0", "floor"),
                                                ("e8m0", "ceil"), ("e4m3", None),
                                                ("e5m3", None), ("float32", None)])
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_amax_and_scales_against_quark(scale_format, mode, dynamic, dtype):
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins("PerBlockMXObserver", dtype="fp4", qscheme="per_group", group_size=16,
                         ch_axis=-1, scale_format=scale_format, scale_calculation_mode=mode,
                         is_dynamic=dynamic)
    for x in batches((2, 8, 64)):
        x[0, 0, :16] = 0.0  # a zero block: Quark fills eps
        x[0, 1, 16:32] = 1e-30  # a block far below E8M0's and E5M3's range
        theirs(x.to(dtype))
        ours(x.to(dtype))
    same(ours.amax, theirs.amax)
    for a, b in zip(ours.calculate_qparams(), theirs.calculate_qparams(), strict=True):
        assert a.dtype == b.dtype
        same(a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
def test_mx_float32_scale_with_first_level_and_channel_axis_against_quark():
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins("PerBlockMXObserver", dtype="fp8_e4m3", qscheme="per_group",
                         group_size=32, ch_axis=0, scale_format="float32")
    theirs.quant_max_first_level = ours.quant_max_first_level = 6.0
    x = batches((64, 3, 5))[2]
    theirs(x)
    ours(x)
    same(ours.amax, theirs.amax)
    same(ours.calculate_qparams()[0], theirs.calculate_qparams()[0])


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
def test_e5m3_rounding_against_quark_kernel():
    ref = pytest.importorskip("quark.torch.kernel.float8_e5m3.reference")
    g = torch.Generator().manual_seed(5)
    x = torch.rand(20000, generator=g) * 2.0 ** torch.randint(-20, 18, (20000,), generator=g)
    x = torch.cat([x, e5m3_grid().float(), ((e5m3_grid()[1:] + e5m3_grid()[:-1]) / 2).float()])
    same(FP8_E5M3.round(x, 0.0, FP8_E5M3.max), ref.reference_float32_qdq_to_float8_e5m3(x))


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name, kw", [
    ("PerChannelMinMaxObserver", {"dtype": "fp4", "qscheme": "per_channel", "ch_axis": -1}),
    ("PerTensorMinMaxObserver", {"dtype": "int8", "symmetric": True}),
    ("PerGroupMinMaxObserver", {"dtype": "int4", "qscheme": "per_group", "ch_axis": -1,
                                "group_size": 16, "symmetric": True}),
    ("PerBlockMXObserver", {"dtype": "fp8_e4m3", "qscheme": "per_group", "ch_axis": -1,
                            "group_size": 32, "scale_format": "e8m0"}),
])
def test_reset_state_against_quark(name, kw):
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins(name, **kw)
    x = batches((4, 64))[0]
    theirs(x)
    ours(x)
    theirs.reset_state()
    ours.reset_state()
    for stat in ("min_val", "max_val", "amax"):
        if hasattr(theirs, stat):
            same(getattr(ours, stat), getattr(theirs, stat))
    for obs in (theirs, ours):
        for stat in ("amax",) if name == "PerBlockMXObserver" else ("min_val", "max_val"):
            delattr(obs, stat)
    if name in ("PerChannelMinMaxObserver", "PerBlockMXObserver"):  # Quark checks these two
        for obs in (theirs, ours):
            with pytest.raises(RuntimeError):
                obs.reset_state()


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
def test_quark_config_and_fake_quantize_take_our_classes():
    pytest.importorskip("quark.torch.quantization.observer.observer")
    from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

    c = quark_cfg(dtype="fp8_e4m3", observer_cls=quark.PerTensorMinMaxObserver)
    fq = FakeQuantizeBase.get_fake_quantize(c)
    assert isinstance(fq.observer, quark.PerTensorMinMaxObserver)
    x = batches((4, 32))[1]
    fq.enable_observer()
    fq(x)
    assert torch.equal(fq.observer._calculate_qparams()[0], x.abs().max() / 448.0)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("dtype", ["fp4", "fp8_e4m3", "fp6_e2m3"])
@pytest.mark.parametrize("mode", ["even", "floor", "ceil"])
def test_get_scale_against_quark(dtype, mode):
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins("PerBlockMXObserver", dtype=dtype, qscheme="per_group", group_size=32,
                         ch_axis=-1, scale_format="e8m0", scale_calculation_mode=mode)
    g = torch.Generator().manual_seed(6)
    amax = torch.rand(5000, generator=g) * 2.0 ** torch.randint(-40, 40, (5000,), generator=g)
    amax[:2] = torch.tensor([0.0, 1e-40])
    eps = torch.finfo(torch.float32).eps
    for fmt in ("e8m0", "e4m3", "e5m3", "float32"):
        same(ours.get_scale(amax, eps, fmt), theirs.get_scale(amax, eps, fmt))


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name, kw, shape", [
    ("PerChannelMinMaxObserver", {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 1,
                                  "symmetric": True}, (4, 6, 8)),
    ("PerGroupMinMaxObserver", {"dtype": "uint4", "qscheme": "per_group", "ch_axis": 1,
                                "group_size": 8, "symmetric": False}, (4, 16, 3)),
    ("PerGroupMinMaxObserver", {"dtype": "fp8_e4m3", "qscheme": "per_group", "ch_axis": -1,
                                "group_size": 16}, (4, 32)),
    ("PerGroupMinMaxObserver", {"dtype": "fp8_e5m2", "qscheme": "per_group", "ch_axis": 0,
                                "group_size": 4}, (4, 8, 16)),
    ("PerTensorMinMaxObserver", {"dtype": "uint8", "symmetric": False}, (4, 32)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_minmax_families_against_quark(name, kw, shape, dtype):
    pytest.importorskip("quark.torch.quantization.observer.observer")
    if dtype == torch.bfloat16 and not kw.get("symmetric", True):
        pytest.skip("known difference: Quark prices an asymmetric bfloat16 range in bfloat16")
    theirs, ours = twins(name, **kw)
    for x in batches(shape):
        theirs(x.to(dtype))
        ours(x.to(dtype))
    for a, b in zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        same(a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("dtype, symmetric", [("uint8", False), ("int8", True), ("uint4", False)])
def test_histogram_pro_qparams_as_quark_returns_them(dtype, symmetric):
    """Quark's Pro returns torch.ao's ``_calculate_qparams``: ``(1,)`` tensors, the zero
    point int64 when symmetric, else int32; the values bit for bit (one batch)."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins("PerTensorHistogramObserverPro", dtype=dtype, symmetric=symmetric)
    x = batches((16, 32))[1]
    theirs(x)
    ours(x)
    for a, b in zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape == (1,), (a, b)
        same(a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name, kw", [
    ("PerTensorMinMaxObserver", {}),
    ("PerChannelMinMaxObserver", {"qscheme": "per_channel", "ch_axis": 0}),
    ("PerGroupMinMaxObserver", {"qscheme": "per_group", "ch_axis": -1, "group_size": 4}),
    ("PerGroupMinMaxObserver", {"qscheme": "per_group", "ch_axis": -1, "group_size": 32,
                                "scale_format": "e8m0", "scale_calculation_mode": "even"}),
    ("PerTensorHistogramObserver", {}),
])
@pytest.mark.parametrize("dtype", ["int8", "uint8", "fp8_e4m3"])
def test_qparams_before_data_as_quark(name, kw, dtype):
    """Before any data, Quark's defaults in Quark's shapes: ``(1,)`` integers, ``()`` fp8,
    ``(1, 1)`` per group (e8m0-scaled groups too); the histogram recorder as the min-max
    classes (Quark's prices the range it never set)."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    if dtype != "fp8_e4m3":
        kw = {**kw, "symmetric": dtype == "int8"}
    theirs, ours = twins(name, dtype=dtype, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Quark warns that no data was observed
        want = theirs._calculate_qparams()
    for a, b in zip(ours._calculate_qparams(), want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
        same(a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("mode", ["even", "floor", "ceil"])
@pytest.mark.parametrize("dtype", ["fp4", "fp8_e4m3"])
def test_mx_qparams_before_data_as_quark(mode, dtype):
    """``PerBlockMXObserver`` before data: Quark's E8M0 of its ``amax`` 0, ``2 ** -127``
    (the 'even' rule included), with float zeros."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins("PerBlockMXObserver", dtype=dtype, qscheme="per_group", ch_axis=-1,
                         group_size=32, scale_format="e8m0", scale_calculation_mode=mode)
    for fresh in (True, False):
        for a, b in zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
            same(a, b)
        x = batches((4, 64))[0]
        theirs(x), ours(x)
        theirs.reset_min_max_vals(), ours.reset_min_max_vals()  # before data again


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("dtype, extra", [
    ("int8", {"symmetric": True}), ("fp8_e4m3", {}),
    ("fp8_e4m3", {"scale_format": "e8m0", "scale_calculation_mode": "even"}),
    ("fp4", {"scale_format": "e8m0", "scale_calculation_mode": "even"}),
    ("fp4", {"scale_format": "e4m3"})])
def test_per_group_refuses_a_group_size_that_does_not_divide_the_axis(dtype, extra):
    """Quark's per-group class raises ValueError at forward for 40 columns in groups of 32,
    whatever the scale format (block formats take a padding layout here: refused too)."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins("PerGroupMinMaxObserver", dtype=dtype, qscheme="per_group",
                         ch_axis=-1, group_size=32, **extra)
    x = batches((4, 40))[0]
    with pytest.raises(ValueError):
        theirs(x)
    with pytest.raises(ValueError, match="not divisible by group_size=32|does not divide 40"):
        ours(x)
    ours(batches((4, 64))[0])  # a dividing width is observed


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("fmt", ["e8m0", "e4m3", "e5m3"])
@pytest.mark.parametrize("name, kw", [
    ("PerTensorMinMaxObserver", {}),
    ("PerChannelMinMaxObserver", {"qscheme": "per_channel", "ch_axis": 0}),
    ("PerTensorPercentileObserver", {}), ("PerTensorMSEObserver", {})])
def test_fp8_per_tensor_and_channel_ignore_scale_format_as_quark(name, kw, fmt):
    """Quark's fp8 formula on a per-tensor / per-channel range never reads scale_format
    (plain amax / 448): accepted, and the same qparams (quantscope refused the qspec). One
    batch: a widening one re-bins the histograms approximately (documented)."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins(name, dtype="fp8_e4m3", scale_format=fmt, **kw,
                         **({"scale_calculation_mode": "even"} if fmt == "e8m0" else {}))
    x = batches((4, 64))[0]
    theirs(x), ours(x)
    for a, b in zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        same(a, b)


#: Quark's integer observers, each with the arguments of its granularity
INT_CLASSES = [
    ("PerTensorMinMaxObserver", {}),
    ("PerChannelMinMaxObserver", {"qscheme": "per_channel", "ch_axis": 0}),
    ("PerGroupMinMaxObserver", {"qscheme": "per_group", "ch_axis": -1, "group_size": 32}),
    ("PerTensorMSEObserver", {}),
    ("PerTensorPercentileObserver", {}),
    ("PerTensorHistogramObserverPro", {}),
]


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name, kw", INT_CLASSES)
@pytest.mark.parametrize("dtype", ["uint8", "uint4"])
def test_unsigned_symmetric_zero_point_is_zero_as_quark(name, kw, dtype):
    """Quark's ``calculate_int_quant_params`` returns zero points 0 whenever symmetric."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins(name, dtype=dtype, symmetric=True, **kw)
    x = batches((4, 64))[1]
    theirs(x)
    ours(x)
    if name != "PerTensorHistogramObserverPro":  # torch.ao's qparams there (a known difference)
        for a, b in zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True):
            assert a.dtype == b.dtype, (a.dtype, b.dtype)
            same(a, b)
    lo, hi = torch.tensor([-1.0, -3.0]), torch.tensor([2.0, 0.5])
    for a, b in zip(ours.calculate_int_quant_params(lo, hi),
                    theirs.calculate_int_quant_params(lo, hi), strict=True):
        same(a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name, kw", INT_CLASSES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_scale_dtype_as_quark(name, kw, dtype):
    """Quark's scale dtype without a ``scale_type``: a per-tensor integer scale is lifted to
    float32 by Quark's float32 eps, histogram observers bin ``x.float()``, per channel /
    group keep the input's dtype."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins(name, dtype="int8", symmetric=True, **kw)
    x = batches((4, 64))[1].to(dtype)
    theirs(x)
    ours(x)
    for a, b in zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        same(a, b)
    lo, hi = -x.abs().amax(-1).to(dtype), x.abs().amax(-1).to(dtype)
    for rng in ((lo, hi), (lo[0], hi[0]), (torch.tensor(0), hi[0].float())):
        for a, b in zip(ours.calculate_int_quant_params(*rng),
                        theirs.calculate_int_quant_params(*rng), strict=True):
            assert a.dtype == b.dtype, (rng, a.dtype, b.dtype)


STATE_CLASSES = [
    *INT_CLASSES[:-1],  # Pro: the native state beside Quark's histogram.* (its own test)
    ("PerTensorMinMaxObserver", {"dtype": "fp8_e4m3"}),
    ("PerTensorHistogramObserver", {}),
    ("PerBlockBFPObserver", {"dtype": "bfp16", "qscheme": "per_group", "ch_axis": -1,
                             "group_size": 8}),
    ("PerBlockMXObserver", {"dtype": "fp4", "qscheme": "per_group", "group_size": 16,
                            "ch_axis": -1, "scale_format": "e8m0"}),
]


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name, kw", STATE_CLASSES)
def test_state_dict_has_quarks_keys_and_loads_strictly_both_ways(name, kw):
    """Quark registers its statistics non-persistent: its state_dict is empty, so ours is,
    each loads the other's with strict=True, and a load leaves the observer's state as is."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    kw = {"dtype": "int8", "symmetric": True, **kw}
    theirs, ours = twins(name, **kw)
    for o in (theirs, ours):
        o(batches((4, 64))[1])
    assert set(ours.state_dict()) == set(theirs.state_dict()) == set()
    before = ours._calculate_qparams()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    type(theirs)(theirs.qspec).load_state_dict(ours.state_dict(), strict=True)
    for a, b in zip(ours._calculate_qparams(), before, strict=True):
        same(a, b)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\).*"min_vals"'):
        ours.load_state_dict({"min_vals": torch.zeros(1)})


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
def test_fake_quantize_holding_ours_saves_quarks_keys():
    """Quark's StaticScaledFakeQuantize with our observer saves what it saves with Quark's
    (scale, zero_point), and either state loads strictly into the other."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    from quark.torch.quantization.observer import observer as qo
    from quark.torch.quantization.tensor_quantize import StaticScaledFakeQuantize

    theirs, ours = (StaticScaledFakeQuantize(quark_cfg(dtype="int8", symmetric=True,
                                                               observer_cls=cls))
                    for cls in (qo.PerTensorMinMaxObserver, quark.PerTensorMinMaxObserver))
    x = batches((16, 64))[1]
    theirs(x)
    ours(x)
    assert set(ours.state_dict()) == set(theirs.state_dict()) == {"scale", "zero_point"}
    for src, dst in ((theirs, ours), (ours, theirs)):
        dst.load_state_dict(src.state_dict(), strict=True)


CAST_CLASSES = [
    ("PerTensorMinMaxObserver", {}),
    ("PerTensorMinMaxObserver", {"dtype": "fp8_e4m3"}),
    ("PerChannelMinMaxObserver", {"qscheme": "per_channel", "ch_axis": 0}),
    ("PerGroupMinMaxObserver", {"dtype": "int4", "qscheme": "per_group", "ch_axis": -1,
                                "group_size": 16}),
    ("PerTensorMSEObserver", {}),
    ("PerTensorPercentileObserver", {}),
    ("PerTensorHistogramObserverPro", {}),
]


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name, kw", CAST_CLASSES)
@pytest.mark.parametrize("cast", ["half", "double", "bfloat16"])
@pytest.mark.parametrize("then", [None, torch.float32, torch.float16])
def test_module_cast_converts_eps_range_and_scales_as_quark(name, kw, cast, then):
    """``.half()`` / ``.double()`` / ``.bfloat16()`` convert Quark's min_val / max_val / eps
    buffers: eps, the range and the scale come in Quark's dtypes, before and after a next
    batch (min-max classes: the batch's dtype again; histograms: the cast's, their bin
    edges being cast). Values: Quark's, bit for bit after ``.double()``; after ``.half()`` /
    ``.bfloat16()`` up to the last bits of the cast dtype."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins(name, **{"dtype": "int8", "symmetric": True, **kw})
    x = batches((4, 64))[1]
    for o in (theirs, ours):
        o(x)
        getattr(o, cast)()
        if then is not None:
            o((x / 2).to(then))  # inside the range: Quark's bin edges stay as cast
    qparams = [o._calculate_qparams() for o in (ours, theirs)]
    pairs = [(ours.eps, theirs.eps), (ours.min_val, theirs.min_val),
             (ours.max_val, theirs.max_val), *zip(*qparams, strict=True)]
    # torch.ao counts a batch into a bfloat16 histogram in bfloat16 (it loses counts): Pro's
    # values then differ, its dtypes do not
    lossy = name.endswith("Pro") and cast == "bfloat16" and then is not None
    for a, b in pairs:
        assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
        if cast == "double" and then is None:  # Quark's formula in float64 (s58)
            assert torch.equal(a, b), (a, b)
        elif not lossy:
            torch.testing.assert_close(a, b, rtol=2 ** -7, atol=0, equal_nan=True)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name, kw", CAST_CLASSES[:3])
@pytest.mark.parametrize("cast", [lambda o: o.float(), lambda o: o.to(torch.float32)],
                         ids=["float", "to"])
def test_float_cast_after_a_half_batch_converts_the_range_as_quark(name, kw, cast):
    """Found by probing: a cast to float32 after a float16 batch left min_val / max_val and
    the per-channel / per-group scales in float16 (eps, float32 already, showed no cast)."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins(name, **{"dtype": "int8", "symmetric": True, **kw})
    x = batches((4, 64))[1].half()
    for o in (theirs, ours):
        o(x)
        cast(o)
    pairs = [(ours.min_val, theirs.min_val), (ours.max_val, theirs.max_val),
             *zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True)]
    for a, b in pairs:
        assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
        torch.testing.assert_close(a, b, rtol=2 ** -7, atol=0)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name", ["PerTensorPercentileObserver", "PerTensorMSEObserver"])
@pytest.mark.parametrize("dtype, symmetric", [("int8", True), ("uint8", False), ("int8", False)])
def test_histogram_edges_are_quarks_linspace(name, dtype, symmetric):
    """Quark's edges are ``torch.linspace(lo, hi, bins + 1)`` (not ``lo + i * width``): the
    edges, and the percentile / MSE thresholds read from them, bit for bit."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins(name, dtype=dtype, symmetric=symmetric)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g) * 1.5 + (0.5 if symmetric else 0.0)
    theirs(x)
    ours(x)
    same(ours.calib_bin_edges, theirs.calib_bin_edges)
    same(ours.calib_hist, theirs.calib_hist)
    for a, b in zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True):
        same(a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
def test_per_group_state_and_range_qparams_shapes_as_quark():
    """Quark's per-group ``min_val`` / ``max_val`` are flat; a given range's qparams come back
    ``(-1, groups)``."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins("PerGroupMinMaxObserver", dtype="uint4", qscheme="per_group", ch_axis=1,
                         group_size=8, symmetric=False)
    x = batches((4, 16, 3))[1]
    theirs(x)
    ours(x)
    same(ours.min_val, theirs.min_val)
    same(ours.max_val, theirs.max_val)
    for a, b in zip(ours.calculate_qparams(theirs.min_val, theirs.max_val),
                    theirs.calculate_qparams(theirs.min_val, theirs.max_val), strict=True):
        same(a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
def test_bfp_amax_and_int32_zero_point_as_quark():
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins("PerBlockBFPObserver", dtype="bfp16", qscheme="per_group", ch_axis=-1,
                         group_size=8)
    for a, b in zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)  # before data: Quark's eps
        same(a, b)
    g = torch.Generator().manual_seed(7)  # |x| in [1, 1.9): no block overflows, so Quark's
    x = (1 + 0.9 * torch.rand(8, 64, generator=g)) * torch.randn(8, 64, generator=g).sign()
    theirs(x)  # amax is the block absmax
    ours(x)
    same(ours.amax, theirs.amax)
    for a, b in zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        same(a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("steps", [127.4, 127.5, 127.58, 127.9])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_bfp_overflow_only_at_a_positive_code_of_128_as_quark(steps, sign):
    """Quark's forward bumps a BFP block's scale where a code reaches 128: its positive end
    at 127.5 steps or more; a negative end rounds to -128 at most, which int8 holds (probing
    found ours bumping there too, as the native 'even' rule does on either end)."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins("PerBlockBFPObserver", dtype="bfp16", qscheme="per_group", ch_axis=-1,
                         group_size=8)
    x = torch.tensor([[0.25, -0.5, 1.0, 0.75, -1.25, 0.125, sign * steps / 64, 1.5]] * 2)
    x[1] = -x[1]  # the other sign in the second row
    theirs(x)
    ours(x)
    for a, b in zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        same(a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("dtype, symmetric", [("int8", True), ("uint8", False), ("fp8_e4m3", True)])
def test_percentile_on_all_zero_data_as_quark(dtype, symmetric):
    """Quark's zero-mass histogram gives the range ``zeros(1)``: qparams of shape ``(1,)``."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    kw = {} if dtype.startswith("fp8") else {"symmetric": symmetric}
    theirs, ours = twins("PerTensorPercentileObserver", dtype=dtype, **kw)
    theirs(torch.zeros(4, 8))
    ours(torch.zeros(4, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = theirs._calculate_qparams()
    for a, b in zip(ours._calculate_qparams(), want, strict=True):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        same(a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("kw", [{"dtype": "mx", "mx_element_dtype": "int8"},
                                {"dtype": "int8", "scale_format": "e8m0", "symmetric": True},
                                {"dtype": "mx", "mx_element_dtype": "fp8_e4m3"}],
                         ids=["mx-int8", "int8-e8m0", "mx-fp8"])
def test_per_block_mx_observer_refuses_what_quark_refuses(kw):
    """Quark asserts fp4 / fp6 / fp8 dtypes; ours refuses the integer elements alike (an
    AssertionError) and takes Quark's MX dtype with a float element (Quark's older form)."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    from quark.torch.quantization.config.type import Dtype
    from quark.torch.quantization.observer import observer as qo

    kw = {**kw, "mx_element_dtype": Dtype(kw["mx_element_dtype"])} if "mx_element_dtype" in kw \
        else kw
    c = quark_cfg(observer_cls=qo.PerBlockMXObserver, qscheme="per_group", group_size=32,
                  ch_axis=-1, **kw)
    with pytest.raises(AssertionError):
        qo.PerBlockMXObserver(c)
    if kw["dtype"] == "mx" and kw["mx_element_dtype"] == Dtype.fp8_e4m3:
        assert quark.PerBlockMXObserver(c).spec.format.name == "fp8_e4m3"
    else:
        with pytest.raises(AssertionError, match="float elements only"):
            quark.PerBlockMXObserver(c)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
def test_mxint8_even_rounds_6_fraction_bits_where_quark_rounds_8():
    """The documented difference: on int8 elements Quark's even_round keeps 8 fraction bits
    (get_dtype_params), quantscope's rule 6 (OCP MXINT8's 1.6); on float ones they agree."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    from quark.torch.quantization.utils import even_round

    from quantscope.formats import get_format
    from quantscope.scales import e8m0_scale

    amax = torch.tensor([1.9921875, 1.999])  # 1 + 127/128 rounds up on 6 bits, not on 8
    # Quark's int8 emax is 0 (its shared exponent; ours is that over the codes' 2 ** 6)
    ours = e8m0_scale(amax, get_format("int8_narrow"), "even") * 64
    assert ours.tolist() == [2.0, 2.0] and even_round(amax, "int8").tolist() == [1.0, 2.0]
    assert torch.equal(e8m0_scale(amax, get_format("fp8_e4m3"), "even"),
                       even_round(amax, "fp8_e4m3"))


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name, kw", [
    ("UniformScalingObserver", {"dtype": "int8", "symmetric": True}),
    ("UniformScalingObserver", {"dtype": "uint8", "symmetric": False}),
    ("UniformScalingObserver", {"dtype": "fp8_e4m3"}),
    ("PerChannelMinMaxObserver", {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0,
                                  "symmetric": True}),
    ("PerGroupMinMaxObserver", {"dtype": "int4", "qscheme": "per_group", "ch_axis": 1,
                                "group_size": 16, "symmetric": True}),
    ("PerBlockMXObserver", {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1,
                            "group_size": 16, "scale_format": "e8m0",
                            "scale_calculation_mode": "floor"}),
    ("PerBlockBFPObserver", {"dtype": "bfp16", "qscheme": "per_group", "ch_axis": -1,
                             "group_size": 8})])
@pytest.mark.parametrize("positional", [False, True])
def test_eps_argument_as_quark_uses_or_drops_it(name, kw, positional):
    """Quark's uniform-scaling base and block observers take ``eps`` (the scale of a zero
    range); its per-channel / per-group ones take it and drop it: the same scales here."""
    qo = pytest.importorskip("quark.torch.quantization.observer.observer")

    base = name == "UniformScalingObserver"  # Quark's configs name only its subclasses
    cfg = quark_cfg(observer_cls=quark.PerTensorMinMaxObserver if base else getattr(quark, name),
                    **kw)
    args, kwargs = ((cfg, None, 1e-3), {}) if positional else ((cfg,), {"eps": 1e-3})
    theirs, ours = getattr(qo, name)(*args, **kwargs), getattr(quark, name)(*args, **kwargs)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    x[0] = 0.0  # zero units: where eps becomes the scale
    if base:  # its qparams of given ranges, a zero one among them
        lo, hi = x.amin(1), x.amax(1)
        pairs = zip(ours.calculate_qparams(lo, hi), theirs.calculate_qparams(lo, hi), strict=True)
    else:
        theirs(x)
        ours(x)
        pairs = zip(ours._calculate_qparams(), theirs._calculate_qparams(), strict=True)
    for a, b in pairs:
        same(a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
def test_eps_argument_refused_where_quark_has_none():
    qo = pytest.importorskip("quark.torch.quantization.observer.observer")

    cfg = quark_cfg(observer_cls=quark.PerTensorMinMaxObserver, dtype="int8", symmetric=True)
    for cls in (qo.PerTensorMinMaxObserver, quark.PerTensorMinMaxObserver):
        with pytest.raises(TypeError, match="unexpected keyword argument 'eps'"):
            cls(cfg, eps=1e-3)


# ------------------------------------------------------ Quark's public attributes (peers)
_UNIFORM = ["symmetric", "scale_type", "qscheme", "is_dynamic", "zero_point_type",
            "quant_min", "quant_max"]
_ATTRIBUTE_CASES = [
    ("PerTensorMinMaxObserver", {"dtype": "int8", "symmetric": True}, _UNIFORM),
    ("PerTensorMinMaxObserver", {"dtype": "uint8", "symmetric": False}, _UNIFORM),
    ("PerTensorMinMaxObserver", {"dtype": "fp8_e4m3"}, _UNIFORM),
    ("PerChannelMinMaxObserver", {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0,
                                  "symmetric": True}, [*_UNIFORM, "ch_axis"]),
    ("PerGroupMinMaxObserver", {"dtype": "int4", "qscheme": "per_group", "ch_axis": 1,
                                "group_size": 16, "symmetric": False},
     [*_UNIFORM, "ch_axis", "group_size", "group_count"]),
    ("PerBlockMXObserver", {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1,
                            "group_size": 32, "scale_format": "e8m0"},
     ["block_size", "axis", "mx_element_dtype", "is_dynamic", "eps"]),
    ("PerBlockBFPObserver", {"dtype": "bfp16", "qscheme": "per_group", "ch_axis": -1,
                             "group_size": 8}, ["block_size", "axis", "is_dynamic", "eps"]),
    ("PerTensorHistogramObserver", {"dtype": "int8", "symmetric": True}, _UNIFORM),
    ("PerTensorPercentileObserver", {"dtype": "uint8", "symmetric": False}, _UNIFORM),
    ("PerTensorMSEObserver", {"dtype": "fp8_e4m3"}, _UNIFORM),
    ("PerTensorHistogramObserverPro", {"dtype": "uint8", "symmetric": False}, _UNIFORM),
]


def same_attribute(ours, theirs, name):
    a, b = getattr(ours, name), getattr(theirs, name)
    assert type(a) is type(b) and a == b, (name, a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name, kw, names", _ATTRIBUTE_CASES,
                         ids=[f"{c[0]}-{c[1]['dtype']}" for c in _ATTRIBUTE_CASES])
def test_public_attributes_as_quarks_constructor_sets_them(name, kw, names):
    """The attributes Quark's constructors set, with Quark's values and types (group_count:
    that of the last observed tensor, kept by a reset); the uniform-scaling classes' eps is
    Quark's non-persistent float32 buffer (kept by a reset, not in the state dict)."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins(name, **kw)
    for n in names:
        same_attribute(ours, theirs, n)
    x = batches((4, 64))[0]
    theirs(x)
    ours(x)
    for n in names:
        same_attribute(ours, theirs, n)
    if not isinstance(theirs.eps, torch.Tensor):
        return
    same(ours.eps, theirs.eps)
    assert dict(ours.named_buffers())["eps"] is ours.eps and "eps" not in ours.state_dict()
    ours.reset_state()
    same(ours.eps, theirs.eps)
    assert ours.to("meta").eps.device.type == "meta"


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
def test_group_count_follows_the_last_tensor_and_survives_a_reset_as_quarks():
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins("PerGroupMinMaxObserver", dtype="int4", qscheme="per_group",
                         ch_axis=-1, group_size=8, symmetric=True)
    for shape in ((4, 64), (2, 16)):
        theirs(torch.randn(shape))
        ours(torch.randn(shape))
        same_attribute(ours, theirs, "group_count")
    theirs.reset_state()
    ours.reset_state()
    same_attribute(ours, theirs, "group_count")


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name, kw", [
    ("PerTensorMinMaxObserver", {"dtype": "int8", "symmetric": True}),
    ("PerChannelMinMaxObserver", {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0,
                                  "symmetric": True}),
    ("PerTensorMinMaxObserver", {"dtype": "fp8_e4m3"}),
    ("PerTensorHistogramObserver", {"dtype": "int8", "symmetric": True}),
    ("PerTensorHistogramObserverPro", {"dtype": "int8", "symmetric": True})])
def test_extra_repr_as_quarks(name, kw):
    """Quark's ``min_val=..., max_val=...`` (0-dim ranges print as numbers)."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins(name, **kw)
    assert ours.extra_repr() == theirs.extra_repr()  # before data: inf / -inf
    x = batches((4, 32))[0]
    theirs(x)
    ours(x)
    assert ours.extra_repr() == theirs.extra_repr()


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_placeholder_extra_repr_as_quarks(dtype):
    qo = pytest.importorskip("quark.torch.quantization.observer.observer")
    c = quark_cfg(observer_cls=qo.PlaceholderObserver, dtype=dtype)  # Quark's only, for casts
    assert quark.PlaceholderObserver(c).extra_repr() == qo.PlaceholderObserver(c).extra_repr()


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name, kw", [
    ("PerTensorMinMaxObserver", {"dtype": "fp4", "scale_format": "float32"}),
    ("PerGroupMinMaxObserver", {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1,
                                "group_size": 16, "scale_format": "e5m3"}),
    ("PerGroupMinMaxObserver", {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1,
                                "group_size": 16, "scale_format": "e4m3"}),
    ("PerGroupMinMaxObserver", {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1,
                                "group_size": 16, "scale_format": "e8m0",
                                "scale_calculation_mode": "floor"})])
def test_calculate_fp4_quant_parameters_as_quarks(name, kw):
    pytest.importorskip("quark.torch.quantization.observer.observer")
    theirs, ours = twins(name, **kw)
    g = torch.Generator().manual_seed(8)
    lo, hi = -torch.rand(64, generator=g) * 5, torch.rand(64, generator=g) * 3
    lo[:2], hi[:2] = 0.0, 0.0  # zero ranges: eps
    for a, b in zip(ours.calculate_fp4_quant_parameters(lo, hi),
                    theirs.calculate_fp4_quant_parameters(lo, hi), strict=True):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        same(a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("dtype, symmetric", [("int8", True), ("uint8", False),
                                              ("fp8_e4m3", True), ("fp8_e5m2", True)])
def test_mse_candidate_quantizers_as_quarks(dtype, symmetric):
    """PerTensorMSEObserver's ``int_fake_tensor_quant`` / ``scaling_fp8``: Quark's results."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    kw = {} if dtype.startswith("fp8") else {"symmetric": symmetric}
    theirs, ours = twins("PerTensorMSEObserver", dtype=dtype, **kw)
    centers = torch.linspace(-3.0, 5.0, 2049)[:-1] + 1 / 512
    for amax in (centers[-1], centers[1500], torch.tensor(1e-3)):
        if dtype.startswith("fp8"):
            a, b = ours.scaling_fp8(centers, amax), theirs.scaling_fp8(centers, amax)
        else:
            zero = torch.tensor(0)
            a = ours.int_fake_tensor_quant(centers, zero, amax)
            b = theirs.int_fake_tensor_quant(centers, zero, amax)
        assert a.dtype == b.dtype and torch.equal(a, b)
    if not dtype.startswith("fp8"):
        with pytest.raises(ValueError, match="Supported fp8 formats"):
            ours.scaling_fp8(centers, centers[-1])


def widening_batches(seed, factor):
    """Two batches, the second's max ``factor`` times the first's |x| max and its min not
    below the first's (Quark merges a batch that widens downward misaligned: its old counts
    stay at the first indices of the new bins, so only upward widening has a ground truth)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 64, generator=g) * 2, torch.randn(4, 64, generator=g) * 2
    y = (y * (factor * x.abs().max() / y.abs().max())).clamp(min=x.min())
    return x, y


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize(("factor", "dtype", "symmetric", "name"),
                         each_value([1.001, 1.5, 3.0],
                                    [("int8", True), ("uint8", False), ("int8", False)],
                                    ["PerTensorMSEObserver", "PerTensorPercentileObserver"]))
def test_widening_batch_searches_quarks_candidates(name, dtype, symmetric, factor):
    """A batch that widens the range: Quark appends bins of the first width and bins the
    batch over all of them; quantscope keeps that grid, so counts, edges and qparams are
    Quark's bit for bit. Where Quark's bin count is one off its edges' (its _num_bins and
    arange round apart) its MSE search fails on the sizes: quantscope's raises ValueError."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    for seed in range(4):
        theirs, ours = twins(name, dtype=dtype, symmetric=symmetric)
        x, y = widening_batches(seed, factor)
        for obs in (theirs, ours):
            obs(x)
            obs(y)
        same(ours.calib_bin_edges, theirs.calib_bin_edges)
        same(ours.calib_hist, theirs.calib_hist)
        if name == "PerTensorMSEObserver" and \
                ours.calib_hist.shape[-1] != ours.calib_bin_edges.shape[-1] - 1:
            with pytest.raises(RuntimeError):
                theirs._calculate_qparams()
            with pytest.raises(ValueError, match="bins and"):
                ours._calculate_qparams()
            continue
        (sa, za), (sb, zb) = ours._calculate_qparams(), theirs._calculate_qparams()
        if name == "PerTensorMSEObserver" and not torch.equal(sa, sb):
            # the documented difference: Quark's float32 mean orders two candidates within
            # its rounding; quantscope's float64 error takes the truly smaller one
            (f32_ours, f64_ours), (f32_theirs, f64_theirs) = (
                _quark_int_mse(theirs, o.max_val) for o in (ours, theirs))
            assert f64_ours < f64_theirs
            assert f32_ours == pytest.approx(f32_theirs, rel=2 ** -20)
            continue
        same(sa, sb)
        same(za, zb)
        same(ours.min_val, theirs.min_val)
        same(ours.max_val, theirs.max_val)


def _quark_int_mse(obs, amax):
    """Quark's float32 mean squared error of its histogram at the integer candidate ``amax``,
    and the float64 sum."""
    centers = (obs.calib_bin_edges[1:] + obs.calib_bin_edges[:-1]) / 2
    err = obs.int_fake_tensor_quant(centers, torch.tensor(0), amax) - centers
    return (float((err ** 2 * obs.calib_hist).mean()),
            float((err.double() ** 2 * obs.calib_hist.double()).sum()))
