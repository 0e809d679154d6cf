"""ModelOpt's mse amax on a histogram that grew past GROW_LIMIT and moved to the power-of-two
grid: ModelOpt's own grid ends at the bin of the data's max, so no candidate lies past it;
the moved grid's empty top bins were candidates, and a max of ~300 gave 511."""

import warnings

import pytest
import torch

from quantscope.compat.modelopt import HistogramCalibrator


@pytest.mark.parametrize("num_bits", [8, (4, 3)])
@pytest.mark.parametrize("seed", range(3))
def test_mse_amax_of_a_moved_grid_stays_at_the_datas_top_bin(num_bits, seed):
    g = torch.Generator().manual_seed(seed)
    calib = HistogramCalibrator(num_bits=num_bits, num_bins=256)
    batches = [torch.rand(200, 4, generator=g), torch.rand(200, 4, generator=g) * 300]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the move is said once
        for x in batches:
            calib.collect(x)
    assert not bool(calib.linear_grid)  # moved: 300x the first range is past GROW_LIMIT
    top = max(float(x.abs().max()) for x in batches)
    width = float(calib.current_histogram().width.max())
    for stride, start_bin in ((1, 128), (3, 64)):
        amax = float(calib.compute_amax("mse", stride=stride, start_bin=start_bin))
        assert 0 < amax <= top + width
