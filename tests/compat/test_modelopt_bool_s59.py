"""Bool batches in the ModelOpt calibrators, against ModelOpt 0.47 (s59): ``MaxCalibrator``
refuses them with a ``NotImplementedError`` as ModelOpt's ``abs`` does; ``HistogramCalibrator``
bins their 0 / 1 values as ModelOpt's, with its histogram, edges and percentile amax."""

import pytest
import torch

pytestmark = pytest.mark.peers

calib = pytest.importorskip("modelopt.torch.quantization.calib")

from quantscope.compat import UnsupportedInputError
from quantscope.compat.modelopt import HistogramCalibrator, MaxCalibrator


def test_max_calibrator_refuses_bool_as_modelopt():
    x = torch.tensor([[True, False], [True, True]])
    with pytest.raises(NotImplementedError):
        calib.MaxCalibrator().collect(x)
    ours = MaxCalibrator()
    with pytest.raises(UnsupportedInputError, match="bool"):
        ours.collect(x)
    assert ours.compute_amax() is None  # nothing kept


@pytest.mark.parametrize("seed", range(3))
def test_histogram_calibrator_bins_bool_as_modelopt(seed):
    g = torch.Generator().manual_seed(seed)
    batches = [torch.rand(64, 32, generator=g) > 0.3, torch.randn(16, 8, generator=g) * 0.5,
               torch.rand(8, 8, generator=g) > 0.9]
    theirs, ours = calib.HistogramCalibrator(), HistogramCalibrator()
    for b in batches:
        theirs.collect(b)
        ours.collect(b)
    assert torch.equal(ours._calib_bin_edges, theirs._calib_bin_edges)
    assert torch.equal(ours._calib_hist.float(), theirs._calib_hist.float())
    assert torch.equal(ours.compute_amax("percentile", percentile=99.9),
                       theirs.compute_amax("percentile", percentile=99.9))
