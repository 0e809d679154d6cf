"""``_numerics.as_float32``: numpy's float32 rounding in Python's double arithmetic, so the
CPU's flush-to-zero mode cannot move it (found by probing: under
``torch.set_flush_denormal(True)`` numpy flushed compat observers' internal eps of 2**-149 to
0, and every llm-compressor compat observer refused to build)."""

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantscope._numerics import as_float32

EDGES = [0.0, -0.0, 2.0 ** -149, 2.0 ** -150, 2.0 ** -150 * 1.0000001, 1.5 * 2.0 ** -149,
         2.5 * 2.0 ** -149, 2.0 ** -126, 2.0 ** -126 * (1 - 2.0 ** -25), 1.0 + 2.0 ** -24,
         1.0 + 3 * 2.0 ** -24, float(np.finfo(np.float32).max), 3.4028235677973366e38,
         3.4028235e38 * (1 + 2.0 ** -25), 1e39, math.inf, -math.inf, 1 / 3, -7.3e-42]


def _numpy(x: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def _same(a: float, b: float) -> bool:
    return struct.pack("<d", a) == struct.pack("<d", b)


@pytest.mark.parametrize("x", EDGES)
def test_edges_round_as_numpy(x):
    assert _same(as_float32(x), _numpy(x))
    assert _same(as_float32(-x), _numpy(-x))


@settings(max_examples=2000, deadline=None)
@given(st.floats(allow_nan=False, width=64))
def test_every_double_rounds_as_numpy(x):
    assert _same(as_float32(x), _numpy(x))


def test_nan_and_huge_ints():
    assert math.isnan(as_float32(math.nan))
    assert as_float32(10 ** 400) == math.inf and as_float32(-(10 ** 400)) == -math.inf


def test_flush_to_zero_moves_nothing():
    from compressed_tensors.quantization import QuantizationArgs

    from quantscope.compat import llmcompressor as lc

    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))

    def scale():
        obs = lc.Observer.load_from_registry("memoryless_minmax", base_name="weight",
                                             args=args)
        obs(w)
        return obs.get_qparams()["scale"]

    want = scale()
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        assert as_float32(2.0 ** -149) == 2.0 ** -149
        got = scale()
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(got, want)
