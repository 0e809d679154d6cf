"""compat.quark against AMD Quark 0.13 (and its docstring, where it states a deliberate
difference) where s60's mutants changed behaviour no test saw: Quark's ``quant_min`` of the
unsigned E5M3 (0, not -max), the E8M0 scales of the legacy dtype ``mx`` with no
``scale_format`` (the docstring's rule; Quark's branch returns integer exponents), fp4 on
``PerGroupMinMaxObserver`` (Quark's integer formula: its default before data, its assert
after), a static ``PerBlockMXObserver`` merging a batch whose last block pads to the same
``(rows, blocks)``, the +0.0 amax of a block of -0.0 (Quark's ``abs().max()``), a zero-mass
histogram's percentile range (0, 0), BFP16's overflow edge (a positive end at 127.5 steps
rounds half to even to code 128: the scale doubles), and NVFP4's e4m3 two-level rounding in
Quark's order of operations. Values, dtypes, shapes and exception types. Runs in the peers'
venv."""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = [pytest.mark.peers, pytest.mark.xdist_group("quark")]

pytest.importorskip("quark")  # quark_twins imports quark.torch when a test first uses it
from quark_twins import qo, quark_config, quark_twins
from quiet_logs import quiet

from quantscope.compat import quark
from quantscope.compat.quark_spec import quark_qmin_qmax


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)  # Quark's loggers
    yield
    logging.disable(logging.NOTSET)


def _equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (a, b)


def _qparams(theirs, ours, theirs_name="_calculate_qparams"):
    with quiet():
        want = getattr(theirs, theirs_name)()
    got = ours._calculate_qparams()
    for a, b in zip(want, got, strict=True):
        _equal(a, b)
    return got


# S5: quark_spec.quark_qmin_qmax("fp8_e5m3")
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "int4", "uint4", "int2", "uint2",
                                   "fp8_e4m3", "fp8_e5m2", "fp8_e5m3", "fp6_e3m2", "fp6_e2m3",
                                   "fp4", "bfloat16", "float16"])
def test_qmin_qmax_are_quarks_calculate_qmin_qmax(dtype):
    from quark.torch.quantization.config.type import Dtype
    from quark.torch.quantization.utils import calculate_qmin_qmax

    want = calculate_qmin_qmax(Dtype(dtype))
    got = quark_qmin_qmax(dtype)
    assert got == want and [type(v) for v in got] == [type(v) for v in want], (got, want)


def test_e5m3_observer_quant_min_is_quarks_zero():
    theirs, ours = quark_twins("PerTensorMinMaxObserver", dtype="fp8_e5m3")
    assert (ours.quant_min, ours.quant_max) == (theirs.quant_min, theirs.quant_max)
    assert ours.quant_min == 0.0 and type(ours.quant_min) is float


# L4: PerBlockMXObserver, dtype 'mx', no scale_format: E8M0 scales (compat/quark.py's
# docstring: "with no scale_format gives float32 scales (E8M0 for the dtype mx)")
def test_legacy_mx_dtype_without_scale_format_takes_e8m0_scales():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 5
    x[1, :32] = 0.0
    mx = {"dtype": "mx", "mx_element_dtype": "fp4", "qscheme": "per_group", "group_size": 32,
          "ch_axis": -1, "is_dynamic": False}
    ours = quark.PerBlockMXObserver(mx)
    before, zp = ours._calculate_qparams()
    assert before.item() == 2.0 ** -127 and zp.item() == 0.0  # E8M0's scale of amax 0
    # the same blocks by Quark's fp4 e8m0 'even' rule: what the docstring says mx takes
    theirs = qo.PerBlockMXObserver(quark_config("PerBlockMXObserver", dtype="fp4",
                                                qscheme="per_group", group_size=32, ch_axis=-1,
                                                scale_format="e8m0"))
    with quiet():
        theirs(x)
    ours(x)
    scale, zp = _qparams(theirs, ours)
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two
    assert scale[1, 0].item() == 2.0 ** -127  # the zero block


# K5: PerGroupMinMaxObserver prices fp4 with Quark's integer formula
def test_per_group_fp4_is_quarks_integer_formula():
    kw = {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1, "group_size": 16,
          "symmetric": True}
    theirs, ours = quark_twins("PerGroupMinMaxObserver", **kw)
    _qparams(theirs, ours)  # before data: Quark's integer default ([1.], [0]) as (1, 1)
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    with quiet():
        theirs(x)
    ours(x)
    with pytest.raises(AssertionError), quiet():
        theirs._calculate_qparams()
    with pytest.raises(quark.UnsupportedElementError, match="integer"):
        ours._calculate_qparams()
    lo, hi = torch.tensor([-1.0, -2.0]), torch.tensor([1.0, 3.0])
    with pytest.raises(AssertionError), quiet():
        theirs.calculate_qparams(lo, hi)
    with pytest.raises(quark.UnsupportedElementError):
        ours.calculate_qparams(lo, hi)


