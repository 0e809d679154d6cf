"""``not_encoded`` flags an fp8 (e4m3) block scale of 0 or below, as its docstring says ("not an
e4m3 value in (0, 448]") and as every other encoding does: e4m3 rounds 0 and negative values
to themselves, so they passed as encoded, and the compressed-tensors export wrote a zero or
negative NVFP4 block scale without a word (found by a mutation round, session 66; the export
case is in tests/export/test_scale_range_probe_fixes.py)."""

from __future__ import annotations

import torch

from quantscope.scales import ScaleEncoding, not_encoded


def test_not_encoded_fp8_flags_scales_outside_0_448():
    """0, -0.5 and -448 are e4m3 values but outside (0, 448]: each is flagged, as fp16,
    bf16, pow2 and E8M0 flag them; 0.5 and 448 are not."""
    s = torch.tensor([0.0, -0.5, -448.0, 0.5, 448.0])
    assert not_encoded(s, ScaleEncoding("fp8_e4m3")).tolist() == [True, True, True, False, False]
    for name in ("fp16", "bf16", "pow2", "e8m0"):
        assert not_encoded(s[:3], ScaleEncoding.parse(name)).all(), name
