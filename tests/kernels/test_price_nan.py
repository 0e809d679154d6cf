"""The C price kernel keeps the NaN of a 0 / 0 quotient, as torch.clamp does.

``mse_price_int`` on CPU runs csrc/mse_search.c, whose contract is the torch path's bits
(``qdq.fake_quantize_units``: ``clamp(round(x / s + z), qmin, qmax)``). A clamp written as
``t > qmin ? t : qmin`` (or SIMD ``max(t, lo)``, which returns its second operand on NaN)
turns the NaN into ``qmin`` and prices the element as exact. Each SIMD branch is built and
compared, since a CI machine may take another than this one.
"""
from pathlib import Path

import pytest
import torch

from quantscope import kernels
from quantscope.kernels import price_ops

CSRC = Path(__file__).resolve().with_name("csrc")


def _variant(name):
    if name == "native":
        return kernels.lib("mse_search")
    return kernels.load(f"search_{name}_test", kernels.SIGNATURES["mse_search"],
                        source=CSRC / f"search_{name}_test.c")


@pytest.mark.parametrize("branch", ("native", "avx2", "scalar"))
@pytest.mark.parametrize("E", (2, 37))  # the scalar tail only; whole SIMD vectors and a tail
def test_price_keeps_nan_as_torch(branch, E, monkeypatch):
    lib = _variant(branch)
    if lib is None:
        pytest.skip(f"the {branch} build did not load")
    monkeypatch.setattr(price_ops, "_c_lib", lambda name: lib)
    units = torch.linspace(-1, 1, 2 * E).reshape(2, E)
    units[:, ::3] = 0.0  # 0 / 0 under a zero scale: NaN, whatever the zero point
    scale = torch.tensor([[0.0, 0.5], [0.25, 0.0]])
    zp = torch.tensor([[3, 0], [-2, 0]], dtype=torch.int32)  # both the zp and the zp-free path
    got = price_ops._c_price("qs_mse_price_w", units, scale, zp, -128.0, 127.0)
    ref = price_ops._torch_price(units, scale, zp, price_ops._IntBounds(-128.0, 127.0))
    assert got is not None and ref.isnan().sum() == 2
    torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
