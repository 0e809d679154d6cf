"""compat.quark against AMD Quark 0.13 on integer and bool input: the classes Quark's
observers take it in (min-max, histogram, percentile, MSE, MX, BFP16, placeholder) give its
qparams bit for bit and keep its statistics' dtypes (min-max: the input's; MX / BFP16 amax:
float32); where Quark's torch ops fail (``abs`` of a bool range, torch.ao's histogram of any
integer) ours raise a ``NotImplementedError`` too.

Every test imports Quark and compares with its own classes (the peers' venv).
"""

from __future__ import annotations

import pytest
import torch
from quark_twins import qo

from quantscope.compat import quark

pytestmark = [pytest.mark.peers, pytest.mark.xdist_group("quark")]
pytest.importorskip("quark")  # quark_twins imports quark.torch when a test first uses it

INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
MINMAX = [("PerTensorMinMaxObserver", {}),
          ("PerChannelMinMaxObserver", {"qscheme": "per_channel", "ch_axis": 0}),
          ("PerGroupMinMaxObserver", {"qscheme": "per_group", "ch_axis": 1, "group_size": 4})]
HISTOGRAMS = ["PerTensorHistogramObserver", "PerTensorPercentileObserver",
              "PerTensorMSEObserver"]


def twins(name, quark_cls=False, **kw):
    """Quark's class and ours on one ``QTensorConfig`` (it takes our class as observer_cls;
    ``quark_cls``: Quark's, which a cast dtype's config requires)."""
    from quark.torch.quantization.config.config import QTensorConfig
    from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType

    kw = {"qscheme": "per_tensor", "round_method": RoundType.half_even, "scale_type": "float",
          "is_dynamic": False, "symmetric": True, **kw}
    kw["dtype"], kw["qscheme"] = Dtype(kw["dtype"]), QSchemeType(kw["qscheme"])
    kw["scale_type"] = ScaleType(kw["scale_type"])
    c = QTensorConfig(observer_cls=getattr(qo if quark_cls else quark, name), **kw)
    return getattr(qo, name)(c), getattr(quark, name)(c)


