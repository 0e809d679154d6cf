"""ModelOpt 0.47 against quantscope's compat (s38): ``_axis`` re-set to the same axis
spelled otherwise keeps the amax, as ModelOpt's; a ``start_bin`` leaving entropy or mse no
candidate fails in both (ModelOpt: numpy's ``argmin`` of nothing), entropy's last candidate
being the bins, mse's the last centre."""

import warnings

import pytest
import torch

pytestmark = pytest.mark.peers

calib = pytest.importorskip("modelopt.torch.quantization.calib")

from quantscope.compat.modelopt import HistogramCalibrator, MaxCalibrator


@pytest.mark.parametrize(("axis", "again", "shape"), [
    (-1, 1, (4, 3)), (1, -1, (4, 3)), (0, -2, (4, 3)), (None, (), (4, 3)),
    ((0, 1), (1, -3), (2, 3, 5))])
def test_axis_respelled_keeps_the_amax_as_modelopts(axis, again, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    got = []
    for cls in (calib.MaxCalibrator, MaxCalibrator):
        c = cls(axis=axis)
        c.collect(x)
        c._axis = again
        c.collect(x * 0.5)
        got.append(c.compute_amax())
    assert torch.equal(got[1], got[0])


@pytest.mark.parametrize(("method", "start_bin", "fails"), [
    ("entropy", 64, False), ("entropy", 65, True), ("entropy", 128, True),
    ("mse", 64, True), ("mse", 100, True)])
def test_start_bin_past_the_candidates_fails_as_modelopts(method, start_bin, fails):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    ours, theirs = HistogramCalibrator(num_bins=64), calib.HistogramCalibrator(num_bins=64)
    ours.collect(x)
    theirs.collect(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if fails:
            with pytest.raises(ValueError):
                theirs.compute_amax(method, start_bin=start_bin)
            with pytest.raises(ValueError, match=rf"start_bin={start_bin} leaves no {method} "
                                                 r"candidate .*num_bins=64"):
                ours.compute_amax(method, start_bin=start_bin)
        else:
            assert torch.equal(ours.compute_amax(method, start_bin=start_bin),
                               theirs.compute_amax(method, start_bin=start_bin).float())
