"""Probe s27: compat.quark's Pro after a widening batch (torch.ao's merge, through its torch.ao
child), a static BFP16 batch of other ``(rows, blocks)``, a refused batch's dtype, block scale
formats on per-tensor fp4 / fp6 histogram classes, integer MX elements refused before the
spec, dtypes uint2 / int32. The tests marked ``peers`` run Quark itself (the peers' venv);
the others need torch only."""

from __future__ import annotations

import math

import pytest
import torch
from torch.ao.quantization import HistogramObserver

from quantscope.compat import quark
from quantscope.compat.quark_base import quark_qmin_qmax

_G = torch.Generator().manual_seed(27)
_X = torch.randn(8, 64, generator=_G)
_PRO = [("int8", True), ("uint8", False), ("uint4", False), ("uint8", True)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _pro_batches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 64, generator=g) * s + o for s, o in ((1, 0), (3, 0.5), (2, -4))]


# ------------------------------------------------------------------ 1: Pro's widening batches
@pytest.mark.parametrize("dtype, symmetric", _PRO)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pro_merges_widening_batches_as_torch_ao(dtype, symmetric, seed):
    """Quark's Pro is torch.ao's HistogramObserver with Quark's code range: after batches
    that widen the range up and down, the qparams are torch.ao's (the native grid re-binned
    its own way and gave other scales), and so after the first batch alone."""
    ao_dtype = {"int8": torch.qint8, "uint8": torch.quint8, "uint4": torch.quint4x2}[dtype]
    qmin, qmax = quark_qmin_qmax(dtype)
    ref = HistogramObserver(bins=256, dtype=ao_dtype, quant_min=qmin, quant_max=qmax,
                            qscheme=torch.per_tensor_symmetric if symmetric
                            else torch.per_tensor_affine)
    ours = quark.PerTensorHistogramObserverPro({"dtype": dtype, "qscheme": "per_tensor",
                                                "symmetric": symmetric})
    for i, x in enumerate(_pro_batches(seed)):
        ref(x)
        ours(x)
        want = ref._calculate_qparams(*ref._non_linear_param_search())
        got = ours._calculate_qparams()
        assert all(_same(a, b) for a, b in zip(got, want, strict=True)), (i, got, want)


def test_pro_reset_and_state_dict_carry_the_torch_ao_child():
    o = quark.PerTensorHistogramObserverPro({"dtype": "int8"})
    for x in _pro_batches(3):
        o(x)
    back = quark.PerTensorHistogramObserverPro({"dtype": "int8"})
    back.load_state_dict(o.state_dict(), strict=True)
    assert {"histogram.histogram", "histogram.min_val"} <= set(o.state_dict())
    assert all(_same(a, b) for a, b in zip(back._calculate_qparams(), o._calculate_qparams(),
                                           strict=True))
    o.reset_state()
    with pytest.raises(ValueError, match="before any tensor"):
        o._calculate_qparams()
    o(_X)
    fresh = quark.PerTensorHistogramObserverPro({"dtype": "int8"})
    fresh(_X)
    assert all(_same(a, b) for a, b in zip(o._calculate_qparams(), fresh._calculate_qparams(),
                                           strict=True))


# ------------------------------------------------------------------ 2: static BFP16 layouts
def _bfp(dynamic=False):
    return quark.PerBlockBFPObserver({"dtype": "bfp16", "qscheme": "per_group", "ch_axis": -1,
                                      "group_size": 32, "is_dynamic": dynamic})


@pytest.mark.parametrize("first, then", [((2, 64), (4, 32)), ((1, 128), (4, 32)),
                                         ((1, 64), (4, 64)), ((2, 64), (2, 96))])