def batches(dtype, seed=0):
    """Two (4, 8) batches of ``dtype``; signed ones within [-60, 60] (Quark computes an int8
    range's ``max - min`` in int8, which wraps past 127: see the docs' known difference)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return [torch.rand(4, 8, generator=g) > 0.5 for _ in range(2)]
    lo = 0 if dtype == torch.uint8 else -60
    return [torch.randint(lo, 60, (4, 8), generator=g).to(dtype) for _ in range(2)]


def observe(obs, xs):
    for x in xs:
        assert obs(x) is x  # Quark returns its input
    return obs._calculate_qparams()


def same(theirs, ours):
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (theirs, ours)
    assert torch.equal(ours, theirs), (theirs, ours)


def test_repro_int32_per_tensor():
    theirs, ours = twins("PerTensorMinMaxObserver", dtype="int8")
    x = torch.tensor([-100, 3, 50, 7], dtype=torch.int32)
    for t, o in zip(observe(theirs, [x]), observe(ours, [x]), strict=True):
        same(t, o)
    assert ours._calculate_qparams()[0].item() == pytest.approx(100 / 127.5)


@pytest.mark.parametrize("dtype", [*INTS, torch.bool])
@pytest.mark.parametrize(("name", "kw"), MINMAX)
@pytest.mark.parametrize(("qdtype", "symmetric"), [("int8", True), ("uint8", False),
                                                   ("fp8_e4m3", True)])
def test_minmax_integer_input(name, kw, qdtype, symmetric, dtype):
    theirs, ours = twins(name, dtype=qdtype, symmetric=symmetric, **kw)
    xs = batches(dtype)
    if dtype == torch.bool and qdtype == "fp8_e4m3":  # Quark's amax: abs() of a bool range
        for x in xs:
            theirs(x), ours(x)
        with pytest.raises(NotImplementedError):
            theirs._calculate_qparams()
        with pytest.raises(NotImplementedError, match="bool"):
            ours._calculate_qparams()
        with pytest.raises(TypeError):  # quantscope's bad-input type too
            ours._calculate_qparams()
        return
    for t, o in zip(observe(theirs, xs), observe(ours, xs), strict=True):
        same(t, o)
    same(theirs.min_val, ours.min_val)  # in the input's dtype, as Quark's
    same(theirs.max_val, ours.max_val)
    for t, o in zip(theirs.calculate_qparams(theirs.min_val, theirs.max_val),
                    ours.calculate_qparams(ours.min_val, ours.max_val), strict=True):
        same(t, o)


@pytest.mark.parametrize("dtype", [*INTS, torch.bool])
@pytest.mark.parametrize("name", HISTOGRAMS)
@pytest.mark.parametrize(("qdtype", "symmetric"), [("int8", True), ("uint8", False),
                                                   ("fp8_e4m3", True)])
def test_histograms_bin_the_float32_values(name, qdtype, symmetric, dtype):
    theirs, ours = twins(name, dtype=qdtype, symmetric=symmetric)
    if name == "PerTensorHistogramObserver":  # ours estimates (see its docstring): the bins
        for x in batches(dtype):
            theirs(x), ours(x)
        same(theirs.calib_hist, ours.calib_hist)
        same(theirs.calib_bin_edges, ours.calib_bin_edges)
        return
    for t, o in zip(observe(theirs, batches(dtype)), observe(ours, batches(dtype)),
                    strict=True):
        same(t, o)


@pytest.mark.parametrize("dtype", [*INTS, torch.bool])
def test_histogram_pro_fails_as_quarks(dtype):
    theirs, ours = twins("PerTensorHistogramObserverPro", dtype="int8")
    x = batches(dtype)[0]
    with pytest.raises(NotImplementedError):
        theirs(x)
    with pytest.raises(NotImplementedError, match=str(dtype)):
        ours(x)
    assert not ours.has_observed


def blocks(name, **kw):
    if name == "PerBlockBFPObserver":
        return twins(name, dtype="bfp16", qscheme="per_group", group_size=8, ch_axis=-1, **kw)
    return twins(name, dtype="fp4", qscheme="per_group", group_size=4, ch_axis=-1,
                 scale_format="e8m0", **kw)


@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize("name", ["PerBlockMXObserver", "PerBlockBFPObserver"])
def test_blocks_integer_input(name, dtype):
    theirs, ours = blocks(name)
    for t, o in zip(observe(theirs, batches(dtype)), observe(ours, batches(dtype)),
                    strict=True):
        same(t, o)
    same(theirs.amax, ours.amax)  # float32: Quark's running max starts from a float32 zero


@pytest.mark.parametrize("name", ["PerBlockMXObserver", "PerBlockBFPObserver"])
def test_blocks_bool_fails_as_quarks(name):
    theirs, ours = blocks(name)
    x = batches(torch.bool)[0]
    with pytest.raises(NotImplementedError):
        theirs(x)
    with pytest.raises(NotImplementedError, match="bool"):
        ours(x)


def test_mx_amax_dtype_after_mixed_batches():
    """int then float16: Quark's float32 amax stays float32; float16 then int: float16."""
    for first, second in ((torch.int32, torch.float16), (torch.float16, torch.int32)):
        theirs, ours = blocks("PerBlockMXObserver")
        xs = [batches(torch.int8)[0].to(first), batches(torch.int8, 1)[0].to(second)]
        for t, o in zip(observe(theirs, xs), observe(ours, xs), strict=True):
            same(t, o)
        same(theirs.amax, ours.amax)


def test_minmax_integer_then_float_batch():
    theirs, ours = twins("PerTensorMinMaxObserver", dtype="int8")
    xs = [batches(torch.int16)[0], batches(torch.int8, 1)[0].to(torch.float16) / 3]
    for t, o in zip(observe(theirs, xs), observe(ours, xs), strict=True):
        same(t, o)
    same(theirs.min_val, ours.min_val)


@pytest.mark.parametrize("dtype", [*INTS, torch.bool])
def test_placeholder_passes_integer_input(dtype):
    theirs, ours = twins("PlaceholderObserver", True, dtype="float16")
    x = batches(dtype)[0]
    assert theirs(x) is x and ours(x) is x
    assert theirs._calculate_qparams() is None and ours._calculate_qparams() is None
