"""compat.quark against AMD Quark 0.13 where a second probe found it differ: cast dtypes on
min-max classes, integer-typed ranges, fp4 per-tensor / per-channel block scale formats, a
qscheme that contradicts the class, NVFP4's all-zero tensor and zero blocks, the exception
type of an inverted range, quark_e8m0_scale's message. Runs in the peers' venv."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

pytestmark = [pytest.mark.peers, pytest.mark.xdist_group("quark")]

pytest.importorskip("quark")  # quark_twins imports quark.torch when a test first uses it

from quark_twins import qconfig, qo, qtypes, quark_config, quark_twins

from quantscope.compat import quark
from quantscope.layout import Block
from quantscope.qparams import qparams_from_range
from quantscope.spec import QuantSpec


def _cfg(name: str, **kw):
    return quark_config(name, **{"symmetric": True, **kw})


def _pair(name: str, **kw):
    return quark_twins(name, **{"symmetric": True, **kw})


def _quiet(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*args)


def _assert_same(a, b):
    """Bitwise, the sign of zero included."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, (x, y)
        assert torch.equal(x, y) and torch.equal(x.signbit(), y.signbit()), (x, y)


_X = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))


# 1. a cast dtype on a min-max class: Quark's config takes it with PlaceholderObserver only
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["PerTensorMinMaxObserver", "PerChannelMinMaxObserver"])
def test_cast_dtype_on_a_min_max_class_raises_when_built(name, dtype):
    with pytest.raises(ValueError, match="PlaceholderObserver"):
        qconfig.QTensorConfig(dtype=qtypes.Dtype(dtype), qscheme=qtypes.QSchemeType.per_tensor,
                              observer_cls=getattr(qo, name))
    with pytest.raises(ValueError, match=rf"{name}.*'{dtype}'.*PlaceholderObserver"):
        getattr(quark, name)({"dtype": dtype, "qscheme": "per_tensor", "ch_axis": 0})
    assert quark.PlaceholderObserver({"dtype": dtype})._calculate_qparams() is None


# 2. integer-typed ranges: Quark's division promotes them to float32
@pytest.mark.parametrize(("dtype", "symmetric"), [("int8", True), ("uint8", False),
                                                  ("int4", True)])
def test_integer_typed_range_takes_quarks_float_scale(dtype, symmetric):
    theirs, ours = _pair("PerChannelMinMaxObserver", dtype=dtype, qscheme="per_channel",
                         ch_axis=0, symmetric=symmetric)
    lo, hi = torch.tensor([-3, -1, 0]), torch.tensor([4, 2, 0])
    _assert_same(ours.calculate_qparams(lo, hi), theirs.calculate_qparams(lo, hi))


def test_fp4_integer_range_keeps_eps_then_a_zero_range_gets_it():
    theirs, ours = _pair("PerTensorMinMaxObserver", dtype="fp4", scale_format="float32")
    lo, hi = torch.tensor([-3, -1]), torch.tensor([4, 2])
    _assert_same(ours.calculate_qparams(lo, hi), theirs.calculate_qparams(lo, hi))
    z = torch.tensor(0.0)
    _assert_same(ours.calculate_qparams(z, z), theirs.calculate_qparams(z, z))
    assert ours.eps.dtype == torch.float32 and ours.eps.item() == theirs.eps.item()


# 3. fp4 per tensor / per channel with a block scale format: Quark's get_scale
@pytest.mark.parametrize(("scale_format", "mode"), [("e8m0", None), ("e8m0", "even"),
                                                    ("e8m0", "floor"), ("e8m0", "ceil"),
                                                    ("e4m3", None), ("e5m3", None),
                                                    ("float32", None)])
@pytest.mark.parametrize(("name", "qscheme", "ch_axis"),
                         [("PerTensorMinMaxObserver", "per_tensor", None),
                          ("PerChannelMinMaxObserver", "per_channel", 0),
                          ("PerChannelMinMaxObserver", "per_channel", 1)])
def test_fp4_tensor_and_channel_block_scale_formats_are_quarks(name, qscheme, ch_axis,
                                                              scale_format, mode):
    kw = {} if mode is None else {"scale_calculation_mode": mode}
    theirs, ours = _pair(name, dtype="fp4", qscheme=qscheme, ch_axis=ch_axis,
                         scale_format=scale_format, **kw)
    x = _X.clone()
    x[1] = 0.0  # a zero channel: eps / the e8m0 fill
    for m in (theirs, ours):
        m(x)
    _assert_same(_quiet(ours._calculate_qparams), _quiet(theirs._calculate_qparams))
    lo, hi = ours.min_val, ours.max_val
    _assert_same(ours.calculate_qparams(lo, hi), theirs.calculate_qparams(lo, hi))


# 4. a qscheme the class does not take; a missing ch_axis
@pytest.mark.parametrize(("name", "kw"), [
    ("PerTensorMinMaxObserver", {"qscheme": "per_channel", "ch_axis": 0}),
    ("PerTensorMinMaxObserver", {"qscheme": "per_group", "ch_axis": -1, "group_size": 4}),
    ("PerChannelMinMaxObserver", {"qscheme": "per_tensor", "ch_axis": 0}),
    ("PerGroupMinMaxObserver", {"qscheme": "per_tensor", "ch_axis": -1, "group_size": 4}),
    ("PerGroupMinMaxObserver", {"qscheme": "per_channel", "ch_axis": 0, "group_size": 4})])
def test_qscheme_contradicting_the_class_raises(name, kw):
    with pytest.raises(ValueError):
        _cfg(name, dtype="int8", **kw)
    with pytest.raises(ValueError, match=rf"{name}: qscheme '{kw['qscheme']}'.*takes"):
        getattr(quark, name)({"dtype": "int8", **kw})


