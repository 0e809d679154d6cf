"""An observer whose own arithmetic takes finite input past float32 says so.

The moving average ``s + c * (b - s)`` (torch.ao's update, kept bitwise) of a batch at -2e38
then one at +2e38 computes ``b - s = 4e38``, past float32's max: the state is inf although
every value observed was finite. qparams used to blame "NaN or inf" input that never came.
"""

from __future__ import annotations

import pytest
import torch

import quantscope
from quantscope import QuantSpec


def _fed(name, *batches, **kw):
    o = quantscope.get_observer(name, QuantSpec("int8"), **kw)
    for b in batches:
        o(b)
    return o


@pytest.mark.parametrize("name", ["minmax", "mse"])
def test_moving_average_overflow_names_the_observer_and_the_update(name):
    o = _fed(name, torch.full((4, 8), -2.0e38), torch.full((4, 8), 2.0e38))
    # b - s = 2e38 - (-2e38) = 4e38 > 3.4028e38: inf in float32, and so the state
    assert torch.isinf(o.min_vals).all() and not bool(o.seen_non_finite)
    with pytest.raises(ValueError, match=r"(?s)MovingAverage.*moving average.*overflowed"
                                         r".*s \+ c \* \(b - s\)") as e:
        o.calculate_qparams()
    assert "NaN or inf" not in str(e.value)


def test_nan_input_still_reports_nan_input():
    o = _fed("minmax", torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="observed NaN or inf values"):
        o.calculate_qparams()


def test_calibrate_names_the_layer_and_the_overflow():
    m = torch.nn.Sequential(torch.nn.Linear(8, 8))
    batches = [torch.full((2, 8), -2e38), torch.full((2, 8), 2e38)]
    with pytest.raises(ValueError, match=r"(?s)layer '0' input.*moving average.*overflowed"):
        quantscope.calibrate(m, batches, quantscope.calibrate.preset("w8a8", "minmax"),
                             progress=False)


def test_compat_expand_past_float32_names_expand():
    # llm-compressor's search: every candidate (3e38 * 1.5) * p is inf (their scales NaN)
    w = torch.tensor([[3.0e38, -1.0, 2.0, 0.5] * 8])
    o = _fed("memoryless_mse", w, expand=1.5, compat="llmcompressor")
    with pytest.raises(ValueError, match=r"MemorylessMSEObserver.*expand=1.5 takes the "
                                         r"observed range past float32's max"):
        o.calculate_qparams()
