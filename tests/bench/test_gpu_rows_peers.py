"""bench/peer_modelopt_nvfp4.py against the installed ModelOpt (peers' venv): the shim feeds
its NVFP4MSECalibrator the blocked weight so that each block gets the best of ModelOpt's 126
fp8 block scales, priced as bench/gpu_nvfp4.py prices every method."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.peers
pytest.importorskip("modelopt")

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_modelopt_sweep_keeps_each_blocks_best_candidate(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import peer_modelopt_nvfp4 as peer
    from gpu_nvfp4 import SPEC, reference_quant
    from modelopt.torch.kernels.quantization.gemm._fp8_scale_candidates import (
        fp8_scale_candidates,
    )

    from quantscope.estimators import range_error

    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(1)) * 3
    w[0, :16] *= 40  # one outlier block: the global amax is far above the others
    assert peer.path(w, reference_quant(w)) == "reference Python sweep"
    amax, ga = peer.sweep(w, reference_quant(w))
    u = SPEC.layout.to_units(w)
    assert amax.shape == (u.shape[0],) and float(ga) == float(w.abs().max())
    chosen = range_error(u, -amax, amax, SPEC, global_amax=ga)
    every = torch.stack([range_error(u, -c * ga.expand(len(u)), c * ga.expand(len(u)), SPEC,
                                     global_amax=ga) for c in fp8_scale_candidates()])
    assert torch.all(chosen <= every.min(0).values * (1 + 1e-5))
    cands = fp8_scale_candidates()  # every chosen amax is a candidate times the global amax
    assert torch.all(((amax / ga)[:, None] / cands[None] - 1).abs().min(1).values < 1e-6)


def test_sweep_refuses_a_width_blocks_do_not_divide(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import peer_modelopt_nvfp4 as peer

    with pytest.raises(ValueError, match="multiple of 16"):
        peer.sweep(torch.randn(4, 24))
