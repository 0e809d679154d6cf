"""ModelOpt's MaxCalibrator through ``forward`` and ``collect``: cases a mutation round on
them found untested (s48): an empty batch through ``forward``, fp8 batches (both formats),
the amax dtype over batches of two float dtypes, a single value's 0-d amax, and an integer
amax at its dtype's top. Each amax from first principles (``max |x|``, as ModelOpt defines
it; its dtype and 0-d shape as ModelOpt's ``torch.max`` and ``reduce_amax`` give them)."""

import pytest
import torch
from test_modelopt_forward_s47 import _amax

from quantscope.compat.modelopt import MaxCalibrator


@pytest.mark.parametrize("axis", [None, 0])
def test_an_empty_batch_through_forward_observes_nothing(axis):
    """``forward`` of a tensor of no elements leaves the state as it was (no amax, no amax
    shape), so the batches after it give their own amax and shape."""
    c = MaxCalibrator(8, axis, False)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    c.forward(torch.empty(0, 6))
    assert c.compute_amax() is None and c._amax_shape is None
    c.forward(x)
    c.forward(torch.empty(0, 6))
    assert torch.equal(c.compute_amax(), _amax([x], axis))


@pytest.mark.parametrize("how", ["forward", "collect"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("axis", [None, 0])
def test_fp8_batches_are_read_as_their_float32_values(axis, dtype, how):
    """fp8 has no abs / max kernels: its batches are read as float32 (ModelOpt's
    ``reduce_amax`` upcasts them), the amax their values' ``max |x|``."""
    x = (torch.randn(4, 6, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    c = MaxCalibrator(8, axis, False)
    getattr(c, how)(x)
    want = _amax([x.float()], axis)
    assert c.compute_amax().dtype == torch.float32 and torch.equal(c.compute_amax(), want)


@pytest.mark.parametrize("how", ["forward", "collect"])
@pytest.mark.parametrize("first,second", [(torch.float32, torch.float16),
                                          (torch.float16, torch.float32),
                                          (torch.bfloat16, torch.float16)])
def test_the_amax_dtype_promotes_over_the_batches(first, second, how):
    """ModelOpt's running ``torch.max(amax, batch amax)`` promotes: the amax has the
    promoted dtype of every batch's (float32 then fp16 stays float32)."""
    c = MaxCalibrator(8, None, False)
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(s)).to(d)
          for s, d in ((3, first), (4, second))]
    for x in xs:
        getattr(c, how)(x)
    want = torch.promote_types(first, second)
    assert c.compute_amax().dtype == want
    assert c.compute_amax() == max(x.float().abs().max() for x in xs).to(want)


@pytest.mark.parametrize("how", ["forward", "collect"])
@pytest.mark.parametrize("axis,shape", [(None, (1, 1)), (0, (1, 5)), (None, (3, 4))])
def test_one_value_is_a_0d_amax(axis, shape, how):
    """A single amax is 0-d (ModelOpt's ``reduce_amax`` squeezes it), whatever the input's
    dims: one element, or one row kept by axis 0."""
    c = MaxCalibrator(8, axis, False)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    getattr(c, how)(x)
    amax = c.compute_amax()
    assert amax.shape == () and float(amax) == float(x.abs().max())


def test_an_integer_amax_at_its_dtypes_top_is_that_top():
    """int32's ``2 ** 31 - 1`` reads ``2 ** 31`` in float32: the amax in the input's dtype is
    the top, not a value wrapped past it (ModelOpt's is the top: its max runs in int32)."""
    top = torch.iinfo(torch.int32).max
    c = MaxCalibrator(8, None, False)
    c.collect(torch.tensor([[top, -5], [3, 7]], dtype=torch.int32))
    amax = c.compute_amax()
    assert amax.dtype == torch.int32 and int(amax) == top


@pytest.mark.parametrize("axis", [None, 0])
def test_a_meta_batch_through_forward_of_a_meta_calibrator(axis):
    """A calibrator moved to the meta device (a model built empty, then traced) takes a meta
    batch through ``forward`` as the native observer does (shapes only) and returns it; no
    data was seen, so ``compute_amax()`` has no statistics to refuse."""
    c = MaxCalibrator(8, axis, False).to("meta")
    x = torch.empty(3, 4, device="meta")
    assert c.forward(x) is x
    amax = c.compute_amax()
    assert amax is None or amax.is_meta
