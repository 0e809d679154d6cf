"""Pins of a behaviour no test held (mutation run s35), against ModelOpt 0.47: a
HistogramCalibrator of float ``num_bits=(E, M)`` prices its ``"mse"`` candidates in that
format (its integer-codes check is entropy's only). ModelOpt's own ``_compute_amax_mse``
fails there (``scaled_e4m3`` called without its ``bias``: the documented difference), so the
reference is its arithmetic with ``scaled_e4m3``'s arguments by name."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from quantscope.compat.modelopt import HistogramCalibrator

pytestmark = pytest.mark.peers
pytest.importorskip("modelopt")
with warnings.catch_warnings():  # (transformers' version, untested by ModelOpt)
    warnings.simplefilter("ignore")
    import modelopt.torch.quantization.calib as mo
    from modelopt.torch.quantization.tensor_quant import scaled_e4m3


def _batches(seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(64, 32, generator=g) * (1 + k) for k in range(3)]
    return [x * x.abs() for x in reversed(xs)] if seed % 2 else xs  # heavy tails too


def _modelopt_mse_amax(ref, start_bin=128):
    """ModelOpt's _compute_amax_mse for (4, 3): bin centres from ``start_bin``, the first
    least ``mean(counts * (scaled_e4m3(c, amax) - c) ** 2)``."""
    counts, edges = ref._calib_hist, ref._calib_bin_edges
    if isinstance(counts, np.ndarray):
        counts, edges = torch.from_numpy(counts), torch.from_numpy(edges)
    counts, edges = counts.float(), edges.float()
    c = (edges[1:] + edges[:-1]) / 2
    mses = [((scaled_e4m3(c, c[i], None, 4, 3) - c) ** 2 * counts).mean()
            for i in range(start_bin, len(c))]
    return c[start_bin + int(np.argmin(mses))]


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_fp8_histogram_mse_is_modelopts_arithmetic(seed):
    ref, ours = mo.HistogramCalibrator(num_bits=(4, 3)), HistogramCalibrator(num_bits=(4, 3))
    for x in _batches(seed):
        ref.collect(x)
        ours.collect(x)
    with pytest.raises(TypeError):  # ModelOpt's own call: scaled_e4m3 without its bias
        ref.compute_amax("mse")
    got = ours.compute_amax("mse")
    assert got.dtype == torch.float32 and got.shape == () and torch.isfinite(got)
    torch.testing.assert_close(got, _modelopt_mse_amax(ref), rtol=1e-6, atol=0)


@pytest.mark.parametrize("bits", [(4, 3), (5, 2), (2, 1)])
def test_float_bits_take_mse_and_refuse_only_entropy(bits):
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
    ours = HistogramCalibrator(num_bits=bits)
    ours.collect(x)
    amax = ours.compute_amax("mse")
    # a bin centre from start_bin on: within the data's max |x|, past 128 / 2048 of it
    top = float(x.abs().max())
    assert torch.isfinite(amax) and 128 / 2048 * top < float(amax) <= top
    with pytest.raises(ValueError, match="num_bits must be an integer"):
        ours.compute_amax("entropy")
