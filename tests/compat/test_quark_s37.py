"""Quark compat edges: an all-zero fp4 tensor with e4m3 block scales keeps ``scale_type``'s
dtype in its zero point (float32 before, float16 on data), and a per-group ``group_size`` of
-1 or below is refused naming it (a bare "Group: size must be ..." before)."""

import pytest
import torch

from quantscope.compat import quark as qs

_FP4 = {"PerBlockMXObserver": {"qscheme": "per_group", "ch_axis": -1, "group_size": 16},
        "PerTensorMinMaxObserver": {"qscheme": "per_tensor"},
        "PerChannelMinMaxObserver": {"qscheme": "per_channel", "ch_axis": 0}}


@pytest.mark.parametrize("name", sorted(_FP4))
@pytest.mark.parametrize("data", ["zeros", "randn"])
def test_e4m3_scales_keep_scale_types_dtype_on_all_zero_data(name, data):
    obs = getattr(qs, name)({"dtype": "fp4", "scale_format": "e4m3", "scale_type": "float16",
                             **_FP4[name]})
    obs(getattr(torch, data)(2, 32))
    scale, zero_point = obs._calculate_qparams()
    assert scale.dtype == zero_point.dtype == torch.float16
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())


@pytest.mark.parametrize("size, said", [(-1, "group_size=-1 .*give the axis's length"),
                                        (-4, "group_size must be a positive integer, got -4"),
                                        (True, "group_size must be a positive integer, got True"),
                                        (32.0, "group_size must be a positive integer, got 32.0")])
def test_per_group_sizes_below_one_are_refused_naming_group_size(size, said):
    with pytest.raises(ValueError, match=said):
        qs.PerGroupMinMaxObserver({"dtype": "int4", "qscheme": "per_group", "ch_axis": -1,
                                   "group_size": size})


def test_group_size_of_the_axis_length_is_one_group_per_row():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    obs = qs.PerGroupMinMaxObserver({"dtype": "int4", "qscheme": "per_group", "ch_axis": -1,
                                     "group_size": 32, "symmetric": True})
    obs(x)
    scale, _ = obs._calculate_qparams()
    assert scale.shape == (4, 1)
    torch.testing.assert_close(scale.view(-1), x.abs().amax(1) / 7.5, rtol=0, atol=1e-7)


def test_a_numpy_group_size_is_taken_as_its_int():
    import numpy as np

    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    qspec = {"dtype": "int4", "qscheme": "per_group", "ch_axis": -1, "symmetric": True}
    ours = [qs.PerGroupMinMaxObserver({**qspec, "group_size": size}) for size in (np.int64(16), 16)]
    for obs in ours:
        obs(x)
    assert torch.equal(ours[0]._calculate_qparams()[0], ours[1]._calculate_qparams()[0])