def test_static_bfp_refuses_other_rows_and_blocks(first, then):
    """Quark's static amax is torch.max(amax, the batch's): another (rows, blocks) fails to
    broadcast (RuntimeError); quantscope's merged the blocks of unrelated layouts when the
    block count stayed the same ((2, 64) then (4, 32): 4 blocks each)."""
    obs = _bfp()
    a = torch.zeros(first)
    a.view(-1)[-1] = 100.0
    obs(a)
    before = obs._calculate_qparams()
    with pytest.raises(quark.StateShapeError, match=r"\(rows, blocks\)") as info:
        obs(torch.full(then, 0.01))
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)
    assert all(_same(a, b) for a, b in zip(obs._calculate_qparams(), before, strict=True))
    obs(a)  # the same layout still merges
    dyn = _bfp(dynamic=True)
    dyn(a)
    dyn(torch.full(then, 0.01))  # dynamic: each batch alone, as Quark's
    assert dyn._calculate_qparams()[0].shape == (math.prod(then[:-1]), -(-then[-1] // 32))


# ------------------------------------------------------------------ 3: a refused batch's dtype
def test_a_refused_batch_leaves_the_range_dtype():
    """PerGroupMinMaxObserver refuses a batch whose axis its group size does not divide:
    the float16 batch switched the observer to float16 before the check (scales rounded)."""
    spec = {"dtype": "int8", "qscheme": "per_group", "ch_axis": 0, "group_size": 8}
    obs = quark.PerGroupMinMaxObserver(spec)
    obs(_X * 3.3331)
    before = obs._calculate_qparams()
    with pytest.raises(ValueError, match="does not divide"):
        obs(torch.randn(4, 16).half())
    assert obs.min_val.dtype == torch.float32
    assert all(_same(a, b) for a, b in zip(obs._calculate_qparams(), before, strict=True))
    fp8 = quark.PerGroupMinMaxObserver({**spec, "dtype": "fp8_e4m3"})
    with pytest.raises(ValueError, match="does not divide"):
        fp8(torch.randn(4, 16).half())
    scale, _ = fp8._calculate_qparams()  # before data: Quark's float32 range (inf, -inf)
    assert scale.dtype == torch.float32 and fp8.min_val.dtype == torch.float32


# ------------------------------------------------------------------ 4: fp4 / fp6 scale formats
_HIST = ["PerTensorPercentileObserver", "PerTensorHistogramObserver", "PerTensorMSEObserver"]


@pytest.mark.parametrize("name", _HIST)
@pytest.mark.parametrize("fmt", ["e8m0", "e5m3", "e4m3"])
def test_histogram_classes_take_block_scale_formats_on_fp4_per_tensor(name, fmt):
    """Quark's histogram classes price fp4 with get_scale(scale_format), as its min-max
    classes: quantscope's refused the qspec at construction ("needs qscheme per_group")."""
    kw = {"dtype": "fp4", "qscheme": "per_tensor", "scale_format": fmt}
    obs = getattr(quark, name)(kw)
    obs(_X)
    if name == "PerTensorMSEObserver":  # Quark's search prices int / fp8 only
        with pytest.raises(ValueError, match="MSE search prices"):
            obs._calculate_qparams()
        return
    scale, zp = obs._calculate_qparams()
    want, _ = quark.PerTensorMinMaxObserver(kw).calculate_qparams(obs.min_val, obs.max_val)
    assert _same(scale, want) and not zp.any()


@pytest.mark.parametrize("dtype", ["fp6_e2m3", "fp6_e3m2"])
@pytest.mark.parametrize("name", ["PerTensorMinMaxObserver", "PerTensorHistogramObserver"])
def test_fp6_per_tensor_takes_a_block_scale_format_unread(dtype, name):
    """Quark prices fp6 with its integer formula, which never reads scale_format: the qspec
    builds, before data Quark's ([1.], [0]), after data its assert."""
    obs = getattr(quark, name)({"dtype": dtype, "qscheme": "per_tensor", "scale_format": "e8m0"})
    scale, zp = obs._calculate_qparams()
    assert _same(scale, torch.tensor([1.0])) and _same(zp, torch.tensor([0]))
    obs(_X)
    with pytest.raises(quark.UnsupportedElementError):
        obs._calculate_qparams()


# ------------------------------------------------------------------ 5: integer MX elements
@pytest.mark.parametrize("dtype, fmt", [("int8", "e4m3"), ("int4", "e4m3"), ("uint8", "e8m0"),
                                        ("uint8", "e4m3"), ("int8", "e8m0"), ("uint2", "e8m0")])
def test_mx_integer_elements_raise_the_documented_error(dtype, fmt):
    """Some integer elements' block scales made QuantSpec raise a plain ValueError before the
    element check: not the AssertionError Quark's assert raises."""
    with pytest.raises(quark.UnsupportedElementError, match="float elements only"):
        quark.PerBlockMXObserver({"dtype": dtype, "qscheme": "per_group", "group_size": 32,
                                  "ch_axis": -1, "scale_format": fmt})


# ------------------------------------------------------------------ 6: uint2 / int32
def test_uint2_is_priced_and_int32_refused_by_name():
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    obs = quark.PerTensorMinMaxObserver({"dtype": "uint2", "qscheme": "per_tensor",
                                         "symmetric": False})
    assert (obs.quant_min, obs.quant_max) == (0, 3)
    obs(x)
    scale, zp = obs._calculate_qparams()
    want = (x.max() - x.min()) / 3  # Quark's asymmetric formula: 1.8419074, zero point 1
    assert torch.equal(scale, want) and int(zp) == int(-torch.round(x.min() / want)) == 1
    with pytest.raises(ValueError, match="dtype 'int32' is not supported.*16 bits"):
        quark.PerTensorMinMaxObserver({"dtype": "int32", "qscheme": "per_tensor"})


# ------------------------------------------------------------------ against Quark itself
def _both(theirs, ours, batches):
    out = []
    for o in (theirs, ours):
        try:
            for b in batches:
                o(b)
            out.append(o._calculate_qparams())
        except Exception as e:  # noqa: BLE001 (the types are compared)
            out.append(e)
    return out


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("dtype, symmetric", _PRO)
def test_pro_widening_as_quark(dtype, symmetric):
    pytest.importorskip("quark.torch.quantization.observer.observer")
    from quark_twins import quark_twins
    for seed in range(4):
        theirs, ours = quark_twins("PerTensorHistogramObserverPro", dtype=dtype,
                                   symmetric=symmetric)
        got, want = _both(ours, theirs, _pro_batches(seed))
        assert all(_same(a, b) for a, b in zip(got, want, strict=True)), (seed, got, want)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
def test_bfp_layout_change_raises_as_quark():
    pytest.importorskip("quark.torch.quantization.observer.observer")
    from quark_twins import quark_twins
    theirs, ours = quark_twins("PerBlockBFPObserver", dtype="bfp16", qscheme="per_group",
                               ch_axis=-1, group_size=32, symmetric=True)
    for o in (theirs, ours):
        o(torch.randn(2, 64))
        with pytest.raises(RuntimeError):
            o(torch.randn(4, 32))


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
def test_refused_batch_dtype_as_quark():
    pytest.importorskip("quark.torch.quantization.observer.observer")
    from quark_twins import quark_twins
    for dtype, first in (("int8", [_X * 3.3331]), ("fp8_e4m3", [])):
        pair = quark_twins("PerGroupMinMaxObserver", dtype=dtype, qscheme="per_group",
                           ch_axis=0, group_size=8, symmetric=True)
        for o in pair:
            for b in first:
                o(b)
            with pytest.raises(ValueError):
                o(torch.randn(4, 16).half())
        (st, zt), (so, zo) = (o._calculate_qparams() for o in pair)
        assert _same(so, st) and torch.equal(zo, zt), (dtype, so, st)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name", [*_HIST, "PerTensorMinMaxObserver"])
@pytest.mark.parametrize("dtype", ["fp4", "fp6_e2m3"])
@pytest.mark.parametrize("fmt, mode", [("e8m0", "even"), ("e8m0", "floor"), ("e8m0", "ceil"),
                                       ("e5m3", None), ("e4m3", None)])
def test_fp4_fp6_block_scale_formats_per_tensor_as_quark(name, dtype, fmt, mode):
    """Values and error types equal Quark's after data on several ranges, and before data
    (but Quark's NaN e4m3 scale of a zero amax, a known difference; Quark's histogram
    recorder never sets a range after data, another)."""
    pytest.importorskip("quark.torch.quantization.observer.observer")
    from quark_twins import quark_twins
    for seed, symmetric in ((0, True), (1, True), (2, False), (3, True)):
        g = torch.Generator().manual_seed(seed)
        batches = [] if seed == 0 else [torch.randn(4, 64, generator=g) * 10.0 ** (seed - 2)
                                        + 0.1 * seed for _ in range(2)]
        if batches and name == "PerTensorHistogramObserver":
            continue
        theirs, ours = quark_twins(name, dtype=dtype, symmetric=symmetric, scale_format=fmt,
                                   **({"scale_calculation_mode": mode} if mode else {}))
        want, got = _both(theirs, ours, batches)
        if isinstance(want, Exception) or isinstance(got, Exception):
            # both raise (before data Quark's percentile / MSE: AttributeError, ours ValueError)
            assert isinstance(want, Exception) and isinstance(got, Exception), (got, want)
            assert isinstance(want, AssertionError) == isinstance(got, AssertionError)
        elif not (fmt == "e4m3" and not batches and dtype == "fp4"):
            assert all(_same(a, b) for a, b in zip(got, want, strict=True)), (seed, got, want)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("dtype, fmt", [("int8", "e4m3"), ("int4", "e4m3"), ("uint8", "e8m0"),
                                        ("uint8", "e4m3")])
def test_mx_integer_elements_assert_as_quark(dtype, fmt):
    pytest.importorskip("quark.torch.quantization.observer.observer")
    from quark_twins import qo, quark_config
    c = quark_config("PerBlockMXObserver", dtype=dtype, qscheme="per_group", ch_axis=-1,
                     group_size=32, symmetric=True, scale_format=fmt)
    for cls in (qo.PerBlockMXObserver, quark.PerBlockMXObserver):
        with pytest.raises(AssertionError):
            cls(c)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name, kw", [
    ("PerTensorMinMaxObserver", {}),
    ("PerChannelMinMaxObserver", {"qscheme": "per_channel", "ch_axis": 0}),
    ("PerGroupMinMaxObserver", {"qscheme": "per_group", "ch_axis": -1, "group_size": 16}),
    ("PerTensorPercentileObserver", {})])
@pytest.mark.parametrize("symmetric", [True, False])
def test_uint2_as_quark(name, kw, symmetric):
    pytest.importorskip("quark.torch.quantization.observer.observer")
    from quark_twins import quark_twins
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        batches = [torch.randn(4, 64, generator=g) * (1 + k) + 0.5 * seed for k in range(2)]
        theirs, ours = quark_twins(name, dtype="uint2", symmetric=symmetric, **kw)
        assert (ours.quant_min, ours.quant_max) == (theirs.quant_min, theirs.quant_max)
        want, got = _both(theirs, ours, batches)
        assert all(_same(a, b) for a, b in zip(got, want, strict=True)), (seed, got, want)
