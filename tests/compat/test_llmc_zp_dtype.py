"""A float ``zp_dtype`` on an asymmetric integer format: compressed-tensors keeps those zero
points unrounded (NaN for an all-zero range); quantscope's zero point is a code, so both
observer generations refuse it, naming the field."""

import pytest
import torch

from quantscope.compat import llmcompressor, llmcompressor_legacy


def _args(symmetric, zp):
    return {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "channel",
            "zp_dtype": zp}


@pytest.mark.parametrize("zp", [torch.float32, torch.float16, torch.bfloat16])
def test_float_zero_points_are_refused(zp):
    w = torch.randn(4, 64)
    with pytest.raises(ValueError, match=f"zp_dtype {zp} .fractional zero points"):
        obs = llmcompressor.Observer.load_from_registry("memoryless_minmax", base_name="weight",
                                                         args=_args(False, zp))
        obs(w)
        obs.get_qparams()
    with pytest.raises(ValueError, match=f"zp_dtype {zp} .fractional zero points"):
        llmcompressor_legacy.MemorylessMinMaxObserver("weight", _args(False, zp))


def test_integer_and_symmetric_zero_points_still_come_in_the_dtype_asked():
    w = torch.randn(4, 64)
    obs = llmcompressor.Observer.load_from_registry("memoryless_minmax", base_name="weight",
                                                     args=_args(False, torch.int32))
    obs(w)
    assert obs.get_qparams()["zero_point"].dtype == torch.int32
    obs = llmcompressor.Observer.load_from_registry("memoryless_minmax", base_name="weight",
                                                     args=_args(True, torch.float32))
    obs(w)
    zero = obs.get_qparams()["zero_point"]
    assert zero.dtype == torch.float32 and not zero.any()  # symmetric: 0 in any dtype
