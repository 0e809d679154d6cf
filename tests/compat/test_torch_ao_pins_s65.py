"""compat.torch_ao against torch.ao 2.13 where s65's mutants of ``torch_ao.py`` and
``torch_ao_steps.py`` changed behaviour no test saw (the file came from a mutation round):
``torch_ao_spec`` / ``spec`` (quint4x2 is unsigned 4-bit, a custom ``eps`` kept, one code bound
alone is no custom range, as torch.ao's), torch.ao's own ``AssertionError`` for a bad code
range of every dtype it takes, the TorchScript name only for this module's classes, the
``qparams`` refusals (one infinite end, float zero points, dtypes without a format), the
clear per-channel message, ``bins`` set after the first batch, empty batches, a 16-bit
histogram's 2 ** 16 search codes, a float64 batch past float32's max, the search op's fake
dtypes and the sync view's NaN flag. Values and exceptions as torch.ao's."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.ao import quantization as tq

from quantscope.compat import torch_ao as qa
from quantscope.compat.torch_ao import UnsupportedDtypeError, torch_ao_spec

#: the dtypes torch.ao's observers take (its ``_ALLOWED_DTYPES``, a local of its __init__)
AO_DTYPES = [torch.qint8, torch.quint8, torch.quint4x2, torch.qint32, torch.int8, torch.uint8,
             torch.int16, torch.int32, torch.float8_e5m2, torch.float8_e4m3fn, torch.uint16]


def test_quint4x2_spec_is_unsigned_four_bit():
    spec = torch_ao_spec(dtype=torch.quint4x2)
    assert (spec.format.bits, spec.format.signed) == (4, False)
    ref = tq.MinMaxObserver(dtype=torch.quint4x2)
    assert (spec.qmin, spec.qmax) == (ref.quant_min, ref.quant_max) == (0, 15)


def test_spec_keeps_a_custom_eps():
    assert torch_ao_spec(eps=1e-3).eps == 1e-3
    assert qa.MinMaxObserver(eps=2.0 ** -10).spec.eps == 2.0 ** -10


@pytest.mark.parametrize("dtype", [torch.quint8, torch.qint8, torch.int16])
@pytest.mark.parametrize("bound", [{"quant_min": 0}, {"quant_max": 5}])
def test_one_code_bound_alone_is_no_custom_range_as_torch_ao(dtype, bound):
    ref = tq.MinMaxObserver(dtype=dtype, **bound)  # torch.ao: both or the dtype's range
    spec = torch_ao_spec(dtype=dtype, **bound)
    assert (spec.qmin, spec.qmax) == (ref.quant_min, ref.quant_max)


@pytest.mark.parametrize("dtype", AO_DTYPES, ids=str)
def test_a_bad_code_range_is_torch_aos_assertion_for_every_dtype_it_takes(dtype):
    tq.MinMaxObserver(dtype=dtype)  # torch.ao takes the dtype
    with pytest.raises(AssertionError) as want:
        tq.MinMaxObserver(dtype=dtype, quant_min=5, quant_max=10)
    with pytest.raises(AssertionError) as got:
        qa.MinMaxObserver(dtype=dtype, quant_min=5, quant_max=10)
    assert not isinstance(got.value, UnsupportedDtypeError)
    assert str(got.value) == str(want.value)


def test_only_this_modules_classes_take_its_torchscript_name():
    class Sub(qa.MinMaxObserver):
        pass

    assert not hasattr(Sub, "_jit_override_qualname")  # TorchScript names it itself
    assert qa.MinMaxObserver._jit_override_qualname == (
        "__torch__.quantscope.compat.torch_ao.quantization.observer.MinMaxObserver")


@pytest.mark.parametrize("batch", [[1.0, float("inf")], [float("-inf"), 1.0]], ids=["max", "min"])
def test_qparams_refuses_a_range_with_one_infinite_end(batch):
    obs = qa.MinMaxObserver()
    obs(torch.tensor(batch))
    with pytest.raises(ValueError, match="observed NaN or inf"):
        obs.qparams()


def test_qparams_refuses_float_zero_points():
    obs = qa.PerChannelMinMaxObserver(qscheme=torch.per_channel_affine_float_qparams)
    obs(torch.randn(3, 4))
    with pytest.raises(NotImplementedError, match="float zero points"):
        obs.qparams()


@pytest.mark.parametrize("dtype", [torch.qint32, torch.int32, torch.float8_e4m3fn], ids=str)
def test_qparams_refuses_a_dtype_quantscope_has_no_format_for(dtype):
    obs = qa.MinMaxObserver(dtype=dtype)
    obs(torch.randn(16))
    obs.calculate_qparams()  # torch.ao's own qparams exist
    with pytest.raises(ValueError, match="16 bits"):
        obs.qparams()


def test_bins_set_after_the_first_batch_keep_the_histogram():
    x, y = torch.randn(200), torch.randn(200) * 3
    ref, ours = tq.HistogramObserver(), qa.HistogramObserver()
    ref(x)
    ours(x)
    ours.bins = 256  # after the first batch: quantscope keeps its 2048 bins
    ref(y)
    ours(y)
    assert ours.histogram.shape == (2048,)
    for name in ("histogram", "min_val", "max_val"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name


@pytest.mark.parametrize("qscheme", [torch.per_channel_affine, torch.per_channel_symmetric])
def test_histogram_refuses_a_per_channel_qscheme_with_the_clear_message(qscheme):
    with pytest.raises(NotImplementedError):  # torch.ao's type
        tq.HistogramObserver(qscheme=qscheme)
    with pytest.raises(NotImplementedError, match=r"^HistogramObserver: qscheme must be "
                                                  r"per_tensor_symmetric or per_tensor_affine"):
        qa.HistogramObserver(qscheme=qscheme)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_an_empty_batch_touches_nothing_as_torch_ao(dtype):
    empty = torch.empty(0, dtype=dtype)
    for bins in (0, 2048):  # torch.ao returns before its histc's bins check
        ref, ours = tq.HistogramObserver(bins=bins), qa.HistogramObserver(bins=bins)
        assert ref(empty) is empty and ours(empty) is empty
        assert not ours.has_observed and ours.histogram.shape == (bins,)
    x = torch.randn(100, dtype=dtype)
    ref(x)
    ours(x)
    ref(empty)
    ours(empty)
    for name in ("histogram", "min_val", "max_val"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name


@pytest.mark.parametrize("cast", [None, "double"])
@pytest.mark.parametrize("dtype", [torch.int16, torch.uint16], ids=str)
def test_a_16_bit_histogram_searches_for_its_65536_codes(dtype, cast):
    """dst_nbins is 2 ** 16, in the vectorized search and in torch.ao's loop (a float64 state)."""
    x = torch.linspace(-1.0, 1.0, 20001) ** 9  # 256 codes would clip its tail, 2 ** 16 not
    ref, ours = tq.HistogramObserver(dtype=dtype), qa.HistogramObserver(dtype=dtype)
    for obs in (ref, ours):
        obs(x)
        if cast:
            getattr(obs, cast)()
    assert ours.dst_nbins == ref.dst_nbins == 2 ** 16
    for a, b in zip(ref.calculate_qparams(), ours.calculate_qparams(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)


@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_a_float64_batch_of_one_value_past_float32_max_stores_both_ends_as_max(sign):
    # 2 ** 102 past float32's max is half its last ulp: torch.ao's copy_ rounds it to max
    end = sign * (torch.finfo(torch.float32).max + 2.0 ** 102)
    x = torch.full((4,), end, dtype=torch.float64)
    ref, ours = tq.HistogramObserver(), qa.HistogramObserver()
    ref(x)
    ours(x)
    f32_max = torch.finfo(torch.float32).max
    assert float(ours.min_val) == float(ours.max_val) == sign * f32_max
    for name in ("histogram", "min_val", "max_val"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name


def test_the_search_ops_fake_promotes_a_mixed_state_as_torch_aos_search():
    """A float16 min_val and a float32 max_val: torch.ao's new_min = min_val + bin_width *
    start_bin (bin_width from max_val - min_val) is float32; the fake says so too."""
    hist, lo, hi = torch.ones(2048), torch.tensor(-1.0).half(), torch.tensor(2.0)
    with FakeTensorMode() as mode:
        fake = torch.ops.quantscope.ao_histogram_search(*map(mode.from_tensor, (hist, lo, hi)),
                                                        256)
    assert [t.dtype for t in fake] == [torch.float32] * 2
    assert [t.shape for t in fake] == [torch.Size([])] * 2


def test_the_sync_view_flags_a_unit_with_one_nan_end():
    """A NaN at either end goes as the unit's NaN flag (reduced by MAX), not as a value."""
    obs = qa.MinMaxObserver()
    obs.load_state_dict({"min_val": torch.tensor(math.nan), "max_val": torch.tensor(1.0),
                         "eps": obs.eps.clone()})
    view = obs._sync_view()
    assert view.nan_units.tolist() is True
    assert (float(view.min_val), float(view.max_val)) == (math.inf, -math.inf)
    view.write_back()  # the unit comes back NaN
    assert math.isnan(float(obs.min_val)) and math.isnan(float(obs.max_val))