def test_qscheme_left_out_is_the_classs():
    ours = quark.PerChannelMinMaxObserver({"dtype": "int8", "ch_axis": 0})
    theirs = qo.PerChannelMinMaxObserver(_cfg("PerChannelMinMaxObserver", dtype="int8",
                                              qscheme="per_channel", ch_axis=0))
    for m in (theirs, ours):
        m(_X)
    _assert_same(ours._calculate_qparams(), theirs._calculate_qparams())


def test_per_channel_without_ch_axis_raises():
    with pytest.raises(ValueError, match="ch_axis"):
        quark.PerChannelMinMaxObserver({"dtype": "int8", "qscheme": "per_channel"})


def test_block_mx_without_ch_axis_raises_quarks_assertion():
    spec = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0"}
    with pytest.raises(AssertionError):
        qo.PerBlockMXObserver(_QSpec(**spec))
    with pytest.raises(ValueError, match="ch_axis") as info:
        quark.PerBlockMXObserver(spec)
    assert isinstance(info.value, AssertionError)


class _QSpec:
    """A QTensorConfig-like object Quark's constructor reads (its config would refuse it)."""

    def __init__(self, **kw):
        self.__dict__.update({"scale_type": None, "scale_format": None, "ch_axis": None,
                              "scale_calculation_mode": None, "mx_element_dtype": None,
                              "zero_point_type": None, "group_size": None, "is_dynamic": False,
                              "symmetric": True, **kw})
        self.dtype, self.qscheme = qtypes.Dtype(self.dtype), qtypes.QSchemeType(self.qscheme)


# 5. NVFP4 (e4m3): an all-zero tensor (Quark: NaN) and a zero block's +0.0
def _native_zero(shape):
    spec = QuantSpec("fp4_e2m1", Block(1, -1), scale="fp8_e4m3")
    z = torch.zeros(*shape, 1)
    return qparams_from_range(z, z, spec).effective_scale.reshape(shape)


def test_e4m3_all_zero_tensor_gives_the_native_finite_scale():
    theirs, ours = _pair("PerBlockMXObserver", dtype="fp4", qscheme="per_group", ch_axis=-1,
                         group_size=16, scale_format="e4m3")
    z = torch.zeros(2, 32)
    for m in (theirs, ours):
        m(z)
    assert _quiet(theirs._calculate_qparams)[0].isnan().all()  # Quark's
    scale, zp = ours._calculate_qparams()
    assert torch.equal(scale, _native_zero((2, 2))) and bool(torch.isfinite(scale).all())
    assert scale.dtype == torch.float32 and torch.equal(zp, torch.zeros_like(scale))
    per_tensor = quark.PerTensorMinMaxObserver({"dtype": "fp4", "qscheme": "per_tensor",
                                                "scale_format": "e4m3", "scale_type": "float"})
    per_tensor(z)
    assert torch.equal(per_tensor._calculate_qparams()[0], _native_zero(()))


def test_e4m3_zero_block_amax_and_scale_are_quarks_positive_zero():
    theirs, ours = _pair("PerBlockMXObserver", dtype="fp4", qscheme="per_group", ch_axis=-1,
                         group_size=16, scale_format="e4m3")
    x = torch.zeros(2, 32)
    x[0, 0] = 1.0
    for m in (theirs, ours):
        m(x)
    _assert_same((ours.amax,), (theirs.amax,))
    _assert_same(ours._calculate_qparams(), _quiet(theirs._calculate_qparams))


# 6. min > max: Quark's exception type too, the message quantscope's
@pytest.mark.parametrize(("lo", "hi", "kind"), [(torch.tensor(2.0), torch.tensor(-1.0),
                                                 AssertionError),
                                                (torch.tensor([2.0]), torch.tensor([-1.0]),
                                                 RuntimeError)])
def test_inverted_range_raises_quarks_type_and_a_value_error(lo, hi, kind):
    theirs, ours = _pair("PerTensorMinMaxObserver", dtype="int8")
    with pytest.raises(kind):
        _quiet(theirs.calculate_qparams, lo, hi)
    with pytest.raises(kind, match="lo must be <= hi in every unit") as info:
        ours.calculate_qparams(lo, hi)
    assert isinstance(info.value, ValueError)


# 7. quark_e8m0_scale's message names what it takes
@pytest.mark.parametrize("mode", ["even", "nearest"])
def test_quark_e8m0_scale_message_names_what_it_takes(mode):
    with pytest.raises(ValueError, match=r"Unsupported scale_calculation_mode") as info:
        quark.quark_e8m0_scale(torch.tensor([1.0]), 2, mode)
    message = str(info.value)
    assert "expected even" not in message and "'floor' or 'ceil'" in message


# probe s24: Quark's statistics are buffers a caller may assign; ours say they are not
@pytest.mark.parametrize(("name", "kw", "stats"), [
    ("PerTensorMinMaxObserver", {"dtype": "int8", "qscheme": "per_tensor"},
     ("min_val", "max_val")),
    ("PerBlockMXObserver", {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1,
                            "group_size": 32, "scale_format": "e8m0"}, ("amax",))])
def test_assigned_statistics_are_refused_naming_them(name, kw, stats):
    theirs, ours = _pair(name, **kw)
    for m in (theirs, ours):
        m(_X)
    before = ours._calculate_qparams()
    for stat in stats:
        setattr(theirs, stat, getattr(theirs, stat) * 2)  # Quark takes it
        with pytest.raises(AttributeError, match=f"{stat} cannot be assigned"):
            setattr(ours, stat, getattr(ours, stat) * 2)
    _assert_same(ours._calculate_qparams(), before)  # the observed state stays
