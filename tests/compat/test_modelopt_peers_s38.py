"""ModelOpt 0.47 against quantscope's compat (s38): ``_axis`` re-set to the same axis
spelled otherwise keeps the amax, as ModelOpt's; a ``start_bin`` leaving entropy or mse no
candidate fails in both (ModelOpt: numpy's ``argmin`` of nothing), entropy's last candidate
being the bins, mse's the last centre; mse on data so small that its amax nears 2**-24, where
ModelOpt's quantizer degenerates (s42)."""

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


@pytest.mark.parametrize("k", [25, 26, 27])
def test_mse_amax_of_tiny_data_is_modelopts_loop(k):
    # ModelOpt's _compute_amax_mse (fake_tensor_quant's arguments by name: its call passes
    # num_bits as bias, the documented difference) on its own histogram of data scaled by
    # 2**-k. Its quantizer degenerates under amax 2**-24 only: at k=26 the data's max is
    # ~6.5e-8 and the candidates just past 2**-24 are real quantizers, which a floor of
    # 2**-23 (every candidate tied, the first winning) would lose
    import numpy as np
    from modelopt.torch.quantization.tensor_quant import fake_tensor_quant

    x = torch.randn(20000, generator=torch.Generator().manual_seed(0)).abs() * 2.0 ** -k
    ours, theirs = HistogramCalibrator(), calib.HistogramCalibrator()
    ours.collect(x)
    theirs.collect(x)
    counts = theirs._calib_hist.float()
    edges = theirs._calib_bin_edges.float()
    centers = (edges[1:] + edges[:-1]) / 2
    mses = [float(((fake_tensor_quant(centers, centers[i], None, 8, False) - centers) ** 2
                   * counts).mean()) for i in range(128, len(centers))]
    want = centers[128 + int(np.argmin(mses))]
    torch.testing.assert_close(ours.compute_amax("mse"), want, rtol=1e-6, atol=0)