# L1: a static PerBlockMXObserver's (rows, blocks): the last block padded (ceil)
@pytest.mark.parametrize("second", [(2, 48), (2, 33)])
def test_static_mx_merges_a_batch_whose_padded_blocks_match(second):
    kw = {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1, "group_size": 16,
          "scale_format": "e8m0", "scale_calculation_mode": "even"}
    theirs, ours = quark_twins("PerBlockMXObserver", **kw)
    for x in (torch.full((2, 40), 5.0), torch.full(second, 0.5)):  # ceil(n / 16) == 3
        with quiet():
            theirs(x)
        ours(x)
    _equal(theirs.amax, ours.amax)
    assert ours.amax.flatten().tolist() == [5.0] * 6  # merged, not started over
    _qparams(theirs, ours)


# L8: the amax of a zero block is +0.0, as Quark's abs().max() (the native range of a block
# of +0.0 gives max(-0.0, 0.0) = -0.0), and so is an e4m3 scale of it
@pytest.mark.parametrize("scale_format", ["e8m0", "e4m3"])
@pytest.mark.parametrize("is_dynamic", [False, True])
def test_block_amax_of_zeros_is_positive_zero(scale_format, is_dynamic):
    kw = {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1, "group_size": 4,
          "scale_format": scale_format, "is_dynamic": is_dynamic}
    theirs, ours = quark_twins("PerBlockMXObserver", **kw)
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0, -0.0, -0.0, -0.0, -0.0, 0.0, -0.0, 0.0, -0.0,
                       1.0, 2.0, 0.0, 0.0]])
    with quiet():
        theirs(x)
    ours(x)
    _equal(theirs.amax, ours.amax)
    assert torch.signbit(ours.amax).tolist() == torch.signbit(theirs.amax).tolist() \
        == [[False] * 4]
    scale, _ = _qparams(theirs, ours)
    with quiet():
        want = theirs._calculate_qparams()[0]
    assert torch.signbit(scale).tolist() == torch.signbit(want).tolist()


# H7: get_min_max_by_percentile of a zero-mass histogram: Quark's (0, 0)
@pytest.mark.parametrize("symmetric", [True, False])
def test_percentile_of_a_zero_mass_histogram_is_zero_zero(symmetric):
    theirs, ours = quark_twins("PerTensorPercentileObserver", dtype="int8", symmetric=symmetric)
    hist, edges = torch.zeros(8), torch.linspace(-1.0, 1.0, 9)
    theirs.device = torch.device("cpu")  # (Quark's forward sets it)
    with quiet():
        want = theirs.get_min_max_by_percentile(hist, edges, 99.9)
    got = ours.get_min_max_by_percentile(hist, edges, 99.9)
    # Quark's zero-mass answer is zeros(1) twice (its other answers are 0-dim): values only
    assert [v.item() for v in want] == [v.item() for v in got] == [0.0, 0.0]
    assert all(v.dtype == torch.float32 for v in got)


# Q2: BFP16's overflow: a positive end at 127.5 steps or more rounds to code 128
def test_bfp16_overflow_edge_is_half_a_step_below_128():
    theirs, ours = quark_twins("PerBlockBFPObserver", dtype="bfp16", qscheme="per_group",
                               group_size=8, ch_axis=-1, is_dynamic=True, symmetric=True)
    x = torch.zeros(4, 8)
    x[:, 0] = torch.tensor([127.5, 127.75, 127.25, 100.0])  # floor(log2) = 6: steps of 1
    x[:, 1] = -3.0
    with quiet():
        theirs(x)
    ours(x)
    scale, _ = _qparams(theirs, ours, "calculate_qparams")
    assert scale.flatten().tolist() == [2.0, 2.0, 1.0, 1.0]


# Q6: NVFP4's e4m3 scales: (amax / 6) * two_level, Quark's order (one ulp decides a tie)
@pytest.mark.parametrize("amax", [(17.30335807800293, 7.7247138023376465),
                                  (15.229748725891113, 7.342913627624512),
                                  (13.552523612976074, 9.196354866027832)])
def test_nvfp4_e4m3_scales_round_in_quarks_order(amax):
    theirs, ours = quark_twins("PerBlockMXObserver", dtype="fp4", qscheme="per_group",
                               ch_axis=-1, group_size=4, scale_format="e4m3")
    x = torch.zeros(1, 8)
    x[0, 0], x[0, 4] = amax
    with quiet():
        theirs(x)
    ours(x)
    _qparams(theirs, ours)


# B2: Quark's asymmetric zero point qmin - round(min(lo, 0) / scale): a positive min is not
# divided (a float16 int16 range: 602.5 / (602.5 / 65535) overflows float16 to inf, whose
# int32 wraps the zero point to qmax)
def test_int16_zero_point_of_a_positive_float16_range_is_qmin():
    kw = {"dtype": "int16", "qscheme": "per_channel", "ch_axis": 0, "symmetric": False}
    theirs, ours = quark_twins("PerChannelMinMaxObserver", **kw)
    x = torch.tensor([[602.5, 602.5, 602.5], [780.0, 780.0, 781.0], [0.5, 300.0, 888.5],
                      [0.0, 1.0, 565.0]], dtype=torch.float16)
    with quiet():
        theirs(x)
    ours(x)
    scale, zp = _qparams(theirs, ours)
    assert zp.tolist() == [-32768] * 4 and scale.dtype == torch.float16
    lo, hi = x.amin(1), x.amax(1)
    with quiet():
        want = theirs.calculate_qparams(lo, hi)
    for a, b in zip(want, ours.calculate_qparams(lo, hi), strict=True):
        _equal(a, b)
