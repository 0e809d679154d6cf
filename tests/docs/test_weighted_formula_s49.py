"""The imatrix benchmark's notes (docs/benchmarks.md and bench/results/notes.md, which
``make bench-docs`` copies) give the native weighted search's terms as the code computes
them: each square exact in float64 since the price ops stopped rounding squares to float32.
A review (s49) found both still saying ``float64(w) * float64(d * d)``."""

from __future__ import annotations

import pathlib
import re

import torch

from quantscope import QuantSpec
from quantscope.estimators import weighted
from quantscope.kernels import ops
from quantscope.qdq import fake_quantize_units

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXACT = "float64(w) * (float64(d) * float64(d))"


def _imatrix_section(path: pathlib.Path) -> str:
    text = path.read_text()
    return re.search(r"^## imatrix\n(.*?)^## ", text, flags=re.MULTILINE | re.DOTALL).group(1)


def test_the_notes_quote_the_searchs_own_formula():
    assert EXACT in weighted.weighted_search.__doc__.replace("``", "")
    for path in (ROOT / "docs" / "benchmarks.md", ROOT / "bench" / "results" / "notes.md"):
        section = " ".join(_imatrix_section(path).split())
        assert f"`{EXACT}`" in section, path
        assert "float64(d * d)" not in section, path


def test_the_op_prices_that_formula_where_a_float32_square_would_underflow():
    spec = QuantSpec("int8", "channel:0", eps=1e-45)
    g = torch.Generator().manual_seed(0)
    units = torch.randn(4, 64, generator=g) * 2.0 ** -70  # squares below float32's range
    w = torch.rand(4, 64, generator=g) * 10
    lo, hi = torch.aminmax(units, dim=1)
    scale = ((hi - lo) / 255)[None].contiguous()
    zp = torch.zeros_like(scale, dtype=torch.int32)
    got = ops.mse_price_int(units, scale, zp, float(spec.qmin), float(spec.qmax), w)[0]
    d = fake_quantize_units(units, scale[0][:, None], zp[0][:, None].float(), spec) - units
    exact = (w.double() * (d.double() * d.double())).sum(1)
    torch.testing.assert_close(got, exact, rtol=1e-12, atol=0)
    assert not torch.equal(exact, (w.double() * (d * d).double()).sum(1))  # they differ here
