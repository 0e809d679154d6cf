"""Differential pins from session 64's mutation round over compat.llmcompressor: cases where a
mutant kept every other test passing, compared with the installed llm-compressor 0.14 (the
behaviour compat.llmcompressor copies). Runs in the peers' venv."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.peers

pytest.importorskip("llmcompressor")


def _ranges(name, fields, w, **observer_kwargs):
    """``[(min_vals, max_vals)]`` of llm-compressor's observer, then ours, on weight ``w``."""
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers import Observer as Theirs
    from quiet_logs import quiet

    from quantscope.compat.llmcompressor import Observer as Ours

    out = []
    with quiet():
        for cls in (Theirs, Ours):
            args = QuantizationArgs(**fields, observer_kwargs=dict(observer_kwargs))
            obs = cls.load_from_registry(name, base_name="weight", args=args)
            obs(w)
            out.append((obs.min_vals, obs.max_vals))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("symmetric", [True, False])
def test_memoryless_mse_prices_half_weights_in_their_dtype(dtype, symmetric):
    """memoryless_mse on bfloat16 / float16 weights: candidates priced in the dtype, as
    llm-compressor's, so the chosen ranges are theirs bit for bit."""
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(32, 64, generator=g) * torch.linspace(0.05, 3, 64)).to(dtype)
    fields = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "channel"}
    (their_lo, their_hi), (lo, hi) = _ranges("memoryless_mse", fields, w)
    assert lo.dtype == their_lo.dtype == dtype
    assert torch.equal(lo, their_lo) and torch.equal(hi, their_hi)
