"""compat.llmcompressor: a ``group_size`` that does not divide the observed columns is a clear
error (a ``ValueError`` that is also llm-compressor's ``RuntimeError``), for weights and
activations, every observer; an asymmetric integer ``scale_dtype`` wider than the statistics'
dtype gives qparams as the symmetric one does (found by the s38 llmc2 probe)."""

from __future__ import annotations

import pytest
import torch

from quantscope.compat import llmcompressor as lc

G16 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}


@pytest.mark.parametrize("name", ["memoryless_minmax", "minmax", "memoryless_mse", "mse",
                                  "imatrix_mse"])
@pytest.mark.parametrize("base_name, shape", [("weight", (8, 40)), ("input", (2, 3, 40))])
def test_group_size_not_dividing_columns_is_a_clear_error(name, base_name, shape):
    obs = lc.Observer.load_from_registry(name, base_name=base_name, args=dict(G16))
    with pytest.raises(ValueError, match=r"group_size.*40 columns.*group_size=16") as err:
        obs(torch.randn(shape))
    assert isinstance(err.value, RuntimeError)  # llm-compressor's type (torch's unflatten)
    assert not obs.has_statistics


def test_a_2d_activation_is_grouped_whole_as_theirs():
    # llm-compressor flattens an activation's leading dims first: a 2-D [tokens, 40] value is
    # one row of 240 values, 15 groups of 16 (only a 3-D value's columns must divide)
    from quantscope.compat.llmcompressor_parts import flatten_for_calibration

    x = torch.randn(6, 40)
    got = flatten_for_calibration(x, "input", dict(G16))
    assert torch.equal(got, x.reshape(15, 16))


@pytest.mark.parametrize("size, ok", [(pytest.importorskip("numpy").int64(16), True),
                                      (True, False), (16.0, False)])
def test_group_size_takes_integers_only(size, ok):
    from quantscope.compat.llmcompressor_parts import GroupSizeError, _groups

    x = torch.randn(4, 32)
    if ok:
        assert _groups(x, {"group_size": size}).shape == (4, 2, 16)
    else:
        with pytest.raises(GroupSizeError, match=r"got group_size="):
            _groups(x, {"group_size": size})


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("sd, dtype", [(torch.float32, torch.bfloat16),
                                       (torch.float32, torch.float16),
                                       (torch.bfloat16, torch.float16)], ids=str)
def test_scale_dtype_wider_than_the_statistics(sd, dtype, symmetric):
    """The scale in the statistics' dtype rounded through ``scale_dtype`` (no clamp: its bounds
    do not fit the dtype, where compressed-tensors raises): asymmetric as symmetric."""
    fields = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "channel"}
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    got, plain = ({**lc.Observer.load_from_registry(
        "memoryless_minmax", base_name="weight", args=dict(fields, **extra))(w).get_qparams()}
        for extra in ({"scale_dtype": sd}, {}))
    assert got["scale"].dtype == dtype and bool(torch.isfinite(got["scale"]).all())
    assert torch.equal(got["scale"], plain["scale"].to(sd).to(dtype))
    assert torch.equal(got["zero_point"], plain["zero_point"])


@pytest.mark.parametrize("size", [0, -16])
def test_a_group_size_under_1_is_a_group_size_error(size):
    from quantscope.compat.llmcompressor_parts import GroupSizeError, flatten_for_calibration

    with pytest.raises(GroupSizeError, match=rf"got group_size={size}"):
        flatten_for_calibration(torch.randn(4, 16), "weight", dict(G16, group_size=size))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_scale_dtype_as_wide_as_the_scale_still_clamps(dtype):
    # their clamp to the scale_dtype's range runs where the bounds fit (equal dtypes too)
    from quantscope.compat.llmcompressor_base import round_to_scale_dtype

    got = round_to_scale_dtype(torch.tensor([float("inf"), 1.0], dtype=dtype), dtype)
    assert got.tolist() == [torch.finfo(dtype).max, 1.0]
