"""compat.modelopt in ModelOpt 0.47's own mtq.quantize, the calibrator swapped for ours: every
enabled quantizer's amax bitwise ModelOpt's. Its fp8 / fp4 configs build calibrators with
``num_bits=(E, M)``, which ours refused (an integer in [2, 16])."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from quantscope.compat import modelopt as qm

pytestmark = pytest.mark.peers
pytest.importorskip("modelopt")
with warnings.catch_warnings():  # (transformers' version, untested by ModelOpt)
    warnings.simplefilter("ignore")
    import modelopt.torch.quantization as mtq
    import modelopt.torch.quantization.nn.modules.tensor_quantizer as tq_module
    from modelopt.torch.quantization.nn import TensorQuantizer


def _amaxes(cfg, calibrator, monkeypatch):
    """mtq.quantize of a small MLP with ``calibrator`` as ModelOpt's MaxCalibrator."""
    monkeypatch.setattr(tq_module.calib, "MaxCalibrator", calibrator)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 16))
    batches = [torch.randn(8, 64) * (i + 1) for i in range(3)]
    model = mtq.quantize(model, copy.deepcopy(cfg), lambda m: [m(x) for x in batches])
    return {name: q._amax.clone() for name, q in model.named_modules()
            if isinstance(q, TensorQuantizer) and not q._disabled
            and getattr(q, "_amax", None) is not None}


@pytest.mark.parametrize("name", ["INT8_DEFAULT_CFG", "FP8_DEFAULT_CFG",
                                  "FP8_PER_CHANNEL_PER_TOKEN_CFG", "NVFP4_DEFAULT_CFG"])
def test_mtq_quantize_with_our_max_calibrator_is_modelopts(name, monkeypatch):
    cfg = getattr(mtq, name)
    want = _amaxes(cfg, tq_module.calib.MaxCalibrator, monkeypatch)
    got = _amaxes(cfg, qm.MaxCalibrator, monkeypatch)
    assert want and got.keys() == want.keys()
    for key, amax in want.items():
        assert torch.equal(got[key], amax), key


@pytest.mark.parametrize("bits", [(4, 3), (5, 2), (2, 1)])
def test_float_num_bits_take_the_float_format(bits):
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    ours = qm.HistogramCalibrator(num_bits=bits)
    ours.collect(x)
    ref = mtq.calib.HistogramCalibrator(num_bits=bits)
    ref.collect(x)
    assert torch.equal(ours.compute_amax("percentile", percentile=99.9),
                       ref.compute_amax("percentile", percentile=99.9))
    with pytest.raises(ValueError, match="num_bits must be an integer"):
        ours.compute_amax("entropy")  # integer codes (ModelOpt's fails in its arithmetic)
    with pytest.raises(ValueError, match=r"or one of \[\(4, 3\), \(5, 2\), \(2, 1\)\]"):
        qm.MaxCalibrator(num_bits=(3, 3))
